"""The tensor-core il32 GEMV with a tile's blocks split into pieces across CTAs (`IlSchedule.splits`), on
the 27B's iq3_s matrices at 3-8 columns: each split count checked against the float64 product (and the same
bits on a second call and inside a CUDA graph), then timed as `bench/gpu_check.py`'s `graph_us` does (one
CUDA graph over weight copies larger than 3× L2), beside the count `il_schedule` routes.

    python3 bench/il_splits.py [--shapes 5120x17408,...] [--widths 3,4,8] [--splits 1,2,3,4,6]
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.gpu_check import graph_us, rel_err  # noqa: E402
from bench.il_group256 import il32_activation, il32_copies  # noqa: E402
from ninfer.kernels.gemv_il import gemv_il, il_group, il_schedule  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="5120x17408,5120x6144,34816x5120,14336x5120,16480x5120")
    p.add_argument("--widths", default="3,4,8")
    p.add_argument("--splits", default="1,2,3,4,6")
    args = p.parse_args()
    torch.manual_seed(0)
    group, counts = il_group(), [int(v) for v in args.splits.split(",")]
    rows, worst = [], 0.0
    for shape in args.shapes.split(","):
        n, k, copies, dense = il32_copies(shape)
        words = copies[0]
        for width in (int(w) for w in args.widths.split(",")):
            xa, fp32, want = il32_activation(width, dense, group)
            routed = il_schedule(width, k, n, group)
            times = {}
            for splits in counts:
                s = replace(routed, splits=splits)
                first = gemv_il(words, fp32, n, s)
                err = rel_err(first, want)
                worst = max(worst, err)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    captured = gemv_il(words, fp32, n, s)
                graph.replay()
                same = torch.equal(gemv_il(words, fp32, n, s), first) and torch.equal(captured, first)
                if not same:
                    worst = float("inf")
                times[splits] = graph_us([lambda w=w, s=s, xa=xa, n=n: gemv_il(w, xa, n, s) for w in copies])
                print(f"{shape} w{width} s{splits}: {times[splits]:.1f} µs (err {err:.1e}, repeatable "
                      f"{same})", flush=True)
            rows.append((shape, width, routed.splits, times))
        del copies, words, dense
        torch.cuda.empty_cache()
    print(f"\n| matrix | columns | {' | '.join(f'{c} piece(s) (µs)' for c in counts)} | routed |")
    print("|---|---|" + "---|" * (len(counts) + 1))
    for shape, width, routed, times in rows:
        best = min(times, key=times.get)
        cells = " | ".join(f"**{times[c]:.1f}**" if c == best else f"{times[c]:.1f}" for c in counts)
        print(f"| {shape} | {width} | {cells} | {routed} |")
    if worst > 1e-4:
        raise SystemExit("a split count is off its float64 reference by more than 1e-4, or not repeatable")


if __name__ == "__main__":
    main()

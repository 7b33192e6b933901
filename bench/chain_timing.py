"""Decode GEMV schedules timed as the step runs them: each call after its producer (add + RMSNorm of the
GEMV's input rows, quantising them to int8 in the same launch, as `ops.add_rms_norm` does in the engine) and
before its consumer (the next pair's norm reads the output), over weight copies larger than 3× the L2, in one
CUDA graph with the engine's launch settings (PDL). µs per (norm + GEMV + copy) pair, every schedule timed
twice in A/B/B/A order. `rows_timing.py` times one GEMV back to back instead; session 16 found schedules
9-15 % faster there (q4_k, two row tiles a warp at 8 columns) whose gain did not reach the suite's round.

    python3 bench/chain_timing.py --format q4_k --shape 34816x5120 --width 8 \\
        --schedules route,frag_w2_r1_m8_s4,frag_w2_r2_m8_s8          # "route": quant_matmul's own choice
    python3 bench/chain_timing.py ... --settings NINFER_PDL=1,NINFER_PDL=0   # each schedule under each
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.gpu_check import graph_us, weight_copies  # noqa: E402
from bench.rows_timing import kernel  # noqa: E402
from ninfer.kernels import ops, triton_support  # noqa: E402
from ninfer.kernels.gemv_q8 import quantize_activation_cached  # noqa: E402
from ninfer.kernels.gguf_matmul import quant_matmul  # noqa: E402


def chain(fmt: str, weights: list[torch.Tensor], rows: int, cols: int, width: int, name: str, pairs: int):
    """The closure of `pairs` (norm → GEMV → the output into the next norm's input) pairs over `weights`."""
    _, gemv, _ = kernel(fmt)
    dev = weights[0].device
    x = torch.randn(width, cols, device=dev, dtype=torch.bfloat16)
    h = torch.randn(width, cols, device=dev, dtype=torch.bfloat16)
    w = torch.randn(cols, device=dev)
    keep = min(rows, cols)

    def run():
        res = h
        for i in range(pairs):
            n, res = ops.add_rms_norm(x, res, w, 1e-6, True)
            raw = weights[i % len(weights)]
            y = quant_matmul(raw, fmt, n, rows) if name == "route" else gemv(
                raw, fmt, quantize_activation_cached(n), rows, name)
            x[:, :keep].copy_(y[:, :keep])  # the next norm depends on this output
        return x

    return run


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--format", default="q4_k")
    p.add_argument("--shape", default="34816x5120", help="rows x columns of the GEMV")
    p.add_argument("--width", type=int, default=8, help="columns (decode lanes)")
    p.add_argument("--schedules", default="route", help="comma-separated names; route = quant_matmul's")
    p.add_argument("--pairs", type=int, default=64, help="norm + GEMV pairs per graph")
    p.add_argument("--settings", default="", help="comma-separated launch settings NAME=value (several "
                   "joined by +), each schedule timed under each: e.g. NINFER_PDL=1,NINFER_PDL=0")
    a = p.parse_args()
    rows, cols = map(int, a.shape.split("x"))
    runs = [(setting, name) for setting in (a.settings.split(",") if a.settings else [""])
            for name in a.schedules.split(",")]
    weights = weight_copies(a.format, rows, cols, torch.device("cuda"))
    times: dict[tuple[str, str], list[float]] = {}
    for setting, name in runs + runs[::-1]:
        for assignment in filter(None, setting.split("+")):
            key, _, value = assignment.partition("=")
            os.environ[key] = value
        triton_support.reread_launch_settings()
        us = graph_us([chain(a.format, weights, rows, cols, a.width, name, a.pairs)]) / a.pairs
        times.setdefault((setting, name), []).append(us)
        print(f"{a.format} {a.shape} w{a.width} {setting or 'defaults'} {name}: {us:.1f} µs a pair",
              flush=True)
    print("\n| settings | schedule | µs a pair (A/B/B/A) |\n|---|---|---|")
    for (setting, name), t in times.items():
        print(f"| {setting or 'defaults'} | {name} | {' / '.join(f'{v:.1f}' for v in t)} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Where a warm prefill goes: one request of each prompt length (after two warm-ups of that length) timed
bare, then under torch.profiler (GPU time by kernel group, the device's busy and idle time, the largest
idle gaps and the kernels around them) and, with --cprofile, under cProfile (the host's time by function).
A short prompt's prefill is host time on the H200 (gpu-notes "Session 42": 512 tokens of the 27B take
144-216 ms of wall time for 74-83 ms of GPU time, ~2,000 launches); a 2048-token chunk is the GPU's.

    python3 bench/prefill_profile.py --wtype iq3_s --tokens 512,2048 [--cprofile] --out $OUT   # GPU machine
    python3 bench/prefill_profile.py --synthetic tiny --device cpu --dtype float32 --tokens 48   # CPU smoke
    python3 bench/prefill_profile.py --wtype iq3_s --tokens 2048 --pieces 8192,1073741824 --no-profile
        # the dense weight made 8,192 rows at a time against whole (gguf_matmul.PREFILL_ROWS), A B B A ...
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from step_profile import add_model_arguments, engine_args, grouped, idle_gaps, sync  # noqa: E402

from ninfer.cli.bench import make_engine  # noqa: E402
from ninfer.cli.bench_suite import _submit, drive  # noqa: E402


def prefill(engine, n: int, seed: int, device: str) -> float:
    """One request of n prompt tokens and one generated token, driven to its end; its wall ms."""
    sync()
    t0 = time.perf_counter()
    drive(engine, [_submit(engine, "prefill", n, 1, seed)], device)
    sync()
    return (time.perf_counter() - t0) * 1e3


def time_pieces(engine, n: int, pieces: list[int], samples: int, device: str) -> dict[str, list[float]]:
    """A warm n-token prefill's wall ms under each `gguf_matmul.PREFILL_ROWS`, A B B A order over and over."""
    from ninfer.kernels import gguf_matmul

    saved, times = gguf_matmul.PREFILL_ROWS, {str(r): [] for r in pieces}
    try:
        for i in range(samples):
            for rows in pieces if i % 2 == 0 else pieces[::-1]:
                gguf_matmul.PREFILL_ROWS = rows
                times[str(rows)].append(prefill(engine, n, 10 + i, device))
    finally:
        gguf_matmul.PREFILL_ROWS = saved
    return times


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_arguments(p, "iq3_s")
    p.add_argument("--tokens", default="512,2048", help="prompt lengths, comma-separated (one chunk each up "
                   "to --chunk)")
    p.add_argument("--chunk", type=int, default=2048, help="the engine's prefill chunk")
    p.add_argument("--cprofile", action="store_true", help="also the host's time by function (cProfile)")
    p.add_argument("--top", type=int, default=18, help="rows of each table")
    p.add_argument("--pieces", default="", help="weight rows a prefill matmul makes dense at a time "
                   "(gguf_matmul.PREFILL_ROWS), comma-separated: each length timed under each, in A B B A "
                   "order, --samples times over")
    p.add_argument("--samples", type=int, default=3, help="with --pieces: rounds of the A B B A order")
    p.add_argument("--no-profile", action="store_true", help="no torch.profiler run")
    p.add_argument("--out", type=Path, help="a folder for prefill_profile.json")
    a = p.parse_args()
    lengths = [int(n) for n in a.tokens.split(",")]
    engine, name = make_engine(engine_args(a), "bf16", max(lengths) + 64, a.chunk)
    on_gpu = a.device.startswith("cuda")
    activities = [torch.profiler.ProfilerActivity.CPU]
    if on_gpu:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    rows = []
    for n in lengths:
        for seed in (1, 2):  # compile and autotune this length's shapes
            prefill(engine, n, seed, a.device)
        bare = prefill(engine, n, 3, a.device)
        row = dict(tokens=n, bare_ms=bare)
        if a.pieces:
            row["pieces_ms"] = time_pieces(engine, n, [int(r) for r in a.pieces.split(",")], a.samples,
                                           a.device)
            print(f"\n== {name}: prefill of {n} tokens by dense weight rows at a time (ms):")
            for rows_at_once, times in row["pieces_ms"].items():
                print(f"| {rows_at_once} | {' / '.join(f'{t:.1f}' for t in times)} |", flush=True)
        if a.no_profile:
            rows.append(row)
            continue
        with torch.profiler.profile(activities=activities) as prof:
            row["profiled_ms"] = prefill(engine, n, 4, a.device)
        print(f"\n== {name}: prefill of {n} tokens: {bare:.1f} ms bare ({n / bare * 1e3:,.0f} tok/s), "
              f"{row['profiled_ms']:.1f} ms profiled", flush=True)
        if on_gpu:
            table = grouped(prof, 1)
            row["gpu_busy_ms"] = sum(r[1] for r in table) / 1e3
            row["kernels"] = [dict(name=k, us=us, launches=c) for k, us, c in table]
            print(f"GPU time {row['gpu_busy_ms']:.1f} ms, {sum(r[2] for r in table):.0f} launches\n"
                  "| kernel | ms | launches |\n|---|---|---|")
            for k, us, c in table[: a.top]:
                print(f"| {k[:80]} | {us / 1e3:.2f} | {c:.0f} |")
            row["timeline"] = idle_gaps(prof, 1, top=a.top // 3)
        if a.cprofile:
            host = cProfile.Profile()
            host.enable()
            prefill(engine, n, 5, a.device)
            host.disable()
            text = io.StringIO()
            pstats.Stats(host, stream=text).sort_stats("cumulative").print_stats(a.top)
            print(text.getvalue())
        rows.append(row)
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "prefill_profile.json").write_text(json.dumps(dict(model=name, rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

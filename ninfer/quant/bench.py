"""Dequantisation throughput on a 4096x4096 tensor of random valid blocks per format (not a test).

    python -m ninfer.quant.bench [--threads N] [--repeats R] [FORMAT ...]   (default: every block format)

Prints MB/s of quantized input and of float32 output; the best of R runs, by wall time and by the thread's
CPU time (the CPU figure is steadier on a shared machine; with one thread the two agree when it is idle).
"""

from __future__ import annotations

import argparse
import time

import torch

from ninfer.quant.dequant import dequantize
from ninfer.quant.formats import FORMATS, tensor_bytes

SHAPE = (4096, 4096)


def random_blocks(name: str, shape: tuple[int, int], seed: int = 0) -> torch.Tensor:
    """Random bytes in `name`'s layout with every fp16 field set to a finite value (0.0078 or smaller)."""
    fmt = FORMATS[name]
    gen = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (tensor_bytes("gguf_" + name, shape) // fmt.block_bytes, fmt.block_bytes),
                           generator=gen, dtype=torch.uint8)
    blocks[:, 1::2] &= 0x23  # clearing bits 2..4 and 6..7 of every odd byte keeps each fp16 field finite
    return blocks


def measure(name: str, repeats: int) -> tuple[float, float]:
    """Best wall and CPU seconds to dequantise a `SHAPE` tensor of `name`."""
    raw = random_blocks(name, SHAPE)
    dequantize(raw, "gguf_" + name, SHAPE)  # warm-up: tables, allocator
    wall, cpu = float("inf"), float("inf")
    for _ in range(repeats):
        start_wall, start_cpu = time.perf_counter(), time.thread_time()
        dequantize(raw, "gguf_" + name, SHAPE)
        cpu = min(cpu, time.thread_time() - start_cpu)
        wall = min(wall, time.perf_counter() - start_wall)
    return wall, cpu


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ninfer.quant.bench", description=__doc__.splitlines()[0])
    parser.add_argument("formats", nargs="*", metavar="FORMAT", help=f"any of {', '.join(FORMATS)}")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    unknown = sorted(set(args.formats) - set(FORMATS))
    if unknown:
        parser.error(f"unknown format(s) {', '.join(unknown)}; choose from {', '.join(FORMATS)}")
    torch.set_num_threads(args.threads)
    out_mb = SHAPE[0] * SHAPE[1] * 4 / 1e6
    print(f"{SHAPE[0]}x{SHAPE[1]}, {args.threads} thread(s), best of {args.repeats}")
    print("format    in MB  wall ms  in MB/s  out MB/s  cpu ms  in MB/s")
    for name in args.formats or FORMATS:
        wall, cpu = measure(name, args.repeats)
        in_mb = tensor_bytes("gguf_" + name, SHAPE) / 1e6
        print(f"{name:8} {in_mb:6.1f} {wall * 1e3:8.0f} {in_mb / wall:8.0f} {out_mb / wall:9.0f} "
              f"{cpu * 1e3:7.0f} {in_mb / cpu:8.0f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

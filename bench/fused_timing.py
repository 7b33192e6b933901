"""GPU timing of the decode step's small fused kernels at the 27B widths, one row (C = 1): the residual add +
RMSNorm (+ int8 activation) per warp count and
columns per program, SwiGLU (+ int8), the activation quantiser. Each call inside one
CUDA graph (`gpu_check.graph_us`), so launch gaps are as in a graphed decode step.

    python3 bench/fused_timing.py [--warps 4,8,16] [--chunks 512,1024,2048,8192]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.gpu_check import graph_us  # noqa: E402
from ninfer.kernels import fused  # noqa: E402
from ninfer.kernels.gemv_q8 import quantize_activation  # noqa: E402


def calls(make, copies: int = 32) -> list:
    """`copies` closures, each on its own random inputs."""
    return [make() for _ in range(copies)]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--warps", default="4,8,16")
    p.add_argument("--chunks", default="512,1024,2048,8192", help="NORM_CHUNK values (8192: one program)")
    a = p.parse_args()
    dev, bf16 = torch.device("cuda"), torch.bfloat16
    hidden, inter = 5120, 17408
    w = torch.randn(hidden, device=dev, dtype=bf16)
    rows = []

    def norm(quantize: bool):
        x, r = torch.randn(1, hidden, device=dev, dtype=bf16), torch.randn(1, hidden, device=dev, dtype=bf16)
        return lambda: fused.add_rms_norm(x, r, w, 1e-6, True, quantize=quantize)

    default = fused._row_warps, fused.NORM_CHUNK
    for nw in [int(v) for v in a.warps.split(",")]:
        for chunk in [int(v) for v in a.chunks.split(",")]:
            fused._row_warps, fused.NORM_CHUNK = (lambda block, nw=nw: nw), chunk
            for q in (False, True):
                label = f"add_rms_norm 1×{hidden}{' + int8' if q else ''}, {nw} warps, chunk {chunk}"
                rows.append((label, graph_us(calls(lambda q=q: norm(q)))))
    fused._row_warps, fused.NORM_CHUNK = default

    def glu(quantize: bool):
        g, u = torch.randn(1, inter, device=dev, dtype=bf16), torch.randn(1, inter, device=dev, dtype=bf16)
        return lambda: fused.swiglu(g, u, quantize=quantize)

    for q in (False, True):
        rows.append((f"swiglu 1×{inter}{' + int8' if q else ''}", graph_us(calls(lambda q=q: glu(q)))))
    for width in (hidden, inter):
        def quant(width=width):
            x = torch.randn(1, width, device=dev, dtype=bf16)
            return lambda: quantize_activation(x)
        rows.append((f"quantize_activation 1×{width}", graph_us(calls(quant))))
    print("| kernel | µs |\n|---|---|")
    for name, us in rows:
        print(f"| {name} | {us:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

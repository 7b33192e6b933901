"""Programmatic dependent launch on the GPU: µs per kernel of two chains captured in a CUDA graph, with PDL
off and on (`NINFER_PDL`): 400 SwiGLU kernels on one 5120-wide row, and 64 add + RMSNorm + int8 → q4_k
5120×5120 GEMV pairs (docs/gpu-notes.md, session 8).

    python3 bench/pdl_timing.py
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.gpu_check import graph_us  # noqa: E402
from ninfer.kernels import fused, ops, triton_support  # noqa: E402
from ninfer.kernels.gguf_matmul import quant_matmul, random_gguf_weight  # noqa: E402


def main() -> int:
    dev = "cuda"
    g = torch.randn(1, 5120, device=dev, dtype=torch.bfloat16)
    u = torch.randn(1, 5120, device=dev, dtype=torch.bfloat16)
    weights = [random_gguf_weight("q4_k", 5120, 5120, dev) for _ in range(8)]
    norm_w = torch.randn(5120, device=dev)

    def small_chain():
        x = g
        for _ in range(400):
            x = fused.swiglu(x, u)
        return x

    def gemv_chain():
        x, h = g, u
        for i in range(64):
            n, h = ops.add_rms_norm(x, h, norm_w, 1e-6, True)
            x = quant_matmul(weights[i % 8], "q4_k", n, 5120)
        return x

    for pdl in ("0", "1", "0", "1"):
        os.environ["NINFER_PDL"] = pdl
        triton_support.reread_launch_settings()
        small, pairs = graph_us([small_chain]) / 400, graph_us([gemv_chain]) / 128  # µs per kernel
        print(f"PDL {'on ' if triton_support.pdl_enabled() else 'off'}: SwiGLU chain {small:.2f} µs/kernel, "
              f"norm + GEMV chain {pairs:.2f} µs/kernel", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The q6_k output head at one column: the q8 GEMV's route beside every q6_k rows schedule (gemv_rows_q6k.py),
µs per call in one CUDA graph over two weight copies (2 GB at the 27B's 248320×5120, far beyond the L2), with
each schedule's output checked against the q8 route's.

    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
    PYTHONPATH=/tmp/site:$PWD python3 bench/head_timing.py [--rows 248320 --cols 5120]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.gpu_check import graph_us  # noqa: E402
from ninfer.kernels.gemv_q8 import gemv_q8, quantize_activation  # noqa: E402
from ninfer.kernels.gemv_rows_q6k import SCHEDULES, gemv_rows_q6k  # noqa: E402
from ninfer.kernels.gguf_matmul import default_schedule, random_gguf_weight  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=248320)
    p.add_argument("--cols", type=int, default=5120)
    a = p.parse_args()
    weights = [random_gguf_weight("q6_k", a.rows, a.cols, "cuda") for _ in range(2)]
    xa = quantize_activation(torch.randn(1, a.cols, device="cuda", dtype=torch.bfloat16))
    q8 = default_schedule(1, "q6_k", a.rows, a.cols, q8=True)
    ref = gemv_q8(weights[0], "q6_k", xa, a.rows, q8).float()
    times = {f"q8 {q8.name}": graph_us([lambda w=w: gemv_q8(w, "q6_k", xa, a.rows, q8) for w in weights])}
    for name in SCHEDULES:
        out = gemv_rows_q6k(weights[0], "q6_k", xa, a.rows, name).float()
        err = float((out - ref).norm() / ref.norm())
        assert err < 5e-3, f"{name}: {err:.2e} from the q8 route"  # both round to bf16
        times[name] = graph_us([lambda w=w, n=name: gemv_rows_q6k(w, "q6_k", xa, a.rows, n) for w in weights])
    size = weights[0].numel()
    print(f"q6_k {a.rows}×{a.cols} ({size / 1e9:.3f} GB) at one column, µs a call:")
    for name, us in sorted(times.items(), key=lambda kv: kv[1]):
        print(f"  {name:28s} {us:8.1f}  {size / us / 1e6:5.2f} TB/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

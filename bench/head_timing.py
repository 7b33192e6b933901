"""The q6_k output head at 1-8 columns: the q8 GEMV at one column or the fragment kernel's `frag_w1_r2_m8`
at 2-8 (its route from 5) beside every q6_k rows schedule of that width (1-4; gemv_rows_q6k.py: one program
decodes its weights once for all of its columns), µs per call in one CUDA graph over two weight copies (2 GB
at the 27B's 248320×5120, far beyond the L2), each schedule's output checked against the q8 GEMV's.

    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
    PYTHONPATH=/tmp/site:$PWD python3 bench/head_timing.py [--rows 248320 --cols 5120 --widths 1,2,3,4,8]

--q6il: also the tensor-core kernel on the repacked head (`gemv_q6il`, the route since session 34; its
activation per 256), checked against float64 on the first 4096 rows.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.gpu_check import graph_us  # noqa: E402
from ninfer.kernels.gemv_frag import frag_route, gemv_frag  # noqa: E402
from ninfer.kernels.gemv_q8 import gemv_q8, quantize_activation  # noqa: E402
from ninfer.kernels.gemv_rows_q6k import SCHEDULES, gemv_rows_q6k  # noqa: E402
from ninfer.kernels.gguf_matmul import default_schedule, random_gguf_weight  # noqa: E402


def time_width(weights: list[torch.Tensor], m: int, rows: int, cols: int) -> dict[str, float]:
    """µs a call of the present route and of every rows schedule at `m` columns, outputs checked."""
    xa = quantize_activation(torch.randn(m, cols, device="cuda", dtype=torch.bfloat16))
    q8 = default_schedule(1, "q6_k", rows, cols, q8=True)
    ref = torch.cat([gemv_q8(weights[0], "q6_k", xa.row(i), rows, q8) for i in range(m)]).float()
    if m == 1:
        calls = {f"q8 {q8.name}": lambda w: gemv_q8(w, "q6_k", xa, rows, q8)}
    else:
        frag = frag_route("q6_k", rows, cols, m)  # the fragment kernel's head schedule
        calls = {frag.name: lambda w: gemv_frag(w, "q6_k", xa, rows, frag)}
    for name in (n for n, s in SCHEDULES.items() if s.block_m == m):
        calls[name] = lambda w, n=name: gemv_rows_q6k(w, "q6_k", xa, rows, n)
    times = {}
    for name, call in calls.items():
        out = call(weights[0]).float()
        err = float((out - ref).norm() / ref.norm())
        assert err < 5e-3, f"{name} at {m} columns: {err:.2e} from the q8 GEMV"  # both round to bf16
        times[name] = graph_us([lambda w=w, c=call: c(w) for w in weights])
    return times


def time_q6il(weights: list[torch.Tensor], m: int, rows: int, cols: int) -> float:
    """µs a call of `gemv_q6il` at `m` columns on the repacked copies, the first 4096 rows checked against
    the float64 product of their dequantised rows and the per-256 activation."""
    from ninfer.kernels.gemv_q6il import gemv_q6il, repack_q6il
    from ninfer.quant import dequantize

    if not hasattr(weights[0], "q6il"):
        for w in weights:
            w.q6il = repack_q6il(w)
    xa = quantize_activation(torch.randn(m, cols, device="cuda", dtype=torch.bfloat16), group=256)
    part = min(rows, 4096)
    dense = dequantize(weights[0][:part].reshape(-1), "gguf_q6_k", (part, cols)).double()
    want = xa.dequantize().double() @ dense.t()
    out = gemv_q6il(weights[0].q6il, xa, rows)[:, :part].double()
    err = float((out - want).norm() / want.norm())
    assert err < 5e-3, f"q6il at {m} columns: {err:.2e} from float64"  # the bf16 output's rounding
    return graph_us([lambda w=w: gemv_q6il(w.q6il, xa, rows) for w in weights])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=248320)
    p.add_argument("--cols", type=int, default=5120)
    p.add_argument("--widths", default="1,2,3,4")
    p.add_argument("--q6il", action="store_true", help="also the tensor-core kernel (gemv_q6il)")
    a = p.parse_args()
    weights = [random_gguf_weight("q6_k", a.rows, a.cols, "cuda") for _ in range(2)]
    size = weights[0].numel()
    for m in map(int, a.widths.split(",")):
        times = time_width(weights, m, a.rows, a.cols)
        if a.q6il:
            times["q6il (tensor cores, repacked)"] = time_q6il(weights, m, a.rows, a.cols)
        print(f"q6_k {a.rows}×{a.cols} ({size / 1e9:.3f} GB) at {m} column(s), µs a call:", flush=True)
        for name, us in sorted(times.items(), key=lambda kv: kv[1]):
            print(f"  {name:28s} {us:8.1f}  {size / us / 1e6:5.2f} TB/s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

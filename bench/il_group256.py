"""The tensor-core il32 GEMV with one activation scale per 256 inputs (`IlSchedule(group=256)`:
the sub-block scales weigh the integer mma results, one float conversion a block) against the routed kernel
(one scale per 32) on the 27B's iq3_s matrices at 3, 4 and 8 columns (CUDA).

Checks each variant against the float64 product of the dequantised weights and its own dequantised int8
activation, then times both in CUDA graphs whose calls rotate over weight copies larger than 3× L2.

    python3 bench/il_group256.py [--shapes 34816x5120,...] [--widths 3,4,8] [--calls 200]
"""

from __future__ import annotations

import argparse

import torch

from ninfer.kernels.gemv_il import IlSchedule, gemv_il, il_schedule, repack_il32
from ninfer.kernels.gemv_q8 import QuantizedActivation, quantize_activation
from ninfer.kernels.gguf_matmul import random_gguf_weight
from ninfer.quant import dequantize


def time_calls(copies: list[torch.Tensor], xa: QuantizedActivation, n: int, s: IlSchedule,
               calls: int) -> float:
    """µs a call: `calls` GEMVs rotating over the weight copies, in one CUDA graph."""
    gemv_il(copies[0], xa, n, s)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            gemv_il(copies[i % len(copies)], xa, n, s)
    graph.replay()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) * 1000 / calls)
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="34816x5120,16480x5120,5120x17408,14336x5120,5120x6144")
    p.add_argument("--widths", default="3,4,8")
    p.add_argument("--calls", type=int, default=200)
    args = p.parse_args()
    torch.manual_seed(0)
    rows = []
    for shape in args.shapes.split(","):
        n, k = (int(v) for v in shape.split("x"))
        raw = random_gguf_weight("iq3_s", n, k, "cuda")
        dense = dequantize(raw.reshape(-1), "gguf_iq3_s", (n, k)).double()
        words = repack_il32(raw)
        del raw
        copies = [words] + [words.clone() for _ in range(-(-3 * 60 * 2**20 // words.nbytes))]
        for width in (int(w) for w in args.widths.split(",")):
            x = torch.randn(width, k, device="cuda", dtype=torch.bfloat16)
            x32 = quantize_activation(x)
            x256 = quantize_activation(x, group=256)
            s32 = il_schedule(width, k, n)
            s256 = IlSchedule(s32.warps, kernel="il_mma", regs=s32.regs, group=256)
            errors = []
            for xa, s in ((x32, s32), (x256, s256)):
                want = xa.dequantize() @ dense.t()
                y = gemv_il(words, QuantizedActivation(xa.q, xa.d, xa.s, torch.float32), n, s)
                errors.append(float((y.double() - want).norm() / want.norm()))
            t32 = time_calls(copies, x32, n, s32, args.calls)
            t256 = time_calls(copies, x256, n, s256, args.calls)
            rows.append((shape, width, t32, t256, *errors))
            print(f"{shape} w{width}: per-32 {t32:.1f} µs (err {errors[0]:.1e}), per-256 {t256:.1f} µs "
                  f"(err {errors[1]:.1e})", flush=True)
        del copies, words, dense
        torch.cuda.empty_cache()
    print("\n| matrix | columns | per 32 (µs) | per 256 (µs) | ratio | rel. error 32 / 256 |")
    print("|---|---|---|---|---|---|")
    for shape, width, t32, t256, e32, e256 in rows:
        print(f"| {shape} | {width} | {t32:.1f} | {t256:.1f} | {t256 / t32:.3f} | {e32:.1e} / {e256:.1e} |")
    if max(max(r[4], r[5]) for r in rows) > 1e-4:
        raise SystemExit("a variant is off its float64 reference by more than 1e-4")


if __name__ == "__main__":
    main()

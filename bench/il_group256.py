"""The il32 GEMVs with one activation scale per 256 inputs (`IlSchedule(group=256)`: the sub-block
scales weigh the integer sums, one float conversion a block) against one scale per 32, on the 27B's iq3_s
matrices: the dp4a kernel at 1-2 columns, the tensor-core kernel at 3-8 (CUDA).

Checks each variant against the float64 product of the dequantised weights and its own dequantised int8
activation, then times both as `bench/gpu_check.py`'s `graph_us` does (one CUDA graph over weight copies
larger than 3× L2).

    python3 bench/il_group256.py [--shapes 34816x5120,...] [--widths 1,2,3,4,8]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.gpu_check import graph_us, rel_err, weight_copies  # noqa: E402
from ninfer.kernels.gemv_il import gemv_il, il_schedule, repack_il32  # noqa: E402
from ninfer.kernels.gemv_q8 import QuantizedActivation, quantize_activation  # noqa: E402
from ninfer.quant import dequantize  # noqa: E402


def iq3s_copies(shape: str) -> tuple[int, int, list[torch.Tensor], torch.Tensor]:
    """(rows, columns, GGUF copies of one random iq3_s weight totalling > 3× L2, its dequantised float64
    matrix) for a ROWSxCOLS shape on the GPU."""
    n, k = (int(v) for v in shape.split("x"))
    raws = weight_copies("iq3_s", n, k, torch.device("cuda"), at_least=3)
    return n, k, raws, dequantize(raws[0].reshape(-1), "gguf_iq3_s", (n, k)).double()


def il32_copies(shape: str) -> tuple[int, int, list[torch.Tensor], torch.Tensor]:
    """`iq3s_copies` repacked to il32."""
    n, k, raws, dense = iq3s_copies(shape)
    return n, k, [repack_il32(raw) for raw in raws], dense


def il32_activation(width: int, dense: torch.Tensor, group: int
                    ) -> tuple[QuantizedActivation, QuantizedActivation, torch.Tensor]:
    """(a random int8 activation of `width` columns for the float64 weight `dense`, the same writing fp32, its
    exact product with `dense`) for the il32 benches."""
    xa = quantize_activation(torch.randn(width, dense.shape[1], device=dense.device, dtype=torch.bfloat16),
                             group=group)
    fp32 = QuantizedActivation(xa.q, xa.d, xa.s, torch.float32)
    return xa, fp32, fp32.dequantize() @ dense.t()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="34816x5120,16480x5120,5120x17408,14336x5120,5120x6144")
    p.add_argument("--widths", default="1,2,3,4,8")
    args = p.parse_args()
    torch.manual_seed(0)
    rows = []
    for shape in args.shapes.split(","):
        n, k, copies, dense = il32_copies(shape)
        words = copies[0]
        for width in (int(w) for w in args.widths.split(",")):
            x = torch.randn(width, k, device="cuda", dtype=torch.bfloat16)
            x32 = quantize_activation(x)
            x256 = quantize_activation(x, group=256)
            s32, s256 = il_schedule(width, k, n, group=32), il_schedule(width, k, n, group=256)
            errors = []
            for xa, s in ((x32, s32), (x256, s256)):
                fp32 = QuantizedActivation(xa.q, xa.d, xa.s, torch.float32)
                errors.append(rel_err(gemv_il(words, fp32, n, s), xa.dequantize() @ dense.t()))
            t32, t256 = (graph_us([lambda w=w, xa=xa, s=s, n=n: gemv_il(w, xa, n, s) for w in copies])
                         for xa, s in ((x32, s32), (x256, s256)))
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

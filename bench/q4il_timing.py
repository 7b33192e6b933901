"""The 27B's q4_k GEMVs on the lane-per-row tensor-core kernel (`gemv_q4il`, routed on ≥ 8192 rows) against
today's GGUF routes (`quant_matmul`), each checked against the float64 product of the dequantised weight, then
timed as `bench/gpu_check.py`'s `graph_us` does (one CUDA graph over weight copies larger than 3× L2).

    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
    PYTHONPATH=/tmp/site:$PWD python3 bench/q4il_timing.py [--shapes 34816x5120,...] [--widths 1,2,4,8] \\
        [--ctas 8x2,5x3]

--ctas: the q4il kernel at these CTA shapes (warps x CTAs an SM; the default: `SHAPES`). --conv: each also
with the GDN decode conv of the first min(rows, 10240) outputs in its epilogue, a lane a column (the CONV
builds; gpu-notes "Session 47": their 4- and 8-column loops are shorter than the plain builds'). --staged:
each also with its next block staged in shared memory (cp.async; gpu-notes "Session 48"), checked to give the
same bits. --clusters 2,3: each CTA shape also in clusters of that many CTAs a tile (distributed shared
memory; gpu-notes "Session 51"), checked against float64 like the rest.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.gpu_check import graph_us, rel_err, weight_copies  # noqa: E402
from ninfer.kernels.gdn_decode import ConvEpilogue  # noqa: E402
from ninfer.kernels.gemv_q4il import SHAPES, gemv_q4il, repack_q4il  # noqa: E402
from ninfer.kernels.gemv_q8 import quantize_activation  # noqa: E402
from ninfer.kernels.gguf_matmul import quant_matmul  # noqa: E402
from ninfer.quant import dequantize  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="34816x5120,16480x5120,14336x5120,5120x17408,5120x6144")
    p.add_argument("--widths", default="1,2,4,8")
    p.add_argument("--ctas", default=",".join(f"{w}x{c}" for w, c in SHAPES), help="warps x CTAs an SM")
    p.add_argument("--conv", action="store_true", help="also the builds with the GDN conv epilogue")
    p.add_argument("--staged", action="store_true",
                   help="also the builds that stage each warp's next block in shared memory (cp.async)")
    p.add_argument("--clusters", default="", help="also in clusters of these many CTAs a tile (2,3)")
    args = p.parse_args()
    torch.manual_seed(0)
    ctas = [tuple(int(v) for v in s.split("x")) for s in args.ctas.split(",")]
    rows = []
    for shape in args.shapes.split(","):
        n, k = (int(v) for v in shape.split("x"))
        raws = weight_copies("q4_k", n, k, torch.device("cuda"), at_least=3)
        words = [repack_q4il(raw) for raw in raws]
        dense = dequantize(raws[0].reshape(-1), "gguf_q4_k", (n, k)).double()
        for width in (int(w) for w in args.widths.split(",")):
            x = torch.randn(width, k, device="cuda", dtype=torch.bfloat16)
            xa = quantize_activation(x, group=256)
            exact = x.double() @ dense.t()
            err = rel_err(quant_matmul(raws[0], "q4_k", x, n), exact)
            assert err < 2e-2, f"the GGUF route at {shape}, {width} columns: {err:.2e}"  # int8 x, bf16 out
            times = {"gguf": graph_us([lambda r=r, x=x, n=n: quant_matmul(r, "q4_k", x, n) for r in raws])}
            for cta in ctas:
                for cluster in (1, *(int(c) for c in filter(None, args.clusters.split(",")))):
                    got = gemv_q4il(words[0], xa, n, cta, cluster=cluster)
                    err = rel_err(got, xa.dequantize().double() @ dense.t())
                    assert err < 5e-3, f"q4il at {shape}, {width} columns, CTAs {cta} in {cluster}: {err:.2e}"
                    times[f"q4il {cta[0]}x{cta[1]}" + (f" c{cluster}" if cluster > 1 else "")] = graph_us(
                        [lambda w=w, c=cta, xa=xa, n=n, cl=cluster: gemv_q4il(w, xa, n, c, cluster=cl)
                         for w in words])
                if args.staged:
                    staged = gemv_q4il(words[0], xa, n, cta, staged=True)
                    assert torch.equal(staged, gemv_q4il(words[0], xa, n, cta)), \
                        f"q4il staged at {shape}, {width} columns, CTAs {cta}"
                    times[f"q4il {cta[0]}x{cta[1]} staged"] = graph_us(
                        [lambda w=w, c=cta, xa=xa, n=n: gemv_q4il(w, xa, n, c, staged=True) for w in words])
                if args.conv:
                    channels = min(n, 10240)
                    conv = ConvEpilogue.of(torch.randn(channels, 4, device="cuda"),
                                           torch.randn(width + 1, channels, 3, device="cuda"),
                                           torch.arange(width, device="cuda"))
                    times[f"q4il {cta[0]}x{cta[1]} +conv"] = graph_us(
                        [lambda w=w, c=cta, xa=xa, n=n, cv=conv: gemv_q4il(w, xa, n, c, conv=cv)
                         for w in words])
            gb = raws[0].numel() / 1e9
            best = min(times, key=times.get)
            line = " | ".join(f"{times[name]:.1f}" for name in times)
            fastest = min(v for name, v in times.items() if name != "gguf")
            rows.append(f"| {shape} | {width} | {line} | {best} | {gb / fastest * 1e3:.2f} |")
            print(rows[-1], flush=True)
    heads = " | ".join(f"{name} (µs)" for name in times)
    print(f"\n| matrix | columns | {heads} | best | q4il's best TB/s |")
    print("|---|---|" + "---|" * (len(times) + 2))
    print("\n".join(rows))


if __name__ == "__main__":
    main()

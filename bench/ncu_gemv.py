"""Launch named decode-GEMV schedules for Nsight Compute: each one compiled and warmed first, then called
twice on weight copies that do not fit the L2, between cudaProfilerStart/Stop (so `ncu --profile-from-start
off` sees only these launches).

    ncu --profile-from-start off --clock-control none --set full -o $OUT/gemv -f \
        python3 bench/ncu_gemv.py q4_k:1:rows_n4_m1_b4_w2_ef q4_k:4:mma_n32_m8_w2_s8_pl iq3_s:4:route
    ncu -i $OUT/gemv.ncu-rep --page details --csv > $OUT/details.csv

Each argument is format:columns:schedule (`route`: the schedule `quant_matmul` takes; `il_route` (iq3_s): the
il32 GEMV with the schedule and activation grouping the engine takes; `bf16:<frag schedule>`:
the bf16 fragment GEMV of bench/frag_bf16.py, q4_k); --shape ROWSxCOLS; --nvrtc: the CUDA C schedules too
(`cu_il_w10_c16`, `cu_ilmma_w10_r96`, ... of bench/nvrtc_iq3s_il.py).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import rows_timing  # noqa: E402
from bench.rows_timing import kernel  # noqa: E402
from ninfer.kernels.gemv_q8 import quantize_activation  # noqa: E402
from ninfer.kernels.gguf_matmul import random_gguf_weight  # noqa: E402


def launcher(spec: str, rows: int, cols: int, dev: torch.device):
    """(label, call(copy)) for one `format:columns:schedule` spec."""
    fmt, width, name = spec.split(":", 2)
    width = int(width)
    if name.startswith("bf16:"):
        from bench.frag_bf16 import gemv_frag_bf16

        x = torch.randn(width, cols, device=dev, dtype=torch.bfloat16)
        return f"{fmt} {width} col {name}", lambda raw: gemv_frag_bf16(raw, fmt, x, rows, name[5:])
    if name == "il_route":  # the il32 GEMV as the engine routes it (`il_schedule`, `il_group`'s activation)
        from ninfer.kernels.gemv_il import gemv_il, il_group, il_schedule, repack_il32

        group = il_group()
        s = il_schedule(width, cols, rows, group)
        xa = quantize_activation(torch.randn(width, cols, device=dev, dtype=torch.bfloat16), group=group)

        def call(raw):
            if not hasattr(raw, "il32"):
                raw.il32 = repack_il32(raw)
            return gemv_il(raw.il32, xa, rows, s)

        return f"{fmt} {width} col {s.name}", call
    schedules, gemv, route = kernel(fmt)
    if name == "route":
        name = route(fmt, rows, cols, width).name
    if name not in schedules:
        raise SystemExit(f"{spec}: no schedule {name!r} for {fmt} (have: {', '.join(schedules)})")
    xa = quantize_activation(torch.randn(width, cols, device=dev, dtype=torch.bfloat16))
    return f"{fmt} {width} col {name}", lambda raw: gemv(raw, fmt, xa, rows, name)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("specs", nargs="+", help="format:columns:schedule")
    p.add_argument("--shape", default="17408x5120")
    p.add_argument("--nvrtc", action="store_true", help="also the CUDA C schedules (rows_timing --nvrtc)")
    a = p.parse_args()
    rows_timing.NVRTC = a.nvrtc
    rows, cols = map(int, a.shape.split("x"))
    dev = torch.device("cuda")
    runs = []
    for spec in a.specs:
        label, call = launcher(spec, rows, cols, dev)
        copies = [random_gguf_weight(spec.split(":")[0], rows, cols, dev) for _ in range(4)]
        for raw in copies:
            call(raw)
        runs.append((label, call, copies))
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    for label, call, copies in runs:
        print(label, flush=True)
        call(copies[0])
        call(copies[2])
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

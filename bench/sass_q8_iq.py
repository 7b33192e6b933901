"""Compile every q8 i-quant GEMV schedule (ninfer/kernels/gemv_q8_iq.py) for sm_90 without a GPU and print the
SASS instructions per weight of its block loop (1-column schedules; `--all` for every schedule).

    NINFER_TRITON_COMPILE_CHECK=1 python bench/sass_q8_iq.py [--all | --schedules A,B] [--dump FMT:SCHEDULE]

Per weight = loop-body instructions ÷ (BLOCK_N · 256 / threads), the same rule as gpu_check.py --sass.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import sys

os.environ.setdefault("NINFER_TRITON_COMPILE_CHECK", "1")  # before ninfer imports triton_support

from sass_tools import compile_sm90, cuobjdump, loop_body, opcode_mix  # noqa: E402  (bench/ is sys.path[0])

REGS: dict = {}  # (format, schedule) -> (registers per thread, spills) of the last compile


def compile_schedule(fmt: str, sched) -> str:
    """The SASS of one (format, schedule), compiled for sm_90 with 16-divisibility hints. Format "iq3_s_l1":
    iq3_s with the grid looked up through L1 (global loads) instead of shared memory."""
    from ninfer.kernels import gemv_q8_iq as q

    smem = fmt == "iq3_s" and not getattr(sched, "grid_l1", False)
    fmt = fmt.removesuffix("_l1")
    sig = {"w_ptr": "*u16" if fmt == "iq3_s" else "*i32", "xq_ptr": "*i64", "xd_ptr": "*fp32",
           "y_ptr": "*fp32" if sched.split_k > 1 else "*bf16", "grid_ptr": "*i32", "N": "i32", "K": "i32",
           "M": "i32", "row_units": "i32", "stride_xq": "i32", "stride_xd": "i32", "stride_ym": "i32"}
    hinted = ("w_ptr", "xq_ptr", "xd_ptr", "y_ptr", "grid_ptr", "K", "stride_xq", "stride_xd", "stride_ym")
    t0, t1, t2, t3 = q._IQ4_WORDS
    const = dict(FMT=q.IQ_Q8_FORMATS.index(fmt), BLOCK_N=sched.block_n, BLOCK_M=sched.block_m,
                 SPLIT_K=sched.split_k, T0=t0, T1=t1, T2=t2, T3=t3, EMULATE=False,
                 GRID_SMEM=smem, PREFETCH=getattr(sched, "prefetch", 0), FENCE=getattr(sched, "fence", True),
                 DEPTH=getattr(sched, "depth", 1), KB=getattr(sched, "kb", 1),
                 SB=8 * getattr(sched, "kb", 1))
    kernel = q._gemv_q8_iq_kernel
    if getattr(sched, "stream", 0):  # stream-K: fp32 atomics, no split / fence / depth
        kernel = q._gemv_q8_iq_stream_kernel
        sig["y_ptr"] = "*fp32"
        for k in ("SPLIT_K", "FENCE", "DEPTH", "KB", "SB"):
            const.pop(k)
    c = compile_sm90(kernel, sig, const, hinted, sched.num_warps)
    res = cuobjdump(c, "-res-usage")
    regs = re.search(r"REG:(\d+)", res)
    spills = re.search(r"STACK:(\d+)", res)
    REGS[(fmt, sched.name)] = (int(regs.group(1)) if regs else -1, int(spills.group(1)) if spills else -1)
    return cuobjdump(c, "-sass")


def per_weight(fmt: str, sched) -> tuple[float, int, collections.Counter]:
    body = loop_body(compile_schedule(fmt, sched))
    mix = opcode_mix(body)
    weights_per_thread = sched.block_n * 256 * getattr(sched, "kb", 1) / (32 * sched.num_warps)
    return len(body) / weights_per_thread, len(body), mix


def main(argv=None) -> int:
    from ninfer.kernels import gemv_q8_iq as q

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--all", action="store_true", help="every schedule, not only the 1-column ones")
    ap.add_argument("--dump", help="print the loop body of FMT:SCHEDULE")
    ap.add_argument("--schedules", help="comma-separated schedule names (default: the 1-column ones)")
    a = ap.parse_args(argv)
    if a.dump:
        fmt, name = a.dump.split(":")
        print("\n".join(loop_body(compile_schedule(fmt, q.SCHEDULES[name]))))
        return 0
    for fmt in ("iq3_s", "iq3_s_l1", "iq4_xs"):
        for s in q.SCHEDULES.values():
            if (a.schedules and s.name not in a.schedules.split(",")) or (
                    not a.schedules and s.block_m != 1 and not a.all):
                continue
            pw, n, mix = per_weight(fmt, s)
            top = " ".join(f"{k} {v}" for k, v in mix.most_common(10))
            regs, spills = REGS[(fmt.removesuffix("_l1"), s.name)]
            print(f"{fmt} {s.name}: {n} loop instructions = {pw:.2f} per weight (IDP4A {mix.get('IDP', 0)}, "
                  f"BAR {mix.get('BAR', 0)}); {regs} regs, stack {spills}; {top}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

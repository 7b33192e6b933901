"""Compile rows-GEMV schedules (ninfer/kernels/gemv_rows.py: q4_k, q5_k; gemv_rows_iq.py: iq3_s;
gemv_rows_q6k.py: q6_k) for sm_90 without a GPU and print their block loop: registers, SASS instruction count,
loads and dp4a (IDP) count, barriers and shuffles (layout conversions in the loop).

    NINFER_TRITON_COMPILE_CHECK=1 python bench/sass_rows.py [--schedules A,B] [--format q4_k|q5_k|iq3_s|q6_k]
        [--conv]       # the chunk lanes built with the GDN decode conv in the epilogue
        [--early]      # with --conv: its operands loaded before the programmatic-launch wait
        [--maxnreg N]  # registers a thread capped (ptxas), e.g. the conv build at the plain build's 78
        [--unhinted]   # also the build Triton makes when the row length is not a multiple of 16 (rows of a
                       # number of blocks that is not a multiple of 4: 2560 or 9728 columns)
    PYTHONPATH=.triton-device ...  # the GPU machine's Triton (make device-triton): its builds, not 3.9's
"""

from __future__ import annotations

import argparse
import os
import re

os.environ.setdefault("NINFER_TRITON_COMPILE_CHECK", "1")  # before ninfer imports triton_support

from sass_tools import compile_sm90, cuobjdump, loop_body, opcode_mix  # noqa: E402  (bench/ is sys.path[0])


def build_args(fmt: str, s, conv: bool, early: bool):
    """(kernel, signature, constexprs, 16-divisible arguments) of a rows schedule's build."""
    from ninfer.kernels import gemv_rows as g
    from ninfer.kernels import gemv_rows_iq as gi
    from ninfer.kernels import gemv_rows_q6k as gq

    ints = dict.fromkeys(("N", "K", "M"), "i32")
    conv_sig = {"cw_ptr": "*fp32", "cs_ptr": "*fp32", "slot_ptr": "*i32", "co_ptr": "*fp32", "C": "i32",
                "s_cs": "i32"}
    fixup_sig = {"o_ptr": "*bf16", "cnt_ptr": "*i32"}  # split-K's fixup (unused without FIXUP)
    const = dict(BLOCK_N=s.block_n, BLOCK_M=s.block_m, NB=s.blocks, SPLIT_K=s.split_k, EVEN=True,
                 EMULATE=False, PDL=3)
    if fmt == "q6_k":
        sig = {"w_ptr": "*i32", "xw_ptr": "*i32", "xd_ptr": "*fp32", "y_ptr": "*bf16", **ints,
               "row_bytes": "i32", "stride_ym": "i32"}
        return gq._gemv_rows_q6k_kernel, sig, const, ("w_ptr", "xw_ptr", "xd_ptr", "y_ptr", "K", "row_bytes",
                                                      "stride_ym")
    if fmt == "iq3_s":
        sig = {"w_ptr": "*i32", "xw_ptr": "*i32", "xd_ptr": "*fp32", "grid_ptr": "*i16", "y_ptr": "*bf16",
               **ints, "row_bytes": "i32", "stride_ym": "i32", **conv_sig, **fixup_sig}
        const.update(SIGNED=s.signed_grid, PADDED=False, CONV=conv, CONV_EARLY=early, FIXUP=s.split_k > 1)
        return gi._gemv_rows_iq3_kernel, sig, const, ("w_ptr", "xw_ptr", "xd_ptr", "grid_ptr", "y_ptr", "K",
                                                      "row_bytes", "stride_ym")
    sig = {"w_ptr": "*i32", "xw_ptr": "*i32", "xd_ptr": "*fp32", "xs_ptr": "*fp32", "y_ptr": "*bf16", **ints,
           "row_quads": "i32", "stride_ym": "i32"}
    hinted = ("w_ptr", "xw_ptr", "xd_ptr", "xs_ptr", "y_ptr", "K", "row_quads", "stride_ym")
    const.update(FMT=g._FMT[fmt], CACHE=s.cache, FIXUP=s.split_k > 1)
    if s.lanes == "piece":
        return g._gemv_rows_p_kernel, {**sig, **fixup_sig}, const, hinted
    const.update(R=s.rows_per_lane, CONV=conv, CONV_EARLY=early)
    return g._gemv_rows_kernel, {**sig, **conv_sig, **fixup_sig}, const, hinted


def main() -> int:
    from ninfer.kernels import gemv_rows as g
    from ninfer.kernels import gemv_rows_iq as gi
    from ninfer.kernels import gemv_rows_q6k as gq

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--schedules", default="rows_n16_m1_b4_w4_r2_ef,rowsp_n2_m4_b4_w1")
    p.add_argument("--format", default="q4_k", choices=(*g.ROWS_FORMATS, "iq3_s", "q6_k"))
    p.add_argument("--unhinted", action="store_true",
                   help="also build with the row length not 16-divisible (Triton specialises on that at run "
                        "time)")
    p.add_argument("--conv", action="store_true", help="the chunk lanes' build with the GDN conv epilogue")
    p.add_argument("--early", action="store_true", help="with --conv: the conv operands loaded first")
    p.add_argument("--maxnreg", type=int, default=0, help="cap the registers a thread (ptxas maxnreg)")
    a = p.parse_args()
    schedules = gi.SCHEDULES if a.format == "iq3_s" else gq.SCHEDULES if a.format == "q6_k" else g.SCHEDULES
    for name in a.schedules.split(","):
        s = schedules[name]
        kernel, sig, const, hinted = build_args(a.format, s, a.conv, a.early)
        row = "row_bytes" if "row_bytes" in hinted else "row_quads"
        unhinted = tuple(h for h in hinted if h != row)
        builds = [("", hinted)] + ([(" unhinted", unhinted)] if a.unhinted else [])
        for label, hints in builds:
            c = compile_sm90(kernel, sig, const, hints, s.num_warps, 1, a.maxnreg)
            regs = re.search(r"REG:(\d+)", cuobjdump(c, "-res-usage")).group(1)
            mix = opcode_mix(body := loop_body(cuobjdump(c, "-sass")))
            print(f"{a.format}:{name}{label}: regs {regs} loop {len(body)} "
                  f"(LDG {mix['LDG']}, IDP {mix['IDP']}, local {mix.get('LDL', 0) + mix.get('STL', 0)}) "
                  f"BAR {mix.get('BAR', 0)} SHFL {mix.get('SHFL', 0)} LDS {mix.get('LDS', 0)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

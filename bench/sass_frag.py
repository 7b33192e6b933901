"""Compile fragment-GEMV schedules (ninfer/kernels/gemv_frag.py) for sm_90 without a GPU and print what their
super-block loop runs: registers, SASS instruction count and opcode mix (IMMA = the int8 mma.sync, HMMA the
q4_k / q5_k min term's tf32 one; no BAR / STS / LDS: the fragments never pass through shared memory).

    NINFER_TRITON_COMPILE_CHECK=1 python bench/sass_frag.py [--schedules A,B] [--format q4_k|q5_k|iq3_s|q6_k]
        [--dump] [--unhinted]   # --dump: the loop's SASS too; --unhinted: also the build for sizes that are
                                # not multiples of 16 (rows of 256·odd columns: K % 512 ≠ 0, e.g. 1280)
"""

from __future__ import annotations

import argparse
import os
import re

os.environ.setdefault("NINFER_TRITON_COMPILE_CHECK", "1")  # before ninfer imports triton_support

from sass_tools import compile_sm90, cuobjdump, loop_body, opcode_mix  # noqa: E402  (bench/ is sys.path[0])


def main() -> int:
    from ninfer.kernels import gemv_frag as f

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--schedules", default="frag_w1_r1_m8_s2,frag_w2_r1_m8_s8")
    p.add_argument("--format", default="q4_k")
    p.add_argument("--dump", action="store_true", help="also print the loop's SASS")
    p.add_argument("--maxnreg", type=int, default=0, help="cap the registers a thread (ptxas maxnreg)")
    p.add_argument("--unhinted", action="store_true",
                   help="also build with the row-length and scale-stride arguments not 16-divisible (Triton "
                        "specialises on that at run time: K = 256 · odd gets this build; q4_k / q5_k take "
                        "them in aligned units there)")
    a = p.parse_args()
    for name in a.schedules.split(","):
        s = f.SCHEDULES[name]
        y = "*fp32" if s.split_k > 1 or s.stream else "*bf16"
        const = dict(WARPS=s.num_warps, RT=s.row_tiles, NT=s.block_m // 8, SPLIT_K=s.split_k, EMULATE=False,
                     STREAM=s.stream > 0, FIXUP=s.split_k > 1 and not s.stream, PDL=3)  # wait, late release
        out = {"y_ptr": y, "o_ptr": "*bf16", "cnt_ptr": "*i32"}  # sums, output (split-K fixup), counters
        if a.format in ("iq3_s", "q6_k"):  # byte offsets into aligned words (2-byte-aligned blocks)
            sig = {"w_ptr": "*i32", "xw_ptr": "*i32", "xd_ptr": "*fp32", "grid_ptr": "*i16", **out,
                   "N": "i32", "K": "i32", "M": "i32", "row_bytes": "i32", "xd_blocks": "i32",
                   "stride_ym": "i32"}
            hinted = ("w_ptr", "xw_ptr", "xd_ptr", "grid_ptr", "y_ptr", "K", "xd_blocks", "stride_ym")
            kernel = f._gemv_frag_iq3_kernel
            if a.format == "q6_k":
                del sig["grid_ptr"]
                kernel = f._gemv_frag_q6k_kernel
            hinted = tuple(h for h in hinted if h in sig)
            const["WIDE"] = False
        else:
            sig = {"w_ptr": "*i32", "xw_ptr": "*i32", "xd_ptr": "*fp32", "xs_ptr": "*fp32", **out,
                   "N": "i32", "K": "i32", "M": "i32", "row_len": "i32", "xd_len": "i32", "stride_ym": "i32"}
            hinted = ("w_ptr", "xw_ptr", "xd_ptr", "xs_ptr", "y_ptr", "K", "row_len", "xd_len", "stride_ym")
            kernel = f._gemv_frag_kernel
            const["FMT"] = f._FMT[a.format]
            const["PREFETCH"] = s.prefetch
            const["UNITS"] = False
        # q4_k / q5_k: sizes in words (16-divisible) as the 27B's, else in aligned units (needs_units)
        builds = [("", hinted, {})]
        if a.unhinted:
            sized = ("row_len", "xd_len", "xd_blocks")
            builds.append((" unhinted", tuple(h for h in hinted if h not in sized),
                           {"UNITS": True} if kernel is f._gemv_frag_kernel else {}))
        for label, hints, units in builds:
            c = compile_sm90(kernel, sig, {**const, **units}, hints, s.num_warps, 1, a.maxnreg)
            regs = re.search(r"REG:(\d+)", cuobjdump(c, "-res-usage")).group(1)
            body = loop_body(cuobjdump(c, "-sass"))
            mix = opcode_mix(body)
            print(f"{a.format}:{name}{label}: regs {regs} loop {len(body)} {dict(mix.most_common(12))} "
                  f"(IMMA {mix['IMMA']}, HMMA {mix['HMMA']}, BAR {mix['BAR']}, STS {mix['STS']}, "
                  f"LDS {mix['LDS']}, local {mix['LDL'] + mix['STL']})")
            if a.dump:
                print("\n".join(body))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

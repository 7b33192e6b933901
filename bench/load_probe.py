"""How fast the H200 streams a q4_k weight under each lane map's load pattern alone (no decoding, no dots):
which pattern a decode GEMV can afford, measured apart from its arithmetic.

    python3 bench/load_probe.py [--rows 17408 --cols 5120] [--modes chunk,half,...] [--act]

Every program takes G rows (one per row group) and walks them NB blocks (144 bytes, q4_k) per step, XOR-ing
every loaded word into one int per lane (stored, so nothing is dropped). Modes, per block (words of 4 bytes;
"pair": the same-size layout whose unit of two blocks holds qs 0, qs 1, then the two 16-byte headers):

    chunk       4 lanes, lane c: qs words 8c..8c+3 and 8c+4..8c+7 (today's rows kernel), the 16-byte header
    half        4 lanes, lane c: qs words 4c..4c+3 and 16+4c..16+4c+3 (each load 64 contiguous bytes), header
    piece       8 lanes, lane p: qs words 4p..4p+3, header
    half_pair / piece_pair   the same on the pair layout (every qs run 32-byte aligned)
    flat        8 lanes reading 512 contiguous bytes of each 4-block step (the copy-like ideal)

`--act 1` adds the activation loads each lane map needs (int8 words and two fp32 scales per 32 codes, the
scales as 4 scalar loads), `--act 2` the same with the scales interleaved (one 16-byte load); `--tiles RxG`
holds R rows per lane in registers (one activation load serves them) over G row groups. Times are µs per
call inside one CUDA graph whose calls rotate over weight copies larger than 3× the L2.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.gpu_check import graph_us, weight_copies  # noqa: E402

MODES = {"chunk": (0, 4), "half": (1, 4), "piece": (2, 8), "half_pair": (3, 4), "piece_pair": (4, 8),
         "flat": (5, 8)}


@triton.jit
def _probe_kernel(w_ptr, x_ptr, xd_ptr, out_ptr, row_words, K, MODE: tl.constexpr, R: tl.constexpr,
                  G: tl.constexpr, NB: tl.constexpr, L: tl.constexpr, ACT: tl.constexpr,
                  SWEEP: tl.constexpr = False):
    # tile [row r (registers), row group g, block b, lane c, word e]; activation-side tensors carry no r axis
    r = tl.arange(0, R)[:, None, None, None, None]
    g = tl.arange(0, G)[None, :, None, None, None]
    b = tl.arange(0, NB)[None, None, :, None, None]
    c = tl.arange(0, L)[None, None, None, :, None]
    e = tl.arange(0, 4)[None, None, None, None, :]
    zw = r * 0 + g * 0 + b * 0 + c * 0 + e * 0
    zx = g * 0 + b * 0 + c * 0 + e * 0
    row = w_ptr + (tl.program_id(0) * (R * G) + r * G + g).to(tl.int64) * row_words
    if MODE == 0:
        q_at = b * 36 + 4 + 8 * c + e
        q2_at = q_at + 4
        h_at = b * 36 + e + c * 0
    elif MODE == 1:
        q_at = b * 36 + 4 + 4 * c + e
        q2_at = q_at + 16
        h_at = b * 36 + e + c * 0
    elif MODE == 2:
        q_at = b * 36 + 4 + 4 * c + e
        q2_at = q_at
        h_at = b * 36 + e + c * 0
    elif MODE == 3:
        q_at = (b // 2) * 72 + (b % 2) * 32 + 4 * c + e
        q2_at = q_at + 16
        h_at = (b // 2) * 72 + 64 + (b % 2) * 4 + e + c * 0
    elif MODE == 4:
        q_at = (b // 2) * 72 + (b % 2) * 32 + 4 * c + e
        q2_at = q_at
        h_at = (b // 2) * 72 + 64 + (b % 2) * 4 + e + c * 0
    else:
        q_at = (b * L + c) * 4 + e
        q2_at = q_at
        h_at = q_at
    acc = zw
    for step in range(0, K // 256 // NB):
        if SWEEP:  # step-major layout: step s of every program's rows is one contiguous run, program order
            run = (step * tl.num_programs(0) + tl.program_id(0)) * (R * G) + r * G + g
            wb = w_ptr + run.to(tl.int64) * (NB * 36)
        else:
            wb = row + step * NB * 36
        acc ^= tl.load(wb + q_at, eviction_policy="evict_first")
        if MODE < 2 or MODE == 3:
            acc ^= tl.load(wb + q2_at, eviction_policy="evict_first")
        if MODE != 5:
            acc ^= tl.load(wb + h_at, eviction_policy="evict_first")
        if ACT > 0:
            xb = x_ptr + (step * NB + b) * 64 + zx
            sub = (step * NB + b) * 8 + zx  # the block's first 32-code sub-block
            if L == 4:
                for k in tl.static_range(4):
                    acc ^= tl.load(xb + 16 * c + 4 * k + e)
                first = 2 * c
            else:
                x_at = 16 * (c // 2) + 4 * (c % 2) + e
                acc ^= tl.load(xb + x_at) ^ tl.load(xb + x_at + 8)
                first = 2 * (c // 2)
            if ACT == 1:  # d and d·Σq of the lane's two sub-blocks: 4 scalar loads, as gemv_rows reads them
                d_at = sub + first
                acc ^= tl.load(xd_ptr + d_at) ^ tl.load(xd_ptr + d_at + 1)
                acc ^= tl.load(xd_ptr + K // 32 + d_at) ^ tl.load(xd_ptr + K // 32 + d_at + 1)
            else:  # the same 4 values interleaved (d, s, d, s): one 16-byte load
                acc ^= tl.load(xd_ptr + 2 * (sub + first) + e)
    out = tl.reduce(tl.reduce(tl.reduce(tl.reduce(acc, 4, _xor), 3, _xor), 2, _xor), 0, _xor)
    tl.store(out_ptr + tl.program_id(0) * G + tl.arange(0, G), out)


@triton.jit
def _xor(a, b):
    return a ^ b


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=17408)
    ap.add_argument("--cols", type=int, default=5120)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--tiles", default="1x2,1x4,1x8",
                    help="RxG: R rows per lane (registers) × G row groups (warps = G·NB·L / 32)")
    ap.add_argument("--act", default="0,1", help="0 weights only, 1 + activation (scales as 4 scalar loads), "
                    "2 + activation (scales interleaved: one 16-byte load)")
    ap.add_argument("--sweep", default="0", help="0 rows as stored (each program walks its own rows), 1 a "
                    "step-major layout (step s of all programs' rows contiguous: programs sweep memory "
                    "together)")
    ap.add_argument("--ncu", action="store_true", help="launch each once between cudaProfilerStart/Stop")
    a = ap.parse_args()
    dev = torch.device("cuda")
    copies = weight_copies("q4_k", a.rows, a.cols, dev)
    words = [c.view(torch.int32) for c in copies]
    x = torch.randint(-2**31, 2**31 - 1, (a.cols // 4,), dtype=torch.int32, device=dev)
    xd = torch.randn(2 * a.cols // 32 + 16, device=dev).view(torch.int32)
    out = torch.empty(a.rows, dtype=torch.int32, device=dev)  # ≥ programs × G
    nbytes = copies[0].numel()
    table = []
    for name in a.modes.split(","):
        mode, lanes = MODES[name]
        sweeps = list(map(int, a.sweep.split(",")))
        for act, sweep in ((act, sweep) for act in map(int, a.act.split(",")) for sweep in sweeps):
            for R, G in (tuple(map(int, t.split("x"))) for t in a.tiles.split(",")):
                nb = 4
                warps = max(1, G * nb * lanes // 32)

                def call(w, mode=mode, lanes=lanes, act=act, R=R, G=G, nb=nb, warps=warps, sweep=sweep):
                    _probe_kernel[(a.rows // (R * G),)](w, x, xd, out, w.shape[1], a.cols, MODE=mode, R=R,
                                                        G=G, NB=nb, L=lanes, ACT=act, SWEEP=bool(sweep),
                                                        num_warps=warps)
                if a.ncu:
                    call(words[0])
                    torch.cuda.synchronize()
                    torch.cuda.profiler.start()
                    call(words[1])
                    torch.cuda.synchronize()
                    torch.cuda.profiler.stop()
                    continue
                us = graph_us([lambda w=w: call(w) for w in words])
                label = f"{name}{('', '+act', '+act4')[act]}{'+sweep' if sweep else ''} r{R} g{G} w{warps}"
                table.append((label, us, nbytes / us / 1e6))
                print(f"{label:28s} {us:7.2f} µs {nbytes / us / 1e6:5.2f} TB/s", flush=True)
    print("\nmode                          µs     TB/s (weight bytes / time)")
    for label, us, tbps in table:
        print(f"{label:28s} {us:7.2f} {tbps:6.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

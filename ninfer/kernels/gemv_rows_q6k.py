"""Decode GEMV for q6_k rows read contiguously ("rows"), int8 activations and `dp4a`: the output head of the
Qwen3.5 GGUFs (248,320 × 5,120 at the 27B) at one column, at 3.74 TB/s where the q8 GEMV's q6_k path (rows
across lanes) reaches 3.07 on the H200.

The lane map of `gemv_rows_iq.py` (8 lanes per block, a warp over NB consecutive blocks of one row, rows over
warps and registers; tile axes `[lane c, block b, row n, column m, word e]`) for q6_k's 210-byte blocks
(GGUF layout: ql[128] the codes' low 4 bits, qh[64] their high 2 bits, 16 int8 scales, fp16 d). Code
128h + 32j + l (half h, run j of 32, l < 32) has its low nibble in ql byte 64h + 32(j % 2) + l (nibble j // 2)
and its high bits in qh byte 128 + 32h + l (bits 2j, 2j + 1); its scale is byte 192 + 8h + 2j + (l ≥ 16).
Lane c = 4h + g takes l = 8g .. 8g + 7 of all four runs j of half h: two ql words from each of the two ql
runs, two qh words, the four scale bytes of its l range and d — 13 aligned int32 words read as three 4-word
loads and one word (blocks start 0 or 2 bytes into a word; NB is even, so a step keeps every thread's
alignment and the misaligned words are funnel-shifted by an amount fixed for the loop, as for iq3_s); the
activation words of each run as the aligned 16 bytes that hold the lane's 8 (lanes 2g, 2g + 1 share them). A
code word becomes four signed bytes q − 32 (with c = code ^ 0x20 per byte, c + 6·(c & 0x20) sign-extends bit
5) and one `dp4a` with the activation word; each run j sums 8 codes, so its scale and the activation's group
scale (32-code groups 8b + 4h + j) apply once per run. The oracle is `gemv_q8_reference` (float64).
"""

from __future__ import annotations

import os

import torch

from ninfer.kernels.gemv_q8 import EMULATE_DP4A, QuantizedActivation, dp4a
from ninfer.kernels.gemv_rows import RowsSchedule, rows_setup
from ninfer.kernels.gemv_rows_iq import _aligned_words
from ninfer.kernels.gguf_matmul import QuantKernelError, _f16_lo
from ninfer.kernels.triton_support import HAVE_TRITON, jit, pdl_options, pdl_release, pdl_start, tl, tl_sum
from ninfer.quant.formats import GGUF_PREFIX

ROWS_Q6K_FORMATS = ("q6_k",)


def _sched(block_n: int, blocks: int, num_warps: int, block_m: int = 1) -> RowsSchedule:
    name = f"rows_q6k_n{block_n}_m{block_m}_b{blocks}_w{num_warps}"
    return RowsSchedule(name, "rows_q6k", block_n, block_m, num_warps=num_warps, num_stages=1, blocks=blocks,
                        lanes="q6k")


# blocks × rows × 8 ≥ 32 · warps (else lanes repeat work); 1-4 columns a program
SCHEDULES: dict[str, RowsSchedule] = {s.name: s for s in (
    _sched(8, 4, 8), _sched(8, 4, 4), _sched(16, 4, 8), _sched(4, 4, 4), _sched(4, 4, 1), _sched(8, 4, 2),
    _sched(8, 4, 1), _sched(2, 4, 1),
    *(_sched(n, 4, w, m) for m in (2, 3, 4) for n, w in ((4, 1), (8, 2), (16, 4))),
    _sched(8, 4, 1, 2), _sched(8, 4, 1, 3), _sched(16, 4, 2, 4), _sched(32, 4, 4, 4),
)}
# The head at one column (H200 session 21 runs 4, 5; 248320×5120 in a CUDA graph over two copies: the q8
# GEMV 340 µs = 3.07 TB/s; n4_w1 279 (3.74 TB/s), n8_w2 282, n8_w1 298, n2_w1 294, n8_w4 307, n16_w8 307,
# n8_w8 387, n4_w4 398 µs; the 27B step on its own slot: Q4_K 5.557 -> 5.495 ms, IQ3_S 7.815 -> 7.757).
# At 2-4 columns (each program decoding its weights once for all of them; session 22 runs 1, 4):
# n4_m2_w1 320.0 µs (n16_m2_w4 327.8, n8_m2_w2 325.7), n4_m3_w1 387.5 (n16_m3_w4 400.9) and n16_m4_w2 448.7
# (8 rows a thread, 244 registers; n32_m4_w4 462.4, n8_m4_w2 502.9) where the fragment kernel's frag_w1_r2_m8
# takes 449.3, 461.2 and 461.9; at 8 columns the fragment kernel keeps the head (510.8 µs; this kernel at 8
# columns a program took 698.8 at best): the dp4a and scaling per column and row outweigh the shared decode.
HEAD_ROUTES = {1: "rows_q6k_n4_m1_b4_w1", 2: "rows_q6k_n4_m2_b4_w1", 3: "rows_q6k_n4_m3_b4_w1",
               4: "rows_q6k_n16_m4_b4_w2"}
HEAD_ROUTE = HEAD_ROUTES[1]


def rows_q6k_route(fmt: str, out_features: int, in_features: int, columns: int) -> RowsSchedule | None:
    """The q6_k rows schedule for a decode GEMV: the output head (≥ 65536 rows) at 1-4 columns, else None
    (the fragment kernel at 5-8 columns, the q8 GEMV elsewhere). NINFER_Q6K_ROWS: "0" none, "1" one column
    only (session 21's route), a schedule's name that one at its width (1-4)."""
    if fmt.removeprefix(GGUF_PREFIX) != "q6_k" or in_features % 1024 or out_features < 65536:
        return None
    asked = os.environ.get("NINFER_Q6K_ROWS", "")
    if asked == "0" or (asked == "1" and columns > 1):
        return None
    if asked in SCHEDULES and SCHEDULES[asked].block_m == columns:
        return SCHEDULES[asked]
    name = HEAD_ROUTES.get(columns)
    return SCHEDULES[name] if name else None


if HAVE_TRITON:
    from ninfer.kernels.gemv_rows import _ld, _pick, _step_range, _store, _tile_axes
    from ninfer.kernels.gemv_rows_iq import _shf

    @jit
    def _code_word(ql, qh, J: tl.constexpr):
        """Four codes of run J as signed bytes q − 32: the low nibbles (nibble J // 2 of the ql word) and
        bits 2J, 2J + 1 of the qh word moved to bits 4, 5."""
        lo = (ql >> (4 * (J // 2))) & 0x0F0F0F0F
        if J < 2:
            hi = (qh << (4 - 2 * J)) & 0x30303030
        else:
            hi = (qh >> (2 * J - 4)) & 0x30303030
        c = (lo | hi) ^ 0x20202020
        return c + 6 * (c & 0x20202020)

    @jit
    def _dot2(c0, c1, x, odd, e, zero, EMULATE: tl.constexpr):
        """Σ over 8 codes: code words c0, c1 with the activation words 0, 1 (or 2, 3 where `odd`) of the 4
        loaded."""
        x0 = tl.where(odd, _pick(x, e, 2), _pick(x, e, 0))
        x1 = tl.where(odd, _pick(x, e, 3), _pick(x, e, 1))
        return dp4a(c1, x1, dp4a(c0, x0, _pick(zero, e, 0), EMULATE), EMULATE)

    @jit
    def _column(acc, c0, c1, c2, c3, c4, c5, c6, c7, r0, r1, r2, r3, dw, xrow, drow, col, M, K, kb, ok, odd,
                e, zero, J: tl.constexpr, COLS: tl.constexpr, EVEN: tl.constexpr, EMULATE: tl.constexpr):
        """acc + the lane's sums over block kb for the program's column J (col + J, or the last column where
        that is past M): run j's code words c(2j), c(2j + 1) (shared by every column) against the column's
        activation words, times the run's int8 scale r_j, the activation's group scale and the block's d
        (dw). Unchanged where J ≥ COLS."""
        if J < COLS:
            mc = tl.minimum(col + J, M - 1).to(tl.int64)
            xb = xrow + mc * (K // 4) + kb * 64
            xd = _ld(drow + mc * (K // 32) + kb * 8, ok, EVEN)
            i0 = _dot2(c0, c1, _ld(xb, ok, EVEN), odd, e, zero, EMULATE)
            i1 = _dot2(c2, c3, _ld(xb + 8, ok, EVEN), odd, e, zero, EMULATE)
            i2 = _dot2(c4, c5, _ld(xb + 16, ok, EVEN), odd, e, zero, EMULATE)
            i3 = _dot2(c6, c7, _ld(xb + 24, ok, EVEN), odd, e, zero, EMULATE)
            sums = (r0 * i0).to(tl.float32) * _pick(xd, e, 0, -0.0)
            sums += (r1 * i1).to(tl.float32) * _pick(xd, e, 1, -0.0)
            sums += (r2 * i2).to(tl.float32) * _pick(xd, e, 2, -0.0)
            sums += (r3 * i3).to(tl.float32) * _pick(xd, e, 3, -0.0)
            acc += dw * sums
        return acc

    @jit
    def _store_column(y_ptr, acc, col, M, N, stride_ym, BLOCK_N: tl.constexpr, SPLIT_K: tl.constexpr,
                      J: tl.constexpr, COLS: tl.constexpr):
        """The program's sums of column col + J (none past M, none where J ≥ COLS)."""
        if J < COLS:
            no = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)[:, None]
            _store(y_ptr, tl_sum(tl_sum(acc, 0), 0), col + J + no * 0, no, M, N, stride_ym, SPLIT_K)

    @jit
    def _gemv_rows_q6k_kernel(w_ptr, xw_ptr, xd_ptr, y_ptr, N, K, M, row_bytes, stride_ym,
                              BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, NB: tl.constexpr,
                              SPLIT_K: tl.constexpr, EVEN: tl.constexpr, EMULATE: tl.constexpr,
                              PDL: tl.constexpr = 0):
        """BLOCK_M (1-4) columns a program, each its own accumulator over tiles without a column axis (the
        one-column layout), so the weights are loaded and decoded once for all of them."""
        pdl_start(PDL)
        c, b, n, m, e = _tile_axes(BLOCK_N, 1, NB)
        zero = (m * 0) + (n * 0) + (b * 0) + (c * 0) + (e * 0)  # int32 zeros at the full tile shape
        col = tl.program_id(1) * BLOCK_M  # the program's first column
        h = c // 4
        g = c % 4
        nblk = K // 256
        s0, s1 = _step_range(K, NB, SPLIT_K)
        # the thread's block start (bytes) in the first step; rows past the end read the last one
        start = tl.minimum(n, N - 1).to(tl.int64) * row_bytes + 210 * (b % 2) + zero
        base = w_ptr + (start >> 2)
        # words [ql run 2h: 0-2, d], [ql run 2h + 1: 0-2, qh 0], [qh 1-2, scales 0-1], [scales 2]
        wa = base + tl.where(e < 3, 16 * h + 2 * g + e, 52)
        wb = base + tl.where(e < 3, 16 * h + 8 + 2 * g + e, 32 + 8 * h + 2 * g)
        wc = base + tl.where(e < 2, 32 + 8 * h + 2 * g + 1 + e, 48 + 2 * h + e - 2)
        wd = base + 48 + 2 * h + 2 + e * 0
        sh = _pick(((start & 3) * 8).to(tl.int32), e, 0)  # 0 or 16, the same in every step (NB even)
        gg = _pick(g // 2 + zero, e, 0)  # the lane's scale byte in each pair: l ≥ 16
        k0 = 24 - 8 * gg
        # activation words 2g, 2g + 1 of run j at 32h + 8j: read as the aligned 4 words that hold them (a
        # 16-byte load; a narrower one would split the word axis over lanes and shuffle every pick)
        xrow = xw_ptr + 32 * h + 4 * (g // 2) + e + zero
        odd = _pick(g % 2 + zero, e, 0) == 1
        drow = xd_ptr + 4 * h + e + zero  # the 4 runs' activation group scales
        acc0 = tl.zeros([8, NB, BLOCK_N, 1], dtype=tl.float32)
        acc1 = acc0
        acc2 = acc0
        acc3 = acc0
        for step in range(s0, s1):
            blk = step * NB
            ok = ((blk + b) < nblk) & (zero == 0)  # unused where EVEN (whole steps of NB blocks)
            words = ((blk + b) >> 1) * 105  # per thread (b // 2 pairs of blocks further)
            la = _ld(wa + words, ok, EVEN)
            lb = _ld(wb + words, ok, EVEN)
            lc = _ld(wc + words, ok, EVEN)
            s2 = _pick(_ld(wd + words, ok, EVEN), e, 0)
            qa0 = _shf(_pick(la, e, 0), _pick(la, e, 1), sh, EMULATE)
            qa1 = _shf(_pick(la, e, 1), _pick(la, e, 2), sh, EMULATE)
            qb0 = _shf(_pick(lb, e, 0), _pick(lb, e, 1), sh, EMULATE)
            qb1 = _shf(_pick(lb, e, 1), _pick(lb, e, 2), sh, EMULATE)
            qh0 = _shf(_pick(lb, e, 3), _pick(lc, e, 0), sh, EMULATE)
            qh1 = _shf(_pick(lc, e, 0), _pick(lc, e, 1), sh, EMULATE)
            sc01 = _shf(_pick(lc, e, 2), _pick(lc, e, 3), sh, EMULATE)  # scale bytes 0-3 (runs 0, 1)
            sc23 = _shf(_pick(lc, e, 3), s2, sh, EMULATE)  # bytes 4-7 (runs 2, 3)
            c0 = _code_word(qa0, qh0, 0)
            c1 = _code_word(qa1, qh1, 0)
            c2 = _code_word(qb0, qh0, 1)
            c3 = _code_word(qb1, qh1, 1)
            c4 = _code_word(qa0, qh0, 2)
            c5 = _code_word(qa1, qh1, 2)
            c6 = _code_word(qb0, qh0, 3)
            c7 = _code_word(qb1, qh1, 3)
            # int8 scale of run j: byte 2j + gg, sign-extended; the block's d
            r0 = (sc01 << k0) >> 24
            r1 = (sc01 << (k0 - 16)) >> 24
            r2 = (sc23 << k0) >> 24
            r3 = (sc23 << (k0 - 16)) >> 24
            dw = _f16_lo(_pick(la, e, 3) >> sh)
            acc0 = _column(acc0, c0, c1, c2, c3, c4, c5, c6, c7, r0, r1, r2, r3, dw, xrow, drow, col, M,
                           K, blk + b, ok, odd, e, zero, 0, BLOCK_M, EVEN, EMULATE)
            acc1 = _column(acc1, c0, c1, c2, c3, c4, c5, c6, c7, r0, r1, r2, r3, dw, xrow, drow, col, M,
                           K, blk + b, ok, odd, e, zero, 1, BLOCK_M, EVEN, EMULATE)
            acc2 = _column(acc2, c0, c1, c2, c3, c4, c5, c6, c7, r0, r1, r2, r3, dw, xrow, drow, col, M,
                           K, blk + b, ok, odd, e, zero, 2, BLOCK_M, EVEN, EMULATE)
            acc3 = _column(acc3, c0, c1, c2, c3, c4, c5, c6, c7, r0, r1, r2, r3, dw, xrow, drow, col, M,
                           K, blk + b, ok, odd, e, zero, 3, BLOCK_M, EVEN, EMULATE)
        pdl_release(PDL)
        _store_column(y_ptr, acc0, col, M, N, stride_ym, BLOCK_N, SPLIT_K, 0, BLOCK_M)
        _store_column(y_ptr, acc1, col, M, N, stride_ym, BLOCK_N, SPLIT_K, 1, BLOCK_M)
        _store_column(y_ptr, acc2, col, M, N, stride_ym, BLOCK_N, SPLIT_K, 2, BLOCK_M)
        _store_column(y_ptr, acc3, col, M, N, stride_ym, BLOCK_N, SPLIT_K, 3, BLOCK_M)


def gemv_rows_q6k(raw: torch.Tensor, format: str, xa: QuantizedActivation, out_features: int,
                  schedule: RowsSchedule | str, conv=None) -> torch.Tensor:
    """`(q·d) @ Wᵀ -> [n, out_features]` in `xa.dtype`, W the q6_k GGUF rows `raw` (uint8 `[N, row_bytes]`)
    and xa the int8 activation; the kernel runs on `raw`'s device (CUDA, or CPU under the interpreter).
    `conv` must be None (no GDN conv epilogue here)."""
    format = format.removeprefix(GGUF_PREFIX)
    s = SCHEDULES[schedule] if isinstance(schedule, str) else schedule
    if conv is not None:
        raise QuantKernelError(f"schedule {s.name} runs no GDN conv epilogue")
    n, k = xa.q.shape
    y, launch, extra = rows_setup(raw, format, xa, out_features, s, ROWS_Q6K_FORMATS, "rows q6_k GEMV")
    if s.blocks % 2:
        raise QuantKernelError(f"schedule {s.name} steps over {s.blocks} blocks; the q6_k rows GEMV needs an "
                               "even number")
    _gemv_rows_q6k_kernel[launch](_aligned_words(raw), xa.words, xa.d, y, out_features, k, n, raw.shape[1],
                                  y.stride(0), BLOCK_N=s.block_n, BLOCK_M=s.block_m, NB=s.blocks,
                                  SPLIT_K=s.split_k, EVEN=k // 256 % s.blocks == 0, EMULATE=EMULATE_DP4A,
                                  **extra, **pdl_options(raw, trigger=False))
    return y.to(xa.dtype)

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


def _sched(block_n: int, blocks: int, num_warps: int) -> RowsSchedule:
    return RowsSchedule(f"rows_q6k_n{block_n}_m1_b{blocks}_w{num_warps}", "rows_q6k", block_n, 1,
                        num_warps=num_warps, num_stages=1, blocks=blocks, lanes="q6k")


# one column; blocks × rows × 8 ≥ 32 · warps (else lanes repeat work)
SCHEDULES: dict[str, RowsSchedule] = {s.name: s for s in (
    _sched(8, 4, 8), _sched(8, 4, 4), _sched(16, 4, 8), _sched(4, 4, 4), _sched(4, 4, 1), _sched(8, 4, 2),
    _sched(8, 4, 1), _sched(2, 4, 1),
)}
# The head at one column (H200 session 21 runs 4, 5; 248320×5120 in a CUDA graph over two copies: the q8
# GEMV 340 µs = 3.07 TB/s; n4_w1 279 (3.74 TB/s), n8_w2 282, n8_w1 298, n2_w1 294, n8_w4 307, n16_w8 307,
# n8_w8 387, n4_w4 398 µs; the 27B step on its own slot: Q4_K 5.557 -> 5.495 ms, IQ3_S 7.815 -> 7.757).
# NINFER_Q6K_ROWS=0 leaves the head to the q8 GEMV; a schedule's name runs that one instead.
HEAD_ROUTE = "rows_q6k_n4_m1_b4_w1"


def rows_q6k_route(fmt: str, out_features: int, in_features: int, columns: int) -> RowsSchedule | None:
    """The q6_k rows schedule for a decode GEMV: the output head (≥ 65536 rows) at one column, unless
    NINFER_Q6K_ROWS=0; else None (the q8 GEMV)."""
    asked = os.environ.get("NINFER_Q6K_ROWS", "1")
    if (fmt.removeprefix(GGUF_PREFIX) != "q6_k" or columns != 1 or in_features % 1024
            or out_features < 65536 or asked == "0"):
        return None
    return SCHEDULES[HEAD_ROUTE if asked == "1" else asked]


if HAVE_TRITON:
    from ninfer.kernels.gemv_rows import _ld, _pick, _step_range, _store_rows, _tile_axes
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
    def _run_dot(ql0, ql1, qh0, qh1, x, odd, e, zero, J: tl.constexpr, EMULATE: tl.constexpr):
        """Σ (q − 32)·x over the lane's 8 codes of run J: code words from ql0 / qh0 and ql1 / qh1, the
        activation words 0, 1 (or 2, 3 where `odd`) of the 4 loaded."""
        x0 = tl.where(odd, _pick(x, e, 2), _pick(x, e, 0))
        x1 = tl.where(odd, _pick(x, e, 3), _pick(x, e, 1))
        acc = dp4a(_code_word(ql0, qh0, J), x0, _pick(zero, e, 0), EMULATE)
        return dp4a(_code_word(ql1, qh1, J), x1, acc, EMULATE)

    @jit
    def _gemv_rows_q6k_kernel(w_ptr, xw_ptr, xd_ptr, y_ptr, N, K, M, row_bytes, stride_ym,
                              BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, NB: tl.constexpr,
                              SPLIT_K: tl.constexpr, EVEN: tl.constexpr, EMULATE: tl.constexpr,
                              PDL: tl.constexpr = 0):
        pdl_start(PDL)
        c, b, n, m, e = _tile_axes(BLOCK_N, BLOCK_M, NB)
        zero = (m * 0) + (n * 0) + (b * 0) + (c * 0) + (e * 0)  # int32 zeros at the full tile shape
        h = c // 4
        g = c % 4
        nblk = K // 256
        s0, s1 = _step_range(K, NB, SPLIT_K)
        # the thread's block start (bytes) in the first step; rows and columns past the end read the last one
        start = tl.minimum(n, N - 1).to(tl.int64) * row_bytes + 210 * (b % 2) + zero
        base = w_ptr + (start >> 2)
        # words [ql run 2h: 0-2, d], [ql run 2h + 1: 0-2, qh 0], [qh 1-2, scales 0-1], [scales 2]
        wa = base + tl.where(e < 3, 16 * h + 2 * g + e, 52)
        wb = base + tl.where(e < 3, 16 * h + 8 + 2 * g + e, 32 + 8 * h + 2 * g)
        wc = base + tl.where(e < 2, 32 + 8 * h + 2 * g + 1 + e, 48 + 2 * h + e - 2)
        wd = base + 48 + 2 * h + 2 + e * 0
        sh = _pick(((start & 3) * 8).to(tl.int32), e, 0)  # 0 or 16, the same in every step (NB even)
        gg = _pick(g // 2 + zero, e, 0)  # the lane's scale byte in each pair: l ≥ 16
        mc = tl.minimum(m, M - 1).to(tl.int64)
        # activation words 2g, 2g + 1 of run j at 32h + 8j: read as the aligned 4 words that hold them (a
        # 16-byte load; a narrower one would split the word axis over lanes and shuffle every pick)
        xrow = xw_ptr + mc * (K // 4) + 32 * h + 4 * (g // 2) + e + zero
        odd = _pick(g % 2 + zero, e, 0) == 1
        drow = xd_ptr + mc * (K // 32) + 4 * h + e + zero  # the 4 runs' activation group scales
        acc = tl.zeros([8, NB, BLOCK_N, BLOCK_M], dtype=tl.float32)
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
            xb = xrow + (blk + b) * 64
            i0 = _run_dot(qa0, qa1, qh0, qh1, _ld(xb, ok, EVEN), odd, e, zero, 0, EMULATE)
            i1 = _run_dot(qb0, qb1, qh0, qh1, _ld(xb + 8, ok, EVEN), odd, e, zero, 1, EMULATE)
            i2 = _run_dot(qa0, qa1, qh0, qh1, _ld(xb + 16, ok, EVEN), odd, e, zero, 2, EMULATE)
            i3 = _run_dot(qb0, qb1, qh0, qh1, _ld(xb + 24, ok, EVEN), odd, e, zero, 3, EMULATE)
            # int8 scale of run j: byte 2j + gg, sign-extended
            k0 = 24 - 8 * gg
            part = ((sc01 << k0) >> 24) * i0
            xd = _ld(drow + (blk + b) * 8, ok, EVEN)
            sums = part.to(tl.float32) * _pick(xd, e, 0, -0.0)
            sums += (((sc01 << (k0 - 16)) >> 24) * i1).to(tl.float32) * _pick(xd, e, 1, -0.0)
            sums += (((sc23 << k0) >> 24) * i2).to(tl.float32) * _pick(xd, e, 2, -0.0)
            sums += (((sc23 << (k0 - 16)) >> 24) * i3).to(tl.float32) * _pick(xd, e, 3, -0.0)
            acc += _f16_lo(_pick(la, e, 3) >> sh) * sums
        pdl_release(PDL)
        _store_rows(y_ptr, tl_sum(tl_sum(acc, 0), 0), M, N, stride_ym, BLOCK_N, BLOCK_M, SPLIT_K)


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

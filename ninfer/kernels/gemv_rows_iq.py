"""Decode GEMV whose warps read weight rows contiguously ("rows"), int8 activations and `dp4a`, for the
i-quants iq3_s and iq4_xs.

The design of `gemv_rows.py` (q4_k / q5_k) for the i-quant: a thread takes one 32-weight sub-block c of
block b of row n, so 8 lanes cover a block and a warp covers NB consecutive blocks of one row; rows wrap over
warps and registers. Tile axes `[sub-block c, block b, row n, column m, word e]` (lane axes first, see
`gemv_rows._tile_axes`), every load built at the full 5-d shape (zero strides where a value does not depend on
an axis) so that all values share one register layout and no layout conversion runs in the loop.

iq3_s blocks are 110 bytes, so a block starts 0 or 2 bytes into an int32 word; the tensor is read as aligned
int32 words (two 4-word loads per thread and step: qs words 0-2 and d; sign words 0-1, the qh word and the
scale word) and the misaligned ones are funnel-shifted by a per-thread amount that is fixed for the whole
loop (NB is even, so a step moves by a multiple of 4 bytes). The grid index of word j is one `prmt` of a qs
word and the spread qh bits (its top bytes zero by sign-replicating a byte below 0x80); the grid word is a
2-byte load of the packed 1 KB grid (`iq3s_grid16`) through L1. Signs: the byte of 8 sign bits times
0x80402010 (low nibble) or 0x08040201 (high nibble) puts sign bit k at the top bit of byte 3 − k, and a
sign-replicating `prmt` makes the byte mask M; σ·g = g ^ (M & 0xFEFEFEFE) (the magnitudes are odd, and an
odd byte xor 0xFE is its negation), one dp4a a word and column. Schedules "_sg" instead look up a 32 KB signed
grid (every grid word under all 16 sign patterns), indexed by the same `prmt` with the sign nibble beside the
qh bit: fewer instructions, a 16× larger table in L1 (lost on the H200: 47.9 vs 37.3 µs at 1 column in
session 3, 39.6 vs 27.1 in session 7).

iq4_xs blocks are 136 bytes (always 8-byte aligned): int64 loads, the levels by three `prmt`s per 4 codes as
in `gemv_q8_iq.py`. The kernels' oracle is `gemv_q8_reference` (dequantised weight × dequantised int8
activation, float64).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ninfer.kernels.gdn_decode import ConvEpilogue
from ninfer.kernels.gemv_q8 import EMULATE_DP4A, QuantizedActivation, dp4a
from ninfer.kernels.gemv_rows import (
    RowsSchedule,
    conv_arguments,
    conv_early,
    rows_setup,
    shape_class,
    split_target,
    split_work,
    takes_conv,
    width_slot,
)
from ninfer.kernels.gguf_matmul import QuantKernelError, _f16_lo, iq3s_grid16, iq3s_grid_word
from ninfer.kernels.triton_support import HAVE_TRITON, jit, pdl_options, pdl_release, pdl_start, tl, tl_sum
from ninfer.quant.formats import GGUF_PREFIX
from ninfer.quant.tables import IQ4_LEVELS

IQ_ROWS_FORMATS = ("iq3_s", "iq4_xs")
MAX_COLUMNS = 8
# iq4_xs levels as int8 bytes in 4 little-endian int32 words (the prmt tables of levels 0-7 and 8-15)
_IQ4_WORDS = tuple(torch.tensor(IQ4_LEVELS.tolist(), dtype=torch.int8).view(torch.int32).tolist())


@dataclass(frozen=True)
class RowsIqSchedule(RowsSchedule):
    """`block_n` rows × `block_m` columns per program, `blocks` consecutive blocks of each row per loop step
    (8 lanes per block; iq3_s: even, so that a step keeps every thread's word alignment), split-K over the
    steps. `signed_grid` (iq3_s): look the signs up with the grid (one 32 KB table of all 16 sign patterns per
    grid word) instead of applying them with integer instructions."""

    signed_grid: bool = False


def _sched(block_n: int, block_m: int, blocks: int, num_warps: int, split_k: int = 1,
           signed_grid: bool = False) -> RowsIqSchedule:
    name = (f"rows_iq_n{block_n}_m{block_m}_b{blocks}_w{num_warps}" + (f"_s{split_k}" if split_k > 1 else "")
            + ("_sg" if signed_grid else ""))
    return RowsIqSchedule(name, "rows_iq", block_n, block_m, split_k=split_k, num_warps=num_warps,
                          num_stages=1, blocks=blocks, signed_grid=signed_grid)


# (block_n, block_m, blocks, num_warps, split_k); blocks × rows × 8 should be ≥ 32 · warps or lanes repeat
# work. b4: a warp spans 4 blocks of 1 row. Each tile with the plain grid and with the signed grid ("_sg").
_TILES = (
    (4, 1, 4, 4, 1), (8, 1, 4, 4, 1), (8, 1, 4, 8, 1), (2, 1, 4, 2, 1), (2, 1, 8, 4, 1),
    (4, 1, 4, 4, 2), (2, 1, 4, 2, 4), (2, 1, 2, 1, 4),
    # several columns (each sub-block decoded once for all of them)
    (4, 2, 4, 4, 1), (2, 2, 4, 2, 4), (4, 4, 4, 4, 1), (2, 4, 4, 2, 4), (4, 8, 4, 4, 1), (2, 8, 4, 2, 4),
    (8, 2, 4, 4, 1), (8, 4, 4, 4, 1), (2, 4, 8, 4, 1), (2, 8, 8, 4, 1), (4, 4, 4, 4, 2),
    (16, 1, 4, 4, 1), (16, 1, 4, 8, 1), (8, 1, 4, 2, 1), (4, 1, 4, 1, 1), (16, 2, 4, 8, 1), (8, 4, 4, 2, 1),
    # split-K with the one-launch fixup (`gemv_rows._store_split`): more programs for the 5120-row matrices
    *((n, 1, 4, w, k) for n, w in ((8, 4), (8, 8), (4, 1)) for k in (2, 3, 4)),
)
SCHEDULES: dict[str, RowsIqSchedule] = {
    s.name: s for tile in _TILES for signed in (False, True) for s in [_sched(*tile, signed_grid=signed)]
}


# shape class (gemv_rows.shape_class) -> the iq3_s schedule for 1, 2, 3-4 and 5-8 columns (None: the tile's)
_ROUTE = {"small": ("rows_iq_n2_m1_b8_w4", "rows_iq_n4_m2_b4_w4", "rows_iq_n2_m4_b8_w4",
                    "rows_iq_n4_m8_b4_w4"),
          "long": ("rows_iq_n8_m1_b4_w4", "rows_iq_n8_m2_b4_w4", "rows_iq_n8_m4_b4_w2", None),
          "wide": ("rows_iq_n8_m1_b4_w4", "rows_iq_n8_m2_b4_w4", "rows_iq_n8_m4_b4_w2", None),
          "mid": ("rows_iq_n8_m1_b4_w4", "rows_iq_n8_m2_b4_w4", "rows_iq_n8_m4_b4_w2", None)}


# (out, in) of the 27B step's merged matrices -> the schedule for 1, 2, 3-4 and 5-8 columns where it differs
# from the shape class's (H200 session 15 run 1, µs at 1 column): MLP gate|up 34816×5120 44.0 vs 45.0, GDN
# q|k|v|z|a|b 16480×5120 22.1 vs 24.3, MLP down 5120×17408 26.1 vs 27.0
# (2 columns: the class's won everywhere)
_EXACT = {
    (34816, 5120): ("rows_iq_n4_m1_b4_w1", *_ROUTE["wide"][1:]),
    (16480, 5120): ("rows_iq_n4_m1_b4_w1", *_ROUTE["wide"][1:]),
    (5120, 17408): ("rows_iq_n8_m1_b4_w8", *_ROUTE["long"][1:]),
}


def rows_iq_route(fmt: str, out_features: int, in_features: int, columns: int) -> RowsIqSchedule | None:
    """The iq3_s rows schedule for a decode GEMV of `columns` columns, None where the tensor-core tile
    (gemv_mma) is faster or nothing was measured (iq4_xs). H200, the 27B shapes after the lane-axes-first
    tiles (bench/rows_timing.py, session 7 run 3, µs): 1 column 25.6 (17408×5120), 27.3 (5120×17408), 17.2
    (10240), 19.3 (12288), 10.3 (6144), 4.6 (1024 rows); 2 columns 29.0, 28.9, 18.2, 22.2, 14.6; 4 columns
    (run 6: 4 rows per lane over two warps) 34.0, 37.1, 22.6, 24.1, 13.3 (the tile: 59.5, 77.7, 35.4, 42.0,
    26.7); 8 columns the tile wins (63.3 vs 71.0 on 17408×5120) except on ≤ 1024 rows (7.8 vs 11.1)."""
    fmt = fmt.removeprefix(GGUF_PREFIX)
    if fmt != "iq3_s" or in_features % 256 or not 1 <= columns <= MAX_COLUMNS:
        return None
    routes = _EXACT.get((out_features, in_features)) or _ROUTE[shape_class(out_features, in_features)]
    name = routes[width_slot(columns)]
    return SCHEDULES[name] if name else None


if HAVE_TRITON:
    from ninfer.kernels.gdn_decode import conv_epilogue_load, conv_epilogue_store
    from ninfer.kernels.gemv_q8_iq import prmt
    from ninfer.kernels.gemv_rows import _ld, _pick, _step_range, _store_rows, _tile_axes

    @jit
    def _shf(lo, hi, sh, EMULATE: tl.constexpr):
        """The int32 word `sh` (0 or 16) bits into the pair (lo, hi): PTX `shf.r.clamp`, one instruction."""
        if EMULATE:
            return tl.where(sh == 0, lo, ((lo >> 16) & 0xFFFF) | (hi << 16))
        else:
            return tl.inline_asm_elementwise("shf.r.clamp.b32 $0, $1, $2, $3;", "=r,r,r,r", [lo, hi, sh],
                                             dtype=tl.int32, is_pure=True, pack=1)

    @jit
    def _iq3_s_half(qw, hw, sg, x, grid_ptr, e, zero, H: tl.constexpr, EMULATE: tl.constexpr):
        """Σ dp4a(σ·g, x) over grid words 4H..4H+3 of each thread's sub-block: qw holds their 4 qs bytes, hw
        their 4 qh bits (one per byte), sg the sub-block's 32 sign bits, x `[..., 4]` the activation words;
        the signed word σ·g = g ^ (M & 0xFEFEFEFE), M the sign bytes' mask (the grid's magnitudes are odd, and
        an odd byte xor 0xFE is its negation), made once for every column."""
        # grid index: qs byte e, qh byte e, then two zero bytes (the sign of hw's byte 0, which is 0 or 1)
        idx = prmt(qw[:, :, :, :, None] + zero, hw[:, :, :, :, None] + zero, 0xCC40 + 0x11 * e, EMULATE)
        g = iq3s_grid_word(grid_ptr, idx)
        # the 8 sign bits of words 2j', 2j' + 1 (byte j' = 2H + e // 2), spread to the bytes' top bits
        byte = prmt(sg[:, :, :, :, None] + zero, zero, 0x4440 + 2 * H + e // 2, EMULATE)
        spread = byte * tl.where(e % 2 == 0, -0x7FBFDFF0, 0x08040201)  # 0x80402010 as int32
        m = prmt(spread, zero, 0x89AB + zero, EMULATE)  # byte k: sign bit k of the word as 0x00 / 0xFF
        gm = g ^ (m & -0x01010102)  # 0xFEFEFEFE as int32
        acc = dp4a(_pick(gm, e, 0), _pick(x, e, 0), _pick(zero, e, 0), EMULATE)
        for i in tl.static_range(1, 4):
            acc = dp4a(_pick(gm, e, i), _pick(x, e, i), acc, EMULATE)
        return acc

    @jit
    def _iq3_s_half_signed(qw, tw, x, grid_ptr, e, zero, EMULATE: tl.constexpr):
        """Σ dp4a(signed grid word, x) over grid words 4H..4H+3 of each thread's sub-block: qw holds their 4
        qs bytes, tw per byte their qh bit (bit 0) and 4 sign bits (bits 1-4), x `[..., 4]` the activation
        words; the signed grid's 8192 words are indexed by qs byte | qh bit << 8 | signs << 9."""
        idx = prmt(qw[:, :, :, :, None] + zero, tw[:, :, :, :, None] + zero, 0xCC40 + 0x11 * e, EMULATE)
        g = tl.load(grid_ptr + idx.to(tl.uint32))
        acc = dp4a(_pick(g, e, 0), _pick(x, e, 0), _pick(zero, e, 0), EMULATE)
        for i in tl.static_range(1, 4):
            acc = dp4a(_pick(g, e, i), _pick(x, e, i), acc, EMULATE)
        return acc

    @jit
    def _sign_nibbles(sg, qh_bits, SEL: tl.constexpr, EMULATE: tl.constexpr):
        """qh_bits | (sign nibble k << 1) in byte k, the nibbles of sign bytes SEL & 7 (low and high nibble
        to bytes 0, 1) and (SEL >> 8) & 7 (to bytes 2, 3)."""
        p = prmt(sg, sg * 0, SEL + sg * 0, EMULATE)  # [sign byte, 0, sign byte, 0]
        return (((p << 1) | (p << 5)) & 0x1E1E1E1E) | qh_bits

    @jit
    def _gemv_rows_iq3_kernel(w_ptr, xw_ptr, xd_ptr, grid_ptr, y_ptr, N, K, M, row_bytes, stride_ym, cw_ptr,
                              cs_ptr, slot_ptr, co_ptr, C, s_cs, o_ptr, cnt_ptr, BLOCK_N: tl.constexpr,
                              BLOCK_M: tl.constexpr, NB: tl.constexpr, SPLIT_K: tl.constexpr,
                              EVEN: tl.constexpr, SIGNED: tl.constexpr, EMULATE: tl.constexpr,
                              PADDED: tl.constexpr = False, CONV: tl.constexpr = False,
                              CONV_EARLY: tl.constexpr = False, FIXUP: tl.constexpr = False,
                              PDL: tl.constexpr = 0):
        """PADDED: the 112-byte aligned blocks of `iq3_s_padded` (qs, signs, qh, scales, d, 2 zero bytes).
        CONV: the GDN decode conv of the first C rows in the epilogue (`gdn_decode.ConvEpilogue`);
        CONV_EARLY: its operands loaded before the wait. FIXUP: split-K's one-launch fixup
        (`gemv_rows._store_split`)."""
        no = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)[:, None]
        mo = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)[None, :]
        if CONV and CONV_EARLY:
            cp, cs0, cs1, cs2, cw0, cw1, cw2, cw3 = conv_epilogue_load(mo, no, M, N, cw_ptr, cs_ptr, slot_ptr,
                                                                       C, s_cs)
        pdl_start(PDL)
        BB: tl.constexpr = 112 if PADDED else 110  # bytes per block
        c, b, n, m, e = _tile_axes(BLOCK_N, BLOCK_M, NB)
        zero = (m * 0) + (n * 0) + (b * 0) + (c * 0) + (e * 0)  # int32 zeros at the full tile shape
        nblk = K // 256
        s0, s1 = _step_range(K, NB, SPLIT_K)
        # the thread's block start (bytes) in the first step; rows and columns past the end read the last one
        start = tl.minimum(n, N - 1).to(tl.int64) * row_bytes + BB * (b % 2) + zero
        if PADDED:  # [qs 2c, 2c + 1, signs c, signs c] and [qh 0-3, qh 4-7, scales, d], all aligned
            wa = w_ptr + (start >> 2) + tl.where(e < 2, 2 * c + e, 16 + c)
            wb = w_ptr + (start >> 2) + 24 + e
        else:
            # bytes of the two weight loads: [qs 0-3, 4-7, 8-11, d] and [signs 0-3, 4-7, qh, scales]
            # (consecutive words as constant offsets from one word: one address computation for the run)
            wa = w_ptr + tl.where(e < 3, ((start + 2 + 8 * c) >> 2) + e, start >> 2)
            wb = w_ptr + tl.where(e < 2, ((start + 74 + 4 * c) >> 2) + e,
                                  tl.where(e == 2, (start + 66 + c) >> 2, (start + 106 + c // 2) >> 2))
        # bit offsets inside the aligned words, the same in every step (NB even: steps of 4-byte multiples)
        lead = (start & 3).to(tl.int32)
        sh_q = _pick(((lead + 2) & 3) * 8, e, 0)  # qs and signs start 2 bytes after d
        sh_d = _pick(lead * 8, e, 0)
        sh_s = _pick(((lead + 2 + c // 2) & 3) * 8 + 4 * (c % 2), e, 0)  # scale nibble of byte 106 + c // 2
        cc = _pick(c + zero, e, 0)
        if PADDED:  # prmt selector of qh byte c (byte c % 4 of word c // 4), zero-extended
            sel_h = 0x4440 + (cc & 3)
        else:  # of qh byte 66 + c
            sel_h = _pick(0x4440 + ((lead + 2 + c) & 3), e, 0)
        mc = tl.minimum(m, M - 1).to(tl.int64)
        xrow = xw_ptr + mc * (K // 4) + 8 * c + e + zero
        # a column's sub-block scales are contiguous along c: hidden from Triton's contiguity analysis, which
        # would otherwise lay that load out along c and convert it through shared memory in the loop
        drow = xd_ptr + mc * (K // 32) + tl.where(c < 8, c, 0) + zero
        acc = tl.zeros([8, NB, BLOCK_N, BLOCK_M], dtype=tl.float32)
        for step in range(s0, s1):
            blk = step * NB
            ok = ((blk + b) < nblk) & (zero == 0)  # unused where EVEN (whole steps of NB blocks)
            # per thread (b // 2 pairs of blocks further), so that one IMAD.WIDE makes each address
            words = ((blk + b) >> 1) * (2 * BB // 4)
            ha = _ld(wa + words, ok, EVEN)
            hb = _ld(wb + words, ok, EVEN)
            if PADDED:
                q0 = _pick(ha, e, 0)
                q1 = _pick(ha, e, 1)
                sg = _pick(ha, e, 2)
                qh = prmt(tl.where(cc < 4, _pick(hb, e, 0), _pick(hb, e, 1)), sh_q * 0, sel_h, EMULATE)
            else:
                q0 = _shf(_pick(ha, e, 0), _pick(ha, e, 1), sh_q, EMULATE)
                q1 = _shf(_pick(ha, e, 1), _pick(ha, e, 2), sh_q, EMULATE)
                sg = _shf(_pick(hb, e, 0), _pick(hb, e, 1), sh_q, EMULATE)
                qh = prmt(_pick(hb, e, 2), sh_q * 0, sel_h, EMULATE)
            h0 = ((qh & 0xF) * 0x204081) & 0x01010101  # qh bit k -> byte k (0 or 1)
            h1 = ((qh >> 4) * 0x204081) & 0x01010101
            x0 = _ld(xrow + (blk + b) * 64, ok, EVEN)
            x1 = _ld(xrow + (blk + b) * 64 + 4, ok, EVEN)
            if SIGNED:
                isum = _iq3_s_half_signed(q0, _sign_nibbles(sg, h0, 0x4140, EMULATE), x0, grid_ptr, e, zero,
                                          EMULATE)
                isum += _iq3_s_half_signed(q1, _sign_nibbles(sg, h1, 0x4342, EMULATE), x1, grid_ptr, e, zero,
                                           EMULATE)
            else:
                isum = _iq3_s_half(q0, h0, sg, x0, grid_ptr, e, zero, 0, EMULATE)
                isum += _iq3_s_half(q1, h1, sg, x1, grid_ptr, e, zero, 1, EMULATE)
            if PADDED:
                sc = (_pick(hb, e, 2) >> (4 * cc)) & 0xF
                dw = _f16_lo(_pick(hb, e, 3)) * (1 + 2 * sc).to(tl.float32)
            else:
                sc = (_pick(hb, e, 3) >> sh_s) & 0xF
                dw = _f16_lo(_pick(ha, e, 3) >> sh_d) * (1 + 2 * sc).to(tl.float32)
            dx = _pick(_ld(drow + (blk + b) * 8, ok, EVEN), e, 0, -0.0)
            acc += dw * (isum.to(tl.float32) * dx)
        pdl_release(PDL)
        if CONV:
            if not CONV_EARLY:
                cp, cs0, cs1, cs2, cw0, cw1, cw2, cw3 = conv_epilogue_load(mo, no, M, N, cw_ptr, cs_ptr,
                                                                           slot_ptr, C, s_cs)
            conv_epilogue_store(y_ptr, tl_sum(tl_sum(acc, 0), 0), mo, no, M, N, stride_ym, co_ptr, C, cp,
                                cs0, cs1, cs2, cw0, cw1, cw2, cw3)
        else:
            _store_rows(y_ptr, o_ptr, cnt_ptr, tl_sum(tl_sum(acc, 0), 0), M, N, stride_ym, BLOCK_N, BLOCK_M,
                        SPLIT_K, FIXUP)

    @jit
    def _iq4_levels(nib, T0: tl.constexpr, T1: tl.constexpr, T2: tl.constexpr, T3: tl.constexpr,
                    EMULATE: tl.constexpr):
        """The int8 levels of the 4 nibbles in the low 16 bits of `nib` as one word: a `prmt` into each
        8-level half of the table by the nibbles' low 3 bits, a third picks the half by their bit 3."""
        low3 = nib & 0x7777
        lo = prmt(nib * 0 + T0, nib * 0 + T1, low3, EMULATE)
        hi = prmt(nib * 0 + T2, nib * 0 + T3, low3, EMULATE)
        return prmt(lo, hi, ((nib >> 1) & 0x4444) | 0x3210, EMULATE)

    @jit
    def _gemv_rows_iq4_kernel(w_ptr, xw_ptr, xd_ptr, y_ptr, N, K, M, row_units, stride_ym,
                              BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, NB: tl.constexpr,
                              SPLIT_K: tl.constexpr, EVEN: tl.constexpr, T0: tl.constexpr, T1: tl.constexpr,
                              T2: tl.constexpr, T3: tl.constexpr, EMULATE: tl.constexpr,
                              PDL: tl.constexpr = 0):
        pdl_start(PDL)
        # iq4_xs: 136-byte blocks read as int64 units (17 per block, always 8-byte aligned): unit 0 holds d,
        # scales_h and scales_l, units 1 + 2c and 2 + 2c the 16 qs bytes of sub-block c (byte l: codes l and
        # l + 16 in its low and high nibble). Word j's low 16 bits give codes 4j, 16 + 4j, 4j + 1, 17 + 4j,
        # its high 16 bits the next two pairs; the activation bytes are interleaved to match.
        c, b, n, m, e = _tile_axes(BLOCK_N, BLOCK_M, NB)
        zero = (m * 0) + (n * 0) + (b * 0) + (c * 0) + (e * 0)
        nblk = K // 256
        s0, s1 = _step_range(K, NB, SPLIT_K)
        wrow = w_ptr + tl.minimum(n, N - 1).to(tl.int64) * row_units + zero
        q_at = 1 + 2 * c + tl.minimum(e, 1)  # the sub-block's two qs units
        h_at = c * 0  # the header unit
        mc = tl.minimum(m, M - 1).to(tl.int64)
        xrow = xw_ptr + mc * (K // 4) + 8 * c + e + zero
        drow = xd_ptr + mc * (K // 32) + tl.where(c < 8, c, 0) + zero  # see _gemv_rows_iq3_kernel
        x_lo_sel = 0x5140 + zero  # activation bytes (4j, 16 + 4j, 4j + 1, 17 + 4j) of words j, 4 + j
        x_hi_sel = 0x7362 + zero  # (4j + 2, 18 + 4j, 4j + 3, 19 + 4j)
        acc = tl.zeros([8, NB, BLOCK_N, BLOCK_M], dtype=tl.float32)
        for step in range(s0, s1):
            blk = step * NB
            ok = ((blk + b) < nblk) & (zero == 0)  # unused where EVEN (whole steps of NB blocks)
            units = (blk + b) * 17  # per thread: one IMAD.WIDE per address
            q = _ld(wrow + units + q_at, ok, EVEN)
            qa = _pick(q, e, 0)
            qb = _pick(q, e, 1)
            # word e of the 16 qs bytes, in registers
            qw = tl.where(e < 2, qa[:, :, :, :, None], qb[:, :, :, :, None]) + zero
            qw = tl.where(e % 2 == 0, qw.to(tl.int32), (qw >> 32).to(tl.int32))
            w_lo = _iq4_levels(qw, T0, T1, T2, T3, EMULATE)
            w_hi = _iq4_levels(qw >> 16, T0, T1, T2, T3, EMULATE)
            hd = _pick(_ld(wrow + units + h_at, ok, EVEN), e, 0)
            h0 = hd.to(tl.int32)  # d | scales_h << 16
            scl = (hd >> 32).to(tl.int32)
            cc = _pick(c + zero, e, 0)
            sc = ((scl >> (4 * cc)) & 0xF) | (((h0 >> (16 + 2 * cc)) & 3) << 4)
            dw = _f16_lo(h0) * (sc - 32).to(tl.float32)
            xb = xrow + (blk + b) * 64
            x0 = _ld(xb, ok, EVEN)
            x1 = _ld(xb + 4, ok, EVEN)
            x_lo = prmt(x0, x1, x_lo_sel, EMULATE)
            x_hi = prmt(x0, x1, x_hi_sel, EMULATE)
            isum = dp4a(_pick(w_lo, e, 0), _pick(x_lo, e, 0), _pick(zero, e, 0), EMULATE)
            isum = dp4a(_pick(w_hi, e, 0), _pick(x_hi, e, 0), isum, EMULATE)
            for i in tl.static_range(1, 4):
                isum = dp4a(_pick(w_lo, e, i), _pick(x_lo, e, i), isum, EMULATE)
                isum = dp4a(_pick(w_hi, e, i), _pick(x_hi, e, i), isum, EMULATE)
            dx = _pick(_ld(drow + (blk + b) * 8, ok, EVEN), e, 0, -0.0)
            acc += dw * (isum.to(tl.float32) * dx)
        pdl_release(PDL)
        _store_rows(y_ptr, y_ptr, y_ptr, tl_sum(tl_sum(acc, 0), 0), M, N, stride_ym, BLOCK_N, BLOCK_M,
                    SPLIT_K, False)


def _aligned_words(raw: torch.Tensor) -> torch.Tensor:
    """The whole weight as int32 words (a copy padded to whole words in the rare case that its size or
    address is not a multiple of 4: the last block's aligned reads run up to 2 bytes past its end)."""
    flat = raw.reshape(-1)
    if flat.numel() % 4 or flat.data_ptr() % 4:
        flat = torch.cat([flat, flat.new_zeros(4 - flat.numel() % 4)])
    return flat.view(torch.int32)


_SIGNED_GRIDS: dict[torch.device, torch.Tensor] = {}


def _grid_words(device: torch.device, signed: bool) -> torch.Tensor:
    """The iq3_s grid as packed int16 `[512]` (`iq3s_grid16`) or, `signed`, as the int32 words of every sign
    pattern `[16 · 512]` (entry s · 512 + i: grid word i with byte k negated where bit k of s)."""
    from ninfer.kernels.gguf_matmul import _tables

    if not signed:
        return iq3s_grid16(device)
    if device not in _SIGNED_GRIDS:
        grid = _tables(torch.device("cpu"))[0].view(1, 512, 4).to(torch.int16)
        signs = 1 - 2 * ((torch.arange(16)[:, None] >> torch.arange(4)) & 1)  # [16, 4]
        signed_bytes = (grid * signs[:, None, :]).to(torch.int8).contiguous()
        _SIGNED_GRIDS[device] = signed_bytes.view(torch.int32).reshape(-1).to(device)
    return _SIGNED_GRIDS[device]


IQ3_S_PADDED_BYTES = 112


def iq3_s_padded(raw: torch.Tensor) -> torch.Tensor:
    """iq3_s rows (uint8 `[N, 110 · blocks]`) as 112-byte blocks with every field naturally aligned: qs[64]
    at 0, signs[32] at 64, qh[8] at 96, scales[4] at 104, d at 108, two zero bytes (1.018× the bytes)."""
    blocks = raw.reshape(raw.shape[0], -1, 110)
    return torch.cat([blocks[..., 2:66], blocks[..., 74:106], blocks[..., 66:74], blocks[..., 106:110],
                      blocks[..., 0:2], torch.zeros_like(blocks[..., :2])], dim=-1).reshape(raw.shape[0], -1)


def gemv_rows_iq(raw: torch.Tensor, format: str, xa: QuantizedActivation, out_features: int,
                 schedule: RowsIqSchedule | str, padded: bool = False, conv: ConvEpilogue | None = None
                 ) -> torch.Tensor:
    """`(q·d) @ Wᵀ -> [n, out_features]` in `xa.dtype`, W the GGUF rows `raw` (uint8 `[N, row_bytes]`, iq3_s
    or iq4_xs; "_sg" schedules matter to iq3_s only) and xa the int8 activation; the kernel runs on `raw`'s
    device (CUDA, or CPU under the interpreter). `padded`: raw is `iq3_s_padded`'s layout (iq3_s). `conv`
    (iq3_s): as in `gemv_rows.gemv_rows`."""
    format = format.removeprefix(GGUF_PREFIX)
    s = SCHEDULES[schedule] if isinstance(schedule, str) else schedule
    n, k = xa.q.shape
    if padded and (format != "iq3_s" or raw.dtype != torch.uint8
                   or tuple(raw.shape) != (out_features, k // 256 * IQ3_S_PADDED_BYTES)):
        raise QuantKernelError(f"a padded weight is iq3_s uint8 [{out_features}, {k // 256 * 112}] "
                               f"(iq3_s_padded), got {format} {raw.dtype} {list(raw.shape)}")
    work = split_work(raw.device, s, n, out_features) if format == "iq3_s" else None
    y, launch, extra = rows_setup(raw, format, xa, out_features, s, IQ_ROWS_FORMATS, "rows i-quant GEMV",
                                  check=not padded, output=None if work is None else work[0])
    if conv is not None and (format != "iq3_s" or not takes_conv(s, conv, n, out_features)):
        raise QuantKernelError(f"schedule {s.name} cannot run the GDN conv of {conv.channels} channels for "
                               f"{conv.slot_ids.shape[0]} lanes at {n} columns ({format}; iq3_s, no split-K)")
    if s.blocks % 2 and format == "iq3_s":
        raise QuantKernelError(f"schedule {s.name} steps over {s.blocks} blocks; the iq3_s rows GEMV needs "
                               "an even number")
    if format == "iq4_xs":
        units = raw if raw.data_ptr() % 8 == 0 else raw.clone()  # 136-byte blocks: whole int64 units
        t0, t1, t2, t3 = _IQ4_WORDS
        _gemv_rows_iq4_kernel[launch](units.view(torch.int64), xa.words, xa.d, y, out_features, k, n,
                                      raw.shape[1] // 8, y.stride(0), BLOCK_N=s.block_n, BLOCK_M=s.block_m,
                                      NB=s.blocks, SPLIT_K=s.split_k, EVEN=k // 256 % s.blocks == 0, T0=t0,
                                      T1=t1, T2=t2, T3=t3, EMULATE=EMULATE_DP4A,
                                      **extra, **pdl_options(raw, trigger=False))
        return y.to(xa.dtype)
    grid = _grid_words(raw.device, s.signed_grid)
    out, fixup = split_target(y, work, xa.dtype)
    _gemv_rows_iq3_kernel[launch](_aligned_words(raw), xa.words, xa.d, grid, y, out_features, k, n,
                                  raw.shape[1], y.stride(0), *conv_arguments(y, conv), BLOCK_N=s.block_n,
                                  BLOCK_M=s.block_m, NB=s.blocks, SPLIT_K=s.split_k,
                                  EVEN=k // 256 % s.blocks == 0, SIGNED=s.signed_grid, EMULATE=EMULATE_DP4A,
                                  PADDED=padded, CONV=conv is not None, CONV_EARLY=conv_early(n), **fixup,
                                  **extra, **pdl_options(raw, trigger=False))
    if conv is not None:
        conv.applied = True
    return out.to(xa.dtype)

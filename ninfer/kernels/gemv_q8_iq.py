"""Decode GEMV with int8 activations ("q8") for the i-quants iq3_s and iq4_xs: the weight codes of each
32-value sub-block are rebuilt as packed signed int8x4 words and multiplied with the activation words by
`dp4a`; the weight and activation scales are applied once per sub-block.

iq3_s: a 9-bit index (qs byte + one qh bit) picks a grid word of 4 magnitudes (1, 3, .., 15); the 4 sign bits
become a byte mask m (0xFE where negative) and the signed word is `g ^ m` (an odd byte xor 0xFE is its
negation). iq4_xs: a byte of qs holds a low and a high nibble; one `prmt` per
8-byte half of the 16-level table maps 4 nibbles to levels and a third `prmt` picks per byte by the
nibble's top bit. The activation words are interleaved the same way (code l beside code l + 16).

Program tile: `[BLOCK_N rows, 8 sub-blocks]` (one thread per pair at BLOCK_N·8 = 32·warps; columns are the
leading axis of the 3-d tiles, so each thread holds all of its pair's columns and the weight tile broadcasts
without a layout conversion); the 8 words of a sub-block chain `dp4a` per column in registers, so no
cross-thread reduction happens per block. The iq3_s grid is looked up either in shared memory (`tl.gather` of
all 64 indices of the thread's sub-block at once: one table copy and one barrier pair per block) or through
L1 (global loads), `grid_in_shared`.
`gemv_q8_iq_reference` (dequantise with `ninfer.quant`, times `q·d`, float64) is the tests' oracle.

Schedule options (`IqSchedule`): `prefetch` loads the next block's weight units (1) and activation words (2)
one loop step ahead into registers, the block's arithmetic behind an always-taken run-time branch so that
ptxas keeps those loads ahead of it (it otherwise sinks them to the loop's end); `depth` 2 prefetches the
weights two blocks ahead; `grid_l1` looks the iq3_s grid up through L1; `kb` spans kb consecutive blocks of
a row per tile (1 column); `stream` runs "stream-K": a grid of the programs the GPU holds at once (sized from
the compiled kernel's registers and shared memory) walks all (row tile, block) steps evenly, flushing each
row tile's partial sums with fp32 atomics. H200 timings (bench/q8_timing.py) pick `default_iq_schedule`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ninfer.kernels.gemv_q8 import EMULATE_DP4A, QuantizedActivation, dp4a, gemv_q8_reference
from ninfer.kernels.gguf_matmul import MatmulSchedule, QuantKernelError, check_weight, triton_cdiv
from ninfer.kernels.triton_support import HAVE_TRITON, jit, tl, tl_sum, triton_runs_on
from ninfer.quant.formats import GGUF_PREFIX
from ninfer.quant.tables import IQ4_LEVELS

IQ_Q8_FORMATS = ("iq3_s", "iq4_xs")
# Schedules should keep BLOCK_N·8 ≥ 32·num_warps: a smaller tile is replicated across the spare threads.
MAX_COLUMNS = 8



@dataclass(frozen=True)
class IqSchedule(MatmulSchedule):
    """A q8 i-quant schedule; `prefetch` 1: the next block's weight units are loaded one loop step ahead into
    registers (latency hiding), 2: its activation words too. gguf_matmul's q8 schedules mean prefetch 0."""

    prefetch: int = 0
    depth: int = 1  # prefetch distance of the weight units in blocks (1 or 2)
    fence: bool = True  # prefetch: the block's arithmetic behind a run-time branch (loads stay ahead)
    grid_l1: bool = False  # iq3_s: the grid looked up through L1 (global loads), not shared memory
    kb: int = 1  # consecutive blocks of a row the tile spans (BLOCK_N · 8 · kb threads)
    stream: int = 0  # > 0: stream-K over a grid of `stream` × the programs the GPU holds at once; no split_k


def _sched(name: str, block_n: int, block_m: int, split_k: int = 1, num_warps: int = 4, **kw) -> IqSchedule:
    return IqSchedule(name, "q8", block_n, block_m, split_k=split_k, num_warps=num_warps, **kw)


SCHEDULES: dict[str, MatmulSchedule] = {
    s.name: s
    for s in (
        _sched("q8_n16_m1", 16, 1),
        _sched("q8_n32_m1", 32, 1),
        _sched("q8_n64_m1", 64, 1, num_warps=8),
        _sched("q8_n16_m1_s2", 16, 1, split_k=2),
        _sched("q8_n16_m1_s4", 16, 1, split_k=4),
        _sched("q8_n8_m1_s4_w2", 8, 1, split_k=4, num_warps=2),
        _sched("q8_n16_m4", 16, 4),
        _sched("q8_n16_m4_s4", 16, 4, split_k=4),
        _sched("q8_n32_m4", 32, 4),
        _sched("q8_n16_m8", 16, 8),
        _sched("q8_n32_m8", 32, 8, num_warps=8),
        # register double-buffering (p1: weights, p2: weights and activations one block ahead)
        _sched("q8_n16_m1_p1", 16, 1, prefetch=1),
        _sched("q8_n16_m1_p2", 16, 1, prefetch=2),
        _sched("q8_n32_m1_p2", 32, 1, prefetch=2),
        _sched("q8_n16_m1_s2_p2", 16, 1, split_k=2, prefetch=2),
        _sched("q8_n16_m1_s4_p2", 16, 1, split_k=4, prefetch=2),
        _sched("q8_n8_m1_s4_w2_p2", 8, 1, split_k=4, num_warps=2, prefetch=2),
        _sched("q8_n16_m4_p2", 16, 4, prefetch=2),
        _sched("q8_n16_m4_s4_p2", 16, 4, split_k=4, prefetch=2),
        _sched("q8_n32_m4_p1", 32, 4, prefetch=1),
        _sched("q8_n32_m4_p2", 32, 4, prefetch=2),
        _sched("q8_n16_m8_p1", 16, 8, prefetch=1),
        _sched("q8_n16_m8_s4_p1", 16, 8, split_k=4, prefetch=1),
        # several rows per thread at 8 columns: the activation words are loaded once per thread for its rows
        _sched("q8_n32_m8_w4", 32, 8),
        _sched("q8_n32_m8_w4_p1", 32, 8, prefetch=1),
        _sched("q8_n64_m8_w4_p1", 64, 8, prefetch=1),
        # weights two blocks ahead
        _sched("q8_n16_m1_p2_d2", 16, 1, prefetch=2, depth=2),
        _sched("q8_n16_m1_s4_p2_d2", 16, 1, split_k=4, prefetch=2, depth=2),
        _sched("q8_n8_m1_s4_w2_p2_d2", 8, 1, split_k=4, num_warps=2, prefetch=2, depth=2),
        _sched("q8_n16_m4_s4_p2_d2", 16, 4, split_k=4, prefetch=2, depth=2),
        _sched("q8_n16_m4_p2_d2", 16, 4, prefetch=2, depth=2),
        _sched("q8_n16_m8_p1_d2", 16, 8, prefetch=1, depth=2),
        _sched("q8_n16_m8_s4_p1_d2", 16, 8, split_k=4, prefetch=1, depth=2),
        # iq3_s grid through L1 (no barriers in the loop)
        _sched("q8_n16_m1_p2_l1", 16, 1, prefetch=2, grid_l1=True),
        _sched("q8_n16_m1_s4_p2_d2_l1", 16, 1, split_k=4, prefetch=2, depth=2, grid_l1=True),
        _sched("q8_n8_m1_s4_w2_p2_d2_l1", 8, 1, split_k=4, num_warps=2, prefetch=2, depth=2, grid_l1=True),
        _sched("q8_n16_m4_s4_p2_d2_l1", 16, 4, split_k=4, prefetch=2, depth=2, grid_l1=True),
        _sched("q8_n16_m8_s4_p1_d2_l1", 16, 8, split_k=4, prefetch=1, depth=2, grid_l1=True),
        # a warp on 4 consecutive blocks of one row (longer contiguous reads per row; not yet timed). At 4-8
        # columns the sm_90 build converts layouts through shared memory (18-20 BAR per step): 1 column only
        _sched("q8_n4_m1_b4", 4, 1, kb=4),
        _sched("q8_n4_m1_b4_p2", 4, 1, kb=4, prefetch=2),
        _sched("q8_n4_m1_b4_s2_p2", 4, 1, kb=4, split_k=2, prefetch=2),
        _sched("q8_n8_m1_b2_p2", 8, 1, kb=2, prefetch=2),
        # stream-K: one wave of resident programs walks all (row tile, block) steps evenly (no tail wave)
        _sched("q8_n16_m1_k", 16, 1, stream=1),
        _sched("q8_n16_m1_k_l1", 16, 1, stream=1, grid_l1=True),
        _sched("q8_n16_m1_k_p2", 16, 1, stream=1, prefetch=2),
        _sched("q8_n16_m1_k_p2_l1", 16, 1, stream=1, prefetch=2, grid_l1=True),
        _sched("q8_n8_m1_k_w2_p2", 8, 1, num_warps=2, stream=1, prefetch=2),
        _sched("q8_n16_m4_k", 16, 4, stream=1),
        _sched("q8_n16_m4_k_l1", 16, 4, stream=1, grid_l1=True),
        _sched("q8_n16_m4_k_p2_l1", 16, 4, stream=1, prefetch=2, grid_l1=True),
        _sched("q8_n16_m8_k", 16, 8, stream=1),
        _sched("q8_n16_m8_k_l1", 16, 8, stream=1, grid_l1=True),
        _sched("q8_n16_m8_k_p1_l1", 16, 8, stream=1, prefetch=1, grid_l1=True),
    )
}


def default_iq_schedule(fmt: str, out_features: int, in_features: int, columns: int) -> MatmulSchedule:
    """The fastest schedule measured on the H200 (bench/q8_timing.py, two runs, 2026-11-30) for the 27B
    shapes, by format, rows (out_features), the reduction length and the column tile (1, 2–4, 5–8 columns):
    stream-K for the small matrices, split-K where the reduction is long (17408), prefetching tiles
    elsewhere."""
    fmt = fmt.removeprefix(GGUF_PREFIX)
    if fmt not in IQ_Q8_FORMATS or not 1 <= columns <= MAX_COLUMNS:
        raise QuantKernelError(f"the q8 i-quant GEMV takes {', '.join(IQ_Q8_FORMATS)} at 1–{MAX_COLUMNS} "
                               f"columns, not {fmt} at {columns}; use quant_matmul's wv_*/sub_* schedules")
    iq3 = fmt == "iq3_s"
    rows, long_k = out_features, in_features >= 16384
    if columns == 1:
        if rows <= 1024:
            name = "q8_n16_m1_k"  # 1024 rows: 8.2 / 7.1 µs (iq3_s / iq4_xs); split-K 9.3 / 8.4
        elif long_k:
            name = "q8_n8_m1_k_w2_p2" if iq3 else "q8_n8_m1_s4_w2"  # 5120×17408: 55.0 / 37.5 µs
        elif rows >= 16384:
            name = "q8_n8_m1_s4_w2" if iq3 else "q8_n16_m1_p2"  # 17408×5120: 54.5 / 35.7 µs
        else:
            name = "q8_n16_m1_p2"  # 6144–12288 rows: 21.4–38.4 / 15.9–24.4 µs, 8–15 % under split-K
    elif columns <= 4:
        if rows <= 1024:
            name = "q8_n16_m4_k"
        elif long_k:
            name = "q8_n16_m4_s4"  # 77.9 / 64.0 µs
        elif iq3:
            name = "q8_n16_m4_k" if rows >= 16384 else "q8_n32_m4" if rows > 11000 else "q8_n16_m4"
        else:
            name = "q8_n32_m4_p2" if rows > 11000 else "q8_n16_m4" if rows > 8192 else "q8_n16_m4_s4"
    else:
        if rows < 512:
            name = "q8_n16_m8_k"  # 48 rows: 5.4 µs; split-K 8.8
        elif rows <= 1024:
            name = "q8_n16_m8_s4_p1"
        elif long_k:
            name = "q8_n16_m8_k_l1" if iq3 else "q8_n16_m8_k_p1_l1"  # 110.4 / 98.3 µs
        elif not iq3 and 8192 < rows < 16384:
            name = "q8_n32_m8_w4"  # iq4_xs 10240, 12288 rows: 48.8, 49.3 µs; n16 p1 60.8, 61.5
        else:
            name = "q8_n16_m8_p1"
    return SCHEDULES[name]


def gemv_q8_iq_reference(raw: torch.Tensor, fmt: str, xa: QuantizedActivation, out_features: int,
                         out_dtype: torch.dtype | None = torch.float64) -> torch.Tensor:
    """`gemv_q8_reference` (`(q·d) @ Wᵀ` in float64, W dequantised by `ninfer.quant`) on xa's device, in
    `out_dtype` (None: the activation's dtype)."""
    return gemv_q8_reference(raw, fmt, xa, out_features).to(xa.q.device, out_dtype or xa.dtype)


# ---------------------------------------------------------------------------------------------------------
# Triton


# iq4_xs levels as int8 bytes packed into 4 little-endian int32 words (prmt tables: levels 0-7, 8-15)
_IQ4_WORDS = torch.tensor(IQ4_LEVELS.tolist(), dtype=torch.int8).view(torch.int32).tolist()

if HAVE_TRITON:

    @jit
    def prmt(a, b, sel, EMULATE: tl.constexpr):
        """PTX `prmt.b32` (default mode): byte i of the result is byte `(sel >> 4i) & 7` of the 8 bytes
        {a, b} (a the low four), or, where bit 3 of that selector nibble is set, that byte's top bit
        replicated (0x00 / 0xFF)."""
        if EMULATE:
            out = tl.zeros_like(a)
            for i in tl.static_range(4):
                s = (sel >> (4 * i)) & 0xF
                byte = tl.where((s & 7) < 4, a >> (8 * (s & 3)), b >> (8 * (s & 3))) & 0xFF
                byte = tl.where((s & 8) != 0, tl.where(byte >= 0x80, 0xFF, 0), byte)
                out |= byte << (8 * i)
            return out
        else:
            return tl.inline_asm_elementwise("prmt.b32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, sel],
                                             dtype=tl.int32, is_pure=True, pack=1)

    @jit
    def _iq4_levels(nib, T0: tl.constexpr, T1: tl.constexpr, T2: tl.constexpr, T3: tl.constexpr,
                    EMULATE: tl.constexpr):
        """The 4 int8 levels of the 4 nibbles in the low 16 bits of `nib`, as one int32 word."""
        low3 = nib & 0x7777
        lo = prmt(tl.full(nib.shape, T0, tl.int32), tl.full(nib.shape, T1, tl.int32), low3, EMULATE)
        hi = prmt(tl.full(nib.shape, T2, tl.int32), tl.full(nib.shape, T3, tl.int32), low3, EMULATE)
        pick = ((nib >> 1) & 0x4444) | 0x3210  # byte i from hi where the nibble's bit 3 is set
        return prmt(lo, hi, pick, EMULATE)

    @jit
    def _gather8(grid_all, i0, i1, i2, i3, i4, i5, i6, i7, BLOCK_N: tl.constexpr, SB: tl.constexpr):
        """The grid words of 8 index tiles `[BLOCK_N, 8]` in one `tl.gather` (one shared-memory copy of the
        table and one barrier pair per call): joined along new in-thread axes, gathered, split back."""
        idx = tl.join(tl.join(tl.join(i0, i4), tl.join(i2, i6)), tl.join(tl.join(i1, i5), tl.join(i3, i7)))
        g = tl.reshape(tl.gather(grid_all, tl.reshape(idx, [BLOCK_N * SB * 8]), 0), [BLOCK_N, SB, 2, 2, 2])
        g_even, g_odd = tl.split(g)
        g_0426, g_2637 = tl.split(g_even)
        g_1537, g_3715 = tl.split(g_odd)
        g0, g4 = tl.split(g_0426)
        g2, g6 = tl.split(g_2637)
        g1, g5 = tl.split(g_1537)
        g3, g7 = tl.split(g_3715)
        return g0, g1, g2, g3, g4, g5, g6, g7

    @jit
    def _load8(grid_ptr, i0, i1, i2, i3, i4, i5, i6, i7):
        """The grid words of 8 index tiles as global (L1) loads."""
        return (tl.load(grid_ptr + i0.to(tl.uint32)), tl.load(grid_ptr + i1.to(tl.uint32)),
                tl.load(grid_ptr + i2.to(tl.uint32)), tl.load(grid_ptr + i3.to(tl.uint32)),
                tl.load(grid_ptr + i4.to(tl.uint32)), tl.load(grid_ptr + i5.to(tl.uint32)),
                tl.load(grid_ptr + i6.to(tl.uint32)), tl.load(grid_ptr + i7.to(tl.uint32)))

    @jit
    def _iq3_s_dot(g, t, xv, isum, EMULATE: tl.constexpr):
        """isum + dp4a(grid word g with the 4 sign bits t, activation word xv)."""
        neg = ((t & 0xF) * 0x204081) & 0x01010101  # sign bit j -> bit 8j
        wq = g ^ (neg * 254)  # the magnitudes are odd (1..15): m ^ 0xFE = -m in a byte
        return dp4a(tl.broadcast_to(wq[None, :, :], isum.shape), tl.broadcast_to(xv, isum.shape), isum,
                    EMULATE)

    @jit
    def _halves(pair):
        """The low and high int32 words of an int64 (two activation words read at once)."""
        return pair.to(tl.int32), (pair >> 32).to(tl.int32)

    @jit
    def _iq4_xs_dot(qw, x_lo, x_hi, isum, T0: tl.constexpr, T1: tl.constexpr, T2: tl.constexpr,
                    T3: tl.constexpr, EMULATE: tl.constexpr):
        """isum + the dot of one iq4_xs qs word (8 codes) with its activation words: x_lo holds codes
        4j..4j+3, x_hi codes 16+4j..; the nibbles come in the word's order (4j, 16+4j, 4j+1, 17+4j) then
        (4j+2, 18+4j, 4j+3, 19+4j), and the activation bytes are interleaved to match."""
        w_a = _iq4_levels(qw, T0, T1, T2, T3, EMULATE)
        w_b = _iq4_levels(qw >> 16, T0, T1, T2, T3, EMULATE)
        x_a = prmt(x_lo, x_hi, tl.full(x_lo.shape, 0x5140, tl.int32), EMULATE)
        x_b = prmt(x_lo, x_hi, tl.full(x_lo.shape, 0x7362, tl.int32), EMULATE)
        isum = dp4a(tl.broadcast_to(w_a[None, :, :], isum.shape), tl.broadcast_to(x_a, isum.shape), isum,
                    EMULATE)
        return dp4a(tl.broadcast_to(w_b[None, :, :], isum.shape), tl.broadcast_to(x_b, isum.shape), isum,
                    EMULATE)

    @jit
    def _iq3_s_load(b, sb):
        """The raw uint16 units of one iq3_s block a thread reads (b: the rows' block start `[BLOCK_N, 1]`):
        d 0, qs 1..32, qh 33..36, signs 37..52, scales 53..54."""
        return (tl.load(b), tl.load(b + 53 + sb // 4), tl.load(b + 33 + sb // 2), tl.load(b + 37 + 2 * sb),
                tl.load(b + 38 + 2 * sb), tl.load(b + 1 + 4 * sb), tl.load(b + 2 + 4 * sb),
                tl.load(b + 3 + 4 * sb), tl.load(b + 4 + 4 * sb))

    @jit
    def _iq3_s_sums(hd, scw, qhw, sg_lo, sg_hi, qa, qb, qc, qd, p0, p1, p2, p3, isum, sb, grid_all, grid_ptr,
                    BLOCK_N: tl.constexpr, SB: tl.constexpr, EMULATE: tl.constexpr, GRID_SMEM: tl.constexpr):
        """(isum + the sub-block dots, the sub-block weight scales) of one iq3_s block from its units."""
        x01, x23 = _halves(p0)
        x45, x67 = _halves(p1)
        x89, xab = _halves(p2)
        xcd, xef = _halves(p3)
        d = hd.to(tl.int16, bitcast=True).to(tl.float16, bitcast=True).to(tl.float32)
        sc = (scw.to(tl.int32) >> (4 * (sb % 4))) & 0xF
        dw = d * (1 + 2 * sc).to(tl.float32)
        qh = qhw.to(tl.int32) >> (8 * (sb % 2))
        # qh bit p as byte p % 4 of spread word p // 4 (0 or 1), the grid index's high byte
        qh_lo = ((qh & 0xF) * 0x204081) & 0x01010101
        qh_hi = (((qh >> 4) & 0xF) * 0x204081) & 0x01010101
        t_lo = sg_lo.to(tl.int32)  # sign bits of entries 0-3, 4 each
        t_hi = sg_hi.to(tl.int32)  # entries 4-7
        # grid index of entry p = qs byte p | qh bit p << 8: one prmt (qs bytes 2, 3 are zero)
        qa = qa.to(tl.int32)
        qb = qb.to(tl.int32)
        qc = qc.to(tl.int32)
        qd = qd.to(tl.int32)
        i0 = prmt(qa, qh_lo, tl.full(qa.shape, 0x2240, tl.int32), EMULATE)
        i1 = prmt(qa, qh_lo, tl.full(qa.shape, 0x2251, tl.int32), EMULATE)
        i2 = prmt(qb, qh_lo, tl.full(qa.shape, 0x2260, tl.int32), EMULATE)
        i3 = prmt(qb, qh_lo, tl.full(qa.shape, 0x2271, tl.int32), EMULATE)
        i4 = prmt(qc, qh_hi, tl.full(qa.shape, 0x2240, tl.int32), EMULATE)
        i5 = prmt(qc, qh_hi, tl.full(qa.shape, 0x2251, tl.int32), EMULATE)
        i6 = prmt(qd, qh_hi, tl.full(qa.shape, 0x2260, tl.int32), EMULATE)
        i7 = prmt(qd, qh_hi, tl.full(qa.shape, 0x2271, tl.int32), EMULATE)
        if GRID_SMEM:
            g0, g1, g2, g3, g4, g5, g6, g7 = _gather8(grid_all, i0, i1, i2, i3, i4, i5, i6, i7, BLOCK_N, SB)
        else:
            g0, g1, g2, g3, g4, g5, g6, g7 = _load8(grid_ptr, i0, i1, i2, i3, i4, i5, i6, i7)
        isum = _iq3_s_dot(g0, t_lo, x01, isum, EMULATE)
        isum = _iq3_s_dot(g1, t_lo >> 4, x23, isum, EMULATE)
        isum = _iq3_s_dot(g2, t_lo >> 8, x45, isum, EMULATE)
        isum = _iq3_s_dot(g3, t_lo >> 12, x67, isum, EMULATE)
        isum = _iq3_s_dot(g4, t_hi, x89, isum, EMULATE)
        isum = _iq3_s_dot(g5, t_hi >> 4, xab, isum, EMULATE)
        isum = _iq3_s_dot(g6, t_hi >> 8, xcd, isum, EMULATE)
        isum = _iq3_s_dot(g7, t_hi >> 12, xef, isum, EMULATE)
        return isum, dw

    @jit
    def _iq4_xs_load(b, sb):
        """The int32 units of one iq4_xs block a thread reads: d | scales_h << 16 at 0, scales_l 1, qs 2..33
        (4 words per group)."""
        qs = b + 2 + 4 * sb
        return tl.load(b), tl.load(b + 1), tl.load(qs), tl.load(qs + 1), tl.load(qs + 2), tl.load(qs + 3)

    @jit
    def _iq4_xs_sums(h0, scl, q0, q1, q2, q3, p0, p1, p2, p3, isum, sb, T0: tl.constexpr, T1: tl.constexpr,
                     T2: tl.constexpr, T3: tl.constexpr, EMULATE: tl.constexpr):
        """(isum + the sub-block dots, the sub-block weight scales) of one iq4_xs block from its units; qs
        word j of a group holds codes 4j..4j+3 (low nibbles) and 16+4j.. (high)."""
        x01, x23 = _halves(p0)
        x45, x67 = _halves(p1)
        x89, xab = _halves(p2)
        xcd, xef = _halves(p3)
        d = (h0 & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        sc_lo = (scl >> (4 * sb)) & 0xF
        sc_hi = (h0 >> (16 + 2 * sb)) & 3
        dw = d * ((sc_lo | (sc_hi << 4)) - 32).to(tl.float32)
        isum = _iq4_xs_dot(q0, x01, x89, isum, T0, T1, T2, T3, EMULATE)
        isum = _iq4_xs_dot(q1, x23, xab, isum, T0, T1, T2, T3, EMULATE)
        isum = _iq4_xs_dot(q2, x45, xcd, isum, T0, T1, T2, T3, EMULATE)
        isum = _iq4_xs_dot(q3, x67, xef, isum, T0, T1, T2, T3, EMULATE)
        return isum, dw

    @jit
    def _wblk(g, bo, blocks, KB: tl.constexpr):
        """The block index of each thread in group g (KB blocks per group; past the end: the last block)."""
        if KB == 1:
            return g
        else:
            return tl.minimum(g * KB + bo, blocks - 1)

    @jit
    def _w_load(FMT: tl.constexpr, b, sb):
        """A block's weight units as 9 values (iq4_xs: 6, padded with copies of the first)."""
        if FMT == 0:
            return _iq3_s_load(b, sb)
        else:
            h0, scl, q0, q1, q2, q3 = _iq4_xs_load(b, sb)
            return h0, scl, q0, q1, q2, q3, h0, h0, h0

    @jit
    def _x_load(xq_row, xd_row, blk):
        """A block's activation words of the thread's sub-block (4 int64 pairs) and their scale."""
        xw = xq_row + blk * 32
        return tl.load(xw), tl.load(xw + 1), tl.load(xw + 2), tl.load(xw + 3), tl.load(xd_row + blk * 8)

    @jit
    def _opaque(v, EMULATE: tl.constexpr):
        """v through an asm `mov` (the compiler cannot reason about the result)."""
        if EMULATE:
            return v
        else:
            return tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [v], dtype=tl.int32, is_pure=True,
                                             pack=1)

    @jit
    def _acc_block(acc, u0, u1, u2, u3, u4, u5, u6, u7, u8, p0, p1, p2, p3, dx, sb, grid_all, grid_ptr,
                   FMT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, T0: tl.constexpr,
                   T1: tl.constexpr, T2: tl.constexpr, T3: tl.constexpr, EMULATE: tl.constexpr,
                   GRID_SMEM: tl.constexpr, SB: tl.constexpr):
        """acc + one block's scaled sub-block dots, from its units u (iq4_xs: u0..u5) and activation words
        (SB sub-blocks per row: 8 per block the tile spans)."""
        isum = tl.zeros([BLOCK_M, BLOCK_N, SB], dtype=tl.int32)
        if FMT == 0:
            isum, dw = _iq3_s_sums(u0, u1, u2, u3, u4, u5, u6, u7, u8, p0, p1, p2, p3, isum, sb, grid_all,
                                   grid_ptr, BLOCK_N, SB, EMULATE, GRID_SMEM)
        else:
            isum, dw = _iq4_xs_sums(u0, u1, u2, u3, u4, u5, p0, p1, p2, p3, isum, sb, T0, T1, T2, T3, EMULATE)
        return acc + isum.to(tl.float32) * (dw[None, :, :] * dx)

    @jit
    def _gemv_q8_iq_kernel(
        w_ptr, xq_ptr, xd_ptr, y_ptr, grid_ptr,
        N, K, M, row_units, stride_xq, stride_xd, stride_ym,
        FMT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, SPLIT_K: tl.constexpr,
        T0: tl.constexpr, T1: tl.constexpr, T2: tl.constexpr, T3: tl.constexpr, EMULATE: tl.constexpr,
        GRID_SMEM: tl.constexpr, PREFETCH: tl.constexpr, FENCE: tl.constexpr, DEPTH: tl.constexpr,
        KB: tl.constexpr, SB: tl.constexpr,
    ):
        # w_ptr: iq3_s rows as uint16 (2-byte aligned blocks, 55 units each), iq4_xs as int32 (34 per block).
        # PREFETCH 1: block b + 1's weight units are loaded into loop-carried registers before block b is
        # computed (its loads stay in flight during b's arithmetic); 2: its activation words too. DEPTH 2:
        # the weight units of block b + 2 instead (two blocks' loads in flight per thread). KB > 1: the tile
        # spans KB consecutive blocks of each row (a warp reads KB·block bytes of one row at once: longer
        # contiguous runs per row); the loop then steps over groups of KB blocks ("blk" counts groups).
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(2)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        n_ok = offs_n < N
        # SB = 8 · KB sub-blocks per row in the tile
        sb = tl.arange(0, SB)[None, :] % 8  # sub-block of 32 codes
        bo = tl.arange(0, SB)[None, :] // 8  # block within the group
        sb3 = tl.arange(0, SB)[None, None, :] % 8
        bo3 = tl.arange(0, SB)[None, None, :] // 8
        # rows and columns past the ends read the last one (never stored): no masks in the loop
        m3 = tl.minimum(offs_m, M - 1)[:, None, None]
        row = w_ptr + tl.minimum(offs_n, N - 1).to(tl.int64)[:, None] * row_units
        xq_row = xq_ptr + m3.to(tl.int64) * stride_xq + 4 * sb3  # the sub-block's 8 words as 4 int64
        xd_row = xd_ptr + m3.to(tl.int64) * stride_xd + sb3
        acc = tl.zeros([BLOCK_M, BLOCK_N, SB], dtype=tl.float32)
        if GRID_SMEM:  # iq3_s grid in registers; tl.gather looks it up through shared memory
            grid_all = tl.load(grid_ptr + tl.arange(0, 512))
        else:
            grid_all = tl.zeros([1], dtype=tl.int32)  # unused
        blocks = K // 256
        groups = (blocks + KB - 1) // KB
        per_split = (groups + SPLIT_K - 1) // SPLIT_K
        lo = pid_k * per_split
        hi = tl.minimum(groups, lo + per_split)
        unit = 55 if FMT == 0 else 34  # units per block
        # the blocks loaded before the loop (clamped: an empty split-K part reads a valid block, unused)
        first = tl.minimum(lo, groups - 1)
        u0, u1, u2, u3, u4, u5, u6, u7, u8 = _w_load(FMT, row + _wblk(first, bo, blocks, KB) * unit, sb)
        if DEPTH == 2:
            second = tl.minimum(first + 1, groups - 1)
            v0, v1, v2, v3, v4, v5, v6, v7, v8 = _w_load(FMT, row + _wblk(second, bo, blocks, KB) * unit, sb)
        p0, p1, p2, p3, dx = _x_load(xq_row, xd_row, _wblk(first, bo3, blocks, KB))
        for blk in range(lo, hi):
            if PREFETCH == 0:
                u0, u1, u2, u3, u4, u5, u6, u7, u8 = _w_load(FMT, row + _wblk(blk, bo, blocks, KB) * unit, sb)
            if PREFETCH < 2:
                p0, p1, p2, p3, dx = _x_load(xq_row, xd_row, _wblk(blk, bo3, blocks, KB))
            if PREFETCH > 0:  # issue block b + DEPTH's loads before block b's arithmetic (clamped: unused)
                nb = tl.minimum(blk + DEPTH, hi - 1)
                n0, n1, n2, n3, n4, n5, n6, n7, n8 = _w_load(FMT, row + _wblk(nb, bo, blocks, KB) * unit, sb)
            if PREFETCH == 2:
                nx = _wblk(tl.minimum(blk + 1, hi - 1), bo3, blocks, KB)
                np0, np1, np2, np3, ndx = _x_load(xq_row, xd_row, nx)
            if KB > 1:  # blocks past the row's end (clamped loads) add nothing
                dxv = tl.where(blk * KB + bo3 < blocks, dx, 0.0)
            else:
                dxv = dx
            if PREFETCH > 0 and FENCE:
                # a run-time branch (always taken; its condition opaque to LLVM, so not unswitched): ptxas
                # schedules within basic blocks, so the loads above stay ahead of this block's arithmetic
                # instead of sinking to the loop's end
                if _opaque(blk, EMULATE) < hi:
                    acc = _acc_block(acc, u0, u1, u2, u3, u4, u5, u6, u7, u8, p0, p1, p2, p3, dxv, sb,
                                     grid_all, grid_ptr, FMT, BLOCK_M, BLOCK_N, T0, T1, T2, T3, EMULATE,
                                     GRID_SMEM, SB)
            else:
                acc = _acc_block(acc, u0, u1, u2, u3, u4, u5, u6, u7, u8, p0, p1, p2, p3, dxv, sb, grid_all,
                                 grid_ptr, FMT, BLOCK_M, BLOCK_N, T0, T1, T2, T3, EMULATE, GRID_SMEM, SB)
            if PREFETCH > 0:
                if DEPTH == 2:
                    u0, u1, u2, u3, u4, u5, u6, u7, u8 = v0, v1, v2, v3, v4, v5, v6, v7, v8
                    v0, v1, v2, v3, v4, v5, v6, v7, v8 = n0, n1, n2, n3, n4, n5, n6, n7, n8
                else:
                    u0, u1, u2, u3, u4, u5, u6, u7, u8 = n0, n1, n2, n3, n4, n5, n6, n7, n8
            if PREFETCH == 2:
                p0, p1, p2, p3, dx = np0, np1, np2, np3, ndx
        out = tl_sum(acc, 2)
        ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
        mask = (offs_m < M)[:, None] & n_ok[None, :]
        if SPLIT_K == 1:
            tl.store(ptrs, out.to(y_ptr.dtype.element_ty), mask=mask)
        else:
            tl.atomic_add(ptrs, out, mask=mask)

    @jit
    def _gemv_q8_iq_stream_kernel(
        w_ptr, xq_ptr, xd_ptr, y_ptr, grid_ptr,
        N, K, M, row_units, stride_xq, stride_xd, stride_ym,
        FMT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
        T0: tl.constexpr, T1: tl.constexpr, T2: tl.constexpr, T3: tl.constexpr, EMULATE: tl.constexpr,
        GRID_SMEM: tl.constexpr, PREFETCH: tl.constexpr,
    ):
        # "stream-K": the (row tile, block) steps of the whole matrix, row tile after row tile, split evenly
        # over a grid sized to the GPU (no tail wave); a program adds its partial sums atomically (fp32 y)
        # whenever its range leaves a row tile. PREFETCH 1 / 2 as in _gemv_q8_iq_kernel (distance 1).
        pid = tl.program_id(0)
        offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        ar = tl.arange(0, BLOCK_N)
        sb = tl.arange(0, 8)[None, :]
        sb3 = tl.arange(0, 8)[None, None, :]
        m3 = tl.minimum(offs_m, M - 1)[:, None, None]
        xq_row = xq_ptr + m3.to(tl.int64) * stride_xq + 4 * sb3
        xd_row = xd_ptr + m3.to(tl.int64) * stride_xd + sb3
        m_ok = (offs_m < M)[:, None]
        acc = tl.zeros([BLOCK_M, BLOCK_N, 8], dtype=tl.float32)
        if GRID_SMEM:
            grid_all = tl.load(grid_ptr + tl.arange(0, 512))
        else:
            grid_all = tl.zeros([1], dtype=tl.int32)  # unused
        blocks = K // 256
        total = (N + BLOCK_N - 1) // BLOCK_N * blocks
        per = (total + tl.num_programs(0) - 1) // tl.num_programs(0)
        g_lo = pid * per
        g_hi = tl.minimum(total, g_lo + per)
        unit = 55 if FMT == 0 else 34
        tile = g_lo // blocks
        blk = g_lo - tile * blocks
        # the step before the loop (clamped to the last step: an empty range reads a valid block, unused)
        g0 = tl.minimum(g_lo, total - 1)
        t0 = g0 // blocks
        row0 = w_ptr + tl.minimum(t0 * BLOCK_N + ar, N - 1).to(tl.int64)[:, None] * row_units
        u0, u1, u2, u3, u4, u5, u6, u7, u8 = _w_load(FMT, row0 + (g0 - t0 * blocks) * unit, sb)
        p0, p1, p2, p3, dx = _x_load(xq_row, xd_row, g0 - t0 * blocks)
        for g in range(g_lo, g_hi):
            row = w_ptr + tl.minimum(tile * BLOCK_N + ar, N - 1).to(tl.int64)[:, None] * row_units
            last = blk == blocks - 1  # the step leaves the row tile after this block
            if PREFETCH == 0:
                u0, u1, u2, u3, u4, u5, u6, u7, u8 = _w_load(FMT, row + blk * unit, sb)
            if PREFETCH < 2:
                p0, p1, p2, p3, dx = _x_load(xq_row, xd_row, blk)
            if PREFETCH > 0:  # the next step's block (the next tile's first after a tile's last)
                n_tile = tl.where(last, tile + 1, tile)
                n_row = w_ptr + tl.minimum(n_tile * BLOCK_N + ar, N - 1).to(tl.int64)[:, None] * row_units
                n_blk = tl.where(last, 0, blk + 1)
                n0, n1, n2, n3, n4, n5, n6, n7, n8 = _w_load(FMT, n_row + n_blk * unit, sb)
            if PREFETCH == 2:
                np0, np1, np2, np3, ndx = _x_load(xq_row, xd_row, tl.where(last, 0, blk + 1))
            if PREFETCH > 0:
                if _opaque(g, EMULATE) < g_hi:  # keeps the loads above ahead of the arithmetic (see FENCE)
                    acc = _acc_block(acc, u0, u1, u2, u3, u4, u5, u6, u7, u8, p0, p1, p2, p3, dx, sb,
                                     grid_all, grid_ptr, FMT, BLOCK_M, BLOCK_N, T0, T1, T2, T3, EMULATE,
                                     GRID_SMEM, 8)
            else:
                acc = _acc_block(acc, u0, u1, u2, u3, u4, u5, u6, u7, u8, p0, p1, p2, p3, dx, sb, grid_all,
                                 grid_ptr, FMT, BLOCK_M, BLOCK_N, T0, T1, T2, T3, EMULATE, GRID_SMEM, 8)
            if last | (g == g_hi - 1):  # flush the row tile's partial sums
                offs_n = tile * BLOCK_N + ar
                ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
                tl.atomic_add(ptrs, tl_sum(acc, 2), mask=m_ok & (offs_n < N)[None, :])
                acc = tl.zeros([BLOCK_M, BLOCK_N, 8], dtype=tl.float32)
            if PREFETCH > 0:
                u0, u1, u2, u3, u4, u5, u6, u7, u8 = n0, n1, n2, n3, n4, n5, n6, n7, n8
            if PREFETCH == 2:
                p0, p1, p2, p3, dx = np0, np1, np2, np3, ndx
            tile = tl.where(last, tile + 1, tile)
            blk = tl.where(last, 0, blk + 1)


def _grid_words(device: torch.device) -> torch.Tensor:
    from ninfer.kernels.gguf_matmul import _tables

    return _tables(device)[1]


# (format, tile, warps, prefetch, grid_smem, device) -> programs the whole GPU holds at once (stream-K grid)
_STREAM_SLOTS: dict = {}


def _resident_programs(compiled, device: torch.device, num_warps: int) -> int:
    """How many programs of a compiled kernel all SMs hold at once (registers, shared memory, warp and
    block limits of sm_90); 1 where it cannot be known (the interpreter: one "SM" running one program)."""
    if device.type != "cuda":
        return 1
    props = torch.cuda.get_device_properties(device)
    try:
        regs = max(getattr(compiled, "n_regs", 0), 1)
        shared = getattr(compiled, "metadata", None)
        shared = getattr(shared, "shared", 0) if shared is not None else 0
    except Exception:  # pragma: no cover - a Triton without these attributes: one program per SM
        return props.multi_processor_count
    per_warp = -(-regs * 32 // 256) * 256  # registers are allocated per warp in 256s
    by_regs = (65536 // per_warp) // num_warps
    by_smem = (233472 - 1024) // (shared + 1024) if shared else 32  # 228 KB per SM, 1 KB reserved per block
    per_sm = max(1, min(32, 64 // num_warps, by_regs, by_smem))
    return per_sm * props.multi_processor_count


def _schedule(name: str) -> MatmulSchedule:
    from ninfer.kernels import gguf_matmul

    s = SCHEDULES.get(name) or gguf_matmul.SCHEDULES.get(name)
    if s is None:
        raise QuantKernelError(f"unknown schedule {name!r}; the q8 i-quant schedules are "
                               f"{', '.join(SCHEDULES)}")
    return s


def gemv_q8_iq(raw: torch.Tensor, fmt: str, xa: QuantizedActivation, out_features: int,
               schedule: MatmulSchedule | str | None = None, grid_in_shared: bool = True) -> torch.Tensor:
    """`(q·d) @ Wᵀ -> [n, out_features]` in the activation's dtype for `fmt` iq3_s or iq4_xs (`gguf_` prefix
    allowed), W the rows `raw` (uint8 `[out_features, row_bytes]`), 1–8 activation rows; any q8
    `MatmulSchedule` (ours or gguf_matmul's) or its name; None: `default_iq_schedule`. `grid_in_shared`
    (iq3_s): the grid lookup in shared memory rather than through L1. The float64 reference runs where
    Triton cannot take the weight's device."""
    fmt = fmt.removeprefix(GGUF_PREFIX)
    if fmt not in IQ_Q8_FORMATS:
        raise QuantKernelError(f"the q8 i-quant GEMV decodes {', '.join(IQ_Q8_FORMATS)}, not {fmt}; use "
                               "gemv_q8 or quant_matmul for other formats")
    n, in_features = xa.q.shape
    check_weight(raw, fmt, out_features, in_features)
    if not 1 <= n <= MAX_COLUMNS:
        raise QuantKernelError(f"the q8 i-quant GEMV takes 1–{MAX_COLUMNS} columns, got {n}; use "
                               "quant_matmul's sub_* or dequant_mm schedules for wider inputs")
    if raw.device != xa.q.device:
        raise QuantKernelError(f"weight on {raw.device} but activation on {xa.q.device}; move both to one "
                               "device")
    s = _schedule(schedule) if isinstance(schedule, str) else (
        schedule or default_iq_schedule(fmt, out_features, in_features, n))
    if s.kernel != "q8":
        raise QuantKernelError(f"schedule {s.name} is not a q8 schedule; pick one of {', '.join(SCHEDULES)}")
    if not (HAVE_TRITON and triton_runs_on(raw)):
        return gemv_q8_iq_reference(raw, fmt, xa, out_features, out_dtype=None)
    stream = getattr(s, "stream", 0)
    atomic = s.split_k > 1 or stream > 0
    y = (torch.zeros if atomic else torch.empty)(
        (n, out_features), dtype=torch.float32 if atomic else xa.dtype, device=raw.device)
    units = raw.view(torch.uint16) if fmt == "iq3_s" else raw.view(torch.int32)
    words = xa.q.view(torch.int64)  # 8 codes per unit: two activation words per load
    grid_smem = grid_in_shared and fmt == "iq3_s" and not getattr(s, "grid_l1", False)
    t0, t1, t2, t3 = _IQ4_WORDS
    if stream > 0:
        key = (fmt, s.block_n, s.block_m, s.num_warps, getattr(s, "prefetch", 0), grid_smem, raw.device)
        steps = triton_cdiv(out_features, s.block_n) * (in_features // 256)
        guess = 4 * torch.cuda.get_device_properties(raw.device).multi_processor_count if raw.is_cuda else 1
        launch = (min(steps, _STREAM_SLOTS.get(key, guess) * stream), triton_cdiv(n, s.block_m))
        extra = {} if raw.device.type == "cpu" else {"num_warps": s.num_warps, "num_stages": s.num_stages}
        compiled = _gemv_q8_iq_stream_kernel[launch](
            units, words, xa.d, y, _grid_words(raw.device),
            out_features, in_features, n, units.shape[1], words.stride(0), xa.d.stride(0), y.stride(0),
            FMT=IQ_Q8_FORMATS.index(fmt), BLOCK_N=s.block_n, BLOCK_M=s.block_m, T0=t0, T1=t1, T2=t2, T3=t3,
            EMULATE=EMULATE_DP4A, GRID_SMEM=grid_smem, PREFETCH=getattr(s, "prefetch", 0), **extra)
        if key not in _STREAM_SLOTS:  # the first call's grid was a guess: size the next ones to the GPU
            _STREAM_SLOTS[key] = _resident_programs(compiled, raw.device, s.num_warps)
        return y.to(xa.dtype)
    launch = (triton_cdiv(out_features, s.block_n), triton_cdiv(n, s.block_m), s.split_k)
    extra = {} if raw.device.type == "cpu" else {"num_warps": s.num_warps, "num_stages": s.num_stages}
    _gemv_q8_iq_kernel[launch](
        units, words, xa.d, y, _grid_words(raw.device),
        out_features, in_features, n, units.shape[1], words.stride(0), xa.d.stride(0), y.stride(0),
        FMT=IQ_Q8_FORMATS.index(fmt), BLOCK_N=s.block_n, BLOCK_M=s.block_m, SPLIT_K=s.split_k,
        T0=t0, T1=t1, T2=t2, T3=t3, EMULATE=EMULATE_DP4A,
        GRID_SMEM=grid_smem, PREFETCH=getattr(s, "prefetch", 0), FENCE=getattr(s, "fence", True),
        DEPTH=getattr(s, "depth", 1), KB=getattr(s, "kb", 1),
        SB=8 * getattr(s, "kb", 1), **extra)
    return y.to(xa.dtype)


def gemv_q8_iq3_s(raw: torch.Tensor, xa: QuantizedActivation, out_features: int,
                  schedule: MatmulSchedule | str | None = None, grid_in_shared: bool = True) -> torch.Tensor:
    """`(q·d) @ Wᵀ -> [n, out_features]` in the activation's dtype, W the iq3_s rows `raw` (uint8
    `[out_features, row_bytes]`), 1–8 activation rows. `grid_in_shared`: look the 2 KB grid up in shared
    memory (`tl.gather`; one table copy and barrier pair per block) rather than through L1 (global loads)."""
    return gemv_q8_iq(raw, "iq3_s", xa, out_features, schedule, grid_in_shared)


def gemv_q8_iq4_xs(raw: torch.Tensor, xa: QuantizedActivation, out_features: int,
                   schedule: MatmulSchedule | str | None = None) -> torch.Tensor:
    """As `gemv_q8_iq3_s` for iq4_xs rows."""
    return gemv_q8_iq(raw, "iq4_xs", xa, out_features, schedule)

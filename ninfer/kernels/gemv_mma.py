"""Decode GEMM for 2–16 columns on int8 tensor cores ("mma"): GGUF codes × int8 activations.

The dp4a kernels (`gemv_q8.py`, `gemv_rows.py`) pay one dp4a and one activation load per 4 weights and per
column, so 8 columns cost 5–8× one column on the H200 (docs/gpu-notes.md, session 3) where the weight bytes
are the same. Here a program decodes a `[BLOCK_N rows, 32 codes]` int8 tile of one sub-block once and
multiplies it with the `[32, BLOCK_M columns]` int8 activation tile in one `tl.dot` (int32 accumulate:
mma.sync m16n8k32 on sm_80+, wgmma on sm_90), then applies the sub-block's weight scale and the activation's
per-32 scale to the int32 tile in fp32:

    y[n, m] += d·sc_j[n] · (Σ_k q[n, k]·xq[m, k]) · xd_j[m] − dmin·mn_j[n] · xs_j[m]

(xs = xd·Σxq, the min term of q4_k / q5_k). Columns cost tensor-core throughput and an fp32 epilogue per
(row, column, sub-block), not a dp4a per 4 weights; the weight decode is shared by every column.

Formats: q4_k, q5_k (sub-blocks of 32: low and high nibbles of a 32-byte qs run, q5_k's fifth bit from qh,
unpacked four bytes per PTX operation), q6_k (6-bit codes − 32 built four bytes per operation; its scales
cover 16 codes, so each sub-block takes two dots, the activation tile's other half zeroed) and iq3_s (8 grid
words of 4 magnitudes per sub-block, signs applied to whole words, the bytes joined into the tile in
registers). A program's sub-blocks run one after another (~340 ns each on the H200: operand staging, dot,
epilogue), waiting on their L1 loads (Nsight Compute, session 6), so the routed schedules are the ones with
the most programs: 16-32 rows, split-K 4-8, block-wide preloads, at 9-16 columns the batched kernels (a
super-block's sub-blocks in one 3-D dot); docs/gpu-notes.md, sessions 5-6: q4_k 17408×5120 at 4 / 8 / 16
columns 39.7 / 45.8 / 67.0 µs where one column takes 21.5 on the rows kernel.
The oracle is `gemv_q8_reference` (dequantised weight × dequantised int8 activation, float64).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ninfer.kernels.gemv_q8 import EMULATE_DP4A, QuantizedActivation
from ninfer.kernels.gemv_rows import rows_setup
from ninfer.kernels.gguf_matmul import MatmulSchedule, _f16_lo, _small_float, iq3s_grid16, iq3s_grid_word
from ninfer.kernels.triton_support import HAVE_TRITON, jit, tl
from ninfer.quant.formats import GGUF_PREFIX

MMA_FORMATS = ("q4_k", "q5_k", "q6_k", "iq3_s")
_FMT = {"q4_k": 4, "q5_k": 5, "q6_k": 6, "iq3_s": 33}
MAX_COLUMNS = 16
_HEADER_WORD = {"q4_k": torch.int32, "q5_k": torch.int32, "q6_k": torch.int16, "iq3_s": torch.int16}


@dataclass(frozen=True)
class MmaSchedule(MatmulSchedule):
    """`block_n` weight rows × `block_m` columns (8 or 16: n of the int8 mma) per program, split-K
    over the row's super-blocks (fp32 atomics), evict-first weight loads where `evict_first`, block-wide
    preloads where `preload`, the batched kernels (q4_k / q5_k / iq3_s: a super-block in 3-D dots) where
    `batched`."""

    evict_first: bool = False
    preload: bool = False
    batched: bool = False


def _sched(block_n: int, block_m: int, num_warps: int, split_k: int = 1, stages: int = 1,
           ef: bool = False, pl: bool = False, b3: bool = False) -> MmaSchedule:
    name = (f"mma_n{block_n}_m{block_m}_w{num_warps}" + (f"_s{split_k}" if split_k > 1 else "")
            + (f"_p{stages}" if stages > 1 else "") + ("_ef" if ef else "") + ("_pl" if pl else "")
            + ("_b3" if b3 else ""))
    return MmaSchedule(name, "mma", block_n, block_m, split_k=split_k, num_warps=num_warps, num_stages=stages,
                       evict_first=ef, preload=pl, batched=b3)


SCHEDULES: dict[str, MmaSchedule] = {
    s.name: s
    for s in (
        # the H200 sweeps (bench/rows_timing.py, session 5): a program's sub-blocks run one after another
        # (~340 ns each), so the most programs win: 16-32 rows, split-K 4-8, block-wide preloads ("_pl": a
        # super-block's weight runs, activation tiles and scales loaded before its first dot). Routed:
        _sched(32, 8, 2, split_k=8, pl=True),  # q4_k / q5_k, 3-8 columns
        _sched(32, 16, 2, split_k=4, stages=3, pl=True),  # q5_k, 9-16 columns
        _sched(32, 8, 2, split_k=4, pl=True),  # q6_k, 3-8 columns
        _sched(64, 16, 4, split_k=8),  # q6_k, 9-16 columns
        _sched(16, 8, 1, split_k=4),  # iq3_s, 2-8 columns
        # within 10 % of the routed ones somewhere (kept for the next sweeps). Lost everywhere and gone:
        # 64-128-row tiles without split-K (2-3× slower), evict-first loads, 16-row tiles for the k-quants,
        # 16-column tiles with split-K 8, 2-3 pipeline stages at 8 columns (iq3_s: 2× slower); in session 6
        # the iq3_s grid gathered from shared memory (tl.gather: 13-30 % slower at 2-16 columns)
        _sched(32, 16, 2, split_k=4),
        _sched(32, 8, 2, split_k=2),
        _sched(32, 8, 2, split_k=2, pl=True),
        _sched(32, 8, 2, split_k=8, stages=3, pl=True),
        _sched(32, 16, 2, split_k=4, pl=True),
        _sched(64, 16, 4, split_k=4, pl=True),
        _sched(64, 16, 4, stages=3),
        # the batched kernels (one `[4, rows, 32]` load and two 3-D dots per q4_k / q5_k block; iq3_s's 8
        # code tiles as one `[8, rows, 32]` tensor). Timed in session 6: the routed 9-16-column tile of q4_k
        # (17408×5120: 67.0 vs 73.5 µs) and iq3_s (83.7 vs 108.3); at 2-8 columns within ±10 % of the
        # routes (not the 25 / 40 µs predicted from the SASS: the tiles wait on the L1, not on round trips)
        _sched(32, 16, 2, split_k=4, b3=True),  # q4_k / iq3_s, 9-16 columns
        _sched(32, 8, 2, split_k=8, b3=True),
        _sched(32, 8, 2, split_k=4, b3=True),
        _sched(16, 8, 1, split_k=8, b3=True),
        _sched(64, 16, 4, split_k=4, b3=True),
        _sched(16, 8, 1, split_k=4, b3=True),
    )
}
BATCHED_FORMATS = ("q4_k", "q5_k", "iq3_s")


def schedules_for(fmt: str) -> dict[str, MmaSchedule]:
    """The schedules that run `fmt` (the batched ones take q4_k, q5_k and iq3_s)."""
    fmt = fmt.removeprefix(GGUF_PREFIX)
    if fmt not in MMA_FORMATS:
        return {}
    return {name: s for name, s in SCHEDULES.items() if not s.batched or fmt in BATCHED_FORMATS}


# the routed tile up to 8 columns and up to 16, by format
_ROUTE = {"q4_k": ("mma_n32_m8_w2_s8_pl", "mma_n32_m16_w2_s4_b3"),
          "q5_k": ("mma_n32_m8_w2_s8_pl", "mma_n32_m16_w2_s4_p3_pl"),
          "q6_k": ("mma_n32_m8_w2_s4_pl", "mma_n64_m16_w4_s8"),
          "iq3_s": ("mma_n16_m8_w1_s4", "mma_n32_m16_w2_s4_b3")}
# the fewest columns where the tile beats the dp4a routes
_MIN_COLUMNS = {"q4_k": 3, "q5_k": 3, "q6_k": 3, "iq3_s": 2}


def mma_wins(fmt: str, out_features: int, in_features: int, columns: int) -> bool:
    """Where the tensor-core tile beats the dp4a routes (rows, q8) on the H200 (bench/rows_timing.py at the
    27B shapes): wherever the rows kernels have no route (`rows_route`, `rows_iq_route`: since session 7 they
    win at 1-4 columns everywhere and at 5-8 columns except q4_k / iq3_s on the biggest matrices, e.g. q4_k
    17408×5120 at 8 columns 45.3 vs 46.7 µs, iq3_s 63.3 vs 71.0), on matrices of ≥ 4096 rows from
    `_MIN_COLUMNS` columns on (q6_k at 4 / 8 columns 93.6 / 95.0 vs 100.5 / 147.7 µs; the q6_k output head
    1155 / 1185 vs 1231 / 1683) and at 9-16 columns (session 6's batched tiles: q4_k 67.0 and iq3_s 83.7 µs
    on 17408×5120)."""
    from ninfer.kernels.gemv_rows import rows_route
    from ninfer.kernels.gemv_rows_iq import rows_iq_route

    if rows_route(fmt, out_features, in_features, columns) or rows_iq_route(fmt, out_features, in_features,
                                                                            columns):
        return False
    return out_features >= 4096 and columns >= _MIN_COLUMNS[fmt]


def mma_route(fmt: str, out_features: int, in_features: int, columns: int,
              forced: bool = False) -> MmaSchedule | None:
    """The tensor-core schedule for a decode GEMM of 2–16 columns where it wins (`mma_wins`; everywhere it
    applies when `forced`: NINFER_GEMV=mma), None where the kernel does not apply or loses."""
    fmt = fmt.removeprefix(GGUF_PREFIX)
    if fmt not in MMA_FORMATS or in_features % 256 or not 2 <= columns <= MAX_COLUMNS:
        return None
    if not forced and not mma_wins(fmt, out_features, in_features, columns):
        return None
    return SCHEDULES[_ROUTE[fmt][columns > 8]]


if HAVE_TRITON:
    from ninfer.kernels.gemv_rows import _ldw, _step_range, _store

    @jit
    def _tile(N, M, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr):
        """A program's weight rows n and columns m, and both clamped to the last one (the loads need no
        masks; `_store` masks the sums)."""
        n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        return n, m, tl.minimum(n, N - 1).to(tl.int64), tl.minimum(m, M - 1).to(tl.int64)

    @jit
    def _nibbles(q, HIGH: tl.constexpr, EMULATE: tl.constexpr):
        """The low (or high) nibbles of uint8 codes q as int8, four bytes per 32-bit operation (PTX on packed
        registers: elementwise ops on 8-bit tensors would cost one instruction per byte)."""
        if EMULATE:
            return ((q >> (4 * HIGH)) & 0x0F).to(tl.int8)
        elif HIGH:
            return tl.inline_asm_elementwise("{ .reg .b32 t; shr.b32 t, $1, 4; and.b32 $0, t, 0x0F0F0F0F; }",
                                             "=r,r", [q], dtype=tl.int8, is_pure=True, pack=4)
        else:
            return tl.inline_asm_elementwise("and.b32 $0, $1, 0x0F0F0F0F;", "=r,r", [q], dtype=tl.int8,
                                             is_pure=True, pack=4)

    @jit
    def _fifth_bit(codes, qh, BIT: tl.constexpr, EMULATE: tl.constexpr):
        """q5_k: codes | (bit BIT of the qh bytes) << 4, four bytes per operation."""
        if EMULATE:
            return codes | (((qh >> BIT) & 1) << 4).to(tl.int8)
        else:
            return tl.inline_asm_elementwise(
                f"{{ .reg .b32 t; shr.b32 t, $2, {BIT}; and.b32 t, t, 0x01010101; shl.b32 t, t, 4; "
                "or.b32 $0, $1, t; }", "=r,r,r", [codes, qh], dtype=tl.int8, is_pure=True, pack=4)

    @jit
    def _q6k_codes(ql, qh, NIB: tl.constexpr, SHIFT: tl.constexpr, EMULATE: tl.constexpr):
        """q6_k: the signed codes (nibble NIB of ql | 2 bits of qh at SHIFT << 4) − 32 as int8, four bytes
        per operation: for a 6-bit code c, c − 32 is c & 31 where bit 5 is set, else c | 0xE0."""
        if EMULATE:
            code = ((ql >> (4 * NIB)) & 0x0F) | (((qh >> SHIFT) & 3) << 4)
            return (code.to(tl.int32) - 32).to(tl.int8)
        else:
            return tl.inline_asm_elementwise(
                f"{{ .reg .b32 a, b; shr.b32 a, $1, {4 * NIB}; and.b32 a, a, 0x0F0F0F0F; "
                f"shr.b32 b, $2, {SHIFT}; and.b32 b, b, 0x03030303; shl.b32 b, b, 4; or.b32 a, a, b; "
                "not.b32 b, a; shr.b32 b, b, 5; and.b32 b, b, 0x01010101; mul.lo.u32 b, b, 0xE0; "
                "and.b32 a, a, 0x1F1F1F1F; or.b32 $0, a, b; }",
                "=r,r,r", [ql, qh], dtype=tl.int8, is_pure=True, pack=4)

    @jit
    def _byte_float(word, i: tl.constexpr):
        """float32 of byte i of an int32 word."""
        return _small_float((word >> (8 * i)) & 0xFF)

    @jit
    def _iq3s_signed(words, bits):
        """Grid words of 4 magnitudes with their 4 sign bits applied: the bits spread to a byte mask M
        (× 0x00204081 puts bit i at bit 8i, × 0xFE fills the byte but bit 0), then w ^ M negates the marked
        bytes (the magnitudes are odd, and an odd byte xor 0xFE is its negation)."""
        return words ^ (((bits * 0x00204081) & 0x01010101) * 0xFE)

    @jit
    def _iq3s_codes(rb, rb16, g: tl.constexpr, grid_ptr, BLOCK_N: tl.constexpr):
        """The signed codes of iq3_s sub-block g as an int8 `[BLOCK_N, 32]` tile (rb / rb16: each row's block
        start as bytes / int16). Pair i of groups 2i, 2i + 1: one int16 of qs bytes, qh bits 2i and 2i + 1,
        one sign byte (low nibble group 2i); everything on [BLOCK_N, 4] tensors, then the bytes joined in
        registers (no layout conversion) so that code 8i + 4j + e is byte e of group 2i + j."""
        i4 = tl.arange(0, 4)[None, :]
        qs = tl.load(rb16[:, None] + (1 + 4 * g) + i4).to(tl.int32)
        qh = (tl.load(rb16[:, None] + (33 + g // 2) + i4 * 0).to(tl.int32) >> (8 * (g % 2) + 2 * i4)) & 3
        sb = tl.load(rb[:, None] + (74 + 4 * g) + i4).to(tl.int32)
        lo = _iq3s_signed(iq3s_grid_word(grid_ptr, (qs & 0xFF) | ((qh & 1) << 8)), sb & 0xF)
        hi = _iq3s_signed(iq3s_grid_word(grid_ptr, ((qs >> 8) & 0xFF) | ((qh & 2) << 7)), (sb >> 4) & 0xF)
        c0 = tl.join(lo.to(tl.int8), hi.to(tl.int8))  # [n, i, j]: byte 0 of group 2i + j
        c1 = tl.join((lo >> 8).to(tl.int8), (hi >> 8).to(tl.int8))
        c2 = tl.join((lo >> 16).to(tl.int8), (hi >> 16).to(tl.int8))
        c3 = tl.join((lo >> 24).to(tl.int8), (hi >> 24).to(tl.int8))
        # [n, i, j, p, q] = byte 2p + q of group 2i + j
        return tl.reshape(tl.join(tl.join(c0, c2), tl.join(c1, c3)), [BLOCK_N, 32])

    @jit
    def _eight(ptrs, STEP: tl.constexpr):
        """The loads at ptrs, ptrs + STEP, ..., ptrs + 7·STEP (a super-block's 8 sub-block scales, or its 8
        activation tiles with STEP 32), issued together."""
        return (tl.load(ptrs), tl.load(ptrs + STEP), tl.load(ptrs + 2 * STEP), tl.load(ptrs + 3 * STEP),
                tl.load(ptrs + 4 * STEP), tl.load(ptrs + 5 * STEP), tl.load(ptrs + 6 * STEP),
                tl.load(ptrs + 7 * STEP))

    @jit
    def _iq3s_block(rb, rb16, grid_ptr, BLOCK_N: tl.constexpr):
        """The 8 sub-blocks' code tiles of an iq3_s super-block, their gathers issued together."""
        return (_iq3s_codes(rb, rb16, 0, grid_ptr, BLOCK_N), _iq3s_codes(rb, rb16, 1, grid_ptr, BLOCK_N),
                _iq3s_codes(rb, rb16, 2, grid_ptr, BLOCK_N), _iq3s_codes(rb, rb16, 3, grid_ptr, BLOCK_N),
                _iq3s_codes(rb, rb16, 4, grid_ptr, BLOCK_N), _iq3s_codes(rb, rb16, 5, grid_ptr, BLOCK_N),
                _iq3s_codes(rb, rb16, 6, grid_ptr, BLOCK_N), _iq3s_codes(rb, rb16, 7, grid_ptr, BLOCK_N))

    @jit
    def _mma_kernel(w_ptr, wh_ptr, grid_ptr, xq_ptr, xd_ptr, xs_ptr, y_ptr, N, K, M, row_bytes, stride_ym,
                    FMT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, SPLIT_K: tl.constexpr,
                    EF: tl.constexpr, PL: tl.constexpr, EMULATE: tl.constexpr):
        """One program: BLOCK_N rows × BLOCK_M columns over its split of the super-blocks. Rows and columns
        past the end are clamped (they read the last one; their sums are not stored), so the loop has no
        masks. Per (row, column, sub-block) the epilogue is one int→float conversion, one multiply by the
        activation scale and one FMA by the weight scale; the k-quant min terms go to a second accumulator.
        FMT 4 / 5: q4_k / q5_k (wh_ptr the weight as int32 words); 6: q6_k (wh_ptr as int16); 33: iq3_s
        (wh_ptr as int16, grid_ptr its packed 512 entries, `iq3s_grid16`). PL: each super-block's activation
        tiles and scales, and its weight runs (iq3_s: its code tiles), are loaded before the first dot, not
        one sub-block at a time."""
        # bytes per block
        WB: tl.constexpr = 144 if FMT == 4 else (176 if FMT == 5 else (210 if FMT == 6 else 110))
        QS: tl.constexpr = 16 if FMT == 4 else 48  # first qs byte (k-quants)
        CACHE: tl.constexpr = 2 if EF else 0  # k-quant weight loads: evict-first or default
        n, m, nc, mc = _tile(N, M, BLOCK_N, BLOCK_M)
        k = tl.arange(0, 32)
        w_at = w_ptr + nc[:, None] * row_bytes + k[None, :]  # [BLOCK_N, 32] bytes of a run
        h_at = wh_ptr + nc * (row_bytes // 4)  # header words of each row (k-quants)
        x_at = xq_ptr + mc[None, :] * K + k[:, None]  # [32, BLOCK_M] codes of a sub-block, k fastest
        s_at = mc * (K // 32)
        s0, s1 = _step_range(K, 1, SPLIT_K)
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        mins = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        for blk in range(s0, s1):
            if PL:
                xts = _eight(x_at + blk * 256, 32)
                xds = _eight(xd_ptr + s_at + blk * 8, 1)
            if FMT == 6:
                wb = w_at + blk * WB
                hb = wh_ptr + nc * (row_bytes // 2) + blk * (WB // 2)  # int16 view (2-byte aligned blocks)
                d = tl.load(hb + 104).to(tl.float16, bitcast=True).to(tl.float32)
                sb = w_ptr + nc * row_bytes + blk * WB + 192  # 16 signed scales, one per 16 codes
                if PL:
                    qls = (tl.load(wb), tl.load(wb + 32), tl.load(wb + 64), tl.load(wb + 96))
                    qhs = (tl.load(wb + 128), tl.load(wb + 160))
                for h in tl.static_range(2):
                    if PL:
                        qh = qhs[h]
                    else:
                        qh = tl.load(wb + (128 + 32 * h))
                    for r in tl.static_range(2):
                        if PL:
                            ql = qls[2 * h + r]
                        else:
                            ql = tl.load(wb + (64 * h + 32 * r))
                        for nib in tl.static_range(2):
                            # sub-block j = 4h + q of quarter q = 2·nib + r: ql run r, nibble nib, qh bits 2q
                            codes = _q6k_codes(ql, qh, nib, 2 * (2 * nib + r), EMULATE)
                            if PL:
                                xt, xd = xts[4 * h + 2 * nib + r], xds[4 * h + 2 * nib + r]
                            else:
                                xt = tl.load(x_at + (blk * 256 + 32 * (4 * h + 2 * nib + r)))
                                xd = tl.load(xd_ptr + s_at + (blk * 8 + 4 * h + 2 * nib + r))
                            first = k[:, None] < 16  # the two halves have their own scales: two dots
                            lo = tl.dot(codes, tl.where(first, xt, 0), out_dtype=tl.int32)
                            hi = tl.dot(codes, tl.where(first, 0, xt), out_dtype=tl.int32)
                            j2 = 2 * (4 * h + 2 * nib + r)
                            sc_lo = tl.load(sb + j2).to(tl.int8).to(tl.float32)
                            sc_hi = tl.load(sb + (j2 + 1)).to(tl.int8).to(tl.float32)
                            part = lo.to(tl.float32) * sc_lo[:, None] + hi.to(tl.float32) * sc_hi[:, None]
                            acc += (part * xd[None, :]) * d[:, None]
            elif FMT == 33:
                rb = w_ptr + nc * row_bytes + blk * WB
                rb16 = wh_ptr + nc * (row_bytes // 2) + blk * (WB // 2)  # int16 view (2-byte aligned blocks)
                d = tl.load(rb16).to(tl.float16, bitcast=True).to(tl.float32)
                if PL:
                    tiles = _iq3s_block(rb, rb16, grid_ptr, BLOCK_N)
                for g in tl.static_range(8):
                    if PL:
                        codes, xt, xd = tiles[g], xts[g], xds[g]
                    else:
                        codes = _iq3s_codes(rb, rb16, g, grid_ptr, BLOCK_N)
                        xt = tl.load(x_at + (blk * 256 + 32 * g))
                        xd = tl.load(xd_ptr + s_at + (blk * 8 + g))
                    dot = tl.dot(codes, xt, out_dtype=tl.int32)
                    nib = (tl.load(rb + (106 + g // 2)).to(tl.int32) >> (4 * (g % 2))) & 0xF
                    acc += (dot.to(tl.float32) * xd[None, :]) * (d * (2 * nib + 1).to(tl.float32))[:, None]
            else:
                wb = w_at + blk * WB
                hb = h_at + blk * (WB // 4)
                h0 = _ldw(hb, 0, True, CACHE)
                h1 = _ldw(hb + 1, 0, True, CACHE)
                h2 = _ldw(hb + 2, 0, True, CACHE)
                h3 = _ldw(hb + 3, 0, True, CACHE)
                d = _f16_lo(h0)
                dmin = _f16_lo(h0 >> 16)
                # the 6-bit scales and mins of sub-blocks 0-3 and 4-7, one byte each, four per word
                sc_words = (h1 & 0x3F3F3F3F, (h3 & 0x0F0F0F0F) | ((h1 >> 2) & 0x30303030))
                mn_words = (h2 & 0x3F3F3F3F, ((h3 >> 4) & 0x0F0F0F0F) | ((h2 >> 2) & 0x30303030))
                if FMT == 5:
                    qh = _ldw(wb + 16, 0, True, CACHE)
                if PL:
                    runs = (_ldw(wb + QS, 0, True, CACHE), _ldw(wb + (QS + 32), 0, True, CACHE),
                            _ldw(wb + (QS + 64), 0, True, CACHE), _ldw(wb + (QS + 96), 0, True, CACHE))
                    xss = _eight(xs_ptr + s_at + blk * 8, 1)
                for c in tl.static_range(4):
                    if PL:
                        q = runs[c]
                    else:
                        q = _ldw(wb + (QS + 32 * c), 0, True, CACHE)
                    for half in tl.static_range(2):
                        codes = _nibbles(q, half, EMULATE)
                        if FMT == 5:
                            codes = _fifth_bit(codes, qh, 2 * c + half, EMULATE)
                        if PL:  # sub-block 2c + half
                            xt, xd, xs = xts[2 * c + half], xds[2 * c + half], xss[2 * c + half]
                        else:
                            xt = tl.load(x_at + (blk * 256 + 64 * c + 32 * half))
                            xd = tl.load(xd_ptr + s_at + (blk * 8 + 2 * c + half))
                            xs = tl.load(xs_ptr + s_at + (blk * 8 + 2 * c + half))
                        dot = tl.dot(codes, xt, out_dtype=tl.int32)
                        sc = _byte_float(sc_words[c // 2], (2 * c + half) % 4)
                        mn = _byte_float(mn_words[c // 2], (2 * c + half) % 4)
                        acc += (dot.to(tl.float32) * xd[None, :]) * (d * sc)[:, None]
                        mins += (dmin * mn)[:, None] * xs[None, :]
        _store(y_ptr, acc - mins, m[None, :], n[:, None], M, N, stride_ym, SPLIT_K)

    @jit
    def _k_scales(hb8, j):
        """The 6-bit scales and mins of q4_k / q5_k sub-blocks j (an int32 tensor broadcast against hb8, the
        rows' block-start byte pointers), as float32: for j < 4 the low 6 bits of bytes 4 + j and 8 + j,
        else the nibbles of byte 8 + j with the top 2 bits of bytes j and 4 + j (12 scale bytes from 4)."""
        qa = tl.load(hb8 + 4 + j).to(tl.int32)  # byte j of the 12
        qb = tl.load(hb8 + 8 + j).to(tl.int32)  # byte j + 4
        qc = tl.load(hb8 + 4 + (j % 4)).to(tl.int32)  # byte j - 4 where j >= 4
        low = j < 4
        sc = tl.where(low, qa & 63, (qb & 0xF) | ((qc >> 6) << 4))
        mn = tl.where(low, qb & 63, (qb >> 4) | ((qa >> 6) << 4))
        return _small_float(sc), _small_float(mn)

    @jit
    def _batched_kernel(w_ptr, wh_ptr, xq_ptr, xd_ptr, xs_ptr, y_ptr, N, K, M, row_bytes, stride_ym,
                        FMT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
                        SPLIT_K: tl.constexpr, EMULATE: tl.constexpr):
        """`_mma_kernel` for q4_k (FMT 4) / q5_k (5) with a super-block in two 3-D dots: its 128 qs bytes
        loaded as one `[4 runs, BLOCK_N, 32]` tile, the low nibbles of run c (sub-block 2c) and the high ones
        (2c + 1) each multiplied with their `[4, 32, BLOCK_M]` activation tiles (batched int8 mma, int32), the
        sub-block scales `[4, BLOCK_N]` and activation scales `[4, BLOCK_M]` applied into a `[4, BLOCK_N,
        BLOCK_M]` accumulator, summed over the runs after the last block. wh_ptr: the weight as int32 words
        (the header's d and dmin)."""
        WB: tl.constexpr = 144 if FMT == 4 else 176
        QS: tl.constexpr = 16 if FMT == 4 else 48
        n, m, nc, mc = _tile(N, M, BLOCK_N, BLOCK_M)
        c4 = tl.arange(0, 4)
        c3 = c4[:, None, None]
        k = tl.arange(0, 32)
        rows = w_ptr + nc * row_bytes  # [BLOCK_N]
        q_at = rows[None, :, None] + QS + 32 * c3 + k[None, None, :]  # [4, BLOCK_N, 32]: run c of each row
        x_at = xq_ptr + mc[None, None, :] * K + 64 * c3 + k[None, :, None]  # [4, 32, BLOCK_M]: sub-block 2c
        s_at = mc[None, :] * (K // 32) + 2 * c4[:, None]  # [4, BLOCK_M]: scales of sub-block 2c
        s0, s1 = _step_range(K, 1, SPLIT_K)
        acc = tl.zeros([4, BLOCK_N, BLOCK_M], dtype=tl.float32)  # summed over the runs once, at the end
        for blk in range(s0, s1):
            # every load of the block first, the weight runs last: Triton stages each dot operand through
            # shared memory right after its load, and a load placed after that staging's barrier waits
            x_lo = tl.load(x_at + blk * 256)
            x_hi = tl.load(x_at + (blk * 256 + 32))
            hb8 = rows[None, :] + blk * WB  # [1, BLOCK_N]
            h = tl.load(wh_ptr + nc * (row_bytes // 4) + blk * (WB // 4))  # d, dmin: two f16
            sc_lo, mn_lo = _k_scales(hb8, 2 * c4[:, None])  # [4, BLOCK_N]
            sc_hi, mn_hi = _k_scales(hb8, 2 * c4[:, None] + 1)
            xd_lo = tl.load(xd_ptr + s_at + blk * 8)  # [4, BLOCK_M]
            xd_hi = tl.load(xd_ptr + s_at + (blk * 8 + 1))
            xs_lo = tl.load(xs_ptr + s_at + blk * 8)
            xs_hi = tl.load(xs_ptr + s_at + (blk * 8 + 1))
            if FMT == 5:
                qh = tl.load(rows[None, :, None] + blk * WB + 16 + k[None, None, :]).to(tl.int32)
            q = tl.load(q_at + blk * WB)
            lo = _nibbles(q, 0, EMULATE)
            hi = _nibbles(q, 1, EMULATE)
            if FMT == 5:  # fifth bits: bit 2c (low) and 2c + 1 (high) of the 32 qh bytes
                lo = lo | (((qh >> (2 * c3)) & 1) << 4).to(tl.int8)
                hi = hi | (((qh >> (2 * c3 + 1)) & 1) << 4).to(tl.int8)
            dot_lo = tl.dot(lo, x_lo, out_dtype=tl.int32)  # [4, BLOCK_N, BLOCK_M]
            dot_hi = tl.dot(hi, x_hi, out_dtype=tl.int32)
            d = _f16_lo(h)
            dmin = _f16_lo(h >> 16)
            acc += (dot_lo.to(tl.float32) * xd_lo[:, None, :] * (d * sc_lo)[:, :, None]
                    + dot_hi.to(tl.float32) * xd_hi[:, None, :] * (d * sc_hi)[:, :, None]
                    - (dmin * mn_lo)[:, :, None] * xs_lo[:, None, :]
                    - (dmin * mn_hi)[:, :, None] * xs_hi[:, None, :])
        _store(y_ptr, tl.sum(acc, 0), m[None, :], n[:, None], M, N, stride_ym, SPLIT_K)

    @jit
    def _batched_iq3s_kernel(w_ptr, wh_ptr, grid_ptr, xq_ptr, xd_ptr, y_ptr, N, K, M, row_bytes, stride_ym,
                             BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, SPLIT_K: tl.constexpr):
        """iq3_s with a super-block in one 3-D dot: its 8 sub-blocks' code tiles built as one
        `[8, BLOCK_N, 32]` tensor (64 grid words gathered at once, signed whole, their bytes joined in
        registers) times the `[8, 32, BLOCK_M]` activation tiles, scaled into a `[8, BLOCK_N, BLOCK_M]`
        accumulator summed after the last block. Every load of a block is written before the gathers and the
        dot, so it is issued before the first shared-memory barrier. wh_ptr: the weight as int16 (d)."""
        WB: tl.constexpr = 110
        n, m, nc, mc = _tile(N, M, BLOCK_N, BLOCK_M)
        g = tl.arange(0, 8)[:, None, None]  # sub-block
        i = tl.arange(0, 4)[None, None, :]  # pair of grid words 2i, 2i + 1 (8 codes) of a sub-block
        k = tl.arange(0, 32)
        rows = (w_ptr + nc * row_bytes)[None, :, None]  # [1, BLOCK_N, 1]
        rows16 = (wh_ptr + nc * (row_bytes // 2))[None, :, None]
        x_at = xq_ptr + mc[None, None, :] * K + 32 * g + k[None, :, None]  # [8, 32, BLOCK_M]
        s_at = mc[None, None, :] * (K // 32) + g  # [8, 1, BLOCK_M]
        s0, s1 = _step_range(K, 1, SPLIT_K)
        acc = tl.zeros([8, BLOCK_N, BLOCK_M], dtype=tl.float32)
        for blk in range(s0, s1):
            rb = rows + blk * WB
            rb16 = rows16 + blk * (WB // 2)
            xt = tl.load(x_at + blk * 256)
            xd = tl.load(xd_ptr + s_at + blk * 8)
            d = tl.load(rb16).to(tl.float16, bitcast=True).to(tl.float32)  # [1, BLOCK_N, 1]
            nib = (tl.load(rb + 106 + g // 2).to(tl.int32) >> (4 * (g % 2))) & 0xF  # [8, BLOCK_N, 1]
            qs = tl.load(rb16 + 1 + 4 * g + i).to(tl.int32)  # [8, BLOCK_N, 4]: indices 2i, 2i + 1, low 8 bits
            qh = (tl.load(rb16 + 33 + g // 2).to(tl.int32) >> (8 * (g % 2) + 2 * i)) & 3  # their 9th bits
            sb = tl.load(rb + 74 + 4 * g + i).to(tl.int32)  # their sign bits (low nibble: word 2i)
            lo = _iq3s_signed(iq3s_grid_word(grid_ptr, (qs & 0xFF) | ((qh & 1) << 8)), sb & 0xF)
            hi = _iq3s_signed(iq3s_grid_word(grid_ptr, ((qs >> 8) & 0xFF) | ((qh & 2) << 7)), (sb >> 4) & 0xF)
            c0 = tl.join(lo.to(tl.int8), hi.to(tl.int8))  # [8, n, i, j]: byte 0 of word 2i + j
            c1 = tl.join((lo >> 8).to(tl.int8), (hi >> 8).to(tl.int8))
            c2 = tl.join((lo >> 16).to(tl.int8), (hi >> 16).to(tl.int8))
            c3 = tl.join((lo >> 24).to(tl.int8), (hi >> 24).to(tl.int8))
            # [8, n, i, j, p, q] = byte 2p + q of word 2i + j: code 8i + 4j + 2p + q
            codes = tl.reshape(tl.join(tl.join(c0, c2), tl.join(c1, c3)), [8, BLOCK_N, 32])
            dot = tl.dot(codes, xt, out_dtype=tl.int32)  # [8, BLOCK_N, BLOCK_M]
            acc += dot.to(tl.float32) * xd * (d * (2 * nib + 1).to(tl.float32))
        _store(y_ptr, tl.sum(acc, 0), m[None, :], n[:, None], M, N, stride_ym, SPLIT_K)


def gemv_mma(raw: torch.Tensor, format: str, xa: QuantizedActivation, out_features: int,
             schedule: MmaSchedule | str) -> torch.Tensor:
    """`(q·d) @ Wᵀ -> [n, out_features]` in `xa.dtype`, W the GGUF rows `raw` (uint8 `[N, row_bytes]`, one of
    MMA_FORMATS) and xa the int8 activation; the kernel runs on `raw`'s device (CUDA, or CPU under the
    interpreter)."""
    format = format.removeprefix(GGUF_PREFIX)
    s = SCHEDULES[schedule] if isinstance(schedule, str) else schedule
    n, k = xa.q.shape
    formats = BATCHED_FORMATS if s.batched else MMA_FORMATS
    y, launch, extra = rows_setup(raw, format, xa, out_features, s, formats, "int8 tensor-core GEMM")
    # header words: int32 for q4_k / q5_k, int16 for q6_k / iq3_s (2-byte aligned blocks)
    words = raw.view(_HEADER_WORD[format])
    tile = dict(FMT=_FMT[format], BLOCK_N=s.block_n, BLOCK_M=s.block_m, SPLIT_K=s.split_k,
                EMULATE=EMULATE_DP4A, **extra)
    if s.batched and format == "iq3_s":
        del tile["FMT"], tile["EMULATE"]
        _batched_iq3s_kernel[launch](raw, words, iq3s_grid16(raw.device), xa.q, xa.d, y, out_features, k, n,
                                     raw.shape[1], y.stride(0), **tile)
    elif s.batched:
        _batched_kernel[launch](raw, words, xa.q, xa.d, xa.s, y, out_features, k, n, raw.shape[1],
                                y.stride(0), **tile)
    else:
        _mma_kernel[launch](raw, words, iq3s_grid16(raw.device), xa.q, xa.d, xa.s, y, out_features, k, n,
                            raw.shape[1], y.stride(0), EF=s.evict_first, PL=s.preload, **tile)
    return y.to(xa.dtype)

"""Decode GEMV whose warps read weight rows contiguously ("rows"), int8 activations and `dp4a` (q4_k, q5_k).

The q8 kernels of `gemv_q8.py` give each thread one (row, 64-code chunk) and read it as strided int64 words.
Here a warp's lanes cover consecutive blocks of a row and read them as 16-byte vectors; on the H200 both
designs turned out bound by the SM's L1 load pipeline (ncu: L1/TEX throughput 84–91 %, DRAM 45–48 %), so what
counts is how many bytes each lane re-reads through L1 per weight (activation, block header, scales), and
the rows kernel wins by sharing those loads across rows and columns (docs/gpu-notes.md, session 3). Session
7 measured the loads alone (`bench/load_probe.py`): the weights' lane map hardly matters, the activation
re-reads cost as much as half the weight stream, so 2-4 rows per lane share each activation load.

Two lane maps, every load built at the full tile shape (zero strides where a value does not depend on an
axis) so that all loads share one register layout and no layout conversion runs in the loop; rows and
columns past the end are clamped (not masked), and whole steps of NB blocks need no masks at all (EVEN):

* "chunk" (`_gemv_rows_kernel`): 4 lanes per block, lane c takes the 64 codes of chunk c — two 16-byte qs
  vectors (words e and 4 + e: low nibbles sub-block 2c, high nibbles 2c + 1), the 16-byte header, 4 dp4a per
  vector and column, its two sub-blocks' scales decoded once. Tile `[chunk, block, row group g, row r of a
  group, column, word]`: lanes and warps on (chunk, block, g), R rows of a group and all columns in
  registers, so one activation load serves R rows and one weight decode serves every column.
* "piece" (`_gemv_rows_p_kernel`): 8 lanes per block, lane p reads qs bytes 16p..16p + 15 (chunk p // 2,
  half p % 2), all rows and columns in registers; the min terms are counted by the half-0 lane only.

A third map ("kres": the activation of a block range held in registers while a program walked its rows,
sums by fp32 atomics) lost at 1 column on every shape (H200 session 5, 31.8-37.9 vs 21.5 µs) and was removed.

The oracle is `gemv_q8_reference` (dequantised weight × dequantised int8 activation, float64).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ninfer.kernels.gdn_decode import ConvEpilogue
from ninfer.kernels.gemv_q8 import EMULATE_DP4A, QuantizedActivation, dp4a
from ninfer.kernels.gguf_matmul import (
    MatmulSchedule,
    QuantKernelError,
    _f16_lo,
    _k_scale_min_words,
    check_weight,
    triton_cdiv,
)
from ninfer.kernels.triton_support import HAVE_TRITON, jit, pdl_options, pdl_release, pdl_start, tl, tl_sum
from ninfer.quant.formats import GGUF_PREFIX

ROWS_FORMATS = ("q4_k", "q5_k")
_FMT = {"q4_k": 4, "q5_k": 5}
MAX_COLUMNS = 8


@dataclass(frozen=True)
class RowsSchedule(MatmulSchedule):
    """`block_n` rows × `block_m` columns per program, `blocks` consecutive blocks of each row per loop step,
    split-K over the row's steps; the lane map, rows per lane (chunk lanes) and the weight loads' caching."""

    blocks: int = 4
    rows_per_lane: int = 1  # chunk lanes: rows of a group held in registers (block_n / r groups)
    cache: int = 0  # weight loads: 0 default, 1 ld.global.cg (no L1 allocation), 2 evict-first
    lanes: str = "chunk"  # "chunk" or "piece" (see the module docstring)


def _sched(block_n: int, block_m: int, blocks: int, num_warps: int, split_k: int = 1,
           lanes: str = "chunk", cache: int = 0, r: int = 1) -> RowsSchedule:
    name = (f"rows{dict(chunk='', piece='p')[lanes]}_n{block_n}_m{block_m}_b{blocks}_w{num_warps}"
            + (f"_r{r}" if r > 1 else "") + (f"_s{split_k}" if split_k > 1 else "")
            + ("", "_cg", "_ef")[cache])
    return RowsSchedule(name, "rows", block_n, block_m, split_k=split_k, num_warps=num_warps, num_stages=1,
                        blocks=blocks, lanes=lanes, cache=cache, rows_per_lane=r)


SCHEDULES: dict[str, RowsSchedule] = {
    s.name: s
    for s in (
        # Chunk lanes: blocks × (block_n / r) × 4 must be ≥ 32 · warps or lanes repeat work. One row per lane
        # (session 3's 1-column routes; since session 7 only b8 on ≤ 1024 rows is routed)
        _sched(8, 1, 4, 4),
        _sched(4, 1, 8, 4),
        _sched(4, 1, 4, 2),
        _sched(2, 1, 8, 2),
        _sched(4, 1, 4, 2, split_k=4),
        _sched(4, 1, 4, 2, cache=1),
        _sched(4, 1, 4, 2, cache=2),
        _sched(8, 2, 4, 4),
        # r rows per lane in registers (before session 7 slowed by a layout conversion per step: see
        # `_chunk_axes`); since then they win at 1-4 columns
        _sched(4, 1, 4, 1, r=2, cache=2),
        _sched(8, 1, 4, 1, r=4, cache=2),
        _sched(4, 1, 8, 1, r=4, cache=2),
        _sched(4, 2, 4, 1, r=2),
        _sched(8, 4, 4, 1, r=4),
        _sched(2, 4, 8, 1, r=2),
        _sched(4, 8, 4, 1, r=2),
        _sched(2, 8, 8, 1, r=2),
        _sched(4, 8, 4, 1, r=2, split_k=2),
        # rows per lane over several warps (no layout conversion since the lane axes come first: session 7)
        _sched(8, 1, 4, 2, r=2, cache=2),
        _sched(16, 1, 4, 4, r=2, cache=2),
        _sched(16, 1, 4, 2, r=4, cache=2),
        _sched(32, 1, 4, 4, r=4, cache=2),
        _sched(16, 1, 8, 4, r=4, cache=2),
        _sched(8, 2, 4, 2, r=2),
        _sched(16, 2, 4, 2, r=4),
        _sched(16, 4, 4, 2, r=4),
        _sched(8, 4, 4, 2, r=2),
        _sched(8, 4, 4, 1, r=4),
        _sched(8, 8, 4, 2, r=2),
        _sched(32, 4, 4, 4, r=4),
        _sched(8, 4, 8, 2, r=4),
        _sched(16, 4, 8, 4, r=4),
        _sched(8, 1, 8, 2, r=4, cache=2),
        _sched(8, 1, 8, 4, r=2, cache=2),
        # split-K with the one-launch fixup (`_store_split`): more programs for the 5120-row matrices
        *(_sched(n, 1, b, w, r=2, cache=2, split_k=k) for n, b, w in ((8, 8, 4), (16, 4, 4), (4, 4, 1))
          for k in (2, 3, 4)),
        # piece lanes (blocks = 4 · warps, rows and columns in registers): won at 2 and 8 columns, ≤ 1024 rows
        _sched(4, 1, 4, 1, lanes="piece"),
        _sched(2, 1, 4, 1, lanes="piece"),
        _sched(4, 1, 8, 2, lanes="piece"),
        _sched(2, 1, 4, 1, split_k=4, lanes="piece"),
        _sched(2, 2, 4, 1, lanes="piece"),
        _sched(4, 4, 4, 1, lanes="piece"),
        _sched(2, 4, 4, 1, lanes="piece"),
        _sched(2, 8, 4, 1, lanes="piece"),
        _sched(4, 2, 4, 1, lanes="piece"),
        _sched(4, 4, 8, 2, lanes="piece"),
        _sched(4, 8, 4, 1, lanes="piece"),
    )
}


def shape_class(out_features: int, in_features: int) -> str:
    """The 27B shape family a decode GEMV belongs to, for the routes: "small" (≤ 1024 rows: k / v, the GDN
    gates), "long" (rows of > 8192 columns: the MLP down projection), "wide" (≥ 16384 rows: MLP gate / up),
    "mid" (the rest: GDN qkv and z, attention q, the output projections)."""
    if out_features <= 1024:
        return "small"
    if in_features > 8192:
        return "long"
    return "wide" if out_features >= 16384 else "mid"


# (format, shape class) -> the schedule for 1, 2, 3-4 and 5-8 columns (None: the tensor-core tile's)
_ROUTE = {
    ("q4_k", "small"): ("rows_n2_m1_b8_w2", "rowsp_n2_m2_b4_w1", "rows_n2_m4_b8_w1_r2",
                        "rows_n2_m8_b8_w1_r2"),
    ("q4_k", "long"): ("rows_n8_m1_b8_w4_r2_ef", "rowsp_n2_m2_b4_w1", "rowsp_n2_m4_b4_w1", None),
    ("q4_k", "wide"): ("rows_n16_m1_b4_w4_r2_ef", "rows_n4_m2_b4_w1_r2", "rows_n8_m4_b4_w1_r4", None),
    ("q4_k", "mid"): ("rows_n4_m1_b4_w1_r2_ef", "rows_n4_m2_b4_w1_r2", "rows_n8_m4_b4_w1_r4",
                      "rowsp_n4_m8_b4_w1"),
    ("q5_k", "small"): ("rows_n2_m1_b8_w2", "rowsp_n2_m2_b4_w1", "rows_n2_m4_b8_w1_r2",
                        "rows_n2_m8_b8_w1_r2"),
    ("q5_k", "long"): ("rows_n4_m1_b8_w1_r4_ef", "rowsp_n2_m2_b4_w1", "rows_n2_m4_b8_w1_r2",
                       "rowsp_n4_m8_b4_w1"),
    ("q5_k", "wide"): ("rows_n16_m1_b4_w4_r2_ef", "rowsp_n2_m2_b4_w1", "rowsp_n2_m4_b4_w1",
                       "rowsp_n4_m8_b4_w1"),
    ("q5_k", "mid"): ("rows_n16_m1_b4_w4_r2_ef", "rowsp_n2_m2_b4_w1", "rowsp_n2_m4_b4_w1",
                      "rowsp_n4_m8_b4_w1"),
}


# (format, out, in) of the 27B step's merged matrices -> the schedule for 1, 2, 3-4 and 5-8 columns where it
# differs from the shape class's (H200 session 14 runs 5-6, µs): attention q|gate|k|v 14336×5120 at 1 column
# 13.5 vs 13.9, at 2 columns 18.4 vs 19.7; the output projections 5120×6144 at 1 column 7.5 vs 7.8, at 4
# columns 12.1 vs 13.5 (5-8 columns: gemv_frag.MEASURED_ROUTES, as the others at 2-8)
_EXACT = {
    ("q4_k", 14336, 5120): ("rows_n16_m1_b4_w4_r2_ef", "rowsp_n2_m2_b4_w1", "rows_n8_m4_b4_w1_r4",
                            "rowsp_n4_m8_b4_w1"),
    ("q4_k", 5120, 6144): ("rows_n8_m1_b8_w4_r2_ef", "rows_n4_m2_b4_w1_r2", "rowsp_n2_m4_b4_w1",
                           "rowsp_n4_m8_b4_w1"),
}


def width_slot(columns: int) -> int:
    """The index of a route tuple's entry for `columns` (1, 2, 3-4, 5-8)."""
    return 0 if columns == 1 else 1 if columns == 2 else 2 if columns <= 4 else 3


def rows_route(fmt: str, out_features: int, in_features: int, columns: int) -> RowsSchedule | None:
    """The rows schedule for a decode GEMV of `columns` columns, None where the kernel does not apply or
    the tensor-core tile (gemv_mma) is faster. From the H200 sweeps at the 27B shapes after the lane-axes-
    first tiles (bench/rows_timing.py, session 7 runs 2-3 and 6, µs): q4_k 1 column 16.2 (17408×5120), 17.5
    (5120×17408), 10.4 (10240), 12.1 (12288), 7.6 (6144), 4.1 (1024 rows); 2 columns 21.8, 24.0, 12.8; 4
    columns 27.2, 31.6, 16.2 (the tile: 39.6, 39.7, 25.7); 8 columns on 17408×5120 and 5120×17408 the tile
    wins (45.3 vs 46.7, 43.2 vs 55.4), on the mid shapes the piece lanes (28.0 vs 28.5, 31.9 vs 34.7). q5_k:
    1 column 22.4, 24.2, 13.0; 2 columns 25.3, 27.5; 4 columns 35.5, 45.1; 8 columns 51.8 vs the tile's 55.0,
    63.4 vs 70.0."""
    fmt = fmt.removeprefix(GGUF_PREFIX)
    if fmt not in ROWS_FORMATS or in_features % 256 or not 1 <= columns <= MAX_COLUMNS:
        return None
    routes = _EXACT.get((fmt, out_features, in_features))
    name = (routes or _ROUTE[fmt, shape_class(out_features, in_features)])[width_slot(columns)]
    return SCHEDULES[name] if name else None


if HAVE_TRITON:
    from ninfer.kernels.gdn_decode import conv_epilogue_load, conv_epilogue_store

    @jit
    def _pick(v, e, i: tl.constexpr, ZERO: tl.constexpr = 0):
        """Word i of the 4 words along the last axis (held by one thread: a register pick, no shuffle). Summed
        with Triton's own combine function, which the interpreter runs as one numpy sum. ZERO -0.0 for floats:
        x + -0.0 folds away, x + 0.0 does not."""
        return tl.reduce(tl.where(e == i, v, ZERO), len(v.shape) - 1, tl.standard._sum_combine)

    @jit
    def _pick_sum(v):
        """The sum over the last axis (in-thread adds)."""
        return tl.reduce(v, len(v.shape) - 1, tl.standard._sum_combine)

    @jit
    def _ld(ptrs, ok, EVEN: tl.constexpr):
        """A load, masked (zeros past the row's last block) unless every step is whole."""
        if EVEN:
            return tl.load(ptrs)
        else:
            return tl.load(ptrs, mask=ok, other=0)

    @jit
    def _ldw(ptrs, ok, EVEN: tl.constexpr, CACHE: tl.constexpr):
        """A weight load (each byte is read once): CACHE 1 skips L1 (ld.global.cg), 2 evict-first."""
        if CACHE == 1:
            if EVEN:
                return tl.load(ptrs, cache_modifier=".cg")
            else:
                return tl.load(ptrs, mask=ok, other=0, cache_modifier=".cg")
        elif CACHE == 2:
            if EVEN:
                return tl.load(ptrs, eviction_policy="evict_first")
            else:
                return tl.load(ptrs, mask=ok, other=0, eviction_policy="evict_first")
        else:
            return _ld(ptrs, ok, EVEN)

    @jit
    def _step_range(K, NB: tl.constexpr, SPLIT_K: tl.constexpr):
        """The loop steps (of NB blocks of a row) this program's split of K walks: [s0, s1)."""
        steps = (K // 256 + NB - 1) // NB
        per_split = (steps + SPLIT_K - 1) // SPLIT_K
        s0 = tl.program_id(2) * per_split
        return s0, tl.minimum(steps, s0 + per_split)

    @jit
    def _row_bases(w_ptr, xw_ptr, n, m, zw, zx, N, M, K, row_quads):
        """Pointers to the weight rows n and activation rows m, and the activation-scale offsets; rows and
        columns past the end read the last one (no masks in the loop), their sums are not stored. The row
        length comes in 16-byte units (9 or 11 a block): times 4 words, the rows' alignment is known to the
        axis analysis whatever Triton's divisibility specialisation says of the size (in words, rows of a
        number of blocks not a multiple of 4 — 2560 or 9728 columns — got scalar loads: 2-3x the loop)."""
        mc = tl.minimum(m, M - 1).to(tl.int64)
        wrow = w_ptr + tl.minimum(n, N - 1).to(tl.int64) * (row_quads * 4) + zw
        return wrow, xw_ptr + mc * (K // 4) + zx, mc * (K // 32) + zx

    @jit
    def _store(y_ptr, out, mo, no, M, N, stride_ym, SPLIT_K: tl.constexpr):
        """Row sums into y at (column mo, row no): stored, or added with fp32 atomics under split-K."""
        ptrs = y_ptr + mo * stride_ym + no
        mask = (mo < M) & (no < N)
        if SPLIT_K == 1:
            tl.store(ptrs, out.to(y_ptr.dtype.element_ty), mask=mask)
        else:
            tl.atomic_add(ptrs, out, mask=mask)

    @jit
    def _store_split(y_ptr, o_ptr, cnt_ptr, out, mo, no, M, N, stride_ym, SPLIT_K: tl.constexpr,
                     FIXUP: tl.constexpr):
        """`_store`; FIXUP (split-K into the zeroed workspace y, `split_work`): the last of a program tile's
        SPLIT_K programs to finish (a counter per tile, acq_rel at GPU scope after a barrier over the
        program) moves the tile's totals into o in its dtype and leaves y and its counter zero, as
        `gemv_frag._finish` does: one launch, no zero-fill and no conversion."""
        if SPLIT_K == 1 or not FIXUP:
            _store(y_ptr, out, mo, no, M, N, stride_ym, SPLIT_K)
        else:
            at = mo * stride_ym + no
            mask = (mo < M) & (no < N)
            tl.atomic_add(y_ptr + at, out, mask=mask, sem="relaxed")  # a RED, ordered by the release below
            tl.debug_barrier()
            cnt = cnt_ptr + tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
            if tl.atomic_add(cnt, 1, sem="acq_rel", scope="gpu") == SPLIT_K - 1:
                total = tl.load(y_ptr + at, mask=mask, other=0.0, cache_modifier=".cg")
                tl.store(o_ptr + at, total.to(o_ptr.dtype.element_ty), mask=mask)
                tl.store(y_ptr + at, tl.zeros_like(total), mask=mask)
                tl.atomic_xchg(cnt, 0, sem="relaxed")

    @jit
    def _store_rows(y_ptr, o_ptr, cnt_ptr, out, M, N, stride_ym, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
                    SPLIT_K: tl.constexpr, FIXUP: tl.constexpr):
        """`_store_split` of a program's `[BLOCK_N, BLOCK_M]` tile of sums (rows × columns)."""
        no = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)[:, None]
        mo = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)[None, :]
        _store_split(y_ptr, o_ptr, cnt_ptr, out, mo, no, M, N, stride_ym, SPLIT_K, FIXUP)

    @jit
    def _tile_axes(BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, NB: tl.constexpr):
        """Axes [lane l (8 per block), block b, row n, column m, word e] of the piece and i-quant lane maps,
        each an arange along its own axis (n and m offset by the program's tile). Lane axes come first: see
        `_chunk_axes`."""
        return (tl.arange(0, 8)[:, None, None, None, None],
                tl.arange(0, NB)[None, :, None, None, None],
                tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)[None, None, :, None, None],
                tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)[None, None, None, :, None],
                tl.arange(0, 4)[None, None, None, None, :])

    @jit
    def _x_scales(xd_ptr, xs_ptr, at, ok, e, EVEN: tl.constexpr):
        """The activation scales d and d·Σq of sub-blocks `at` and `at + 1` (each lane loads them once)."""
        return (_pick(_ld(xd_ptr + at, ok, EVEN), e, 0, -0.0),
                _pick(_ld(xd_ptr + at + 1, ok, EVEN), e, 0, -0.0),
                _pick(_ld(xs_ptr + at, ok, EVEN), e, 0, -0.0),
                _pick(_ld(xs_ptr + at + 1, ok, EVEN), e, 0, -0.0))

    @jit
    def _chunk_sum(hd, e, c4, i_lo, i_hi, dx_lo, dx_hi, sx_lo, sx_hi, count_mins):
        """A lane's share of a q4_k / q5_k block: sub-blocks 2·c4 (int32 dot i_lo) and 2·c4 + 1 (i_hi) scaled
        by the header words hd (d, dmin, 6-bit scales and mins) and the activation scales, minus the min
        terms where count_mins (another lane counts them elsewhere)."""
        h0 = _pick(hd, e, 0)
        sc_lo, mn_lo = _k_scale_min_words(_pick(hd, e, 1), _pick(hd, e, 2), _pick(hd, e, 3), 2 * c4)
        sc_hi, mn_hi = _k_scale_min_words(_pick(hd, e, 1), _pick(hd, e, 2), _pick(hd, e, 3), 2 * c4 + 1)
        part = sc_lo * (i_lo.to(tl.float32) * dx_lo) + sc_hi * (i_hi.to(tl.float32) * dx_hi)
        mins = tl.where(count_mins, mn_lo * sx_lo + mn_hi * sx_hi, 0.0)
        return _f16_lo(h0) * part - _f16_lo(h0 >> 16) * mins

    @jit
    def _chunk_axes(BLOCK_M: tl.constexpr, R: tl.constexpr, G: tl.constexpr, NB: tl.constexpr):
        """The chunk lanes' 6-d tile axes (chunk c, block b, row group g, row r, column m, word e), each an
        arange along its own axis (m offset by the program's column tile). Triton hands lanes and warps to
        the axes of equal contiguity in axis order, so the lane axes come first and the register axes (r, m)
        last: weight-side tensors (no m extent) and activation-side ones (no r extent) then get one layout."""
        return (tl.arange(0, 4)[:, None, None, None, None, None],
                tl.arange(0, NB)[None, :, None, None, None, None],
                tl.arange(0, G)[None, None, :, None, None, None],
                tl.arange(0, R)[None, None, None, :, None, None],
                tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)[None, None, None, None, :, None],
                tl.arange(0, 4)[None, None, None, None, None, :])

    @jit
    def _gemv_rows_kernel(w_ptr, xw_ptr, xd_ptr, xs_ptr, y_ptr, N, K, M, row_quads, stride_ym, cw_ptr, cs_ptr,
                          slot_ptr, co_ptr, C, s_cs, o_ptr, cnt_ptr, FMT: tl.constexpr,
                          BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, NB: tl.constexpr, R: tl.constexpr,
                          SPLIT_K: tl.constexpr, EVEN: tl.constexpr, CACHE: tl.constexpr,
                          EMULATE: tl.constexpr, CONV: tl.constexpr = False,
                          CONV_EARLY: tl.constexpr = False, FIXUP: tl.constexpr = False,
                          PDL: tl.constexpr = 0):
        """The "chunk" lane map. Tile axes [chunk c, block b, row group g, row r, column m, word e]: lanes
        and warps lie on (c, b, g), words and the R rows of a group and the columns in registers, so an
        activation load serves R rows. Weight-side tensors carry no column axis and activation-side ones no
        row axis; both keep the full g axis, so they share one layout and broadcast without a conversion.
        CONV: the GDN decode conv of the first C rows in the epilogue (`gdn_decode.ConvEpilogue`; the
        conv arguments are placeholders otherwise); CONV_EARLY: its operands loaded before the wait."""
        G: tl.constexpr = BLOCK_N // R
        mo = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)[None, None, :]
        no = tl.program_id(0) * BLOCK_N + tl.arange(0, R)[None, :, None] * G + tl.arange(0, G)[:, None, None]
        if CONV and CONV_EARLY:
            cp, cs0, cs1, cs2, cw0, cw1, cw2, cw3 = conv_epilogue_load(mo, no, M, N, cw_ptr, cs_ptr, slot_ptr,
                                                                       C, s_cs)
        pdl_start(PDL)
        WB: tl.constexpr = 36 if FMT == 4 else 44  # int32 words per block
        QS: tl.constexpr = 4 if FMT == 4 else 12  # first qs word
        c, b, g, r, m, e = _chunk_axes(BLOCK_M, R, G, NB)
        n = tl.program_id(0) * BLOCK_N + r * G + g
        zw = (n * 0) + (b * 0) + (c * 0) + (e * 0)  # [4, NB, G, R, 1, 4]
        zx = (m * 0) + (g * 0) + (b * 0) + (c * 0) + (e * 0)  # [4, NB, G, 1, BLOCK_M, 4]
        nblk = K // 256
        s0, s1 = _step_range(K, NB, SPLIT_K)
        wrow, xrow, drow = _row_bases(w_ptr, xw_ptr, n, m, zw, zx, N, M, K, row_quads)
        q_at = b * WB + QS + 8 * c + e  # words e and 4 + e of chunk c
        h_at = b * WB + e  # the 4 header words, for every chunk
        x_at = b * 64 + 16 * c + e
        d_at = b * 8 + 2 * c + e * 0
        c4 = _pick(c + zw, e, 0)
        acc = tl.zeros([4, NB, G, R, BLOCK_M], dtype=tl.float32)
        for step in range(s0, s1):
            blk = step * NB
            ok_w = ((blk + b) < nblk) & (zw == 0)  # unused where EVEN (whole steps of NB blocks)
            ok = ((blk + b) < nblk) & (zx == 0)
            wb = wrow + blk * WB
            xb = xrow + blk * 64
            i_lo = 0
            i_hi = 0
            for half in tl.static_range(2):
                q = _ldw(wb + q_at + 4 * half, ok_w, EVEN, CACHE)
                lo = q & 0x0F0F0F0F
                hi = (q >> 4) & 0x0F0F0F0F
                if FMT == 5:  # fifth bit of code 32s + l: bit s of qh byte l (qh words 4..11)
                    qh = _ldw(wb + (b * WB + 4 + e + 4 * half + c * 0), ok_w, EVEN, CACHE)
                    lo = lo | (((qh >> (2 * c)) << 4) & 0x10101010)
                    hi = hi | (((qh >> (2 * c + 1)) << 4) & 0x10101010)
                i_lo = dp4a(lo, _ld(xb + x_at + 4 * half, ok, EVEN), i_lo, EMULATE)
                i_hi = dp4a(hi, _ld(xb + x_at + 8 + 4 * half, ok, EVEN), i_hi, EMULATE)
            hd = _ldw(wb + h_at, ok_w, EVEN, CACHE)
            dx_lo, dx_hi, sx_lo, sx_hi = _x_scales(xd_ptr, xs_ptr, drow + blk * 8 + d_at, ok, e, EVEN)
            acc += _chunk_sum(hd, e, c4, _pick_sum(i_lo), _pick_sum(i_hi), dx_lo, dx_hi, sx_lo, sx_hi, True)
        pdl_release(PDL)
        out = tl_sum(tl_sum(acc, 0), 0)  # [G, R, BLOCK_M]
        if CONV:
            if not CONV_EARLY:
                cp, cs0, cs1, cs2, cw0, cw1, cw2, cw3 = conv_epilogue_load(mo, no, M, N, cw_ptr, cs_ptr,
                                                                           slot_ptr, C, s_cs)
            conv_epilogue_store(y_ptr, out, mo, no, M, N, stride_ym, co_ptr, C, cp, cs0, cs1, cs2, cw0, cw1,
                                cw2, cw3)
        else:
            _store_split(y_ptr, o_ptr, cnt_ptr, out, mo, no, M, N, stride_ym, SPLIT_K, FIXUP)

    @jit
    def _gemv_rows_p_kernel(w_ptr, xw_ptr, xd_ptr, xs_ptr, y_ptr, N, K, M, row_quads, stride_ym, o_ptr,
                            cnt_ptr, FMT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
                            NB: tl.constexpr, SPLIT_K: tl.constexpr, EVEN: tl.constexpr, CACHE: tl.constexpr,
                            EMULATE: tl.constexpr, FIXUP: tl.constexpr = False, PDL: tl.constexpr = 0):
        """The "piece" lane map: 8 lanes per block, lane p reads qs bytes 16p..16p + 15 (a warp load: 4 whole
        128-byte qs runs), and every lane holds all BLOCK_N rows and BLOCK_M columns in registers, so one
        activation load serves BLOCK_N rows. Piece p = (chunk c = p // 2, half h = p % 2)."""
        pdl_start(PDL)
        WB: tl.constexpr = 36 if FMT == 4 else 44
        QS: tl.constexpr = 4 if FMT == 4 else 12
        p, b, n, m, e = _tile_axes(BLOCK_N, BLOCK_M, NB)
        c = p // 2
        h = p % 2
        # weight-side tensors carry no column axis and activation-side ones no row axis (all lanes and warps
        # lie on the block, piece and word axes, so both broadcast in registers without a conversion)
        zw = (n * 0) + (b * 0) + (p * 0) + (e * 0)
        zx = (m * 0) + (b * 0) + (p * 0) + (e * 0)
        nblk = K // 256
        s0, s1 = _step_range(K, NB, SPLIT_K)
        wrow, xrow, drow = _row_bases(w_ptr, xw_ptr, n, m, zw, zx, N, M, K, row_quads)
        q_at = b * WB + QS + 4 * p + e
        h_at = b * WB + e
        x_at = b * 64 + 16 * c + 4 * h + e
        d_at = b * 8 + 2 * c + e * 0
        c4 = _pick(c + zw, e, 0)
        first = _pick(h + zw, e, 0) == 0  # the piece that counts its sub-blocks' min terms
        acc = tl.zeros([8, NB, BLOCK_N, BLOCK_M], dtype=tl.float32)
        for step in range(s0, s1):
            blk = step * NB
            ok_w = ((blk + b) < nblk) & (zw == 0)  # unused where EVEN
            ok = ((blk + b) < nblk) & (zx == 0)
            wb = wrow + blk * WB
            xb = xrow + blk * 64
            q = _ldw(wb + q_at, ok_w, EVEN, CACHE)
            lo = q & 0x0F0F0F0F
            hi = (q >> 4) & 0x0F0F0F0F
            if FMT == 5:
                qh = _ldw(wb + (b * WB + 4 + 4 * h + e), ok_w, EVEN, CACHE)
                lo = lo | (((qh >> (2 * c)) << 4) & 0x10101010)
                hi = hi | (((qh >> (2 * c + 1)) << 4) & 0x10101010)
            i_lo = _pick_sum(dp4a(lo, _ld(xb + x_at, ok, EVEN), 0, EMULATE))
            i_hi = _pick_sum(dp4a(hi, _ld(xb + x_at + 8, ok, EVEN), 0, EMULATE))
            hd = _ldw(wb + h_at, ok_w, EVEN, CACHE)
            dx_lo, dx_hi, sx_lo, sx_hi = _x_scales(xd_ptr, xs_ptr, drow + blk * 8 + d_at, ok, e, EVEN)
            acc += _chunk_sum(hd, e, c4, i_lo, i_hi, dx_lo, dx_hi, sx_lo, sx_hi, first)
        pdl_release(PDL)
        _store_rows(y_ptr, o_ptr, cnt_ptr, tl_sum(tl_sum(acc, 0), 0), M, N, stride_ym, BLOCK_N, BLOCK_M,
                    SPLIT_K, FIXUP)


# (device, slots) -> (fp32 sums, int32 tile counters). The adding kernels' sums (slots False: gemv_rows,
# gemv_frag) are zero between calls, the last program of each tile clearing its part; the slot kernels
# (gemv_il, gemv_q4il) store each piece's sums in a slot of their own and leave them, so they get their own
# workspace. The counters are zero between calls in both. A workspace is replaced by a bigger one when a call
# needs more, the old one kept alive for the CUDA graphs that captured it (never freed: 8 MB and 256 KB at
# first)
_WORKSPACES: dict[tuple[torch.device, bool], tuple[torch.Tensor, torch.Tensor]] = {}
_CAPTURED_WORKSPACES: list[tuple[torch.Tensor, torch.Tensor]] = []


def split_workspace(device: torch.device, floats: int, counters: int, slots: bool = False
                    ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The split-K workspace of a device with room for `floats` sums and `counters` tiles, its sums zeroed
    unless `slots` (a kernel that stores its pieces' sums rather than adding them); None while a CUDA graph
    is being captured and the present one is too small (an allocation there would belong to the graph's
    pool; the caller falls back to a zero-filled output and a conversion)."""
    ws = _WORKSPACES.get((device, slots))
    if ws is not None and ws[0].numel() >= floats and ws[1].numel() >= counters:
        return ws
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return None
    if ws is not None:
        _CAPTURED_WORKSPACES.append(ws)
    sums = max(floats, 1 << 21, ws[0].numel() if ws else 0)
    tiles = max(counters, 1 << 16, ws[1].numel() if ws else 0)
    _WORKSPACES[device, slots] = ws = (torch.zeros(sums, dtype=torch.float32, device=device),
                                       torch.zeros(tiles, dtype=torch.int32, device=device))
    return ws


def split_work(device: torch.device, s: MatmulSchedule, columns: int, out_features: int, stream: int = 0
               ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A split-K schedule's one-launch fixup: the zeroed workspace as the `[columns, out_features]` fp32 sums
    and the tile counters (one per program tile, `_store_split`, `gemv_frag._finish`); None without split-K,
    for stream-K, or while a graph is being captured and the workspace is too small (zero-filled output and a
    conversion then)."""
    if s.split_k == 1 or stream:
        return None
    tiles = -(-out_features // s.block_n) * -(-columns // s.block_m)
    ws = split_workspace(device, columns * out_features, tiles)
    return None if ws is None else (ws[0][: columns * out_features].view(columns, out_features), ws[1])


def rows_setup(raw: torch.Tensor, format: str, xa: QuantizedActivation, out_features: int,
               s: MatmulSchedule, formats: tuple[str, ...], kind: str, stream_programs: int = 0,
               check: bool = True, output: torch.Tensor | None = None) -> tuple[torch.Tensor, tuple, dict]:
    """What every rows GEMV (and the tensor-core GEMM) does before its launch: check the weight against
    `formats` (`kind` names the kernel in the error), then the output (fp32 zeros when split-K or stream-K
    programs add partial sums), the launch grid (`stream_programs` > 0: that many stream-K programs on the
    third axis instead of the row tiles × splits) and the compile options; `check=False`: the caller checked
    a weight in another layout; `output`: the caller's fp32 buffer for the partial sums (zero), used as y."""
    n, k = xa.q.shape
    if check:
        check_weight(raw, format, out_features, k)
    if format not in formats:
        raise QuantKernelError(f"schedule {s.name} ({kind}) supports {', '.join(formats)}, not {format}; "
                               "pick another rows_*, a q8_* or a wv_* schedule")
    if k % 256:
        raise QuantKernelError(f"schedule {s.name} needs rows of whole 256-column blocks, got {k}")
    partial = s.split_k > 1 or stream_programs > 0
    y = output if output is not None else (torch.zeros if partial else torch.empty)(
        (n, out_features), dtype=torch.float32 if partial else xa.dtype, device=raw.device)
    if stream_programs:
        launch = (1, triton_cdiv(n, s.block_m), stream_programs)
    else:
        launch = (triton_cdiv(out_features, s.block_n), triton_cdiv(n, s.block_m), s.split_k)
    extra = {} if raw.device.type == "cpu" else {"num_warps": s.num_warps, "num_stages": s.num_stages}
    return y, launch, extra


def split_target(y: torch.Tensor, work: tuple[torch.Tensor, torch.Tensor] | None, dtype: torch.dtype
                 ) -> tuple[torch.Tensor, dict]:
    """The output a rows kernel leaves its sums in and the launch keywords of its split-K fixup: y itself
    without a workspace (`split_work` None), else a fresh tensor in the activation's dtype that the last
    program of each tile fills from the workspace y."""
    if work is None:
        return y, dict(o_ptr=y, cnt_ptr=y, FIXUP=False)
    out = torch.empty(y.shape, dtype=dtype, device=y.device)
    return out, dict(o_ptr=out, cnt_ptr=work[1], FIXUP=True)


def takes_conv(s: RowsSchedule, conv: ConvEpilogue, columns: int, out_features: int) -> bool:
    """Whether a rows schedule can run a GDN decode conv in its epilogue (`gdn_decode.ConvEpilogue`): no
    split-K, the chunk lanes of q4_k / q5_k or the i-quant kernel, one conv lane per column."""
    return (s.split_k == 1 and (s.kernel == "rows_iq" or s.lanes == "chunk")
            and conv.slot_ids.shape[0] == conv.out.shape[0] == columns and conv.channels <= out_features)


def conv_early(columns: int) -> bool:
    """Whether a conv epilogue loads its operands (conv slots, weights) before the GEMV's programmatic-launch
    wait: at several columns, where small programs would each wait on them at their end (H200 session 21: two
    lanes Q4_K −0.10 ms a step against loading them after the loop); one column loads them after the loop
    (−0.03 ms against before the wait: fewer registers through the loop)."""
    return columns > 1


def conv_arguments(y: torch.Tensor, conv: ConvEpilogue | None) -> tuple:
    """The rows kernels' conv arguments: the epilogue's, or placeholders (y for every pointer)."""
    return (y, y, y, y, 0, 0) if conv is None else conv.launch_args()


def gemv_rows(raw: torch.Tensor, format: str, xa: QuantizedActivation, out_features: int,
              schedule: RowsSchedule | str, conv: ConvEpilogue | None = None) -> torch.Tensor:
    """`(q·d) @ Wᵀ -> [n, out_features]` in `xa.dtype`, W the GGUF rows `raw` (uint8 `[N, row_bytes]`, q4_k
    or q5_k) and xa the int8 activation; the kernel runs on `raw`'s device (CUDA, or CPU under the
    interpreter). `conv`: the epilogue also runs that GDN decode conv on the first outputs (`takes_conv`
    must hold) and marks it applied."""
    format = format.removeprefix(GGUF_PREFIX)
    s = SCHEDULES[schedule] if isinstance(schedule, str) else schedule
    n, k = xa.q.shape
    work = split_work(raw.device, s, n, out_features)
    y, launch, extra = rows_setup(raw, format, xa, out_features, s, ROWS_FORMATS, "rows GEMV",
                                  output=None if work is None else work[0])
    if conv is not None and not takes_conv(s, conv, n, out_features):
        raise QuantKernelError(f"schedule {s.name} cannot run the GDN conv of {conv.channels} channels for "
                               f"{conv.slot_ids.shape[0]} lanes at {n} columns (no split-K, chunk lanes)")
    out, fixup = split_target(y, work, xa.dtype)
    args = (raw.view(torch.int32), xa.words, xa.d, xa.s, y, out_features, k, n, raw.shape[1] // 16,
            y.stride(0))
    common = dict(FMT=_FMT[format], BLOCK_N=s.block_n, BLOCK_M=s.block_m, NB=s.blocks,
                  EVEN=k // 256 % s.blocks == 0, CACHE=s.cache, EMULATE=EMULATE_DP4A, **fixup, **extra,
                  **pdl_options(raw, trigger=False))
    if s.lanes == "piece":
        _gemv_rows_p_kernel[launch](*args, SPLIT_K=s.split_k, **common)
    else:
        _gemv_rows_kernel[launch](*args, *conv_arguments(y, conv), R=s.rows_per_lane, SPLIT_K=s.split_k,
                                  CONV=conv is not None, CONV_EARLY=conv_early(n), **common)
    if conv is not None:
        conv.applied = True
    return out.to(xa.dtype)

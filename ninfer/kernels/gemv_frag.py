"""Decode GEMV for 1–16 columns on int8 tensor cores with the operands loaded straight into the mma
fragments ("frag"): q4_k, q5_k, iq3_s and q6_k codes × int8 activations.

`gemv_mma.py` reaches the tensor cores through `tl.dot`, which stages both operands through shared memory
behind a barrier: each sub-block's dot waits on its loads, one after another (~340 ns each on the H200). Here
every warp issues PTX `mma.sync.m16n8k32.s8` itself (`tl.inline_asm_elementwise` on tensors that hold one
element per thread and mma), so the operands go from global memory into registers and nothing is staged.

A warp owns a tile of 16 weight rows and walks its split of K one super-block at a time; lane 4g + t holds the
A fragment of rows g and g + 8 and the B fragment of column g (PTX's m16n8k32 layout: A words a0 / a1 = rows
g / g + 8 at k-slots 4t..4t + 3, a2 / a3 the same rows at 16 + 4t..19 + 4t; B words b0 / b1 = column g at
the same k-slots; D d0, d1 = row g, columns 2t, 2t + 1; d2, d3 = row g + 8). The order of k inside one mma
is free as long as A and B agree, so lane t takes codes 8t..8t + 7 of each 32-code sub-block: for q4_k
those are bytes 8t..8t + 7 of the sub-block's 32-byte qs run (one 8-byte load per row serves the low-nibble
and the high-nibble sub-block), the activation's codes 8t..8t + 7 one 8-byte load per column. After each
mma the int32 tile gets the sub-block's scales (sc·D in int32, d and dmin once per super-block):

    y[n, m] += d·sc_j[n] · D[n, m] · xd_j[m] − dmin·mn_j[n] · xs_j[m]

so columns 1–8 cost the same weight traffic and one mma per sub-block (16 columns: two). iq3_s
(`_gemv_frag_iq3_kernel`): lane t's codes are grid words 2t, 2t + 1 of each sub-block with sign byte t, read
as 2-byte pieces of the 2-byte-aligned blocks; q6_k (`_gemv_frag_q6k_kernel`, the output head): one m16n8k16
mma per 16-code scale group on the codes 0..63, seeded by one with A = −32 for their offset. Both run ~2×
q4_k's instructions per super-block; `frag_route` says where each wins (docs/gpu-notes.md, sessions 9–10).
The q4_k / q5_k min term `dmin·Σ_s mn_s·xs_s` of a super-block is one m16n8k8 tf32 mma (k = the 8
sub-blocks; the activation sums split in three tf32 parts: exact).

Split-K programs add their sums into a per-device fp32 workspace (`split_workspace`) and the last program of
each tile to finish converts the totals to the output dtype and zeroes them again (`_finish`), so a call is
one launch. Stream-K schedules (`_sk`) share the (row tile, super-block) steps of one full wave of programs;
they were measured slower and are not routed.

Tensors are `[32·warps, RT, NT, 4]`: the lane axis first (Triton gives lanes to the leading axis of equal
contiguity, so element i of axis 0 lives in thread i), RT row tiles and NT column tiles of 8 per lane in
registers, the word axis e last; every load is built at the full shape (zero strides where a value does not
depend on an axis), so all values share one register layout. Under the CPU interpreter the mma is computed
from the whole warp's fragments (`_mma_emulated`), the same lane map, so the CPU tests check the kernel's
indexing.

The oracle is `gemv_q8_reference` (dequantised weight × dequantised int8 activation, float64).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ninfer.kernels.gemv_q8 import EMULATE_DP4A, QuantizedActivation, dp4a
from ninfer.kernels.gemv_rows import rows_setup, split_target, split_work, width_slot
from ninfer.kernels.gguf_matmul import MatmulSchedule, QuantKernelError, _f16_lo, iq3s_grid16
from ninfer.kernels.triton_support import HAVE_TRITON, jit, pdl_options, pdl_release, pdl_start, tl, tl_sum
from ninfer.quant.formats import GGUF_PREFIX

FRAG_FORMATS = ("q4_k", "q5_k", "iq3_s", "q6_k")
_FMT = {"q4_k": 4, "q5_k": 5}  # the formats of `_gemv_frag_kernel`, the only one with the `_pf` schedules


@dataclass(frozen=True)
class FragSchedule(MatmulSchedule):
    """`num_warps` warps of `row_tiles` 16-row tiles each per program (block_n = 16 · warps · row_tiles rows),
    block_m = 8 · column tiles columns, split-K over the row's super-blocks (fp32 atomics); `prefetch`: every
    load of the next super-block issues before this one's math (q4_k, q5_k). `stream` > 0: stream-K, that
    many programs per SM share the (row tile, super-block) steps evenly, each walking a contiguous run of
    them across row tiles (fp32 atomics at each tile's end): one full wave, no split to tune (split_k
    unused)."""

    row_tiles: int = 1
    prefetch: bool = False
    stream: int = 0


def _sched(num_warps: int, row_tiles: int, col_tiles: int, split_k: int = 1, prefetch: bool = False,
           stream: int = 0) -> FragSchedule:
    name = (f"frag_w{num_warps}_r{row_tiles}_m{8 * col_tiles}" + (f"_s{split_k}" if split_k > 1 else "")
            + (f"_sk{stream}" if stream else "") + ("_pf" if prefetch else ""))
    return FragSchedule(name, "frag", 16 * num_warps * row_tiles, 8 * col_tiles, split_k=split_k,
                        num_warps=num_warps, num_stages=1, row_tiles=row_tiles, prefetch=prefetch,
                        stream=stream)


SCHEDULES: dict[str, FragSchedule] = {
    s.name: s
    for w in (1, 2, 4)
    for r in (1, 2)
    for m in (1, 2)
    for k in (1, 2, 4, 8)
    for s in [_sched(w, r, m, k)]
}
# loads one super-block ahead, for the routed 8-column shapes (session 10: written after the device time)
SCHEDULES.update((s.name, s) for w, k in ((1, 2), (2, 2), (2, 4), (2, 8), (4, 4))
                 for s in [_sched(w, 1, 1, k, True)])
# stream-K at or below the register-limited occupancy (sm_90, 64 K registers per SM): q4_k's 96 (w2) / 102
# (w1) registers hold 10 two-warp / 19 one-warp programs per SM, iq3_s's 71 (w2) 14, q6_k's 88 (w2) 11
SCHEDULES.update((s.name, s) for w, p, pf in ((1, 16, False), (1, 19, False), (2, 8, False), (2, 10, False),
                                              (2, 14, False), (4, 5, False), (2, 8, True))
                 for s in [_sched(w, 1, 1, prefetch=pf, stream=p)])


def schedules_for(fmt: str) -> dict[str, FragSchedule]:
    """The schedules `gemv_frag` runs for a format (the `_pf` ones only for q4_k / q5_k; none outside
    FRAG_FORMATS)."""
    if fmt not in FRAG_FORMATS:
        return {}
    return {n: s for n, s in SCHEDULES.items() if not s.prefetch or fmt in _FMT}


# the fewest columns from which the fragment kernel beats the rows kernels and two 1-column GEMVs
FRAG_FROM = {"q4_k": 5, "iq3_s": 5, "q6_k": 2}

# The matrices the 27B decode step runs (same-input Linears merged: MLP gate|up 34816×5120, GDN q|k|v|z|a|b
# 16480×5120 (16384 where a, b are stored apart), attention q|gate|k|v 14336×5120, the output projections
# 5120×6144, MLP down 5120×17408): the fragment schedule for 2, 3–4 and 5–8 columns, None where the rows
# kernels win. H200 session 14 runs 5–6 (bench/rows_timing.py on these shapes, µs; "was" = the routes by
# shape class, measured on the unmerged matrices): q4_k at 8 columns 55.4 (was 65.6), 26.3 (32.7), 25.5
# (31.1), 30.1 (31.6), 14.3 (21.3 on the rows kernel's piece lanes); at 4 columns 16480 24.5 (26.5), 16384
# 21.6 (26.8), 14336 20.8 (26.0), 5120×17408 25.4 (25.9); at 2 columns 16384 20.1 (21.6), 5120×17408 23.9
# (25.2); iq3_s at 8 columns 87.5 (109.9), 45.2 (49.7), 38.6, 48.2 (48.8), 20.5 (24.9 on the tile); iq3_s at
# 2–4 columns stays on the rows kernels (59.1–13.5 vs the fragment kernel's 76.7–18.8 at 4). (Session 15 run
# 4 timed q4_k's aligned-units build, which these shapes no longer take (`needs_units`): 34816×5120 at 8
# columns `frag_w2_r1_m8_s4` 63.0, `_s8` 59.9, the `_pf` schedules as before.) Session 16 run 3: two row tiles
# per warp (`_r2`: each activation fragment serves 32 rows) at 8 columns 49.3 (55.8 on the route before), 22.8
# (26.9), 21.8 (25.4), 27.6 (30.1), 13.1 (14.4); at 4 columns 16480×5120 22.1 (25.0), elsewhere within 0.3 of
# the route (kept); the 16384 route is unmeasured with them. All routed in session 16, they made the 8-lane
# round slower, not faster (session 17 run 4, A/B in one process: 10.31 → 10.45 ms replayed on the lanes' own
# GDN slots and pages, the suite's C = 8 768 → 759 tok/s); bisected (run 6): gate|up's alone changes nothing
# (10.49 vs 10.47 ms, C = 8 759 vs 759), the others' alone gain (10.35 ms, C = 8 768): gate|up keeps one tile.
# Session 18 run 1, one matrix at a time in that round (512-token prompts): down back on one tile 10.29 →
# 10.24 ms (`frag_w2_r1_m8_s8`; `frag_w4_r1_m8_s8` 10.25), every other alternative slower or within 0.02.
# iq3_s `_r2` at 8 columns (session 16 run 4, session 17 run 1): 81.3 (87.1), 41.0 (45.7), 35.8 (38.8), 19.8
# (20.6); 5120×17408 48.2 (48.0, kept); the 8-lane round 15.30 → 14.54 ms, C = 8 520 → 547 tok/s (run 2).
MEASURED_ROUTES: dict[tuple[str, int, int], tuple[str | None, str | None, str | None]] = {
    ("q4_k", 34816, 5120): (None, None, "frag_w2_r1_m8_s4"),
    ("q4_k", 16480, 5120): (None, "frag_w4_r2_m8_s4", "frag_w4_r2_m8_s4"),
    ("q4_k", 16384, 5120): ("frag_w2_r1_m8_s2_pf", "frag_w2_r1_m8_s2_pf", "frag_w2_r1_m8_s2_pf"),
    ("q4_k", 14336, 5120): (None, "frag_w2_r1_m8_s2_pf", "frag_w2_r2_m8_s4"),
    ("q4_k", 5120, 17408): ("frag_w4_r1_m8_s8", "frag_w4_r1_m8_s8", "frag_w2_r1_m8_s8"),
    ("q4_k", 5120, 6144): (None, None, "frag_w2_r2_m8_s8"),
    ("iq3_s", 34816, 5120): (None, None, "frag_w2_r2_m8_s8"),
    ("iq3_s", 16480, 5120): (None, None, "frag_w4_r2_m8_s8"),
    ("iq3_s", 16384, 5120): (None, None, "frag_w4_r1_m8_s8"),
    ("iq3_s", 14336, 5120): (None, None, "frag_w2_r2_m8_s8"),
    ("iq3_s", 5120, 17408): (None, None, "frag_w4_r1_m8_s8"),
    ("iq3_s", 5120, 6144): (None, None, "frag_w2_r2_m8_s8"),
}


def frag_route(fmt: str, out_features: int, in_features: int, columns: int) -> FragSchedule | None:
    """The fragment schedule for a decode GEMV of up to 8 columns where it beats the rows kernels and the
    `tl.dot` tiles (H200, bench/frag_timing.py and rows_timing.py; µs at 8 columns unless named):

    - the q6_k output head (248320×5120) at 2–8 columns: 458 / 504 / 603 µs at 2 / 4 / 8 (session 11 run 1)
      where two 1-column GEMVs take 676 and the tile 1,174 / 1,210 (one column stays on the q8 GEMV: 339 vs
      452); on two row tiles a warp (`frag_w1_r2_m8`) 447 / 465 / 508 where `frag_w2_r1_m8` took 457 / 506 /
      609 (session 17 run 3); quant_matmul asks `gemv_rows_q6k.rows_q6k_route` first, which takes the head at
      1-4 columns since session 22;
    - q4_k and iq3_s from 5, q6_k from 2 columns, on matrices of ≥ 10240 rows or of rows longer than 8192
      columns (session 9 runs 6 and 8, session 10 runs 1 and 3): q4_k 17408×5120 37.1 vs 45.6 (the tile),
      5120×17408 36.4 vs 43.2-46.3, 12288×5120 27.5 vs 32.1 and 10240×5120 24.2 vs 27.5 (the rows kernel's
      piece lanes); iq3_s 53.8 vs 65.0, 52.0 vs 78.0, 39.4 vs 43.7 and 32.8 vs 36.9 (the tile); q6_k 60.7 vs
      95.3, 55.5 vs 102.3, 43.8 vs 66.3 (at 2 columns 48.7 / 46.5 / 35.3 where two 1-column GEMVs take
      59.9 / 64.7 / 46.9). Not on 6144×5120 (q4_k 18.3 vs 17.8), nor below 5 columns for q4_k and iq3_s,
      where the rows kernels win (iq3_s 17408×5120 at 4 columns: 33.5 vs 51.2);
    - q4_k 5120×17408 (rows longer than 8192 columns) from 4 columns on `frag_w2_r1_m8_s4_pf` (session 11
      run 2: 27.9 / 31.2 µs at 4 / 8 where the rows kernel takes 30.6 at 4 and `_s8` 32.2 at 8).

    Stream-K (`_sk`: one full wave of programs sharing the steps) was slower everywhere at 4–8 columns
    (session 11 run 2: q4_k 17408×5120 at 8 36.5–51.4 vs 32.4), though at 1 column `_sk8_pf` is the fastest
    fragment schedule (24.1 vs 27.4; the rows kernel 15.8).

    Its cost hardly grows with the columns: the weight decode and the scaling of each int32 tile (283
    instructions per warp and q4_k super-block) are the same for 1 and for 8. The matrices of the 27B step
    take `MEASURED_ROUTES` instead (timed on those shapes: the grid's fit in one wave of programs moves the
    best schedule between neighbouring shapes)."""
    fmt = fmt.removeprefix(GGUF_PREFIX)
    first = FRAG_FROM.get(fmt)
    if first is None or in_features % 256 or columns > 8:
        return None
    measured = MEASURED_ROUTES.get((fmt, out_features, in_features))
    if measured is not None:
        name = measured[width_slot(columns) - 1] if columns > 1 else None
        return SCHEDULES[name] if name else None
    if fmt == "q4_k" and in_features > 8192 and columns >= 4:  # loads one super-block ahead (session 11)
        return SCHEDULES["frag_w2_r1_m8_s4_pf"]
    if columns < first:
        return None
    if fmt == "q6_k" and out_features >= 65536:
        return SCHEDULES["frag_w1_r2_m8"]
    if in_features > 8192:
        return SCHEDULES["frag_w2_r1_m8_s8"]
    if out_features >= 16384:
        return SCHEDULES["frag_w1_r1_m8_s2"]
    return SCHEDULES["frag_w4_r1_m8_s4"] if out_features >= 10240 else None


if HAVE_TRITON:
    from ninfer.kernels.gemv_q8_iq import prmt
    from ninfer.kernels.gemv_rows import _pick, _step_range
    from ninfer.kernels.gemv_rows_iq import _shf

    @jit
    def _mma_emulated(a0, a1, a2, a3, b0, b1, L: tl.constexpr, RT: tl.constexpr, NT: tl.constexpr,
                      TF32: tl.constexpr = False):
        """What `mma.sync.m16n8k32.row.col.s32.s8.s8.s32` (TF32: `m16n8k8.row.col.f32.tf32.tf32.f32`, the
        operands fp32 bits) returns to each lane, computed from the whole warp's fragments (tensors
        `[L, RT, NT]`, lane 4g + t of warp w at index 32w + 4g + t). Both lay A out as a0 / a2 = row g and
        a1 / a3 = row g + 8 at k-slot t (four int8 slots 4t..4t + 3) in the lower / upper half of k, B as
        b0 / b1 = column g at the same slots, D as row g (d0, d1) and g + 8 (d2, d3) × columns 2t, 2t + 1."""
        W: tl.constexpr = L // 32
        A0 = tl.reshape(a0, [W, 8, 4, RT, NT])[:, :, None, :, :, :]  # [warp, row g, ·, slot t, RT, NT]
        A1 = tl.reshape(a1, [W, 8, 4, RT, NT])[:, :, None, :, :, :]
        A2 = tl.reshape(a2, [W, 8, 4, RT, NT])[:, :, None, :, :, :]
        A3 = tl.reshape(a3, [W, 8, 4, RT, NT])[:, :, None, :, :, :]
        B0 = tl.reshape(b0, [W, 8, 4, RT, NT])[:, None, :, :, :, :]  # [warp, ·, column n, slot t, RT, NT]
        B1 = tl.reshape(b1, [W, 8, 4, RT, NT])[:, None, :, :, :, :]
        if TF32:
            A0, A1, A2, A3 = (A0.to(tl.float32, bitcast=True), A1.to(tl.float32, bitcast=True),
                              A2.to(tl.float32, bitcast=True), A3.to(tl.float32, bitcast=True))
            B0, B1 = B0.to(tl.float32, bitcast=True), B1.to(tl.float32, bitcast=True)
            top = tl_sum(A0 * B0 + A2 * B1, 3)[:, :, None, :, :, :]  # [W, g, ·, n]
            bot = tl_sum(A1 * B0 + A3 * B1, 3)[:, :, None, :, :, :]
        else:
            top = tl_sum(dp4a(A0, B0, 0, True) + dp4a(A2, B1, 0, True), 3)[:, :, None, :, :, :]
            bot = tl_sum(dp4a(A1, B0, 0, True) + dp4a(A3, B1, 0, True), 3)[:, :, None, :, :, :]
        n = tl.arange(0, 8)[None, None, None, :, None, None]
        t = tl.arange(0, 4)[None, None, :, None, None, None]
        d0 = tl_sum(tl.where(n == 2 * t, top, 0), 3)  # [W, g, t, RT, NT]: row g, column 2t
        d1 = tl_sum(tl.where(n == 2 * t + 1, top, 0), 3)
        d2 = tl_sum(tl.where(n == 2 * t, bot, 0), 3)
        d3 = tl_sum(tl.where(n == 2 * t + 1, bot, 0), 3)
        return (tl.reshape(d0, [L, RT, NT]), tl.reshape(d1, [L, RT, NT]), tl.reshape(d2, [L, RT, NT]),
                tl.reshape(d3, [L, RT, NT]))

    @jit
    def _mma(a0, a1, a2, a3, b0, b1, L: tl.constexpr, RT: tl.constexpr, NT: tl.constexpr,
             EMULATE: tl.constexpr):
        """The int32 16×8 tile A·B of one m16n8k32 int8 mma (no accumulator: each sub-block is scaled on its
        own), as each lane's (d0, d1, d2, d3)."""
        if EMULATE:
            return _mma_emulated(a0, a1, a2, a3, b0, b1, L, RT, NT)
        else:
            return tl.inline_asm_elementwise(
                "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {$0, $1, $2, $3}, {$4, $5, $6, $7}, "
                "{$8, $9}, {$10, $10, $10, $10};",
                "=r,=r,=r,=r,r,r,r,r,r,r,r", [a0, a1, a2, a3, b0, b1, a0 * 0],
                dtype=(tl.int32, tl.int32, tl.int32, tl.int32), is_pure=True, pack=1)

    @jit
    def _tf32_parts(v):
        """v (fp32) as three tf32 values (fp32 bits with the low 13 mantissa bits clear) that sum to v exactly
        (11 + 11 + 2 of its 24 significant bits): each mma product of a part is then exact."""
        hi = (v.to(tl.int32, bitcast=True) & -8192).to(tl.float32, bitcast=True)
        mid = ((v - hi).to(tl.int32, bitcast=True) & -8192).to(tl.float32, bitcast=True)
        return hi, mid, v - hi - mid

    @jit
    def _mma_tf32(a0, a1, a2, a3, b, b4, L: tl.constexpr, RT: tl.constexpr, NT: tl.constexpr,
                  EMULATE: tl.constexpr):
        """The fp32 16×8 tile A·B of m16n8k8 tf32 mmas, A (a0..a3: small integers, exact in tf32) times B
        (b, b4: fp32 of k-slots t and t + 4, split into three tf32 parts, so the tile is fp32-exact up to the
        mma's own fp32 sums), as each lane's (d0, d1, d2, d3)."""
        bh, bm, bl = _tf32_parts(b)
        b4h, b4m, b4l = _tf32_parts(b4)
        a0 = a0.to(tl.int32, bitcast=True)
        a1 = a1.to(tl.int32, bitcast=True)
        a2 = a2.to(tl.int32, bitcast=True)
        a3 = a3.to(tl.int32, bitcast=True)
        if EMULATE:  # the three products in the hardware's order, each exact, added in fp32
            l0, l1, l2, l3 = _mma_emulated(a0, a1, a2, a3, bl.to(tl.int32, bitcast=True),
                                           b4l.to(tl.int32, bitcast=True), L, RT, NT, True)
            m0, m1, m2, m3 = _mma_emulated(a0, a1, a2, a3, bm.to(tl.int32, bitcast=True),
                                           b4m.to(tl.int32, bitcast=True), L, RT, NT, True)
            h0, h1, h2, h3 = _mma_emulated(a0, a1, a2, a3, bh.to(tl.int32, bitcast=True),
                                           b4h.to(tl.int32, bitcast=True), L, RT, NT, True)
            return l0 + m0 + h0, l1 + m1 + h1, l2 + m2 + h2, l3 + m3 + h3
        else:
            return tl.inline_asm_elementwise(
                "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {$0, $1, $2, $3}, {$4, $5, $6, $7}, "
                "{$8, $9}, {$14, $14, $14, $14};\n"
                "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {$0, $1, $2, $3}, {$4, $5, $6, $7}, "
                "{$10, $11}, {$0, $1, $2, $3};\n"
                "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {$0, $1, $2, $3}, {$4, $5, $6, $7}, "
                "{$12, $13}, {$0, $1, $2, $3};",
                "=&f,=&f,=&f,=&f,r,r,r,r,r,r,r,r,r,r,f",
                [a0, a1, a2, a3, bl.to(tl.int32, bitcast=True), b4l.to(tl.int32, bitcast=True),
                 bm.to(tl.int32, bitcast=True), b4m.to(tl.int32, bitcast=True), bh.to(tl.int32, bitcast=True),
                 b4h.to(tl.int32, bitcast=True), tl.zeros_like(b)],
                dtype=(tl.float32, tl.float32, tl.float32, tl.float32), is_pure=True, pack=1)

    @jit
    def _minus32(q):
        """Bytes q − 32 mod 256 of 4 codes 0..63 without carries between bytes: q ^ 0x20 is q − 32 for q ≥ 32
        and q + 32 below, where adding 6·32 wraps it to q − 32."""
        x = q ^ 0x20202020
        return x + 6 * (x & 0x20202020)

    @jit
    def _mma16_q6(a0, a1, b0, L: tl.constexpr, RT: tl.constexpr, NT: tl.constexpr, EMULATE: tl.constexpr):
        """The int32 16×8 tile of m16n8k16 int8 mmas for q6_k codes 0..63 (read as int8: the same values):
        A words a0 / a1 = rows g / g + 8 at k-slots 4t..4t + 3, B word b0 = column g at the same slots; the
        codes' offset −32 is one more mma with every A byte −32 (0xE0), whose tile seeds the accumulator
        (emulated as the k32 mma, upper half zero)."""
        neg = a0 * 0 - 0x1F1F1F20  # 0xE0E0E0E0: −32 in every byte
        if EMULATE:  # the same tile as one mma on the bytes q − 32 (the mma is linear in A)
            z = a0 * 0
            return _mma_emulated(_minus32(a0), _minus32(a1), z, z, b0, z, L, RT, NT)
        else:
            return tl.inline_asm_elementwise(
                "mma.sync.aligned.m16n8k16.row.col.s32.s8.s8.s32 {$0, $1, $2, $3}, {$7, $7}, {$6}, "
                "{$8, $8, $8, $8};\n"
                "mma.sync.aligned.m16n8k16.row.col.s32.s8.s8.s32 {$0, $1, $2, $3}, {$4, $5}, {$6}, "
                "{$0, $1, $2, $3};",
                "=&r,=&r,=&r,=&r,r,r,r,r,r", [a0, a1, b0, neg, a0 * 0],
                dtype=(tl.int32, tl.int32, tl.int32, tl.int32), is_pure=True, pack=1)

    @jit
    def _k_scale_bytes(hd, e):
        """The 6-bit scales and mins of a q4_k / q5_k super-block from its header words hd (word e: d | dmin,
        then the 12 scale bytes), four to a word: (sc 0-3, sc 4-7, mn 0-3, mn 4-7), byte j of each the
        sub-block's value."""
        w1 = _pick(hd, e, 1)
        w2 = _pick(hd, e, 2)
        w3 = _pick(hd, e, 3)
        return (w1 & 0x3F3F3F3F, (w3 & 0x0F0F0F0F) | ((w1 >> 2) & 0x30303030), w2 & 0x3F3F3F3F,
                ((w3 >> 4) & 0x0F0F0F0F) | ((w2 >> 2) & 0x30303030))

    @jit
    def _int22_float(v):
        """float32 of an int32 with |v| < 2^22: the bits of 2^23 + 2^22 + v as a float, minus that bias (two
        full-rate operations instead of a quarter-rate I2F)."""
        return (v + 0x4B400000).to(tl.float32, bitcast=True) - 12582912.0

    @jit
    def _d_columns(col0, t, M, stride_xd, e, zw):
        """Offsets of the per-32 activation scales of the D columns 2t and 2t + 1 (word e: sub-block e of a
        super-block; stride_xd = K / 32 as its own argument, which Triton specialises as 16-divisible, so
        the loads are 16 bytes wide); columns past the end read the last one."""
        return (tl.minimum(col0 + 2 * t, M - 1).to(tl.int64) * stride_xd + e + zw,
                tl.minimum(col0 + 2 * t + 1, M - 1).to(tl.int64) * stride_xd + e + zw)

    @jit
    def _block_scales(ptr, c_d0, c_d1, blk):
        """A super-block's 8 per-32 scales of the two D columns: (column 2t sub-blocks 0-3, 4-7, column
        2t + 1 sub-blocks 0-3, 4-7)."""
        at0 = ptr + c_d0 + blk * 8
        at1 = ptr + c_d1 + blk * 8
        return tl.load(at0), tl.load(at0 + 4), tl.load(at1), tl.load(at1 + 4)

    @jit
    def _word(v, S: tl.constexpr):
        """Word S of the 4 along the last axis of a `[L, RT, NT, 4]` tensor, split out of the thread's
        registers (no arithmetic: a float pick by a sum needs an add of +0.0 per value to keep −0.0)."""
        even, odd = tl.split(tl.reshape(v, [v.shape[0], v.shape[1], v.shape[2], 2, 2]))
        w02, w13 = tl.split(odd if S % 2 else even)
        return w13 if S >= 2 else w02

    @jit
    def _of8(lo, hi, S: tl.constexpr):
        """Value S of the 8 held as words of lo (0-3) and hi (4-7)."""
        return _word(lo, S) if S < 4 else _word(hi, S - 4)

    @jit
    def _lane_map(tile, WARPS: tl.constexpr, RT: tl.constexpr, NT: tl.constexpr):
        """The lane map of row tile `tile` (16 · WARPS · RT rows), tensors `[32·warps, RT, NT, 4]`: the word
        axis e, int32 zeros at that shape, each lane's group g and slot t (lane 4g + t), its A rows row_a = g
        and row_a + 8 of its warp's 16-row tile, and the first column of its 8-column tile."""
        i = tl.arange(0, 32 * WARPS)[:, None, None, None]
        rt = tl.arange(0, RT)[None, :, None, None]
        nt = tl.arange(0, NT)[None, None, :, None]
        e = tl.arange(0, 4)[None, None, None, :]
        g = (i % 32) // 4
        row_a = ((tile * WARPS + i // 32) * RT + rt) * 16 + g
        return (e, i * 0 + rt * 0 + nt * 0 + e * 0, g, i % 4, row_a, tl.program_id(1) * (8 * NT) + nt * 8)

    @jit
    def _k_loads(w_ptr, xd_ptr, h_a, h_b, q_at, x_at, w_row, c_d0, c_d1, xs_at, blk, e, t, FMT: tl.constexpr,
                 WB: tl.constexpr):
        """Everything a lane reads of one q4_k / q5_k super-block: header words of rows g and g + 8, the D
        columns' activation scales, column g's activation sums of sub-blocks t and 4 + t, the qs and
        activation words of the 4 sub-block pairs, and (q5_k) the qh words."""
        dx0_lo, dx0_hi, dx1_lo, dx1_hi = _block_scales(xd_ptr, c_d0, c_d1, blk)
        q = q_at + blk * WB
        x = x_at + blk * 64
        if FMT == 5:  # fifth bit of code 32s + l: bit s of qh byte l (qh words 4..11)
            qh = tl.load(w_ptr + w_row + blk * WB + 4 + 2 * t + e % 2)
        else:
            qh = e * 0
        return (tl.load(h_a + blk * WB), tl.load(h_b + blk * WB), dx0_lo, dx0_hi, dx1_lo, dx1_hi,
                tl.load(xs_at + blk * 8), tl.load(xs_at + blk * 8 + 4), tl.load(q), tl.load(q + 8),
                tl.load(q + 16), tl.load(q + 24), tl.load(x), tl.load(x + 16), tl.load(x + 32),
                tl.load(x + 48), qh)

    @jit
    def _k_math(ha, hb, dx0_lo, dx0_hi, dx1_lo, dx1_hi, xs_lo, xs_hi, q0, q1, q2, q3, x0, x1, x2, x3, qh,
                byte_t, top, e, zf, FMT: tl.constexpr, L: tl.constexpr, RT: tl.constexpr, NT: tl.constexpr,
                EMULATE: tl.constexpr):
        """One q4_k / q5_k super-block's part of a lane's four sums, from what `_k_loads` read."""
        # the 6-bit scales and mins of rows g and g + 8, four to a word (byte j: sub-block j, 4 + j)
        sc_a_lo, sc_a_hi, mn_a_lo, mn_a_hi = _k_scale_bytes(ha, e)
        sc_b_lo, sc_b_hi, mn_b_lo, mn_b_hi = _k_scale_bytes(hb, e)
        # Σ_s mn·xs of the four (dmin after it): one 16×8×8 product over the 8 sub-blocks
        low0, low1, low2, low3 = _mma_tf32(
            prmt(mn_a_lo, top, byte_t, EMULATE).to(tl.float32, bitcast=True) - 8388608.0,
            prmt(mn_b_lo, top, byte_t, EMULATE).to(tl.float32, bitcast=True) - 8388608.0,
            prmt(mn_a_hi, top, byte_t, EMULATE).to(tl.float32, bitcast=True) - 8388608.0,
            prmt(mn_b_hi, top, byte_t, EMULATE).to(tl.float32, bitcast=True) - 8388608.0,
            xs_lo, xs_hi, L, RT, NT, EMULATE)
        sum0 = zf  # this super-block's Σ_s sc·D·xd of the four (d applied after it)
        sum1 = zf
        sum2 = zf
        sum3 = zf
        for c in tl.static_range(4):
            if c == 0:
                q = q0
                x = x0
            elif c == 1:
                q = q1
                x = x1
            elif c == 2:
                q = q2
                x = x2
            else:
                q = q3
                x = x3
            for h in tl.static_range(2):
                codes = (q >> (4 * h)) & 0x0F0F0F0F
                if FMT == 5:
                    codes = codes | (((qh >> (2 * c + h)) << 4) & 0x10101010)
                r0, r1, r2, r3 = _mma(_pick(codes, e, 0), _pick(codes, e, 2), _pick(codes, e, 1),
                                      _pick(codes, e, 3), _pick(x, e, 2 * h), _pick(x, e, 2 * h + 1),
                                      L, RT, NT, EMULATE)
                s = 2 * c + h
                sh = 8 * (s % 4)
                if s < 4:
                    sc_a = (sc_a_lo >> sh) & 0xFF
                    sc_b = (sc_b_lo >> sh) & 0xFF
                else:
                    sc_a = (sc_a_hi >> sh) & 0xFF
                    sc_b = (sc_b_hi >> sh) & 0xFF
                xd0 = _of8(dx0_lo, dx0_hi, s)
                xd1 = _of8(dx1_lo, dx1_hi, s)
                # sc·D exactly in int32 (|D| ≤ 32·15·127, sc < 64), then to float without a conversion
                sum0 += _int22_float(r0 * sc_a) * xd0
                sum1 += _int22_float(r1 * sc_a) * xd1
                sum2 += _int22_float(r2 * sc_b) * xd0
                sum3 += _int22_float(r3 * sc_b) * xd1
        d_a = _f16_lo(_pick(ha, e, 0))
        m_a = _f16_lo(_pick(ha, e, 0) >> 16)
        d_b = _f16_lo(_pick(hb, e, 0))
        m_b = _f16_lo(_pick(hb, e, 0) >> 16)
        return (d_a * sum0 - m_a * low0, d_a * sum1 - m_a * low1, d_b * sum2 - m_b * low2,
                d_b * sum3 - m_b * low3)

    @jit
    def _stream_span(N, K, ROWS: tl.constexpr):
        """Stream-K: this program's even share [start, end) of the row-tile-major (row tile of ROWS rows,
        super-block) steps, and the number of super-blocks per row; it touches row tiles start // nb up to
        (end − 1) // nb (none where start ≥ end)."""
        nb = K // 256
        total = tl.cdiv(N, ROWS) * nb
        per = tl.cdiv(total, tl.num_programs(2))
        start = tl.program_id(2) * per
        return start, tl.minimum(start + per, total), nb

    @jit
    def _gemv_frag_kernel(w_ptr, xw_ptr, xd_ptr, xs_ptr, y_ptr, o_ptr, cnt_ptr, N, K, M, row_len, xd_len,
                          stride_ym, FMT: tl.constexpr, WARPS: tl.constexpr, RT: tl.constexpr,
                          NT: tl.constexpr, SPLIT_K: tl.constexpr, EMULATE: tl.constexpr,
                          PREFETCH: tl.constexpr = False, STREAM: tl.constexpr = False,
                          FIXUP: tl.constexpr = False, PDL: tl.constexpr = 0, UNITS: tl.constexpr = False):
        # the row length (36 or 44 words a block) and the activation scales' row stride (8 a block). UNITS:
        # given in 16-byte units and super-blocks, whose products with the constants carry the alignment into
        # the axis analysis, so the loads keep 4 words to a thread whatever the sizes' divisibility by 16
        # (in words, rows of e.g. 1280 columns had Triton lay the word axis 2 to a thread and 2 over lanes,
        # which breaks the lane-first fragments: garbage sums). Else in words, both multiples of 16 (Triton
        # specialises them so, `needs_units`): the build timed in sessions 9-14, whose non-prefetching loop
        # issues its loads earlier
        row_words = row_len * 4 if UNITS else row_len
        stride_xd = xd_len * 8 if UNITS else xd_len
        pdl_start(PDL)
        if STREAM:
            start, end, nb = _stream_span(N, K, 16 * WARPS * RT)
            for tile in range(start // nb, (end + nb - 1) // nb):
                a0, a1, a2, a3, row, col = _k_tile(
                    w_ptr, xw_ptr, xd_ptr, xs_ptr, N, K, M, row_words, stride_xd, tile,
                    tl.maximum(start - tile * nb, 0), tl.minimum(end - tile * nb, nb), FMT, WARPS, RT, NT,
                    EMULATE, PREFETCH)
                _store_tile(y_ptr, a0, a1, a2, a3, row, col, M, N, stride_ym, True)
        else:
            s0, s1 = _step_range(K, 1, SPLIT_K)
            a0, a1, a2, a3, row, col = _k_tile(w_ptr, xw_ptr, xd_ptr, xs_ptr, N, K, M, row_words,
                                               stride_xd, tl.program_id(0), s0, s1, FMT, WARPS, RT, NT,
                                               EMULATE, PREFETCH)
            pdl_release(PDL)
            _finish(y_ptr, o_ptr, cnt_ptr, a0, a1, a2, a3, row, col, M, N, stride_ym, SPLIT_K, FIXUP)

    @jit
    def _k_tile(w_ptr, xw_ptr, xd_ptr, xs_ptr, N, K, M, row_words, stride_xd, tile, s0, s1, FMT: tl.constexpr,
                WARPS: tl.constexpr, RT: tl.constexpr, NT: tl.constexpr, EMULATE: tl.constexpr,
                PREFETCH: tl.constexpr):
        """Row tile `tile`'s super-blocks [s0, s1) of q4_k / q5_k: a lane's four sums of the mma's D layout
        and their row and column (`_store_tile`)."""
        L: tl.constexpr = 32 * WARPS
        WB: tl.constexpr = 36 if FMT == 4 else 44  # int32 words per block
        QS: tl.constexpr = 4 if FMT == 4 else 12  # first qs word
        e, zw, g, t, row_a, col0 = _lane_map(tile, WARPS, RT, NT)
        # weights: the lane's 8 qs bytes of rows g (words e = 0, 1) and g + 8 (e = 2, 3); rows past the end
        # read the last one and are not stored
        w_row = tl.minimum(row_a + 8 * (e // 2), N - 1).to(tl.int64) * row_words + zw
        h_a = w_ptr + tl.minimum(row_a, N - 1).to(tl.int64) * row_words + e + zw  # header words of row g
        h_b = w_ptr + tl.minimum(row_a + 8, N - 1).to(tl.int64) * row_words + e + zw
        q_at = w_ptr + w_row + QS + 2 * t + e % 2
        # activation: codes 8t..8t + 7 of column g's low (e = 0, 1) and high (e = 2, 3) sub-block
        x_col = tl.minimum(col0 + g, M - 1).to(tl.int64) * (K // 4)
        x_at = xw_ptr + x_col + 2 * t + e % 2 + 8 * (e // 2) + zw
        c_d0, c_d1 = _d_columns(col0, t, M, stride_xd, e, zw)
        # the min term's B fragment: column g's activation sums of sub-blocks t and 4 + t (t hidden from
        # the contiguity analysis, see the q6_k kernel); its A fragment picks byte t of the min words
        t3 = _pick(t + zw, e, 0)
        xs_at = xs_ptr + _pick(tl.minimum(col0 + g, M - 1).to(tl.int64) + zw, e, 0) * stride_xd + tl.where(
            t3 < 4, t3, 0)
        byte_t = 0x7440 + t3  # prmt: byte t, zeros, 0x4B on top (the fp32 bits of 2^23 + byte)
        top = t3 * 0 + 0x4B000000
        zf = tl.zeros([L, RT, NT], dtype=tl.float32)
        acc0 = zf  # row g, column 2t
        acc1 = zf  # row g, column 2t + 1
        acc2 = zf  # row g + 8, column 2t
        acc3 = zf  # row g + 8, column 2t + 1
        if PREFETCH:  # the loads of super-block blk + 1 issue before blk's math (the last one reads itself)
            (ha, hb, dx0_lo, dx0_hi, dx1_lo, dx1_hi, xs_lo, xs_hi, q0, q1, q2, q3, x0, x1, x2, x3,
             qh) = _k_loads(w_ptr, xd_ptr, h_a, h_b, q_at, x_at, w_row, c_d0, c_d1, xs_at,
                            tl.minimum(s0, K // 256 - 1), e, t, FMT, WB)
            for blk in range(s0, s1):
                (n_ha, n_hb, n_dx0_lo, n_dx0_hi, n_dx1_lo, n_dx1_hi, n_xs_lo, n_xs_hi, n_q0, n_q1, n_q2, n_q3,
                 n_x0, n_x1, n_x2, n_x3, n_qh) = _k_loads(w_ptr, xd_ptr, h_a, h_b, q_at, x_at, w_row, c_d0,
                                                          c_d1, xs_at, tl.minimum(blk + 1, s1 - 1), e, t, FMT,
                                                          WB)
                c0, c1, c2, c3 = _k_math(ha, hb, dx0_lo, dx0_hi, dx1_lo, dx1_hi, xs_lo, xs_hi, q0, q1, q2, q3,
                                         x0, x1, x2, x3, qh, byte_t, top, e, zf, FMT, L, RT, NT, EMULATE)
                acc0 += c0
                acc1 += c1
                acc2 += c2
                acc3 += c3
                ha, hb, dx0_lo, dx0_hi, dx1_lo, dx1_hi = n_ha, n_hb, n_dx0_lo, n_dx0_hi, n_dx1_lo, n_dx1_hi
                xs_lo, xs_hi, qh = n_xs_lo, n_xs_hi, n_qh
                q0, q1, q2, q3, x0, x1, x2, x3 = n_q0, n_q1, n_q2, n_q3, n_x0, n_x1, n_x2, n_x3
        else:
            for blk in range(s0, s1):
                c0, c1, c2, c3 = _k_math(*_k_loads(w_ptr, xd_ptr, h_a, h_b, q_at, x_at, w_row, c_d0, c_d1,
                                                   xs_at, blk, e, t, FMT, WB), byte_t, top, e, zf, FMT, L, RT,
                                         NT, EMULATE)
                acc0 += c0
                acc1 += c1
                acc2 += c2
                acc3 += c3
        return acc0, acc1, acc2, acc3, _pick(row_a + zw, e, 0), _pick(col0 + 2 * t + zw, e, 0)

    @jit
    def _signed_grid(g, nib, EMULATE: tl.constexpr):
        """Grid word g (4 magnitude bytes, each 1..15) with byte k negated where bit k of nib (low 4 bits) is
        set: nib · 0x10204080 puts bit k at the top of byte k (the 4 shifted copies never overlap), a
        sign-replicating `prmt` makes the byte mask m, and −g = g ^ 0xFE per byte (odd magnitudes)."""
        m = prmt((nib & 0xF) * 0x10204080, nib * 0, 0xBA98 + nib * 0, EMULATE)
        return g ^ (m & -0x01010102)  # 0xFEFEFEFE as int32

    @jit
    def _grid(grid16_ptr, idx):
        """`iq3s_grid_word` for int32 indices (0..511): a signed offset is one IMAD.WIDE, an unsigned one
        two LEAs."""
        h = tl.load(grid16_ptr + idx).to(tl.uint16, bitcast=True).to(tl.int32)
        return (h | (h << 12)) & 0x0F0F0F0F

    @jit
    def _iq3_lane_words(w_ptr, b0, t, e):
        """A lane's qs-pair and sign-byte words of one iq3_s block at byte offset b0 (full tile shape, the
        same for every e): qs pair 2t of sub-blocks e (lo) and 4 + e (hi), sign byte t of the same
        sub-blocks, each shifted into the low bits."""
        q_at = b0 + 2 + 2 * t  # even: a 2-byte piece never crosses an aligned word
        s_at = b0 + 74 + t
        q_word = w_ptr + (q_at >> 2) + 2 * e
        s_word = w_ptr + (s_at >> 2) + e
        q_sh = ((q_at & 3) * 8).to(tl.int32)
        s_sh = ((s_at & 3) * 8).to(tl.int32)
        return (tl.load(q_word) >> q_sh, tl.load(q_word + 8) >> q_sh, tl.load(s_word) >> s_sh,
                tl.load(s_word + 4) >> s_sh)

    @jit
    def _gemv_frag_iq3_kernel(w_ptr, xw_ptr, xd_ptr, grid_ptr, y_ptr, o_ptr, cnt_ptr, N, K, M, row_bytes,
                              xd_blocks, stride_ym, WARPS: tl.constexpr, RT: tl.constexpr, NT: tl.constexpr,
                              SPLIT_K: tl.constexpr, WIDE: tl.constexpr, EMULATE: tl.constexpr,
                              STREAM: tl.constexpr = False, FIXUP: tl.constexpr = False,
                              PDL: tl.constexpr = 0):
        stride_xd = xd_blocks * 8  # as `_gemv_frag_kernel`: 4 words to a thread whatever K's divisibility
        pdl_start(PDL)
        if STREAM:
            start, end, nb = _stream_span(N, K, 16 * WARPS * RT)
            for tile in range(start // nb, (end + nb - 1) // nb):
                a0, a1, a2, a3, row, col = _iq3_tile(
                    w_ptr, xw_ptr, xd_ptr, grid_ptr, N, K, M, row_bytes, stride_xd, tile,
                    tl.maximum(start - tile * nb, 0), tl.minimum(end - tile * nb, nb), WARPS, RT, NT, WIDE,
                    EMULATE)
                _store_tile(y_ptr, a0, a1, a2, a3, row, col, M, N, stride_ym, True)
        else:
            s0, s1 = _step_range(K, 1, SPLIT_K)
            a0, a1, a2, a3, row, col = _iq3_tile(w_ptr, xw_ptr, xd_ptr, grid_ptr, N, K, M, row_bytes,
                                                 stride_xd, tl.program_id(0), s0, s1, WARPS, RT, NT, WIDE,
                                                 EMULATE)
            pdl_release(PDL)
            _finish(y_ptr, o_ptr, cnt_ptr, a0, a1, a2, a3, row, col, M, N, stride_ym, SPLIT_K, FIXUP)

    @jit
    def _iq3_tile(w_ptr, xw_ptr, xd_ptr, grid_ptr, N, K, M, row_bytes, stride_xd, tile, s0, s1,
                  WARPS: tl.constexpr, RT: tl.constexpr, NT: tl.constexpr, WIDE: tl.constexpr,
                  EMULATE: tl.constexpr):
        """iq3_s (110-byte blocks: d, qs[64], qh[8], signs[32], scales[4]): lane t's codes 8t..8t + 7 of
        sub-block s are grid words 2t and 2t + 1 — qs bytes 8s + 2t, 8s + 2t + 1, their 9th bits 2t, 2t + 1
        of qh byte s — and sign byte 4s + t (low nibble word 2t, high nibble 2t + 1). Blocks are only 2-byte
        aligned, so the weight is read as aligned int32 words at byte offsets; every piece lies at an even
        offset of its block, so a shift of 0 or 16 bits places it (`_shf` where 4 bytes span two words).
        The word axis e carries rows g (e even) and g + 8 (odd). y += Σ_s d·(1 + 2·sc_s) · D_s · xd_s (no
        min term). WIDE: 64-bit byte offsets (tensors of 2 GiB and more). Row tile `tile`'s super-blocks
        [s0, s1), returned as `_k_tile`'s."""
        L: tl.constexpr = 32 * WARPS
        e, zw, g, t, row_a, col0 = _lane_map(tile, WARPS, RT, NT)
        row = tl.minimum(tl.where(e % 2 == 0, row_a, row_a + 8), N - 1)
        base = (row.to(tl.int64) if WIDE else row) * row_bytes + zw  # rows g (e even) and g + 8 (e odd)
        row_g = tl.minimum(row_a, N - 1)
        row_g8 = tl.minimum(row_a + 8, N - 1)
        base_a = (row_g.to(tl.int64) if WIDE else row_g) * row_bytes + zw
        base_b = (row_g8.to(tl.int64) if WIDE else row_g8) * row_bytes + zw
        x_col = tl.minimum(col0 + g, M - 1).to(tl.int64) * (K // 4)
        x_at = xw_ptr + x_col + 2 * t + e % 2 + 8 * (e // 2) + zw
        c_d0, c_d1 = _d_columns(col0, t, M, stride_xd, e, zw)
        t3 = _pick(t + zw, e, 0)
        zf = tl.zeros([L, RT, NT], dtype=tl.float32)
        acc0 = zf  # row g, column 2t
        acc1 = zf  # row g, column 2t + 1
        acc2 = zf  # row g + 8, column 2t
        acc3 = zf  # row g + 8, column 2t + 1
        for blk in range(s0, s1):
            b0 = base + blk * 110
            sh0 = ((b0 & 3) * 8).to(tl.int32)  # 0 or 16: the bit shift of offsets ≡ 0 mod 4 (d)
            sh2 = 16 - sh0  # and of offsets ≡ 2 mod 4 (qh at 66, scales at 106)
            # per row, words (qh 0, qh 1 | qh 2, d | scales 0, scales 1) in e = (g, g + 8, g, g + 8)
            h_at = (b0 + 66) >> 2
            w_qh = tl.load(w_ptr + h_at + e // 2)
            w_qd = tl.load(w_ptr + tl.where(e < 2, h_at + 2, b0 >> 2))
            w_sc = tl.load(w_ptr + ((b0 + 106) >> 2) + e // 2)
            # the rows' qh bytes 0-3 and 4-7 and their 4 scale bytes as words (funnel-shifted by sh2)
            sh2_a = _pick(sh2, e, 0)
            sh2_b = _pick(sh2, e, 1)
            qh_a0 = _shf(_pick(w_qh, e, 0), _pick(w_qh, e, 2), sh2_a, EMULATE)
            qh_a1 = _shf(_pick(w_qh, e, 2), _pick(w_qd, e, 0), sh2_a, EMULATE)
            qh_b0 = _shf(_pick(w_qh, e, 1), _pick(w_qh, e, 3), sh2_b, EMULATE)
            qh_b1 = _shf(_pick(w_qh, e, 3), _pick(w_qd, e, 1), sh2_b, EMULATE)
            sc_aw = _shf(_pick(w_sc, e, 0), _pick(w_sc, e, 2), sh2_a, EMULATE)
            sc_bw = _shf(_pick(w_sc, e, 1), _pick(w_sc, e, 3), sh2_b, EMULATE)
            # per row: the words of the qs pairs 2t of sub-blocks s = e, 4 + e (every second word) and of the
            # sign bytes t (consecutive words), each set from one base (4 loads at immediate offsets)
            qa_lo, qa_hi, sa_lo, sa_hi = _iq3_lane_words(w_ptr, base_a + blk * 110, t, e)
            qb_lo, qb_hi, sb_lo, sb_hi = _iq3_lane_words(w_ptr, base_b + blk * 110, t, e)
            dx0_lo, dx0_hi, dx1_lo, dx1_hi = _block_scales(xd_ptr, c_d0, c_d1, blk)
            sum0 = zf
            sum1 = zf
            sum2 = zf
            sum3 = zf
            for c in tl.static_range(4):
                x = tl.load(x_at + blk * 64 + 16 * c)
                for h in tl.static_range(2):
                    s = 2 * c + h
                    if s < 4:
                        q_a = _pick(qa_lo, e, s)
                        q_b = _pick(qb_lo, e, s)
                        sg_a = _pick(sa_lo, e, s)
                        sg_b = _pick(sb_lo, e, s)
                    else:
                        q_a = _pick(qa_hi, e, s - 4)
                        q_b = _pick(qb_hi, e, s - 4)
                        sg_a = _pick(sa_hi, e, s - 4)
                        sg_b = _pick(sb_hi, e, s - 4)
                    # bits 2t, 2t + 1 of qh byte s: the 9th index bits of words 2t, 2t + 1
                    if s < 4:
                        h_a = qh_a0 >> (8 * s + 2 * t3)
                        h_b = qh_b0 >> (8 * s + 2 * t3)
                    else:
                        h_a = qh_a1 >> (8 * s - 32 + 2 * t3)
                        h_b = qh_b1 >> (8 * s - 32 + 2 * t3)
                    g0_a = _grid(grid_ptr, (q_a & 0xFF) | ((h_a & 1) << 8))
                    g1_a = _grid(grid_ptr, ((q_a >> 8) & 0xFF) | ((h_a & 2) << 7))
                    g0_b = _grid(grid_ptr, (q_b & 0xFF) | ((h_b & 1) << 8))
                    g1_b = _grid(grid_ptr, ((q_b >> 8) & 0xFF) | ((h_b & 2) << 7))
                    r0, r1, r2, r3 = _mma(_signed_grid(g0_a, sg_a, EMULATE),
                                          _signed_grid(g0_b, sg_b, EMULATE),
                                          _signed_grid(g1_a, sg_a >> 4, EMULATE),
                                          _signed_grid(g1_b, sg_b >> 4, EMULATE),
                                          _pick(x, e, 2 * h), _pick(x, e, 2 * h + 1), L, RT, NT, EMULATE)
                    # scale nibble s: 4 scale bytes from the two words of each row
                    sc_a = 1 + 2 * ((sc_aw >> (4 * s)) & 0xF)
                    sc_b = 1 + 2 * ((sc_bw >> (4 * s)) & 0xF)
                    xd0 = _of8(dx0_lo, dx0_hi, s)
                    xd1 = _of8(dx1_lo, dx1_hi, s)
                    # sc·D exactly in int32 (|D| ≤ 32·15·127, sc ≤ 31), then to float without a conversion
                    sum0 += _int22_float(r0 * sc_a) * xd0
                    sum1 += _int22_float(r1 * sc_a) * xd1
                    sum2 += _int22_float(r2 * sc_b) * xd0
                    sum3 += _int22_float(r3 * sc_b) * xd1
            d_a = _f16_lo(_pick(w_qd, e, 2) >> _pick(sh0, e, 0))
            d_b = _f16_lo(_pick(w_qd, e, 3) >> _pick(sh0, e, 1))
            acc0 += d_a * sum0
            acc1 += d_a * sum1
            acc2 += d_b * sum2
            acc3 += d_b * sum3
        return acc0, acc1, acc2, acc3, _pick(row_a + zw, e, 0), _pick(col0 + 2 * t + zw, e, 0)

    @jit
    def _q6k_lane_words(w_ptr, b0, t, e):
        """A lane's words of one q6_k block at byte offset b0 (full tile shape, the same for every e), each
        with the aligned word after it (the pair `_shf` joins): the 4-byte pieces 4t of the eight 16-byte ql
        runs (runs e and 4 + e), of the four 16-byte qh runs (run e), and the scale words 48 + e (the word
        after the last one, 52, holds d)."""
        q = w_ptr + (b0 >> 2) + t + 4 * e
        sc = w_ptr + (b0 >> 2) + 48 + e
        return (tl.load(q), tl.load(q + 1), tl.load(q + 16), tl.load(q + 17), tl.load(q + 32),
                tl.load(q + 33), tl.load(sc), tl.load(sc + 1))

    @jit
    def _q6_codes(low, qh, JQ: tl.constexpr):
        """Words of 4 q6_k codes 0..63 from 4 low nibbles (low, in each byte's bits 0-3) and their two high
        bits (bits 2·JQ, 2·JQ + 1 of each qh byte); `_mma16_q6` applies the −32."""
        return low | (((qh >> (2 * JQ)) & 0x03030303) << 4)

    @jit
    def _gemv_frag_q6k_kernel(w_ptr, xw_ptr, xd_ptr, y_ptr, o_ptr, cnt_ptr, N, K, M, row_bytes, xd_blocks,
                              stride_ym, WARPS: tl.constexpr, RT: tl.constexpr, NT: tl.constexpr,
                              SPLIT_K: tl.constexpr, WIDE: tl.constexpr, EMULATE: tl.constexpr,
                              STREAM: tl.constexpr = False, FIXUP: tl.constexpr = False,
                              PDL: tl.constexpr = 0):
        stride_xd = xd_blocks * 8  # as `_gemv_frag_kernel`: 4 words to a thread whatever K's divisibility
        pdl_start(PDL)
        if STREAM:
            start, end, nb = _stream_span(N, K, 16 * WARPS * RT)
            for tile in range(start // nb, (end + nb - 1) // nb):
                a0, a1, a2, a3, row, col = _q6_tile(
                    w_ptr, xw_ptr, xd_ptr, N, K, M, row_bytes, stride_xd, tile,
                    tl.maximum(start - tile * nb, 0), tl.minimum(end - tile * nb, nb), WARPS, RT, NT, WIDE,
                    EMULATE)
                _store_tile(y_ptr, a0, a1, a2, a3, row, col, M, N, stride_ym, True)
        else:
            s0, s1 = _step_range(K, 1, SPLIT_K)
            a0, a1, a2, a3, row, col = _q6_tile(w_ptr, xw_ptr, xd_ptr, N, K, M, row_bytes, stride_xd,
                                                tl.program_id(0), s0, s1, WARPS, RT, NT, WIDE, EMULATE)
            pdl_release(PDL)
            _finish(y_ptr, o_ptr, cnt_ptr, a0, a1, a2, a3, row, col, M, N, stride_ym, SPLIT_K, FIXUP)

    @jit
    def _q6_tile(w_ptr, xw_ptr, xd_ptr, N, K, M, row_bytes, stride_xd, tile, s0, s1, WARPS: tl.constexpr,
                 RT: tl.constexpr, NT: tl.constexpr, WIDE: tl.constexpr, EMULATE: tl.constexpr):
        """q6_k (210-byte blocks: ql[128], qh[64], scales[16] int8, d) on m16n8k16 int8 mmas, one per
        16-code scale group j = 8h + 2·jq + b: lane t's codes 4t..4t + 3 of the group are the 4-byte ql piece
        at 64h + 32(jq % 2) + 16b + 4t (nibble jq // 2) and the qh piece at 128 + 32h + 16b + 4t (bits
        2·jq). Every piece lies at an offset ≡ 0 mod 4 of its 2-byte-aligned block, so all take the block's
        one funnel shift (0 or 16 bits). y += d · Σ_j sc_j · D_j · xd_(j/2), over row tile `tile`'s
        super-blocks [s0, s1), returned as `_k_tile`'s."""
        L: tl.constexpr = 32 * WARPS
        e, zw, g, t, row_a, col0 = _lane_map(tile, WARPS, RT, NT)
        row_g = tl.minimum(row_a, N - 1)
        row_g8 = tl.minimum(row_a + 8, N - 1)
        base_a = (row_g.to(tl.int64) if WIDE else row_g) * row_bytes + zw
        base_b = (row_g8.to(tl.int64) if WIDE else row_g8) * row_bytes + zw
        # t hidden from Triton's contiguity analysis: the lanes of a row read consecutive words, and a
        # contiguous lane axis would be vectorised, giving a thread 4 lanes' elements (and each mma 4 times)
        t_h = tl.where(t < 4, t, 0)
        # activation: codes 16j + 4t..4t + 3 of column g are word 4j + t (group 4u + e in load u)
        x_at = xw_ptr + tl.minimum(col0 + g, M - 1).to(tl.int64) * (K // 4) + t_h + 4 * e + zw
        c_d0, c_d1 = _d_columns(col0, t, M, stride_xd, e, zw)
        zf = tl.zeros([L, RT, NT], dtype=tl.float32)
        acc0 = zf  # row g, column 2t
        acc1 = zf  # row g, column 2t + 1
        acc2 = zf  # row g + 8, column 2t
        acc3 = zf  # row g + 8, column 2t + 1
        for blk in range(s0, s1):
            b_a = base_a + blk * 210
            b_b = base_b + blk * 210
            sh_a = _pick(((b_a & 3) * 8).to(tl.int32), e, 0)  # 0 or 16
            sh_b = _pick(((b_b & 3) * 8).to(tl.int32), e, 0)
            la, la_n, la4, la4_n, ha, ha_n, sa, sa_n = _q6k_lane_words(w_ptr, b_a, t_h, e)
            lb, lb_n, lb4, lb4_n, hb, hb_n, sb, sb_n = _q6k_lane_words(w_ptr, b_b, t_h, e)
            d_a = _f16_lo(_pick(sa_n, e, 3) >> sh_a)
            d_b = _f16_lo(_pick(sb_n, e, 3) >> sh_b)
            dx0_lo, dx0_hi, dx1_lo, dx1_hi = _block_scales(xd_ptr, c_d0, c_d1, blk)
            sum0 = zf
            sum1 = zf
            sum2 = zf
            sum3 = zf
            for u in tl.static_range(4):  # activation words of groups 4u..4u + 3
                x = tl.load(x_at + blk * 64 + 16 * u)
                for v in tl.static_range(4):
                    j = 4 * u + v
                    jq = (j % 8) // 2
                    run = 4 * (j // 8) + 2 * (jq % 2) + j % 2  # the 16-byte ql run: 64h + 32(jq % 2) + 16b
                    if run < 4:
                        qa = _shf(_pick(la, e, run), _pick(la_n, e, run), sh_a, EMULATE)
                        qb = _shf(_pick(lb, e, run), _pick(lb_n, e, run), sh_b, EMULATE)
                    else:
                        qa = _shf(_pick(la4, e, run - 4), _pick(la4_n, e, run - 4), sh_a, EMULATE)
                        qb = _shf(_pick(lb4, e, run - 4), _pick(lb4_n, e, run - 4), sh_b, EMULATE)
                    hrun = 2 * (j // 8) + j % 2  # the 16-byte qh run: 128 + 32h + 16b
                    hh_a = _shf(_pick(ha, e, hrun), _pick(ha_n, e, hrun), sh_a, EMULATE)
                    hh_b = _shf(_pick(hb, e, hrun), _pick(hb_n, e, hrun), sh_b, EMULATE)
                    code_a = _q6_codes((qa >> (4 * (jq // 2))) & 0x0F0F0F0F, hh_a, jq)
                    code_b = _q6_codes((qb >> (4 * (jq // 2))) & 0x0F0F0F0F, hh_b, jq)
                    r0, r1, r2, r3 = _mma16_q6(code_a, code_b, _pick(x, e, v), L, RT, NT, EMULATE)
                    # the groups' int8 scales: byte j % 4 of scale word j // 4, sign-extended
                    sw_a = _shf(_pick(sa, e, j // 4), _pick(sa_n, e, j // 4), sh_a, EMULATE)
                    sw_b = _shf(_pick(sb, e, j // 4), _pick(sb_n, e, j // 4), sh_b, EMULATE)
                    sc_a = _int22_float((sw_a << (24 - 8 * (j % 4))) >> 24)
                    sc_b = _int22_float((sw_b << (24 - 8 * (j % 4))) >> 24)
                    xd0 = _of8(dx0_lo, dx0_hi, j // 2)
                    xd1 = _of8(dx1_lo, dx1_hi, j // 2)
                    sum0 += (_int22_float(r0) * sc_a) * xd0
                    sum1 += (_int22_float(r1) * sc_a) * xd1
                    sum2 += (_int22_float(r2) * sc_b) * xd0
                    sum3 += (_int22_float(r3) * sc_b) * xd1
            acc0 += d_a * sum0
            acc1 += d_a * sum1
            acc2 += d_b * sum2
            acc3 += d_b * sum3
        return acc0, acc1, acc2, acc3, _pick(row_a + zw, e, 0), _pick(col0 + 2 * t + zw, e, 0)

    @jit
    def _finish(y_ptr, o_ptr, cnt_ptr, acc0, acc1, acc2, acc3, row, col, M, N, stride_ym,
                SPLIT_K: tl.constexpr, FIXUP: tl.constexpr):
        """A split-K program's sums into y: stored (one split), or added with fp32 atomics; FIXUP: the last
        of a tile's SPLIT_K programs to finish (a counter per program tile at cnt_ptr, acq_rel at GPU scope
        after a barrier over the program) reads the tile's totals, writes them to o in its dtype, and leaves
        y and its counter zero for the next call: no zero-fill and no conversion launches."""
        _store_tile(y_ptr, acc0, acc1, acc2, acc3, row, col, M, N, stride_ym, SPLIT_K > 1)
        if FIXUP:
            tl.debug_barrier()
            cnt = cnt_ptr + tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
            if tl.atomic_add(cnt, 1, sem="acq_rel", scope="gpu") == SPLIT_K - 1:
                _fixup_frag(y_ptr, o_ptr, row, col, M, N, stride_ym)
                _fixup_frag(y_ptr, o_ptr, row, col + 1, M, N, stride_ym)
                _fixup_frag(y_ptr, o_ptr, row + 8, col, M, N, stride_ym)
                _fixup_frag(y_ptr, o_ptr, row + 8, col + 1, M, N, stride_ym)
                tl.atomic_xchg(cnt, 0, sem="relaxed")

    @jit
    def _fixup_frag(y_ptr, o_ptr, row, col, M, N, stride_ym):
        """The totals at a lane's (column col, row row) positions from y (through L2) into o; y back to 0."""
        at = col.to(tl.int64) * stride_ym + row
        mask = (col < M) & (row < N)
        total = tl.load(y_ptr + at, mask=mask, other=0.0, cache_modifier=".cg")
        tl.store(o_ptr + at, total.to(o_ptr.dtype.element_ty), mask=mask)
        tl.store(y_ptr + at, tl.zeros_like(total), mask=mask)

    @jit
    def _store_tile(y_ptr, acc0, acc1, acc2, acc3, row, col, M, N, stride_ym, ATOMIC: tl.constexpr):
        """A lane's four sums of the mma's D layout: rows row, row + 8 × columns col, col + 1."""
        _store_frag(y_ptr, acc0, row, col, M, N, stride_ym, ATOMIC)
        _store_frag(y_ptr, acc1, row, col + 1, M, N, stride_ym, ATOMIC)
        _store_frag(y_ptr, acc2, row + 8, col, M, N, stride_ym, ATOMIC)
        _store_frag(y_ptr, acc3, row + 8, col + 1, M, N, stride_ym, ATOMIC)

    @jit
    def _store_frag(y_ptr, out, row, col, M, N, stride_ym, ATOMIC: tl.constexpr):
        """A lane's sums into y at (column col, row row): stored, or added with fp32 atomics (split-K,
        stream-K)."""
        ptrs = y_ptr + col.to(tl.int64) * stride_ym + row
        mask = (col < M) & (row < N)
        if ATOMIC:  # relaxed (a RED): the kernel's end or `_finish`'s release orders them
            tl.atomic_add(ptrs, out, mask=mask, sem="relaxed")
        else:
            tl.store(ptrs, out.to(y_ptr.dtype.element_ty), mask=mask)


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def stream_programs(device: torch.device, s: FragSchedule, out_features: int, in_features: int) -> int:
    """A stream-K schedule's program count: `s.stream` per SM (one per row tile and super-block at most; the
    CPU interpreter counts as one SM)."""
    steps = -(-out_features // s.block_n) * (in_features // 256)
    sms = _sm_count(device) if device.type == "cuda" else 1
    return max(1, min(steps, s.stream * sms))


def needs_units(row_words: int, k: int) -> bool:
    """Whether `_gemv_frag_kernel` takes a weight row's length and the activation scales' stride in aligned
    units (16 bytes, super-blocks) rather than in words: unless both word counts are multiples of 16 (q4_k /
    q5_k rows of a multiple of 1024 columns, as all of the 27B's). The words build is the one timed in
    sessions 9-14; the units build gives the same instructions but another order and register count, and
    its non-prefetching schedules measured slower (docs/gpu-notes.md, session 15)."""
    return row_words % 16 != 0 or k // 32 % 16 != 0


def gemv_frag(raw: torch.Tensor, format: str, xa: QuantizedActivation, out_features: int,
              schedule: FragSchedule | str) -> torch.Tensor:
    """`(q·d) @ Wᵀ -> [n, out_features]` in `xa.dtype`, W the GGUF rows `raw` (uint8 `[N, row_bytes]`, q4_k,
    q5_k, iq3_s or q6_k) and xa the int8 activation (1–16 columns); the kernel runs on `raw`'s device (CUDA,
    or CPU under the interpreter)."""
    format = format.removeprefix(GGUF_PREFIX)
    s = SCHEDULES[schedule] if isinstance(schedule, str) else schedule
    n, k = xa.q.shape
    programs = stream_programs(raw.device, s, out_features, k) if s.stream else 0
    work = split_work(raw.device, s, n, out_features, programs)
    y, launch, extra = rows_setup(raw, format, xa, out_features, s, FRAG_FORMATS, "tensor-core fragment GEMV",
                                  programs, output=None if work is None else work[0])
    out, fixup = split_target(y, work, xa.dtype)
    args = (y, out, fixup["cnt_ptr"], out_features, k, n)
    tiles = dict(WARPS=s.num_warps, RT=s.row_tiles, NT=s.block_m // 8, SPLIT_K=s.split_k,
                 STREAM=programs > 0, FIXUP=fixup["FIXUP"], EMULATE=EMULATE_DP4A)
    if format in ("iq3_s", "q6_k"):  # 2-byte-aligned blocks: aligned words at byte offsets
        if s.prefetch:  # not in the iq3_s / q6_k kernels
            raise QuantKernelError(f"fragment schedule {s.name} prefetches in the q4_k / q5_k loop only; "
                                   f"{format} takes the schedules without _pf")
        from ninfer.kernels.gemv_rows_iq import _aligned_words

        wide = raw.numel() >= 2**31 - 256
        if format == "iq3_s":
            _gemv_frag_iq3_kernel[launch](_aligned_words(raw), xa.words, xa.d, iq3s_grid16(raw.device), *args,
                                          raw.shape[1], k // 256, y.stride(0), **tiles, WIDE=wide, **extra,
                                          **pdl_options(raw, trigger=False))
        else:
            _gemv_frag_q6k_kernel[launch](_aligned_words(raw), xa.words, xa.d, *args, raw.shape[1], k // 256,
                                          y.stride(0), **tiles, WIDE=wide, **extra,
                                          **pdl_options(raw, trigger=False))
    else:
        units = needs_units(raw.shape[1] // 4, k)
        row_len, xd_len = (raw.shape[1] // 16, k // 256) if units else (raw.shape[1] // 4, k // 32)
        _gemv_frag_kernel[launch](raw.view(torch.int32), xa.words, xa.d, xa.s, *args, row_len, xd_len,
                                  y.stride(0), FMT=_FMT[format], **tiles, PREFETCH=s.prefetch, UNITS=units,
                                  **extra, **pdl_options(raw, trigger=False))
    return out.to(xa.dtype)

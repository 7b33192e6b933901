"""Decode GEMV with int8 activations ("q8"): the activation is quantised once per 32 values, then the GGUF
weight codes are multiplied 4 at a time with `dp4a` and the scales applied once per sub-block.

Shared pieces (also used by `gemv_q8_iq.py`): `QuantizedActivation`, its reference and Triton quantiser, a
one-entry memo so that several Linears fed the same activation quantise it once, and the `dp4a` helper
(PTX on the GPU, shifts and masks under the CPU interpreter).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from ninfer.kernels.gguf_matmul import (
    SCHEDULES,
    MatmulSchedule,
    QuantKernelError,
    _f16_lo,
    _k_scale_min_words,
    check_weight,
    triton_cdiv,
)
from ninfer.kernels.triton_support import (
    HAVE_TRITON,
    INTERPRET,
    jit,
    pdl_options,
    pdl_release,
    pdl_start,
    tl,
    tl_max,
    tl_sum,
    triton_runs_on,
)

QBLOCK = 32  # activation values per int8 scale
EMULATE_DP4A = INTERPRET  # pass as the dp4a EMULATE argument: PTX cannot run in the interpreter


@dataclass(frozen=True)
class QuantizedActivation:
    """`x [n, K]` as int8 codes `q` (contiguous; kernels read `q.view(torch.int32)` `[n, K/4]`), fp32 scale
    `d [n, K/32]` per 32 values, `s = d·Σq` per 32 values (for formats with mins) and the original dtype.
    (`quantize_activation_reference(x, 256)`: d per 256 values, for the group-256 kernels, and `s` int8
    `[n, K/16]`: each 32 values' Σq as 64·hi + lo (hi in -64..63, lo in 0..63), a block of 256's eight hi
    then its eight lo — `gemv_q4il`'s min term reads them as its producer wrote them.)"""

    q: torch.Tensor
    d: torch.Tensor
    s: torch.Tensor
    dtype: torch.dtype

    @property
    def words(self) -> torch.Tensor:
        return self.q.view(torch.int32)

    def row(self, i: int) -> QuantizedActivation:
        """Column `i` alone (views, no copy)."""
        return self.rows(i, i + 1)

    def rows(self, start: int, end: int) -> QuantizedActivation:
        """Columns `start` to `end` (views, no copy)."""
        return QuantizedActivation(self.q[start:end], self.d[start:end], self.s[start:end], self.dtype)

    def dequantize(self) -> torch.Tensor:
        """`q·d` as float64 `[n, K]` (what the q8 kernels multiply the weights with)."""
        n, k = self.q.shape
        group = k // self.d.shape[-1]
        return (self.q.double().reshape(n, k // group, group) * self.d.double()[..., None]).reshape(n, k)


def _check_activation(x: torch.Tensor, group: int = QBLOCK) -> None:
    if x.dim() != 2 or x.shape[1] % QBLOCK:
        raise QuantKernelError(f"int8 activation quantisation needs x [n, K] with K a multiple of {QBLOCK}, "
                               f"got {list(x.shape)}; use a wv_* or sub_* schedule for this weight")
    if group not in (QBLOCK, 256) or x.shape[1] % group:
        raise QuantKernelError(f"int8 activation groups of {group} over {x.shape[1]} values: 32, or 256 "
                               "dividing K")


def quantize_activation_reference(x: torch.Tensor, group: int = QBLOCK) -> QuantizedActivation:
    """Per `group` (32, or 256 for `gemv_il`'s group-256 kernel) values: `d = max|x| / 127`,
    `q = round-half-even(x / d)` (0 where the group is all zero)."""
    _check_activation(x, group)
    n, k = x.shape
    xb = x.float().reshape(n, k // group, group)
    amax = xb.abs().amax(-1)
    # a tensor divisor: PyTorch's CUDA kernels multiply by the reciprocal of a Python-number divisor (not
    # correctly rounded: d one ulp off, then a code one off), the kernels divide (div_rn)
    d = amax / torch.full_like(amax, 127.0)
    safe = torch.where(d == 0, torch.ones_like(d), d)
    q = torch.round(xb / safe[..., None]).clamp(-127, 127).to(torch.int8)
    if group == QBLOCK:
        s = d * q.sum(-1, dtype=torch.int32).float()
    else:  # each 32's Σq split, a block's eight hi then its eight lo
        sums = q.reshape(n, k // 256, 8, 32).sum(-1, dtype=torch.int32)
        s = torch.cat([sums >> 6, sums & 63], -1).to(torch.int8).reshape(n, k // 16)
    return QuantizedActivation(q.reshape(n, k).contiguous(), d.contiguous(), s.contiguous(), x.dtype)


def empty_sums(rows: int, features: int, group: int, device: torch.device) -> torch.Tensor:
    """A `QuantizedActivation`'s `s` to fill: fp32 `[rows, features/32]` at group 32, int8
    `[rows, features/16]` at 256."""
    if group == QBLOCK:
        return torch.empty((rows, features // QBLOCK), dtype=torch.float32, device=device)
    return torch.empty((rows, features // 16), dtype=torch.int8, device=device)


if HAVE_TRITON:

    @jit
    def dp4a(a, b, acc, EMULATE: tl.constexpr):
        """acc + Σ_i a.byte_i · b.byte_i over the 4 signed bytes of int32 words a and b (PTX dp4a.s32.s32);
        EMULATE computes the same with shifts where PTX cannot run (the CPU interpreter)."""
        if EMULATE:
            p = ((a << 24) >> 24) * ((b << 24) >> 24)
            p += ((a << 16) >> 24) * ((b << 16) >> 24)
            p += ((a << 8) >> 24) * ((b << 8) >> 24)
            p += (a >> 24) * (b >> 24)
            return acc + p
        else:
            return tl.inline_asm_elementwise("dp4a.s32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, acc],
                                             dtype=tl.int32, is_pure=True, pack=1)

    @jit
    def _scale(amax):
        """A group's scale from its largest magnitude, and the divisor its codes take (1 where it is 0)."""
        d = tl.math.div_rn(amax, 127.0)
        return d, tl.where(d == 0.0, 1.0, d)

    @jit
    def _codes(v, safe):
        """int8 codes of v / safe as int32: round half to even — adding and removing 1.5·2^23 leaves the
        nearest integer (|v| <= 127) — then clamped to ±127."""
        r = (tl.math.div_rn(v, safe) + 12582912.0) - 12582912.0
        return tl.minimum(tl.maximum(r, -127.0), 127.0).to(tl.int32)

    @jit
    def quantize_groups(v, row, blk, ok, K, q_ptr, d_ptr, s_ptr, GROUP: tl.constexpr = 32):
        """Store the int8 activation of groups `blk` [G] of row `row` (`v` [G, GROUP] fp32, zero where not
        `ok`): codes into q [n, K], d into [n, K/GROUP], and at GROUP 32 d·Σq into [n, K/32], at 256 each
        32's Σq as hi and lo bytes into [n, K/16] (what `quantize_activation_reference` gives; the fused
        norm / SwiGLU kernels call this on their rounded outputs)."""
        nb = K // GROUP
        d, safe = _scale(tl_max(tl.abs(v), 1))
        q = _codes(v, safe[:, None])
        cols = blk[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
        tl.store(q_ptr + row.to(tl.int64) * K + cols, q.to(tl.int8), mask=ok)
        tl.store(d_ptr + row.to(tl.int64) * nb + blk, d, mask=blk < nb)
        if GROUP == 32:
            tl.store(s_ptr + row.to(tl.int64) * nb + blk, d * tl_sum(q, 1).to(tl.float32), mask=blk < nb)
        else:
            sums = tl_sum(tl.reshape(q, [q.shape[0], 8, 32]), 2)  # [G, 8]: each 32's Σq
            at = s_ptr + row.to(tl.int64) * (K // 16) + blk[:, None] * 16 + tl.arange(0, 8)[None, :]
            tl.store(at, (sums >> 6).to(tl.int8), mask=(blk < nb)[:, None])
            tl.store(at + 8, (sums & 63).to(tl.int8), mask=(blk < nb)[:, None])

    @jit
    def quantize_group_rows(v, row, blk, K, q_ptr, d_ptr, s_ptr):
        """`quantize_groups` at GROUP 256 of one group `blk` held as 8 rows of 32 (`v` [8, 32] fp32): the same
        bytes, its scale a scalar and each 32's Σq a row's sum, so a program whose rows of 32 are each in one
        warp reduces the group's maximum across warps once and its sums in none (held as [groups, 256], every
        reduction and the per-32 reshape crossed warps: the 27B's decode norm took 17 barriers, not 5)."""
        d, safe = _scale(tl_max(tl_max(tl.abs(v), 1), 0))
        q = _codes(v, safe)
        sub = tl.arange(0, 8)
        tl.store(q_ptr + row.to(tl.int64) * K + blk * 256 + sub[:, None] * 32 + tl.arange(0, 32)[None, :],
                 q.to(tl.int8))
        tl.store(d_ptr + row.to(tl.int64) * (K // 256) + blk, d)
        sums = tl_sum(q, 1)
        at = s_ptr + row.to(tl.int64) * (K // 16) + blk * 16 + sub
        tl.store(at, (sums >> 6).to(tl.int8))
        tl.store(at + 8, (sums & 63).to(tl.int8))

    @jit
    def _quantize_activation_kernel(x_ptr, q_ptr, d_ptr, s_ptr, K, stride_xm, BLOCKS: tl.constexpr,
                                    GROUP: tl.constexpr = 32, PDL: tl.constexpr = 0):
        pdl_start(PDL)
        row = tl.program_id(0)
        blk = tl.program_id(1) * BLOCKS + tl.arange(0, BLOCKS)
        ok = (blk < K // GROUP)[:, None]
        cols = blk[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
        x = tl.load(x_ptr + row.to(tl.int64) * stride_xm + cols, mask=ok, other=0.0).to(tl.float32)
        quantize_groups(x, row, blk, ok, K, q_ptr, d_ptr, s_ptr, GROUP)


def quantize_activation(x: torch.Tensor, blocks_per_program: int = 8, group: int = QBLOCK
                        ) -> QuantizedActivation:
    """`quantize_activation_reference(x, group)` as one Triton kernel (bit-exact); the reference where
    Triton cannot run on x's device. A program takes `blocks_per_program` groups of 32 (at least one
    group)."""
    _check_activation(x, group)
    if not (HAVE_TRITON and triton_runs_on(x)):
        return quantize_activation_reference(x, group)
    if x.stride(-1) != 1:
        x = x.contiguous()
    n, k = x.shape
    nb = k // group
    blocks = max(1, blocks_per_program * QBLOCK // group)
    q = torch.empty((n, k), dtype=torch.int8, device=x.device)
    d = torch.empty((n, nb), dtype=torch.float32, device=x.device)
    s = empty_sums(n, k, group, x.device)
    _quantize_activation_kernel[(n, -(-nb // blocks))](x, q, d, s, k, x.stride(0), BLOCKS=blocks, GROUP=group,
                                                       **pdl_options(x))
    return QuantizedActivation(q, d, s, x.dtype)


class _ActivationMemo:
    """The last quantised activation, keyed by tensor identity and in-place version: the GDN layer feeds one
    x to six projections and the MLP feeds one x to gate and up, each quantises it once. Pure host-side
    bookkeeping (no syncs). Inference-mode tensors carry no version counter: for them identity alone is the
    key (model code never writes a Linear's input in place, and every other Linear evicts the entry). An
    entry made outside a CUDA-graph capture is never used inside one (nor the reverse), so a captured graph
    always holds its own quantisation."""

    def __init__(self) -> None:
        self.clear()

    @staticmethod
    def _key(x: torch.Tensor) -> tuple[int, bool]:
        version = -2 if x.is_inference() else x._version
        return version, x.is_cuda and torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()

    def get(self, x: torch.Tensor, group: int = QBLOCK) -> QuantizedActivation:
        if (self.ref is not None and self.ref() is x and self._key(x) == (self.version, self.capturing)
                and self.result.d.shape[-1] * group == x.shape[-1]):
            return self.result
        result = quantize_activation(x.reshape(-1, x.shape[-1]), group=group)
        self.put(x, result)
        return result

    def put(self, x: torch.Tensor, result: QuantizedActivation) -> None:
        """Make `result` the entry for x (a kernel that produced x quantised it in the same launch)."""
        self.ref, self.version, self.capturing, self.result = weakref.ref(x), *self._key(x), result

    def clear(self) -> None:
        self.ref: weakref.ref | None = None
        self.version = -1
        self.capturing = False
        self.result: QuantizedActivation | None = None


_MEMO = _ActivationMemo()


def remember_activation(x: torch.Tensor, result: QuantizedActivation) -> None:
    """`result` is x's int8 activation: the next `quantize_activation_cached(x)` returns it."""
    _MEMO.put(x, result)


def int8_next(x: torch.Tensor, group: int = QBLOCK) -> bool:
    """Whether a quantized Linear fed x would quantise it to int8 in groups of `group` (CUDA, decode widths
    of the int8 routes: 1-8 columns, 1-16 where the tensor-core GEMM may take it; whole groups): the kernel
    producing x then does it in the same launch."""
    return x.dim() == 2 and int8_next_shape(x.is_cuda, *x.shape, group)


def int8_next_shape(cuda: bool, rows: int, features: int, group: int = QBLOCK) -> bool:
    """`int8_next` of a `[rows, features]` tensor (on CUDA or not) that is not made yet."""
    from ninfer.kernels.gguf_matmul import q8_enabled, rows_enabled

    return (cuda and features % group == 0 and q8_enabled()
            and 1 <= rows <= (16 if rows_enabled() else 8))


def quantize_activation_cached(x: torch.Tensor, group: int = QBLOCK) -> QuantizedActivation:
    """`quantize_activation(x [..., K], group=group)` of the rows `[n, K]`, reusing the previous result when
    called again with the same, unmodified x (same tensor object, same `_version`) and group."""
    return _MEMO.get(x, group)


# ---------------------------------------------------------------------------------------------------------
# The twin (oracle): dequantised weight times the dequantised int8 activation, float64


def gemv_q8_reference(raw: torch.Tensor, format: str, xa: QuantizedActivation, out_features: int
                      ) -> torch.Tensor:
    """`(q·d) @ Wᵀ` in float64 `[n, out_features]` on raw's device, W dequantised with `ninfer.quant` (on CUDA
    too: bitwise gguf's, `tests/test_quant.py`): what the q8 kernels compute up to fp32 rounding."""
    from ninfer.quant import dequantize
    from ninfer.quant.formats import GGUF_PREFIX

    n, k = xa.q.shape
    name = GGUF_PREFIX + format.removeprefix(GGUF_PREFIX)
    w = dequantize(raw.reshape(-1), name, (out_features, k)).double()
    return xa.dequantize().to(w.device) @ w.t()


# ---------------------------------------------------------------------------------------------------------
# Triton kernels. A program takes BLOCK_N rows × BLOCK_M columns × one split of K and walks 256 codes per
# step (one k-quant block, or 8 q8_0 blocks). Tile axes (column, row, group): each thread owns one (row,
# group) pair, a quarter of the row's step (BLOCK_N·4 = 32·warps), and all columns in registers, so a weight
# word is decoded once for every column and the dp4a sums of a sub-block chain in registers (no cross-thread
# reduction inside the loop). The activation words are loaded per thread (L1 hits: rows share them).

Q8_FORMATS = ("q4_k", "q6_k", "q5_k", "q8_0")  # formats the q8 kernel decodes
_FMT = {"q8_0": 3, "q4_k": 4, "q5_k": 5, "q6_k": 6}  # the codes gguf_matmul.FORMAT_CODES uses
STEP = 256  # codes per loop step of every q8 format


if HAVE_TRITON:

    @jit
    def _word16(u_ptr, mask):
        """int32 word of the int16 pair at u_ptr, u_ptr + 1 (q6_k / q8_0 data are only 2-byte aligned)."""
        lo = tl.load(u_ptr, mask=mask, other=0).to(tl.int32) & 0xFFFF
        hi = tl.load(u_ptr + 1, mask=mask, other=0).to(tl.int32)
        return lo | (hi << 16)

    @jit
    def _full(ptrs, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, STAGES: tl.constexpr):
        """A [BLOCK_M, 1, 4] pointer tile broadcast to the program's [BLOCK_M, BLOCK_N, 4] tile (each thread
        loads the words its own (row, group) needs) for a plain loop; kept [BLOCK_M, 1, 4] for a pipelined
        one (STAGES > 1), whose copies go through shared memory once per program, not once per row."""
        if STAGES > 1:
            return ptrs
        else:
            return tl.broadcast_to(ptrs, [BLOCK_M, BLOCK_N, 4])

    @jit
    def _halves(p64, mask):
        """The low and high int32 words of the int64 at p64 (one 8-byte load for two words)."""
        v = tl.load(p64, mask=mask, other=0)
        return v.to(tl.int32), (v >> 32).to(tl.int32)

    @jit
    def _half(p64, HIGH: tl.constexpr, mask):
        """One int32 word of the int64 at p64 (the loads of both halves are one load after CSE)."""
        v = tl.load(p64, mask=mask, other=0)
        if HIGH:
            return (v >> 32).to(tl.int32)
        else:
            return v.to(tl.int32)

    @jit
    def _kquant_block(row, xw, xd_ptr, xs_ptr, xd, blk, c3, nm, xm, FMT: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_M: tl.constexpr, EMULATE: tl.constexpr):
        """One q4_k / q5_k block's share of the thread tile (see `_kquant_q8`)."""
        WB: tl.constexpr = 18 if FMT == 4 else 22
        QS0: tl.constexpr = 2 if FMT == 4 else 6
        wb = row + blk * WB
        xb = xw + blk * 32
        i_lo = tl.zeros([BLOCK_M, BLOCK_N, 4], dtype=tl.int32)
        i_hi = tl.zeros([BLOCK_M, BLOCK_N, 4], dtype=tl.int32)
        for p2 in tl.static_range(4):
            w0, w1 = _halves(wb + QS0 + 4 * c3 + p2, nm)
            x0, x1 = _halves(xb + p2, xm)
            y0, y1 = _halves(xb + 4 + p2, xm)
            if FMT == 5:
                qh0, qh1 = _halves(wb + 2 + p2, nm)
            for k in tl.static_range(2):
                words = w0 if k == 0 else w1
                lo = words & 0x0F0F0F0F
                hi = (words >> 4) & 0x0F0F0F0F
                if FMT == 5:
                    qh = (qh0 if k == 0 else qh1) >> (2 * c3)
                    lo = lo | ((qh << 4) & 0x10101010)
                    hi = hi | ((qh << 3) & 0x10101010)
                i_lo = dp4a(lo, x0 if k == 0 else x1, i_lo, EMULATE)
                i_hi = dp4a(hi, y0 if k == 0 else y1, i_hi, EMULATE)
        h0, h1 = _halves(wb, nm)
        h2, h3 = _halves(wb + 1, nm)
        d = _f16_lo(h0)
        dmin = _f16_lo(h0 >> 16)
        sc_lo, mn_lo = _k_scale_min_words(h1, h2, h3, 2 * c3)
        sc_hi, mn_hi = _k_scale_min_words(h1, h2, h3, 2 * c3 + 1)
        dx_lo = tl.load(xd_ptr + xd + blk * 8, mask=xm, other=0.0)
        dx_hi = tl.load(xd_ptr + xd + blk * 8 + 1, mask=xm, other=0.0)
        sx_lo = tl.load(xs_ptr + xd + blk * 8, mask=xm, other=0.0)
        sx_hi = tl.load(xs_ptr + xd + blk * 8 + 1, mask=xm, other=0.0)
        part = (d * sc_lo) * (i_lo.to(tl.float32) * dx_lo) + (d * sc_hi) * (i_hi.to(tl.float32) * dx_hi)
        return part - ((dmin * mn_lo) * sx_lo + (dmin * mn_hi) * sx_hi)

    @jit
    def _kquant_q8(u_ptr, xw_ptr, xd_ptr, xs_ptr, offs_n, n_ok, offs_m, m_ok, K, row_units, s0, s1,
                   FMT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, EMULATE: tl.constexpr,
                   STAGES: tl.constexpr, UNROLL: tl.constexpr):
        """q4_k (18 int64 per block) / q5_k (22): qs word (c, p) holds codes 64c + 4p..+3 in its low nibbles
        and 64c + 32 + 4p.. in its high ones; q5_k's fifth bit of code 32s + l is bit s of qh byte l. Group =
        chunk c (sub-blocks 2c, 2c + 1): d·sc·dx·Σq·qx − dmin·mn·(dx·Σqx) per sub-block. Weight and activation
        words are read in int64 pairs. UNROLL = 2 takes two blocks per loop step (both blocks' loads in
        flight together; an odd last block is read twice and counted once)."""
        c3 = tl.arange(0, 4)[None, None, :]
        nm = n_ok[None, :, None]
        xm = m_ok[:, None, None] & (c3 >= 0)
        row = u_ptr + offs_n.to(tl.int64)[None, :, None] * row_units
        xrow = offs_m.to(tl.int64)[:, None, None]
        xw = _full(xw_ptr + xrow * (K // 8) + 8 * c3, BLOCK_M, BLOCK_N, STAGES)
        xd = _full(xrow * (K // 32) + 2 * c3, BLOCK_M, BLOCK_N, STAGES)
        acc = tl.zeros([BLOCK_M, BLOCK_N, 4], dtype=tl.float32)
        for blk in tl.range(s0, s1, UNROLL, num_stages=STAGES):
            part = _kquant_block(row, xw, xd_ptr, xs_ptr, xd, blk, c3, nm, xm, FMT, BLOCK_N, BLOCK_M, EMULATE)
            if UNROLL == 2:
                nxt = _kquant_block(row, xw, xd_ptr, xs_ptr, xd, tl.minimum(blk + 1, s1 - 1), c3, nm, xm, FMT,
                                    BLOCK_N, BLOCK_M, EMULATE)
                part += tl.where(blk + 1 < s1, nxt, 0.0)
            acc += part
        return tl_sum(acc, 2)

    @jit
    def _funnel(lo, hi, odd):
        """The int32 word 2 bytes into the int32 pair (lo, hi) where `odd`, else lo."""
        return tl.where(odd, ((lo >> 16) & 0xFFFF) | (hi << 16), lo)

    @jit
    def _q6k_block(u_ptr, row, xw, xd, blk, h3, half, nm, xm, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
                   EMULATE: tl.constexpr):
        """One q6_k block's share of the thread tile (see `_q6k_q8`)."""
        start = row + blk * 210
        odd = (start & 2) != 0
        ub = u_ptr + (start >> 2)
        xb = xw + blk * 32
        i0 = tl.zeros([BLOCK_M, BLOCK_N, 4], dtype=tl.int32)
        i1 = tl.zeros([BLOCK_M, BLOCK_N, 4], dtype=tl.int32)
        i2 = tl.zeros([BLOCK_M, BLOCK_N, 4], dtype=tl.int32)
        i3 = tl.zeros([BLOCK_M, BLOCK_N, 4], dtype=tl.int32)
        for p in tl.static_range(4):
            at = ub + 32 + 8 * h3 + 4 * half + p
            qh = _funnel(tl.load(at, mask=nm, other=0), tl.load(at + 1, mask=nm, other=0), odd)
            for a in tl.static_range(2):
                at = ub + 16 * h3 + 8 * a + 4 * half + p
                ql = _funnel(tl.load(at, mask=nm, other=0), tl.load(at + 1, mask=nm, other=0), odd)
                for hi in tl.static_range(2):
                    j = a + 2 * hi
                    lo4 = (ql >> (4 * hi)) & 0x0F0F0F0F
                    if j < 2:
                        hi2 = (qh << (4 - 2 * j)) & 0x30303030
                    else:
                        hi2 = (qh >> (2 * j - 4)) & 0x30303030
                    x = (lo4 | hi2) ^ 0x20202020
                    q = x + 6 * (x & 0x20202020)
                    xj = _half(xb + 4 * j + p // 2, p % 2, xm)
                    if j == 0:
                        i0 = dp4a(q, xj, i0, EMULATE)
                    elif j == 1:
                        i1 = dp4a(q, xj, i1, EMULATE)
                    elif j == 2:
                        i2 = dp4a(q, xj, i2, EMULATE)
                    else:
                        i3 = dp4a(q, xj, i3, EMULATE)
        # scale bytes 192 + 8h .. + 7 (words 48 + 2h, 49 + 2h), d in the low or high half of word 52
        sa = ub + 48 + 2 * h3
        w48 = tl.load(sa, mask=nm, other=0)
        w49 = tl.load(sa + 1, mask=nm, other=0)
        w50 = tl.load(sa + 2, mask=nm, other=0)
        sc01 = _funnel(w48, w49, odd)
        sc23 = _funnel(w49, w50, odd)
        sh0 = 24 - 8 * half
        s_0 = (sc01 << sh0) >> 24
        s_1 = (sc01 << (sh0 - 16)) >> 24
        s_2 = (sc23 << sh0) >> 24
        s_3 = (sc23 << (sh0 - 16)) >> 24
        w52 = tl.load(ub + 52, mask=nm, other=0)
        d = _f16_lo(tl.where(odd, w52 >> 16, w52))
        xdb = xd + blk * 8
        part = (s_0 * i0).to(tl.float32) * tl.load(xdb, mask=xm, other=0.0)
        part += (s_1 * i1).to(tl.float32) * tl.load(xdb + 1, mask=xm, other=0.0)
        part += (s_2 * i2).to(tl.float32) * tl.load(xdb + 2, mask=xm, other=0.0)
        part += (s_3 * i3).to(tl.float32) * tl.load(xdb + 3, mask=xm, other=0.0)
        return d * part

    @jit
    def _q6k_q8(u_ptr, xw_ptr, xd_ptr, offs_n, n_ok, offs_m, m_ok, K, row_bytes, s0, s1,
                BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, EMULATE: tl.constexpr, STAGES: tl.constexpr,
                UNROLL: tl.constexpr):
        """q6_k (210 bytes): code 128h + 32j + l has its low 4 bits in ql byte 64h + 32(j % 2) + l (nibble
        j // 2) and its high 2 bits in qh byte 32h + l (bits 2j); int8 scale per 16 codes at byte
        192 + 8h + 2j + (l ≥ 16), fp16 d at byte 208. Group t = (h, half of each 32-code run): 4 words × 4
        runs j. A code word becomes 4 signed bytes q − 32 with x = c ^ 0x20 per byte and the sign spread
        x + 6·(x & 0x20). The weight is read as aligned int32 words (u_ptr: the whole tensor as int32, so the
        loads are 4-byte and the pipeliner can copy them asynchronously): a block starts 0 or 2 bytes into a
        word, its word i is then the funnel of aligned words i and i + 1 (adjacent words share the loads).
        UNROLL = 2: two blocks per loop step, as in `_kquant_q8`."""
        t3 = tl.arange(0, 4)[None, None, :]
        h3 = t3 // 2
        half = t3 % 2
        nm = n_ok[None, :, None]
        xm = m_ok[:, None, None] & (t3 >= 0)
        row = offs_n.to(tl.int64)[None, :, None] * row_bytes
        xrow = offs_m.to(tl.int64)[:, None, None]
        xw = _full(xw_ptr + xrow * (K // 8) + 16 * h3 + 2 * half, BLOCK_M, BLOCK_N, STAGES)
        xd = _full(xd_ptr + xrow * (K // 32) + 4 * h3, BLOCK_M, BLOCK_N, STAGES)
        acc = tl.zeros([BLOCK_M, BLOCK_N, 4], dtype=tl.float32)
        for blk in tl.range(s0, s1, UNROLL, num_stages=STAGES):
            part = _q6k_block(u_ptr, row, xw, xd, blk, h3, half, nm, xm, BLOCK_N, BLOCK_M, EMULATE)
            if UNROLL == 2:
                nxt = _q6k_block(u_ptr, row, xw, xd, tl.minimum(blk + 1, s1 - 1), h3, half, nm, xm, BLOCK_N,
                                 BLOCK_M, EMULATE)
                part += tl.where(blk + 1 < s1, nxt, 0.0)
            acc += part
        return tl_sum(acc, 2)

    @jit
    def _q80_q8(u_ptr, xw_ptr, xd_ptr, offs_n, n_ok, offs_m, m_ok, K, row_units, s0, s1,
                BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, EMULATE: tl.constexpr, STAGES: tl.constexpr):
        """q8_0, 8 blocks of 34 bytes (17 int16: d, then code pairs) per step; group g = blocks 2g, 2g + 1:
        d·dx·Σq·qx per block."""
        g3 = tl.arange(0, 4)[None, None, :]
        nm = n_ok[None, :, None]
        xm = m_ok[:, None, None] & (g3 >= 0)
        urow = u_ptr + offs_n.to(tl.int64)[None, :, None] * row_units + 34 * g3
        xrow = offs_m.to(tl.int64)[:, None, None]
        xw = _full(xw_ptr + xrow * (K // 8) + 8 * g3, BLOCK_M, BLOCK_N, STAGES)
        xd = _full(xd_ptr + xrow * (K // 32) + 2 * g3, BLOCK_M, BLOCK_N, STAGES)
        acc = tl.zeros([BLOCK_M, BLOCK_N, 4], dtype=tl.float32)
        for step in tl.range(s0, s1, num_stages=STAGES):
            ub = urow + step * 136
            xb = xw + step * 32
            for b in tl.static_range(2):
                isum = tl.zeros([BLOCK_M, BLOCK_N, 4], dtype=tl.int32)
                for p in tl.static_range(8):
                    xj = _half(xb + 4 * b + p // 2, p % 2, xm)
                    isum = dp4a(_word16(ub + 17 * b + 1 + 2 * p, nm), xj, isum, EMULATE)
                d = tl.load(ub + 17 * b, mask=nm, other=0).to(tl.float16, bitcast=True).to(tl.float32)
                acc += d * (isum.to(tl.float32) * tl.load(xd + step * 8 + b, mask=xm, other=0.0))
        return tl_sum(acc, 2)

    @jit
    def _gemv_q8_kernel(w_ptr, u_ptr, xw_ptr, xd_ptr, xs_ptr, y_ptr, N, K, M, row_bytes, row_units, stride_ym,
                        FMT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
                        SPLIT_K: tl.constexpr, EMULATE: tl.constexpr, STAGES: tl.constexpr,
                        UNROLL: tl.constexpr, PDL: tl.constexpr = 0):
        pdl_start(PDL)
        offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        n_ok = offs_n < N
        m_ok = offs_m < M
        steps = K // 256
        per_split = (steps + SPLIT_K - 1) // SPLIT_K
        s0 = tl.program_id(2) * per_split
        s1 = tl.minimum(steps, s0 + per_split)
        if FMT == 6:
            out = _q6k_q8(u_ptr, xw_ptr, xd_ptr, offs_n, n_ok, offs_m, m_ok, K, row_bytes, s0, s1,
                          BLOCK_N, BLOCK_M, EMULATE, STAGES, UNROLL)
        elif FMT == 3:
            out = _q80_q8(u_ptr, xw_ptr, xd_ptr, offs_n, n_ok, offs_m, m_ok, K, row_units, s0, s1,
                          BLOCK_N, BLOCK_M, EMULATE, STAGES)
        else:
            out = _kquant_q8(u_ptr, xw_ptr, xd_ptr, xs_ptr, offs_n, n_ok, offs_m, m_ok, K, row_units, s0, s1,
                             FMT, BLOCK_N, BLOCK_M, EMULATE, STAGES, UNROLL)
        pdl_release(PDL)
        ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
        mask = m_ok[:, None] & n_ok[None, :]
        if SPLIT_K == 1:
            tl.store(ptrs, out.to(y_ptr.dtype.element_ty), mask=mask)
        else:
            tl.atomic_add(ptrs, out, mask=mask)


def q8_units(raw: torch.Tensor, format: str) -> tuple[torch.Tensor, int]:
    """The weight rows as the units the q8 kernel reads, and units per row: int64 word pairs (q4_k, q5_k:
    16-byte aligned blocks), int16 (q8_0: 2-byte aligned) or, for q6_k, the whole tensor as aligned int32
    words (a copy padded to whole words in the rare case that its size or address is not a multiple of 4)."""
    if format == "q6_k":
        flat = raw.reshape(-1)
        if flat.numel() % 4 or flat.data_ptr() % 4:
            flat = torch.cat([flat, flat.new_zeros(-flat.numel() % 4)])
        return flat.view(torch.int32), raw.shape[1] // 4
    unit, size = (torch.int64, 8) if format in ("q4_k", "q5_k") else (torch.int16, 2)
    return raw.view(unit), raw.shape[1] // size


def gemv_q8(raw: torch.Tensor, format: str, xa: QuantizedActivation, out_features: int,
            schedule: MatmulSchedule | str) -> torch.Tensor:
    """`(q·d) @ Wᵀ -> [n, out_features]` in `xa.dtype` with W the GGUF rows `raw` (uint8 `[N, row_bytes]`)
    and xa the int8 activation; the kernel runs on `raw`'s device (CUDA, or CPU under the interpreter)."""
    format = format.removeprefix("gguf_")
    s = SCHEDULES[schedule] if isinstance(schedule, str) else schedule
    n, k = xa.q.shape
    check_weight(raw, format, out_features, k)
    if format not in Q8_FORMATS:
        raise QuantKernelError(f"schedule {s.name} (int8-activation GEMV) supports {', '.join(Q8_FORMATS)}, "
                               f"not {format}; pick a wv_* or sub_* schedule")
    if k % STEP:
        raise QuantKernelError(f"schedule {s.name} needs rows of whole {STEP}-column steps, got {k}; pick a "
                               "sub_* schedule")
    units, row_units = q8_units(raw, format)
    split = s.split_k > 1
    y = (torch.zeros if split else torch.empty)(
        (n, out_features), dtype=torch.float32 if split else xa.dtype, device=raw.device)
    launch = (triton_cdiv(out_features, s.block_n), triton_cdiv(n, s.block_m), s.split_k)
    extra = {} if raw.device.type == "cpu" else {"num_warps": s.num_warps, "num_stages": s.num_stages}
    xw = xa.q.view(torch.int64)  # activation words read in pairs
    _gemv_q8_kernel[launch](raw, units, xw, xa.d, xa.s, y, out_features, k, n, raw.shape[1], row_units,
                            y.stride(0), FMT=_FMT[format], BLOCK_N=s.block_n, BLOCK_M=s.block_m,
                            SPLIT_K=s.split_k, EMULATE=EMULATE_DP4A, STAGES=s.num_stages,
                            UNROLL=s.block_k // STEP if format != "q8_0" else 1,
                            **extra, **pdl_options(raw, trigger=False))
    return y.to(xa.dtype)

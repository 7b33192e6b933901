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
from ninfer.kernels.triton_support import HAVE_TRITON, INTERPRET, jit, tl, tl_max, tl_sum, triton_runs_on

QBLOCK = 32  # activation values per int8 scale
EMULATE_DP4A = INTERPRET  # pass as the dp4a EMULATE argument: PTX cannot run in the interpreter


@dataclass(frozen=True)
class QuantizedActivation:
    """`x [n, K]` as int8 codes `q` (contiguous; kernels read `q.view(torch.int32)` `[n, K/4]`), fp32 scale
    `d [n, K/32]` per 32 values, `s = d·Σq` per 32 values (for formats with mins) and the original dtype."""

    q: torch.Tensor
    d: torch.Tensor
    s: torch.Tensor
    dtype: torch.dtype

    @property
    def words(self) -> torch.Tensor:
        return self.q.view(torch.int32)

    def dequantize(self) -> torch.Tensor:
        """`q·d` as float64 `[n, K]` (what the q8 kernels multiply the weights with)."""
        n, k = self.q.shape
        return (self.q.double().reshape(n, k // QBLOCK, QBLOCK) * self.d.double()[..., None]).reshape(n, k)


def _check_activation(x: torch.Tensor) -> None:
    if x.dim() != 2 or x.shape[1] % QBLOCK:
        raise QuantKernelError(f"int8 activation quantisation needs x [n, K] with K a multiple of {QBLOCK}, "
                               f"got {list(x.shape)}; use a wv_* or sub_* schedule for this weight")


def quantize_activation_reference(x: torch.Tensor) -> QuantizedActivation:
    """Per 32 values: `d = max|x| / 127`, `q = round-half-even(x / d)` (0 where the block is all zero)."""
    _check_activation(x)
    n, k = x.shape
    xb = x.float().reshape(n, k // QBLOCK, QBLOCK)
    d = xb.abs().amax(-1) / 127.0
    safe = torch.where(d == 0, torch.ones_like(d), d)
    q = torch.round(xb / safe[..., None]).clamp(-127, 127).to(torch.int8)
    s = d * q.sum(-1, dtype=torch.int32).float()
    return QuantizedActivation(q.reshape(n, k).contiguous(), d.contiguous(), s.contiguous(), x.dtype)


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
    def _quantize_activation_kernel(x_ptr, q_ptr, d_ptr, s_ptr, K, stride_xm, BLOCKS: tl.constexpr):
        row = tl.program_id(0)
        blk = tl.program_id(1) * BLOCKS + tl.arange(0, BLOCKS)
        nb = K // 32
        ok = (blk < nb)[:, None]
        cols = blk[:, None] * 32 + tl.arange(0, 32)[None, :]
        x = tl.load(x_ptr + row.to(tl.int64) * stride_xm + cols, mask=ok, other=0.0).to(tl.float32)
        amax = tl_max(tl.abs(x), 1)
        d = tl.math.div_rn(amax, 127.0)
        safe = tl.where(d == 0.0, 1.0, d)
        v = tl.math.div_rn(x, safe[:, None])
        # round half to even: adding and removing 1.5·2^23 leaves the nearest integer (|v| <= 127)
        r = (v + 12582912.0) - 12582912.0
        r = tl.minimum(tl.maximum(r, -127.0), 127.0)
        q = r.to(tl.int32)
        tl.store(q_ptr + row.to(tl.int64) * K + cols, q.to(tl.int8), mask=ok)
        s = d * tl_sum(q, 1).to(tl.float32)
        tl.store(d_ptr + row.to(tl.int64) * nb + blk, d, mask=blk < nb)
        tl.store(s_ptr + row.to(tl.int64) * nb + blk, s, mask=blk < nb)


def quantize_activation(x: torch.Tensor, blocks_per_program: int = 8) -> QuantizedActivation:
    """`quantize_activation_reference` as one Triton kernel (bit-exact); the reference where Triton cannot
    run on x's device."""
    _check_activation(x)
    if not (HAVE_TRITON and triton_runs_on(x)):
        return quantize_activation_reference(x)
    if x.stride(-1) != 1:
        x = x.contiguous()
    n, k = x.shape
    nb = k // QBLOCK
    q = torch.empty((n, k), dtype=torch.int8, device=x.device)
    d = torch.empty((n, nb), dtype=torch.float32, device=x.device)
    s = torch.empty((n, nb), dtype=torch.float32, device=x.device)
    grid = (n, -(-nb // blocks_per_program))
    _quantize_activation_kernel[grid](x, q, d, s, k, x.stride(0), BLOCKS=blocks_per_program)
    return QuantizedActivation(q, d, s, x.dtype)


class _ActivationMemo:
    """The last quantised activation, keyed by tensor identity and in-place version: the GDN layer feeds one
    x to six projections and the MLP feeds one x to gate and up, each quantises it once. Pure host-side
    bookkeeping (no syncs), so it is safe under CUDA-graph capture. Inference-mode tensors carry no version
    counter: for them identity alone is the key (model code never writes a Linear's input in place)."""

    def __init__(self) -> None:
        self.ref: weakref.ref | None = None
        self.version = -1
        self.result: QuantizedActivation | None = None

    def get(self, x: torch.Tensor) -> QuantizedActivation:
        version = -2 if x.is_inference() else x._version
        if self.ref is not None and self.ref() is x and version == self.version:
            return self.result
        result = quantize_activation(x.reshape(-1, x.shape[-1]))
        self.ref, self.version, self.result = weakref.ref(x), version, result
        return result

    def clear(self) -> None:
        self.ref, self.version, self.result = None, -1, None


_MEMO = _ActivationMemo()


def quantize_activation_cached(x: torch.Tensor) -> QuantizedActivation:
    """`quantize_activation(x [..., K])` of the rows `[n, K]`, reusing the previous result when called
    again with the same, unmodified x (same tensor object, same `_version`)."""
    return _MEMO.get(x)


# ---------------------------------------------------------------------------------------------------------
# The twin (oracle): dequantised weight times the dequantised int8 activation, float64


def gemv_q8_reference(raw: torch.Tensor, format: str, xa: QuantizedActivation, out_features: int
                      ) -> torch.Tensor:
    """`(q·d) @ Wᵀ` in float64 `[n, out_features]`, W dequantised with `ninfer.quant`: what the q8 kernels
    compute up to fp32 rounding."""
    from ninfer.quant import dequantize
    from ninfer.quant.formats import GGUF_PREFIX

    n, k = xa.q.shape
    name = GGUF_PREFIX + format.removeprefix(GGUF_PREFIX)
    w = dequantize(raw.cpu().reshape(-1), name, (out_features, k)).double()
    return xa.dequantize().cpu() @ w.t()


# ---------------------------------------------------------------------------------------------------------
# Triton kernels. A program takes BLOCK_N rows × BLOCK_M columns × one split of K, walks 256 codes per step
# (one k-quant block, or 8 q8_0 blocks), decodes each weight word once for all its columns and multiplies it
# with the activation word by dp4a; the int32 sums of a sub-block get the weight and activation scales once.
# Tile axes (row, group, word, column); sums over the word axis stay int32.

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
    def _kquant_q8(u_ptr, xw_ptr, xd_ptr, xs_ptr, offs_n, n_ok, offs_m, m_ok, K, row_units, s0, s1,
                   FMT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, EMULATE: tl.constexpr):
        """q4_k (36 words per block) / q5_k (44): qs word (c, p) holds codes 64c + 4p..+3 in its low nibbles
        and 64c + 32 + 4p.. in its high ones; q5_k's fifth bit of code 32s + l is bit s of qh byte l. Per
        sub-block s: d·sc·dx·Σq·qx − dmin·mn·(dx·Σqx)."""
        g3 = tl.arange(0, 4)[None, :, None]
        l3 = tl.arange(0, 8)[None, None, :]
        nm = n_ok[:, None, None]
        row = u_ptr + offs_n.to(tl.int64)[:, None, None] * row_units
        xw = xw_ptr + offs_m.to(tl.int64)[None, None, None, :] * (K // 4) + (16 * g3 + l3)[:, :, :, None]
        xm4 = m_ok[None, None, None, :]
        xd = offs_m.to(tl.int64)[None, None, :] * (K // 32) + 2 * g3
        xm3 = m_ok[None, None, :]
        WB: tl.constexpr = 36 if FMT == 4 else 44
        QS0: tl.constexpr = 4 if FMT == 4 else 12
        zero = tl.zeros([BLOCK_N, 4, 8, BLOCK_M], dtype=tl.int32)
        acc = tl.zeros([BLOCK_N, 4, BLOCK_M], dtype=tl.float32)
        for blk in range(s0, s1):
            wb = row + blk * WB
            words = tl.load(wb + QS0 + 8 * g3 + l3, mask=nm, other=0)
            lo = words & 0x0F0F0F0F
            hi = (words >> 4) & 0x0F0F0F0F
            if FMT == 5:
                qh = tl.load(wb + 4 + l3, mask=nm, other=0)
                lo = lo | (((qh >> (2 * g3)) & 0x01010101) << 4)
                hi = hi | (((qh >> (2 * g3 + 1)) & 0x01010101) << 4)
            x_lo = tl.load(xw + blk * 64, mask=xm4, other=0)
            x_hi = tl.load(xw + blk * 64 + 8, mask=xm4, other=0)
            i_lo = tl_sum(dp4a(lo[:, :, :, None], x_lo, zero, EMULATE), 2).to(tl.float32)
            i_hi = tl_sum(dp4a(hi[:, :, :, None], x_hi, zero, EMULATE), 2).to(tl.float32)
            dx_lo = tl.load(xd_ptr + xd + blk * 8, mask=xm3, other=0.0)
            dx_hi = tl.load(xd_ptr + xd + blk * 8 + 1, mask=xm3, other=0.0)
            sx_lo = tl.load(xs_ptr + xd + blk * 8, mask=xm3, other=0.0)
            sx_hi = tl.load(xs_ptr + xd + blk * 8 + 1, mask=xm3, other=0.0)
            h0 = tl.load(wb, mask=nm, other=0)
            h1 = tl.load(wb + 1, mask=nm, other=0)
            h2 = tl.load(wb + 2, mask=nm, other=0)
            h3 = tl.load(wb + 3, mask=nm, other=0)
            d = _f16_lo(h0)
            dmin = _f16_lo(h0 >> 16)
            sc_lo, mn_lo = _k_scale_min_words(h1, h2, h3, 2 * g3)
            sc_hi, mn_hi = _k_scale_min_words(h1, h2, h3, 2 * g3 + 1)
            acc += (d * sc_lo) * (i_lo * dx_lo) + (d * sc_hi) * (i_hi * dx_hi)
            acc -= (dmin * mn_lo) * sx_lo + (dmin * mn_hi) * sx_hi
        return tl_sum(acc, 1)

    @jit
    def _q6k_q8(w_ptr, u_ptr, xw_ptr, xd_ptr, offs_n, n_ok, offs_m, m_ok, K, row_bytes, row_units, s0, s1,
                BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, EMULATE: tl.constexpr):
        """q6_k (210 bytes = 105 int16): code 128h + 32j + l has its low 4 bits in ql byte 64h + 32(j % 2) + l
        (nibble j // 2) and its high 2 bits in qh byte 32h + l (bits 2j); the 6-bit codes (bias 32) go through
        dp4a as bytes and 32·Σqx per 16 codes is removed; int8 scale per 16 codes (byte 192 + 8h + 2j + half).
        Tile: (row, half of 16 codes, word of the half)."""
        half = tl.arange(0, 2)[None, :, None]
        t3 = 4 * half + tl.arange(0, 4)[None, None, :]  # word of a 32-code run
        nm = n_ok[:, None, None]
        urow = u_ptr + offs_n.to(tl.int64)[:, None, None] * row_units
        brow = w_ptr + offs_n.to(tl.int64)[:, None, None] * row_bytes
        xw = xw_ptr + offs_m.to(tl.int64)[None, None, None, :] * (K // 4) + t3[:, :, :, None]
        xm4 = m_ok[None, None, None, :]
        xd = xd_ptr + offs_m.to(tl.int64)[None, :] * (K // 32)
        xm2 = m_ok[None, :]
        zero = tl.zeros([BLOCK_N, 2, 4, BLOCK_M], dtype=tl.int32)
        ones = tl.full([1, 2, 4, BLOCK_M], 0x01010101, dtype=tl.int32)
        zero1 = tl.zeros([1, 2, 4, BLOCK_M], dtype=tl.int32)
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        for blk in range(s0, s1):
            ub = urow + blk * 105
            bb = brow + blk * 210
            d = tl.load(u_ptr + offs_n.to(tl.int64)[:, None] * row_units + blk * 105 + 104,
                        mask=n_ok[:, None], other=0).to(tl.float16, bitcast=True).to(tl.float32)
            for h in tl.static_range(2):
                qh = _word16(ub + 64 + 2 * (8 * h + t3), nm)
                for a in tl.static_range(2):
                    ql = _word16(ub + 2 * (16 * h + 8 * a + t3), nm)
                    for hi in tl.static_range(2):
                        j: tl.constexpr = a + 2 * hi
                        if hi == 0:
                            lo4 = ql & 0x0F0F0F0F
                        else:
                            lo4 = (ql >> 4) & 0x0F0F0F0F
                        if j < 2:
                            hi2 = (qh << (4 - 2 * j)) & 0x30303030
                        else:
                            hi2 = (qh >> (2 * j - 4)) & 0x30303030
                        xj = tl.load(xw + blk * 64 + 32 * h + 8 * j, mask=xm4, other=0)
                        isum = tl_sum(dp4a((lo4 | hi2)[:, :, :, None], xj, zero, EMULATE), 2)
                        xsum = tl_sum(dp4a(ones, xj, zero1, EMULATE), 2)
                        sc = tl.load(bb + 192 + 8 * h + 2 * j + half, mask=nm, other=0).to(
                            tl.int8, bitcast=True).to(tl.int32)
                        v = tl_sum((isum - 32 * xsum) * sc, 1)
                        dx = tl.load(xd + blk * 8 + 4 * h + j, mask=xm2, other=0.0)
                        acc += d * (v.to(tl.float32) * dx)
        return acc

    @jit
    def _q80_q8(u_ptr, xw_ptr, xd_ptr, offs_n, n_ok, offs_m, m_ok, K, row_units, s0, s1,
                BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, EMULATE: tl.constexpr):
        """q8_0, 8 blocks of 34 bytes (17 int16: d, then code pairs) per step: d·dx·Σq·qx per block."""
        g3 = tl.arange(0, 8)[None, :, None]
        l3 = tl.arange(0, 8)[None, None, :]
        nm = n_ok[:, None, None]
        urow = u_ptr + offs_n.to(tl.int64)[:, None, None] * row_units + 17 * g3
        xw = xw_ptr + offs_m.to(tl.int64)[None, None, None, :] * (K // 4) + (8 * g3 + l3)[:, :, :, None]
        xm4 = m_ok[None, None, None, :]
        xd = xd_ptr + offs_m.to(tl.int64)[None, None, :] * (K // 32) + g3
        xm3 = m_ok[None, None, :]
        zero = tl.zeros([BLOCK_N, 8, 8, BLOCK_M], dtype=tl.int32)
        acc = tl.zeros([BLOCK_N, 8, BLOCK_M], dtype=tl.float32)
        for step in range(s0, s1):
            ub = urow + step * 136
            words = _word16(ub + 1 + 2 * l3, nm)
            d = tl.load(ub, mask=nm, other=0).to(tl.float16, bitcast=True).to(tl.float32)
            xj = tl.load(xw + step * 64, mask=xm4, other=0)
            isum = tl_sum(dp4a(words[:, :, :, None], xj, zero, EMULATE), 2)
            dx = tl.load(xd + step * 8, mask=xm3, other=0.0)
            acc += d * (isum.to(tl.float32) * dx)
        return tl_sum(acc, 1)

    @jit
    def _gemv_q8_kernel(w_ptr, u_ptr, xw_ptr, xd_ptr, xs_ptr, y_ptr, N, K, M, row_bytes, row_units, stride_ym,
                        FMT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
                        SPLIT_K: tl.constexpr, EMULATE: tl.constexpr):
        offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        n_ok = offs_n < N
        m_ok = offs_m < M
        steps = K // 256
        per_split = (steps + SPLIT_K - 1) // SPLIT_K
        s0 = tl.program_id(2) * per_split
        s1 = tl.minimum(steps, s0 + per_split)
        if FMT == 6:
            out = _q6k_q8(w_ptr, u_ptr, xw_ptr, xd_ptr, offs_n, n_ok, offs_m, m_ok, K, row_bytes, row_units,
                          s0, s1, BLOCK_N, BLOCK_M, EMULATE)
        elif FMT == 3:
            out = _q80_q8(u_ptr, xw_ptr, xd_ptr, offs_n, n_ok, offs_m, m_ok, K, row_units, s0, s1,
                          BLOCK_N, BLOCK_M, EMULATE)
        else:
            out = _kquant_q8(u_ptr, xw_ptr, xd_ptr, xs_ptr, offs_n, n_ok, offs_m, m_ok, K, row_units, s0, s1,
                             FMT, BLOCK_N, BLOCK_M, EMULATE)
        ptrs = y_ptr + offs_m[None, :] * stride_ym + offs_n[:, None]
        mask = n_ok[:, None] & m_ok[None, :]
        if SPLIT_K == 1:
            tl.store(ptrs, out.to(y_ptr.dtype.element_ty), mask=mask)
        else:
            tl.atomic_add(ptrs, out, mask=mask)


def q8_units(raw: torch.Tensor, format: str) -> tuple[torch.Tensor, int]:
    """The weight rows as the units the q8 kernel reads: int32 words (q4_k, q5_k: 16-byte aligned blocks) or
    int16 (q6_k, q8_0: 2-byte aligned), and units per row."""
    unit = torch.int32 if format in ("q4_k", "q5_k") else torch.int16
    size = 4 if unit == torch.int32 else 2
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
    _gemv_q8_kernel[launch](raw, units, xa.words, xa.d, xa.s, y, out_features, k, n, raw.shape[1], row_units,
                            y.stride(0), FMT=_FMT[format], BLOCK_N=s.block_n, BLOCK_M=s.block_m,
                            SPLIT_K=s.split_k, EMULATE=EMULATE_DP4A, **extra)
    return y.to(xa.dtype)

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

from ninfer.errors import NinferError
from ninfer.kernels.triton_support import HAVE_TRITON, INTERPRET, jit, tl, tl_max, tl_sum, triton_runs_on

QBLOCK = 32  # activation values per int8 scale


def _kernel_error() -> type[NinferError]:
    """gguf_matmul.QuantKernelError (one error type for the matmul kernels; imported late: no cycle)."""
    from ninfer.kernels.gguf_matmul import QuantKernelError

    return QuantKernelError


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
        raise _kernel_error()(f"int8 activation quantisation needs x [n, K] with K a multiple of {QBLOCK}, "
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
    bookkeeping (no syncs), so it is safe under CUDA-graph capture."""

    def __init__(self) -> None:
        self.ref: weakref.ref | None = None
        self.version = -1
        self.result: QuantizedActivation | None = None

    def get(self, x: torch.Tensor) -> QuantizedActivation:
        if self.ref is not None and self.ref() is x and x._version == self.version:
            return self.result
        result = quantize_activation(x.reshape(-1, x.shape[-1]))
        self.ref, self.version, self.result = weakref.ref(x), x._version, result
        return result

    def clear(self) -> None:
        self.ref, self.version, self.result = None, -1, None


_MEMO = _ActivationMemo()


def quantize_activation_cached(x: torch.Tensor) -> QuantizedActivation:
    """`quantize_activation(x [..., K])` of the rows `[n, K]`, reusing the previous result when called
    again with the same, unmodified x (same tensor object, same `_version`)."""
    return _MEMO.get(x)


EMULATE_DP4A = INTERPRET  # pass as the dp4a EMULATE argument: PTX cannot run in the interpreter

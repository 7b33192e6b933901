"""An add + RMSNorm left to the GEMV that reads its output (opt-in, NINFER_NORM_GEMV=1, until timed).

At one decode row on CUDA a decoder layer's two norms each run as a kernel of their own
(`fused.add_rms_norm`, ~2.9 µs "end − previous end" in the H200's graphed IQ3_S step, 128 of them a 27B
step) that writes the int8 activation the next GEMV then reads. `defer` instead hands back the norm's output
buffers unwritten and keeps the norm waiting; the il32 dp4a or q4il GEMV that reads them
(`gemv_il.gemv_il_norm`, `gemv_q4il.gemv_q4il_norm`) makes its activation itself in its prologue (every CTA
sums the row's squares and quantises it into its shared memory) and its first CTA fills the buffers, so one
launch does both. Any other reader runs the norm first (`settle`: the norm kernel into the same buffers):
the numbers are the same whichever way it runs.

One norm waits at a time: a decoder layer's norm and the matmul that reads it are adjacent calls
(`models.qwen3_5.DecoderLayer`), and every other entry point settles first (`ops.add_rms_norm`, the
Linears but the il32 and q4il ones, whose matmuls take the norm or settle it).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from ninfer.kernels import fused
from ninfer.kernels.gemv_q8 import QuantizedActivation, remember_activation


@dataclass(frozen=True)
class NormOutputs:
    """What the norm kernel writes (`fused.add_rms_norm` with the int8 activation): the normed x `out` and
    the new residual (bf16 `[1, K]`), the codes `q` (int8 `[1, K]`), the scales `d` and `s = d·Σq` (fp32
    `[1, K/256]`)."""

    out: torch.Tensor
    residual: torch.Tensor
    q: torch.Tensor
    d: torch.Tensor
    s: torch.Tensor


@dataclass(frozen=True)
class PendingNorm:
    x: torch.Tensor
    residual: torch.Tensor
    weight: torch.Tensor
    eps: float
    zero_centred: bool
    outputs: NormOutputs


GROUP = 256  # the il32 GEMVs' activation grouping (gemv_il.il_group)
_waiting: PendingNorm | None = None


def enabled() -> bool:
    return os.environ.get("NINFER_NORM_GEMV") == "1"


def deferrable(x: torch.Tensor, residual: torch.Tensor | None, group: int) -> bool:
    """One contiguous bf16 row and its residual on CUDA, read next by a Linear of `group` = 256 (il32,
    q4il)."""
    return (enabled() and residual is not None and x.is_cuda and x.dim() == 2 and x.shape[0] == 1
            and x.dtype == residual.dtype == torch.bfloat16 and residual.shape == x.shape
            and x.is_contiguous() and residual.is_contiguous() and group == GROUP and x.shape[1] % GROUP == 0)


def defer(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, zero_centred: bool
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """`(norm(x + residual), x + residual)` as buffers still to be written: by the GEMV that reads the first
    (`take`), or by the norm kernel when anything else asks first (`settle`)."""
    global _waiting
    settle()
    k = x.shape[1]
    scales = (torch.empty((1, k // GROUP), dtype=torch.float32, device=x.device) for _ in range(2))
    outputs = NormOutputs(torch.empty_like(x), torch.empty_like(residual),
                          torch.empty((1, k), dtype=torch.int8, device=x.device), *scales)
    _waiting = PendingNorm(x, residual, weight, eps, zero_centred, outputs)
    return outputs.out, outputs.residual


def take(x: torch.Tensor) -> PendingNorm | None:
    """The waiting norm whose output x is, now the caller's launch to run (it writes the norm's outputs);
    gemv_q8's memo learns x's int8 activation for any later reader. None: x is no waiting norm's."""
    global _waiting
    pending = _waiting
    if pending is None or pending.outputs.out is not x:
        return None
    _waiting = None
    o = pending.outputs
    remember_activation(x, QuantizedActivation(o.q, o.d, o.s, x.dtype))
    return pending


def settle() -> None:
    """Run the waiting norm, if one waits, as its own kernel into its buffers."""
    global _waiting
    pending, _waiting = _waiting, None
    if pending is not None:
        o = pending.outputs
        fused.add_rms_norm(pending.x, pending.residual, pending.weight, pending.eps, pending.zero_centred,
                           quantize=True, group=GROUP, into=(o.out, o.residual, o.q, o.d, o.s))

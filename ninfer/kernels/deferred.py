"""Elementwise producers left to the GEMV that reads their output (opt-in until timed on the H200:
NINFER_NORM_GEMV=1 for the decoder layers' add + RMSNorm, NINFER_SWIGLU_GEMV=1 for the MLP's SwiGLU,
NINFER_GATED_NORM_GEMV=1 for the GDN output norm).

At one decode row on CUDA each of these runs as a kernel of its own (`fused.add_rms_norm`, ~2.9 µs "end −
previous end" in the H200's graphed IQ3_S step, 128 of them a 27B step; `fused.swiglu`, ~1.5 µs, 64;
`fused.gated_rms_norm`, ~1.9 µs, 48) that writes the int8 activation the next GEMV then reads. `defer_norm`,
`defer_swiglu`, `defer_gated_norm` instead hand back the output buffers unwritten and keep the op waiting;
the il32 dp4a or q4il GEMV that reads them (`gemv_il.gemv_il_prologue`, `gemv_q4il.gemv_q4il_prologue`)
makes its activation itself in its prologue (every CTA computes the row and quantises it into its shared
memory: `gemv_il.PROLOGUE_STAGE`) and its first CTA fills the buffers, so one launch does both. Any other
reader runs the op first (`settle`: its kernel into the same buffers): the numbers are the same whichever
way it runs.

One op waits at a time: each is followed at once by the matmul that reads it (`models.qwen3_5.DecoderLayer`,
`GatedDeltaNet`, `models.layers.SwiGLUMLP`), and every other entry point settles first (`ops.add_rms_norm`,
`ops.swiglu`, `ops.gated_rms_norm`, the Linears but the il32 and q4il ones, whose matmuls take the op or
settle it).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch

from ninfer.kernels import fused
from ninfer.kernels.gemv_q8 import QuantizedActivation, remember_activation

GROUP = 256  # the il32 and q4il GEMVs' activation grouping
# the kernels' PROLOGUE: what a GEMV's prologue makes
NORM, NORM_ZERO_CENTRED, SWIGLU, GATED_NORM = 1, 2, 3, 4
HEAD = 128  # the gated norm's head width the prologue takes (two heads a group of 256)


@dataclass(frozen=True)
class Outputs:
    """What the op's own kernel writes with the int8 activation: the row `out` (bf16 `[1, K]`), the norm's
    new residual (None for SwiGLU), the codes `q` (int8 `[1, K]`), the scales `d` and `s = d·Σq` (fp32
    `[1, K/256]`)."""

    out: torch.Tensor
    residual: torch.Tensor | None
    q: torch.Tensor
    d: torch.Tensor
    s: torch.Tensor


@dataclass(frozen=True)
class Pending:
    """An op waiting for its GEMV: `prologue` (NORM, NORM_ZERO_CENTRED, SWIGLU, GATED_NORM), its inputs `a`,
    `b` (x and the residual, gate and up, or the GDN core output o `[1, H, 128]` fp32 and z), the norm's
    weight and eps; the gated norm's column `gather` (int64, identity when the Linear records none) and
    `scatter` (its inverse, None for the identity)."""

    prologue: int
    a: torch.Tensor
    b: torch.Tensor
    weight: torch.Tensor | None
    eps: float
    outputs: Outputs
    gather: torch.Tensor | None = None
    scatter: torch.Tensor | None = None

    def launch_args(self) -> list:
        """The prologue's kernel arguments (a, b, the weight, eps, out, the residual or the gather, q, d, s;
        unused ones any valid pointer)."""
        o = self.outputs
        res = self.gather if self.prologue == GATED_NORM else o.residual
        return [self.a, self.b, self.a if self.weight is None else self.weight, float(self.eps), o.out,
                o.out if res is None else res, o.q, o.d, o.s]

    def run(self) -> None:
        """The op's own kernel into the outputs."""
        o = self.outputs
        if self.prologue == SWIGLU:
            fused.swiglu(self.a, self.b, quantize=True, group=GROUP, into=(o.out, o.q, o.d, o.s))
        elif self.prologue == GATED_NORM:
            gather = None if self.scatter is None else self.gather
            fused.gated_rms_norm(self.a, self.b.view(self.a.shape), self.weight, self.eps, o.out.dtype,
                                 self.scatter, quantize=True, group=GROUP, gather=gather,
                                 into=(o.out, o.q, o.d, o.s))
        else:
            fused.add_rms_norm(self.a, self.b, self.weight, self.eps, self.prologue == NORM_ZERO_CENTRED,
                               quantize=True, group=GROUP, into=(o.out, o.residual, o.q, o.d, o.s))


_waiting: Pending | None = None


def _row(t: torch.Tensor) -> bool:
    """One bf16 row on CUDA, contiguous, 16-byte aligned (the prologues load 16 bytes a lane)."""
    return (t.is_cuda and t.dim() == 2 and t.shape[0] == 1 and t.dtype == torch.bfloat16 and t.stride(-1) == 1
            and t.data_ptr() % 16 == 0)


def norm_deferrable(x: torch.Tensor, residual: torch.Tensor | None, group: int) -> bool:
    """NINFER_NORM_GEMV=1, x and its residual one row each, read next by a Linear of `group` = 256."""
    return (os.environ.get("NINFER_NORM_GEMV") == "1" and residual is not None and group == GROUP
            and residual.shape == x.shape and x.shape[-1] % GROUP == 0 and _row(x) and _row(residual))


def swiglu_deferrable(gate: torch.Tensor, up: torch.Tensor, group: int) -> bool:
    """NINFER_SWIGLU_GEMV=1, gate and up one row each, read next by a Linear of `group` = 256."""
    return (os.environ.get("NINFER_SWIGLU_GEMV") == "1" and group == GROUP and gate.shape == up.shape
            and gate.shape[-1] % GROUP == 0 and _row(gate) and _row(up))


def gated_norm_deferrable(o: torch.Tensor, z: torch.Tensor, out_dtype: torch.dtype, scatter_run: int,
                          group: int) -> bool:
    """NINFER_GATED_NORM_GEMV=1, o one contiguous fp32 row of an even number of heads of 128 on CUDA, z its
    bf16 row, a bf16 output read next by a Linear of `group` = 256 whose input columns (if any) keep each
    head one aligned run (`scatter_run`)."""
    return (os.environ.get("NINFER_GATED_NORM_GEMV") == "1" and group == GROUP and out_dtype == torch.bfloat16
            and o.is_cuda and o.dim() == 3 and o.shape[0] == 1 and o.shape[2] == HEAD and o.shape[1] % 2 == 0
            and o.dtype == torch.float32 and o.is_contiguous() and _row(z) and z.shape[1] == o.shape[1] * HEAD
            and scatter_run % HEAD == 0)


def _wait(prologue: int, a: torch.Tensor, b: torch.Tensor, weight: torch.Tensor | None, eps: float,
          residual: bool, gather: torch.Tensor | None = None, scatter: torch.Tensor | None = None) -> Outputs:
    global _waiting
    settle()
    k = b.shape[1]
    scales = (torch.empty((1, k // GROUP), dtype=torch.float32, device=b.device) for _ in range(2))
    outputs = Outputs(torch.empty((1, k), dtype=b.dtype, device=b.device),
                      torch.empty_like(b) if residual else None,
                      torch.empty((1, k), dtype=torch.int8, device=b.device), *scales)
    _waiting = Pending(prologue, a, b, weight, eps, outputs, gather, scatter)
    return outputs


def defer_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, zero_centred: bool
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """`(norm(x + residual), x + residual)` as buffers still to be written: by the GEMV that reads the first
    (`take`), or by the norm kernel when anything else asks first (`settle`)."""
    o = _wait(NORM_ZERO_CENTRED if zero_centred else NORM, x, residual, weight, eps, True)
    return o.out, o.residual


def defer_swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """`silu(gate)·up` as a buffer still to be written (`defer_norm`'s way)."""
    return _wait(SWIGLU, gate, up, None, 0.0, False).out


def defer_gated_norm(o: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float,
                     gather: torch.Tensor | None, scatter: torch.Tensor | None) -> torch.Tensor:
    """`gated_rms_norm(o, z, ...)`'s flat bf16 output `[1, H·128]` (in the Linear's input order: `gather`,
    `scatter` its recorded columns and their inverse) as a buffer still to be written (`defer_norm`'s way)."""
    k = z.shape[1]
    if gather is None:
        gather = _identity(k, z.device)
    return _wait(GATED_NORM, o, z, weight, eps, False, gather, scatter).out


@functools.cache
def _identity(k: int, device: torch.device) -> torch.Tensor:
    return torch.arange(k, device=device)


def take(x: torch.Tensor) -> Pending | None:
    """The waiting op whose output x is, now the caller's launch to run (it writes the op's outputs);
    gemv_q8's memo learns x's int8 activation for any later reader. None: x is no waiting op's."""
    global _waiting
    pending = _waiting
    if pending is None or pending.outputs.out is not x:
        return None
    _waiting = None
    o = pending.outputs
    remember_activation(x, QuantizedActivation(o.q, o.d, o.s, x.dtype))
    return pending


def settle() -> None:
    """Run the waiting op, if one waits, as its own kernel into its buffers."""
    global _waiting
    pending, _waiting = _waiting, None
    if pending is not None:
        pending.run()

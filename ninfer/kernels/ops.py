"""The models' op set: `reference.py`'s names plus the fused forms, each running its Triton kernel where
Triton takes the tensor (`triton_runs_on`: CUDA, or CPU under NINFER_TRITON_ON_CPU=1) and the plain-PyTorch
reference otherwise, so CPU inference computes exactly what the references compute.
"""

from __future__ import annotations

import math

import torch

from ninfer.kernels import fused, reference
from ninfer.kernels.gemv_q8 import int8_next, int8_next_shape
from ninfer.kernels.reference import (  # noqa: F401  (re-exported: no fused form, PyTorch on every device)
    apply_rotary,
    attention_reference,
    causal_conv1d,
    gdn_chunked,
    gdn_recurrent,
    l2_norm,
    mrope_axis_of_frequency,
    rope_inv_freq,
    rotate_half,
)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float, zero_centred: bool) -> torch.Tensor:
    """RMSNorm over the last dim (rows of [T, N] or per head of [T, H, D]); see `reference.rms_norm`."""
    if fused.runs_on(x) and x.dim() in (2, 3) and x.stride(-1) == 1:
        return fused.rms_norm(x, w, eps, zero_centred)
    return reference.rms_norm(x, w, eps, zero_centred)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, w: torch.Tensor, eps: float, zero_centred: bool,
    group: int = 32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(rms_norm(residual + x), residual + x)`; with residual None `(rms_norm(x), x)` (the first layer).
    `group` here and below: inputs per scale of the int8 activation the next Linear takes
    (`models.weights.Linear.activation_group`), which the fused kernels write at decode widths on CUDA."""
    if fused.runs_on(x) and x.dim() == 2 and x.stride(-1) == 1:
        return fused.add_rms_norm(x, residual, w, eps, zero_centred, quantize=int8_next(x, group),
                                  group=group)
    return fused.add_rms_norm_reference(x, residual, w, eps, zero_centred)


def gated_rms_norm(
    o: torch.Tensor, z: torch.Tensor, w: torch.Tensor, eps: float, out_dtype: torch.dtype | None = None,
    gather: torch.Tensor | None = None, scatter: torch.Tensor | None = None, scatter_run: int = 0,
    group: int = 32,
) -> torch.Tensor:
    """The GDN output norm `rmsnorm(o)·w·silu(z)` (`reference.gated_rms_norm`) of o cast to `out_dtype`;
    with `gather` (and its inverse permutation `scatter`, whose `models.weights.aligned_run` is
    `scatter_run`) the flattened output's columns `gather`, ready for a Linear with those recorded input
    columns. At decode widths on CUDA the kernel quantises its output for that Linear too, where each head's
    columns stay one aligned run."""
    if fused.runs_on(o) and o.dim() in (2, 3) and o.stride(-1) == 1 and z.stride(-1) == 1:
        if gather is None or scatter is not None:
            H, N = math.prod(o.shape[1:-1]), o.shape[-1]
            whole_heads = N % 32 == 0 and N & (N - 1) == 0 and (scatter is None or scatter_run % N == 0)
            whole_groups = H % max(1, group // N) == 0  # a group wider than a head takes whole heads
            quantize = whole_heads and whole_groups and int8_next_shape(o.is_cuda, o.shape[0], N * H, group)
            return fused.gated_rms_norm(o, z, w, eps, out_dtype, scatter, quantize, group, gather)
    return fused.gated_rms_norm_reference(o, z, w, eps, out_dtype, gather)


def norm_rotary_pair(
    q: torch.Tensor, wq: torch.Tensor | None, k: torch.Tensor, wk: torch.Tensor | None, cos: torch.Tensor,
    sin: torch.Tensor, eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head RMSNorm (none where the weight is None) then partial rotate-half RoPE of the queries
    q [T, Hq, D] and the keys k [T, Hk, D], each with its own norm weight (one launch on CUDA)."""
    if fused.runs_on(q) and q.dim() == k.dim() == 3 and q.stride(-1) == k.stride(-1) == 1:
        return fused.norm_rotary_pair(q, wq, k, wk, cos.contiguous(), sin.contiguous(), eps)
    return (fused.norm_rotary_reference(q, wq, cos, sin, eps),
            fused.norm_rotary_reference(k, wk, cos, sin, eps))


def mrope_cos_sin(
    positions: torch.Tensor, rotary_dim: int, theta: float,
    sections: tuple[int, ...] | list[int] | None = None, interleaved: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`reference.mrope_cos_sin`; text positions `[T]` in one launch on CUDA (`rope_cos_sin`)."""
    if positions.dim() == 1:
        return rope_cos_sin(positions, reference.inv_freq_on(rotary_dim, theta, positions.device))
    return reference.mrope_cos_sin(positions, rotary_dim, theta, sections, interleaved)


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin `[T, 2F]` fp32 of positions `[T]` and inverse frequencies `[F]` (rotate-half tables)."""
    if fused.round_kernels(positions) and positions.dim() == 1 and inv_freq.dtype == torch.float32:
        return fused.rope_cos_sin(positions, inv_freq)
    return reference.rope_cos_sin(positions, inv_freq)


def logits_argmax(logits: torch.Tensor, vocab: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 logits `[T, N]` and each row's argmax over its first `vocab` columns (default all), int64."""
    if fused.runs_on(logits) and logits.dim() == 2 and logits.stride(-1) == 1:
        return fused.logits_argmax(logits, vocab)
    out = logits.float()
    return out, out[:, :vocab].argmax(dim=-1)


def swiglu(gate: torch.Tensor, up: torch.Tensor, group: int = 32) -> torch.Tensor:
    """`silu(gate)·up`; gate and up may be the two halves of a merged gate|up output."""
    if fused.runs_on(gate) and gate.dim() == 2 and gate.stride(-1) == 1 and up.stride(-1) == 1:
        return fused.swiglu(gate, up, quantize=int8_next(gate, group), group=group)
    return reference.swiglu(gate, up)


def sigmoid_gate_mul(attn: torch.Tensor, gate: torch.Tensor, group: int = 32) -> torch.Tensor:
    """The attention output gate `attn · sigmoid(gate)` in attn's dtype."""
    if fused.runs_on(attn) and attn.dim() == 2 and attn.stride(-1) == 1 and gate.stride(-1) == 1:
        return fused.sigmoid_gate_mul(attn, gate, quantize=int8_next(attn, group), group=group)
    return fused.sigmoid_gate_mul_reference(attn, gate)

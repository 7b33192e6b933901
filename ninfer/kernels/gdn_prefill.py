"""Chunked Gated DeltaNet for prefill: fla-core's Triton kernels on CUDA, `reference.gdn_chunked` elsewhere.

Same contract as `reference.gdn_chunked`: q, k `[T, Hk, Dk]` (L2-normalised, q already scaled by
1/sqrt(Dk)), v `[T, Hv, Dv]` (value heads grouped by key head), g, beta `[T, Hv]`, state `[Hv, Dk, Dv]`;
returns (o `[T, Hv, Dv]` in v's dtype, final state fp32). fla-core is optional (the `gpu` extra).
"""

from __future__ import annotations

import functools

import torch

from ninfer.kernels import reference


@functools.cache
def _fla_chunk():
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except Exception:  # fla-core absent or incompatible with this torch/triton: use the reference
        return None
    return chunk_gated_delta_rule


def fla_available() -> bool:
    return torch.cuda.is_available() and _fla_chunk() is not None


def gdn_prefill(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked gated delta rule over one sequence; fla-core on CUDA when installed."""
    chunk = _fla_chunk() if v.is_cuda else None
    if chunk is None:
        return reference.gdn_chunked(q, k, v, g, beta, state)
    o, final = chunk(q[None], k[None], v[None], g[None].float(), beta[None], scale=1.0,
                     initial_state=state[None].float(), output_final_state=True)
    return o[0].to(v.dtype), final[0].float()

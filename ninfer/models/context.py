"""The seam between a model and the engine: what a layer may ask of the batch it runs in.

The engine's runner builds one BatchContext per forward; models never see pages, pools or lanes.
Tokens of all sequences in a step are flattened into one [T, ...] batch; `spans` says which rows
belong to which sequence. Attention and Gated DeltaNet state handling sit behind this object so a
GPU backend (paged kernels, fused recurrent decode) can replace the CPU reference without touching
the model files.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True)
class SequenceSpan:
    """Rows [start, start+length) of the flat batch belong to one sequence.

    `cached_tokens` tokens of that sequence are already in its KV cache / recurrent state, so the
    first row sits at absolute position `cached_tokens` (text positions; mRoPE positions are passed
    to the model separately). `slot` indexes the sequence's GDN state slot and KV page table.
    """

    start: int
    length: int
    cached_tokens: int
    slot: int


@dataclass
class GdnState:
    """One sequence's Gated DeltaNet state for one layer, updated in place by the layer.

    conv:      [conv_channels, kernel-1]   last inputs of the causal conv (oldest first)
    recurrent: [value_heads, key_dim, value_dim]  S, fp32 (or fp16 with --gdn-state-fp16)
    """

    conv: torch.Tensor
    recurrent: torch.Tensor


class BatchContext(Protocol):
    spans: list[SequenceSpan]

    def attention(self, kv_layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention for full-attention layer number `kv_layer` (0-based among KV layers).

        q [T, Hq, D], k/v [T, Hkv, D] after q/k norm and rotary. Appends k/v of each span to its
        sequence's cache, then attends each row to its sequence's cached + new keys up to itself.
        Scale 1/sqrt(D). Returns [T, Hq, D] in q's dtype.

        A context may also define the optional hook `gated_attention(kv_layer, q, k, v, gate [T, Hq·D],
        group) -> [T, Hq·D]`: the same attention times its output gate, `fused.sigmoid_gate_mul`, in the
        attention's own launches (the CUDA-graph decode context; `group`: the output Linear's
        `activation_group()`); models fall back to attention + gate.
        """
        ...

    def gdn_state(self, gdn_layer: int, span_index: int) -> GdnState:
        """State of span `span_index` for GDN layer number `gdn_layer` (0-based among GDN layers)."""
        ...

"""The engine's BatchContext: reference paged attention over the KV pool and GDN state from the slot pool.

Attention (CPU reference): write the span's new k/v into its pages, gather the sequence's pages, decode
them, rotate the query when keys are stored rotated, attend causally in fp32. Every key goes through the
pool's encoding, so the result does not depend on how the prompt was chunked.
"""

from __future__ import annotations

import math

import torch

from ninfer.engine.kv_pool import KvPool
from ninfer.engine.state_pool import GdnStatePool
from ninfer.kernels.kv_quant import rotate
from ninfer.models.context import GdnState, SequenceSpan


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offset: int) -> torch.Tensor:
    """q [L, Hq, D], k/v [N, Hkv, D] fp32; query row i sits at position offset+i. Returns [L, Hq, D]."""
    length, hq, d = q.shape
    n, hkv = k.shape[0], k.shape[1]
    group = hq // hkv
    qg = q.reshape(length, hkv, group, d)
    scores = torch.einsum("lhgd,nhd->hgln", qg, k) / math.sqrt(d)
    allowed = torch.arange(n)[None, :] <= (torch.arange(length)[:, None] + offset)
    scores = scores.masked_fill(~allowed.to(scores.device), float("-inf"))
    out = torch.einsum("hgln,nhd->lhgd", torch.softmax(scores, dim=-1), v)
    return out.reshape(length, hq, d)


class PagedBatchContext:
    """One forward's view of the pools; `spans[i].slot` is the lane (page table row and GDN slot)."""

    def __init__(self, spans: list[SequenceSpan], kv: KvPool, states: GdnStatePool):
        self.spans = spans
        self._kv = kv
        self._states = states
        self._handed_out: dict[tuple[int, int], GdnState] = {}

    def attention(self, kv_layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(q)
        for span in self.spans:
            rows = slice(span.start, span.start + span.length)
            self._kv.write(kv_layer, span.slot, span.cached_tokens, k[rows], v[rows])
            keys, values = self._kv.read(kv_layer, span.slot, span.cached_tokens + span.length)
            qs = q[rows].float()
            if self._kv.fmt.rotated_keys:
                qs = rotate(qs)
            out[rows] = causal_attention(qs, keys, values, span.cached_tokens).to(q.dtype)
        return out

    def gdn_state(self, gdn_layer: int, span_index: int) -> GdnState:
        key = (gdn_layer, span_index)
        if key not in self._handed_out:
            slot = self.spans[span_index].slot
            st = self._states
            recurrent = st.recurrent[gdn_layer][slot]
            # layers compute in fp32; an fp16 slot is widened here and narrowed again in commit_states
            if recurrent.dtype != torch.float32:
                recurrent = recurrent.float()
            self._handed_out[key] = GdnState(conv=st.conv[gdn_layer][slot], recurrent=recurrent)
        return self._handed_out[key]

    def commit_states(self) -> None:
        """Copy back states a layer replaced instead of updating in place (and casts fp32 -> fp16)."""
        for (layer, span_index), state in self._handed_out.items():
            slot = self.spans[span_index].slot
            pairs = ((self._states.conv[layer], state.conv), (self._states.recurrent[layer], state.recurrent))
            for pool, new in pairs:
                if new.data_ptr() != pool[slot].data_ptr():
                    pool[slot].copy_(new)

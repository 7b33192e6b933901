"""The engine's BatchContext: reference paged attention over the KV pool and GDN state from the slot pool.

Attention (CPU reference): write the span's new k/v into its pages, gather the sequence's pages, decode
them, rotate the query when keys are stored rotated, attend causally in fp32. Every key goes through the
pool's encoding, so the result does not depend on how the prompt was chunked. On CUDA the same attention
runs in the kernels that read the pages as stored: `prefill_attention` per span of several tokens,
`paged_decode_attention` for all one-token spans at once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ninfer.engine.gdn_mix import GdnMixPlan, decode_conv
from ninfer.engine.gdn_mix import mix as mix_spans
from ninfer.engine.kv_pool import KvPool
from ninfer.engine.state_pool import GdnStatePool
from ninfer.kernels.gdn_decode import ConvEpilogue
from ninfer.kernels.kv_quant import rotate
from ninfer.kernels.paged_attention import kernel_supports
from ninfer.kernels.prefill_attention import prefill_attention
from ninfer.models.context import GdnState, SequenceSpan


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offset: int) -> torch.Tensor:
    """q [L, Hq, D]; k/v [Hkv, N, D]; query row i sits at position offset+i and sees keys 0..offset+i.
    fp32 in, [L, Hq, D] out; scale 1/sqrt(D); query head j uses KV head j // (Hq / Hkv)."""
    length, n = q.shape[0], k.shape[1]
    mask = None
    if length > 1 or offset + 1 != n:
        mask = torch.arange(n, device=q.device)[None, :] <= torch.arange(offset, offset + length,
                                                                         device=q.device)[:, None]
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k[None], v[None], attn_mask=mask,
                                         enable_gqa=True)
    return out[0].transpose(0, 1)


class PagedBatchContext:
    """One forward's view of the pools; `spans[i].slot` is the lane (page table row and GDN slot)."""

    def __init__(self, spans: list[SequenceSpan], kv: KvPool, states: GdnStatePool,
                 batched_decode: bool | None = None, gdn_kernels: bool | None = None):
        self.spans = spans
        # one-token spans go through ninfer.kernels.paged_attention in one call (default: on CUDA)
        self.batched_decode = kv.device.type == "cuda" if batched_decode is None else batched_decode
        if not (kv.device.type == "cuda" if gdn_kernels is None else gdn_kernels):
            self.gdn_mix = None  # no hook: GDN layers run their reference ops (the CPU path)
        self._gdn_plan = None
        self._kv = kv
        self._states = states
        self._handed_out: dict[tuple[int, int], GdnState] = {}
        self._where: dict[int, tuple] = {}
        self._decode_meta: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        # every row a one-token span, in row order: batched decode attention needs no gather or scatter
        self._rows_are_decodes = all(s.length == 1 and s.start == i for i, s in enumerate(spans))

    # spans of several tokens go through ninfer.kernels.prefill_attention (None: on CUDA only)
    prefill_kernel: bool | None = None

    def attention(self, kv_layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(q)
        decode = [i for i, s in enumerate(self.spans) if s.length == 1] if self.batched_decode else []
        kernel = self._kv.device.type == "cuda" if self.prefill_kernel is None else self.prefill_kernel
        kernel = kernel and kernel_supports(self._kv.fmt)  # e.g. fp32 KV keeps the SDPA path
        for i, span in enumerate(self.spans):
            rows = slice(span.start, span.start + span.length)
            where, pages = self._addresses(i)
            self._kv.write(kv_layer, where, k[rows], v[rows])
            if i in decode:
                continue
            if kernel:  # flash attention over the pages in their stored format
                o = prefill_attention(q[rows], self._kv.storage[kv_layer], self._kv.page_tables, span.slot,
                                      span.cached_tokens, self._kv.fmt)
                if len(self.spans) == 1:  # the span is the whole batch: no copy
                    return o
                out[rows] = o
                continue
            keys, values = self._kv.read(kv_layer, pages, span.cached_tokens + span.length)
            qs = q[rows].float()
            if self._kv.fmt.rotated_keys:
                qs = rotate(qs)
            out[rows] = causal_attention(qs, keys, values, span.cached_tokens).to(q.dtype)
        if decode:
            if self._rows_are_decodes:
                return self._decode_attention(kv_layer, q, decode)
            out[self._decode_batch(decode)[0]] = self._decode_attention(kv_layer, q, decode, gather=True)
        return out

    def _decode_batch(self, decode: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rows, lanes and lengths of the one-token spans (one host-to-device copy per forward)."""
        if self._decode_meta is None:
            spans = [self.spans[i] for i in decode]
            meta = torch.tensor([[s.start for s in spans], [s.slot for s in spans],
                                 [s.cached_tokens + 1 for s in spans]], dtype=torch.int32).to(self._kv.device)
            self._decode_meta = (meta[0].long(), meta[1], meta[2])
        return self._decode_meta

    def _decode_attention(self, kv_layer: int, q: torch.Tensor, decode: list[int],
                          gather: bool = False) -> torch.Tensor:
        """One-token spans in one paged-kernel call (Triton on CUDA, its reference elsewhere): their rows of q
        where `gather`, else q is theirs alone."""
        from ninfer.kernels.paged_attention import paged_decode_attention

        rows, lanes, lens = self._decode_batch(decode)
        return paged_decode_attention(q[rows] if gather else q, self._kv.storage[kv_layer],
                                      self._kv.page_tables, lanes, lens, self._kv.fmt)

    def _addresses(self, span_index: int):
        """Write slots and read pages of a span, computed once per forward (all layers share them)."""
        if span_index not in self._where:
            span = self.spans[span_index]
            self._where[span_index] = (self._kv.locate(span.slot, span.cached_tokens, span.length),
                                       self._kv.page_index(span.slot, span.cached_tokens + span.length))
        return self._where[span_index]

    def _plan(self) -> GdnMixPlan:
        if self._gdn_plan is None:  # once per forward, shared by every GDN layer
            self._gdn_plan = GdnMixPlan.of(self.spans, self._kv.device)
        return self._gdn_plan

    def gdn_mix(self, gdn_layer: int, mixed_qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                params, conv_done: bool = False) -> torch.Tensor:
        """GDN token mixing on the kernels (`ninfer.engine.gdn_mix`; contract: `models.qwen3_5.GdnParams`)."""
        return mix_spans(self._plan(), self._states, gdn_layer, mixed_qkv, a, b, params, conv_done)

    def gdn_conv(self, gdn_layer: int, params) -> ConvEpilogue | None:
        """The decode conv for the input projection to run (`GdnParams`), where every row is a one-token
        span."""
        plan = self._plan()
        return decode_conv(self._states, gdn_layer, params, plan.decode_slots) if plan.all_decodes else None

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

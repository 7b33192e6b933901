"""Gated DeltaNet token mixing on the kernels: what the engine's batch contexts plug into the `gdn_mix` hook.

One-token spans (decode) of a forward go through `kernels.gdn_decode` in one call, the lanes' slot ids as a
tensor, conv and recurrent slots updated in place (fp32 or fp16 state); spans of 2..SHORT_SPAN tokens (the
verification shape) through the same kernel with T positions. Longer spans (prefill chunks) run the
causal conv over [cached conv inputs ; chunk] (`gdn_prefill.prefill_qkv`: one Triton launch with the SiLU
and the q / k normalisation, F.conv1d and PyTorch ops elsewhere), g and β (`gdn_prefill.prefill_gates`) and
the chunked rule `kernels.gdn_prefill` (fla-core on CUDA, `reference.gdn_chunked` elsewhere), continuing
from and writing back the span's slots.
Same numbers as the model's reference `GatedDeltaNet._mix` within fp32 rounding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ninfer.engine.state_pool import GdnStatePool
from ninfer.kernels.gdn_decode import ConvEpilogue, apply_pending, gdn_decode
from ninfer.kernels.gdn_prefill import gdn_prefill, prefill_gates, prefill_qkv
from ninfer.models.context import SequenceSpan

# Spans up to this many tokens (speculative verification) take the recurrent decode kernel (T positions in
# one launch pair); longer ones (prefill chunks) the chunked kernels.
SHORT_SPAN = 8


@dataclass(frozen=True)
class GdnMixPlan:
    """Where a forward's spans sit, computed once and shared by every GDN layer.

    decode_rows / decode_slots: rows and slots of the one-token spans (device tensors; `decode_rows` None when
    every row of the batch is a one-token span in order, so no gather is needed); spans: the longer ones.
    """

    decode_rows: torch.Tensor | None
    decode_slots: torch.Tensor | None
    spans: tuple[SequenceSpan, ...]
    rows: int
    short_slots: tuple[torch.Tensor | None, ...] = ()  # per span: its slot id on the device when short

    @property
    def all_decodes(self) -> bool:
        """Every row a one-token span, in row order (one `gdn_decode` call for the whole batch)."""
        return self.decode_slots is not None and self.decode_rows is None

    @classmethod
    def of(cls, spans: list[SequenceSpan], device: torch.device) -> GdnMixPlan:
        one = [s for s in spans if s.length == 1]
        longer = tuple(s for s in spans if s.length > 1)
        rows = sum(s.length for s in spans)
        short = tuple(torch.tensor([s.slot], dtype=torch.int32, device=device) if s.length <= SHORT_SPAN
                      else None for s in longer)
        if not one:
            return cls(None, None, longer, rows, short)
        slots = torch.tensor([s.slot for s in one], dtype=torch.int32, device=device)
        in_order = not longer and all(s.start == i for i, s in enumerate(one))
        index = None if in_order else torch.tensor([s.start for s in one], dtype=torch.long, device=device)
        return cls(index, slots, longer, rows, short)


def decode_mix(states: GdnStatePool, gdn_layer: int, mixed_qkv: torch.Tensor, a: torch.Tensor,
               b: torch.Tensor, params, slot_ids: torch.Tensor, conv_done: bool = False,
               side: torch.cuda.Stream | None = None) -> torch.Tensor:
    """B one-token spans in one `gdn_decode` call: mixed_qkv [B, C], a/b [B, Hv] -> o [B, Hv, Dv] fp32.
    No host synchronisation (the slot ids stay on the device): safe inside a CUDA graph. `conv_done`:
    mixed_qkv is the conv's output already (`decode_conv`'s epilogue ran in the input projection). `side`:
    a CUDA stream that writes the recurrent states (`gdn_decode.apply_pending`) after the recurrence, beside
    the kernels that follow it on this one; the caller joins it before anything reads the slots again."""
    result = gdn_decode(mixed_qkv[:, None], a[:, None], b[:, None], params.conv_weight, params.a_log,
                        params.dt_bias, states.conv[gdn_layer], states.recurrent[gdn_layer], slot_ids,
                        params.num_key_heads, conv_done=conv_done, defer_state=side is not None)
    if result.pending is not None:
        side.wait_stream(torch.cuda.current_stream(side.device))
        with torch.cuda.stream(side):
            apply_pending(result.pending)
        for t in result.pending.tensors():  # not reused by this stream's later allocations before it runs
            t.record_stream(side)
    return result.output[:, 0]


def decode_conv(states: GdnStatePool, gdn_layer: int, params, slot_ids: torch.Tensor,
                positions: int = 1) -> ConvEpilogue:
    """The decode conv of B spans of `positions` tokens on lanes `slot_ids`, for the input projection's GEMV
    to run in its epilogue (`gdn_decode.ConvEpilogue`), unless NINFER_CONV_EPILOGUE=0 leaves it to
    `decode_mix`."""
    return ConvEpilogue.of(params.conv_weight, states.conv[gdn_layer], slot_ids, positions)


def span_mix(states: GdnStatePool, gdn_layer: int, slot: int, mixed_qkv: torch.Tensor, a: torch.Tensor,
             b: torch.Tensor, params) -> torch.Tensor:
    """One sequence's chunk: mixed_qkv [L, C], a/b [L, Hv] -> o [L, Hv, Dv] fp32; slot updated in place."""
    conv_slot = states.conv[gdn_layer][slot]  # [C, K-1], oldest input first
    # fla wants q, k, v in one dtype: the model's (fp32 on the CPU reference, bf16 on the GPU)
    q, k, v = prefill_qkv(mixed_qkv, params.conv_weight, conv_slot, params.num_key_heads, params.key_dim,
                          params.num_value_heads, params.value_dim)
    g, beta = prefill_gates(a, b, params.a_log, params.dt_bias)
    recurrent = states.recurrent[gdn_layer][slot]
    o, final = gdn_prefill(q, k, v, g, beta, recurrent.float())
    recurrent.copy_(final)
    return o.float()


def mix(plan: GdnMixPlan, states: GdnStatePool, gdn_layer: int, mixed_qkv: torch.Tensor, a: torch.Tensor,
        b: torch.Tensor, params, conv_done: bool = False) -> torch.Tensor:
    """The `gdn_mix` hook over a forward's spans -> o [T, Hv, Dv] fp32 (`conv_done`: where every row is a
    one-token span in order, as `GdnMixPlan.all_decodes` says)."""
    if plan.all_decodes:
        return decode_mix(states, gdn_layer, mixed_qkv, a, b, params, plan.decode_slots, conv_done)
    if conv_done:
        raise ValueError("the GDN conv ran in the projection, but the forward has spans longer than a token")
    if plan.decode_slots is None and len(plan.spans) == 1:  # one span is the whole batch: no copy
        return _span_rows(states, gdn_layer, plan.spans[0], plan.short_slots[0], mixed_qkv, a, b, params)
    out = torch.empty(plan.rows, params.num_value_heads, params.value_dim, dtype=torch.float32,
                      device=mixed_qkv.device)
    if plan.decode_slots is not None:
        r = plan.decode_rows
        out[r] = decode_mix(states, gdn_layer, mixed_qkv[r], a[r], b[r], params, plan.decode_slots)
    for s, slot_id in zip(plan.spans, plan.short_slots, strict=True):
        rows = slice(s.start, s.start + s.length)
        out[rows] = _span_rows(states, gdn_layer, s, slot_id, mixed_qkv[rows], a[rows], b[rows], params)
    return out


def _span_rows(states: GdnStatePool, gdn_layer: int, span: SequenceSpan, slot_id: torch.Tensor | None,
               mixed_qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor, params) -> torch.Tensor:
    """One longer span's rows -> o [L, Hv, Dv] fp32: a few positions (speculative verification, `slot_id`
    on the device) on the recurrent decode kernel, a prefill chunk on the chunked one."""
    if slot_id is None:
        return span_mix(states, gdn_layer, span.slot, mixed_qkv, a, b, params)
    out = gdn_decode(mixed_qkv[None], a[None], b[None], params.conv_weight, params.a_log, params.dt_bias,
                     states.conv[gdn_layer], states.recurrent[gdn_layer], slot_id, params.num_key_heads)
    return out.output[0]

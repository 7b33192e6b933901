"""The multi-token-prediction (MTP) head of Qwen3.5: drafts the token after next from the target's hidden
state and the next token.

    h' = fc([norm_e(embed(next_token)) ; norm_h(h)])   (embedding half first)
    h' = one gated full-attention decoder layer (own KV layer id = number of text KV layers)
    draft logits = shared output head(final_norm(h'))

`h` is the target model's final-normed hidden state (what `Qwen35Model.forward` returns): llama.cpp's
qwen35 graph hands the MTP block the hidden after `output_norm`, and vLLM's Qwen3-Next/Qwen3.5 MTP the
model output, also after its final norm. Row t of a call pairs h_t with token t+1 and runs at the
target's position t. Chained drafting feeds the MTP's own final-normed output back as `h` (as llama.cpp
does). transformers drops these weights, so the semantics follow those graphs.
"""

from __future__ import annotations

import torch
from torch import nn

from ninfer.models.context import BatchContext
from ninfer.models.layers import RMSNorm
from ninfer.models.qwen3_5 import DecoderLayer, GatedAttention, Qwen35Model, rope_tables
from ninfer.models.weights import Linear, WeightSource


class MtpHead(nn.Module):
    def __init__(self, source: WeightSource, text: Qwen35Model, dtype=torch.float32, device="cpu"):
        super().__init__()
        cfg = text.cfg
        self.cfg = cfg
        self.kv_layer = text.cache_spec.num_kv_layers
        # The text model is shared, not owned: keep it out of this module's parameters.
        self._text = [text]
        eps = cfg.rms_norm_eps
        self.embedding_norm = RMSNorm(source, "mtp/embedding_norm", eps, True, device)
        self.hidden_norm = RMSNorm(source, "mtp/hidden_norm", eps, True, device)
        self.input_projection = Linear(source, "mtp/input_projection", dtype, device)
        attention = GatedAttention(source, "mtp/layers/0", cfg, self.kv_layer, dtype, device)
        self.layer = DecoderLayer(source, "mtp/layers/0", cfg, attention, dtype, device)
        self.final_norm = RMSNorm(source, "mtp/final_norm", eps, True, device)

    @property
    def text(self) -> Qwen35Model:
        return self._text[0]

    def forward(
        self, hidden: torch.Tensor, next_ids: torch.Tensor, positions: torch.Tensor, ctx: BatchContext
    ) -> torch.Tensor:
        """hidden [T, H] (target's), next_ids [T], positions [T] or [3, T] -> MTP hidden [T, H]."""
        e = self.embedding_norm(self.text.embed(next_ids))
        h = self.hidden_norm(hidden.to(e.dtype))
        x = self.input_projection(torch.cat([e, h], dim=-1))
        cos, sin = rope_tables(self.cfg, positions)
        h, residual = self.layer(x, None, cos, sin, ctx)
        return self.final_norm.add_forward(h, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Draft logits through the shared output head, fp32 [N, vocab]."""
        return self.text.compute_logits(hidden)

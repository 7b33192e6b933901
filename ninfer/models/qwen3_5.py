"""The Qwen3.5 / 3.6 / 3.8 hybrid text model: Gated DeltaNet layers 3:1 with gated full attention.

Reads beside transformers' `models/qwen3_5/modeling_qwen3_5.py`: `GatedDeltaNet` ↔ `Qwen3_5GatedDeltaNet`,
`GatedAttention` ↔ `Qwen3_5Attention`, `DecoderLayer` ↔ `Qwen3_5DecoderLayer`, `Qwen35Model` ↔
`Qwen3_5ForCausalLM`. Tokens of all sequences arrive flattened as [T, ...]; caches and recurrent state
are reached only through the `BatchContext`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ninfer.errors import ArtifactError
from ninfer.kernels import ops
from ninfer.models.cache_spec import CacheSpec
from ninfer.models.context import BatchContext
from ninfer.models.layers import RMSNorm, SwiGLUMLP
from ninfer.models.weights import (
    Embedding,
    Linear,
    MergedLinear,
    WeightSource,
    has_tensor,
    load_vector,
    merging_projections,
    same_stored_object,
)

# Spans up to this length (decode, speculative verification) use the token-by-token recurrence;
# longer ones (prefill) the chunked form. Both give the same numbers within fp32 rounding.
RECURRENT_MAX_SPAN = 8
GDN_CHUNK = 64


@dataclass(frozen=True)
class Qwen35Config:
    hidden_size: int
    num_layers: int
    layer_types: tuple[str, ...]
    vocab_size: int
    intermediate_size: int
    rms_norm_eps: float
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rotary_dim: int
    mrope_sections: tuple[int, ...] | None
    mrope_interleaved: bool
    gdn_key_heads: int
    gdn_value_heads: int
    gdn_key_dim: int
    gdn_value_dim: int
    gdn_conv_kernel: int
    tie_word_embeddings: bool

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> Qwen35Config:
        try:
            rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
            head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])
            partial = float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)))
            sections = rope.get("mrope_section")
            n_layers = int(cfg["num_hidden_layers"])
            interval = int(cfg.get("full_attention_interval", 4))
            layer_types = cfg.get("layer_types") or [
                "full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n_layers)
            ]
            return cls(
                hidden_size=int(cfg["hidden_size"]),
                num_layers=n_layers,
                layer_types=tuple(layer_types),
                vocab_size=int(cfg["vocab_size"]),
                intermediate_size=int(cfg["intermediate_size"]),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                num_heads=int(cfg["num_attention_heads"]),
                num_kv_heads=int(cfg["num_key_value_heads"]),
                head_dim=head_dim,
                rope_theta=float(rope.get("rope_theta", cfg.get("rope_theta", 1e7))),
                rotary_dim=int(head_dim * partial),
                mrope_sections=tuple(int(s) for s in sections) if sections else None,
                mrope_interleaved=bool(rope.get("mrope_interleaved", False)),
                gdn_key_heads=int(cfg["linear_num_key_heads"]),
                gdn_value_heads=int(cfg["linear_num_value_heads"]),
                gdn_key_dim=int(cfg["linear_key_head_dim"]),
                gdn_value_dim=int(cfg["linear_value_head_dim"]),
                gdn_conv_kernel=int(cfg.get("linear_conv_kernel_dim", 4)),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            )
        except KeyError as e:
            raise ArtifactError(
                f"text config lacks {e.args[0]!r}, needed by the qwen3_5 model; re-convert the model"
            ) from None

    @property
    def gdn_conv_channels(self) -> int:
        return 2 * self.gdn_key_heads * self.gdn_key_dim + self.gdn_value_heads * self.gdn_value_dim


def rope_tables(cfg: Qwen35Config, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [T, rotary_dim] for text ([T]) or multimodal ([3, T]) positions."""
    return ops.mrope_cos_sin(
        positions, cfg.rotary_dim, cfg.rope_theta, cfg.mrope_sections, cfg.mrope_interleaved
    )


@dataclass(frozen=True)
class GdnParams:
    """A GDN layer's small parameters, for a context that runs the token mixing itself.

    A BatchContext may define `gdn_mix(gdn_layer, mixed_qkv [T, C], a [T, Hv], b [T, Hv], params) ->
    o [T, Hv, Dv]`: conv + SiLU over the pre-conv q|k|v channels, q/k L2 norm, q·1/sqrt(Dk),
    g = −exp(a_log)·softplus(a + dt_bias), β = sigmoid(b), the gated delta rule per span on the span's
    state, updating its conv and recurrent state (and, for speculative verification, keeping the
    per-position states it needs). GPU backends (fused decode, chunked prefill kernels) plug in here;
    without it the layer runs the reference ops span by span. With it a context may also define
    `gdn_conv(gdn_layer, params) -> kernels.gdn_decode.ConvEpilogue | None` (a forward of spans of one
    length, one token or a verification's few): the input projection may then run the conv itself, and
    where it did (`applied`) `gdn_mix(..., conv_done=True)` gets the conv's output instead of the pre-conv
    channels.
    """

    conv_weight: torch.Tensor  # [C, K] fp32
    a_log: torch.Tensor  # [Hv] fp32
    dt_bias: torch.Tensor  # [Hv] fp32
    num_key_heads: int
    key_dim: int
    num_value_heads: int
    value_dim: int


class GatedDeltaNet(nn.Module):
    """Linear-attention token mixer; `gdn_index` is its number among the GDN layers (state slot).

    In quantized mode the input projections run merged (`in_proj`: q|k|v, z, a, b per storage format);
    `mixed`, z, a and b are then column views of the merged outputs.
    """

    def __init__(self, source: WeightSource, prefix: str, cfg: Qwen35Config, gdn_index: int, dtype, device):
        super().__init__()
        p = f"{prefix}/gdn"
        self.cfg, self.gdn_index = cfg, gdn_index
        roles = ("query", "key", "value", "z", "a_projection", "b_projection")
        q, k, v, z, a, b = (f"{p}/{r}" for r in roles)
        if merging_projections():
            self.in_proj = MergedLinear(source, [[q, k, v], [z], [a], [b]], dtype, device)
        else:
            self.in_proj = None
            self.query = Linear(source, q, dtype, device)
            self.key = Linear(source, k, dtype, device)
            self.value = Linear(source, v, dtype, device)
            self.z = Linear(source, z, dtype, device)
            self.a_projection = Linear(source, a, dtype, device)
            self.b_projection = Linear(source, b, dtype, device)
        self.output = Linear(source, f"{p}/output", dtype, device)  # input_columns: applied by the gated norm
        self.a_log = nn.Buffer(load_vector(source, f"{p}/a_log", device))
        self.dt_bias = nn.Buffer(load_vector(source, f"{p}/dt_bias", device))
        conv = load_vector(source, f"{p}/convolution", device)
        self.conv_weight = nn.Buffer(conv.reshape(cfg.gdn_conv_channels, cfg.gdn_conv_kernel))
        self.norm_weight = nn.Buffer(load_vector(source, f"{p}/norm", device))
        self.eps = cfg.rms_norm_eps

    @property
    def params(self) -> GdnParams:
        cfg = self.cfg
        return GdnParams(self.conv_weight, self.a_log, self.dt_bias, cfg.gdn_key_heads, cfg.gdn_key_dim,
                         cfg.gdn_value_heads, cfg.gdn_value_dim)  # fmt: skip

    def _project(self, x: torch.Tensor, conv=None) -> list[torch.Tensor]:
        """mixed (conv channels q|k|v) [T, C], z [T, Hv·Dv], a, b [T, Hv]; `conv` (a decode context's
        `kernels.gdn_decode.ConvEpilogue`) handed to the merged projection, which may run it."""
        if self.in_proj is not None:
            return self.in_proj(x, conv=conv)
        mixed = torch.cat([self.query(x), self.key(x), self.value(x)], dim=-1)
        return [mixed, self.z(x), self.a_projection(x), self.b_projection(x)]

    def forward(self, x: torch.Tensor, ctx: BatchContext) -> torch.Tensor:
        cfg = self.cfg
        fused = getattr(ctx, "gdn_mix", None)  # optional backend hooks, see GdnParams
        conv_hook = getattr(ctx, "gdn_conv", None)
        params = self.params
        conv = conv_hook(self.gdn_index, params) if fused and conv_hook else None
        mixed, z, a, b = self._project(x, conv)
        z = z.view(-1, cfg.gdn_value_heads, cfg.gdn_value_dim)
        if fused is not None:
            if conv is not None and conv.applied:  # the projection ran the conv: its output is the input
                core = fused(self.gdn_index, conv.out, a, b, params, conv_done=True)
            else:
                core = fused(self.gdn_index, mixed, a, b, params)  # fp32: cast inside the gated norm
        else:
            core = self._mix(mixed, a, b, ctx)
        # the output projection's recorded input-column order is applied by the norm as it writes
        out = ops.gated_rms_norm(core, z, self.norm_weight, self.eps, x.dtype, self.output.input_columns,
                                 self.output.input_scatter, self.output.scatter_run,
                                 self.output.activation_group())
        # the very tensor (not a new view of it) when flat: its int8 activation is found by identity
        flat = out if out.dim() == 2 else out.reshape(x.shape[0], -1)
        return self.output(flat, columns_applied=True)

    def _mix(self, mixed: torch.Tensor, a: torch.Tensor, b: torch.Tensor, ctx: BatchContext) -> torch.Tensor:
        """Reference token mixing: per sequence span, conv + gated delta rule on its GdnState."""
        cfg = self.cfg
        beta = torch.sigmoid(b.float())
        g = -self.a_log.exp() * F.softplus(a.float() + self.dt_bias)
        core = torch.empty(mixed.shape[0], cfg.gdn_value_heads, cfg.gdn_value_dim, dtype=mixed.dtype,
                           device=mixed.device)  # fmt: skip
        for i, span in enumerate(ctx.spans):
            rows = slice(span.start, span.start + span.length)
            core[rows] = self._sequence(mixed[rows], g[rows], beta[rows], ctx.gdn_state(self.gdn_index, i))
        return core

    def _sequence(self, mixed: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state) -> torch.Tensor:
        """Conv + delta rule for one sequence's rows, continuing from and updating its state."""
        cfg = self.cfg
        T = mixed.shape[0]
        conv_out, new_conv = ops.causal_conv1d(mixed, self.conv_weight, state.conv, silu=True)
        state.conv.copy_(new_conv)
        key_width = cfg.gdn_key_heads * cfg.gdn_key_dim
        q, k, v = conv_out.split([key_width, key_width, cfg.gdn_value_heads * cfg.gdn_value_dim], dim=-1)
        q = ops.l2_norm(q.reshape(T, cfg.gdn_key_heads, cfg.gdn_key_dim).float()) / math.sqrt(cfg.gdn_key_dim)
        k = ops.l2_norm(k.reshape(T, cfg.gdn_key_heads, cfg.gdn_key_dim).float())
        v = v.reshape(T, cfg.gdn_value_heads, cfg.gdn_value_dim)
        if T <= RECURRENT_MAX_SPAN:
            o, s = ops.gdn_recurrent(q, k, v, g, beta, state.recurrent)
        else:
            o, s = ops.gdn_chunked(q, k, v, g, beta, state.recurrent, chunk_size=GDN_CHUNK)
        state.recurrent.copy_(s)
        return o


class GatedAttention(nn.Module):
    """Full attention with a per-head output gate, per-head q/k RMSNorm and partial (m)RoPE. In quantized
    mode query|gate|key|value run merged (`in_proj`)."""

    def __init__(self, source: WeightSource, prefix: str, cfg: Qwen35Config, kv_layer: int, dtype, device):
        super().__init__()
        p = f"{prefix}/attention"
        self.cfg, self.kv_layer = cfg, kv_layer
        q, g, k, v = (f"{p}/{r}" for r in ("query", "gate", "key", "value"))
        if merging_projections():
            self.in_proj = MergedLinear(source, [[q], [g], [k], [v]], dtype, device)
        else:
            self.in_proj = None
            self.query = Linear(source, q, dtype, device)
            self.gate = Linear(source, g, dtype, device)
            self.key = Linear(source, k, dtype, device)
            self.value = Linear(source, v, dtype, device)
        self.output = Linear(source, f"{p}/output", dtype, device)
        self.query_norm = RMSNorm(source, f"{p}/query_norm", cfg.rms_norm_eps, True, device)
        self.key_norm = RMSNorm(source, f"{p}/key_norm", cfg.rms_norm_eps, True, device)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: BatchContext
    ) -> torch.Tensor:
        cfg, T = self.cfg, x.shape[0]
        if self.in_proj is not None:
            q, gate, k, v = self.in_proj(x)
        else:
            q, gate, k, v = self.query(x), self.gate(x), self.key(x), self.value(x)
        eps = cfg.rms_norm_eps
        q, k = ops.norm_rotary_pair(q.view(T, cfg.num_heads, cfg.head_dim), self.query_norm.weight,
                                    k.view(T, cfg.num_kv_heads, cfg.head_dim), self.key_norm.weight, cos, sin,
                                    eps)
        v = v.view(T, cfg.num_kv_heads, cfg.head_dim)
        gated = getattr(ctx, "gated_attention", None)  # optional backend hook: the gate inside the attention
        group = self.output.activation_group()
        if gated is not None:
            return self.output(gated(self.kv_layer, q, k, v, gate, group))
        attn = ctx.attention(self.kv_layer, q, k, v).reshape(T, -1)
        return self.output(ops.sigmoid_gate_mul(attn, gate, group))


class DecoderLayer(nn.Module):
    """Pre-norm residual block: token mixer (GDN or gated attention), then SwiGLU MLP.

    The residual stream travels beside the layer output (`forward(x, residual) -> (mlp_out, residual)`) so
    each residual add is fused into the norm that follows it (this layer's two, the next layer's input
    norm, and the model's final norm).
    """

    def __init__(self, source: WeightSource, prefix: str, cfg: Qwen35Config, mixer: nn.Module, dtype, device):
        super().__init__()
        eps = cfg.rms_norm_eps
        self.input_norm = RMSNorm(source, f"{prefix}/input_norm", eps, True, device)
        self.mixer = mixer
        self.post_attention_norm = RMSNorm(source, f"{prefix}/post_attention_norm", eps, True, device)
        self.mlp = SwiGLUMLP(source, prefix, dtype, device)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, cos, sin, ctx: BatchContext
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the previous layer's MLP output (or the embeddings, with residual None)."""
        mixer = self.mixer
        first = mixer.in_proj if mixer.in_proj is not None else mixer.query  # the matmul the norm feeds
        h, residual = self.input_norm.add_forward(x, residual, first.activation_group())
        if isinstance(mixer, GatedAttention):
            h = mixer(h, cos, sin, ctx)
        else:
            h = mixer(h, ctx)
        h, residual = self.post_attention_norm.add_forward(h, residual, self.mlp.input_group())
        return self.mlp(h), residual


class Qwen35Model(nn.Module):
    """forward(ids [T], positions [T] or [3,T], ctx) -> final-normed hidden [T, H]; compute_logits."""

    def __init__(self, source: WeightSource, config: dict[str, Any], dtype=torch.float32, device="cpu"):
        super().__init__()
        cfg = self.cfg = Qwen35Config.from_dict(config)
        self.dtype = dtype
        self.token_embedding = Embedding(source, "text/token_embedding", dtype, device)
        layers, n_kv, n_gdn = [], 0, 0
        for i, kind in enumerate(cfg.layer_types):
            prefix = f"text/layers/{i}"
            if kind == "full_attention":
                mixer = GatedAttention(source, prefix, cfg, n_kv, dtype, device)
                n_kv += 1
            else:
                mixer = GatedDeltaNet(source, prefix, cfg, n_gdn, dtype, device)
                n_gdn += 1
            layers.append(DecoderLayer(source, prefix, cfg, mixer, dtype, device))
        self.layers = nn.ModuleList(layers)
        self.final_norm = RMSNorm(source, "text/final_norm", cfg.rms_norm_eps, True, device)
        self.output_head = output_head(source, self.token_embedding, dtype, device)
        self.cache_spec = CacheSpec(
            num_kv_layers=n_kv, kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, num_gdn_layers=n_gdn,
            gdn_conv_channels=cfg.gdn_conv_channels, gdn_conv_kernel=cfg.gdn_conv_kernel,
            gdn_key_heads=cfg.gdn_key_heads, gdn_value_heads=cfg.gdn_value_heads,
            gdn_key_dim=cfg.gdn_key_dim, gdn_value_dim=cfg.gdn_value_dim,
        )
        self.mtp = None  # set by load_model when the artifact has an MTP component

    @property
    def vocab_size(self) -> int:
        return self.output_head.out_features

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.token_embedding(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        ctx: BatchContext,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`inputs_embeds` (optional, [T, H]) replaces the token embeddings (image tokens, later)."""
        x = self.embed(input_ids) if inputs_embeds is None else inputs_embeds.to(self.dtype)
        cos, sin = rope_tables(self.cfg, positions)
        residual = None
        for layer in self.layers:
            x, residual = layer(x, residual, cos, sin, ctx)
        return self.final_norm.add_forward(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, H] final-normed hidden -> [N, vocab] fp32 logits (padding rows included)."""
        return self.output_head(hidden).float()


def output_head(source: WeightSource, embedding: Embedding, dtype, device) -> nn.Module:
    """The untied head, or the embedding table itself when absent or bound to the same stored object."""
    name = "text/output_head"
    if has_tensor(source, name) and not same_stored_object(source, name, embedding.name):
        return Linear(source, name, dtype, device)
    return TiedHead(embedding)


class TiedHead(nn.Module):
    """Output head sharing the token embedding table."""

    def __init__(self, embedding: Embedding):
        super().__init__()
        self.embedding = embedding

    @property
    def weight(self) -> torch.Tensor | None:
        return self.embedding.weight  # None when the table stays GGUF blocks (quantized mode)

    @property
    def out_features(self) -> int:
        return self.embedding.num_rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.embedding.as_output_head(x)

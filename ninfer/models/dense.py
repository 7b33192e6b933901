"""Dense pre-norm decoders: Qwen2/2.5 (q/k/v biases) and Llama/SmolLM, as transformers' `modeling_qwen2`
and `modeling_llama`: plain RMSNorm `x/rms·w`, rotate-half RoPE on the whole head, GQA, SwiGLU MLP.

The artifact holds the model's own (Hugging Face order) q/k rows; llama.cpp's llama q/k permutation is
undone at conversion.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ninfer.errors import ArtifactError
from ninfer.kernels import ops
from ninfer.models.cache_spec import CacheSpec
from ninfer.models.context import BatchContext
from ninfer.models.layers import RMSNorm, SwiGLUMLP
from ninfer.models.qwen3_5 import output_head
from ninfer.models.weights import Embedding, Linear, WeightSource, has_tensor, load_vector

SUPPORTED_ROPE_TYPES = (None, "default", "llama3")
# llama.cpp stores Llama 3.x's per-frequency RoPE divisors as `rope_freqs.weight`; carried under this name.
ROPE_FACTORS = "text/rope_frequency_factors"


def bias_name(prefix: str, role: str) -> str:
    """Logical name of an attention projection's bias (Qwen2 has them on query, key, value)."""
    return f"{prefix}/attention/{role}_bias"


@dataclass(frozen=True)
class DenseConfig:
    architecture: str
    hidden_size: int
    num_layers: int
    vocab_size: int
    intermediate_size: int
    rms_norm_eps: float
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rope: tuple[tuple[str, float], ...] = ()  # scaling parameters (llama3: factor, low/high_freq_factor, ...)

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> DenseConfig:
        try:
            rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
            rope_type = rope.get("rope_type", rope.get("type"))
            if rope_type not in SUPPORTED_ROPE_TYPES:
                raise ArtifactError(
                    f"rope type {rope_type!r} of this {cfg.get('architecture')} model is not supported yet "
                    f"(supported: default); use a model without RoPE scaling"
                )
            heads = int(cfg["num_attention_heads"])
            return cls(
                architecture=str(cfg.get("architecture", "llama")),
                hidden_size=int(cfg["hidden_size"]),
                num_layers=int(cfg["num_hidden_layers"]),
                vocab_size=int(cfg["vocab_size"]),
                intermediate_size=int(cfg["intermediate_size"]),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                num_heads=heads,
                num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
                head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // heads),
                rope_theta=float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))),
                rope=tuple((k, float(v)) for k, v in rope.items() if isinstance(v, (int, float))),
            )
        except KeyError as e:
            raise ArtifactError(
                f"text config lacks {e.args[0]!r}, needed by the dense model; re-convert the model"
            ) from None


def rope_inv_freq(cfg: DenseConfig, factors: torch.Tensor | None) -> torch.Tensor:
    """Inverse frequencies [head_dim/2]: plain, divided by stored per-frequency factors, or llama3-scaled."""
    inv_freq = ops.rope_inv_freq(cfg.head_dim, cfg.rope_theta)
    if factors is not None:
        return inv_freq / factors.float()
    params = dict(cfg.rope)
    if "factor" not in params or "low_freq_factor" not in params:
        return inv_freq
    # Llama 3.x: long wavelengths slowed by `factor`, short ones kept, a smooth blend in between.
    factor, low, high = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
    old_context = params["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    smooth = ((old_context / wavelen - low) / (high - low)).clamp(0.0, 1.0)
    return (1 - smooth) * inv_freq / factor + smooth * inv_freq


class DenseAttention(nn.Module):
    def __init__(self, source: WeightSource, prefix: str, cfg: DenseConfig, kv_layer: int, dtype, device):
        super().__init__()
        self.cfg, self.kv_layer = cfg, kv_layer

        def proj(role: str) -> Linear:
            b = bias_name(prefix, role)
            return Linear(source, f"{prefix}/attention/{role}", dtype, device,
                          bias_name=b if has_tensor(source, b) else None)

        self.query, self.key, self.value = proj("query"), proj("key"), proj("value")
        self.output = Linear(source, f"{prefix}/attention/output", dtype, device)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: BatchContext
    ) -> torch.Tensor:
        cfg, T = self.cfg, x.shape[0]
        eps = cfg.rms_norm_eps  # unused: no q/k norm here, rotary only
        q, k = ops.norm_rotary_pair(self.query(x).view(T, cfg.num_heads, cfg.head_dim), None,
                                    self.key(x).view(T, cfg.num_kv_heads, cfg.head_dim), None, cos, sin, eps)
        v = self.value(x).view(T, cfg.num_kv_heads, cfg.head_dim)
        return self.output(ctx.attention(self.kv_layer, q, k, v).reshape(T, -1))


class DenseLayer(nn.Module):
    def __init__(self, source: WeightSource, prefix: str, cfg: DenseConfig, index: int, dtype, device):
        super().__init__()
        eps = cfg.rms_norm_eps
        self.input_norm = RMSNorm(source, f"{prefix}/input_norm", eps, False, device)
        self.attention = DenseAttention(source, prefix, cfg, index, dtype, device)
        self.post_attention_norm = RMSNorm(source, f"{prefix}/post_attention_norm", eps, False, device)
        self.mlp = SwiGLUMLP(source, prefix, dtype, device)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, cos, sin, ctx: BatchContext
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """As `qwen3_5.DecoderLayer`: the residual stream beside the output, each add fused into a norm."""
        h, residual = self.input_norm.add_forward(x, residual, self.attention.query.activation_group())
        h, residual = self.post_attention_norm.add_forward(self.attention(h, cos, sin, ctx), residual,
                                                           self.mlp.input_group())
        return self.mlp(h), residual


class DenseModel(nn.Module):
    """forward(ids [T], positions [T], ctx) -> final-normed hidden [T, H]; compute_logits."""

    def __init__(self, source: WeightSource, config: dict[str, Any], dtype=torch.float32, device="cpu"):
        super().__init__()
        cfg = self.cfg = DenseConfig.from_dict(config)
        self.dtype = dtype
        self.token_embedding = Embedding(source, "text/token_embedding", dtype, device)
        self.layers = nn.ModuleList(
            DenseLayer(source, f"text/layers/{i}", cfg, i, dtype, device) for i in range(cfg.num_layers)
        )
        self.final_norm = RMSNorm(source, "text/final_norm", cfg.rms_norm_eps, False, device)
        self.output_head = output_head(source, self.token_embedding, dtype, device)
        factors = load_vector(source, ROPE_FACTORS, device) if has_tensor(source, ROPE_FACTORS) else None
        if factors is None and dict(cfg.rope).get("gguf_rope_freqs"):
            raise ArtifactError(
                "this Llama 3 artifact lacks its RoPE frequency factors (GGUF rope_freqs.weight); "
                "re-convert it with a converter that carries them"
            )
        self.inv_freq = nn.Buffer(rope_inv_freq(cfg, factors).to(device))
        self.cache_spec = CacheSpec(
            num_kv_layers=cfg.num_layers, kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim
        )
        self.mtp = None

    @property
    def vocab_size(self) -> int:
        return self.output_head.out_features

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.token_embedding(input_ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: BatchContext,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        x = self.embed(input_ids) if inputs_embeds is None else inputs_embeds.to(self.dtype)
        if positions.dim() == 2:  # [3, T] multimodal positions: dense models use the text axis
            positions = positions[0]
        cos, sin = ops.rope_cos_sin(positions, self.inv_freq)
        residual = None
        for layer in self.layers:
            x, residual = layer(x, residual, cos, sin, ctx)
        return self.final_norm.add_forward(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.output_head(hidden).float()

"""Random Qwen3.5-hybrid models of a named geometry, built in memory (for `ninfer-bench --synthetic`).

Speed does not depend on weight values, so random weights with the real shapes are a fair benchmark input.
On CPU the model holds dense weights in the compute dtype whatever `--wtype` says (quantized blocks are
dequantised at load there too), so `wtype` only labels the run; GPU kernels reading GGUF blocks will use it.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from ninfer.errors import EngineConfigError

# facts of the released geometries (text model only)
GEOMETRIES = {
    "tiny": dict(hidden_size=256, num_hidden_layers=4, intermediate_size=768, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=128, linear_num_key_heads=2, linear_num_value_heads=6,
                 linear_key_head_dim=128, linear_value_head_dim=128, vocab_size=4096),
    "9b": dict(hidden_size=4096, num_hidden_layers=32, intermediate_size=12288, num_attention_heads=16,
               num_key_value_heads=4, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32,
               linear_key_head_dim=128, linear_value_head_dim=128, vocab_size=248320),
    "27b": dict(hidden_size=5120, num_hidden_layers=64, intermediate_size=17408, num_attention_heads=24,
                num_key_value_heads=4, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=48,
                linear_key_head_dim=128, linear_value_head_dim=128, vocab_size=248320),
}
COMMON = dict(full_attention_interval=4, linear_conv_kernel_dim=4, rms_norm_eps=1e-6,
              tie_word_embeddings=False,
              rope_parameters=dict(rope_theta=1e7, partial_rotary_factor=0.25, mrope_section=[11, 11, 10],
                                   mrope_interleaved=True), architecture="qwen3_5")


def synthetic_config(name: str) -> dict:
    if name not in GEOMETRIES:
        raise EngineConfigError(f"unknown --synthetic {name!r}; choose one of {', '.join(GEOMETRIES)}")
    cfg = {**GEOMETRIES[name], **COMMON}
    if name == "tiny":
        cfg["rope_parameters"] = {**COMMON["rope_parameters"], "mrope_section": [6, 5, 5]}
    return cfg


@dataclass
class _Dense:
    data: torch.Tensor

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.data.shape)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.data.to(dtype)


def parameter_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """Logical name -> shape of every text parameter (SPEC §3 names)."""
    h, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    hq, hkv, d = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    hk, hv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    dk, dv = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
    conv = 2 * hk * dk + hv * dv
    shapes = {"text/token_embedding": (v, h), "text/output_head": (v, h), "text/final_norm": (h,)}
    for n in range(cfg["num_hidden_layers"]):
        p = f"text/layers/{n}"
        shapes.update({f"{p}/input_norm": (h,), f"{p}/post_attention_norm": (h,), f"{p}/mlp/gate": (i, h),
                       f"{p}/mlp/up": (i, h), f"{p}/mlp/down": (h, i)})
        if (n + 1) % cfg["full_attention_interval"] == 0:
            a = f"{p}/attention"
            shapes.update({f"{a}/query": (hq * d, h), f"{a}/gate": (hq * d, h), f"{a}/key": (hkv * d, h),
                           f"{a}/value": (hkv * d, h), f"{a}/output": (h, hq * d), f"{a}/query_norm": (d,),
                           f"{a}/key_norm": (d,)})
        else:
            g = f"{p}/gdn"
            shapes.update({f"{g}/query": (hk * dk, h), f"{g}/key": (hk * dk, h), f"{g}/value": (hv * dv, h),
                           f"{g}/z": (hv * dv, h), f"{g}/output": (h, hv * dv), f"{g}/a_projection": (hv, h),
                           f"{g}/b_projection": (hv, h), f"{g}/a_log": (hv,), f"{g}/dt_bias": (hv,),
                           f"{g}/convolution": (conv, cfg["linear_conv_kernel_dim"]), f"{g}/norm": (dv,)})
    return shapes


class SyntheticSource:
    """A WeightSource of random tensors (seeded per name), plus `components` like an Artifact."""

    def __init__(self, cfg: dict, seed: int = 0):
        self.cfg = cfg
        self.shapes = parameter_shapes(cfg)
        self.seed = seed
        self.components = {"text": SimpleNamespace(config=cfg, resources={})}

    def has(self, name: str) -> bool:
        return name in self.shapes

    def input_columns(self, name: str) -> None:
        return None

    def tensor(self, name: str) -> _Dense:
        if name not in self.shapes:
            raise KeyError(name)
        shape = self.shapes[name]
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + zlib.crc32(name.encode()))
        leaf = name.rsplit("/", 1)[-1]
        if leaf == "a_log":
            data = torch.empty(shape).uniform_(1, 16, generator=g).log()
        elif leaf == "dt_bias":
            data = torch.full(shape, math.log(math.expm1(0.01)))
        elif leaf == "norm":  # the GDN output norm multiplies by w
            data = torch.ones(shape)
        elif len(shape) == 1:  # zero-centred norms: (1 + w)
            data = torch.zeros(shape)
        elif leaf == "convolution":
            data = torch.randn(shape, generator=g) * 0.3
        else:
            data = torch.randn(shape, generator=g) * (1 / math.sqrt(shape[-1]))
        return _Dense(data)


def synthetic_model(name: str, dtype: torch.dtype = torch.float32, device: str = "cpu", seed: int = 0):
    """A random Qwen3.5 text model of geometry `name` (tiny, 9b, 27b)."""
    from ninfer.models import load_model

    source = SyntheticSource(synthetic_config(name), seed)
    return load_model(source, dtype=dtype, device=device, load_mtp=False)

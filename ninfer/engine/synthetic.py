"""Random Qwen3.5-hybrid models of a named geometry, built in memory (for `ninfer-bench --synthetic`).

Speed does not depend on weight values, so random weights with the real shapes and the real block formats are
a fair benchmark input. `wtype` bf16 gives dense weights (today's dense behaviour); a GGUF type gives valid
random GGUF rows (`gguf_matmul.random_gguf_weight`, generated directly on the target device, so the 27B
builds in seconds on a GPU). Formats per tensor mirror `../shared/tools/synth_qwen35_gguf.py` (the file
ik_llama.cpp is measured on): every projection in `wtype` (GDN a/b too, since hidden % 256 == 0 in every
geometry here), the token embedding q4_k (the tool's `--embd-type` default), the output head q6_k
(`--out-type`), norms / A_log / dt_bias / conv1d f32. The tool's MTP layer (q6_k) is not built: the bench
loads no MTP head.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from ninfer.errors import EngineConfigError
from ninfer.quant import FORMATS, dequantize, tensor_bytes

# GGUF types the synthetic builder can fill with valid random blocks (random_gguf_weight's formats)
QUANT_WTYPES = ("q4_0", "q4_1", "q5_0", "q8_0", "q4_k", "q5_k", "q6_k", "iq4_xs", "iq3_s")
WTYPES = ("bf16", *QUANT_WTYPES)
EMBEDDING_WTYPE = "q4_k"  # synth_qwen35_gguf.py --embd-type default
HEAD_WTYPE = "q6_k"  # synth_qwen35_gguf.py --out-type default

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

    @property
    def format(self) -> str:
        return {torch.bfloat16: "bf16", torch.float16: "f16"}.get(self.data.dtype, "f32")

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.data.to(dtype)


class _GgufRows:
    """A stored GGUF tensor like the artifact's: `data` uint8 [out, row_bytes], `format` gguf_<t>. The rows
    are generated on first use of `data`, so asking for shape or format (merged projections) costs nothing."""

    def __init__(self, make: Callable[[], torch.Tensor], format: str, shape: tuple[int, int]):
        self._make, self._data = make, None
        self.format, self.shape = format, shape

    @property
    def data(self) -> torch.Tensor:
        if self._data is None:
            self._data = self._make()
        return self._data

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize(self.data.cpu().reshape(-1), self.format, self.shape).to(self.data.device, dtype)


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
    """A WeightSource of random tensors (seeded per name), plus `components` like an Artifact.

    `wtype` "bf16": dense matrices (generated in `dense_dtype`); a GGUF type: matrices as GGUF rows (formats
    in the module docstring). Tensors are generated on `device`.
    """

    def __init__(self, cfg: dict, seed: int = 0, wtype: str = "bf16", device: torch.device | str = "cpu",
                 dense_dtype: torch.dtype = torch.float32):
        if wtype not in WTYPES:
            raise EngineConfigError(f"unknown --wtype {wtype!r}; choose one of {', '.join(WTYPES)}")
        self.cfg = cfg
        self.shapes = parameter_shapes(cfg)
        self.seed = seed
        self.wtype = wtype
        self.device = torch.device(device)
        self.dense_dtype = dense_dtype
        self.components = {"text": SimpleNamespace(config=cfg, resources={})}

    def has(self, name: str) -> bool:
        return name in self.shapes

    def input_columns(self, name: str) -> None:
        return None

    def format_of(self, name: str) -> str:
        """The artifact format `name` is stored in (`f32`, `bf16` or `gguf_<t>`)."""
        shape = self.shapes[name]
        if len(shape) == 1 or name.endswith("/convolution"):
            return "f32"
        if self.wtype == "bf16":
            return "bf16" if self.dense_dtype == torch.bfloat16 else "f32"
        leaf = name.rsplit("/", 1)[-1]
        t = {"token_embedding": EMBEDDING_WTYPE, "output_head": HEAD_WTYPE}.get(leaf, self.wtype)
        if shape[-1] % FORMATS[t].block_elems:
            return "f32"  # like the tool's GDN a/b on a hidden size that is not whole blocks
        return "gguf_" + t

    def stored_bytes(self) -> int:
        """Bytes every tensor of the model takes in its stored format (the memory check's denominator)."""
        return sum(tensor_bytes(self.format_of(n), s) for n, s in self.shapes.items())

    def _generator(self, name: str, device: torch.device) -> torch.Generator | None:
        if device.type == "meta":  # shapes only (no values): planning and tests of the big geometries
            return None
        g = torch.Generator(device=device)
        return g.manual_seed(self.seed * 1_000_003 + zlib.crc32(name.encode()))

    def tensor(self, name: str) -> _Dense | _GgufRows:
        if name not in self.shapes:
            raise KeyError(name)
        shape = self.shapes[name]
        fmt = self.format_of(name)
        if fmt.startswith("gguf_"):
            from ninfer.kernels.gguf_matmul import random_gguf_weight

            def make() -> torch.Tensor:
                g = self._generator(name, self.device)
                return random_gguf_weight(fmt, shape[0], shape[1], self.device, g)

            return _GgufRows(make, fmt, shape)
        leaf = name.rsplit("/", 1)[-1]
        if len(shape) == 1 or leaf == "convolution":  # small tensors: on the CPU, the same on every device
            g = self._generator(name, torch.device("cpu"))
            if leaf == "a_log":
                data = torch.empty(shape).uniform_(1, 16, generator=g).log()
            elif leaf == "dt_bias":
                data = torch.full(shape, math.log(math.expm1(0.01)))
            elif leaf == "norm":  # the GDN output norm multiplies by w
                data = torch.ones(shape)
            elif len(shape) == 1:  # zero-centred norms: (1 + w)
                data = torch.zeros(shape)
            else:
                data = torch.randn(shape, generator=g) * 0.3
            return _Dense(data.to(self.device))
        g = self._generator(name, self.device)
        data = torch.randn(shape, generator=g, device=self.device, dtype=self.dense_dtype)
        return _Dense(data.mul_(1 / math.sqrt(shape[-1])))


def synthetic_model(name: str, dtype: torch.dtype = torch.float32, device: str = "cpu", seed: int = 0,
                    wtype: str = "bf16", quantized_weights: bool = False):
    """A random Qwen3.5 text model of geometry `name` (tiny, 9b, 27b) with `wtype` weights; with
    `quantized_weights` its GGUF matrices stay blocks on `device` (else they are dequantised to `dtype`)."""
    from ninfer.models import load_model

    source = synthetic_source(name, seed, wtype, device, dtype)
    return load_model(source, dtype=dtype, device=device, load_mtp=False, quantized_weights=quantized_weights)


def synthetic_source(name: str, seed: int = 0, wtype: str = "bf16", device: str = "cpu",
                     dtype: torch.dtype = torch.float32) -> SyntheticSource:
    """The WeightSource behind `synthetic_model` (dense tensors generated in `dtype`)."""
    return SyntheticSource(synthetic_config(name), seed, wtype, device, dtype)

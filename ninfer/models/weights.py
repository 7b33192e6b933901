"""Weights as the model sees them: a `Linear` / `Embedding` that keep the artifact's stored tensor and,
on CPU, a dense copy in the compute dtype made once at load.

A quantized GPU backend replaces `Linear.forward` (it has `stored`, the raw GGUF blocks, and
`input_columns`) without touching the model files.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from ninfer.errors import ArtifactError


class StoredLike(Protocol):
    shape: Any

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor: ...


class WeightSource(Protocol):
    """What the models need from `ninfer.artifact.Artifact` (tests may supply their own)."""

    def tensor(self, name: str) -> StoredLike: ...

    def input_columns(self, name: str) -> torch.Tensor | None: ...


def has_tensor(source: WeightSource, name: str) -> bool:
    """True when `name` is bound in the source (optional parameters: biases, untied head)."""
    for method in ("has", "has_tensor"):
        if hasattr(source, method):
            return bool(getattr(source, method)(name))
    bindings = getattr(source, "bindings", None)
    if isinstance(bindings, dict):
        return name in bindings
    try:
        source.tensor(name)
    except (KeyError, ArtifactError):
        return False
    return True


def same_stored_object(source: WeightSource, a: str, b: str) -> bool:
    """True when two names are bound to one stored object (a tied output head): load it once."""
    bindings = getattr(source, "bindings", None)
    if not isinstance(bindings, dict) or a not in bindings or b not in bindings:
        return False
    return "object" in bindings[a] and bindings[a] == bindings[b]


def load_dense(
    source: WeightSource, name: str, dtype: torch.dtype, device: torch.device | str
) -> torch.Tensor:
    """Dequantise one stored tensor into a dense tensor of `dtype` on `device`."""
    return source.tensor(name).dequantize(torch.float32).to(device=device, dtype=dtype).contiguous()


def load_vector(source: WeightSource, name: str, device: torch.device | str) -> torch.Tensor:
    """Small vectors (norm weights, A_log, dt_bias) stay fp32 whatever the compute dtype."""
    return load_dense(source, name, torch.float32, device)


class Linear(nn.Module):
    """`y = x[..., input_columns] @ Wᵀ (+ b)`; W [out, in] from the artifact, dequantised once."""

    def __init__(
        self,
        source: WeightSource,
        name: str,
        dtype: torch.dtype,
        device: torch.device | str,
        bias_name: str | None = None,
    ):
        super().__init__()
        self.name = name
        self.stored = source.tensor(name)
        self.weight = nn.Buffer(load_dense(source, name, dtype, device))
        self.out_features, self.in_features = self.weight.shape
        columns = source.input_columns(name)
        self.input_columns = None if columns is None else columns.to(device=device, dtype=torch.long)
        self.bias = None if bias_name is None else nn.Buffer(load_dense(source, bias_name, dtype, device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.input_columns is not None:
            x = x.index_select(-1, self.input_columns)
        return F.linear(x.to(self.weight.dtype), self.weight, self.bias)


class Embedding(nn.Module):
    """Token embedding table [vocab, hidden]; also serves as a tied output head via `weight`."""

    def __init__(self, source: WeightSource, name: str, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        self.name = name
        self.stored = source.tensor(name)
        self.weight = nn.Buffer(load_dense(source, name, dtype, device))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.weight.index_select(0, ids.to(device=self.weight.device, dtype=torch.long))

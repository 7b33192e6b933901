"""Weights as the model sees them: a `Linear` / `Embedding` that keep the artifact's stored tensor and,
on CPU, a dense copy in the compute dtype made once at load.

A quantized GPU backend replaces `Linear.forward` (it has `stored`, the raw GGUF blocks, and
`input_columns`) without touching the model files.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from ninfer.errors import ArtifactError

# Set by `load_model(..., quantized_weights=True)` while it builds a model: Linears keep GGUF blocks.
QUANTIZED_LINEARS: ContextVar[bool] = ContextVar("quantized_linears", default=False)


@contextmanager
def quantized_linears(enabled: bool) -> Iterator[None]:
    """Build every `Linear` in this block in quantized mode (GGUF formats) or dense mode."""
    token = QUANTIZED_LINEARS.set(enabled)
    try:
        yield
    finally:
        QUANTIZED_LINEARS.reset(token)


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
    """`y = x[..., input_columns] @ Wᵀ (+ b)`; W [out, in] from the artifact.

    Dense mode (default, the CPU reference): W dequantised once to the compute dtype (`weight`).
    Quantized mode (`quantized=True`, GGUF block formats only): the raw blocks (`raw`, uint8
    [out, row_bytes]) move to `device` as stored and every call runs `kernels.gguf_matmul.quant_matmul`
    (Triton on CUDA; its reference elsewhere). Other formats stay dense in either mode.
    """

    def __init__(
        self,
        source: WeightSource,
        name: str,
        dtype: torch.dtype,
        device: torch.device | str,
        bias_name: str | None = None,
        quantized: bool | None = None,
    ):
        super().__init__()
        self.name = name
        self.dtype = dtype
        self.stored = source.tensor(name)
        self.out_features, self.in_features = (int(n) for n in self.stored.shape)
        self.format = getattr(self.stored, "format", "f32")
        if quantized is None:
            quantized = QUANTIZED_LINEARS.get()
        if quantized and self.format.startswith("gguf_"):
            self.weight, self.raw = None, nn.Buffer(self.stored.data.to(device))
        else:
            self.weight, self.raw = nn.Buffer(load_dense(source, name, dtype, device)), None
        columns = source.input_columns(name)
        self.input_columns = None if columns is None else columns.to(device=device, dtype=torch.long)
        self.bias = None if bias_name is None else nn.Buffer(load_dense(source, bias_name, dtype, device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.input_columns is not None:
            x = x.index_select(-1, self.input_columns)
        x = x.to(self.dtype)
        if self.raw is None:
            return F.linear(x, self.weight, self.bias)
        from ninfer.kernels.gguf_matmul import quant_matmul

        y = quant_matmul(self.raw, self.format, x, self.out_features)
        return y if self.bias is None else y + self.bias


class Embedding(nn.Module):
    """Token embedding table [vocab, hidden]; also serves as a tied output head (`as_output_head`).

    Dense mode: the table dequantised once to the compute dtype (`weight`). Quantized mode (as for `Linear`,
    GGUF formats the kernels decode): the rows stay GGUF blocks on `device` (`raw`) and a lookup decodes only
    the gathered rows, so the table costs its stored bytes; as a tied head it multiplies via `quant_matmul`.
    """

    def __init__(
        self,
        source: WeightSource,
        name: str,
        dtype: torch.dtype,
        device: torch.device | str,
        quantized: bool | None = None,
    ):
        super().__init__()
        from ninfer.kernels.gguf_matmul import KERNEL_FORMATS

        self.name = name
        self.dtype = dtype
        self.stored = source.tensor(name)
        self.num_rows, self.dim = (int(n) for n in self.stored.shape)
        self.format = getattr(self.stored, "format", "f32")
        if quantized is None:
            quantized = QUANTIZED_LINEARS.get()
        if quantized and self.format.removeprefix("gguf_") in KERNEL_FORMATS:
            self.weight, self.raw = None, nn.Buffer(self.stored.data.to(device))
        else:
            self.weight, self.raw = nn.Buffer(load_dense(source, name, dtype, device)), None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.raw is None:
            return self.weight.index_select(0, ids.to(device=self.weight.device, dtype=torch.long))
        from ninfer.kernels.gguf_matmul import dequantize_rows

        rows = self.raw.index_select(0, ids.to(device=self.raw.device, dtype=torch.long))
        return dequantize_rows(rows, self.format, rows.shape[0], self.dim, self.dtype)

    def as_output_head(self, x: torch.Tensor) -> torch.Tensor:
        """`x [..., hidden] -> [..., vocab]` logits through this table (a tied output head)."""
        if self.raw is None:
            return F.linear(x.to(self.weight.dtype), self.weight)
        from ninfer.kernels.gguf_matmul import quant_matmul

        return quant_matmul(self.raw, self.format, x.to(self.dtype), self.num_rows)

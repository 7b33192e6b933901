"""Temporary stand-in for ninfer.quant (sizes, reference dequantisation via gguf-py) until quant lands."""

from __future__ import annotations

import math

import gguf
import numpy as np
import torch

from ninfer.errors import QuantFormatError

_DENSE_ITEM_BYTES = {"f32": 4, "f16": 2, "bf16": 2, "i32": 4}
_GGUF_NAMES = (
    "q4_0",
    "q4_1",
    "q5_0",
    "q5_1",
    "q8_0",
    "q2_k",
    "q3_k",
    "q4_k",
    "q5_k",
    "q6_k",
    "iq2_xxs",
    "iq2_xs",
    "iq2_s",
    "iq3_xxs",
    "iq3_s",
    "iq4_nl",
    "iq4_xs",
)


def _ggml_type(fmt: str) -> gguf.GGMLQuantizationType:
    if not fmt.startswith("gguf_") or fmt[5:] not in _GGUF_NAMES:
        raise QuantFormatError(f"unknown tensor format {fmt!r}")
    return gguf.GGMLQuantizationType[fmt[5:].upper()]


def tensor_bytes(fmt: str, shape) -> int:
    n = math.prod(shape)
    if fmt in _DENSE_ITEM_BYTES:
        return n * _DENSE_ITEM_BYTES[fmt]
    block_elems, block_bytes = gguf.GGML_QUANT_SIZES[_ggml_type(fmt)]
    if not shape or shape[-1] % block_elems:
        raise QuantFormatError(f"{fmt}: last dimension of {list(shape)} is not a multiple of {block_elems}")
    return n // block_elems * block_bytes


def dequantize(raw: torch.Tensor, fmt: str, shape) -> torch.Tensor:
    qtype = _ggml_type(fmt)
    data = raw.contiguous().numpy().reshape(-1)
    values = gguf.quants.dequantize(data, qtype)
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(tuple(shape))

"""Artifact tensor formats: names, layouts, byte sizes, and how a stored row maps to torch."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ninfer.quant import FORMATS as BLOCK_FORMATS
from ninfer.quant import tensor_bytes

MAGIC = b"NINFER\x00\x03"
HEADER_BYTES = 32
PAYLOAD_ALIGN = 4096
OBJECT_ALIGN = 64

DENSE_DTYPES: dict[str, torch.dtype] = {
    "f32": torch.float32,
    "f16": torch.float16,
    "bf16": torch.bfloat16,
    "i32": torch.int32,
}
GGUF_FORMATS = tuple(f.artifact_format for f in BLOCK_FORMATS.values())
FORMATS = tuple(DENSE_DTYPES) + GGUF_FORMATS
DENSE_LAYOUT = "contiguous_le_v1"
BLOCK_LAYOUT = "gguf_blocks_v1"
RESOURCE_ENCODING = "raw_bytes_v1"


def is_block_format(fmt: str) -> bool:
    return fmt.startswith("gguf_")


def layout_of(fmt: str) -> str:
    return BLOCK_LAYOUT if is_block_format(fmt) else DENSE_LAYOUT


def num_rows(fmt: str, shape: Sequence[int]) -> int:
    """The streaming unit: a ggml row for block formats, the first axis (1-D: an element) for dense ones."""
    if not shape:
        return 1
    if is_block_format(fmt):
        return math.prod(int(d) for d in shape[:-1])
    return int(shape[0])


def row_bytes(fmt: str, shape: Sequence[int]) -> int:
    rows = num_rows(fmt, shape)
    return byte_size(fmt, shape) // rows if rows else 0


def byte_size(fmt: str, shape: Sequence[int]) -> int:
    return tensor_bytes(fmt, tuple(int(d) for d in shape))


def numel(shape: Sequence[int]) -> int:
    return math.prod(int(d) for d in shape)


def align_up(n: int, alignment: int) -> int:
    return (n + alignment - 1) // alignment * alignment

"""GGUF block-format geometry and the byte sizes of every artifact tensor format.

An artifact format is `bf16`, `f16`, `f32`, `i32` (plain element types) or `gguf_<t>` where `t` is a key of
`FORMATS` (a GGUF block format whose blocks are stored byte for byte, layout `gguf_blocks_v1`).
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass

from ninfer.errors import QuantFormatError

GGUF_PREFIX = "gguf_"


@dataclass(frozen=True)
class BlockFormat:
    """One GGUF block format: `block_elems` consecutive row elements are stored in `block_bytes` bytes."""

    name: str  # without the gguf_ prefix, e.g. "iq3_s"
    ggml_type: int  # ggml's type id (GGMLQuantizationType value)
    block_elems: int
    block_bytes: int

    @property
    def artifact_format(self) -> str:
        return GGUF_PREFIX + self.name


def _formats(*specs: tuple[str, int, int, int]) -> dict[str, BlockFormat]:
    return {name: BlockFormat(name, ggml_type, elems, size) for name, ggml_type, elems, size in specs}


# (name, ggml type id, elements per block, bytes per block) — facts of the GGUF file format.
FORMATS: dict[str, BlockFormat] = _formats(
    ("q4_0", 2, 32, 18),
    ("q4_1", 3, 32, 20),
    ("q5_0", 6, 32, 22),
    ("q5_1", 7, 32, 24),
    ("q8_0", 8, 32, 34),
    ("q2_k", 10, 256, 84),
    ("q3_k", 11, 256, 110),
    ("q4_k", 12, 256, 144),
    ("q5_k", 13, 256, 176),
    ("q6_k", 14, 256, 210),
    ("iq2_xxs", 16, 256, 66),
    ("iq2_xs", 17, 256, 74),
    ("iq3_xxs", 18, 256, 98),
    ("iq4_nl", 20, 32, 18),
    ("iq3_s", 21, 256, 110),
    ("iq2_s", 22, 256, 82),
    ("iq4_xs", 23, 256, 136),
)

# Plain element formats: artifact name -> (ggml type id, bytes per element).
PLAIN_FORMATS: dict[str, tuple[int, int]] = {"f32": (0, 4), "f16": (1, 2), "i32": (26, 4), "bf16": (30, 2)}

_FORMAT_BY_GGML_TYPE: dict[int, str] = {
    **{ggml_type: name for name, (ggml_type, _) in PLAIN_FORMATS.items()},
    **{fmt.ggml_type: fmt.artifact_format for fmt in FORMATS.values()},
}


def _known_formats() -> str:
    return ", ".join([*PLAIN_FORMATS, *(fmt.artifact_format for fmt in FORMATS.values())])


def artifact_format_for_ggml_type(type_id: int) -> str:
    """The artifact format name for a GGML type id, e.g. 21 -> "gguf_iq3_s", 30 -> "bf16"."""
    name = _FORMAT_BY_GGML_TYPE.get(int(type_id))
    if name is None:
        raise QuantFormatError(
            f"GGML tensor type {int(type_id)} is not supported; "
            f"re-quantize the GGUF to one of: {_known_formats()}"
        )
    return name


def block_format(format: str) -> BlockFormat | None:
    """The `BlockFormat` of a `gguf_<t>` artifact format, None for a plain format; unknown names raise."""
    if format in PLAIN_FORMATS:
        return None
    if format.startswith(GGUF_PREFIX) and format[len(GGUF_PREFIX) :] in FORMATS:
        return FORMATS[format[len(GGUF_PREFIX) :]]
    raise QuantFormatError(f"unknown tensor format {format!r}; use one of: {_known_formats()}")


def _dimension(value: object) -> int:
    """A tensor dimension as a plain int (numpy integers accepted); bools, floats and negatives raise."""
    try:
        dim = operator.index(value) if not isinstance(value, bool) else -1
    except TypeError:
        dim = -1
    if dim < 0:
        raise QuantFormatError(f"tensor dimensions must be non-negative integers, got {value!r}")
    return dim


def row_bytes(format: str, cols: int) -> int:
    """Bytes of one row of `cols` elements; `cols` must be a whole number of blocks for block formats."""
    cols = _dimension(cols)
    fmt = block_format(format)
    if fmt is None:
        return cols * PLAIN_FORMATS[format][1]
    if cols % fmt.block_elems:
        raise QuantFormatError(
            f"{format} stores rows in blocks of {fmt.block_elems} elements but the row has {cols}; "
            f"use a format whose block size divides {cols} (e.g. bf16 or q8_0)"
        )
    return cols // fmt.block_elems * fmt.block_bytes


def tensor_bytes(format: str, shape: Sequence[int]) -> int:
    """Bytes a tensor of `shape` occupies in `format` (rows are the last dimension)."""
    shape = tuple(_dimension(dim) for dim in shape)
    if not shape:
        if block_format(format) is not None:
            raise QuantFormatError(f"{format} needs at least one dimension; store a scalar as f32")
        return PLAIN_FORMATS[format][1]
    return math.prod(shape[:-1]) * row_bytes(format, shape[-1])

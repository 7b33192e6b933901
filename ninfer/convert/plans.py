"""Tensor plans: what one artifact object will hold and how to produce its rows from a source.

`carry` moves bytes as stored (quantized blocks byte for byte), optionally gathering rows;
`transform` decodes rows to fp32, applies a small elementwise change and re-encodes (vectors, norms);
`computed` stores a tensor built in memory (e.g. an input-column permutation).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ninfer import quant
from ninfer.artifact.formats import DENSE_DTYPES, byte_size, is_block_format, num_rows
from ninfer.convert.sources import SourceTensor
from ninfer.errors import ConversionError


@dataclass(frozen=True)
class TensorPlan:
    format: str
    shape: tuple[int, ...]
    produce: Callable[[int, int], object]  # rows [b, e) of the output -> encoded bytes
    key: Hashable | None = None  # equal keys are stored once
    copy_from: tuple[Callable[[], int], int] | None = None  # (fd getter, offset) when bytes are verbatim


def _digest(rows: np.ndarray | None) -> str | None:
    return None if rows is None else hashlib.sha1(np.ascontiguousarray(rows, dtype=np.int64)).hexdigest()


def read_gathered(t: SourceTensor, rows: np.ndarray | None, begin: int, end: int) -> np.ndarray:
    """Raw source rows rows[begin:end] (or begin:end), reading each run of consecutive rows at once."""
    if rows is None:
        return t.read_rows(begin, end)
    idx = rows[begin:end]
    breaks = np.flatnonzero(np.diff(idx) != 1) + 1
    pieces = [t.read_rows(int(run[0]), int(run[-1]) + 1) for run in np.split(idx, breaks)]
    return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)


def _out_shape(t: SourceTensor, rows: np.ndarray | None, shape: Sequence[int] | None) -> tuple[int, ...]:
    base = tuple(t.shape) if rows is None else (len(rows), *t.shape[1:])
    if is_block_format(t.format) and rows is not None and len(t.shape) != 2:
        raise ConversionError(f"{t.name}: row gathers on block-format tensors need a 2-D tensor")
    if shape is None:
        return base
    shape = tuple(int(d) for d in shape)
    if byte_size(t.format, shape) != byte_size(t.format, base) or num_rows(t.format, shape) != len(
        rows if rows is not None else range(t.rows)
    ):
        raise ConversionError(f"{t.name}: cannot view {list(base)} as {list(shape)}")
    return shape


def carry(
    t: SourceTensor, rows: Sequence[int] | None = None, shape: Sequence[int] | None = None
) -> TensorPlan:
    """Store `t` as it is (same format, same bytes), optionally as a row gather `out[r] = t[rows[r]]`."""
    idx = None if rows is None else np.asarray(rows, dtype=np.int64)
    if idx is not None and (idx.min() < 0 or idx.max() >= t.rows):
        raise ConversionError(f"{t.name}: row gather outside its {t.rows} rows")
    out_shape = _out_shape(t, idx, shape)
    key = ("carry", str(t.source.path), t.name, _digest(idx), out_shape)
    copy_from = (t.source.fileno, t.offset) if idx is None else None
    return TensorPlan(t.format, out_shape, lambda b, e: read_gathered(t, idx, b, e), key, copy_from)


def decode_rows(t: SourceTensor, raw: np.ndarray) -> torch.Tensor:
    """fp32 values of raw rows of `t`: [n, *row shape]."""
    n = raw.shape[0]
    row_shape = tuple(t.shape[1:]) if not is_block_format(t.format) else (t.shape[-1],)
    if t.format in DENSE_DTYPES:
        flat = torch.from_numpy(raw.copy()).view(DENSE_DTYPES[t.format])
        return flat.reshape(n, *row_shape).to(torch.float32)
    return quant.dequantize(torch.from_numpy(raw.copy()), t.format, (n, t.shape[-1]))


def encode(values: torch.Tensor, fmt: str) -> np.ndarray:
    if fmt not in DENSE_DTYPES:
        raise ConversionError(f"cannot encode computed values as {fmt}; use f32, f16, bf16 or i32")
    return values.to(DENSE_DTYPES[fmt]).contiguous().view(torch.uint8).numpy()


def transform(
    t: SourceTensor,
    fn: Callable[[torch.Tensor], torch.Tensor],
    fmt: str,
    label: str,
    rows: Sequence[int] | None = None,
) -> TensorPlan:
    """Decode rows to fp32, apply `fn` (elementwise; `label` names it for dedupe), store as `fmt`."""
    idx = None if rows is None else np.asarray(rows, dtype=np.int64)
    shape = tuple(t.shape) if idx is None else (len(idx), *t.shape[1:])

    def produce(b: int, e: int) -> np.ndarray:
        return encode(fn(decode_rows(t, read_gathered(t, idx, b, e))), fmt)

    if is_block_format(t.format) and len(shape) != 2:
        raise ConversionError(f"{t.name}: cannot transform a {len(shape)}-D block-format tensor")
    return TensorPlan(
        fmt, shape, produce, ("transform", str(t.source.path), t.name, label, _digest(idx), fmt)
    )


def computed(values: torch.Tensor, fmt: str, key: Hashable | None = None) -> TensorPlan:
    """A tensor built in memory (small: auxiliaries, reshaped vectors)."""
    data = encode(values, fmt)
    row = data.nbytes // max(1, num_rows(fmt, tuple(values.shape)))
    return TensorPlan(fmt, tuple(values.shape), lambda b, e: data[b * row : e * row], key)

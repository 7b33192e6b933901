"""Conversion sources: GGUF and safetensors files parsed from their headers, rows read on demand.

Rows are read with plain positioned reads (no mmap), so converting a large file keeps a small resident set.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
import threading
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ninfer.artifact.formats import byte_size, num_rows
from ninfer.errors import ConversionError, GGUFError, QuantFormatError
from ninfer.quant import artifact_format_for_ggml_type

_SAFETENSORS_DTYPES = {"F32": "f32", "F16": "f16", "BF16": "bf16", "I32": "i32"}


@dataclass(frozen=True)
class SourceTensor:
    """One tensor of a source file: format, PyTorch-order shape, and where its bytes lie."""

    source: Source
    name: str
    format: str
    shape: tuple[int, ...]
    offset: int  # absolute file offset of the first byte

    @property
    def nbytes(self) -> int:
        return byte_size(self.format, self.shape)

    @property
    def rows(self) -> int:
        return num_rows(self.format, self.shape)

    @property
    def row_bytes(self) -> int:
        return self.nbytes // self.rows

    def read_rows(self, begin: int, end: int) -> np.ndarray:
        """Raw bytes of rows [begin, end) as uint8 [end - begin, row_bytes]."""
        rb = self.row_bytes
        data = self.source.read_at(self.offset + begin * rb, (end - begin) * rb)
        return np.frombuffer(data, dtype=np.uint8).reshape(end - begin, rb)

    def read_all(self) -> np.ndarray:
        return self.read_rows(0, self.rows)


@dataclass
class Source:
    """A file opened for conversion: tensors by name, header metadata, positioned reads."""

    kind: str
    path: Path
    tensors: dict[str, SourceTensor] = field(default_factory=dict)
    metadata: dict = field(default_factory=dict)
    header_bytes: int = 0
    header_sha256: str = ""
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _file: object = field(default=None, repr=False)

    @property
    def size(self) -> int:
        return self.path.stat().st_size

    def fileno(self) -> int:
        with self._lock:
            if self._file is None:
                self._file = open(self.path, "rb")  # noqa: SIM115 - kept open for the conversion
            return self._file.fileno()

    def read_at(self, offset: int, n: int) -> bytes:
        with self._lock:
            if self._file is None:
                self._file = open(self.path, "rb")  # noqa: SIM115 - kept open for the conversion
            self._file.seek(offset)
            data = self._file.read(n)
        if len(data) != n:
            raise ConversionError(f"{self.path}: truncated: wanted {n} bytes at {offset}; get the file again")
        return data

    def tensor(self, name: str) -> SourceTensor:
        if name not in self.tensors:
            raise ConversionError(
                f"{self.path}: tensor {name!r} is missing; is this the right {self.kind} file?"
            )
        return self.tensors[name]

    def get(self, name: str) -> SourceTensor | None:
        return self.tensors.get(name)

    def describe(self) -> dict:
        return {
            "kind": self.kind,
            "path": str(self.path),
            "bytes": self.size,
            "header_bytes": self.header_bytes,
            "header_sha256": self.header_sha256,
        }

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


# ---- GGUF ---------------------------------------------------------------------------------------

_SCALARS = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
          7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}  # fmt: skip


class _Cursor:
    def __init__(self, f, path: Path):
        self.f, self.path, self.pos = f, path, 0

    def take(self, n: int) -> bytes:
        data = self.f.read(n)
        if len(data) != n:
            raise GGUFError(
                f"{self.path}: truncated GGUF header (ends at byte {self.pos + len(data)}); "
                "download the file again"
            )
        self.pos += n
        return data

    def unpack(self, fmt: str):
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        n = self.unpack("<Q")
        if n > 1 << 30:
            raise GGUFError(f"{self.path}: corrupt GGUF header (string of {n} bytes)")
        return self.take(n).decode("utf-8", errors="replace")

    def value(self, vtype: int):
        if vtype == 8:
            return self.string()
        if vtype == 9:
            etype, count = self.unpack("<I"), self.unpack("<Q")
            if etype in _NUMPY:
                arr = np.frombuffer(self.take(count * np.dtype(_NUMPY[etype]).itemsize), dtype=_NUMPY[etype])
                return arr.tolist()
            if count > 1 << 26:
                raise GGUFError(f"{self.path}: corrupt GGUF header (array of {count} items)")
            return [self.value(etype) for _ in range(count)]
        if vtype not in _SCALARS:
            raise GGUFError(f"{self.path}: corrupt GGUF header (value type {vtype})")
        return self.unpack(_SCALARS[vtype])


def open_gguf(path: Path) -> Source:
    """Parse a GGUF v2/v3 header; check every tensor's type and that the data section is complete."""
    path = Path(path)
    if not path.is_file():
        raise GGUFError(f"{path}: no such GGUF file; check the --source path")
    with open(path, "rb") as f:
        cur = _Cursor(f, path)
        if cur.take(4) != b"GGUF":
            raise GGUFError(f"{path}: not a GGUF file (bad magic); pass the model's .gguf file")
        version = cur.unpack("<I")
        if version not in (2, 3):
            raise GGUFError(f"{path}: GGUF version {version} is not supported (2 or 3 are)")
        n_tensors, n_kv = cur.unpack("<Q"), cur.unpack("<Q")
        if n_tensors > 1 << 24 or n_kv > 1 << 24:
            raise GGUFError(f"{path}: corrupt GGUF header ({n_tensors} tensors, {n_kv} keys)")
        metadata = {}
        for _ in range(n_kv):
            key = cur.string()
            metadata[key] = cur.value(cur.unpack("<I"))
        infos = []
        for _ in range(n_tensors):
            name = cur.string()
            ndim = cur.unpack("<I")
            if ndim > 8:
                raise GGUFError(f"{path}: corrupt GGUF header (tensor {name} has {ndim} dims)")
            ne = [cur.unpack("<Q") for _ in range(ndim)]
            infos.append((name, ne, cur.unpack("<I"), cur.unpack("<Q")))
        alignment = int(metadata.get("general.alignment", 32))
        data_start = (cur.pos + alignment - 1) // alignment * alignment
        f.seek(0)
        header_sha = hashlib.sha256(f.read(cur.pos)).hexdigest()
    src = Source("gguf", path, metadata=metadata, header_bytes=cur.pos, header_sha256=header_sha)
    size = path.stat().st_size
    for name, ne, ggml_type, rel in infos:
        try:
            fmt = artifact_format_for_ggml_type(ggml_type)
        except QuantFormatError as exc:
            raise GGUFError(f"{path}: tensor {name}: {exc}") from None
        t = SourceTensor(src, name, fmt, tuple(int(d) for d in reversed(ne)), data_start + rel)
        if t.offset + t.nbytes > size:
            raise GGUFError(
                f"{path}: truncated: tensor {name} ends at byte {t.offset + t.nbytes}, the file "
                f"has {size}; download the file again"
            )
        src.tensors[name] = t
    return src


# ---- safetensors --------------------------------------------------------------------------------


def open_safetensors(path: Path) -> Source:
    """One safetensors file, or a folder of them (all *.safetensors files, shards included)."""
    path = Path(path)
    if path.is_dir():
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise ConversionError(
                f"{path}: no *.safetensors files in this folder; pass the checkpoint folder"
            )
        merged = Source("safetensors", path)
        digest = hashlib.sha256()
        for file in files:
            part = _open_one_safetensors(file)
            merged.tensors.update(part.tensors)
            merged.header_bytes += part.header_bytes
            digest.update(part.header_sha256.encode())
        merged.header_sha256 = digest.hexdigest()
        return merged
    return _open_one_safetensors(path)


def _open_one_safetensors(path: Path) -> Source:
    if not path.is_file():
        raise ConversionError(f"{path}: no such safetensors file; check the --source path")
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ConversionError(f"{path}: truncated safetensors file ({size} bytes); download it again")
        n = struct.unpack("<Q", head)[0]
        if 8 + n > size:
            raise ConversionError(
                f"{path}: truncated safetensors header ({n} bytes promised, file has {size})"
            )
        text = f.read(n)
    try:
        header = json.loads(text)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise ConversionError(f"{path}: corrupt safetensors header; download the file again") from None
    src = Source(
        "safetensors",
        path,
        metadata=header.pop("__metadata__", None) or {},
        header_bytes=8 + n,
        header_sha256=hashlib.sha256(head + text).hexdigest(),
    )
    for name, info in header.items():
        fmt = _SAFETENSORS_DTYPES.get(info.get("dtype"))
        if fmt is None:
            raise ConversionError(
                f"{path}: tensor {name} has dtype {info.get('dtype')}, not one of "
                f"{', '.join(_SAFETENSORS_DTYPES)}"
            )
        b, e = info["data_offsets"]
        shape = tuple(int(d) for d in info["shape"])
        t = SourceTensor(src, name, fmt, shape, 8 + n + b)
        if 8 + n + e > size or e - b != t.nbytes or math.prod(shape) == 0:
            raise ConversionError(
                f"{path}: truncated or corrupt: tensor {name} needs bytes {8 + n + b}.."
                f"{8 + n + e} of {size}; download the file again"
            )
        src.tensors[name] = t
    return src

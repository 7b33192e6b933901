"""Writes a .ninfer v3 file: plan every object, lay them out, write header + directory, stream payloads.

Peak memory stays at one chunk of rows: each tensor's bytes come from a producer called per row range.
The file is written to a temporary name beside the output, fsynced, then renamed over it.
"""

from __future__ import annotations

import json
import os
import struct
import uuid
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from ninfer import __version__
from ninfer.artifact.formats import (
    FORMATS,
    HEADER_BYTES,
    MAGIC,
    OBJECT_ALIGN,
    PAYLOAD_ALIGN,
    RESOURCE_ENCODING,
    align_up,
    byte_size,
    layout_of,
    num_rows,
    row_bytes,
)
from ninfer.errors import ArtifactError

# produce(row_begin, row_end) -> the encoded bytes of those rows (bytes, bytearray, memoryview or ndarray)
Producer = Callable[[int, int], object]
# (function returning an open file descriptor, byte offset): the object's bytes lie there unchanged
FileRange = tuple[Callable[[], int], int]


@dataclass
class _Tensor:
    id: str
    format: str
    shape: tuple[int, ...]
    produce: Producer
    bytes: int
    copy_from: FileRange | None = None
    offset: int = -1


@dataclass
class _Resource:
    id: str
    data: bytes
    offset: int = -1


@dataclass(frozen=True)
class WriteSummary:
    path: Path
    objects: int
    bindings: int
    file_bytes: int
    payload_bytes: int
    artifact_id: str


@dataclass
class ArtifactWriter:
    """Collects objects, bindings, uses and components, then writes the file in one streaming pass."""

    path: Path
    force: bool = False
    rows_per_chunk: int = 512
    metadata: dict = field(default_factory=dict)
    provenance: dict = field(default_factory=dict)
    _objects: list = field(default_factory=list)
    _by_key: dict = field(default_factory=dict)
    bindings: dict = field(default_factory=dict)
    uses: list = field(default_factory=list)
    components: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.path = Path(self.path)
        self._kernel_copy = hasattr(os, "copy_file_range")
        if self.rows_per_chunk < 1:
            raise ArtifactError(f"rows per chunk must be >= 1, got {self.rows_per_chunk}")

    def check_target(self) -> None:
        if self.path.exists() and not self.force:
            raise ArtifactError(f"{self.path} already exists; pass --force to overwrite it")
        if not self.path.parent.is_dir():
            raise ArtifactError(f"output folder {self.path.parent} does not exist; create it first")

    # ---- planning -------------------------------------------------------------------------------
    def add_tensor(
        self,
        fmt: str,
        shape: Sequence[int],
        produce: Producer,
        key: Hashable | None = None,
        copy_from: FileRange | None = None,
    ) -> str:
        """Plan one tensor object; a repeated `key` returns the object already planned (stored once).

        `copy_from` says the bytes are a verbatim file range, which is copied in the kernel where the OS
        can (`os.copy_file_range`); `produce` is the portable path and must give the same bytes.
        """
        if key is not None and key in self._by_key:
            return self._by_key[key]
        if fmt not in FORMATS:
            raise ArtifactError(f"unknown tensor format {fmt!r}; known: {', '.join(FORMATS)}")
        shape = tuple(int(d) for d in shape)
        if any(d <= 0 for d in shape):
            raise ArtifactError(f"tensor shape {list(shape)} has an empty dimension")
        obj = _Tensor(f"t{len(self._objects):05d}", fmt, shape, produce, byte_size(fmt, shape), copy_from)
        self._objects.append(obj)
        if key is not None:
            self._by_key[key] = obj.id
        return obj.id

    def add_resource(self, data: bytes) -> str:
        key = ("resource", bytes(data))
        if key in self._by_key:
            return self._by_key[key]
        obj = _Resource(f"r{len(self._objects):05d}", bytes(data))
        self._objects.append(obj)
        self._by_key[key] = obj.id
        return obj.id

    def bind(self, name: str, object_id: str) -> None:
        self._check_new_binding(name)
        self.bindings[name] = {"object": object_id}

    def bind_parts(self, name: str, parts: Sequence[tuple[str, int, int]]) -> None:
        """Bind a name to flat C-order element ranges [b, e) of fused parent objects."""
        self._check_new_binding(name)
        self.bindings[name] = {"parts": [{"object": o, "range": [int(b), int(e)]} for o, b, e in parts]}

    def add_use(self, parameter: str, auxiliaries: dict[str, str]) -> None:
        self.uses.append({"parameter": parameter, "auxiliaries": dict(auxiliaries)})

    def set_component(self, name: str, config: dict, resources: dict[str, str]) -> None:
        self.components[name] = {"config": config, "resources": dict(resources)}

    def _check_new_binding(self, name: str) -> None:
        if name in self.bindings:
            raise ArtifactError(f"parameter {name!r} is bound twice")

    @property
    def object_count(self) -> int:
        return len(self._objects)

    def payload_bytes_total(self) -> int:
        """Bytes of every planned object (tensors and resources), without alignment padding."""
        return sum(o.bytes if isinstance(o, _Tensor) else len(o.data) for o in self._objects)

    # ---- layout and writing ---------------------------------------------------------------------
    def _layout(self) -> int:
        cursor = 0
        for obj in self._objects:
            if isinstance(obj, _Tensor):
                cursor = align_up(cursor, OBJECT_ALIGN)
                obj.offset = cursor
                cursor += obj.bytes
        for obj in self._objects:  # resources (unaligned) after the tensors
            if isinstance(obj, _Resource):
                obj.offset = cursor
                cursor += len(obj.data)
        return cursor

    def directory(self, payload_bytes: int) -> dict:
        objects = []
        for obj in self._objects:
            if isinstance(obj, _Tensor):
                objects.append(
                    {
                        "id": obj.id,
                        "kind": "tensor",
                        "shape": list(obj.shape),
                        "format": obj.format,
                        "layout": layout_of(obj.format),
                        "offset": obj.offset,
                        "bytes": obj.bytes,
                    }
                )
            else:
                objects.append(
                    {
                        "id": obj.id,
                        "kind": "resource",
                        "encoding": RESOURCE_ENCODING,
                        "offset": obj.offset,
                        "bytes": len(obj.data),
                    }
                )
        metadata = {"created_by": f"ninfer {__version__}", **self.metadata}
        return {
            "format_version": 3,
            "components": self.components,
            "objects": objects,
            "bindings": self.bindings,
            "uses": self.uses,
            "metadata": metadata,
            "provenance": self.provenance,
            "files": [{"path": None, "payload_bytes": payload_bytes}],
        }

    def write(self, progress: Callable[[int], None] | None = None) -> WriteSummary:
        """Write the whole file; `progress(n_bytes)` is called as payload bytes are written."""
        self.check_target()
        payload_bytes = self._layout()
        text = json.dumps(self.directory(payload_bytes), separators=(",", ":")).encode("utf-8")
        artifact_id = uuid.uuid4().bytes
        payload_start = align_up(HEADER_BYTES + len(text), PAYLOAD_ALIGN)
        tmp = self.path.with_name(f".{self.path.name}.tmp-{os.getpid()}")
        try:
            with open(tmp, "wb") as f:
                f.write(struct.pack("<8sQ16s", MAGIC, len(text), artifact_id))
                f.write(text)
                f.write(b"\0" * (payload_start - HEADER_BYTES - len(text)))
                self._write_payload(f, payload_start, progress)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        _fsync_dir(self.path.parent)
        return WriteSummary(
            self.path,
            len(self._objects),
            len(self.bindings),
            payload_start + payload_bytes,
            payload_bytes,
            artifact_id.hex(),
        )

    def _write_payload(self, f, payload_start: int, progress) -> None:
        written = 0
        for obj in sorted(self._objects, key=lambda o: o.offset):
            if obj.offset > written:
                f.write(b"\0" * (obj.offset - written))
                written = obj.offset
            if isinstance(obj, _Resource):
                f.write(obj.data)
                n = len(obj.data)
            else:
                n = self._write_tensor(f, obj)
            written += n
            if progress is not None:
                progress(n)

    def _write_tensor(self, f, obj: _Tensor) -> int:
        if obj.copy_from is not None and self._kernel_copy and self._copy_range(f, obj):
            return obj.bytes
        rows = num_rows(obj.format, obj.shape)
        per_row = row_bytes(obj.format, obj.shape)
        written = 0
        for b in range(0, rows, self.rows_per_chunk):
            e = min(rows, b + self.rows_per_chunk)
            chunk = _as_bytes(obj.produce(b, e))
            if len(chunk) != (e - b) * per_row:
                raise ArtifactError(
                    f"object {obj.id}: producer gave {len(chunk)} bytes for rows {b}..{e}, "
                    f"expected {(e - b) * per_row}"
                )
            f.write(chunk)
            written += len(chunk)
        return written

    def _copy_range(self, f, obj: _Tensor) -> bool:
        """Kernel-side copy of a verbatim file range; False (nothing written) where the OS refuses."""
        get_fd, src_offset = obj.copy_from
        f.flush()
        dst, step = f.tell(), max(1, row_bytes(obj.format, obj.shape) * self.rows_per_chunk)
        done = 0
        try:
            while done < obj.bytes:
                n = os.copy_file_range(get_fd(), f.fileno(), min(step, obj.bytes - done),
                                       src_offset + done, dst + done)  # fmt: skip
                if n <= 0:
                    raise OSError("copy_file_range made no progress")
                done += n
        except OSError:
            if done:
                raise
            self._kernel_copy = False  # e.g. across file systems on old kernels: use the read path
            return False
        f.seek(dst + done)
        return True


def _as_bytes(data) -> memoryview:
    if isinstance(data, torch.Tensor):
        data = data.detach().contiguous().cpu().view(torch.uint8).numpy()
    if isinstance(data, np.ndarray):
        data = np.ascontiguousarray(data)
    return memoryview(data).cast("B")


def _fsync_dir(folder: Path) -> None:
    """Make the rename durable where the OS allows opening a directory (not on Windows)."""
    if os.name != "posix":
        return
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

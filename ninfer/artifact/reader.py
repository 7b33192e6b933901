"""Opens a .ninfer v3 file: validates the whole directory, memory-maps the payload, hands out tensor views."""

from __future__ import annotations

import json
import mmap
import struct
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from ninfer import quant
from ninfer.artifact.formats import (
    DENSE_DTYPES,
    FORMATS,
    HEADER_BYTES,
    MAGIC,
    OBJECT_ALIGN,
    PAYLOAD_ALIGN,
    RESOURCE_ENCODING,
    align_up,
    is_block_format,
    layout_of,
    num_rows,
    numel,
)
from ninfer.artifact.schema import (
    required_mtp_bindings,
    required_text_bindings,
    required_vision_bindings,
)
from ninfer.errors import ArtifactError, QuantFormatError


@dataclass(frozen=True)
class StoredTensor:
    """A bound parameter as stored: `data` is a zero-copy, read-only view of the mapped file (uint8
    [rows, row_bytes] for GGUF blocks). Never write into it (copy first): the pages are the file's."""

    format: str
    shape: tuple[int, ...]
    data: torch.Tensor

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        if is_block_format(self.format):
            return quant.dequantize(self.data, self.format, self.shape).to(dtype)
        return self.data.to(dtype)


@dataclass(frozen=True)
class Component:
    config: dict
    resources: dict[str, str]


class Artifact:
    """A validated, memory-mapped .ninfer file. Build it with `open_artifact(path)`."""

    def __init__(
        self, path: Path, directory: dict, artifact_id: bytes, payload_start: int, buffer: mmap.mmap
    ):
        self.path = path
        self.directory = directory
        self.artifact_id = artifact_id.hex()
        self._payload_start = payload_start
        self._buffer = buffer
        self._objects = {o["id"]: o for o in directory["objects"]}
        self.bindings: dict[str, dict] = directory["bindings"]
        self.metadata: dict = directory.get("metadata", {})
        self.provenance: dict = directory.get("provenance", {})
        self.components = {
            name: Component(c.get("config", {}), c.get("resources", {}))
            for name, c in directory["components"].items()
        }
        self._uses = {u["parameter"]: u.get("auxiliaries", {}) for u in directory.get("uses", [])}

    # ---- lookups --------------------------------------------------------------------------------
    def names(self) -> list[str]:
        return list(self.bindings)

    def has(self, name: str) -> bool:
        return name in self.bindings

    def object_info(self, object_id: str) -> dict:
        return self._objects[object_id]

    def object_tensor(self, object_id: str) -> StoredTensor:
        """The whole stored object (e.g. a fused parent), as a zero-copy view."""
        info = self._objects[object_id]
        fmt, shape = info["format"], tuple(info["shape"])
        start = self._payload_start + info["offset"]
        with warnings.catch_warnings():  # the views are read-only by design; torch warns about that
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            raw = torch.frombuffer(self._buffer, dtype=torch.uint8, count=info["bytes"], offset=start)
        if is_block_format(fmt):
            rows = num_rows(fmt, shape)
            return StoredTensor(fmt, shape, raw.view(rows, info["bytes"] // rows))
        return StoredTensor(fmt, shape, raw.view(DENSE_DTYPES[fmt]).view(shape))

    def tensor(self, name: str) -> StoredTensor:
        if name not in self.bindings:
            raise ArtifactError(f"{self.path}: no parameter {name!r} in this artifact")
        binding = self.bindings[name]
        if "object" in binding:
            return self.object_tensor(binding["object"])
        pieces = [self._part(p["object"], *p["range"]) for p in binding["parts"]]
        if len(pieces) == 1:
            return pieces[0]
        fmt = pieces[0].format
        rows = sum(p.shape[0] for p in pieces)
        return StoredTensor(fmt, (rows, *pieces[0].shape[1:]), torch.cat([p.data for p in pieces]))

    def _part(self, object_id: str, begin: int, end: int) -> StoredTensor:
        whole = self.object_tensor(object_id)
        shape = whole.shape
        if len(shape) == 1:
            return StoredTensor(whole.format, (end - begin,), whole.data[begin:end])
        row_elems = numel(shape[1:])
        b, e = begin // row_elems, end // row_elems
        return StoredTensor(whole.format, (e - b, *shape[1:]), whole.data[b:e])

    def input_columns(self, name: str) -> torch.Tensor | None:
        """The recorded input-column permutation of parameter `name` (int64), or None."""
        aux = self._uses.get(name, {})
        if "input_columns" not in aux:
            return None
        return self.object_tensor(aux["input_columns"]).data.to(torch.long)

    def resource(self, component: str, role: str) -> bytes:
        comp = self.components.get(component)
        if comp is None or role not in comp.resources:
            raise ArtifactError(f"{self.path}: component {component!r} has no resource {role!r}")
        info = self._objects[comp.resources[role]]
        start = self._payload_start + info["offset"]
        return bytes(self._buffer[start : start + info["bytes"]])

    def close(self) -> None:
        self._buffer.close()

    def __repr__(self) -> str:
        return (
            f"Artifact({str(self.path)!r}, {len(self._objects)} objects, components={list(self.components)})"
        )


def open_artifact(path: str | Path) -> Artifact:
    """Open and validate a .ninfer file; any inconsistency raises ArtifactError naming it."""
    path = Path(path)
    if not path.is_file():
        raise ArtifactError(
            f"{path}: no such artifact file; check the path (convert one with ninfer-convert)"
        )
    size = path.stat().st_size
    with open(path, "rb") as f:
        header = f.read(HEADER_BYTES)
        if len(header) < HEADER_BYTES:
            raise ArtifactError(f"{path}: truncated: {size} bytes is shorter than the 32-byte header")
        magic, json_bytes, artifact_id = struct.unpack("<8sQ16s", header)
        if magic != MAGIC:
            raise ArtifactError(
                f"{path}: not a .ninfer v3 file (magic {magic!r}); convert it with ninfer-convert"
            )
        if HEADER_BYTES + json_bytes > size:
            raise ArtifactError(
                f"{path}: truncated: the directory needs {HEADER_BYTES + json_bytes} bytes, "
                f"the file has {size}; convert it again"
            )
        try:
            directory = json.loads(f.read(json_bytes).decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ArtifactError(f"{path}: corrupt directory JSON ({exc}); convert it again") from None
        payload_start = align_up(HEADER_BYTES + json_bytes, PAYLOAD_ALIGN)
        _validate(path, directory, payload_start, size)
        # read-only shared mapping: no commit charge for a 20 GB file (a private copy-on-write map has one)
        buffer = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    art = Artifact(path, directory, artifact_id, payload_start, buffer)
    _check_permutations(art)
    return art


def _check_permutations(art: Artifact) -> None:
    """Every recorded input_columns must be a permutation (a corrupt one would silently scramble outputs)."""
    for use in art.directory.get("uses", []):
        cols = art.input_columns(use["parameter"])
        if cols is not None and not torch.equal(torch.sort(cols).values, torch.arange(cols.numel())):
            art.close()
            raise ArtifactError(
                f"{art.path}: input_columns of {use['parameter']} is not a permutation; "
                "the file is corrupt, convert it again"
            )


def _validate(path: Path, d: dict, payload_start: int, size: int) -> None:
    def fail(msg: str) -> None:
        raise ArtifactError(f"{path}: {msg}")

    if not isinstance(d, dict):
        fail("corrupt directory: not a JSON object")
    for key in ("objects", "bindings", "components", "files"):
        if key not in d:
            fail(f"corrupt directory: missing key {key!r}")
    files = d["files"]
    if not (isinstance(files, list) and len(files) == 1 and files[0].get("path") is None):
        fail("split artifacts (several files) are not supported yet")
    payload_bytes = files[0].get("payload_bytes")
    if not isinstance(payload_bytes, int) or payload_start + payload_bytes != size:
        fail(
            f"truncated or padded: the directory promises {payload_start + (payload_bytes or 0)} bytes, "
            f"the file has {size}; convert it again"
        )
    objects = _validate_objects(fail, d["objects"], payload_bytes)
    _validate_bindings(fail, d["bindings"], objects)
    _validate_uses(fail, d.get("uses", []), d["bindings"], objects)
    _validate_components(fail, d["components"], d["bindings"], objects)


def _validate_objects(fail, objects: list, payload_bytes: int) -> dict:
    seen: dict[str, dict] = {}
    for o in objects:
        oid = o.get("id")
        if not isinstance(oid, str) or oid in seen:
            fail(f"corrupt directory: missing or repeated object id {oid!r}")
        seen[oid] = o
        offset, nbytes = o.get("offset"), o.get("bytes")
        if not (isinstance(offset, int) and isinstance(nbytes, int) and offset >= 0 and nbytes >= 0):
            fail(f"object {oid}: bad offset/bytes {offset!r}/{nbytes!r}")
        if offset + nbytes > payload_bytes:
            fail(f"object {oid}: bytes {offset}..{offset + nbytes} exceed the payload ({payload_bytes})")
        if o.get("kind") == "resource":
            if o.get("encoding") != RESOURCE_ENCODING:
                fail(f"object {oid}: unknown resource encoding {o.get('encoding')!r}")
            continue
        if o.get("kind") != "tensor":
            fail(f"object {oid}: unknown kind {o.get('kind')!r}")
        fmt, shape = o.get("format"), o.get("shape")
        if fmt not in FORMATS:
            fail(f"object {oid}: unknown format {fmt!r}")
        if not (isinstance(shape, list) and shape and all(isinstance(x, int) and x > 0 for x in shape)):
            fail(f"object {oid}: bad shape {shape!r}")
        if o.get("layout") != layout_of(fmt):
            fail(f"object {oid}: layout {o.get('layout')!r} does not fit format {fmt} ({layout_of(fmt)})")
        if offset % OBJECT_ALIGN:
            fail(f"object {oid}: offset {offset} is not {OBJECT_ALIGN}-byte aligned")
        try:
            expected = quant.tensor_bytes(fmt, shape)
        except QuantFormatError as exc:
            fail(f"object {oid}: {exc}")
        if nbytes != expected:
            fail(f"object {oid}: {nbytes} bytes, but {fmt} {shape} takes {expected}")
    return seen


def _validate_bindings(fail, bindings: dict, objects: dict) -> None:
    for name, b in bindings.items():
        parts = [{"object": b["object"], "range": None}] if "object" in b else b.get("parts")
        if not parts:
            fail(f"binding {name!r}: neither an object nor parts")
        for p in parts:
            o = objects.get(p.get("object"))
            if o is None or o.get("kind") != "tensor":
                fail(f"binding {name!r}: object {p.get('object')!r} does not exist or is not a tensor")
            if p["range"] is None:
                continue
            first = objects.get(parts[0].get("object"), o)
            if (first["format"], first["shape"][1:]) != (o["format"], o["shape"][1:]):
                fail(f"binding {name!r}: its parts differ in format or row shape")
            _check_range(fail, name, p["range"], o)


def _check_range(fail, name: str, rng, o: dict) -> None:
    total = numel(o["shape"])
    if not (isinstance(rng, list) and len(rng) == 2 and 0 <= rng[0] < rng[1] <= total):
        fail(f"binding {name!r}: range {rng!r} is outside object {o['id']} ({total} elements)")
    if len(o["shape"]) > 1:
        row_elems = numel(o["shape"][1:])
        if rng[0] % row_elems or rng[1] % row_elems:
            fail(f"binding {name!r}: range {rng!r} does not cover whole rows of object {o['id']}")
    elif is_block_format(o["format"]):
        fail(f"binding {name!r}: a range inside a 1-D block-format object cannot be viewed")


def _validate_uses(fail, uses: list, bindings: dict, objects: dict) -> None:
    for u in uses:
        param = u.get("parameter")
        if param not in bindings:
            fail(f"use of {param!r}: no such binding")
        for aux_name, oid in u.get("auxiliaries", {}).items():
            o = objects.get(oid)
            if o is None or o.get("kind") != "tensor":
                fail(f"use of {param!r}: auxiliary {aux_name} object {oid!r} does not exist")
            if aux_name == "input_columns":
                b = bindings[param]
                parent = objects[b["object"] if "object" in b else b["parts"][0]["object"]]
                if o["format"] != "i32" or o["shape"] != [parent["shape"][-1]]:
                    fail(
                        f"use of {param!r}: input_columns must be i32 [{parent['shape'][-1]}], "
                        f"got {o['format']} {o['shape']}"
                    )


def _validate_components(fail, components: dict, bindings: dict, objects: dict) -> None:
    if "text" not in components:
        fail("no text component; every artifact needs one (convert with --components text)")
    for name, comp in components.items():
        for role, oid in comp.get("resources", {}).items():
            if objects.get(oid, {}).get("kind") != "resource":
                fail(f"component {name}: resource {role!r} object {oid!r} does not exist")
        config = comp.get("config", {})
        try:
            if name == "text":
                required = required_text_bindings(config)
            elif name == "mtp":
                required = required_mtp_bindings(config)
            elif name == "vision":
                required = required_vision_bindings(config)
            else:
                required = []
        except KeyError:
            fail(f"text component architecture {config.get('architecture')!r} is unknown to this ninfer")
        except (TypeError, ValueError) as exc:
            fail(f"component {name}: bad config ({exc})")
        missing = [n for n in required if n not in bindings]
        if missing:
            more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
            fail(
                f"component {name} lacks required parameters {', '.join(missing[:3])}{more}; convert it again"
            )

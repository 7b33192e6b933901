"""What a recipe sees: the request, opened sources, metadata lookups, and the artifact being planned."""

from __future__ import annotations

import hashlib
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ninfer.artifact import ArtifactWriter
from ninfer.artifact.schema import RESOURCE_ROLES
from ninfer.convert.plans import TensorPlan, computed
from ninfer.convert.sources import Source
from ninfer.errors import ConversionError


@dataclass(frozen=True)
class ConvertRequest:
    """Everything `ninfer-convert` was asked to do (one field per flag)."""

    recipe: str
    out: Path
    sources: dict[str, Path] = field(default_factory=dict)
    components: tuple[str, ...] = ("text",)
    model_dir: Path | None = None
    resources: dict[str, Path] = field(default_factory=dict)
    device: str = "cpu"
    rows_per_chunk: int = 512
    name: str | None = None
    force: bool = False
    argv: tuple[str, ...] = ()


class ConversionJob:
    """The recipe-facing API. A recipe reads sources and metadata, then adds objects, bindings, components."""

    def __init__(self, request: ConvertRequest, sources: dict[str, Source], writer: ArtifactWriter):
        self.request = request
        self.sources = sources
        self.writer = writer
        self.warnings: list[str] = []
        self.parameters: dict[str, TensorPlan] = {}  # logical name -> plan (for the report)

    # ---- inputs ---------------------------------------------------------------------------------
    def wants(self, component: str) -> bool:
        return component in self.request.components

    def has_source(self, name: str) -> bool:
        return name in self.sources

    def source(self, name: str) -> Source:
        if name not in self.sources:
            raise ConversionError(f"recipe {self.request.recipe} needs --source {name}=PATH")
        return self.sources[name]

    @property
    def model_dir(self) -> Path | None:
        return self.request.model_dir

    def model_json(self, filename: str) -> dict | None:
        """A JSON file of the --model folder (e.g. config.json), or None when absent."""
        if self.model_dir is None or not (self.model_dir / filename).is_file():
            return None
        try:
            return json.loads((self.model_dir / filename).read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ConversionError(
                f"{self.model_dir / filename}: not valid JSON ({exc}); fix or replace it"
            ) from None

    def resource_bytes(self, role: str, fallback: bytes | None = None) -> bytes:
        """`--resource ROLE=PATH`, else `--model DIR/ROLE`, else `fallback`, else a ConversionError."""
        if role in self.request.resources:
            return self.request.resources[role].read_bytes()
        if self.model_dir is not None and (self.model_dir / role).is_file():
            return (self.model_dir / role).read_bytes()
        if fallback is not None:
            return fallback
        where = (
            f"in --model {self.model_dir} ({self.model_dir / role})"
            if self.model_dir
            else "in no folder (no --model was given)"
        )
        raise ConversionError(
            f"{role} not found: looked {where} and among --resource; pass --resource {role}=PATH"
        )

    # ---- outputs --------------------------------------------------------------------------------
    def add_object(self, plan: TensorPlan) -> str:
        return self.writer.add_tensor(
            plan.format, plan.shape, plan.produce, key=plan.key, copy_from=plan.copy_from
        )

    def add(self, name: str, plan: TensorPlan) -> str:
        """Plan `plan` (stored once per key) and bind logical parameter `name` to it."""
        object_id = self.add_object(plan)
        self.writer.bind(name, object_id)
        self.parameters[name] = plan
        return object_id

    def bind(self, name: str, object_id: str) -> None:
        self.writer.bind(name, object_id)

    def add_fused(self, plan: TensorPlan, parts: Sequence[tuple[str, int]]) -> str:
        """Store one fused parent and bind consecutive row blocks of it: parts = [(name, n_rows), ...]."""
        object_id = self.add_object(plan)
        row_elems = 1
        for d in plan.shape[1:]:
            row_elems *= d
        start = 0
        for name, n_rows in parts:
            self.writer.bind_parts(name, [(object_id, start * row_elems, (start + n_rows) * row_elems)])
            start += n_rows
        if start != plan.shape[0]:
            raise ConversionError(f"fused parts cover {start} of {plan.shape[0]} rows")
        return object_id

    def use_input_columns(self, parameter: str, columns: torch.Tensor) -> None:
        """Record that stored column c of `parameter` multiplies model input column columns[c]."""
        cols = columns.to(torch.int32).contiguous()
        key = ("input_columns", hashlib.sha1(cols.numpy().tobytes()).hexdigest())
        plan = computed(cols, "i32", key=key)
        self.writer.add_use(parameter, {"input_columns": self.add_object(plan)})

    def set_component(self, name: str, config: dict, roles: dict[str, bytes]) -> None:
        known = RESOURCE_ROLES[name]
        resources = {}
        for role, data in roles.items():
            if role not in known:
                raise ConversionError(f"component {name} has no resource role {role!r}")
            resources[role] = self.writer.add_resource(data)
        self.writer.set_component(name, config, resources)

    def set_metadata(self, **values) -> None:
        self.writer.metadata.update(values)

    def warn(self, message: str) -> None:
        self.warnings.append(message)
        print(f"warning: {message}", file=sys.stderr)

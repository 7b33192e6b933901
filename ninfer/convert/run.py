"""One conversion: check the request, open sources, run the recipe, write the artifact and its report."""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from ninfer import __version__
from ninfer.artifact import ArtifactWriter, WriteSummary
from ninfer.artifact.schema import COMPONENTS, RESOURCE_ROLES
from ninfer.convert.job import ConversionJob, ConvertRequest
from ninfer.convert.registry import get_recipe
from ninfer.convert.sources import Source, open_gguf, open_safetensors
from ninfer.errors import ConversionError

SOURCE_NAMES = ("gguf", "mtp", "vision", "safetensors")


@dataclass(frozen=True)
class ConversionResult:
    summary: WriteSummary
    seconds: float
    warnings: tuple[str, ...]
    report_path: Path


def check_request(request: ConvertRequest) -> None:
    """Every mistake that can be found before reading any source."""
    recipe = get_recipe(request.recipe)
    for name in request.components:
        if name not in COMPONENTS:
            raise ConversionError(
                f"unknown component {name!r} in --components; choose from {', '.join(COMPONENTS)}"
            )
    if "text" not in request.components:
        raise ConversionError("--components must include text (e.g. --components text,mtp)")
    for name, path in request.sources.items():
        if name not in SOURCE_NAMES:
            raise ConversionError(f"unknown source name {name!r}; use one of {', '.join(SOURCE_NAMES)}")
        if name not in recipe.sources:
            raise ConversionError(
                f"recipe {recipe.name} does not read --source {name}=; it reads {', '.join(recipe.sources)}"
            )
        if not path.exists():
            raise ConversionError(f"--source {name}={path}: no such file or folder; check the path")
    known_roles = sorted({r for roles in RESOURCE_ROLES.values() for r in roles})
    for role, path in request.resources.items():
        if role not in known_roles:
            raise ConversionError(
                f"unknown resource role {role!r} in --resource; known roles: {', '.join(known_roles)}"
            )
        if not path.is_file():
            raise ConversionError(f"--resource {role}={path}: no such file; check the path")
    if request.model_dir is not None and not request.model_dir.is_dir():
        raise ConversionError(
            f"--model {request.model_dir}: no such folder; pass the folder holding config.json"
        )
    if request.rows_per_chunk < 1:
        raise ConversionError(f"--rows-per-chunk must be at least 1, got {request.rows_per_chunk}")
    if request.device not in ("cpu", "cuda"):
        raise ConversionError(f"--device {request.device!r}: use cpu or cuda")
    if "mtp" in request.components and "mtp" not in request.sources:
        raise ConversionError(
            "mtp is in --components but no --source mtp=PATH was given; pass the -mtp GGUF "
            "(it may be the same file as --source gguf=) or drop mtp from --components"
        )
    out = request.out
    if out.exists() and not request.force:
        raise ConversionError(f"{out} already exists; pass --force to overwrite it or choose another --out")
    if not out.parent.is_dir():
        raise ConversionError(f"the folder of --out {out} does not exist; create it first")


def open_sources(request: ConvertRequest) -> dict[str, Source]:
    """Open each --source once per file (gguf= and mtp= are often the same file)."""
    opened: dict[Path, Source] = {}
    sources = {}
    for name, path in request.sources.items():
        key = path.resolve()
        if key not in opened:
            is_gguf = path.is_file() and _has_gguf_magic(path)
            opened[key] = open_gguf(path) if is_gguf else open_safetensors(path)
        sources[name] = opened[key]
    return sources


def _has_gguf_magic(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF" or path.suffix == ".gguf"


def convert(request: ConvertRequest, progress: bool = True) -> ConversionResult:
    started = time.perf_counter()
    check_request(request)
    recipe = get_recipe(request.recipe)
    sources = open_sources(request)
    writer = ArtifactWriter(request.out, force=request.force, rows_per_chunk=request.rows_per_chunk)
    job = ConversionJob(request, sources, writer)
    if "vision" in request.sources and "vision" not in request.components:
        job.warn(
            "--source vision= was given but vision is not in --components: the vision tower will not be "
            "included; add vision to --components"
        )
    if "mtp" in request.sources and "mtp" not in request.components:
        job.warn(
            "--source mtp= was given but mtp is not in --components: the MTP layer will not be included; "
            "add mtp to --components"
        )
    try:
        recipe.build(job)
        writer.metadata.setdefault("architecture", recipe.architecture)
        if request.name:
            writer.metadata["name"] = request.name
        writer.metadata.setdefault("name", recipe.architecture)
        writer.metadata["recipe"] = recipe.name
        writer.provenance = {
            "recipe": recipe.name,
            "sources": {name: src.describe() for name, src in sources.items()},
            "argv": list(request.argv),
            "components": list(request.components),
            "created_by": f"ninfer {__version__}",
        }
        total = writer.payload_bytes_total()
        with tqdm(
            total=total,
            unit="B",
            unit_scale=True,
            desc="convert",
            file=sys.stderr,
            disable=not progress,
            mininterval=0.5,
        ) as bar:
            summary = writer.write(progress=bar.update)
    finally:
        for src in sources.values():
            src.close()
    seconds = time.perf_counter() - started
    report_path = request.out.with_name(request.out.name + ".conversion.json")
    report_path.write_text(json.dumps(_report(job, summary, seconds), indent=1) + "\n", encoding="utf-8")
    return ConversionResult(summary, seconds, tuple(job.warnings), report_path)


def _report(job: ConversionJob, summary: WriteSummary, seconds: float) -> dict:
    formats: dict[str, int] = {}
    for plan in job.parameters.values():
        formats[plan.format] = formats.get(plan.format, 0) + 1
    return {
        "artifact": str(summary.path),
        "artifact_id": summary.artifact_id,
        "file_bytes": summary.file_bytes,
        "objects": summary.objects,
        "bindings": summary.bindings,
        "seconds": round(seconds, 3),
        "metadata": job.writer.metadata,
        "provenance": job.writer.provenance,
        "components": {k: {"resources": sorted(v["resources"])} for k, v in job.writer.components.items()},
        "parameter_formats": formats,
        "parameters": {n: {"format": p.format, "shape": list(p.shape)} for n, p in job.parameters.items()},
        "warnings": job.warnings,
    }

"""Kernel registry: which schedule runs each hot op, by route key and batch width.

Route keys name an op at a shape, e.g. `gemv/gguf_iq3_s/6144x5120` (out × in features). A route is a list of
`[max_width, schedule]` pairs, ascending: the first pair whose `max_width` ≥ the call's width (tokens)
wins. Built-in defaults cover every key; a device profile written by `ninfer-calibrate` (SPEC §7) overrides
keys it measured. `quant_linear` is the hook the model's quantized Linear calls on CUDA.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ninfer.errors import NinferError
from ninfer.kernels.gguf_matmul import SCHEDULES, default_route, quant_matmul

Route = list[tuple[int, str]]


class DeviceProfileError(NinferError):
    """A device-profile file that cannot be used."""


def gemv_key(format: str, out_features: int, in_features: int) -> str:
    """Route key of a quantized matmul: `gemv/gguf_<t>/<out>x<in>`."""
    fmt = format if format.startswith("gguf_") else "gguf_" + format
    return f"gemv/{fmt}/{out_features}x{in_features}"


def default_gemv_route(format: str, out_features: int, in_features: int = 0) -> Route:
    """Built-in route (measured on the H200, docs/gpu-notes.md): `gguf_matmul.default_route`."""
    return default_route(format, out_features, in_features)


def route_catalog_digest() -> str:
    """Digest of every candidate schedule's definition; a profile measured on another catalog is stale."""
    text = json.dumps({name: repr(s) for name, s in sorted(SCHEDULES.items())}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclass
class KernelRegistry:
    """Routes by key; `routes` holds calibrated entries, anything else gets the built-in default."""

    routes: dict[str, Route] = field(default_factory=dict)

    def schedule(self, format: str, out_features: int, in_features: int, width: int) -> str:
        key = gemv_key(format, out_features, in_features)
        route = self.routes.get(key) or default_gemv_route(format, out_features, in_features)
        for max_width, name in route:
            if width <= max_width:
                return name
        return route[-1][1]

    @classmethod
    def from_profile(cls, path: Path | str, hardware_class: str, multiprocessors: int) -> KernelRegistry:
        """Routes of the profile entry for this GPU (schema `ninfer.device-route-profiles` v2); an entry
        measured against another schedule catalog is ignored (the caller warns), none → built-ins only."""
        path = Path(path)
        try:
            doc = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise DeviceProfileError(f"cannot read device profile {path}: {e}; re-run ninfer-calibrate or "
                                     "pass --device-profile off") from e
        if doc.get("schema") != "ninfer.device-route-profiles" or doc.get("schema_version") != 2:
            raise DeviceProfileError(f"{path} is not a ninfer device-route profile (schema version 2); "
                                     "re-run ninfer-calibrate")
        digest = route_catalog_digest()
        for dev in doc.get("devices", []):
            if dev.get("hardware_class") != hardware_class or dev.get("multiprocessors") != multiprocessors:
                continue
            if dev.get("calibration", {}).get("route_catalog") != digest:
                return cls()
            routes = {key: [(int(w), str(s)) for w, s in pairs]
                      for key, pairs in dev.get("routes", {}).items()}
            unknown = sorted({s for pairs in routes.values() for _, s in pairs} - set(SCHEDULES))
            if unknown:
                raise DeviceProfileError(f"{path} routes to unknown schedules {unknown}; "
                                         "re-run ninfer-calibrate")
            return cls(routes)
        return cls()


def quant_linear(raw: torch.Tensor, format: str, x: torch.Tensor, out_features: int,
                 registry: KernelRegistry | None = None) -> torch.Tensor:
    """The quantized Linear's forward: `x [..., in] -> [..., out]` through the routed schedule."""
    width = x.numel() // x.shape[-1]
    schedule = (registry or KernelRegistry()).schedule(format, out_features, x.shape[-1], width)
    return quant_matmul(raw, format, x, out_features, schedule=schedule)

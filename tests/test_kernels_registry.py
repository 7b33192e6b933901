"""Kernel registry: route lookup by width, profile loading, and the quant_linear hook."""

from __future__ import annotations

import json

import pytest
import torch

from ninfer.errors import NinferError
from ninfer.kernels.gguf_matmul import SCHEDULES, quant_matmul_reference, random_gguf_weight
from ninfer.kernels.registry import (
    KernelRegistry,
    default_gemv_route,
    gemv_key,
    quant_linear,
    route_catalog_digest,
)


def test_default_routes_cover_every_width():
    reg = KernelRegistry()
    assert gemv_key("iq3_s", 6144, 5120) == "gemv/gguf_iq3_s/6144x5120"
    # the H200 run-5 bests (docs/gpu-notes.md)
    assert reg.schedule("iq3_s", 6144, 5120, 1) == "wv_n16_m1_s4"
    assert reg.schedule("iq3_s", 6144, 5120, 3) == "wv_n16_m4"
    assert reg.schedule("iq3_s", 5120, 17408, 4) == "wv_n8_m4"
    assert reg.schedule("iq3_s", 48, 5120, 1) == "wv_n8_m1_s4"
    assert reg.schedule("iq3_s", 17408, 5120, 16) == "sub_n32_s4"
    assert reg.schedule("gguf_q4_k", 17408, 5120, 1) == "wv_n16_m1_s4"
    assert reg.schedule("gguf_q4_k", 12288, 5120, 1) == "wv_n32_m1"
    assert reg.schedule("gguf_q4_k", 17408, 5120, 4) == "sub_n64"
    assert reg.schedule("gguf_q4_k", 6144, 5120, 4) == "wv_n8_m4"
    assert reg.schedule("q6_k", 248320, 5120, 1) == "wv_n32_m1"  # the output head
    assert reg.schedule("q6_k", 5120, 6144, 1) == "sub_n32_s4"  # not measured for wv: the older route
    assert reg.schedule("q4_k", 6144, 5120, 5000) == "dequant_mm"
    for fmt in ("q4_0", "iq3_s", "q4_k", "q6_k"):
        for rows in (48, 6144, 248320):
            assert all(name in SCHEDULES for _, name in default_gemv_route(fmt, rows))


def profile(tmp_path, routes, digest=None, sms=132):
    doc = {"schema": "ninfer.device-route-profiles", "schema_version": 2, "devices": [
        {"hardware_class": "nvidia-h200-sm90", "multiprocessors": sms, "origin": "calibrated",
         "calibration": {"route_catalog": digest or route_catalog_digest()}, "routes": routes}]}
    path = tmp_path / "profiles.json"
    path.write_text(json.dumps(doc))
    return path


def test_profile_overrides_measured_keys_only(tmp_path):
    key = gemv_key("iq3_s", 6144, 5120)
    path = profile(tmp_path, {key: [[1, "sub_n32"], [1 << 30, "dequant_mm"]]})
    reg = KernelRegistry.from_profile(path, "nvidia-h200-sm90", 132)
    assert reg.schedule("iq3_s", 6144, 5120, 1) == "sub_n32"
    assert reg.schedule("iq3_s", 6144, 5120, 2) == "dequant_mm"
    assert reg.schedule("iq3_s", 5120, 6144, 1) == "wv_n16_m1_s4"  # not in the profile: built-in
    assert KernelRegistry.from_profile(path, "nvidia-h200-sm90", 114).routes == {}  # other GPU
    stale = profile(tmp_path, {key: [[1, "sub_n32"]]}, digest="0" * 16)
    assert KernelRegistry.from_profile(stale, "nvidia-h200-sm90", 132).routes == {}


def test_bad_profiles_are_user_errors(tmp_path):
    with pytest.raises(NinferError, match="cannot read device profile"):
        KernelRegistry.from_profile(tmp_path / "missing.json", "x", 1)
    bad = profile(tmp_path, {gemv_key("q4_k", 16, 256): [[1, "no_such_schedule"]]})
    with pytest.raises(NinferError, match="unknown schedules"):
        KernelRegistry.from_profile(bad, "nvidia-h200-sm90", 132)


def test_quant_linear_matches_reference():
    gen = torch.Generator().manual_seed(5)
    raw = random_gguf_weight("q8_0", 8, 64, generator=gen)
    x = torch.randn(2, 1, 64, generator=gen)
    ref = quant_matmul_reference(raw, "q8_0", x, 8)
    reg = KernelRegistry({gemv_key("q8_0", 8, 64): [[1 << 30, "dequant_mm"]]})
    out = quant_linear(raw, "q8_0", x, 8, reg)
    assert out.shape == (2, 1, 8)
    assert torch.allclose(out, ref, rtol=1e-5, atol=1e-5)

"""q8 (int8-activation, dp4a) GEMV for iq3_s / iq4_xs: the Triton kernel (CPU interpreter) vs its float64 twin
on fresh random GGUF rows, the twin vs the unquantised fp64 matmul, errors, and an sm_90 compile with dp4a."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import kernels_only

import ninfer.kernels.gemv_q8_iq as q8iq
from ninfer.kernels.gemv_q8 import quantize_activation, quantize_activation_reference
from ninfer.kernels.gemv_q8_iq import (
    SCHEDULES,
    default_iq_schedule,
    gemv_q8_iq,
    gemv_q8_iq3_s,
    gemv_q8_iq4_xs,
    gemv_q8_iq_reference,
)
from ninfer.kernels.gguf_matmul import SCHEDULES as MATMUL_SCHEDULES
from ninfer.kernels.gguf_matmul import QuantKernelError, random_gguf_weight
from ninfer.quant import dequantize
from ninfer.quant.tables import iq_grid

REPO = Path(__file__).resolve().parents[1]
KERNELS = {"iq3_s": gemv_q8_iq3_s, "iq4_xs": gemv_q8_iq4_xs}
# kernel vs twin, max |diff| / max |twin|: measured ≤ 1.4e-7 (fp32 sums of exact int32 sub-block dots)
KERNEL_TOL = 1e-6
# twin vs fp64 matmul of the unquantised x, relative Frobenius error: measured 0.0049–0.0056 on normal x
# (theory: rounding to d = max|x|/127 per 32 values leaves ≈ 0.5 % of the rms)
INT8_TOL = 8e-3


@pytest.fixture()
def kernel_on_cpu(monkeypatch):
    kernels_only(monkeypatch, q8iq, "gemv_q8_iq_reference")


def _case(fmt: str, rows: int, cols: int, n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    raw = random_gguf_weight(fmt, rows, cols, generator=g)
    x = torch.randn(n, cols, generator=g) * (torch.rand(n, cols, generator=g) + 0.2)
    return raw, x, quantize_activation_reference(x)


def _rel_max(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).abs().max() / ref.double().abs().max()).item()


@pytest.mark.parametrize("fmt", ["iq3_s", "iq4_xs"])
@pytest.mark.parametrize("n, schedule", [(1, "q8_n16_m1"), (1, "q8_n8_m1_s4_w2"), (3, "q8_n16_m4_s4"),
                                         (8, "q8_n16_m8"), (5, "q8_n32_m8"), (4, "q8_n32_m4"),
                                         (1, "q8_n16_m1_p2"), (2, "q8_n16_m4_s4_p2"),
                                         (1, "q8_n8_m1_s4_w2_p2"), (7, "q8_n16_m8_s4_p1"),
                                         (8, "q8_n64_m8_w4_p1"), (1, "q8_n16_m1_p2_d2"),
                                         (3, "q8_n16_m4_s4_p2_d2_l1"), (6, "q8_n16_m8_s4_p1_d2"),
                                         (1, "q8_n8_m1_s4_w2_p2_d2_l1"), (1, "q8_n4_m1_b4"),
                                         (1, "q8_n4_m1_b4_s2_p2"), (2, "q8_n4_m1_b4_p2"),
                                         (1, "q8_n8_m1_b2_p2")])
def test_kernel_matches_twin(kernel_on_cpu, fmt, n, schedule):
    # split-K over 3 blocks: uneven parts; 20 rows: a partial row tile
    cols = 768 if SCHEDULES[schedule].split_k > 1 else 512
    raw, _, xa = _case(fmt, 20, cols, n, seed=sum(map(ord, fmt + schedule)) + n)
    out = KERNELS[fmt](raw, xa, 20, schedule)
    ref = gemv_q8_iq_reference(raw, fmt, xa, 20)
    assert out.shape == (n, 20) and out.dtype == torch.float32
    assert _rel_max(out, ref) < KERNEL_TOL


@pytest.mark.parametrize("fmt", ["iq3_s", "iq4_xs"])
@pytest.mark.parametrize("n, prefetch, grid_l1, programs", [(1, 2, False, 4), (3, 1, True, 5),
                                                           (2, 0, False, 2), (1, 2, True, 50)])
def test_stream_k_matches_twin(kernel_on_cpu, fmt, n, prefetch, grid_l1, programs):
    # 20 rows (2 row tiles) × 3 blocks = 6 steps over `programs` programs (the CPU has "1 SM"): ranges that
    # cross a row tile's end, one step each, or (50) more programs than steps
    s = q8iq.IqSchedule("test_k", "q8", 16, 4, stream=programs, prefetch=prefetch, grid_l1=grid_l1)
    raw, _, xa = _case(fmt, 20, 768, n, seed=programs * 7 + n)
    out = gemv_q8_iq(raw, fmt, xa, 20, s)
    assert _rel_max(out, gemv_q8_iq_reference(raw, fmt, xa, 20)) < KERNEL_TOL


def test_gguf_matmul_q8_schedule_by_name(kernel_on_cpu):
    raw, _, xa = _case("iq3_s", 6, 512, 3, seed=9)  # tiny_q8_m4: 4-row tiles, split-K 2
    out = gemv_q8_iq(raw, "gguf_iq3_s", xa, 6, "tiny_q8_m4")
    assert _rel_max(out, gemv_q8_iq_reference(raw, "iq3_s", xa, 6)) < KERNEL_TOL


def test_iq3_s_grid_through_l1(kernel_on_cpu):
    raw, _, xa = _case("iq3_s", 20, 512, 2, seed=5)
    out = gemv_q8_iq3_s(raw, xa, 20, "q8_n16_m4", grid_in_shared=False)
    assert _rel_max(out, gemv_q8_iq_reference(raw, "iq3_s", xa, 20)) < KERNEL_TOL


@pytest.mark.parametrize("fmt", ["iq3_s", "iq4_xs"])
def test_kernel_default_schedule_bf16_output(kernel_on_cpu, fmt):
    g = torch.Generator().manual_seed(7)
    raw = random_gguf_weight(fmt, 16, 256, generator=g)
    xa = quantize_activation(torch.randn(2, 256, generator=g).to(torch.bfloat16))
    out = KERNELS[fmt](raw, xa, 16)
    assert out.dtype == torch.bfloat16
    assert _rel_max(out, gemv_q8_iq_reference(raw, fmt, xa, 16)) < 2 ** -8  # bf16 rounding of the output


@pytest.mark.parametrize("fmt", ["iq3_s", "iq4_xs"])
def test_twin_vs_unquantised_matmul(fmt):
    raw, x, xa = _case(fmt, 64, 1024, 8, seed=11)
    ref = gemv_q8_iq_reference(raw, fmt, xa, 64)
    w = dequantize(raw.reshape(-1), "gguf_" + fmt, (64, 1024)).double()
    exact = x.double() @ w.t()
    err = ((ref - exact).norm() / exact.norm()).item()
    assert 1e-4 < err < INT8_TOL  # int8 rounding is visible but small


def test_iq3_s_grid_magnitudes_are_odd_bytes():
    """Every iq3_s kernel signs a grid word by g ^ (mask & 0xFEFEFEFE): an odd byte below 128 xor 0xFE is
    its int8 negation (and an even one would not be)."""
    grid = iq_grid("iq3_s").to(torch.int64)
    assert grid.min() >= 1 and grid.max() <= 127 and bool((grid % 2 == 1).all())
    negated = (grid ^ 0xFE) - 256  # the xor's byte read as int8 (its top bit is set)
    assert torch.equal(negated, -grid)
    assert (2 ^ 0xFE) - 256 == -4  # not -2: the premise matters


def test_errors():
    g = torch.Generator().manual_seed(1)
    raw = random_gguf_weight("iq3_s", 16, 256, generator=g)
    with pytest.raises(QuantKernelError, match="1–8 columns"):
        gemv_q8_iq3_s(raw, quantize_activation_reference(torch.randn(9, 256, generator=g)), 16)
    with pytest.raises(QuantKernelError, match="uint8"):
        gemv_q8_iq4_xs(raw, quantize_activation_reference(torch.randn(1, 256, generator=g)), 16)
    with pytest.raises(QuantKernelError, match="not a q8 schedule"):
        gemv_q8_iq3_s(raw, quantize_activation_reference(torch.randn(1, 256, generator=g)), 16,
                      schedule=MATMUL_SCHEDULES["wv_n16_m1"])
    with pytest.raises(QuantKernelError, match="q4_k"):
        default_iq_schedule("q4_k", 16, 256, 1)
    with pytest.raises(QuantKernelError, match="not q6_k"):
        gemv_q8_iq(raw, "q6_k", quantize_activation_reference(torch.randn(1, 256, generator=g)), 16)
    with pytest.raises(QuantKernelError, match="unknown schedule"):
        gemv_q8_iq3_s(raw, quantize_activation_reference(torch.randn(1, 256, generator=g)), 16, "q8_fast")


def test_default_schedules_cover_1_to_8_columns():
    for rows in (48, 1024, 5120, 17408):
        for n in range(1, 9):
            s = default_iq_schedule("gguf_iq3_s", rows, 5120, n)
            assert s.kernel == "q8" and s.block_m >= n and s.name in SCHEDULES


def test_sm90_compile_uses_dp4a():
    # compiled mode needs a fresh process: this one runs Triton's interpreter
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["NINFER_TRITON_COMPILE_CHECK"] = "1"
    out = subprocess.run([sys.executable, str(REPO / "bench" / "sass_q8_iq.py"), "--schedules", "q8_n16_m1"],
                         capture_output=True, text=True, timeout=300, cwd=REPO,
                         env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = [ln for ln in out.stdout.splitlines() if "q8_n16_m1:" in ln]
    assert len(lines) == 3 and all("(IDP4A 8," in ln for ln in lines), out.stdout
    assert "BAR 2)" in lines[0] and "BAR 0)" in lines[1]  # one table copy per block in shared memory

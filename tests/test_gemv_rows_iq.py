"""Coalesced-rows int8-activation GEMV (iq3_s) vs its float64 twin (Triton interpreter on CPU)."""

from __future__ import annotations

import pytest
import torch
from conftest import needs_triton

from ninfer.errors import NinferError
from ninfer.kernels.gemv_q8 import gemv_q8_reference, quantize_activation
from ninfer.kernels.gemv_rows_iq import MAX_COLUMNS, SCHEDULES, gemv_rows_iq, rows_iq_route
from ninfer.kernels.gguf_matmul import random_gguf_weight

pytestmark = needs_triton


@pytest.fixture(autouse=True)
def _triton_on_cpu(monkeypatch):
    monkeypatch.setenv("NINFER_TRITON_ON_CPU", "1")


def _case(rows: int, cols: int, width: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    raw = random_gguf_weight("iq3_s", rows, cols, generator=g)
    x = torch.randn(width, cols, generator=g) * (0.5 + torch.rand(width, 1, generator=g))
    return raw, x


# (schedule, columns, blocks per row); 5 rows (no multiple of a tile). 3 blocks per row: rows alternate
# between 4-byte and 2-byte aligned starts (330-byte rows); a partly masked last step at b2 / b4, and under
# split-K 4 (2 steps of b2) two empty splits. 2 or 4 blocks: whole steps (no masks), every row aligned.
# "_sg": signs looked up with the grid.
CASES = [("rows_iq_n4_m1_b4_w4", 1, 2), ("rows_iq_n2_m1_b4_w2", 1, 3), ("rows_iq_n2_m1_b2_w1_s4", 1, 3),
         ("rows_iq_n2_m1_b4_w2_s4", 1, 4), ("rows_iq_n4_m4_b4_w4", 3, 3), ("rows_iq_n2_m8_b4_w2_s4", 8, 2),
         ("rows_iq_n2_m1_b4_w2_sg", 1, 3), ("rows_iq_n2_m1_b2_w1_s4_sg", 1, 3),
         ("rows_iq_n4_m8_b4_w4_sg", 8, 2)]


@pytest.mark.parametrize("sched,width,nb", CASES)
def test_rows_iq_kernel_equals_twin(sched, width, nb):
    raw, x = _case(5, nb * 256, width, seed=width * 10 + nb)
    xa = quantize_activation(x)
    y = gemv_rows_iq(raw, "iq3_s", xa, 5, sched)
    want = gemv_q8_reference(raw, "iq3_s", xa, 5)
    assert y.dtype == torch.float32 and y.shape == (width, 5)
    # fp32 sums of int32 sub-block dot products (as the q8 kernels)
    assert (y.double() - want).abs().max() <= 1e-6 * want.abs().max()


def test_rows_iq_route_and_errors():
    assert rows_iq_route("gguf_iq3_s", 17408, 5120, 1).name in SCHEDULES
    assert all(rows_iq_route("iq3_s", 1024, 5120, m).block_m >= m for m in range(1, MAX_COLUMNS + 1))
    assert rows_iq_route("q4_k", 17408, 5120, 1) is None
    assert rows_iq_route("iq3_s", 17408, 5120, MAX_COLUMNS + 1) is None
    raw = random_gguf_weight("q4_k", 4, 256)
    with pytest.raises(NinferError, match="rows i-quant GEMV"):
        gemv_rows_iq(raw, "q4_k", quantize_activation(torch.randn(1, 256)), 4, "rows_iq_n4_m1_b4_w4")

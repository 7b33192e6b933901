"""Coalesced-rows int8-activation GEMV (iq3_s) vs its float64 twin (Triton interpreter on CPU)."""

from __future__ import annotations

import pytest
import torch
from conftest import gemv_case, needs_triton

from ninfer.errors import NinferError
from ninfer.kernels.gemv_q8 import gemv_q8_reference, quantize_activation
from ninfer.kernels.gemv_rows import split_workspace
from ninfer.kernels.gemv_rows_iq import (
    MAX_COLUMNS,
    SCHEDULES,
    RowsIqSchedule,
    gemv_rows_iq,
    iq3_s_padded,
    rows_iq_route,
)
from ninfer.kernels.gguf_matmul import random_gguf_weight

pytestmark = [needs_triton, pytest.mark.usefixtures("triton_on_cpu_env")]


# (format, schedule, columns, blocks per row); 5 rows (no multiple of a tile). iq3_s, 3 blocks per row: rows
# alternate between 4-byte and 2-byte aligned starts (330-byte rows). 3 blocks: a partly masked last step at
# b2 / b4, and under split-K 4 (2 steps of b2) two empty splits; 2 or 4 blocks: whole steps (no masks); 5
# blocks under split-K 3 (two steps of b4: an empty split, the fixup `gemv_rows._store_split`).
# "_sg": iq3_s signs looked up with the grid.
CASES = [("iq3_s", "rows_iq_n4_m1_b4_w4", 1, 2), ("iq3_s", "rows_iq_n2_m1_b4_w2", 1, 3),
         ("iq3_s", "rows_iq_n2_m1_b2_w1_s4", 1, 3), ("iq3_s", "rows_iq_n2_m1_b4_w2_s4", 1, 4),
         ("iq3_s", "rows_iq_n4_m4_b4_w4", 3, 3), ("iq3_s", "rows_iq_n2_m8_b4_w2_s4", 8, 2),
         ("iq3_s", "rows_iq_n2_m1_b4_w2_sg", 1, 3), ("iq3_s", "rows_iq_n2_m1_b2_w1_s4_sg", 1, 3),
         ("iq3_s", "rows_iq_n4_m8_b4_w4_sg", 8, 2), ("iq3_s", "rows_iq_n8_m1_b4_w4_s3", 1, 5),
         ("iq4_xs", "rows_iq_n4_m1_b4_w4", 1, 4), ("iq4_xs", "rows_iq_n2_m1_b2_w1_s4", 1, 3),
         ("iq4_xs", "rows_iq_n2_m4_b4_w2_s4", 3, 2), ("iq4_xs", "rows_iq_n4_m8_b4_w4", 8, 3)]


@pytest.mark.parametrize("fmt,sched,width,nb", CASES)
def test_rows_iq_kernel_equals_twin(fmt, sched, width, nb):
    raw, x = gemv_case(fmt, 5, nb * 256, width, seed=width * 10 + nb)
    xa = quantize_activation(x)
    y = gemv_rows_iq(raw, fmt, xa, 5, sched)
    want = gemv_q8_reference(raw, fmt, xa, 5)
    assert y.dtype == torch.float32 and y.shape == (width, 5)
    # fp32 sums of int32 sub-block dot products (as the q8 kernels)
    assert (y.double() - want).abs().max() <= 1e-6 * want.abs().max()
    if SCHEDULES[sched].split_k > 1 and fmt == "iq3_s":  # split-K's fixup left its workspace zero
        sums, counters = split_workspace(raw.device, 0, 0)
        assert not sums.any() and not counters.any()


@pytest.mark.parametrize("fmt", ["iq3_s", "iq4_xs"])
def test_rows_iq_misaligned_view(fmt):
    # rows 1.. of 330-byte iq3_s rows start 2 bytes into a word (the kernel reads a padded aligned copy)
    raw, x = gemv_case(fmt, 3, 768, 1, seed=7)
    xa = quantize_activation(x)
    y = gemv_rows_iq(raw[1:], fmt, xa, 2, "rows_iq_n2_m1_b2_w1_s4")
    want = gemv_q8_reference(raw[1:], fmt, xa, 2)
    assert (y.double() - want).abs().max() <= 1e-6 * want.abs().max()


@pytest.mark.parametrize("sched,width,nb", [("rows_iq_n2_m1_b4_w2", 1, 3), ("rows_iq_n4_m4_b4_w4", 3, 2)])
def test_rows_iq3_s_padded_layout(sched, width, nb):
    """The 112-byte aligned iq3_s blocks give the GGUF blocks' products (every sub-block c of every block
    reads its own qs, signs, qh byte and scale nibble: a wrong offset changes the sums)."""
    raw, x = gemv_case("iq3_s", 5, nb * 256, width, seed=40 + nb)
    xa = quantize_activation(x)
    padded = iq3_s_padded(raw)
    assert padded.shape == (5, nb * 112) and padded.view(5, nb, 112)[..., 110:].eq(0).all()
    y = gemv_rows_iq(padded, "iq3_s", xa, 5, sched, padded=True)
    want = gemv_q8_reference(raw, "iq3_s", xa, 5)
    assert (y.double() - want).abs().max() <= 1e-6 * want.abs().max()
    with pytest.raises(NinferError, match="padded weight"):
        gemv_rows_iq(raw, "iq3_s", xa, 5, sched, padded=True)


def test_rows_iq_route_and_errors():
    assert rows_iq_route("gguf_iq3_s", 17408, 5120, 1).name in SCHEDULES
    assert rows_iq_route("iq3_s", 1024, 5120, 1).block_m == 1
    assert all(rows_iq_route("iq3_s", 1024, 5120, m).block_m >= m for m in range(2, MAX_COLUMNS + 1))
    assert all(rows_iq_route("iq3_s", 5120, 17408, m).block_m >= m for m in range(1, 5))
    # the merged 27B matrices' own 1-column routes; wider, the shape class's
    for rows, cols in ((34816, 5120), (16480, 5120), (5120, 17408)):
        assert rows_iq_route("iq3_s", rows, cols, 1).name != rows_iq_route("iq3_s", rows + 256, cols, 1).name
        for m in range(2, MAX_COLUMNS + 1):
            assert rows_iq_route("iq3_s", rows, cols, m) == rows_iq_route("iq3_s", rows + 256, cols, m)
    # slower than the tensor-core tile (5-8 columns on big matrices) or not measured (iq4_xs)
    assert rows_iq_route("iq3_s", 17408, 5120, 8) is None
    assert rows_iq_route("iq4_xs", 5120, 17408, 1) is None
    assert rows_iq_route("q4_k", 17408, 5120, 1) is None
    assert rows_iq_route("iq3_s", 17408, 5120, MAX_COLUMNS + 1) is None
    xa = quantize_activation(torch.randn(1, 256))
    with pytest.raises(NinferError, match="rows i-quant GEMV"):
        gemv_rows_iq(random_gguf_weight("q4_k", 4, 256), "q4_k", xa, 4, "rows_iq_n4_m1_b4_w4")
    odd = RowsIqSchedule("rows_iq_odd", "rows_iq", 2, 1, blocks=1)
    with pytest.raises(NinferError, match="even number"):
        gemv_rows_iq(random_gguf_weight("iq3_s", 2, 256), "iq3_s", xa, 2, odd)
    with pytest.raises(NinferError, match="must be uint8"):
        gemv_rows_iq(random_gguf_weight("iq4_xs", 2, 256), "iq4_xs", xa, 3, "rows_iq_n4_m1_b4_w4")

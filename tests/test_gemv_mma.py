"""int8 tensor-core decode GEMM (q4_k, q5_k, q6_k, iq3_s; 2–16 columns) vs its float64 twin (interpreter)."""

from __future__ import annotations

import pytest
import torch
from conftest import gemv_case, needs_triton

from ninfer.errors import NinferError
from ninfer.kernels.gemv_mma import (
    BATCHED_FORMATS,
    MAX_COLUMNS,
    MMA_FORMATS,
    SCHEDULES,
    gemv_mma,
    mma_route,
    schedules_for,
)
from ninfer.kernels.gemv_q8 import gemv_q8_reference, quantize_activation

pytestmark = [needs_triton, pytest.mark.usefixtures("triton_on_cpu_env")]


# (format, schedule, columns, rows, blocks per row): rows and columns not multiples of the tile (clamped
# loads, masked stores), split-K with empty splits (3 blocks over 8 splits), two column tiles (17 columns),
# block-wide preloads (_pl)
CASES = [(fmt, sched, m, n, nb) for fmt in MMA_FORMATS
         for sched, m, n, nb in (("mma_n16_m8_w1_s4", 3, 70, 2), ("mma_n64_m16_w4_p3", 16, 64, 3),
                                 ("mma_n32_m8_w2_s2", 8, 40, 5), ("mma_n64_m16_w4_s8", 17, 20, 3),
                                 ("mma_n32_m8_w2_s4_pl", 2, 130, 1), ("mma_n32_m8_w2_s8_pl", 5, 40, 3),
                                 ("mma_n32_m16_w2_s4_p3_pl", 12, 70, 5))] + [
    (fmt, sched, m, n, nb) for fmt in BATCHED_FORMATS
    for sched, m, n, nb in (("mma_n32_m8_w2_s8_b3", 3, 70, 3), ("mma_n64_m16_w4_s4_b3", 17, 40, 2),
                            ("mma_n16_m8_w1_s8_b3", 8, 20, 5), ("mma_n16_m8_w1_s4_b3", 2, 24, 2))]


@pytest.mark.parametrize("fmt,sched,width,rows,nb", CASES)
def test_mma_kernel_equals_twin(fmt, sched, width, rows, nb):
    raw, x = gemv_case(fmt, rows, nb * 256, width, seed=MMA_FORMATS.index(fmt) * 10 + width)
    xa = quantize_activation(x)
    y = gemv_mma(raw, fmt, xa, rows, sched)
    want = gemv_q8_reference(raw, fmt, xa, rows)
    assert y.dtype == torch.float32 and y.shape == (width, rows)
    # exact int32 sub-block dots, fp32 scaling and sums (≤ 2.3e-7 of max|y| measured)
    assert (y.double() - want).abs().max() <= 1e-6 * want.abs().max()


def test_mma_route_and_errors():
    assert mma_route("gguf_q4_k", 17408, 5120, 8).name in SCHEDULES
    assert mma_route("q4_k", 17408, 5120, 4) is None  # 1-4 columns: the rows GEMV wins
    assert mma_route("q4_k", 17408, 5120, 5).name == "mma_n32_m8_w2_s8_pl"
    assert mma_route("q4_k", 6144, 5120, 8) is None and mma_route("q4_k", 1024, 5120, 8) is None
    assert mma_route("q6_k", 248320, 5120, 2) is None and mma_route("q6_k", 248320, 5120, 3) is not None
    assert mma_route("iq3_s", 5120, 17408, 4) is None and mma_route("iq3_s", 5120, 17408, 5) is not None
    assert all(mma_route("q5_k", 5120, 17408, m, forced=True).block_m >= m for m in range(2, MAX_COLUMNS + 1))
    assert mma_route("q4_k", 17408, 5120, 1, forced=True) is None  # one column: the rows GEMV
    assert mma_route("iq4_xs", 17408, 5120, 4) is None
    assert mma_route("q4_k", 17408, 5120, MAX_COLUMNS + 1) is None
    raw, x = gemv_case("iq4_xs", 4, 256, 2, seed=3)
    with pytest.raises(NinferError, match="tensor-core"):
        gemv_mma(raw, "iq4_xs", quantize_activation(x), 4, "mma_n32_m8_w2_s2")
    raw, x = gemv_case("q6_k", 4, 256, 2, seed=4)
    batched = "mma_n32_m8_w2_s8_b3"
    with pytest.raises(NinferError, match="q4_k, q5_k, iq3_s, not q6_k"):  # the batched kernels
        gemv_mma(raw, "q6_k", quantize_activation(x), 4, batched)
    assert batched in schedules_for("gguf_q4_k") and batched not in schedules_for("q6_k")
    assert schedules_for("q8_0") == {}

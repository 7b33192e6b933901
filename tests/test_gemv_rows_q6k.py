"""The q6_k rows GEMV (`gemv_rows_q6k`, the output head at one column) against the float64 twin of the
int8-activation product (Triton interpreter on CPU), and its route."""

from __future__ import annotations

import pytest
from conftest import gemv_case, needs_triton

from ninfer.errors import NinferError
from ninfer.kernels.gemv_q8 import gemv_q8_reference, quantize_activation
from ninfer.kernels.gemv_rows_q6k import HEAD_ROUTE, HEAD_ROUTES, gemv_rows_q6k, rows_q6k_route


@needs_triton
@pytest.mark.usefixtures("triton_on_cpu_env")
@pytest.mark.parametrize("schedule", ["rows_q6k_n8_m1_b4_w4", "rows_q6k_n4_m1_b4_w1"])
def test_q6k_rows_gemv_matches_the_float64_twin(schedule):
    # whole steps (1024), a partial first step (512), a masked last step (1536), rows of an odd number of
    # blocks (768: every other row starts 2 bytes into a word), rows past the program's tile
    for rows, cols in ((24, 1024), (13, 512), (7, 1536), (5, 768)):
        raw, x = gemv_case("q6_k", rows, cols, 1, seed=rows + cols)
        xa = quantize_activation(x)
        want = gemv_q8_reference(raw, "q6_k", xa, rows)
        got = gemv_rows_q6k(raw, "q6_k", xa, rows, schedule)
        # fp32 sums of exact int8 products, measured <= 1.3e-7
        assert float((got.double() - want).norm() / want.norm()) < 1e-6, (rows, cols)


@needs_triton
@pytest.mark.usefixtures("triton_on_cpu_env")
@pytest.mark.parametrize("schedule, widths", [
    ("rows_q6k_n4_m4_b4_w1", (1, 3, 4, 6)), ("rows_q6k_n4_m2_b4_w1", (3,)), ("rows_q6k_n16_m4_b4_w2", (4,))])
def test_q6k_rows_gemv_at_several_columns(schedule, widths):
    # each program decodes its weights once for up to 4 columns; columns past the last (3 or 6 columns on 4
    # a program) are computed on the last one and not stored
    for m in widths:
        for rows, cols in ((9, 1024), (5, 768)):
            raw, x = gemv_case("q6_k", rows, cols, m, seed=rows + cols + m)
            xa = quantize_activation(x)
            want = gemv_q8_reference(raw, "q6_k", xa, rows)
            got = gemv_rows_q6k(raw, "q6_k", xa, rows, schedule)
            assert got.shape == want.shape
            assert float((got.double() - want).norm() / want.norm()) < 1e-6, (m, rows, cols)


def test_q6k_rows_route_is_the_head_at_one_to_four_columns(monkeypatch):
    monkeypatch.delenv("NINFER_Q6K_ROWS", raising=False)
    assert rows_q6k_route("gguf_q6_k", 248320, 5120, 1).name == HEAD_ROUTE == HEAD_ROUTES[1]
    for m in (2, 3, 4):
        assert rows_q6k_route("q6_k", 248320, 5120, m).name == HEAD_ROUTES[m]
    assert rows_q6k_route("q6_k", 248320, 5120, 5) is None  # the fragment kernel
    monkeypatch.setenv("NINFER_Q6K_ROWS", "rows_q6k_n8_m4_b4_w2")  # a schedule at its width
    assert rows_q6k_route("q6_k", 248320, 5120, 4).name == "rows_q6k_n8_m4_b4_w2"
    assert rows_q6k_route("q6_k", 5120, 17408, 1) is None  # not a head: the q8 GEMV
    assert rows_q6k_route("q4_k", 248320, 5120, 1) is None
    monkeypatch.setenv("NINFER_Q6K_ROWS", "rows_q6k_n16_m1_b4_w8")
    assert rows_q6k_route("q6_k", 248320, 5120, 1).name == "rows_q6k_n16_m1_b4_w8"
    assert rows_q6k_route("q6_k", 248320, 5120, 2).name == HEAD_ROUTES[2]
    monkeypatch.setenv("NINFER_Q6K_ROWS", "1")  # one column only
    assert rows_q6k_route("q6_k", 248320, 5120, 1).name == HEAD_ROUTE
    assert rows_q6k_route("q6_k", 248320, 5120, 2) is None
    monkeypatch.setenv("NINFER_Q6K_ROWS", "0")
    assert rows_q6k_route("q6_k", 248320, 5120, 1) is None


def test_q6k_rows_refuses_what_it_cannot_run():
    raw, x = gemv_case("q6_k", 8, 512, 1, seed=1)
    xa = quantize_activation(x)
    with pytest.raises(NinferError, match="supports q6_k"):
        gemv_rows_q6k(gemv_case("q4_k", 8, 512, 1, seed=1)[0], "q4_k", xa, 8, HEAD_ROUTE)
    with pytest.raises(NinferError, match="no GDN conv"):
        gemv_rows_q6k(raw, "q6_k", xa, 8, HEAD_ROUTE, conv=object())

"""Quantized GGUF matmul kernel vs gguf-py's dequantisation + fp64 matmul (Triton interpreter on CPU)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import kernels_only, needs_triton
from gguf import GGMLQuantizationType, quants

import ninfer.kernels.gguf_matmul
from ninfer.errors import NinferError
from ninfer.kernels.gguf_matmul import (
    KERNEL_FORMATS,
    SCHEDULES,
    dequantize_rows,
    quant_matmul,
    quant_matmul_reference,
)
from ninfer.quant import FORMATS

# byte offsets of each format's fp16 scale fields: set to small finite values so random blocks are valid
SCALE_OFFSETS = {"q4_0": [0], "q4_1": [0, 2], "q5_0": [0], "q8_0": [0], "q4_k": [0, 2], "q5_k": [0, 2],
                 "q6_k": [208], "iq4_xs": [0], "iq3_s": [0]}


@pytest.fixture(autouse=True)
def _triton_on_cpu(monkeypatch):
    kernels_only(monkeypatch, ninfer.kernels.gguf_matmul, "quant_matmul_reference")


def random_gguf_rows(fmt: str, rows: int, cols: int, gen: torch.Generator) -> torch.Tensor:
    """Random but valid GGUF blocks: uniform bytes, fp16 scales in [0.0005, 0.0025)."""
    f = FORMATS[fmt]
    nblk = rows * cols // f.block_elems
    blocks = torch.randint(0, 256, (nblk, f.block_bytes), dtype=torch.uint8, generator=gen)
    for off in SCALE_OFFSETS[fmt]:
        d = (torch.rand(nblk, generator=gen) * 0.002 + 0.0005).to(torch.float16)
        blocks[:, off:off + 2] = d.view(torch.uint8).reshape(nblk, 2)
    return blocks.reshape(rows, -1)


def gguf_py_dense(raw: torch.Tensor, fmt: str, rows: int, cols: int) -> torch.Tensor:
    """The weight as gguf-py (not ours) dequantises it, float64."""
    qtype = GGMLQuantizationType[fmt.upper()]
    return torch.from_numpy(quants.dequantize(raw.numpy(), qtype).astype(np.float64)).reshape(rows, cols)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref).norm() / ref.norm())


@needs_triton
@pytest.mark.parametrize("fmt", KERNEL_FORMATS)
def test_kernel_matches_gguf_py(fmt):
    gen = torch.Generator().manual_seed(FORMATS[fmt].ggml_type)
    block = FORMATS[fmt].block_elems
    rows, cols = 24, 512 if block == 256 else 96  # 24 rows: one full and one partial 16-row tile
    raw = random_gguf_rows(fmt, rows, cols, gen)
    dense = gguf_py_dense(raw, fmt, rows, cols)
    for width, schedule in ((3, "tiny_sub"), (1, "tiny_elem"), (2, "dequant_mm")):
        x = torch.randn(width, cols, generator=gen)
        ref = x.double() @ dense.t()
        out = quant_matmul(raw, fmt, x, rows, schedule=SCHEDULES[schedule])
        assert torch.isfinite(out).all()
        # fp16 dot operands (weights and activations rounded to 2^-11): measured 9e-5..4e-4 over the nine
        # formats and both kernels; bound 1e-3. dequant_mm on CPU decodes to fp32: far below.
        assert rel_err(out, ref) < 1e-3, (fmt, width, schedule, rel_err(out, ref))


@needs_triton
@pytest.mark.parametrize("fmt", KERNEL_FORMATS)
def test_dequantize_rows_gathers_in_the_launch(fmt):
    """An embedding lookup: the rows asked for (repeats, any order, past one 16-row tile), decoded where they
    lie, are gguf-py's rows exactly (fp32 out); the same through the CPU path."""
    gen = torch.Generator().manual_seed(FORMATS[fmt].ggml_type)
    cols = 512 if FORMATS[fmt].block_elems == 256 else 96
    raw = random_gguf_rows(fmt, 40, cols, gen)
    ids = torch.tensor([39, 0, 7, 7, *torch.randint(0, 40, (15,), generator=gen).tolist()])
    want = gguf_py_dense(raw, fmt, 40, cols)[ids].float()
    got = dequantize_rows(raw, fmt, 40, cols, torch.float32, rows=ids)
    assert torch.equal(got, want)
    with pytest.MonkeyPatch.context() as m:
        m.delenv("NINFER_TRITON_ON_CPU")
        assert torch.equal(dequantize_rows(raw, fmt, 40, cols, torch.float32, rows=ids), want)


@needs_triton
def test_split_k_and_multi_tile_columns():
    gen = torch.Generator().manual_seed(7)
    rows, cols = 16, 1024
    raw = random_gguf_rows("q4_k", rows, cols, gen)
    dense = gguf_py_dense(raw, "q4_k", rows, cols)
    x = torch.randn(20, cols, generator=gen)  # 20 columns: two 16-column tiles, the second partial
    ref = x.double() @ dense.t()
    for split in ("elem_n16_k256_s4", "sub_n16_s4"):
        out = quant_matmul(raw, "q4_k", x, rows, schedule=split)
        assert rel_err(out, ref) < 1e-3, split


@needs_triton
@pytest.mark.parametrize("fmt", ["q4_k", "iq3_s"])
def test_fma_kernel_matches_gguf_py(fmt):
    gen = torch.Generator().manual_seed(21)
    rows, cols = 20, 512
    raw = random_gguf_rows(fmt, rows, cols, gen)
    dense = gguf_py_dense(raw, fmt, rows, cols)
    x = torch.randn(3, cols, generator=gen)  # 3 columns: two 2-column tiles, the second partial
    for schedule in ("tiny_fma_m2", "fma_n16_m1_s4"):
        xs = x[:1] if SCHEDULES[schedule].block_m == 1 else x
        out = quant_matmul(raw, fmt, xs, rows, schedule=schedule)
        # fp32 FMAs on exact codes: measured ~1e-7
        assert rel_err(out, xs.double() @ dense.t()) < 1e-5, schedule


def test_reference_matches_gguf_py():
    gen = torch.Generator().manual_seed(3)
    raw = random_gguf_rows("iq3_s", 8, 256, gen)
    x = torch.randn(2, 256, generator=gen)
    ref = x.double() @ gguf_py_dense(raw, "iq3_s", 8, 256).t()
    assert rel_err(quant_matmul_reference(raw, "iq3_s", x, 8), ref) < 1e-6


def test_bad_weight_is_a_user_error():
    raw = torch.zeros(4, 100, dtype=torch.uint8)
    with pytest.raises(NinferError, match="must be uint8"):
        quant_matmul(raw, "q4_k", torch.randn(1, 256), 4)
    with pytest.raises(NinferError, match="no quantized matmul kernel"):
        quant_matmul(raw, "q2_k", torch.randn(1, 256), 4)


@needs_triton
@pytest.mark.parametrize("fmt", ["q4_k", "iq3_s", "q6_k", "q5_k", "q8_0"])
def test_word_vector_gemv_matches_gguf_py(fmt):
    """The word-vector GEMV (codes as mantissa bits, per-sub-block x-sum corrections) on fresh blocks:
    partial row tiles, 1–3 columns (a partial column tile), split-K, and an in_features of 3 blocks."""
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, (1,)).item()))
    rows, cols = 20, 768
    raw = random_gguf_rows(fmt, rows, cols, gen)
    dense = gguf_py_dense(raw, fmt, rows, cols)
    x = torch.randn(3, cols, generator=gen)
    for schedule, width in (("tiny_wv_m2", 3), ("wv_n16_m1_s4", 1), ("wv_n8_m4", 2)):
        xs = x[:width]
        out = quant_matmul(raw, fmt, xs, rows, schedule=schedule)
        # fp32 FMAs on exact codes; the 1 + q/2^b offset costs a few bits (cancellation): measured ≤ 1.3e-6
        assert rel_err(out, xs.double() @ dense.t()) < 1e-5, (fmt, schedule)


def test_word_vector_gemv_rejects_other_formats():
    raw = torch.zeros(4, 18, dtype=torch.uint8)
    with pytest.raises(NinferError, match="word-vector GEMV"):
        quant_matmul(raw, "q4_0", torch.randn(1, 32), 4, schedule="wv_n16_m1")
    raw = torch.zeros(4, 34 * 4, dtype=torch.uint8)  # q8_0 rows of 128 columns: not whole 256-column steps
    with pytest.raises(NinferError, match="256-column"):
        quant_matmul(raw, "q8_0", torch.randn(1, 128), 4, schedule="wv_n16_m1")


@needs_triton
def test_every_word_vector_schedule_runs():
    """Each wv tile/split/warp variant (the default routes use several) on one of the formats, in turn."""
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, (1,)).item()))
    rows, cols = 40, 512
    names = sorted(n for n, s in SCHEDULES.items() if s.kernel == "wv")
    for i, name in enumerate(names):
        fmt = ("q4_k", "iq3_s", "q6_k", "q5_k", "q8_0")[i % 5]
        raw = random_gguf_rows(fmt, rows, cols, gen)
        x = torch.randn(min(SCHEDULES[name].block_m + 1, 5), cols, generator=gen)
        out = quant_matmul(raw, fmt, x, rows, schedule=name)
        assert rel_err(out, x.double() @ gguf_py_dense(raw, fmt, rows, cols).t()) < 1e-5, (fmt, name)

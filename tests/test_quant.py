"""ninfer.quant against gguf's own tables and reference dequantisation (gguf.quants), which are not ours.

Tolerance: exact equality (atol = rtol = 0). Every format computes `fp16 scale x small integers`; with at
most 11 + 12 significant bits those products are exact in fp32 whatever the order, and the only rounding
(adding the block minimum in q4_1/q5_1/q2_k/q4_k/q5_k) is one fp32 rounding of the same exact operands in
both implementations. So the outputs must be bit-identical; any difference is a layout bug.
"""

from __future__ import annotations

import math

import gguf
import numpy as np
import pytest
import torch
from conftest import TINY_GGUF
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from ninfer.errors import QuantFormatError
from ninfer.quant import (
    FORMATS,
    IQ4_LEVELS,
    IQ_GRID_SHAPES,
    BlockFormat,
    artifact_format_for_ggml_type,
    dequantize,
    iq_grid,
    iq_sign_codes,
    row_bytes,
    tensor_bytes,
)

# Byte offsets of the fp16 scale fields (d, dmin, m) in each block: the only fields that can hold inf/NaN.
FP16_FIELDS = {
    "q4_0": [0], "q4_1": [0, 2], "q5_0": [0], "q5_1": [0, 2], "q8_0": [0],
    "q2_k": [80, 82], "q3_k": [108], "q4_k": [0, 2], "q5_k": [0, 2], "q6_k": [208],
    "iq2_xxs": [0], "iq2_xs": [0], "iq2_s": [0], "iq3_xxs": [0], "iq3_s": [0], "iq4_nl": [0], "iq4_xs": [0],
}  # fmt: skip

SHAPES = [(1, 1), (3, 2), (2, 3, 4), (7, 1)]  # (leading dims..., blocks per row)


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """These tensors are small; on a shared 2-core machine a second thread only waits (3x slower)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def random_valid_blocks(fmt: BlockFormat, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """Random bytes `[*shape[:-1], blocks * block_bytes]` whose fp16 scale fields are finite: half are
    random finite fp16 bit patterns over the whole range (subnormals included), half realistic N(0, 0.01)."""
    blocks = rng.integers(0, 256, size=(*shape, fmt.block_bytes), dtype=np.uint8)
    for offset in FP16_FIELDS[fmt.name]:
        bits = rng.integers(0, 1 << 16, size=shape, dtype=np.uint16)
        bits = np.where((bits & 0x7C00) == 0x7C00, bits & 0x83FF, bits)  # inf/NaN exponent -> subnormal
        realistic = (rng.standard_normal(shape) * 0.01).astype(np.float16).view(np.uint16)
        bits = np.where(rng.random(shape) < 0.5, bits, realistic)
        blocks[..., offset : offset + 2] = bits[..., None].view(np.uint8)
    return blocks.reshape(*shape[:-1], -1)


def test_formats_match_gguf_geometry():
    assert len(FORMATS) == 17
    for name, fmt in FORMATS.items():
        gguf_type = GGMLQuantizationType[name.upper()]
        assert fmt.name == name and fmt.ggml_type == int(gguf_type)
        assert (fmt.block_elems, fmt.block_bytes) == GGML_QUANT_SIZES[gguf_type]
        assert artifact_format_for_ggml_type(gguf_type) == f"gguf_{name}"
    for plain, gguf_type in [("bf16", "BF16"), ("f16", "F16"), ("f32", "F32"), ("i32", "I32")]:
        assert artifact_format_for_ggml_type(int(GGMLQuantizationType[gguf_type])) == plain


def test_tables_match_gguf():
    ksigns = np.frombuffer(gguf.quants.IQ2_XXS.ksigns, dtype=np.uint8)  # 128 sign bytes
    bits = (ksigns[:, None] >> np.arange(8)) & 1
    assert torch.equal(iq_sign_codes(), torch.from_numpy(1.0 - 2.0 * bits).float())
    assert IQ4_LEVELS.tolist() == list(gguf.quants.IQ4_NL.kvalues)
    for name, shape in IQ_GRID_SHAPES.items():
        source = getattr(gguf.quants, name.upper())
        grid = iq_grid(name)
        assert tuple(grid.shape) == shape == source.grid_shape
        assert set(grid.unique().tolist()) == set(source.grid_map)


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_dequantize_equals_gguf_on_random_valid_blocks(name):
    fmt = FORMATS[name]
    rng = np.random.default_rng(sum(map(ord, name)))
    for shape in SHAPES:
        raw = random_valid_blocks(fmt, shape, rng)
        expected = gguf.quants.dequantize(raw, GGMLQuantizationType(fmt.ggml_type))
        out_shape = (*shape[:-1], shape[-1] * fmt.block_elems)
        assert expected.shape == out_shape
        ours = dequantize(torch.from_numpy(raw), f"gguf_{name}", out_shape)
        assert ours.dtype == torch.float32 and tuple(ours.shape) == out_shape
        torch.testing.assert_close(ours, torch.from_numpy(expected), rtol=0, atol=0, equal_nan=False)


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(FORMATS))
def test_dequantize_on_cuda_equals_gguf(name):
    fmt = FORMATS[name]
    raw = random_valid_blocks(fmt, (3000, 2), np.random.default_rng(7))  # 3 chunks of 256-element formats
    expected = gguf.quants.dequantize(raw, GGMLQuantizationType(fmt.ggml_type))
    ours = dequantize(torch.from_numpy(raw).cuda(), f"gguf_{name}", expected.shape)
    assert ours.is_cuda
    torch.testing.assert_close(ours.cpu(), torch.from_numpy(expected), rtol=0, atol=0)


def test_dequantize_accepts_any_byte_shape_and_views():
    fmt = FORMATS["q4_k"]
    raw = torch.from_numpy(random_valid_blocks(fmt, (4, 2), np.random.default_rng(1)))  # [4, 288]
    ref = dequantize(raw, "gguf_q4_k", (4, 512))
    assert torch.equal(dequantize(raw.reshape(-1), "gguf_q4_k", (2, 2, 512)), ref.reshape(2, 2, 512))
    wide = torch.zeros(4, 400, dtype=torch.uint8)
    wide[:, 50:338] = raw
    assert torch.equal(dequantize(wide[:, 50:338], "gguf_q4_k", (4, 512)), ref)  # non-contiguous rows


@pytest.mark.parametrize("fmt", ["bf16", "gguf_q8_0", "gguf_iq2_xxs", "gguf_iq3_s"])
def test_dequantize_empty_tensor(fmt):
    out = dequantize(torch.zeros(0, dtype=torch.uint8), fmt, (0, 256))
    assert out.dtype == torch.float32 and tuple(out.shape) == (0, 256)


def test_dequantize_large_tensor_spans_chunks():
    fmt = FORMATS["iq3_s"]
    raw = random_valid_blocks(fmt, (5000, 1), np.random.default_rng(2))  # 1.28M elements > one chunk
    expected = gguf.quants.dequantize(raw, GGMLQuantizationType.IQ3_S).reshape(1000, 1280)
    ours = dequantize(torch.from_numpy(raw), "gguf_iq3_s", (1000, 1280))
    assert torch.equal(ours, torch.from_numpy(expected))


@pytest.mark.parametrize(
    ("fmt", "torch_dtype"),
    [("bf16", torch.bfloat16), ("f16", torch.float16), ("f32", torch.float32), ("i32", torch.int32)],
)
def test_dequantize_plain_formats(fmt, torch_dtype):
    gen = torch.Generator().manual_seed(3)
    if torch_dtype is torch.int32:
        values = torch.randint(-(2**24), 2**24, (3, 5), generator=gen, dtype=torch.int32)
    else:
        values = torch.randn(3, 5, generator=gen).to(torch_dtype)
    raw = values.view(torch.uint8)
    assert tensor_bytes(fmt, (3, 5)) == raw.numel()
    assert torch.equal(dequantize(raw, fmt, (3, 5)), values.to(torch.float32))


def fixture_tensors():
    for path in sorted(TINY_GGUF.glob("*.gguf")):
        for tensor in gguf.GGUFReader(path).tensors:
            yield path.name, tensor


@pytest.mark.filterwarnings("ignore:The given NumPy array is not writable")  # GGUFReader maps read-only
def test_dequantize_equals_gguf_on_every_fixture_tensor():
    seen_formats = set()
    for file_name, tensor in fixture_tensors():
        fmt = artifact_format_for_ggml_type(tensor.tensor_type)
        shape = tuple(int(dim) for dim in reversed(tensor.shape))  # GGUF lists dims innermost first
        raw = np.ascontiguousarray(tensor.data).view(np.uint8)
        assert tensor_bytes(fmt, shape) == raw.size == tensor.n_bytes, (file_name, tensor.name)
        expected = gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape(shape)
        ours = dequantize(torch.from_numpy(raw), fmt, shape)
        mismatches = (ours != torch.from_numpy(expected)).sum().item()
        assert mismatches == 0, f"{file_name} {tensor.name} ({fmt}): {mismatches} of {ours.numel()} differ"
        seen_formats.add(fmt)
    assert {"gguf_q8_0", "gguf_q4_k", "gguf_q6_k", "gguf_iq4_xs", "gguf_iq3_s", "bf16", "f32"} <= seen_formats


def test_tensor_bytes_agrees_with_gguf_sizes():
    for name, fmt in FORMATS.items():
        elems, size = GGML_QUANT_SIZES[GGMLQuantizationType(fmt.ggml_type)]
        for shape in [(elems,), (3, 4 * elems), (2, 5, 7 * elems), (0, elems)]:
            assert tensor_bytes(f"gguf_{name}", shape) == math.prod(shape) // elems * size
        assert row_bytes(f"gguf_{name}", 6 * elems) == 6 * size
    assert tensor_bytes("bf16", (3, 7)) == 42
    assert tensor_bytes("f16", (5,)) == 10
    assert tensor_bytes("f32", (2, 3, 5)) == 120
    assert tensor_bytes("i32", ()) == 4
    assert tensor_bytes("gguf_q8_0", (np.int64(4), np.uint64(64))) == 4 * 2 * 34  # GGUFReader's int types


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: tensor_bytes("gguf_q4_k", (4, 100)), "blocks of 256 elements but the row has 100"),
        (lambda: row_bytes("gguf_q8_0", 33), "blocks of 32 elements but the row has 33"),
        (lambda: tensor_bytes("gguf_iq1_s", (4, 256)), "unknown tensor format 'gguf_iq1_s'"),
        (lambda: tensor_bytes("q4_k", (4, 256)), "unknown tensor format 'q4_k'"),
        (lambda: tensor_bytes("f32", (4, -1)), "non-negative integers"),
        (lambda: tensor_bytes("f32", (4, 2.0)), "non-negative integers"),
        (lambda: tensor_bytes("gguf_q8_0", ()), "needs at least one dimension"),
        (lambda: artifact_format_for_ggml_type(19), "GGML tensor type 19 is not supported"),
        (lambda: dequantize(torch.zeros(100, dtype=torch.uint8), "gguf_q8_0", (2, 32)), "needs 68 bytes"),
        (lambda: dequantize(torch.zeros(68, dtype=torch.int8), "gguf_q8_0", (2, 32)), "uint8"),
        (lambda: dequantize(torch.zeros(68, dtype=torch.uint8), "gguf_q8_0", (2, 30)), "row has 30"),
    ],
)
def test_wrong_sizes_and_formats_raise_quant_format_error(call, message):
    with pytest.raises(QuantFormatError, match=message) as info:
        call()
    assert "\n" not in str(info.value)

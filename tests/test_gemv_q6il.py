"""The q6_k tensor-core GEMV on its lane-per-row repack (ninfer/kernels/gemv_q6il.py): the layout, the
kernel's integer recipe in numpy lane by lane against the float64 twin, the routing (which weights take the
layout, prefill by chunks), and (GPU) the kernel itself."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ninfer.kernels import gemv_q6il as q6il
from ninfer.kernels import gguf_matmul
from ninfer.kernels.gemv_q6il import (
    PAIR_WORDS,
    gemv_q6il_reference,
    q6il_matmul,
    q6il_shape,
    q6il_wanted,
    repack_q6il,
    unpack_q6il,
)
from ninfer.kernels.gemv_q8 import gemv_q8_reference, quantize_activation_reference
from ninfer.kernels.gguf_matmul import quant_matmul_reference, random_gguf_weight


@pytest.mark.parametrize(("n", "k"), [(40, 768), (64, 1024), (33, 256)])
def test_repack_is_a_lossless_same_size_permutation(n, k):
    """Rows padded to 32 and blocks to an even count with zeros; on whole tiles and pairs the same bytes."""
    raw = random_gguf_weight("q6_k", n, k, generator=torch.Generator().manual_seed(n + k))
    words = repack_q6il(raw)
    tiles, pairs = q6il_shape(n, k)
    assert words.dtype == torch.int32 and words.numel() == tiles * pairs * PAIR_WORDS * 32
    assert torch.equal(unpack_q6il(words, n, k), raw)
    assert torch.equal(repack_q6il(raw, chunk_rows=32), words)  # a tile at a time: the same words
    if n % 32 == 0 and (k // 256) % 2 == 0:
        assert words.numel() * 4 == raw.numel()


def _prmt(a: np.ndarray, b: np.ndarray, sel: int) -> np.ndarray:
    """PTX prmt.b32 (default mode) on uint32 arrays: byte k of the result is byte sel[k] & 7 of {b, a}, its
    sign bit replicated when sel[k] & 8."""
    v = (a.astype(np.uint64) & 0xFFFFFFFF) | ((b.astype(np.uint64) & 0xFFFFFFFF) << np.uint64(32))
    out = np.zeros(np.broadcast(a, b).shape, dtype=np.uint64)
    for k in range(4):
        nib = (sel >> (4 * k)) & 15
        byte = (v >> np.uint64(8 * (nib & 7))) & np.uint64(0xFF)
        if nib & 8:
            byte = np.where(byte & np.uint64(0x80), np.uint64(0xFF), np.uint64(0))
        out |= byte << np.uint64(8 * k)
    return out


def _mma_m16n8k16_u8s8(a0: np.ndarray, a1: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """PTX mma.m16n8k16.u8.s8 by its fragment tables, lane by lane: a0 / a1 `[..., 32]` (lane 4g + t: rows g /
    g + 8, k 4t..4t + 3, unsigned bytes), b `[32]` (k 4t..4t + 3 of column g, signed), c `[..., 32, 4]` (rows
    g, g, g + 8, g + 8 × columns 2t, 2t + 1) -> d like c, int64."""
    lanes = np.arange(32)
    g, t = lanes >> 2, lanes & 3

    def bytes_of(x, signed):
        x = x.astype(np.int64) & 0xFFFFFFFF
        out = np.stack([(x >> (8 * i)) & 0xFF for i in range(4)], axis=-1)
        return (out ^ 0x80) - 0x80 if signed else out

    dense_a = np.zeros(a0.shape[:-1] + (16, 16), dtype=np.int64)
    dense_b = np.zeros((16, 8), dtype=np.int64)
    for i in range(4):
        dense_a[..., g, 4 * t + i] = bytes_of(a0, False)[..., i]
        dense_a[..., g + 8, 4 * t + i] = bytes_of(a1, False)[..., i]
        dense_b[4 * t + i, g] = bytes_of(b, True)[:, i]
    dense_d = dense_a @ dense_b
    rows = np.stack([g, g, g + 8, g + 8], axis=-1)
    cols = np.stack([2 * t, 2 * t + 1, 2 * t, 2 * t + 1], axis=-1)
    return c + dense_d[..., rows, cols]


@pytest.mark.parametrize(("n", "k", "columns"), [(40, 768, 3), (64, 512, 8), (32, 1024, 1)])
def test_the_kernels_integer_recipe_gives_the_twin(n, k, columns):
    """`q6k_il_mma` in numpy, lane by lane: rows 4g..4g + 3 of each 16-byte load, inputs 4t..4t + 3 of each
    16-input step; the unsigned 6-bit words from a ql and a qh word (masks and shifts), the accumulator
    started at −32 × the step's activation sums of the lane's two columns, m16n8k16 by PTX's fragment tables,
    the int8 scale by a sign-extending prmt, one float conversion a block: equal to the float64 twin."""
    gen = torch.Generator().manual_seed(k + columns)
    raw = random_gguf_weight("q6_k", n, k, generator=gen)
    xa = quantize_activation_reference(torch.randn(columns, k, generator=gen), 256)
    tiles, pairs = q6il_shape(n, k)
    w = repack_q6il(raw).numpy().view(np.uint32).reshape(tiles, pairs, PAIR_WORDS, 32).astype(np.uint64)
    last = np.minimum(np.arange(8), columns - 1)  # lanes of columns past the last read the last
    xq = xa.q.numpy().astype(np.int64)[last]  # [8, k]
    xw = xa.words.numpy().astype(np.int64)[last] & 0xFFFFFFFF
    xd = xa.d.numpy().astype(np.float64)[last]
    xs = -32 * xq.reshape(8, k // 16, 16).sum(-1)  # [8 columns, steps]
    lanes = np.arange(32)
    gq, t = lanes >> 2, lanes & 3
    acc = np.zeros((tiles, 32, 4, 2))
    for kb in range(k // 256):
        p, h = divmod(kb, 2)
        words = w[:, p][:, :, 4 * gq[:, None] + np.arange(4)]  # [tile, word, lane, row r]
        bw = words[:, 52 * h: 52 * h + 52]  # block h's words
        d = (words[:, 104] >> np.uint64(16 * h) & np.uint64(0xFFFF)).astype(np.uint16).view(np.float16)
        isum = np.zeros((tiles, 32, 4, 2), dtype=np.int64)
        for nn in range(2):
            sc = (bw[:, 48 + 2 * nn], bw[:, 49 + 2 * nn])  # [tile, lane, r]
            for s in range(2):
                # each lane's word j + t: [tile, lane, r]
                qa, qb = bw[:, 16 * nn + 4 * s + t, lanes], bw[:, 16 * nn + 8 + 4 * s + t, lanes]
                qh = bw[:, 32 + 8 * nn + 4 * s + t, lanes]
                for q in range(4):
                    step = kb * 16 + 8 * nn + 2 * q + s
                    b = xw[gq, 4 * step + t]
                    c = np.stack([xs[2 * t, step], xs[2 * t + 1, step]] * 2, axis=-1)  # [32, 4]
                    c = np.broadcast_to(c, (tiles, 32, 4))
                    lo = (qb if q & 1 else qa) >> np.uint64(0 if q < 2 else 4) & np.uint64(0x0F0F0F0F)
                    hi = (qh << np.uint64(4 - 2 * q)) if q < 2 else (qh >> np.uint64(2 * q - 4))
                    a = lo | (hi & np.uint64(0x30303030))  # [tile, lane, r]
                    sums = [_mma_m16n8k16_u8s8(a[..., 2 * mt], a[..., 2 * mt + 1], b, c) for mt in range(2)]
                    byte = (2 * q + s) & 3
                    for r in range(4):
                        word = sc[0 if 2 * q + s < 4 else 1][..., r]
                        ls = _prmt(word, 0 * word, 0x8880 | (byte * 0x1111)).astype(np.int64)
                        ls = (ls ^ 0x80000000) - 0x80000000  # the int32 the prmt leaves
                        for e in range(2):
                            isum[:, :, r, e] += sums[r >> 1][..., 2 * (r & 1) + e] * ls
        for r in range(4):
            for e in range(2):
                value = isum[:, :, r, e].astype(np.float32).astype(np.float64)
                acc[:, :, r, e] += value * d[:, :, r].astype(np.float64) * xd[2 * t + e, kb]
    y = np.zeros((8, tiles * 32))
    for e in range(2):
        rows = np.arange(tiles)[:, None, None] * 32 + 4 * gq[None, :, None] + np.arange(4)
        y[(2 * t + e)[None, :, None].repeat(tiles, 0).repeat(4, 2), rows] = acc[..., e]
    want = gemv_q8_reference(raw, "q6_k", xa, n).numpy()
    assert np.abs(y[:columns, :n] - want).max() <= 1e-5 * np.abs(want).max()


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.gpu
@pytest.mark.parametrize(("n", "k"), [(1040, 5120), (40, 768), (65536, 5120)])
def test_gemv_q6il_matches_its_twin_on_gpu(n, k):
    """1-8 columns, bf16 and fp32 outputs, padded rows and blocks, in a CUDA graph the same bits as eager."""
    from ninfer.kernels.gemv_q6il import gemv_q6il
    from ninfer.kernels.gemv_q8 import quantize_activation

    words = repack_q6il(random_gguf_weight("q6_k", n, k, "cuda"))
    for width in range(1, 9):
        for dtype in (torch.bfloat16, torch.float32):
            xa = quantize_activation(torch.randn(width, k, device="cuda", dtype=dtype), group=256)
            out = gemv_q6il(words, xa, n)
            # bf16 output rounding (2^-9) bounds the bf16 case; fp32 sums in another order
            assert rel(out, gemv_q6il_reference(words, xa, n)) < (5e-3 if dtype == torch.bfloat16 else 1e-4)
    xa = quantize_activation(torch.randn(4, k, device="cuda"), group=256)
    eager = gemv_q6il(words, xa, n)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = gemv_q6il(words, xa, n)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, eager)


@pytest.mark.gpu
def test_q6il_matmul_on_gpu_at_every_width():
    """Through 16 columns the GEMV (8 at a time), beyond by unpacked chunks: each against float64."""
    n, k = 1040, 2560
    raw = random_gguf_weight("q6_k", n, k, "cuda")
    words = repack_q6il(raw)
    for width in (3, 12, 40):
        x = torch.randn(width, k, device="cuda", dtype=torch.bfloat16)
        want = quant_matmul_reference(raw, "q6_k", x.float(), n)
        assert rel(q6il_matmul(words, x, n), want) < 1e-2  # int8 activation and bf16 output (measured 4e-3)


def test_q6il_matmul_prefill_runs_by_chunks(monkeypatch):
    """More than 16 columns: `PREFILL_ROWS` rows at a time unpacked and dequantised (here 64 of 100 rows:
    two chunks, the second partial), the same product as the whole GGUF weight's."""
    monkeypatch.setattr(gguf_matmul, "PREFILL_ROWS", 64)
    n, k = 100, 768
    raw = random_gguf_weight("q6_k", n, k, generator=torch.Generator().manual_seed(5))
    x = torch.randn(2, 10, k, generator=torch.Generator().manual_seed(6))
    y = q6il_matmul(repack_q6il(raw), x, n)
    assert y.shape == (2, 10, n)
    assert torch.allclose(y, quant_matmul_reference(raw, "q6_k", x, n), rtol=1e-5, atol=1e-5)


def test_which_weights_take_the_layout(monkeypatch):
    monkeypatch.setattr(q6il, "_compiles", lambda: True)
    monkeypatch.delenv("NINFER_Q6K_IL", raising=False)
    assert q6il_wanted("gguf_q6_k", 248320, 5120, "cuda")  # the 27B's head
    assert q6il_wanted("q6_k", 151936, 2048, "cuda:0")
    assert not q6il_wanted("q6_k", 5120, 17408, "cuda")  # a Q4_K_M down projection
    assert not q6il_wanted("q4_k", 248320, 5120, "cuda")
    assert not q6il_wanted("q6_k", 248320, 5120, "cpu")
    assert not q6il_wanted("q6_k", 248320, 5000, "cuda")  # not whole blocks
    monkeypatch.setenv("NINFER_Q6K_IL", "1")
    assert q6il_wanted("q6_k", 40, 256, "cuda")
    monkeypatch.setenv("NINFER_Q6K_IL", "0")
    assert not q6il_wanted("q6_k", 248320, 5120, "cuda")
    monkeypatch.setattr(q6il, "_compiles", lambda: False)
    monkeypatch.delenv("NINFER_Q6K_IL")
    assert not q6il_wanted("q6_k", 248320, 5120, "cuda")


def test_errors_name_the_problem():
    from ninfer.errors import NinferError
    from ninfer.kernels.gemv_q6il import gemv_q6il

    raw = random_gguf_weight("q6_k", 40, 512, generator=torch.Generator().manual_seed(1))
    words = repack_q6il(raw)
    x = torch.randn(2, 512)
    with pytest.raises(NinferError, match="one activation scale per 256"):
        gemv_q6il(words, quantize_activation_reference(x, 32), 40)
    with pytest.raises(NinferError, match="CUDA kernel"):
        gemv_q6il(words, quantize_activation_reference(x, 256), 40)
    with pytest.raises(NinferError, match="CUDA kernel"):
        q6il_matmul(words, x, 40)  # decode widths run only the kernel
    with pytest.raises(NinferError, match="repack_q6il"):
        gemv_q6il(words[:-32], quantize_activation_reference(x, 256), 40)

"""The q4_k tensor-core GEMV on its lane-per-row repack (ninfer/kernels/gemv_q4il.py): the layout,
the kernel's integer recipe in numpy lane by lane against the float64 twin, and (GPU) the kernel itself."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import kernels_only, needs_triton, ptx_mma_m16n8k32, word_bytes

from ninfer.kernels import gemv_il, gemv_q4il, gguf_matmul
from ninfer.kernels.gemv_q4il import (
    LAYOUT,
    PAIR_WORDS,
    SHAPES,
    gemv_q4il_reference,
    q4il_matmul,
    q4il_shape,
    repack_q4il,
    unpack_q4il,
)
from ninfer.kernels.gemv_q8 import gemv_q8_reference, quantize_activation_reference
from ninfer.kernels.gguf_matmul import QuantKernelError, quant_matmul_reference, random_gguf_weight


@pytest.mark.parametrize(("n", "k"), [(40, 768), (64, 1024), (33, 256)])
def test_repack_is_a_lossless_same_size_permutation(n, k):
    """Rows padded to 32 and blocks to an even count with zeros; on whole tiles and pairs the same bytes; qs
    first, then the scales, d | dmin last."""
    raw = random_gguf_weight("q4_k", n, k, generator=torch.Generator().manual_seed(n + k))
    words = repack_q4il(raw)
    tiles, pairs = LAYOUT.shape(n, k)
    assert PAIR_WORDS == 72 and words.dtype == torch.int32 and words.numel() == tiles * pairs * 72 * 32
    assert torch.equal(unpack_q4il(words, n, k), raw)
    assert torch.equal(repack_q4il(raw, chunk_rows=32), words)
    if n % 32 == 0 and (k // 256) % 2 == 0:
        assert words.numel() * 4 == raw.numel()
    w = words.view(tiles, pairs, 72, 32)
    row3 = raw[3].view(-1, 144)  # row 3's blocks
    assert torch.equal(w[0, 0, :32, 3].contiguous().view(torch.uint8), row3[0, 16:144])
    assert torch.equal(w[0, 0, 32:35, 3].contiguous().view(torch.uint8), row3[0, 4:16])
    assert torch.equal(w[0, 0, 70, 3:4].view(torch.uint8), row3[0, :4])


def _dp4a(a: np.ndarray, b: np.ndarray, c) -> np.ndarray:
    """PTX dp4a.s32.s32."""
    return (word_bytes(a, True) * word_bytes(b, True)).sum(-1) + c


def _f16(words: np.ndarray, shift: int) -> np.ndarray:
    half = ((words >> np.uint64(shift)) & np.uint64(0xFFFF)).astype(np.uint16)
    return half.view(np.float16).astype(np.float32)


@pytest.mark.parametrize(("n", "k", "columns"), [(40, 768, 3), (64, 512, 8), (32, 1024, 1)])
def test_the_kernels_integer_recipe_gives_the_twin(n, k, columns):
    """`q4k_il_mma` in numpy, lane by lane: rows 4g..4g + 3 of each 16-byte load; per pair of sub-blocks qs
    words 2t, 2t + 1 as the A fragments of two m16n8k32 (low nibbles & 0x0F0F0F0F, high & 0xF0F0F0F0, by
    PTX's fragment tables) against the activation words of the same inputs; the 6-bit scales by masks and a
    zero-extending prmt; the mins by four dp4a against the per-32 activation sums split 64·hi + lo; one float
    expression a block: equal to the float64 twin."""
    gen = torch.Generator().manual_seed(k + columns)
    raw = random_gguf_weight("q4_k", n, k, generator=gen)
    xa = quantize_activation_reference(torch.randn(columns, k, generator=gen), 256)
    tiles, pairs = LAYOUT.shape(n, k)
    w = repack_q4il(raw).numpy().view(np.uint32).reshape(tiles, pairs, 72, 32).astype(np.uint64)
    last = np.minimum(np.arange(8), columns - 1)  # lanes of columns past the last read the last
    xq = xa.q.numpy().astype(np.int64)[last]  # [8, k]
    xw = xa.words.numpy().astype(np.int64)[last] & 0xFFFFFFFF
    xd = xa.d.numpy().astype(np.float64)[last]
    sums = xq.reshape(8, k // 32, 32).sum(-1)
    hi, lo = sums >> 6, sums & 63  # each 32's sum as its producer splits it: 64 hi + lo
    assert np.all((hi >= -64) & (hi < 64)) and np.array_equal(64 * hi + lo, sums)
    split = xa.s.numpy().astype(np.int64)[last].reshape(8, k // 256, 2, 8)  # what the kernel reads
    assert np.array_equal(split[:, :, 0], hi.reshape(8, k // 256, 8))
    assert np.array_equal(split[:, :, 1], lo.reshape(8, k // 256, 8))

    def packed(v, j0):  # bytes j0..j0 + 3 of a block's 8 values as a word: [8 columns, blocks]
        b = v.reshape(8, k // 256, 8)[..., j0 : j0 + 4] & 0xFF
        return b[..., 0] | b[..., 1] << 8 | b[..., 2] << 16 | b[..., 3] << 24

    xs = [packed(hi, 0), packed(hi, 4), packed(lo, 0), packed(lo, 4)]
    lanes = np.arange(32)
    gq, t = lanes >> 2, lanes & 3
    c_of = [2 * t, 2 * t + 1]
    acc = np.zeros((tiles, 32, 4, 2))
    m0f, m3f, m4f = np.uint64(0x3F3F3F3F), np.uint64(0x30303030), np.uint64(0x0F0F0F0F)
    for kb in range(k // 256):
        p, h = divmod(kb, 2)
        words = w[:, p][:, :, 4 * gq[:, None] + np.arange(4)]  # [tile, word, lane, row r]
        bw = words[:, 35 * h : 35 * h + 35]
        s0, s1, s2 = bw[:, 32], bw[:, 33], bw[:, 34]  # [tile, lane, r]
        sl, sh = s0 & m0f, (s2 & m4f) | ((s0 >> np.uint64(2)) & m3f)
        ilo = np.zeros((tiles, 32, 4, 2), dtype=np.int64)
        ihi = np.zeros_like(ilo)
        for i in range(4):
            qa, qb = bw[:, 8 * i + 2 * t, lanes], bw[:, 8 * i + 2 * t + 1, lanes]  # [tile, lane, r]
            for nib, acc_i, mask in ((0, ilo, 0x0F0F0F0F), (1, ihi, 0xF0F0F0F0)):
                b = np.stack([xw[gq, kb * 64 + 16 * i + 8 * nib + 2 * t + e] for e in range(2)], axis=-1)
                m = np.uint64(mask)
                a = [np.stack([qa[..., 2 * mt] & m, qa[..., 2 * mt + 1] & m, qb[..., 2 * mt] & m,
                               qb[..., 2 * mt + 1] & m], axis=-1) for mt in range(2)]
                c = [ptx_mma_m16n8k32(a[mt], b, a_signed=False) for mt in range(2)]
                for r in range(4):
                    word = (sl if i < 2 else sh)[..., r]
                    scale = word_bytes(word, False)[..., (2 * i + nib) & 3]  # prmt 0x4440 + byte
                    for e in range(2):
                        acc_i[:, :, r, e] += c[r >> 1][..., 2 * (r & 1) + e] * scale
        dd = words[:, 70 + h]
        for r in range(4):
            ml = s1[..., r] & m0f
            mh = ((s2[..., r] >> np.uint64(4)) & m4f) | ((s1[..., r] >> np.uint64(2)) & m3f)
            d = _f16(dd[..., r], 0) * np.float32(0.0625)
            dmin = _f16(dd[..., r], 16)
            for e in range(2):
                col = np.minimum(c_of[e], columns - 1)
                v = [x[col, kb] for x in xs]
                msum = 64 * _dp4a(mh, v[1], _dp4a(ml, v[0], 0)) + _dp4a(mh, v[3], _dp4a(ml, v[2], 0))
                isum = (16 * ilo[:, :, r, e] + ihi[:, :, r, e]).astype(np.float32).astype(np.float64)
                value = d * isum - dmin * msum.astype(np.float32).astype(np.float64)
                acc[:, :, r, e] += value * xd[col, kb]
    y = np.zeros((8, tiles * 32))
    for e in range(2):
        rows = np.arange(tiles)[:, None, None] * 32 + 4 * gq[None, :, None] + np.arange(4)
        y[np.broadcast_to(c_of[e][None, :, None], rows.shape), rows] = acc[..., e]
    want = gemv_q8_reference(raw, "q4_k", xa, n).numpy()
    assert np.abs(y[:columns, :n] - want).max() <= 1e-5 * np.abs(want).max()


def test_shape_rule(monkeypatch):
    """The CTA shape whose last round of tiles is the fullest, the most CTAs on a tie; NINFER_Q4IL_SHAPE
    another for the matrices of fewer tiles than any shape's slots only, one of SHAPES."""
    monkeypatch.delenv("NINFER_Q4IL_SHAPE", raising=False)
    assert q4il_shape(1088, 132) == (5, 3)  # gate|up: 2.75 rounds of 396 against 4.12 of 264
    assert q4il_shape(515, 132) == (4, 4)  # 0.98 rounds of 528, 1.95 of 264
    assert q4il_shape(160, 132) == (8, 2)  # down: 0.61 of 264 against 0.40 of 396
    assert q4il_shape(792, 132) == (5, 3)  # 3 of 264 and 2 of 396: a tie
    monkeypatch.setenv("NINFER_Q4IL_SHAPE", "4x4")
    assert q4il_shape(160, 132) == (4, 4)
    assert q4il_shape(263, 132) == (4, 4)
    assert q4il_shape(264, 132) == (8, 2)  # fills the 8 × 2 slots: as the rule says
    assert q4il_shape(515, 132) == (4, 4)
    assert q4il_shape(1088, 132) == (5, 3)
    monkeypatch.setenv("NINFER_Q4IL_SHAPE", "6x2")
    with pytest.raises(QuantKernelError, match="one of 8x2, 5x3, 4x4"):
        q4il_shape(160, 132)


def test_the_cluster_rule(monkeypatch):
    """Clusters of 2 at 1-2 columns where they pay, for matrices whose tiles leave the default shape's slots
    idle, at the shape of the most warps whose slots hold every CTA; NINFER_Q4IL_CLUSTER=N clusters of N at
    every width (1: none), one CTA a tile where no shape holds them."""
    rule = gemv_q4il.q4il_cluster
    monkeypatch.delenv("NINFER_Q4IL_CLUSTER", raising=False)
    assert rule(160, 132, (8, 2), 1, True) == ((5, 3), 2)  # down's 160 tiles: 320 CTAs on 396 slots
    assert rule(160, 132, (8, 2), 2, True) == ((5, 3), 2)
    assert rule(160, 132, (8, 2), 3, True) == ((8, 2), 1)
    assert rule(160, 132, (8, 2), 1, False) == ((8, 2), 1)
    assert rule(1088, 132, (5, 3), 1, True) == ((5, 3), 1)  # gate|up fills its slots
    monkeypatch.setenv("NINFER_Q4IL_CLUSTER", "3")
    assert rule(160, 132, (8, 2), 8, False) == ((4, 4), 3)  # 480 CTAs on 528
    monkeypatch.setenv("NINFER_Q4IL_CLUSTER", "4")
    assert rule(160, 132, (8, 2), 1, True) == ((8, 2), 1)  # 640 CTAs fit no shape
    monkeypatch.setenv("NINFER_Q4IL_CLUSTER", "1")
    assert rule(160, 132, (8, 2), 1, True) == ((8, 2), 1)
    with pytest.raises(QuantKernelError, match="not staged"):
        gemv_q4il.kernel_source(1, 1, shape=(4, 4), staged=True, cluster=2)


def test_clusters_pay_on_devices_with_clusters_and_bandwidth_to_an_sm(monkeypatch):
    """Compute capability 9+ and ≥ 30 GB/s of memory bandwidth an SM (`gemv_il.wide_memory`, which also picks
    the next GEMV's prefetch): the H200 (4.8 TB/s on 132 SMs) yes, the H100 (3.35 TB/s) and an RTX 4090 (1
    TB/s, 8.9) no."""
    import types

    def props(major, clock_khz, bus_bits, sms):
        return types.SimpleNamespace(major=major, memory_clock_rate=clock_khz, memory_bus_width=bus_bits,
                                     multi_processor_count=sms)

    devices = {"h200": props(9, 3_201_000, 6144, 132), "h100": props(9, 2_619_000, 5120, 132),
               "4090": props(8, 10_501_000, 384, 128)}
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: devices[device])
    gemv_q4il.clusters_pay.cache_clear()
    gemv_il.wide_memory.cache_clear()
    try:
        assert [gemv_q4il.clusters_pay(d) for d in devices] == [True, False, False]
        assert [gemv_il.wide_memory(d) for d in devices] == [True, False, False]
        assert not gemv_il.wide_memory(torch.device("cpu"))
    finally:
        gemv_q4il.clusters_pay.cache_clear()
        gemv_il.wide_memory.cache_clear()


def test_the_staged_build_by_default(monkeypatch):
    """Staged at 1-`STAGED_COLUMNS` columns; NINFER_Q4IL_STAGED=0 / 1 never / always."""
    monkeypatch.delenv("NINFER_Q4IL_STAGED", raising=False)
    staged = gemv_q4il.q4il_staged
    most = gemv_q4il.STAGED_COLUMNS
    assert staged(1) and staged(most) and not staged(most + 1)
    monkeypatch.setenv("NINFER_Q4IL_STAGED", "0")
    assert not staged(1)
    monkeypatch.setenv("NINFER_Q4IL_STAGED", "1")
    assert staged(8)


def test_q4k_matrices_of_many_rows_take_the_layout(monkeypatch):
    """q4_k matrices of ≥ 5120 rows on CUDA where the kernel compiles; NINFER_Q4K_IL=0 none, =N those of
    ≥ N rows (1: every one)."""
    monkeypatch.setattr(gemv_q4il, "_compiles", lambda: True)
    monkeypatch.delenv("NINFER_Q4K_IL", raising=False)
    assert gemv_q4il.q4il_wanted("gguf_q4_k", 34816, 5120, "cuda")
    assert gemv_q4il.q4il_wanted("q4_k", 5120, 17408, "cuda:0")
    assert not gemv_q4il.q4il_wanted("q4_k", 4096, 12288, "cuda")
    assert not gemv_q4il.q4il_wanted("q6_k", 34816, 5120, "cuda")
    assert not gemv_q4il.q4il_wanted("q4_k", 34816, 5120, "cpu")
    assert not gemv_q4il.q4il_wanted("q4_k", 34816, 5000, "cuda")
    monkeypatch.setenv("NINFER_Q4K_IL", "1")
    assert gemv_q4il.q4il_wanted("q4_k", 40, 256, "cuda:0")
    monkeypatch.setenv("NINFER_Q4K_IL", "8192")  # a row threshold
    assert gemv_q4il.q4il_wanted("q4_k", 8192, 5120, "cuda")
    assert not gemv_q4il.q4il_wanted("q4_k", 5120, 6144, "cuda")
    monkeypatch.setenv("NINFER_Q4K_IL", "0")
    assert not gemv_q4il.q4il_wanted("gguf_q4_k", 34816, 5120, "cuda")
    monkeypatch.delenv("NINFER_Q4K_IL")
    monkeypatch.setattr(gemv_q4il, "_compiles", lambda: False)
    assert not gemv_q4il.q4il_wanted("q4_k", 34816, 5120, "cuda")


def test_q4il_matmul_prefill_runs_by_chunks(monkeypatch):
    monkeypatch.setattr(gguf_matmul, "PREFILL_ROWS", 64)
    n, k = 100, 768
    raw = random_gguf_weight("q4_k", n, k, generator=torch.Generator().manual_seed(5))
    x = torch.randn(20, k, generator=torch.Generator().manual_seed(6))
    assert torch.allclose(q4il_matmul(repack_q4il(raw), x, n), quant_matmul_reference(raw, "q4_k", x, n),
                          rtol=1e-5, atol=1e-5)


def test_a_decode_call_returns_the_gemvs_own_output():
    """Up to 8 columns a call is one GEMV and nothing after it: a copy of its output is a graph node that cost
    ~2 µs a GEMV in the decode graph and broke the launch overlap with the next kernel (gpu-notes "Session
    36"); 9-16 columns are two GEMVs, side by side in column order."""
    made = []

    def gemv(words, xa, out_features):
        seed = torch.Generator().manual_seed(len(made))
        made.append(torch.randn(xa.q.shape[0], out_features, generator=seed))
        return made[-1]

    words, k = torch.zeros(1, dtype=torch.int32), 512
    for columns in (1, 8):
        y = gemv_q4il.LAYOUT.matmul(words, torch.randn(1, columns, k), 40, gemv)
        assert y.shape == (1, columns, 40) and y.data_ptr() == made[-1].data_ptr()
    y = gemv_q4il.LAYOUT.matmul(words, torch.randn(11, k), 40, gemv)
    assert [m.shape[0] for m in made[-2:]] == [8, 3] and torch.equal(y, torch.cat(made[-2:]))


@needs_triton
@pytest.mark.parametrize(("n", "k"), [(40, 768), (64, 512)])
def test_the_triton_dequantisation_matches_the_reference(monkeypatch, n, k):
    """The prefill's one-pass decode of the q4il words (Triton's interpreter on the CPU) equals the GGUF rows
    dequantised by ninfer.quant; the prefill matmul takes it."""
    from ninfer.quant import dequantize

    kernels_only(monkeypatch, gemv_q4il, "dequantize_rows")
    raw = random_gguf_weight("q4_k", n, k, generator=torch.Generator().manual_seed(n + k))
    words = repack_q4il(raw)
    want = dequantize(raw.reshape(-1), "gguf_q4_k", (n, k))
    assert torch.equal(gemv_q4il.dequantize_q4il(words, n, k, torch.float32), want)
    x = torch.randn(20, k, generator=torch.Generator().manual_seed(1))
    assert torch.allclose(q4il_matmul(words, x, n), x @ want.t(), rtol=1e-5, atol=1e-5)


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.gpu
@pytest.mark.parametrize(("n", "k"), [(1040, 5120), (40, 768), (5120, 17408), (34816, 5120)])
def test_gemv_q4il_matches_its_twin_on_gpu(n, k):
    """1-8 columns, bf16 and fp32 outputs, padded rows and blocks, every CTA shape (the warps sharing a
    tile's 3, 20 or 68 blocks unevenly or not, CTAs taking one tile or several), each also staged (each warp's
    next block through shared memory: the same bits); 40 columns through the dequantised weight; in a CUDA
    graph the same bits as eager, staged too."""
    from ninfer.kernels.gemv_q4il import gemv_q4il
    from ninfer.kernels.gemv_q8 import quantize_activation

    words = repack_q4il(random_gguf_weight("q4_k", n, k, "cuda"))
    for width in range(1, 9):
        for dtype in (torch.bfloat16, torch.float32):
            xa = quantize_activation(torch.randn(width, k, device="cuda", dtype=dtype), group=256)
            want = gemv_q4il_reference(words, xa, n)
            for shape in SHAPES:
                out = gemv_q4il(words, xa, n, shape)
                # bf16 output rounding (2^-9) bounds the bf16 case; fp32 sums in another order
                assert rel(out, want) < (5e-3 if dtype == torch.bfloat16 else 1e-4), (width, dtype, shape)
                assert torch.equal(gemv_q4il(words, xa, n, shape, staged=True), out), (width, dtype, shape)
    from ninfer.quant import dequantize

    x = torch.randn(40, k, device="cuda", dtype=torch.bfloat16)  # prefill: the Triton dequantisation
    dense = dequantize(unpack_q4il(words, n, k).reshape(-1), "gguf_q4_k", (n, k)).double()
    assert rel(q4il_matmul(words, x, n), x.double() @ dense.t()) < 5e-3  # bf16 weights and output
    xa = quantize_activation(torch.randn(4, k, device="cuda"), group=256)
    for shape in SHAPES:
        for staged in (False, True):
            eager = gemv_q4il(words, xa, n, shape, staged=staged)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                captured = gemv_q4il(words, xa, n, shape, staged=staged)
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(captured, eager), (shape, staged)


@pytest.mark.gpu
@pytest.mark.parametrize(("n", "k"), [(5120, 17408), (5120, 6144), (1040, 5120), (40, 768)])
def test_gemv_q4il_in_clusters_on_gpu(n, k):
    """Clusters of 2 and 3 CTAs a tile (distributed shared memory, cluster barriers) at 1-8 columns, bf16 and
    fp32 outputs, on 4 × 4 (every CTA at once on the 27B's 5120-row matrices) and 5 × 3 (clusters of 3 loop
    over tiles there); in a CUDA graph the same bits as eager."""
    from ninfer.kernels.gemv_q4il import gemv_q4il
    from ninfer.kernels.gemv_q8 import quantize_activation

    words = repack_q4il(random_gguf_weight("q4_k", n, k, "cuda"))
    for width in range(1, 9):
        for dtype in (torch.bfloat16, torch.float32):
            xa = quantize_activation(torch.randn(width, k, device="cuda", dtype=dtype), group=256)
            want = gemv_q4il_reference(words, xa, n)
            for shape, cluster in (((4, 4), 2), ((4, 4), 3), ((5, 3), 3)):
                out = gemv_q4il(words, xa, n, shape, cluster=cluster)
                assert rel(out, want) < (5e-3 if dtype == torch.bfloat16 else 1e-4), (width, dtype, cluster)
    xa = quantize_activation(torch.randn(2, k, device="cuda"), group=256)
    eager = gemv_q4il(words, xa, n, (4, 4), cluster=2)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = gemv_q4il(words, xa, n, (4, 4), cluster=2)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, eager)


def test_errors_name_the_problem():
    from ninfer.errors import NinferError
    from ninfer.kernels.gemv_q4il import gemv_q4il

    raw = random_gguf_weight("q4_k", 40, 512, generator=torch.Generator().manual_seed(1))
    words = repack_q4il(raw)
    x = torch.randn(2, 512)
    with pytest.raises(NinferError, match="one activation scale per 256"):
        gemv_q4il(words, quantize_activation_reference(x, 32), 40)
    with pytest.raises(NinferError, match="CUDA kernel"):
        gemv_q4il(words, quantize_activation_reference(x, 256), 40)
    with pytest.raises(NinferError, match="repack_q4il"):
        gemv_q4il(words[:-32], quantize_activation_reference(x, 256), 40)

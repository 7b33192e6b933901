"""The lane-per-row iq3_s layout and GEMV (ninfer/kernels/gemv_il.py): the layout, the kernel's integer
recipe and the prefill path on the CPU; the CUDA kernel against its float64 twin on the GPU."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from conftest import assert_conv_ran, kernels_only, lane_conv_on_and_off, needs_triton, ptx_mma_m16n8k32

from ninfer.kernels import gemv_il
from ninfer.kernels.gemv_il import (
    dequantize_il32,
    il32_shape,
    il32_wanted,
    il_matmul,
    repack_il32,
    unpack_il32,
)
from ninfer.kernels.gemv_q8 import gemv_q8_reference, quantize_activation_reference
from ninfer.kernels.gguf_matmul import _tables, quant_matmul_reference, random_gguf_weight

# (rows, columns): whole tiles and pairs; rows and blocks padded (3 blocks); one block
SHAPES = [(64, 5120), (40, 768), (33, 256)]


@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_repack_is_a_lossless_same_size_permutation(n, k):
    gen = torch.Generator().manual_seed(n)
    raw = torch.randint(0, 256, (n, k // 256 * 110), dtype=torch.uint8, generator=gen)
    words = repack_il32(raw)
    tiles, pairs = il32_shape(n, k)
    assert words.dtype == torch.int32 and words.numel() == tiles * pairs * 55 * 32
    assert torch.equal(unpack_il32(words, n, k), raw)
    if n % 32 == 0 and k % 512 == 0:  # nothing padded: the very bytes, moved
        assert words.numel() * 4 == raw.numel()
        assert torch.equal(words.view(torch.uint8).sort().values, raw.reshape(-1).sort().values)


def test_a_warp_load_is_one_row_per_lane():
    """Word j of pair p of tile t for row r sits at ((t·P + p)·55 + j)·32 + r: word 54 holds both blocks' d,
    words 0-15 the first block's qs."""
    n, k = 64, 1024
    raw = random_gguf_weight("iq3_s", n, k)
    words = repack_il32(raw).view(2, 2, 55, 32)  # [tile, pair, word, lane]
    blocks = raw.view(n, 4, 110)
    for row in (0, 31, 45):
        t, r = divmod(row, 32)
        for p in range(2):
            d0, d1 = blocks[row, 2 * p, :2], blocks[row, 2 * p + 1, :2]
            assert words[t, p, 54, r].item() == torch.cat([d0, d1]).view(torch.int32).item()
            assert torch.equal(words[t, p, :16, r].contiguous().view(torch.uint8), blocks[row, 2 * p, 2:66])


def _prmt(a: np.ndarray, b: np.ndarray, sel: int) -> np.ndarray:
    """PTX prmt.b32: byte k of the result is byte (sel nibble k & 7) of {b:a}, sign-replicated if & 8."""
    v = (a.astype(np.uint64) & 0xFFFFFFFF) | ((b.astype(np.uint64) & 0xFFFFFFFF) << np.uint64(32))
    out = np.zeros(a.shape, dtype=np.uint64)
    for k in range(4):
        nib = (sel >> (4 * k)) & 15
        byte = (v >> np.uint64(8 * (nib & 7))) & np.uint64(0xFF)
        if nib & 8:
            byte = np.where(byte & np.uint64(0x80), np.uint64(0xFF), np.uint64(0))
        out |= byte << np.uint64(8 * k)
    return out


def _dp4a(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Σ of the 4 signed byte products (dp4a.s32.s32 with c = 0)."""
    def signed(x, k):
        return (((x.astype(np.int64) & 0xFFFFFFFF) >> (8 * k)) & 0xFF ^ 0x80) - 0x80
    return sum(signed(a, k) * signed(b, k) for k in range(4))


@pytest.mark.parametrize("group", [32, 256])
@pytest.mark.parametrize(("n", "k"), [(40, 768), (64, 1024)])
def test_the_kernels_integer_recipe_gives_the_twin(n, k, group):
    """The CUDA kernel's decode written out in numpy, step for step (9-bit index by one prmt of a qs word and
    the spread qh bits, grid word g from the table, sign bytes M by a multiply and a sign-replicating prmt;
    the signed word g ^ (M & 0xFEFEFEFE), as the grid's magnitudes are odd; one dp4a a column): equal to the
    float64 twin, padding blocks included. Group 256: one activation scale a block, the
    sub-block sums weighed by 1 + 2·scale in integers, one float product a block."""
    gen = torch.Generator().manual_seed(k)
    raw = random_gguf_weight("iq3_s", n, k, generator=gen)
    xa = quantize_activation_reference(torch.randn(2, k, generator=gen), group)
    tiles, pairs = il32_shape(n, k)
    w = repack_il32(raw).numpy().view(np.uint32).reshape(tiles, pairs, 55, 32)
    w = w.transpose(0, 3, 1, 2).reshape(tiles * 32, pairs, 55)  # [row, pair, word]
    grid = _tables(torch.device("cpu"))[1].numpy().view(np.uint32)
    xw, xd = xa.words.numpy(), xa.d.numpy().astype(np.float64)
    y = np.zeros((2, tiles * 32))
    zero = np.zeros(tiles * 32, dtype=np.uint32)
    for p in range(pairs):
        for h in range(2):
            sb0 = (2 * p + h) * 8
            if sb0 >= k // 32:
                break
            d = (w[:, p, 54] >> (16 * h) & 0xFFFF).astype(np.uint16).view(np.float16).astype(np.float64)
            isum = np.zeros((2, tiles * 32), dtype=np.int64)
            for j in range(8):
                qh = (w[:, p, 33 + 2 * h if j >= 4 else 32 + 2 * h] >> (8 * (j & 3))) & 0xFF
                ls = 1 + 2 * ((w[:, p, 52 + h] >> (4 * j)) & 15).astype(np.int64)
                s = np.zeros((2, tiles * 32), dtype=np.int64)
                for kw in range(8):  # grid word kw of the sub-block
                    hs = (((qh >> (4 * (kw >> 2))) & 15).astype(np.uint64) * 0x204081) & 0x01010101
                    idx = _prmt(w[:, p, 16 * h + 2 * j + (kw >> 2)], hs, 0xCC40 + 0x11 * (kw & 3))
                    g = grid[idx.astype(np.int64)].astype(np.uint64)
                    byte = _prmt(w[:, p, 36 + 8 * h + j], zero, 0x4440 + (kw >> 1))
                    mul = np.uint64(0x08040201 if kw & 1 else 0x80402010)
                    m8 = _prmt((byte * mul) & np.uint64(0xFFFFFFFF), zero, 0x89AB)
                    for m in range(2):
                        x = np.full(g.shape, xw[m, (sb0 + j) * 8 + kw], dtype=np.int64)
                        s[m] += _dp4a(g ^ (m8 & np.uint64(0xFEFEFEFE)), x)
                for m in range(2):
                    if group == 256:
                        isum[m] += ls * s[m]
                    else:
                        y[m] += d * ls * xd[m, sb0 + j] * s[m]
            if group == 256:
                for m in range(2):
                    y[m] += d * xd[m, sb0 // 8] * isum[m]
    want = gemv_q8_reference(raw, "iq3_s", xa, n).numpy()
    assert np.abs(y[:, :n] - want).max() <= 1e-12 * np.abs(want).max()


@pytest.mark.parametrize(("n", "k", "columns", "group"),
                         [(40, 768, 3, 32), (64, 512, 8, 32), (40, 768, 4, 256)])
def test_the_tensor_core_recipe_gives_the_twin(n, k, columns, group):
    """The mma kernel (`iq3s_il_mma`) in numpy, lane by lane: rows 4g..4g + 3 of each 16-byte load, the table
    offsets of grid words 2t, 2t + 1 (a prmt of the qs word and the qh bits spread a byte each, · 128) and
    this lane's copy (32 copies of the grid), the sign bytes' masks & 0xFE xor the word, the A/B
    fragments through PTX's m16n8k32 tables, the sums seeded with 1.5·2^23 and read back as floats: equal
    to the float64 twin. Group 256: one activation scale a block, the sub-block scales (1 + 2·nibble)
    weighing the integer sums, one float conversion a block."""
    gen = torch.Generator().manual_seed(k + columns)
    raw = random_gguf_weight("iq3_s", n, k, generator=gen)
    xa = quantize_activation_reference(torch.randn(columns, k, generator=gen), group)
    tiles, pairs = il32_shape(n, k)
    w = repack_il32(raw).numpy().view(np.uint32).reshape(tiles, pairs, 55, 32).astype(np.uint64)
    grid = _tables(torch.device("cpu"))[1].numpy().view(np.uint32).astype(np.uint64)
    table = grid.repeat(32)  # word i of copy c at i·32 + c
    # lanes of columns past the last read the last column (their outputs are never stored)
    last = np.minimum(np.arange(8), columns - 1)
    xw = xa.words.numpy().astype(np.int64)[last]
    xd = xa.d.numpy().astype(np.float64)[last]
    lanes = np.arange(32)
    gq, t = lanes >> 2, lanes & 3
    copy = (4 * lanes).astype(np.uint64)
    acc = np.zeros((tiles, 32, 4, 2))
    for kb in range(k // 256):
        p, h = divmod(kb, 2)
        words = w[:, p][:, :, 4 * gq[:, None] + np.arange(4)]  # [tile, word, lane, row r]
        d = (words[:, 54] >> np.uint64(16 * h) & np.uint64(0xFFFF)).astype(np.uint16).view(np.float16)
        isum = np.zeros((tiles, 32, 4, 2), dtype=np.int64)  # group 256: the block's weighted integer sums
        for j in range(8):
            qh = words[:, 32 + 2 * h + (j >> 2)]
            a = np.zeros((tiles, 32, 4, 2), dtype=np.uint64)  # [tile, lane, row r, word 2t / 2t + 1]
            for tt in range(4):
                on = t == tt
                qs, hq = words[:, 16 * h + 2 * j + (tt >> 1)][:, on], qh[:, on]
                sg = words[:, 36 + 8 * h + j][:, on]
                selj = (4 + (j & 3)) * 0x10 + (0xC + (j & 3)) * 0x1100
                bits = hq >> np.uint64(2 * tt)
                qhb = (bits & np.uint64(0x01010101), (bits >> np.uint64(1)) & np.uint64(0x01010101))
                offsets = [_prmt(qs, qhb[e], (2 * (tt & 1) + e) | selj) * 128 + copy[on, None]
                           for e in range(2)]
                sb = _prmt(sg, 0 * sg, 0x4440 + tt)
                for e, mul in enumerate((0x80402010, 0x08040201)):
                    entry = table[(offsets[e] // 4).astype(np.int64)]
                    m = _prmt((sb * np.uint64(mul)) & np.uint64(0xFFFFFFFF), 0 * sb, 0x89AB)
                    a[..., e][:, on] = entry ^ (m & np.uint64(0xFEFEFEFE))
            b = xw[gq[:, None], kb * 64 + 8 * j + 2 * t[:, None] + np.arange(2)]
            sums = [ptx_mma_m16n8k32(np.stack([a[:, :, 2 * mt, 0], a[:, :, 2 * mt + 1, 0], a[:, :, 2 * mt, 1],
                                               a[:, :, 2 * mt + 1, 1]], axis=-1), b, a_signed=True)
                    for mt in range(2)]
            for r in range(4):
                nib = (words[:, 52 + h][:, :, r] >> np.uint64(4 * j)) & np.uint64(15)
                if group == 256:
                    weight = 1 + 2 * nib.astype(np.int64)
                    for e in range(2):
                        isum[:, :, r, e] += sums[r >> 1][..., 2 * (r & 1) + e] * weight
                    continue
                dl = d[:, :, r].astype(np.float64) * (1 + 2 * nib.astype(np.float64))
                for e in range(2):
                    seeded = (0x4B400000 + sums[r >> 1][..., 2 * (r & 1) + e]).astype(np.uint32)
                    value = seeded.view(np.float32).astype(np.float64) - 12582912.0
                    acc[:, :, r, e] += value * dl * xd[2 * t + e, kb * 8 + j]
        if group == 256:
            for r in range(4):
                for e in range(2):
                    value = isum[:, :, r, e].astype(np.float32).astype(np.float64)  # exact: |sum| < 2^24
                    acc[:, :, r, e] += value * d[:, :, r].astype(np.float64) * xd[2 * t + e, kb]
    y = np.zeros((8, tiles * 32))
    for e in range(2):
        rows = np.arange(tiles)[:, None, None] * 32 + 4 * gq[None, :, None] + np.arange(4)
        y[(2 * t + e)[None, :, None].repeat(tiles, 0).repeat(4, 2), rows] = acc[..., e]
    want = gemv_q8_reference(raw, "iq3_s", xa, n).numpy()
    assert np.abs(y[:columns, :n] - want).max() <= 1e-12 * np.abs(want).max()


def test_prefill_unpacks_and_dequantises():
    """More than 16 columns: the weight unpacked to its GGUF rows and dequantised (runs on the CPU too)."""
    gen = torch.Generator().manual_seed(3)
    raw = random_gguf_weight("iq3_s", 40, 768, generator=gen)
    x = torch.randn(2, 10, 768, generator=gen)
    out = il_matmul(repack_il32(raw), x, 40)
    assert out.shape == (2, 10, 40)
    want = quant_matmul_reference(raw, "iq3_s", x, 40)
    assert (out - want).abs().max() <= 1e-4 * want.abs().max()


@needs_triton
def test_prefill_makes_the_dense_weight_a_piece_at_a_time(monkeypatch, triton_on_cpu_env):
    """A prefill matmul's dense weight is made `PREFILL_ROWS` rows at a time (a whole 27B gate|up in bf16 is
    340 MiB, a block the allocator's cache may not find room for beside a full KV pool): 100 rows in pieces
    of 64 and 36 (the second tile partial), il32 words and GGUF rows alike (Triton's dequantisation, on the
    CPU through its interpreter), each into the one buffer of `dense_piece`, the product the reference's."""
    from ninfer.kernels import gguf_matmul
    from ninfer.kernels.gguf_matmul import quant_matmul

    monkeypatch.setattr(gguf_matmul, "PREFILL_ROWS", 64)
    made = []
    for module, name in ((gemv_il, "dequantize_il32"), (gguf_matmul, "dequantize_rows")):
        real = getattr(module, name)
        def dense(*args, real=real, **kwargs):
            made.append(real(*args, **kwargs))
            return made[-1]

        monkeypatch.setattr(module, name, dense)
    gen = torch.Generator().manual_seed(4)
    n, k = 100, 512
    raw = random_gguf_weight("iq3_s", n, k, generator=gen)
    x = torch.randn(20, k, generator=gen)
    want = quant_matmul_reference(raw, "iq3_s", x, n)
    for out in (il_matmul(repack_il32(raw), x, n), quant_matmul(raw, "iq3_s", x, n, schedule="dequant_mm")):
        assert (out - want).abs().max() <= 1e-4 * want.abs().max()
    assert [w.shape for w in made] == [(64, k), (36, k)] * 2
    # every piece in the one buffer (`dense_piece`: no transient of each matrix's size for the allocator)
    assert len({w.untyped_storage().data_ptr() for w in made}) == 1
    gguf_matmul.release_dense_pieces()
    assert not gguf_matmul._DENSE_PIECES


@needs_triton
@pytest.mark.parametrize(("n", "k"), [(40, 768), (64, 512)])
def test_the_triton_dequantisation_matches_the_reference(monkeypatch, n, k):
    """The prefill's one-pass decode of the il32 words (Triton's interpreter on the CPU) equals the GGUF rows
    dequantised by ninfer.quant."""
    from ninfer.quant import dequantize

    kernels_only(monkeypatch, gemv_il, "dequantize_rows")
    raw = random_gguf_weight("iq3_s", n, k, generator=torch.Generator().manual_seed(n + k))
    out = dequantize_il32(repack_il32(raw), n, k, torch.float32)
    want = dequantize(raw.reshape(-1), "gguf_iq3_s", (n, k))
    assert torch.equal(out, want)


def test_the_kernels_keep_all_shared_memory_dynamic():
    """Both CUDA sources declare only their dynamic shared buffer: `_compiled` asks the driver for the whole
    opt-in size for it, which a static `__shared__` variable beside it makes an invalid argument (session 32
    run 3: every il32 launch failed on a 4-byte flag)."""
    import re

    for s in (gemv_il.il_schedule(1, 5120), gemv_il.il_schedule(8, 17408, 5120)):
        source = gemv_il.kernel_source(8 if s.kernel == "il_mma" else 1, 1, s, pdl=True)
        declared = re.findall(r"(?:extern\s+)?__shared__", source)
        assert declared == ["extern __shared__"], (s.name, declared)


def test_the_launch_structs_have_the_drivers_layout():
    """`cuLaunchKernelEx`'s CUlaunchConfig and CUlaunchAttribute as CUDA 12-13's cuda.h lays them out (the
    driver reads them by offset: a wrong one launches with garbage or fails)."""
    import ctypes

    config, attribute = gemv_il._LaunchConfig, gemv_il._LaunchAttribute
    assert ctypes.sizeof(config) == 56
    assert [config.stream.offset, config.attrs.offset, config.num_attrs.offset] == [32, 40, 48]
    assert ctypes.sizeof(attribute) == 72 and attribute.value.offset == 8


def test_which_weights_take_the_layout(monkeypatch):
    monkeypatch.setattr(gemv_il, "nvrtc_available", lambda: True)
    monkeypatch.delenv("NINFER_IQ3S_IL", raising=False)
    assert il32_wanted("gguf_iq3_s", 34816, 5120, "cuda")
    assert il32_wanted("iq3_s", 8192, 8192, "cuda:0")
    assert il32_wanted("iq3_s", 5120, 17408, "cuda")  # the 27B's down projection
    assert il32_wanted("iq3_s", 5120, 6144, "cuda")  # its output projections
    assert not il32_wanted("iq3_s", 4096, 4096, "cuda")
    assert not il32_wanted("q4_k", 34816, 5120, "cuda")
    assert not il32_wanted("iq3_s", 34816, 5120, "cpu")
    monkeypatch.setenv("NINFER_IQ3S_IL", "1")
    assert il32_wanted("iq3_s", 40, 256, "cuda")
    monkeypatch.setenv("NINFER_IQ3S_IL", "0")
    assert not il32_wanted("iq3_s", 34816, 5120, "cuda")
    monkeypatch.setattr(gemv_il, "nvrtc_available", lambda: False)
    monkeypatch.delenv("NINFER_IQ3S_IL")
    assert not il32_wanted("iq3_s", 34816, 5120, "cuda")


def test_the_activation_groups_the_kernels_take():
    """The il32 kernels take one activation scale per 32 or per 256 inputs; the activation's scales must
    match the schedule's group (a clear error, before any launch)."""
    from ninfer.errors import NinferError

    with pytest.raises(NinferError, match="groups of 64: the il32 kernels take 32 or 256"):
        gemv_il.IlSchedule(10, kernel="il_mma", group=64)
    assert gemv_il.il_schedule(2, 512, group=256).group == 256
    x = torch.randn(4, 512, generator=torch.Generator().manual_seed(2))
    xa = quantize_activation_reference(x, 256)
    assert xa.d.shape == (4, 2) and torch.allclose(xa.dequantize().float(), x, atol=float(xa.d.max()) / 2)
    with pytest.raises(NinferError, match="groups of 64"):
        quantize_activation_reference(x, 64)
    words = repack_il32(random_gguf_weight("iq3_s", 32, 512))
    g256 = gemv_il.IlSchedule(2, kernel="il_mma", group=256)
    with pytest.raises(NinferError, match="one activation scale per 256 inputs, got 16 over 512"):
        gemv_il.gemv_il(words, quantize_activation_reference(x), 32, g256)
    with pytest.raises(NinferError, match="one activation scale per 32 inputs, got 2 over 512"):
        gemv_il.gemv_il(words, xa, 32, gemv_il.il_schedule(4, 512))


def test_il_matmul_takes_groups_of_256_unless_told_32(monkeypatch):
    """By default every width (the dp4a kernel at 1-2 columns, the tensor-core kernel at 3-8, 9-16 in two
    calls) takes one activation scale per 256 inputs; with NINFER_IL_GROUP=32 one per 32."""
    seen = []

    def fake(words, xa, out_features, schedule=None, conv=None):
        seen.append((xa.q.shape[0], xa.d.shape[-1], schedule.group, schedule.kernel))
        return torch.zeros(xa.q.shape[0], out_features)

    monkeypatch.setattr(gemv_il, "gemv_il", fake)
    words = torch.zeros(1, dtype=torch.int32)
    for flag, columns, want in ((None, 1, [(1, 2, 256, "il")]), ("256", 4, [(4, 2, 256, "il_mma")]),
                                (None, 12, [(8, 2, 256, "il_mma"), (4, 2, 256, "il_mma")]),
                                ("32", 2, [(2, 16, 32, "il")]), ("32", 8, [(8, 16, 32, "il_mma")])):
        if flag is None:
            monkeypatch.delenv("NINFER_IL_GROUP", raising=False)
        else:
            monkeypatch.setenv("NINFER_IL_GROUP", flag)
        seen.clear()
        y = gemv_il.il_matmul(words, torch.randn(columns, 512), 40)
        assert y.shape == (columns, 40) and seen == want, (flag, columns, seen)


def test_the_dp4a_kernel_loads_its_first_block_before_or_after_its_wait(monkeypatch):
    """`IlSchedule.ahead`: the dp4a kernel's first block loaded before the programmatic launch's wait (1, the
    default `IL_AHEAD`) or after it (0: NINFER_IL_AHEAD=0); the tensor-core kernel's stays 1."""
    from ninfer.errors import NinferError

    monkeypatch.delenv("NINFER_IL_AHEAD", raising=False)
    assert gemv_il.il_schedule(1, 5120, 17408).ahead == gemv_il.IL_AHEAD
    monkeypatch.setenv("NINFER_IL_AHEAD", "0")
    assert gemv_il.il_schedule(1, 5120, 17408).ahead == 0 and gemv_il.il_schedule(2, 5120).ahead == 0
    assert gemv_il.il_schedule(4, 5120).ahead == 1
    assert "#define AHEAD 0" in gemv_il.kernel_source(1, 1, gemv_il.il_schedule(1, 5120))
    with pytest.raises(NinferError, match="0 blocks before the wait"):
        gemv_il.IlSchedule(10, kernel="il_mma", ahead=0)


def test_the_weight_loads_cache_hints_by_kernel(monkeypatch):
    """`evict_level`: the dp4a il32 kernel's weight loads at 2 by default, q4il's at 1, the tensor-core il32
    kernel's and the head's plain; NINFER_EVICT one level for every kernel or some kernels' own; the level
    reaches the build's `EVICT`."""
    kernels = ("il", "il_mma", "q4il", "q6il")
    monkeypatch.delenv("NINFER_EVICT", raising=False)
    assert [gemv_il.evict_level(k) for k in kernels] == [2, 0, 1, 0]
    monkeypatch.setenv("NINFER_EVICT", "1")
    assert [gemv_il.evict_level(k) for k in kernels] == [1, 1, 1, 1]
    monkeypatch.setenv("NINFER_EVICT", "q6il=2:il=1")
    assert [gemv_il.evict_level(k) for k in kernels] == [1, 0, 0, 2]
    for wrong in ("3", "il", "il=2:q6il", "il=first"):
        monkeypatch.setenv("NINFER_EVICT", wrong)
        with pytest.raises(gemv_il.QuantKernelError, match="NINFER_EVICT"):
            gemv_il.evict_level("il")
    source = gemv_il.kernel_source(1, 1, gemv_il.il_schedule(1, 5120), evict=2)
    assert "#define EVICT 2\n" in source and "ldw(wp + " in source


def test_only_few_long_tiles_are_split():
    """`mma_splits`: a tile's blocks go to several CTAs only where the tiles are fewer than the CTA slots and
    each warp keeps two blocks or more a piece (the 27B's down projection: 160 tiles of 68 blocks, 264 slots
    on an H200 -> 3 pieces); only the tensor-core kernel splits."""
    from ninfer.errors import NinferError

    assert gemv_il.mma_splits(160, 68, 10, 264) == 3  # down
    assert gemv_il.mma_splits(160, 24, 10, 264) == 1  # the output projections
    assert gemv_il.mma_splits(1088, 20, 10, 264) == 1  # gate|up
    assert gemv_il.mma_splits(40, 400, 10, 264) == 4
    assert gemv_il.il_schedule(4, 17408, 5120).splits == 3 and gemv_il.il_schedule(2, 17408, 5120).splits == 1
    assert gemv_il.il_schedule(8, 5120, 34816).splits == 1
    # few short rows (the output projections): 6 warps of 112 registers, three CTAs an SM, the tile in two
    short = gemv_il.il_schedule(4, 6144, 5120)
    assert (short.warps, short.regs, short.splits) == (6, 112, 2)
    assert gemv_il._ctas_per_sm(short, 4, 6144) == 3 and gemv_il.tile_ring(short, 4, 6144, 1) == 1
    assert gemv_il.il_schedule(4, 5120, 34816).warps == gemv_il.il_schedule(4, 17408, 5120).warps == 10
    assert gemv_il.il_schedule(8, 6144, 5120).warps == 10
    with pytest.raises(NinferError, match="split-K over CTAs is the tensor-core"):
        gemv_il.IlSchedule(10, splits=2)


def test_the_tile_ring_keeps_the_ctas_an_sm_holds():
    """A CTA of either kernel sums up to `most` of its tiles after one barrier (`_RING`; the launch caps the
    tensor-core kernel's at `_MMA_RING`), as many as its shared memory allows without costing the SM a CTA
    (the H200: 228 KB an SM, 227 KB a CTA)."""
    for columns in (1, 2, 4, 8):
        for k in (5120, 17408):
            s = gemv_il.il_schedule(columns, k, 34816)
            held = gemv_il._ctas_per_sm(s, columns, k)
            for tiles in (1, 2, 5, 40):
                ring = gemv_il.tile_ring(s, columns, k, tiles)
                assert 1 <= ring <= min(tiles, gemv_il._RING)
                smem = s.smem_bytes(columns, k, ring)
                assert smem <= 227 * 1024 and held * (smem + 1024) <= 228 * 1024, (columns, k, tiles, ring)
                if ring < min(tiles, gemv_il._RING):  # the next ring would not fit
                    assert held * (s.smem_bytes(columns, k, ring + 1) + 1024) > 228 * 1024
    assert gemv_il.tile_ring(gemv_il.il_schedule(1, 5120), 1, 5120, 5) == 5  # gate|up's tiles on the H200
    assert gemv_il.tile_ring(gemv_il.il_schedule(2, 17408, 34816), 2, 17408, 8) == 8  # 35 KB before the sums
    # the tensor-core kernel: 64 KB of tables and 10 KB of sums a tile, 2 CTAs an SM -> 4 of gate|up's 5 tiles
    assert gemv_il.tile_ring(gemv_il.il_schedule(4, 5120, 34816), 4, 5120, 5) == 4


# ---------------------------------------------------------------------------------------------------------
# GPU


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.gpu
@pytest.mark.parametrize(("n", "k"), [(1040, 5120), (17408, 5120), (40, 768), (8224, 2048)])
def test_gemv_il_matches_its_twin_on_gpu(n, k):
    """1-8 columns (the dp4a kernel at 1 and 2, the tensor-core kernel at 3-8), 12 through two calls, bf16 and
    fp32 outputs, padded rows and blocks; 40 columns through the dequantised weight; both kernels with one
    activation scale per 32 inputs and per 256 (a block); a CTA's tiles summed in a ring (17408 rows: 2-3
    tiles a CTA) the same bits as one at a time, in both kernels; the tensor-core kernel's tiles split into
    2-4 pieces across CTAs, the same bits on a second call; and both kernels captured in a CUDA graph, the
    same bits as eager; the dp4a kernel loading its first block before its wait or after, the same bits."""
    from ninfer.kernels import gemv_il as gemv_il_module
    from ninfer.kernels.gemv_il import gemv_il, gemv_il_reference
    from ninfer.kernels.gemv_q8 import quantize_activation

    raw = random_gguf_weight("iq3_s", n, k, "cuda")
    words = repack_il32(raw)
    for width in (1, 2, 3, 4, 8, 12):
        for dtype in (torch.bfloat16, torch.float32):
            x = torch.randn(width, k, device="cuda", dtype=dtype)
            xa = quantize_activation(x, group=gemv_il_module.il_group())  # the routed grouping
            want = gemv_il_reference(words, xa, n)
            out = il_matmul(words, x, n)
            # bf16 output rounding (2^-9) bounds the bf16 case; fp32 sums in another order: 1e-5 measured
            assert rel(out, want) < (5e-3 if dtype == torch.bfloat16 else 1e-4), (n, k, width, dtype)
    from ninfer.quant import dequantize

    x = torch.randn(40, k, device="cuda", dtype=torch.bfloat16)  # prefill: the Triton dequantisation
    dense = dequantize(raw.reshape(-1), "gguf_iq3_s", (n, k)).double()
    assert rel(il_matmul(words, x, n), x.double() @ dense.t()) < 5e-3
    for width in (1, 2, 3, 4, 8):  # one activation scale a block (IlSchedule.group 256), both kernels
        x = torch.randn(width, k, device="cuda")
        xa, want = quantize_activation(x, group=256), quantize_activation_reference(x, 256)
        assert torch.equal(xa.q, want.q) and torch.equal(xa.d, want.d), width
        s = gemv_il_module.il_schedule(width, k, n, group=256)
        # fp32 sums in another order, as above (7e-8 measured on the 27B's matrices, bench/il_group256.py)
        out = gemv_il(words, xa, n, s)
        assert rel(out, gemv_il_reference(words, xa, n)) < 1e-4, (n, k, width)
        if s.kernel == "il":  # the first block loaded before the wait or after: the same bits
            other = dataclasses.replace(s, ahead=1 - s.ahead)
            assert torch.equal(gemv_il(words, xa, n, other), out), (n, k, width)
    for width in (3, 4, 8):  # the tensor-core kernel's tiles split across CTAs: the pieces' sums in order
        xa = quantize_activation(torch.randn(width, k, device="cuda"), group=256)
        want = gemv_il_reference(words, xa, n)
        for splits in (2, 3, 4):
            s = dataclasses.replace(gemv_il_module.il_schedule(width, k, n, group=256), splits=splits)
            once = gemv_il(words, xa, n, s)
            assert rel(once, want) < 1e-4, (n, k, width, splits)
            assert torch.equal(gemv_il(words, xa, n, s), once), (n, k, width, splits)  # counts left zero
    for width in (1, 2, 4):  # the tiles summed one at a time: the same sums in the same order
        xa = quantize_activation(torch.randn(width, k, device="cuda", dtype=torch.bfloat16))
        ringed = gemv_il(words, xa, n)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr("ninfer.kernels.gemv_il._RING", 1)
            mp.setattr("ninfer.kernels.gemv_il._MMA_RING", 1)
            assert torch.equal(gemv_il(words, xa, n), ringed), width
    for width, splits in ((1, 1), (4, 1), (4, 3), (8, 3)):
        xa = quantize_activation(torch.randn(width, k, device="cuda", dtype=torch.bfloat16))
        s = dataclasses.replace(gemv_il_module.il_schedule(width, k, n), splits=splits)
        eager = gemv_il(words, xa, n, s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = gemv_il(words, xa, n, s)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, eager), width



@pytest.mark.gpu
@pytest.mark.parametrize(("kind", "lanes", "positions"), [
    ("il32", 1, 1), ("il32", 2, 1), ("il32", 4, 1), ("il32", 8, 1), ("q4il", 1, 1), ("q4il", 4, 1),
    ("q4il", 8, 1), ("il32", 1, 2), ("il32", 1, 4), ("il32", 2, 4), ("q4il", 1, 4), ("q4il", 2, 4)])
def test_the_gdn_conv_in_the_gemvs_epilogue_on_gpu(kind, lanes, positions, monkeypatch):
    """The 27B's GDN input projection at one token a lane, and over a verification's 2-4 positions a lane,
    runs the decode conv of its first 10240 outputs in its epilogue (`lane_conv`, NINFER_LANE_CONV_COLUMNS=8;
    NINFER_LANE_CONV=0 turns it off): the output the same bits as without, each lane's conv outputs and slot
    as `conv_epilogue_store`'s arithmetic on them position after position, the other slots untouched."""
    from ninfer.kernels import gemv_q4il
    from ninfer.kernels.gdn_decode import ConvEpilogue

    monkeypatch.setenv("NINFER_LANE_CONV_COLUMNS", "8")
    monkeypatch.setenv("NINFER_LANE_CONV_SPANS", "1")  # the tensor-core il32 kernel's span build too
    n, k, c = 16480, 5120, 10240
    raw = random_gguf_weight("iq3_s" if kind == "il32" else "q4_k", n, k, "cuda")
    words, matmul = ((repack_il32(raw), il_matmul) if kind == "il32"
                     else (gemv_q4il.repack_q4il(raw), gemv_q4il.q4il_matmul))
    x = torch.randn(lanes * positions, k, device="cuda").to(torch.bfloat16)
    ids = torch.randperm(lanes + 2)[:lanes].cuda()  # int64, as the decode graphs'
    conv = ConvEpilogue.of(torch.randn(c, 4, device="cuda"), torch.randn(lanes + 2, c, 3, device="cuda"), ids,
                           positions)
    before = conv.slots.clone()
    y = lane_conv_on_and_off(monkeypatch, matmul, words, x, n, conv)
    assert_conv_ran(y, conv, before, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("columns", [1, 2, 4, 8])
def test_the_next_gemvs_weights_asked_into_l2_on_gpu(columns, monkeypatch):
    """NINFER_NEXT_PREFETCH=KB (`next_prefetch`): a round of an il32, a q4il and a q6il GEMV, each prefetching
    the next one's first bytes (a few KiB, or more than the whole tensor: all of it; as one prefix or spread
    over the next launch's first tiles) as its CTAs finish — eager and captured in a CUDA graph, the same
    bits as without."""
    from ninfer.kernels import gemv_il as gemv_il_module
    from ninfer.kernels import gemv_q4il, gemv_q6il
    from ninfer.kernels.gemv_q8 import quantize_activation

    k = 5120
    words = [repack_il32(random_gguf_weight("iq3_s", 16480, k, "cuda")),
             gemv_q4il.repack_q4il(random_gguf_weight("q4_k", 5120, k, "cuda")),
             gemv_q6il.repack_q6il(random_gguf_weight("q6_k", 8192, k, "cuda"))]
    s = gemv_il_module.il_schedule(columns, k, 16480, 256)
    calls = [lambda w, xa: gemv_il_module.gemv_il(w, xa, 16480, s),
             lambda w, xa: gemv_q4il.gemv_q4il(w, xa, 5120), lambda w, xa: gemv_q6il.gemv_q6il(w, xa, 8192)]
    xa = quantize_activation(torch.randn(columns, k, device="cuda", dtype=torch.bfloat16), group=256)
    monkeypatch.setenv("NINFER_NEXT_PREFETCH", "0")
    want = [call(w, xa) for call, w in zip(calls, words, strict=True)]
    for kb, spread in (("4", "0"), ("1048576", "0"), ("8192", "1")):
        monkeypatch.setenv("NINFER_NEXT_PREFETCH", kb)
        monkeypatch.setenv("NINFER_NEXT_PREFETCH_SPREAD", spread)
        for _ in range(2):
            assert all(torch.equal(call(w, xa), y) for call, w, y in zip(calls, words, want, strict=True)), kb
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = [call(w, xa) for call, w in zip(calls, words, strict=True)]
        graph.replay()
        torch.cuda.synchronize()
        assert all(torch.equal(a, b) for a, b in zip(captured, want, strict=True)), kb


@pytest.mark.gpu
def test_split_il32_calls_leave_the_adding_kernels_workspace_zero():
    """The split tensor-core il32 kernel stores its pieces' sums in slots it leaves behind; the split-K
    kernels that add into a zeroed workspace (here gemv_frag on the 27B's q4_k gate|up) must not find them
    there (they did, through one shared workspace: 0.54 relative error at 8 columns)."""
    from ninfer.kernels import gemv_il as gemv_il_module
    from ninfer.kernels.gemv_frag import gemv_frag
    from ninfer.kernels.gemv_q8 import quantize_activation

    n, k = 17408, 5120
    words = repack_il32(random_gguf_weight("iq3_s", n, k, "cuda"))
    raw = random_gguf_weight("q4_k", 34816, k, "cuda")
    s = dataclasses.replace(gemv_il_module.il_schedule(8, k, n, group=256), splits=4)
    for _ in range(2):
        gemv_il_module.gemv_il(words, quantize_activation(torch.randn(8, k, device="cuda"), group=256), n, s)
        xa = quantize_activation(torch.randn(8, k, device="cuda", dtype=torch.bfloat16))
        out = gemv_frag(raw, "q4_k", xa, 34816, "frag_w2_r1_m8_s4")  # the routed 8-column schedule
        assert rel(out, gemv_q8_reference(raw, "q4_k", xa, 34816)) < 5e-3  # bf16 output rounding

def test_a_linear_asks_its_producer_for_its_kernels_grouping(monkeypatch):
    """`Linear.activation_group`: the il32 layout's grouping (256, 32 with NINFER_IL_GROUP=32), 32 for the
    other layouts; a merged projection asks for its largest matmul's."""
    from types import SimpleNamespace

    from ninfer.models.weights import Linear, MergedLinear

    il32, gguf = SimpleNamespace(layout="il32"), SimpleNamespace(layout="gguf")
    monkeypatch.delenv("NINFER_IL_GROUP", raising=False)
    assert Linear.activation_group(il32) == 256 and Linear.activation_group(gguf) == 32
    merged = SimpleNamespace(groups=[SimpleNamespace(out_features=96, activation_group=lambda: 32),
                                     SimpleNamespace(out_features=16384, activation_group=lambda: 256)])
    assert MergedLinear.activation_group(merged) == 256
    monkeypatch.setenv("NINFER_IL_GROUP", "32")
    assert Linear.activation_group(il32) == 32


def test_lane_conv_takes_a_row_a_position_up_to_its_column_limit(monkeypatch):
    """`lane_conv` hands the conv to the GEMV for bf16 rows, one a position of the conv's lanes, at most
    `LANE_CONV_COLUMNS` (NINFER_LANE_CONV_COLUMNS another count, at most the GEMVs' 8); never under
    NINFER_LANE_CONV=0, for a float32 row, or for rows that are not the conv's positions; spans of several
    positions a lane in `span_kernels()`: the dp4a il32 and the q4il GEMVs, not the tensor-core il32 one
    (NINFER_LANE_CONV_SPANS=0 none, =1 all, or names)."""
    from ninfer.kernels.gdn_decode import ConvEpilogue

    monkeypatch.delenv("NINFER_LANE_CONV", raising=False)
    monkeypatch.delenv("NINFER_LANE_CONV_COLUMNS", raising=False)
    monkeypatch.delenv("NINFER_LANE_CONV_SPANS", raising=False)
    c, n, k = 64, 96, 256

    def conv_of(lanes: int) -> ConvEpilogue:
        return ConvEpilogue.of(torch.randn(c, 4), torch.randn(lanes + 1, c, 3), torch.arange(lanes))

    def rows(lanes: int, dtype=torch.bfloat16) -> torch.Tensor:
        return torch.randn(lanes, k).to(dtype)

    one, four, nine = conv_of(1), conv_of(4), conv_of(9)
    assert gemv_il.LANE_CONV_COLUMNS == 8
    assert gemv_il.lane_conv(one, rows(1), n, "il") is one
    assert gemv_il.lane_conv(four, rows(4), n, "il") is four
    monkeypatch.setenv("NINFER_LANE_CONV_COLUMNS", "1")
    assert gemv_il.lane_conv(one, rows(1), n, "il") is one
    assert gemv_il.lane_conv(four, rows(4), n, "il") is None
    monkeypatch.setenv("NINFER_LANE_CONV_COLUMNS", "4")
    assert gemv_il.lane_conv(four, rows(4), n, "il") is four
    assert gemv_il.lane_conv(four, rows(3), n, "il") is None  # not the lanes (a span's positions)
    assert gemv_il.lane_conv(four, rows(4, torch.float32), n, "il") is None
    assert gemv_il.lane_conv(four, rows(4), c - 1, "il") is None  # fewer outputs than conv channels
    monkeypatch.setenv("NINFER_LANE_CONV_COLUMNS", "16")
    assert gemv_il.lane_conv(nine, rows(9), n, "il") is None  # past the GEMVs' 8 columns
    # a verification's spans: a row a position, T a lane (span_kernels(); NINFER_LANE_CONV_SPANS)
    monkeypatch.delenv("NINFER_LANE_CONV_COLUMNS")
    spans = ConvEpilogue.of(torch.randn(c, 4), torch.randn(3, c, 3), torch.tensor([2, 0]), positions=4)
    assert spans.positions == 4 and spans.out.shape == (8, c)
    assert gemv_il.lane_conv(spans, rows(8), n, "il") is spans
    assert gemv_il.lane_conv(spans, rows(8), n, "q4il") is spans
    assert gemv_il.lane_conv(spans, rows(8), n, "il_mma") is None  # not by default: measured slower
    assert gemv_il.lane_conv(four, rows(4), n, "il_mma") is four  # one position a lane: every kernel
    assert gemv_il.lane_conv(spans, rows(2), n, "il") is None  # a row a lane, not a position
    monkeypatch.setenv("NINFER_LANE_CONV_SPANS", "1")
    assert gemv_il.lane_conv(spans, rows(8), n, "il_mma") is spans
    monkeypatch.setenv("NINFER_LANE_CONV_SPANS", "il_mma")
    assert gemv_il.lane_conv(spans, rows(8), n, "il_mma") is spans
    assert gemv_il.lane_conv(spans, rows(8), n, "il") is None
    monkeypatch.setenv("NINFER_LANE_CONV_SPANS", "0")
    assert gemv_il.lane_conv(spans, rows(8), n, "il") is None
    assert gemv_il.lane_conv(four, rows(4), n, "il") is four  # one position a lane regardless
    monkeypatch.setenv("NINFER_LANE_CONV", "0")
    assert gemv_il.lane_conv(one, rows(1), n, "il") is None


def test_the_next_gemv_is_the_one_launched_after_it_last_time(monkeypatch):
    """`next_prefetch`: each call notes its words as the next of the previous call's (a new order replaces the
    old), and with NINFER_NEXT_PREFETCH=KB returns its own next words with runs of 16-byte multiples over
    their first min(KB KiB, bytes): one a CTA, or (NINFER_NEXT_PREFETCH_SPREAD=1) a share at the start of
    each tile the next launch starts on; none while off (nothing learned), through the first round, or
    once the next words are gone; NINFER_NEXT_PREFETCH=kernel=KB pairs: runs for those kernels alone, the
    order learned from every kernel's calls."""
    monkeypatch.setattr(gemv_il, "_after", {})
    monkeypatch.setattr(gemv_il, "_latest", [None])
    monkeypatch.setattr(gemv_il, "_first", {})
    monkeypatch.delenv("NINFER_NEXT_PREFETCH_SPREAD", raising=False)
    a, b, c = torch.zeros(1000, dtype=torch.int32), torch.zeros(30, dtype=torch.uint8), torch.zeros(8000)
    geometry = {id(a): (3, 1, 1), id(b): (2, 1, 1), id(c): (4, 4, 2)}  # CTAs, tiles, tiles started on
    kernel = {id(a): "il", id(b): "il_mma", id(c): "q4il"}
    call = lambda w: gemv_il.next_prefetch(kernel[id(w)], w, *geometry[id(w)])  # noqa: E731
    monkeypatch.setenv("NINFER_NEXT_PREFETCH", "0")
    assert [call(w) for w in (a, b, c)] == [[], [], []]
    monkeypatch.setenv("NINFER_NEXT_PREFETCH", "2")
    assert [call(w) for w in (a, b, c)] == [[], [], []]  # the first round with it on teaches the order
    got = [call(w) for w in (a, b, c)]
    # [next words, cut at, stride, run, runs]: 30 bytes -> 16, one run; 2048 bytes on 2 / 4 / 3 CTAs
    assert got[0][0] is b and got[0][1:] == [16, 16, 16, 1]
    assert got[1][0] is c and got[1][1:] == [2048, 1024, 1024, 2]
    assert got[2][0] is a and got[2][1:] == [2048, 512, 512, 4]
    monkeypatch.setenv("NINFER_NEXT_PREFETCH_SPREAD", "1")
    # c's 32,000 bytes are 4 tiles of 8,000, its launch starts on 2: 1,024 bytes at the start of each
    assert call(b)[1:] == [32000, 8000, 1024, 2]
    call(c)
    assert call(a)[1:] == [16, 16, 16, 1]  # b: one tile of 16 bytes
    monkeypatch.delenv("NINFER_NEXT_PREFETCH_SPREAD")
    monkeypatch.setenv("NINFER_NEXT_PREFETCH", "q4il=2:il=1")
    got = [call(w) for w in (a, b, c)]
    assert got[0][0] is b and got[1] == [] and got[2][0] is a and got[2][1:] == [2048, 512, 512, 4]
    monkeypatch.setenv("NINFER_NEXT_PREFETCH", "il_mma=2")  # b's next (c) learned while b's own was off
    assert call(b)[0] is c
    for wrong in ("q4il", "q4il=-1", "mma=2", "il=2:q4il"):
        monkeypatch.setenv("NINFER_NEXT_PREFETCH", wrong)
        with pytest.raises(gemv_il.QuantKernelError, match="NINFER_NEXT_PREFETCH"):
            call(a)
    monkeypatch.delenv("NINFER_NEXT_PREFETCH")  # the default: 8 MiB from il, q4il and q6il, none from il_mma
    got = [call(w) for w in (a, b, c)]
    # (c's next is b: the round before ended c, b)
    assert got[0][0] is b and got[1] == [] and got[2][0] is b and got[2][1:] == [16, 16, 16, 1]
    monkeypatch.setattr(gemv_il, "wide_memory", lambda device: True)  # an H200's SMs: q4il's alone
    got = [call(w) for w in (a, b, c)]
    assert got[0] == [] and got[1] == [] and got[2][0] is a and got[2][1:] == [4000, 1008, 1008, 4]
    monkeypatch.setenv("NINFER_NEXT_PREFETCH", "2")
    call(a), call(c)  # a -> c now
    assert call(a)[0] is c
    del c, got
    assert call(a) == []  # (a again: nothing noted) its next is gone

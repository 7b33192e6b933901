"""Paged decode attention kernel (Triton interpreter on CPU) vs the reference on the same stored KV bytes."""

from __future__ import annotations

import pytest
import torch
from conftest import kernels_only, needs_triton

import ninfer.kernels.paged_attention
from ninfer.errors import NinferError
from ninfer.kernels import kv_quant
from ninfer.kernels.paged_attention import paged_decode_attention, paged_decode_attention_reference


@pytest.fixture(autouse=True)
def _triton_on_cpu(monkeypatch):
    kernels_only(monkeypatch, ninfer.kernels.paged_attention, "paged_decode_attention_reference")


def filled_pool(gen, fmt, lens, kv_heads, pages_total=12):
    """A KV pool with random K/V for sequences of `lens` tokens on shuffled pages; returns storage, tables."""
    D = fmt.head_dim
    storage = torch.randint(0, 256, (pages_total, kv_heads, 64, fmt.token_bytes), dtype=torch.uint8,
                            generator=gen)  # garbage beyond each sequence's length must be ignored
    free = torch.randperm(pages_total, generator=gen).tolist()
    tables = torch.full((len(lens), 4), -1, dtype=torch.int32)
    for lane, n in enumerate(lens):
        for i in range(-(-n // 64)):
            page = free.pop()
            tables[lane, i] = page
            k = torch.randn(kv_heads, 64, D, generator=gen)
            v = torch.randn(kv_heads, 64, D, generator=gen)
            storage[page] = kv_quant.encode_kv(fmt, k, v)
    return storage, tables


@needs_triton
@pytest.mark.parametrize("name", ["bf16", "int8", "rk8v4", "rk4v4"])
def test_kernel_matches_reference(name):
    gen = torch.Generator().manual_seed(len(name))
    fmt = kv_quant.kv_format(name, 64)
    lens = [70, 5, 130]
    storage, tables = filled_pool(gen, fmt, lens, kv_heads=2)
    lane_ids = torch.tensor([2, 0, 1], dtype=torch.int32)  # batch rows map to lanes out of order
    seq_lens = torch.tensor([lens[2], lens[0], lens[1]], dtype=torch.int32)
    q = torch.randn(3, 6, 64, generator=gen)  # 6 query heads on 2 KV heads (GQA 3)
    ref = paged_decode_attention_reference(q, storage, tables, lane_ids, seq_lens, fmt)
    # one split per sequence; one per page; at most two splits, so that a sequence of 3 pages
    # takes runs of 2 and 1 and one of 2 pages a page each (runs found from the length in both kernels)
    # (and at most 7 or 6 programs over the 6 sequence × KV-head pairs: two splits, then one a sequence)
    for per_split, max_splits, programs in ((4, 64, 0), (1, 64, 0), (1, 2, 0), (1, 64, 7), (1, 64, 6)):
        out = paged_decode_attention(q, storage, tables, lane_ids, seq_lens, fmt, pages_per_split=per_split,
                                     max_splits=max_splits, max_programs=programs)
        # same decoded values, fp32 softmax in another order: measured 1.6e-7..2.6e-7
        err = float((out - ref).norm() / ref.norm())
        assert err < 1e-5, (name, per_split, max_splits, programs, err)


def test_decode_splits():
    """Runs across the page table's width, at most the cap, and with a program budget at most enough for it
    (one at least): the 27B's 4 KV heads under the suite's context (259 pages wide)."""
    from ninfer.kernels.paged_attention import decode_splits

    assert decode_splits(259, 32, 2, 64, 0) == 64  # 8 lanes, no budget: 2,048 programs
    assert decode_splits(259, 32, 2, 64, 512) == 16  # 8 lanes: 512
    assert decode_splits(259, 16, 2, 64, 512) == 32
    assert decode_splits(259, 4, 2, 64, 512) == 64  # one lane: as without
    assert decode_splits(64, 4, 2, 64, 512) == 32  # a narrower table: its runs
    assert decode_splits(259, 1024, 2, 64, 512) == 1
    assert decode_splits(3, 6, 1, 2, 7) == 2 and decode_splits(3, 6, 1, 64, 6) == 1


@needs_triton
@pytest.mark.parametrize(("dtype", "dim", "group"), [(torch.float32, 64, 32), (torch.bfloat16, 64, 32),
                                                   (torch.float32, 256, 256)])
def test_output_gate_in_the_merge_launch(dtype, dim, group, monkeypatch):
    """The gate applied by the merge kernel: fp32 bit for bit the attention then `fused.sigmoid_gate_mul`'s
    kernel; bf16 against the references (the interpreter's plain bf16 store truncates, so not against the
    ungated kernel); with the int8 activation asked for, exactly `quantize_activation_reference` of the gated
    rows, in groups of 32 or of a whole head (256); none where a group would span heads."""
    from ninfer.kernels import fused, gemv_q8

    monkeypatch.setenv("NINFER_TRITON_ON_CPU", "1")
    gen = torch.Generator().manual_seed(3)
    fmt = kv_quant.kv_format("bf16", dim)
    lens = [70, 130]
    storage, tables = filled_pool(gen, fmt, lens, kv_heads=2)
    lane_ids, seq_lens = torch.tensor([1, 0], dtype=torch.int32), torch.tensor([130, 70], dtype=torch.int32)
    q = torch.randn(2, 6, dim, generator=gen).to(dtype)
    merged = torch.randn(2, 6 * dim + 16, generator=gen).to(dtype)
    gate = merged[:, 16:]  # a column view of a merged projection
    attn = paged_decode_attention(q, storage, tables, lane_ids, seq_lens, fmt, pages_per_split=1)
    want = fused.sigmoid_gate_mul(attn.reshape(2, -1), gate)
    got = paged_decode_attention(q, storage, tables, lane_ids, seq_lens, fmt, pages_per_split=1, gate=gate)
    assert got.shape == (2, 6 * dim)
    if dtype == torch.float32:
        assert torch.equal(got, want)
    else:
        ref = paged_decode_attention_reference(q, storage, tables, lane_ids, seq_lens, fmt)
        want = fused.sigmoid_gate_mul_reference(ref.reshape(2, -1), gate)
        # measured: equal; the softmax's fp32 order may move a rounding boundary, by one ulp
        torch.testing.assert_close(got, want, rtol=2.0**-7, atol=0)
        assert (got != want).float().mean() <= 0.01
    monkeypatch.setattr(gemv_q8, "int8_next", lambda x, group=32: True)
    got = paged_decode_attention(q, storage, tables, lane_ids, seq_lens, fmt, pages_per_split=1, gate=gate,
                                 group=group)
    assert gemv_q8._MEMO.ref() is got
    memo = gemv_q8.quantize_activation_cached(got, group)
    ref = gemv_q8.quantize_activation_reference(got, group)
    assert torch.equal(memo.q, ref.q) and torch.equal(memo.d, ref.d) and torch.equal(memo.s, ref.s)
    gemv_q8._MEMO.clear()
    if dim < 256:
        got = paged_decode_attention(q, storage, tables, lane_ids, seq_lens, fmt, gate=gate, group=256)
        assert gemv_q8._MEMO.ref is None  # groups of 256 would span heads: the Linear quantises
    with pytest.raises(NinferError, match="output gate"):
        paged_decode_attention(q, storage, tables, lane_ids, seq_lens, fmt, gate=gate[:, :64])


def test_decode_pages_asked_into_l2_up_to_a_budget(monkeypatch):
    monkeypatch.delenv("NINFER_ATTN_PREFETCH_MIB", raising=False)
    assert ninfer.kernels.paged_attention.decode_prefetch() == ninfer.kernels.paged_attention.PREFETCH_BYTES
    monkeypatch.setenv("NINFER_ATTN_PREFETCH_MIB", "64")
    assert ninfer.kernels.paged_attention.decode_prefetch() == 64 << 20
    monkeypatch.setenv("NINFER_ATTN_PREFETCH_MIB", "0")
    assert ninfer.kernels.paged_attention.decode_prefetch() == 0


def test_mismatched_pool_is_a_user_error():
    fmt = kv_quant.kv_format("int8", 64)
    storage = torch.zeros(2, 2, 64, 100, dtype=torch.uint8)
    with pytest.raises(NinferError, match="do not match --kv-dtype int8"):
        paged_decode_attention(torch.randn(1, 4, 64), storage, torch.zeros(1, 2, dtype=torch.int32),
                               torch.zeros(1, dtype=torch.int32), torch.ones(1, dtype=torch.int32), fmt)

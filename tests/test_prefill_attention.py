"""Prefill (flash) attention kernel (Triton interpreter on CPU) vs its reference on the same stored KV bytes,
and the engine's batch context routing prefill spans through it."""

from __future__ import annotations

import pytest
import torch
from conftest import kernels_only, needs_triton

import ninfer.kernels.prefill_attention as pf
from ninfer.errors import NinferError
from ninfer.kernels import kv_quant
from ninfer.kernels.prefill_attention import prefill_attention


@pytest.fixture
def kernel_only(monkeypatch):
    """The Triton kernel itself (interpreter) on CPU tensors; returns the reference (the oracle)."""
    return kernels_only(monkeypatch, pf, "prefill_attention_reference")


def span_pool(gen, fmt, tokens, kv_heads, spare_pages=3, lanes=2, lane=1):
    """Random K/V for `tokens` positions of `lane` on shuffled pages among garbage pages; storage, tables."""
    pages = -(-tokens // 64)
    total = pages + spare_pages
    storage = torch.randint(0, 256, (total, kv_heads, 64, fmt.token_bytes), dtype=torch.uint8, generator=gen)
    order = torch.randperm(total, generator=gen)[:pages]
    tables = torch.full((lanes, pages + 2), -1, dtype=torch.int32)
    tables[lane, :pages] = order.to(torch.int32)
    k = torch.randn(pages * 64, kv_heads, fmt.head_dim, generator=gen)
    v = torch.randn(pages * 64, kv_heads, fmt.head_dim, generator=gen)
    rows = kv_quant.encode_kv(fmt, k, v)[:tokens]  # positions past `tokens` keep garbage bytes
    flat = order.repeat_interleave(64)[:tokens]
    storage[flat, :, torch.arange(tokens) % 64] = rows
    return storage, tables


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


CASES = [  # (kv dtype, head dim, Hq, Hkv, cached, L, block_rows)
    ("bf16", 64, 6, 1, 0, 37, 16),      # GQA 6:1, no cache, L not a multiple of the tile
    ("int8", 64, 4, 2, 100, 29, 16),    # GQA 2:1, cached not a multiple of 64
    ("rk8v4", 64, 6, 2, 64, 20, 32),    # GQA 3:1, the chunk starts on a page boundary
    ("rk4v4", 128, 4, 2, 5, 3, 16),     # a short span at head dim 128
]


@needs_triton
@pytest.mark.parametrize("name,dim,hq,hkv,cached,length,block", CASES)
def test_kernel_matches_reference(kernel_only, name, dim, hq, hkv, cached, length, block):
    gen = torch.Generator().manual_seed(hash((name, cached)) % 1000)
    fmt = kv_quant.kv_format(name, dim)
    storage, tables = span_pool(gen, fmt, cached + length, hkv)
    q = torch.randn(length, hq, dim, generator=gen) * 2
    ref = kernel_only(q, storage, tables, 1, cached, fmt)
    exact = prefill_attention(q, storage, tables, 1, cached, fmt, block_rows=block, dot_f16=False)
    # same decoded values, fp32 online softmax in another order: measured 2.6e-7..6.9e-7
    assert rel(exact, ref) < 2e-6, rel(exact, ref)
    fast = prefill_attention(q, storage, tables, 1, cached, fmt, block_rows=block, dot_f16=True)
    # fp16 dot operands (the GPU path): measured 2.5e-4..5.1e-4, the fp16 rounding of q, k, p and v
    assert rel(fast, ref) < 1.5e-3, rel(fast, ref)


@needs_triton
@pytest.mark.parametrize("name,cached,length,per_split", [("int8", 100, 29, 1), ("rk4v4", 600, 4, None)])
def test_context_split_over_programs(kernel_only, name, cached, length, per_split):
    # short spans over long contexts split the pages over programs and merge (verification shapes); the
    # second case takes the automatic split (4 pages per program: 3 splits, the last one partly unseen)
    gen = torch.Generator().manual_seed(cached)
    fmt = kv_quant.kv_format(name, 64)
    storage, tables = span_pool(gen, fmt, cached + length, 2)
    q = torch.randn(length, 6, 64, generator=gen)
    ref = kernel_only(q, storage, tables, 1, cached, fmt)
    out = prefill_attention(q, storage, tables, 1, cached, fmt, block_rows=16, dot_f16=False,
                            pages_per_split=per_split)
    assert rel(out, ref) < 2e-6, rel(out, ref)  # measured 4.2e-7, 5.7e-7


@needs_triton
def test_bf16_queries_and_one_table_row(kernel_only):
    gen = torch.Generator().manual_seed(7)
    fmt = kv_quant.kv_format("int8", 64)
    storage, tables = span_pool(gen, fmt, 150, 2)
    q = torch.randn(20, 4, 64, generator=gen).to(torch.bfloat16)
    ref = kernel_only(q, storage, tables, 1, 130, fmt, scale=0.3)
    out = prefill_attention(q, storage, tables[1], 0, 130, fmt, scale=0.3, block_rows=16)
    assert out.dtype == torch.bfloat16
    assert rel(out, ref) < 1e-2  # both rounded to bf16 at the end (2^-9 relative)


def test_short_page_table_is_a_user_error():
    fmt = kv_quant.kv_format("bf16", 64)
    storage = torch.zeros(2, 1, 64, fmt.token_bytes, dtype=torch.uint8)
    with pytest.raises(NinferError, match="page table row"):
        prefill_attention(torch.randn(10, 2, 64), storage, torch.zeros(1, 1, dtype=torch.int32), 0, 60, fmt)


@needs_triton
def test_batch_context_routes_spans_through_the_kernels(kernel_only, monkeypatch):
    import ninfer.kernels.paged_attention as pa
    from ninfer.engine.kv_pool import KvPool
    from ninfer.engine.paged_context import PagedBatchContext
    from ninfer.engine.state_pool import GdnStatePool
    from ninfer.models.cache_spec import CacheSpec
    from ninfer.models.context import SequenceSpan

    kernels_only(monkeypatch, pa, "paged_decode_attention_reference")
    spec = CacheSpec(num_kv_layers=1, kv_heads=2, head_dim=64)
    gen = torch.Generator().manual_seed(3)
    pools = [KvPool(spec, "rk8v4", 512, 2, 256) for _ in range(2)]
    pages = torch.randperm(8, generator=gen).tolist()
    for pool in pools:
        pool.assign(0, pages[:2])
        pool.assign(1, pages[2:4])
    forwards = [  # (spans, tokens): two prompts, then a second chunk beside a decode step
        [SequenceSpan(0, 40, 0, 0), SequenceSpan(40, 70, 0, 1)],
        [SequenceSpan(0, 30, 40, 0), SequenceSpan(30, 1, 70, 1)],
        [SequenceSpan(0, 4, 70, 0)],  # one span: the whole batch (returned without a copy)
    ]
    for spans in forwards:
        T = sum(s.length for s in spans)
        q, k, v = (torch.randn(T, h, 64, generator=gen) for h in (4, 2, 2))
        outs = []
        for pool, kernel in zip(pools, (False, True), strict=True):  # kernels: prefill and batched decode
            ctx = PagedBatchContext(spans, pool, GdnStatePool(spec, 2), batched_decode=kernel)
            ctx.prefill_kernel = kernel
            outs.append(ctx.attention(0, q, k, v))
        assert torch.equal(pools[0].storage[0], pools[1].storage[0])
        # the kernel (fp32 dots on CPU) vs the SDPA reference path on the same bytes: measured 2.4e-7, 3.5e-7
        err = rel(outs[1], outs[0])
        assert err < 2e-6, err

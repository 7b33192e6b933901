"""Prefill (flash) attention of one span's queries over its sequence's pages in the KV pool.

The span's rows sit at positions cached..cached+L-1 and their K/V are already written to the pool; row i sees
keys 0..cached+i. One program takes one KV head and a tile of BLOCK_R (position, query head) pairs of that
head's GQA group, flattened position-major, so K/V pages are decoded once for the whole group. Pages are
64-token tiles decoded in the kernel like `paged_attention` (bf16 / int8 / rk8v4 / rk4v4; rotated-key formats
take the query rotated by the same Walsh–Hadamard matrix); online softmax with fp32 accumulation; the dots
take fp16 operands on the GPU (tensor cores) or fp32 (`dot_f16=False`, exact in the CPU interpreter). Short
spans over long contexts (verification) split the pages over programs too, merged like paged decode.
`prefill_attention_reference` decodes the same bytes with `kv_quant.decode_kv` and runs
`reference.attention_reference`: the oracle and the CPU path.
"""

from __future__ import annotations

import math

import torch

from ninfer.kernels import kv_quant, reference
from ninfer.kernels.paged_attention import (
    KERNEL_KV_CODES,
    PAGE_TOKENS,
    PAGES_PER_SPLIT,
    PagedAttentionError,
    _device_tables,
    _load_k,
    _load_v,
    _merge_splits_kernel,
    check_storage,
    kernel_supports,
)
from ninfer.kernels.triton_support import HAVE_TRITON, jit, tl, tl_max, tl_sum, triton_runs_on


def _table_row(page_tables: torch.Tensor, lane: int) -> torch.Tensor:
    return page_tables if page_tables.dim() == 1 else page_tables[lane]


def prefill_attention_reference(
    q: torch.Tensor, storage: torch.Tensor, page_tables: torch.Tensor, lane: int, cached: int,
    fmt: kv_quant.KvFormat, scale: float | None = None,
) -> torch.Tensor:
    """q `[L, Hq, D]` (not rotated) at positions cached.. -> `[L, Hq, D]` in q's dtype."""
    n = cached + q.shape[0]
    pages = _table_row(page_tables, lane)[: -(-n // PAGE_TOKENS)].long()
    rows = storage[pages].transpose(1, 2).reshape(-1, storage.shape[1], storage.shape[3])[:n]
    k, v = kv_quant.decode_kv(fmt, rows)
    qf = kv_quant.rotate(q.float()) if fmt.rotated_keys else q.float()
    return reference.attention_reference(qf, k, v, causal_offset=cached, scale=scale).to(q.dtype)


@jit
def _prefill_kernel(
    q_ptr, kv_ptr, kv16_ptr, pt_ptr, levels_ptr, o_ptr, acc_ptr, ml_ptr,
    L, cached, Hq, Hkv, pages_per_split, scale,
    FMT: tl.constexpr, D: tl.constexpr, G: tl.constexpr, KB: tl.constexpr, TB: tl.constexpr,
    BLOCK_R: tl.constexpr, DOT_F16: tl.constexpr, SPLITS: tl.constexpr,
):
    """SPLITS == 1: each program attends to all pages its rows see and writes the output. SPLITS > 1 (short
    spans over long contexts): program (tile, head, split) takes `pages_per_split` pages and writes its
    partial softmax for the rows that see any of them; `paged_attention._merge_splits_kernel` merges."""
    tile = tl.num_programs(0) - 1 - tl.program_id(0)  # the longest (last) rows start first
    h = tl.program_id(1)
    sp = tl.program_id(2)
    f = tile * BLOCK_R + tl.arange(0, BLOCK_R)  # flattened (position, head-in-group) pairs
    row_ok = f < L * G
    pos = f // G
    heads = h * G + f % G
    d = tl.arange(0, D)[None, :]
    t = tl.arange(0, 64)
    q = tl.load(q_ptr + (pos * Hq + heads)[:, None] * D + d, mask=row_ok[:, None], other=0.0).to(tl.float32)
    q = q * (scale * 1.4426950408889634)  # scores in log2 units: exp2 below
    if DOT_F16:
        q = q.to(tl.float16)
    sees = cached + pos  # last key position each row may see
    n = cached + L
    last = tl.minimum(cached + (tile * BLOCK_R + BLOCK_R - 1) // G, n - 1)
    m_i = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_R], dtype=tl.float32)
    acc = tl.zeros([BLOCK_R, D], dtype=tl.float32)
    first = sp * pages_per_split
    for pi in range(first, tl.minimum(last // 64 + 1, first + pages_per_split)):
        page = tl.load(pt_ptr + pi).to(tl.int64)
        tok = (page * Hkv + h) * 64 + t
        key = pi * 64 + t
        tok_ok = (key < n)[:, None]
        row = kv_ptr + tok[:, None] * TB  # TB constexpr: the compiler sees each row's alignment
        row16 = kv16_ptr + tok[:, None] * (TB // 2)
        k = _load_k(row, row16, tok_ok, levels_ptr, FMT, D, 64)
        if DOT_F16:
            k = k.to(tl.float16)
        s = tl.dot(q, tl.trans(k))
        s = tl.where(key[None, :] <= sees[:, None], s, float("-inf"))
        m_new = tl.maximum(m_i, tl_max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that sees no key yet (splits): p = 0
        p = tl.exp2(s - m_use[:, None])
        alpha = tl.exp2(m_i - m_use)
        l_i = l_i * alpha + tl_sum(p, 1)
        v = _load_v(row, row16, tok_ok, FMT, D, KB, 64)
        if DOT_F16:
            acc = acc * alpha[:, None] + tl.dot(p.to(tl.float16), v.to(tl.float16))
        else:
            acc = acc * alpha[:, None] + tl.dot(p, v)
        m_i = m_new
    if SPLITS == 1:
        out = acc / l_i[:, None]
        out_ptr = o_ptr + (pos * Hq + heads)[:, None] * D + d
        tl.store(out_ptr, out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None])
    else:  # rows that see no key of this split are not stored
        seen = row_ok & (first * 64 <= sees)
        part = (pos * Hq + heads) * SPLITS + sp
        tl.store(acc_ptr + part[:, None] * D + d, acc, mask=seen[:, None])
        tl.store(ml_ptr + part * 2, m_i, mask=seen)
        tl.store(ml_ptr + part * 2 + 1, l_i, mask=seen)


def _check(q, storage, row, cached, fmt) -> None:
    check_storage(q, storage, fmt)
    L = q.shape[0]
    if row.dtype != torch.int32 or -(-(cached + L) // PAGE_TOKENS) > row.shape[0]:
        raise PagedAttentionError(f"the page table row must be int32 and hold the pages of {cached + L} "
                                  "positions")


def prefill_attention(
    q: torch.Tensor, storage: torch.Tensor, page_tables: torch.Tensor, lane: int, cached: int,
    fmt: kv_quant.KvFormat, scale: float | None = None, *, block_rows: int = 64, num_warps: int | None = None,
    dot_f16: bool | None = None, pages_per_split: int | None = None,
) -> torch.Tensor:
    """Causal attention of a span's queries `q [L, Hq, D]` (not rotated; positions cached..cached+L-1) over
    the sequence's pages (the span's K/V already written). `page_tables` is the pool's `[lanes, max_pages]`
    int32 table (row `lane` used) or one row. Returns `[L, Hq, D]` in q's dtype. `pages_per_split` (default:
    automatic) splits the context over programs, for spans too short to fill the GPU."""
    row = _table_row(page_tables, lane)
    _check(q, storage, row, cached, fmt)
    if not (HAVE_TRITON and triton_runs_on(q) and kernel_supports(fmt)):
        return prefill_attention_reference(q, storage, page_tables, lane, cached, fmt, scale)
    L, Hq, D = q.shape
    Hkv = storage.shape[1]
    G = Hq // Hkv
    hadamard, levels = _device_tables(D, q.device)
    qr = (q.float() @ hadamard if fmt.rotated_keys else q).contiguous()
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if dot_f16 is None:
        dot_f16 = q.is_cuda
    if num_warps is None:
        num_warps = 8 if D * block_rows >= 128 * 128 else 4
    tiles, pages = -(-L * G // block_rows), -(-(cached + L) // PAGE_TOKENS)
    if pages_per_split is None:  # few programs over a long context (verification spans): split the pages
        pages_per_split = PAGES_PER_SPLIT if tiles * Hkv < 128 and pages > 2 * PAGES_PER_SPLIT else pages
    splits = -(-pages // pages_per_split)
    acc = ml = out
    if splits > 1:
        acc = torch.empty((L, Hq, splits, D), dtype=torch.float32, device=q.device)
        ml = torch.empty((L, Hq, splits, 2), dtype=torch.float32, device=q.device)
    _prefill_kernel[(tiles, Hkv, splits)](
        qr, storage, storage.view(torch.int16), row, levels, out, acc, ml, L, cached, Hq, Hkv,
        pages_per_split, scale if scale is not None else 1.0 / math.sqrt(D),
        FMT=KERNEL_KV_CODES[fmt.name], D=D, G=G, KB=fmt.key_bytes, TB=fmt.token_bytes, BLOCK_R=block_rows,
        DOT_F16=dot_f16, SPLITS=splits, num_warps=num_warps,
    )
    if splits > 1:  # row i sees cached + i + 1 keys: the merge takes its active splits from that
        lens = torch.arange(cached + 1, cached + L + 1, dtype=torch.int32, device=q.device)
        # no output gate here (the gate pointers are placeholders): prefill spans take ops.sigmoid_gate_mul
        _merge_splits_kernel[(L, Hq)](acc, ml, lens, out, out, out, out, out, Hq, pages_per_split, 0, D=D,
                                      SPLITS=splits, BS=min(64, max(16, 1 << (splits - 1).bit_length())),
                                      GATE=False, QUANT=False)
    return out

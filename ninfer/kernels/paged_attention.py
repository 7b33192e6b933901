"""Paged decode attention over the shared KV pool, decoding bf16 / int8 / rk8v4 / rk4v4 rows in the kernel.

Layout (docs/engine.md): per layer a uint8 pool `[num_pages, kv_heads, 64, token_bytes]`, page tables int32
`[lanes, max_pages]`; a token row is K part then V part, codes then fp16 scales. One program handles one
sequence × one KV head × one run of its pages (the context split over up to `DECODE_SPLITS` programs), for
all the query heads of that KV head at once (GQA: K and V are read once per group). Each split keeps an
online softmax; a second kernel merges the splits that hold pages of the sequence. Rotated-key formats take
the query rotated by the same Walsh–Hadamard matrix, so keys are used as stored.
`paged_decode_attention_reference` decodes the same bytes with `kv_quant.decode_kv` and runs
`reference.attention_reference`: the oracle and the fallback.
"""

from __future__ import annotations

import functools
import math
import os

import torch

from ninfer.errors import NinferError
from ninfer.kernels import fused, gemv_q8, kv_quant, reference
from ninfer.kernels.triton_support import (
    HAVE_TRITON,
    jit,
    pdl_options,
    pdl_start,
    tl,
    tl_max,
    tl_sum,
    triton_runs_on,
)

if HAVE_TRITON:  # the output gate's arithmetic, shared with fused.sigmoid_gate_mul
    from ninfer.kernels.fused import _quantize_row, _round, _sigmoid

PAGE_TOKENS = 64
PAGES_PER_SPLIT = 4  # pages one prefill-span program reads over a long context (prefill_attention)
# decode: runs of at least DECODE_RUN_PAGES pages, at most DECODE_SPLITS programs per sequence and KV head
# (longer runs past 128 pages); module settings read at each call (`bench/step_profile.py --sweep
# attn=RUN:SPLITS` times others in the round). H200, the 27B at 512 tokens (session 18 run 4), a step's graph
# replay on the lanes' own slots, runs of 1 / 2 / 4 pages: one lane 5.62 / 5.63 / 5.68 ms, eight lanes
# 10.34 / 10.19 / 10.23 ms
DECODE_RUN_PAGES = 2
DECODE_SPLITS = 64
# with DECODE_PROGRAMS > 0, a launch's splits also at most enough for DECODE_PROGRAMS (sequence, KV head,
# split) programs (`decode_splits`): the split count follows the page table's width (graph-safe), so a
# server's long max context gave every short sequence 64 splits, nearly all empty, 2,048 programs for the
# 27B's 8 lanes. H100, context 16,520 (session 53, `pending_ab.sh gaps`), graphed rounds on the lanes' own
# slots uncapped / 512 / 128 programs: Q4_K at 512 tokens 1 lane 6.636 / 6.639 / 6.629 ms, 8 lanes 9.656 /
# 9.582 / 9.512; IQ3_S at 16K 1 lane 6.705 / 6.711 / 6.700, 8 lanes 11.889 / 11.673 / 12.166. 512 leaves
# one lane's 64 splits as they were.
DECODE_PROGRAMS = 512
KERNEL_KV_CODES = {"bf16": 0, "int8": 1, "rk8v4": 2, "rk4v4": 3}
# Under a programmatic launch each decode program asks its pages' rows into L2 before its wait (`_ask_pages`):
# the pages were written in earlier rounds (all but the new token's row, whose line the KV write stores
# through L2 meanwhile), the page table and lengths by the round's first kernels, so the loads after the wait
# meet L2, not DRAM — where a launch's pages come to at most PREFETCH_BYTES (a long context's would flush
# L2 and be read twice; 0: never). H100, the 27B's graphed rounds at 512 tokens (session 62): IQ3_S's
# 4-column step 7.652 -> 7.606 ms (twice), Q4_K's 1 and 8 lanes even; with this cap (session 63, another
# H100) even everywhere, 64 MiB at 16K no better: a hint kept, nothing depends on it.
# NINFER_ATTN_PREFETCH_MIB=N for A/B.
PREFETCH_BYTES = 16 << 20


def decode_prefetch() -> int:
    """The bytes of pages a decode launch may ask into L2: `PREFETCH_BYTES`, or NINFER_ATTN_PREFETCH_MIB=N."""
    forced = os.environ.get("NINFER_ATTN_PREFETCH_MIB", "")
    return int(forced) << 20 if forced.isdigit() else PREFETCH_BYTES


def decode_splits(width: int, pairs: int, pages_per_split: int, max_splits: int, programs: int) -> int:
    """Splits of each sequence's context in a decode launch of `pairs` (sequence, KV head) pairs over page
    tables `width` pages wide: runs of `pages_per_split` across the width, at most `max_splits`, and with
    `programs` > 0 at most enough for `programs` programs in all (one at least)."""
    splits = min(-(-width // pages_per_split), max_splits)
    return min(splits, max(1, -(-programs // pairs))) if programs > 0 else splits


class PagedAttentionError(NinferError):
    """Paged attention inputs that do not match the KV pool layout."""


def paged_decode_attention_reference(
    q: torch.Tensor, storage: torch.Tensor, page_tables: torch.Tensor, lane_ids: torch.Tensor,
    seq_lens: torch.Tensor, fmt: kv_quant.KvFormat, scale: float | None = None,
) -> torch.Tensor:
    """q `[B, Hq, D]` (one new token per sequence, not rotated) -> `[B, Hq, D]` in q's dtype."""
    outs = []
    for b in range(q.shape[0]):
        n = int(seq_lens[b])
        pages = page_tables[int(lane_ids[b]), : -(-n // PAGE_TOKENS)].long()
        rows = storage[pages].transpose(1, 2).reshape(-1, storage.shape[1], storage.shape[3])[:n]
        k, v = kv_quant.decode_kv(fmt, rows)
        qb = kv_quant.rotate(q[b].float()) if fmt.rotated_keys else q[b].float()
        outs.append(reference.attention_reference(qb[None], k, v, causal_offset=n - 1, scale=scale)[0])
    return torch.stack(outs).to(q.dtype)


@jit
def _scales(row16, off16: tl.constexpr, NG: tl.constexpr, m):
    """[rows, NG] fp16 scales of each row (2-byte aligned in every format), loaded once per group."""
    j = tl.arange(0, NG)[None, :]
    return tl.load(row16 + off16 + j, mask=m, other=0).to(tl.float16, bitcast=True).to(tl.float32)


@jit
def _grouped(x, s, ROWS: tl.constexpr, D: tl.constexpr, GROUP: tl.constexpr):
    """x [ROWS, D] times its per-group scales s [ROWS, D // GROUP], broadcast over each group."""
    return tl.reshape(tl.reshape(x, (ROWS, D // GROUP, GROUP)) * s[:, :, None], (ROWS, D))


@jit
def _nibbles(row, off: tl.constexpr, m, ROWS: tl.constexpr, D: tl.constexpr):
    """[ROWS, D] 4-bit codes (int32) from D/2 packed bytes: value 2i low nibble of byte i, 2i+1 high."""
    byte = tl.load(row + off + tl.arange(0, D // 2)[None, :], mask=m, other=0).to(tl.int32)
    return tl.reshape(tl.join(byte & 0xF, byte >> 4), (ROWS, D))


@jit
def _load_k(row, row16, m, levels_ptr, FMT: tl.constexpr, D: tl.constexpr, ROWS: tl.constexpr):
    """Decoded keys [ROWS, D] fp32 (still rotated for rk formats) of the token rows at `row`."""
    d = tl.arange(0, D)[None, :]
    if FMT == 0:
        return tl.load(row16 + d, mask=m, other=0).to(tl.bfloat16, bitcast=True).to(tl.float32)
    elif FMT == 1 or FMT == 2:
        code = tl.load(row + d, mask=m, other=0).to(tl.int8, bitcast=True).to(tl.float32)
        return _grouped(code, _scales(row16, D // 2, D // 64, m), ROWS, D, 64)
    else:
        level = tl.load(levels_ptr + _nibbles(row, 0, m, ROWS, D))
        return _grouped(level, _scales(row16, D // 4, D // 64, m), ROWS, D, 64)


@jit
def _load_v(row, row16, m, FMT: tl.constexpr, D: tl.constexpr, KB: tl.constexpr, ROWS: tl.constexpr):
    """Decoded values [ROWS, D] fp32 of the token rows at `row` (V part starts at byte KB)."""
    d = tl.arange(0, D)[None, :]
    if FMT == 0:
        return tl.load(row16 + D + d, mask=m, other=0).to(tl.bfloat16, bitcast=True).to(tl.float32)
    elif FMT == 1:
        code = tl.load(row + KB + d, mask=m, other=0).to(tl.int8, bitcast=True).to(tl.float32)
        return _grouped(code, _scales(row16, (KB + D) // 2, D // 64, m), ROWS, D, 64)
    else:
        code = (_nibbles(row, KB, m, ROWS, D) - 8).to(tl.float32)
        return _grouped(code, _scales(row16, (KB + D // 2) // 2, D // 32, m), ROWS, D, 32)


@jit
def _run_pages(n, pages_per_split, SPLITS: tl.constexpr):
    """Pages each split of a sequence of n tokens reads: `pages_per_split`, or more where SPLITS runs of it
    would not cover the sequence's pages."""
    pages = (n + 63) // 64
    return tl.maximum(pages_per_split, (pages + SPLITS - 1) // SPLITS)


@jit
def _run_of(n, sp, pages_per_split, SPLITS: tl.constexpr):
    """(first, last + 1) page of split sp's run of a sequence of n tokens (an empty run past its pages)."""
    per = _run_pages(n, pages_per_split, SPLITS)
    return sp * per, tl.minimum((n + 63) // 64, sp * per + per)


@jit
def _ask_pages(kv_ptr, pt_ptr, lane_ptr, len_ptr, Hkv, pt_stride, pages_per_split, TB: tl.constexpr,
               SPLITS: tl.constexpr, LIMIT: tl.constexpr):
    """Ask the rows of this program's run of pages into L2 (PTX `prefetch.global.L2`, a hint: nothing waits
    on it), a line of 128 bytes at a time, each row's last line at its last byte (no line past the pool);
    none where the launch's rows at this one's length would pass LIMIT bytes (`PREFETCH_BYTES`)."""
    LINES: tl.constexpr = 1 << ((TB + 127) // 128 - 1).bit_length()
    b = tl.program_id(0)
    h = tl.program_id(1)
    lane = tl.load(lane_ptr + b).to(tl.int64)
    n = tl.load(len_ptr + b)
    first, last = _run_of(n, tl.program_id(2), pages_per_split, SPLITS)
    if n.to(tl.int64) * tl.num_programs(0) * Hkv * TB > LIMIT:
        last = first
    at = tl.minimum(tl.arange(0, LINES) * 128, TB - 1)[None, :]
    for pi in range(first, last):
        page = tl.load(pt_ptr + lane * pt_stride + pi).to(tl.int64)
        rows = ((page * Hkv + h) * 64 + tl.arange(0, 64))[:, None] * TB
        tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [kv_ptr + rows + at],
                                  dtype=tl.int32, is_pure=False, pack=1)


@jit
def _paged_decode_kernel(
    q_ptr, kv_ptr, kv16_ptr, pt_ptr, lane_ptr, len_ptr, levels_ptr, acc_ptr, ml_ptr,
    Hq, Hkv, pt_stride, pages_per_split, scale,
    FMT: tl.constexpr, D: tl.constexpr, G: tl.constexpr, GPAD: tl.constexpr, KB: tl.constexpr,
    TB: tl.constexpr, SPLITS: tl.constexpr, PREFETCH: tl.constexpr = 0, PDL: tl.constexpr = 0,
):
    if PREFETCH > 0 and PDL != 0:  # at most PREFETCH bytes asked into L2 (PDL 0, the interpreter: no PTX)
        _ask_pages(kv_ptr, pt_ptr, lane_ptr, len_ptr, Hkv, pt_stride, pages_per_split, TB, SPLITS, PREFETCH)
    pdl_start(PDL)
    b = tl.program_id(0)
    h = tl.program_id(1)
    sp = tl.program_id(2)
    lane = tl.load(lane_ptr + b).to(tl.int64)
    n = tl.load(len_ptr + b)
    first, last = _run_of(n, sp, pages_per_split, SPLITS)
    g = tl.arange(0, GPAD)
    g_ok = g < G
    d = tl.arange(0, D)[None, :]
    t = tl.arange(0, 64)
    heads = h * G + g
    # an empty split (past the sequence's pages: most of them at short contexts) reads and writes nothing
    mine = g_ok & (first + 0 * g < last)  # (a tensor compare: the interpreter rejects a scalar bool mask)
    q = tl.load(q_ptr + (b * Hq + heads)[:, None] * D + d, mask=mine[:, None], other=0.0).to(tl.float32)
    q = q * (scale * 1.4426950408889634)  # scores in log2 units: exp2 below
    m_i = tl.full([GPAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([GPAD], dtype=tl.float32)
    acc = tl.zeros([GPAD, D], dtype=tl.float32)
    for pi in range(first, last):
        page = tl.load(pt_ptr + lane * pt_stride + pi).to(tl.int64)
        tok = (page * Hkv + h) * 64 + t
        tok_ok = (pi * 64 + t) < n
        row = kv_ptr + tok[:, None] * TB  # TB constexpr: the compiler sees each row's alignment
        row16 = kv16_ptr + tok[:, None] * (TB // 2)
        k = _load_k(row, row16, tok_ok[:, None], levels_ptr, FMT, D, 64)
        s = tl.dot(q, tl.trans(k))
        s = tl.where(tok_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl_max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl_sum(p, 1)
        v = _load_v(row, row16, tok_ok[:, None], FMT, D, KB, 64)
        acc = acc * alpha[:, None] + tl.dot(p, v)
        m_i = m_new
    part = (b * Hq + heads) * SPLITS + sp
    tl.store(acc_ptr + part[:, None] * D + d, acc, mask=mine[:, None])
    tl.store(ml_ptr + part * 2, m_i, mask=mine)
    tl.store(ml_ptr + part * 2 + 1, l_i, mask=mine)


@jit
def _merge_splits_kernel(
    acc_ptr, ml_ptr, len_ptr, out_ptr, gate_ptr, q_ptr, d_ptr, s_ptr, Hq, pages_per_split, s_gate,
    D: tl.constexpr, SPLITS: tl.constexpr, BS: tl.constexpr, GATE: tl.constexpr, QUANT: tl.constexpr,
    GROUP: tl.constexpr = 32, PDL: tl.constexpr = 0,
):
    """out[b, head] from the partial softmaxes of the splits that hold pages of sequence b (the rest were not
    written): two passes over those splits, max then weighted sums. GATE: times the output gate as
    `fused.sigmoid_gate_mul` computes it (out rounded to its dtype, the sigmoid too); QUANT: the int8
    activation of the gated rows as well (each head's D columns are whole groups of GROUP)."""
    pdl_start(PDL)
    b = tl.program_id(0)
    hq = tl.program_id(1)
    n = tl.load(len_ptr + b)
    per = _run_pages(n, pages_per_split, SPLITS)
    active = ((n + 63) // 64 + per - 1) // per
    base = (b * Hq + hq) * SPLITS
    s = tl.arange(0, BS)
    d = tl.arange(0, D)
    top = tl.full([BS], float("-inf"), dtype=tl.float32)
    for c in range(0, active, BS):
        m = tl.load(ml_ptr + (base + c + s) * 2, mask=c + s < active, other=float("-inf"))
        top = tl.maximum(top, m)
    mx = tl_max(top, 0)
    den = tl.zeros([BS], dtype=tl.float32)
    out = tl.zeros([D], dtype=tl.float32)
    for c in range(0, active, BS):
        ok = c + s < active
        m = tl.load(ml_ptr + (base + c + s) * 2, mask=ok, other=float("-inf"))
        w = tl.where(ok, tl.exp2(m - mx), 0.0)
        den += w * tl.load(ml_ptr + (base + c + s) * 2 + 1, mask=ok, other=0.0)
        part = tl.load(acc_ptr + (base + c + s)[:, None] * D + d[None, :], mask=ok[:, None], other=0.0)
        out += tl_sum(part * w[:, None], 0)
    out = out / tl_sum(den, 0)
    if GATE:
        ty = out_ptr.dtype.element_ty
        g = tl.load(gate_ptr + b * s_gate + hq * D + d).to(tl.float32)
        out = _round(out, ty).to(tl.float32) * _round(_sigmoid(g), ty).to(tl.float32)
        out = _round(out, ty)
        tl.store(out_ptr + (b * Hq + hq) * D + d, out)
        if QUANT:
            _quantize_row(out.to(tl.float32), b, hq * (D // GROUP), d < D, Hq * D, q_ptr, d_ptr, s_ptr, D,
                          GROUP)
    else:
        tl.store(out_ptr + (b * Hq + hq) * D + d, out.to(out_ptr.dtype.element_ty))


@functools.cache
def _device_tables(head_dim: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Walsh–Hadamard matrix and codebook levels on `device`, made once (no host copies inside a graph)."""
    return (kv_quant.hadamard_matrix(head_dim).to(device),
            kv_quant.lloyd_max_gaussian_levels().to(device=device, dtype=torch.float32))


def check_storage(q: torch.Tensor, storage: torch.Tensor, fmt: kv_quant.KvFormat) -> None:
    """The pool layer's bytes fit `fmt` and q's heads (`q [rows, Hq, D]`), or PagedAttentionError."""
    Hq, D = q.shape[1:]
    if storage.dtype != torch.uint8 or storage.dim() != 4 or storage.shape[2] != PAGE_TOKENS:
        raise PagedAttentionError(f"KV storage must be uint8 [pages, kv_heads, {PAGE_TOKENS}, token_bytes], "
                                  f"got {storage.dtype} {list(storage.shape)}")
    if storage.shape[3] != fmt.token_bytes or fmt.head_dim != D:
        raise PagedAttentionError(f"KV rows of {storage.shape[3]} bytes do not match --kv-dtype {fmt.name} "
                                  f"at head dim {D} ({fmt.token_bytes} bytes); check the pool's dtype")
    if Hq % storage.shape[1]:
        raise PagedAttentionError(f"{Hq} query heads cannot share {storage.shape[1]} KV heads evenly")


def _check(q, storage, page_tables, lane_ids, seq_lens, fmt) -> None:
    check_storage(q, storage, fmt)
    B = q.shape[0]
    if lane_ids.shape != (B,) or seq_lens.shape != (B,) or page_tables.dtype != torch.int32:
        raise PagedAttentionError("lane_ids and seq_lens must be [batch] and page tables int32")


def kernel_supports(fmt: kv_quant.KvFormat) -> bool:
    """Formats and head dims the Triton kernels decode (power-of-two head dims from 16)."""
    D = fmt.head_dim
    return fmt.name in KERNEL_KV_CODES and D >= 16 and D & (D - 1) == 0


def paged_decode_attention(
    q: torch.Tensor, storage: torch.Tensor, page_tables: torch.Tensor, lane_ids: torch.Tensor,
    seq_lens: torch.Tensor, fmt: kv_quant.KvFormat, scale: float | None = None,
    pages_per_split: int | None = None, gate: torch.Tensor | None = None, max_splits: int | None = None,
    group: int = 32, max_programs: int | None = None,
) -> torch.Tensor:
    """Attention of one new query token per sequence over its cached pages (the new token's K/V already
    written). q `[B, Hq, D]` not rotated; seq_lens include the new token. Returns `[B, Hq, D]`, q's dtype.

    The context is split into runs of `pages_per_split` pages (at least; default `DECODE_RUN_PAGES`), one
    program each per sequence and KV head, at most `max_splits` of them (default `DECODE_SPLITS`): a longer
    context takes longer runs (each program finds its run from the sequence's length, the merge likewise).
    The split count comes from the page table's width, never from the lengths (no host sync: graph-safe),
    and from the batch where `max_programs` (default `DECODE_PROGRAMS`) caps the programs (`decode_splits`).
    Short runs keep the GPU busy at short contexts: at 512 tokens one lane's 4 KV heads are 16 programs of two
    pages, where runs of 4 pages made 8.

    `gate` (`[B, Hq·D]`, unit stride along its rows): the attention output gate applied in the merge launch,
    `fused.sigmoid_gate_mul(out, gate)`, returned as `[B, Hq·D]` with its int8 activation left for the
    Linear that reads it (decode widths on CUDA, as the fused kernels do; `group` values a scale, where
    they tile a head)."""
    _check(q, storage, page_tables, lane_ids, seq_lens, fmt)
    B, Hq, D = q.shape
    if gate is not None and (gate.shape != (B, Hq * D) or gate.stride(1) != 1):
        raise PagedAttentionError(f"the output gate must be [{B}, {Hq * D}] with unit stride along its rows, "
                                  f"got {tuple(gate.shape)} strides {gate.stride()}")
    if not (HAVE_TRITON and triton_runs_on(q) and kernel_supports(fmt)):
        out = paged_decode_attention_reference(q, storage, page_tables, lane_ids, seq_lens, fmt, scale)
        return out if gate is None else fused.sigmoid_gate_mul_reference(out.reshape(B, Hq * D), gate)
    Hkv = storage.shape[1]
    G = Hq // Hkv
    pages_per_split = pages_per_split or DECODE_RUN_PAGES
    splits = decode_splits(page_tables.shape[1], B * Hkv, pages_per_split, max_splits or DECODE_SPLITS,
                           DECODE_PROGRAMS if max_programs is None else max_programs)
    hadamard, levels = _device_tables(D, q.device)
    qr = (q.float() @ hadamard if fmt.rotated_keys else q).contiguous()
    acc = torch.empty((B, Hq, splits, D), dtype=torch.float32, device=q.device)
    ml = torch.empty((B, Hq, splits, 2), dtype=torch.float32, device=q.device)
    lens = seq_lens if seq_lens.dtype == torch.int32 else seq_lens.to(torch.int32)
    lanes = lane_ids if lane_ids.dtype == torch.int32 else lane_ids.to(torch.int32)
    _paged_decode_kernel[(B, Hkv, splits)](
        qr, storage, storage.view(torch.int16), page_tables, lanes, lens, levels, acc, ml, Hq, Hkv,
        page_tables.stride(0), pages_per_split, scale if scale is not None else 1.0 / math.sqrt(D),
        FMT=KERNEL_KV_CODES[fmt.name], D=D, G=G, GPAD=max(16, 1 << (G - 1).bit_length()), KB=fmt.key_bytes,
        TB=fmt.token_bytes, SPLITS=splits, PREFETCH=decode_prefetch(),
        **pdl_options(q),
    )
    out = torch.empty(q.shape if gate is None else (B, Hq * D), dtype=q.dtype, device=q.device)
    quantize = gate is not None and D % group == 0 and gemv_q8.int8_next(out, group)
    q8 = fused.int8_buffers(out, quantize, group)
    _merge_splits_kernel[(B, Hq)](acc, ml, lens, out, out if gate is None else gate, *q8, Hq, pages_per_split,
                                  0 if gate is None else gate.stride(0), D=D, SPLITS=splits,
                                  BS=min(64, max(16, 1 << (splits - 1).bit_length())), GATE=gate is not None,
                                  QUANT=quantize, GROUP=group, **pdl_options(q))
    if quantize:
        fused.remember_int8(out, q8)
    return out

"""A sampled round's tokens in two launches (`draw_top_k`): each row's top-k candidates, then its draw.

`sampler.sample_rows` takes this where every row keeps at most `MAX_K` candidates (the Qwen presets keep 20;
greedy rows one) and the kernels run on the logits' device; its batched PyTorch ops (`torch.topk`, softmax,
the masks, the cumulative sums: some 25 launches a round) are the reference and stay the path elsewhere.

1. `_chunk_top_kernel`, a program per (row, chunk of columns): the row's penalties on the chunk's logits
   where it has any (`sampler._penalised`'s arithmetic, from the request's output counts and prompt mask
   kept on the device), then the chunk's K best columns as int64 keys, the logit's order key
   (`fused._order_key`: as `torch.argmax` compares) above the column's complement, so equal logits rank
   their first column first (as `argmax`).
2. `_draw_kernel`, a program per row: the row's K best of its chunks' candidates, each row's own k of them,
   their (penalised) logits read back from the keys, then `sample_rows`' arithmetic — ÷ T, softmax, top-p
   (the mass strictly above a token, fp64), min-p — and the inverse-CDF pick of the row's uniform number
   over the kept mass (fp64 sums). A greedy row (k = 1) takes its best column.
"""

from __future__ import annotations

import os

import torch

from ninfer.kernels.fused import runs_on
from ninfer.kernels.triton_support import HAVE_TRITON, jit, tl, triton

pow2 = triton.next_power_of_2 if HAVE_TRITON else None

MAX_K = 64  # candidates a row at most (a power of two); rows asking more, or all (no top_k): PyTorch's
# a row's chunk candidates at most: the draw's one program holds them all (H100, the presets' rows, the two
# kernels: 2,048 → the 27B's row in 61 chunks of 4,096, 24.6 µs a row, 56.7 for eight; 4,096 → 122 chunks of
# 2,048 at 4 / 4 warps, 30.7 / 61.0; docs/gpu-notes.md "Session 80")
CANDIDATES = 2048

if HAVE_TRITON:
    from ninfer.kernels.fused import _order_key

    NO_COLUMN = tl.constexpr(-2147483647)  # the order key of columns past the vocabulary (below every number)
    PAD = tl.constexpr(-9223372036854775807)  # below every key

    @jit
    def _chunk_top_kernel(x_ptr, cand_ptr, set_ptr, counts_ptr, seen_ptr, V, sx, B, CHUNKS, K: tl.constexpr,
                          CHUNK: tl.constexpr, PENALTIES: tl.constexpr):
        """Row r, chunk c: the K largest keys of columns [c·CHUNK, (c + 1)·CHUNK) at cand[r, c, :], after the
        row's penalties (PENALTIES: set[5:9, r] its slot of counts / seen `[P, V]` (−1: none), repetition,
        presence and frequency penalties)."""
        r, c = tl.program_id(0), tl.program_id(1)
        cols = c * CHUNK + tl.arange(0, CHUNK)
        live = cols < V
        x = tl.load(x_ptr + r * sx + cols, mask=live, other=0.0)
        if PENALTIES:
            slot = tl.load(set_ptr + 5 * B + r).to(tl.int32)
            if slot >= 0:
                n = tl.load(counts_ptr + slot * V + cols, mask=live, other=0.0)
                seen = tl.load(seen_ptr + slot * V + cols, mask=live, other=0) != 0
                rp = tl.load(set_ptr + 6 * B + r)
                cost = tl.load(set_ptr + 7 * B + r) + tl.load(set_ptr + 8 * B + r) * n
                out = n > 0
                x = tl.where(seen | out, tl.where(x > 0, tl.math.div_rn(x, rp), x * rp), x)
                x = tl.where(out, x - cost, x)
        key = tl.where(live, _order_key(x), NO_COLUMN)
        packed = (key.to(tl.int64) << 32) | (2147483647 - cols.to(tl.int64))
        tl.store(cand_ptr + (r * CHUNKS + c) * K + tl.arange(0, K), tl.topk(packed, K))

    @jit
    def _draw_kernel(cand_ptr, set_ptr, out_ptr, B, N, K: tl.constexpr, BLOCK: tl.constexpr):
        """Row r's token from its N chunk candidates and its settings (set[:5, r]: k, T, top_p, min_p, u)."""
        r = tl.program_id(0)
        i = tl.arange(0, BLOCK)
        best = tl.topk(tl.load(cand_ptr + r * N + i, mask=i < N, other=PAD), K)
        cols = (2147483647 - (best & 0xFFFFFFFF)).to(tl.int32)
        key = (best >> 32).to(tl.int32)  # `_order_key` undone: the logit's bits (−0 came back as +0)
        logit = tl.where(key < 0, key ^ 0x7FFFFFFF, key).to(tl.float32, bitcast=True)
        j = tl.arange(0, K)
        k = tl.load(set_ptr + r)
        temp = tl.load(set_ptr + B + r)
        top_p = tl.load(set_ptr + 2 * B + r)
        min_p = tl.load(set_ptr + 3 * B + r)
        u = tl.load(set_ptr + 4 * B + r)
        z = tl.where(j < k, logit / temp, float("-inf"))
        e = tl.exp(z - tl.max(z, 0))
        p = e / tl.sum(e, 0)
        p = tl.where(tl.cumsum(p.to(tl.float64), 0) - p >= top_p, 0.0, p)  # the mass strictly above each
        p = tl.where(p < min_p * tl.max(p, 0), 0.0, p)
        cdf = tl.cumsum(p.to(tl.float64), 0)
        at = tl.sum((cdf < u * tl.max(cdf, 0)).to(tl.int32), 0)
        at = tl.minimum(at, tl.sum((p > 0).to(tl.int32), 0) - 1)
        tl.store(out_ptr + r, tl.sum(tl.where(j == at, cols, 0), 0).to(tl.int64))


def takes(x: torch.Tensor, k: int) -> bool:
    """Whether `draw_top_k` takes logits `x` `[B, V]` whose rows keep at most k candidates: Triton runs on
    x's device (with `tl.topk`), 1 ≤ k ≤ MAX_K and k < V; NINFER_FUSED_SAMPLER=0 leaves it off (for A/B)."""
    return (runs_on(x) and hasattr(tl, "topk") and x.dim() == 2 and x.stride(-1) == 1
            and 1 <= k <= min(MAX_K, x.shape[1] - 1) and os.environ.get("NINFER_FUSED_SAMPLER", "1") != "0")


def draw_top_k(x: torch.Tensor, settings: torch.Tensor, k: int, chunk: int | None = None,
               penalties: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Each row's token (int64 `[B]`) from fp32 logits `x` `[B, V]` and `settings` fp32 `[5, B]` or `[9, B]`
    on its device (a row's candidates ≤ k, temperature, top_p (≥ 1: off), min_p, its uniform number — a
    greedy row 1, 1, 2, 0, 0 — then, with `penalties`, its slot of them (−1: none) and its repetition,
    presence and frequency penalties), as `sampler.sample_rows` draws them, in two launches. `penalties`:
    fp32 output counts and a bool mask of the prompt's ids, `[P, V]` each (`SamplerState.dense`, stacked).
    `chunk`: columns a program of the first (a power of two ≥ k; default ≥ 1,024 and few enough chunks for
    the draw's CANDIDATES)."""
    B, V = x.shape
    K = max(pow2(k), 2)  # tl.topk's k: a power of two above one
    chunk = chunk or max(K, min(1024, pow2(V)), pow2(-(-V * K // CANDIDATES)))
    if chunk < K or chunk != pow2(chunk) or -(-V // chunk) * K > CANDIDATES:
        raise ValueError(f"draw_top_k: chunk {chunk} must be a power of two ≥ {K}, at most {CANDIDATES} "
                         "candidates a row")
    if penalties is not None and (settings.shape[0] < 9 or any(t.shape[1:] != (V,) for t in penalties)):
        raise ValueError(f"draw_top_k: penalties need settings [9, B] and counts / mask [P, {V}]")
    chunks = -(-V // chunk)
    cand = torch.empty((B, chunks, K), dtype=torch.int64, device=x.device)
    out = torch.empty(B, dtype=torch.int64, device=x.device)
    # (without penalties the kernel reads neither)
    counts, seen = (penalties[0], penalties[1].view(torch.uint8)) if penalties is not None else (x, x)
    if B:
        # (no multiply-add fused on the GPU: the penalties round as PyTorch's separate ops do)
        _chunk_top_kernel[(B, chunks)](x, cand, settings, counts, seen, V, x.stride(0), B, chunks, K=K,
                                       CHUNK=chunk, PENALTIES=penalties is not None,
                                       num_warps=8 if chunk >= 4096 else 4 if chunk >= 1024 else 1,
                                       enable_fp_fusion=False)
        _draw_kernel[(B,)](cand, settings, out, B, chunks * K, K=K, BLOCK=pow2(chunks * K),
                           num_warps=16 if chunks * K > 1024 else 4)
    return out

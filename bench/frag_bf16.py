"""The bf16 fragment GEMV (an experiment, session 9): q4_k decoded to bf16 in registers and multiplied with
the bf16 activation as it is on `mma.sync.m16n8k16.bf16` issued through inline PTX, the operands loaded
straight into the mma fragments (the lane map of `ninfer/kernels/gemv_frag.py`).

Lane t of a row owns chunk t of every super-block (its 32 qs bytes: sub-blocks 2t and 2t + 1), so the scales
fold into the A words (sc·q as bf16: (128 + q)·sc − 128·sc in one `fma.rn.bf16x2`) and one fp32 tile
accumulates the whole super-block; the mins take 16 more mmas with A = mn (exact in bf16); d and dmin apply
once per super-block. No int8 activation, no per-sub-block epilogue, and more exact than the int8 route (the
activation is not quantised; sc·q rounds to bf16 above 256). Timed on the H200 beside the int8 kernel
(`bench/frag_timing.py`, session 9 runs 2-3, 5): no faster (17408×5120: 31.8 µs at 1 column, 41.0 at 8),
both issue-bound at ~410-460 instructions per warp and super-block with 16-22 % occupancy — kept here, not
routed. `gemv_frag_bf16_twin` is its float64 oracle.
"""

from __future__ import annotations

import torch

from ninfer.kernels.gemv_frag import SCHEDULES, FragSchedule
from ninfer.kernels.gemv_q8 import EMULATE_DP4A
from ninfer.kernels.gguf_matmul import _f16_lo, _k_scale_min_words
from ninfer.kernels.triton_support import jit, pdl_options, pdl_start, tl, tl_sum
from ninfer.quant.formats import GGUF_PREFIX

if tl is not None:
    from ninfer.kernels.gemv_frag import _lane_map, _store_tile
    from ninfer.kernels.gemv_q8_iq import prmt
    from ninfer.kernels.gemv_rows import _pick, _step_range


@jit
def _bf16_lo(w):
    """float32 of the bf16 in the low half of int32 words."""
    return (w << 16).to(tl.float32, bitcast=True)

@jit
def _bf16_hi(w):
    """float32 of the bf16 in the high half of int32 words."""
    return (w & -65536).to(tl.float32, bitcast=True)

@jit
def _bf16_pair(v):
    """Both halves of an int32 word set to the bf16 of float32 v (v must be exact in bf16)."""
    b = (v.to(tl.int32, bitcast=True) >> 16) & 0xFFFF
    return b | (b << 16)

@jit
def _round_bf16(v):
    """The bf16 bits (low 16) of float32 v, rounded to nearest even."""
    b = v.to(tl.int32, bitcast=True)
    return ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) & 0xFFFF

@jit
def _fma_bf16x2(a, b, c, EMULATE: tl.constexpr):
    """PTX `fma.rn.bf16x2`: a·b + c per bf16 half of int32 words, rounded once."""
    if EMULATE:
        lo = _round_bf16(_bf16_lo(a) * _bf16_lo(b) + _bf16_lo(c))
        hi = _round_bf16(_bf16_hi(a) * _bf16_hi(b) + _bf16_hi(c))
        return lo | (hi << 16)
    else:
        return tl.inline_asm_elementwise("fma.rn.bf16x2 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c],
                                         dtype=tl.int32, is_pure=True, pack=1)

@jit
def _dot2(a, b):
    """Σ over the two bf16 halves of int32 words a and b, in float32."""
    return _bf16_lo(a) * _bf16_lo(b) + _bf16_hi(a) * _bf16_hi(b)

@jit
def _mma_bf16_emulated(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3, L: tl.constexpr, RT: tl.constexpr,
                       NT: tl.constexpr):
    """What `mma.sync.m16n8k16.row.col.f32.bf16.bf16.f32` returns to each lane (see `_mma_emulated`;
    k-slots 2t, 2t + 1 in words a0 / a1 / b0, 2t + 8, 2t + 9 in a2 / a3 / b1)."""
    W: tl.constexpr = L // 32
    A0 = tl.reshape(a0, [W, 8, 4, RT, NT])[:, :, None, :, :, :]
    A1 = tl.reshape(a1, [W, 8, 4, RT, NT])[:, :, None, :, :, :]
    A2 = tl.reshape(a2, [W, 8, 4, RT, NT])[:, :, None, :, :, :]
    A3 = tl.reshape(a3, [W, 8, 4, RT, NT])[:, :, None, :, :, :]
    B0 = tl.reshape(b0, [W, 8, 4, RT, NT])[:, None, :, :, :, :]
    B1 = tl.reshape(b1, [W, 8, 4, RT, NT])[:, None, :, :, :, :]
    top = tl_sum(_dot2(A0, B0) + _dot2(A2, B1), 3)[:, :, None, :, :, :]
    bot = tl_sum(_dot2(A1, B0) + _dot2(A3, B1), 3)[:, :, None, :, :, :]
    n = tl.arange(0, 8)[None, None, None, :, None, None]
    t = tl.arange(0, 4)[None, None, :, None, None, None]
    d0 = tl_sum(tl.where(n == 2 * t, top, 0.0), 3)
    d1 = tl_sum(tl.where(n == 2 * t + 1, top, 0.0), 3)
    d2 = tl_sum(tl.where(n == 2 * t, bot, 0.0), 3)
    d3 = tl_sum(tl.where(n == 2 * t + 1, bot, 0.0), 3)
    return (c0 + tl.reshape(d0, [L, RT, NT]), c1 + tl.reshape(d1, [L, RT, NT]),
            c2 + tl.reshape(d2, [L, RT, NT]), c3 + tl.reshape(d3, [L, RT, NT]))

@jit
def _mma_bf16(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3, L: tl.constexpr, RT: tl.constexpr, NT: tl.constexpr,
              EMULATE: tl.constexpr):
    """C + A·B of one m16n8k16 bf16 mma (fp32 accumulate), as each lane's (d0, d1, d2, d3)."""
    if EMULATE:
        return _mma_bf16_emulated(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3, L, RT, NT)
    else:
        return tl.inline_asm_elementwise(
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {$0, $1, $2, $3}, {$4, $5, $6, $7}, "
            "{$8, $9}, {$10, $11, $12, $13};",
            "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f", [a0, a1, a2, a3, b0, b1, c0, c1, c2, c3],
            dtype=(tl.float32, tl.float32, tl.float32, tl.float32), is_pure=True, pack=1)

@jit
def _biased(v, magic, EMULATE: tl.constexpr):
    """(v & 0x000F000F) | magic in one `lop3` (magic a register: 0x43004300, so that the two nibbles
    become the bf16 pair 128 + q)."""
    if EMULATE:
        return (v & 0x000F000F) | magic
    else:
        return tl.inline_asm_elementwise("lop3.b32 $0, $1, 0x000f000f, $2, 0xea;", "=r,r,r", [v, magic],
                                         dtype=tl.int32, is_pure=True, pack=1)

@jit
def _q4_pairs(w, scale, bias, magic, EMULATE: tl.constexpr):
    """The 8 codes of a qs word as bf16 pairs sc·q, (codes of bytes 0, 2; 1, 3) of the low nibbles, then
    of the high nibbles: 128 + q is exact in bf16 (0x4300 | q), and (128 + q)·sc − 128·sc = q·sc in one
    rounding."""
    p0 = _fma_bf16x2(_biased(w, magic, EMULATE), scale[0], bias[0], EMULATE)
    p1 = _fma_bf16x2(_biased(w >> 8, magic, EMULATE), scale[0], bias[0], EMULATE)
    p2 = _fma_bf16x2(_biased(w >> 4, magic, EMULATE), scale[1], bias[1], EMULATE)
    p3 = _fma_bf16x2(_biased(w >> 12, magic, EMULATE), scale[1], bias[1], EMULATE)
    return p0, p1, p2, p3

@jit
def _sel4(a, b, c, d, k: tl.constexpr):
    """The k-th of four values (k a constant)."""
    if k == 0:
        return a
    elif k == 1:
        return b
    elif k == 2:
        return c
    else:
        return d

@jit
def _bf16_step_loads(wa, wb, qa, qb, xr, blk, e):
    """One super-block's loads for `_gemv_frag_bf16_kernel`: the header words of rows g and g + 8, the
    lane's 8 qs words of each (two 16-byte loads a row), its 32 activation words (8 × 16 bytes: words
    0-15 the low sub-block, 16-31 the high one)."""
    wo = blk * 36 + e
    xo = blk * 128 + e
    return (tl.load(wa + wo), tl.load(wb + wo), tl.load(qa + wo + 4), tl.load(qa + wo + 8),
            tl.load(qb + wo + 4), tl.load(qb + wo + 8), tl.load(xr + xo), tl.load(xr + xo + 4),
            tl.load(xr + xo + 8), tl.load(xr + xo + 12), tl.load(xr + xo + 16), tl.load(xr + xo + 20),
            tl.load(xr + xo + 24), tl.load(xr + xo + 28))

@jit
def _gemv_frag_bf16_kernel(w_ptr, x_ptr, y_ptr, N, K, M, row_quads, stride_x, stride_ym,
                           WARPS: tl.constexpr, RT: tl.constexpr, NT: tl.constexpr,
                           SPLIT_K: tl.constexpr, PF: tl.constexpr, EMULATE: tl.constexpr,
                           PDL: tl.constexpr = 0):
    """q4_k × bf16 activation on bf16 mma (m16n8k16). Lane t of a row owns chunk t of every super-block
    (its 32 qs bytes: sub-blocks 2t and 2t + 1, 64 codes): per super-block, per row, two 16-byte weight
    loads, the two sub-blocks' scales as bf16 pairs, 16 mmas whose A words are sc·q (bf16) and whose B
    words are the column's activation pairs at the same codes (x[i], x[i + 2]: a `prmt` of two loaded
    pairs), 16 more whose A words are the mins mn (exact in bf16) — the two fp32 tiles take d and dmin
    once per super-block: y += d·Σ sc·q·x − dmin·Σ mn·x."""
    pdl_start(PDL)
    L: tl.constexpr = 32 * WARPS
    # the row length comes in 16-byte units so its 4-word alignment is known whatever Triton's divisibility
    # specialisation of the arguments (gemv_frag's fragment layout depends on it)
    row_words = row_quads * 4
    e, zw, g, t, row_a, col0 = _lane_map(tl.program_id(0), WARPS, RT, NT)
    wa = w_ptr + tl.minimum(row_a, N - 1).to(tl.int64) * row_words + zw
    wb = w_ptr + tl.minimum(row_a + 8, N - 1).to(tl.int64) * row_words + zw
    qa = wa + 8 * t  # the lane's chunk t: qs words 8t..8t + 7 after the 4 header words
    qb = wb + 8 * t
    # the lane's 64 activation values of a super-block (codes 64t..64t + 63) as 32 bf16-pair words
    xr = x_ptr + tl.minimum(col0 + g, M - 1).to(tl.int64) * stride_x + 32 * t + zw
    s0, s1 = _step_range(K, 1, SPLIT_K)
    zf = tl.zeros([L, RT, NT], dtype=tl.float32)
    magic = _pick(zw + 0x43004300, e, 0)
    acc0 = zf  # row g, column 2t
    acc1 = zf  # row g, column 2t + 1
    acc2 = zf  # row g + 8, column 2t
    acc3 = zf  # row g + 8, column 2t + 1
    # a super-block's loads (headers, the lane's qs words of rows g and g + 8, its 32 activation words)
    # are issued one step ahead (PF): the step computes while the next one's bytes are on their way
    blk_ld = tl.minimum(s0, s1 - 1)
    ha, hb, qa0, qa1, qb0, qb1, xl0, xl1, xl2, xl3, xh0, xh1, xh2, xh3 = _bf16_step_loads(
        wa, wb, qa, qb, xr, blk_ld, e)
    for blk in range(s0, s1):
        if PF:
            nxt = tl.minimum(blk + 1, s1 - 1)  # the last step reloads its own bytes (cache hits)
            (ha_n, hb_n, qa0_n, qa1_n, qb0_n, qb1_n, xl0_n, xl1_n, xl2_n, xl3_n, xh0_n, xh1_n, xh2_n,
             xh3_n) = _bf16_step_loads(wa, wb, qa, qb, xr, nxt, e)
        else:
            ha, hb, qa0, qa1, qb0, qb1, xl0, xl1, xl2, xl3, xh0, xh1, xh2, xh3 = _bf16_step_loads(
                wa, wb, qa, qb, xr, blk, e)
        s_lo = _pick(2 * t + zw, e, 0)
        sa0, ma0 = _k_scale_min_words(_pick(ha, e, 1), _pick(ha, e, 2), _pick(ha, e, 3), s_lo)
        sa1, ma1 = _k_scale_min_words(_pick(ha, e, 1), _pick(ha, e, 2), _pick(ha, e, 3), s_lo + 1)
        sb0, mb0 = _k_scale_min_words(_pick(hb, e, 1), _pick(hb, e, 2), _pick(hb, e, 3), s_lo)
        sb1, mb1 = _k_scale_min_words(_pick(hb, e, 1), _pick(hb, e, 2), _pick(hb, e, 3), s_lo + 1)
        scale_a = (_bf16_pair(sa0), _bf16_pair(sa1))
        bias_a = (_bf16_pair(-128.0 * sa0), _bf16_pair(-128.0 * sa1))
        scale_b = (_bf16_pair(sb0), _bf16_pair(sb1))
        bias_b = (_bf16_pair(-128.0 * sb0), _bf16_pair(-128.0 * sb1))
        min_a0 = _bf16_pair(ma0)
        min_a1 = _bf16_pair(ma1)
        min_b0 = _bf16_pair(mb0)
        min_b1 = _bf16_pair(mb1)
        d0 = zf
        d1 = zf
        d2 = zf
        d3 = zf
        m0 = zf
        m1 = zf
        m2 = zf
        m3 = zf
        for u in tl.static_range(8):  # qs word u of the chunk: codes 4u..4u + 3 of both sub-blocks
            if u < 4:
                w_a = _pick(qa0, e, u)
                w_b = _pick(qb0, e, u)
            else:
                w_a = _pick(qa1, e, u - 4)
                w_b = _pick(qb1, e, u - 4)
            a0, a1, a2, a3 = _q4_pairs(w_a, scale_a, bias_a, magic, EMULATE)
            b0, b1, b2, b3 = _q4_pairs(w_b, scale_b, bias_b, magic, EMULATE)
            # activation words 2u, 2u + 1 of the low and the high sub-block: codes 4u..4u + 3
            x_lo = _sel4(xl0, xl1, xl2, xl3, u // 2)
            x_hi = _sel4(xh0, xh1, xh2, xh3, u // 2)
            j = 2 * (u % 2)
            lo0 = _pick(x_lo, e, j)
            lo1 = _pick(x_lo, e, j + 1)
            hi0 = _pick(x_hi, e, j)
            hi1 = _pick(x_hi, e, j + 1)
            # x pairs at codes (4u, 4u + 2) and (4u + 1, 4u + 3), as the A words pair them
            x0 = prmt(lo0, lo1, 0x5410, EMULATE)
            x1 = prmt(lo0, lo1, 0x7632, EMULATE)
            x2 = prmt(hi0, hi1, 0x5410, EMULATE)
            x3 = prmt(hi0, hi1, 0x7632, EMULATE)
            d0, d1, d2, d3 = _mma_bf16(a0, b0, a1, b1, x0, x1, d0, d1, d2, d3, L, RT, NT, EMULATE)
            d0, d1, d2, d3 = _mma_bf16(a2, b2, a3, b3, x2, x3, d0, d1, d2, d3, L, RT, NT, EMULATE)
            m0, m1, m2, m3 = _mma_bf16(min_a0, min_b0, min_a0, min_b0, x0, x1, m0, m1, m2, m3, L, RT, NT,
                                       EMULATE)
            m0, m1, m2, m3 = _mma_bf16(min_a1, min_b1, min_a1, min_b1, x2, x3, m0, m1, m2, m3, L, RT, NT,
                                       EMULATE)
        d_a = _f16_lo(_pick(ha, e, 0))
        dm_a = _f16_lo(_pick(ha, e, 0) >> 16)
        d_b = _f16_lo(_pick(hb, e, 0))
        dm_b = _f16_lo(_pick(hb, e, 0) >> 16)
        acc0 += d_a * d0 - dm_a * m0
        acc1 += d_a * d1 - dm_a * m1
        acc2 += d_b * d2 - dm_b * m2
        acc3 += d_b * d3 - dm_b * m3
        if PF:
            ha, hb, qa0, qa1, qb0, qb1 = ha_n, hb_n, qa0_n, qa1_n, qb0_n, qb1_n
            xl0, xl1, xl2, xl3, xh0, xh1, xh2, xh3 = xl0_n, xl1_n, xl2_n, xl3_n, xh0_n, xh1_n, xh2_n, xh3_n
    _store_tile(y_ptr, acc0, acc1, acc2, acc3, _pick(row_a + zw, e, 0), _pick(col0 + 2 * t + zw, e, 0), M, N,
                stride_ym, SPLIT_K > 1)


def gemv_frag_bf16(raw: torch.Tensor, format: str, x: torch.Tensor, out_features: int,
                   schedule: FragSchedule | str, prefetch: bool = True) -> torch.Tensor:
    """`x @ Wᵀ -> [n, out_features]` in x's dtype, W the q4_k rows `raw` (uint8 `[N, row_bytes]`) decoded to
    bf16 in registers, x `[n, K]` (1–16 columns) read as bf16; on `raw`'s device (CUDA, or CPU under the
    interpreter)."""
    from ninfer.kernels.gguf_matmul import QuantKernelError, check_weight, triton_cdiv
    from ninfer.kernels.triton_support import INTERPRET

    format = format.removeprefix(GGUF_PREFIX)
    s = SCHEDULES[schedule] if isinstance(schedule, str) else schedule
    n, k = x.shape
    check_weight(raw, format, out_features, k)
    if format != "q4_k" or k % 256:
        raise QuantKernelError(f"schedule {s.name} (bf16 fragment GEMV) takes q4_k rows of whole 256-column "
                               f"blocks, not {format} with {k} columns")
    xb = x.to(torch.bfloat16).contiguous()
    partial = s.split_k > 1
    y = (torch.zeros if partial else torch.empty)(
        (n, out_features), dtype=torch.float32 if partial else x.dtype, device=raw.device)
    launch = (triton_cdiv(out_features, s.block_n), triton_cdiv(n, s.block_m), s.split_k)
    extra = {} if INTERPRET else {"num_warps": s.num_warps, "num_stages": s.num_stages}
    _gemv_frag_bf16_kernel[launch](raw.view(torch.int32), xb.view(torch.int32), y, out_features, k, n,
                                   raw.shape[1] // 16, k // 2, y.stride(0), WARPS=s.num_warps, RT=s.row_tiles,
                                   NT=s.block_m // 8, SPLIT_K=s.split_k, PF=prefetch, EMULATE=EMULATE_DP4A,
                                   **extra, **pdl_options(raw, trigger=False))
    return y.to(x.dtype)


def gemv_frag_bf16_twin(raw: torch.Tensor, x: torch.Tensor, out_features: int) -> torch.Tensor:
    """What `gemv_frag_bf16` computes, in float64: the q4_k weight with sc·q rounded to bf16 as the kernel
    decodes it (d, dmin and the mins exact), times the bf16 activation."""
    from ninfer.quant.dequant import _f16, _fields, _k_scales_mins

    blocks = raw.cpu().reshape(-1, 144)
    sc, mn = _k_scales_mins(blocks[:, 4:16])  # [B, 8]
    q = _fields(blocks[:, 16:144].reshape(-1, 4, 32), 4).reshape(-1, 8, 32)
    scq = (sc[:, :, None] * q.float()).to(torch.bfloat16).double()
    w = _f16(blocks, 0).double()[:, :, None] * scq - (_f16(blocks, 2).double() * mn.double())[:, :, None]
    return x.cpu().to(torch.bfloat16).double() @ w.reshape(out_features, -1).t()

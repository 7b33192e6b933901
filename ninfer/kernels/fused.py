"""Fused elementwise Triton kernels of the decoder layers: one launch each where PyTorch needs several.

Each kernel computes in fp32 and rounds where its reference (`*_reference` here, built only from
`ninfer.kernels.reference`) rounds, so the two agree to fp32 reduction order; inputs may be strided row
views (the split outputs of a merged projection). The models reach these through `ninfer.kernels.ops`.
"""

from __future__ import annotations

import os

import torch

from ninfer.errors import NinferError
from ninfer.kernels import reference
from ninfer.kernels.triton_support import HAVE_TRITON, jit, pdl_options, pdl_start, tl, tl_max, triton_runs_on

MAX_ROW = 65536  # the norms hold a whole row in one program
ELEMENTWISE_BLOCK = 1024


class FusedKernelError(NinferError):
    """Inputs a fused kernel cannot take (shape, width, layout)."""


def runs_on(t: torch.Tensor) -> bool:
    """True when the fused kernels should take `t` (CUDA, or CPU under NINFER_TRITON_ON_CPU=1)."""
    return HAVE_TRITON and triton_runs_on(t)


def round_kernels(t: torch.Tensor) -> bool:
    """Whether a decode round's first launches, the RoPE tables (`rope_cos_sin`) and the round's addresses
    (`kv_write.decode_rows`), take their one-launch kernels: where `runs_on(t)`, unless NINFER_ROUND_KERNELS=0
    (PyTorch's five and six launches, for A/B)."""
    return runs_on(t) and os.environ.get("NINFER_ROUND_KERNELS", "1") != "0"


# ---------------------------------------------------------------------------------------------------------
# References: compositions of the plain-PyTorch ops, in the order the models ran them before fusion


def add_rms_norm_reference(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, zero_centred: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """`new_residual = x + residual` (x when residual is None), then `rms_norm(new_residual)`."""
    new_residual = x if residual is None else residual + x
    return reference.rms_norm(new_residual, weight, eps, zero_centred), new_residual


def norm_rotary_reference(
    x: torch.Tensor, weight: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor, eps: float,
    zero_centred: bool = True,
) -> torch.Tensor:
    """Per-head RMSNorm of x [T, H, D] (skipped when weight is None), then partial rotate-half RoPE."""
    if weight is not None:
        x = reference.rms_norm(x, weight, eps, zero_centred)
    return reference.apply_rotary(x, cos, sin)


def sigmoid_gate_mul_reference(attn: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """The attention output gate: `attn · sigmoid(gate)` (the sigmoid rounded to attn's dtype first)."""
    return attn * torch.sigmoid(gate.float()).to(attn.dtype)


# ---------------------------------------------------------------------------------------------------------
# Kernels


def _extra(t: torch.Tensor, num_warps: int) -> dict:
    """Compile and launch options: the warps (not under the interpreter) and the `PDL` flag (every kernel
    here takes one)."""
    return pdl_options(t) | ({} if t.device.type == "cpu" else {"num_warps": num_warps})


def _row_warps(block: int) -> int:
    return max(1, min(16, block // 256))


if HAVE_TRITON:
    from ninfer.kernels.gemv_q8 import quantize_group_rows, quantize_groups

    @jit
    def _quantize_row(v, row, g0, ok, N, q_ptr, d_ptr, s_ptr, BLOCK: tl.constexpr, GROUP: tl.constexpr = 32):
        """The int8 activation (gemv_q8's format, GROUP values a scale) of a program's BLOCK rounded outputs
        `v` of row `row`, starting at group g0 (BLOCK a multiple of GROUP), for the Linear that reads them
        next."""
        G: tl.constexpr = BLOCK // GROUP
        quantize_groups(tl.reshape(tl.where(ok, v, 0.0), [G, GROUP]), row, g0 + tl.arange(0, G),
                        tl.reshape(ok, [G, GROUP]), N, q_ptr, d_ptr, s_ptr, GROUP)

    @jit
    def _sigmoid(x):
        # spelled out: tl.sigmoid is compiled-only when triton was imported before interpreter mode
        return 1.0 / (1.0 + tl.exp(-x))

    @jit
    def _row_sum(x):
        """`tl.sum(x, 0)` as a reduce with Triton's own sum combiner: the interpreter recognises it and
        sums in NumPy (an element-by-element Python loop for any other combiner), whichever mode Triton was
        imported in."""
        return tl.reduce(x, 0, tl.standard._sum_combine)

    @jit
    def _tile_sum(x):
        """The sum of a 2-D tile (`_row_sum` of each axis in turn)."""
        return tl.reduce(tl.reduce(x, 1, tl.standard._sum_combine), 0, tl.standard._sum_combine)

    @jit
    def _round(x, ty: tl.constexpr):
        """fp32 -> the I/O dtype, round to nearest even as PyTorch does. bf16 by integer arithmetic: Triton's
        interpreter truncates a plain `.to(bfloat16)` (and its "rtne" mode does not carry), and the tests run
        this very source there."""
        if ty == tl.bfloat16:
            bits = x.to(tl.uint32, bitcast=True)
            bits = bits + 0x7FFF + ((bits >> 16) & 1)
            return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        return x.to(ty)

    @jit
    def _norm_kernel(x_ptr, r_ptr, w_ptr, out_ptr, res_out_ptr, q_ptr, d_ptr, s_ptr, N, H, sx0, sx1, sr0, sr1,
                     so0, so1, sro0, sro1, eps, HAS_RES: tl.constexpr, HAS_W: tl.constexpr,
                     ZERO_CENTRED: tl.constexpr, QUANT: tl.constexpr, BLOCK: tl.constexpr,
                     CHUNK: tl.constexpr, GROUP: tl.constexpr = 32, PDL: tl.constexpr = 0):
        """One row of N per program axis 0, its CHUNK columns number program_id(1); rows are (i // H, i % H)
        of a [T, H, N] strided view. Each program sums the squares of the whole row, then writes its chunk
        (so that a one-row decode step's norm runs on N / CHUNK SMs, not one). QUANT (H = 1): the output's
        int8 activation too (q, d, s; GROUP values a scale). Rows are held as [groups, GROUP] tiles, the
        int8 activation's groups, so quantising needs no reshape (a layout conversion through shared
        memory) — except where CHUNK is one group of 256 (decode): then as rows of 32, as at GROUP 32, and
        the group quantised as those rows (`quantize_group_rows`). The norm weight (a constant) is loaded
        before the PDL wait, its latency hidden."""
        ONE: tl.constexpr = QUANT and GROUP == 256 and CHUNK == 256
        W: tl.constexpr = 32 if ONE else GROUP if BLOCK >= GROUP else BLOCK
        group = tl.program_id(1) * (CHUNK // W) + tl.arange(0, CHUNK // W)
        chunk = group[:, None] * W + tl.arange(0, W)[None, :]
        ok = chunk < N
        if HAS_W:
            w = tl.load(w_ptr + chunk, mask=ok, other=0.0).to(tl.float32)
            w = 1.0 + w if ZERO_CENTRED else w
        pdl_start(PDL)
        i = tl.program_id(0)
        t, h = i // H, i % H
        x_row, r_row = x_ptr + t * sx0 + h * sx1, r_ptr + t * sr0 + h * sr1
        cols = tl.arange(0, BLOCK // W)[:, None] * W + tl.arange(0, W)[None, :]
        s = _norm_input(x_row, r_row, cols, cols < N, HAS_RES, res_out_ptr.dtype.element_ty)
        inv = tl.math.rsqrt(_tile_sum(s * s) / N + eps)
        cols = chunk
        s = _norm_input(x_row, r_row, cols, ok, HAS_RES, res_out_ptr.dtype.element_ty)  # L1 hits
        if HAS_RES:
            tl.store(res_out_ptr + t * sro0 + h * sro1 + cols, s, mask=ok)
        y = s * inv
        if HAS_W:
            y = y * w
        y = _round(y, out_ptr.dtype.element_ty)
        tl.store(out_ptr + t * so0 + h * so1 + cols, y, mask=ok)
        if ONE:
            quantize_group_rows(y.to(tl.float32), i, tl.program_id(1), N, q_ptr, d_ptr, s_ptr)
        elif QUANT:  # W = GROUP (N a multiple of GROUP)
            quantize_groups(tl.where(ok, y.to(tl.float32), 0.0), i, group, ok, N, q_ptr, d_ptr, s_ptr, GROUP)

    @jit
    def _norm_input(x_row, r_row, cols, ok, HAS_RES: tl.constexpr, res_ty: tl.constexpr):
        """x at cols as fp32, or x + residual rounded to the residual stream's dtype (as it is stored)."""
        s = tl.load(x_row + cols, mask=ok, other=0.0).to(tl.float32)
        if HAS_RES:
            s = _round(s + tl.load(r_row + cols, mask=ok, other=0.0).to(tl.float32), res_ty).to(tl.float32)
        return s

    @jit
    def _gated_norm_kernel(o_ptr, z_ptr, w_ptr, out_ptr, scatter_ptr, q_ptr, d_ptr, s_ptr, N, H, so0, so1,
                           sz0, sz1, eps, SCATTER: tl.constexpr, QUANT: tl.constexpr, BLOCK: tl.constexpr,
                           GROUP: tl.constexpr = 32, PDL: tl.constexpr = 0):
        """`rmsnorm(o)·w·silu(z)` per row of N; rows (i // H, i % H); o first rounded to the output dtype (the
        unfused model cast the mixer's fp32 output first). Out contiguous [T, H·N]; with SCATTER, flat column
        c of row t lands in column scatter[c] (a Linear's input-column order applied on the way out). QUANT
        (BLOCK = N, a multiple of GROUP, and each head's N columns landing as one aligned run): the int8
        activation of out's rows too. The constants (norm weight, scatter) are loaded before the PDL wait."""
        i = tl.program_id(0)
        t, h = i // H, i % H
        cols = tl.arange(0, BLOCK)
        ok = cols < N
        w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
        if SCATTER:
            dest = tl.load(scatter_ptr + h * N + cols, mask=ok, other=0)
        pdl_start(PDL)
        o = tl.load(o_ptr + t * so0 + h * so1 + cols, mask=ok, other=0.0).to(tl.float32)
        o = _round(o, out_ptr.dtype.element_ty).to(tl.float32)
        z = tl.load(z_ptr + t * sz0 + h * sz1 + cols, mask=ok, other=0.0).to(tl.float32)
        inv = tl.math.rsqrt(_row_sum(o * o) / N + eps)
        y = _round(o * inv * w * (z * _sigmoid(z)), out_ptr.dtype.element_ty)
        if SCATTER:
            tl.store(out_ptr + t * H * N + dest, y, mask=ok)
        else:
            dest = h * N + cols
            tl.store(out_ptr + i * N + cols, y, mask=ok)
        if QUANT:  # the head's run starts at its smallest destination column
            _quantize_row(y.to(tl.float32), t, -tl_max(-dest, 0) // GROUP, ok, H * N, q_ptr, d_ptr, s_ptr,
                          BLOCK, GROUP)

    @jit
    def _gated_norm_heads_kernel(o_ptr, z_ptr, w_ptr, out_ptr, scatter_ptr, gather_ptr, q_ptr, d_ptr, s_ptr,
                                 N, H, so0, so1, sz0, sz1, eps, SCATTER: tl.constexpr,
                                 BLOCK: tl.constexpr, HEADS: tl.constexpr, PDL: tl.constexpr = 0):
        """`_gated_norm_kernel` with QUANT for int8 groups of HEADS heads (BLOCK = N): program (t, g) takes
        the heads whose runs make up output columns g·HEADS·N .. (g + 1)·HEADS·N - 1, in their order (with
        SCATTER found through gather, scatter's inverse: `gather[g·HEADS·N + k·N] // N`), and writes group
        g."""
        i = tl.program_id(0)
        t, g = i // (H // HEADS), i % (H // HEADS)
        cols = tl.arange(0, BLOCK)[None, :]
        if SCATTER:
            h = tl.load(gather_ptr + g * HEADS * N + tl.arange(0, HEADS)[:, None] * N) // N
        else:
            h = g * HEADS + tl.arange(0, HEADS)[:, None]
        w = tl.load(w_ptr + cols).to(tl.float32)
        if SCATTER:
            dest = tl.load(scatter_ptr + h * N + cols)
        else:
            dest = h * N + cols
        pdl_start(PDL)
        o = tl.load(o_ptr + t * so0 + h * so1 + cols).to(tl.float32)
        o = _round(o, out_ptr.dtype.element_ty).to(tl.float32)
        z = tl.load(z_ptr + t * sz0 + h * sz1 + cols).to(tl.float32)
        inv = tl.math.rsqrt(tl.reduce(o * o, 1, tl.standard._sum_combine)[:, None] / N + eps)
        y = _round(o * inv * w * (z * _sigmoid(z)), out_ptr.dtype.element_ty)
        tl.store(out_ptr + t * H * N + dest, y)
        whole = tl.arange(0, HEADS * BLOCK) < HEADS * BLOCK  # every column: BLOCK = N
        _quantize_row(tl.reshape(y, [HEADS * BLOCK]).to(tl.float32), t, g, whole, H * N, q_ptr, d_ptr, s_ptr,
                      HEADS * BLOCK, HEADS * BLOCK)

    @jit
    def _rope_kernel(pos_ptr, freq_ptr, cos_ptr, sin_ptr, F, s_pos, BLOCK: tl.constexpr,
                     PDL: tl.constexpr = 0):
        """Row t: the angles pos[t]·freq[j] (fp32, as PyTorch multiplies them) and their cos and sin
        (libdevice's, as PyTorch's CUDA ops), each at columns j and F + j (the rotate-half tables)."""
        pdl_start(PDL)
        t = tl.program_id(0)
        j = tl.arange(0, BLOCK)
        ok = j < F
        angle = tl.load(pos_ptr + t * s_pos).to(tl.float32) * tl.load(freq_ptr + j, mask=ok, other=0.0)
        c, s = tl.cos(angle), tl.sin(angle)
        row = t * 2 * F + j
        tl.store(cos_ptr + row, c, mask=ok)
        tl.store(cos_ptr + row + F, c, mask=ok)
        tl.store(sin_ptr + row, s, mask=ok)
        tl.store(sin_ptr + row + F, s, mask=ok)

    NO_KEY = tl.constexpr(-2147483647)  # below every number's `_order_key` (columns past the vocab)

    @jit
    def _logits_argmax_kernel(x_ptr, out_ptr, key_ptr, col_ptr, N, V, sx, so, CHUNKS,
                              BLOCK: tl.constexpr, PDL: tl.constexpr = 0):
        """Row r, chunk c of BLOCK columns: x's fp32 copy (all N columns) into out, and among the columns
        below V the largest value's order key (`_order_key`) and first column, at [r, c] of key / col."""
        pdl_start(PDL)
        r, c = tl.program_id(0), tl.program_id(1)
        cols = c * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + r * sx + cols, mask=cols < N, other=0.0).to(tl.float32)
        tl.store(out_ptr + r * so + cols, x, mask=cols < N)
        best, first = _first_best(tl.where(cols < V, _order_key(x), NO_KEY), cols)
        tl.store(key_ptr + r * CHUNKS + c, best)
        tl.store(col_ptr + r * CHUNKS + c, first)

    @jit
    def _order_key(x):
        """int32 keys in the order of fp32 x as argmax compares them: −0 as +0, NaN above every number."""
        bits = tl.where(x == 0.0, 0.0, x).to(tl.int32, bitcast=True)
        key = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
        return tl.where(x != x, 0x7FFFFFFF, key)

    @jit
    def _first_best(key, col):
        """The largest of `key` and the smallest `col` among its holders."""
        best = tl.max(key, 0)
        return best, tl.min(tl.where(key == best, col, 2147483647), 0)

    @jit
    def _argmax_chunks_kernel(key_ptr, col_ptr, ids_ptr, CHUNKS, BLOCK: tl.constexpr, PDL: tl.constexpr = 0):
        """Row r's argmax from its chunks' best keys and first columns: the first column of the best key."""
        pdl_start(PDL)
        r = tl.program_id(0)
        c = tl.arange(0, BLOCK)
        key = tl.load(key_ptr + r * CHUNKS + c, mask=c < CHUNKS, other=NO_KEY)
        col = tl.load(col_ptr + r * CHUNKS + c, mask=c < CHUNKS, other=0)
        tl.store(ids_ptr + r, _first_best(key, col)[1].to(tl.int64))

    @jit
    def _norm_rotary_kernel(x_ptr, w_ptr, out_ptr, x2_ptr, w2_ptr, out2_ptr, cos_ptr, sin_ptr, D, H, H2, R,
                            sx0, sx1, sx20, sx21, sc0, ss0, eps, HAS_W: tl.constexpr,
                            ZERO_CENTRED: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = 0):
        """Per head row of D: RMSNorm (rounded to the dtype, as the unfused ops did), then rotate-half on
        the first R dims: `y[d] = n[d]·cos[d] + n[partner(d)]·sin[d]·(−1 if d < R/2)`; out contiguous.
        Programs t·(H + H2) + h take head h of x (h < H) or head h − H of x2 (the keys beside the queries:
        one launch for both); their norm weights w, w2."""
        pdl_start(PDL)
        i = tl.program_id(0)
        t, h = i // (H + H2), i % (H + H2)
        if h < H:
            _norm_rotary_row(x_ptr + t * sx0 + h * sx1, w_ptr, out_ptr + (t * H + h) * D, cos_ptr + t * sc0,
                             sin_ptr + t * ss0, D, R, eps, HAS_W, ZERO_CENTRED, BLOCK)
        else:
            _norm_rotary_row(x2_ptr + t * sx20 + (h - H) * sx21, w2_ptr, out2_ptr + (t * H2 + h - H) * D,
                             cos_ptr + t * sc0, sin_ptr + t * ss0, D, R, eps, HAS_W, ZERO_CENTRED, BLOCK)

    @jit
    def _norm_rotary_row(row, w_ptr, out_row, cos_row, sin_row, D, R, eps, HAS_W: tl.constexpr,
                         ZERO_CENTRED: tl.constexpr, BLOCK: tl.constexpr):
        cols = tl.arange(0, BLOCK)
        ok = cols < D
        half = R // 2
        rot = cols < R
        partner = tl.where(cols < half, cols + half, cols - half)
        x = tl.load(row + cols, mask=ok, other=0.0).to(tl.float32)
        xp = tl.load(row + partner, mask=rot, other=0.0).to(tl.float32)
        if HAS_W:
            inv = tl.math.rsqrt(_row_sum(x * x) / D + eps)
            w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
            wp = tl.load(w_ptr + partner, mask=rot, other=0.0).to(tl.float32)
            if ZERO_CENTRED:
                w, wp = 1.0 + w, 1.0 + wp
            x = _round(x * inv * w, out_row.dtype.element_ty).to(tl.float32)
            xp = _round(xp * inv * wp, out_row.dtype.element_ty).to(tl.float32)
        c = tl.load(cos_row + cols, mask=rot, other=1.0).to(tl.float32)
        s = tl.load(sin_row + cols, mask=rot, other=0.0).to(tl.float32)
        y = x * c + tl.where(cols < half, -xp, xp) * s
        tl.store(out_row + cols, _round(y, out_row.dtype.element_ty), mask=ok)

    @jit
    def _store_row_block(out_ptr, y, t, cols, ok, N, q_ptr, d_ptr, s_ptr, QUANT: tl.constexpr,
                         BLOCK: tl.constexpr, GROUP: tl.constexpr):
        """An elementwise kernel's fp32 results into row t of the contiguous [T, N] out (rounded to its
        dtype), and with QUANT their int8 activation (GROUP values a scale)."""
        y = _round(y, out_ptr.dtype.element_ty)
        tl.store(out_ptr + t * N + cols, y, mask=ok)
        if QUANT:
            _quantize_row(y.to(tl.float32), t, tl.program_id(1) * (BLOCK // GROUP), ok, N, q_ptr, d_ptr,
                          s_ptr, BLOCK, GROUP)

    @jit
    def _swiglu_kernel(g_ptr, u_ptr, out_ptr, q_ptr, d_ptr, s_ptr, N, sg, su, QUANT: tl.constexpr,
                       BLOCK: tl.constexpr, GROUP: tl.constexpr = 32, PDL: tl.constexpr = 0):
        """`silu(gate)·up` over [T, N] row views; out contiguous."""
        pdl_start(PDL)
        t = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < N
        g = tl.load(g_ptr + t * sg + cols, mask=ok, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + t * su + cols, mask=ok, other=0.0).to(tl.float32)
        _store_row_block(out_ptr, g * _sigmoid(g) * u, t, cols, ok, N, q_ptr, d_ptr, s_ptr, QUANT, BLOCK,
                         GROUP)

    @jit
    def _gate_mul_kernel(a_ptr, g_ptr, out_ptr, q_ptr, d_ptr, s_ptr, N, sa, sg, QUANT: tl.constexpr,
                         BLOCK: tl.constexpr, GROUP: tl.constexpr = 32, PDL: tl.constexpr = 0):
        """`attn · sigmoid(gate)` over [T, N] row views, the sigmoid rounded to the output dtype first."""
        pdl_start(PDL)
        t = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < N
        a = tl.load(a_ptr + t * sa + cols, mask=ok, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + t * sg + cols, mask=ok, other=0.0).to(tl.float32)
        gate = _round(_sigmoid(g), out_ptr.dtype.element_ty).to(tl.float32)
        _store_row_block(out_ptr, a * gate, t, cols, ok, N, q_ptr, d_ptr, s_ptr, QUANT, BLOCK, GROUP)


# ---------------------------------------------------------------------------------------------------------
# Launchers


def _rows3(x: torch.Tensor, what: str) -> torch.Tensor:
    """x as a [T, H, N] view with unit stride along N (2D inputs get H = 1)."""
    if x.dim() == 2:
        x = x[:, None, :]
    if x.dim() != 3 or x.stride(2) != 1:
        raise FusedKernelError(f"{what} must be [T, N] or [T, H, N] with unit stride along N, got shape "
                               f"{tuple(x.shape)} strides {x.stride()}; pass a contiguous tensor")
    if x.shape[2] > MAX_ROW:
        raise FusedKernelError(f"{what} rows of {x.shape[2]} exceed the fused norms' {MAX_ROW}; use the "
                               "reference op")
    return x


NORM_CHUNK = 512  # columns per program where a norm's rows are split (bench/fused_timing.py: 2.6 µs vs 6.0)
NORM_SPLIT_ROWS = 16  # split rows when there are at most this many (NINFER_NORM_SPLIT_ROWS for A/B)
# Up to this many rows quantised in groups of 256 (q4il's activations), a program a group, held as rows of
# 32 (the group's reductions to scalars, `quantize_group_rows`), instead of NORM_CHUNK columns as [2, 256]
# tiles, whose reductions and reshape crossed the program's 16 warps (17 barriers against 5). The 27B Q4_K's
# graphed rounds (H100, session 61): 1 lane 6.074 -> 6.044 ms, 2 lanes 6.243 -> 6.225, but 8 lanes 7.170 ->
# 7.277 (twice the programs, each reading its whole row for the sum). NINFER_NORM_ONE_GROUP=0 / 1: never /
# at any count of split rows, for A/B.
NORM_ONE_GROUP_ROWS = 2


def norm_one_group(rows: int) -> bool:
    """Whether the decode norm of `rows` rows quantising in groups of 256 runs a program a group."""
    forced = os.environ.get("NINFER_NORM_ONE_GROUP", "")
    return forced == "1" if forced in ("0", "1") else rows <= NORM_ONE_GROUP_ROWS


def norm_split_rows() -> int:
    """Up to how many rows the decode norm runs each row over several programs (beyond: a program a row)."""
    return int(os.environ.get("NINFER_NORM_SPLIT_ROWS") or NORM_SPLIT_ROWS)


def _block(n: int) -> int:
    return max(16, 1 << (n - 1).bit_length())


def int8_buffers(out: torch.Tensor, quantize: bool, group: int = 32) -> tuple[torch.Tensor, ...]:
    """Where a kernel writes the int8 activation of its `[T, N]` output `out` (gemv_q8's format, `group`
    values a scale), or placeholders (any pointer) when it does not quantise."""
    from ninfer.kernels.gemv_q8 import empty_sums

    if not quantize:
        return out, out, out
    T, N = out.shape
    if N % group or group not in (32, 256):
        raise FusedKernelError(f"int8 activation rows need a multiple of {group} columns (groups of 32 or "
                               f"256), got {N}")
    return (torch.empty((T, N), dtype=torch.int8, device=out.device),
            torch.empty((T, N // group), dtype=torch.float32, device=out.device),
            empty_sums(T, N, group, out.device))


def remember_int8(out: torch.Tensor, buffers: tuple[torch.Tensor, ...]) -> None:
    """The Linear reading `out` next finds its int8 activation in gemv_q8's memo instead of quantising."""
    from ninfer.kernels.gemv_q8 import QuantizedActivation, remember_activation

    remember_activation(out, QuantizedActivation(*buffers, out.dtype))


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, zero_centred: bool,
    quantize: bool = False, group: int = 32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(rms_norm(x + residual), x + residual)` in one launch; residual None: `(rms_norm(x), x)`. `quantize`
    (2-D x): the normed output's int8 activation too (`group` values a scale), left for the Linear that
    reads it (gemv_q8's memo)."""
    x3 = _rows3(x, "x")
    T, H, N = x3.shape
    if quantize and x.dim() != 2:
        raise FusedKernelError(f"the int8 activation is made for [T, N] rows, got shape {tuple(x.shape)}")
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    q8 = int8_buffers(out, quantize, group)
    o3 = out.view(T, H, N)
    if residual is None:
        r3 = ro3 = x3
        new_residual = x
    else:
        if residual.shape != x.shape:
            raise FusedKernelError(f"residual shape {tuple(residual.shape)} differs from x {tuple(x.shape)}")
        r3 = _rows3(residual, "residual")
        new_residual = torch.empty(x.shape, dtype=residual.dtype, device=x.device)
        ro3 = new_residual.view(T, H, N)
    if T * H:
        block = _block(N)
        # a few rows (decode): each row over several programs, each re-reading the row for its sum
        chunk = block
        if T * H <= norm_split_rows():
            one = quantize and group == 256 and norm_one_group(T * H)
            chunk = 256 if one else min(block, NORM_CHUNK)
        _norm_kernel[(T * H, -(-N // chunk))](
            x3, r3, weight, o3, ro3, *q8, N, H, x3.stride(0), x3.stride(1), r3.stride(0), r3.stride(1),
            o3.stride(0), o3.stride(1), ro3.stride(0), ro3.stride(1), eps, HAS_RES=residual is not None,
            HAS_W=True, ZERO_CENTRED=zero_centred, QUANT=quantize, BLOCK=block, CHUNK=chunk,
            GROUP=group if quantize else 32, **_extra(x, _row_warps(block)))
    if quantize:
        remember_int8(out, q8)
    return out, new_residual


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centred: bool) -> torch.Tensor:
    """RMSNorm over the last dim of [T, N] or [T, H, N] (per head), one launch."""
    return add_rms_norm(x, None, weight, eps, zero_centred)[0]


# Warps of a `_gated_norm_heads_kernel` program (a group of 256 over heads of 128 or fewer): on one warp (as
# `_row_warps` gives 256 columns) each thread ran a ~840-instruction chain with nothing to hide its latency;
# four issue ~510 each and meet 13 barriers. The 27B Q4_K's graphed rounds (H100, session 61): 1 lane 6.044 ->
# 6.000 ms (two warps 6.013), 8 lanes on their own slots 7.831 -> 7.796.
GATED_HEADS_WARPS = 4


def gated_heads_warps() -> int:
    """`GATED_HEADS_WARPS`, or NINFER_GATED_NORM_WARPS (1, 2, 4 or 8) for A/B."""
    forced = os.environ.get("NINFER_GATED_NORM_WARPS", "")
    return int(forced) if forced in ("1", "2", "4", "8") else GATED_HEADS_WARPS


def gated_rms_norm(
    o: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float, out_dtype: torch.dtype | None = None,
    scatter: torch.Tensor | None = None, quantize: bool = False, group: int = 32,
    gather: torch.Tensor | None = None,
) -> torch.Tensor:
    """The GDN output norm `rmsnorm(o)·w·silu(z)` over the last dim, in `out_dtype` (default o's; o is rounded
    to it first). `scatter` (int [H·N], a permutation): output `[T, H·N]` whose column scatter[c] holds
    flat column c, i.e. `gated_rms_norm_reference(...)[:, argsort(scatter)]` in the same launch. `quantize`
    (N a power of two and a multiple of 32; with `scatter`, each head's N columns one aligned run: see
    `models.weights.aligned_run`): output `[T, H·N]` and its int8 activation, `group` values a scale, left
    for the Linear that reads it. A group wider than a head (256 over heads of 128) takes its heads in one
    program; with `scatter` they are found through `gather` (its inverse)."""
    o3, z3 = _rows3(o, "o"), _rows3(z, "z")
    if o3.shape != z3.shape:
        raise FusedKernelError(f"gated norm: o {tuple(o.shape)} and z {tuple(z.shape)} differ")
    T, H, N = o3.shape
    for name, perm in (("scatter", scatter), ("gather", gather)):
        if perm is not None and (perm.shape != (H * N,) or perm.device != o.device):
            raise FusedKernelError(f"gated norm: {name} must be [{H * N}] on {o.device}, got "
                                   f"{tuple(perm.shape)} on {perm.device}")
    block = _block(N)
    heads = max(1, group // N) if quantize else 1
    if quantize and (block != N or N % 32 or H % heads):  # groups (32 or 256) then divide or tile heads
        raise FusedKernelError(f"gated norm: the int8 activation in groups of {group} needs heads of a "
                               f"power-of-two multiple of 32 columns, whole groups of them; got {H} of {N}")
    if heads > 1 and scatter is not None and gather is None:
        raise FusedKernelError(f"gated norm: groups of {group} over heads of {N} and a scatter take `gather`")
    flat = scatter is not None or quantize
    out = torch.empty((T, H * N) if flat else o.shape, dtype=out_dtype or o.dtype, device=o.device)
    q8 = int8_buffers(out, quantize, group)
    if T * H:
        dest = o3 if scatter is None else scatter  # any pointer when not scattering
        strides = (o3.stride(0), o3.stride(1), z3.stride(0), z3.stride(1))
        if heads > 1:
            _gated_norm_heads_kernel[(T * H // heads,)](
                o3, z3, weight, out, dest, o3 if gather is None else gather, *q8, N, H, *strides, eps,
                SCATTER=scatter is not None, BLOCK=block, HEADS=heads, **_extra(o, gated_heads_warps()))
        else:
            _gated_norm_kernel[(T * H,)](o3, z3, weight, out, dest, *q8, N, H, *strides, eps,
                                         SCATTER=scatter is not None, QUANT=quantize, BLOCK=block,
                                         GROUP=group if quantize else 32, **_extra(o, _row_warps(block)))
    if quantize:
        remember_int8(out, q8)
    return out


def gated_rms_norm_reference(
    o: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float, out_dtype: torch.dtype | None = None,
    gather: torch.Tensor | None = None,
) -> torch.Tensor:
    """`reference.gated_rms_norm(o.to(out_dtype))`; with `gather` (the inverse of the kernel's scatter) the
    flattened `[T, H·N]` output's columns `gather`, as `Linear` applies recorded input columns."""
    out = reference.gated_rms_norm(o.to(out_dtype or o.dtype), z, weight, eps)
    return out if gather is None else out.reshape(o.shape[0], -1).index_select(-1, gather)


def norm_rotary(
    x: torch.Tensor, weight: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor, eps: float,
    zero_centred: bool = True,
) -> torch.Tensor:
    """Per-head RMSNorm (none when weight is None) + rotate-half RoPE on the first cos.shape[-1] dims of
    x [T, H, D]; cos/sin [T, R] fp32 (`reference.mrope_cos_sin`). One launch; out contiguous."""
    return norm_rotary_pair(x, weight, x[:, :0], weight, cos, sin, eps, zero_centred)[0]


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin `[T, 2F]` fp32 of positions `[T]` (integer) and inverse frequencies `[F]` fp32: what
    `reference.mrope_cos_sin` gives for text positions (the outer product, the frequencies repeated for both
    halves, cos and sin: five launches in PyTorch) in one launch."""
    if positions.dim() != 1 or inv_freq.dim() != 1 or inv_freq.dtype != torch.float32:
        raise FusedKernelError(f"rope_cos_sin takes positions [T] and fp32 inverse frequencies [F], got "
                               f"{tuple(positions.shape)} and {inv_freq.dtype} {tuple(inv_freq.shape)}")
    T, F = positions.shape[0], inv_freq.shape[0]
    cos = torch.empty((T, 2 * F), dtype=torch.float32, device=positions.device)
    sin = torch.empty_like(cos)
    if T * F:
        _rope_kernel[(T,)](positions, inv_freq.contiguous(), cos, sin, F, positions.stride(0),
                           BLOCK=_block(F), **_extra(positions, 1))
    return cos, sin


ARGMAX_BLOCK = 2048  # logits columns a program: the 27B's 248,320 in 122 programs a row


def logits_argmax(logits: torch.Tensor, vocab: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 logits `[T, N]` of the head's `logits` (any float dtype, unit column stride) and each row's argmax
    over its first `vocab` columns (default all; the first of equal maxima, NaN above every number, as
    `torch.argmax`), int64 `[T]`, in two launches: the cast with each chunk's maximum, then the rows' choice
    (PyTorch: the cast, then a memset and a reduction after it)."""
    T, N = _rows2(logits, "logits_argmax's logits").shape
    vocab = N if vocab is None else vocab
    if not 0 < vocab <= N:
        raise FusedKernelError(f"logits_argmax: vocab {vocab} must be in 1..{N}")
    out = torch.empty((T, N), dtype=torch.float32, device=logits.device)
    ids = torch.empty(T, dtype=torch.long, device=logits.device)
    chunks = -(-N // ARGMAX_BLOCK)
    keys = torch.empty((2, T, chunks), dtype=torch.int32, device=logits.device)
    if T:
        _logits_argmax_kernel[(T, chunks)](logits, out, keys[0], keys[1], N, vocab, logits.stride(0),
                                           out.stride(0), chunks, BLOCK=ARGMAX_BLOCK, **_extra(logits, 4))
        _argmax_chunks_kernel[(T,)](keys[0], keys[1], ids, chunks, BLOCK=_block(chunks), **_extra(logits, 1))
    return out, ids


def norm_rotary_pair(
    x: torch.Tensor, weight: torch.Tensor | None, x2: torch.Tensor, weight2: torch.Tensor | None,
    cos: torch.Tensor, sin: torch.Tensor, eps: float, zero_centred: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`norm_rotary` of x [T, H, D] and of x2 [T, H2, D] (queries and keys, each with its own norm weight,
    both or neither) in one launch."""
    for name, t in (("x", x), ("x2", x2)):
        if t.dim() != 3 or (t.shape[1] and t.stride(2) != 1):
            raise FusedKernelError(f"norm_rotary takes {name} [T, H, D], unit stride along D; got "
                                   f"{tuple(t.shape)}")
    T, H, D = x.shape
    R = cos.shape[-1]
    if x2.shape[0] != T or x2.shape[2] != D or (weight is None) != (weight2 is None):
        raise FusedKernelError(f"norm_rotary_pair: x2 {tuple(x2.shape)} must be [T={T}, H2, D={D}], with a "
                               "norm weight exactly when x has one")
    unit_stride = cos.stride(-1) == 1 and sin.stride(-1) == 1
    if R % 2 or R > D or cos.shape[0] != T or sin.shape != cos.shape or not unit_stride:
        raise FusedKernelError(f"norm_rotary: cos/sin {tuple(cos.shape)} must be [T={T}, R], even R <= {D}")
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    out2 = torch.empty(x2.shape, dtype=x2.dtype, device=x2.device)
    H2 = x2.shape[1]
    if T * (H + H2):
        block = _block(D)
        w, w2 = (x, x2) if weight is None else (weight, weight2)  # any pointer when there is no norm
        second = (x2, w2, out2) if H2 else (x, w, out)  # never read without heads (maybe no storage)
        _norm_rotary_kernel[(T * (H + H2),)](
            x, w, out, *second, cos, sin, D, H, H2, R, x.stride(0), x.stride(1), second[0].stride(0),
            second[0].stride(1), cos.stride(0), sin.stride(0), eps, HAS_W=weight is not None,
            ZERO_CENTRED=zero_centred, BLOCK=block, **_extra(x, _row_warps(block)))
    return out, out2


def _rows2(x: torch.Tensor, what: str) -> torch.Tensor:
    if x.dim() != 2 or x.stride(1) != 1:
        raise FusedKernelError(f"{what} must be a [T, N] row view with unit column stride, got shape "
                               f"{tuple(x.shape)} strides {x.stride()}")
    return x


def _elementwise2(kernel, a: torch.Tensor, b: torch.Tensor, op: str, names: tuple[str, str],
                  quantize: bool, group: int = 32) -> torch.Tensor:
    """One launch of a two-input elementwise kernel over [T, N] row views; output [T, N] in a's dtype (and
    its int8 activation where `quantize`, `group` values a scale)."""
    x, y = _rows2(a, names[0]), _rows2(b, names[1])
    if x.shape != y.shape:
        raise FusedKernelError(f"{op}: {names[0]} {tuple(x.shape)} and {names[1]} {tuple(y.shape)} differ")
    T, N = x.shape
    out = torch.empty((T, N), dtype=a.dtype, device=a.device)
    q8 = int8_buffers(out, quantize, group)
    if T * N:
        grid = (T, -(-N // ELEMENTWISE_BLOCK))
        kernel[grid](x, y, out, *q8, N, x.stride(0), y.stride(0), QUANT=quantize, BLOCK=ELEMENTWISE_BLOCK,
                     GROUP=group if quantize else 32, **_extra(x, 4))
    if quantize:
        remember_int8(out, q8)
    return out


def swiglu(gate: torch.Tensor, up: torch.Tensor, quantize: bool = False, group: int = 32) -> torch.Tensor:
    """`silu(gate)·up` of two [T, I] row views (e.g. the halves of a merged gate|up output), gate's dtype;
    `quantize`: its int8 activation too (`group` values a scale), left for the Linear that reads it
    (gemv_q8's memo)."""
    return _elementwise2(_swiglu_kernel, gate, up, "swiglu", ("gate", "up"), quantize, group)


def sigmoid_gate_mul(attn: torch.Tensor, gate: torch.Tensor, quantize: bool = False, group: int = 32
                     ) -> torch.Tensor:
    """`attn · sigmoid(gate)` of two [T, N] row views, in attn's dtype (`quantize`, `group`: `swiglu`'s)."""
    return _elementwise2(_gate_mul_kernel, attn, gate, "sigmoid_gate_mul", ("attn", "gate"), quantize, group)

"""Quantized matmul `y = x @ Wᵀ` reading GGUF blocks directly (no dequantised copy of the weights).

The weight stays in its GGUF bytes, uint8 `[out_features, row_bytes]` (one ggml row per output feature).
One Triton kernel serves decode (1–16 columns: a 16-wide column tile, the weight stream is the cost) and
prefill (many columns: larger tiles, the dequantised tile feeds a tensor-core dot). Each program
dequantises a `[BLOCK_N, BLOCK_K]` weight tile into registers and multiplies it with the activation tile.
`quant_matmul_reference` (dequantise with `ninfer.quant` + torch matmul) is the fallback and the test oracle.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch

from ninfer.errors import NinferError
from ninfer.kernels.gdn_decode import ConvEpilogue
from ninfer.kernels.triton_support import HAVE_TRITON, jit, tl, tl_sum, triton_runs_on
from ninfer.quant import FORMATS, dequantize
from ninfer.quant.formats import GGUF_PREFIX

# Format codes the kernel branches on (compile-time constants).
FORMAT_CODES = {"q4_0": 0, "q4_1": 1, "q5_0": 2, "q8_0": 3, "q4_k": 4, "q5_k": 5, "q6_k": 6,
                "iq4_xs": 7, "iq3_s": 8}
KERNEL_FORMATS = tuple(FORMAT_CODES)
FMA_FORMATS = ("q4_k", "iq3_s")  # formats the 1–4 column FMA kernel decodes
WV_FORMATS = ("q4_k", "iq3_s", "q6_k", "q5_k", "q8_0")  # formats the word-vector GEMV kernel decodes
PREFILL_ROWS = 8192  # weight rows made dense at a time for a prefill matmul (80 MiB of bf16 at 5120 inputs)


class QuantKernelError(NinferError):
    """A quantized weight cannot be used by the matmul kernels (format or shape)."""


@dataclass(frozen=True)
class MatmulSchedule:
    """One way to run the matmul. `kernel`: "sub" (per sub-block tensor-core dots, the decode kernel),
    "elem" (per-element dequantisation, the simple kernel) or "dequant_mm" (dequantise the weight into a
    transient bf16 buffer with the elem kernel's decoder, then torch's matmul: prefill). Tiles: rows (out
    features) × columns (tokens) × reduction step (elem only), split-K partitions."""

    name: str
    kernel: str
    block_n: int
    block_m: int
    block_k: int = 256
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 2


SCHEDULES: dict[str, MatmulSchedule] = {
    s.name: s
    for s in (
        MatmulSchedule("sub_n16", "sub", 16, 16),
        MatmulSchedule("sub_n32", "sub", 32, 16),
        MatmulSchedule("sub_n64", "sub", 64, 16),
        MatmulSchedule("sub_n32_w2", "sub", 32, 16, num_warps=2),
        MatmulSchedule("sub_n16_s4", "sub", 16, 16, split_k=4),
        MatmulSchedule("sub_n32_s4", "sub", 32, 16, split_k=4),
        MatmulSchedule("sub_n64_m64", "sub", 64, 64),
        MatmulSchedule("elem_n16_k256", "elem", 16, 16, 256),
        MatmulSchedule("elem_n16_k256_s4", "elem", 16, 16, 256, split_k=4),
        MatmulSchedule("elem_n128_m128_k64_w8", "elem", 128, 128, 64, num_warps=8, num_stages=3),
        MatmulSchedule("tiny_elem", "elem", 16, 16, 64),
        MatmulSchedule("tiny_sub", "sub", 16, 16),
        MatmulSchedule("fma_n32_m1", "fma", 32, 1),
        MatmulSchedule("fma_n64_m1", "fma", 64, 1),
        MatmulSchedule("fma_n16_m1_s4", "fma", 16, 1, split_k=4),
        MatmulSchedule("fma_n32_m1_s2", "fma", 32, 1, split_k=2),
        MatmulSchedule("fma_n16_m4", "fma", 16, 4),
        MatmulSchedule("fma_n32_m4", "fma", 32, 4),
        MatmulSchedule("fma_n16_m4_s4", "fma", 16, 4, split_k=4),
        MatmulSchedule("tiny_fma_m2", "fma", 16, 2),
        MatmulSchedule("dequant_mm", "dequant_mm", 64, 0, 256),
        MatmulSchedule("wv_n16_m1", "wv", 16, 1),
        MatmulSchedule("wv_n32_m1", "wv", 32, 1),
        MatmulSchedule("wv_n64_m1", "wv", 64, 1, num_warps=8),
        MatmulSchedule("wv_n16_m1_s2", "wv", 16, 1, split_k=2),
        MatmulSchedule("wv_n16_m1_s4", "wv", 16, 1, split_k=4),
        MatmulSchedule("wv_n8_m1_s4", "wv", 8, 1, split_k=4),
        MatmulSchedule("wv_n16_m4", "wv", 16, 4),
        MatmulSchedule("wv_n16_m4_s4", "wv", 16, 4, split_k=4),
        MatmulSchedule("wv_n8_m4", "wv", 8, 4),
        MatmulSchedule("wv_n8_m16_w8", "wv", 8, 16, num_warps=8),
        MatmulSchedule("tiny_wv_m2", "wv", 16, 2),
        # int8-activation dp4a GEMV (ninfer/kernels/gemv_q8.py): one thread per (row, quarter block), so
        # warps = block_n / 8; 1 column, then up to 8
        MatmulSchedule("q8_n16_m1", "q8", 16, 1, num_stages=1, num_warps=2),
        MatmulSchedule("q8_n32_m1", "q8", 32, 1, num_stages=1, num_warps=4),
        MatmulSchedule("q8_n64_m1", "q8", 64, 1, num_stages=1, num_warps=8),
        MatmulSchedule("q8_n16_m1_s2", "q8", 16, 1, split_k=2, num_stages=1, num_warps=2),
        MatmulSchedule("q8_n32_m1_s2", "q8", 32, 1, split_k=2, num_stages=1, num_warps=4),
        MatmulSchedule("q8_n16_m1_s4", "q8", 16, 1, split_k=4, num_stages=1, num_warps=2),
        MatmulSchedule("q8_n32_m1_s4", "q8", 32, 1, split_k=4, num_stages=1, num_warps=4),
        MatmulSchedule("q8_n8_m1_s4", "q8", 8, 1, split_k=4, num_stages=1, num_warps=1),
        MatmulSchedule("q8_n8_m8", "q8", 8, 8, num_stages=1, num_warps=1),
        MatmulSchedule("q8_n16_m8", "q8", 16, 8, num_stages=1, num_warps=2),
        MatmulSchedule("q8_n32_m8", "q8", 32, 8, num_stages=1, num_warps=4),
        MatmulSchedule("q8_n16_m8_s4", "q8", 16, 8, split_k=4, num_stages=1, num_warps=2),
        MatmulSchedule("q8_n8_m8_s4", "q8", 8, 8, split_k=4, num_stages=1, num_warps=1),
        MatmulSchedule("q8_n32_m4", "q8", 32, 4, num_stages=1, num_warps=4),
        MatmulSchedule("q8_n16_m4_s4", "q8", 16, 4, split_k=4, num_stages=1, num_warps=2),
        # the same tiles with the block loop software-pipelined (`num_stages` ≥ 2: cp.async of the weight and
        # activation words `num_stages - 1` steps ahead, through shared memory): latency hiding; the
        # activation words are copied once per program and read from shared memory by every row
        MatmulSchedule("q8_n16_m1_p3", "q8", 16, 1, num_stages=3, num_warps=2),
        MatmulSchedule("q8_n16_m1_p4", "q8", 16, 1, num_stages=4, num_warps=2),
        MatmulSchedule("q8_n32_m1_p3", "q8", 32, 1, num_stages=3, num_warps=4),
        MatmulSchedule("q8_n8_m1_s4_p3", "q8", 8, 1, split_k=4, num_stages=3, num_warps=1),
        MatmulSchedule("q8_n16_m1_s2_p3", "q8", 16, 1, split_k=2, num_stages=3, num_warps=2),
        MatmulSchedule("q8_n16_m4_s4_p3", "q8", 16, 4, split_k=4, num_stages=3, num_warps=2),
        MatmulSchedule("q8_n32_m4_p3", "q8", 32, 4, num_stages=3, num_warps=4),
        MatmulSchedule("q8_n16_m8_p3", "q8", 16, 8, num_stages=3, num_warps=2),
        MatmulSchedule("q8_n16_m8_s4_p3", "q8", 16, 8, split_k=4, num_stages=3, num_warps=2),
        MatmulSchedule("q8_n32_m8_p3", "q8", 32, 8, num_stages=3, num_warps=4),
        MatmulSchedule("q8_n16_m4_p3", "q8", 16, 4, num_stages=3, num_warps=2),
        # two blocks per loop step (block_k 512: both blocks' loads in flight together)
        MatmulSchedule("q8_n8_m1_s2_u2", "q8", 8, 1, block_k=512, split_k=2, num_stages=1, num_warps=1),
        MatmulSchedule("q8_n8_m1_s4_u2", "q8", 8, 1, block_k=512, split_k=4, num_stages=1, num_warps=1),
        MatmulSchedule("q8_n16_m1_u2", "q8", 16, 1, block_k=512, num_stages=1, num_warps=2),
        MatmulSchedule("q8_n16_m1_s2_u2", "q8", 16, 1, block_k=512, split_k=2, num_stages=1, num_warps=2),
        MatmulSchedule("q8_n8_m1", "q8", 8, 1, num_stages=1, num_warps=1),
        MatmulSchedule("q8_n8_m1_s2", "q8", 8, 1, split_k=2, num_stages=1, num_warps=1),
        MatmulSchedule("q8_n16_m4_p3_u2", "q8", 16, 4, block_k=512, num_stages=3, num_warps=2),
        MatmulSchedule("q8_n16_m8_p3_u2", "q8", 16, 8, block_k=512, num_stages=3, num_warps=2),
        # one-warp pipelined multi-column tiles (1-warp 8-row programs won at 1 column): not yet timed
        MatmulSchedule("q8_n8_m4_p3", "q8", 8, 4, num_stages=3, num_warps=1),
        MatmulSchedule("q8_n8_m8_p3", "q8", 8, 8, num_stages=3, num_warps=1),
        MatmulSchedule("q8_n8_m8_s4_p3", "q8", 8, 8, split_k=4, num_stages=3, num_warps=1),
        MatmulSchedule("tiny_q8_m4", "q8", 4, 4, split_k=2, num_warps=1),
    )
}


WIDE = 1 << 30  # a route's last max_width: any number of columns


def default_route(format: str, out_features: int, in_features: int = 0) -> list[tuple[int, str]]:
    """Built-in `[(max_width, schedule), ...]` for a weight, from the H200 sweeps of docs/gpu-notes.md (run 5
    for 1–4 columns, runs 2–3 beyond): word-vector GEMV for 1–4 columns where it measured fastest, the
    sub-block kernel to 64 columns, dequantise + matmul beyond. Shapes not measured keep the older routes."""
    name = format.removeprefix(GGUF_PREFIX)
    if out_features >= 17408:
        sub = "sub_n64"
    elif out_features >= 10240:
        sub = "sub_n32_w2"
    else:
        sub = "sub_n32_s4"
    route: list[tuple[int, str]] = []
    small = out_features <= 1024  # few rows: split-K fills the GPU
    if name == "iq3_s":
        four = "wv_n16_m4_s4" if small else ("wv_n8_m4" if in_features >= 16384 else "wv_n16_m4")
        route += [(1, "wv_n8_m1_s4" if small else "wv_n16_m1_s4"), (4, four)]
        sub = "sub_n32_s4"  # run 5, 16 columns: sub_n32_s4 beat sub_n64 / sub_n32_w2 at 17408 and 5120 rows
    elif name == "q4_k":
        if small:
            one, four = "wv_n8_m1_s4", "wv_n16_m4_s4"
        elif out_features <= 6144:
            one = "wv_n16_m1_s4" if out_features <= 5120 else "wv_n16_m1"
            four = "wv_n16_m4_s4" if in_features >= 16384 else "wv_n8_m4"
        else:
            one = "wv_n16_m1" if out_features < 12288 else (
                "wv_n32_m1" if out_features < 17408 else "wv_n16_m1_s4")
            four = "sub_n64"
        route += [(1, one), (4, four)]
    elif name == "q6_k" and out_features >= 65536:  # the output head (248320 rows): wv 854 µs vs sub 1799 µs
        route += [(1, "wv_n32_m1")]
    return route + [(16, sub), (64, "sub_n64_m64"), (WIDE, "dequant_mm")]


Q8_ROUTE_FORMATS = ("q4_k", "q6_k", "q5_k", "q8_0")  # formats of the int8-activation GEMV (gemv_q8.py)
IQ_Q8_ROUTE_FORMATS = ("iq3_s", "iq4_xs")  # and of gemv_q8_iq.py (its own default tiles)


def q8_route(format: str, out_features: int, in_features: int) -> list[tuple[int, str]]:
    """Route of the int8-activation dp4a GEMV for 1–8 columns, `[]` where it does not apply (other formats,
    rows not whole 256-column steps). From the H200 sweeps (q4_k at the 27B shapes, q6_k at the output head;
    docs/gpu-notes.md): one column takes the plain loop in 1-warp programs of 8 rows, split-K 4 / 2 / none as
    rows grow (≤ 1024 rows: software-pipelined); 2–8 columns take the software-pipelined tiles (activation
    words copied once per program), split-K 4 where few rows or long rows leave SMs idle."""
    name = format.removeprefix(GGUF_PREFIX)
    if name not in Q8_ROUTE_FORMATS or in_features % 256:
        return []
    if out_features <= 1024:
        return [(1, "q8_n8_m1_s4_p3"), (4, "q8_n16_m4_s4_p3"), (8, "q8_n16_m8_s4_p3")]
    if in_features >= 16384:
        return [(1, "q8_n8_m1_s4"), (4, "q8_n16_m4_s4_p3"), (8, "q8_n16_m8_s4_p3")]
    one = "q8_n8_m1_s4" if out_features <= 6144 else "q8_n8_m1_s2" if out_features < 12288 else "q8_n8_m1"
    return [(1, one), (4, "q8_n16_m4_p3"), (8, "q8_n16_m8_p3")]


def q8_enabled() -> bool:
    """The int8-activation GEMVs are the default decode routes on CUDA unless NINFER_GEMV=wv restores the
    word-vector one."""
    return os.environ.get("NINFER_GEMV", "rows") != "wv"


def rows_enabled() -> bool:
    """The coalesced-rows GEMVs (gemv_rows.py, gemv_rows_iq.py) take decode where their routes say so, unless
    NINFER_GEMV is q8 or wv."""
    return os.environ.get("NINFER_GEMV", "rows") in ("rows", "mma")


def mma_forced() -> bool:
    """NINFER_GEMV=mma: the int8 tensor-core GEMM (gemv_mma.py) takes q4_k, q5_k, q6_k and iq3_s decode at
    every width of 2–16 columns, not only where its route says it wins (for benchmarks)."""
    return os.environ.get("NINFER_GEMV", "rows") == "mma"


def default_schedule(columns: int, format: str = "q8_0", out_features: int = 4096,
                     in_features: int = 0, q8: bool = False) -> MatmulSchedule:
    """The built-in route's schedule for `columns` columns; `q8` puts the int8-activation GEMV first."""
    route = q8_route(format, out_features, in_features) if q8 else []
    for max_width, name in route + default_route(format, out_features, in_features):
        if columns <= max_width:
            return SCHEDULES[name]
    return SCHEDULES["dequant_mm"]


# ---------------------------------------------------------------------------------------------------------
# Reference (the fallback where Triton cannot run, and the tests' oracle)


def quant_matmul_reference(
    raw: torch.Tensor, format: str, x: torch.Tensor, out_features: int
) -> torch.Tensor:
    """Dequantise the whole weight with `ninfer.quant` (fp32) and multiply: `x [..., K] -> [..., N]`."""
    in_features = x.shape[-1]
    name = GGUF_PREFIX + format.removeprefix(GGUF_PREFIX)
    w = dequantize(raw.cpu().reshape(-1), name, (out_features, in_features)).to(x.device)
    return (x.float() @ w.t()).to(x.dtype)


# ---------------------------------------------------------------------------------------------------------
# Lookup tables the kernel reads (facts of the formats)


@functools.cache
def _tables(device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """iq3_s lattice as uint8 `[512 * 4]` and as int32 words `[512]` (4 magnitudes, lowest byte first),
    and the iq4 levels as float32 `[16]`, on `device`."""
    from gguf import quants

    from ninfer.quant.dequant import IQ4_LEVELS

    quants.IQ3_S.init_grid()
    grid = torch.from_numpy(quants.IQ3_S.grid.reshape(-1).copy()).to(torch.uint8)
    return grid.to(device), grid.view(torch.int32).to(device), IQ4_LEVELS.to(device)


@functools.cache
def iq3s_grid16(device: torch.device) -> torch.Tensor:
    """The iq3_s grid as int16 `[512]` (1 KB: a warp's 32 gathers touch ~8 L1 lines, not ~14 of the 2 KB
    word table): every magnitude is odd and ≤ 15, so the 4 of a grid word fit in nibbles, stored in the
    order g0 | g2 << 4 | g1 << 8 | g3 << 12 that `iq3s_grid_word` spreads back to bytes in two
    instructions."""
    g = _tables(torch.device("cpu"))[0].view(512, 4).to(torch.int32)
    packed = g[:, 0] | (g[:, 2] << 4) | (g[:, 1] << 8) | (g[:, 3] << 12)
    return torch.where(packed >= 1 << 15, packed - (1 << 16), packed).to(torch.int16).to(device)


# ---------------------------------------------------------------------------------------------------------
# Triton: per-format dequantisation of a [BLOCK_N, BLOCK_K] tile. `b` points at each element's block start,
# `w` is each element's index inside its block, `m` the load mask. Every helper returns float32.


@jit
def iq3s_grid_word(grid16_ptr, idx):
    """The iq3_s grid word (4 magnitude bytes, lowest first) of the 9-bit indices idx, from `iq3s_grid16`:
    nibbles (g0, g2, g1, g3) of h and of h << 12 land g_k in the low nibble of byte k."""
    h = tl.load(grid16_ptr + idx.to(tl.uint32)).to(tl.uint16, bitcast=True).to(tl.int32)
    return (h | (h << 12)) & 0x0F0F0F0F


@jit
def _f16_at(p, m):
    lo = tl.load(p, mask=m, other=0).to(tl.uint16)
    hi = tl.load(p + 1, mask=m, other=0).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@jit
def _u8(p, m):
    return tl.load(p, mask=m, other=0).to(tl.int32)


@jit
def _nibble(p, m, high):
    return (_u8(p, m) >> (4 * high)) & 0xF


@jit
def _k_scale_min(sp, s, m):
    """6-bit scale and min of sub-block s (0..7) from the 12 packed bytes at sp (q4_k, q5_k)."""
    lo = s < 4
    b_s = _u8(sp + s, m)
    b_s4 = _u8(sp + s + 4, m)
    b_sm4 = _u8(sp + tl.where(lo, s, s - 4), m)
    sc = tl.where(lo, b_s & 63, (b_s4 & 0xF) | ((b_sm4 >> 6) << 4))
    mn = tl.where(lo, b_s4 & 63, (b_s4 >> 4) | ((b_s >> 6) << 4))
    return sc.to(tl.float32), mn.to(tl.float32)


@jit
def _k_scale_min_const(sp, s: tl.constexpr, m):
    """`_k_scale_min` for a compile-time sub-block index: three byte loads per row."""
    if s < 4:
        sc = _u8(sp + s, m) & 63
        mn = _u8(sp + s + 4, m) & 63
    else:
        b_s4 = _u8(sp + s + 4, m)
        sc = (b_s4 & 0xF) | ((_u8(sp + s - 4, m) >> 6) << 4)
        mn = (b_s4 >> 4) | ((_u8(sp + s, m) >> 6) << 4)
    return sc.to(tl.float32), mn.to(tl.float32)


@jit
def _dequant_tile(b, w, m, grid_ptr, levels_ptr, FMT: tl.constexpr):
    if FMT == 0:  # q4_0: d, qs[16]; element j<16 low nibble of qs[j], j+16 its high nibble
        q = _nibble(b + 2 + (w % 16), m, w // 16)
        return _f16_at(b, m) * (q - 8).to(tl.float32)
    elif FMT == 1:  # q4_1: d, m, qs[16]
        q = _nibble(b + 4 + (w % 16), m, w // 16)
        return _f16_at(b, m) * q.to(tl.float32) + _f16_at(b + 2, m)
    elif FMT == 2:  # q5_0: d, qh (32 high bits, bit j for element j), qs[16]
        hb = (_u8(b + 2 + w // 8, m) >> (w % 8)) & 1
        q = _nibble(b + 6 + (w % 16), m, w // 16) | (hb << 4)
        return _f16_at(b, m) * (q - 16).to(tl.float32)
    elif FMT == 3:  # q8_0: d, qs[32] int8
        q = tl.load(b + 2 + w, mask=m, other=0).to(tl.int8, bitcast=True)
        return _f16_at(b, m) * q.to(tl.float32)
    elif FMT == 4 or FMT == 5:  # q4_k / q5_k: d, dmin, scales[12], (q5_k: qh[32]), qs[128]
        s = w // 32
        sc, mn = _k_scale_min(b + 4, s, m)
        if FMT == 4:
            q = _nibble(b + 16 + 32 * (s // 2) + (w % 32), m, s % 2)
        else:
            hb = (_u8(b + 16 + (w % 32), m) >> s) & 1
            q = _nibble(b + 48 + 32 * (s // 2) + (w % 32), m, s % 2) | (hb << 4)
        return _f16_at(b, m) * sc * q.to(tl.float32) - _f16_at(b + 2, m) * mn
    elif FMT == 6:  # q6_k: ql[128], qh[64], scales[16] int8, d
        h = w // 128
        j = (w % 128) // 32
        lane = w % 32
        lo4 = _nibble(b + 64 * h + lane + 32 * (j % 2), m, j // 2)
        hi2 = (_u8(b + 128 + 32 * h + lane, m) >> (2 * j)) & 3
        q = (lo4 | (hi2 << 4)) - 32
        sc = tl.load(b + 192 + 8 * h + lane // 16 + 2 * j, mask=m, other=0).to(tl.int8, bitcast=True)
        return _f16_at(b + 208, m) * sc.to(tl.float32) * q.to(tl.float32)
    elif FMT == 7:  # iq4_xs: d, scales_h (u16), scales_l[4], qs[128]; 8 sub-blocks of 32
        ib = w // 32
        low = (_u8(b + 4 + ib // 2, m) >> (4 * (ib % 2))) & 0xF
        high = (_u8(b + 2 + ib // 4, m) >> (2 * (ib % 4))) & 3
        dl = _f16_at(b, m) * ((low | (high << 4)) - 32).to(tl.float32)
        q = _nibble(b + 8 + 16 * ib + (w % 16), m, (w % 32) // 16)
        return dl * tl.load(levels_ptr + q)
    else:  # iq3_s: d, qs[64], qh[8], signs[32], scales[4]; grid entries of 4 magnitudes
        ib = w // 32
        r = w % 32
        pair = r // 4  # which 9-bit grid index of the sub-block (0..7)
        sc = (_u8(b + 106 + ib // 2, m) >> (4 * (ib % 2))) & 0xF
        hb = (_u8(b + 66 + ib, m) >> pair) & 1
        idx = _u8(b + 2 + 8 * ib + pair, m) | (hb << 8)
        mag = tl.load(grid_ptr + idx * 4 + (r % 4)).to(tl.float32)
        sign = (_u8(b + 74 + 4 * ib + r // 8, m) >> (r % 8)) & 1
        db = _f16_at(b, m) * (1 + 2 * sc).to(tl.float32)
        return db * mag * (1 - 2 * sign).to(tl.float32)


@jit
def _store_tile(y_ptr, acc, offs_m, offs_n, m_ok, n_ok, stride_ym, SPLIT_K: tl.constexpr):
    """y[m, n] = acc[n, m] (one split), or atomically added into a zero-filled fp32 y (split-K)."""
    out = y_ptr + offs_m[None, :] * stride_ym + offs_n[:, None]
    mask = n_ok[:, None] & m_ok[None, :]
    if SPLIT_K == 1:
        tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        tl.atomic_add(out, acc, mask=mask)


@jit
def _gguf_matmul_kernel(
    w_ptr, x_ptr, y_ptr, grid_ptr, levels_ptr,
    N, K, M, row_bytes, stride_xm, stride_ym,
    FMT: tl.constexpr, QK: tl.constexpr, BB: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    DOT_F16: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    n_ok = offs_n < N
    m_ok = offs_m < M
    rows = w_ptr + offs_n.to(tl.int64)[:, None] * row_bytes
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    k_tiles = (K + BLOCK_K - 1) // BLOCK_K
    per_split = (k_tiles + SPLIT_K - 1) // SPLIT_K
    for t in range(pid_k * per_split, tl.minimum(k_tiles, (pid_k + 1) * per_split)):
        kk = t * BLOCK_K + offs_k
        k_ok = kk < K
        b = rows + ((kk // QK) * BB)[None, :]
        wt = _dequant_tile(b, (kk % QK)[None, :], n_ok[:, None] & k_ok[None, :], grid_ptr, levels_ptr, FMT)
        xt = tl.load(x_ptr + offs_m[None, :] * stride_xm + kk[:, None], mask=k_ok[:, None] & m_ok[None, :],
                     other=0.0)
        if DOT_F16:
            acc += tl.dot(wt.to(tl.float16), xt.to(tl.float16))
        else:
            acc += tl.dot(wt.to(tl.bfloat16), xt.to(tl.bfloat16))
    _store_tile(y_ptr, acc, offs_m, offs_n, m_ok, n_ok, stride_ym, SPLIT_K)


# ---------------------------------------------------------------------------------------------------------
# Triton, sub-block kernel: per GGUF sub-block (16 or 32 elements sharing one scale) the integer codes are
# unpacked from whole words into a [BLOCK_N, 32] fp16 tile (exact small integers), multiplied with the
# activation slice by one tensor-core dot, and the per-row scale is applied to the [BLOCK_N, BLOCK_M] partial
# sum. Scales are decoded once per row and sub-block, not per element: far fewer instructions per weight
# than `_dequant_tile`.


@jit
def _x_tile(x_ptr, k0, SUB: tl.constexpr, offs_m, m_ok, stride_xm):
    ks = k0 + tl.arange(0, SUB)
    xt = tl.load(x_ptr + offs_m[None, :] * stride_xm + ks[:, None], mask=m_ok[None, :], other=0.0)
    return xt.to(tl.float32)


@jit
def _sub_dot(q, xt, DOT_F16: tl.constexpr):
    if DOT_F16:
        return tl.dot(q.to(tl.float16), xt.to(tl.float16))
    else:
        return tl.dot(q.to(tl.bfloat16), xt.to(tl.bfloat16))


@jit
def _block_dot(acc, b, w32, x_ptr, k0, offs_m, m_ok, n_ok, stride_xm, grid_ptr, levels_ptr,
               FMT: tl.constexpr, BLOCK_N: tl.constexpr, DOT_F16: tl.constexpr):
    """acc += (one GGUF block of each row, at byte pointers b / int32 word pointers w32) @ x slice."""
    nm = n_ok[:, None]
    if FMT == 4 or FMT == 5:  # q4_k / q5_k: words of 8 nibbles; sub-block s = 2c + h
        d = _f16_at(b, nm)
        dmin = _f16_at(b + 2, nm)
        j4 = tl.arange(0, 4)
        if FMT == 5:
            qh = tl.load(w32 + 4 + tl.arange(0, 8)[None, :], mask=nm, other=0)
        for c in tl.static_range(4):
            if FMT == 4:
                words = tl.load(w32 + 4 + 8 * c + tl.arange(0, 8)[None, :], mask=nm, other=0)
            else:
                words = tl.load(w32 + 12 + 8 * c + tl.arange(0, 8)[None, :], mask=nm, other=0)
            for h in tl.static_range(2):
                sc, mn = _k_scale_min_const(b + 4, 2 * c + h, nm)
                q = (words[:, :, None] >> (4 * (2 * j4 + h))[None, None, :]) & 0xF
                if FMT == 5:
                    q = q | (((qh[:, :, None] >> (8 * j4 + 2 * c + h)[None, None, :]) & 1) << 4)
                xt = _x_tile(x_ptr, k0 + 32 * (2 * c + h), 32, offs_m, m_ok, stride_xm)
                part = _sub_dot(tl.reshape(q, (BLOCK_N, 32)), xt, DOT_F16)
                acc += (d * sc) * part - (dmin * mn) * tl_sum(xt, 0)[None, :]
    elif FMT == 8:  # iq3_s: 8 grid indices (9 bits) of 4 magnitudes each, 32 sign bits per sub-block
        d = _f16_at(b, nm)
        p8 = tl.arange(0, 8)
        e = (4 * p8[:, None] + tl.arange(0, 4)[None, :])[None, :, :]
        for ib in tl.static_range(8):
            sc = (_u8(b + 106 + ib // 2, nm) >> (4 * (ib % 2))) & 0xF
            qh = _u8(b + 66 + ib, nm)
            idx = _u8(b + 2 + 8 * ib + p8[None, :], nm) | (((qh >> p8[None, :]) & 1) << 8)
            g = tl.load(grid_ptr + idx)
            mag = (g[:, :, None] >> (8 * tl.arange(0, 4))[None, None, :]) & 0xFF
            sw = (_u8(b + 74 + 4 * ib, nm) | (_u8(b + 75 + 4 * ib, nm) << 8)
                  | (_u8(b + 76 + 4 * ib, nm) << 16) | (_u8(b + 77 + 4 * ib, nm) << 24))
            sign = (sw[:, :, None] >> e) & 1
            q = mag * (1 - 2 * sign)
            xt = _x_tile(x_ptr, k0 + 32 * ib, 32, offs_m, m_ok, stride_xm)
            part = _sub_dot(tl.reshape(q, (BLOCK_N, 32)), xt, DOT_F16)
            acc += (d * (1 + 2 * sc).to(tl.float32)) * part
    elif FMT == 6:  # q6_k: per 128-half h and quarter j, 32 codes; scale per 16 codes
        d = _f16_at(b + 208, nm)
        l32 = tl.arange(0, 32)[None, :]
        for h in tl.static_range(2):
            qh = _u8(b + 128 + 32 * h + l32, nm)
            for j in tl.static_range(4):
                lo = (_u8(b + 64 * h + 32 * (j % 2) + l32, nm) >> (4 * (j // 2))) & 0xF
                q = (lo | (((qh >> (2 * j)) & 3) << 4)) - 32
                s0 = tl.load(b + 192 + 8 * h + 2 * j, mask=nm, other=0).to(tl.int8, bitcast=True)
                s1 = tl.load(b + 193 + 8 * h + 2 * j, mask=nm, other=0).to(tl.int8, bitcast=True)
                scaled = q.to(tl.float32) * tl.where(l32 < 16, s0, s1).to(tl.float32)
                xt = _x_tile(x_ptr, k0 + 128 * h + 32 * j, 32, offs_m, m_ok, stride_xm)
                acc += d * _sub_dot(scaled, xt, DOT_F16)
    elif FMT == 7:  # iq4_xs: 8 sub-blocks, 16 bytes of nibbles each (low nibbles first 16 codes)
        d = _f16_at(b, nm)
        l16 = tl.arange(0, 16)[None, :]
        for ib in tl.static_range(8):
            low = (_u8(b + 4 + ib // 2, nm) >> (4 * (ib % 2))) & 0xF
            high = (_u8(b + 2 + ib // 4, nm) >> (2 * (ib % 4))) & 3
            dl = d * ((low | (high << 4)) - 32).to(tl.float32)
            qs = _u8(b + 8 + 16 * ib + l16, nm)
            x0 = _x_tile(x_ptr, k0 + 32 * ib, 16, offs_m, m_ok, stride_xm)
            x1 = _x_tile(x_ptr, k0 + 32 * ib + 16, 16, offs_m, m_ok, stride_xm)
            part = (_sub_dot(tl.load(levels_ptr + (qs & 0xF)), x0, DOT_F16)
                    + _sub_dot(tl.load(levels_ptr + (qs >> 4)), x1, DOT_F16))
            acc += dl * part
    elif FMT == 3:  # q8_0: 32 int8 codes
        q = tl.load(b + 2 + tl.arange(0, 32)[None, :], mask=nm, other=0).to(tl.int8, bitcast=True)
        xt = _x_tile(x_ptr, k0, 32, offs_m, m_ok, stride_xm)
        acc += _f16_at(b, nm) * _sub_dot(q, xt, DOT_F16)
    else:  # q4_0 / q4_1 / q5_0: 16 bytes of nibbles, low nibbles = codes 0..15
        if FMT == 0:
            qs = _u8(b + 2 + tl.arange(0, 16)[None, :], nm)
        elif FMT == 1:
            qs = _u8(b + 4 + tl.arange(0, 16)[None, :], nm)
        else:
            qs = _u8(b + 6 + tl.arange(0, 16)[None, :], nm)
        lo = qs & 0xF
        hi = qs >> 4
        x0 = _x_tile(x_ptr, k0, 16, offs_m, m_ok, stride_xm)
        x1 = _x_tile(x_ptr, k0 + 16, 16, offs_m, m_ok, stride_xm)
        if FMT == 2:
            bits = (_u8(b + 2, nm) | (_u8(b + 3, nm) << 8) | (_u8(b + 4, nm) << 16) | (_u8(b + 5, nm) << 24))
            l16 = tl.arange(0, 16)[None, :]
            lo = lo | (((bits >> l16) & 1) << 4)
            hi = hi | (((bits >> (l16 + 16)) & 1) << 4)
        d = _f16_at(b, nm)
        if FMT == 1:  # affine: d·q + m
            part = _sub_dot(lo, x0, DOT_F16) + _sub_dot(hi, x1, DOT_F16)
            acc += d * part + _f16_at(b + 2, nm) * (tl_sum(x0, 0) + tl_sum(x1, 0))[None, :]
        elif FMT == 0:  # centred codes (q - 8, q - 16) stay exact small integers in the dot
            acc += d * (_sub_dot(lo - 8, x0, DOT_F16) + _sub_dot(hi - 8, x1, DOT_F16))
        else:
            acc += d * (_sub_dot(lo - 16, x0, DOT_F16) + _sub_dot(hi - 16, x1, DOT_F16))
    return acc


@jit
def _gguf_matmul_sub_kernel(
    w_ptr, w32_ptr, x_ptr, y_ptr, grid_ptr, levels_ptr,
    N, K, M, row_bytes, stride_xm, stride_ym,
    FMT: tl.constexpr, QK: tl.constexpr, BB: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, SPLIT_K: tl.constexpr, DOT_F16: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n_ok = offs_n < N
    m_ok = offs_m < M
    row_off = offs_n.to(tl.int64)[:, None] * row_bytes
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    blocks = K // QK
    per_split = (blocks + SPLIT_K - 1) // SPLIT_K
    for blk in range(pid_k * per_split, tl.minimum(blocks, (pid_k + 1) * per_split)):
        off = row_off + blk * BB
        acc = _block_dot(acc, w_ptr + off, w32_ptr + off // 4, x_ptr, blk * QK, offs_m, m_ok, n_ok, stride_xm,
                         grid_ptr, levels_ptr, FMT, BLOCK_N, DOT_F16)
    _store_tile(y_ptr, acc, offs_m, offs_n, m_ok, n_ok, stride_ym, SPLIT_K)


# ---------------------------------------------------------------------------------------------------------
# Triton, FMA kernel for 1–4 columns (q4_k, iq3_s): no tensor cores and no layout changes. A row's block is
# viewed as units of 4 codes (a byte lane of a qs word for q4_k, one grid entry for iq3_s); the weight tile
# is [BLOCK_N, units] and each of the 4 codes of a unit multiplies a strided gather of x shared by all rows.
# Partial sums stay in a [BLOCK_N, units, BLOCK_M] accumulator, reduced once at the end.


@jit
def _x_units(x_ptr, idx, offs_m, m_ok, stride_xm):
    """x[m, idx] as [units, BLOCK_M] float32."""
    return tl.load(x_ptr + offs_m[None, :] * stride_xm + idx[:, None], mask=m_ok[None, :], other=0.0).to(
        tl.float32)


@jit
def _gemv_fma_kernel(
    w_ptr, w32_ptr, x_ptr, y_ptr, grid_ptr,
    N, K, M, row_bytes, stride_xm, stride_ym,
    FMT: tl.constexpr, QK: tl.constexpr, BB: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, SPLIT_K: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    n_ok = offs_n < N
    m_ok = offs_m < M
    nm = n_ok[:, None]
    row_off = offs_n.to(tl.int64)[:, None] * row_bytes
    UNITS: tl.constexpr = 32 if FMT == 4 else 64
    u = tl.arange(0, UNITS)
    acc = tl.zeros([BLOCK_N, UNITS, BLOCK_M], dtype=tl.float32)
    blocks = K // QK
    per_split = (blocks + SPLIT_K - 1) // SPLIT_K
    for blk in range(pid_k * per_split, tl.minimum(blocks, (pid_k + 1) * per_split)):
        b = w_ptr + row_off + blk * BB
        k0 = blk * QK
        if FMT == 4:  # q4_k: unit w = qs word w (chunk c = w // 8, byte lane p = w % 8)
            words = tl.load(w32_ptr + (row_off + blk * BB) // 4 + 4 + u[None, :], mask=nm, other=0)
            c = u // 8
            sc_lo, mn_lo = _k_scale_min(b + 4, (2 * c)[None, :], nm)
            sc_hi, mn_hi = _k_scale_min(b + 4, (2 * c + 1)[None, :], nm)
            d = _f16_at(b, nm)
            dmin = _f16_at(b + 2, nm)
            base = k0 + 64 * c + 4 * (u % 8)
            p_lo = tl.zeros([BLOCK_N, UNITS, BLOCK_M], dtype=tl.float32)
            p_hi = tl.zeros([BLOCK_N, UNITS, BLOCK_M], dtype=tl.float32)
            xs_lo = tl.zeros([UNITS, BLOCK_M], dtype=tl.float32)
            xs_hi = tl.zeros([UNITS, BLOCK_M], dtype=tl.float32)
            for j in tl.static_range(4):
                x_lo = _x_units(x_ptr, base + j, offs_m, m_ok, stride_xm)
                x_hi = _x_units(x_ptr, base + 32 + j, offs_m, m_ok, stride_xm)
                lo = ((words >> (8 * j)) & 0xF).to(tl.float32)
                hi = ((words >> (8 * j + 4)) & 0xF).to(tl.float32)
                p_lo += lo[:, :, None] * x_lo[None, :, :]
                p_hi += hi[:, :, None] * x_hi[None, :, :]
                xs_lo += x_lo
                xs_hi += x_hi
            acc += (d * sc_lo)[:, :, None] * p_lo + (d * sc_hi)[:, :, None] * p_hi
            acc -= ((dmin * mn_lo)[:, :, None] * xs_lo[None, :, :]
                    + (dmin * mn_hi)[:, :, None] * xs_hi[None, :, :])
        else:  # iq3_s: unit t = grid entry t (sub-block ib = t // 8, position p = t % 8)
            ib = u // 8
            p = u % 8
            qh = _u8(b + 66 + ib[None, :], nm)
            idx = _u8(b + 2 + u[None, :], nm) | (((qh >> p[None, :]) & 1) << 8)
            g = tl.load(grid_ptr + idx)
            sb = _u8(b + 74 + 4 * ib[None, :] + p[None, :] // 2, nm) >> (4 * (p[None, :] % 2))
            sc = (_u8(b + 106 + ib[None, :] // 2, nm) >> (4 * (ib[None, :] % 2))) & 0xF
            db = _f16_at(b, nm) * (1 + 2 * sc).to(tl.float32)
            part = tl.zeros([BLOCK_N, UNITS, BLOCK_M], dtype=tl.float32)
            for j in tl.static_range(4):
                xj = _x_units(x_ptr, k0 + 4 * u + j, offs_m, m_ok, stride_xm)
                mag = ((g >> (8 * j)) & 0xFF).to(tl.float32)
                val = tl.where(((sb >> j) & 1) != 0, -mag, mag)
                part += val[:, :, None] * xj[None, :, :]
            acc += db[:, :, None] * part
    out = tl_sum(acc, 1)
    ptrs = y_ptr + offs_m[None, :] * stride_ym + offs_n[:, None]
    mask = n_ok[:, None] & m_ok[None, :]
    if SPLIT_K == 1:
        tl.store(ptrs, out.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        tl.atomic_add(ptrs, out, mask=mask)


# ---------------------------------------------------------------------------------------------------------
# Triton, word-vector GEMV ("wv", q4_k, iq3_s, q6_k; 1–16 columns). Same program grid as the FMA kernel, but
# no integer→float conversion per weight (I2F issues at 1/8 of the FMA rate on Hopper: the largest single cost
# of the older kernels). Each code is placed in the mantissa of a float in [1, 2) with one shift and one
# and/or (`1 + q / 2^b`, exact), multiplied with x by one FMA, and the constant part is removed once per
# sub-block with the sum of x over that sub-block, which all rows of the program share:
#     Σ q·x = 2^b · (Σ v·x − Σ x)          for v = 1 + q / 2^b.
# Predicted issue slots per weight (1 column): q4_k 3 (shift, and/or, FMA) + 2/8 (scale FMAs per word)
# ≈ 3.3; iq3_s 3 + ~15 integer ops per unit of 4 (index, grid gather, signs folded into a biased 5-bit
# code c = 16 + s·m with word-wide integer ops) ≈ 6.8; q6_k 2 shifts + 2 and/or + FMA ≈ 5 + byte loads.
# Each extra column adds one FMA per weight. Compiled (sm_90 SASS, 1 column, `gpu_check.py --sass`): q4_k
# 8.5–11.2, iq3_s 13.6–14.6, q6_k 13.2–13.9 instructions per weight; H200 (run 5, docs/gpu-notes.md):
# 17408×5120 q4_k 49 µs, iq3_s 80 µs; q6_k head 854 µs.


@jit
def _mant(word, SHIFT: tl.constexpr, MASK: tl.constexpr):
    """The float32 whose bits are `(word << SHIFT) & MASK` (a right shift for negative SHIFT) or-ed into 1.0:
    `1 + q / 2^b` for the code q that MASK selects in the mantissa (b = 23 − the mask's lowest bit)."""
    if SHIFT >= 0:
        bits = (word << SHIFT) & MASK
    else:
        bits = (word >> (-SHIFT)) & MASK
    return (bits | 0x3F800000).to(tl.float32, bitcast=True)


@jit
def _f16_lo(word):
    """float32 of the fp16 in the low 16 bits of an int32 word."""
    return (word & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@jit
def _small_float(q):
    """float32 of a small non-negative int32 (< 2^23) without an integer→float conversion instruction."""
    return (q | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0


@jit
def _k_scale_min_words(w1, w2, w3, s):
    """6-bit scale and min of sub-block s (q4_k, q5_k) from the 12 scale bytes as int32 words w1..w3."""
    sh = 8 * (s % 4)
    low = s < 4
    sc = tl.where(low, (w1 >> sh) & 63, ((w3 >> sh) & 0xF) | (((w1 >> (sh + 6)) & 3) << 4))
    mn = tl.where(low, (w2 >> sh) & 63, ((w3 >> (sh + 4)) & 0xF) | (((w2 >> (sh + 6)) & 3) << 4))
    return _small_float(sc), _small_float(mn)


@jit
def _sh(word, SHIFT: tl.constexpr):
    """word << SHIFT, or >> −SHIFT for a negative SHIFT."""
    if SHIFT >= 0:
        return word << SHIFT
    else:
        return word >> (-SHIFT)


@jit
def _gemv_wv_kernel(
    w_ptr, w32_ptr, x_ptr, y_ptr, grid_ptr,
    N, K, M, row_bytes, stride_xm, stride_ym, row_words,
    FMT: tl.constexpr, QK: tl.constexpr, BB: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, SPLIT_K: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    n_ok = offs_n < N
    nm = n_ok[:, None, None, None]
    m4 = offs_m[None, None, None, :]
    xm = m4 < M
    row_off = offs_n.to(tl.int64)[:, None, None, None] * row_bytes
    row_w = offs_n.to(tl.int64)[:, None, None, None] * row_words  # q4_k, q5_k: words; q8_0: int16
    # tile axes: (row, group, lane, column); q4_k: group = 64-code chunk, lane = qs word of the chunk;
    # iq3_s: group = 32-code sub-block, lane = grid entry; q6_k: group = 16-code half of 32, lane = code
    # q5_k: as q4_k; q8_0: group = one of 8 blocks (QK = 256 here), lane = int16 of 2 codes
    G: tl.constexpr = 4 if (FMT == 4 or FMT == 5) else (2 if FMT == 6 else 8)
    L: tl.constexpr = 16 if (FMT == 6 or FMT == 3) else 8
    g4 = tl.arange(0, G)[None, :, None, None]
    l4 = tl.arange(0, L)[None, None, :, None]
    acc = tl.zeros([BLOCK_N, G, L, BLOCK_M], dtype=tl.float32)
    blocks = K // QK
    per_split = (blocks + SPLIT_K - 1) // SPLIT_K
    for blk in range(pid_k * per_split, tl.minimum(blocks, (pid_k + 1) * per_split)):
        b = w_ptr + row_off + blk * BB
        xb = x_ptr + m4 * stride_xm + blk * QK
        if FMT == 4 or FMT == 5:  # q4_k / q5_k: word (c, p) holds codes 64c + 4p + j (low nibbles) and
            # 64c + 32 + 4p + j (high); q5_k's fifth bit of code 32s + l is bit s of qh byte l
            wb = w32_ptr + row_w + blk * (BB // 4)  # the block's first word: 16-byte aligned
            QS0: tl.constexpr = 4 if FMT == 4 else 12
            SCALE: tl.constexpr = 16.0 if FMT == 4 else 32.0
            words = tl.load(wb + QS0 + 8 * g4 + l4, mask=nm, other=0)
            if FMT == 5:
                qhc = tl.load(wb + 4 + l4, mask=nm, other=0) >> (2 * g4)  # bits 8j (low) and 8j + 1 (high)
            h0 = tl.load(wb, mask=nm, other=0)
            h1 = tl.load(wb + 1, mask=nm, other=0)
            h2 = tl.load(wb + 2, mask=nm, other=0)
            h3 = tl.load(wb + 3, mask=nm, other=0)
            dsc = SCALE * _f16_lo(h0)
            dmin = _f16_lo(h0 >> 16)
            sc_lo, mn_lo = _k_scale_min_words(h1, h2, h3, 2 * g4)
            sc_hi, mn_hi = _k_scale_min_words(h1, h2, h3, 2 * g4 + 1)
            p_lo = tl.zeros([BLOCK_N, G, L, BLOCK_M], dtype=tl.float32)
            p_hi = tl.zeros([BLOCK_N, G, L, BLOCK_M], dtype=tl.float32)
            xs_lo = tl.zeros([1, G, L, BLOCK_M], dtype=tl.float32)
            xs_hi = tl.zeros([1, G, L, BLOCK_M], dtype=tl.float32)
            for j in tl.static_range(4):
                x_lo = tl.load(xb + 64 * g4 + 4 * l4 + j, mask=xm, other=0.0).to(tl.float32)
                x_hi = tl.load(xb + 64 * g4 + 32 + 4 * l4 + j, mask=xm, other=0.0).to(tl.float32)
                if FMT == 4:  # v = 1 + q/16: nibble at bits 19..22
                    v_lo = _mant(words, 19 - 8 * j, 0x00780000)
                    v_hi = _mant(words, 15 - 8 * j, 0x00780000)
                else:  # v = 1 + q/32: nibble at bits 18..21, fifth bit at 22
                    v_lo = ((_sh(words, 18 - 8 * j) & 0x003C0000) | (_sh(qhc, 22 - 8 * j) & 0x00400000)
                            | 0x3F800000).to(tl.float32, bitcast=True)
                    v_hi = ((_sh(words, 14 - 8 * j) & 0x003C0000) | (_sh(qhc, 21 - 8 * j) & 0x00400000)
                            | 0x3F800000).to(tl.float32, bitcast=True)
                p_lo += v_lo * x_lo
                p_hi += v_hi * x_hi
                xs_lo += x_lo
                xs_hi += x_hi
            # d·sc·Σq·x − dmin·mn·Σx with Σq·x = SCALE·(Σv·x − Σx)
            ds_lo = dsc * sc_lo
            ds_hi = dsc * sc_hi
            acc += ds_lo * p_lo + ds_hi * p_hi
            acc -= (ds_lo + dmin * mn_lo) * xs_lo + (ds_hi + dmin * mn_hi) * xs_hi
        elif FMT == 3:  # q8_0, 8 blocks of 34 bytes per step: int16 (g, l) of block g holds codes 2l, 2l + 1
            wb = w32_ptr + row_w + blk * (BB // 2) + 17 * g4  # int16 units; the block's d first
            h = tl.load(wb + 1 + l4, mask=nm, other=0).to(tl.int32)
            d256 = 256.0 * tl.load(wb, mask=nm, other=0).to(tl.float16, bitcast=True).to(tl.float32)
            x0 = tl.load(xb + 32 * g4 + 2 * l4, mask=xm, other=0.0).to(tl.float32)
            x1 = tl.load(xb + 32 * g4 + 2 * l4 + 1, mask=xm, other=0.0).to(tl.float32)
            # v = 1 + (q + 128)/256 (the byte with its top bit flipped at bits 15..22): q = 256v − 384
            v0 = (((h << 15) & 0x007F8000) ^ 0x3FC00000).to(tl.float32, bitcast=True)
            v1 = (((h << 7) & 0x007F8000) ^ 0x3FC00000).to(tl.float32, bitcast=True)
            acc += d256 * (v0 * x0 + v1 * x1) - (1.5 * d256) * (x0 + x1)
        elif FMT == 8:  # iq3_s: entry (ib, p) = grid index qs[8ib + p] | qh bit, 4 codes 32ib + 4p + j
            qs = _u8(b + 2 + 8 * g4 + l4, nm)
            qh = _u8(b + 66 + g4, nm)
            g = tl.load(grid_ptr + (qs | (((qh >> l4) & 1) << 8)))
            sn = (_u8(b + 74 + 4 * g4 + l4 // 2, nm) >> (4 * (l4 % 2))) & 0xF
            # byte j of c = 16 + m_j (sign bit 0) or 16 − m_j (sign 1): no carries between bytes
            neg = ((sn * 0x204081) & 0x01010101) * 31
            c = ((g ^ neg) + 0x10101010) - neg
            part = tl.zeros([BLOCK_N, G, L, BLOCK_M], dtype=tl.float32)
            for j in tl.static_range(4):  # 2^23 + c_j as a float, minus 2^23 + 16: s·m exactly
                xj = tl.load(xb + 32 * g4 + 4 * l4 + j, mask=xm, other=0.0).to(tl.float32)
                if j < 3:
                    cj = (c >> (8 * j)) & 0x1F
                else:
                    cj = c >> 24
                part += ((cj | 0x4B000000).to(tl.float32, bitcast=True) - 8388624.0) * xj
            sc = (_u8(b + 106 + g4 // 2, nm) >> (4 * (g4 % 2))) & 0xF
            db = _f16_at(b, nm) * _small_float(1 + 2 * sc)
            acc += db * part
        else:  # q6_k: code 128h + 32j + 16g + l; low 4 bits in ql byte (h, j % 2, g, l) (nibble j // 2),
            # high 2 bits in qh byte (h, g, l) (bits 2j); scale int8 at 192 + 8h + g + 2j
            d64 = 64.0 * _f16_at(b + 208, nm)
            for h in tl.static_range(2):
                qhb = _u8(b + 128 + 32 * h + 16 * g4 + l4, nm)
                for a in tl.static_range(2):
                    ql = _u8(b + 64 * h + 32 * a + 16 * g4 + l4, nm)
                    for hi in tl.static_range(2):  # j = a + 2·hi: v = 1 + q/64, q at bits 17..22
                        j = a + 2 * hi
                        lo4 = (ql << (17 - 4 * hi)) & 0x001E0000
                        bits = lo4 | ((qhb << (21 - 2 * j)) & 0x00600000) | 0x3F800000
                        sc = tl.load(b + 192 + 8 * h + 2 * j + g4, mask=nm, other=0).to(tl.int8, bitcast=True)
                        ds = d64 * sc.to(tl.float32)  # d·sc·(q − 32) = 64d·sc·v − 96d·sc, one FMA
                        xj = tl.load(xb + 128 * h + 32 * j + 16 * g4 + l4, mask=xm, other=0.0).to(tl.float32)
                        acc += (bits.to(tl.float32, bitcast=True) * ds - 1.5 * ds) * xj
    out = tl_sum(tl_sum(acc, 2), 1)
    ptrs = y_ptr + offs_m[None, :] * stride_ym + offs_n[:, None]
    mask = n_ok[:, None] & (offs_m < M)[None, :]
    if SPLIT_K == 1:
        tl.store(ptrs, out.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        tl.atomic_add(ptrs, out, mask=mask)


# ---------------------------------------------------------------------------------------------------------
# Public entry


def wv_geometry(format: str) -> tuple[int, int]:
    """(codes, bytes) the word-vector kernel reads per row and loop step: one block, or 8 q8_0 blocks."""
    fmt = FORMATS[format.removeprefix(GGUF_PREFIX)]
    k = 8 if fmt.name == "q8_0" else 1
    return k * fmt.block_elems, k * fmt.block_bytes


def check_weight(raw: torch.Tensor, format: str, out_features: int, in_features: int) -> None:
    """Raise `QuantKernelError` unless `raw` is the uint8 `[out_features, row_bytes]` of `format`."""
    format = format.removeprefix(GGUF_PREFIX)
    if format not in FORMAT_CODES:
        raise QuantKernelError(
            f"no quantized matmul kernel for format {format!r}; supported: {', '.join(KERNEL_FORMATS)} "
            "(use the dequantised reference path for other formats)"
        )
    fmt = FORMATS[format]
    if in_features % fmt.block_elems:
        raise QuantKernelError(f"{format} rows of {in_features} columns are not whole blocks of "
                               f"{fmt.block_elems}; the weight's shape does not match its format")
    row_bytes = in_features // fmt.block_elems * fmt.block_bytes
    if raw.dtype != torch.uint8 or tuple(raw.shape) != (out_features, row_bytes):
        raise QuantKernelError(f"{format} weight must be uint8 [{out_features}, {row_bytes}], got "
                               f"{raw.dtype} {list(raw.shape)}; pass the artifact tensor's row view")


# The formats whose rows kernels run a GDN decode conv in their epilogue (gdn_decode.ConvEpilogue), and up to
# how many columns. H200 session 21 run 1, the 27B step's graph replay on the lanes' own slots (ms): one lane
# Q4_K 5.625 -> 5.574, IQ3_S 7.868 -> 7.806 (operands loaded after the loop; before the wait: 5.601, 7.833);
# two lanes Q4_K 7.277 -> 7.203 with the operands loaded before the wait (after the loop: 7.307, the 1-warp
# `rows_n4_m2_b4_w1_r2` programs each waiting on them at their end), IQ3_S 9.023 -> 9.097 / 9.141: one column.
CONV_COLUMNS = {"q4_k": 2, "q5_k": 2, "iq3_s": 1}


def _conv_route(conv: ConvEpilogue | None, rows, format: str, columns: int, out_features: int
                ) -> ConvEpilogue | None:
    """`conv` where the rows GEMV `rows` is to run it (CONV_COLUMNS, `gemv_rows.takes_conv`,
    NINFER_CONV_EPILOGUE not 0), else None."""
    if conv is None or columns > CONV_COLUMNS.get(format, 0):
        return None
    from ninfer.kernels.gemv_rows import takes_conv

    ok = takes_conv(rows, conv, columns, out_features) and os.environ.get("NINFER_CONV_EPILOGUE", "1") != "0"
    return conv if ok else None


def quant_matmul(
    raw: torch.Tensor,
    format: str,
    x: torch.Tensor,
    out_features: int,
    schedule: MatmulSchedule | str | None = None,
    dot_f16: bool = True,
    conv: ConvEpilogue | None = None,
) -> torch.Tensor:
    """`x [..., K] @ Wᵀ -> [..., N]` with W the GGUF rows `raw` (uint8 `[N, row_bytes]`), in x's dtype.

    Runs a Triton kernel where it can (CUDA, or CPU under the interpreter), else the reference.
    `dot_f16` picks fp16 (default: more mantissa for the weights) or bf16 operands for the dot. `conv`: a
    GDN decode conv the GEMV may run on its first outputs (one column on a rows kernel's route without
    split-K, unless NINFER_CONV_EPILOGUE=0); `conv.applied` says whether it did.
    """
    in_features = x.shape[-1]
    format = format.removeprefix(GGUF_PREFIX)
    check_weight(raw, format, out_features, in_features)
    if not (HAVE_TRITON and triton_runs_on(x) and raw.device == x.device):
        return quant_matmul_reference(raw, format, x, out_features)
    x2 = x.reshape(-1, in_features)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    M = x2.shape[0]
    if schedule is None and x.is_cuda and rows_enabled():  # 2-16 columns on int8 tensor cores
        from ninfer.kernels.gemv_frag import frag_route, gemv_frag
        from ninfer.kernels.gemv_mma import gemv_mma, mma_route
        from ninfer.kernels.gemv_q8 import quantize_activation_cached
        from ninfer.kernels.gemv_rows_q6k import gemv_rows_q6k, rows_q6k_route

        head = rows_q6k_route(format, out_features, in_features, M)  # the output head at 1-4 columns
        if head is not None:
            y = gemv_rows_q6k(raw, format, quantize_activation_cached(x), out_features, head)
            return y.reshape(*x.shape[:-1], out_features)
        frag = None if mma_forced() else frag_route(format, out_features, in_features, M)
        if frag is not None:  # the mma fragments loaded by each lane (frag_route)
            y = gemv_frag(raw, format, quantize_activation_cached(x), out_features, frag)
            return y.reshape(*x.shape[:-1], out_features)
        tile = mma_route(format, out_features, in_features, M, mma_forced())
        if tile is not None:
            y = gemv_mma(raw, format, quantize_activation_cached(x), out_features, tile)
            return y.reshape(*x.shape[:-1], out_features)
    q8 = schedule is None and x.is_cuda and q8_enabled()
    if q8 and format in IQ_Q8_ROUTE_FORMATS and M <= 8:  # gemv_q8_iq picks its own tile
        s = None
    else:
        s = SCHEDULES[schedule] if isinstance(schedule, str) else (
            schedule or default_schedule(M, format, out_features, in_features, q8=q8))
    if s is None or s.kernel == "q8":  # int8 activation (quantised once per tensor: the memo), dp4a GEMV
        from ninfer.kernels.gemv_q8 import gemv_q8, quantize_activation_cached

        xa = quantize_activation_cached(x)
        rows = None
        if schedule is None and rows_enabled():  # the coalesced-rows kernels where they were measured faster
            if format in IQ_Q8_ROUTE_FORMATS:
                from ninfer.kernels.gemv_rows_iq import gemv_rows_iq as rows_gemv
                from ninfer.kernels.gemv_rows_iq import rows_iq_route as route
            else:
                from ninfer.kernels.gemv_rows import gemv_rows as rows_gemv
                from ninfer.kernels.gemv_rows import rows_route as route
            rows = route(format, out_features, in_features, M)
        if rows is not None:
            y = rows_gemv(raw, format, xa, out_features, rows, conv=_conv_route(conv, rows, format, M,
                                                                               out_features))
        elif format in IQ_Q8_ROUTE_FORMATS:
            from ninfer.kernels.gemv_q8_iq import gemv_q8_iq

            y = gemv_q8_iq(raw, format, xa, out_features, s)
        elif M == 2 and schedule is None:
            # two 1-column GEMVs beat one 4-column tile for the k-quants (H200: q4_k 17408×5120 2 × 23.1 µs vs
            # 75.5 µs; at 3 columns the tile wins on 12288 rows; big q6_k matrices take frag_route first)
            one = default_schedule(1, format, out_features, in_features, q8=True)
            y = torch.cat([gemv_q8(raw, format, xa.row(i), out_features, one) for i in range(2)])
        else:
            y = gemv_q8(raw, format, xa, out_features, s)
        return y.reshape(*x.shape[:-1], out_features)
    if s.kernel == "dequant_mm":
        y = matmul_by_rows(x2, out_features, lambda r0, r1, out: dequantize_rows(
            raw[r0:r1], format, r1 - r0, in_features, out=out))
        return y.reshape(*x.shape[:-1], out_features)
    fmt = FORMATS[format]
    y = (torch.zeros if s.split_k > 1 else torch.empty)(
        (M, out_features), dtype=torch.float32 if s.split_k > 1 else x.dtype, device=x.device)
    grid_u8, grid_u32, levels = _tables(x.device)
    launch = (triton_cdiv(out_features, s.block_n), triton_cdiv(M, s.block_m), s.split_k)
    extra = {} if x.device.type == "cpu" else {"num_warps": s.num_warps, "num_stages": s.num_stages}
    common = dict(FMT=FORMAT_CODES[format], QK=fmt.block_elems, BB=fmt.block_bytes, BLOCK_N=s.block_n,
                  BLOCK_M=s.block_m, SPLIT_K=s.split_k, DOT_F16=dot_f16, **extra)
    shape_args = (out_features, in_features, M, raw.shape[1], x2.stride(0), y.stride(0))
    words = raw.view(torch.int32) if raw.shape[1] % 4 == 0 else raw
    if s.kernel == "wv":
        if format not in WV_FORMATS:
            raise QuantKernelError(f"schedule {s.name} (word-vector GEMV) supports {', '.join(WV_FORMATS)}, "
                                   f"not {format}; pick a sub_* schedule")
        common.pop("DOT_F16")
        if format == "q8_0":  # 8 blocks per step, read as int16
            if in_features % 256:
                raise QuantKernelError(f"schedule {s.name} needs q8_0 rows of whole 256-column steps, got "
                                       f"{in_features}; pick a sub_* schedule")
            units, per_row = raw.view(torch.int16), raw.shape[1] // 2
        else:
            units, per_row = words, raw.shape[1] // 4
        common["QK"], common["BB"] = wv_geometry(format)
        _gemv_wv_kernel[launch](raw, units, x2, y, grid_u32, *shape_args, per_row, **common)
    elif s.kernel == "fma":
        if format not in FMA_FORMATS:
            raise QuantKernelError(f"schedule {s.name} (FMA kernel) supports {', '.join(FMA_FORMATS)}, not "
                                   f"{format}; pick a sub_* schedule")
        common.pop("DOT_F16")
        _gemv_fma_kernel[launch](raw, words, x2, y, grid_u32, *shape_args, **common)
    elif s.kernel == "sub":
        _gguf_matmul_sub_kernel[launch](raw, words, x2, y, grid_u32, levels, *shape_args, **common)
    else:
        _gguf_matmul_kernel[launch](raw, x2, y, grid_u8, levels, *shape_args, BLOCK_K=s.block_k, **common)
    return y.to(x.dtype).reshape(*x.shape[:-1], out_features)


@jit
def _dequant_rows_kernel(w_ptr, out_ptr, grid_ptr, levels_ptr, rows_ptr, N, K, row_bytes,
                         FMT: tl.constexpr, QK: tl.constexpr, BB: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GATHER: tl.constexpr = False):
    """Output row n from weight row n, or (GATHER) from weight row rows_ptr[n]."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    kk = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (offs_n < N)[:, None] & (kk < K)[None, :]
    src = tl.load(rows_ptr + offs_n, mask=offs_n < N, other=0) if GATHER else offs_n
    b = w_ptr + src.to(tl.int64)[:, None] * row_bytes + ((kk // QK) * BB)[None, :]
    wt = _dequant_tile(b, (kk % QK)[None, :], mask, grid_ptr, levels_ptr, FMT)
    tl.store(out_ptr + offs_n.to(tl.int64)[:, None] * K + kk[None, :], wt.to(out_ptr.dtype.element_ty),
             mask=mask)


def dequantize_rows(raw: torch.Tensor, format: str, out_features: int, in_features: int,
                    dtype: torch.dtype = torch.bfloat16, out: torch.Tensor | None = None,
                    rows: torch.Tensor | None = None) -> torch.Tensor:
    """The dense `[out_features, in_features]` weight in `dtype`, decoded on the weight's device (a transient
    for prefill matmuls; the resident weight stays in its GGUF bytes); into `out` where given (its dtype).
    `rows` (integer `[n]` on the device): only those rows, `[n, in_features]`, gathered in the same launch
    (an embedding lookup)."""
    format = format.removeprefix(GGUF_PREFIX)
    check_weight(raw, format, out_features, in_features)
    if not (HAVE_TRITON and triton_runs_on(raw)):
        if rows is not None:
            raw, out_features = raw.index_select(0, rows.long()), rows.shape[0]
        name = GGUF_PREFIX + format
        value = dequantize(raw.cpu().reshape(-1), name, (out_features, in_features))
        return value.to(raw.device, dtype) if out is None else out.copy_(value)
    fmt = FORMATS[format]
    n = out_features if rows is None else rows.shape[0]
    out = dense_out(out, n, in_features, dtype, raw.device)
    grid_u8, _, levels = _tables(raw.device)
    block_n, block_k = 16, 256
    _dequant_rows_kernel[(triton_cdiv(n, block_n), triton_cdiv(in_features, block_k))](
        raw, out, grid_u8, levels, raw if rows is None else rows, n, in_features, raw.shape[1],
        FMT=FORMAT_CODES[format], QK=fmt.block_elems, BB=fmt.block_bytes, BLOCK_N=block_n, BLOCK_K=block_k,
        GATHER=rows is not None)
    return out


def dense_out(out: torch.Tensor | None, rows: int, cols: int, dtype: torch.dtype,
              device: torch.device) -> torch.Tensor:
    """A dequantiser's output: `out` where the caller gave one, else a new `[rows, cols]` tensor."""
    return torch.empty((rows, cols), dtype=dtype, device=device) if out is None else out


# The dense weight pieces of prefill matmuls (`matmul_by_rows`), one buffer a device and dtype, grown to the
# largest piece asked: every matmul's piece reuses it, so the caching allocator keeps one block rather than a
# transient of each matrix's size (80-170 MiB at the 27B) that rounds of other shapes split around
# (fragmentation: gpu-notes "Session 46", run 4). `measure_workspace` lets it go first, so the widest round it
# measures makes it again.
_DENSE_PIECES: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def dense_piece(device: torch.device, dtype: torch.dtype, rows: int, cols: int) -> torch.Tensor:
    """A `[rows, cols]` view of the device's buffer for dense weight pieces (a new tensor while a CUDA graph
    is captured: the buffer must not come from a graph's pool)."""
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return torch.empty((rows, cols), dtype=dtype, device=device)
    key, size = (device, dtype), rows * cols
    buffer = _DENSE_PIECES.get(key)
    if buffer is None or buffer.numel() < size:
        _DENSE_PIECES.pop(key, None)
        del buffer  # (the old buffer freed before the larger one is made)
        buffer = _DENSE_PIECES[key] = torch.empty(size, dtype=dtype, device=device)
    return buffer[:size].view(rows, cols)


def release_dense_pieces() -> None:
    """Drop the dense weight pieces' buffers (made again by the next prefill matmul)."""
    _DENSE_PIECES.clear()


def matmul_by_rows(x2: torch.Tensor, out_features: int, dense) -> torch.Tensor:
    """`x2 [n, K] @ Wᵀ -> [n, out_features]` in x2's dtype, W made dense `PREFILL_ROWS` rows at a time by
    `dense(r0, r1, out)` into `out` (`dense_piece`'s; x2's dtype on a GPU, fp32 on the CPU) for a prefill
    matmul. One piece at a time bounds the transient: a whole 34816×5120 matrix in bf16 is 340 MiB, a block
    the allocator's cache may find no room for beside a full KV pool (fragmentation). Each piece's product
    goes straight into its columns of the output (a strided view cuBLAS writes; a copy of each piece's
    product cost a 27B 2048-token prefill 3 %)."""
    dtype = x2.dtype if x2.is_cuda else torch.float32
    xd = x2.to(dtype)
    y = torch.empty((x2.shape[0], out_features), dtype=x2.dtype, device=x2.device)
    for r0 in range(0, out_features, PREFILL_ROWS):
        r1 = min(out_features, r0 + PREFILL_ROWS)
        piece = dense_piece(x2.device, dtype, r1 - r0, x2.shape[1])
        dense(r0, r1, piece)
        if dtype == y.dtype:
            torch.mm(xd, piece.t(), out=y[:, r0:r1])
        else:  # the CPU's fp32 matmul of a bf16 input
            y[:, r0:r1] = xd @ piece.t()
    return y


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


# byte offsets of each kernel format's fp16 scale fields
_SCALE_OFFSETS = {"q4_0": (0,), "q4_1": (0, 2), "q5_0": (0,), "q8_0": (0,), "q4_k": (0, 2), "q5_k": (0, 2),
                  "q6_k": (208,), "iq4_xs": (0,), "iq3_s": (0,)}


def random_gguf_weight(format: str, out_features: int, in_features: int, device: torch.device | str = "cpu",
                       generator: torch.Generator | None = None) -> torch.Tensor:
    """Random but valid GGUF rows (uniform bytes, fp16 scales in [0.0005, 0.0025)) for tests and timing."""
    fmt = FORMATS[format.removeprefix(GGUF_PREFIX)]
    nblk = out_features * in_features // fmt.block_elems
    blocks = torch.randint(0, 256, (nblk, fmt.block_bytes), dtype=torch.uint8, device=device,
                           generator=generator)
    for off in _SCALE_OFFSETS[fmt.name]:
        d = (torch.rand(nblk, device=device, generator=generator) * 0.002 + 0.0005).to(torch.float16)
        blocks[:, off:off + 2] = d.view(torch.uint8).reshape(nblk, 2)
    return blocks.reshape(out_features, -1)

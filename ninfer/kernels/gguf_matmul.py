"""Quantized matmul `y = x @ Wᵀ` reading GGUF blocks directly (no dequantised copy of the weights).

The weight stays in its GGUF bytes, uint8 `[out_features, row_bytes]` (one ggml row per output feature).
One Triton kernel serves decode (1–16 columns: a 16-wide column tile, the weight stream is the cost) and
prefill (many columns: larger tiles, the dequantised tile feeds a tensor-core dot). Each program
dequantises a `[BLOCK_N, BLOCK_K]` weight tile into registers and multiplies it with the activation tile.
`quant_matmul_reference` (dequantise with `ninfer.quant` + torch matmul) is the fallback and the test oracle.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ninfer.errors import NinferError
from ninfer.kernels.triton_support import HAVE_TRITON, jit, tl, triton_runs_on
from ninfer.quant import FORMATS, dequantize
from ninfer.quant.formats import GGUF_PREFIX

# Format codes the kernel branches on (compile-time constants).
FORMAT_CODES = {"q4_0": 0, "q4_1": 1, "q5_0": 2, "q8_0": 3, "q4_k": 4, "q5_k": 5, "q6_k": 6,
                "iq4_xs": 7, "iq3_s": 8}
KERNEL_FORMATS = tuple(FORMAT_CODES)


class QuantKernelError(NinferError):
    """A quantized weight cannot be used by the matmul kernels (format or shape)."""


@dataclass(frozen=True)
class MatmulSchedule:
    """Tile shape of one kernel launch: rows (out features) × columns (tokens) × reduction step."""

    name: str
    block_n: int
    block_m: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 2


SCHEDULES: dict[str, MatmulSchedule] = {
    s.name: s
    for s in (
        MatmulSchedule("dec_n16_k256", 16, 16, 256),
        MatmulSchedule("dec_n32_k256", 32, 16, 256),
        MatmulSchedule("dec_n16_k256_s4", 16, 16, 256, split_k=4),
        MatmulSchedule("dec_n32_k128_w2", 32, 16, 128, num_warps=2),
        MatmulSchedule("dec_n64_k128", 64, 16, 128),
        MatmulSchedule("pre_n64_m64_k64", 64, 64, 64),
        MatmulSchedule("pre_n128_m64_k64_w8", 128, 64, 64, num_warps=8),
        MatmulSchedule("pre_n128_m128_k64_w8", 128, 128, 64, num_warps=8, num_stages=3),
        MatmulSchedule("tiny_n16_m16_k64", 16, 16, 64),
    )
}


def default_schedule(columns: int) -> MatmulSchedule:
    """Built-in choice before calibration: 16-column tile for decode, 64/128 tiles for prefill."""
    if columns <= 16:
        return SCHEDULES["dec_n16_k256"]
    if columns <= 256:
        return SCHEDULES["pre_n64_m64_k64"]
    return SCHEDULES["pre_n128_m128_k64_w8"]


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
def _tables(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """iq3_s lattice as uint8 `[512 * 4]` and the iq4 levels as float32 `[16]`, on `device`."""
    from gguf import quants

    from ninfer.quant.dequant import IQ4_LEVELS

    quants.IQ3_S.init_grid()
    grid = torch.from_numpy(quants.IQ3_S.grid.reshape(-1).copy()).to(torch.uint8)
    return grid.to(device), IQ4_LEVELS.to(device)


# ---------------------------------------------------------------------------------------------------------
# Triton: per-format dequantisation of a [BLOCK_N, BLOCK_K] tile. `b` points at each element's block start,
# `w` is each element's index inside its block, `m` the load mask. Every helper returns float32.


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
    out = y_ptr + offs_m[None, :] * stride_ym + offs_n[:, None]
    mask = n_ok[:, None] & m_ok[None, :]
    if SPLIT_K == 1:
        tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        tl.atomic_add(out, acc, mask=mask)


# ---------------------------------------------------------------------------------------------------------
# Public entry


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


def quant_matmul(
    raw: torch.Tensor,
    format: str,
    x: torch.Tensor,
    out_features: int,
    schedule: MatmulSchedule | str | None = None,
    dot_f16: bool = True,
) -> torch.Tensor:
    """`x [..., K] @ Wᵀ -> [..., N]` with W the GGUF rows `raw` (uint8 `[N, row_bytes]`), in x's dtype.

    Runs the Triton kernel where it can (CUDA, or CPU under the interpreter), else the reference.
    `dot_f16` picks fp16 (default: more mantissa for the weights) or bf16 operands for the dot.
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
    if isinstance(schedule, str):
        schedule = SCHEDULES[schedule]
    s = schedule or default_schedule(M)
    fmt = FORMATS[format]
    split = s.split_k
    y = (torch.zeros if split > 1 else torch.empty)(
        (M, out_features), dtype=torch.float32 if split > 1 else x.dtype, device=x.device)
    grid_tab, levels = _tables(x.device)
    launch = (triton_cdiv(out_features, s.block_n), triton_cdiv(M, s.block_m), split)
    extra = {} if x.device.type == "cpu" else {"num_warps": s.num_warps, "num_stages": s.num_stages}
    _gguf_matmul_kernel[launch](
        raw, x2, y, grid_tab, levels, out_features, in_features, M, raw.shape[1], x2.stride(0), y.stride(0),
        FMT=FORMAT_CODES[format], QK=fmt.block_elems, BB=fmt.block_bytes,
        BLOCK_N=s.block_n, BLOCK_M=s.block_m, BLOCK_K=s.block_k, SPLIT_K=split, DOT_F16=dot_f16, **extra,
    )
    return y.to(x.dtype).reshape(*x.shape[:-1], out_features)


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

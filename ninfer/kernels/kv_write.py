"""A forward's new keys and values written into the paged KV pool, encoded in the kernel: one launch per layer
where `storage[pages, :, offsets] = kv_quant.encode_kv(...)` takes a concatenation, the encoding ops and an
indexed copy (the row layout is `kv_quant`'s; the page layout docs/engine.md's).

One program per (token, KV head) encodes that head's key and value rows (D values each) and stores the token's
row of bytes in place: bf16 and fp32 as they are, int8 per group of 64 (scale = the smallest f16 at or above
max|x| / 127, codes rounded half to even), bit for bit what `kv_quant.encode_kv` gives. The rotated formats
(rk8v4, rk4v4: a Walsh–Hadamard product and a codebook) keep the PyTorch encoding (`KvPool.write`).
"""

from __future__ import annotations

import torch

from ninfer.kernels.kv_quant import INT8_GROUP, KvFormat
from ninfer.kernels.triton_support import HAVE_TRITON, jit, pdl_options, pdl_start, tl, tl_max, triton_runs_on

WRITE_CODES = {"bf16": 0, "fp32": 1, "int8": 2}


def kernel_writes(fmt: KvFormat, storage: torch.Tensor) -> bool:
    """True when `write_kv` encodes `fmt` into `storage` in a kernel (else the caller's PyTorch path)."""
    return (HAVE_TRITON and triton_runs_on(storage) and fmt.name in WRITE_CODES
            and fmt.head_dim % INT8_GROUP == 0 and fmt.head_dim & (fmt.head_dim - 1) == 0)


if HAVE_TRITON:

    @jit
    def _bf16_bits(x):
        """fp32 -> bf16 bit pattern (int16), rounded to nearest even as PyTorch's cast (finite x)."""
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        return bits.to(tl.uint16).to(tl.int16, bitcast=True)

    @jit
    def _int8_part(x, codes_ptr, scales16_ptr, D: tl.constexpr):
        """`kv_quant.encode_int8` of one row x [D]: codes at codes_ptr (bytes), f16 scales (bit patterns) at
        scales16_ptr (int16 units)."""
        g = tl.reshape(x, [D // 64, 64])
        want = tl.math.div_rn(tl_max(tl.abs(g), 1), 127.0)
        h = want.to(tl.float16)
        bits = h.to(tl.int16, bitcast=True)
        bits = tl.where(h.to(tl.float32) < want, bits + 1, bits)  # the smallest f16 >= max|x| / 127
        scale = bits.to(tl.float16, bitcast=True).to(tl.float32)
        safe = tl.where(scale == 0.0, 1.0, scale)
        # round half to even: adding and removing 1.5·2^23 leaves the nearest integer (|x / scale| <= 127)
        r = (tl.math.div_rn(g, safe[:, None]) + 12582912.0) - 12582912.0
        code = tl.minimum(tl.maximum(r, -127.0), 127.0).to(tl.int32).to(tl.int8).to(tl.uint8, bitcast=True)
        tl.store(codes_ptr + tl.reshape(tl.arange(0, D), [D // 64, 64]), code)
        tl.store(scales16_ptr + tl.arange(0, D // 64), bits)

    @jit
    def _kv_write_kernel(k_ptr, v_ptr, kv8_ptr, kv16_ptr, kv32_ptr, page_ptr, off_ptr, H, sk0, sk1, sv0, sv1,
                         D: tl.constexpr, TB: tl.constexpr, FMT: tl.constexpr, PDL: tl.constexpr = 0):
        """Token t = program // H, KV head h = program % H: its key and value rows into the pool row at
        (page_ptr[t], head h, off_ptr[t]); TB bytes per row (constexpr: the compiler sees the alignment)."""
        pdl_start(PDL)
        i = tl.program_id(0)
        t, h = i // H, i % H
        page = tl.load(page_ptr + t).to(tl.int64)
        row = ((page * H + h) * 64 + tl.load(off_ptr + t).to(tl.int64)) * TB  # byte offset
        d = tl.arange(0, D)
        k = tl.load(k_ptr + t * sk0 + h * sk1 + d).to(tl.float32)
        v = tl.load(v_ptr + t * sv0 + h * sv1 + d).to(tl.float32)
        if FMT == 0:
            tl.store(kv16_ptr + row // 2 + d, _bf16_bits(k))
            tl.store(kv16_ptr + row // 2 + D + d, _bf16_bits(v))
        elif FMT == 1:
            tl.store(kv32_ptr + row // 4 + d, k)
            tl.store(kv32_ptr + row // 4 + D + d, v)
        else:  # K part: D codes, D/64 scales; then the V part alike
            half: tl.constexpr = D + D // 32
            _int8_part(k, kv8_ptr + row, kv16_ptr + (row + D) // 2, D)
            _int8_part(v, kv8_ptr + row + half, kv16_ptr + (row + half + D) // 2, D)


def write_kv(storage: torch.Tensor, pages: torch.Tensor, offsets: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor, fmt: KvFormat) -> None:
    """`storage[pages, :, offsets] = encode_kv(fmt, k, v)` in one launch (`kernel_writes(fmt, ...)` must
    hold): storage `[num_pages, H, 64, token_bytes]` uint8, pages / offsets `[T]` integer, k, v `[T, H, D]`
    with unit stride along D (views of a merged projection are fine). Positions must be distinct."""
    T, H, D = k.shape
    if v.shape != k.shape or k.stride(2) != 1 or v.stride(2) != 1 or D != fmt.head_dim:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must be [T, H, D={fmt.head_dim}] with "
                         "unit stride along D")
    if storage.dtype != torch.uint8 or storage.shape[1:] != (H, 64, fmt.token_bytes):
        raise ValueError(f"KV storage {storage.dtype} {list(storage.shape)} does not hold [pages, {H}, 64, "
                         f"{fmt.token_bytes}] rows of --kv-dtype {fmt.name}")
    if not T:
        return
    kv16 = storage.view(torch.int16)
    kv32 = storage.view(torch.float32) if fmt.name == "fp32" else kv16
    _kv_write_kernel[(T * H,)](k, v, storage, kv16, kv32, pages, offsets, H, k.stride(0), k.stride(1),
                               v.stride(0), v.stride(1), D=D, TB=fmt.token_bytes, FMT=WRITE_CODES[fmt.name],
                               **pdl_options(k))

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

from ninfer.kernels import fused
from ninfer.kernels.kv_quant import INT8_GROUP, KvFormat
from ninfer.kernels.paged_attention import PAGE_TOKENS
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

    @jit
    def _decode_rows_kernel(in_ptr, table_ptr, pages_ptr, offs_ptr, lanes_ptr, lens_ptr, slots_ptr, N,
                            s_table, T: tl.constexpr, PAGE: tl.constexpr, BLOCK: tl.constexpr,
                            PDL: tl.constexpr = 0):
        """Rows i of the `[5, N]` int64 inputs (token id, position, lane, length, GDN slot): the page and
        in-page offset of position i, the lane and length as int32, and each lane's slot (its first row of
        T)."""
        pdl_start(PDL)
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = i < N
        pos = tl.load(in_ptr + N + i, mask=ok, other=0)
        lane = tl.load(in_ptr + 2 * N + i, mask=ok, other=0)
        page = tl.load(table_ptr + lane * s_table + pos // PAGE, mask=ok, other=0)
        tl.store(pages_ptr + i, page.to(tl.int64), mask=ok)
        tl.store(offs_ptr + i, pos % PAGE, mask=ok)
        tl.store(lanes_ptr + i, lane.to(tl.int32), mask=ok)
        tl.store(lens_ptr + i, tl.load(in_ptr + 3 * N + i, mask=ok, other=0).to(tl.int32), mask=ok)
        first = ok & (i % T == 0)
        tl.store(slots_ptr + i // T, tl.load(in_ptr + 4 * N + i, mask=first, other=0), mask=first)


def decode_rows_reference(inputs: torch.Tensor, page_tables: torch.Tensor, positions: int
                          ) -> tuple[torch.Tensor, ...]:
    """What a decode round's kernels take from its `[5, N]` int64 inputs (rows: token id, position, lane,
    length, GDN slot; N = lanes × `positions`, lane-major): each row's page id (int64) and in-page offset
    (`KvPool.locate`'s), its lane and length as int32 (the attention kernels'), and each lane's slot."""
    lanes, pos = inputs[2], inputs[1]
    pages = page_tables[lanes, pos // PAGE_TOKENS].long()
    return (pages, pos % PAGE_TOKENS, lanes.to(torch.int32), inputs[3].to(torch.int32),
            inputs[4][::positions].contiguous())


def decode_rows(inputs: torch.Tensor, page_tables: torch.Tensor, positions: int) -> tuple[torch.Tensor, ...]:
    """`decode_rows_reference` in one launch where Triton takes the tensors (PyTorch's indexing and
    conversions are six)."""
    if not fused.round_kernels(inputs) or inputs.dtype != torch.int64 or not inputs.is_contiguous():
        return decode_rows_reference(inputs, page_tables, positions)
    N = inputs.shape[1]
    pages, offsets = torch.empty_like(inputs[0]), torch.empty_like(inputs[0])
    lanes, lens = (torch.empty(N, dtype=torch.int32, device=inputs.device) for _ in range(2))
    slots = torch.empty(N // positions, dtype=torch.int64, device=inputs.device)
    if N:
        block = max(16, min(1024, 1 << (N - 1).bit_length()))
        _decode_rows_kernel[(-(-N // block),)](inputs, page_tables, pages, offsets, lanes, lens, slots, N,
                                                page_tables.stride(0), T=positions, PAGE=PAGE_TOKENS,
                                                BLOCK=block, **pdl_options(inputs))
    return pages, offsets, lanes, lens, slots


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

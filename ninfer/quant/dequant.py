"""Reference PyTorch dequantisation of every artifact tensor format to float32.

This is the obviously-right version every GPU kernel is tested against, and the CPU load path. Each GGUF
family has one function taking `blocks` (uint8 `[n, block_bytes]`) and returning float32
`[n, block_elems]`; its docstring gives the block layout (byte offsets; multi-byte fields little-endian;
`d`/`dmin` are fp16). Everything is vectorised over blocks; the only loop is over chunks of blocks, which
bounds the temporaries' memory. It runs on whichever device holds `raw` (the tables follow it).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ninfer.errors import QuantFormatError
from ninfer.quant.formats import block_format, tensor_bytes
from ninfer.quant.tables import IQ4_LEVELS, byte_signs, iq_grid, iq_sign_codes

_PLAIN_DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16, "i32": torch.int32}
_CHUNK_ELEMS = 1 << 20  # elements dequantised per step: big enough to vectorise, small enough for cache


def dequantize(raw: torch.Tensor, format: str, shape: Sequence[int]) -> torch.Tensor:
    """Dequantise `raw` (uint8, any shape, `tensor_bytes(format, shape)` bytes) to a float32 `shape`."""
    shape = tuple(int(dim) for dim in shape)
    expected = tensor_bytes(format, shape)
    if raw.dtype != torch.uint8:
        raise QuantFormatError(f"dequantize needs the raw bytes as a uint8 tensor, got {raw.dtype}")
    if raw.numel() != expected:
        raise QuantFormatError(
            f"{format} tensor of shape {list(shape)} needs {expected} bytes but {raw.numel()} were given; "
            "check the tensor's format and shape"
        )
    fmt = block_format(format)
    flat = raw.reshape(-1)
    if fmt is None:
        return flat.contiguous().view(_PLAIN_DTYPES[format]).to(torch.float32).reshape(shape)
    blocks = flat.view(-1, fmt.block_bytes)
    decode = _DECODERS[fmt.name]
    step = max(1, _CHUNK_ELEMS // fmt.block_elems)
    if blocks.shape[0] == 0:
        return torch.empty(shape, dtype=torch.float32, device=blocks.device)
    if blocks.shape[0] <= step:
        return decode(blocks).reshape(shape)
    out = torch.empty(blocks.shape[0], fmt.block_elems, dtype=torch.float32, device=blocks.device)
    for start in range(0, blocks.shape[0], step):
        out[start : start + step] = decode(blocks[start : start + step])
    return out.reshape(shape)


# ---------------------------------------------------------------------------------------------------------
# Bit-field helpers


def _f16(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    """The fp16 at byte `offset` of every block, as float32 `[n, 1]`."""
    return blocks[:, offset : offset + 2].contiguous().view(torch.float16).to(torch.float32)


def _fields(packed: torch.Tensor, width: int) -> torch.Tensor:
    """Split each byte into its `width`-bit fields, lowest first: `[..., k]` -> `[..., 8 // width, k]`."""
    mask = (1 << width) - 1
    return torch.stack([(packed >> shift) & mask for shift in range(0, 8, width)], dim=-2)


def _lookup(table: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """`table[index]` for integer `index` of any shape (index_select: several times faster than indexing)."""
    rows = torch.index_select(table.to(index.device), 0, index.reshape(-1).to(torch.int64))
    return rows.view(*index.shape, *table.shape[1:])


def _u32(packed: torch.Tensor) -> torch.Tensor:
    """Little-endian uint32 from the last dim's groups of 4 bytes, as int64: `[..., 4k]` -> `[..., k]`."""
    b = packed.reshape(*packed.shape[:-1], packed.shape[-1] // 4, 4).to(torch.int64)
    return b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16) | (b[..., 3] << 24)


def _sign_bits(packed: torch.Tensor) -> torch.Tensor:
    """Bit j of each byte as a sign (set -> -1.0, clear -> +1.0): `[..., k]` -> `[..., k, 8]`."""
    return _lookup(byte_signs(), packed)


# ---------------------------------------------------------------------------------------------------------
# Legacy 32-element formats


def _q4_0(blocks: torch.Tensor) -> torch.Tensor:
    """q4_0 (18 B / 32): d[0:2], qs[2:18]. Element j (j < 16) is the low nibble of qs[j], element j + 16 its
    high nibble; x = d * (q - 8)."""
    q = _fields(blocks[:, 2:18], 4).reshape(-1, 32)
    return _f16(blocks, 0) * (q.to(torch.float32) - 8)


def _q4_1(blocks: torch.Tensor) -> torch.Tensor:
    """q4_1 (20 B / 32): d[0:2], m[2:4], qs[4:20] (nibbles as q4_0); x = d * q + m."""
    q = _fields(blocks[:, 4:20], 4).reshape(-1, 32)
    return _f16(blocks, 0) * q.to(torch.float32) + _f16(blocks, 2)


def _q5_low_high(nibbles: torch.Tensor, high_bits: torch.Tensor) -> torch.Tensor:
    """5-bit values of 32 elements: nibbles as q4_0; element j's 5th bit is bit j of uint32 `high_bits`."""
    low = _fields(nibbles, 4).reshape(-1, 32)
    high = _fields(high_bits, 1).transpose(-1, -2).reshape(-1, 32)  # bit 8*byte + i -> element 8*byte + i
    return (low | (high << 4)).to(torch.float32)


def _q5_0(blocks: torch.Tensor) -> torch.Tensor:
    """q5_0 (22 B / 32): d[0:2], qh[2:6] (uint32: bit j = element j's 5th bit), qs[6:22]; x = d * (q - 16)."""
    return _f16(blocks, 0) * (_q5_low_high(blocks[:, 6:22], blocks[:, 2:6]) - 16)


def _q5_1(blocks: torch.Tensor) -> torch.Tensor:
    """q5_1 (24 B / 32): d[0:2], m[2:4], qh[4:8], qs[8:24] (as q5_0); x = d * q + m."""
    return _f16(blocks, 0) * _q5_low_high(blocks[:, 8:24], blocks[:, 4:8]) + _f16(blocks, 2)


def _q8_0(blocks: torch.Tensor) -> torch.Tensor:
    """q8_0 (34 B / 32): d[0:2], qs[2:34] int8; x = d * q."""
    return _f16(blocks, 0) * blocks[:, 2:34].contiguous().view(torch.int8).to(torch.float32)


# ---------------------------------------------------------------------------------------------------------
# k-quants: 256-element super-blocks of 16 or 8 sub-blocks, each with its own small integer scale


def _q2_k(blocks: torch.Tensor) -> torch.Tensor:
    """q2_k (84 B / 256): scales[0:16], qs[16:80], d[80:82], dmin[82:84].
    Element 128h + 32j + l (h < 2, j < 4, l < 32) is bits 2j..2j+1 of qs[32h + l]; it belongs to sub-block
    s = e // 16 whose byte scales[s] holds the scale (low nibble) and min (high nibble):
    x = d * (scales[s] & 15) * q - dmin * (scales[s] >> 4)."""
    scales = blocks[:, 0:16]
    q = _fields(blocks[:, 16:80].reshape(-1, 2, 32), 2).reshape(-1, 16, 16).to(torch.float32)
    scale = (_f16(blocks, 80) * (scales & 15).to(torch.float32)).unsqueeze(-1)
    minimum = (_f16(blocks, 82) * (scales >> 4).to(torch.float32)).unsqueeze(-1)
    return (scale * q - minimum).reshape(-1, 256)


def _q3_k_scales(packed: torch.Tensor) -> torch.Tensor:
    """The 16 signed 6-bit sub-block scales of q3_k from 12 bytes: scale i's low 4 bits are nibble i // 8
    of byte i % 8; its high 2 bits are bits 2(i // 4)..+1 of byte 8 + i % 4; stored with a +32 offset."""
    low = _fields(packed[:, 0:8], 4).reshape(-1, 16)
    high = _fields(packed[:, 8:12], 2).reshape(-1, 16)
    return (low | (high << 4)).to(torch.float32) - 32


def _q3_k(blocks: torch.Tensor) -> torch.Tensor:
    """q3_k (110 B / 256): hmask[0:32], qs[32:96], scales[96:108] (see `_q3_k_scales`), d[108:110].
    Element 128h + 32j + l: low 2 bits are bits 2j..2j+1 of qs[32h + l], the 3rd bit is bit 4h + j of
    hmask[l]; x = d * scale[e // 16] * (q - 4)."""
    low = _fields(blocks[:, 32:96].reshape(-1, 2, 32), 2).reshape(-1, 256)
    high = _fields(blocks[:, 0:32], 1).reshape(-1, 256)
    q = (low | (high << 2)).to(torch.float32) - 4
    scale = (_f16(blocks, 108) * _q3_k_scales(blocks[:, 96:108])).unsqueeze(-1)
    return (scale * q.view(-1, 16, 16)).reshape(-1, 256)


def _k_scales_mins(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 8 unsigned 6-bit (scale, min) pairs of q4_k/q5_k from 12 bytes a[0:4], b[4:8], c[8:12]:
    sub-blocks 0..3: scale = a & 63, min = b & 63; sub-blocks 4..7: scale = (c & 15) | (a >> 6) << 4,
    min = (c >> 4) | (b >> 6) << 4."""
    a, b, c = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    scales = torch.cat((a & 63, (c & 15) | ((a >> 6) << 4)), dim=1)
    mins = torch.cat((b & 63, (c >> 4) | ((b >> 6) << 4)), dim=1)
    return scales.to(torch.float32), mins.to(torch.float32)


def _k_affine(blocks: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """x = d * scale[s] * q - dmin * min[s] for q4_k/q5_k, whose d[0:2], dmin[2:4], scales[4:16] agree."""
    scales, mins = _k_scales_mins(blocks[:, 4:16])
    scale = (_f16(blocks, 0) * scales).unsqueeze(-1)
    minimum = (_f16(blocks, 2) * mins).unsqueeze(-1)
    return (scale * q.to(torch.float32) - minimum).reshape(-1, 256)


def _q4_k(blocks: torch.Tensor) -> torch.Tensor:
    """q4_k (144 B / 256): d[0:2], dmin[2:4], scales[4:16] (see `_k_scales_mins`), qs[16:144].
    Sub-block 2c (c < 4) is the low nibbles of qs[32c : 32c + 32], sub-block 2c + 1 their high nibbles."""
    return _k_affine(blocks, _fields(blocks[:, 16:144].reshape(-1, 4, 32), 4).reshape(-1, 8, 32))


def _q5_k(blocks: torch.Tensor) -> torch.Tensor:
    """q5_k (176 B / 256): d[0:2], dmin[2:4], scales[4:16], qh[16:48], qs[48:176]. Low 4 bits as q4_k; the
    5th bit of element l of sub-block s is bit s of qh[l]."""
    low = _fields(blocks[:, 48:176].reshape(-1, 4, 32), 4).reshape(-1, 8, 32)
    high = _fields(blocks[:, 16:48], 1)
    return _k_affine(blocks, low | (high << 4))


def _q6_k(blocks: torch.Tensor) -> torch.Tensor:
    """q6_k (210 B / 256): ql[0:128], qh[128:192], scales[192:208] int8, d[208:210].
    Element 128h + 32j + l (h < 2, j < 4, l < 32): low 4 bits are nibble j // 2 of ql[64h + 32(j % 2) + l],
    high 2 bits are bits 2j..2j+1 of qh[32h + l]; x = d * scales[e // 16] * (q - 32)."""
    low = _fields(blocks[:, 0:128].reshape(-1, 2, 64), 4).reshape(-1, 2, 4, 32)  # (h, nibble, half) -> j
    high = _fields(blocks[:, 128:192].reshape(-1, 2, 32), 2)
    q = (low | (high << 4)).to(torch.float32) - 32
    scales = blocks[:, 192:208].contiguous().view(torch.int8).to(torch.float32)
    scale = (_f16(blocks, 208) * scales).unsqueeze(-1)
    return (scale * q.view(-1, 16, 16)).reshape(-1, 256)


# ---------------------------------------------------------------------------------------------------------
# i-quants: 8 groups of 32 elements; values come from lattice grids (8 or 4 elements per index) with signs


def _signs_and_scale(aux: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """iq2_xxs/iq3_xxs group words `[n, 8]` (uint32 in int64): bits 7l..7l+6 are the sign code of the group's
    l-th eighth, bits 28..31 its 4-bit scale. Returns signs `[n, 8, 4, 8]` and scales `[n, 8, 1, 1]`."""
    codes = torch.stack([(aux >> shift) & 127 for shift in (0, 7, 14, 21)], dim=-1)
    return _lookup(iq_sign_codes(), codes), (aux >> 28).to(torch.float32).view(-1, 8, 1, 1)


def _iq2_xxs(blocks: torch.Tensor) -> torch.Tensor:
    """iq2_xxs (66 B / 256): d[0:2], then 8 groups of 8 bytes: 4 grid indices (8-bit, 256x8 grid) and a
    uint32 holding four 7-bit sign codes (bits 7l..7l+6 for index l) and a 4-bit scale s (bits 28..31);
    x = d * (0.5 + s) / 4 * grid * sign."""
    groups = blocks[:, 2:66].reshape(-1, 8, 8)
    values = _lookup(iq_grid("iq2_xxs"), groups[:, :, 0:4])  # [n, 8, 4, 8]
    signs, s = _signs_and_scale(_u32(groups[:, :, 4:8]).view(-1, 8))
    scale = _f16(blocks, 0).view(-1, 1, 1, 1) * (0.5 + s) * 0.25
    return (scale * values * signs).reshape(-1, 256)


def _iq2_half_scales(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    """iq2_xs/iq2_s scales: 8 bytes, group g's low nibble scales its first 16 elements, the high nibble the
    last 16; the multiplier is d * (0.5 + nibble) / 4. Returns `[n, 8, 2, 1, 1]`."""
    nibbles = _fields(blocks[:, offset : offset + 8], 4).transpose(1, 2).to(torch.float32)  # [n, 8, 2]
    return (_f16(blocks, 0).view(-1, 1, 1) * (0.5 + nibbles) * 0.25).view(-1, 8, 2, 1, 1)


def _iq2_xs(blocks: torch.Tensor) -> torch.Tensor:
    """iq2_xs (74 B / 256): d[0:2], qs[2:66] (32 uint16: bits 0..8 index a 512x8 grid, bits 9..15 a sign
    code), scales[66:74] (see `_iq2_half_scales`); x = scale * grid * sign."""
    codes = blocks[:, 2:66].reshape(-1, 32, 2).to(torch.int64)
    codes = codes[..., 0] | (codes[..., 1] << 8)
    values = _lookup(iq_grid("iq2_xs"), codes & 511) * _lookup(iq_sign_codes(), codes >> 9)  # [n, 32, 8]
    return (_iq2_half_scales(blocks, 66) * values.view(-1, 8, 2, 2, 8)).reshape(-1, 256)


def _iq2_s(blocks: torch.Tensor) -> torch.Tensor:
    """iq2_s (82 B / 256): d[0:2], qs[2:34] (low 8 bits of 32 grid indices into a 1024x8 grid), signs[34:66]
    (one byte of 8 sign bits per grid index), qh[66:74] (bits 2l..2l+1 of qh[g] are index 4g + l's top 2
    bits), scales[74:82] (see `_iq2_half_scales`); x = scale * grid * sign."""
    high = _fields(blocks[:, 66:74], 2).transpose(1, 2).to(torch.int64)  # [n, 8 groups, 4]
    index = blocks[:, 2:34].reshape(-1, 8, 4).to(torch.int64) | (high << 8)
    values = _lookup(iq_grid("iq2_s"), index) * _sign_bits(blocks[:, 34:66].reshape(-1, 8, 4))  # [n, 8, 4, 8]
    return (_iq2_half_scales(blocks, 74) * values.view(-1, 8, 2, 2, 8)).reshape(-1, 256)


def _iq3_xxs(blocks: torch.Tensor) -> torch.Tensor:
    """iq3_xxs (98 B / 256): d[0:2], qs[2:66] (64 8-bit indices into a 256x4 grid, 8 per group), then 8
    uint32 [66:98], one per group, with four 7-bit sign codes (each covering 8 elements) and a 4-bit scale
    s in bits 28..31; x = d * (0.5 + s) / 2 * grid * sign."""
    values = _lookup(iq_grid("iq3_xxs"), blocks[:, 2:66]).view(-1, 8, 4, 8)
    signs, s = _signs_and_scale(_u32(blocks[:, 66:98]))
    scale = _f16(blocks, 0).view(-1, 1, 1, 1) * (0.5 + s) * 0.5
    return (scale * values * signs).reshape(-1, 256)


def _iq3_s(blocks: torch.Tensor) -> torch.Tensor:
    """iq3_s (110 B / 256): d[0:2], qs[2:66] (low 8 bits of 64 indices into a 512x4 grid), qh[66:74] (bit k
    of qh[g] is index 8g + k's 9th bit), signs[74:106] (one sign bit per element), scales[106:110] (group g
    uses nibble g % 2 of byte g // 2); x = d * (1 + 2 * nibble) * grid * sign."""
    high = _fields(blocks[:, 66:74], 1).transpose(1, 2).to(torch.int64)  # [n, 8 groups, 8]
    index = blocks[:, 2:66].reshape(-1, 8, 8).to(torch.int64) | (high << 8)
    signs = _sign_bits(blocks[:, 74:106].reshape(-1, 8, 4)).view(-1, 8, 32)
    values = _lookup(iq_grid("iq3_s"), index).view(-1, 8, 32) * signs
    nibbles = _fields(blocks[:, 106:110], 4).transpose(1, 2).reshape(-1, 8, 1).to(torch.float32)
    return (_f16(blocks, 0).view(-1, 1, 1) * (1 + 2 * nibbles) * values).reshape(-1, 256)


def _iq4_nl(blocks: torch.Tensor) -> torch.Tensor:
    """iq4_nl (18 B / 32): d[0:2], qs[2:18] (nibbles ordered as q4_0); x = d * IQ4_LEVELS[q]."""
    q = _fields(blocks[:, 2:18], 4).reshape(-1, 32)
    return _f16(blocks, 0) * _lookup(IQ4_LEVELS, q)


def _iq4_xs(blocks: torch.Tensor) -> torch.Tensor:
    """iq4_xs (136 B / 256): d[0:2], scales_h[2:4] (uint16: bits 2g..2g+1 are group g's scale high bits),
    scales_l[4:8] (nibble g % 2 of byte g // 2: low bits), qs[8:136] (16 bytes per group, nibbles as q4_0);
    x = d * (scale - 32) * IQ4_LEVELS[q]."""
    high = _fields(blocks[:, 2:4], 2).transpose(1, 2).reshape(-1, 8)
    low = _fields(blocks[:, 4:8], 4).transpose(1, 2).reshape(-1, 8)
    scale = _f16(blocks, 0) * ((low | (high << 4)).to(torch.float32) - 32)  # [n, 8]
    q = _fields(blocks[:, 8:136].reshape(-1, 8, 16), 4).reshape(-1, 8, 32)
    return (scale.unsqueeze(-1) * _lookup(IQ4_LEVELS, q)).reshape(-1, 256)


_DECODERS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "q4_0": _q4_0, "q4_1": _q4_1, "q5_0": _q5_0, "q5_1": _q5_1, "q8_0": _q8_0,
    "q2_k": _q2_k, "q3_k": _q3_k, "q4_k": _q4_k, "q5_k": _q5_k, "q6_k": _q6_k,
    "iq2_xxs": _iq2_xxs, "iq2_xs": _iq2_xs, "iq2_s": _iq2_s, "iq3_xxs": _iq3_xxs, "iq3_s": _iq3_s,
    "iq4_nl": _iq4_nl, "iq4_xs": _iq4_xs,
}

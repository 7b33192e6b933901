"""KV-cache dtypes: byte layout of one token's K and V for one KV head, and their reference encode/decode.

Every dtype stores one token of one KV head as a fixed-size row of bytes, K part first, then V part:

    bf16   K: D x bf16                            V: D x bf16                         4D bytes
    fp32   K: D x f32                             V: D x f32 (CPU exactness)          8D bytes
    int8   K: D x int8, D/64 x f16 scale          V: same as K                        2D + D/16
    rk8v4  K: rotated, D x int8, D/64 x f16       V: D/2 x u8 (int4 pairs), D/32 x f16  D + D/2 + D/32 + D/16
    rk4v4  K: rotated, D/2 x u8 (4-bit codebook   V: as rk8v4                         D/2 + D/32 + D/2 + D/16
              index pairs), D/64 x f16 scale

Codes come first within each half, then that half's scales; all multi-byte values little-endian. For head dim
256: bf16 1024, int8 528, rk8v4 408, rk4v4 280 bytes (SPEC §5). Details (docs/engine.md has the page layout):

* int8 group (64 values): scale = f16↑(max|x| / 127); code = round(x / scale) in -127..127.
* int4 group (32 values): scale = f16↑(max|x| / 7); code = round(x / scale) + 8 in 0..15;
  value 2i sits in the low nibble of byte i, value 2i+1 in the high nibble.
* 4-bit Lloyd–Max group (64 values): scale = f16(rms(x)); index = nearest of the 16 ascending levels of the
  Lloyd–Max quantiser for a unit Gaussian (`lloyd_max_gaussian_levels`); nibbles packed as int4.
* "rotated" keys are k @ H with H the orthonormal Walsh–Hadamard matrix of size D (symmetric, H @ H = I);
  the query is rotated the same way, so q·k = (qH)·(kH) and decoded keys are never rotated back.

f16↑ rounds up to the nearest f16 at or above the value: a scale rounded down would push max|x| past the top
code (clamped, error up to a whole step where f16 is subnormal, below ~6e-5), and a zero scale would erase a
small nonzero group. Rounded up, every error stays within half a step plus f16's quantum (2^-25).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import torch

from ninfer.errors import EngineConfigError

KV_DTYPES = ("bf16", "fp32", "int8", "rk8v4", "rk4v4")
INT8_GROUP = 64
INT4_GROUP = 32
CODEBOOK_GROUP = 64


@dataclass(frozen=True)
class KvFormat:
    """Byte layout of one token of one KV head for `name` at head dim `head_dim`."""

    name: str
    head_dim: int

    @property
    def rotated_keys(self) -> bool:
        return self.name.startswith("rk")

    @property
    def key_bytes(self) -> int:
        d = self.head_dim
        return {"bf16": 2 * d, "fp32": 4 * d, "int8": d + d // 32, "rk8v4": d + d // 32,
                "rk4v4": d // 2 + d // 32}[self.name]

    @property
    def value_bytes(self) -> int:
        d = self.head_dim
        return {"bf16": 2 * d, "fp32": 4 * d, "int8": d + d // 32, "rk8v4": d // 2 + d // 16,
                "rk4v4": d // 2 + d // 16}[self.name]

    @property
    def token_bytes(self) -> int:
        """Bytes per token per KV head (K and V together)."""
        return self.key_bytes + self.value_bytes


def kv_format(name: str, head_dim: int) -> KvFormat:
    """Validate a --kv-dtype for a model's head dim."""
    if name not in KV_DTYPES:
        raise EngineConfigError(f"unknown --kv-dtype {name!r}; choose one of {', '.join(KV_DTYPES)}")
    if name in ("int8", "rk8v4", "rk4v4") and head_dim % 64:
        raise EngineConfigError(f"--kv-dtype {name} needs a head dim divisible by 64 (model has {head_dim}); "
                                "use --kv-dtype bf16")
    if name.startswith("rk") and head_dim & (head_dim - 1):
        raise EngineConfigError(f"--kv-dtype {name} rotates keys with a Walsh–Hadamard transform, which "
                                f"needs a power-of-two head dim (model has {head_dim}); use --kv-dtype int8")
    return KvFormat(name, head_dim)


# ---- Walsh–Hadamard rotation ----------------------------------------------------------------------

@lru_cache(maxsize=8)
def hadamard_matrix(size: int) -> torch.Tensor:
    """Orthonormal Walsh–Hadamard matrix (Sylvester order), float32, symmetric; H @ H = I."""
    if size < 1 or size & (size - 1):
        raise ValueError(f"Hadamard size must be a power of two, got {size}")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < size:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / math.sqrt(size)).to(torch.float32)


@lru_cache(maxsize=16)
def _on_device(table: str, size: int, device: torch.device) -> torch.Tensor:
    """A constant table copied to `device` once (no host-to-device copy per call: CUDA-graph capture)."""
    return (hadamard_matrix(size) if table == "hadamard" else lloyd_max_gaussian_levels()).to(device)


def rotate(x: torch.Tensor) -> torch.Tensor:
    """x @ H over the last dim (its own inverse). Keeps x's dtype; computes in fp32."""
    h = _on_device("hadamard", x.shape[-1], x.device)
    return (x.float() @ h).to(x.dtype)


# ---- Lloyd–Max codebook ---------------------------------------------------------------------------

@lru_cache(maxsize=4)
def lloyd_max_gaussian_levels(levels: int = 16, iterations: int = 500) -> torch.Tensor:
    """Reconstruction levels of the MSE-optimal scalar quantiser for N(0, 1), ascending, float32.

    Lloyd's iteration: thresholds at midpoints; each level is the conditional mean of its interval,
    (phi(a) - phi(b)) / (Phi(b) - Phi(a)) for the standard normal density phi and CDF Phi.
    """
    y = torch.linspace(-2.5, 2.5, levels, dtype=torch.float64)
    for _ in range(iterations):
        inf = torch.tensor([math.inf], dtype=torch.float64)
        t = torch.cat([-inf, (y[1:] + y[:-1]) / 2, inf])
        pdf = torch.exp(-t * t / 2) / math.sqrt(2 * math.pi)
        pdf = torch.nan_to_num(pdf, nan=0.0)
        cdf = 0.5 * (1 + torch.erf(t / math.sqrt(2)))
        y = (pdf[:-1] - pdf[1:]) / (cdf[1:] - cdf[:-1])
    return y.to(torch.float32)


# ---- group quantisers -----------------------------------------------------------------------------

def _groups(x: torch.Tensor, group: int) -> torch.Tensor:
    return x.float().reshape(*x.shape[:-1], x.shape[-1] // group, group)


def _f16_bytes(scale: torch.Tensor) -> torch.Tensor:
    """[..., G] f16 scales -> [..., 2G] little-endian bytes."""
    return scale.to(torch.float16).contiguous().view(torch.uint8)


def _f16_from(raw: torch.Tensor) -> torch.Tensor:
    return raw.contiguous().view(torch.float16).float()


def _pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """[..., 2n] values in 0..15 -> [..., n] bytes, even index in the low nibble."""
    c = codes.to(torch.uint8)
    return c[..., 0::2] | (c[..., 1::2] << 4)


def _unpack_nibbles(raw: torch.Tensor) -> torch.Tensor:
    lo, hi = raw & 0x0F, raw >> 4
    return torch.stack([lo, hi], dim=-1).flatten(-2)


def _f16_up(v: torch.Tensor) -> torch.Tensor:
    """The smallest f16 >= v (v >= 0), as fp32; one more in the bit pattern is the next f16 up."""
    h = v.to(torch.float16)
    return torch.where(h.float() < v, (h.view(torch.int16) + 1).view(torch.float16), h).float()


def _safe_div(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x / torch.where(scale == 0, torch.ones_like(scale), scale)


def encode_int8(x: torch.Tensor) -> torch.Tensor:
    """[..., D] -> [..., D + D/32] bytes: int8 codes then f16 scales per 64."""
    g = _groups(x, INT8_GROUP)
    scale = _f16_up(g.abs().amax(-1, keepdim=True) / 127)
    codes = torch.round(_safe_div(g, scale)).clamp(-127, 127).to(torch.int8)
    return torch.cat([codes.flatten(-2).view(torch.uint8), _f16_bytes(scale.squeeze(-1))], -1)


def decode_int8(raw: torch.Tensor, dim: int) -> torch.Tensor:
    codes = raw[..., :dim].contiguous().view(torch.int8).float()
    scale = _f16_from(raw[..., dim:dim + dim // 32])
    return (_groups(codes, INT8_GROUP) * scale.unsqueeze(-1)).flatten(-2)


def encode_int4(x: torch.Tensor) -> torch.Tensor:
    """[..., D] -> [..., D/2 + D/16] bytes: packed int4 codes (offset 8) then f16 scales per 32."""
    g = _groups(x, INT4_GROUP)
    scale = _f16_up(g.abs().amax(-1, keepdim=True) / 7)
    codes = torch.round(_safe_div(g, scale)).clamp(-7, 7) + 8
    return torch.cat([_pack_nibbles(codes.flatten(-2)), _f16_bytes(scale.squeeze(-1))], -1)


def decode_int4(raw: torch.Tensor, dim: int) -> torch.Tensor:
    codes = _unpack_nibbles(raw[..., :dim // 2]).float() - 8
    scale = _f16_from(raw[..., dim // 2:dim // 2 + dim // 16])
    return (_groups(codes, INT4_GROUP) * scale.unsqueeze(-1)).flatten(-2)


def encode_codebook4(x: torch.Tensor) -> torch.Tensor:
    """[..., D] -> [..., D/2 + D/32] bytes: packed Lloyd–Max indices then f16 rms scales per 64."""
    levels = _on_device("levels", 16, x.device)
    g = _groups(x, CODEBOOK_GROUP)
    scale = g.pow(2).mean(-1, keepdim=True).sqrt().to(torch.float16).float()
    u = _safe_div(g, scale).flatten(-2)
    # nearest level = number of midpoints below u
    index = torch.bucketize(u.contiguous(), (levels[1:] + levels[:-1]) / 2)
    return torch.cat([_pack_nibbles(index), _f16_bytes(scale.squeeze(-1))], -1)


def decode_codebook4(raw: torch.Tensor, dim: int) -> torch.Tensor:
    levels = _on_device("levels", 16, raw.device)
    values = levels[_unpack_nibbles(raw[..., :dim // 2]).long()]
    scale = _f16_from(raw[..., dim // 2:dim // 2 + dim // 32])
    return (_groups(values, CODEBOOK_GROUP) * scale.unsqueeze(-1)).flatten(-2)


# ---- whole-token encode / decode ------------------------------------------------------------------

def _encode_plain(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return x.to(dtype).contiguous().view(torch.uint8)


def encode_kv(fmt: KvFormat, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """k, v [..., D] (keys NOT yet rotated) -> [..., token_bytes] uint8 rows."""
    if fmt.name == "bf16":
        return torch.cat([_encode_plain(k, torch.bfloat16), _encode_plain(v, torch.bfloat16)], -1)
    if fmt.name == "fp32":
        return torch.cat([_encode_plain(k, torch.float32), _encode_plain(v, torch.float32)], -1)
    if fmt.name == "int8":
        return torch.cat([encode_int8(k), encode_int8(v)], -1)
    kr = rotate(k.float())
    kraw = encode_int8(kr) if fmt.name == "rk8v4" else encode_codebook4(kr)
    return torch.cat([kraw, encode_int4(v)], -1)


def decode_kv(fmt: KvFormat, raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., token_bytes] rows -> (k, v) float32 [..., D]; k is rotated when fmt.rotated_keys."""
    d, kb = fmt.head_dim, fmt.key_bytes
    kraw, vraw = raw[..., :kb], raw[..., kb:]
    if fmt.name in ("bf16", "fp32"):
        dt = torch.bfloat16 if fmt.name == "bf16" else torch.float32
        return kraw.contiguous().view(dt).float(), vraw.contiguous().view(dt).float()
    if fmt.name == "int8":
        return decode_int8(kraw, d), decode_int8(vraw, d)
    k = decode_int8(kraw, d) if fmt.name == "rk8v4" else decode_codebook4(kraw, d)
    return k, decode_int4(vraw, d)

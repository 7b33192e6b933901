"""KV dtypes: SPEC table byte sizes, Hadamard rotation, Lloyd–Max codebook, encode/decode error bounds."""

from __future__ import annotations

import pytest
import torch

from ninfer.errors import EngineConfigError
from ninfer.kernels import kv_quant as kq


@pytest.mark.parametrize("name,expected", [("bf16", 1024), ("int8", 528), ("rk8v4", 408), ("rk4v4", 280)])
def test_bytes_per_token_per_head_match_spec_table(name, expected):
    fmt = kq.kv_format(name, 256)
    assert fmt.token_bytes == expected
    k, v = torch.randn(3, 256), torch.randn(3, 256)
    assert kq.encode_kv(fmt, k, v).shape == (3, expected)


@pytest.mark.parametrize("size", [64, 128, 256])
def test_hadamard_is_orthonormal_and_its_own_inverse(size):
    h = kq.hadamard_matrix(size)
    assert torch.allclose(h @ h.T, torch.eye(size), atol=1e-6)
    x = torch.randn(50, size)
    assert (kq.rotate(kq.rotate(x)) - x).abs().max() < 1e-6 * 4  # fp32 matmul rounding, two passes
    q, k = torch.randn(7, size), torch.randn(9, size)
    assert torch.allclose(kq.rotate(q) @ kq.rotate(k).T, q @ k.T, atol=1e-4)


def test_hadamard_round_trip_below_1e6_relative():
    x = torch.randn(1000, 256)
    err = (kq.rotate(kq.rotate(x)) - x).abs().max() / x.abs().max()
    assert err < 1e-6


def test_lloyd_max_levels_are_the_gaussian_optimum():
    levels = kq.lloyd_max_gaussian_levels().double()
    # Max (1960), 16-level quantiser for N(0,1): positive half of the reconstruction levels
    published = torch.tensor([0.1284, 0.3881, 0.6568, 0.9424, 1.2562, 1.6181, 2.0690, 2.7326],
                             dtype=torch.float64)
    assert torch.allclose(levels[8:], published, atol=2e-4)
    assert torch.allclose(levels[:8], -published.flip(0), atol=2e-4)
    # the MSE on Gaussian samples equals the known optimum 0.009497 (+- sampling noise)
    g = torch.randn(400_000, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    nearest = levels[(g[:, None] - levels[None]).abs().argmin(1)]
    assert abs(((g - nearest) ** 2).mean().item() - 0.009497) < 4e-4


def _group_bound(x: torch.Tensor, group: int, qmax: float) -> torch.Tensor:
    """Half a step of an f16 scale max|x|/qmax: relative f16 rounding 2^-10 of it, or f16's quantum 2^-24."""
    amax = x.reshape(*x.shape[:-1], -1, group).abs().amax(-1, keepdim=True)
    half_step = amax / qmax / 2 * (1 + 2**-10) + 2**-25
    return half_step.expand(*amax.shape[:-1], group).reshape(x.shape)


@pytest.mark.parametrize("magnitude", ["mixed", "tiny"])
def test_int8_and_int4_errors_within_half_a_step(magnitude):
    # "tiny" groups have scales where f16 is subnormal (below 6e-5) or would round to zero
    spread = torch.rand(4, 3, 1) * 5 if magnitude == "mixed" else 10 ** (torch.rand(4, 3, 1) * 5 - 9)
    x = torch.randn(4, 3, 256) * spread
    d8 = kq.decode_int8(kq.encode_int8(x), 256)
    assert ((d8 - x).abs() <= _group_bound(x, 64, 127)).all()
    d4 = kq.decode_int4(kq.encode_int4(x), 256)
    assert ((d4 - x).abs() <= _group_bound(x, 32, 7)).all()


def test_codebook4_picks_the_nearest_level():
    x = torch.randn(6, 128)
    raw = kq.encode_codebook4(x)
    dec = kq.decode_codebook4(raw, 128)
    scale = x.reshape(6, 2, 64).pow(2).mean(-1, keepdim=True).sqrt().half().float()
    cand = kq.lloyd_max_gaussian_levels()[None, None, None, :] * scale[..., None]
    best = (x.reshape(6, 2, 64, 1) - cand).abs().min(-1).values.reshape(6, 128)
    assert torch.allclose((dec - x).abs(), best, atol=1e-5)


def test_byte_layout_int8_codes_then_scales_little_endian():
    x = torch.zeros(64)
    x[0], x[1], x[63] = 127.0, -1.0, 63.5
    raw = kq.encode_int8(x)
    assert raw.shape == (66,)
    assert raw[0].item() == 127 and raw[1].view(torch.int8).item() == -1 and raw[63].item() == 64
    assert raw[64:66].view(torch.float16).item() == 1.0


def test_byte_layout_int4_low_nibble_first():
    x = torch.zeros(32)
    x[0], x[1] = 7.0, -7.0
    raw = kq.encode_int4(x)
    assert raw.shape == (18,)
    assert raw[0].item() == (15 | (1 << 4))
    assert raw[1].item() == (8 | (8 << 4))
    assert raw[16:18].view(torch.float16).item() == 1.0


@pytest.mark.parametrize("name", ["int8", "rk8v4", "rk4v4"])
def test_zero_groups_decode_to_zero(name):
    fmt = kq.kv_format(name, 128)
    k, v = torch.zeros(2, 128), torch.zeros(2, 128)
    dk, dv = kq.decode_kv(fmt, kq.encode_kv(fmt, k, v))
    assert dk.abs().max() == 0 and dv.abs().max() == 0


@pytest.mark.parametrize("name,k_rel,v_rel", [("bf16", 0.004, 0.004), ("int8", 0.01, 0.01),
                                              ("rk8v4", 0.01, 0.12), ("rk4v4", 0.11, 0.12)])
def test_relative_errors_on_gaussian_rows(name, k_rel, v_rel):
    # measured relative Frobenius errors: bf16 0.0017, int8 0.006, int4 values 0.097, 4-bit keys 0.095
    fmt = kq.kv_format(name, 256)
    k, v = torch.randn(64, 2, 256), torch.randn(64, 2, 256)
    dk, dv = kq.decode_kv(fmt, kq.encode_kv(fmt, k, v))
    ref_k = kq.rotate(k) if fmt.rotated_keys else k
    assert (dk - ref_k).norm() / ref_k.norm() < k_rel
    assert (dv - v).norm() / v.norm() < v_rel


def test_bad_dtype_and_head_dim_are_user_errors():
    with pytest.raises(EngineConfigError, match="unknown --kv-dtype"):
        kq.kv_format("fp4", 128)
    with pytest.raises(EngineConfigError, match="power-of-two"):
        kq.kv_format("rk8v4", 192)
    assert kq.kv_format("int8", 192).token_bytes == 2 * 192 + 192 // 16

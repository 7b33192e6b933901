"""The KV write kernel (`kernels.kv_write`, Triton's interpreter on CPU): the pool's bytes after it are those
of `storage[pages, :, offsets] = kv_quant.encode_kv(...)`, every other byte untouched."""

from __future__ import annotations

import pytest
import torch
from conftest import needs_triton

from ninfer.engine.kv_pool import KvPool
from ninfer.kernels import kv_quant, kv_write
from ninfer.models.cache_spec import CacheSpec

pytestmark = needs_triton


def _case(fmt: kv_quant.KvFormat, T: int, H: int, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    D = fmt.head_dim
    storage = torch.randint(0, 256, (6, H, 64, fmt.token_bytes), dtype=torch.uint8, generator=g)
    slots = torch.randperm(6 * 64, generator=g)[:T]  # distinct positions anywhere in the pool
    # k and v as strided column views of one merged projection output, magnitudes spread over rows and groups
    merged = torch.randn(T, 2 * H * D + 8, generator=g) * torch.rand(T, 1, generator=g) * 3
    merged[:, 8:] *= torch.rand(2 * H * D // 64, generator=g).repeat_interleave(64) ** 4
    merged = merged.to(dtype)
    k, v = merged[:, 8:8 + H * D].view(T, H, D), merged[:, 8 + H * D:].view(T, H, D)
    return storage, slots // 64, slots % 64, k, v


@pytest.mark.parametrize("name", ["bf16", "fp32", "int8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("T", "H", "D"), [(1, 4, 256), (5, 2, 128), (3, 1, 64)])
def test_kernel_bytes_equal_encode_kv(triton_on_cpu_env, name, dtype, T, H, D):
    fmt = kv_quant.kv_format(name, D)
    storage, pages, offsets, k, v = _case(fmt, T, H, dtype, seed=T * 100 + D)
    want = storage.clone()
    want[pages, :, offsets] = kv_quant.encode_kv(fmt, k, v)
    assert kv_write.kernel_writes(fmt, storage)
    kv_write.write_kv(storage, pages, offsets, k, v, fmt)
    assert torch.equal(storage, want)


def test_int8_groups_of_zeros_and_tiny_values(triton_on_cpu_env):
    """A zero group (scale 0: codes 0) and groups whose scale is an f16 subnormal, rounded up."""
    fmt = kv_quant.kv_format("int8", 128)
    storage, pages, offsets, k, v = _case(fmt, 2, 2, torch.float32, seed=7)
    k[0, 0, :64] = 0.0
    k[1, 1, 64:] *= 1e-6
    v[0, 1, :64] *= 3e-8
    want = storage.clone()
    want[pages, :, offsets] = kv_quant.encode_kv(fmt, k, v)
    kv_write.write_kv(storage, pages, offsets, k, v, fmt)
    assert torch.equal(storage, want)


def test_pool_write_takes_the_kernel_and_rotated_formats_keep_pytorch(triton_on_cpu_env, monkeypatch):
    spec = CacheSpec(num_kv_layers=1, kv_heads=2, head_dim=64, num_gdn_layers=0, gdn_conv_channels=0,
                     gdn_conv_kernel=4, gdn_key_heads=0, gdn_value_heads=0, gdn_key_dim=0, gdn_value_dim=0)
    calls = []
    monkeypatch.setattr("ninfer.engine.kv_pool.write_kv", lambda *a: calls.append(a[-1].name))
    for name in ("int8", "rk8v4"):
        pool = KvPool(spec, name, 128, 1, 128)
        pool.assign(0, [0])
        k, v = torch.randn(2, 2, 64), torch.randn(2, 2, 64)
        pool.write(0, pool.locate(0, 0, 2), k, v)
    assert calls == ["int8"]
    keys, values = pool.read(0, pool.page_index(0, 2), 2)  # rk8v4 through encode_kv: read back decoded
    assert (values - v.transpose(0, 1)).abs().max() < 0.2 * v.abs().max()


def test_bad_shapes_are_refused(triton_on_cpu_env):
    fmt = kv_quant.kv_format("bf16", 64)
    storage, pages, offsets, k, v = _case(fmt, 2, 2, torch.float32, seed=1)
    with pytest.raises(ValueError, match="unit stride"):
        kv_write.write_kv(storage, pages, offsets, k, v[:, :1], fmt)
    with pytest.raises(ValueError, match="does not hold"):
        kv_write.write_kv(storage[:, :1], pages, offsets, k, v, fmt)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["bf16", "fp32", "int8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_bytes_equal_encode_kv_on_gpu(name, dtype):
    fmt = kv_quant.kv_format(name, 256)
    storage, pages, offsets, k, v = (t.cuda() for t in _case(fmt, 9, 4, dtype, seed=11))
    want = storage.clone()
    want[pages, :, offsets] = kv_quant.encode_kv(fmt, k, v)
    kv_write.write_kv(storage, pages, offsets, k, v, fmt)
    assert torch.equal(storage, want)

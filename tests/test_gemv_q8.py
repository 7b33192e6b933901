"""int8-activation ("q8") decode GEMV: activation quantiser, dp4a helper, memo, and the kernels vs the twin
(Triton interpreter on CPU)."""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch
from conftest import gemv_case

import ninfer.kernels.gemv_q8 as q8mod
from ninfer.errors import NinferError
from ninfer.kernels.gemv_q8 import (
    EMULATE_DP4A,
    Q8_FORMATS,
    dp4a,
    gemv_q8,
    gemv_q8_reference,
    quantize_activation,
    quantize_activation_cached,
    quantize_activation_reference,
)
from ninfer.kernels.gguf_matmul import SCHEDULES, quant_matmul, random_gguf_weight
from ninfer.kernels.triton_support import HAVE_TRITON, jit, tl
from ninfer.quant import dequantize

pytestmark = [pytest.mark.skipif(not HAVE_TRITON, reason="Triton is not installed"),
              pytest.mark.usefixtures("triton_on_cpu_env")]


if HAVE_TRITON:

    @jit
    def _dp4a_kernel(a_ptr, b_ptr, c_ptr, out_ptr, N: tl.constexpr, EMULATE: tl.constexpr):
        i = tl.arange(0, N)
        out = dp4a(tl.load(a_ptr + i), tl.load(b_ptr + i), tl.load(c_ptr + i), EMULATE)
        tl.store(out_ptr + i, out)


def test_dp4a_emulation_matches_numpy():
    rng = np.random.default_rng(1)
    n = 256
    a = rng.integers(-2**31, 2**31, n, dtype=np.int64).astype(np.int32)
    b = rng.integers(-2**31, 2**31, n, dtype=np.int64).astype(np.int32)
    c = rng.integers(-2**31, 2**31, n, dtype=np.int64).astype(np.int32)
    out = torch.empty(n, dtype=torch.int32)
    _dp4a_kernel[(1,)](torch.from_numpy(a), torch.from_numpy(b), torch.from_numpy(c), out, N=n,
                       EMULATE=EMULATE_DP4A)
    ab = a.view(np.int8).reshape(n, 4).astype(np.int64)
    bb = b.view(np.int8).reshape(n, 4).astype(np.int64)
    want = ((ab * bb).sum(1) + c.astype(np.int64) + 2**31) % 2**32 - 2**31  # int32 wrap-around
    assert EMULATE_DP4A  # CPU: the interpreter path
    np.testing.assert_array_equal(out.numpy().astype(np.int64), want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("shape", "group"), [((1, 32), 32), ((4, 608), 32), ((3, 768), 256)])
def test_quantize_activation_bit_exact(dtype, shape, group):
    g = torch.Generator().manual_seed(hash((str(dtype), shape)) % 2**31)
    x = (torch.randn(shape, generator=g) * torch.rand(shape[0], 1, generator=g) * 10).to(dtype)
    x[0, :group] = 0  # an all-zero group: d = 0, q = 0
    got, want = quantize_activation(x, group=group), quantize_activation_reference(x, group)
    assert got.q.dtype == torch.int8 and got.q.is_contiguous() and got.dtype == dtype
    assert torch.equal(got.q, want.q) and torch.equal(got.d, want.d) and torch.equal(got.s, want.s)
    assert got.d.shape == (shape[0], shape[1] // group)
    assert torch.all(got.d[0, 0] == 0) and torch.all(got.q[0, :group] == 0)
    # the quantisation error is half a step per value, plus fp32 rounding of d and x/d (measured 1.8e-6 step)
    err = (got.dequantize() - x.double()).abs().reshape(shape[0], -1, group)
    assert torch.all(err <= got.d.double()[..., None] * (0.5 + 1e-5))
    assert got.words.shape == (shape[0], shape[1] // 4)


def test_quantize_activation_rounds_half_to_even():
    x = torch.zeros(1, 32)
    x[0, :6] = torch.tensor([127.0, 2.5, -3.5, 0.5, -0.5, 1.5])  # amax 127: d = 1, q = round-half-even(x)
    for qa in (quantize_activation(x), quantize_activation_reference(x)):
        assert qa.q[0, :6].tolist() == [127, 2, -4, 0, 0, 2]
        assert qa.s[0, 0].item() == 127 + 2 - 4 + 2


def test_the_group_size_probe_quantises_as_the_gemvs_do():
    """bench/act_group_ppl.py's fake quantisation at 32 is the GEMVs' activation (codes times scales, bit for
    bit); at 256 over 576 columns (a short last group) each value moves by at most half its group's step."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from bench.act_group_ppl import fake_quantize

    x = torch.randn(3, 576, generator=torch.Generator().manual_seed(5)) * torch.rand(576) * 4
    xa = quantize_activation_reference(x)
    want = (xa.q.float().reshape(3, 18, 32) * xa.d[..., None]).reshape(3, 576)
    assert torch.equal(fake_quantize(x, 32), want)
    y = fake_quantize(x, 256)
    for lo, hi in ((0, 256), (256, 512), (512, 576)):
        step = x[:, lo:hi].abs().amax(-1, keepdim=True) / 127
        assert ((y[:, lo:hi] - x[:, lo:hi]).abs() <= step / 2 * (1 + 1e-6)).all()
    assert not torch.equal(y, fake_quantize(x, 32))


def test_quantize_activation_rejects_partial_blocks():
    with pytest.raises(NinferError, match="multiple of 32"):
        quantize_activation(torch.randn(2, 48))


def test_memo_reuses_only_the_same_unmodified_tensor(monkeypatch):
    calls = []
    real = q8mod.quantize_activation
    monkeypatch.setattr(q8mod, "quantize_activation", lambda x, **kw: calls.append(1) or real(x, **kw))
    q8mod._MEMO.clear()
    x = torch.randn(2, 64)
    a = quantize_activation_cached(x)
    assert quantize_activation_cached(x) is a and len(calls) == 1
    x.mul_(2)  # in place: a new version
    b = quantize_activation_cached(x)
    assert b is not a and len(calls) == 2 and torch.equal(b.q, quantize_activation_reference(x).q)
    y = x.clone()  # equal values, another tensor
    assert quantize_activation_cached(y) is not b and len(calls) == 3
    z = torch.randn(1, 2, 64)  # leading dims are flattened
    assert quantize_activation_cached(z).q.shape == (2, 64)


def test_memo_keeps_one_grouping_at_a_time():
    """A consumer asking for groups of 256 does not get a producer's groups of 32 (nor the reverse)."""
    q8mod._MEMO.clear()
    x = torch.randn(3, 512)
    q8mod.remember_activation(x, quantize_activation_reference(x))  # what a fused norm leaves
    a = quantize_activation_cached(x, 256)
    assert a.d.shape == (3, 2) and torch.equal(a.q, quantize_activation_reference(x, 256).q)
    assert quantize_activation_cached(x, 256) is a
    b = quantize_activation_cached(x)
    assert b.d.shape == (3, 16) and torch.equal(b.q, quantize_activation_reference(x).q)


# ---------------------------------------------------------------------------------------------------------
# The q8 kernels vs their float64 twin, and the twin vs the float matmul

# (format, schedule, columns); 12 rows (no multiple of a tile); split-K, software-pipelined (num_stages > 1)
# and two-block (block_k 512) schedules get 3 steps of 256: an empty split (s4), an odd last block (u2), more
# steps than stages ahead
KERNEL_CASES = [(fmt, sched, m) for fmt in Q8_FORMATS
                for sched, m in (("q8_n8_m1_s4", 1), ("tiny_q8_m4", 3), ("q8_n8_m8", 8), ("q8_n16_m1_p3", 2),
                                 ("q8_n8_m1_s2_u2", 1), ("q8_n16_m4_p3_u2", 4), ("q8_n8_m8_s4_p3", 5))]


@pytest.mark.parametrize("fmt,sched,width", KERNEL_CASES)
def test_kernel_equals_twin(fmt, sched, width):
    s = SCHEDULES[sched]
    cols = 768 if s.split_k > 1 or s.num_stages > 1 or s.block_k > 256 else 256
    raw, x = gemv_case(fmt, 12, cols, width, seed=Q8_FORMATS.index(fmt) * 10 + width)
    xa = quantize_activation(x)
    y = gemv_q8(raw, fmt, xa, 12, sched)
    want = gemv_q8_reference(raw, fmt, xa, 12)
    assert y.dtype == torch.float32 and y.shape == (width, 12)
    # fp32 sums of int32 sub-block dot products: measured ≤ 1.6e-7 of max|y| (interpreter)
    assert (y.double() - want).abs().max() <= 1e-6 * want.abs().max()


def test_kernel_bf16_output_and_quant_matmul_route(monkeypatch):
    raw, x = gemv_case("q4_k", 12, 256, 2, seed=5)
    x = x.bfloat16()
    q8mod._MEMO.clear()
    y = quant_matmul(raw, "q4_k", x, 12, schedule="q8_n16_m8")  # explicit q8 schedule: the q8 kernel
    want = gemv_q8_reference(raw, "q4_k", quantize_activation_reference(x), 12)
    assert y.dtype == torch.bfloat16
    assert (y.double() - want).abs().max() <= 2 ** -8 * want.abs().max()  # bf16 output rounding
    assert q8mod._MEMO.ref() is x  # quantised through the memo


@pytest.mark.parametrize("fmt", Q8_FORMATS)
def test_twin_is_within_int8_activation_error(fmt):
    """The int8 activation costs ~0.5 % rms of the output on Gaussian inputs (noise d/√12 per value, d =
    max|x|/127 over 32 values): measured 4.6e-3 – 5.5e-3 for all four formats at K = 512 and 5120."""
    rows, cols = 256, 2048
    raw, x = gemv_case(fmt, rows, cols, 4, seed=40 + Q8_FORMATS.index(fmt))
    x = torch.randn(4, cols, generator=torch.Generator().manual_seed(7))
    twin = gemv_q8_reference(raw, fmt, quantize_activation_reference(x), rows)
    w = dequantize(raw.reshape(-1), "gguf_" + fmt, (rows, cols)).double()
    full = x.double() @ w.t()
    rel = ((twin - full).pow(2).mean() / full.pow(2).mean()).sqrt().item()
    assert 2e-3 < rel < 7e-3


def test_q8_rejects_unsupported_weights():
    g = torch.Generator().manual_seed(0)
    xa = quantize_activation(torch.randn(1, 256))
    with pytest.raises(NinferError, match="int8-activation GEMV"):
        gemv_q8(random_gguf_weight("q4_0", 4, 256, generator=g), "q4_0", xa, 4, "q8_n16_m1")
    xa = quantize_activation(torch.randn(1, 160))
    with pytest.raises(NinferError, match="256-column"):
        gemv_q8(random_gguf_weight("q8_0", 4, 160, generator=g), "q8_0", xa, 4, "q8_n16_m1")


def test_memo_inference_tensors_and_capture_state(monkeypatch):
    q8mod._MEMO.clear()
    with torch.inference_mode():
        x = torch.randn(1, 64)
        a = quantize_activation_cached(x)
        assert quantize_activation_cached(x) is a  # identity alone: no version counter
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(q8mod, "quantize_activation", quantize_activation_reference)
    b = quantize_activation_cached(x)  # a capture never reuses an entry made outside it
    assert b is not a and quantize_activation_cached(x) is b


@pytest.mark.parametrize("fmt", ["q4_k", "iq3_s"])
def test_default_route_on_cuda_is_q8_unless_wv_is_asked(monkeypatch, fmt):
    """quant_matmul's default on CUDA (faked: is_cuda patched, the kernels run in the interpreter) takes an
    int8-activation GEMV for 1–8 columns: the coalesced-rows kernels where their routes say so (every width
    on a small matrix like this one), else the q8 kernels (NINFER_GEMV=q8: always); NINFER_GEMV=wv restores
    the word-vector route."""
    import ninfer.kernels.gemv_q8_iq as iqmod
    import ninfer.kernels.gemv_rows as rowsmod
    import ninfer.kernels.gemv_rows_iq as rowsiqmod

    calls = []
    real_q8, real_iq, real_rows = q8mod.gemv_q8, iqmod.gemv_q8_iq, rowsmod.gemv_rows
    monkeypatch.setattr(q8mod, "gemv_q8", lambda *a: calls.append("q8") or real_q8(*a))
    monkeypatch.setattr(iqmod, "gemv_q8_iq", lambda *a: calls.append("iq") or real_iq(*a))
    monkeypatch.setattr(rowsmod, "gemv_rows", lambda *a, **kw: calls.append("rows") or real_rows(*a, **kw))
    real_rows_iq = rowsiqmod.gemv_rows_iq
    monkeypatch.setattr(rowsiqmod, "gemv_rows_iq",
                        lambda *a, **kw: calls.append("rows_iq") or real_rows_iq(*a, **kw))
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: self.device.type == "cpu"))
    monkeypatch.setattr(torch.cuda, "get_device_properties",  # gemv_q8_iq sizes stream-K grids by SM count
                        lambda device: types.SimpleNamespace(multi_processor_count=132))
    raw, x = gemv_case(fmt, 8, 256, 2, seed=9)
    want = gemv_q8_reference(raw, fmt, quantize_activation_reference(x), 8)
    y = quant_matmul(raw, fmt, x, 8)
    assert calls == (["rows"] if fmt == "q4_k" else ["rows_iq"])
    assert (y.double() - want).abs().max() <= 1e-6 * want.abs().max()
    calls.clear()
    want1 = gemv_q8_reference(raw, fmt, quantize_activation_reference(x[1:]), 8)
    y1 = quant_matmul(raw, fmt, x[1:], 8)
    assert calls == (["rows"] if fmt == "q4_k" else ["rows_iq"])
    assert (y1.double() - want1).abs().max() <= 1e-6 * want1.abs().max()
    calls.clear()
    monkeypatch.setenv("NINFER_GEMV", "q8")
    y = quant_matmul(raw, fmt, x, 8)
    # 2 columns of a k-quant: two 1-column GEMVs (faster than a 4-column tile on the H200); i-quants: one tile
    assert calls == (["q8", "q8"] if fmt == "q4_k" else ["iq"])
    assert (y.double() - want).abs().max() <= 1e-6 * want.abs().max()
    calls.clear()
    x3 = torch.cat([x, x[:1] * 0.5])
    want3 = gemv_q8_reference(raw, fmt, quantize_activation_reference(x3), 8)
    y3 = quant_matmul(raw, fmt, x3, 8)
    assert calls == ["q8" if fmt == "q4_k" else "iq"]
    assert (y3.double() - want3).abs().max() <= 1e-6 * want3.abs().max()
    monkeypatch.setenv("NINFER_GEMV", "wv")
    quant_matmul(raw, fmt, x, 8)
    assert len(calls) == 1


def test_q6k_any_size_and_alignment():
    """q6_k is read as aligned int32 words: a tensor whose size (13 rows × 3 blocks = 8190 bytes) or address
    (2 bytes into a buffer) is no multiple of 4 still gives the twin's result (odd blocks start mid-word)."""
    raw, x = gemv_case("q6_k", 13, 768, 2, seed=21)
    xa = quantize_activation(x)
    want = gemv_q8_reference(raw, "q6_k", xa, 13)
    buf = torch.zeros(raw.numel() + 2, dtype=torch.uint8)
    buf[2:] = raw.reshape(-1)
    shifted = buf[2:].view(13, -1)
    assert raw.numel() % 4 and shifted.data_ptr() % 4
    for w in (raw, shifted):
        y = gemv_q8(w, "q6_k", xa, 13, "q8_n16_m1_p3")
        assert (y.double() - want).abs().max() <= 1e-6 * want.abs().max()

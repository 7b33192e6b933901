"""`--cpu-weights int8`: per-row int8 requantisation, the `_weight_int8pack_mm` linear against a float
reference of the requantised weights, and the tiny fixture model with int8 weights against transformers fp32.

Measured (this machine): the int8 linear's bf16 output differs from the fp64 product of the same bf16
activations and requantised weights by at most 0.0022 × (|x|·|w| + |b|) — bf16 output rounding; on the
tiny model (random weights, logit std 0.95) int8 logits are within 0.29 max / 0.041 mean of transformers
fp32 over all 20 positions of prompt 1 (dense bf16: 0.13 / 0.017).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from simple_context import prefill_logits, single_thread

from ninfer.artifact import open_artifact
from ninfer.errors import NinferError
from ninfer.kernels.cpu_linear import (
    dequantize_rows_int8,
    int8_linear,
    int8_linear_reference,
    quantize_rows_int8,
)
from ninfer.models import load_model
from ninfer.models.weights import Linear, cpu_weights

# (rows, in, out); widths 17 and 12 are not multiples of 8: the op mishandles those, the reference runs
SHAPES = [(1, 896, 4864), (1, 4864, 896), (3, 256, 1280), (17, 128, 96), (2, 64, 7), (1, 17, 6), (5, 12, 9)]
# bf16 output: one rounding, at most 2^-8 relative to |x|·|w| (+ |b|) per element (measured max 0.0022)
OUT_REL_TOL = 2**-8
# tiny model, int8 vs transformers fp32 logits over p1's 20 positions (measured 0.288 / 0.0405 with fp32
# compute, 0.250 / 0.0413 with bf16 compute)
TINY_MAX_ATOL, TINY_MEAN_ATOL = 0.40, 0.06


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    with single_thread():
        yield


def _fresh(seed: int, *shape: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g) * (0.5 + torch.rand(shape[0], 1, generator=g))


@pytest.mark.parametrize("out_f,in_f", [(4864, 896), (7, 64), (96, 128)])
def test_requantised_rows_are_within_half_a_step(out_f, in_f):
    w = _fresh(out_f + in_f, out_f, in_f)
    w[0] = 0.0  # an all-zero row must not divide by zero
    q, scale = quantize_rows_int8(w)
    assert q.dtype == torch.int8 and scale.dtype == torch.bfloat16 and q.shape == w.shape
    assert int(q.abs().max()) <= 127 and int(q[0].abs().max()) == 0
    err = (dequantize_rows_int8(q, scale) - w).abs()
    # round-to-nearest against the bf16 scale actually used: half a step, plus the bf16 scale's rounding
    # at the row's largest element (|w|max/127 rounded to bf16 may clip it by < 2^-8 relative)
    bound = scale.float()[:, None] * 0.5 + w.abs().amax(1, keepdim=True) * 2**-8
    assert bool((err <= bound).all())


@pytest.mark.parametrize("rows,in_f,out_f", SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_int8_linear_equals_float_product_of_requantised_weights(rows, in_f, out_f, bias):
    seed = rows * 7919 + in_f * 31 + out_f + int(bias)
    w = _fresh(seed, out_f, in_f)
    x = torch.randn(rows, in_f, generator=torch.Generator().manual_seed(seed + 1))
    b = torch.randn(out_f, generator=torch.Generator().manual_seed(seed + 2)) if bias else None
    q, scale = quantize_rows_int8(w)
    xb = x.to(torch.bfloat16)
    expected = F.linear(xb.double(), dequantize_rows_int8(q, scale).double())
    if b is not None:
        expected = expected + b.to(torch.bfloat16).double()
    bound = xb.double().abs() @ dequantize_rows_int8(q, scale).double().abs().T + 1e-6
    if b is not None:
        bound = bound + b.to(torch.bfloat16).double().abs()
    for fn in (int8_linear, int8_linear_reference):
        y = fn(x, q, scale, b)
        assert y.dtype == torch.bfloat16 and y.shape == (rows, out_f)
        rel = ((y.double() - expected).abs() / bound).max().item()
        assert rel <= OUT_REL_TOL, (fn.__name__, rel)


def test_int8_linear_keeps_leading_dims():
    w, x = _fresh(1, 40, 24), torch.randn(2, 3, 24)
    q, scale = quantize_rows_int8(w)
    y = int8_linear(x, q, scale)
    assert y.shape == (2, 3, 40)
    torch.testing.assert_close(y.reshape(6, 40), int8_linear(x.reshape(6, 24), q, scale), rtol=0, atol=0)


class _Stored:
    def __init__(self, w: torch.Tensor):
        self.shape, self.w = tuple(w.shape), w

    def dequantize(self, dtype=torch.float32):
        return self.w.to(dtype)


class _Source:
    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.tensors = tensors

    def tensor(self, name):
        return _Stored(self.tensors[name])

    def input_columns(self, name):
        return torch.tensor([2, 0, 1, 3]) if name == "perm" else None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_in_int8_mode(dtype):
    w, b = _fresh(3, 6, 4), torch.randn(6)
    src = _Source({"w": w, "b": b, "perm": w})
    with cpu_weights("int8"):
        lin = Linear(src, "w", dtype, "cpu", bias_name="b")
        perm = Linear(src, "perm", dtype, "cpu")
    dense = Linear(src, "w", dtype, "cpu", bias_name="b")
    assert lin.weight.dtype == torch.int8 and lin.scales is not None and dense.scales is None
    assert dense.weight.dtype == dtype
    x = torch.randn(5, 4)
    q, scale = quantize_rows_int8(w)
    y = lin(x)
    assert y.dtype == dtype
    torch.testing.assert_close(y, int8_linear(x, q, scale, b.to(dtype)).to(dtype), rtol=0, atol=0)
    torch.testing.assert_close(perm(x), int8_linear(x[:, [2, 0, 1, 3]], q, scale).to(dtype), rtol=0, atol=0)


def test_unknown_mode_is_a_user_error():
    with pytest.raises(NinferError, match="int8"):
        with cpu_weights("int4"):
            pass


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiny_model_with_int8_weights_stays_near_transformers(tiny_artifact, tiny_dir, dtype):
    ref = dict(np.load(tiny_dir / "reference" / "reference.npz"))
    model = load_model(open_artifact(tiny_artifact), dtype=dtype, load_mtp=False, cpu_weights="int8")
    heads = [m for m in model.modules() if isinstance(m, Linear)]
    assert heads and all(m.weight.dtype == torch.int8 for m in heads)
    assert model.output_head in heads  # the untied output head is int8 too
    logits = prefill_logits(model, ref["p1_ids"].tolist())
    diff = (logits - torch.from_numpy(ref["p1_tf_logits"])).abs()
    assert diff.max().item() <= TINY_MAX_ATOL, diff.max()
    assert diff.mean().item() <= TINY_MEAN_ATOL, diff.mean()


def test_engine_config_plumbs_int8_weights(tiny_artifact):
    from ninfer.engine.engine import Engine, EngineConfig
    from ninfer.errors import EngineConfigError

    with pytest.raises(EngineConfigError, match="cpu-weights"):
        EngineConfig(cpu_weights="int4").validate()
    engine = Engine(tiny_artifact, EngineConfig(max_context=64, kv_capacity=64, cpu_weights="int8"))
    assert engine.model.output_head.weight.dtype == torch.int8


def test_bench_cli_runs_int8_weights(capsys):
    from ninfer.cli.bench import main

    assert main(["--synthetic", "tiny", "-p", "4", "-n", "3", "-r", "1", "--cpu-weights", "int8",
                 "-o", "json"]) == 0
    assert '"float32+int8"' in capsys.readouterr().out

"""Fused elementwise kernels (`kernels.fused`, through `kernels.ops`) and merged projections (`MergedLinear`).

Kernels run in Triton's interpreter on CPU (NINFER_TRITON_ON_CPU=1) against their references on fresh random
inputs; the models' CPU path must stay the reference exactly; merged quantized projections must give the
unmerged model's logits; and a decode step's kernel launches are counted before and after fusion.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import TINY_GGUF, TINY_HF
from simple_context import Sequence, SequenceCache, SimpleContext, prefill_logits, single_thread, step
from torch.utils._python_dispatch import TorchDispatchMode

from ninfer.artifact import open_artifact
from ninfer.cli.convert import main as convert_main
from ninfer.convert.recipes.qwen3_5 import tiled_input_columns
from ninfer.errors import NinferError
from ninfer.kernels import fused, gguf_matmul, kv_quant, kv_write, ops, paged_attention, reference
from ninfer.models import load_model
from ninfer.models.weights import MergedLinear, merged_projections

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Measured (interpreter vs reference, these shapes): fp32 ≤ 2.9e-6 abs on outputs of magnitude ≤ ~5 (fp32
# reduction order); bf16/fp16 outputs equal except ≤ 0.1 % of elements one unit in the last place apart
# (a rounding boundary crossed by that reduction-order difference).
FP32_ATOL = 1e-5
ULP_RTOL = {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}
MAX_OFF_BY_ONE = 0.01


@pytest.fixture(autouse=True)
def _kernels_on_cpu(monkeypatch):
    monkeypatch.setenv("NINFER_TRITON_ON_CPU", "1")


@pytest.fixture
def gen():
    # the test's own seed (conftest: its id, re-rolled by NINFER_TEST_SEED)
    g = torch.Generator().manual_seed(torch.initial_seed())
    return g


def _randn(gen, *shape, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape, generator=gen) * scale).to(dtype)


def _close(got: torch.Tensor, want: torch.Tensor, operand_ulps: float = 0.0) -> None:
    """Equal up to one unit in the last place (most elements exactly equal); `operand_ulps`: also allow that
    many ulps of the largest output, for a sum of rounded operands (rotary: `n·cos ± n'·sin`, where a flipped
    ulp of n shows in full when the two terms cancel)."""
    assert got.dtype == want.dtype and got.shape == want.shape
    if want.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=0, atol=FP32_ATOL)
        return
    rtol = ULP_RTOL[want.dtype]
    atol = max(1e-6, operand_ulps * rtol * want.float().abs().max().item())
    torch.testing.assert_close(got.float(), want.float(), rtol=rtol, atol=atol)
    assert (got != want).float().mean().item() <= MAX_OFF_BY_ONE


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [5120, 6144, 200])
@pytest.mark.parametrize("rows", [3, fused.NORM_SPLIT_ROWS + 1])  # rows split over programs, or whole
def test_add_rms_norm_matches_reference(gen, dtype, width, rows):
    x, res = _randn(gen, rows, width, dtype=dtype), _randn(gen, rows, width, dtype=dtype, scale=4.0)
    w = _randn(gen, width, scale=0.2)
    for zero_centred in (True, False):
        normed, new_res = fused.add_rms_norm(x, res, w, 1e-6, zero_centred)
        want_normed, want_res = fused.add_rms_norm_reference(x, res, w, 1e-6, zero_centred)
        assert torch.equal(new_res, want_res)  # one rounding of an fp32 sum, as PyTorch's add
        _close(normed, want_normed)
    normed, same = fused.add_rms_norm(x, None, w, 1e-6, True)
    assert same is x
    _close(normed, reference.rms_norm(x, w, 1e-6, True))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [128, 256])
def test_per_head_rms_norm_on_a_strided_view(gen, dtype, head_dim):
    merged = _randn(gen, 2, 5 * head_dim + 7, dtype=dtype)  # q heads are a column view of a merged output
    q = merged[:, : 4 * head_dim].view(2, 4, head_dim)
    w = _randn(gen, head_dim, scale=0.2)
    _close(ops.rms_norm(q, w, 1e-6, True), reference.rms_norm(q, w, 1e-6, True))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("head_dim", "rotary_dim", "sections"),
                         [(256, 64, (11, 11, 10)), (128, 32, (6, 5, 5)), (128, 128, None)])
def test_norm_rotary_matches_reference(gen, dtype, head_dim, rotary_dim, sections):
    T, H = 3, 6
    merged = _randn(gen, T, H * head_dim + 64, dtype=dtype)
    x = merged[:, 64:].view(T, H, head_dim)
    w = _randn(gen, head_dim, scale=0.2)
    positions = torch.randint(0, 5000, (3, T), generator=gen) if sections else torch.arange(T) + 900
    cos, sin = reference.mrope_cos_sin(positions, rotary_dim, 1e7, sections, True)
    # measured over 400 seeds (fp16): ≤ 0.0038 relative where the two rotary terms cancel, ≤ 1 ulp elsewhere
    _close(fused.norm_rotary(x, w, cos, sin, 1e-6), fused.norm_rotary_reference(x, w, cos, sin, 1e-6), 2.0)
    _close(fused.norm_rotary(x, None, cos, sin, 1e-6), reference.apply_rotary(x, cos, sin))


@pytest.mark.parametrize(("rotary_dim", "theta"), [(64, 1e7), (128, 1e6), (64, 5e5), (6, 1e4)])
def test_rope_tables_match_reference(gen, rotary_dim, theta):
    """The rotate-half tables of text positions in one launch: the reference's angles (fp32 pos·freq) and
    cos / sin, at positions up to 2^18 (angles up to ~2.6e5 rad) and a run at the start."""
    positions = torch.cat([torch.arange(5), torch.randint(0, 1 << 18, (40,), generator=gen)])
    inv_freq = reference.rope_inv_freq(rotary_dim, theta)
    got, want = fused.rope_cos_sin(positions, inv_freq), reference.rope_cos_sin(positions, inv_freq)
    # measured over 200 seeds (the interpreter's numpy cos / sin against PyTorch's, both fp32): ≤ 6.0e-8
    # apart, one ulp; allowed: one ulp at 1
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=2.0**-23)
    assert torch.equal(ops.mrope_cos_sin(positions, rotary_dim, theta)[0], got[0])
    assert got[0].shape == (45, rotary_dim)


def test_decode_rows_match_reference(gen):
    """A decode round's addresses in one launch: page ids through the page tables, in-page offsets, int32
    lanes and lengths, each lane's GDN slot (lanes of T rows: the first row's)."""
    tables = torch.randint(0, 1000, (9, 12), generator=gen, dtype=torch.int32)
    for lanes, T in ((5, 1), (3, 4), (1, 1)):
        N = lanes * T
        lane = torch.randint(0, 9, (lanes,), generator=gen).repeat_interleave(T)
        pos = (torch.randint(0, 700, (lanes,), generator=gen)[:, None] + torch.arange(T)).flatten()
        slot = torch.randint(0, 20, (lanes,), generator=gen).repeat_interleave(T)
        inputs = torch.stack([torch.randint(0, 100, (N,), generator=gen), pos, lane, pos + 1, slot])
        got = kv_write.decode_rows(inputs, tables, T)
        want = kv_write.decode_rows_reference(inputs, tables, T)
        for g, w in zip(got, want, strict=True):
            assert g.dtype == w.dtype and torch.equal(g, w)
        assert want[4].shape == (lanes,) and want[2].dtype == torch.int32


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block", [2048, 64])
def test_logits_argmax_is_torch_argmax(gen, monkeypatch, dtype, block):
    """The head's fp32 logits and each row's argmax below the sample vocab in two launches: the cast bit for
    bit, and torch.argmax's choice — the first of equal maxima (across chunks too), −0 equal to +0, NaN above
    every number, the columns past the vocab never chosen, a row of −inf its first column."""
    monkeypatch.setattr(fused, "ARGMAX_BLOCK", block)
    T, N, vocab = 6, 5000, 4901
    logits = _randn(gen, T, N, dtype=dtype, scale=4.0)
    top = torch.randint(0, vocab, (2,), generator=gen).sort().values
    logits[0, top] = 50.0  # a tie: the first wins (another chunk when apart by a block)
    logits[1, vocab:] = 99.0  # past the vocab (the head's padded rows): never chosen
    logits[2, torch.randint(0, vocab, (2,), generator=gen)] = float("nan")
    logits[3] = -1.0
    logits[3, [700, 800]] = torch.tensor([-0.0, 0.0], dtype=dtype)
    logits[4] = float("-inf")
    got, ids = fused.logits_argmax(logits, vocab)
    want = logits.float()
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))  # bits: NaN and −0 too
    assert torch.equal(ids, want[:, :vocab].argmax(dim=-1))
    assert ids[0] == top[0] and ids[1] < vocab and ids[3] == 700 and ids[4] == 0
    assert torch.equal(fused.logits_argmax(logits)[1], want.argmax(dim=-1))  # every column


def test_logits_argmax_checks_its_vocab(gen):
    logits = _randn(gen, 2, 40)
    for vocab in (0, 41):
        with pytest.raises(fused.FusedKernelError, match="vocab"):
            fused.logits_argmax(logits, vocab)
    got, ids = ops.logits_argmax(logits[:, ::2], 7)  # strided columns: PyTorch's ops
    assert torch.equal(ids, logits[:, ::2][:, :7].argmax(-1)) and torch.equal(got, logits[:, ::2])


@pytest.mark.parametrize("dtype", DTYPES)
def test_norm_rotary_pair_is_two_norm_rotaries(gen, dtype):
    """Queries and keys (strided views of one merged output, their own norm weights) in one launch: each the
    single-tensor kernel's result bit for bit."""
    T, Hq, Hk, D = 2, 6, 2, 128
    merged = _randn(gen, T, (Hq + Hk) * D + 32, dtype=dtype)
    q, k = merged[:, 32:32 + Hq * D].view(T, Hq, D), merged[:, 32 + Hq * D:].view(T, Hk, D)
    wq, wk = _randn(gen, D, scale=0.2), _randn(gen, D, scale=0.2)
    cos, sin = reference.mrope_cos_sin(torch.arange(T) + 300, 64, 1e7, None, False)
    got_q, got_k = fused.norm_rotary_pair(q, wq, k, wk, cos, sin, 1e-6)
    assert torch.equal(got_q, fused.norm_rotary(q, wq, cos, sin, 1e-6))
    assert torch.equal(got_k, fused.norm_rotary(k, wk, cos, sin, 1e-6))
    _close(got_k, fused.norm_rotary_reference(k, wk, cos, sin, 1e-6), 2.0)
    with pytest.raises(fused.FusedKernelError, match="norm weight"):
        fused.norm_rotary_pair(q, wq, k, None, cos, sin, 1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [17408, 768, 1000])
def test_swiglu_on_merged_gate_up(gen, dtype, width):
    gate_up = _randn(gen, 2, 2 * width, dtype=dtype, scale=3.0)
    gate, up = gate_up[:, :width], gate_up[:, width:]
    _close(fused.swiglu(gate, up), reference.swiglu(gate, up))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("heads", "dim"), [(48, 128), (6, 128), (3, 100)])
def test_gated_rms_norm_matches_reference(gen, dtype, heads, dim):
    core = _randn(gen, 2, heads, dim, dtype=dtype)
    z_merged = _randn(gen, 2, heads * dim + 33, dtype=dtype, scale=2.0)  # z: a column view
    z = z_merged[:, 33:].view(2, heads, dim)
    w = _randn(gen, dim).abs()
    _close(fused.gated_rms_norm(core, z, w, 1e-6), reference.gated_rms_norm(core, z, w, 1e-6))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gated_rms_norm_casts_and_scatters_for_the_output_projection(gen, dtype):
    """fp32 mixer output cast to the compute dtype and the output Linear's input-column order applied, in the
    same launch: equal to cast → norm → flatten → index_select (what the unfused model ran)."""
    T, H, N = 2, 6, 128
    core, z = _randn(gen, T, H, N), _randn(gen, T, H, N, dtype=dtype)
    w = _randn(gen, N).abs()
    gather = torch.randperm(H * N, generator=gen)
    got = ops.gated_rms_norm(core, z, w, 1e-6, dtype, gather, torch.argsort(gather))
    want = reference.gated_rms_norm(core.to(dtype), z, w, 1e-6).reshape(T, -1).index_select(-1, gather)
    _close(got, want)
    _close(fused.gated_rms_norm_reference(core, z, w, 1e-6, dtype, gather), want)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [6144, 512, 300])
def test_sigmoid_gate_mul_matches_reference(gen, dtype, width):
    attn = _randn(gen, 3, width, dtype=dtype)
    gate = _randn(gen, 3, 2 * width, dtype=dtype, scale=3.0)[:, width:]
    _close(fused.sigmoid_gate_mul(attn, gate), fused.sigmoid_gate_mul_reference(attn, gate))


@pytest.mark.parametrize(("op", "width", "group"), [("add_rms_norm", 5120, 32), ("add_rms_norm", 96, 32),
                                                  ("swiglu", 1056, 32), ("sigmoid_gate_mul", 6144, 32),
                                                  ("add_rms_norm", 5120, 256), ("swiglu", 2048, 256),
                                                  ("sigmoid_gate_mul", 6144, 256)])
def test_int8_activation_made_in_the_same_launch(gen, op, width, group):
    """With `quantize`, the kernel also writes its output's int8 activation (bit-equal to quantising the
    stored output, `group` values a scale) and leaves it in gemv_q8's memo for the Linear that reads the
    output next."""
    from ninfer.kernels import gemv_q8

    a, b = _randn(gen, 3, width, dtype=torch.bfloat16, scale=3.0), _randn(gen, 3, width, dtype=torch.bfloat16)
    if op == "add_rms_norm":
        w = _randn(gen, width)
        out, res = fused.add_rms_norm(a, b, w, 1e-6, True, quantize=True, group=group)
        plain = fused.add_rms_norm(a, b, w, 1e-6, True)
        assert torch.equal(res, plain[1])
        plain = plain[0]
    else:
        kernel = getattr(fused, op)
        out, plain = kernel(a, b, quantize=True, group=group), kernel(a, b)
    assert torch.equal(out, plain)  # the output itself is unchanged
    remembered = gemv_q8._MEMO.result
    assert gemv_q8.quantize_activation_cached(out, group) is remembered  # no second quantisation
    want = gemv_q8.quantize_activation_reference(out, group)
    assert torch.equal(remembered.q, want.q) and torch.equal(remembered.d, want.d)
    assert torch.equal(remembered.s, want.s) and remembered.dtype == torch.bfloat16
    gemv_q8._MEMO.clear()
    with pytest.raises(NinferError, match="multiple of 32"):
        fused.swiglu(a[:, :40], b[:, :40], quantize=True)


def test_decode_norm_takes_a_program_a_group_of_256_at_few_rows(monkeypatch):
    """A program a group of 256 up to NORM_ONE_GROUP_ROWS split rows; NINFER_NORM_ONE_GROUP=0 / 1 never /
    always."""
    monkeypatch.delenv("NINFER_NORM_ONE_GROUP", raising=False)
    most = fused.NORM_ONE_GROUP_ROWS
    assert fused.norm_one_group(1) and fused.norm_one_group(most) and not fused.norm_one_group(most + 1)
    monkeypatch.setenv("NINFER_NORM_ONE_GROUP", "0")
    assert not fused.norm_one_group(1)
    monkeypatch.setenv("NINFER_NORM_ONE_GROUP", "1")
    assert fused.norm_one_group(8)


def test_decode_norm_splits_rows_up_to_a_count(monkeypatch):
    """Each row over several programs up to NORM_SPLIT_ROWS rows, a program a row beyond;
    NINFER_NORM_SPLIT_ROWS moves the count (A/B)."""
    monkeypatch.setenv("NINFER_NORM_SPLIT_ROWS", "")  # set empty: the default (a sweep's baseline)
    assert fused.norm_split_rows() == fused.NORM_SPLIT_ROWS
    monkeypatch.setenv("NINFER_NORM_SPLIT_ROWS", "2")
    assert fused.norm_split_rows() == 2


def test_gated_norm_heads_warps(monkeypatch):
    """The several-head gated norm's warps: GATED_HEADS_WARPS unless NINFER_GATED_NORM_WARPS names 1, 2, 4
    or 8."""
    monkeypatch.delenv("NINFER_GATED_NORM_WARPS", raising=False)
    assert fused.gated_heads_warps() == fused.GATED_HEADS_WARPS == 4
    monkeypatch.setenv("NINFER_GATED_NORM_WARPS", "2")
    assert fused.gated_heads_warps() == 2
    monkeypatch.setenv("NINFER_GATED_NORM_WARPS", "3")
    assert fused.gated_heads_warps() == 4


@pytest.mark.parametrize("one_group", ["0", "1"])
def test_decode_norm_in_groups_of_256_either_way(gen, monkeypatch, one_group):
    """The decode add + RMSNorm quantising in groups of 256 a program a group (held as rows of 32) or
    NORM_CHUNK columns a program (as [2, 256]): the same output, residual and int8 activation bytes as the
    references, over rows whose groups differ in scale."""
    from ninfer.kernels import gemv_q8

    monkeypatch.setenv("NINFER_NORM_ONE_GROUP", one_group)
    x = (_randn(gen, 2, 1024) * torch.linspace(0.1, 8.0, 1024)).to(torch.bfloat16)
    r, w = _randn(gen, 2, 1024, dtype=torch.bfloat16), _randn(gen, 1024)
    out, res = fused.add_rms_norm(x, r, w, 1e-6, True, quantize=True, group=256)
    want_out, want_res = fused.add_rms_norm(x, r, w, 1e-6, True)
    assert torch.equal(res, want_res)
    _close(out, want_out)
    made = gemv_q8._MEMO.result
    want = gemv_q8.quantize_activation_reference(out, 256)
    assert torch.equal(made.q, want.q) and torch.equal(made.d, want.d) and torch.equal(made.s, want.s)
    gemv_q8._MEMO.clear()


@pytest.mark.parametrize("dims", [(3, 8, 64), (2, 48, 128)])  # the 27B's: 48 value heads of 128
@pytest.mark.parametrize("group", [32, 256])
@pytest.mark.parametrize("order", ["none", "heads", "tiled"])
def test_gated_rms_norm_quantises_whole_heads_for_the_output_projection(gen, order, group, dims):
    """The GDN output norm with `quantize`: its flat bf16 output unchanged and its int8 activation bit-equal
    to quantising that output, also when the output Linear's input order moves whole heads (a GGUF's tiled
    value heads) — each program's head stays one run of 32-column groups; groups of 256 over heads of 64
    (four heads a program, found through the gather where heads move)."""
    from ninfer.kernels import gemv_q8
    from ninfer.models.weights import aligned_run

    T, H, N = dims
    core, z = _randn(gen, T, H, N), _randn(gen, T, H, N, dtype=torch.bfloat16, scale=2.0)
    w = _randn(gen, N).abs()
    heads = torch.randperm(H, generator=gen)
    gather = {"none": None, "heads": (heads[:, None] * N + torch.arange(N)).reshape(-1),
              "tiled": tiled_input_columns(H // 4, H, N)}[order]
    scatter = None if gather is None else torch.argsort(gather)
    if scatter is not None:
        assert aligned_run(scatter) % N == 0
    out = fused.gated_rms_norm(core, z, w, 1e-6, torch.bfloat16, scatter, quantize=True, group=group,
                               gather=gather)
    want = reference.gated_rms_norm(core.to(torch.bfloat16), z, w, 1e-6).reshape(T, -1)
    _close(out, want if gather is None else want.index_select(-1, gather))
    assert torch.equal(out, fused.gated_rms_norm(core, z, w, 1e-6, torch.bfloat16, scatter).reshape(T, -1))
    got = gemv_q8.quantize_activation_cached(out, group)
    ref = gemv_q8.quantize_activation_reference(out, group)
    assert got is gemv_q8._MEMO.result
    assert torch.equal(got.q, ref.q) and torch.equal(got.d, ref.d) and torch.equal(got.s, ref.s)
    gemv_q8._MEMO.clear()
    with pytest.raises(NinferError, match="power-of-two multiple of 32"):
        fused.gated_rms_norm(core[..., :48], z[..., :48], w[:48], 1e-6, torch.bfloat16, quantize=True)
    with pytest.raises(NinferError, match=f"whole groups of them; got {H - 1} of {N}"):  # odd: no pairs
        fused.gated_rms_norm(core[:, 1:], z[:, 1:], w, 1e-6, torch.bfloat16, quantize=True, group=256)


def test_aligned_run_finds_the_runs_a_permutation_keeps_together():
    from ninfer.models.weights import aligned_run

    assert aligned_run(torch.arange(768)) == 256  # 768 = 3 · 256: no longer power-of-two run divides it
    heads = torch.tensor([2, 0, 3, 1])
    assert aligned_run((heads[:, None] * 128 + torch.arange(128)).reshape(-1)) == 128
    swapped = torch.arange(512)
    swapped[[5, 6]] = swapped[[6, 5]]
    assert aligned_run(swapped) == 1
    shifted = (torch.arange(512) + 32) % 512  # consecutive runs, but starting off their alignment
    assert aligned_run(shifted) == 32


def test_ops_take_the_reference_path_off_triton(gen, monkeypatch):
    """Without NINFER_TRITON_ON_CPU (ordinary CPU inference) every op is its reference, bit for bit."""
    monkeypatch.delenv("NINFER_TRITON_ON_CPU")
    x, r = _randn(gen, 2, 256, dtype=torch.bfloat16), _randn(gen, 2, 256, dtype=torch.bfloat16)
    w = _randn(gen, 256)
    cos, sin = reference.mrope_cos_sin(torch.arange(2), 64, 1e7)
    h = x.view(2, 2, 128)
    pairs = [
        (ops.add_rms_norm(x, r, w, 1e-6, True), fused.add_rms_norm_reference(x, r, w, 1e-6, True)),
        (ops.rms_norm(x, w, 1e-6, False), reference.rms_norm(x, w, 1e-6, False)),
        (ops.gated_rms_norm(h, h, w[:128], 1e-6), reference.gated_rms_norm(h, h, w[:128], 1e-6)),
        (ops.norm_rotary_pair(h, w[:128], x.view(2, 2, 128)[:, :1], w[128:], cos, sin, 1e-6),
         (fused.norm_rotary_reference(h, w[:128], cos, sin, 1e-6),
          fused.norm_rotary_reference(h[:, :1], w[128:], cos, sin, 1e-6))),
        (ops.swiglu(x, r), reference.swiglu(x, r)),
        (ops.sigmoid_gate_mul(x, r), fused.sigmoid_gate_mul_reference(x, r)),
    ]
    for got, want in pairs:
        got, want = (got, want) if isinstance(got, tuple) else ((got,), (want,))
        assert all(torch.equal(g, wt) for g, wt in zip(got, want, strict=True))


def test_bad_inputs_are_clear_errors(gen):
    x = _randn(gen, 2, 4, 128)
    with pytest.raises(NinferError, match="unit stride"):
        fused.rms_norm(x.transpose(1, 2), torch.ones(4), 1e-6, True)
    with pytest.raises(NinferError, match="differ"):
        fused.swiglu(x[:, 0], x[:, 1, :64])
    cos, sin = reference.mrope_cos_sin(torch.arange(3), 64, 1e7)
    with pytest.raises(NinferError, match="cos/sin"):
        fused.norm_rotary(x, None, cos, sin, 1e-6)


# ---- the model on the fused ops, merged projections --------------------------------------------------------


def _convert(out, wtype: str):
    f = TINY_GGUF / f"model-{wtype}.gguf"
    rc = convert_main(["--recipe", "qwen3_5_gguf", "--source", f"gguf={f}", "--source", f"mtp={f}",
                       "--components", "text,mtp", "--model", str(TINY_HF), "--out", str(out), "--quiet"])
    assert rc == 0
    return open_artifact(out)


@pytest.fixture(scope="module")
def q4km(tmp_path_factory):
    """q4_k_m: layer 2's GDN q|k|v is q6_k while z, a, b are q4_k — two merged matmuls in that layer."""
    return _convert(tmp_path_factory.mktemp("fused") / "q4km.ninfer", "q4_k_m")


@pytest.fixture(scope="module")
def tiny_bf16(tiny_artifact):
    return open_artifact(tiny_artifact)


def _reference_matmul(monkeypatch):
    monkeypatch.setattr(gguf_matmul, "quant_matmul", lambda raw, format, x, out_features, **kw:
                        gguf_matmul.quant_matmul_reference(raw, format, x, out_features))


def test_merged_projections_give_the_unmerged_logits(q4km, monkeypatch):
    monkeypatch.delenv("NINFER_TRITON_ON_CPU")
    _reference_matmul(monkeypatch)
    with single_thread():
        merged = load_model(q4km, quantized_weights=True)
        with merged_projections(False):
            plain = load_model(q4km, quantized_weights=True)
        gdn2 = merged.layers[2].mixer.in_proj
        assert isinstance(gdn2, MergedLinear) and len(gdn2.groups) == 2
        assert [g.format for g in gdn2.groups] == ["gguf_q6_k", "gguf_q4_k"]
        assert len(merged.layers[0].mixer.in_proj.groups) == len(merged.layers[0].mlp.gate_up.groups) == 1
        assert not any(isinstance(m, MergedLinear) for m in plain.modules())
        assert not any(isinstance(m, MergedLinear) for m in load_model(q4km).modules())  # dense: never
        # the same bytes in one buffer: merged raw rows are the members' rows, in order
        attn = merged.layers[3].mixer.in_proj
        rows = [getattr(plain.layers[3].mixer, r).raw for r in ("query", "gate", "key", "value")]
        assert len(attn.groups) == 1 and torch.equal(attn.groups[0].raw, torch.cat(rows))
        ids = [5, 17, 300, 42, 7, 99, 1000, 3, 8]
        torch.testing.assert_close(prefill_logits(merged, ids), prefill_logits(plain, ids), rtol=0, atol=2e-5)
        assert isinstance(merged.mtp.layer.mixer.in_proj, MergedLinear)  # MTP's v is q6_k, the rest q4_k
        torch.testing.assert_close(_mtp_logits(merged, ids), _mtp_logits(plain, ids), rtol=0, atol=2e-5)


def _mtp_logits(model, ids: list[int]) -> torch.Tensor:
    cache = SequenceCache(model.cache_spec, mtp=True)
    ctx = SimpleContext([cache], [len(ids) - 1], [0])
    hidden = model(torch.tensor(ids[:-1]), torch.arange(len(ids) - 1), ctx)
    return model.mtp.compute_logits(model.mtp(hidden, torch.tensor(ids[1:]), torch.arange(len(ids) - 1), ctx))


def test_merged_outputs_are_views(q4km, monkeypatch):
    _reference_matmul(monkeypatch)
    with single_thread():
        model = load_model(q4km, quantized_weights=True)
        x = torch.randn(3, 256)
        mixed, z, a, b = model.layers[0].mixer.in_proj(x)
        base = mixed.untyped_storage().data_ptr()
        assert all(t.untyped_storage().data_ptr() == base for t in (z, a, b))
        assert mixed.shape == (3, model.cfg.gdn_conv_channels) and a.shape == (3, model.cfg.gdn_value_heads)


def test_model_on_fused_kernels_matches_the_reference_path(tiny_bf16, monkeypatch):
    """The bf16 tiny model with every fused op in the interpreter vs the same model on the references."""
    with single_thread():
        model = load_model(tiny_bf16, dtype=torch.bfloat16)
        ids = [5, 17, 300, 42, 7, 99]

        def run():
            seq = Sequence(SequenceCache(model.cache_spec), ids + [11, 12])
            logits = [model.compute_logits(step(model, [seq], [len(ids)]))[-1]]
            logits += [model.compute_logits(step(model, [seq], [1]))[-1] for _ in range(2)]
            return torch.stack(logits)

        monkeypatch.delenv("NINFER_TRITON_ON_CPU")
        want = run()
        monkeypatch.setenv("NINFER_TRITON_ON_CPU", "1")
        got = run()
    # measured: max |Δlogit| 0.0 to 0.03 (logits up to ~8; bf16 ulps flipped inside the layers), argmax equal
    torch.testing.assert_close(got, want, rtol=0, atol=0.1)
    assert torch.equal(got.argmax(-1), want.argmax(-1))


# ---- launch count of one decode step ---------------------------------------------------------------------

def _gated_norm_stand_in(o, z, w, eps, out_dtype=None, scatter=None, quantize=False, group=32, gather=None):
    gather = None if scatter is None else torch.argsort(scatter)
    return fused.gated_rms_norm_reference(o, z, w, eps, out_dtype, gather)


REFERENCE_FORMS = {"add_rms_norm": fused.add_rms_norm_reference, "rms_norm": reference.rms_norm,
                   "gated_rms_norm": _gated_norm_stand_in, "norm_rotary": fused.norm_rotary_reference,
                   "norm_rotary_pair": lambda q, wq, k, wk, cos, sin, eps: (
                       fused.norm_rotary_reference(q, wq, cos, sin, eps),
                       fused.norm_rotary_reference(k, wk, cos, sin, eps)),
                   "swiglu": reference.swiglu, "sigmoid_gate_mul": fused.sigmoid_gate_mul_reference,
                   "rope_cos_sin": reference.rope_cos_sin}
NOT_LAUNCHES = {torch.ops.aten.empty.memory_format, torch.ops.aten.empty_strided.default,
                torch.ops.aten.empty_like.default, torch.ops.aten.lift_fresh.default}


class LaunchCounter(TorchDispatchMode):
    """Counts ATen ops that launch a kernel on a GPU (views and allocations excluded); calls wrapped with
    `launches(n)` count as n kernels whatever their CPU stand-in does."""

    def __init__(self):
        super().__init__()
        self.count = 0
        self.inside = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.inside and not func.is_view and func not in NOT_LAUNCHES:
            self.count += 1
        return func(*args, **(kwargs or {}))

    def launches(self, n: int, fn):
        @functools.wraps(fn)
        def wrapped(*args, quantize: bool = False, group: int = 32, **kwargs):  # int8 output: same launch
            self.count += n
            self.inside += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self.inside -= 1

        return wrapped


class KernelGdnContext(SimpleContext):
    """GDN through the `gdn_mix` hook, as the engine's GPU contexts run it (conv + recurrent: 2 kernels)."""

    def gdn_mix(self, gdn_layer, mixed, a, b, params):
        from ninfer.kernels.gdn_decode import gdn_decode_reference

        st = self.gdn_state(gdn_layer, 0)
        return gdn_decode_reference(mixed[None], a[None], b[None], params.conv_weight, params.a_log,
                                    params.dt_bias, st.conv[None], st.recurrent[None], torch.tensor([0]),
                                    params.num_key_heads).output[0]


def decode_step_launches(model, fused_kernels: bool, monkeypatch) -> tuple[int, list[int]]:
    """Kernels one decode step of `model` would launch (total, per layer): ATen ops, plus 1 per quantized
    matmul, attention and fused op and 2 per GDN mix; `fused_kernels` routes ops' fused forms to (counted)
    kernels."""
    counter = LaunchCounter()
    per_layer: list[int] = []
    for layer in model.layers:
        layer.register_forward_pre_hook(lambda *_: per_layer.append(-counter.count))
        layer.register_forward_hook(lambda *_: per_layer.append(per_layer.pop() + counter.count))
    cache = SequenceCache(model.cache_spec)
    with monkeypatch.context() as m:
        m.delenv("NINFER_TRITON_ON_CPU", raising=False)
        _reference_matmul(m)
        step(model, [Sequence(cache, [5, 6, 7])], [2])  # some context first
        m.setattr(gguf_matmul, "quant_matmul", counter.launches(1, gguf_matmul.quant_matmul))
        m.setattr(KernelGdnContext, "attention", counter.launches(1, SimpleContext.attention))
        m.setattr(KernelGdnContext, "gdn_mix", counter.launches(2, KernelGdnContext.gdn_mix))
        if fused_kernels:
            m.setattr(fused, "runs_on", lambda t: True)
            for name, reference_form in REFERENCE_FORMS.items():
                m.setattr(fused, name, counter.launches(1, reference_form))
        ctx = KernelGdnContext([cache], [1], [2])
        per_layer.clear()
        with counter:
            model(torch.tensor([7]), torch.tensor([2]), ctx)
    return counter.count, per_layer


def test_decode_step_launch_count(q4km, monkeypatch, capsys):
    with single_thread():
        with merged_projections(False):
            plain = load_model(q4km, dtype=torch.bfloat16, quantized_weights=True, load_mtp=False)
        merged = load_model(q4km, dtype=torch.bfloat16, quantized_weights=True, load_mtp=False)
        before, layers_before = decode_step_launches(plain, False, monkeypatch)
        after, layers_after = decode_step_launches(merged, True, monkeypatch)
    with capsys.disabled():
        print(f"\ndecode step launches: before {before}, per layer {layers_before}; "
              f"after {after}, per layer {layers_after} (layer types {plain.cfg.layer_types})")
    # measured: before 267, per layer [50, 51, 51, 72]; after 71, per layer [10, 10, 11, 10] (layer 2: q|k|v
    # in q6_k apart from z|a|b in q4_k; the attention layer's queries and keys normed in one launch). The
    # rest of a step: the embedding lookup (here the CPU stand-in of the quantized row decode, ~20 ops, the
    # same before and after) and the RoPE tables (5 ops before, one launch after: 75 → 71).
    assert max(layers_after) <= 11 and layers_after[3] <= 10 and sum(layers_after) * 4 < sum(layers_before)


# ---- compiled for the GPU (sm_90) without a GPU: front end + ptxas ---------------------------------------


def compile_for_sm90() -> list[str]:
    """Compile every fused kernel variant, the KV write, paged attention's decode and merge, and the rows
    GEMVs with the GDN conv in their epilogue for sm_90 (run with NINFER_TRITON_COMPILE_CHECK=1); failures."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from ninfer.kernels import gdn_decode, gemv_rows, gemv_rows_iq, gemv_rows_q6k, sampling

    failures = []

    def build(fn, sig, const, warps):
        if "PDL" in fn.arg_names:  # the PDL prologue (pdl_start) on one dtype
            const = {**const, "PDL": 2 if ty == "bf16" else 0}
        try:
            triton.compile(ASTSource(fn, {**sig, **dict.fromkeys(const, "constexpr")}, const),
                           target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
        except Exception as e:  # report every variant
            failures.append(f"{fn.__name__} {const}: {type(e).__name__} {e}")

    for ty in ("bf16", "fp16", "fp32"):
        ints = lambda *names: dict.fromkeys(names, "i32")  # noqa: E731
        int8 = {"q_ptr": "*i8", "d_ptr": "*fp32", "s_ptr": "*fp32"}
        norm = {"x_ptr": f"*{ty}", "r_ptr": f"*{ty}", "w_ptr": "*fp32", "out_ptr": f"*{ty}",
                "res_out_ptr": f"*{ty}", **int8, **ints("N", "H", "sx0", "sx1", "sr0", "sr1", "so0", "so1"),
                **ints("sro0", "sro1"), "eps": "fp32"}
        # QUANT with the residual; a program a group of 256 (decode)
        for res, group, chunk in ((True, 32, 1024), (True, 256, 1024), (True, 256, 256), (False, 32, 8192)):
            flags = {"HAS_RES": res, "HAS_W": True, "ZERO_CENTRED": res, "QUANT": res, "BLOCK": 8192,
                     "CHUNK": chunk, "GROUP": group}
            build(fused._norm_kernel, norm, flags, 16)
        rows = {"o_ptr": "*fp32", "z_ptr": f"*{ty}", "w_ptr": "*fp32", "out_ptr": f"*{ty}",
                "scatter_ptr": "*i64"}
        rest = {**int8, **ints("N", "H", "so0", "so1", "sz0", "sz1"), "eps": "fp32"}
        for scatter in (True, False):  # a head a program; groups of 256 over two heads of 128
            build(fused._gated_norm_kernel, {**rows, **rest}, {"SCATTER": scatter, "QUANT": scatter,
                                                               "BLOCK": 128, "GROUP": 32}, 1)
            build(fused._gated_norm_heads_kernel, {**rows, "gather_ptr": "*i64", **rest},
                  {"SCATTER": scatter, "BLOCK": 128, "HEADS": 2}, fused.GATED_HEADS_WARPS)
        rotary = {"x_ptr": f"*{ty}", "w_ptr": "*fp32", "out_ptr": f"*{ty}", "x2_ptr": f"*{ty}",
                  "w2_ptr": "*fp32", "out2_ptr": f"*{ty}", "cos_ptr": "*fp32", "sin_ptr": "*fp32",
                  **ints("D", "H", "H2", "R", "sx0", "sx1", "sx20", "sx21", "sc0", "ss0"), "eps": "fp32"}
        for has_w in (True, False):
            build(fused._norm_rotary_kernel, rotary, {"HAS_W": has_w, "ZERO_CENTRED": True, "BLOCK": 256}, 1)
        pair = [f"*{ty}", f"*{ty}", f"*{ty}", *int8.values(), "i32", "i32", "i32"]
        swiglu = ["g_ptr", "u_ptr", "out_ptr", *int8, "N", "sg", "su"]
        gate_mul = ["a_ptr", "g_ptr", "out_ptr", *int8, "N", "sa", "sg"]
        for quant, group in ((True, 32), (True, 256), (False, 32)):
            for kernel, names in ((fused._swiglu_kernel, swiglu), (fused._gate_mul_kernel, gate_mul)):
                build(kernel, dict(zip(names, pair, strict=True)), {"QUANT": quant, "BLOCK": 1024,
                                                                      "GROUP": group}, 4)
        for name, code in kv_write.WRITE_CODES.items():  # the KV pool write (kernels.kv_write)
            write = {"k_ptr": f"*{ty}", "v_ptr": f"*{ty}", "kv8_ptr": "*u8", "kv16_ptr": "*i16",
                     "kv32_ptr": "*fp32" if name == "fp32" else "*i16", "page_ptr": "*i64", "off_ptr": "*i64",
                     **ints("H", "sk0", "sk1", "sv0", "sv1")}
            build(kv_write._kv_write_kernel, write,
                  {"D": 256, "TB": kv_quant.kv_format(name, 256).token_bytes, "FMT": code}, 4)
        if ty == "bf16":  # the rope tables; a decode round's addresses (their PDL prologue)
            build(fused._rope_kernel, {"pos_ptr": "*i64", "freq_ptr": "*fp32", "cos_ptr": "*fp32",
                                       "sin_ptr": "*fp32", **ints("F", "s_pos")}, {"BLOCK": 32}, 1)
            rows = dict.fromkeys(("in_ptr", "pages_ptr", "offs_ptr", "slots_ptr"), "*i64")
            build(kv_write._decode_rows_kernel, {**rows, "table_ptr": "*i32", "lanes_ptr": "*i32",
                                                 "lens_ptr": "*i32", **ints("N", "s_table")},
                  {"T": 4, "PAGE": 64, "BLOCK": 32}, 1)
        keys = {"key_ptr": "*i32", "col_ptr": "*i32"}  # the head's cast and argmax, both passes
        build(fused._logits_argmax_kernel, {"x_ptr": f"*{ty}", "out_ptr": "*fp32", **keys,
                                            **ints("N", "V", "sx", "so", "CHUNKS")},
              {"BLOCK": fused.ARGMAX_BLOCK}, 4)
        if ty == "bf16":
            build(fused._argmax_chunks_kernel, {**keys, "ids_ptr": "*i64", "CHUNKS": "i32"},
                  {"BLOCK": 128}, 1)
            # a sampled round's two kernels (kernels.sampling) at the presets' 20 candidates and at MAX_K
            # (the first with the rows' penalties and without)
            for k, chunk, penalties in ((32, 4096, True), (sampling.MAX_K, 8192, False)):
                build(sampling._chunk_top_kernel, {"x_ptr": "*fp32", "cand_ptr": "*i64", "set_ptr": "*fp32",
                                                   "counts_ptr": "*fp32", "seen_ptr": "*u8",
                                                   **ints("V", "sx", "B", "CHUNKS")},
                      {"K": k, "CHUNK": chunk, "PENALTIES": penalties}, 8)
                build(sampling._draw_kernel, {"cand_ptr": "*i64", "set_ptr": "*fp32", "out_ptr": "*i64",
                                              **ints("B", "N")}, {"K": k, "BLOCK": sampling.CANDIDATES}, 16)
        merge = {"acc_ptr": "*fp32", "ml_ptr": "*fp32", "len_ptr": "*i32", "out_ptr": f"*{ty}",
                 "gate_ptr": f"*{ty}", **int8, **ints("Hq", "pages_per_split", "s_gate")}
        for gate, group in ((True, 32), (True, 256), (False, 32)):  # paged attention's merge, the output gate
            build(paged_attention._merge_splits_kernel, merge,
                  {"D": 256, "SPLITS": 16, "BS": 16, "GATE": gate, "QUANT": gate, "GROUP": group}, 4)
        if ty == "bf16":  # paged decode attention's splits; the GDN decode conv in the rows GEMVs' epilogue
            decode = {"q_ptr": f"*{ty}", "kv_ptr": "*u8", "kv16_ptr": "*i16", "pt_ptr": "*i32",
                      "lane_ptr": "*i32", "len_ptr": "*i32", "levels_ptr": "*fp32", "acc_ptr": "*fp32",
                      "ml_ptr": "*fp32", **ints("Hq", "Hkv", "pt_stride", "pages_per_split"), "scale": "fp32"}
            # its pages asked into L2 before the wait (`prefetch.global.L2`) or not
            for name, prefetch in (("int8", False), ("rk4v4", False), ("bf16", True), ("rk4v4", True)):
                fmt = kv_quant.kv_format(name, 256)
                build(paged_attention._paged_decode_kernel, decode,
                      {"FMT": paged_attention.KERNEL_KV_CODES[name], "D": 256, "G": 6, "GPAD": 16,
                       "KB": fmt.key_bytes, "TB": fmt.token_bytes, "SPLITS": 16,
                       "PREFETCH": paged_attention.PREFETCH_BYTES * prefetch}, 4)
            recurrence = {"y_ptr": "*fp32", "a_ptr": f"*{ty}", "b_ptr": f"*{ty}", "alog_ptr": "*fp32",
                          "dtb_ptr": "*fp32", "state_ptr": "*fp32", "slot_ptr": "*i64", "o_ptr": "*fp32",
                          "all_ptr": "*fp32", "pk_ptr": "*fp32", "pd_ptr": "*fp32", "pg_ptr": "*fp32",
                          **ints("C", "Hv", "s_ab", "s_at", "s_ss", "s_sh")}
            # the GDN decode recurrence, its state evict-first in L2 or not, or its write deferred
            for evict, defer in ((0, 0), (1, 0), (0, 1)):
                build(gdn_decode._recurrent_kernel, recurrence,
                      {"T": 1, "HK": 16, "DK": 128, "DV": 128, "BLOCK_V": 16, "STORE_ALL": False,
                       "EVICT": evict, "DEFER": defer}, 1)
            pending = {"pk_ptr": "*fp32", "pd_ptr": "*fp32", "pg_ptr": "*fp32", "state_ptr": "*fp32",
                       "slot_ptr": "*i32", **ints("Hv", "s_ss", "s_sh", "tiles")}
            build(gdn_decode._pending_kernel, pending, {"HK": 16, "DK": 128, "DV": 128, "BLOCK_V": 32}, 4)
            conv = {"cw_ptr": "*fp32", "cs_ptr": "*fp32", "slot_ptr": "*i32", "co_ptr": "*fp32",
                    **ints("C", "s_cs")}
            gemv = {"w_ptr": "*i32", "xw_ptr": "*i32", "xd_ptr": "*fp32", "y_ptr": f"*{ty}",
                    **ints("N", "K", "M")}
            fixup = {"o_ptr": f"*{ty}", "cnt_ptr": "*i32"}
            # the conv epilogue with its operands loaded after the loop or before the wait; split-K's fixup
            for conv_on, early, split in ((True, False, 1), (True, True, 1), (False, False, 2)):
                build(gemv_rows._gemv_rows_kernel, {**gemv, "xs_ptr": "*fp32",
                                                    **ints("row_quads", "stride_ym"), **conv, **fixup},
                      {"FMT": 4, "BLOCK_N": 16, "BLOCK_M": 1, "NB": 4, "R": 2, "SPLIT_K": split, "EVEN": True,
                       "CACHE": 2, "EMULATE": False, "CONV": conv_on, "CONV_EARLY": early,
                       "FIXUP": split > 1}, 4)
                build(gemv_rows_iq._gemv_rows_iq3_kernel, {**gemv, "grid_ptr": "*i16",
                                                           **ints("row_bytes", "stride_ym"), **conv, **fixup},
                      {"BLOCK_N": 4, "BLOCK_M": 1, "NB": 4, "SPLIT_K": split, "EVEN": True, "SIGNED": False,
                       "EMULATE": False, "PADDED": False, "CONV": conv_on, "CONV_EARLY": early,
                       "FIXUP": split > 1}, 1)
            for columns in (1, 4):  # the q6_k output head's rows GEMV
                build(gemv_rows_q6k._gemv_rows_q6k_kernel, {**gemv, **ints("row_bytes", "stride_ym")},
                      {"BLOCK_N": 2, "BLOCK_M": columns, "NB": 4, "SPLIT_K": 1, "EVEN": True,
                       "EMULATE": False}, 1)
    return failures


def test_kernels_compile_for_sm90():
    """Every variant through Triton's front end and ptxas for an H200, in a process where Triton compiles."""
    code = ("import test_fused_ops as t; f = t.compile_for_sm90(); print(*f, sep='\\n'); "
            "raise SystemExit(bool(f))")
    env = {**os.environ, "NINFER_TRITON_COMPILE_CHECK": "1", "TRITON_DEFAULT_FP_FUSION": "1"}
    env.pop("TRITON_INTERPRET", None)
    env.pop("NINFER_TRITON_ON_CPU", None)
    here = Path(__file__).parent
    done = subprocess.run([sys.executable, "-c", code], cwd=here, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

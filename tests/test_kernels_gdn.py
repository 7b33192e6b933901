"""Fused GDN decode kernel (Triton interpreter on CPU) vs transformers' decode ops and our reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import kernels_only, needs_triton
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

import ninfer.kernels.gdn_decode
from ninfer.errors import NinferError
from ninfer.kernels.gdn_decode import gdn_decode, gdn_decode_reference


@pytest.fixture(autouse=True)
def _triton_on_cpu(monkeypatch):
    kernels_only(monkeypatch, ninfer.kernels.gdn_decode, "gdn_decode_reference")


def make_layer(gen, B, T, Hk, Hv, Dk, Dv, slots, state_dtype=torch.float32):
    C = 2 * Hk * Dk + Hv * Dv
    return dict(
        mixed_qkv=torch.randn(B, T, C, generator=gen),
        a=torch.randn(B, T, Hv, generator=gen),
        b=torch.randn(B, T, Hv, generator=gen),
        conv_weight=torch.randn(C, 4, generator=gen) * 0.3,
        a_log=torch.log(torch.rand(Hv, generator=gen) * 15 + 1),
        dt_bias=torch.randn(Hv, generator=gen) * 0.5 - 2.0,
        conv_slots=torch.randn(slots, C, 3, generator=gen),
        state_slots=(torch.randn(slots, Hv, Dk, Dv, generator=gen) * 0.1).to(state_dtype),
    )


def cloned(layer):
    return {k: v.clone() for k, v in layer.items()}


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


@needs_triton
def test_single_step_matches_transformers():
    gen = torch.Generator().manual_seed(11)
    B, Hk, Hv, Dk, Dv = 2, 2, 6, 32, 32
    layer = make_layer(gen, B, 1, Hk, Hv, Dk, Dv, slots=4)
    slot_ids = torch.tensor([2, 0], dtype=torch.int32)
    # transformers' own single-token decode ops on the lanes' slots
    conv = layer["conv_slots"][slot_ids.long()].clone()
    y = hf.causal_conv1d_update(layer["mixed_qkv"].transpose(1, 2).clone(), conv, layer["conv_weight"], None,
                                "silu").transpose(1, 2)
    q, k, v = torch.split(y, [Hk * Dk, Hk * Dk, Hv * Dv], dim=-1)
    g = -layer["a_log"].exp() * F.softplus(layer["a"] + layer["dt_bias"])
    o_hf, s_hf = hf.torch_recurrent_gated_delta_rule(
        q.reshape(B, 1, Hk, Dk), k.reshape(B, 1, Hk, Dk), v.reshape(B, 1, Hv, Dv), g=g,
        beta=layer["b"].sigmoid(), initial_state=layer["state_slots"][slot_ids.long()].clone(),
        output_final_state=True, use_qk_l2norm_in_kernel=True)
    mine = cloned(layer)
    out = gdn_decode(**mine, slot_ids=slot_ids, num_key_heads=Hk)
    # fp32 throughout, summation order differs: measured ~1e-7
    assert rel(out.output, o_hf) < 1e-6
    assert rel(mine["state_slots"][slot_ids.long()], s_hf) < 1e-6
    assert rel(mine["conv_slots"][slot_ids.long()], conv) < 1e-7
    for untouched in (1, 3):
        assert torch.equal(mine["state_slots"][untouched], layer["state_slots"][untouched])
        assert torch.equal(mine["conv_slots"][untouched], layer["conv_slots"][untouched])


@needs_triton
# one lane: 16 value columns a program, else 32; 5 positions: the conv's 8-row tile with 3 rows of padding
@pytest.mark.parametrize("B,T", [(2, 3), (1, 3), (1, 5)])
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.float16])
def test_multi_position_states_match_reference(state_dtype, B, T):
    gen = torch.Generator().manual_seed(12 if state_dtype == torch.float32 else 13)
    Hk, Hv, Dk, Dv = 1, 2, 16, 64  # Dv 64: two or four value slices per head
    layer = make_layer(gen, B, T, Hk, Hv, Dk, Dv, slots=5, state_dtype=state_dtype)
    slot_ids = torch.tensor([4, 1][:B], dtype=torch.int32)
    ref_in, mine = cloned(layer), cloned(layer)
    # a and b as column views of one projection output (as the model hands them): read in place, strided
    ab = torch.cat([mine["a"], torch.randn(B, T, 3, generator=gen), mine["b"]], dim=-1)
    mine["a"], mine["b"] = ab[..., :Hv], ab[..., Hv + 3:]
    ref = gdn_decode_reference(**ref_in, slot_ids=slot_ids, num_key_heads=Hk, return_all_states=True)
    out = gdn_decode(**mine, slot_ids=slot_ids, num_key_heads=Hk, return_all_states=True)
    # fp32: the same operations in another summation order, measured <= 1.8e-7; fp16 slots: both round
    # the states to fp16, order differences flip a few roundings, measured 5.6e-6
    tol = 1e-6 if state_dtype == torch.float32 else 5e-5
    assert rel(out.output, ref.output) < tol
    assert rel(out.states.float(), ref.states.float()) < tol
    assert torch.equal(out.conv_states, ref.conv_states)
    assert rel(mine["state_slots"].float(), ref_in["state_slots"].float()) < tol
    assert torch.equal(mine["conv_slots"], ref_in["conv_slots"])
    # the last per-position state is the committed slot state
    assert torch.equal(out.states[:, -1], mine["state_slots"][slot_ids.long()])


@needs_triton
def test_the_state_read_evict_first_gives_the_same_bits(monkeypatch):
    """NINFER_GDN_STATE_EVICT=1 (`gdn_decode.state_evict`): the recurrence's state read and written with an L2
    hint, the same outputs and slots bit for bit."""
    gen = torch.Generator().manual_seed(14)
    layer = make_layer(gen, 2, 3, 1, 2, 16, 64, slots=5, state_dtype=torch.float32)
    slot_ids = torch.tensor([4, 1], dtype=torch.int32)
    runs = []
    for hint in ("0", "1"):
        monkeypatch.setenv("NINFER_GDN_STATE_EVICT", hint)
        assert ninfer.kernels.gdn_decode.state_evict() == (hint == "1")
        mine = cloned(layer)
        runs.append((gdn_decode(**mine, slot_ids=slot_ids, num_key_heads=1, return_all_states=True), mine))
    (plain, slots), (hinted, hinted_slots) = runs
    assert torch.equal(plain.output, hinted.output) and torch.equal(plain.states, hinted.states)
    assert torch.equal(slots["state_slots"], hinted_slots["state_slots"])


@needs_triton
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("conv_done", [False, True])
@pytest.mark.parametrize("programs", [0, 3])
def test_a_deferred_state_write_gives_the_fused_steps_bits(state_dtype, conv_done, programs):
    """`gdn_decode(defer_state=True)` leaves the slots as they were and the same outputs; `apply_pending`
    (a tile a program, or 3 programs looping over 24 tiles) then writes the fused kernel's slots bit for bit —
    two lanes of two key heads × four value heads (k shared by two value heads), one slot untouched."""
    gen = torch.Generator().manual_seed(23)
    layer = make_layer(gen, 2, 1, 2, 4, 16, 32, slots=4, state_dtype=state_dtype)
    if conv_done:  # the conv's output as the projection's epilogue leaves it
        layer["mixed_qkv"] = torch.nn.functional.silu(layer["mixed_qkv"])
    slot_ids = torch.tensor([3, 0], dtype=torch.int32)
    fused, deferred = cloned(layer), cloned(layer)
    want = gdn_decode(**fused, slot_ids=slot_ids, num_key_heads=2, conv_done=conv_done)
    got = gdn_decode(**deferred, slot_ids=slot_ids, num_key_heads=2, conv_done=conv_done, defer_state=True)
    assert want.pending is None and got.pending is not None
    assert torch.equal(got.output, want.output)
    assert torch.equal(deferred["state_slots"], layer["state_slots"])  # nothing written yet
    assert torch.equal(deferred["conv_slots"], fused["conv_slots"])
    assert not torch.equal(fused["state_slots"][3], layer["state_slots"][3])
    ninfer.kernels.gdn_decode.apply_pending(got.pending, programs=programs)
    assert torch.equal(deferred["state_slots"], fused["state_slots"])
    assert torch.equal(deferred["state_slots"][1], layer["state_slots"][1])


def test_a_deferred_state_write_takes_one_position():
    gen = torch.Generator().manual_seed(24)
    layer = make_layer(gen, 1, 2, 1, 2, 16, 32, slots=2)
    with pytest.raises(NinferError, match="one position a lane"):
        gdn_decode(**layer, slot_ids=torch.tensor([1], dtype=torch.int32), num_key_heads=1, defer_state=True)


def test_wrong_geometry_is_a_user_error():
    gen = torch.Generator().manual_seed(1)
    layer = make_layer(gen, 1, 1, 2, 4, 16, 16, slots=2)
    with pytest.raises(NinferError, match="key heads"):
        gdn_decode(**layer, slot_ids=torch.tensor([0], dtype=torch.int32), num_key_heads=3)


@needs_triton
@pytest.mark.parametrize(("L", "Hk", "Hv", "D"),
                         [(1, 2, 4, 32), (2, 1, 2, 16), (5, 2, 4, 32), (70, 2, 6, 16)])
def test_prefill_qkv_kernel_matches_its_reference(monkeypatch, L, Hk, Hv, D):
    """`gdn_prefill.prefill_qkv` (interpreter): the conv's taps from the chunk and from the slot (chunks
    shorter than the three cached inputs among them), SiLU, q / k L2-normalised (q scaled), v as is,
    position blocks cut at PREP_BLOCK_T; the slot moved on to the chunk's last inputs."""
    import ninfer.kernels.gdn_prefill as prefill

    reference = kernels_only(monkeypatch, prefill, "prefill_qkv_reference")
    gen = torch.Generator().manual_seed(L * 100 + D)
    C = (2 * Hk + Hv) * D
    x = torch.randn(L, C, generator=gen)
    w = torch.randn(C, 4, generator=gen) * 0.5
    slot = torch.randn(C, 3, generator=gen)
    mine_slot, ref_slot = slot.clone(), slot.clone()
    got = prefill.prefill_qkv(x, w, mine_slot, Hk, D, Hv, D)
    want = reference(x, w, ref_slot, Hk, D, Hv, D)
    for g, r, name in zip(got, want, "qkv", strict=True):
        assert g.shape == r.shape and g.dtype == r.dtype, name
        assert rel(g, r) < 1e-6, (name, rel(g, r))  # fp32 both ways: 1e-7 measured
    assert torch.equal(mine_slot, ref_slot)
    assert not torch.equal(mine_slot, slot)


@pytest.mark.gpu
def test_prefill_qkv_kernel_on_gpu():
    """The 27B's head geometry (16 key heads, 48 value heads of 128) at chunk lengths across the position
    blocks, bf16 as the engine runs it: outputs within one bf16 rounding of the PyTorch ops, the same slot."""
    import ninfer.kernels.gdn_prefill as prefill

    gen = torch.Generator(device="cuda").manual_seed(5)
    Hk, Hv, D = 16, 48, 128
    C = (2 * Hk + Hv) * D
    w = torch.randn(C, 4, generator=gen, device="cuda") * 0.5
    for L in (17, 512, 2048):
        x = torch.randn(L, C, generator=gen, device="cuda").to(torch.bfloat16)
        slot = torch.randn(C, 3, generator=gen, device="cuda")
        mine_slot, ref_slot = slot.clone(), slot.clone()
        got = prefill.prefill_qkv(x, w, mine_slot, Hk, D, Hv, D)
        want = prefill.prefill_qkv_reference(x, w, ref_slot, Hk, D, Hv, D)
        for g, r, name in zip(got, want, "qkv", strict=True):
            assert g.dtype == r.dtype == torch.bfloat16 and g.shape == r.shape
            assert rel(g, r) < 2e-3, (L, name, rel(g, r))  # fp32 sums in another order, then bf16 (2^-9)
        assert torch.equal(mine_slot, ref_slot), L


@needs_triton
@pytest.mark.parametrize(("L", "Hv"), [(3, 4), (70, 6)])
def test_prefill_gates_kernel_matches_its_reference(monkeypatch, L, Hv):
    """`gdn_prefill.prefill_gates` (interpreter): the decay (softplus past its threshold among the inputs) and
    β from column views of one projection, position blocks cut at PREP_BLOCK_T."""
    import ninfer.kernels.gdn_prefill as prefill

    reference = kernels_only(monkeypatch, prefill, "prefill_gates_reference")
    gen = torch.Generator().manual_seed(L + Hv)
    ab = torch.randn(L, 2 * Hv + 3, generator=gen) * 8  # some a + dt_bias past 20
    a, b = ab[:, 1:1 + Hv], ab[:, 1 + Hv:1 + 2 * Hv]
    a_log, dt_bias = torch.randn(Hv, generator=gen), torch.randn(Hv, generator=gen) * 8
    got, want = prefill.prefill_gates(a, b, a_log, dt_bias), reference(a, b, a_log, dt_bias)
    for g, r in zip(got, want, strict=True):
        assert g.shape == r.shape == (L, Hv) and g.dtype == torch.float32
        assert rel(g, r) < 1e-6, rel(g, r)


@pytest.mark.gpu
def test_prefill_gates_kernel_on_gpu():
    """The 27B's 48 value heads over a 2048-token chunk, a and b bf16 column views of one projection."""
    import ninfer.kernels.gdn_prefill as prefill

    gen = torch.Generator(device="cuda").manual_seed(6)
    ab = (torch.randn(2048, 100, generator=gen, device="cuda") * 8).to(torch.bfloat16)
    a, b = ab[:, :48], ab[:, 48:96]
    a_log = torch.randn(48, generator=gen, device="cuda")
    dt_bias = torch.randn(48, generator=gen, device="cuda") * 8
    got = prefill.prefill_gates(a, b, a_log, dt_bias)
    want = prefill.prefill_gates_reference(a, b, a_log, dt_bias)
    for g, r in zip(got, want, strict=True):
        assert rel(g, r) < 1e-6, rel(g, r)  # fp32 both ways (exp, log against softplus's log1p)

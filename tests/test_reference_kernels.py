"""The plain-PyTorch reference kernels against transformers' Qwen3.5 functions and torch built-ins.

Every input is fresh random data; tolerances are fp32 rounding (measured max errors are ~1e-6 relative).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf
from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig

from ninfer.kernels import reference as ref


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _gdn_inputs(T, Hk, Hv, Dk, Dv, seed):
    g = _gen(seed)
    q = torch.randn(T, Hk, Dk, generator=g)
    k = torch.randn(T, Hk, Dk, generator=g)
    v = torch.randn(T, Hv, Dv, generator=g)
    # realistic decays: g = -exp(A_log)·softplus(a + dt_bias), mostly small, some strong
    gate = -torch.rand(T, Hv, generator=g) * 2.0
    beta = torch.sigmoid(torch.randn(T, Hv, generator=g))
    state = torch.randn(Hv, Dk, Dv, generator=g) * 0.5
    return q, k, v, gate, beta, state


def _normed(q, k):
    qn = ref.l2_norm(q) / q.shape[-1] ** 0.5
    return qn, ref.l2_norm(k)


@pytest.mark.parametrize(
    "T,Hk,Hv,Dk,Dv,chunk",
    [(1, 2, 6, 16, 16, 64), (5, 1, 1, 8, 12, 64), (64, 2, 6, 32, 32, 64), (130, 2, 4, 16, 24, 64),
     (47, 3, 3, 16, 8, 16)],
)
def test_gdn_chunked_equals_recurrent(T, Hk, Hv, Dk, Dv, chunk):
    q, k, v, g, beta, state = _gdn_inputs(T, Hk, Hv, Dk, Dv, seed=T * 7 + Hv)
    qn, kn = _normed(q, k)
    o_r, s_r = ref.gdn_recurrent(qn, kn, v, g, beta, state)
    o_c, s_c = ref.gdn_chunked(qn, kn, v, g, beta, state, chunk_size=chunk)
    assert o_r.shape == (T, Hv, Dv) and s_r.shape == (Hv, Dk, Dv)
    torch.testing.assert_close(o_c, o_r, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(s_c, s_r, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("T,Hk,Hv,Dk,Dv", [(3, 2, 6, 16, 16), (70, 2, 4, 32, 16)])
def test_gdn_matches_transformers(T, Hk, Hv, Dk, Dv):
    q, k, v, g, beta, state = _gdn_inputs(T, Hk, Hv, Dk, Dv, seed=100 + T)
    qn, kn = _normed(q, k)
    o_ours, s_ours = ref.gdn_recurrent(qn, kn, v, g, beta, state)
    o_cm, s_cm = ref.gdn_chunked(qn, kn, v, g, beta, state)
    args = dict(initial_state=state[None], output_final_state=True, use_qk_l2norm_in_kernel=True)
    o_hf, s_hf = hf.torch_recurrent_gated_delta_rule(q[None], k[None], v[None], g[None], beta[None], **args)
    torch.testing.assert_close(o_ours, o_hf[0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(s_ours, s_hf[0], rtol=1e-4, atol=1e-4)
    o_hfc, s_hfc = hf.torch_chunk_gated_delta_rule(q[None], k[None], v[None], g[None], beta[None], **args)
    torch.testing.assert_close(o_cm, o_hfc[0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(s_cm, s_hfc[0], rtol=1e-4, atol=1e-4)


def test_gdn_split_sequence_continues_state():
    q, k, v, g, beta, state = _gdn_inputs(40, 2, 6, 16, 16, seed=3)
    qn, kn = _normed(q, k)
    o_all, s_all = ref.gdn_chunked(qn, kn, v, g, beta, state)
    o1, s1 = ref.gdn_chunked(qn[:17], kn[:17], v[:17], g[:17], beta[:17], state)
    o2, s2 = ref.gdn_recurrent(qn[17:], kn[17:], v[17:], g[17:], beta[17:], s1)
    torch.testing.assert_close(torch.cat([o1, o2]), o_all, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(s2, s_all, rtol=1e-4, atol=1e-4)
    # per-position states: the last equals the final state, each one continues the recurrence
    o3, states = ref.gdn_recurrent(qn, kn, v, g, beta, state, return_all_states=True)
    assert states.shape == (40, 6, 16, 16)
    torch.testing.assert_close(states[-1], s_all, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(states[16], s1, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(o3, o_all, rtol=1e-4, atol=1e-4)


def test_gdn_does_not_modify_input_state():
    q, k, v, g, beta, state = _gdn_inputs(9, 1, 2, 8, 8, seed=5)
    before = state.clone()
    ref.gdn_recurrent(q, k, v, g, beta, state)
    ref.gdn_chunked(q, k, v, g, beta, state)
    assert torch.equal(state, before)


@pytest.mark.parametrize("zero_centred", [True, False])
def test_rms_norm(zero_centred):
    g = _gen(11)
    x = torch.randn(7, 3, 64, generator=g) * 3
    w = torch.randn(64, generator=g) * 0.1
    if zero_centred:
        mod = hf.Qwen3_5RMSNorm(64, eps=1e-6)
        mod.weight.data.copy_(w)
        expected = mod(x)
    else:
        expected = F.rms_norm(x, (64,), w, eps=1e-6)
    torch.testing.assert_close(ref.rms_norm(x, w, 1e-6, zero_centred), expected, rtol=1e-5, atol=1e-5)


def test_gated_rms_norm_and_swiglu():
    g = _gen(12)
    o, z = torch.randn(9, 128, generator=g), torch.randn(9, 128, generator=g)
    w = 1 + 0.1 * torch.randn(128, generator=g)
    mod = hf.Qwen3_5RMSNormGated(128, eps=1e-6)
    mod.weight.data.copy_(w)
    torch.testing.assert_close(ref.gated_rms_norm(o, z, w, 1e-6), mod(o, z), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ref.swiglu(o, z), F.silu(o) * z)


def _hf_rotary(head_dim=128, sections=(6, 5, 5)):
    cfg = Qwen3_5TextConfig(
        head_dim=head_dim, hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
        rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                         "mrope_section": list(sections), "mrope_interleaved": True},
    )
    return hf.Qwen3_5TextRotaryEmbedding(cfg)


def test_mrope_matches_transformers_text_and_3d():
    rotary = _hf_rotary()
    g = _gen(13)
    pos3 = torch.randint(0, 5000, (3, 11), generator=g)
    x = torch.zeros(1, 11, 8)
    cos_hf, sin_hf = rotary(x, pos3[:, None, :])
    cos, sin = ref.mrope_cos_sin(pos3, rotary_dim=32, theta=1e7, sections=[6, 5, 5], interleaved=True)
    torch.testing.assert_close(cos, cos_hf[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(sin, sin_hf[0], rtol=1e-5, atol=1e-5)
    # text tokens: [T] positions equal the same position on all three axes
    pos = torch.arange(100, 111)
    c1, s1 = ref.mrope_cos_sin(pos, 32, 1e7, [6, 5, 5], True)
    c3, s3 = ref.mrope_cos_sin(pos.expand(3, -1), 32, 1e7, [6, 5, 5], True)
    torch.testing.assert_close(c1, c3)
    torch.testing.assert_close(s1, s3)


def test_mrope_contiguous_sections():
    pos3 = torch.stack([torch.arange(6), torch.arange(6) * 10, torch.arange(6) * 100])
    cos, _ = ref.mrope_cos_sin(pos3, rotary_dim=8, theta=10.0, sections=[1, 2, 1], interleaved=False)
    inv = ref.rope_inv_freq(8, 10.0)
    expected = torch.stack([pos3[0] * inv[0], pos3[1] * inv[1], pos3[1] * inv[2], pos3[2] * inv[3]], -1)
    torch.testing.assert_close(cos, torch.cat([expected, expected], -1).cos())


def test_apply_rotary_partial_matches_transformers():
    g = _gen(14)
    q = torch.randn(11, 4, 128, generator=g)
    k = torch.randn(11, 2, 128, generator=g)
    pos = torch.randint(0, 300, (11,), generator=g)
    cos, sin = ref.mrope_cos_sin(pos, 32, 1e7, [6, 5, 5], True)
    q_hf, k_hf = hf.apply_rotary_pos_emb(q[None], k[None], cos[None], sin[None], unsqueeze_dim=2)
    torch.testing.assert_close(ref.apply_rotary(q, cos, sin), q_hf[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ref.apply_rotary(k, cos, sin), k_hf[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("T,C,K", [(1, 8, 4), (3, 16, 4), (33, 40, 4), (9, 6, 2)])
def test_causal_conv1d_matches_torch_and_continues(T, C, K):
    g = _gen(15 + T)
    x = torch.randn(T, C, generator=g)
    w = torch.randn(C, K, generator=g)
    zero = torch.zeros(C, K - 1)
    y, state = ref.causal_conv1d(x, w, zero, silu=True)
    expected = F.silu(F.conv1d(x.t()[None], w[:, None, :], padding=K - 1, groups=C)[0, :, :T].t())
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5)
    hist = torch.cat([zero, x.t()], dim=1)
    torch.testing.assert_close(state, hist[:, -(K - 1):])
    # continuing token by token from the state equals the one-shot result
    s = zero
    ys = []
    for t in range(T):
        yt, s = ref.causal_conv1d(x[t : t + 1], w, s, silu=False)
        ys.append(yt)
    y_plain, _ = ref.causal_conv1d(x, w, zero, silu=False)
    torch.testing.assert_close(torch.cat(ys), y_plain, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(s, state)


@pytest.mark.parametrize("Tq,Tk,Hq,Hkv,D", [(5, 5, 4, 2, 32), (1, 9, 4, 1, 16), (4, 12, 6, 6, 8)])
def test_attention_reference_matches_sdpa(Tq, Tk, Hq, Hkv, D):
    g = _gen(16 + Tk)
    q = torch.randn(Tq, Hq, D, generator=g)
    k = torch.randn(Tk, Hkv, D, generator=g)
    v = torch.randn(Tk, Hkv, D, generator=g)
    offset = Tk - Tq
    out = ref.attention_reference(q, k, v, causal_offset=offset)
    mask = torch.arange(Tk)[None, :] <= (torch.arange(Tq)[:, None] + offset)
    expected = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], attn_mask=mask,
        enable_gqa=True,
    )[0].transpose(0, 1)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)

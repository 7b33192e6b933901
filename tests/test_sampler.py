"""Sampler: each filter and penalty against a direct computation, seeded reproducibility, distribution."""

from __future__ import annotations

import torch

from ninfer.engine.api import SamplingParams
from ninfer.engine.sampler import SamplerState, apply_penalties, filter_probs, sample_token, stop_reason


def state(prompt: tuple[int, ...] = (), **kw) -> SamplerState:
    return SamplerState(SamplingParams(**kw), prompt_ids=prompt)


def fresh_logits(n: int = 50, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed)) * 2


def test_greedy_is_argmax_and_temperature_zero_is_greedy():
    x = fresh_logits()
    assert sample_token(x, state(temperature=0.0)) == int(x.argmax())
    assert sample_token(x, state(top_k=1, seed=5)) == int(x.argmax())


def test_top_k_keeps_exactly_k_tokens_renormalised():
    x = fresh_logits()
    p = filter_probs(x, SamplingParams(top_k=5))
    top5 = torch.topk(x, 5).indices
    assert set(p.nonzero().flatten().tolist()) == set(top5.tolist())
    ref = torch.softmax(x[top5], 0)
    assert torch.allclose(p[top5], ref, atol=1e-6)


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    x = fresh_logits(seed=1)
    full = torch.softmax(x, 0)
    sp, order = torch.sort(full, descending=True)
    need = int((torch.cumsum(sp, 0) < 0.7).sum()) + 1
    p = filter_probs(x, SamplingParams(top_p=0.7))
    assert set(p.nonzero().flatten().tolist()) == set(order[:need].tolist())
    assert abs(p.sum().item() - 1) < 1e-6


def test_min_p_drops_tokens_below_fraction_of_max():
    x = fresh_logits(seed=2)
    full = torch.softmax(x, 0)
    p = filter_probs(x, SamplingParams(min_p=0.1))
    kept = (full >= 0.1 * full.max()).nonzero().flatten().tolist()
    assert set(p.nonzero().flatten().tolist()) == set(kept)


def test_temperature_scales_logits():
    x = fresh_logits(seed=3)
    expected = torch.softmax(x / 0.5, 0)
    assert torch.allclose(filter_probs(x, SamplingParams(temperature=0.5)), expected, atol=1e-6)


def test_presence_frequency_and_repetition_penalties():
    x = torch.tensor([2.0, -1.0, 0.5, 3.0])
    st = state(presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=2.0, prompt=(1,))
    for t in (0, 0, 3):
        st.record(t)
    out = apply_penalties(x.clone(), st)
    # repetition (HF): positive / 2, negative * 2 on prompt+output ids {0, 1, 3};
    # then OpenAI presence/frequency on output ids only
    assert torch.allclose(out, torch.tensor([1.0 - 0.5 - 0.5, -2.0, 0.5, 1.5 - 0.5 - 0.25]))


def test_same_seed_same_tokens_different_seed_differs():
    x = fresh_logits(200, seed=4)

    def run(seed):
        st = state(temperature=1.0, seed=seed)
        return [sample_token(x, st) for _ in range(30)]

    assert run(7) == run(7)
    assert run(7) != run(8)


def test_samples_follow_the_filtered_distribution():
    x = fresh_logits(8, seed=5)
    params = SamplingParams(temperature=0.8, top_k=4, seed=11)
    st = SamplerState(params, ())
    counts = torch.bincount(torch.tensor([sample_token(x, st) for _ in range(4000)]), minlength=8).float()
    expected = filter_probs(x, params) * 4000
    assert (counts[expected == 0] == 0).all()
    # chi-square-ish bound: each kept bucket within 5 sigma
    kept = expected > 0
    sigma = expected[kept].sqrt()
    assert ((counts[kept] - expected[kept]).abs() < 5 * sigma + 5).all()


def test_stop_reasons():
    p = SamplingParams(max_tokens=3, stop_token_ids=(9,))
    eos = frozenset({2})
    assert stop_reason(2, 1, p, eos) == "stop"
    assert stop_reason(9, 1, p, eos) == "stop"
    assert stop_reason(5, 3, p, eos) == "length"
    assert stop_reason(5, 2, p, eos) is None
    assert stop_reason(2, 1, SamplingParams(ignore_eos=True), eos) is None

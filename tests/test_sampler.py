"""Sampler: each filter and penalty against a direct computation, seeded reproducibility, distribution; the
batched sampler (`sample_rows`) against the single-row reference and the float64 distribution."""

from __future__ import annotations

import functools

import pytest
import torch
from conftest import needs_triton

from ninfer.engine.api import SamplingParams
from ninfer.engine.sampler import (
    SamplerState,
    _penalised,
    apply_penalties,
    filter_probs,
    sample_rows,
    sample_token,
    stop_reason,
)
from ninfer.kernels import sampling
from ninfer.kernels.sampling import draw_top_k


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


# one request of each kind the server sends: the presets (thinking, non-thinking with its presence penalty),
# greedy with and without penalties, every filter, no top_k (the whole vocabulary sorted)
MIXED = (
    dict(temperature=1.0, top_p=0.95, top_k=20),
    dict(temperature=0.7, top_p=0.8, top_k=20, presence_penalty=1.5),
    dict(temperature=0.0),
    dict(temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.4),
    dict(temperature=1.3, top_p=0.9),
    dict(temperature=0.8, min_p=0.05, top_k=50, repetition_penalty=1.2),
    dict(temperature=1.0),
)
# rows the two kernels take (`sampling.draw_top_k`): each bounded by its top_k (≤ sampling.MAX_K) or greedy
BOUNDED = (*MIXED[:4], MIXED[5], dict(temperature=1.5, top_k=3, frequency_penalty=0.5))


def mixed_states(seed: int, vocab: int, kinds: tuple[dict, ...] = MIXED, prompt: int = 12,
                 outputs: int = 9) -> list[SamplerState]:
    """Requests of `kinds` with seeds, prompts and earlier output tokens (some repeated) of their own."""
    g = torch.Generator().manual_seed(seed)
    states = []
    for i, kw in enumerate(kinds):
        st = SamplerState(SamplingParams(seed=seed * 10 + i, **kw),
                          tuple(torch.randint(0, vocab, (prompt,), generator=g).tolist()))
        for t in torch.randint(0, vocab // 4, (outputs,), generator=g).tolist():
            st.record(t)
        states.append(st)
    return states


def test_rows_penalties_are_the_reference_arithmetic():
    """Bit for bit `apply_penalties`, also after more tokens are recorded (repeats and new ones: the rows'
    device counts kept in step), never in place."""
    states = mixed_states(1, 300)
    g = torch.Generator().manual_seed(2)
    for _ in range(3):
        x = torch.randn(len(states), 300, generator=g) * 3
        expected = torch.stack([apply_penalties(row.clone(), st) for row, st in zip(x, states, strict=True)])
        out = _penalised(x, states)
        assert torch.equal(out, expected)
        assert not torch.equal(out, x)
        for st, t in zip(states, torch.randint(0, 150, (len(states),), generator=g).tolist(), strict=True):
            st.record(t)
            st.record(t % 75)


def assert_rounds_draw_the_references_tokens(batch: list[SamplerState], alone: list[SamplerState], vocab: int,
                                             rounds: int, seed: int) -> None:
    """Same logits, same seeds: `sample_rows` over the batch = `sample_token` row by row for each round
    (each row's generator consumed in the same order), each token then recorded in both for the penalties."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(rounds):
        x = torch.randn(len(batch), vocab, generator=g) * 2.5
        tokens = sample_rows(x, batch).tolist()
        assert tokens == [sample_token(row, st) for row, st in zip(x, alone, strict=True)]
        for t, a, b in zip(tokens, batch, alone, strict=True):
            a.record(t)
            b.record(t)


@pytest.mark.parametrize("seed", [3, 4, 5])
def test_rows_draw_the_single_row_references_tokens(seed):
    assert_rounds_draw_the_references_tokens(mixed_states(seed, 400), mixed_states(seed, 400), 400, 6, seed)


def test_rows_pick_the_token_whose_interval_holds_the_draw():
    """Against float64: the filtered distribution in descending order, its cumulative mass; each sampled
    row's token is the one whose interval holds the row's uniform number; greedy rows the penalised argmax."""
    vocab = 500
    states, twins = mixed_states(6, vocab), mixed_states(6, vocab)
    x = torch.randn(len(states), vocab, generator=torch.Generator().manual_seed(7)) * 2
    tokens = sample_rows(x, states).tolist()
    for row, st, token in zip(x, twins, tokens, strict=True):
        logits = apply_penalties(row.double().clone(), st)
        if st.params.greedy:
            assert token == int(logits.argmax())
            continue
        probs, order = torch.sort(filter_probs(logits, st.params), descending=True)
        cdf = probs.cumsum(0)
        j = order.tolist().index(token)
        u = st.uniform()
        assert probs[j] > 0
        assert (cdf[j - 1] if j else 0.0) - 1e-6 <= u <= cdf[j] + 1e-6


def test_rows_follow_the_filtered_distribution():
    x = fresh_logits(8, seed=8)
    params = (SamplingParams(temperature=0.8, top_k=4, seed=11), SamplingParams(top_p=0.7, seed=12))
    states = [SamplerState(p, ()) for p in params]
    draws = torch.stack([sample_rows(torch.stack([x, x]), states) for _ in range(4000)])
    for col, p in enumerate(params):
        counts = torch.bincount(draws[:, col], minlength=8).float()
        expected = filter_probs(x, p) * 4000
        assert (counts[expected == 0] == 0).all()
        kept = expected > 0
        assert ((counts[kept] - expected[kept]).abs() < 5 * expected[kept].sqrt() + 5).all()


@pytest.mark.gpu
@pytest.mark.parametrize("kinds", [MIXED, BOUNDED], ids=["pytorch", "kernels"])
def test_rows_on_the_gpu_draw_the_cpus_tokens(kinds):
    """The server's batches on the device (rows without a top_k: PyTorch's ops; all bounded: the two
    kernels): the CPU's tokens for the same logits and seeds — or, where two logits of a row are equal
    (248,320 normal floats hold a few hundred ties) and the two sorts ordered them apart, a token of the same
    logit."""
    vocab = 248_320  # the 27B's head: the whole-vocabulary sort and the top-20 of each row
    g = torch.Generator().manual_seed(9)
    on_cpu, on_gpu = mixed_states(9, vocab, kinds), mixed_states(9, vocab, kinds)
    for _ in range(4):
        x = torch.randn(len(on_cpu), vocab, generator=g) * 3
        tokens = sample_rows(x, on_cpu)
        got = sample_rows(x.cuda(), on_gpu).cpu()
        rows = torch.arange(len(on_cpu))
        assert torch.equal(_penalised(x, on_cpu)[rows, got], _penalised(x, on_cpu)[rows, tokens])
        assert (got == tokens).float().mean() > 0.8
        for t, a, b in zip(tokens.tolist(), on_cpu, on_gpu, strict=True):
            a.record(t)
            b.record(t)



@needs_triton
@pytest.mark.parametrize("chunk", [64, None])  # 64: five chunks a row, the candidates merged across them
def test_kernels_draw_the_single_row_references_tokens(triton_on_cpu_env, monkeypatch, chunk):
    """`sample_rows` through its two kernels (Triton's interpreter) over rows with a top_k and greedy rows,
    four of six with penalties (applied by the first kernel): `sample_token`'s tokens row by row for several
    rounds, each token then recorded for the penalties."""
    calls = []

    def draw(x, settings, k, penalties=None):
        calls.append((k, len(penalties[0])))
        return draw_top_k(x, settings, k, chunk=chunk, penalties=penalties)
    monkeypatch.setattr(sampling, "draw_top_k", draw)
    batch, alone = mixed_states(13, 300, BOUNDED), mixed_states(13, 300, BOUNDED)
    assert_rounds_draw_the_references_tokens(batch, alone, 300, rounds=4, seed=13)
    assert calls == [(50, 4)] * 4


@needs_triton
def test_kernels_penalise_as_the_reference(triton_on_cpu_env, monkeypatch):
    """Each penalty alone and together on greedy rows whose prompts and outputs hold a third of the
    vocabulary (so the penalised ids often decide the argmax), beside a sampled row that sends the round to
    the kernels: `sample_token`'s tokens over rounds."""
    monkeypatch.setattr(sampling, "draw_top_k", functools.partial(draw_top_k, chunk=64))
    kinds = (dict(temperature=0.0, repetition_penalty=1.5), dict(temperature=0.0, repetition_penalty=0.7),
             dict(temperature=0.0, presence_penalty=1.0), dict(temperature=0.0, frequency_penalty=0.7),
             dict(temperature=0.0, repetition_penalty=1.2, presence_penalty=0.5, frequency_penalty=0.3),
             dict(temperature=0.9, top_k=8, presence_penalty=2.0))
    batch, alone = (mixed_states(17, 300, kinds, prompt=100, outputs=160) for _ in range(2))
    assert_rounds_draw_the_references_tokens(batch, alone, 300, rounds=12, seed=17)


@needs_triton
def test_kernels_take_the_first_of_equal_logits(triton_on_cpu_env):
    """A greedy row's token is its first column of the largest logit, as `argmax` (ties across chunks and
    inside one); a top-2 row at a tiny temperature draws between its two equal best with its number."""
    x = torch.randn(4, 320, generator=torch.Generator().manual_seed(14))
    x[0, [250, 40, 200]] = 9.0  # chunks 3, 0, 3 of 64 columns
    x[1, [71, 70]] = 9.0
    x[[2, 3], 100] = x[[2, 3], 300] = 9.0
    settings = torch.tensor([[1, 1, 2, 2], [1, 1, 0.01, 0.01], [2] * 4, [0] * 4, [0, 0, 0.25, 0.75]])
    assert draw_top_k(x, settings, 2, chunk=64).tolist() == [40, 70, 100, 300]


def test_kernels_leave_unbounded_rows_to_pytorch(triton_on_cpu_env, monkeypatch):
    """Rows without a top_k (the whole vocabulary) or with more than MAX_K candidates: not the kernels'."""
    def draw(*args):
        raise AssertionError("the kernels took rows they cannot")
    monkeypatch.setattr(sampling, "draw_top_k", draw)
    x = torch.randn(2, 200, generator=torch.Generator().manual_seed(15))
    for kw in (dict(temperature=0.9, top_p=0.9), dict(temperature=0.9, top_k=sampling.MAX_K + 1)):
        states = [SamplerState(SamplingParams(seed=1, **kw), ()), state(temperature=0.0)]
        assert sample_rows(x, states).shape == (2,)
    assert not sampling.takes(x[:, :sampling.MAX_K], sampling.MAX_K)  # k must be below the vocabulary


@needs_triton
def test_kernels_pick_the_token_whose_interval_holds_the_number(triton_on_cpu_env):
    """Against float64 (`filter_probs`): rows of each filter at numbers across [0, 1) draw the token whose
    interval of the filtered distribution, in descending order, holds the number."""
    x = torch.randn(200, generator=torch.Generator().manual_seed(16)) * 2
    filters = (dict(temperature=0.6, top_k=30), dict(temperature=1.0, top_k=30, top_p=0.7),
               dict(temperature=1.2, top_k=30, min_p=0.1),
               dict(temperature=0.9, top_k=5, top_p=0.9, min_p=0.2))
    numbers = (0.02, 0.3, 0.55, 0.8, 0.97, 0.999)
    settings = torch.tensor([[kw["top_k"], kw["temperature"], kw.get("top_p", 2.0), kw.get("min_p", 0.0), u]
                             for kw in filters for u in numbers]).T.contiguous()
    # (and below zero: the second kernel reads the candidates' logits back from their keys)
    for shift in (0.0, -20.0):
        tokens = draw_top_k(x.expand(settings.shape[1], -1) + shift, settings, 30).tolist()
        for i, kw in enumerate(filters):
            probs, order = torch.sort(filter_probs(x.double(), SamplingParams(**kw)), descending=True)
            cdf = probs.cumsum(0)
            for u, token in zip(numbers, tokens[i * len(numbers):], strict=False):
                j = order.tolist().index(token)
                assert probs[j] > 0
                assert (cdf[j - 1] if j else 0.0) - 1e-6 <= u <= cdf[j] + 1e-6

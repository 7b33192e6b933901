"""Token sampling: penalties, temperature, top-k, top-p, min-p, seeded draws, stop conditions.

Order (as vLLM/HF): repetition penalty (prompt + output, HF style), presence/frequency penalties (output
tokens, OpenAI style), then greedy argmax or temperature → top-k → top-p → min-p → one draw. The draw is an
inverse-CDF pick over the kept tokens in descending probability with one uniform number from the request's
own generator (on the host), so a seeded request gives the same tokens whatever else shares its batch.
`sample_token` is the single-row reference; `sample_rows` does the same for a batch where the logits are (on
CUDA: on the device, only the token ids cross to the host; rows of at most `sampling.MAX_K` candidates in two
kernel launches, `ninfer.kernels.sampling`).
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ninfer.engine.api import FinishReason, SamplingParams
from ninfer.kernels import sampling


@dataclass
class SamplerState:
    """Per-request sampler memory: its generator and the token counts penalties need."""

    params: SamplingParams
    prompt_ids: tuple[int, ...]
    generator: torch.Generator = field(init=False)
    output_counts: Counter = field(default_factory=Counter)
    # (device, vocab) -> `dense`'s tensors, kept in step by `record`
    _dense: dict = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        seed = self.params.seed if self.params.seed is not None else random.getrandbits(63)
        self.generator = torch.Generator().manual_seed(seed)

    @property
    def penalises(self) -> bool:
        p = self.params
        return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0

    def record(self, token: int) -> None:
        self.output_counts[token] += 1
        for counts, _ in self._dense.values():
            if token < counts.numel():
                counts[token] += 1

    def uniform(self) -> float:
        """The next draw's number in [0, 1) from the request's generator."""
        return float(torch.rand((), generator=self.generator))

    def dense(self, device: torch.device, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 `[vocab]` output counts and a bool `[vocab]` mask of the prompt's ids, on `device`: made once
        (from the counts so far), then `record` adds each token — the penalties cost a round the same
        whatever the output's length (the ids rebuilt on the host each round took 6 ms at 8K tokens)."""
        tensors = self._dense.get((device, vocab))
        if tensors is None:  # (ids past the vocabulary can never be drawn: nothing to penalise)
            ids = [t for t in self.output_counts if t < vocab]
            counts = torch.zeros(vocab, dtype=torch.float32)
            counts[ids] = torch.tensor([self.output_counts[t] for t in ids], dtype=torch.float32)
            prompt = torch.zeros(vocab, dtype=torch.bool)
            prompt[[t for t in self.prompt_ids if t < vocab]] = True
            tensors = self._dense[device, vocab] = (to_device(counts, device), to_device(prompt, device))
        return tensors


def apply_penalties(logits: torch.Tensor, state: SamplerState) -> torch.Tensor:
    p = state.params
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(state.prompt_ids) | set(state.output_counts)), dtype=torch.long)
        if seen.numel():
            vals = logits[seen]
            logits[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if (p.presence_penalty or p.frequency_penalty) and state.output_counts:
        ids = torch.tensor(list(state.output_counts), dtype=torch.long)
        counts = torch.tensor(list(state.output_counts.values()), dtype=logits.dtype)
        logits[ids] -= p.presence_penalty + p.frequency_penalty * counts
    return logits


def filter_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Probabilities after temperature, top-k, top-p and min-p (renormalised)."""
    logits = logits / p.temperature
    if 0 < p.top_k < logits.numel():
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if p.top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        before = torch.cumsum(sorted_p.double(), 0) - sorted_p  # mass strictly above each token (fp64 sums)
        drop = before >= p.top_p
        probs = probs.scatter(0, order, sorted_p.masked_fill(drop, 0.0))
    if p.min_p > 0.0:
        probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
    return probs / probs.sum()


def sample_token(logits: torch.Tensor, state: SamplerState) -> int:
    """One token from a [vocab] row of logits (not modified): the reference of `sample_rows`."""
    logits = apply_penalties(logits.float().clone(), state)
    if state.params.greedy:
        return int(torch.argmax(logits))
    sorted_p, order = torch.sort(filter_probs(logits, state.params), descending=True)
    return int(order[_pick(sorted_p[None], torch.tensor([state.uniform()]))[0]])


def _pick(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Per row of `probs` [B, K] (descending, the kept tokens first, zeros after), the index where the
    cumulative mass first reaches u · total — the last kept index at most (rounding). The sums in fp64: an
    fp32 scan over a vocabulary is off by more than its tail tokens' mass, and unlike on two devices."""
    cdf = probs.double().cumsum(-1)
    at = (cdf < u[:, None].to(cdf) * cdf[:, -1:]).sum(-1)
    return torch.minimum(at, (probs > 0).sum(-1) - 1)


def sample_rows(logits: torch.Tensor, states: Sequence[SamplerState]) -> torch.Tensor:
    """Each row's token (int64 `[B]` on logits' device) for rows `[B, vocab]` of logits (not modified) and
    their requests' states: `sample_token` for a batch in a few batched ops (the candidates: each row's
    top_k largest logits; every logit where a sampled row has no top_k)."""
    x = logits.float()
    greedy = [s.params.greedy for s in states]
    if all(greedy):
        return _penalised(x, states).argmax(-1)
    vocab, dev = x.shape[-1], x.device
    penalising = [r for r, s in enumerate(states) if s.penalises]
    slots = {r: slot for slot, r in enumerate(penalising)}  # a row's slot of the stacked penalty rows
    rows = [[*_row_settings(s, vocab), slots.get(r, -1), *_penalty_terms(s)] for r, s in enumerate(states)]
    k = int(max(r[0] for r in rows))
    settings = to_device(torch.tensor(rows, dtype=torch.float32).T.contiguous(), dev)
    if sampling.takes(x, k):
        dense = _dense_rows([states[r] for r in penalising], dev, vocab) if penalising else None
        return sampling.draw_top_k(x, settings, k, penalties=dense)
    x = _penalised(x, states)
    vals, idx = torch.sort(x, descending=True) if k == vocab else torch.topk(x, k)
    kr, temp, top_p, min_p, u = settings[:5]
    vals = vals.masked_fill(torch.arange(k, device=dev) >= kr[:, None], float("-inf"))
    probs = torch.softmax(vals / temp[:, None], dim=-1)
    probs = probs.masked_fill(probs.double().cumsum(-1) - probs >= top_p[:, None], 0.0)  # mass strictly above
    probs = probs.masked_fill(probs < min_p[:, None] * probs[:, :1], 0.0)
    drawn = idx.gather(1, _pick(probs, u)[:, None])[:, 0]
    if not any(greedy):
        return drawn
    return torch.where(to_device(torch.tensor(greedy), dev), x.argmax(-1), drawn)


def _row_settings(state: SamplerState, vocab: int) -> list[float]:
    """A row's candidates (k), temperature, top_p (2: off), min_p and the draw's number (a greedy row: one
    candidate, no draw)."""
    p = state.params
    if p.greedy:
        return [1, 1.0, 2.0, 0.0, 0.0]
    k = p.top_k if 0 < p.top_k < vocab else vocab
    return [k, p.temperature, p.top_p if p.top_p < 1.0 else 2.0, p.min_p, state.uniform()]


def _penalty_terms(state: SamplerState) -> list[float]:
    """A row's repetition, presence and frequency penalties."""
    p = state.params
    return [p.repetition_penalty, p.presence_penalty, p.frequency_penalty]


def _dense_rows(states: Sequence[SamplerState], device: torch.device,
                vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The requests' output counts and prompt masks (`SamplerState.dense`), stacked `[len(states), vocab]`."""
    counts, prompt = zip(*(s.dense(device, vocab) for s in states), strict=True)
    return torch.stack(counts), torch.stack(prompt)


def _penalised(x: torch.Tensor, states: Sequence[SamplerState]) -> torch.Tensor:
    """`x` after each row's penalties (`apply_penalties`' arithmetic, over whole rows: each request's output
    counts and prompt mask kept on x's device), a copy where any row has one."""
    rows = [r for r, s in enumerate(states) if s.penalises]
    if not rows:
        return x
    dev, vocab = x.device, x.shape[-1]
    penalised = [states[r] for r in rows]
    counts, prompt = _dense_rows(penalised, dev, vocab)
    terms = torch.tensor([_penalty_terms(s) for s in penalised], dtype=torch.float32)
    rp, presence, frequency = to_device(terms.T.contiguous(), dev)[:, :, None]
    at = to_device(torch.tensor(rows), dev)
    y = x[at]
    out = counts > 0
    # HF: every id seen (prompt or output), positive / rp, negative · rp (rp 1: exactly y)
    y = torch.where(prompt | out, torch.where(y > 0, y / rp, y * rp), y)
    # OpenAI: presence + frequency · count off each output id
    y = torch.where(out, y - (presence + frequency * counts), y)
    return x.index_copy(0, at, y)


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device`; to CUDA through pinned memory, so the copy queues behind the rounds in
    flight instead of waiting for them (a plain copy had idled the device while the host caught up)."""
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def stop_reason(token: int, generated: int, params: SamplingParams,
                eos_ids: frozenset[int]) -> FinishReason | None:
    """Why generation ends after `token` (the generated-th output token), or None to continue."""
    if token in params.stop_token_ids or (not params.ignore_eos and token in eos_ids):
        return "stop"
    if generated >= params.max_tokens:
        return "length"
    return None

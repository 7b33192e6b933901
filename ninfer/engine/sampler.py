"""Token sampling: penalties, temperature, top-k, top-p, min-p, seeded draws, stop conditions.

Order (as vLLM/HF): repetition penalty (prompt + output, HF style), presence/frequency penalties (output
tokens, OpenAI style), then greedy argmax or temperature → top-k → top-p → min-p → draw from the request's own
generator, so a seeded request gives the same tokens whatever else shares its batch.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field

import torch

from ninfer.engine.api import FinishReason, SamplingParams


@dataclass
class SamplerState:
    """Per-request sampler memory: its generator and the token counts penalties need."""

    params: SamplingParams
    prompt_ids: tuple[int, ...]
    generator: torch.Generator = field(init=False)
    output_counts: Counter = field(default_factory=Counter)

    def __post_init__(self) -> None:
        seed = self.params.seed if self.params.seed is not None else random.getrandbits(63)
        self.generator = torch.Generator().manual_seed(seed)

    def record(self, token: int) -> None:
        self.output_counts[token] += 1


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
        before = torch.cumsum(sorted_p, 0) - sorted_p  # mass strictly above each token
        drop = before >= p.top_p
        probs = probs.scatter(0, order, sorted_p.masked_fill(drop, 0.0))
    if p.min_p > 0.0:
        probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
    return probs / probs.sum()


def sample_token(logits: torch.Tensor, state: SamplerState) -> int:
    """One token from a [vocab] row of logits (not modified)."""
    logits = apply_penalties(logits.float().clone(), state)
    if state.params.greedy:
        return int(torch.argmax(logits))
    probs = filter_probs(logits, state.params)
    return int(torch.multinomial(probs, 1, generator=state.generator))


def stop_reason(token: int, generated: int, params: SamplingParams,
                eos_ids: frozenset[int]) -> FinishReason | None:
    """Why generation ends after `token` (the generated-th output token), or None to continue."""
    if token in params.stop_token_ids or (not params.ignore_eos and token in eos_ids):
        return "stop"
    if generated >= params.max_tokens:
        return "length"
    return None

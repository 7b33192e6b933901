"""Perplexity of a token sequence through the engine's own path (paged KV of the chosen dtype, GDN slots).

The text is fed in `prefill_chunk` pieces as one sequence; every key, including those of the current chunk,
is read back from the KV pool, so the number reflects the KV dtype's cost.
"""

from __future__ import annotations

import math

import torch

from ninfer.engine.engine import Engine
from ninfer.engine.kv_pool import pages_for
from ninfer.engine.scheduler import Round, WorkItem
from ninfer.errors import EngineConfigError


def perplexity(engine: Engine, token_ids: list[int], chunk: int | None = None) -> tuple[float, int]:
    """exp(mean NLL) of token_ids[1:] given their prefixes, and the number of scored tokens."""
    n = len(token_ids)
    if n < 2:
        raise EngineConfigError("perplexity needs at least 2 tokens")
    if n > engine.config.max_context:
        raise EngineConfigError(f"{n} tokens exceed --max-context {engine.config.max_context}")
    if engine.scheduler.has_work:
        raise EngineConfigError("perplexity needs an idle engine")
    chunk = chunk or engine.config.prefill_chunk
    alloc = engine.kv.allocator
    pages = alloc.reserve(pages_for(n))
    nll, scored = 0.0, 0
    try:
        admitted = [(0, pages)]
        for start in range(0, n, chunk):
            piece = tuple(token_ids[start:start + chunk])
            rnd = Round([WorkItem(None, 0, piece, start, True)], admitted, [])
            admitted = []
            logits = engine.runner.run(rnd, all_rows=True)
            targets = torch.tensor(token_ids[start + 1:start + 1 + len(piece)], dtype=torch.long)
            logp = torch.log_softmax(logits[: len(targets)], dim=-1)
            nll -= logp.gather(1, targets[:, None]).sum().item()
            scored += len(targets)
    finally:
        engine.kv.release(0)
        alloc.free(pages)
    return math.exp(nll / scored), scored

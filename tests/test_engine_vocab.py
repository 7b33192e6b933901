"""Padded output-head rows (ids the tokenizer does not know) are never sampled.

The tiny fixture's head has 4096 rows for 4001 real tokens; rows 4001..4095 are zero, so their logit is 0
while real logits have std ~1: at temperature 2 an unmasked sampler draws one of them every ~30 tokens.
"""

from __future__ import annotations

from ninfer.engine.api import GenerationRequest, SamplingParams
from ninfer.engine.engine import Engine, EngineConfig

REAL_TOKENS = 4001


def test_padding_rows_are_never_sampled(tiny_artifact):
    engine = Engine(tiny_artifact, EngineConfig(max_context=512, kv_capacity=512, kv_dtype="fp32")).start()
    try:
        assert engine.sample_vocab == REAL_TOKENS
        params = SamplingParams(max_tokens=400, temperature=2.0, seed=7, ignore_eos=True)
        events = engine.generate(GenerationRequest("hot", (3969, 846, 198), params))
    finally:
        engine.shutdown()
    tokens = [t for ev in events for t in ev.token_ids]
    assert len(tokens) == 400
    assert max(tokens) < REAL_TOKENS

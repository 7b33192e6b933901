"""Real small dense models: our artifact (converted from the GGUF) against transformers loading the same
GGUF (its loader dequantises to fp32), 32-token greedy continuations of 3 chat prompts, EOS not special.

Measured: identical on all 3 prompts for SmolLM2-135M (Q4_1, llama) and Qwen2.5-Coder-0.5B (Q4_K_M,
qwen2). Slow: transformers' GGUF dequantisation alone takes 1-3 minutes per model on this machine.
"""

from __future__ import annotations

import pytest
import torch
from realmodels import converted, hf_gguf_tokenizer, qwen25_coder_gguf, smollm2_gguf
from simple_context import greedy, single_thread

from ninfer.artifact import open_artifact
from ninfer.models import DenseModel, load_model
from ninfer.models.qwen3_5 import TiedHead

pytestmark = pytest.mark.slow

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a Python function that reverses a string."}],
    [{"role": "system", "content": "You are a terse assistant."},
     {"role": "user", "content": "Name three primary colors."}],
]  # fmt: skip
NEW_TOKENS = 32


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    with single_thread():
        yield


def _hf_greedy(hf, ids: list[int], n: int) -> list[int]:
    """Greedy with transformers' KV cache, ignoring EOS (generate() would stop at it)."""
    out, tokens = hf(torch.tensor([ids]), use_cache=True), []
    for _ in range(n):
        tokens.append(int(out.logits[0, -1].argmax()))
        out = hf(torch.tensor([[tokens[-1]]]), past_key_values=out.past_key_values, use_cache=True)
    return tokens


def _prompt_ids(tok, messages) -> list[int]:
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


@pytest.mark.parametrize("key", ["smollm2", "qwen2.5-coder"])
def test_greedy_equals_transformers_on_the_same_gguf(key):
    from transformers import AutoModelForCausalLM

    gguf = smollm2_gguf() if key == "smollm2" else qwen25_coder_gguf()
    ours = load_model(open_artifact(converted(key)))
    assert isinstance(ours, DenseModel)
    # SmolLM2 ties its head: the artifact binds both names to one object, loaded once
    assert isinstance(ours.output_head, TiedHead) == (key == "smollm2")
    tok = hf_gguf_tokenizer(gguf)
    with torch.no_grad():
        hf = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
        hf.eval()
        for messages in CHATS:
            ids = _prompt_ids(tok, messages)
            assert greedy(ours, ids, NEW_TOKENS) == _hf_greedy(hf, ids, NEW_TOKENS), messages

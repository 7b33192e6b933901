"""The engine on the real Qwen3.5 tiny fixture model against transformers fp32 references; KV dtype costs.

Measured (this machine, prompts p1/p2/p3, last-position logits after a chunked prefill, logit std ~0.97):
max |Δlogit| vs transformers with fp32 KV 1.0e-5; vs the fp32-KV engine: bf16 1.2e-3, int8 4.9e-3,
rk8v4 4.4e-2, rk4v4 5.8e-2. Tolerances below are about 2x those.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_engine_invariants import capture_logits, drive, req

from ninfer.artifact import open_artifact
from ninfer.engine.engine import Engine, EngineConfig
from ninfer.models import load_model

KV_TOLERANCE = {"bf16": 3e-3, "int8": 1e-2, "rk8v4": 9e-2, "rk4v4": 1.2e-1}
TF_ATOL = 3e-5
PROMPTS = ("p1", "p2", "p3")


@pytest.fixture(scope="module")
def ref(tiny_dir):
    return dict(np.load(tiny_dir / "reference" / "reference.npz"))


@pytest.fixture(scope="module")
def model(tiny_artifact):
    """The fixture's bf16 GGUF converted with ninfer-convert, loaded as the engine loads it."""
    return load_model(open_artifact(tiny_artifact), load_mtp=False)


def last_logits(ref, p: str) -> torch.Tensor:
    key = "p1_tf_logits" if p == "p1" else f"{p}_tf_logits_last"
    x = torch.from_numpy(ref[key])
    return x[-1] if x.dim() == 2 else x


def prefill_last(model, kv_dtype: str, ids: tuple[int, ...], chunk: int) -> torch.Tensor:
    engine = Engine.from_model(model, EngineConfig(max_context=128, kv_capacity=128, kv_dtype=kv_dtype,
                                                   prefill_chunk=chunk))
    seen = capture_logits(engine)
    try:
        drive(engine, [engine.submit(req("x", ids, max_tokens=1, temperature=0))])
    finally:
        del engine.model.compute_logits  # restore the class method
    return seen[0][0]


def test_fp32_kv_matches_transformers_logits_and_greedy(model, ref):
    engine = Engine.from_model(model, EngineConfig(max_concurrency=3, max_context=128, kv_capacity=256,
                                                   kv_dtype="fp32", prefill_chunk=16))
    seen = capture_logits(engine)
    handles = [engine.submit(req(p, tuple(ref[f"{p}_ids"].tolist()), max_tokens=24, temperature=0,
                                 ignore_eos=True)) for p in PROMPTS]
    try:
        out = drive(engine, handles)
    finally:
        del engine.model.compute_logits
    assert sum(x.shape[0] for x in seen) == 3 * 24  # one logits row per sampled token
    for p in PROMPTS:
        greedy = ref[f"{p}_tf_greedy"].tolist()
        margin = ref[f"{p}_tf_greedy_margin"]
        fragile = next((i for i, m in enumerate(margin) if m < 1e-2), len(greedy))
        assert out[p][0][:fragile + 1] == greedy[:fragile + 1], p
    for p in PROMPTS:
        got = prefill_last(model, "fp32", tuple(ref[f"{p}_ids"].tolist()), chunk=8)
        assert (got - last_logits(ref, p)).abs().max() < TF_ATOL


@pytest.fixture(scope="module")
def exact(model, ref):
    return {p: prefill_last(model, "fp32", tuple(ref[f"{p}_ids"].tolist()), chunk=64) for p in PROMPTS}


@pytest.mark.parametrize("kv_dtype", ["bf16", "int8", "rk8v4", "rk4v4"])
def test_quantized_kv_logits_within_measured_tolerance(model, ref, exact, kv_dtype):
    for p in PROMPTS:
        got = prefill_last(model, kv_dtype, tuple(ref[f"{p}_ids"].tolist()), chunk=64)
        assert (got - exact[p]).abs().max() < KV_TOLERANCE[kv_dtype], p
        assert got.argmax() == exact[p].argmax()


def test_gdn_state_fp16_stays_close(model, ref):
    ids = tuple(ref["p3_ids"].tolist())
    e32 = Engine.from_model(model, EngineConfig(max_context=128, kv_capacity=128, kv_dtype="fp32",
                                                prefill_chunk=8))
    e16 = Engine.from_model(model, EngineConfig(max_context=128, kv_capacity=128, kv_dtype="fp32",
                                                prefill_chunk=8, gdn_state_fp16=True))
    assert e16.states.recurrent[0].dtype == torch.float16
    a = drive(e32, [e32.submit(req("a", ids, max_tokens=6, temperature=0))])["a"][0]
    b = drive(e16, [e16.submit(req("a", ids, max_tokens=6, temperature=0))])["a"][0]
    assert a == b


def test_greedy_alone_equals_greedy_among_three_others_at_different_stages(model, ref):
    target = tuple(ref["p2_ids"].tolist())

    def engine():
        return Engine.from_model(model, EngineConfig(max_concurrency=4, max_context=128, kv_capacity=512,
                                                     kv_dtype="bf16", prefill_chunk=16))

    alone = engine()
    expected = drive(alone, [alone.submit(req("t", target, max_tokens=12, temperature=0, ignore_eos=True))])
    busy = engine()
    handles = [busy.submit(req("a", tuple(ref["p3_ids"].tolist()), max_tokens=20, temperature=0))]
    for _ in range(3):  # "a" is decoding when the others arrive
        busy.step(busy.scheduler.schedule())
    handles.append(busy.submit(req("b", tuple(ref["p1_ids"].tolist()) * 3, max_tokens=8, seed=5)))
    busy.step(busy.scheduler.schedule())  # "b" is mid-prefill
    handles.append(busy.submit(req("t", target, max_tokens=12, temperature=0, ignore_eos=True)))
    handles.append(busy.submit(req("c", (5, 6, 7), max_tokens=12, top_k=20, seed=1)))
    out = drive(busy, handles)
    assert out["t"] == expected["t"]

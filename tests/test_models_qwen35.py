"""The Qwen3.5 hybrid model and its MTP head on CPU against transformers' fp32 reference.

Weights come from the fixture's HF checkpoint through `tests/simple_context.HfQwen35Source` (logical
ninfer names); the artifact-based tests live in test_models_artifacts.py.
Measured (fp32): max |Δlogit| vs transformers 6.8e-6 (p1, all 20 positions), 5.1e-6 (p2), 6.0e-6 (p3);
logit std ≈ 0.97. Tolerance 2e-5 (3× the measurement).
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from safetensors import safe_open
from simple_context import (
    HfQwen35Source,
    Sequence,
    SequenceCache,
    SimpleContext,
    greedy,
    prefill_logits,
    single_thread,
    step,
)

from ninfer.models import load_model

TF_ATOL = 2e-5
# chunked vs whole prefill: the chunked GDN form and split attention differ only by fp32 rounding
CHUNK_ATOL = 2e-5


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    with single_thread():
        yield


@pytest.fixture(scope="module")
def text_config(tiny_dir):
    return json.loads((tiny_dir / "hf" / "config.json").read_text())["text_config"]


@pytest.fixture(scope="module")
def source(tiny_dir, text_config):
    return HfQwen35Source(tiny_dir / "hf" / "model.safetensors", text_config)


def fake_artifact(source, text_config, mtp=True):
    comps = {"text": SimpleNamespace(config={**text_config, "architecture": "qwen3_5"})}
    if mtp:
        comps["mtp"] = SimpleNamespace(config={"num_layers": 1, "layer_index": 4})
    return SimpleNamespace(
        components=comps, tensor=source.tensor, input_columns=source.input_columns, has=source.has_tensor
    )


@pytest.fixture(scope="module")
def model(source, text_config):
    return load_model(fake_artifact(source, text_config))


@pytest.fixture(scope="module")
def ref(tiny_dir):
    return dict(np.load(tiny_dir / "reference" / "reference.npz"))


def test_cache_spec(model):
    spec = model.cache_spec
    assert (spec.num_kv_layers, spec.kv_heads, spec.head_dim) == (1, 2, 128)
    assert (spec.num_gdn_layers, spec.gdn_conv_channels, spec.gdn_conv_kernel) == (3, 1280, 4)
    gdn = (spec.gdn_key_heads, spec.gdn_value_heads, spec.gdn_key_dim, spec.gdn_value_dim)
    assert gdn == (2, 6, 128, 128)
    assert spec.mtp_kv_layers == 1 and spec.total_kv_layers == 2 and model.mtp.kv_layer == 1
    assert model.vocab_size == 4096


def test_logits_match_transformers(model, ref):
    p1 = prefill_logits(model, ref["p1_ids"].tolist())
    torch.testing.assert_close(p1, torch.from_numpy(ref["p1_tf_logits"]), rtol=0, atol=TF_ATOL)
    for p in ("p2", "p3"):
        last = prefill_logits(model, ref[f"{p}_ids"].tolist())[-1]
        torch.testing.assert_close(last, torch.from_numpy(ref[f"{p}_tf_logits_last"]), rtol=0, atol=TF_ATOL)


@pytest.mark.parametrize("p", ["p1", "p2", "p3"])
def test_greedy_matches_transformers(model, ref, p):
    assert greedy(model, ref[f"{p}_ids"].tolist(), 24) == ref[f"{p}_tf_greedy"].tolist()


def _long_prompt(ref):
    return ref["p1_ids"].tolist() + ref["p2_ids"].tolist() + ref["p3_ids"].tolist()  # 77 tokens


@pytest.mark.parametrize("chunk", [16, 64, 5])
def test_chunked_prefill_equals_whole(model, ref, chunk):
    ids = _long_prompt(ref)
    whole = prefill_logits(model, ids)
    torch.testing.assert_close(prefill_logits(model, ids, chunk=chunk), whole, rtol=0, atol=CHUNK_ATOL)


def test_prefill_then_decode_equals_full_forward(model, ref):
    ids = ref["p2_ids"].tolist()
    cont = greedy(model, ids, 12)
    full = prefill_logits(model, ids + cont)
    seq = Sequence(SequenceCache(model.cache_spec), ids + cont)
    rows = [model.compute_logits(step(model, [seq], [len(ids)]))]
    for _ in cont:
        rows.append(model.compute_logits(step(model, [seq], [1])))
    torch.testing.assert_close(torch.cat(rows), full, rtol=0, atol=CHUNK_ATOL)


def test_flat_batch_of_sequences_equals_each_alone(model, ref):
    prompts = [ref["p1_ids"].tolist(), ref["p2_ids"].tolist(), ref["p3_ids"].tolist()]
    alone = [prefill_logits(model, p) for p in prompts]
    seqs = [Sequence(SequenceCache(model.cache_spec), p) for p in prompts]
    # different stages in one batch: a first chunk, a mid-prompt chunk, single tokens
    plan = [[7, 13, 0], [10, 1, 1, 9, 1], [30, 1, 1, 1, 1, 1]]
    outs: list[list[torch.Tensor]] = [[], [], []]
    for r in range(max(len(p) for p in plan)):
        counts = [p[r] if r < len(p) else 0 for p in plan]
        active = [i for i, n in enumerate(counts) if n > 0]
        hidden = step(model, [seqs[i] for i in active], [counts[i] for i in active])
        logits = model.compute_logits(hidden)
        start = 0
        for i in active:
            outs[i].append(logits[start : start + counts[i]])
            start += counts[i]
    for i in range(3):
        torch.testing.assert_close(torch.cat(outs[i]), alone[i], rtol=0, atol=CHUNK_ATOL)


def test_bf16_compute_runs_close_to_fp32(source, text_config, ref):
    m16 = load_model(fake_artifact(source, text_config, mtp=False), dtype=torch.bfloat16)
    logits = prefill_logits(m16, ref["p1_ids"].tolist())
    expected = torch.from_numpy(ref["p1_tf_logits"])
    assert logits.dtype == torch.float32 and m16.mtp is None
    # measured: max |Δ| 0.13, top-1 agreement 20/20 positions (bf16 weights+activations; logit std ≈ 1)
    assert (logits - expected).abs().max() < 0.3
    assert (logits.argmax(-1) == expected.argmax(-1)).float().mean() >= 0.85


# ---- MTP ---------------------------------------------------------------------------------------


def _mtp_inputs(model, ref):
    ids = ref["p1_ids"].tolist()
    seq = Sequence(SequenceCache(model.cache_spec), ids)
    hidden = step(model, [seq], [len(ids)])
    # row t pairs h_t with token t+1 (the last row with the model's own argmax)
    nxt = ids[1:] + [int(model.compute_logits(hidden[-1:]).argmax())]
    return hidden, torch.tensor(nxt), torch.arange(len(ids))


def _run_mtp(model, hidden, nxt, pos, chunks):
    cache = SequenceCache(model.cache_spec, mtp=True)
    outs, done = [], 0
    for n in chunks:
        ctx = SimpleContext([cache], [n], [done])
        h = model.mtp(hidden[done : done + n], nxt[done : done + n], pos[done : done + n], ctx)
        outs.append(model.mtp.compute_logits(h))
        done += n
    assert cache.length(model.mtp.kv_layer) == done
    return torch.cat(outs)


def test_mtp_shapes_and_chunking_consistency(model, ref):
    hidden, nxt, pos = _mtp_inputs(model, ref)
    T = hidden.shape[0]
    whole = _run_mtp(model, hidden, nxt, pos, [T])
    assert whole.shape == (T, 4096) and torch.isfinite(whole).all()
    torch.testing.assert_close(_run_mtp(model, hidden, nxt, pos, [1] * T), whole, rtol=0, atol=CHUNK_ATOL)
    torch.testing.assert_close(_run_mtp(model, hidden, nxt, pos, [7, 9, 4]), whole, rtol=0, atol=CHUNK_ATOL)


def test_mtp_matches_transformers_blocks(model, ref, tiny_dir, text_config):
    """The MTP formula assembled from transformers' own Qwen3.5 modules on the checkpoint's mtp.* weights."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as hf
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig

    hidden, nxt, pos = _mtp_inputs(model, ref)
    T = hidden.shape[0]
    cfg = Qwen3_5TextConfig(**{k: v for k, v in text_config.items() if k != "model_type"})
    cfg._attn_implementation = "eager"
    with safe_open(str(tiny_dir / "hf" / "model.safetensors"), "pt") as f:
        w = {k: f.get_tensor(k).float() for k in f.keys() if k.startswith(("mtp.", "lm_head", "model.lang"))}
    layer = hf.Qwen3_5DecoderLayer(cfg, layer_idx=cfg.layer_types.index("full_attention")).eval()
    prefix = "mtp.layers.0."
    layer.load_state_dict({k[len(prefix):]: v for k, v in w.items() if k.startswith(prefix)})
    norms = {}
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        norms[name] = hf.Qwen3_5RMSNorm(256, eps=cfg.rms_norm_eps)
        norms[name].weight.data.copy_(w[f"mtp.{name}.weight"])
    rotary = hf.Qwen3_5TextRotaryEmbedding(cfg)
    with torch.no_grad():
        e = norms["pre_fc_norm_embedding"](w["model.language_model.embed_tokens.weight"][nxt])
        x = torch.cat([e, norms["pre_fc_norm_hidden"](hidden)], -1) @ w["mtp.fc.weight"].T
        cos, sin = rotary(x[None], pos[None])
        mask = torch.full((T, T), float("-inf")).triu(1)[None, None]
        y = layer(x[None], position_embeddings=(cos, sin), attention_mask=mask)
        expected = norms["norm"](y[0]) @ w["lm_head.weight"].T
    ours = _run_mtp(model, hidden, nxt, pos, [T])
    torch.testing.assert_close(ours, expected, rtol=0, atol=TF_ATOL)

"""The dense Qwen2 / Llama decoder against transformers' Qwen2ForCausalLM / LlamaForCausalLM (fp32).

Fast tests: small randomly initialised transformers models, their weights handed to ours under ninfer's
logical names. Measured max |Δlogit| ≤ 2.9e-6 (3.9e-6 with Llama 3 RoPE scaling over 90 positions;
logit std ≈ 0.8-0.85); tolerance 1e-5.
The real SmolLM2 / Qwen2.5-Coder GGUFs are in test_models_dense_real.py (slow).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from simple_context import DenseStored, greedy, prefill_logits, single_thread
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from ninfer.errors import ArtifactError
from ninfer.kernels.reference import rope_inv_freq
from ninfer.models import DenseModel, load_model

TF_ATOL = 1e-5


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    with single_thread():
        yield


def _hf_to_logical(sd: dict[str, torch.Tensor], n_layers: int) -> dict[str, torch.Tensor]:
    emb = sd["model.embed_tokens.weight"]
    out = {"text/token_embedding": emb, "text/final_norm": sd["model.norm.weight"]}
    if "lm_head.weight" in sd and sd["lm_head.weight"].data_ptr() != emb.data_ptr():
        out["text/output_head"] = sd["lm_head.weight"]
    for i in range(n_layers):
        hf, ours = f"model.layers.{i}.", f"text/layers/{i}"
        out[f"{ours}/input_norm"] = sd[hf + "input_layernorm.weight"]
        out[f"{ours}/post_attention_norm"] = sd[hf + "post_attention_layernorm.weight"]
        for role, name in (("query", "q_proj"), ("key", "k_proj"), ("value", "v_proj"), ("output", "o_proj")):
            out[f"{ours}/attention/{role}"] = sd[hf + f"self_attn.{name}.weight"]
            if hf + f"self_attn.{name}.bias" in sd:
                out[f"{ours}/attention/{role}_bias"] = sd[hf + f"self_attn.{name}.bias"]
        for part in ("gate", "up", "down"):
            out[f"{ours}/mlp/{part}"] = sd[hf + f"mlp.{part}_proj.weight"]
    return out


def _source(tensors: dict[str, torch.Tensor], config: dict):
    return SimpleNamespace(
        components={"text": SimpleNamespace(config=config)},
        tensor=lambda name: DenseStored(tensors[name].detach().float()),
        input_columns=lambda name: None,
        has=lambda name: name in tensors,
    )


COMMON = dict(vocab_size=300, hidden_size=64, intermediate_size=160, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
              initializer_range=0.1)  # fmt: skip


LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}  # fmt: skip


def _pair(arch: str, tied: bool, rope: dict | None = None):
    torch.manual_seed(7 if arch == "qwen2" else 8)
    if rope is not None:
        cfg = LlamaConfig(**COMMON, rms_norm_eps=1e-5, rope_parameters=rope, tie_word_embeddings=tied)
        hf = LlamaForCausalLM(cfg)
    elif arch == "qwen2":
        cfg = Qwen2Config(**COMMON, rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=tied)
        hf = Qwen2ForCausalLM(cfg)
    else:
        cfg = LlamaConfig(**COMMON, rms_norm_eps=1e-5, rope_theta=1e4, tie_word_embeddings=tied,
                          attention_bias=False)  # fmt: skip
        hf = LlamaForCausalLM(cfg)
    hf = hf.float().eval()
    with torch.no_grad():  # random init has tiny norms/biases; make them matter
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                p.normal_(1.0 if name.endswith("norm.weight") else 0.0, 0.2)
    config = {**cfg.to_dict(), "architecture": arch}
    ours = load_model(_source(_hf_to_logical(hf.state_dict(), cfg.num_hidden_layers), config))
    return hf, ours


@pytest.mark.parametrize("arch,tied", [("qwen2", False), ("qwen2", True), ("llama", True), ("llama", False)])
def test_dense_matches_transformers(arch, tied):
    hf, ours = _pair(arch, tied)
    assert isinstance(ours, DenseModel) and ours.mtp is None
    assert ours.cache_spec.num_kv_layers == 3 and ours.cache_spec.num_gdn_layers == 0
    ids = torch.randint(0, 300, (23,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        expected = hf(torch.tensor([ids])).logits[0]
        expected_greedy = hf.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False,
                                      pad_token_id=0)[0, len(ids):].tolist()  # fmt: skip
    torch.testing.assert_close(prefill_logits(ours, ids), expected, rtol=0, atol=TF_ATOL)
    torch.testing.assert_close(prefill_logits(ours, ids, chunk=5), expected, rtol=0, atol=TF_ATOL)
    assert greedy(ours, ids, 12) == expected_greedy


def _check_against(hf, ours, n_ids=23, seed=1):
    ids = torch.randint(0, 300, (n_ids,), generator=torch.Generator().manual_seed(seed)).tolist()
    with torch.no_grad():
        expected = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(prefill_logits(ours, ids), expected, rtol=0, atol=TF_ATOL)


def test_llama3_rope_scaling_matches_transformers():
    hf, ours = _pair("llama", False, rope=LLAMA3_ROPE)
    plain = rope_inv_freq(16, 5e5)
    assert not torch.allclose(ours.inv_freq, plain)  # the scaling really changes frequencies
    _check_against(hf, ours, n_ids=90)
    # llama.cpp's form: the same scaling stored as per-frequency divisors (rope_freqs.weight)
    tensors = _hf_to_logical(hf.state_dict(), 3)
    tensors["text/rope_frequency_factors"] = plain / ours.inv_freq
    config = {**hf.config.to_dict(), "architecture": "llama",
              "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "gguf_rope_freqs": True}}
    _check_against(hf, load_model(_source(tensors, config)), n_ids=90)
    del tensors["text/rope_frequency_factors"]
    with pytest.raises(ArtifactError, match="RoPE frequency factors"):
        load_model(_source(tensors, config))


def test_unsupported_rope_scaling_is_a_clear_error():
    cfg = {**COMMON, "architecture": "llama", "rope_parameters": {"rope_type": "yarn", "factor": 4.0}}
    with pytest.raises(ArtifactError, match="rope type 'yarn'"):
        load_model(_source({}, cfg))


def test_unknown_architecture_is_a_clear_error():
    with pytest.raises(ArtifactError, match="text architecture 'mamba'"):
        load_model(_source({}, {"architecture": "mamba"}))

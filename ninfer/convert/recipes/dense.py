"""Dense GGUF recipes `qwen2_gguf` and `llama_gguf` (Qwen2/2.5, Llama, SmolLM): quantized tensors carried
byte for byte, llama.cpp's q/k row permutation undone for `llama` GGUFs, the text config derived from the
GGUF header (or a config.json), and the tokenizer resources rebuilt from the GGUF when none are given.
"""

from __future__ import annotations

import re

import numpy as np

from ninfer.convert.gguf_tokenizer import TokenizerResources, tokenizer_resources
from ninfer.convert.job import ConversionJob
from ninfer.convert.plans import carry
from ninfer.convert.registry import recipe
from ninfer.convert.sources import Source
from ninfer.errors import ConversionError, GGUFError

# Geometry keys checked against a config.json given with --model.
_GEOMETRY_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                  "head_dim", "intermediate_size", "vocab_size")  # fmt: skip
_TOKENIZER_ROLES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


def unpermute_rope_rows(n_heads: int, head_dim: int) -> np.ndarray:
    """Row gather undoing llama.cpp's llama q/k permutation: out[r] = gguf[rows[r]].

    convert_hf_to_gguf stores, per head, the two rotary halves interleaved: GGUF row h·d + 2i + s holds HF
    row h·d + s·d/2 + i (s = which half, i < d/2). So HF row h·d + s·d/2 + i is read back from there.
    """
    if head_dim % 2:
        raise ConversionError(f"head dim {head_dim} is odd; a llama GGUF's rotary layout needs an even one")
    half = head_dim // 2
    j = np.arange(head_dim)
    within = 2 * (j % half) + j // half
    return (np.arange(n_heads)[:, None] * head_dim + within[None, :]).reshape(-1)


def _header(src: Source, arch: str, key: str, default=None):
    value = src.metadata.get(f"{arch}.{key}", default)
    if value is None:
        raise GGUFError(f"{src.path}: GGUF header lacks {arch}.{key}; is this a complete {arch} GGUF?")
    return value


def config_from_header(src: Source, arch: str) -> dict:
    """A Hugging Face style text config (qwen2 / llama key names) built from the GGUF header."""
    md = src.metadata
    hidden = int(_header(src, arch, "embedding_length"))
    heads = int(_header(src, arch, "attention.head_count"))
    config = {
        "architecture": arch,
        "model_type": arch,
        "hidden_size": hidden,
        "num_hidden_layers": int(_header(src, arch, "block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_header(src, arch, "attention.head_count_kv", heads)),
        "head_dim": int(_header(src, arch, "attention.key_length", hidden // heads)),
        "intermediate_size": int(_header(src, arch, "feed_forward_length")),
        "rms_norm_eps": float(_header(src, arch, "attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(_header(src, arch, "rope.freq_base", 10000.0)),
        "vocab_size": src.tensor("token_embd.weight").shape[0],
        "max_position_embeddings": int(_header(src, arch, "context_length", 4096)),
        "tie_word_embeddings": "output.weight" not in src.tensors,
        "hidden_act": "silu",
        "attention_bias": arch == "qwen2",
    }
    config["rope_parameters"] = _rope_parameters(src, arch, config["rope_theta"])
    for hf_key, gguf_key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                             ("pad_token_id", "padding_token_id")):  # fmt: skip
        if isinstance(md.get(f"tokenizer.ggml.{gguf_key}"), int):
            config[hf_key] = md[f"tokenizer.ggml.{gguf_key}"]
    return config


def _rope_parameters(src: Source, arch: str, theta: float) -> dict:
    """Plain RoPE, or the scaling the header names (recorded so the model can refuse what it lacks)."""
    scaling = src.metadata.get(f"{arch}.rope.scaling.type", "none")
    if "rope_freqs.weight" in src.tensors:
        return {"rope_type": "llama3", "rope_theta": theta, "gguf_rope_freqs": True}
    if scaling not in ("none", None):
        params = {"rope_type": str(scaling), "rope_theta": theta}
        factor = src.metadata.get(f"{arch}.rope.scaling.factor")
        if factor is not None:
            params["factor"] = float(factor)
        return params
    return {"rope_type": "default", "rope_theta": theta}


def text_config(job: ConversionJob, src: Source, arch: str) -> dict:
    """config.json from --model (cross-checked against the GGUF), else the header-derived config."""
    derived = config_from_header(src, arch)
    given = job.model_json("config.json")
    if given is None:
        return derived
    given = dict(given.get("text_config", given))
    for key in _GEOMETRY_KEYS:
        if given.get(key) is not None and int(given[key]) != derived[key]:
            raise ConversionError(
                f"geometry mismatch: config.json {key} = {given[key]} but the GGUF header of "
                f"{src.path.name} has {derived[key]}; pass the config.json that belongs to this model"
            )
    config = {**derived, **{k: v for k, v in given.items() if v is not None}}  # config.json wins
    config.pop("architectures", None)
    config["tie_word_embeddings"] = derived["tie_word_embeddings"]  # what is stored decides
    config["architecture"] = arch
    return config


def text_resources(job: ConversionJob, src: Source) -> dict[str, bytes]:
    """--resource > --model DIR > rebuilt from the GGUF's tokenizer metadata (built only when needed)."""
    built: TokenizerResources | None = None

    def from_gguf() -> dict[str, bytes]:
        nonlocal built
        if built is None:
            built = tokenizer_resources(src.metadata, str(src.path))
        return built.as_resources()

    roles = {}
    for role in _TOKENIZER_ROLES:
        if _given(job, role):
            roles[role] = job.resource_bytes(role)
        else:
            roles[role] = from_gguf()[role]
    template = _chat_template(job, src)
    if template is not None:
        roles["chat_template.jinja"] = template
    return roles


def _given(job: ConversionJob, role: str) -> bool:
    return role in job.request.resources or (job.model_dir is not None and (job.model_dir / role).is_file())


def _chat_template(job: ConversionJob, src: Source) -> bytes | None:
    if _given(job, "chat_template.jinja"):
        return job.resource_bytes("chat_template.jinja")
    tok_cfg = job.model_json("tokenizer_config.json") or {}
    if isinstance(tok_cfg.get("chat_template"), str):
        return tok_cfg["chat_template"].encode("utf-8")
    template = src.metadata.get("tokenizer.chat_template")
    if isinstance(template, str):
        return template.encode("utf-8")
    job.warn("no chat template (none in the GGUF or --model); pass --resource chat_template.jinja=PATH "
             "to serve chat requests")  # fmt: skip
    return None


def _layer(job: ConversionJob, src: Source, i: int, config: dict, arch: str) -> None:
    blk, prefix = f"blk.{i}", f"text/layers/{i}"
    job.add(f"{prefix}/input_norm", carry(src.tensor(f"{blk}.attn_norm.weight")))
    job.add(f"{prefix}/post_attention_norm", carry(src.tensor(f"{blk}.ffn_norm.weight")))
    heads, kv_heads, d = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    q_rows = k_rows = None
    if arch == "llama":  # llama.cpp permutes llama q/k rows for its rotary layout; qwen2 is stored as is
        q_rows, k_rows = unpermute_rope_rows(heads, d), unpermute_rope_rows(kv_heads, d)
    attention = f"{prefix}/attention"
    job.add(f"{attention}/query", carry(_rows_checked(src, f"{blk}.attn_q.weight", heads * d), rows=q_rows))
    job.add(f"{attention}/key", carry(_rows_checked(src, f"{blk}.attn_k.weight", kv_heads * d), rows=k_rows))
    job.add(f"{attention}/value", carry(_rows_checked(src, f"{blk}.attn_v.weight", kv_heads * d)))
    job.add(f"{attention}/output", carry(src.tensor(f"{blk}.attn_output.weight")))
    for role in ("query", "key", "value"):
        bias = src.get(f"{blk}.attn_{role[0]}.bias")
        if bias is not None:
            rows = {"query": q_rows, "key": k_rows}.get(role)
            job.add(f"{attention}/{role}_bias", carry(bias, rows=rows))
        elif arch == "qwen2":
            raise ConversionError(
                f"{src.path}: {blk}.attn_{role[0]}.bias is missing; a qwen2 GGUF has q/k/v biases"
            )
    for role, tensor in (("gate", "ffn_gate"), ("up", "ffn_up"), ("down", "ffn_down")):
        job.add(f"{prefix}/mlp/{role}", carry(src.tensor(f"{blk}.{tensor}.weight")))


def _rows_checked(src: Source, name: str, rows: int):
    t = src.tensor(name)
    if t.shape[0] != rows:
        raise ConversionError(f"{src.path}: {name} has {t.shape[0]} rows, the header implies {rows}")
    return t


def _model_name(src: Source) -> str:
    """Default public model id: the GGUF file name without `.gguf`, lower-cased (e.g. smollm2-135m-…)."""
    return re.sub(r"\.gguf$", "", src.path.name, flags=re.IGNORECASE).lower()


def build_dense(job: ConversionJob, arch: str, recipe_name: str) -> None:
    src = job.source("gguf")
    if src.kind != "gguf":
        raise ConversionError(f"--source gguf={src.path} is not a GGUF file; pass the model's .gguf file")
    found = src.metadata.get("general.architecture")
    if found != arch:
        other = {"qwen2": "qwen2_gguf", "llama": "llama_gguf", "qwen35": "qwen3_5_gguf"}.get(found)
        hint = f"use --recipe {other}" if other else "ninfer cannot convert it"
        raise GGUFError(f"{src.path} is a {found!r} GGUF, but recipe {recipe_name} needs {arch!r}; {hint}")
    for component in job.request.components:
        if component != "text":
            raise ConversionError(f"recipe {recipe_name} has only a text component; use --components text")
    config = text_config(job, src, arch)
    emb = job.add("text/token_embedding", carry(src.tensor("token_embd.weight")))
    if config["tie_word_embeddings"]:
        job.bind("text/output_head", emb)  # one object, two names
    else:
        job.add("text/output_head", carry(src.tensor("output.weight")))
    job.add("text/final_norm", carry(src.tensor("output_norm.weight")))
    for i in range(config["num_hidden_layers"]):
        _layer(job, src, i, config, arch)
    job.set_component("text", config, text_resources(job, src))
    job.set_metadata(name=_model_name(src), architecture=arch, source_name=src.metadata.get("general.name"))


@recipe("qwen2_gguf", sources=("gguf",), architecture="qwen2",
        description="dense Qwen2/2.5 qwen2 GGUF (tokenizer from the GGUF if no --model)")  # fmt: skip
def qwen2_gguf(job: ConversionJob) -> None:
    build_dense(job, "qwen2", "qwen2_gguf")


@recipe("llama_gguf", sources=("gguf",), architecture="llama",
        description="dense Llama/SmolLM llama GGUF (tokenizer from the GGUF if no --model)")  # fmt: skip
def llama_gguf(job: ConversionJob) -> None:
    build_dense(job, "llama", "llama_gguf")

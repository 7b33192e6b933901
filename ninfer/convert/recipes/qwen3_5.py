"""Qwen3.5/3.6/3.8 hybrid recipes: llama.cpp `qwen35` GGUF (+ MTP, + mmproj vision) and HF safetensors.

GGUF conventions undone here (fixture README, "GGUF conventions"): `1+w` norms -> w (not ssm_norm),
`ssm_a = -exp(A_log)` -> A_log, per-head [query; gate] `attn_q` -> query and gate, tiled value heads ->
grouped order (row gathers), and `ssm_out`'s tiled input columns recorded as an `input_columns` use.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np
import torch

from ninfer.artifact.schema import TEXT_RESOURCES, VISION_RESOURCES
from ninfer.convert.job import ConversionJob
from ninfer.convert.plans import carry, transform
from ninfer.convert.recipes.qwen3_5_vision import add_vision
from ninfer.convert.registry import recipe
from ninfer.convert.sources import Source
from ninfer.errors import ConversionError, GGUFError

ARCH = "qwen35"


@dataclass(frozen=True)
class Geometry:
    """Shape facts of a Qwen3.5 text model, under Hugging Face text_config key names."""

    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    full_attention_interval: int
    vocab_size: int


GEOMETRY_27B = {"hidden_size": 5120, "num_hidden_layers": 64, "intermediate_size": 17408,
                "num_attention_heads": 24, "num_key_value_heads": 4, "head_dim": 256,
                "linear_num_key_heads": 16, "linear_num_value_heads": 48, "linear_key_head_dim": 128,
                "linear_value_head_dim": 128, "vocab_size": 248320}  # fmt: skip
_HEADER_KEYS = {  # geometry key -> where the GGUF header says it
    "hidden_size": f"{ARCH}.embedding_length",
    "num_hidden_layers": f"{ARCH}.block_count - nextn_predict_layers",
    "intermediate_size": f"{ARCH}.feed_forward_length", "num_attention_heads": f"{ARCH}.attention.head_count",
    "num_key_value_heads": f"{ARCH}.attention.head_count_kv", "head_dim": f"{ARCH}.attention.key_length",
    "linear_num_key_heads": f"{ARCH}.ssm.group_count", "linear_num_value_heads": f"{ARCH}.ssm.time_step_rank",
    "linear_key_head_dim": f"{ARCH}.ssm.state_size",
    "linear_value_head_dim": f"{ARCH}.ssm.inner_size / time_step_rank",
    "linear_conv_kernel_dim": f"{ARCH}.ssm.conv_kernel",
    "full_attention_interval": f"{ARCH}.full_attention_interval", "vocab_size": "token_embd rows",
}  # fmt: skip


# ---- value-head order ---------------------------------------------------------------------------


def grouped_from_tiled(n_key_heads: int, n_value_heads: int) -> np.ndarray:
    """g[h] = the tiled (GGUF) value head holding grouped (HF) value head h."""
    ratio = n_value_heads // n_key_heads
    h = np.arange(n_value_heads)
    return (h % ratio) * n_key_heads + h // ratio


def head_rows(heads: np.ndarray, dim: int) -> np.ndarray:
    return (heads[:, None] * dim + np.arange(dim)[None, :]).reshape(-1)


def tiled_input_columns(n_key_heads: int, n_value_heads: int, dim: int) -> torch.Tensor:
    """input_columns[c]: the grouped-order input column that stored (tiled-order) column c multiplies."""
    ratio = n_value_heads // n_key_heads
    t = np.arange(n_value_heads)
    grouped_head = (t % n_key_heads) * ratio + t // n_key_heads
    return torch.from_numpy(head_rows(grouped_head, dim))


# ---- GGUF header -> geometry and text config ----------------------------------------------------


def _meta(src: Source, key: str):
    full = f"{ARCH}.{key}"
    if full not in src.metadata:
        raise GGUFError(f"{src.path}: GGUF header lacks {full}; is this a complete qwen35 GGUF?")
    return src.metadata[full]


def check_architecture(src: Source, recipe_name: str) -> None:
    arch = src.metadata.get("general.architecture")
    if arch != ARCH:
        raise GGUFError(
            f"{src.path} is a {arch!r} GGUF, but recipe {recipe_name} needs llama.cpp architecture "
            f"{ARCH!r} (Qwen3.5/3.6/3.8); use qwen2_gguf or llama_gguf for dense models"
        )


def gguf_geometry(src: Source) -> Geometry:
    value_heads = int(_meta(src, "ssm.time_step_rank"))
    return Geometry(
        hidden_size=int(_meta(src, "embedding_length")),
        num_hidden_layers=int(_meta(src, "block_count"))
        - int(src.metadata.get(f"{ARCH}.nextn_predict_layers", 0)),
        intermediate_size=int(_meta(src, "feed_forward_length")),
        num_attention_heads=int(_meta(src, "attention.head_count")),
        num_key_value_heads=int(_meta(src, "attention.head_count_kv")),
        head_dim=int(_meta(src, "attention.key_length")),
        linear_num_key_heads=int(_meta(src, "ssm.group_count")),
        linear_num_value_heads=value_heads,
        linear_key_head_dim=int(_meta(src, "ssm.state_size")),
        linear_value_head_dim=int(_meta(src, "ssm.inner_size")) // max(1, value_heads),
        linear_conv_kernel_dim=int(_meta(src, "ssm.conv_kernel")),
        full_attention_interval=int(_meta(src, "full_attention_interval")),
        vocab_size=src.tensor("token_embd.weight").shape[0],
    )


def config_from_header(src: Source, geo: Geometry) -> dict:
    """A Hugging Face style text_config built from the GGUF header (used when there is no config.json)."""
    md = src.metadata
    n = geo.num_hidden_layers
    recurrent = md.get(f"{ARCH}.attention.recurrent_layers")
    if recurrent:
        layer_types = ["linear_attention" if r else "full_attention" for r in recurrent[:n]]
    else:
        layer_types = [
            "full_attention" if (i + 1) % geo.full_attention_interval == 0 else "linear_attention"
            for i in range(n)
        ]
    sections = list(md.get(f"{ARCH}.rope.dimension_sections", [0, 0, 0]))[:3]
    rope_dim = int(md.get(f"{ARCH}.rope.dimension_count", geo.head_dim // 4))
    theta = float(md.get(f"{ARCH}.rope.freq_base", 1e7))
    config = {**asdict(geo), "model_type": "qwen3_5_text", "layer_types": layer_types,
              "rms_norm_eps": float(md.get(f"{ARCH}.attention.layer_norm_rms_epsilon", 1e-6)),
              "max_position_embeddings": int(md.get(f"{ARCH}.context_length", 262144)),
              "tie_word_embeddings": "output.weight" not in src.tensors,
              "mtp_num_hidden_layers": int(md.get(f"{ARCH}.nextn_predict_layers", 0)),
              "attn_output_gate": True, "hidden_act": "silu", "attention_bias": False,
              "rope_parameters": {"rope_type": "default", "rope_theta": theta,
                                  "partial_rotary_factor": rope_dim / geo.head_dim, "mrope_section": sections,
                                  "mrope_interleaved": True}}  # fmt: skip
    if "tokenizer.ggml.eos_token_id" in md:
        config["eos_token_id"] = int(md["tokenizer.ggml.eos_token_id"])
    return config


def check_geometry(config: dict, geo: Geometry, where: str, origin: str) -> None:
    """Every geometry key present in `config` must equal the source's value."""
    for key, found in asdict(geo).items():
        if key in config and int(config[key]) != found:
            raise ConversionError(
                f"geometry mismatch: {where} {key} = {config[key]} but {origin} has {found} "
                f"({_HEADER_KEYS.get(key, key)}); pass the config.json that belongs to this model"
            )


def guard_27b(geo: Geometry, recipe_name: str) -> None:
    for key, expected in GEOMETRY_27B.items():
        found = getattr(geo, key)
        if found != expected:
            raise ConversionError(
                f"recipe {recipe_name} needs the 27B geometry: {key} is {found}, expected "
                f"{expected}; use --recipe qwen3_5_gguf for other sizes"
            )


def text_config(job: ConversionJob, geo: Geometry, derived: dict | None, origin: str) -> dict:
    """config.json's text_config (cross-checked), else the header-derived one (with a warning)."""
    cfg = job.model_json("config.json")
    if cfg is None:
        if derived is None:
            where = f"--model {job.model_dir}" if job.model_dir else "no --model folder was given"
            raise ConversionError(
                f"config.json not found ({where}); pass --model DIR holding the HF config.json"
            )
        job.warn("no config.json in --model; the text config is derived from the GGUF header")
        config = dict(derived)
    else:
        config = dict(cfg.get("text_config", cfg))
        where = "config.json text_config" if "text_config" in cfg else "config.json"
        check_geometry(config, geo, where, origin)
    config.pop("architectures", None)
    config["architecture"] = "qwen3_5"
    return config


def text_resources(job: ConversionJob, gguf_src: Source | None) -> dict[str, bytes]:
    roles = {}
    for role in TEXT_RESOURCES:
        fallback = None
        if role == "chat_template.jinja":
            fallback = _template_fallback(job, gguf_src)
        roles[role] = job.resource_bytes(role, fallback=fallback)
    return roles


def _template_fallback(job: ConversionJob, gguf_src: Source | None) -> bytes | None:
    tok_cfg = job.model_json("tokenizer_config.json") or {}
    if isinstance(tok_cfg.get("chat_template"), str):
        return tok_cfg["chat_template"].encode("utf-8")
    if gguf_src is not None and isinstance(gguf_src.metadata.get("tokenizer.chat_template"), str):
        return gguf_src.metadata["tokenizer.chat_template"].encode("utf-8")
    return None


# ---- GGUF tensors -> logical parameters ---------------------------------------------------------


def _minus_one(x: torch.Tensor) -> torch.Tensor:
    return x - 1.0


def _norm(job: ConversionJob, name: str, src: Source, tensor: str) -> None:
    """llama.cpp stores zero-centred RMSNorm weights as 1 + w; the artifact holds w (f32)."""
    job.add(name, transform(src.tensor(tensor), _minus_one, "f32", "minus_one"))


def _a_log(job: ConversionJob, name: str, src: Source, tensor: str, rows: np.ndarray) -> None:
    t = src.tensor(tensor)
    raw = torch.from_numpy(t.read_all().copy()).view(torch.float32)
    if bool((raw >= 0).any()) and not any("ssm_a" in w for w in job.warnings):  # once per conversion
        job.warn(
            f"{tensor} has {int((raw >= 0).sum())} entries >= 0 (expected -exp(A_log) < 0; a synthetic "
            "file?); such entries get A_log = log(|ssm_a|) (other layers not reported)"
        )
    job.add(name, transform(t, lambda x: torch.log(x.abs().clamp_min(1e-30)), "f32", "a_log", rows=rows))


def _attention_layer(job: ConversionJob, src: Source, blk: str, prefix: str, geo: Geometry) -> None:
    d, heads = geo.head_dim, geo.num_attention_heads
    starts = np.arange(heads) * 2 * d
    query_rows = (starts[:, None] + np.arange(d)).reshape(-1)
    q = src.tensor(f"{blk}.attn_q.weight")
    if q.shape[0] != 2 * heads * d:
        raise ConversionError(
            f"{src.path}: {q.name} has {q.shape[0]} rows, expected {2 * heads * d} "
            "(per head: query then output gate)"
        )
    job.add(f"{prefix}/attention/query", carry(q, rows=query_rows))
    job.add(f"{prefix}/attention/gate", carry(q, rows=query_rows + d))
    job.add(f"{prefix}/attention/key", carry(src.tensor(f"{blk}.attn_k.weight")))
    job.add(f"{prefix}/attention/value", carry(src.tensor(f"{blk}.attn_v.weight")))
    job.add(f"{prefix}/attention/output", carry(src.tensor(f"{blk}.attn_output.weight")))
    _norm(job, f"{prefix}/attention/query_norm", src, f"{blk}.attn_q_norm.weight")
    _norm(job, f"{prefix}/attention/key_norm", src, f"{blk}.attn_k_norm.weight")


def _gdn_layer(job: ConversionJob, src: Source, blk: str, prefix: str, geo: Geometry) -> None:
    nk, nv = geo.linear_num_key_heads, geo.linear_num_value_heads
    dk, dv = geo.linear_key_head_dim, geo.linear_value_head_dim
    heads = grouped_from_tiled(nk, nv)
    qk = np.arange(2 * nk * dk)
    channel_rows = np.concatenate([qk, 2 * nk * dk + head_rows(heads, dv)])
    job.add_fused(
        carry(src.tensor(f"{blk}.attn_qkv.weight"), rows=channel_rows),
        [(f"{prefix}/gdn/query", nk * dk), (f"{prefix}/gdn/key", nk * dk), (f"{prefix}/gdn/value", nv * dv)],
    )
    job.add(f"{prefix}/gdn/z", carry(src.tensor(f"{blk}.attn_gate.weight"), rows=head_rows(heads, dv)))
    job.add(f"{prefix}/gdn/a_projection", carry(src.tensor(f"{blk}.ssm_alpha.weight"), rows=heads))
    job.add(f"{prefix}/gdn/b_projection", carry(src.tensor(f"{blk}.ssm_beta.weight"), rows=heads))
    job.add(f"{prefix}/gdn/dt_bias", carry(src.tensor(f"{blk}.ssm_dt.bias"), rows=heads))
    _a_log(job, f"{prefix}/gdn/a_log", src, f"{blk}.ssm_a", heads)
    job.add(f"{prefix}/gdn/convolution", carry(src.tensor(f"{blk}.ssm_conv1d.weight"), rows=channel_rows))
    job.add(f"{prefix}/gdn/norm", carry(src.tensor(f"{blk}.ssm_norm.weight")))
    job.add(f"{prefix}/gdn/output", carry(src.tensor(f"{blk}.ssm_out.weight")))
    job.use_input_columns(f"{prefix}/gdn/output", tiled_input_columns(nk, nv, dv))


def _block_common(job: ConversionJob, src: Source, blk: str, prefix: str) -> None:
    _norm(job, f"{prefix}/input_norm", src, f"{blk}.attn_norm.weight")
    _norm(job, f"{prefix}/post_attention_norm", src, f"{blk}.post_attention_norm.weight")
    for role, tensor in (("gate", "ffn_gate"), ("up", "ffn_up"), ("down", "ffn_down")):
        job.add(f"{prefix}/mlp/{role}", carry(src.tensor(f"{blk}.{tensor}.weight")))


def _gguf_text(job: ConversionJob, src: Source, geo: Geometry, config: dict) -> None:
    emb = job.add("text/token_embedding", carry(src.tensor("token_embd.weight")))
    if "output.weight" in src.tensors:
        job.add("text/output_head", carry(src.tensor("output.weight")))
    else:
        job.bind("text/output_head", emb)  # tied: one object, two names
    _norm(job, "text/final_norm", src, "output_norm.weight")
    for i, kind in enumerate(config["layer_types"]):
        blk, prefix = f"blk.{i}", f"text/layers/{i}"
        _block_common(job, src, blk, prefix)
        if kind == "full_attention":
            _attention_layer(job, src, blk, prefix, geo)
        else:
            _gdn_layer(job, src, blk, prefix, geo)


def _gguf_mtp(job: ConversionJob, src: Source, geo: Geometry) -> None:
    n = geo.num_hidden_layers
    blk = f"blk.{n}"
    if f"{blk}.nextn.eh_proj.weight" not in src.tensors:
        raise ConversionError(
            f"--source mtp={src.path} has no {blk}.nextn.* tensors (no MTP layer); pass an "
            "-mtp GGUF or drop mtp from --components"
        )
    job.add("mtp/input_projection", carry(src.tensor(f"{blk}.nextn.eh_proj.weight")))
    _norm(job, "mtp/embedding_norm", src, f"{blk}.nextn.enorm.weight")
    _norm(job, "mtp/hidden_norm", src, f"{blk}.nextn.hnorm.weight")
    _norm(job, "mtp/final_norm", src, f"{blk}.nextn.shared_head_norm.weight")
    _block_common(job, src, blk, "mtp/layers/0")
    _attention_layer(job, src, blk, "mtp/layers/0", geo)
    job.set_component("mtp", {"num_layers": 1, "layer_index": n}, {})


def _build_gguf(job: ConversionJob, recipe_name: str, require_27b: bool) -> None:
    src = job.source("gguf")
    if src.kind != "gguf":
        raise ConversionError(f"--source gguf={src.path} is not a GGUF file; pass the model's .gguf file")
    check_architecture(src, recipe_name)
    geo = gguf_geometry(src)
    if require_27b:
        guard_27b(geo, recipe_name)
    config = text_config(job, geo, config_from_header(src, geo), f"the GGUF header of {src.path.name}")
    _check_layer_types(config, geo)
    _gguf_text(job, src, geo, config)
    job.set_component("text", config, text_resources(job, src))
    if job.wants("mtp"):
        mtp = job.source("mtp")
        if mtp.kind != "gguf":
            raise ConversionError(f"--source mtp={mtp.path} is not a GGUF file; pass the -mtp GGUF")
        check_architecture(mtp, recipe_name)
        _gguf_mtp(job, mtp, geo)
    if job.wants("vision"):
        add_vision(job, job.model_json("config.json"), VISION_RESOURCES)
    name = src.metadata.get("general.name")
    job.set_metadata(architecture="qwen3_5", source_name=name)


def _check_layer_types(config: dict, geo: Geometry) -> None:
    layer_types = config.get("layer_types")
    if not layer_types:
        config["layer_types"] = [
            "full_attention" if (i + 1) % geo.full_attention_interval == 0 else "linear_attention"
            for i in range(geo.num_hidden_layers)
        ]
    elif len(layer_types) != geo.num_hidden_layers:
        raise ConversionError(
            f"geometry mismatch: config.json layer_types has {len(layer_types)} entries but "
            f"the model has {geo.num_hidden_layers} layers"
        )


@recipe(
    "qwen3_5_gguf",
    sources=("gguf", "mtp", "vision"),
    architecture="qwen3_5",
    description="any dense Qwen3.5/3.6/3.8 llama.cpp qwen35 GGUF (+ -mtp GGUF, + mmproj)",
)
def qwen3_5_gguf(job: ConversionJob) -> None:
    _build_gguf(job, "qwen3_5_gguf", require_27b=False)


@recipe(
    "qwen3_8_27b_gguf",
    sources=("gguf", "mtp", "vision"),
    architecture="qwen3_5",
    description="Qwen3.8-27B qwen35 GGUF, with a guard for the 27B geometry",
)
def qwen3_8_27b_gguf(job: ConversionJob) -> None:
    _build_gguf(job, "qwen3_8_27b_gguf", require_27b=True)


@recipe(
    "qwen3_6_27b_gguf",
    sources=("gguf", "mtp", "vision"),
    architecture="qwen3_5",
    description="Qwen3.6-27B qwen35 GGUF, with a guard for the 27B geometry",
)
def qwen3_6_27b_gguf(job: ConversionJob) -> None:
    _build_gguf(job, "qwen3_6_27b_gguf", require_27b=True)


# ---- Hugging Face safetensors -------------------------------------------------------------------


def _hf_geometry(config: dict, src: Source, prefix: str) -> Geometry:
    try:
        return Geometry(
            **{k: int(config[k]) for k in Geometry.__dataclass_fields__ if k != "vocab_size"},
            vocab_size=src.tensor(f"{prefix}embed_tokens.weight").shape[0],
        )
    except KeyError as exc:
        raise ConversionError(
            f"config.json text_config lacks {exc.args[0]}; pass the model's own config.json"
        ) from None


def _hf_attention(job: ConversionJob, src: Source, hf: str, prefix: str, geo: Geometry) -> None:
    d, heads = geo.head_dim, geo.num_attention_heads
    query_rows = (np.arange(heads)[:, None] * 2 * d + np.arange(d)).reshape(-1)
    q = src.tensor(f"{hf}.self_attn.q_proj.weight")
    job.add(f"{prefix}/attention/query", carry(q, rows=query_rows))
    job.add(f"{prefix}/attention/gate", carry(q, rows=query_rows + d))
    for role, name in (
        ("key", "k_proj"),
        ("value", "v_proj"),
        ("output", "o_proj"),
        ("query_norm", "q_norm"),
        ("key_norm", "k_norm"),
    ):
        job.add(f"{prefix}/attention/{role}", carry(src.tensor(f"{hf}.self_attn.{name}.weight")))


def _hf_gdn(job: ConversionJob, src: Source, hf: str, prefix: str, geo: Geometry) -> None:
    nk, nv = geo.linear_num_key_heads, geo.linear_num_value_heads
    dk, dv = geo.linear_key_head_dim, geo.linear_value_head_dim
    la = f"{hf}.linear_attn"
    job.add_fused(
        carry(src.tensor(f"{la}.in_proj_qkv.weight")),
        [(f"{prefix}/gdn/query", nk * dk), (f"{prefix}/gdn/key", nk * dk), (f"{prefix}/gdn/value", nv * dv)],
    )
    conv = src.tensor(f"{la}.conv1d.weight")
    job.add(f"{prefix}/gdn/convolution", carry(conv, shape=(conv.shape[0], conv.shape[-1])))
    for role, name in (
        ("z", "in_proj_z.weight"),
        ("a_projection", "in_proj_a.weight"),
        ("b_projection", "in_proj_b.weight"),
        ("a_log", "A_log"),
        ("dt_bias", "dt_bias"),
        ("norm", "norm.weight"),
        ("output", "out_proj.weight"),
    ):
        job.add(f"{prefix}/gdn/{role}", carry(src.tensor(f"{la}.{name}")))


def _hf_block(job: ConversionJob, src: Source, hf: str, prefix: str) -> None:
    job.add(f"{prefix}/input_norm", carry(src.tensor(f"{hf}.input_layernorm.weight")))
    job.add(f"{prefix}/post_attention_norm", carry(src.tensor(f"{hf}.post_attention_layernorm.weight")))
    for role in ("gate", "up", "down"):
        job.add(f"{prefix}/mlp/{role}", carry(src.tensor(f"{hf}.mlp.{role}_proj.weight")))


def _hf_prefix(src: Source) -> str:
    for prefix in ("model.language_model.", "model."):
        if f"{prefix}embed_tokens.weight" in src.tensors:
            return prefix
    raise ConversionError(
        f"{src.path}: no model.language_model.embed_tokens.weight; is this a Qwen3.5 safetensors checkpoint?"
    )


@recipe(
    "qwen3_5",
    sources=("safetensors", "mtp", "vision"),
    architecture="qwen3_5",
    description="Hugging Face Qwen3.5 safetensors (--source safetensors=DIR or the --model folder)",
)
def qwen3_5_hf(job: ConversionJob) -> None:
    if job.has_source("safetensors"):
        src = job.source("safetensors")
    elif job.model_dir is not None:
        from ninfer.convert.sources import open_safetensors

        src = job.sources.setdefault("safetensors", open_safetensors(job.model_dir))
    else:
        raise ConversionError(
            "recipe qwen3_5 needs --source safetensors=DIR or --model DIR with the checkpoint"
        )
    cfg = job.model_json("config.json")
    if cfg is None:
        raise ConversionError("config.json not found; pass --model DIR holding the checkpoint's config.json")
    config = dict(cfg.get("text_config", cfg))
    config.pop("architectures", None)
    prefix = _hf_prefix(src)
    geo = _hf_geometry(config, src, prefix)
    config["architecture"] = "qwen3_5"
    _check_layer_types(config, geo)
    emb = job.add("text/token_embedding", carry(src.tensor(f"{prefix}embed_tokens.weight")))
    if "lm_head.weight" in src.tensors and not config.get("tie_word_embeddings", False):
        job.add("text/output_head", carry(src.tensor("lm_head.weight")))
    else:
        job.bind("text/output_head", emb)
    job.add("text/final_norm", carry(src.tensor(f"{prefix}norm.weight")))
    for i, kind in enumerate(config["layer_types"]):
        hf, out = f"{prefix}layers.{i}", f"text/layers/{i}"
        _hf_block(job, src, hf, out)
        (_hf_attention if kind == "full_attention" else _hf_gdn)(job, src, hf, out, geo)
    job.set_component("text", config, text_resources(job, None))
    if job.wants("mtp"):
        _hf_mtp(job, job.source("mtp"), geo)
    if job.wants("vision"):
        add_vision(job, cfg, VISION_RESOURCES, hf_source=src)
    job.set_metadata(architecture="qwen3_5")


def _hf_mtp(job: ConversionJob, src: Source, geo: Geometry) -> None:
    if "mtp.fc.weight" not in src.tensors:
        raise ConversionError(
            f"--source mtp={src.path} has no mtp.* tensors; pass the checkpoint that has them "
            "or drop mtp from --components"
        )
    job.add("mtp/input_projection", carry(src.tensor("mtp.fc.weight")))
    for role, name in (
        ("embedding_norm", "pre_fc_norm_embedding"),
        ("hidden_norm", "pre_fc_norm_hidden"),
        ("final_norm", "norm"),
    ):
        job.add(f"mtp/{role}", carry(src.tensor(f"mtp.{name}.weight")))
    _hf_block(job, src, "mtp.layers.0", "mtp/layers/0")
    _hf_attention(job, src, "mtp.layers.0", "mtp/layers/0", geo)
    job.set_component("mtp", {"num_layers": 1, "layer_index": geo.num_hidden_layers}, {})

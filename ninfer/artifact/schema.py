"""Which logical parameters each component must bind, by the text architecture named in its config."""

from __future__ import annotations

ATTENTION_ROLES = ("query", "gate", "key", "value", "output", "query_norm", "key_norm")
GDN_ROLES = (
    "query",
    "key",
    "value",
    "z",
    "output",
    "a_projection",
    "b_projection",
    "a_log",
    "dt_bias",
    "convolution",
    "norm",
)
MLP_ROLES = ("gate", "up", "down")
DENSE_ATTENTION_ROLES = ("query", "key", "value", "output")
TEXT_ARCHITECTURES = ("qwen3_5", "qwen2", "llama")
TEXT_RESOURCES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")
VISION_RESOURCES = ("preprocessor_config.json", "video_preprocessor_config.json")
RESOURCE_ROLES = {"text": TEXT_RESOURCES, "vision": VISION_RESOURCES, "mtp": ()}
COMPONENTS = ("text", "vision", "mtp")


def qwen3_5_layer_types(config: dict) -> list[str]:
    n = int(config["num_hidden_layers"])
    if config.get("layer_types"):
        return list(config["layer_types"])
    interval = int(config.get("full_attention_interval", 4))
    return ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n)]


def _layer_block(
    prefix: str, attention_roles: tuple[str, ...], attention_kind: str = "attention"
) -> list[str]:
    names = [f"{prefix}/input_norm", f"{prefix}/post_attention_norm"]
    names += [f"{prefix}/mlp/{r}" for r in MLP_ROLES]
    names += [f"{prefix}/{attention_kind}/{r}" for r in attention_roles]
    return names


def required_text_bindings(config: dict) -> list[str]:
    """Names the text component of `config["architecture"]` must bind; KeyError if unknown."""
    arch = config.get("architecture")
    if arch not in TEXT_ARCHITECTURES:
        raise KeyError(arch)
    names = ["text/token_embedding", "text/output_head", "text/final_norm"]
    if arch == "qwen3_5":
        for i, kind in enumerate(qwen3_5_layer_types(config)):
            if kind == "full_attention":
                names += _layer_block(f"text/layers/{i}", ATTENTION_ROLES)
            else:
                names += _layer_block(f"text/layers/{i}", GDN_ROLES, "gdn")
    else:
        for i in range(int(config["num_hidden_layers"])):
            names += _layer_block(f"text/layers/{i}", DENSE_ATTENTION_ROLES)
    return names


def required_mtp_bindings(config: dict) -> list[str]:
    names = [f"mtp/{r}" for r in ("input_projection", "embedding_norm", "hidden_norm", "final_norm")]
    for i in range(int(config.get("num_layers", 1))):
        names += _layer_block(f"mtp/layers/{i}", ATTENTION_ROLES)
    return names


def required_vision_bindings(config: dict) -> list[str]:
    names = [
        "vision/patch_embedding/weight",
        "vision/position_embedding",
        "vision/merger/fc1/weight",
        "vision/merger/fc2/weight",
    ]
    for i in range(int(config.get("depth", 0))):
        names += [
            f"vision/layers/{i}/attention/qkv/weight",
            f"vision/layers/{i}/attention/output/weight",
            f"vision/layers/{i}/mlp/fc1/weight",
            f"vision/layers/{i}/mlp/fc2/weight",
        ]
    return names

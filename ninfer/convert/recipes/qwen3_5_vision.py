"""The Qwen3.5 vision tower from an mmproj GGUF (`clip`, qwen3vl_merger) or HF `model.visual.*` tensors.

Both sources land on the same logical names (HF module structure); the mmproj's two Conv2d patch kernels
(temporal slices) are re-joined into HF's Conv3d kernel [hidden, 3, 2, P, P].
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ninfer.convert.job import ConversionJob
from ninfer.convert.plans import TensorPlan, carry, read_gathered
from ninfer.convert.sources import Source
from ninfer.errors import ConversionError, GGUFError

_TOKEN_KEYS = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
# logical suffix -> (mmproj name, HF name) per block and for the tower
_BLOCK = {"attention/qkv": ("attn_qkv", "attn.qkv"), "attention/output": ("attn_out", "attn.proj"),
          "mlp/fc1": ("ffn_up", "mlp.linear_fc1"), "mlp/fc2": ("ffn_down", "mlp.linear_fc2"),
          "norm1": ("ln1", "norm1"), "norm2": ("ln2", "norm2")}  # fmt: skip
_TOWER = {"patch_embedding/bias": ("v.patch_embd.bias", "patch_embed.proj.bias"),
          "merger/norm/weight": ("v.post_ln.weight", "merger.norm.weight"),
          "merger/norm/bias": ("v.post_ln.bias", "merger.norm.bias"),
          "merger/fc1/weight": ("mm.0.weight", "merger.linear_fc1.weight"),
          "merger/fc1/bias": ("mm.0.bias", "merger.linear_fc1.bias"),
          "merger/fc2/weight": ("mm.2.weight", "merger.linear_fc2.weight"),
          "merger/fc2/bias": ("mm.2.bias", "merger.linear_fc2.bias")}  # fmt: skip


def add_vision(
    job: ConversionJob, cfg: dict | None, roles: Sequence[str], hf_source: Source | None = None
) -> None:
    """Add the vision component: tensors, config (HF vision_config, else the mmproj header), resources."""
    resources = {role: _vision_resource(job, role) for role in roles}
    if job.has_source("vision"):
        src = job.source("vision")
    elif hf_source is not None and any(n.startswith("model.visual.") for n in hf_source.tensors):
        src = hf_source
    else:
        raise ConversionError(
            "vision is in --components but no --source vision=PATH (the mmproj GGUF) was given"
        )
    if src.kind == "gguf":
        header_config = _mmproj_config(src)
        config = dict((cfg or {}).get("vision_config") or header_config)
        _cross_check(config, header_config, src)
        _mmproj_tensors(job, src, config)
    else:
        if not cfg or "vision_config" not in cfg:
            raise ConversionError(
                "config.json has no vision_config; pass --model DIR with the full HF config.json"
            )
        config = dict(cfg["vision_config"])
        _hf_tensors(job, src, config)
    for key in _TOKEN_KEYS:
        if cfg and key in cfg:
            config[key] = cfg[key]
    job.set_component("vision", config, resources)


def _vision_resource(job: ConversionJob, role: str) -> bytes:
    try:
        return job.resource_bytes(role)
    except ConversionError as exc:
        raise ConversionError(f"vision needs {role}: {exc}") from None


def _mmproj_config(src: Source) -> dict:
    md = src.metadata
    if md.get("general.architecture") != "clip" or not md.get("clip.has_vision_encoder"):
        raise GGUFError(
            f"--source vision={src.path} is not an mmproj (clip) GGUF with a vision encoder; "
            "pass the model's mmproj-*.gguf"
        )
    projector = md.get("clip.projector_type") or md.get("clip.vision.projector_type")
    if projector != "qwen3vl_merger":
        raise GGUFError(f"{src.path}: projector type {projector!r} is not qwen3vl_merger (Qwen3.5 vision)")
    try:
        return {"depth": int(md["clip.vision.block_count"]),
                "hidden_size": int(md["clip.vision.embedding_length"]),
                "intermediate_size": int(md["clip.vision.feed_forward_length"]),
                "num_heads": int(md["clip.vision.attention.head_count"]),
                "out_hidden_size": int(md["clip.vision.projection_dim"]),
                "patch_size": int(md["clip.vision.patch_size"]),
                "spatial_merge_size": int(md.get("clip.vision.spatial_merge_size", 2)),
                "temporal_patch_size": 2 if "v.patch_embd.weight.1" in src.tensors else 1,
                "num_position_embeddings": src.tensor("v.position_embd.weight").shape[0],
                "in_channels": 3, "hidden_act": "gelu_pytorch_tanh" if md.get("clip.use_gelu") else "silu",
                "deepstack_visual_indexes": [], "model_type": "qwen3_5"}  # fmt: skip
    except KeyError as exc:
        raise GGUFError(f"{src.path}: mmproj header lacks {exc.args[0]}; is the file complete?") from None


def _cross_check(config: dict, header: dict, src: Source) -> None:
    for key in ("depth", "hidden_size", "intermediate_size", "num_heads", "out_hidden_size", "patch_size"):
        if key in config and int(config[key]) != header[key]:
            raise ConversionError(
                f"geometry mismatch: config.json vision_config {key} = {config[key]} but "
                f"{src.path.name} has {header[key]}; pass the mmproj that belongs to this model"
            )


def _expect_shape(src: Source, name: str, shape: tuple[int, ...]) -> None:
    found = src.tensor(name).shape
    if tuple(found) != shape:
        raise GGUFError(
            f"{src.path}: {name} has shape {list(found)}, expected {list(shape)} for this vision config"
        )


def _mmproj_tensors(job: ConversionJob, src: Source, config: dict) -> None:
    hidden, depth = int(config["hidden_size"]), int(config["depth"])
    inter, out = int(config["intermediate_size"]), int(config["out_hidden_size"])
    merged = hidden * int(config.get("spatial_merge_size", 2)) ** 2
    for i in range(depth):
        b = f"v.blk.{i}"
        _expect_shape(src, f"{b}.attn_qkv.weight", (3 * hidden, hidden))
        _expect_shape(src, f"{b}.ffn_up.weight", (inter, hidden))
        for suffix, (gguf_name, _) in _BLOCK.items():
            for kind in ("weight", "bias"):
                job.add(f"vision/layers/{i}/{suffix}/{kind}", carry(src.tensor(f"{b}.{gguf_name}.{kind}")))
    _expect_shape(src, "mm.0.weight", (merged, merged))
    _expect_shape(src, "mm.2.weight", (out, merged))
    for logical, (gguf_name, _) in _TOWER.items():
        job.add(f"vision/{logical}", carry(src.tensor(gguf_name)))
    job.add("vision/position_embedding", carry(src.tensor("v.position_embd.weight")))
    job.add("vision/patch_embedding/weight", _joined_patch_kernel(src))
    extra = sorted(n for n in src.tensors if n.startswith("v.blk.") and int(n.split(".")[2]) >= depth)
    if extra:
        raise GGUFError(
            f"{src.path}: has blocks beyond depth {depth} ({extra[0]}, ...); mmproj and config disagree"
        )


def _joined_patch_kernel(src: Source) -> TensorPlan:
    """mmproj stores Conv3d's two temporal slices as Conv2d kernels; join them as [hidden, C, 2, P, P]."""
    slices = [src.tensor("v.patch_embd.weight")]
    if "v.patch_embd.weight.1" in src.tensors:
        slices.append(src.tensor("v.patch_embd.weight.1"))
    first = slices[0]
    if any(s.format != first.format or s.shape != first.shape for s in slices):
        raise GGUFError(f"{src.path}: the patch embedding slices differ in shape or type")
    hidden, channels, p1, p2 = first.shape
    itemsize = first.row_bytes // (channels * p1 * p2)

    def produce(b: int, e: int) -> np.ndarray:
        parts = [read_gathered(s, None, b, e).reshape(e - b, channels, 1, p1 * p2 * itemsize) for s in slices]
        return np.concatenate(parts, axis=2)

    shape = (hidden, channels, len(slices), p1, p2)
    return TensorPlan(first.format, shape, produce, ("patch_kernel", str(src.path)))


def _hf_tensors(job: ConversionJob, src: Source, config: dict) -> None:
    v = "model.visual."
    for i in range(int(config["depth"])):
        for suffix, (_, hf_name) in _BLOCK.items():
            for kind in ("weight", "bias"):
                job.add(
                    f"vision/layers/{i}/{suffix}/{kind}", carry(src.tensor(f"{v}blocks.{i}.{hf_name}.{kind}"))
                )
    for logical, (_, hf_name) in _TOWER.items():
        job.add(f"vision/{logical}", carry(src.tensor(v + hf_name)))
    job.add("vision/position_embedding", carry(src.tensor(v + "pos_embed.weight")))
    job.add("vision/patch_embedding/weight", carry(src.tensor(v + "patch_embed.proj.weight")))

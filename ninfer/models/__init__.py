"""Models: the Qwen3.5 hybrid (`qwen3_5`), its MTP head (`mtp`), dense Qwen2/Llama (`dense`).

`load_model(artifact)` builds the model the artifact's text config names. Every model exposes
`forward(input_ids [T], positions [T] | [3, T], ctx) -> hidden [T, H]`, `compute_logits(hidden)`,
`cache_spec` (what the engine allocates per sequence) and `mtp` (the MTP head or None).
"""

from __future__ import annotations

import dataclasses

import torch

from ninfer.errors import ArtifactError
from ninfer.models.cache_spec import CacheSpec
from ninfer.models.dense import DenseModel
from ninfer.models.mtp import MtpHead
from ninfer.models.qwen3_5 import Qwen35Model
from ninfer.models.weights import WeightSource, quantized_linears

__all__ = ["CacheSpec", "DenseModel", "MtpHead", "Qwen35Model", "load_model"]

COMPUTE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def load_model(
    artifact,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    load_mtp: bool = True,
    quantized_weights: bool = False,
):
    """Build the text model (and its MTP head when the artifact has one and `load_mtp`).

    `artifact` is a `ninfer.artifact.Artifact` (or any WeightSource with `components`). By default
    quantized weights are dequantised once to `dtype` (the CPU reference); with `quantized_weights`
    the projections keep their GGUF blocks on `device` and multiply through the quantized matmul
    kernel. Embeddings, norms and small vectors are always dense (small vectors fp32).
    """
    with quantized_linears(quantized_weights):
        return _build(artifact, dtype, device, load_mtp)


def _build(artifact, dtype: torch.dtype, device, load_mtp: bool):
    if dtype not in COMPUTE_DTYPES:
        raise ArtifactError(f"compute dtype {dtype} is not supported; use float32 or bfloat16")
    source: WeightSource = artifact
    config = dict(artifact.components["text"].config)
    arch = config.get("architecture", "qwen3_5")
    if arch == "qwen3_5":
        model = Qwen35Model(source, config, dtype, device)
        if load_mtp and "mtp" in artifact.components:
            model.mtp = MtpHead(source, model, dtype, device)
            model.cache_spec = dataclasses.replace(model.cache_spec, mtp_kv_layers=1)
    elif arch in ("qwen2", "llama"):
        model = DenseModel(source, config, dtype, device)
    else:
        raise ArtifactError(
            f"text architecture {arch!r} is not supported (known: qwen3_5, qwen2, llama); "
            "re-convert the model with a supported recipe"
        )
    return model.eval()

"""GGUF block formats: geometry (`FORMATS`), byte sizes and the reference PyTorch dequantisation."""

from ninfer.quant.dequant import dequantize
from ninfer.quant.formats import (
    FORMATS,
    PLAIN_FORMATS,
    BlockFormat,
    artifact_format_for_ggml_type,
    block_format,
    row_bytes,
    tensor_bytes,
)

__all__ = [
    "FORMATS",
    "PLAIN_FORMATS",
    "BlockFormat",
    "artifact_format_for_ggml_type",
    "block_format",
    "dequantize",
    "row_bytes",
    "tensor_bytes",
]

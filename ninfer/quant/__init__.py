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
from ninfer.quant.tables import IQ4_LEVELS, IQ_GRID_SHAPES, iq_grid, iq_sign_codes

__all__ = [
    "FORMATS",
    "IQ4_LEVELS",
    "IQ_GRID_SHAPES",
    "PLAIN_FORMATS",
    "BlockFormat",
    "artifact_format_for_ggml_type",
    "block_format",
    "dequantize",
    "iq_grid",
    "iq_sign_codes",
    "row_bytes",
    "tensor_bytes",
]

"""Lookup tables of the i-quant formats (facts of GGUF): iq lattices, sign codes and the iq4 levels.

Every table is float32 on the CPU, built once and shared: treat it as read-only (copy it to a device
with `.to(device)`). GPU kernels read the same tables so they decode exactly as `dequantize` does.
"""

from __future__ import annotations

import functools

import torch

# iq4_nl / iq4_xs: the 16 non-uniform 4-bit levels a nibble selects.
IQ4_LEVELS = torch.tensor(
    [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=torch.float32
)

# format -> (entries, elements per entry) of its lattice
IQ_GRID_SHAPES = {
    "iq2_xxs": (256, 8),
    "iq2_xs": (512, 8),
    "iq2_s": (1024, 8),
    "iq3_xxs": (256, 4),
    "iq3_s": (512, 4),
}


@functools.cache
def iq_grid(name: str) -> torch.Tensor:
    """The lattice of an i-quant format as float32 `IQ_GRID_SHAPES[name]`: a grid index selects a row of
    4 or 8 small positive magnitudes. Built from the gguf package's published tables."""
    from gguf import quants

    source = {
        "iq2_xxs": quants.IQ2_XXS,
        "iq2_xs": quants.IQ2_XS,
        "iq2_s": quants.IQ2_S,
        "iq3_xxs": quants.IQ3_XXS,
        "iq3_s": quants.IQ3_S,
    }[name]
    source.init_grid()
    grid = torch.from_numpy(source.grid.reshape(source.grid_shape).copy()).to(torch.float32)
    assert tuple(grid.shape) == IQ_GRID_SHAPES[name], (name, grid.shape)
    return grid


@functools.cache
def byte_signs() -> torch.Tensor:
    """`[256, 8]`: row b holds -1.0 where bit j of b is set and +1.0 where it is clear."""
    bits = (torch.arange(256).unsqueeze(-1) >> torch.arange(8)) & 1
    return 1.0 - 2.0 * bits.to(torch.float32)


@functools.cache
def iq_sign_codes() -> torch.Tensor:
    """`[128, 8]`: the 8 signs a 7-bit iq2/iq3 sign code stands for. Bits 0..6 are the signs of elements
    0..6 (set = negative); element 7's sign makes the number of negative signs even."""
    codes = torch.arange(128)
    parity = sum((codes >> bit) & 1 for bit in range(7)) & 1
    return byte_signs()[codes | (parity << 7)]

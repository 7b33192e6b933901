"""Building blocks shared by the model files: RMSNorm and the SwiGLU MLP."""

from __future__ import annotations

import torch
from torch import nn

from ninfer.kernels import reference as ops
from ninfer.models.weights import Linear, WeightSource, load_vector


class RMSNorm(nn.Module):
    """`x/rms·(1+w)` when zero-centred (Qwen3.5), `x/rms·w` otherwise (Qwen2/Llama, GDN output norm)."""

    def __init__(self, source: WeightSource, name: str, eps: float, zero_centred: bool, device):
        super().__init__()
        self.weight = nn.Buffer(load_vector(source, name, device))
        self.eps = eps
        self.zero_centred = zero_centred

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, self.eps, self.zero_centred)


class SwiGLUMLP(nn.Module):
    """down(silu(gate(x)) · up(x)); weights under `{prefix}/mlp/{gate,up,down}`."""

    def __init__(self, source: WeightSource, prefix: str, dtype: torch.dtype, device):
        super().__init__()
        self.gate = Linear(source, f"{prefix}/mlp/gate", dtype, device)
        self.up = Linear(source, f"{prefix}/mlp/up", dtype, device)
        self.down = Linear(source, f"{prefix}/mlp/down", dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(ops.swiglu(self.gate(x), self.up(x)))

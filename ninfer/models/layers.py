"""Building blocks shared by the model files: RMSNorm (with the fused residual add) and the SwiGLU MLP."""

from __future__ import annotations

import torch
from torch import nn

from ninfer.kernels import ops
from ninfer.models.weights import Linear, MergedLinear, WeightSource, load_vector, merging_projections


class RMSNorm(nn.Module):
    """`x/rms·(1+w)` when zero-centred (Qwen3.5), `x/rms·w` otherwise (Qwen2/Llama, GDN output norm)."""

    def __init__(self, source: WeightSource, name: str, eps: float, zero_centred: bool, device):
        super().__init__()
        self.weight = nn.Buffer(load_vector(source, name, device))
        self.eps = eps
        self.zero_centred = zero_centred

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, self.eps, self.zero_centred)

    def add_forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, group: int = 32
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`(norm(residual + x), residual + x)` fused; residual None (first layer): `(norm(x), x)`. `group`:
        the next Linear's `activation_group()`."""
        return ops.add_rms_norm(x, residual, self.weight, self.eps, self.zero_centred, group)


class SwiGLUMLP(nn.Module):
    """down(silu(gate(x)) · up(x)); weights under `{prefix}/mlp/{gate,up,down}`. In quantized mode gate|up
    run as one merged matmul (`gate_up`)."""

    def __init__(self, source: WeightSource, prefix: str, dtype: torch.dtype, device):
        super().__init__()
        gate, up = f"{prefix}/mlp/gate", f"{prefix}/mlp/up"
        if merging_projections():
            self.gate_up = MergedLinear(source, [[gate], [up]], dtype, device)
        else:
            self.gate_up = None
            self.gate = Linear(source, gate, dtype, device)
            self.up = Linear(source, up, dtype, device)
        self.down = Linear(source, f"{prefix}/mlp/down", dtype, device)

    def input_group(self) -> int:
        """The int8 activation grouping its first matmul reads (`Linear.activation_group`)."""
        return (self.gate_up if self.gate_up is not None else self.gate).activation_group()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x) if self.gate_up is not None else (self.gate(x), self.up(x))
        return self.down(ops.swiglu(gate, up, self.down.activation_group()))

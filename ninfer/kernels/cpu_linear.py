"""Int8 weight-only linears for CPU decode: weights requantised to int8 with one scale per output row.

Decode on CPU is memory-bound; int8 halves the bytes read per token compared with bf16. The fast path is
PyTorch's `_weight_int8pack_mm` (bf16 activations); `int8_linear_reference` is the plain-PyTorch version
the tests hold it against, and the fallback where the op is missing.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Activations of the int8 path are bf16 whatever the compute dtype: the op's fp32 path is 5-7x slower.
ACTIVATION_DTYPE = torch.bfloat16


def quantize_rows_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] float -> (int8 [out, in], bf16 scales [out]) with `weight ≈ q * scale[:, None]`.

    Symmetric, absmax per row over 127; the scale is rounded to bf16 first so that `q` is computed against
    the scale the kernel will actually use. All-zero rows get scale 1 (q = 0).
    """
    w = weight.float()
    scale = (w.abs().amax(dim=1) / 127.0).to(ACTIVATION_DTYPE)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(w / scale.float()[:, None]).clamp_(-127, 127).to(torch.int8)
    return q.contiguous(), scale.contiguous()


def dequantize_rows_int8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The float32 matrix an int8 linear multiplies by (the tests' reference weights)."""
    return q.float() * scale.float()[:, None]


def int8_linear_reference(
    x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """`x @ (q * scale)ᵀ (+ bias)` in plain PyTorch: bf16 activations like the fast path, fp32 accumulation,
    one rounding of the result to bf16."""
    x = x.to(ACTIVATION_DTYPE).float()
    y = F.linear(x, q.float()) * scale.float()
    return (y if bias is None else y + bias.float()).to(ACTIVATION_DTYPE)


def _int8pack_mm_fits(q: torch.Tensor) -> bool:
    """The op exists here and handles this shape: torch 2.13's CPU kernel reads past the row end when the
    input width is not a multiple of 8 (garbage for 1 row, a crash for several), so those use the reference.
    """
    return q.device.type == "cpu" and q.shape[1] % 8 == 0 and hasattr(torch.ops.aten, "_weight_int8pack_mm")


def int8_linear(
    x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """`x [..., in] @ (q * scale)ᵀ (+ bias)` -> bf16 [..., out] through `_weight_int8pack_mm` on CPU."""
    if not _int8pack_mm_fits(q):
        return int8_linear_reference(x, q, scale, bias)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1]).to(ACTIVATION_DTYPE).contiguous()
    y = torch.ops.aten._weight_int8pack_mm(x2, q, scale).reshape(*lead, q.shape[0])
    return y if bias is None else y + bias.to(y.dtype)

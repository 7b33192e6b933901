"""Gated DeltaNet state slots: recurrent state (fp32, or fp16 with --gdn-state-fp16) + conv state per lane."""

from __future__ import annotations

import math

import torch

from ninfer.models.cache_spec import CacheSpec


class GdnStatePool:
    """Per GDN layer: conv `[slots, conv_channels, kernel-1]` (fp32) and recurrent `[slots, Hv, Dk, Dv]`."""

    def __init__(self, spec: CacheSpec, slots: int, fp16: bool = False, device: str | torch.device = "cpu"):
        self.spec = spec
        self.slots = slots
        self.recurrent_dtype = torch.float16 if fp16 else torch.float32
        self.conv = [torch.zeros(slots, *spec.conv_state_shape, device=device)
                     for _ in range(spec.num_gdn_layers)]
        self.recurrent = [
            torch.zeros(slots, *spec.recurrent_state_shape, dtype=self.recurrent_dtype, device=device)
            for _ in range(spec.num_gdn_layers)
        ]

    @staticmethod
    def bytes_per_slot(spec: CacheSpec, fp16: bool) -> int:
        conv, recurrent = math.prod(spec.conv_state_shape), math.prod(spec.recurrent_state_shape)
        return spec.num_gdn_layers * (conv * 4 + recurrent * (2 if fp16 else 4))

    @property
    def total_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.conv + self.recurrent)

    def reset(self, slot: int) -> None:
        """A new sequence starts from zero state."""
        for t in self.conv + self.recurrent:
            t[slot].zero_()

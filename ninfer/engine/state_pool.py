"""Gated DeltaNet state slots: recurrent state (fp32, or fp16 with --gdn-state-fp16) + conv state per lane."""

from __future__ import annotations

import math

import torch

from ninfer.models.cache_spec import CacheSpec


class GdnStatePool:
    """Per GDN layer: conv `[slots + 1, conv_channels, kernel-1]` (fp32), recurrent `[slots + 1, Hv, Dk, Dv]`;
    slot `slots` is the scratch slot of padded graph batches."""

    def __init__(self, spec: CacheSpec, slots: int, fp16: bool = False, device: str | torch.device = "cpu"):
        self.spec = spec
        self.slots = slots
        self.scratch_slot = slots  # one slot more: the padding lane of a CUDA-graph decode batch
        self.recurrent_dtype = torch.float16 if fp16 else torch.float32
        self.conv = [torch.zeros(slots + 1, *spec.conv_state_shape, device=device)
                     for _ in range(spec.num_gdn_layers)]
        self.recurrent = [
            torch.zeros(slots + 1, *spec.recurrent_state_shape, dtype=self.recurrent_dtype, device=device)
            for _ in range(spec.num_gdn_layers)
        ]

    @staticmethod
    def bytes_per_slot(spec: CacheSpec, fp16: bool) -> int:
        conv, recurrent = math.prod(spec.conv_state_shape), math.prod(spec.recurrent_state_shape)
        return spec.num_gdn_layers * (conv * 4 + recurrent * (2 if fp16 else 4))

    @property
    def total_bytes(self) -> int:
        """Bytes of the lanes' slots (the scratch slot adds one slot more)."""
        return sum(t[: self.slots].numel() * t.element_size() for t in self.conv + self.recurrent)

    def reset(self, slot: int) -> None:
        """A new sequence starts from zero state."""
        for t in self.conv + self.recurrent:
            t[slot].zero_()

"""What a model needs the engine to allocate: KV layers and Gated DeltaNet state, per sequence."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CacheSpec:
    """Per-sequence cache geometry of a model.

    KV: `num_kv_layers` full-attention layers of the text model (ids 0..n-1), each storing `kv_heads` ×
    `head_dim` keys and values per token; with the MTP head loaded, `mtp_kv_layers` (1) more, whose id
    is `num_kv_layers`. GDN: `num_gdn_layers` layers, each with a conv state [gdn_conv_channels,
    gdn_conv_kernel-1] and a recurrent state [gdn_value_heads, gdn_key_dim, gdn_value_dim].
    """

    num_kv_layers: int
    kv_heads: int
    head_dim: int
    num_gdn_layers: int = 0
    gdn_conv_channels: int = 0
    gdn_conv_kernel: int = 0
    gdn_key_heads: int = 0
    gdn_value_heads: int = 0
    gdn_key_dim: int = 0
    gdn_value_dim: int = 0
    mtp_kv_layers: int = 0

    @property
    def total_kv_layers(self) -> int:
        """KV layers to allocate when the MTP head is used (its layer id is `num_kv_layers`)."""
        return self.num_kv_layers + self.mtp_kv_layers

    @property
    def conv_state_shape(self) -> tuple[int, int]:
        return (self.gdn_conv_channels, max(self.gdn_conv_kernel - 1, 0))

    @property
    def recurrent_state_shape(self) -> tuple[int, int, int]:
        return (self.gdn_value_heads, self.gdn_key_dim, self.gdn_value_dim)

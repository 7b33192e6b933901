"""What the engine must allocate for a model: full-attention KV layers and Gated DeltaNet state shapes."""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass(frozen=True)
class CacheSpec:
    kv_layers: int
    kv_heads: int
    head_dim: int
    gdn_layers: int = 0
    conv_channels: int = 0
    conv_kernel: int = 4
    value_heads: int = 0
    key_dim: int = 0
    value_dim: int = 0

    @property
    def conv_state_elems(self) -> int:
        return self.conv_channels * max(self.conv_kernel - 1, 0)

    @property
    def recurrent_state_elems(self) -> int:
        return self.value_heads * self.key_dim * self.value_dim


_ALIASES = {
    "kv_layers": ("kv_layers", "num_kv_layers", "n_kv_layers"),
    "kv_heads": ("kv_heads", "num_kv_heads", "num_key_value_heads"),
    "head_dim": ("head_dim",),
    "gdn_layers": ("gdn_layers", "num_gdn_layers", "n_gdn_layers"),
    "conv_channels": ("conv_channels", "gdn_conv_channels"),
    "conv_kernel": ("conv_kernel", "gdn_conv_kernel", "conv_kernel_size"),
    "value_heads": ("value_heads", "gdn_value_heads", "num_value_heads"),
    "key_dim": ("key_dim", "gdn_key_dim", "key_head_dim"),
    "value_dim": ("value_dim", "gdn_value_dim", "value_head_dim"),
}


def cache_spec_of(model: object) -> CacheSpec:
    """Read the model's `cache_spec` (any object with these fields, under common names) into a CacheSpec."""
    spec = getattr(model, "cache_spec", model)
    if isinstance(spec, CacheSpec):
        return spec
    values = {}
    for f in fields(CacheSpec):
        for name in _ALIASES[f.name]:
            if hasattr(spec, name):
                values[f.name] = int(getattr(spec, name))
                break
    return CacheSpec(**values)

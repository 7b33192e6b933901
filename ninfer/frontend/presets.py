"""Default sampling settings per model and mode, with request values overriding them.

Precedence, lowest first: `SamplingParams` defaults < `generation_config.json` < the mode preset (only for
models whose chat template has the `enable_thinking` switch: Qwen's published settings for thinking and
non-thinking mode) < the request's own values.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from ninfer.engine.api import SamplingParams

THINKING_PRESET: dict[str, Any] = {"temperature": 1.0, "top_p": 0.95, "top_k": 20}
NON_THINKING_PRESET: dict[str, Any] = {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "presence_penalty": 1.5}

# generation_config.json keys that map one-to-one onto SamplingParams fields
_GENERATION_CONFIG_FIELDS = (
    "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty",
)
_FIELDS = {f.name for f in dataclasses.fields(SamplingParams)}


def generation_config_defaults(generation_config: Mapping[str, Any] | None) -> dict[str, Any]:
    """SamplingParams fields set by a generation_config.json (`do_sample: false` means greedy)."""
    config = generation_config or {}
    values: dict[str, Any] = {}
    for name in _GENERATION_CONFIG_FIELDS:
        value = config.get(name)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            values[name] = int(value) if name == "top_k" else float(value)
    if config.get("do_sample") is False:
        values["temperature"] = 0.0
    return values


@dataclasses.dataclass(frozen=True)
class SamplingPresets:
    """The model's default sampling per mode; `resolve` applies a request's overrides."""

    thinking: Mapping[str, Any]
    non_thinking: Mapping[str, Any]

    @classmethod
    def for_model(
        cls, generation_config: Mapping[str, Any] | None, supports_thinking: bool
    ) -> SamplingPresets:
        base = generation_config_defaults(generation_config)
        if not supports_thinking:
            return cls(thinking=base, non_thinking=base)
        return cls(thinking={**base, **THINKING_PRESET}, non_thinking={**base, **NON_THINKING_PRESET})

    def defaults(self, thinking: bool = True) -> dict[str, Any]:
        return dict(self.thinking if thinking else self.non_thinking)

    def resolve(self, thinking: bool = True, **request: Any) -> SamplingParams:
        """SamplingParams from the mode's defaults and the request's fields (None means "not given")."""
        unknown = set(request) - _FIELDS
        if unknown:
            raise TypeError(f"not SamplingParams fields: {sorted(unknown)}")
        values = self.defaults(thinking)
        values.update({k: v for k, v in request.items() if v is not None})
        if "stop_token_ids" in values:
            values["stop_token_ids"] = tuple(values["stop_token_ids"])
        return SamplingParams(**values)

"""The model behind the server, as the HTTP routes need it: text in, token ids, prompts and generations out.

`Backend` is the seam; `EngineBackend` (in `engine_backend.py`) implements it with the engine and the
frontend. Routes never touch engine objects directly.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from ninfer.engine.api import SamplingParams
from ninfer.serve.generation import GenerateOptions, Generation


@dataclass(frozen=True)
class ModelInfo:
    model_id: str
    max_context: int
    created: int
    modalities: tuple[str, ...] = ("text",)
    owned_by: str = "ninfer"
    chat_template: str = ""
    extra: dict[str, Any] = field(default_factory=dict)  # artifact metadata shown by /props


class Backend(Protocol):
    info: ModelInfo

    def tokenize(self, text: str, add_special: bool = False) -> list[int]: ...

    def detokenize(self, ids: list[int]) -> str: ...

    def token_piece(self, token_id: int) -> str: ...

    def vocab_size(self) -> int: ...

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        add_generation_prompt: bool,
        template_kwargs: dict[str, Any],
    ) -> str:
        """The prompt exactly as the chat template renders it (raises RequestError on template errors)."""
        ...

    def starts_in_reasoning(self, prompt: str) -> bool:
        """True when the rendered prompt leaves the model inside an open <think> block."""
        ...

    def sampling_defaults(self, thinking: bool | None) -> SamplingParams:
        """The model's presets for thinking / non-thinking chat; None (raw text completion): only
        generation_config.json's values, no chat-mode preset."""
        ...

    def generate(self, request_id: str, prompt_ids: list[int], options: GenerateOptions) -> Generation:
        """Submit to the engine (raises RequestError when refused) and return the not-yet-started stream."""
        ...

    def stats(self) -> Any: ...

    def memory_ledger(self) -> Any: ...

    def shutdown(self) -> None: ...

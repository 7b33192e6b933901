"""One object for the text side of a model: build prompts, pick sampling defaults, stream the answer.

`TextFrontend.from_artifact(artifact)` gathers the tokenizer, chat template and sampling presets; the CLI
and the HTTP server turn a request into a `Prompt`, submit `prompt.token_ids` to the engine, and read the
answer through `frontend.stream(handle, prompt, ...)`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ninfer.engine.api import RequestHandle, SamplingParams
from ninfer.frontend.chat_template import ChatTemplate, ChatTemplateError
from ninfer.frontend.presets import SamplingPresets
from ninfer.frontend.reasoning import prompt_opens_reasoning
from ninfer.frontend.stream import StreamOptions, TextStream
from ninfer.frontend.tokenizer import Tokenizer

_MEDIA_KEYS = ("image", "image_url", "video")


@dataclass(frozen=True)
class Prompt:
    text: str
    token_ids: tuple[int, ...]
    starts_in_reasoning: bool  # the prompt ends inside <think>: the answer begins as reasoning
    media: tuple[Mapping[str, Any], ...] = ()  # image/video content parts, in placeholder order


def media_parts(messages: Sequence[Any]) -> list[Mapping[str, Any]]:
    """The image and video content parts of a conversation in the order a template writes their
    `<|vision_start|>…<|vision_end|>` placeholders (message order, then part order)."""
    parts = []
    for message in messages:
        content = message.get("content") if isinstance(message, Mapping) else None
        if not isinstance(content, list):
            continue
        for part in content:
            if not isinstance(part, Mapping):
                continue
            # the same test Qwen's template uses to write a placeholder
            if part.get("type") in ("image", "video") or any(key in part for key in _MEDIA_KEYS):
                parts.append(part)
    return parts


class TextFrontend:
    """Tokenizer + chat template + sampling presets of one model."""

    def __init__(self, tokenizer: Tokenizer, template: ChatTemplate | None, presets: SamplingPresets):
        self.tokenizer = tokenizer
        self.template = template
        self.presets = presets

    @classmethod
    def from_artifact(cls, artifact: Any, chat_template: str | Path | None = None) -> TextFrontend:
        """`chat_template` (a file) replaces the artifact's template; a model without any template can
        still serve raw prompts."""
        tokenizer = Tokenizer.from_artifact(artifact)
        if chat_template is not None:
            template = ChatTemplate.from_file(chat_template, tokenizer.special_tokens)
        else:
            try:
                template = ChatTemplate.from_artifact(artifact, tokenizer)
            except ChatTemplateError:
                template = None
        thinking = template is not None and template.supports_thinking
        return cls(tokenizer, template, SamplingPresets.for_model(tokenizer.generation_config, thinking))

    def chat_prompt(
        self,
        messages: Sequence[Any],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool | str = False,
        **template_kwargs: Any,
    ) -> Prompt:
        """Render a conversation (`template_kwargs`: chat_template_kwargs such as enable_thinking)."""
        if self.template is None:
            raise ChatTemplateError(
                "this model has no chat template; pass --chat-template FILE or send a raw prompt", param=None
            )
        if continue_final_message:
            add_generation_prompt = False
        text = self.template.render(
            messages, tools=tools, add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message, **template_kwargs,
        )
        return Prompt(text, tuple(self.tokenizer.encode(text)), prompt_opens_reasoning(text),
                      tuple(media_parts(messages)))

    def raw_prompt(self, text: str) -> Prompt:
        """Text tokenised as-is (the tokenizer's own BOS rule applies), as llama.cpp's /completion does."""
        return Prompt(text, tuple(self.tokenizer.encode(text, add_special_tokens=True)), False)

    def sampling(self, prompt: Prompt, **request: Any) -> SamplingParams:
        """The mode's preset (thinking when the prompt opened <think>) with the request's values on top."""
        return self.presets.resolve(prompt.starts_in_reasoning, **request)

    def stream(
        self,
        handle: RequestHandle,
        prompt: Prompt,
        *,
        stop: Sequence[str] = (),
        stop_token_ids: Sequence[int] = (),
        tools: Sequence[Mapping[str, Any]] | None = None,
        parse_tool_calls: bool | None = None,
        split_reasoning: bool = True,
    ) -> TextStream:
        """The answer's deltas; tool calls are parsed when tools were offered (unless told otherwise)."""
        options = StreamOptions(
            stop=tuple(stop),
            stop_token_ids=tuple(stop_token_ids),
            starts_in_reasoning=prompt.starts_in_reasoning,
            split_reasoning=split_reasoning,
            parse_tool_calls=bool(tools) if parse_tool_calls is None else parse_tool_calls,
            tools=tuple(tools or ()),
        )
        return TextStream(handle, self.tokenizer, options)

"""The real backend: an `Engine` on its own thread plus the frontend's tokenizer, chat template and
text stream (detokenisation, stop strings, reasoning split, tool-call parsing)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ninfer.engine.api import GenerationRequest, RequestHandle, SamplingParams, TokenEvent
from ninfer.engine.engine import Engine, EngineConfig
from ninfer.frontend import (
    ChatTemplate,
    ContentDelta,
    Finish,
    ReasoningDelta,
    SamplingPresets,
    StreamOptions,
    TextStream,
    Tokenizer,
    ToolCallDelta,
    prompt_opens_reasoning,
)
from ninfer.frontend.presets import generation_config_defaults
from ninfer.frontend.tokenizer import read_resource
from ninfer.serve.backend import ModelInfo
from ninfer.serve.generation import Delta, GenerateOptions, Generation, ToolCall, Usage


class EngineBackend:
    """Implements `ninfer.serve.backend.Backend` over one started engine."""

    def __init__(
        self,
        engine: Engine,
        tokenizer: Tokenizer,
        template: ChatTemplate,
        presets: SamplingPresets,
        info: ModelInfo,
    ):
        self.engine = engine
        self.tokenizer = tokenizer
        self.template = template
        self.presets = presets
        self.info = info
        self.generation_config: dict[str, Any] = {}

    @classmethod
    def load(
        cls,
        artifact_path: str | Path,
        config: EngineConfig,
        model_id: str | None = None,
        chat_template: Path | None = None,
    ) -> EngineBackend:
        """Open the artifact, build and start the engine, and the frontend pieces around it."""
        path = Path(artifact_path)
        engine = Engine(path, config)
        artifact = engine.artifact
        tokenizer = engine.tokenizer
        if chat_template is not None:
            template = ChatTemplate.from_file(chat_template, tokenizer.special_tokens)
        else:
            template = ChatTemplate.from_artifact(artifact, tokenizer)
        generation_config = json.loads(read_resource(artifact, "text", "generation_config.json") or b"{}")
        presets = SamplingPresets.for_model(generation_config, template.supports_thinking)
        metadata = dict(getattr(artifact, "metadata", {}) or {})
        info = ModelInfo(
            model_id=model_id or metadata.get("name") or path.stem,
            max_context=config.max_context,
            created=int(path.stat().st_mtime),
            modalities=("text",),
            chat_template=template.source,
            extra={
                "path": str(path),
                **{k: v for k, v in metadata.items() if isinstance(v, (str, int, float))},
            },
        )
        backend = cls(engine.start(), tokenizer, template, presets, info)
        backend.generation_config = generation_config
        return backend

    # ------------------------------------------------------------------------------------------ text

    def tokenize(self, text: str, add_special: bool = False) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special)

    def detokenize(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)

    def token_piece(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        add_generation_prompt: bool,
        template_kwargs: dict[str, Any],
    ) -> str:
        return self.template.render(
            messages, tools=tools, add_generation_prompt=add_generation_prompt, **template_kwargs
        )

    def starts_in_reasoning(self, prompt: str) -> bool:
        return prompt_opens_reasoning(prompt)

    def sampling_defaults(self, thinking: bool | None) -> SamplingParams:
        if thinking is None:
            return SamplingParams(**generation_config_defaults(self.generation_config))
        return self.presets.resolve(thinking)

    # ------------------------------------------------------------------------------------ generation

    def generate(self, request_id: str, prompt_ids: list[int], options: GenerateOptions) -> Generation:
        handle = _CodeKeepingHandle(
            self.engine.submit(GenerationRequest(request_id, tuple(prompt_ids), options.sampling))
        )
        stream_options = StreamOptions(
            stop=options.stop,
            stop_token_ids=options.sampling.stop_token_ids,
            starts_in_reasoning=options.starts_in_reasoning,
            split_reasoning=options.parse_reasoning,
            parse_tool_calls=options.tools is not None,
            tools=options.tools or (),
        )
        stream = TextStream(handle, self.tokenizer, stream_options)
        return Generation(request_id, len(prompt_ids), _deltas(stream, handle), handle.cancel)

    def stats(self) -> dict[str, Any]:
        return self.engine.stats()

    def memory_ledger(self) -> dict[str, Any]:
        ledger = self.engine.memory_ledger()
        return {**ledger.as_dict(), "line": ledger.line()}

    def shutdown(self) -> None:
        self.engine.shutdown()


class _CodeKeepingHandle:
    """Remembers the error code of the final event (the text stream's Finish carries only the message)."""

    def __init__(self, handle: RequestHandle):
        self._handle = handle
        self.request_id = handle.request_id
        self.error_code: str | None = None

    def next_event(self, timeout_s: float | None = None) -> TokenEvent | None:
        event = self._handle.next_event(timeout_s)
        if event is not None and event.finish_reason == "error":
            self.error_code = getattr(event, "error_code", None)
        return event

    def cancel(self) -> None:
        self._handle.cancel()


def _deltas(stream: TextStream, handle: _CodeKeepingHandle) -> Iterator[Delta]:
    for d in stream:
        if isinstance(d, ContentDelta):
            yield Delta(content=d.text)
        elif isinstance(d, ReasoningDelta):
            yield Delta(reasoning=d.text)
        elif isinstance(d, ToolCallDelta):
            yield Delta(tool_calls=(ToolCall(d.call.id, d.call.name, d.call.arguments),))
        elif isinstance(d, Finish):
            u = d.usage
            usage = Usage(
                u.prompt_tokens,
                u.completion_tokens,
                u.cached_tokens,
                u.time_to_first_token_s,
                u.prefill_tok_per_s,
                u.decode_tok_per_s,
            )
            yield Delta(
                finish_reason=d.reason,
                stop_string=d.stop,
                usage=usage,
                error=d.error,
                error_code=handle.error_code if d.reason == "error" else None,
            )
            return

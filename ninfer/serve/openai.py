"""OpenAI-compatible routes: /v1/models, /v1/chat/completions, /v1/completions (stream and not)."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any, Literal

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field, model_validator
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ninfer.serve.dispatch import (
    Run,
    check_model,
    new_id,
    render_prompt,
    resolve_max_tokens,
    sampling_for,
    sse,
)
from ninfer.serve.errors import ApiError, read_json
from ninfer.serve.generation import Collected, Delta, GenerateOptions, ToolCall, Usage
from ninfer.serve.state import ServerState, get_state

router = APIRouter()

_TOOL_NAME = r"^[A-Za-z0-9_.\-]{1,64}$"


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


class ContentPart(_Lenient):
    type: Literal["text", "image_url", "input_audio", "file", "video_url"]
    text: str | None = None

    @model_validator(mode="after")
    def _text_needed(self) -> ContentPart:
        if self.type == "text" and self.text is None:
            raise ValueError("text: a text part needs a 'text' string")
        return self


class FunctionCallIn(_Lenient):
    name: str = Field(min_length=1)
    arguments: str | dict[str, Any] = "{}"


class ToolCallIn(_Lenient):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ChatMessage(_Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None

    @model_validator(mode="after")
    def _content_present(self) -> ChatMessage:
        empty = self.content is None or self.content == "" or self.content == []
        # an assistant turn may be only tool calls; a tool may return nothing
        if (
            empty
            and not (self.role == "assistant" and self.tool_calls)
            and not (self.role == "tool" and self.content == "")
        ):
            raise ValueError(f"content: {self.role} messages need non-empty content")
        return self


class FunctionDef(_Lenient):
    name: str = Field(pattern=_TOOL_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema_is_object(self) -> FunctionDef:
        if self.parameters is not None and self.parameters.get("type", "object") != "object":
            raise ValueError("parameters: must be a JSON schema of type 'object'")
        return self


class ToolDef(_Lenient):
    type: Literal["function"]
    function: FunctionDef


class StreamOptions(_Lenient):
    include_usage: bool = False


class SamplingFields(_Lenient):
    """Sampling fields shared by chat and text completions (vLLM's extras included)."""

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0, le=1)
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    repetition_penalty: float | None = Field(default=None, gt=0)
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**64)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1)
    logit_bias: dict[str, float] | None = None
    logprobs: bool | int | None = None
    user: str | None = None

    @model_validator(mode="after")
    def _stop_list(self) -> SamplingFields:
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        if len(stops) > 16:
            raise ValueError("stop: at most 16 stop strings")
        if any(s == "" for s in stops):
            raise ValueError("stop: stop strings must not be empty")
        return self


class ChatRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    tools: list[ToolDef] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    enable_thinking: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    top_logprobs: int | None = None


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int]
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(default=None, ge=1)


# ---------------------------------------------------------------- refusals and conversions


def refuse_unsupported(req: SamplingFields) -> None:
    """Fields that would change the output but are not implemented are refused, never ignored."""
    if req.n != 1:
        raise ApiError(
            400, f"n: only n=1 is supported (got {req.n}); send separate requests", "n_not_supported", "n"
        )
    for token, bias in (req.logit_bias or {}).items():
        if not token.lstrip("-").isdigit():
            raise ApiError(
                400, f"logit_bias: key '{token}' is not a token id", "invalid_request_error", "logit_bias"
            )
        if bias != 0:
            raise ApiError(
                400, "logit_bias: non-zero biases are not supported", "logit_bias_not_supported", "logit_bias"
            )
    if req.logprobs:
        raise ApiError(
            400, "logprobs: log probabilities are not supported yet", "logprobs_not_supported", "logprobs"
        )


def _refuse_chat_only(req: ChatRequest) -> None:
    fmt = req.response_format
    if fmt is not None and fmt.get("type", "text") != "text":
        raise ApiError(
            400,
            f"response_format: type '{fmt.get('type')}' needs structured output, not available yet",
            "response_format_not_supported",
            "response_format",
        )
    choice = req.tool_choice
    if choice is None or choice in ("auto", "none"):
        return
    if isinstance(choice, str) and choice != "required":
        raise ApiError(
            400,
            "tool_choice: must be 'auto', 'none', 'required' or a function",
            "invalid_request_error",
            "tool_choice",
        )
    raise ApiError(
        400,
        "tool_choice: forcing a tool call needs structured output, not available yet; use 'auto'",
        "tool_choice_not_supported",
        "tool_choice",
    )


def stop_strings(stop: str | list[str] | None) -> tuple[str, ...]:
    if stop is None:
        return ()
    return (stop,) if isinstance(stop, str) else tuple(stop)


def template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """OpenAI messages → the dicts the chat template expects (tool arguments as mappings)."""
    out = []
    for i, m in enumerate(messages):
        d: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role}
        if isinstance(m.content, list):
            _refuse_media(m.content, f"messages[{i}].content")
            d["content"] = [{"type": "text", "text": p.text} for p in m.content]
        else:
            d["content"] = m.content if m.content is not None else ""
        for key in ("name", "tool_call_id", "reasoning_content"):
            if getattr(m, key) is not None:
                d[key] = getattr(m, key)
        if m.tool_calls:
            d["tool_calls"] = [
                _template_tool_call(tc, f"messages[{i}].tool_calls[{j}]") for j, tc in enumerate(m.tool_calls)
            ]
        out.append(d)
    return out


def _refuse_media(parts: list[ContentPart], where: str) -> None:
    for j, p in enumerate(parts):
        if p.type != "text":
            raise ApiError(
                400,
                f"{where}[{j}]: {p.type} content needs --vision, which is not available yet",
                "vision_disabled",
                f"{where}[{j}]",
            )


def _template_tool_call(tc: ToolCallIn, where: str) -> dict[str, Any]:
    args = tc.function.arguments
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            args = None
        if not isinstance(args, dict):
            raise ApiError(
                400,
                f"{where}.function.arguments: must be a JSON object",
                "invalid_request_error",
                f"{where}.function.arguments",
            )
    return {"id": tc.id, "type": "function", "function": {"name": tc.function.name, "arguments": args}}


def usage_json(u: Usage | None) -> dict[str, Any]:
    if u is None:
        return {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
    }


def tool_call_json(tc: ToolCall, index: int | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {
        "id": tc.id,
        "type": "function",
        "function": {"name": tc.name, "arguments": tc.arguments},
    }
    if index is not None:
        out["index"] = index
    return out


def stream_error_json(delta: Delta) -> dict[str, Any]:
    err = ApiError.from_code(delta.error or "generation failed", delta.error_code)
    return {"error": {"message": err.message, "type": "server_error", "param": None, "code": err.code}}


def _finish_reason(delta: Delta) -> str:
    reason = delta.finish_reason or "stop"
    return "stop" if reason == "cancelled" else reason


# ---------------------------------------------------------------- routes


@router.get("/v1/models")
async def list_models(request: Request) -> dict[str, Any]:
    state = get_state(request)
    return {"object": "list", "data": [_model_card(state)]}


@router.get("/v1/models/{model_id:path}")
async def get_model(model_id: str, request: Request) -> dict[str, Any]:
    state = get_state(request)
    check_model(state, model_id)
    return _model_card(state)


def _model_card(state: ServerState) -> dict[str, Any]:
    info = state.backend.info
    return {
        "id": state.model_id,
        "object": "model",
        "created": info.created,
        "owned_by": info.owned_by,
        "max_model_len": info.max_context,
        "modalities": list(info.modalities),
    }


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    state = get_state(request)
    req = await read_json(request, ChatRequest, state.settings.max_request_bytes)
    check_model(state, req.model)
    refuse_unsupported(req)
    _refuse_chat_only(req)
    backend = state.backend
    kwargs = dict(req.chat_template_kwargs or {})
    if req.enable_thinking is not None:
        kwargs["enable_thinking"] = req.enable_thinking
    use_tools = bool(req.tools) and req.tool_choice != "none"
    tools = [t.model_dump(exclude_none=True) for t in req.tools] if use_tools and req.tools else None
    prompt, prompt_ids = await render_prompt(state, template_messages(req.messages), tools, kwargs)
    thinking = backend.starts_in_reasoning(prompt)
    param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    max_tokens = resolve_max_tokens(state, requested, len(prompt_ids), param, "messages")
    options = GenerateOptions(
        sampling=sampling_for(state, thinking, max_tokens, req),
        stop=stop_strings(req.stop),
        starts_in_reasoning=thinking,
        tools=tuple(tools) if tools else None,
        tag="chat",
    )
    completion_id = new_id("chatcmpl-")
    run = Run.start(state, "/v1/chat/completions", completion_id, prompt_ids, options)
    created = int(time.time())
    if req.stream:
        first = await run.open_stream()
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        fmt = ChatStreamFormatter(completion_id, created, state.model_id, include_usage)
        return run.stream(first, fmt, prologue=fmt.prologue(), done_marker=True)
    out = await run.collect(request)
    return JSONResponse(chat_completion_body(completion_id, created, state.model_id, out))


def chat_completion_body(completion_id: str, created: int, model: str, out: Collected) -> dict[str, Any]:
    last = out.last
    assert last is not None
    message: dict[str, Any] = {
        "role": "assistant",
        "content": out.content if out.content or not out.tool_calls else None,
    }
    if out.reasoning:
        message["reasoning_content"] = out.reasoning
    if out.tool_calls:
        message["tool_calls"] = [tool_call_json(tc) for tc in out.tool_calls]
    return {
        "id": completion_id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [
            {"index": 0, "message": message, "logprobs": None, "finish_reason": _finish_reason(last)}
        ],
        "usage": usage_json(last.usage),
    }


class ChatStreamFormatter:
    def __init__(self, completion_id: str, created: int, model: str, include_usage: bool):
        self.head = {
            "id": completion_id,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
        }
        self.include_usage = include_usage
        self.tool_index = 0

    def _chunk(self, delta: dict[str, Any], finish: str | None = None) -> str:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        return sse({**self.head, "choices": [choice]})

    def prologue(self) -> list[str]:
        return [self._chunk({"role": "assistant", "content": ""})]

    def feed(self, delta: Delta) -> list[str]:
        out = []
        if delta.reasoning:
            out.append(self._chunk({"reasoning_content": delta.reasoning}))
        if delta.content:
            out.append(self._chunk({"content": delta.content}))
        for tc in delta.tool_calls:
            out.append(self._chunk({"tool_calls": [tool_call_json(tc, self.tool_index)]}))
            self.tool_index += 1
        if delta.finish_reason is None:
            return out
        if delta.finish_reason == "error":
            return out + [sse(stream_error_json(delta))]
        out.append(self._chunk({}, _finish_reason(delta)))
        if self.include_usage:
            out.append(sse({**self.head, "choices": [], "usage": usage_json(delta.usage)}))
        return out


@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    state = get_state(request)
    req = await read_json(request, CompletionRequest, state.settings.max_request_bytes)
    check_model(state, req.model)
    refuse_unsupported(req)
    if req.suffix:
        raise ApiError(
            400, "suffix: insertion (fill-in-the-middle) is not supported", "suffix_not_supported", "suffix"
        )
    if req.best_of not in (None, 1):
        raise ApiError(400, "best_of: only 1 is supported", "best_of_not_supported", "best_of")
    prompt_text, prompt_ids = await asyncio.to_thread(_completion_prompt, state, req.prompt)
    requested = req.max_tokens if "max_tokens" in req.model_fields_set else 16  # OpenAI's default
    max_tokens = resolve_max_tokens(state, requested, len(prompt_ids), "max_tokens", "prompt")
    options = GenerateOptions(
        sampling=sampling_for(state, None, max_tokens, req),
        stop=stop_strings(req.stop),
        parse_reasoning=False,
        tag="completions",
    )
    completion_id = new_id("cmpl-")
    run = Run.start(state, "/v1/completions", completion_id, prompt_ids, options)
    created = int(time.time())
    echo = prompt_text if req.echo else ""
    if req.stream:
        first = await run.open_stream()
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        fmt = CompletionStreamFormatter(completion_id, created, state.model_id, include_usage)
        prologue = [fmt.text_chunk(echo, None)] if echo else []
        return run.stream(first, fmt, prologue=prologue, done_marker=True)
    out = await run.collect(request)
    last = out.last
    assert last is not None
    return JSONResponse(
        {
            "id": completion_id,
            "object": "text_completion",
            "created": created,
            "model": state.model_id,
            "choices": [
                {
                    "index": 0,
                    "text": echo + out.content,
                    "logprobs": None,
                    "finish_reason": _finish_reason(last),
                }
            ],
            "usage": usage_json(last.usage),
        }
    )


def _completion_prompt(state: ServerState, prompt: str | list[str] | list[int]) -> tuple[str, list[int]]:
    backend = state.backend
    if isinstance(prompt, str):
        return prompt, backend.tokenize(prompt)
    if not prompt:
        raise ApiError(400, "prompt: must not be empty", "invalid_request_error", "prompt")
    if all(isinstance(p, str) for p in prompt):
        if len(prompt) != 1:
            raise ApiError(
                400, "prompt: only one prompt per request is supported", "n_not_supported", "prompt"
            )
        return prompt[0], backend.tokenize(prompt[0])  # type: ignore[arg-type]
    ids = [int(t) for t in prompt]
    vocab = backend.vocab_size()
    bad = next((i for i, t in enumerate(ids) if not 0 <= t < vocab), None)
    if bad is not None:
        raise ApiError(
            400,
            f"prompt[{bad}]: token id {ids[bad]} is outside the vocabulary (0..{vocab - 1})",
            "invalid_request_error",
            f"prompt[{bad}]",
        )
    return backend.detokenize(ids), ids


class CompletionStreamFormatter:
    def __init__(self, completion_id: str, created: int, model: str, include_usage: bool):
        self.head = {"id": completion_id, "object": "text_completion", "created": created, "model": model}
        self.include_usage = include_usage

    def text_chunk(self, text: str, finish: str | None) -> str:
        return sse(
            {**self.head, "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]}
        )

    def feed(self, delta: Delta) -> list[str]:
        out = [self.text_chunk(delta.content, None)] if delta.content else []
        if delta.finish_reason is None:
            return out
        if delta.finish_reason == "error":
            return out + [sse(stream_error_json(delta))]
        out.append(self.text_chunk("", _finish_reason(delta)))
        if self.include_usage:
            out.append(sse({**self.head, "choices": [], "usage": usage_json(delta.usage)}))
        return out

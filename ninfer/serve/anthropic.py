"""Anthropic Messages API: POST /v1/messages (stream and not) and /v1/messages/count_tokens.

Content blocks map onto the chat template's messages: `thinking` → reasoning_content, `tool_use` →
tool_calls, `tool_result` → tool messages. Errors use Anthropic's envelope (chosen in `errors.py`).
"""

from __future__ import annotations

import json
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
from ninfer.serve.state import get_state

router = APIRouter()


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


class Block(_Lenient):
    type: Literal["text", "image", "document", "tool_use", "tool_result", "thinking", "redacted_thinking"]
    text: str | None = None
    id: str | None = None
    name: str | None = None
    input: dict[str, Any] | None = None
    tool_use_id: str | None = None
    content: str | list[Block] | None = None
    is_error: bool | None = None
    thinking: str | None = None
    signature: str | None = None

    @model_validator(mode="after")
    def _fields_for_type(self) -> Block:
        need = {
            "text": ("text",),
            "tool_use": ("id", "name", "input"),
            "tool_result": ("tool_use_id",),
            "thinking": ("thinking",),
        }.get(self.type, ())
        for name in need:
            if getattr(self, name) is None:
                raise ValueError(f"{name}: a {self.type} block needs '{name}'")
        return self


class Message(_Lenient):
    role: Literal["user", "assistant"]
    content: str | list[Block]

    @model_validator(mode="after")
    def _not_empty(self) -> Message:
        if self.content == "" or self.content == []:
            raise ValueError("content: must not be empty")
        return self


class Tool(_Lenient):
    name: str = Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")
    description: str | None = None
    input_schema: dict[str, Any]

    @model_validator(mode="after")
    def _schema_is_object(self) -> Tool:
        if self.input_schema.get("type") != "object":
            raise ValueError("input_schema: must be a JSON schema of type 'object'")
        return self


class ToolChoice(_Lenient):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None


class Thinking(_Lenient):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = Field(default=None, ge=1)


class CountTokensRequest(_Lenient):
    model: str
    messages: list[Message] = Field(min_length=1)
    system: str | list[Block] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = Field(default=None, ge=0, le=1)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=0)
    metadata: dict[str, Any] | None = None


# ---------------------------------------------------------------- conversion


def template_inputs(
    req: CountTokensRequest,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None, dict]:
    messages: list[dict[str, Any]] = []
    if req.system:
        messages.append({"role": "system", "content": _text_of(req.system, "system")})
    for i, m in enumerate(req.messages):
        if isinstance(m.content, str):
            messages.append({"role": m.role, "content": m.content})
        elif m.role == "user":
            messages.extend(_user_messages(m.content, f"messages[{i}].content"))
        else:
            messages.append(_assistant_message(m.content, f"messages[{i}].content"))
    choice = req.tool_choice.type if req.tool_choice else "auto"
    if choice in ("any", "tool"):
        raise ApiError(
            400,
            f"tool_choice: '{choice}' needs structured output, not available yet; use 'auto'",
            "tool_choice_not_supported",
            "tool_choice",
        )
    tools = None
    if req.tools and choice != "none":
        tools = [
            {
                "type": "function",
                "function": {
                    "name": t.name,
                    "description": t.description or "",
                    "parameters": t.input_schema,
                },
            }
            for t in req.tools
        ]
    kwargs: dict[str, Any] = {}
    if req.thinking is not None:
        kwargs["enable_thinking"] = req.thinking.type != "disabled"
    return messages, tools, kwargs


def _text_of(content: str | list[Block], where: str) -> str:
    if isinstance(content, str):
        return content
    texts = []
    for j, b in enumerate(content):
        if b.type != "text":
            raise ApiError(
                400,
                f"{where}[{j}]: only text blocks are allowed here",
                "invalid_request_error",
                f"{where}[{j}]",
            )
        texts.append(b.text or "")
    return "\n".join(texts)


def _user_messages(blocks: list[Block], where: str) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    texts: list[str] = []
    for j, b in enumerate(blocks):
        if b.type == "tool_result":
            content = _text_of(b.content, f"{where}[{j}].content") if b.content is not None else ""
            out.append({"role": "tool", "tool_call_id": b.tool_use_id, "content": content})
        elif b.type == "text":
            texts.append(b.text or "")
        elif b.type in ("image", "document"):
            raise ApiError(
                400,
                f"{where}[{j}]: {b.type} blocks need --vision, which is not available yet",
                "vision_disabled",
                f"{where}[{j}]",
            )
        else:
            raise ApiError(
                400,
                f"{where}[{j}]: a user message cannot hold a {b.type} block",
                "invalid_request_error",
                f"{where}[{j}].type",
            )
    if texts:
        out.append({"role": "user", "content": "\n".join(texts)})
    return out


def _assistant_message(blocks: list[Block], where: str) -> dict[str, Any]:
    text, reasoning, calls = [], [], []
    for j, b in enumerate(blocks):
        if b.type == "text":
            text.append(b.text or "")
        elif b.type == "thinking":
            reasoning.append(b.thinking or "")
        elif b.type == "tool_use":
            calls.append({"id": b.id, "type": "function", "function": {"name": b.name, "arguments": b.input}})
        elif b.type != "redacted_thinking":
            raise ApiError(
                400,
                f"{where}[{j}]: an assistant message cannot hold a {b.type} block",
                "invalid_request_error",
                f"{where}[{j}].type",
            )
    msg: dict[str, Any] = {"role": "assistant", "content": "".join(text)}
    if reasoning:
        msg["reasoning_content"] = "\n".join(reasoning)
    if calls:
        msg["tool_calls"] = calls
    return msg


def _stop_reason(delta: Delta) -> str:
    if delta.finish_reason == "length":
        return "max_tokens"
    if delta.finish_reason == "tool_calls":
        return "tool_use"
    return "stop_sequence" if delta.stop_string else "end_turn"


def _usage(u: Usage | None, prompt_tokens: int) -> dict[str, int]:
    return {
        "input_tokens": u.prompt_tokens if u else prompt_tokens,
        "output_tokens": u.completion_tokens if u else 0,
        "cache_read_input_tokens": u.cached_tokens if u else 0,
        "cache_creation_input_tokens": 0,
    }


def _tool_input(tc: ToolCall) -> dict[str, Any]:
    try:
        value = json.loads(tc.arguments)
    except json.JSONDecodeError:
        return {"arguments": tc.arguments}
    return value if isinstance(value, dict) else {"value": value}


# ---------------------------------------------------------------- routes


@router.post("/v1/messages/count_tokens")
async def count_tokens(request: Request) -> dict[str, int]:
    state = get_state(request)
    req = await read_json(request, CountTokensRequest, state.settings.max_request_bytes)
    check_model(state, req.model)
    messages, tools, kwargs = template_inputs(req)
    _, prompt_ids = await render_prompt(state, messages, tools, kwargs)
    return {"input_tokens": len(prompt_ids)}


@router.post("/v1/messages")
async def messages(request: Request) -> Response:
    state = get_state(request)
    req = await read_json(request, MessagesRequest, state.settings.max_request_bytes)
    check_model(state, req.model)
    backend = state.backend
    msgs, tools, kwargs = template_inputs(req)
    prompt, prompt_ids = await render_prompt(state, msgs, tools, kwargs)
    thinking = backend.starts_in_reasoning(prompt)
    max_tokens = resolve_max_tokens(state, req.max_tokens, len(prompt_ids), "max_tokens", "messages")
    if any(s == "" for s in req.stop_sequences or []):
        raise ApiError(
            400, "stop_sequences: must not contain empty strings", "invalid_request_error", "stop_sequences"
        )
    options = GenerateOptions(
        sampling=sampling_for(state, thinking, max_tokens, req),
        stop=tuple(req.stop_sequences or ()),
        starts_in_reasoning=thinking,
        tools=tuple(tools) if tools else None,
        tag="messages",
    )
    msg_id = new_id("msg_")
    run = Run.start(state, "/v1/messages", msg_id, prompt_ids, options)
    if req.stream:
        first = await run.open_stream()
        fmt = MessagesStreamFormatter(msg_id, state.model_id, len(prompt_ids))
        return run.stream(first, fmt, prologue=fmt.prologue())
    out = await run.collect(request)
    return JSONResponse(message_body(msg_id, state.model_id, len(prompt_ids), out))


def message_body(msg_id: str, model: str, prompt_tokens: int, out: Collected) -> dict[str, Any]:
    last = out.last
    assert last is not None
    content: list[dict[str, Any]] = []
    if out.reasoning:
        content.append({"type": "thinking", "thinking": out.reasoning, "signature": ""})
    if out.content or not out.tool_calls:
        content.append({"type": "text", "text": out.content})
    for tc in out.tool_calls:
        content.append({"type": "tool_use", "id": tc.id, "name": tc.name, "input": _tool_input(tc)})
    return {
        "id": msg_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": _stop_reason(last),
        "stop_sequence": last.stop_string,
        "usage": _usage(last.usage, prompt_tokens),
    }


class MessagesStreamFormatter:
    """Anthropic's event sequence: message_start, content blocks (start/delta/stop), message_delta/stop."""

    def __init__(self, msg_id: str, model: str, prompt_tokens: int):
        self.msg_id = msg_id
        self.model = model
        self.prompt_tokens = prompt_tokens
        self.index = -1
        self.open_kind: str | None = None

    def prologue(self) -> list[str]:
        message = {
            "id": self.msg_id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": _usage(None, self.prompt_tokens),
        }
        return [
            sse({"type": "message_start", "message": message}, "message_start"),
            sse({"type": "ping"}, "ping"),
        ]

    def _switch(self, kind: str | None, block: dict[str, Any] | None = None) -> list[str]:
        out = []
        if self.open_kind is not None and (kind != self.open_kind or kind == "tool_use"):
            out.append(sse({"type": "content_block_stop", "index": self.index}, "content_block_stop"))
            self.open_kind = None
        if kind is not None and self.open_kind is None:
            self.index += 1
            self.open_kind = kind
            out.append(
                sse(
                    {"type": "content_block_start", "index": self.index, "content_block": block},
                    "content_block_start",
                )
            )
        return out

    def _delta(self, delta: dict[str, Any]) -> str:
        return sse(
            {"type": "content_block_delta", "index": self.index, "delta": delta}, "content_block_delta"
        )

    def feed(self, delta: Delta) -> list[str]:
        out: list[str] = []
        if delta.reasoning:
            out += self._switch("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            out.append(self._delta({"type": "thinking_delta", "thinking": delta.reasoning}))
        if delta.content:
            out += self._switch("text", {"type": "text", "text": ""})
            out.append(self._delta({"type": "text_delta", "text": delta.content}))
        for tc in delta.tool_calls:
            out += self._switch("tool_use", {"type": "tool_use", "id": tc.id, "name": tc.name, "input": {}})
            out.append(self._delta({"type": "input_json_delta", "partial_json": json.dumps(_tool_input(tc))}))
        if delta.finish_reason is None:
            return out
        if delta.finish_reason == "error":
            err = ApiError.from_code(delta.error or "generation failed", delta.error_code)
            kind = "overloaded_error" if err.status in (429, 503) else "api_error"
            return out + [sse({"type": "error", "error": {"type": kind, "message": err.message}}, "error")]
        if self.index < 0:  # no output at all: still one (empty) text block, as Anthropic sends
            out += self._switch("text", {"type": "text", "text": ""})
        out += self._switch(None)
        usage = _usage(delta.usage, self.prompt_tokens)
        out.append(
            sse(
                {
                    "type": "message_delta",
                    "delta": {"stop_reason": _stop_reason(delta), "stop_sequence": delta.stop_string},
                    "usage": {"output_tokens": usage["output_tokens"]},
                },
                "message_delta",
            )
        )
        out.append(sse({"type": "message_stop"}, "message_stop"))
        return out

"""Running one generation for a route: admission checks, non-streaming collection, SSE streaming.

Shared by the OpenAI, Anthropic and llama.cpp routes; each family supplies only a `StreamFormatter` that
turns deltas into its own SSE events. Everything here awaits; nothing blocks the event loop.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

from starlette.requests import Request
from starlette.responses import StreamingResponse

from ninfer.engine.api import SamplingParams
from ninfer.errors import RequestError
from ninfer.serve.errors import ApiError
from ninfer.serve.generation import Collected, Delta, GenerateOptions, Generation
from ninfer.serve.requestlog import RequestRecord
from ninfer.serve.state import ServerState

_DISCONNECT_POLL_S = 0.25


class StreamFormatter(Protocol):
    def feed(self, delta: Delta) -> list[str]:
        """SSE text for one delta (the finishing delta also closes the stream, in-stream error included)."""
        ...


def sse(data: Any, event: str | None = None) -> str:
    body = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {body}\n\n"


def check_model(state: ServerState, requested: str | None) -> None:
    if not requested:
        return
    info = state.backend.info
    if requested in (state.model_id, info.model_id):
        return
    raise ApiError(
        404,
        f"model '{requested}' does not exist; this server serves '{state.model_id}' (see GET /v1/models)",
        "model_not_found",
        "model",
    )


def resolve_max_tokens(
    state: ServerState, requested: int | None, prompt_tokens: int, param: str, prompt_param: str
) -> int:
    """The output budget: the request's value, else --default-max-tokens clipped to the context left."""
    max_context = state.backend.info.max_context
    if prompt_tokens >= max_context:
        raise ApiError(
            400,
            f"{prompt_param}: the prompt has {prompt_tokens} tokens, the context length is {max_context}; "
            "shorten the prompt",
            "context_length_exceeded",
            prompt_param,
        )
    if requested is None:
        return min(state.settings.default_max_tokens, max_context - prompt_tokens)
    if prompt_tokens + requested > max_context:
        raise ApiError(
            400,
            f"{param}: prompt {prompt_tokens} tokens + {param} {requested} = {prompt_tokens + requested} "
            f"exceeds the context length {max_context}; lower {param} or shorten the prompt",
            "context_length_exceeded",
            param,
        )
    return requested


_SAMPLING_FIELDS = (
    "temperature",
    "top_p",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "seed",
)


def sampling_for(state: ServerState, thinking: bool | None, max_tokens: int, req: Any) -> SamplingParams:
    """The model's presets overridden by whatever sampling fields the request set (absent = preset)."""
    base = state.backend.sampling_defaults(thinking)
    overrides: dict[str, Any] = {
        "max_tokens": max_tokens,
        "ignore_eos": bool(getattr(req, "ignore_eos", False)),
    }
    for name in _SAMPLING_FIELDS:
        value = getattr(req, name, None)
        if value is not None:
            overrides[name] = value
    top_k = getattr(req, "top_k", None)
    if top_k is not None:
        overrides["top_k"] = max(top_k, 0)  # -1 and 0 both mean off
    stop_ids = getattr(req, "stop_token_ids", None)
    if stop_ids:
        overrides["stop_token_ids"] = tuple(stop_ids)
    return dataclasses.replace(base, **overrides)


async def render_prompt(
    state: ServerState,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    kwargs: dict[str, Any],
) -> tuple[str, list[int]]:
    """Chat template + tokenizer on a worker thread: long prompts must not stall other streams."""
    backend = state.backend

    def work() -> tuple[str, list[int]]:
        prompt = backend.render_chat(messages, tools, True, kwargs)
        return prompt, backend.tokenize(prompt)

    return await asyncio.to_thread(work)


def new_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex[:24]}"


class _SseResponse(StreamingResponse):
    """A stream that always ends its generation, even if the body never started (client gone early)."""

    def __init__(self, body: AsyncIterator[str], on_close: Callable[[], None], **kwargs: Any):
        super().__init__(body, **kwargs)
        self._on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


class Run:
    """One generation in flight: started, then either collected or streamed, recorded exactly once."""

    def __init__(self, state: ServerState, route: str, gen: Generation):
        self.state = state
        self.route = route
        self.gen = gen
        self.t0 = time.perf_counter()
        self._recorded = False

    @classmethod
    def start(
        cls, state: ServerState, route: str, request_id: str, prompt_ids: list[int], options: GenerateOptions
    ) -> Run:
        if state.stopping.is_set():
            raise ApiError(503, "the server is shutting down", "shutting_down", headers={"Retry-After": "2"})
        try:
            gen = state.backend.generate(request_id, prompt_ids, options)
        except RequestError as exc:
            raise ApiError.from_request_error(exc) from None
        gen.start()
        state.generations.add(gen)
        state.metrics.in_flight.inc()
        return cls(state, route, gen)

    def record(self, last: Delta | None, status: int) -> None:
        if self._recorded:
            return
        self._recorded = True
        self.state.generations.discard(self.gen)
        self.state.metrics.in_flight.dec()
        reason = last.finish_reason if last is not None and last.finish_reason else "cancelled"
        usage = last.usage if last is not None else None
        self.state.metrics.observe_generation(reason, usage)
        self.state.request_log.record(
            RequestRecord(
                request_id=self.gen.request_id,
                route=self.route,
                status=status,
                finish_reason=reason,
                prompt_tokens=usage.prompt_tokens if usage else self.gen.prompt_tokens,
                cached_tokens=usage.cached_tokens if usage else 0,
                generated_tokens=usage.completion_tokens if usage else 0,
                time_to_first_token_s=usage.time_to_first_token_s if usage else None,
                prefill_tok_per_s=usage.prefill_tok_per_s if usage else None,
                decode_tok_per_s=usage.decode_tok_per_s if usage else None,
                duration_s=time.perf_counter() - self.t0,
                error=last.error if last is not None else "client disconnected",
            )
        )

    async def collect(self, request: Request) -> Collected:
        """The whole output; a client that disconnects meanwhile cancels the request."""
        task = asyncio.ensure_future(self.gen.collect())
        client_gone = False
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=_DISCONNECT_POLL_S)
                if done:
                    break
                if not client_gone and await request.is_disconnected():
                    client_gone = True
                    self.gen.cancel()  # the final (cancelled) delta follows within one round
        finally:
            if not task.done():  # this handler itself was cancelled (server stopping)
                self.gen.cancel()
                task.cancel()
                self.record(None, 499)
        out = task.result()
        last = out.last
        assert last is not None
        if last.finish_reason == "error":
            err = ApiError.from_code(last.error or "generation failed", last.error_code)
            self.record(last, err.status)
            raise err
        self.record(last, 499 if client_gone else 200)
        return out

    async def open_stream(self) -> Delta | None:
        """Wait briefly for the first delta so that a refusal before any output is a real HTTP error."""
        first = await self.gen.next(self.state.settings.keepalive_s)
        if first is not None and first.finish_reason == "error" and not (first.content or first.reasoning):
            err = ApiError.from_code(first.error or "generation failed", first.error_code)
            self.record(first, err.status)
            raise err
        return first

    def stream(
        self,
        first: Delta | None,
        formatter: StreamFormatter,
        prologue: list[str] | None = None,
        done_marker: bool = False,
    ) -> StreamingResponse:
        body = self._sse_body(first, formatter, prologue or [], done_marker)
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        return _SseResponse(body, self._abandon, media_type="text/event-stream", headers=headers)

    def _abandon(self) -> None:
        """After the response, whatever happened: a generation nobody reads any more is cancelled."""
        if not self._recorded:
            self.gen.cancel()
            self.record(None, 499)

    async def _sse_body(
        self, first: Delta | None, formatter: StreamFormatter, prologue: list[str], done_marker: bool
    ) -> AsyncIterator[str]:
        last: Delta | None = None
        try:
            for chunk in prologue:
                yield chunk
            pending = first
            if pending is None:
                yield ": keep-alive\n\n"
            while last is None:
                delta = (
                    pending if pending is not None else await self.gen.next(self.state.settings.keepalive_s)
                )
                pending = None
                if delta is None:
                    yield ": keep-alive\n\n"
                    continue
                for chunk in formatter.feed(delta):
                    yield chunk
                if delta.finish_reason is not None:
                    last = delta
            if done_marker:
                yield "data: [DONE]\n\n"
        finally:
            if last is None:  # the client went away (or the server is stopping): free the lane now
                self.gen.cancel()
            self.record(last, 200 if last is not None else 499)

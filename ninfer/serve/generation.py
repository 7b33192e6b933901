"""What the HTTP layer sees of one generation: typed text deltas, read without blocking the event loop.

A `Generation` owns a pump thread that reads a blocking iterator of `Delta`s (the frontend's text stream
over an engine `RequestHandle`) and hands each one to the asyncio loop through a queue, so handlers only
ever `await`. Cancelling (client gone, server stopping) cancels the engine request; the pump then ends.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from ninfer.engine.api import SamplingParams


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text, as OpenAI sends it


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    time_to_first_token_s: float | None = None
    prefill_tok_per_s: float | None = None
    decode_tok_per_s: float | None = None


@dataclass(frozen=True)
class Delta:
    """A piece of output. The last delta of a generation has `finish_reason` and `usage` set.

    finish_reason: stop | length | tool_calls | cancelled | error; `stop_string` is the matched stop
    string (not part of the content); `error_code` names the failure (e.g. request_queue_timeout).
    """

    content: str = ""
    reasoning: str = ""
    tool_calls: tuple[ToolCall, ...] = ()
    finish_reason: str | None = None
    stop_string: str | None = None
    usage: Usage | None = None
    error: str | None = None
    error_code: str | None = None


@dataclass(frozen=True)
class GenerateOptions:
    """Everything a route decides about one generation besides the prompt."""

    sampling: SamplingParams
    stop: tuple[str, ...] = ()
    starts_in_reasoning: bool = False  # the prompt opened <think>: output begins as reasoning
    parse_reasoning: bool = True
    tools: tuple[dict, ...] | None = None  # tool JSON schemas when tool calls are parsed
    tag: str = ""  # route name for logs and metrics


@dataclass
class Collected:
    """A whole generation gathered for a non-streaming response."""

    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    last: Delta | None = None

    def add(self, delta: Delta) -> None:
        self.content += delta.content
        self.reasoning += delta.reasoning
        self.tool_calls.extend(delta.tool_calls)
        if delta.finish_reason is not None:
            self.last = delta


class Generation:
    """Deltas of one request as an async source; `cancel()` stops the engine request."""

    def __init__(
        self, request_id: str, prompt_tokens: int, deltas: Iterator[Delta], cancel: Callable[[], None]
    ):
        self.request_id = request_id
        self.prompt_tokens = prompt_tokens
        self._deltas = deltas
        self._cancel = cancel
        self._cancelled = threading.Event()
        self._queue: asyncio.Queue[Delta] = asyncio.Queue()
        self._loop: asyncio.AbstractEventLoop | None = None
        self.finished = False

    def start(self) -> Generation:
        self._loop = asyncio.get_running_loop()
        threading.Thread(target=self._pump, name=f"pump-{self.request_id}", daemon=True).start()
        return self

    def _pump(self) -> None:
        try:
            for delta in self._deltas:
                self._post(delta)
                if delta.finish_reason is not None:
                    return
            self._post(
                Delta(
                    finish_reason="error",
                    error="generation ended without a finish",
                    error_code="internal_error",
                )
            )
        except Exception as exc:  # the text stream failed: report it in-band, never hang the client
            self._post(
                Delta(finish_reason="error", error=f"internal error: {exc}", error_code="internal_error")
            )

    def _post(self, delta: Delta) -> None:
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, delta)
        except RuntimeError:  # event loop closed (server stopped): nobody reads any more
            self.cancel()

    async def next(self, timeout_s: float | None = None) -> Delta | None:
        """The next delta, or None after `timeout_s` of silence."""
        try:
            delta = await asyncio.wait_for(self._queue.get(), timeout_s)
        except asyncio.TimeoutError:
            return None
        if delta.finish_reason is not None:
            self.finished = True
        return delta

    async def collect(self) -> Collected:
        out = Collected()
        while out.last is None:
            delta = await self.next()
            assert delta is not None
            out.add(delta)
        return out

    def cancel(self) -> None:
        if not self._cancelled.is_set():
            self._cancelled.set()
            self._cancel()

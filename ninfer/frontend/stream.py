"""Generated tokens to typed text deltas: detokenise, apply stop strings, split reasoning, parse tool calls.

`OutputProcessor.feed(TokenEvent)` is the push-style core (the HTTP server reads events itself);
`TextStream` drives it from a `RequestHandle` and cancels the request when a stop string matches.
The last delta is always one `Finish` with the finish reason and the usage.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ninfer.engine.api import RequestHandle, TokenEvent
from ninfer.frontend.detokenizer import IncrementalDetokenizer, StopMatcher
from ninfer.frontend.reasoning import ReasoningParser
from ninfer.frontend.tokenizer import Tokenizer
from ninfer.frontend.tool_calls import ToolCall, ToolCallParser


@dataclass(frozen=True)
class ContentDelta:
    text: str


@dataclass(frozen=True)
class ReasoningDelta:
    text: str


@dataclass(frozen=True)
class ToolCallDelta:
    index: int  # position among this response's calls (OpenAI's `tool_calls[].index`)
    call: ToolCall


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    time_to_first_token_s: float | None = None
    prefill_tok_per_s: float | None = None
    decode_tok_per_s: float | None = None

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True)
class Finish:
    """`reason`: "stop" (eos, stop token or stop string), "tool_calls" (stopped after calling tools),
    "length", "cancelled" or "error" (`error` holds the message, `error_code` the engine's API code).
    `stop` is the matched stop string."""

    reason: str
    usage: Usage
    error: str | None = None
    stop: str | None = None
    token_ids: tuple[int, ...] = ()  # every generated id consumed, stop token included
    error_code: str | None = None


Delta = ContentDelta | ReasoningDelta | ToolCallDelta | Finish


@dataclass(frozen=True)
class StreamOptions:
    stop: tuple[str, ...] = ()  # stop strings (cut, not emitted)
    stop_token_ids: tuple[int, ...] = ()  # ids whose text is not emitted (the engine stops on them)
    starts_in_reasoning: bool = False  # the prompt opened <think> (see reasoning.prompt_opens_reasoning)
    split_reasoning: bool = True  # False: <think> text stays in the content
    parse_tool_calls: bool = True  # False (e.g. tool_choice "none"): tool markup stays in the content
    tools: tuple[Mapping[str, Any], ...] = field(default=())  # request tools, to type parameter values


class OutputProcessor:
    """Turns a request's TokenEvents into deltas. Once `done`, further events are ignored."""

    def __init__(self, tokenizer: Tokenizer, options: StreamOptions = StreamOptions()):
        self.options = options
        self._detok = IncrementalDetokenizer(tokenizer, tokenizer.hidden_ids | set(options.stop_token_ids))
        self._stop = StopMatcher(options.stop)
        self._reasoning = ReasoningParser(options.starts_in_reasoning) if options.split_reasoning else None
        self._tools = ToolCallParser(list(options.tools)) if options.parse_tool_calls else None
        self._token_ids: list[int] = []
        self._calls_emitted = 0
        self._usage: dict[str, Any] = {}
        self.done = False
        self.stop_matched: str | None = None

    def feed(self, event: TokenEvent) -> list[Delta]:
        if self.done:
            return []
        self._record_usage(event)
        deltas: list[Delta] = []
        for token_id in event.token_ids:
            self._token_ids.append(token_id)
            self._route(self._stop.push(self._detok.push((token_id,))), deltas)
            if self._stop.matched is not None:
                self.stop_matched = self._stop.matched
                return self._finish(deltas, "stop")
        if event.finish_reason is not None:
            return self._finish(deltas, event.finish_reason, event.error, getattr(event, "error_code", None))
        return _merge(deltas)

    @property
    def saw_reasoning(self) -> bool:
        """The output had a reasoning block (so `reasoning_content` should be reported, maybe empty)."""
        return self._reasoning is not None and self._reasoning.saw_reasoning

    def _finish(
        self, deltas: list[Delta], reason: str, error: str | None = None, error_code: str | None = None
    ) -> list[Delta]:
        if self._stop.matched is None:
            self._route(self._stop.push(self._detok.flush()), deltas)
            self._route(self._stop.flush(), deltas)
        self.stop_matched = self._stop.matched
        pieces = self._reasoning.flush() if self._reasoning is not None else []
        for kind, text in pieces:
            self._route_piece(kind, text, deltas)
        if self._tools is not None:
            self._add_content_items(self._tools.flush(), deltas)
        if reason == "stop" and self._calls_emitted:
            reason = "tool_calls"
        self.done = True
        usage = self._make_usage()
        deltas.append(Finish(reason, usage, error, self.stop_matched, tuple(self._token_ids), error_code))
        return _merge(deltas)

    def _route(self, text: str, deltas: list[Delta]) -> None:
        if not text:
            return
        if self._reasoning is None:
            self._route_piece("content", text, deltas)
            return
        for kind, piece in self._reasoning.push(text):
            self._route_piece(kind, piece, deltas)

    def _route_piece(self, kind: str, text: str, deltas: list[Delta]) -> None:
        if kind == "reasoning":
            deltas.append(ReasoningDelta(text))
        elif self._tools is None:
            deltas.append(ContentDelta(text))
        else:
            self._add_content_items(self._tools.push(text), deltas)

    def _add_content_items(self, items: Sequence[str | ToolCall], deltas: list[Delta]) -> None:
        for item in items:
            if isinstance(item, ToolCall):
                deltas.append(ToolCallDelta(self._calls_emitted, item))
                self._calls_emitted += 1
            elif item:
                deltas.append(ContentDelta(item))

    def _record_usage(self, event: TokenEvent) -> None:
        for name in ("prompt_tokens", "cached_tokens"):
            if getattr(event, name):
                self._usage[name] = getattr(event, name)
        for name in ("time_to_first_token_s", "prefill_tok_per_s", "decode_tok_per_s"):
            if getattr(event, name) is not None:
                self._usage[name] = getattr(event, name)

    def _make_usage(self) -> Usage:
        return Usage(completion_tokens=len(self._token_ids), **self._usage)


def _merge(deltas: list[Delta]) -> list[Delta]:
    """Join neighbouring text deltas of the same kind."""
    merged: list[Delta] = []
    for delta in deltas:
        last = merged[-1] if merged else None
        if isinstance(delta, (ContentDelta, ReasoningDelta)) and type(last) is type(delta):
            merged[-1] = type(delta)(last.text + delta.text)
        else:
            merged.append(delta)
    return merged


class TextStream:
    """Iterate the deltas of one request: `for delta in TextStream(handle, tokenizer, options): ...`.

    `poll(timeout_s)` returns the deltas of the next event, or [] when nothing arrived in time (an HTTP
    server sends a keep-alive then); after a stop string matches, the handle is cancelled and the stream
    finishes at once without waiting for the engine.
    """

    def __init__(self, handle: RequestHandle, tokenizer: Tokenizer, options: StreamOptions = StreamOptions()):
        self.handle = handle
        self.processor = OutputProcessor(tokenizer, options)

    @property
    def done(self) -> bool:
        return self.processor.done

    def poll(self, timeout_s: float | None = None) -> list[Delta]:
        if self.done:
            return []
        event = self.handle.next_event(timeout_s)
        if event is None:
            return []
        deltas = self.processor.feed(event)
        if self.processor.stop_matched is not None and event.finish_reason is None:
            self.handle.cancel()
        return deltas

    def __iter__(self) -> Iterator[Delta]:
        while not self.done:
            yield from self.poll()

    def collect(self) -> CompletedText:
        """Run to the end and gather the whole response (non-streaming APIs)."""
        started = time.monotonic()
        content, reasoning, calls = [], [], []
        finish = None
        for delta in self:
            if isinstance(delta, ContentDelta):
                content.append(delta.text)
            elif isinstance(delta, ReasoningDelta):
                reasoning.append(delta.text)
            elif isinstance(delta, ToolCallDelta):
                calls.append(delta.call)
            else:
                finish = delta
        assert finish is not None
        reasoning_text = "".join(reasoning) if self.processor.saw_reasoning else None
        elapsed_s = time.monotonic() - started
        return CompletedText("".join(content), reasoning_text, tuple(calls), finish, elapsed_s)


@dataclass(frozen=True)
class CompletedText:
    content: str
    reasoning: str | None  # None when the output had no reasoning block
    tool_calls: tuple[ToolCall, ...]
    finish: Finish
    elapsed_s: float

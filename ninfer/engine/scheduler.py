"""Lanes, the FIFO pending queue, admission by page reservation, and the plan of each round (no tensors).

A round is every decoding lane's next token plus at most one prefill chunk (of the oldest lane still in
prefill), so running requests keep streaming while a long prompt is read. Admission reserves the pages
for prompt + max_tokens up front; the head of the queue waits until they are free (strict FIFO).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from ninfer.engine.api import FinishReason, GenerationRequest, TokenEvent
from ninfer.engine.kv_pool import PageAllocator, pages_for
from ninfer.errors import RequestError


@dataclass
class Sequence:
    """One request's progress. `emit` delivers its events (the handle's queue)."""

    request: GenerationRequest
    emit: Callable[[TokenEvent], None]
    submitted_at: float = field(default_factory=time.monotonic)
    lane: int | None = None
    pages: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    cached: int = 0
    cancel_requested: bool = False
    finished: bool = False
    admitted_at: float | None = None
    prefill_done_at: float | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None

    def __post_init__(self) -> None:
        self.tokens = list(self.request.prompt_ids)

    @property
    def prompt_len(self) -> int:
        return len(self.request.prompt_ids)

    @property
    def generated(self) -> int:
        return len(self.tokens) - self.prompt_len

    @property
    def in_prefill(self) -> bool:
        return self.cached < self.prompt_len

    def event(self, token_ids: tuple[int, ...], finish: FinishReason | None = None,
              error: str | None = None, code: str | None = None) -> TokenEvent:
        ttft = prefill = decode = None
        if self.first_token_at is not None:
            ttft = self.first_token_at - self.submitted_at
        if self.prefill_done_at is not None and self.admitted_at is not None:
            prefill = self.prompt_len / max(self.prefill_done_at - self.admitted_at, 1e-9)
        if self.generated > 1 and self.last_token_at is not None and self.first_token_at is not None:
            decode = (self.generated - 1) / max(self.last_token_at - self.first_token_at, 1e-9)
        return TokenEvent(token_ids, finish, error, self.prompt_len, 0, self.generated, ttft, prefill, decode,
                          code)


@dataclass(frozen=True)
class WorkItem:
    """Feed `token_ids` at positions start.. of `lane`; sample a token after the last one if `sample`."""

    seq: Sequence
    lane: int
    token_ids: tuple[int, ...]
    start: int
    sample: bool


@dataclass
class Round:
    items: list[WorkItem]
    admitted: list[tuple[int, list[int]]]  # (lane, pages) to install before running
    released: list[int]  # lanes whose pages were returned since the last round


@dataclass(frozen=True)
class SchedulerLimits:
    max_concurrency: int
    max_context: int
    max_pending: int = 16
    pending_timeout_s: float | None = None
    prefill_chunk: int = 512


class Scheduler:
    def __init__(self, limits: SchedulerLimits, allocator: PageAllocator):
        self.limits = limits
        self.allocator = allocator
        self.lanes: list[Sequence | None] = [None] * limits.max_concurrency
        self.pending: deque[Sequence] = deque()
        self._admitted: list[tuple[int, list[int]]] = []
        self._released: list[int] = []

    # -- intake ----------------------------------------------------------------------------------------------
    def check(self, request: GenerationRequest) -> None:
        """Refuse at once what can never run; raises RequestError."""
        n, budget = len(request.prompt_ids), request.sampling.max_tokens
        if n == 0:
            raise RequestError("the prompt is empty; send at least one token", param="prompt")
        if budget < 1:
            raise RequestError(f"max_tokens must be >= 1, got {budget}", param="max_tokens")
        if n + budget > self.limits.max_context:
            raise RequestError(
                f"this request needs {n + budget} tokens ({n} prompt + {budget} max_tokens) but the "
                f"maximum context length is {self.limits.max_context}; shorten the prompt or lower "
                "max_tokens",
                code="context_length_exceeded", param="max_tokens")
        if pages_for(n + budget) > self.allocator.num_pages:
            raise RequestError(f"{n + budget} tokens exceed the KV pool ({self.allocator.num_pages} pages)",
                               code="context_length_exceeded", param="max_tokens")

    def add(self, seq: Sequence) -> None:
        self.check(seq.request)
        if self.busy_lanes + len(self.pending) >= self.limits.max_concurrency + self.limits.max_pending:
            raise RequestError(
                f"server overloaded: {self.limits.max_concurrency} requests running and "
                f"{len(self.pending)} waiting; retry later", code="server_overloaded")
        self.pending.append(seq)

    @property
    def busy_lanes(self) -> int:
        return sum(s is not None for s in self.lanes)

    @property
    def has_work(self) -> bool:
        return bool(self.pending) or self.busy_lanes > 0

    # -- planning --------------------------------------------------------------------------------------------
    def schedule(self, now: float | None = None) -> Round | None:
        now = time.monotonic() if now is None else now
        self._drop_cancelled()
        self._expire_pending(now)
        self._admit(now)
        items = [self._decode_item(s) for s in self.lanes if s is not None and not s.in_prefill]
        prefill = self._prefill_item()
        if prefill is not None:
            items.append(prefill)
        rnd = Round(items, self._admitted, self._released)
        self._admitted, self._released = [], []
        return rnd if (items or rnd.admitted or rnd.released) else None

    def _decode_item(self, s: Sequence) -> WorkItem:
        return WorkItem(s, s.lane, (s.tokens[-1],), s.cached, True)

    def _prefill_item(self) -> WorkItem | None:
        waiting = [s for s in self.lanes if s is not None and s.in_prefill]
        if not waiting:
            return None
        s = min(waiting, key=lambda x: x.admitted_at)
        end = min(s.cached + self.limits.prefill_chunk, s.prompt_len)
        return WorkItem(s, s.lane, tuple(s.tokens[s.cached:end]), s.cached, end == s.prompt_len)

    def _admit(self, now: float) -> None:
        while self.pending and None in self.lanes:
            head = self.pending[0]
            need = pages_for(head.prompt_len + head.request.sampling.max_tokens)
            if not self.allocator.can_reserve(need):
                return
            self.pending.popleft()
            lane = self.lanes.index(None)
            head.lane, head.pages, head.admitted_at = lane, self.allocator.reserve(need), now
            self.lanes[lane] = head
            self._admitted.append((lane, head.pages))

    def _expire_pending(self, now: float) -> None:
        timeout = self.limits.pending_timeout_s
        if timeout is None:
            return
        for s in [s for s in self.pending if now - s.submitted_at > timeout]:
            self.pending.remove(s)
            msg = f"request waited {timeout * 1000:.0f} ms in the queue without a free lane; retry later"
            self._finish(s, "error", msg, code="request_queue_timeout")

    def _drop_cancelled(self) -> None:
        for s in [s for s in self.pending if s.cancel_requested]:
            self.pending.remove(s)
            self._finish(s, "cancelled")
        for s in self.lanes:
            if s is not None and s.cancel_requested:
                self._finish(s, "cancelled")

    # -- results ---------------------------------------------------------------------------------------------
    def commit(self, item: WorkItem, token: int | None, finish: FinishReason | None, now: float) -> None:
        """Record that item ran; `token` is the sampled token (None for a non-final prefill chunk)."""
        s = item.seq
        if s.finished:
            return
        s.cached = item.start + len(item.token_ids)
        if not s.in_prefill and s.prefill_done_at is None:
            s.prefill_done_at = now
        if token is None:
            return
        s.tokens.append(token)
        s.first_token_at = s.first_token_at or now
        s.last_token_at = now
        if finish is None:
            s.emit(s.event((token,)))
        else:
            self._finish(s, finish, token_ids=(token,))

    def fail_one(self, seq: Sequence, message: str, code: str) -> None:
        if seq in self.pending:
            self.pending.remove(seq)
        self._finish(seq, "error", message, code=code)

    def fail_all(self, message: str, code: str) -> None:
        for s in list(self.pending) + [s for s in self.lanes if s is not None]:
            self._finish(s, "error", message, code=code)
        self.pending.clear()

    def _finish(self, s: Sequence, reason: FinishReason, error: str | None = None,
                token_ids: tuple[int, ...] = (), code: str | None = None) -> None:
        if s.finished:
            return
        s.finished = True
        if s.lane is not None:
            self.lanes[s.lane] = None
            self.allocator.free(s.pages)
            self._released.append(s.lane)
            s.lane, s.pages = None, []
        s.emit(s.event(token_ids, reason, error, code))

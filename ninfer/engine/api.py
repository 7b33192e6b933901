"""The engine's public contract, used by the CLIs and the HTTP server.

The scheduler loop runs on its own thread; callers submit token-level requests and read events from
a thread-safe handle. Text-level concerns (templates, detokenisation, stop strings, reasoning and
tool parsing) live in `ninfer.frontend`, which cancels a request once a stop string is seen.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Protocol

FinishReason = Literal["stop", "length", "cancelled", "error"]


@dataclass(frozen=True)
class SamplingParams:
    """Token sampling for one request. temperature 0 (or greedy=True) means argmax."""

    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0 or self.top_k == 1


@dataclass(frozen=True)
class GenerationRequest:
    request_id: str
    prompt_ids: tuple[int, ...]
    sampling: SamplingParams = field(default_factory=SamplingParams)


@dataclass(frozen=True)
class TokenEvent:
    """New tokens for a request; the last event of a request has finish_reason set.

    `error` carries a message when finish_reason == "error" and `error_code` its API code
    (`request_queue_timeout`, `engine_shutdown`, `internal_error`). Timings are seconds since submit.
    """

    token_ids: tuple[int, ...]
    finish_reason: FinishReason | None = None
    error: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    generated_tokens: int = 0
    time_to_first_token_s: float | None = None
    prefill_tok_per_s: float | None = None
    decode_tok_per_s: float | None = None
    error_code: str | None = None


class RequestHandle(Protocol):
    request_id: str

    def next_event(self, timeout_s: float | None = None) -> TokenEvent | None:
        """Block for the next event (None on timeout)."""
        ...

    def cancel(self) -> None:
        """Stop generating; frees the lane, pages and slot within one scheduler round."""
        ...

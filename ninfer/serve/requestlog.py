"""One log line per finished request, and the same record appended as JSON to `--request-log FILE`."""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

log = logging.getLogger("ninfer.serve")


@dataclass(frozen=True)
class RequestRecord:
    request_id: str
    route: str
    status: int
    finish_reason: str
    prompt_tokens: int = 0
    cached_tokens: int = 0
    generated_tokens: int = 0
    time_to_first_token_s: float | None = None
    prefill_tok_per_s: float | None = None
    decode_tok_per_s: float | None = None
    duration_s: float = 0.0
    error: str | None = None

    def line(self) -> str:
        parts = [
            f"{self.request_id} {self.route} {self.status} {self.finish_reason}",
            f"prompt {self.prompt_tokens} (cached {self.cached_tokens})",
            f"generated {self.generated_tokens}",
            f"ttft {_fmt(self.time_to_first_token_s, 's', 3)}",
            f"prefill {_fmt(self.prefill_tok_per_s, ' tok/s', 1)}",
            f"decode {_fmt(self.decode_tok_per_s, ' tok/s', 1)}",
            f"total {self.duration_s:.3f}s",
        ]
        if self.error:
            parts.append(f"error: {self.error}")
        return " · ".join(parts)


def _fmt(value: float | None, unit: str, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}{unit}"


class RequestLog:
    def __init__(self, path: Path | None):
        self.path = path
        self._lock = threading.Lock()

    def record(self, rec: RequestRecord) -> None:
        log.info(rec.line())
        if self.path is None:
            return
        entry = {"time": round(time.time(), 3), **asdict(rec)}
        with self._lock, self.path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(entry, ensure_ascii=False) + "\n")

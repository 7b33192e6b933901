"""Server-wide settings and state shared by every route: the backend (once loaded), metrics, request log."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path

from starlette.requests import Request

from ninfer.serve.backend import Backend
from ninfer.serve.errors import ApiError
from ninfer.serve.metrics import Metrics
from ninfer.serve.requestlog import RequestLog


@dataclass(frozen=True)
class ServeSettings:
    api_key: str | None = None
    max_request_mib: float = 32.0
    default_max_tokens: int = 4096
    keepalive_s: float = 5.0
    request_log: Path | None = None
    cors: tuple[str, ...] = ()
    served_model_id: str | None = None  # overrides the backend's id when set

    @property
    def max_request_bytes(self) -> int:
        return int(self.max_request_mib * (1 << 20))


class ServerState:
    def __init__(self, settings: ServeSettings, backend: Backend | None = None):
        self.settings = settings
        self._backend = backend
        self.load_error: str | None = None
        self.stopping = threading.Event()
        self.metrics = Metrics(self._stats)
        self.request_log = RequestLog(settings.request_log)
        self.generations: set = set()  # live Generation objects, cancelled on shutdown

    def _stats(self):
        return self._backend.stats() if self._backend is not None else None

    @property
    def ready(self) -> bool:
        return self._backend is not None and not self.stopping.is_set()

    def set_backend(self, backend: Backend) -> None:
        self._backend = backend

    def begin_shutdown(self) -> None:
        """Refuse new requests and end in-flight ones with an error (the engine sends it in-stream)."""
        if self.stopping.is_set():
            return
        self.stopping.set()
        if self._backend is not None:
            threading.Thread(target=self._backend.shutdown, name="engine-shutdown", daemon=True).start()

    @property
    def backend(self) -> Backend:
        if self._backend is None:
            raise ApiError(
                503,
                "the model is still loading; retry shortly",
                "model_loading",
                headers={"Retry-After": "2"},
            )
        return self._backend

    @property
    def model_id(self) -> str:
        return self.settings.served_model_id or self.backend.info.model_id


def get_state(request: Request) -> ServerState:
    return request.app.state.ninfer

"""Running the app: bind the socket first, load the model on a thread while serving 503s, stop on SIGTERM.

Shutdown order: the signal marks the server stopping (new requests get 503), the engine ends in-flight
requests with an error that their streams deliver, then uvicorn closes the connections.
"""

from __future__ import annotations

import logging
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable

import uvicorn
from fastapi import FastAPI

from ninfer.errors import EngineConfigError, NinferError
from ninfer.serve.backend import Backend
from ninfer.serve.state import ServerState

log = logging.getLogger("ninfer.serve")


def bind_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    if sys.platform != "win32":  # on Windows SO_REUSEADDR would let two servers share a port
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise EngineConfigError(
            f"cannot listen on {host}:{port} ({exc.strerror}); pick another --port or --host"
        ) from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


class _Uvicorn(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state: ServerState):
        super().__init__(config)
        self.ninfer_state = state

    def handle_exit(self, sig: int, frame: object) -> None:
        self.ninfer_state.begin_shutdown()
        super().handle_exit(sig, frame)
        # uvicorn re-raises captured signals after its shutdown; SIGTERM here means "stop cleanly, exit 0"
        if sig == signal.SIGTERM and self._captured_signals[-1:] == [sig]:
            self._captured_signals.pop()


class Server:
    """One app on one bound socket; `run()` blocks until stopped and returns the exit code."""

    def __init__(
        self,
        app: FastAPI,
        sock: socket.socket,
        loader: Callable[[], Backend] | None = None,
        log_level: str = "warning",
        graceful_s: float = 5.0,
    ):
        self.app = app
        self.state: ServerState = app.state.ninfer
        self.sock = sock
        self.loader = loader
        config = uvicorn.Config(
            app, log_level=log_level, timeout_graceful_shutdown=graceful_s, access_log=False
        )
        self.uvicorn = _Uvicorn(config, self.state)

    @property
    def port(self) -> int:
        return self.sock.getsockname()[1]

    def run(self) -> int:
        if self.loader is not None:
            threading.Thread(target=self._load, name="model-loader", daemon=True).start()
        self.uvicorn.run(sockets=[self.sock])
        self.state.begin_shutdown()
        if self.state.load_error:
            raise EngineConfigError(self.state.load_error)
        return 0

    def _load(self) -> None:
        assert self.loader is not None
        t0 = time.perf_counter()
        try:
            backend = self.loader()
        except NinferError as exc:
            self.state.load_error = str(exc)
            self.uvicorn.should_exit = True
            return
        except Exception as exc:  # not a user mistake, but the server must still stop instead of 503 forever
            self.state.load_error = f"loading the model failed: {type(exc).__name__}: {exc}"
            self.uvicorn.should_exit = True
            raise
        self.state.set_backend(backend)
        log.warning("model '%s' ready in %.1f s", backend.info.model_id, time.perf_counter() - t0)

    def stop(self) -> None:
        """Programmatic SIGTERM (tests, embedding)."""
        self.uvicorn.handle_exit(15, None)

    def start_in_thread(self) -> threading.Thread:
        """Serve on a background thread (tests); returns once the socket accepts connections."""
        thread = threading.Thread(target=self._run_quietly, name="ninfer-serve", daemon=True)
        thread.start()
        deadline = time.monotonic() + 30
        while not self.uvicorn.started and thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        return thread

    def _run_quietly(self) -> None:
        try:
            self.run()
        except NinferError as exc:
            log.warning("server stopped: %s", exc)

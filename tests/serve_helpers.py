"""Helpers for the server tests: a real uvicorn on a free loopback port in a background thread."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from ninfer.engine.api import SamplingParams
from ninfer.serve.app import create_app
from ninfer.serve.backend import ModelInfo
from ninfer.serve.generation import Delta, GenerateOptions, Generation, Usage
from ninfer.serve.server import Server, bind_socket
from ninfer.serve.state import ServeSettings


@dataclass
class RunningServer:
    server: Server
    thread: threading.Thread

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.port}"

    @property
    def state(self):
        return self.server.state

    def stop(self) -> None:
        self.server.stop()
        self.thread.join(15)


def start_server(backend: Any, settings: ServeSettings | None = None, loader=None) -> RunningServer:
    app = create_app(settings or ServeSettings(), backend)
    server = Server(app, bind_socket("127.0.0.1", 0), loader, graceful_s=3.0)
    thread = server.start_in_thread()
    return RunningServer(server, thread)


class FakeBackend:
    """Byte-level stand-in used only while the real engine cannot load an artifact."""

    def __init__(self, max_context: int = 512, token_delay_s: float = 0.01):
        self.info = ModelInfo("fake", max_context, 0, chat_template="fake")
        self.token_delay_s = token_delay_s

    def tokenize(self, text: str, add_special: bool = False) -> list[int]:
        return list(text.encode())

    def detokenize(self, ids: list[int]) -> str:
        return bytes(ids).decode(errors="replace")

    def token_piece(self, token_id: int) -> str:
        return self.detokenize([token_id])

    def vocab_size(self) -> int:
        return 256

    def render_chat(self, messages, tools, add_generation_prompt, template_kwargs) -> str:
        text = "".join(f"<{m['role']}>{m.get('content')}\n" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")

    def starts_in_reasoning(self, prompt: str) -> bool:
        return False

    def sampling_defaults(self, thinking: bool) -> SamplingParams:
        return SamplingParams()

    def generate(self, request_id: str, prompt_ids: list[int], options: GenerateOptions) -> Generation:
        cancelled = threading.Event()
        n = options.sampling.max_tokens

        def deltas() -> Iterator[Delta]:
            for i in range(n):
                if cancelled.wait(self.token_delay_s):
                    yield Delta(finish_reason="cancelled", usage=Usage(len(prompt_ids), i))
                    return
                yield Delta(content="ab"[i % 2])
            yield Delta(finish_reason="length", usage=Usage(len(prompt_ids), n))

        return Generation(request_id, len(prompt_ids), deltas(), cancelled.set)

    def stats(self) -> dict:
        return {"lanes_busy": 0}

    def memory_ledger(self) -> dict:
        return {"line": "fake"}

    def shutdown(self) -> None:
        pass


def wait_until(predicate, timeout_s: float = 5.0, interval_s: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return predicate()

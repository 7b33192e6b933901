"""Helpers for the server tests: the tiny fixture model converted once per process, and real uvicorn
servers over the real engine on free loopback ports in background threads."""

from __future__ import annotations

import tempfile
import threading
import time
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import httpx
from conftest import TINY_HF, convert_tiny
from prometheus_client.parser import text_string_to_metric_families

from ninfer.engine.engine import EngineConfig
from ninfer.serve.app import create_app
from ninfer.serve.engine_backend import EngineBackend
from ninfer.serve.server import Server, bind_socket
from ninfer.serve.state import ServeSettings

USER = [{"role": "user", "content": "Write a haiku about the sea."}]


@cache
def tiny_artifact() -> Path:
    """The tiny Qwen3.5 fixture (bf16 GGUF) converted with ninfer-convert, once per test process."""
    return convert_tiny(Path(tempfile.mkdtemp(prefix="ninfer-serve-tests-")) / "tiny.ninfer")


@cache
def hf_tokenizer():
    """transformers' own tokenizer + template of the fixture: the independent reference for counts."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(TINY_HF))


def hf_prompt_ids(messages, **kwargs) -> list[int]:
    tok = hf_tokenizer()
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
    return tok.encode(text, add_special_tokens=False)


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

    @property
    def model_id(self) -> str:
        return self.state.model_id

    def stop(self) -> None:
        self.server.stop()
        self.thread.join(20)
        assert not self.thread.is_alive(), "the server did not stop"


def engine_config(**overrides) -> EngineConfig:
    values = {"max_concurrency": 2, "max_context": 512, "kv_capacity": 1024, "prefill_chunk": 256}
    values.update(overrides)
    return EngineConfig(**values)


def start_server(
    settings: ServeSettings | None = None, wait_ready: bool = True, load_gate=None,
    artifact: Path | None = None, ready_s: float = 60, **engine_overrides,
) -> RunningServer:
    """A real server: bound socket, engine loaded on the loader thread (after `load_gate` is set) from
    `artifact` (default: the tiny bf16 fixture), ready within `ready_s`."""
    config = engine_config(**engine_overrides)
    artifact = artifact or tiny_artifact()

    def load():
        if load_gate is not None:
            load_gate.wait(30)
        return EngineBackend.load(artifact, config)

    app = create_app(settings or ServeSettings())
    server = Server(app, bind_socket("127.0.0.1", 0), load, graceful_s=3.0)
    running = RunningServer(server, server.start_in_thread())
    if wait_ready:
        assert wait_until(lambda: running.state.ready, ready_s), running.state.load_error
    return running


def wait_until(predicate, timeout_s: float = 5.0, interval_s: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return predicate()


def scrape(url: str, headers: dict | None = None) -> dict[str, float]:
    """/metrics parsed with prometheus_client's own parser: sample name (+labels) → value."""
    text = httpx.get(f"{url}/metrics", headers=headers).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            out[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return out

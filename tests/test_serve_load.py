"""Admission and lifecycle on a real server: overload → 429, pending timeout → 503, client disconnect frees
the lane, SSE keep-alives, 503 model_loading until ready, and SIGTERM-style shutdown that ends streams
with an in-stream error instead of hanging."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import pytest
from serve_helpers import USER, scrape, start_server, wait_until

from ninfer.serve.state import ServeSettings

CHAT = "/v1/chat/completions"


def body(max_tokens: int, stream: bool = True, **extra) -> dict:
    return {
        "messages": USER,
        "max_tokens": max_tokens,
        "stream": stream,
        "enable_thinking": False,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
        **extra,
    }


def sse_events(text: str) -> list[dict]:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]


def lanes_busy(url: str) -> float:
    return scrape(url)["ninfer_lanes_busy"]


# ------------------------------------------------------------------------------------------------ overload


async def _one_stream(client: httpx.AsyncClient, url: str, max_tokens: int) -> tuple[int, str]:
    async with client.stream("POST", f"{url}{CHAT}", json=body(max_tokens)) as r:
        return r.status_code, (await r.aread()).decode()


async def _burst(url: str, n: int, max_tokens: int) -> list[tuple[int, str]]:
    limits = httpx.Limits(max_connections=n + 4, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=180, limits=limits) as client:
        return await asyncio.gather(*(_one_stream(client, url, max_tokens) for _ in range(n)))


def test_overload_refuses_exactly_beyond_capacity_and_admitted_ones_complete():
    # long enough that the last admitted ones wait in the queue past a 0.3 s keep-alive even on a fast, idle
    # machine (8 tokens a request drained the queue in under 0.3 s there)
    max_tokens = 32
    server = start_server(ServeSettings(keepalive_s=0.3), max_concurrency=2, max_pending_requests=8)
    try:
        results = asyncio.run(_burst(server.url, 32, max_tokens))
        statuses = [s for s, _ in results]
        assert statuses.count(429) == 22 and statuses.count(200) == 10, statuses
        for status, text in results:
            if status == 429:
                err = json.loads(text)["error"]
                assert err["code"] == "server_overloaded" and err["type"] == "server_overloaded"
                continue
            events = sse_events(text)
            assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == max_tokens
            assert events[-2]["choices"][0]["finish_reason"] == "length"
            assert text.rstrip().endswith("data: [DONE]")
        # requests that waited in the queue were kept alive with SSE comments
        assert any(": keep-alive" in text for status, text in results if status == 200)
        assert httpx.get(f"{server.url}/health").status_code == 200
        assert wait_until(lambda: lanes_busy(server.url) == 0, 5)
        metrics = scrape(server.url)
        assert metrics["ninfer_queue_depth"] == 0 and metrics["ninfer_kv_pages_used"] == 0
        assert metrics["ninfer_requests_total{route=/v1/chat/completions,status=429}"] == 22
    finally:
        server.stop()


# ------------------------------------------------------------------------- pending timeout and disconnects


@pytest.fixture(scope="module")
def one_lane():
    # 1 s in the queue: long enough that a loaded 2-core CI box still admits the lane-occupying stream; room
    # for a stream long enough to outlast two such waits on a fast, idle one (400 tokens did not, once)
    server = start_server(max_concurrency=1, max_pending_requests=4, pending_timeout_ms=1000,
                          max_context=4096, kv_capacity=4096)
    yield server
    server.stop()


def _occupy_lane(url: str, max_tokens: int = 4000):
    """Start a long stream; returns (client, stream context, line iterator) once it is decoding.

    Keep all three referenced: dropping the iterator closes the connection (a disconnect)."""
    client = httpx.Client(timeout=120)
    ctx = client.stream("POST", f"{url}{CHAT}", json=body(max_tokens))
    response = ctx.__enter__()
    assert response.status_code == 200, response.read().decode()
    lines = response.iter_lines()
    assert next(line for line in lines if line.startswith("data: ")).startswith("data: ")
    return client, ctx, lines


def test_pending_timeout_gives_503_request_queue_timeout(one_lane):
    client, ctx, _lines = _occupy_lane(one_lane.url)
    try:
        assert wait_until(lambda: lanes_busy(one_lane.url) == 1)
        for stream in (False, True):
            r = httpx.post(f"{one_lane.url}{CHAT}", json=body(4, stream=stream), timeout=30)
            assert r.status_code == 503, r.text
            assert r.json()["error"]["code"] == "request_queue_timeout"
            assert r.headers["retry-after"] == "2"
    finally:
        ctx.__exit__(None, None, None)
        client.close()
    assert wait_until(lambda: lanes_busy(one_lane.url) == 0, 5)


def test_stream_disconnect_frees_the_lane_within_a_second(one_lane):
    client, ctx, lines = _occupy_lane(one_lane.url)
    assert lanes_busy(one_lane.url) == 1
    closed_at = time.monotonic()
    ctx.__exit__(None, None, None)  # the client goes away mid-stream
    client.close()
    del lines
    assert wait_until(lambda: lanes_busy(one_lane.url) == 0, 1.0)
    assert time.monotonic() - closed_at < 1.0
    # the next request is admitted at once (it would time out in the queue after 1 s otherwise)
    r = httpx.post(f"{one_lane.url}{CHAT}", json=body(3, stream=False), timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


def test_non_stream_disconnect_cancels_the_request(one_lane):
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{one_lane.url}{CHAT}", json=body(400, stream=False), timeout=1.0)
    # noticed by polling every 0.25 s, then freed by the next scheduler round (slow on a loaded CI box)
    assert wait_until(lambda: lanes_busy(one_lane.url) == 0, 3.0)
    r = httpx.post(f"{one_lane.url}{CHAT}", json=body(2, stream=False), timeout=30)
    assert r.status_code == 200


# ---------------------------------------------------------------------------------------------- lifecycle


def test_model_loading_then_ready_then_graceful_shutdown():
    gate = threading.Event()
    server = start_server(wait_ready=False, load_gate=gate)
    try:
        for method, path, payload in (
            ("GET", "/health", None),
            ("POST", CHAT, body(2)),
            ("GET", "/v1/models", None),
        ):
            r = httpx.request(method, f"{server.url}{path}", json=payload)
            assert r.status_code == 503 and r.headers["retry-after"] == "2"
            assert r.json()["error"]["code"] == "model_loading"
        r = httpx.post(f"{server.url}/v1/messages", json={"model": "m", "max_tokens": 1, "messages": USER})
        assert r.status_code == 503 and r.json()["error"]["type"] == "overloaded_error"
        gate.set()
        assert wait_until(lambda: httpx.get(f"{server.url}/health").status_code == 200, 60)

        received: list[str] = []

        def consume():
            with httpx.stream("POST", f"{server.url}{CHAT}", json=body(400), timeout=60) as r:
                for line in r.iter_lines():
                    received.append(line)

        reader = threading.Thread(target=consume)
        reader.start()
        assert wait_until(lambda: any(x.startswith("data: ") for x in received), 30)
        stopped_at = time.monotonic()
        server.server.stop()  # what SIGTERM does
        reader.join(15)
        assert not reader.is_alive(), "the stream hung after shutdown"
        errors = [e for e in sse_events("\n".join(received)) if "error" in e]
        assert errors and "shut down" in errors[0]["error"]["message"]
        server.thread.join(15)
        assert not server.thread.is_alive()
        assert time.monotonic() - stopped_at < 10
    finally:
        gate.set()
        if server.thread.is_alive():
            server.stop()

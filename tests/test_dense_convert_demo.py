"""The demo CLI (ninfer/cli/demo.py): the --ask streaming client against a stub SSE server, start-up failure
detection, and (slow) --prepare-only on the real SmolLM2 package."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from ninfer.artifact import open_artifact
from ninfer.cli import demo
from ninfer.errors import NinferError


class _Stub(BaseHTTPRequestHandler):
    events: list[bytes] = []
    status = 200
    seen: list[dict] = []

    def do_POST(self):  # noqa: N802 - http.server's name
        length = int(self.headers["Content-Length"])
        _Stub.seen.append(json.loads(self.rfile.read(length)))
        self.send_response(self.status)
        self.send_header("Content-Type", "text/event-stream" if self.status == 200 else "application/json")
        self.end_headers()
        for chunk in self.events:
            self.wfile.write(chunk)
            self.wfile.flush()

    def log_message(self, *args):
        pass


@pytest.fixture
def stub():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Stub)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    _Stub.seen.clear()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def _data(obj) -> bytes:
    return f"data: {json.dumps(obj)}\n\n".encode()


def test_ask_streams_deltas_and_reports_usage(stub, capsys):
    _Stub.status = 200
    _Stub.events = [
        _data({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}),
        b": keep-alive\n\n",
        _data({"choices": [{"index": 0, "delta": {"content": "Hel"}}]}),
        _data({"choices": [{"index": 0, "delta": {"content": "lo ✓"}}]}),
        _data({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 2}}),
        b"data: [DONE]\n\n",
    ]
    assert demo.main(["--host", "127.0.0.1", "--port", stub.rsplit(":", 1)[1], "--ask", "hi",
                      "--max-tokens", "7"]) == 0  # fmt: skip
    out, err = capsys.readouterr()
    assert out == "Hello ✓\n"
    assert "[5 prompt tokens, 2 generated" in err
    sent = _Stub.seen[0]
    assert sent["stream"] is True and sent["max_tokens"] == 7 and sent["messages"][0]["content"] == "hi"
    assert sent["stream_options"] == {"include_usage": True}


def test_ask_error_mid_stream_and_http_error(stub):
    _Stub.status = 200
    _Stub.events = [_data({"choices": [{"delta": {"content": "x"}}]}),
                    _data({"error": {"message": "engine stopped", "code": "internal"}})]  # fmt: skip
    with pytest.raises(NinferError, match="mid-stream: engine stopped"):
        demo.ask(stub, "hi", 5)
    _Stub.status = 400
    _Stub.events = [b'{"error": {"message": "bad max_tokens"}}']
    with pytest.raises(NinferError, match="answered 400.*bad max_tokens"):
        demo.ask(stub, "hi", 5)


def test_ask_without_server_says_how_to_start_one(capsys):
    assert demo.main(["--port", "9", "--ask", "hi"]) == 1
    assert "start one first with `make demo`" in capsys.readouterr().err


def test_server_exit_before_ready_is_reported():
    proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(3)"])
    with pytest.raises(NinferError, match="exited with code 3 before it was ready.*--port"):
        demo.wait_ready("http://127.0.0.1:9", proc)


def test_unknown_model_is_refused(capsys):
    assert demo.main(["--model", "gpt-5"]) == 1
    assert "unknown --model 'gpt-5'; choose from smollm2, qwen2.5-coder" in capsys.readouterr().err


@pytest.mark.slow
def test_prepare_only_fetches_and_converts_once(capsys):
    assert demo.main(["--model", "smollm2", "--prepare-only"]) == 0
    path = capsys.readouterr().out.strip()
    art = open_artifact(path)
    assert art.metadata["name"] == "smollm2-135m-instruct" and art.metadata["recipe"] == "llama_gguf"

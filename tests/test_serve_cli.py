"""ninfer-serve as a program: startup refusals (exit 1, one line), a real start on a socket, SIGTERM."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from serve_helpers import USER, tiny_artifact, wait_until

from ninfer.cli.serve import main

REPO = Path(__file__).resolve().parents[1]

REFUSALS = [
    (["--spec", "mtp"], "--spec mtp"),
    (["--spec", "mtp", "--draft-tokens", "2"], "--spec mtp"),
    (["--draft-tokens", "16"], "--draft-tokens must be 1..15"),
    (["--draft-tokens", "2"], "--draft-tokens needs --spec mtp"),
    (["--vision"], "--vision"),
    (["--vision-residency", "overlay"], "need --vision"),
    (["--host-kv-mib", "512"], "--host-kv-mib"),
    (["--device-profile-path", "profiles.json"], "device profiles"),
    (["--kv-dtype", "fp8"], "--kv-dtype fp8 is not available yet"),
    (
        ["--kv-capacity", "1000", "--max-context", "4096"],
        "--kv-capacity 1000 is smaller than --max-context 4096",
    ),
    (["--kv-capacity", "lots"], "--kv-capacity must be a token count"),
    (["--max-concurrency", "9"], "--max-concurrency must be 1..8"),
    (["--max-concurrency", "0"], "--max-concurrency must be 1..8"),
    (["--max-pending-requests", "-1"], "--max-pending-requests must be >= 0"),
    (["--max-request-mib", "0"], "--max-request-mib must be > 0"),
    (["--port", "70000"], "--port must be 0..65535"),
    (["--chat-template", "/no/such/template.jinja"], "--chat-template"),
    (["--request-log", "/no/such/dir/log.jsonl"], "--request-log"),
    (["--device", "cuda"], "no CUDA GPU"),
]


@pytest.mark.parametrize(("flags", "reason"), REFUSALS, ids=[" ".join(f) for f, _ in REFUSALS])
def test_startup_refusals_exit_1_with_one_line(flags, reason, capsys):
    if flags == ["--device", "cuda"]:
        import torch

        if torch.cuda.is_available():
            pytest.skip("a GPU is visible")  # only meaningful on CPU machines
    assert main([str(tiny_artifact()), *flags]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: "), err
    assert reason in err


def test_missing_model_file(capsys):
    assert main(["/no/such/model.ninfer"]) == 1
    assert "model file not found: /no/such/model.ninfer" in capsys.readouterr().err


def test_corrupt_artifact_is_refused_after_binding(tmp_path, capsys):
    bad = tmp_path / "bad.ninfer"
    bad.write_bytes(b"NINFER\0\3" + os.urandom(100))
    assert main([str(bad), "--port", "0"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: ") and "bad.ninfer" in err[-1]


def test_port_in_use(capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main([str(tiny_artifact()), "--port", str(port)]) == 1
    assert f"cannot listen on 127.0.0.1:{port}" in capsys.readouterr().err


def test_later_features_refused_through_the_real_program():
    out = subprocess.run(
        [sys.executable, "-m", "ninfer.serve", str(tiny_artifact()), "--spec", "mtp"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert out.returncode == 1
    assert out.stderr.strip() == "error: --spec mtp: speculative decoding is not available yet; drop --spec"


def test_real_start_serve_and_sigterm(tmp_path):
    log = tmp_path / "requests.jsonl"
    cmd = [
        sys.executable,
        "-m",
        "ninfer.serve",
        str(tiny_artifact()),
        "--port",
        "0",
        "--model-id",
        "tiny",
        "--max-context",
        "256",
        "--kv-capacity",
        "512",
        "--request-log",
        str(log),
        "--api-key",
        "k",
    ]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, cwd=REPO)
    try:
        first = proc.stderr.readline()
        match = re.search(r"listening on (http://127\.0\.0\.1:\d+)", first)
        assert match, first
        url = match[1]
        auth = {"Authorization": "Bearer k"}
        assert wait_until(lambda: httpx.get(f"{url}/health").status_code == 200, 90)
        r = httpx.post(
            f"{url}/v1/chat/completions",
            headers=auth,
            timeout=60,
            json={"model": "tiny", "messages": USER, "max_tokens": 3, "ignore_eos": True},
        )
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        assert httpx.get(f"{url}/v1/models", headers=auth).json()["data"][0]["max_model_len"] == 256
        if sys.platform == "win32":
            proc.terminate()
        else:
            proc.send_signal(signal.SIGTERM)
        started = time.monotonic()
        assert proc.wait(20) == 0
        assert time.monotonic() - started < 20
        stderr = proc.stderr.read()
        assert "memory (" in stderr and "KV" in stderr and "serving 'tiny'" in stderr
        assert "Traceback" not in stderr
        entry = json.loads(log.read_text().splitlines()[-1])
        assert entry["generated_tokens"] == 3 and entry["status"] == 200
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()

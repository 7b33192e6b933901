"""The real server on the GPU: the tiny fixture served on CUDA (bf16 compute; weights loaded on the server's
loader thread, decode rounds captured as CUDA graphs and replayed on the engine's own thread; the q4_k_m file
through the quantized kernels) answers raw HTTP with the tokens the same engine gives driven in process:
every one of them for a request alone, streamed and not; four at once up to the first step whose top-1/top-2
logit margin is under ROUTE_MARGIN (four-lane rounds run other kernels than one-lane ones: other roundings);
bad requests in between leave it serving. That the GPU engine's tokens are the CPU reference engine's is
`test_kernels_gpu.test_fixture_greedy_gpu_matches_cpu`; this is what the server adds on top."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch
from conftest import convert_tiny, reference_prompts
from serve_helpers import start_server
from test_engine_invariants import greedy_logits, greedy_with_margins

pytestmark = pytest.mark.gpu

N_TOKENS = 24
# twice the largest max |Δ logit| bench/logit_drift.py measured between the engine's routes on the H200
# (session 26: one-lane decode against a one-chunk prefill, q4_k_m and q8_0 files: 0.27). A 0.1 cut failed:
# one lane and four took different tokens at a step where one lane's margin passed it (session 25).
ROUTE_MARGIN = 0.55


def complete(url: str, ids, stream: bool = False) -> tuple[str, int, str]:
    """/v1/completions, greedy, EOS ignored: (text, completion tokens, finish reason)."""
    body = {"prompt": list(ids), "max_tokens": N_TOKENS, "temperature": 0, "ignore_eos": True}
    if not stream:
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        out = r.json()
        choice = out["choices"][0]
        return choice["text"], out["usage"]["completion_tokens"], choice["finish_reason"]
    body |= {"stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        lines = [line for line in r.iter_lines() if line and not line.startswith(":")]  # ": keep-alive"
    assert lines[-1] == "data: [DONE]", lines[-3:]
    assert all(line.startswith("data: ") for line in lines), lines
    chunks = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    choices = [c["choices"][0] for c in chunks if c["choices"]]
    finish = [c["finish_reason"] for c in choices if c["finish_reason"]]
    assert len(finish) == 1, finish
    return "".join(c["text"] for c in choices), chunks[-1]["usage"]["completion_tokens"], finish[0]


@pytest.fixture(scope="module", params=["model-bf16.gguf", "model-q4_k_m.gguf"])
def served(request, tmp_path_factory):
    """(GPU server, prompts, name -> the in-process engine's text, -> that text up to the fragile step)."""
    from ninfer.artifact import open_artifact
    from ninfer.engine.engine import EngineConfig
    from ninfer.models import load_model

    artifact = convert_tiny(tmp_path_factory.mktemp("serve-gpu") / "tiny.ninfer", request.param)
    prompts = reference_prompts()
    # the weights as the server's engine keeps them on CUDA (GGUF matrices resident, same-input projections
    # merged, the bf16 file's too: one matmul over the merged rows, whose rounding dense Linears do not share)
    model = load_model(open_artifact(artifact), dtype=torch.bfloat16, device="cuda", load_mtp=False,
                       quantized_weights=EngineConfig(device="cuda").keeps_quantized_weights)
    tokens, margins = greedy_with_margins(model, "cuda", "bfloat16", "bf16", prompts, N_TOKENS)
    # the margins come from eager rounds (graph replays hide their logits); the graphs give the same tokens
    assert greedy_logits(model, "cuda", "bfloat16", "bf16", prompts, N_TOKENS)[0] == tokens
    del model
    # KV dtype and prefill chunk as in greedy_with_margins: the same kernels, the same rounding
    gpu = start_server(artifact=artifact, device="cuda", dtype="bfloat16", kv_dtype="bf16", max_concurrency=4,
                       max_context=256, prefill_chunk=16, ready_s=300)

    def text(ids) -> str:
        r = httpx.post(f"{gpu.url}/detokenize", json={"tokens": ids})
        assert r.status_code == 200, r.text
        return r.json()["content"]

    whole, robust = {}, {}
    for name in prompts:
        agree = next((i for i, m in enumerate(margins[name]) if m < ROUTE_MARGIN), N_TOKENS)
        whole[name] = text(tokens[name])
        # a cut inside a multi-byte character ends with U+FFFD where the longer text goes on
        robust[name] = text(tokens[name][:agree]).rstrip("\ufffd")
    yield gpu, prompts, whole, robust
    gpu.stop()


def check(result: tuple[str, int, str], expected: str, exact: bool) -> None:
    text, completion_tokens, finish = result
    assert (completion_tokens, finish) == (N_TOKENS, "length")
    assert text == expected if exact else text.startswith(expected), (text, expected)


def test_alone_streamed_and_not(served):
    gpu, prompts, whole, _ = served
    for name, ids in prompts.items():
        for stream in (False, True):
            check(complete(gpu.url, ids, stream=stream), whole[name], exact=True)


def test_four_at_once(served):
    gpu, prompts, _, robust = served
    work = [("p1", False), ("p2", True), ("p3", False), ("p1", True)]
    with ThreadPoolExecutor(len(work)) as pool:
        results = list(pool.map(lambda w: complete(gpu.url, prompts[w[0]], stream=w[1]), work))
    for (name, _), result in zip(work, results, strict=True):
        check(result, robust[name], exact=False)


def test_bad_requests_leave_it_serving(served):
    gpu, prompts, whole, _ = served
    r = httpx.post(f"{gpu.url}/v1/completions", content=b"{not json",
                   headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    r = httpx.post(f"{gpu.url}/v1/completions", json={"prompt": [1] * 300, "max_tokens": 4})
    assert r.status_code == 400 and "context" in r.text.lower(), r.text
    r = httpx.post(f"{gpu.url}/v1/completions", json={"prompt": [10**9], "max_tokens": 4})
    assert r.status_code == 400 and "vocabulary" in r.text, r.text
    check(complete(gpu.url, prompts["p2"]), whole["p2"], exact=True)

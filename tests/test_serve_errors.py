"""Malformed requests: each gets its documented status, error envelope and a message naming the field;
the server keeps answering normal requests afterwards."""

from __future__ import annotations

import json

import httpx
import pytest
from serve_helpers import USER, start_server

from ninfer.serve.state import ServeSettings

KEY = "sk-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
LIMIT_MIB = 0.02  # 20 KiB bodies at most
MAX_CONTEXT = 256
CHAT = "/v1/chat/completions"
MSG = "/v1/messages"
U = [{"role": "user", "content": "hi"}]


def chat(**fields):
    return {"messages": U, "max_tokens": 2, **fields}


def claude(**fields):
    return {"model": "qwen35-tiny", "max_tokens": 2, "messages": U, **fields}


TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
CASES = [
    # (id, path, body: dict | bytes, status, param, code)
    ("invalid-json", CHAT, b"{bad json", 400, "body", "invalid_json"),
    (
        "invalid-utf8",
        CHAT,
        b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}',
        400,
        "body",
        "invalid_json",
    ),
    ("empty-body", CHAT, b"", 400, "body", "invalid_json"),
    ("array-body", CHAT, b"[1, 2]", 400, "body", "invalid_json"),
    ("missing-messages", CHAT, {"max_tokens": 2}, 400, "messages", None),
    ("messages-not-list", CHAT, {"messages": "hi"}, 400, "messages", None),
    ("messages-empty", CHAT, {"messages": []}, 400, "messages", None),
    ("missing-role", CHAT, {"messages": [{"content": "hi"}]}, 400, "messages[0].role", None),
    (
        "unknown-role",
        CHAT,
        {"messages": [{"role": "wizard", "content": "hi"}]},
        400,
        "messages[0].role",
        None,
    ),
    (
        "empty-content",
        CHAT,
        {"messages": [{"role": "user", "content": ""}]},
        400,
        "messages[0].content",
        None,
    ),
    (
        "content-wrong-type",
        CHAT,
        {"messages": [{"role": "user", "content": 42}]},
        400,
        "messages[0].content",
        None,
    ),
    (
        "part-without-text",
        CHAT,
        {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
        400,
        "messages[0].content[0].text",
        None,
    ),
    (
        "part-unknown-type",
        CHAT,
        {"messages": [{"role": "user", "content": [{"type": "hologram"}]}]},
        400,
        "messages[0].content[0].type",
        None,
    ),
    (
        "image-without-vision",
        CHAT,
        {
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}],
                }
            ]
        },
        400,
        "messages[0].content[0]",
        "vision_disabled",
    ),
    (
        "second-message-bad",
        CHAT,
        {"messages": [U[0], {"role": "assistant"}, U[0]]},
        400,
        "messages[1].content",
        None,
    ),
    ("n-2", CHAT, chat(n=2), 400, "n", "n_not_supported"),
    ("negative-max-tokens", CHAT, chat(max_tokens=-1), 400, "max_tokens", None),
    ("max-tokens-string", CHAT, chat(max_tokens="many"), 400, "max_tokens", None),
    ("temperature-too-high", CHAT, chat(temperature=5), 400, "temperature", None),
    ("top-p-zero", CHAT, chat(top_p=0), 400, "top_p", None),
    ("top-k-negative", CHAT, chat(top_k=-2), 400, "top_k", None),
    ("presence-penalty-range", CHAT, chat(presence_penalty=3), 400, "presence_penalty", None),
    ("seed-string", CHAT, chat(seed="x"), 400, "seed", None),
    ("too-many-stops", CHAT, chat(stop=[str(i) for i in range(17)]), 400, "stop", None),
    ("empty-stop", CHAT, chat(stop=[""]), 400, "stop", None),
    ("logit-bias-nonzero", CHAT, chat(logit_bias={"5": 10}), 400, "logit_bias", "logit_bias_not_supported"),
    ("logit-bias-bad-key", CHAT, chat(logit_bias={"abc": 0}), 400, "logit_bias", None),
    ("logprobs", CHAT, chat(logprobs=True), 400, "logprobs", "logprobs_not_supported"),
    (
        "response-format",
        CHAT,
        chat(response_format={"type": "json_object"}),
        400,
        "response_format",
        "response_format_not_supported",
    ),
    ("stream-options-type", CHAT, chat(stream=True, stream_options="yes"), 400, "stream_options", None),
    ("template-kwargs-type", CHAT, chat(chat_template_kwargs=[1]), 400, "chat_template_kwargs", None),
    (
        "tool-schema-not-object",
        CHAT,
        chat(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]),
        400,
        "tools[0].function.parameters",
        None,
    ),
    ("tool-without-function", CHAT, chat(tools=[{"type": "function"}]), 400, "tools[0].function", None),
    (
        "tool-bad-name",
        CHAT,
        chat(tools=[{"type": "function", "function": {"name": "get weather!"}}]),
        400,
        "tools[0].function.name",
        None,
    ),
    (
        "tool-choice-required",
        CHAT,
        chat(tools=[TOOL], tool_choice="required"),
        400,
        "tool_choice",
        "tool_choice_not_supported",
    ),
    ("tool-choice-unknown", CHAT, chat(tools=[TOOL], tool_choice="sometimes"), 400, "tool_choice", None),
    (
        "tool-arguments-not-json",
        CHAT,
        {
            "messages": [
                U[0],
                {
                    "role": "assistant",
                    "tool_calls": [
                        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{not json"}}
                    ],
                },
                U[0],
            ]
        },
        400,
        "messages[1].tool_calls[0].function.arguments",
        None,
    ),
    (
        "template-refuses",
        CHAT,
        {"messages": [{"role": "system", "content": "only a system prompt"}]},
        400,
        "messages",
        None,
    ),
    ("unknown-model", CHAT, chat(model="gpt-9"), 404, "model", "model_not_found"),
    (
        "prompt-over-context",
        CHAT,
        {"messages": [{"role": "user", "content": "word " * 400}]},
        400,
        "messages",
        "context_length_exceeded",
    ),
    ("max-tokens-over-context", CHAT, chat(max_tokens=10_000), 400, "max_tokens", "context_length_exceeded"),
    (
        "oversize-body",
        CHAT,
        {"messages": [{"role": "user", "content": "x" * 30_000}]},
        413,
        "body",
        "request_too_large",
    ),
    ("completions-no-prompt", "/v1/completions", {"max_tokens": 2}, 400, "prompt", None),
    ("completions-bad-token", "/v1/completions", {"prompt": [1, 999_999]}, 400, "prompt[1]", None),
    (
        "completions-suffix",
        "/v1/completions",
        {"prompt": "a", "suffix": "b"},
        400,
        "suffix",
        "suffix_not_supported",
    ),
    ("completions-two-prompts", "/v1/completions", {"prompt": ["a", "b"]}, 400, "prompt", "n_not_supported"),
    ("llama-n-predict", "/completion", {"prompt": "a", "n_predict": -5}, 400, "n_predict", None),
    ("llama-n-probs", "/completion", {"prompt": "a", "n_probs": 3}, 400, "n_probs", None),
    ("llama-grammar", "/completion", {"prompt": "a", "grammar": "root ::= x"}, 400, "grammar", None),
    ("tokenize-no-content", "/tokenize", {"text": "a"}, 400, "content", None),
    ("detokenize-out-of-vocab", "/detokenize", {"tokens": [5, -1]}, 400, "tokens[1]", None),
    ("detokenize-not-list", "/detokenize", {"tokens": "1 2"}, 400, "tokens", None),
    ("apply-template-no-messages", "/apply-template", {}, 400, "messages", None),
    # Anthropic envelope: {"type": "error", "error": {"type", "message"}}
    ("claude-missing-max-tokens", MSG, {"model": "qwen35-tiny", "messages": U}, 400, "max_tokens", None),
    ("claude-missing-model", MSG, {"max_tokens": 2, "messages": U}, 400, "model", None),
    (
        "claude-system-role",
        MSG,
        claude(messages=[{"role": "system", "content": "x"}]),
        400,
        "messages[0].role",
        None,
    ),
    (
        "claude-empty-content",
        MSG,
        claude(messages=[{"role": "user", "content": []}]),
        400,
        "messages[0].content",
        None,
    ),
    (
        "claude-tool-use-no-input",
        MSG,
        claude(
            messages=[U[0], {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f"}]}]
        ),
        400,
        "messages[1].content[0].input",
        None,
    ),
    (
        "claude-schema-not-object",
        MSG,
        claude(tools=[{"name": "f", "input_schema": {"type": "array"}}]),
        400,
        "tools[0].input_schema",
        None,
    ),
    ("claude-thinking-type", MSG, claude(thinking={"type": "maybe"}), 400, "thinking.type", None),
    ("claude-temperature", MSG, claude(temperature=1.5), 400, "temperature", None),
    (
        "claude-image",
        MSG,
        claude(
            messages=[
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "image",
                            "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"},
                        }
                    ],
                }
            ]
        ),
        400,
        "messages[0].content[0]",
        None,
    ),
    ("claude-unknown-model", MSG, claude(model="claude-9"), 404, "model", None),
    ("claude-count-no-messages", f"{MSG}/count_tokens", {"model": "qwen35-tiny"}, 400, "messages", None),
]


@pytest.fixture(scope="module")
def server():
    settings = ServeSettings(api_key=KEY, max_request_mib=LIMIT_MIB, cors=("https://app.example",))
    running = start_server(settings, max_context=MAX_CONTEXT)
    yield running
    running.stop()


def post(server, path: str, body, headers=AUTH) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(
        f"{server.url}{path}",
        content=content,
        headers={**headers, "content-type": "application/json"},
        timeout=60,
    )


def test_enough_cases():
    assert len(CASES) >= 40


@pytest.mark.parametrize(
    ("path", "body", "status", "param", "code"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_malformed_request(server, path, body, status, param, code):
    r = post(server, path, body)
    assert r.status_code == status, r.text
    assert r.headers["x-request-id"]
    if path.startswith(MSG):
        err = r.json()
        assert err["type"] == "error" and err["error"]["type"] in ("invalid_request_error", "not_found_error")
        assert param in err["error"]["message"]
        return
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param, err
    assert param in err["message"]
    if code is not None:
        assert err["code"] == code
    assert "\n" not in err["message"]


def test_context_length_message_names_both_numbers(server):
    err = post(server, CHAT, chat(max_tokens=10_000)).json()["error"]
    assert "10000" in err["message"] and str(MAX_CONTEXT) in err["message"]


def test_api_key(server):
    r = post(server, CHAT, chat(), headers={})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = post(server, CHAT, chat(), headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401 and r.json()["error"]["message"] == "invalid API key"
    r = post(server, MSG, claude(), headers={"x-api-key": "wrong"})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert httpx.get(f"{server.url}/health").status_code == 200  # no key needed
    assert httpx.get(f"{server.url}/v1/models", headers={"x-api-key": KEY}).status_code == 200


def test_oversize_chunked_body_without_length(server):
    def chunks():
        for _ in range(40):
            yield b"x" * 1024

    r = httpx.post(f"{server.url}{CHAT}", content=chunks(), headers=AUTH)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


def test_unknown_route_and_method(server):
    r = httpx.get(f"{server.url}/v1/nothing", headers=AUTH)
    assert r.status_code == 404 and "/v1/nothing" in r.json()["error"]["message"]
    r = httpx.get(f"{server.url}{CHAT}", headers=AUTH)
    assert r.status_code == 405


def test_normal_request_after_the_bad_ones(server):
    r = post(server, CHAT, {"messages": USER, "max_tokens": 3, "enable_thinking": False, "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 3


def test_cors_preflight_and_headers(server):
    origin = {"Origin": "https://app.example"}
    r = httpx.options(
        f"{server.url}{CHAT}",
        headers={
            **origin,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization",
        },
    )
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://app.example"
    r = httpx.get(f"{server.url}/v1/models", headers={**AUTH, **origin})
    assert r.headers["access-control-allow-origin"] == "https://app.example"
    r = httpx.options(
        f"{server.url}{CHAT}",
        headers={"Origin": "https://evil.example", "Access-Control-Request-Method": "POST"},
    )
    assert "access-control-allow-origin" not in r.headers

"""The server's APIs through their own clients (openai, anthropic, raw httpx) on a real uvicorn over the
real engine and the tiny fixture model; counts are checked against transformers' tokenizer and template."""

from __future__ import annotations

import json
import logging

import anthropic
import httpx
import openai
import pytest
from serve_helpers import USER, hf_prompt_ids, hf_tokenizer, scrape, start_server

from ninfer.serve.state import ServeSettings

NO_THINK = {"enable_thinking": False, "ignore_eos": True}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather of a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("serve") / "requests.jsonl"
    running = start_server(ServeSettings(request_log=log))
    running.log_path = log
    yield running
    running.stop()


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)


def test_models_list_and_retrieve(server, oai):
    models = oai.models.list().data
    assert [m.id for m in models] == ["qwen35-tiny"]
    assert models[0].model_extra["max_model_len"] == 512
    assert models[0].model_extra["modalities"] == ["text"]
    assert oai.models.retrieve("qwen35-tiny").id == "qwen35-tiny"
    with pytest.raises(openai.NotFoundError):
        oai.models.retrieve("no-such-model")
    assert httpx.get(f"{server.url}/v1/v1/models").json()["data"][0]["id"] == "qwen35-tiny"
    doubled = openai.OpenAI(base_url=f"{server.url}/v1/v1", api_key="unused", max_retries=0)
    r = doubled.chat.completions.create(
        model=server.model_id, messages=USER, max_tokens=1, extra_body=NO_THINK
    )
    assert r.usage.completion_tokens == 1


def test_chat_non_stream_usage_equals_tokenizer_counts(server, oai):
    r = oai.chat.completions.create(
        model=server.model_id, messages=USER, max_tokens=6, seed=1, extra_body=NO_THINK
    )
    assert r.object == "chat.completion"
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == len(hf_prompt_ids(USER, enable_thinking=False))
    assert r.usage.completion_tokens == 6
    assert r.usage.total_tokens == r.usage.prompt_tokens + 6
    assert isinstance(r.choices[0].message.content, str)


def test_chat_thinking_output_is_reasoning_content(server, oai):
    r = oai.chat.completions.create(
        model=server.model_id, messages=USER, max_tokens=5, seed=2, extra_body={"ignore_eos": True}
    )
    # the template opens <think>, so generation starts as reasoning
    assert r.usage.prompt_tokens == len(hf_prompt_ids(USER))
    assert r.choices[0].message.model_extra.get("reasoning_content")


def test_chat_stream_with_usage_and_same_text_as_non_stream(server, oai):
    kwargs = dict(model=server.model_id, messages=USER, max_tokens=6, seed=7, extra_body=NO_THINK)
    chunks = list(oai.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == 6
    assert chunks[-1].usage.prompt_tokens == len(hf_prompt_ids(USER, enable_thinking=False))
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == oai.chat.completions.create(**kwargs).choices[0].message.content


def test_same_seed_same_text(server, oai):
    kwargs = dict(
        model=server.model_id, messages=USER, max_tokens=8, seed=1234, temperature=1.0, extra_body=NO_THINK
    )
    first = oai.chat.completions.create(**kwargs).choices[0].message.content
    assert oai.chat.completions.create(**kwargs).choices[0].message.content == first


def test_completions_stream_and_not(server, oai):
    prompt = "def fibonacci(n):"
    r = oai.completions.create(
        model=server.model_id, prompt=prompt, max_tokens=5, seed=3, extra_body={"ignore_eos": True}
    )
    assert r.usage.prompt_tokens == len(hf_tokenizer().encode(prompt, add_special_tokens=False))
    assert r.usage.completion_tokens == 5
    assert r.choices[0].finish_reason == "length"
    chunks = list(
        oai.completions.create(
            model=server.model_id,
            prompt=prompt,
            max_tokens=5,
            seed=3,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5
    assert "".join(c.choices[0].text for c in chunks if c.choices) == r.choices[0].text


def _tool_conversation(arguments):
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}
    return [
        {"role": "system", "content": "You are a weather bot."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 21}'},
    ]


def test_tool_definitions_round_trip_through_the_template(server, oai):
    ours = _tool_conversation(json.dumps({"city": "Paris"}))  # OpenAI clients send arguments as a JSON string
    theirs = _tool_conversation({"city": "Paris"})
    expected = hf_tokenizer().apply_chat_template(
        theirs, tools=TOOLS, tokenize=False, add_generation_prompt=True
    )
    rendered = httpx.post(f"{server.url}/apply-template", json={"messages": ours, "tools": TOOLS}).json()[
        "prompt"
    ]
    assert rendered == expected
    assert '"name": "get_weather"' in rendered and "<parameter=city>\nParis" in rendered
    r = oai.chat.completions.create(
        model=server.model_id, messages=ours, tools=TOOLS, max_tokens=3, extra_body={"ignore_eos": True}
    )
    assert r.usage.prompt_tokens == len(hf_prompt_ids(theirs, tools=TOOLS))


def test_anthropic_messages_non_stream_and_stream(server, claude):
    kwargs = dict(
        model=server.model_id,
        max_tokens=5,
        system="Answer briefly.",
        extra_body={"temperature": 0},
        messages=[{"role": "user", "content": [{"type": "text", "text": "Hello there"}]}],
        thinking={"type": "disabled"},
    )
    expected_input = len(
        hf_prompt_ids(
            [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Hello there"}],
            enable_thinking=False,
        )
    )
    m = claude.messages.create(**kwargs)
    assert m.type == "message" and m.role == "assistant"
    assert m.usage.input_tokens == expected_input
    assert 1 <= m.usage.output_tokens <= 5
    assert m.stop_reason == ("max_tokens" if m.usage.output_tokens == 5 else "end_turn")
    count = claude.messages.count_tokens(
        model=server.model_id,
        system=kwargs["system"],
        messages=kwargs["messages"],
        thinking={"type": "disabled"},
    )
    assert count.input_tokens == expected_input
    with claude.messages.stream(**kwargs) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert final.content[0].text == m.content[0].text  # greedy: the same text both ways
    assert final.usage.output_tokens == m.usage.output_tokens


def test_anthropic_thinking_blocks_and_tool_history(server, claude):
    m = claude.messages.create(
        model=server.model_id,
        max_tokens=4,
        messages=[{"role": "user", "content": "Hi"}],
        thinking={"type": "enabled", "budget_tokens": 1024},
    )
    assert m.content[0].type == "thinking" and m.content[0].thinking
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": [
                {"type": "tool_use", "id": "call_1", "name": "get_weather", "input": {"city": "Paris"}}
            ],
        },
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": "call_1", "content": '{"temp_c": 21}'}],
        },
    ]
    tools = [
        {
            "name": "get_weather",
            "description": "Current weather of a city",
            "input_schema": TOOLS[0]["function"]["parameters"],
        }
    ]
    count = claude.messages.count_tokens(model=server.model_id, messages=messages, tools=tools)
    theirs = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 21}'},
    ]
    assert count.input_tokens == len(hf_prompt_ids(theirs, tools=TOOLS))


def _sse_data(text: str) -> list[dict]:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: ")]


def test_llamacpp_completion_stream_and_not(server):
    body = {"prompt": "The quick brown fox", "n_predict": 5, "seed": 11, "ignore_eos": True}
    r = httpx.post(f"{server.url}/completion", json=body, timeout=60).json()
    assert r["stop"] is True and r["tokens_predicted"] == 5 and r["stop_type"] == "limit"
    assert r["tokens_evaluated"] == len(hf_tokenizer().encode(body["prompt"], add_special_tokens=False))
    assert r["timings"]["predicted_n"] == 5
    events = _sse_data(httpx.post(f"{server.url}/completion", json={**body, "stream": True}, timeout=60).text)
    assert events[-1]["stop"] is True and events[-1]["tokens_predicted"] == 5
    assert all(e["stop"] is False for e in events[:-1])
    assert "".join(e["content"] for e in events) == r["content"]


def test_tokenize_detokenize_round_trip(server):
    text = "Hello, wörld! 你好 🙂 x = [1, 2]\n\tdone"
    ids = httpx.post(f"{server.url}/tokenize", json={"content": text}).json()["tokens"]
    assert ids == hf_tokenizer().encode(text, add_special_tokens=False)
    pieces = httpx.post(f"{server.url}/tokenize", json={"content": "Hello", "with_pieces": True}).json()[
        "tokens"
    ]
    assert "".join(p["piece"] for p in pieces) == "Hello"
    assert httpx.post(f"{server.url}/detokenize", json={"tokens": ids}).json()["content"] == text


def test_apply_template_equals_engine_render_and_transformers(server):
    messages = [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4", "reasoning_content": "Add them."},
        {"role": "user", "content": "And 3+3?"},
    ]
    for kwargs in ({}, {"enable_thinking": False}):
        rendered = httpx.post(f"{server.url}/apply-template", json={"messages": messages, **kwargs}).json()[
            "prompt"
        ]
        engine_render = server.state.backend.render_chat(messages, None, True, kwargs)
        expected = hf_tokenizer().apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, **kwargs
        )
        assert rendered == engine_render == expected


def test_metrics_parse_and_counters_move(server, oai):
    before = scrape(server.url)
    oai.chat.completions.create(model=server.model_id, messages=USER, max_tokens=4, extra_body=NO_THINK)
    after = scrape(server.url)
    assert after["ninfer_generation_tokens_total"] - before.get("ninfer_generation_tokens_total", 0) == 4
    key = "ninfer_requests_total{route=/v1/chat/completions,status=200}"
    assert after[key] - before.get(key, 0) == 1
    assert after["ninfer_prompt_tokens_total"] > before.get("ninfer_prompt_tokens_total", 0)
    assert after["ninfer_lanes_total"] == 2 and after["ninfer_lanes_busy"] == 0
    assert after["ninfer_kv_pages_used"] == 0 and after["ninfer_kv_pages_free"] > 0
    assert after["ninfer_time_to_first_token_seconds_count"] > before.get(
        "ninfer_time_to_first_token_seconds_count", 0
    )


def test_props_request_id_and_request_log(server, oai, caplog):
    props = httpx.get(f"{server.url}/props").json()
    assert props["total_slots"] == 2 and props["default_generation_settings"]["n_ctx"] == 512
    assert "KV" in props["memory_ledger"]["line"] and props["memory_ledger"]["kv_dtype"] == "bf16"
    assert props["chat_template"].startswith("{%")
    r = httpx.get(f"{server.url}/health", headers={"x-request-id": "my-trace-42"})
    assert r.headers["x-request-id"] == "my-trace-42"
    assert httpx.get(f"{server.url}/nope").headers["x-request-id"].startswith("req-")
    with caplog.at_level(logging.INFO, logger="ninfer.serve"):
        raw = oai.chat.completions.with_raw_response.create(
            model=server.model_id, messages=USER, max_tokens=3, extra_body=NO_THINK
        )
    assert raw.headers["x-request-id"]
    line = next(r.getMessage() for r in caplog.records if "/v1/chat/completions" in r.getMessage())
    assert "prompt" in line and "generated 3" in line and "ttft" in line and "decode" in line
    records = [json.loads(x) for x in server.log_path.read_text().splitlines()]
    last = records[-1]
    assert last["route"] == "/v1/chat/completions" and last["generated_tokens"] == 3
    assert last["prompt_tokens"] == len(hf_prompt_ids(USER, enable_thinking=False))
    assert last["time_to_first_token_s"] > 0 and last["decode_tok_per_s"] > 0


def test_stop_strings_cut_the_output(server, oai, claude):
    kwargs = dict(model=server.model_id, messages=USER, max_tokens=8, temperature=0, extra_body=NO_THINK)
    full = oai.chat.completions.create(**kwargs).choices[0].message.content
    assert len(full) >= 4, full
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    r = oai.chat.completions.create(stop=[stop], **kwargs)
    assert r.choices[0].message.content == full[: full.find(stop)]
    assert r.choices[0].finish_reason == "stop"
    m = claude.messages.create(
        model=server.model_id,
        max_tokens=8,
        messages=USER,
        stop_sequences=[stop],
        thinking={"type": "disabled"},
        extra_body={"temperature": 0},
    )
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop
    assert m.content[0].text == full[: full.find(stop)]

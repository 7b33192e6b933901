"""Response shapes for output the tiny random model never produces (tool calls, reasoning next to content,
in-stream errors), checked with the SDKs' own models and stream accumulators."""

from __future__ import annotations

import json

import anthropic
import openai
import pydantic
from anthropic.lib.streaming._messages import accumulate_event
from openai.lib.streaming.chat import ChatCompletionStreamState

from ninfer.serve.anthropic import MessagesStreamFormatter, message_body
from ninfer.serve.generation import Collected, Delta, ToolCall, Usage
from ninfer.serve.llamacpp import _StreamFormatter as LlamaStreamFormatter
from ninfer.serve.llamacpp import _Summary
from ninfer.serve.openai import ChatStreamFormatter, chat_completion_body

CALL = ToolCall("call_abc", "get_weather", '{"city": "Paris", "days": 2}')
USAGE = Usage(
    prompt_tokens=30,
    completion_tokens=12,
    cached_tokens=4,
    time_to_first_token_s=0.2,
    prefill_tok_per_s=150.0,
    decode_tok_per_s=40.0,
)
DELTAS = [
    Delta(reasoning="The user wants "),
    Delta(reasoning="weather."),
    Delta(content="Let me check."),
    Delta(tool_calls=(CALL,)),
    Delta(finish_reason="tool_calls", usage=USAGE),
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            },
        },
    }
]


def collected(deltas) -> Collected:
    out = Collected()
    for d in deltas:
        out.add(d)
    return out


def data_lines(chunks: list[str]) -> list[dict]:
    return [json.loads(c[6:]) for chunk in chunks for c in chunk.splitlines() if c.startswith("data: {")]


def test_openai_non_stream_tool_call_and_reasoning():
    body = chat_completion_body("chatcmpl-1", 123, "m", collected(DELTAS))
    completion = openai.types.chat.ChatCompletion.model_validate(body)
    message = completion.choices[0].message
    assert message.content == "Let me check."
    assert message.model_extra["reasoning_content"] == "The user wants weather."
    assert message.tool_calls[0].id == "call_abc" and message.tool_calls[0].function.name == "get_weather"
    assert json.loads(message.tool_calls[0].function.arguments) == {"city": "Paris", "days": 2}
    assert completion.choices[0].finish_reason == "tool_calls"
    assert completion.usage.prompt_tokens_details.cached_tokens == 4
    only_call = chat_completion_body("c", 1, "m", collected([Delta(tool_calls=(CALL,)), DELTAS[-1]]))
    assert only_call["choices"][0]["message"]["content"] is None  # as OpenAI sends it


def test_openai_stream_accumulates_like_the_sdk():
    fmt = ChatStreamFormatter("chatcmpl-1", 123, "m", include_usage=True)
    chunks = fmt.prologue() + [c for d in DELTAS for c in fmt.feed(d)]
    state = ChatCompletionStreamState(input_tools=TOOLS)
    for data in data_lines(chunks):
        state.handle_chunk(openai.types.chat.ChatCompletionChunk.model_validate(data))
    final = state.get_final_completion()
    assert final.choices[0].message.content == "Let me check."
    assert final.choices[0].finish_reason == "tool_calls"
    call = final.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather" and call.id == "call_abc"
    assert json.loads(call.function.arguments) == {"city": "Paris", "days": 2}
    assert final.usage.completion_tokens == 12
    last = data_lines(chunks)[-1]
    assert last["choices"] == [] and last["usage"]["total_tokens"] == 42


def test_openai_stream_error_after_start_is_in_stream():
    fmt = ChatStreamFormatter("chatcmpl-1", 123, "m", include_usage=True)
    chunks = fmt.feed(Delta(content="partial")) + fmt.feed(
        Delta(finish_reason="error", error="the engine shut down", error_code="engine_shutdown")
    )
    error = data_lines(chunks)[-1]["error"]
    assert error["code"] == "engine_shutdown" and "shut down" in error["message"]


def test_anthropic_non_stream_blocks():
    message = anthropic.types.Message.model_validate(message_body("msg_1", "m", 30, collected(DELTAS)))
    kinds = [b.type for b in message.content]
    assert kinds == ["thinking", "text", "tool_use"]
    assert message.content[2].input == {"city": "Paris", "days": 2} and message.content[2].id == "call_abc"
    assert message.stop_reason == "tool_use"
    assert message.usage.input_tokens == 30 and message.usage.output_tokens == 12


def _anthropic_events(chunks: list[str]) -> list[tuple[str, dict]]:
    out = []
    for chunk in chunks:
        lines = chunk.strip().splitlines()
        assert lines[0].startswith("event: ") and lines[1].startswith("data: ")
        out.append((lines[0][7:], json.loads(lines[1][6:])))
    return out


def test_anthropic_stream_accumulates_like_the_sdk():
    fmt = MessagesStreamFormatter("msg_1", "m", 30)
    events = _anthropic_events(fmt.prologue() + [c for d in DELTAS for c in fmt.feed(d)])
    assert all(name == data["type"] for name, data in events)
    adapter = pydantic.TypeAdapter(anthropic.types.RawMessageStreamEvent)
    snapshot, bufs = None, {}
    for _, data in events:
        if data["type"] == "ping":
            continue
        snapshot = accumulate_event(
            event=adapter.validate_python(data), current_snapshot=snapshot, json_bufs=bufs
        )
    assert [b.type for b in snapshot.content] == ["thinking", "text", "tool_use"]
    assert snapshot.content[0].thinking == "The user wants weather."
    assert snapshot.content[1].text == "Let me check."
    assert snapshot.content[2].input == {"city": "Paris", "days": 2}
    assert snapshot.stop_reason == "tool_use" and snapshot.usage.output_tokens == 12
    starts = [d["index"] for n, d in events if n == "content_block_start"]
    stops = [d["index"] for n, d in events if n == "content_block_stop"]
    assert starts == stops == [0, 1, 2]


def test_anthropic_stream_stop_sequence_and_error():
    fmt = MessagesStreamFormatter("msg_1", "m", 5)
    events = _anthropic_events(
        fmt.feed(Delta(content="a"))
        + fmt.feed(Delta(finish_reason="stop", stop_string="###", usage=Usage(5, 3)))
    )
    delta = next(d for n, d in events if n == "message_delta")
    assert delta["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "###"}
    fmt = MessagesStreamFormatter("msg_2", "m", 5)
    events = _anthropic_events(
        fmt.feed(Delta(finish_reason="error", error="queue full", error_code="server_overloaded"))
    )
    assert events[-1][0] == "error" and events[-1][1]["error"]["type"] == "overloaded_error"


def test_llamacpp_stop_word_summary():
    class _State:
        model_id = "m"

        class backend:  # noqa: N801 - a stand-in namespace for the one attribute _Summary reads
            class info:  # noqa: N801
                max_context = 64

    from ninfer.engine.api import SamplingParams

    summary = _Summary(_State(), "prompt", 7, SamplingParams(max_tokens=5))
    events = data_lines(
        LlamaStreamFormatter(summary).feed(
            Delta(
                content="x", finish_reason="stop", stop_string="\n\n", usage=Usage(7, 2, 0, 0.1, 70.0, 20.0)
            )
        )
    )
    assert events[0] == {"content": "x", "stop": False, "id_slot": 0, "index": 0}
    final = events[1]
    assert final["stop"] and final["stop_type"] == "word" and final["stopping_word"] == "\n\n"
    assert final["timings"]["predicted_n"] == 2 and final["timings"]["predicted_per_second"] == 20.0

"""TextStream / OutputProcessor over a fake RequestHandle replaying token ids, and sampling presets."""

from __future__ import annotations

import json
import random

import pytest
from conftest import TINY_HF

from ninfer.engine.api import SamplingParams, TokenEvent
from ninfer.frontend import (
    ChatTemplateError,
    ContentDelta,
    Finish,
    ReasoningDelta,
    SamplingPresets,
    StreamOptions,
    TextFrontend,
    TextStream,
    Tokenizer,
    ToolCallDelta,
)

EOS = 3970  # <|im_end|> in the tiny tokenizer

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_dir(TINY_HF)


class FakeHandle:
    """Replays token ids as TokenEvents in random-sized groups; `None` entries simulate a timeout."""

    request_id = "req-test"

    def __init__(self, ids: list[int], finish: str = "stop", seed: int = 0, error: str | None = None,
                 prompt_tokens: int = 11, gaps: bool = False):
        rng = random.Random(seed)
        self.events: list[TokenEvent | None] = []
        at = 0
        while at < len(ids):
            step = rng.randint(1, 4)
            if gaps and rng.random() < 0.3:
                self.events.append(None)
            self.events.append(TokenEvent(tuple(ids[at:at + step]), prompt_tokens=prompt_tokens,
                                          generated_tokens=at + step, time_to_first_token_s=0.01))
            at += step
        self.events.append(TokenEvent((), finish_reason=finish, error=error, prompt_tokens=prompt_tokens,
                                      generated_tokens=len(ids), decode_tok_per_s=123.0))
        self.cancelled = False
        self.reads = 0

    def next_event(self, timeout_s: float | None = None) -> TokenEvent | None:
        self.reads += 1
        return self.events.pop(0)

    def cancel(self) -> None:
        self.cancelled = True


GENERATED = ("The user wants weather.\nI will call the tool.\n</think>\n\nChecking 今天 for you.\n\n"
             "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
             "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>")


@pytest.mark.parametrize("seed", range(4))
def test_stream_reasoning_content_tool_call_and_usage(tok, seed):
    ids = tok.encode(GENERATED) + [EOS]
    handle = FakeHandle(ids, seed=seed, gaps=True)
    stream = TextStream(handle, tok, StreamOptions(starts_in_reasoning=True, tools=(WEATHER,)))
    deltas = list(stream)
    kinds = [type(d) for d in deltas]
    assert kinds.index(ReasoningDelta) < kinds.index(ContentDelta) < kinds.index(ToolCallDelta)
    assert "".join(d.text for d in deltas if isinstance(d, ReasoningDelta)) == \
        "The user wants weather.\nI will call the tool."
    assert "".join(d.text for d in deltas if isinstance(d, ContentDelta)) == "Checking 今天 for you."
    calls = [d for d in deltas if isinstance(d, ToolCallDelta)]
    assert [c.index for c in calls] == [0]
    assert json.loads(calls[0].call.arguments) == {"city": "Paris", "days": 3}
    finish = deltas[-1]
    assert isinstance(finish, Finish) and finish.reason == "tool_calls"
    assert finish.usage.prompt_tokens == 11 and finish.usage.completion_tokens == len(ids)
    assert finish.usage.total_tokens == 11 + len(ids) and finish.usage.decode_tok_per_s == 123.0
    assert finish.token_ids == tuple(ids)
    assert not handle.cancelled


def test_stream_stop_string_cancels_and_cuts(tok):
    text = "Hello there, world of tokens. More text after."
    ids = tok.encode(text) + [EOS]
    handle = FakeHandle(ids, seed=1)
    stream = TextStream(handle, tok, StreamOptions(stop=("world", "zzz")))
    done = stream.collect()
    assert done.content == "Hello there, "
    assert done.reasoning is None and done.tool_calls == ()
    assert done.finish.reason == "stop" and done.finish.stop == "world"
    assert handle.cancelled
    assert handle.events  # finished without draining the engine's remaining events
    # Completion tokens count up to the token that completed the stop string.
    upto = next(n for n in range(1, len(ids) + 1) if "world" in tok.decode(ids[:n]))
    assert done.finish.usage.completion_tokens == upto


def test_stream_stop_string_spanning_events_and_reasoning_split(tok):
    ids = tok.encode("think a bit</think>\n\nAnswer: 42\nEND") + [EOS]
    for seed in range(5):
        done = TextStream(FakeHandle(ids, seed=seed), tok,
                          StreamOptions(stop=("\nEND",), starts_in_reasoning=True)).collect()
        assert (done.reasoning, done.content, done.finish.reason) == ("think a bit", "Answer: 42", "stop")


def test_stream_finish_reasons_and_options(tok):
    ids = tok.encode("<think>\nx\n</think>\n\ny <tool_call>\n<function=f>\n</function>\n</tool_call>")
    raw = TextStream(FakeHandle(ids, finish="length"), tok,
                     StreamOptions(split_reasoning=False, parse_tool_calls=False)).collect()
    assert raw.content == tok.decode(ids) and raw.finish.reason == "length" and raw.reasoning is None
    failing = FakeHandle(ids[:3], finish="error", error="boom")
    failing.events[-1] = TokenEvent((), finish_reason="error", error="boom", error_code="engine_shutdown")
    err = TextStream(failing, tok).collect()
    finish = err.finish
    assert (finish.reason, finish.error, finish.error_code) == ("error", "boom", "engine_shutdown")
    # A stop token id given by the request is not shown as text.
    stop_id = tok.encode("!")[0]
    handle = FakeHandle(tok.encode("Hi") + [stop_id])
    done = TextStream(handle, tok, StreamOptions(stop_token_ids=(stop_id,))).collect()
    assert done.content == "Hi" and done.finish.reason == "stop"


def test_poll_timeout_returns_nothing(tok):
    handle = FakeHandle(tok.encode("abc"), seed=0)
    handle.events.insert(0, None)
    stream = TextStream(handle, tok)
    assert stream.poll(0.01) == []
    assert not stream.done
    rest = list(stream)
    assert isinstance(rest[-1], Finish) and stream.done
    assert stream.poll(0.01) == []


# --- presets ------------------------------------------------------------------------------------------

def test_presets_thinking_and_non_thinking():
    gen = json.loads((TINY_HF / "generation_config.json").read_text())
    presets = SamplingPresets.for_model(gen, supports_thinking=True)
    thinking = presets.resolve(thinking=True)
    got = (thinking.temperature, thinking.top_p, thinking.top_k, thinking.presence_penalty)
    assert got == (1.0, 0.95, 20, 0.0)
    plain = presets.resolve(thinking=False)
    assert (plain.temperature, plain.top_p, plain.top_k, plain.presence_penalty) == (0.7, 0.8, 20, 1.5)
    request = presets.resolve(thinking=False, temperature=0.2, top_k=None, max_tokens=7, seed=3,
                              stop_token_ids=[5, 6])
    assert (request.temperature, request.top_k, request.max_tokens, request.seed) == (0.2, 20, 7, 3)
    assert request.stop_token_ids == (5, 6) and isinstance(request, SamplingParams)
    with pytest.raises(TypeError, match="not SamplingParams fields"):
        presets.resolve(temprature=1.0)


def test_presets_without_thinking_switch_follow_generation_config():
    presets = SamplingPresets.for_model({"temperature": 0.6, "top_p": 0.9, "top_k": 40,
                                         "repetition_penalty": 1.05}, supports_thinking=False)
    params = presets.resolve(thinking=True)
    assert (params.temperature, params.top_p, params.top_k, params.repetition_penalty) == (0.6, 0.9, 40, 1.05)
    assert presets.resolve(thinking=False) == params
    greedy = SamplingPresets.for_model({"do_sample": False, "temperature": 0.7}, supports_thinking=False)
    assert greedy.resolve().greedy
    assert SamplingPresets.for_model(None, supports_thinking=False).resolve() == SamplingParams()


# --- TextFrontend: prompt -> engine ids -> deltas -------------------------------------------------------

class _FakeArtifact:
    def __init__(self, names: tuple[str, ...]):
        self._files = {n: (TINY_HF / n).read_bytes() for n in names}
        self.components = {"text": {"resources": dict.fromkeys(self._files, 0)}}

    def resource(self, component: str, role: str) -> bytes:
        return self._files[role]


FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja")


def test_text_frontend_end_to_end(tok):
    frontend = TextFrontend.from_artifact(_FakeArtifact(FILES))
    messages = [{"role": "user", "content": [{"type": "text", "text": "Look:"},
                                             {"type": "image_url", "image_url": {"url": "x"}},
                                             {"type": "video", "video": "v.mp4"}]}]
    prompt = frontend.chat_prompt(messages, tools=[WEATHER])
    assert prompt.starts_in_reasoning and prompt.text.endswith("<|im_start|>assistant\n<think>\n")
    assert list(prompt.token_ids) == tok.encode(prompt.text)
    assert [p.get("type") for p in prompt.media] == ["image_url", "video"]
    assert frontend.sampling(prompt).temperature == 1.0
    quiet = frontend.chat_prompt(messages, enable_thinking=False)
    assert not quiet.starts_in_reasoning
    params = frontend.sampling(quiet, max_tokens=5)
    assert (params.temperature, params.presence_penalty, params.max_tokens) == (0.7, 1.5, 5)
    handle = FakeHandle(tok.encode(GENERATED) + [EOS], seed=9)
    done = frontend.stream(handle, prompt, tools=[WEATHER]).collect()
    assert done.reasoning.startswith("The user wants") and done.content == "Checking 今天 for you."
    assert [c.name for c in done.tool_calls] == ["get_weather"] and done.finish.reason == "tool_calls"
    raw = frontend.raw_prompt("def f():")
    assert list(raw.token_ids) == tok.encode("def f():") and not raw.starts_in_reasoning


def test_text_frontend_without_template():
    frontend = TextFrontend.from_artifact(_FakeArtifact(FILES[:3]))
    assert frontend.template is None
    with pytest.raises(ChatTemplateError, match="--chat-template"):
        frontend.chat_prompt([{"role": "user", "content": "hi"}])
    assert frontend.sampling(frontend.raw_prompt("x")).temperature == 0.6  # generation_config.json

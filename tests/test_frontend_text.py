"""Detokeniser, stop strings, reasoning split and tool-call parsing.

References: a strict incremental UTF-8 decoder over the tokens' raw bytes (the detokeniser must emit
exactly what it can emit, never a broken character), `str.find` for stop strings, and the chat template
itself for reasoning and tool calls (what the parser extracts must render back to the same prompt).
"""

from __future__ import annotations

import codecs
import gzip
import json
import random

import pytest
from conftest import TINY, TINY_HF

from ninfer.frontend import (
    ChatTemplate,
    IncrementalDetokenizer,
    ReasoningParser,
    StopMatcher,
    Tokenizer,
    ToolCallParser,
    parse_tool_calls,
    prompt_opens_reasoning,
    split_reasoning,
)
from ninfer.frontend.tool_calls import ToolCall, type_parameter

REAL = TINY / "tokenizer-real"


@pytest.fixture(scope="module")
def tiny() -> Tokenizer:
    return Tokenizer.from_dir(TINY_HF)


@pytest.fixture(scope="module")
def real() -> Tokenizer:
    return Tokenizer.from_files(gzip.decompress((REAL / "tokenizer.json.gz").read_bytes()),
                                (REAL / "tokenizer_config.json").read_bytes())


@pytest.fixture(scope="module")
def template(tiny) -> ChatTemplate:
    return ChatTemplate.from_file(TINY_HF / "chat_template.jinja", tiny.special_tokens)


def _byte_level_table() -> dict[str, int]:
    """GPT-2 byte-level alphabet: printable Latin-1 bytes stand for themselves, the rest map to 256+n."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    table, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            table[chr(byte)] = byte
        else:
            table[chr(256 + extra)] = byte
            extra += 1
    return table


BYTE_TABLE = _byte_level_table()

TEXTS = [
    "今天天气很好，我们去公园。", "emoji 🎉👨‍👩‍👧‍👦 and flags 🇫🇷🇯🇵!", "日本語とΕλληνικά и русский",
    "mixed\t\ncode: x = '€' # ✓\r\n", "plain ascii text only", "😀" * 5 + "中" * 3 + "é",
]


@pytest.mark.parametrize("text", TEXTS)
def test_detokenizer_emits_exactly_the_complete_characters(tiny, text):
    ids = tiny.encode(text)
    reference = codecs.getincrementaldecoder("utf-8")()  # strict: raises on broken input
    detok = IncrementalDetokenizer(tiny)
    emitted_total, expected_total = "", ""
    for token_id in ids:
        token_bytes = bytes(BYTE_TABLE[ch] for ch in tiny.id_to_token(token_id))
        expected_total += reference.decode(token_bytes)
        delta = detok.push([token_id])
        assert "\ufffd" not in delta
        emitted_total += delta
        assert emitted_total == expected_total  # nothing held back that is complete, nothing broken
    emitted_total += detok.flush()
    assert emitted_total == text


def test_detokenizer_really_splits_characters(tiny):
    """The tiny vocabulary has few CJK/emoji merges, so these characters span several tokens."""
    ids = tiny.encode("今🎉")
    assert len(ids) >= 5
    detok = IncrementalDetokenizer(tiny)
    deltas = [detok.push([i]) for i in ids]
    assert [d for d in deltas if d] == ["今", "🎉"]


def test_detokenizer_random_chunks_real_tokenizer(real):
    rng = random.Random(1234)
    alphabet = list("abc XYZ\n\t,.!?") + list("今天气好我们") + ["🎉", "👨‍👩‍👧", "é", "ß", "€", "🇫🇷", "ã"]
    for _ in range(40):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 60)))
        ids = real.encode(text)
        detok = IncrementalDetokenizer(real)
        out, at = [], 0
        while at < len(ids):
            step = rng.randint(1, 3)
            out.append(detok.push(ids[at:at + step]))
            at += step
        out.append(detok.flush())
        assert all("\ufffd" not in d for d in out)
        assert "".join(out) == text


def test_detokenizer_hides_control_tokens_and_flushes_broken_tail(real, tiny):
    ids = real.encode("<think>\nhm\n</think>\n\nHi<|im_end|>")
    detok = IncrementalDetokenizer(real)
    text = "".join(detok.push([i]) for i in ids) + detok.flush()
    assert text == "<think>\nhm\n</think>\n\nHi"
    detok = IncrementalDetokenizer(tiny)
    first_byte_of_cjk = tiny.encode("今")[0]
    assert detok.push([first_byte_of_cjk]) == ""
    assert detok.flush() == "\ufffd"  # generation ended mid-character: reported, not hidden forever


# --- stop strings -------------------------------------------------------------------------------------

def _run_stops(text: str, stops: list[str], rng: random.Random) -> tuple[str, str | None]:
    matcher, out, at = StopMatcher(stops), [], 0
    while at < len(text) and matcher.matched is None:
        step = rng.randint(1, 4)
        out.append(matcher.push(text[at:at + step]))
        at += step
    out.append(matcher.flush())
    return "".join(out), matcher.matched


def test_stop_strings_random_against_find():
    rng = random.Random(7)
    for _ in range(300):
        text = "".join(rng.choice("abcab 今\n") for _ in range(rng.randint(0, 30)))
        stops = ["".join(rng.choice("abc今\n") for _ in range(rng.randint(1, 4)))
                 for _ in range(rng.randint(1, 3))]
        hits = [(text.find(s), s) for s in stops if s in text]
        expected = (text[:min(hits)[0]], None) if hits else (text, None)
        got, matched = _run_stops(text, stops, rng)
        assert got == expected[0], (text, stops)
        assert (matched is not None) == bool(hits)
        if hits:
            assert text.find(matched) == min(hits)[0]


def test_stop_holds_back_only_a_possible_prefix():
    matcher = StopMatcher(["world", "\n\n"])
    assert matcher.push("Hello wor") == "Hello "
    assert matcher.push("m\n") == "worm"
    assert matcher.push("\nrest") == ""
    assert matcher.matched == "\n\n"
    assert matcher.flush() == ""
    assert StopMatcher([]).push("anything") == "anything"


# --- reasoning ----------------------------------------------------------------------------------------

GENERATIONS = [
    "Let me think.\nStep 2.\n</think>\n\nThe answer is 4.",
    "\n\nshort</think>answer",
    "no close tag, still reasoning\n",
    "</think>\n\nimmediately content",
    "multi\n\n\nline reasoning\n\n</think>\n\n\ncontent\n\nwith gaps\n",
]


def _split_stream(text: str, starts: bool, rng: random.Random) -> tuple[str, str]:
    parser, pieces, at = ReasoningParser(starts), [], 0
    while at < len(text):
        step = rng.randint(1, 3)
        pieces += parser.push(text[at:at + step])
        at += step
    pieces += parser.flush()
    reasoning = "".join(t for k, t in pieces if k == "reasoning")
    return reasoning, "".join(t for k, t in pieces if k == "content")


@pytest.mark.parametrize("generated", GENERATIONS)
def test_reasoning_split_inverts_the_template(generated, template):
    """Rendering the split parts must give the same prompt as rendering the raw generated turn."""
    reasoning, content = split_reasoning(generated, starts_in_reasoning=True)
    raw_turn = {"role": "assistant", "content": "<think>\n" + generated + ("" if "</think>" in generated
                                                                          else "</think>")}
    split_turn = {"role": "assistant", "content": content, "reasoning_content": reasoning}
    user = {"role": "user", "content": "q"}
    assert template.render([user, raw_turn]) == template.render([user, split_turn])
    rng = random.Random(len(generated))
    for _ in range(5):
        assert _split_stream(generated, True, rng) == (reasoning, content)


def test_reasoning_start_states():
    assert split_reasoning("The answer.", starts_in_reasoning=False) == (None, "The answer.")
    assert split_reasoning("<think>\nhmm\n</think>\n\nYes.") == ("hmm", "Yes.")
    assert split_reasoning("  <think>x</think>y") == ("x", "y")
    assert split_reasoning("<thinking is fun>") == (None, "<thinking is fun>")
    assert split_reasoning("cut off mid-thought", starts_in_reasoning=True) == ("cut off mid-thought", "")
    parser = ReasoningParser(starts_in_reasoning=False)
    assert parser.push("<thi") == []  # could still become <think>
    assert parser.push("nk>\nA") == [("reasoning", "A")]
    assert parser.in_reasoning


def test_prompt_opens_reasoning_on_rendered_prompts():
    cases = {c["name"]: c["prompt"] for c in json.loads((REAL / "rendered.json").read_text())["cases"]}
    assert prompt_opens_reasoning(cases["plain_chat"])
    assert prompt_opens_reasoning(cases["tools_call_and_result"])
    assert not prompt_opens_reasoning(cases["enable_thinking_false"])
    assert not prompt_opens_reasoning("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


# --- tool calls ---------------------------------------------------------------------------------------

SCHEMA_TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
    "s": {"type": "string"}, "i": {"type": "integer"}, "x": {"type": "number"}, "b": {"type": "boolean"},
    "o": {"type": "object"}, "a": {"type": "array"}, "n": {"type": ["integer", "null"]},
    "e": {"enum": ["red", "blue"]}, "u": {"anyOf": [{"type": "integer"}, {"type": "string"}]},
}}}}


def _generated_call_text(template: ChatTemplate, arguments_list: list[dict], content: str = "") -> str:
    """What the template teaches the model to write for these calls (the assistant turn's tail)."""
    calls = [{"type": "function", "function": {"name": "f", "arguments": a}} for a in arguments_list]
    prompt = template.render([{"role": "user", "content": "go"},
                              {"role": "assistant", "content": content, "tool_calls": calls}])
    return prompt.split("</think>\n\n", 1)[1].removesuffix("<|im_end|>\n")


ARGUMENT_SETS = [
    {"s": "Paris", "i": 3, "x": 2.5, "b": True},
    {"s": "line one\nline two\n\nindented:\n    x = 1", "o": {"k": [1, {"z": None}], "é": "ü"},
     "a": [1, "two"]},
    {"b": False, "n": None, "e": "blue", "u": 7, "x": -4},
    {"s": "   spaces kept   ", "u": "text", "i": -12},
]


@pytest.mark.parametrize("arguments", ARGUMENT_SETS)
def test_tool_call_round_trip_through_template(template, arguments):
    text = _generated_call_text(template, [arguments])
    assert text.startswith("<tool_call>\n<function=f>\n")
    content, calls = parse_tool_calls(text, [SCHEMA_TOOL])
    assert content == ""
    assert len(calls) == 1 and calls[0].name == "f"
    assert json.loads(calls[0].arguments) == arguments
    assert calls[0].to_openai()["type"] == "function" and calls[0].id.startswith("call_")


def test_tool_calls_stream_in_order_with_content(template):
    text = _generated_call_text(template, ARGUMENT_SETS[:3], content="Let me call three tools.")
    assert text.startswith("Let me call three tools.\n\n<tool_call>")
    rng = random.Random(3)
    for _ in range(5):
        parser, items, at = ToolCallParser([SCHEMA_TOOL]), [], 0
        content_seen_before_first_close = None
        while at < len(text):
            step = rng.randint(1, 5)
            items += parser.push(text[at:at + step])
            at += step
            if content_seen_before_first_close is None and "</tool_call>" in text[:at]:
                content_seen_before_first_close = any(isinstance(i, str) for i in items)
        items += parser.flush()
        assert content_seen_before_first_close  # content streamed before the call completed
        assert "".join(i for i in items if isinstance(i, str)) == "Let me call three tools."
        calls = [i for i in items if isinstance(i, ToolCall)]
        assert [json.loads(c.arguments) for c in calls] == ARGUMENT_SETS[:3]
        assert len({c.id for c in calls}) == 3


def test_tool_call_json_form_and_untyped_and_malformed():
    qwen25 = ('Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}\n'
              '</tool_call>')
    content, calls = parse_tool_calls(qwen25)
    assert content == "Sure." and calls[0].name == "get_weather"
    assert json.loads(calls[0].arguments) == {"city": "Oslo", "days": 2}
    # Without a schema XML values stay strings.
    _, calls = parse_tool_calls("<tool_call>\n<function=g>\n<parameter=n>\n42\n</parameter>\n</function>\n"
                                "</tool_call>")
    assert json.loads(calls[0].arguments) == {"n": "42"}
    # Markup that does not parse is kept as content.
    bad = "before <tool_call>not a call</tool_call> after"
    assert parse_tool_calls(bad) == (bad, [])
    # Generation cut after </function> (no </tool_call>) still yields the call; a half call is content.
    _, calls = parse_tool_calls("<tool_call>\n<function=g>\n<parameter=a>\nx\n</parameter>\n</function>")
    assert json.loads(calls[0].arguments) == {"a": "x"}
    half = "<tool_call>\n<function=g>\n<parameter=a>\nx"
    assert parse_tool_calls(half) == (half, [])
    assert parse_tool_calls("text with < and <tool but no call") == ("text with < and <tool but no call", [])


def test_type_parameter_falls_back_to_string():
    assert type_parameter("abc", {"type": "integer"}) == "abc"
    assert type_parameter("1e3", {"type": "number"}) == 1000.0
    assert type_parameter("True", {"type": "boolean"}) is True
    assert type_parameter("[1,", {"type": "array"}) == "[1,"
    assert type_parameter("5", None) == "5"

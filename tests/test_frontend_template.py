"""Tokenizer and chat template against references that are not ours: the fixture's rendered.json
(transformers' apply_chat_template + the real 248k tokenizer; llama.cpp tokenises them the same) and
transformers rendering live with the tiny fixture's tokenizer."""

from __future__ import annotations

import gzip
import json

import pytest
from conftest import TINY, TINY_HF

from ninfer.errors import NinferError, RequestError
from ninfer.frontend import ChatTemplate, ChatTemplateError, Tokenizer, TokenizerError

REAL = TINY / "tokenizer-real"


@pytest.fixture(scope="module")
def real_tokenizer() -> Tokenizer:
    return Tokenizer.from_files(
        gzip.decompress((REAL / "tokenizer.json.gz").read_bytes()),
        (REAL / "tokenizer_config.json").read_bytes(),
    )


@pytest.fixture(scope="module")
def tiny() -> Tokenizer:
    return Tokenizer.from_dir(TINY_HF)


@pytest.fixture(scope="module")
def hf_tiny():
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(TINY_HF))


@pytest.fixture(scope="module")
def tiny_template(tiny) -> ChatTemplate:
    return ChatTemplate.from_file(TINY_HF / "chat_template.jinja", tiny.special_tokens)


RENDERED = json.loads((REAL / "rendered.json").read_text())["cases"]


@pytest.mark.parametrize("case", RENDERED, ids=[c["name"] for c in RENDERED])
def test_rendered_fixture_exact(case, real_tokenizer):
    template = ChatTemplate.from_file(REAL / "chat_template.jinja", real_tokenizer.special_tokens)
    prompt = template.render(case["messages"], **case["kwargs"])
    assert prompt == case["prompt"]
    assert real_tokenizer.encode(prompt) == case["ids"]


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Météo d'une ville — “quoted” <b>html</b> & more",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                           "opts": {"type": "object"}},
            "required": ["city"],
        },
    },
}
SEARCH_TOOL = {"type": "function", "function": {"name": "search", "parameters": {"type": "object",
               "properties": {"q": {"type": "string"}}}}}

LIVE_CASES = {
    "tools_with_system_no_call": (
        [{"role": "system", "content": "  Be brief.  "}, {"role": "user", "content": "Hi"}],
        {"tools": [WEATHER_TOOL, SEARCH_TOOL], "add_generation_prompt": True},
    ),
    "parallel_calls_and_results": (
        [
            {"role": "user", "content": "Weather in Paris and Oslo, then search news."},
            {"role": "assistant", "content": "Checking both.", "tool_calls": [
                {"type": "function", "function": {"name": "get_weather",
                                                  "arguments": {"city": "Paris", "days": 3, "metric": True}}},
                {"function": {"name": "get_weather",
                              "arguments": {"city": "Oslo", "opts": {"a": [1, 2]}, "tags": ["x", "ü"]}}},
            ]},
            {"role": "tool", "content": "sunny"},
            {"role": "tool", "content": "rain"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"type": "function", "function": {"name": "search", "arguments": {"q": "news"}}}]},
            {"role": "tool", "content": "nothing new"},
        ],
        {"tools": [WEATHER_TOOL, SEARCH_TOOL], "add_generation_prompt": True},
    ),
    "multimodal_parts_with_vision_ids": (
        [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
            {"type": "text", "text": "Compare with"},
            {"type": "image", "image": "file.png"},
            {"type": "video", "video": "clip.mp4"},
            {"type": "text", "text": " please."},
        ]}],
        {"add_generation_prompt": True, "add_vision_id": True},
    ),
    "reasoning_aliases_after_last_query": (
        [
            {"role": "user", "content": "Q1"},
            {"role": "assistant", "content": "A1", "reasoning": "old thoughts"},
            {"role": "user", "content": "Q2"},
            {"role": "assistant", "content": "A2", "thinking": "\nnew thoughts\n"},
        ],
        {"add_generation_prompt": False},
    ),
    "thinking_explicitly_on": (
        [{"role": "user", "content": "Hello 你好 👋"}],
        {"add_generation_prompt": True, "enable_thinking": True},
    ),
    "continue_final_message": (
        [{"role": "user", "content": "Write a haiku"}, {"role": "assistant", "content": "Autumn moon"}],
        {"continue_final_message": True},
    ),
    "continue_final_message_parts": (
        [{"role": "user", "content": "Hi"},
         {"role": "assistant", "content": [{"type": "text", "text": "Part one. "},
                                           {"type": "text", "text": "Two"}]}],
        {"continue_final_message": True},
    ),
    "continue_reasoning": (
        [{"role": "user", "content": "Hi"},
         {"role": "assistant", "content": "", "reasoning_content": "The user greets me"}],
        {"continue_final_message": "reasoning_content"},
    ),
}


@pytest.mark.parametrize("name", list(LIVE_CASES))
def test_render_matches_transformers_live(name, tiny, tiny_template, hf_tiny):
    messages, kwargs = LIVE_CASES[name]
    ours = tiny_template.render(messages, **kwargs)
    theirs = hf_tiny.apply_chat_template(messages, tokenize=False, **kwargs)
    assert ours == theirs
    theirs_ids = hf_tiny.apply_chat_template(messages, tokenize=True, return_dict=True, **kwargs)["input_ids"]
    assert tiny.encode(ours) == list(theirs_ids)


# A template that exercises the environment itself: trim/lstrip blocks, loop controls, tojson options,
# namespace, dict(), special-token variables, {% generation %}, strftime_now, filters on strings.
FEATURE_TEMPLATE = """{{ bos_token if bos_token is defined else '' }}{{ eos_token }}|{{ pad_token }}
{% set ns = namespace(n=0, seen=[]) %}
{%- for m in messages %}
    {%- if m.role == 'system' %}{% continue %}{% endif %}
    {%- if loop.index > 4 %}{% break %}{% endif %}
    {%- set ns.n = ns.n + 1 %}
    <{{ m.role }}>{{ m.content | trim }}</{{ m.role }}>
    {% generation %}[{{ loop.index0 }}:{{ loop.length }}
{%- if loop.previtem is defined %},prev={{ loop.previtem.role }}{% endif %}]{% endgeneration %}
{% endfor %}
n={{ ns.n }} {{ dict(a=1, b='x') | tojson }} {{ extra | tojson(indent=2, sort_keys=True) }}
{{ extra | tojson(separators=(',', ':')) }} {{ extra.items() | list | length }} {{ "ünï<&>" | tojson }}
{{ strftime_now('%Y') | length }} {{ messages | map(attribute='role') | join(',') }}
{%- if add_generation_prompt %}
GEN{% endif %}"""


def test_environment_features_match_transformers(hf_tiny, tiny):
    messages = [{"role": "system", "content": "sys"}] + [
        {"role": "user" if i % 2 == 0 else "assistant", "content": f"  m{i} é  "} for i in range(6)
    ]
    extra = {"z": [1, 2.5, None, True], "a": {"k": "v<>&"}, "é": "ü"}
    ours = ChatTemplate(FEATURE_TEMPLATE, tiny.special_tokens).render(
        messages, add_generation_prompt=True, extra=extra
    )
    theirs = hf_tiny.apply_chat_template(
        messages, chat_template=FEATURE_TEMPLATE, tokenize=False, add_generation_prompt=True, extra=extra
    )
    assert ours == theirs
    assert ours.endswith("GEN") and "n=3 " in ours and "[1:7,prev=system]" in ours


def test_template_errors_are_request_errors(tiny_template, hf_tiny):
    only_system = [{"role": "system", "content": "x"}]
    with pytest.raises(Exception, match="No user query found in messages."):
        hf_tiny.apply_chat_template(only_system, tokenize=False)
    with pytest.raises(ChatTemplateError, match="No user query found in messages.") as info:
        tiny_template.render(only_system)
    assert isinstance(info.value, RequestError) and info.value.param == "messages"
    with pytest.raises(ChatTemplateError, match="Unexpected message role"):
        tiny_template.render([{"role": "user", "content": "a"}, {"role": "robot", "content": "b"}])
    with pytest.raises(ChatTemplateError, match="line 1"):
        ChatTemplate("{% if %}")
    with pytest.raises(ChatTemplateError, match="cannot both be set"):
        tiny_template.render([{"role": "user", "content": "a"}], add_generation_prompt=True,
                             continue_final_message=True)


def test_openai_string_arguments_render_like_dicts(tiny_template):
    """OpenAI clients send tool-call arguments as a JSON string; they render as the dict would."""
    def convo(arguments):
        return [
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "call_1", "type": "function",
                 "function": {"name": "get_weather", "arguments": arguments}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "ok"},
        ]
    as_dict = tiny_template.render(convo({"city": "Paris", "days": 2}), tools=[WEATHER_TOOL])
    as_text = tiny_template.render(convo('{"city": "Paris", "days": 2}'), tools=[WEATHER_TOOL])
    assert as_dict == as_text
    assert "<parameter=city>\nParis\n</parameter>\n<parameter=days>\n2\n</parameter>" in as_text


def test_template_flags(tiny_template):
    assert tiny_template.supports_thinking
    assert not ChatTemplate("{{ messages[0].content }}").supports_thinking


# --- tokenizer ----------------------------------------------------------------------------------------

STRINGS = [
    "Hello, world!", "def f(x):\n\treturn x**2  # sq\r\n", "今天天气很好，我们去公园。", "日本語のテキスト",
    "emoji 🎉👨‍👩‍👧 ok", "Ünïcödé Ελληνικά Русский", "<|im_start|>user\nhi<|im_end|>\n<think>\nx</think>",
    "   leading and trailing   ", "1234567890 3.14159", "",
]


def test_tokenizer_matches_transformers(tiny, hf_tiny):
    assert tiny.vocab_size == len(hf_tiny)
    assert tiny.eos_token_ids == (3970, 3968)  # tokenizer_config eos, then generation_config's extra
    assert tiny.pad_token_id == hf_tiny.pad_token_id == 3968
    assert tiny.bos_token_id is None
    for text in STRINGS:
        ids = tiny.encode(text)
        assert ids == hf_tiny.encode(text, add_special_tokens=False), text
        assert tiny.count(text) == len(ids)
        assert tiny.decode(ids) == hf_tiny.decode(ids) == text
        assert tiny.decode(ids, skip_special_tokens=True) == hf_tiny.decode(ids, skip_special_tokens=True)
    assert tiny.encode_batch(STRINGS[:3]) == [tiny.encode(s) for s in STRINGS[:3]]


def test_special_token_sets(real_tokenizer):
    tok = real_tokenizer
    assert tok.vocab_size == 248077
    assert tok.eos_token_ids == (248046,)
    for visible in ("<think>", "</think>", "<tool_call>", "</tool_call>"):
        assert tok.token_to_id(visible) not in tok.hidden_ids
    for hidden in ("<|im_end|>", "<|endoftext|>", "<|im_start|>", "<|image_pad|>"):
        assert tok.token_to_id(hidden) in tok.hidden_ids
    assert tok.id_to_token(248068) == "<think>"


class _FakeArtifact:
    def __init__(self, resources: dict[str, bytes]):
        self._resources = resources
        self.components = {"text": {"resources": {role: i for i, role in enumerate(resources)}}}

    def resource(self, component: str, role: str) -> bytes:
        return self._resources[role]


def test_from_artifact_and_errors(tiny):
    files = {name: (TINY_HF / name).read_bytes() for name in
             ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja")}
    artifact = _FakeArtifact(files)
    tok = Tokenizer.from_artifact(artifact)
    assert tok.eos_token_ids == tiny.eos_token_ids and tok.encode("héllo") == tiny.encode("héllo")
    template = ChatTemplate.from_artifact(artifact, tok)
    assert template.render([{"role": "user", "content": "x"}]) == "<|im_start|>user\nx<|im_end|>\n"
    with pytest.raises(TokenizerError, match="tokenizer.json"):
        Tokenizer.from_artifact(_FakeArtifact({}))
    with pytest.raises(ChatTemplateError, match="--chat-template"):
        ChatTemplate.from_artifact(_FakeArtifact({}), tok)
    with pytest.raises(NinferError, match="tokenizer.json cannot be loaded"):
        Tokenizer.from_files(b"{not json")
    with pytest.raises(TokenizerError, match="generation_config.json is not valid JSON"):
        Tokenizer.from_files(files["tokenizer.json"], None, b"[1,")

"""tokenizer.json / configs rebuilt from GGUF metadata vs transformers' GGUF tokenizer loader (the
reference), on the fixture GGUF, a synthetic llama-bpe GGUF with BOS and (slow group) the two real models."""

from __future__ import annotations

import unicodedata
from pathlib import Path

import gguf
import numpy as np
import pytest
from conftest import TINY_GGUF, TINY_HF
from realmodels import hf_gguf_tokenizer, qwen25_coder_gguf, smollm2_gguf
from tokenizers import Tokenizer as HfTokenizer

from ninfer.convert.gguf_tokenizer import (
    GgufTokenizerError,
    build_tokenizer,
    end_of_generation_ids,
    tokenizer_resources,
    tokenizer_resources_from_gguf,
)
from ninfer.convert.sources import open_gguf
from ninfer.frontend.tokenizer import Tokenizer

FIXTURE_GGUF = TINY_GGUF / "model-q8_0.gguf"

STRINGS = [
    "Hello, world!",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "    indented\t\ttabs   and    spaces      \n\n\n",
    "line one\r\nline two\r\n\r\nend",
    "3.14159 2026 1234567890 x=42 v1.2.3",
    "你好，世界！这是一个测试。",
    "emoji 😀👍🏽 family 👨‍👩‍👧 flags 🇯🇵",
    "café naïve résumé Ångström façade",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "I'm you're they'll we've he'd IT'S",
    "",
    " leading space and trailing space ",
    "Ελληνικά и русский текст",
    "日本語のテキストとカタカナ",
    '{"key": [1, 2, 3], "nested": {"a": null}}',
    "SELECT * FROM users WHERE id = 7;  -- comment",
    '<tool_call>\n{"name": "f"}\n</tool_call><|endoftext|>',
    "a" * 50 + " " + "ab" * 20,
    "\u00a0non\u2009breaking\u3000spaces\u200b",
    "cafe\u0301 decomposed e\u0301",  # NFD: the one string where NFC normalisation would matter
]


def _ours(path: Path) -> Tokenizer:
    res = tokenizer_resources_from_gguf(path)
    return Tokenizer.from_files(res.tokenizer_json, res.tokenizer_config, res.generation_config)


def _assert_same_ids(ours: Tokenizer, ref, strings=STRINGS) -> None:
    for s in strings:
        assert ours.encode(s) == ref.encode(s, add_special_tokens=False), s
        assert ours.encode(s, add_special_tokens=True) == ref.encode(s, add_special_tokens=True), s
        assert ours.decode(ours.encode(s)) == s


def _write_gguf(path: Path, metadata: dict, pre: str, **extra) -> Path:
    """A tokenizer-only llama GGUF reusing the fixture's vocabulary and merges with another pre type."""
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_context_length(128)
    w.add_embedding_length(8)
    w.add_feed_forward_length(16)
    w.add_head_count(2)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(metadata["tokenizer.ggml.tokens"])
    w.add_token_types(metadata["tokenizer.ggml.token_type"])
    w.add_token_merges(metadata["tokenizer.ggml.merges"])
    w.add_eos_token_id(extra.get("eos", 3970))
    if "bos" in extra:
        w.add_bos_token_id(extra["bos"])
        w.add_add_bos_token(True)
    w.add_tensor("token_embd.weight", np.random.default_rng(0).standard_normal((4096, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def fixture_metadata() -> dict:
    src = open_gguf(FIXTURE_GGUF)
    src.close()
    return src.metadata


def test_fixture_gguf_matches_transformers_gguf_loader():
    _assert_same_ids(_ours(FIXTURE_GGUF), hf_gguf_tokenizer(FIXTURE_GGUF))


def test_fixture_gguf_matches_real_tokenizer_json_up_to_nfc():
    """The fixture's HF tokenizer.json (same vocabulary) adds an NFC normaliser that GGUF metadata cannot
    express; llama.cpp and transformers' GGUF loader do not normalise either."""
    ours = _ours(FIXTURE_GGUF)
    ref = HfTokenizer.from_file(str(TINY_HF / "tokenizer.json"))
    for s in STRINGS:
        assert ours.encode(unicodedata.normalize("NFC", s)) == ref.encode(s, add_special_tokens=False).ids, s
    nfd = STRINGS[-1]
    assert ours.encode(nfd) != ref.encode(nfd, add_special_tokens=False).ids


def test_llama_bpe_with_bos_matches_transformers(tmp_path, fixture_metadata):
    path = _write_gguf(tmp_path / "llama-bpe.gguf", fixture_metadata, "llama-bpe", bos=3969)
    ours = _ours(path)
    _assert_same_ids(ours, hf_gguf_tokenizer(path))
    assert ours.encode("hi", add_special_tokens=True)[0] == 3969
    assert ours.bos_token_id == 3969


def test_resources_configs_and_template(fixture_metadata):
    res = tokenizer_resources(fixture_metadata)
    cfg = res.tokenizer_config
    assert cfg["eos_token"] == "<|im_end|>" and cfg["pad_token"] == "<|endoftext|>"
    assert cfg["bos_token"] is None
    assert cfg["add_bos_token"] is False and cfg["model_max_length"] == 262144
    assert cfg["added_tokens_decoder"]["3970"]["special"] is True
    # GGUF eos first, then the other end-of-turn control token of the vocabulary
    assert res.generation_config == {"pad_token_id": 3968, "eos_token_id": [3970, 3968]}
    assert res.chat_template == fixture_metadata["tokenizer.chat_template"]
    roles = res.as_resources()
    assert set(roles) == {"tokenizer.json", "tokenizer_config.json", "generation_config.json",
                          "chat_template.jinja"}  # fmt: skip
    tok = Tokenizer.from_files(roles["tokenizer.json"], roles["tokenizer_config.json"],
                               roles["generation_config.json"])  # fmt: skip
    assert tok.eos_token_ids == (3970, 3968)
    assert 3970 in tok.hidden_ids and tok.encode("<think>") == [3992]


def test_user_defined_tokens_are_whole_but_not_special(fixture_metadata):
    md = dict(fixture_metadata)
    types = list(md["tokenizer.ggml.token_type"])
    think = md["tokenizer.ggml.tokens"].index("<think>")
    types[think] = 4  # USER_DEFINED
    md["tokenizer.ggml.token_type"] = types
    tok = build_tokenizer(md)
    assert tok.encode("a<think>b").ids.count(think) == 1
    assert not tok.get_added_tokens_decoder()[think].special


def test_end_of_generation_ids_include_eot(fixture_metadata):
    md = {**fixture_metadata, "tokenizer.ggml.eot_token_id": 3969}
    assert end_of_generation_ids(md)[:2] == [3970, 3969]


def test_missing_tokenizer_metadata_names_the_fix():
    with pytest.raises(GgufTokenizerError, match="--model DIR"):
        tokenizer_resources({"general.architecture": "llama"}, "x.gguf")


def test_sentencepiece_vocab_is_refused(fixture_metadata):
    md = {**fixture_metadata, "tokenizer.ggml.model": "llama"}
    with pytest.raises(GgufTokenizerError, match="only byte-level BPE.*tokenizer.json"):
        tokenizer_resources(md, "x.gguf")


def test_corrupt_token_types_and_merges(fixture_metadata):
    with pytest.raises(GgufTokenizerError, match="token_type"):
        tokenizer_resources({**fixture_metadata, "tokenizer.ggml.token_type": [1, 1]})
    merges = ["a b c", *fixture_metadata["tokenizer.ggml.merges"][1:]]
    with pytest.raises(GgufTokenizerError, match="malformed merge"):
        build_tokenizer({**fixture_metadata, "tokenizer.ggml.merges": merges})


def test_unknown_pre_type_warns_and_falls_back(fixture_metadata):
    with pytest.warns(UserWarning, match="unknown tokenizer.ggml.pre 'brand-new'"):
        tok = build_tokenizer({**fixture_metadata, "tokenizer.ggml.pre": "brand-new"})
    assert tok.decode(tok.encode("hello world").ids) == "hello world"


@pytest.mark.slow
@pytest.mark.parametrize("fetch", [smollm2_gguf, qwen25_coder_gguf], ids=["smollm2", "qwen2.5-coder"])
def test_real_model_tokenizer_matches_transformers_gguf_loader(fetch):
    path = fetch()
    ours = _ours(path)
    ref = hf_gguf_tokenizer(path)
    _assert_same_ids(ours, ref)
    assert ours.vocab_size == len(ref)
    assert ours.eos_token_ids[0] == ref.eos_token_id

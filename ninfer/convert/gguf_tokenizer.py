"""Tokenizer resources rebuilt from a GGUF's own tokenizer metadata (for dense GGUFs given without a
metadata dir): `tokenizer.json` (byte-level BPE via the `tokenizers` library), `tokenizer_config.json`,
`generation_config.json` and the chat template.

Only byte-level BPE vocabularies (`tokenizer.ggml.model == "gpt2"`) are rebuilt; the split regex is chosen
by `tokenizer.ggml.pre`, as llama.cpp does.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from ninfer.errors import ConversionError

# llama.cpp token types (tokenizer.ggml.token_type).
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = 1, 2, 3, 4, 5, 6

# Split regexes, one per family of `tokenizer.ggml.pre` values (these are the models' own facts).
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
_QWEN35_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# pre type -> (split regex or None for GPT-2's built-in one, split digits one by one first, ignore_merges)
_PRE_FAMILIES: dict[str, tuple[str | None, bool, bool]] = {
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez"), (_QWEN2_SPLIT, False, False)),
    "qwen35": (_QWEN35_SPLIT, False, False),
    **dict.fromkeys(
        ("llama3", "llama-v3", "llama-bpe", "falcon3", "smaug-bpe", "dbrx"), (_LLAMA3_SPLIT, False, True)
    ),
    **dict.fromkeys(
        ("smollm", "starcoder", "refact", "codeshell", "command-r", "exaone"), (None, True, False)
    ),
    **dict.fromkeys(("gpt2", "gpt-2", "default", "phi-2"), (None, False, False)),
}

# Control tokens that end a turn in the chat formats we know; llama.cpp also stops on these by text.
_END_OF_GENERATION_TEXTS = (
    "<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|eom_id|>", "<|end_of_text|>", "<end_of_turn>", "<|end|>",
)  # fmt: skip


class GgufTokenizerError(ConversionError):
    """The GGUF's tokenizer metadata is missing or describes a tokenizer we cannot rebuild."""


@dataclass(frozen=True)
class TokenizerResources:
    """The text resources a dense artifact needs, built from GGUF metadata."""

    tokenizer_json: str
    tokenizer_config: dict[str, Any]
    generation_config: dict[str, Any]
    chat_template: str | None

    def as_resources(self) -> dict[str, bytes]:
        """Resource role -> bytes, as the artifact's text component stores them."""
        out = {
            "tokenizer.json": self.tokenizer_json.encode("utf-8"),
            "tokenizer_config.json": _json_bytes(self.tokenizer_config),
            "generation_config.json": _json_bytes(self.generation_config),
        }
        if self.chat_template is not None:
            out["chat_template.jinja"] = self.chat_template.encode("utf-8")
        return out

    def write_dir(self, folder: Path) -> None:
        """Write the resources as a Hugging Face style metadata folder (useful for tests and debugging)."""
        folder.mkdir(parents=True, exist_ok=True)
        for role, data in self.as_resources().items():
            (folder / role).write_bytes(data)


def _json_bytes(obj: Mapping[str, Any]) -> bytes:
    return (json.dumps(obj, indent=2, ensure_ascii=False) + "\n").encode("utf-8")


def tokenizer_resources_from_gguf(path: str | Path) -> TokenizerResources:
    """Open a GGUF (header only) and build its tokenizer resources."""
    from ninfer.convert.sources import open_gguf

    source = open_gguf(Path(path))
    try:
        return tokenizer_resources(source.metadata, str(path))
    finally:
        source.close()


def tokenizer_resources(metadata: Mapping[str, Any], origin: str = "the GGUF") -> TokenizerResources:
    """All text resources from GGUF metadata (`Source.metadata` of `ninfer.convert.sources.open_gguf`)."""
    vocab = _read_vocab(metadata, origin)
    tokenizer = build_tokenizer(metadata, origin)
    return TokenizerResources(
        tokenizer_json=tokenizer.to_str(),
        tokenizer_config=_tokenizer_config(metadata, vocab),
        generation_config=_generation_config(metadata, vocab),
        chat_template=metadata.get("tokenizer.chat_template"),
    )


@dataclass(frozen=True)
class _Vocab:
    tokens: Sequence[str]
    types: Sequence[int]


def _read_vocab(metadata: Mapping[str, Any], origin: str) -> _Vocab:
    tokens = metadata.get("tokenizer.ggml.tokens")
    if not tokens:
        raise GgufTokenizerError(
            f"{origin} has no tokenizer metadata (tokenizer.ggml.tokens); "
            "pass --model DIR with the model's tokenizer.json"
        )
    model = metadata.get("tokenizer.ggml.model")
    if model != "gpt2":
        raise GgufTokenizerError(
            f"{origin} has a {model!r} tokenizer; only byte-level BPE ('gpt2') can be rebuilt from GGUF "
            "metadata; pass --model DIR with the model's tokenizer.json"
        )
    types = metadata.get("tokenizer.ggml.token_type") or [TOKEN_NORMAL] * len(tokens)
    if len(types) != len(tokens):
        raise GgufTokenizerError(
            f"{origin}: tokenizer.ggml.token_type has {len(types)} entries for {len(tokens)} tokens; "
            "the file is corrupt, download it again"
        )
    return _Vocab(tokens, types)


def build_tokenizer(metadata: Mapping[str, Any], origin: str = "the GGUF") -> Tokenizer:
    """The byte-level BPE tokenizer the GGUF metadata describes."""
    vocab = _read_vocab(metadata, origin)
    pre = metadata.get("tokenizer.ggml.pre", "default")
    if pre not in _PRE_FAMILIES:
        warnings.warn(
            f"{origin}: unknown tokenizer.ggml.pre {pre!r}; splitting text the GPT-2 way, which may "
            "tokenize differently from llama.cpp; pass --model DIR with tokenizer.json to be exact",
            stacklevel=2,
        )
    split, split_digits, ignore_merges = _PRE_FAMILIES.get(pre, (None, False, False))
    merges = [_merge_pair(m, origin) for m in metadata.get("tokenizer.ggml.merges") or ()]
    pairs = zip(vocab.tokens, vocab.types, strict=True)
    ids = {_byte_level_spelling(tok, t): i for i, (tok, t) in enumerate(pairs)}
    tok = Tokenizer(models.BPE(ids, merges, fuse_unk=False, byte_fallback=False, ignore_merges=ignore_merges))
    if split is not None:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])  # fmt: skip
    elif split_digits:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ])  # fmt: skip
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_tokens([
        AddedToken(text, special=kind == TOKEN_CONTROL, normalized=False)
        for text, kind in zip(vocab.tokens, vocab.types, strict=True)
        if kind in (TOKEN_CONTROL, TOKEN_USER_DEFINED)
    ])  # fmt: skip
    tok.post_processor = _post_processor(metadata, vocab)
    return tok


def _merge_pair(merge: str, origin: str) -> tuple[str, str]:
    parts = merge.split(" ")
    if len(parts) != 2:
        raise GgufTokenizerError(f"{origin}: malformed merge {merge!r} in tokenizer.ggml.merges")
    return parts[0], parts[1]


def _byte_level_spelling(token: str, kind: int) -> str:
    """Vocabulary key of a token: BPE tokens are already spelled in the byte alphabet; added tokens keep
    their text (they are matched whole before BPE); anything else is re-spelled byte by byte."""
    alphabet = _byte_alphabet()
    if kind in (TOKEN_CONTROL, TOKEN_USER_DEFINED) or all(ch in alphabet for ch in token):
        return token
    return "".join(alphabet[b] for b in token.encode("utf-8"))


@lru_cache(maxsize=1)
def _byte_alphabet() -> dict[Any, str]:
    """GPT-2's byte-level alphabet, both ways: byte -> printable character, and the characters as keys.

    Printable Latin-1 bytes stand for themselves; the other 68 bytes map to U+0100 onwards in byte order.
    """
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    spelling: dict[Any, str] = {b: chr(b) for b in printable}
    shifted = (b for b in range(256) if b not in spelling)
    for n, b in enumerate(shifted):
        spelling[b] = chr(0x100 + n)
    spelling.update({ch: ch for ch in list(spelling.values())})
    return spelling


def _special_text(metadata: Mapping[str, Any], vocab: _Vocab, key: str) -> str | None:
    token_id = metadata.get(f"tokenizer.ggml.{key}")
    if isinstance(token_id, int) and 0 <= token_id < len(vocab.tokens):
        return vocab.tokens[token_id]
    return None


def _post_processor(metadata: Mapping[str, Any], vocab: _Vocab):
    bos = (
        _special_text(metadata, vocab, "bos_token_id")
        if metadata.get("tokenizer.ggml.add_bos_token")
        else None
    )
    eos = (
        _special_text(metadata, vocab, "eos_token_id")
        if metadata.get("tokenizer.ggml.add_eos_token")
        else None
    )
    if bos is None and eos is None:
        return processors.ByteLevel(trim_offsets=False)
    prefix = [bos] if bos else []
    suffix = [eos] if eos else []
    specials = [
        (t, metadata[f"tokenizer.ggml.{k}"]) for t, k in ((bos, "bos_token_id"), (eos, "eos_token_id")) if t
    ]
    return processors.TemplateProcessing(
        single=[*prefix, "$A:0", *suffix],
        pair=[*prefix, "$A:0", *suffix, *prefix, "$B:1", *suffix],
        special_tokens=specials,
    )


def _tokenizer_config(metadata: Mapping[str, Any], vocab: _Vocab) -> dict[str, Any]:
    arch = metadata.get("general.architecture", "")
    added = {
        str(i): {"content": text, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
                 "special": kind == TOKEN_CONTROL}
        for i, (text, kind) in enumerate(zip(vocab.tokens, vocab.types, strict=True))
        if kind in (TOKEN_CONTROL, TOKEN_USER_DEFINED)
    }  # fmt: skip
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": bool(metadata.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(metadata.get("tokenizer.ggml.add_eos_token", False)),
        "bos_token": _special_text(metadata, vocab, "bos_token_id"),
        "eos_token": _special_text(metadata, vocab, "eos_token_id"),
        "pad_token": _special_text(metadata, vocab, "padding_token_id"),
        "unk_token": _special_text(metadata, vocab, "unknown_token_id"),
        "clean_up_tokenization_spaces": False,
        "added_tokens_decoder": added,
    }
    context = metadata.get(f"{arch}.context_length")
    if isinstance(context, int):
        config["model_max_length"] = context
    return config


def end_of_generation_ids(metadata: Mapping[str, Any]) -> list[int]:
    """Token ids that end generation: the GGUF's eos (first), eot and eom, then known end-of-turn control
    tokens present in the vocabulary (e.g. both <|im_end|> and <|endoftext|> for Qwen)."""
    tokens = metadata.get("tokenizer.ggml.tokens") or []
    types = metadata.get("tokenizer.ggml.token_type") or [TOKEN_NORMAL] * len(tokens)
    ids: list[int] = []
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        value = metadata.get(f"tokenizer.ggml.{key}")
        if isinstance(value, int) and 0 <= value < len(tokens) and value not in ids:
            ids.append(value)
    for i, (text, kind) in enumerate(zip(tokens, types, strict=False)):
        if kind == TOKEN_CONTROL and text in _END_OF_GENERATION_TEXTS and i not in ids:
            ids.append(i)
    return ids


def _generation_config(metadata: Mapping[str, Any], vocab: _Vocab) -> dict[str, Any]:
    config: dict[str, Any] = {}
    for hf_key, gguf_key in (("bos_token_id", "bos_token_id"), ("pad_token_id", "padding_token_id")):
        value = metadata.get(f"tokenizer.ggml.{gguf_key}")
        if isinstance(value, int) and 0 <= value < len(vocab.tokens):
            config[hf_key] = value
    eos = end_of_generation_ids(metadata)
    if eos:
        config["eos_token_id"] = eos[0] if len(eos) == 1 else eos
    return config

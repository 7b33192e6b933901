"""The model's tokenizer: `tokenizer.json` through the `tokenizers` library, plus the special-token facts
(eos ids, bos, pad, which added tokens are control tokens) from `tokenizer_config.json` and
`generation_config.json`."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as _HfTokenizer

from ninfer.errors import NinferError

# Added tokens the reasoning and tool-call parsers read as text; every other special token is hidden
# from generated text (e.g. <|im_end|>, <|endoftext|>).
MARKUP_TOKENS = frozenset({"<think>", "</think>", "<tool_call>", "</tool_call>"})

# Named special tokens a chat template may read (transformers passes exactly these to the template).
NAMED_SPECIAL_TOKENS = (
    "bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token",
)


class TokenizerError(NinferError):
    """The tokenizer resources are missing or unreadable."""


def _as_json(value: bytes | str | Mapping[str, Any] | None, what: str) -> dict[str, Any]:
    if value is None:
        return {}
    if isinstance(value, Mapping):
        return dict(value)
    try:
        parsed = json.loads(value)
    except (ValueError, UnicodeDecodeError) as exc:
        raise TokenizerError(f"{what} is not valid JSON ({exc}); re-convert with a correct {what}") from exc
    if not isinstance(parsed, dict):
        raise TokenizerError(f"{what} must hold a JSON object; re-convert with a correct {what}")
    return parsed


def _token_content(value: Any) -> str | None:
    """tokenizer_config stores a special token as a string or as a serialised AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


class Tokenizer:
    """Encode/decode text and know the model's special tokens.

    `encode` never adds special tokens unless asked (chat templates write them themselves, as in
    transformers' `apply_chat_template`); `encode(text, add_special_tokens=True)` applies the
    tokenizer.json post-processor (e.g. a BOS for Llama-style models), which is what a raw prompt needs.
    """

    def __init__(
        self,
        backend: _HfTokenizer,
        tokenizer_config: Mapping[str, Any] | None = None,
        generation_config: Mapping[str, Any] | None = None,
    ):
        self._tok = backend
        self.config = dict(tokenizer_config or {})
        self.generation_config = dict(generation_config or {})
        self.special_tokens: dict[str, str] = {}
        for name in NAMED_SPECIAL_TOKENS:
            content = _token_content(self.config.get(name))
            if content is not None:
                self.special_tokens[name] = content
        added = backend.get_added_tokens_decoder()
        self.special_ids = frozenset(i for i, t in added.items() if t.special)
        self.hidden_ids = frozenset(i for i in self.special_ids if added[i].content not in MARKUP_TOKENS)
        self.eos_token_ids = self._collect_eos_ids()

    # --- construction -------------------------------------------------------------------------------

    @classmethod
    def from_files(
        cls,
        tokenizer_json: bytes | str,
        tokenizer_config: bytes | str | Mapping[str, Any] | None = None,
        generation_config: bytes | str | Mapping[str, Any] | None = None,
    ) -> Tokenizer:
        text = tokenizer_json.decode("utf-8") if isinstance(tokenizer_json, bytes) else tokenizer_json
        try:
            backend = _HfTokenizer.from_str(text)
        except Exception as exc:  # the tokenizers library raises plain Exceptions
            raise TokenizerError(
                f"tokenizer.json cannot be loaded ({exc}); re-convert with a valid tokenizer.json"
            ) from exc
        return cls(
            backend,
            _as_json(tokenizer_config, "tokenizer_config.json"),
            _as_json(generation_config, "generation_config.json"),
        )

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """A Hugging Face metadata folder (tokenizer.json, tokenizer_config.json, generation_config.json)."""
        folder = Path(path)
        tokenizer_json = folder / "tokenizer.json"
        if not tokenizer_json.is_file():
            raise TokenizerError(f"no tokenizer.json in {folder}; point at the model's metadata folder")

        def optional(name: str) -> bytes | None:
            file = folder / name
            return file.read_bytes() if file.is_file() else None

        return cls.from_files(
            tokenizer_json.read_bytes(), optional("tokenizer_config.json"), optional("generation_config.json")
        )

    @classmethod
    def from_artifact(cls, artifact: Any, component: str = "text") -> Tokenizer:
        """From a `.ninfer` artifact's text resources (tokenizer.json required, the configs optional)."""
        tokenizer_json = read_resource(artifact, component, "tokenizer.json")
        if tokenizer_json is None:
            raise TokenizerError(
                "the artifact has no tokenizer.json resource; re-convert with --model DIR holding "
                "tokenizer.json or --resource tokenizer.json=PATH"
            )
        return cls.from_files(
            tokenizer_json,
            read_resource(artifact, component, "tokenizer_config.json"),
            read_resource(artifact, component, "generation_config.json"),
        )

    def _collect_eos_ids(self) -> tuple[int, ...]:
        ids: list[int] = []
        eos = self.special_tokens.get("eos_token")
        if eos is not None and self._tok.token_to_id(eos) is not None:
            ids.append(self._tok.token_to_id(eos))
        gen_eos = self.generation_config.get("eos_token_id")
        for value in gen_eos if isinstance(gen_eos, list) else [gen_eos]:
            if isinstance(value, int) and value not in ids:
                ids.append(value)
        return tuple(ids)

    # --- text <-> ids --------------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = False) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=add_special_tokens)]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def count(self, text: str) -> int:
        """Number of tokens `text` encodes to (no special tokens added)."""
        return len(self.encode(text))

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    @property
    def vocab_size(self) -> int:
        """Number of token ids the tokenizer knows, added tokens included (the model may pad beyond it)."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    def _special_id(self, name: str) -> int | None:
        content = self.special_tokens.get(name)
        return None if content is None else self._tok.token_to_id(content)

    @property
    def bos_token_id(self) -> int | None:
        return self._special_id("bos_token")

    @property
    def pad_token_id(self) -> int | None:
        pad = self._special_id("pad_token")
        if pad is None and isinstance(self.generation_config.get("pad_token_id"), int):
            return self.generation_config["pad_token_id"]
        return pad

    @property
    def chat_template(self) -> str | None:
        """A template embedded in tokenizer_config.json (older checkpoints), if any."""
        template = self.config.get("chat_template")
        if isinstance(template, str):
            return template
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            for entry in template:
                if isinstance(entry, Mapping) and entry.get("name") == "default":
                    return entry.get("template")
        return None


def read_resource(artifact: Any, component: str, role: str) -> bytes | None:
    """A resource of an artifact component, or None when the artifact does not hold it."""
    comp = getattr(artifact, "components", {}).get(component)
    resources = comp.get("resources") if isinstance(comp, Mapping) else getattr(comp, "resources", None)
    if resources is not None and role not in resources:
        return None
    try:
        return artifact.resource(component, role)
    except (KeyError, NinferError):
        return None

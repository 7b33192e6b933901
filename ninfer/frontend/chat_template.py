"""Chat templates rendered with jinja2 the way transformers' `apply_chat_template` renders them.

Same environment semantics: a sandboxed, immutable environment with `trim_blocks` and `lstrip_blocks`,
loop controls, a `{% generation %}` block (rendered as its body), `raise_exception`, `strftime_now`, and a
`tojson` filter that keeps key order and non-ASCII text (jinja's own sorts keys and escapes HTML). Inputs
are normalised as transformers does: message keys whose value is None are dropped, reasoning given as
`thinking`/`reasoning` is also offered as `reasoning_content`, and the named special tokens
(`bos_token`, `eos_token`, ...) are template variables.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ninfer.errors import RequestError
from ninfer.frontend.tokenizer import read_resource

REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
_CONTINUE_TAG = "NINFER_CONTINUE_FINAL_MESSAGE_TAG "


class ChatTemplateError(RequestError):
    """The template refused the conversation (`raise_exception`), failed to render, or does not parse."""

    def __init__(self, message: str, param: str | None = "messages"):
        super().__init__(message, code="invalid_request_error", param=param)


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; we only render it."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    def _render_body(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(value: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def plain_data(value: Any) -> Any:
    """Rebuild `value` from plain JSON types (pydantic models and dataclasses become dicts); anything
    else the template cannot safely see becomes a `<TypeName>` placeholder string."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value)
    if isinstance(value, Mapping):
        return {plain_data(k): plain_data(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain_data(v) for v in value]
    if isinstance(value, tuple):
        return tuple(plain_data(v) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain_data(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return plain_data(value.model_dump())
    item = getattr(value, "item", None)  # numpy scalars
    if callable(item) and type(value).__module__ == "numpy":
        return plain_data(item())
    return f"<{type(value).__name__}>"


def _normalise_message(message: Any, index: int) -> dict[str, Any]:
    message = plain_data(message)
    if not isinstance(message, dict):
        raise ChatTemplateError(
            f"messages[{index}] must be an object with a role", param=f"messages[{index}]"
        )
    message = {k: v for k, v in message.items() if v is not None}
    reasoning = next((message[k] for k in REASONING_FIELDS if message.get(k) is not None), None)
    if reasoning is not None:
        message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
    calls = message.get("tool_calls")
    if isinstance(calls, list):
        message["tool_calls"] = [_decode_arguments(call) for call in calls]
    return message


def _decode_arguments(call: Any) -> Any:
    """OpenAI clients send `function.arguments` as a JSON string; templates iterate it as a mapping."""
    if not isinstance(call, dict):
        return call
    if isinstance(call.get("function"), dict):
        return {**call, "function": _decode_arguments(call["function"])}
    arguments = call.get("arguments")
    if isinstance(arguments, str):
        try:
            parsed = json.loads(arguments)
        except ValueError:
            return call
        if isinstance(parsed, dict):
            return {**call, "arguments": parsed}
    return call


class ChatTemplate:
    """One compiled chat template. `render` mirrors `tokenizer.apply_chat_template(..., tokenize=False)`."""

    def __init__(self, source: str, special_tokens: Mapping[str, str] | None = None):
        self.source = source
        self.special_tokens = dict(special_tokens or {})
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateSyntaxError as exc:
            raise ChatTemplateError(
                f"the chat template does not parse (line {exc.lineno}: {exc.message}); "
                "pass a valid template with --chat-template FILE", param=None
            ) from exc

    @classmethod
    def from_file(cls, path: str | Path, special_tokens: Mapping[str, str] | None = None) -> ChatTemplate:
        return cls(Path(path).read_text(encoding="utf-8"), special_tokens)

    @classmethod
    def from_artifact(cls, artifact: Any, tokenizer: Any = None, component: str = "text") -> ChatTemplate:
        """The artifact's `chat_template.jinja`, else a template embedded in tokenizer_config.json."""
        special = getattr(tokenizer, "special_tokens", None)
        raw = read_resource(artifact, component, "chat_template.jinja")
        if raw is not None:
            return cls(raw.decode("utf-8"), special)
        embedded = getattr(tokenizer, "chat_template", None)
        if embedded:
            return cls(embedded, special)
        raise ChatTemplateError(
            "the artifact has no chat template; pass --chat-template FILE or re-convert with "
            "--resource chat_template.jinja=PATH", param=None
        )

    @property
    def supports_thinking(self) -> bool:
        """The template reads `enable_thinking` (Qwen3-style thinking switch)."""
        return "enable_thinking" in self.source

    def render(
        self,
        messages: Sequence[Any],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        documents: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = False,
        continue_final_message: bool | str = False,
        **template_kwargs: Any,
    ) -> str:
        """The prompt text. `template_kwargs` are `chat_template_kwargs` (e.g. `enable_thinking=False`)."""
        if continue_final_message and add_generation_prompt:
            raise ChatTemplateError(
                "continue_final_message and add_generation_prompt cannot both be set; drop one of them"
            )
        chat = [_normalise_message(m, i) for i, m in enumerate(messages)]
        if tools is not None and any(not isinstance(t, Mapping) for t in tools):
            raise ChatTemplateError("each tool must be a JSON object (a function schema)", param="tools")
        variables = plain_data({**self.special_tokens, **template_kwargs})
        field = None
        if continue_final_message:
            field = continue_final_message if isinstance(continue_final_message, str) else "content"
            final_text = _tag_final_message(chat, field)
        text = self._render(chat, plain_data(tools), plain_data(documents), add_generation_prompt, variables)
        if field is not None:
            text = _cut_at_tag(text, final_text)
        return text

    def _render(self, chat: list, tools: Any, documents: Any, add_generation_prompt: bool,
                variables: dict[str, Any]) -> str:
        try:
            return self._template.render(
                messages=chat, tools=tools, documents=documents,
                add_generation_prompt=add_generation_prompt, **variables,
            )
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"chat template: {exc.message or exc}") from exc
        except (TypeError, ValueError, AttributeError, KeyError, IndexError) as exc:
            raise ChatTemplateError(f"chat template failed on these messages: {exc}") from exc


def _tag_final_message(chat: list[dict[str, Any]], field: str) -> str:
    """Append a marker to the final message's text so the render can be cut right after it."""
    if not chat or chat[-1].get(field) is None:
        raise ChatTemplateError(f"continue_final_message: the final message has no {field!r} to continue")
    value = chat[-1][field]
    fields = [field]
    if field in REASONING_FIELDS:  # reasoning is offered under several names; tag every copy
        fields = [f for f in REASONING_FIELDS if chat[-1].get(f) == value]
    if isinstance(value, list):
        for part in reversed(value):
            if isinstance(part, dict) and isinstance(part.get("text"), str):
                original = part["text"]
                part["text"] = original + _CONTINUE_TAG
                return original
        raise ChatTemplateError("continue_final_message: the final message has no text part to continue")
    if not isinstance(value, str):
        raise ChatTemplateError(f"continue_final_message: the final message's {field!r} must be text")
    for name in fields:
        chat[-1][name] = value + _CONTINUE_TAG
    return value


def _cut_at_tag(text: str, final_text: str) -> str:
    tag = _CONTINUE_TAG.strip()
    if tag not in text or final_text.strip() not in text:
        raise ChatTemplateError(
            "continue_final_message: the template drops or rewrites the final message, "
            "so it cannot be continued"
        )
    at = text.rindex(tag)
    if text[at:at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
        return text[:at]
    return text[:at].rstrip()  # the template trimmed the trailing space of the tag

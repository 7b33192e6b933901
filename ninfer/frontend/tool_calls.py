"""Parse Qwen tool-call markup out of generated content, streaming or whole.

Qwen3.5's template teaches
`<tool_call>\\n<function=NAME>\\n<parameter=P>\\nVALUE\\n</parameter>\\n</function>\\n</tool_call>`;
Qwen2.5/Qwen3 write `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`. Both become OpenAI-style
calls whose `arguments` is a JSON string. XML parameter values are text; they are typed by the tool's JSON
schema where one is given (integer, number, boolean, object, array, null), else kept as strings. Text
before a call streams as content; a call is emitted once its closing tag arrives. Markup that does not
parse is passed through as content, so nothing the model wrote is lost.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

OPEN_TAG = "<tool_call>"
CLOSE_TAG = "</tool_call>"

_FUNCTION_RE = re.compile(r"<function=([^>\n]+)>(.*?)(?:</function>|\Z)", re.DOTALL)
_PARAMETER_RE = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|\Z)", re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON object, as text (OpenAI's convention)

    def to_openai(self) -> dict[str, Any]:
        function = {"name": self.name, "arguments": self.arguments}
        return {"id": self.id, "type": "function", "function": function}


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def tool_schemas(tools: Iterable[Mapping[str, Any]] | None) -> dict[str, dict[str, Any]]:
    """Function name -> JSON schema of its parameters, from OpenAI-style or bare function definitions."""
    schemas: dict[str, dict[str, Any]] = {}
    for tool in tools or ():
        function = tool.get("function", tool) if isinstance(tool, Mapping) else None
        if isinstance(function, Mapping) and isinstance(function.get("name"), str):
            params = function.get("parameters")
            schemas[function["name"]] = dict(params) if isinstance(params, Mapping) else {}
    return schemas


# --- parameter typing ---------------------------------------------------------------------------------

def _schema_types(schema: Any) -> list[str]:
    if not isinstance(schema, Mapping):
        return []
    kind = schema.get("type")
    if isinstance(kind, str):
        return [kind]
    if isinstance(kind, list):
        return [k for k in kind if isinstance(k, str)]
    types: list[str] = []
    for key in ("anyOf", "oneOf"):
        for option in schema.get(key) or ():
            types += _schema_types(option)
    if "enum" in schema and not types:
        types = ["string"]
    return types


_NO_VALUE = object()


def _convert(raw: str, kind: str) -> Any:
    text = raw.strip()
    if kind == "string":
        return raw
    if kind == "integer" and re.fullmatch(r"[+-]?\d+", text):
        return int(text)
    if kind == "number":
        if re.fullmatch(r"[+-]?\d+", text):
            return int(text)
        try:
            return float(text)
        except ValueError:
            return _NO_VALUE
    if kind == "boolean" and text.lower() in ("true", "false"):
        return text.lower() == "true"
    if kind == "null" and text.lower() in ("null", "none"):
        return None
    if kind in ("object", "array"):
        try:
            value = json.loads(text)
        except ValueError:
            return _NO_VALUE
        return value if isinstance(value, dict if kind == "object" else list) else _NO_VALUE
    return _NO_VALUE


def type_parameter(raw: str, schema: Any) -> Any:
    """A parameter's text typed by its schema; text that fits no listed type stays a string."""
    kinds = _schema_types(schema)
    for kind in sorted(kinds, key=lambda k: k == "string"):  # try the non-string types first
        value = _convert(raw, kind)
        if value is not _NO_VALUE:
            return value
    return raw


# --- parsing one <tool_call> body ---------------------------------------------------------------------

def _strip_one_newline(text: str) -> str:
    if text.startswith("\n"):
        text = text[1:]
    if text.endswith("\n"):
        text = text[:-1]
    return text


def _parse_xml(body: str, schemas: Mapping[str, dict[str, Any]], new_id: Callable[[], str]) -> list[ToolCall]:
    calls = []
    for match in _FUNCTION_RE.finditer(body):
        name = match.group(1).strip()
        properties = schemas.get(name, {}).get("properties") or {}
        arguments: dict[str, Any] = {}
        for param in _PARAMETER_RE.finditer(match.group(2)):
            key = param.group(1).strip()
            arguments[key] = type_parameter(_strip_one_newline(param.group(2)), properties.get(key))
        calls.append(ToolCall(new_id(), name, json.dumps(arguments, ensure_ascii=False)))
    return calls


def _parse_json(body: str, new_id: Callable[[], str]) -> list[ToolCall]:
    try:
        value = json.loads(body)
    except ValueError:
        return []
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return []
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return []
    if not isinstance(arguments, dict):
        return []
    return [ToolCall(new_id(), value["name"], json.dumps(arguments, ensure_ascii=False))]


def parse_call_body(
    body: str, schemas: Mapping[str, dict[str, Any]] | None = None, new_id: Callable[[], str] = new_call_id
) -> list[ToolCall]:
    """The calls inside one `<tool_call>…</tool_call>` (without the tags); [] when it does not parse."""
    text = body.strip()
    if text.startswith("{"):
        return _parse_json(text, new_id)
    if "<function=" in text:
        return _parse_xml(text, schemas or {}, new_id)
    return []


# --- streaming ----------------------------------------------------------------------------------------

Item = str | ToolCall  # content text, or one complete call


class ToolCallParser:
    """Streaming parser: `push(content)` and `flush()` return content strings and complete ToolCalls.

    Whitespace between content and a call (and between calls) is dropped: the template writes
    `content\\n\\n<tool_call>` and joins consecutive calls with a newline.
    """

    def __init__(self, tools: Sequence[Mapping[str, Any]] | None = None,
                 new_id: Callable[[], str] = new_call_id):
        self._schemas = tool_schemas(tools)
        self._new_id = new_id
        self._in_call = False
        self._after_call = False
        self._buffer = ""
        self._gap = ""
        self.calls: list[ToolCall] = []

    def push(self, text: str) -> list[Item]:
        self._buffer += text
        items: list[Item] = []
        while self._buffer:
            if self._in_call:
                if not self._close_call(items):
                    break
            elif not self._scan_text(items):
                break
        return items

    def flush(self) -> list[Item]:
        items: list[Item] = []
        held, self._buffer = self._buffer, ""
        if self._in_call:
            calls = parse_call_body(held, self._schemas, self._new_id) if "</function>" in held or \
                held.strip().endswith("}") else []
            self._emit_calls(items, calls, OPEN_TAG + held)
        elif held and not (self._after_call and not held.strip()):
            items.append(held)
        return items

    def _scan_text(self, items: list[Item]) -> bool:
        """Emit content up to a call opener; returns False when waiting for more text."""
        if self._after_call:
            self._buffer = self._buffer.lstrip()
            if not self._buffer:
                return False
        at = self._buffer.find(OPEN_TAG)
        if at >= 0:
            before = self._buffer[:at].rstrip()
            if before:
                items.append(before)
            self._gap = self._buffer[len(before):at]  # dropped if a call follows, kept if it does not parse
            self._buffer = self._buffer[at + len(OPEN_TAG):]
            self._in_call = True
            return True
        # Hold a possible partial <tool_call> and the whitespace before it.
        keep = 0
        for size in range(min(len(OPEN_TAG) - 1, len(self._buffer)), 0, -1):
            if self._buffer.endswith(OPEN_TAG[:size]):
                keep = size
                break
        ready = self._buffer[: len(self._buffer) - keep].rstrip()
        if not ready:
            return False
        items.append(ready)
        self._after_call = False
        self._buffer = self._buffer[len(ready):]
        return True

    def _close_call(self, items: list[Item]) -> bool:
        at = self._buffer.find(CLOSE_TAG)
        if at < 0:
            return False
        body = self._buffer[:at]
        self._buffer = self._buffer[at + len(CLOSE_TAG):]
        self._in_call = False
        self._emit_calls(items, parse_call_body(body, self._schemas, self._new_id),
                         OPEN_TAG + body + CLOSE_TAG)
        return True

    def _emit_calls(self, items: list[Item], calls: list[ToolCall], raw: str) -> None:
        if calls:
            items.extend(calls)
            self.calls.extend(calls)
            self._after_call = True
        else:
            items.append(self._gap + raw)  # not a call we understand: keep the model's text
        self._gap = ""


def parse_tool_calls(
    content: str, tools: Sequence[Mapping[str, Any]] | None = None
) -> tuple[str, list[ToolCall]]:
    """Whole-text parse: (content without the calls, calls)."""
    parser = ToolCallParser(tools)
    items = parser.push(content) + parser.flush()
    text = "".join(i for i in items if isinstance(i, str))
    return text, [i for i in items if isinstance(i, ToolCall)]

"""HTTP errors: one exception type, the OpenAI and Anthropic envelopes, and body parsing with precise params.

Every refusal is an `ApiError(status, message, code, param)`; the envelope is chosen by the route family:
OpenAI `{"error": {"message", "type", "param", "code"}}` everywhere except `/v1/messages...`, which uses
Anthropic's `{"type": "error", "error": {"type", "message"}}`.
"""

from __future__ import annotations

import json
import re
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse

from ninfer.errors import RequestError

M = TypeVar("M", bound=BaseModel)
_FIELD_PREFIX = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*): ")

# OpenAI `type` per HTTP status (the `code` field carries the precise reason).
_OPENAI_TYPE = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    413: "invalid_request_error",
    429: "server_overloaded",
    500: "server_error",
    503: "service_unavailable",
}
_ANTHROPIC_TYPE = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
}
# Engine RequestError codes → HTTP status.
_CODE_STATUS = {
    "server_overloaded": 429,
    "request_queue_timeout": 503,
    "model_loading": 503,
    "shutting_down": 503,
    "engine_shutdown": 503,
    "model_not_found": 404,
    "internal_error": 500,
}


class ApiError(Exception):
    """A refused request: HTTP status, one-line message, machine code and the offending field."""

    def __init__(
        self,
        status: int,
        message: str,
        code: str = "invalid_request_error",
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.headers = headers or {}

    @classmethod
    def from_request_error(cls, exc: RequestError) -> ApiError:
        return cls.from_code(str(exc), getattr(exc, "code", None), getattr(exc, "param", None))

    @classmethod
    def from_code(cls, message: str, code: str | None, param: str | None = None) -> ApiError:
        code = code or "internal_error"
        status = _CODE_STATUS.get(code, 400)
        headers = {"Retry-After": "2"} if status in (429, 503) else None
        return cls(status, message, code, param, headers)


def is_anthropic_path(path: str) -> bool:
    return path.startswith("/v1/messages")


def error_body(err: ApiError, anthropic: bool) -> dict[str, Any]:
    if anthropic:
        kind = _ANTHROPIC_TYPE.get(err.status, "api_error")
        return {"type": "error", "error": {"type": kind, "message": err.message}}
    kind = _OPENAI_TYPE.get(err.status, "invalid_request_error")
    return {"error": {"message": err.message, "type": kind, "param": err.param, "code": err.code}}


def error_response(err: ApiError, path: str) -> JSONResponse:
    return JSONResponse(error_body(err, is_anthropic_path(path)), status_code=err.status, headers=err.headers)


def format_loc(loc: tuple[Any, ...]) -> str:
    """('messages', 2, 'content') → 'messages[2].content'; union-member tags are dropped."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif _is_type_tag(part):
            continue
        else:
            out += f".{part}" if out else str(part)
    return out


def _is_type_tag(part: str) -> bool:
    # pydantic names union branches and validators in locs: 'str', 'list[Part]', 'function-after[...]'.
    return "[" in part or part in {"str", "int", "float", "bool", "dict", "list", "none", "tuple"}


def validation_error(exc: ValidationError) -> ApiError:
    """The first pydantic error as a 400 naming its field."""
    errors = exc.errors(include_url=False)
    # in a union (str | list[Part]) the branch the client meant is the one whose error lies deepest
    first = max(errors, key=lambda e: len(e["loc"]))
    param = format_loc(tuple(first["loc"])) or None
    msg = first["msg"]
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, ") :]
        # model validators name the field themselves ("content: must not be empty")
        match = _FIELD_PREFIX.match(msg)
        if match:
            param = f"{param}.{match[1]}" if param else match[1]
            msg = msg[match.end() :]
    if first["type"] == "missing":
        msg = "is required"
    elif first["type"] == "extra_forbidden":
        msg = "is not a known field"
    message = f"{param}: {msg}" if param else msg
    return ApiError(400, message, "invalid_request_error", param)


async def read_json(request: Request, model: type[M], limit_bytes: int | None = None) -> M:
    """Read, decode (strict UTF-8) and validate a JSON body; every failure is a 400 naming the field."""
    raw = await _read_body(request, limit_bytes)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ApiError(400, f"body: invalid UTF-8 at byte {exc.start}", "invalid_json", "body") from None
    if not text.strip():
        raise ApiError(400, "body: empty; send a JSON object", "invalid_json", "body")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        msg = f"body: invalid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}"
        raise ApiError(400, msg, "invalid_json", "body") from None
    if not isinstance(data, dict):
        raise ApiError(400, "body: must be a JSON object", "invalid_json", "body")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise validation_error(exc) from None


async def _read_body(request: Request, limit_bytes: int | None) -> bytes:
    if limit_bytes is None:
        return await request.body()
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit_bytes:
            raise body_too_large(limit_bytes)
        chunks.append(chunk)
    return b"".join(chunks)


def body_too_large(limit_bytes: int) -> ApiError:
    mib = limit_bytes / (1 << 20)
    return ApiError(
        413,
        f"request body is larger than the {mib:.3g} MiB limit; send less or raise --max-request-mib",
        "request_too_large",
        "body",
    )

"""The FastAPI app: routers of the three API families, /health and /metrics, and one gate middleware.

The gate runs before any route: `/v1/v1/...` aliases, `x-request-id` on every response, 503
`model_loading` (+ `Retry-After: 2`) until the backend is set, the API key (all routes but /health),
the 413 body limit from Content-Length, and the per-route request counter.
"""

from __future__ import annotations

import hmac
import re
import uuid
from typing import Any

from fastapi import FastAPI
from starlette.datastructures import Headers, MutableHeaders
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ninfer import __version__
from ninfer.errors import RequestError
from ninfer.serve import anthropic, llamacpp, openai
from ninfer.serve.backend import Backend
from ninfer.serve.errors import ApiError, body_too_large, error_response
from ninfer.serve.metrics import CONTENT_TYPE
from ninfer.serve.state import ServerState, ServeSettings, get_state

__all__ = ["create_app", "ServeSettings"]

_CLIENT_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")


def create_app(settings: ServeSettings, backend: Backend | None = None) -> FastAPI:
    """The server app; without a backend every route answers 503 model_loading until `set_backend`."""
    app = FastAPI(title="ninfer", version=__version__, docs_url=None, redoc_url=None, openapi_url=None)
    state = ServerState(settings, backend)
    app.state.ninfer = state
    app.include_router(openai.router)
    app.include_router(anthropic.router)
    app.include_router(llamacpp.router)
    app.add_api_route("/health", health, methods=["GET"])
    app.add_api_route("/metrics", metrics, methods=["GET"])
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(RequestError, _request_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_middleware(GateMiddleware, state=state)
    if settings.cors:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(settings.cors),
            allow_methods=["*"],
            allow_headers=["*"],
            expose_headers=["x-request-id"],
        )
    return app


async def health(request: Request) -> dict[str, str]:
    return {"status": "ok"}


async def metrics(request: Request) -> Response:
    return Response(get_state(request).metrics.render(), media_type=CONTENT_TYPE)


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    return error_response(exc, request.url.path)


async def _request_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestError)
    return error_response(ApiError.from_request_error(exc), request.url.path)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, StarletteHTTPException)
    if exc.status_code == 404:
        err = ApiError(404, f"no route {request.method} {request.url.path}", "not_found", None)
    elif exc.status_code == 405:
        err = ApiError(
            405, f"method {request.method} is not allowed on {request.url.path}", "method_not_allowed"
        )
    else:
        err = ApiError(exc.status_code, str(exc.detail), "http_error")
    return error_response(err, request.url.path)


class GateMiddleware:
    def __init__(self, app: ASGIApp, state: ServerState):
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        if path.startswith("/v1/v1/"):
            scope = {**scope, "path": path[3:], "raw_path": path[3:].encode()}
            path = scope["path"]
        headers = Headers(scope=scope)
        client_id = headers.get("x-request-id", "")
        request_id = client_id if _CLIENT_ID.match(client_id) else f"req-{uuid.uuid4().hex[:16]}"
        status = [500]

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
                MutableHeaders(scope=message).append("x-request-id", request_id)
            await send(message)

        try:
            refusal = self._refusal(scope, path, headers)
            if refusal is not None:
                await error_response(refusal, path)(scope, receive, send_with_id)
            else:
                await self.app(scope, receive, send_with_id)
        finally:
            self.state.metrics.observe_request(_route_label(scope), status[0])

    def _refusal(self, scope: Scope, path: str, headers: Headers) -> ApiError | None:
        state = self.state
        if scope["method"] == "OPTIONS":
            return None
        if state.stopping.is_set():
            return ApiError(503, "the server is shutting down", "shutting_down", headers={"Retry-After": "2"})
        if not state.ready:
            return ApiError(
                503,
                "the model is still loading; retry shortly",
                "model_loading",
                headers={"Retry-After": "2"},
            )
        key = state.settings.api_key
        if key and path != "/health":
            given = headers.get("x-api-key") or _bearer(headers.get("authorization", ""))
            if not given:
                return ApiError(
                    401,
                    "missing API key; send 'Authorization: Bearer KEY' or 'x-api-key: KEY'",
                    "invalid_api_key",
                    "authorization",
                )
            if not hmac.compare_digest(given.encode(), key.encode()):
                return ApiError(401, "invalid API key", "invalid_api_key", "authorization")
        length = headers.get("content-length")
        if length and length.isdigit() and int(length) > state.settings.max_request_bytes:
            return body_too_large(state.settings.max_request_bytes)
        return None


def _bearer(value: str) -> str:
    scheme, _, token = value.partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""


def _route_label(scope: Scope) -> str:
    route: Any = scope.get("route")
    return getattr(route, "path", None) or "unmatched"

"""llama.cpp server-compatible routes: /completion (stream and not), /tokenize, /detokenize, /apply-template,
/props (with the memory ledger)."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field, model_validator
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ninfer import __version__
from ninfer.serve.dispatch import Run, check_model, new_id, resolve_max_tokens, sampling_for, sse
from ninfer.serve.errors import ApiError, read_json
from ninfer.serve.generation import Delta, GenerateOptions, Usage
from ninfer.serve.metrics import numeric_stats
from ninfer.serve.openai import ChatMessage, ToolDef, template_messages
from ninfer.serve.state import ServerState, get_state

router = APIRouter()


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


class LlamaCompletionRequest(_Lenient):
    prompt: str | list[int | str]
    model: str | None = None
    n_predict: int = Field(default=-1, ge=-1)
    temperature: float | None = Field(default=None, ge=0)
    top_k: int | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0, le=1)
    min_p: float | None = Field(default=None, ge=0, le=1)
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    repeat_penalty: float | None = Field(default=None, gt=0)
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**64)
    stop: list[str] | None = None
    stream: bool = False
    ignore_eos: bool = False
    cache_prompt: bool = True  # prefix reuse never changes the output
    n_probs: int = Field(default=0, ge=0)
    grammar: str | None = None
    json_schema: dict[str, Any] | None = None
    logit_bias: list[Any] | dict[str, Any] | None = None

    @property
    def repetition_penalty(self) -> float | None:
        return self.repeat_penalty

    @model_validator(mode="after")
    def _refuse_unsupported(self) -> LlamaCompletionRequest:
        if self.n_probs:
            raise ValueError("n_probs: token probabilities are not supported yet")
        if self.grammar or self.json_schema:
            raise ValueError("grammar: constrained generation is not available yet")
        if self.logit_bias:
            raise ValueError("logit_bias: not supported")
        if any(s == "" for s in self.stop or []):
            raise ValueError("stop: stop strings must not be empty")
        return self


class TokenizeRequest(_Lenient):
    content: str
    add_special: bool = False
    with_pieces: bool = False


class DetokenizeRequest(_Lenient):
    tokens: list[int]


class ApplyTemplateRequest(_Lenient):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[ToolDef] | None = None
    add_generation_prompt: bool = True
    enable_thinking: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None


# ---------------------------------------------------------------- routes


@router.post("/completion")
@router.post("/completions")
async def completion(request: Request) -> Response:
    state = get_state(request)
    req = await read_json(request, LlamaCompletionRequest, state.settings.max_request_bytes)
    check_model(state, req.model)
    prompt_text, prompt_ids = await asyncio.to_thread(_prompt, state, req.prompt)
    n_predict = None if req.n_predict < 0 else req.n_predict
    if n_predict == 0:
        raise ApiError(
            400, "n_predict: must be -1 (default) or at least 1", "invalid_request_error", "n_predict"
        )
    max_tokens = resolve_max_tokens(state, n_predict, len(prompt_ids), "n_predict", "prompt")
    sampling = sampling_for(state, None, max_tokens, req)
    if req.seed is not None and req.seed < 0:  # llama.cpp: -1 = random
        sampling = dataclasses.replace(sampling, seed=None)
    options = GenerateOptions(
        sampling=sampling, stop=tuple(req.stop or ()), parse_reasoning=False, tag="completion"
    )
    run = Run.start(state, "/completion", new_id("cmpl-"), prompt_ids, options)
    summary = _Summary(state, prompt_text, len(prompt_ids), sampling)
    if req.stream:
        first = await run.open_stream()
        return run.stream(first, _StreamFormatter(summary))
    out = await run.collect(request)
    assert out.last is not None
    return JSONResponse(summary.final(out.content, out.last))


def _prompt(state: ServerState, prompt: str | list[int | str]) -> tuple[str, list[int]]:
    backend = state.backend
    if isinstance(prompt, str):
        return prompt, backend.tokenize(prompt)
    ids: list[int] = []
    vocab = backend.vocab_size()
    for i, piece in enumerate(prompt):  # llama.cpp accepts token ids mixed with strings
        if isinstance(piece, str):
            ids += backend.tokenize(piece)
        elif not 0 <= piece < vocab:
            raise ApiError(
                400,
                f"prompt[{i}]: token id {piece} is outside the vocabulary (0..{vocab - 1})",
                "invalid_request_error",
                f"prompt[{i}]",
            )
        else:
            ids.append(piece)
    if not ids:
        raise ApiError(400, "prompt: must not be empty", "invalid_request_error", "prompt")
    return backend.detokenize(ids), ids


class _Summary:
    """The fields llama.cpp puts in its final /completion object."""

    def __init__(self, state: ServerState, prompt: str, prompt_tokens: int, sampling: Any):
        self.model = state.model_id
        self.prompt = prompt
        self.prompt_tokens = prompt_tokens
        self.settings = {**dataclasses.asdict(sampling), "n_ctx": state.backend.info.max_context}

    def final(self, content: str, last: Delta) -> dict[str, Any]:
        u = last.usage or Usage(self.prompt_tokens, 0)
        stop_type = {"length": "limit", "error": "none", "cancelled": "none"}.get(
            last.finish_reason or "", "eos"
        )
        if last.stop_string:
            stop_type = "word"
        return {
            "content": content,
            "id_slot": 0,
            "stop": True,
            "model": self.model,
            "tokens_predicted": u.completion_tokens,
            "tokens_evaluated": u.prompt_tokens,
            "tokens_cached": u.cached_tokens,
            "generation_settings": self.settings,
            "prompt": self.prompt,
            "truncated": False,
            "stop_type": stop_type,
            "stopped_eos": stop_type == "eos",
            "stopped_word": stop_type == "word",
            "stopped_limit": stop_type == "limit",
            "stopping_word": last.stop_string or "",
            "timings": _timings(u),
        }


def _timings(u: Usage) -> dict[str, float]:
    prompt_ms = (u.time_to_first_token_s or 0.0) * 1000
    decode_tps = u.decode_tok_per_s or 0.0
    predicted_ms = u.completion_tokens / decode_tps * 1000 if decode_tps else 0.0
    return {
        "prompt_n": u.prompt_tokens,
        "prompt_ms": prompt_ms,
        "prompt_per_token_ms": prompt_ms / u.prompt_tokens if u.prompt_tokens else 0.0,
        "prompt_per_second": u.prefill_tok_per_s or 0.0,
        "predicted_n": u.completion_tokens,
        "predicted_ms": predicted_ms,
        "predicted_per_token_ms": predicted_ms / u.completion_tokens if u.completion_tokens else 0.0,
        "predicted_per_second": decode_tps,
    }


class _StreamFormatter:
    def __init__(self, summary: _Summary):
        self.summary = summary

    def feed(self, delta: Delta) -> list[str]:
        out = []
        if delta.content:
            out.append(sse({"content": delta.content, "stop": False, "id_slot": 0, "index": 0}))
        if delta.finish_reason == "error":
            err = ApiError.from_code(delta.error or "generation failed", delta.error_code)
            out.append(sse({"error": {"code": err.status, "message": err.message, "type": err.code}}))
        elif delta.finish_reason is not None:
            out.append(sse(self.summary.final("", delta)))
        return out


@router.post("/tokenize")
async def tokenize(request: Request) -> dict[str, Any]:
    state = get_state(request)
    req = await read_json(request, TokenizeRequest, state.settings.max_request_bytes)
    ids = await asyncio.to_thread(state.backend.tokenize, req.content, req.add_special)
    if not req.with_pieces:
        return {"tokens": ids}
    return {"tokens": [{"id": i, "piece": state.backend.token_piece(i)} for i in ids]}


@router.post("/detokenize")
async def detokenize(request: Request) -> dict[str, str]:
    state = get_state(request)
    req = await read_json(request, DetokenizeRequest, state.settings.max_request_bytes)
    vocab = state.backend.vocab_size()
    for i, t in enumerate(req.tokens):
        if not 0 <= t < vocab:
            raise ApiError(
                400,
                f"tokens[{i}]: token id {t} is outside the vocabulary (0..{vocab - 1})",
                "invalid_request_error",
                f"tokens[{i}]",
            )
    return {"content": state.backend.detokenize(req.tokens)}


@router.post("/apply-template")
async def apply_template(request: Request) -> dict[str, str]:
    state = get_state(request)
    req = await read_json(request, ApplyTemplateRequest, state.settings.max_request_bytes)
    kwargs = dict(req.chat_template_kwargs or {})
    if req.enable_thinking is not None:
        kwargs["enable_thinking"] = req.enable_thinking
    tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
    prompt = state.backend.render_chat(
        template_messages(req.messages), tools, req.add_generation_prompt, kwargs
    )
    return {"prompt": prompt}


@router.get("/props")
async def props(request: Request) -> dict[str, Any]:
    state = get_state(request)
    backend = state.backend
    info = backend.info
    stats = numeric_stats(backend.stats())
    return {
        "model_alias": state.model_id,
        "model_path": info.extra.get("path"),
        "build_info": f"ninfer {__version__}",
        "total_slots": int(stats.get("lanes_total", 0)),
        "default_generation_settings": {
            "n_ctx": info.max_context,
            "params": dataclasses.asdict(backend.sampling_defaults(None)),  # what /completion uses
        },
        "chat_template": info.chat_template,
        "modalities": {"vision": "image" in info.modalities, "audio": False},
        "metadata": info.extra,
        "engine": stats,
        "memory_ledger": _jsonable(backend.memory_ledger()),
    }


def _jsonable(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    if hasattr(value, "to_dict"):
        return value.to_dict()
    return value

"""OpenAI-compatible HTTP server over the SkipDecode engine (FastAPI + uvicorn).

Endpoints: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions`` (both with
``stream: true`` as server-sent events), ``GET /health``. Besides the OpenAI fields, a request may
carry the SkipDecode fields ``speedup`` or ``max_layers``/``min_layers``/``warmup_layers``/``horizon``;
the response's ``usage`` carries the generation statistics (``skipdecode`` key). Concurrent
requests share forward passes: each prompt is a row of one in-flight batch with its own decode
step and policy (:mod:`skipdecode.scheduler`, no global lock); a completions request with a list
of prompts gives several rows. A full waiting queue answers 429; a client that disconnects has its
rows cancelled at the next step. ``GET /v1/models/{model}`` retrieves the served model.

Streaming: with ``"stream_options": {"include_usage": true}`` (only allowed with ``stream: true``)
one last chunk before ``data: [DONE]`` has ``choices: []`` and the ``usage`` of the non-streamed
response (token counts and the ``skipdecode`` statistics); every other chunk then has
``"usage": null``.

Errors use OpenAI's body ``{"error": {"message", "type", "param", "code": null}}``: HTTP 400 with
type ``invalid_request_error`` for a bad request (schema errors and broken JSON included, not
FastAPI's 422), ``param`` the offending field (null when no field is to blame) and a message that
names it; 404 for an unknown model or route; 500 with type ``server_error`` for a server fault.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import time
import uuid
from typing import Any, AsyncIterator, List, Literal, Mapping, Optional, Sequence, Union

from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from .execution import Executor, Job, Submission
from .model import SkipModel
from .sampling import SamplingParams
from .scheduler import QueueFull, Scheduler

__all__ = ["create_app", "APIError", "CompletionRequest", "ChatCompletionRequest", "StreamOptions"]


class APIError(HTTPException):
    """An HTTP error answered in OpenAI's shape; ``param`` names the request field to blame.

    ``kind`` is OpenAI's error ``type``; by default ``server_error`` for status >= 500, else
    ``invalid_request_error``.
    """

    def __init__(self, status_code: int, message: str, param: Optional[str] = None, kind: Optional[str] = None,
                 headers: Optional[Mapping[str, str]] = None):
        super().__init__(status_code=status_code, detail=message, headers=dict(headers) if headers else None)
        self.param = param
        self.kind = kind or _default_kind(status_code)


def _default_kind(status: int) -> str:
    """OpenAI's error ``type`` for an HTTP status: ``server_error`` from 500, else ``invalid_request_error``."""
    return "server_error" if status >= 500 else "invalid_request_error"


def _error_body(message: str, kind: str, param: Optional[str] = None) -> dict[str, Any]:
    """OpenAI's error object: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}


def _error_response(status: int, message: str, param: Optional[str] = None, kind: Optional[str] = None,
                    headers: Optional[Mapping[str, str]] = None) -> JSONResponse:
    kind = kind or _default_kind(status)
    return JSONResponse(_error_body(message, kind, param), status_code=status, headers=dict(headers or {}))


def _loc_path(loc: Sequence[Union[str, int]]) -> str:
    """A pydantic error ``loc`` as a field path (``messages[0].role``; "" for the whole body).

    The ``body`` prefix and the union-member tags pydantic inserts (``prompt.str``,
    ``stop.list[str]``: any name that is no request field) are left out.
    """
    parts = list(loc[1:] if loc and loc[0] in ("body", "query", "path") else loc)
    path = ""
    for part in parts:
        if isinstance(part, int):
            path += f"[{part}]"
        elif part in _FIELD_NAMES:
            path += f".{part}" if path else part
    return path


def _validation_message(errors: Sequence[Mapping[str, Any]]) -> tuple[str, Optional[str]]:
    """(message, param) for FastAPI's request validation ``errors`` (pydantic error dicts).

    The message is ``"<field>: <pydantic msg>"`` per field (a union's alternatives joined by
    " or "), fields joined by "; "; ``param`` is the first error's field path, or None for a body
    that is not valid JSON or not a JSON object.
    """
    for e in errors:
        if e.get("type") == "json_invalid":
            reason = (e.get("ctx") or {}).get("error", "")
            where = f" at character {e['loc'][-1]}" if isinstance(e["loc"][-1], int) else ""
            return f"the request body is not valid JSON ({reason}{where})", None
    by_path: dict[str, list[str]] = {}
    for e in errors:
        msgs = by_path.setdefault(_loc_path(e.get("loc", ())), [])
        if e.get("msg", "invalid value") not in msgs:
            msgs.append(e.get("msg", "invalid value"))
    message = "; ".join(f"{path or 'body'}: {' or '.join(msgs)}" for path, msgs in by_path.items())
    return message or "invalid request", next((path for path in by_path if path), None)


def _json_safe(value: Any) -> Any:
    """``value`` with non-finite floats (NaN: e.g. ``step_seconds`` of a run without decode
    steps) replaced by None, which JSON can carry."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def _param_in(message: str, fields: Mapping[str, str]) -> Optional[str]:
    """The request field of the first word of ``message`` that is a key of ``fields`` (None: none).

    Engine messages name the engine's argument (``speedup``, ``max_new_tokens``, ``prompts[0]``);
    ``fields`` maps such names to the request field (``max_new_tokens`` -> ``max_tokens``).
    """
    for word in re.findall(r"[A-Za-z_]+", message):
        if word in fields:
            return fields[word]
    return None


_POLICY_FIELDS = {k: k for k in ("speedup", "max_layers", "min_layers", "warmup_layers", "horizon")}
_SAMPLING_FIELDS = {k: k for k in ("temperature", "top_k", "top_p", "seed")}


class SkipFields(BaseModel):
    """SkipDecode extensions accepted by both endpoints (None: the server model's policy)."""

    speedup: Optional[float] = Field(None, description="Target speedup (>= 1).")
    max_layers: Optional[int] = None
    min_layers: Optional[int] = None
    warmup_layers: Optional[int] = None
    horizon: Optional[int] = None


class StreamOptions(BaseModel):
    """OpenAI ``stream_options``: ``include_usage`` adds a last chunk with the request's usage."""

    include_usage: bool = False


class CommonFields(SkipFields):
    """OpenAI sampling fields shared by both endpoints."""

    model: Optional[str] = None
    max_tokens: int = Field(64, ge=1, description="Most new tokens per prompt.")
    temperature: float = Field(0.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)
    seed: Optional[int] = None
    stop: Optional[Union[str, List[str]]] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = Field(None, description="Only with stream=true.")
    n: int = Field(1, ge=1, le=1, description="Only n=1 is supported.")


class CompletionRequest(CommonFields):
    """``POST /v1/completions`` body: ``prompt`` is one string or a batch of strings."""

    prompt: Union[str, List[str]]


class ChatMessage(BaseModel):
    """One chat turn."""

    role: Literal["system", "user", "assistant"]
    content: str


class ChatCompletionRequest(CommonFields):
    """``POST /v1/chat/completions`` body."""

    messages: List[ChatMessage] = Field(..., min_length=1)


_FIELD_NAMES = frozenset(
    name for cls in (CompletionRequest, ChatCompletionRequest, ChatMessage, StreamOptions) for name in cls.model_fields
)


def _stops(stop: Optional[Union[str, List[str]]]) -> list[str]:
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else list(stop)


class _BodyLimit:
    """ASGI middleware: a body whose Content-Length exceeds ``max_request_bytes`` (bytes) answers
    413 in OpenAI's error shape before it is read. (A pure ASGI middleware: Starlette's
    ``BaseHTTPMiddleware`` would hide the client's disconnect from the endpoints.)"""

    def __init__(self, app, max_request_bytes: int) -> None:
        self.app = app
        self.max_request_bytes = max_request_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            length = dict(scope.get("headers") or []).get(b"content-length", b"")
            if length.isdigit() and int(length) > self.max_request_bytes:
                response = _error_response(
                    413, f"the request body is {int(length)} bytes; this server accepts at most "
                    f"{self.max_request_bytes} (max_request_bytes)")
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def create_app(
    model: SkipModel,
    model_name: str = "skipdecode",
    *,
    max_batch_size: int = 32,
    max_waiting: int = 256,
    serial: bool = False,
    max_request_bytes: int = 1_000_000,
) -> FastAPI:
    """Build the FastAPI app serving ``model`` under the name ``model_name``.

    Requests share forward passes through one in-flight :class:`~skipdecode.scheduler.Scheduler`
    (``max_batch_size`` rows decode at once, ``max_waiting`` rows may wait for a slot; a full
    queue answers 429). ``serial`` serves one row at a time (the one-at-a-time design, kept for
    comparison). A body over ``max_request_bytes`` (bytes, by its Content-Length) answers 413
    before it is read. The app's ``state.scheduler`` is the scheduler (``/health`` reports it).

    Every error answers OpenAI's body ``{"error": {"message", "type", "param", "code": null}}``:
    bad request values (a bad policy, an empty prompt, a prompt longer than the context, a schema
    error, broken JSON, ``stream_options`` without ``stream``) answer HTTP 400 with ``param`` the
    field and a message naming it; a ``model`` other than ``model_name`` answers 404; an
    unexpected exception answers 500 (type ``server_error``).
    """
    app = FastAPI(title="skipdecode", description="OpenAI-compatible SkipDecode server")
    scheduler = Scheduler(model.adapter, 1 if serial else max_batch_size, max_waiting)
    executor = Executor(model, scheduler)
    app.state.scheduler = scheduler

    app.add_middleware(_BodyLimit, max_request_bytes=max_request_bytes)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc.errors())
        return _error_response(400, message, param)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
        return _error_response(exc.status_code, message, getattr(exc, "param", None), getattr(exc, "kind", None),
                               headers=exc.headers)

    @app.exception_handler(Exception)
    async def on_server_error(request: Request, exc: Exception) -> JSONResponse:
        # Starlette still re-raises exc after this answer, so the server logs the traceback.
        return _error_response(500, f"the server had an error while processing the request ({type(exc).__name__})")

    def unknown_model(name: str) -> APIError:
        return APIError(404, f"model: the model {name!r} does not exist; this server serves {model_name!r}",
                        param="model")

    def check_request(req: CommonFields) -> None:
        """Raise :class:`APIError` for an unknown ``model`` (404) or ``stream_options`` without stream (400)."""
        if req.model is not None and req.model != model_name:
            raise unknown_model(req.model)
        if req.stream_options is not None and not req.stream:
            raise APIError(400, "stream_options: only allowed when stream is true", param="stream_options")

    def policy_of(req: SkipFields):
        try:
            if req.speedup is not None or any(
                v is not None for v in (req.max_layers, req.min_layers, req.warmup_layers, req.horizon)
            ):
                return model.policy_for(
                    speedup=req.speedup, horizon=req.horizon, max_layers=req.max_layers,
                    min_layers=req.min_layers, warmup_layers=req.warmup_layers,
                )
            return model.policy
        except ValueError as e:
            raise APIError(400, str(e), param=_param_in(str(e), _POLICY_FIELDS)) from None

    def sampling_of(req: CommonFields) -> SamplingParams:
        try:
            return SamplingParams(temperature=req.temperature, top_k=req.top_k, top_p=req.top_p, seed=req.seed)
        except ValueError as e:
            raise APIError(400, str(e), param=_param_in(str(e), _SAMPLING_FIELDS)) from None

    def engine_param(message: str, kind: str) -> Optional[str]:
        """The request field an engine ValueError ``message`` blames (``kind``: "chat" or "text")."""
        prompt_field = "messages" if kind == "chat" else "prompt"
        return _param_in(message, {"max_new_tokens": "max_tokens", "prompts": prompt_field, "stop": "stop"})

    def chat_prompt(messages: List[ChatMessage]) -> str:
        tok = model.tokenizer
        if not getattr(tok, "chat_template", None):
            raise APIError(400, "messages: this model has no chat template; use /v1/completions", param="messages")
        return tok.apply_chat_template([m.model_dump() for m in messages], add_generation_prompt=True, tokenize=False)

    async def submit(prompts: list[str], req: CommonFields, kind: str) -> Submission:
        """Validate and queue a request: 400 for a bad value (lengths included), 429 for a full queue."""
        job = Job(prompts, req.max_tokens, policy_of(req), sampling_of(req), _stops(req.stop))
        try:
            return await executor.submit(job)
        except ValueError as e:
            raise APIError(400, str(e), param=engine_param(str(e), kind)) from None
        except QueueFull as e:
            raise APIError(429, str(e), kind="rate_limit_error", headers={"Retry-After": "1"}) from None

    async def collect(sub: Submission, request: Request):
        """Wait for every row of ``sub``; None (rows cancelled) if the client disconnects."""
        loop = asyncio.get_running_loop()
        checked = loop.time()
        try:
            while not sub.finished:
                try:
                    await sub.next(timeout=0.25)
                except asyncio.TimeoutError:
                    pass
                if loop.time() - checked >= 0.25:  # look for a vanished client 4 times a second
                    checked = loop.time()
                    if await request.is_disconnected():
                        return None
            return sub.result(model.num_layers)
        finally:
            if not sub.finished:
                sub.cancel()

    def usage(result) -> dict[str, Any]:
        """OpenAI ``usage`` (tokens) plus ``skipdecode``: the run's statistics (NaN as null)."""
        stats = _json_safe(result.stats())
        return {
            "prompt_tokens": stats["prompt_tokens"],
            "completion_tokens": stats["new_tokens"],
            "total_tokens": stats["prompt_tokens"] + stats["new_tokens"],
            "skipdecode": stats,
        }

    async def stream(sub: Submission, req: CommonFields, kind: str) -> AsyncIterator[str]:
        """Server-sent events of one request: text deltas, each row's finish reason, with
        ``stream_options.include_usage`` a last chunk holding ``usage``, then ``data: [DONE]``.
        If the client goes away, the generator is closed and the rows are cancelled."""
        include_usage = req.stream_options is not None and req.stream_options.include_usage
        rid = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        created = int(time.time())
        obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
        n = len(sub.requests)

        def sse(choices: list[dict[str, Any]], use: Optional[dict[str, Any]] = None) -> str:
            body = {"id": rid, "object": obj, "created": created, "model": model_name, "choices": choices}
            if include_usage:
                body["usage"] = use  # OpenAI: null on every chunk but the last
            return "data: " + json.dumps(body) + "\n\n"

        def event(i: int, text: str | None = None, finish: str | None = None, role: bool = False) -> str:
            if kind == "chat":
                delta = {"role": "assistant"} if role else ({"content": text} if text else {})
                choice = {"index": i, "delta": delta, "finish_reason": finish}
            else:
                choice = {"index": i, "text": text or "", "finish_reason": finish}
            return sse([choice])

        try:
            if kind == "chat":
                for i in range(n):
                    yield event(i, role=True)
            while not sub.finished:
                i, delta, finished = await sub.next()
                if delta:
                    yield event(i, delta)
                if finished:
                    yield event(i, finish=reason(sub.texts[i].reason))
            if include_usage:
                yield sse([], usage(sub.result(model.num_layers)))
        except Exception as e:  # noqa: BLE001 - headers are sent: the error travels as an event
            yield "data: " + json.dumps(_error_body(f"generation failed ({type(e).__name__})", "server_error")) + "\n\n"
        finally:
            if not sub.finished:
                sub.cancel()
        yield "data: [DONE]\n\n"

    def reason(r: str) -> str:
        return "length" if r == "length" else "stop"

    @app.get("/health")
    def health() -> dict[str, Any]:
        return {"status": "ok", "num_layers": model.num_layers, "policy": model.policy.to_dict(),
                "scheduler": scheduler.stats()}

    @app.get("/v1/models")
    def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    def model_card() -> dict[str, Any]:
        return {"id": model_name, "object": "model", "owned_by": "skipdecode"}

    @app.get("/v1/models/{model_id}")
    def retrieve_model(model_id: str) -> dict[str, Any]:
        if model_id != model_name:
            raise unknown_model(model_id)
        return model_card()

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        check_request(req)
        prompts = [req.prompt] if isinstance(req.prompt, str) else list(req.prompt)
        if not prompts:
            raise APIError(400, "prompt: must hold at least one string", param="prompt")
        sub = await submit(prompts, req, "text")  # every check happens before the stream starts
        if req.stream:
            return StreamingResponse(stream(sub, req, "text"), media_type="text/event-stream")
        result = await collect(sub, request)
        if result is None:
            return Response(status_code=499)  # the client is gone
        return {
            "id": f"cmpl-{uuid.uuid4().hex[:24]}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": model_name,
            "choices": [
                {"index": i, "text": t, "finish_reason": reason(r), "logprobs": None}
                for i, (t, r) in enumerate(zip(result.texts, result.finish_reasons))
            ],
            "usage": usage(result),
        }

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, request: Request):
        check_request(req)
        prompt = chat_prompt(req.messages)
        sub = await submit([prompt], req, "chat")
        if req.stream:
            return StreamingResponse(stream(sub, req, "chat"), media_type="text/event-stream")
        result = await collect(sub, request)
        if result is None:
            return Response(status_code=499)
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex[:24]}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": model_name,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": result.texts[0]},
                    "finish_reason": reason(result.finish_reasons[0]),
                }
            ],
            "usage": usage(result),
        }

    return app

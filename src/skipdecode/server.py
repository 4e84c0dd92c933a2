"""OpenAI-compatible HTTP server over the SkipDecode engine (FastAPI + uvicorn).

Endpoints: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions`` (both with
``stream: true`` as server-sent events), ``GET /health``, ``GET /metrics`` (Prometheus metrics,
:mod:`skipdecode.server_metrics`). Besides the OpenAI fields, a request may carry the SkipDecode
fields ``speedup`` or ``max_layers``/``min_layers``/``warmup_layers``/``horizon``; the response's
``usage`` carries the generation statistics (``skipdecode`` key). Concurrent
requests share forward passes: each prompt is a row of one in-flight batch with its own decode
step and policy (:mod:`skipdecode.scheduler`, no global lock); a completions request with a list
of prompts gives several rows. A full waiting queue answers 429; a client that disconnects has its
rows cancelled at the next step. ``GET /v1/models/{model}`` retrieves the served model.

Streaming: with ``"stream_options": {"include_usage": true}`` (only allowed with ``stream: true``)
one last chunk before ``data: [DONE]`` has ``choices: []`` and the ``usage`` of the non-streamed
response (token counts and the ``skipdecode`` statistics); every other chunk then has
``"usage": null``.

Requests are parsed and checked in full by :mod:`skipdecode.protocol` (OpenAI's fields with their
meaning, unsupported features refused by name, prompts encoded by the one path the library and the
CLI use) before anything reaches the engine; docs/openai-api.md lists what is accepted.

Errors use OpenAI's body ``{"error": {"message", "type", "param", "code"}}`` (``code`` null but for
``model_not_found`` and ``invalid_api_key``): HTTP 400 with
type ``invalid_request_error`` for a bad request (schema errors and broken JSON included, not
FastAPI's 422), ``param`` the offending field (null when no field is to blame) and a message that
names it; 404 for an unknown model or route; 500 with type ``server_error`` for a server fault.
"""

from __future__ import annotations

import asyncio
import re
import secrets
import threading
import time
import uuid
from typing import Any, AsyncIterator, Callable, Mapping, Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .admission import SERVE_ALIGN_STEPS
from .chunked_prefill import SERVE_PREFILL_CHUNK_TOKENS
from .execution import Executor, Submission
from .generate import GenerationResult
from .jsonio import dumps, json_safe
from .logprobs import TextOffsets, chat_logprobs, completion_logprobs
from .model import SkipModel
from .protocol import (
    SHAPE_FIELDS,
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    StreamOptions,
    ValidRequest,
    default_kind,
    error_body,
    unknown_model,
    validate_request,
)
from .validation_errors import validation_message
from .compile_warmup import compiled_graphs
from .scheduler import QueueFull, Scheduler
from .server_metrics import RequestTimer, ServerMetrics

__all__ = ["create_app", "uvicorn_options", "APIError", "CompletionRequest", "ChatCompletionRequest", "StreamOptions"]


def uvicorn_options() -> dict[str, str]:
    """The HTTP stack ``uvicorn.run`` gets: ``{"loop": ..., "http": ...}``.

    uvloop's event loop and httptools' HTTP/1.1 parser where they are installed (dependencies of
    this package on Linux and macOS, as in uvicorn's own ``uvicorn[standard]`` extra), else
    asyncio's loop and h11. They cost the server's event-loop thread about a quarter less CPU
    per streamed request (measured on loopback with 16 streaming clients: 0.36-0.39 against
    0.48-0.54 CPU-s for 112 streamed 32-token requests), CPU that on a small host the model's
    threads want (docs/serving.md). Never raises.
    """
    from importlib.util import find_spec

    return {"loop": "uvloop" if find_spec("uvloop") else "asyncio",
            "http": "httptools" if find_spec("httptools") else "h11"}


def _error_response(status: int, message: str, param: Optional[str] = None, kind: Optional[str] = None,
                    headers: Optional[Mapping[str, str]] = None, code: Optional[str] = None) -> JSONResponse:
    kind = kind or default_kind(status)
    return StrictJSONResponse(error_body(message, kind, param, code), status_code=status, headers=dict(headers or {}))


class StrictJSONResponse(JSONResponse):
    """Every JSON response of the server, rendered by :func:`skipdecode.jsonio.dumps` (strict
    JSON: a non-finite float such as ``step_seconds`` of a run without decode steps is null)."""

    def render(self, content: Any) -> bytes:
        """``content`` as compact strict JSON bytes (UTF-8)."""
        return dumps(content, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


def _param_in(message: str, fields: Mapping[str, str]) -> Optional[str]:
    """The request field of the first word of ``message`` that is a key of ``fields`` (None: none).

    Engine messages name the engine's argument (``speedup``, ``max_new_tokens``, ``prompts[0]``);
    ``fields`` maps such names to the request field (``max_new_tokens`` -> ``max_tokens``).
    """
    for word in re.findall(r"[A-Za-z_]+", message):
        if word in fields:
            return fields[word]
    return None


class _BodyLimit:
    """ASGI middleware: a body over ``max_request_bytes`` (bytes) answers 413 in OpenAI's error
    shape. A Content-Length over it is refused before the body is read; a body without one
    (``Transfer-Encoding: chunked``) is read up to the limit and refused as soon as it passes it,
    else handed on whole. (A pure ASGI middleware: Starlette's ``BaseHTTPMiddleware`` would hide
    the client's disconnect from the endpoints.)"""

    def __init__(self, app, max_request_bytes: int) -> None:
        self.app = app
        self.max_request_bytes = max_request_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope.get("headers") or []).get(b"content-length", b"")
        if length.isdigit():
            if int(length) > self.max_request_bytes:
                await self._refuse(scope, receive, send, f"the request body is {int(length)} bytes")
                return
            await self.app(scope, receive, send)
            return
        parts, size = [], 0  # no length given: count the body as it arrives
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left before its body ended
                return
            parts.append(message.get("body", b""))
            size += len(parts[-1])
            if size > self.max_request_bytes:
                await self._refuse(scope, receive, send, f"the request body is over {self.max_request_bytes} bytes")
                return
            if not message.get("more_body", False):
                break
        whole = {"type": "http.request", "body": b"".join(parts), "more_body": False}

        async def replay():
            nonlocal whole
            if whole is None:
                return await receive()  # later calls: the client's disconnect
            message, whole = whole, None
            return message

        await self.app(scope, replay, send)

    async def _refuse(self, scope, receive, send, what: str) -> None:
        _count_refusal(scope.get("app"), scope.get("path", ""), 413)
        response = _error_response(
            413, f"{what}; this server accepts at most {self.max_request_bytes} bytes")
        await response(scope, receive, send)


def check_api_key(api_key: Any, name: str = "api_key") -> str:
    """``api_key`` without surrounding whitespace (a key read from a file often ends in a newline,
    which no client sends back).

    Raises:
        ValueError: not a string, empty, or holding a character other than printable ASCII
            without spaces (an HTTP header carries it; the ``openai`` client sends ASCII only);
            the message names ``name``.
    """
    key = api_key.strip() if isinstance(api_key, str) else None
    if not key:
        raise ValueError(f"{name} must be a non-empty string (leave it out to serve without a key)")
    if not all("!" <= c <= "~" for c in key):
        raise ValueError(f"{name} must be printable ASCII without spaces (an HTTP header carries it)")
    return key


class _ApiKey:
    """ASGI middleware: a request to an OpenAI route (``/v1/...``) must carry ``Authorization:
    Bearer <api_key>``, as OpenAI's API and vLLM's ``--api-key`` ask; ``/health``, ``/metrics`` and
    the OpenAPI pages stay open. A missing or wrong key answers 401 in OpenAI's error shape (code
    ``invalid_api_key``, header ``WWW-Authenticate: Bearer``) before the body is read; the key is
    compared in constant time (:func:`secrets.compare_digest`)."""

    def __init__(self, app, api_key: str) -> None:
        self.app = app
        self.key = api_key.encode("utf-8")

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope.get("path", "").startswith("/v1/"):
            scheme, _, token = dict(scope.get("headers") or []).get(b"authorization", b"").partition(b" ")
            if scheme.lower() != b"bearer" or not secrets.compare_digest(token.strip(), self.key):
                _count_refusal(scope.get("app"), scope.get("path", ""), 401)
                if not scheme:
                    what = "no API key was given"
                elif scheme.lower() != b"bearer":
                    what = "the Authorization header must use the Bearer scheme"
                else:
                    what = "the API key is not this server's"
                response = _error_response(
                    401, f"{what}: send the header 'Authorization: Bearer <key>' with the key the server was "
                    "started with (skipdecode serve --api-key)", kind="invalid_request_error",
                    headers={"WWW-Authenticate": "Bearer"}, code="invalid_api_key")
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _count_refusal(app: Any, path: str, status: int) -> None:
    """Count a refused request in ``app``'s metrics (:meth:`ServerMetrics.refused`), if it has them."""
    metrics = getattr(getattr(app, "state", None), "metrics", None)
    if metrics is not None:
        metrics.refused(path, status)


async def _on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    """400 ``invalid_request_error`` for a schema error or broken JSON (not FastAPI's 422)."""
    _count_refusal(request.app, request.url.path, 400)
    message, param = validation_message(exc.errors())
    content_type = request.headers.get("content-type", "")
    if param is None and "json" not in content_type.lower():  # e.g. `curl -d` without a JSON header
        message += f" (the body must be a JSON object sent with content-type: application/json; got {content_type or 'no content-type'!r})"
    return _error_response(400, message, param)


async def _on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    """An HTTP error (an :class:`APIError`, an unknown route) in OpenAI's shape, its headers kept."""
    _count_refusal(request.app, request.url.path, exc.status_code)  # 400s and 429s
    message = exc.detail if isinstance(exc.detail, str) else dumps(exc.detail)
    if exc.status_code == 400 and message == "There was an error parsing the body":  # FastAPI's, e.g. not UTF-8
        message = "the request body is not valid JSON (it could not be decoded: send UTF-8 text)"
    elif exc.status_code == 405 and not isinstance(exc, APIError):  # Starlette's "Method Not Allowed"
        message = f"{request.method} is not allowed on {request.url.path}; it takes {(exc.headers or {}).get('Allow', '')}"
    elif exc.status_code == 404 and not isinstance(exc, APIError):  # Starlette's "Not Found": an unknown route
        message = (f"{request.url.path} is not a route of this server (/v1/completions, /v1/chat/completions, "
                   "/v1/models, /health, /metrics)")
    return _error_response(exc.status_code, message, getattr(exc, "param", None), getattr(exc, "kind", None),
                           headers=exc.headers, code=getattr(exc, "code", None))


async def _on_server_error(request: Request, exc: Exception) -> JSONResponse:
    """500 ``server_error`` for an unexpected exception."""
    # Starlette still re-raises exc after this answer, so the server logs the traceback.
    return _error_response(500, f"the server had an error while processing the request ({type(exc).__name__})")


def _add_error_handlers(app: FastAPI) -> None:
    """Register on ``app`` the handlers that answer every error in OpenAI's body."""
    app.add_exception_handler(RequestValidationError, _on_validation_error)
    app.add_exception_handler(StarletteHTTPException, _on_http_error)
    app.add_exception_handler(Exception, _on_server_error)


def _engine_param(message: str, kind: str) -> Optional[str]:
    """The request field an engine ValueError ``message`` blames (``kind``: "chat" or "text")."""
    prompt_field = "messages" if kind == "chat" else "prompt"
    return _param_in(message, {"max_new_tokens": "max_tokens", "prompts": prompt_field, "stop": "stop", "n": "n"})


def _reason(r: str) -> str:
    """OpenAI's ``finish_reason`` of a row's finish reason ``r``: "length", else "stop"."""
    return "length" if r == "length" else "stop"


def _usage(result: GenerationResult) -> dict[str, Any]:
    """OpenAI ``usage`` (tokens; ``prompt_tokens_details.cached_tokens``: prompt tokens
    reused from the prefix cache) plus ``skipdecode``: the run's statistics (NaN as null)."""
    stats = json_safe(result.stats())
    return {
        "prompt_tokens": stats["prompt_tokens"],
        "completion_tokens": stats["new_tokens"],
        "total_tokens": stats["prompt_tokens"] + stats["new_tokens"],
        "prompt_tokens_details": {"cached_tokens": stats["cached_prompt_tokens"]},
        "skipdecode": stats,
    }


class _Routes:
    """One app's state (``model`` served as ``model_name``, its scheduler, executor and metrics) and
    the route handlers :meth:`register` adds. The handlers have no docstrings on purpose: FastAPI would
    publish them as the routes' OpenAPI descriptions."""

    def __init__(self, model: SkipModel, model_name: str, scheduler: Scheduler, executor: Executor,
                 metrics: ServerMetrics, policy_defaults: Mapping[str, int]) -> None:
        self.model = model
        self.model_name = model_name
        self.policy_defaults = policy_defaults
        self.scheduler = scheduler
        self.executor = executor
        self.metrics = metrics
        self.tokenizer_lock = threading.Lock()  # a fast tokenizer must not be reconfigured by two threads at once
        # graphs compiled so far (the model's warm-ups): later ones compiled mid-serving
        self.graphs_at_start = compiled_graphs() if getattr(model, "compile_report", None) is not None else 0

    def register(self, app: FastAPI) -> None:
        """Add the routes (the module docstring's endpoints) to ``app``."""
        app.add_api_route("/health", self.health, methods=["GET"])
        app.add_api_route("/metrics", self.prometheus, methods=["GET"], include_in_schema=False)
        app.add_api_route("/v1/models", self.models, methods=["GET"])
        app.add_api_route("/v1/models/{model_id}", self.retrieve_model, methods=["GET"])
        app.add_api_route("/v1/completions", self.completions, methods=["POST"])
        app.add_api_route("/v1/chat/completions", self.chat_completions, methods=["POST"])

    async def _validate(self, req) -> ValidRequest:
        """:func:`validate_request` (prompts tokenized) on a worker thread, off the event loop."""
        def check() -> ValidRequest:
            with self.tokenizer_lock:
                return validate_request(req, self.model, self.model_name, self.policy_defaults)

        return await asyncio.to_thread(check)

    async def _submit(self, job: ValidRequest) -> Submission:
        """Queue a validated request: 400 if the engine refuses it, 429 for a full queue."""
        try:
            return self.executor.submit(job)
        except ValueError as e:
            raise APIError(400, str(e), param=_engine_param(str(e), job.kind)) from None
        except QueueFull as e:
            raise APIError(429, str(e), kind="rate_limit_error", headers={"Retry-After": "1"}) from None

    async def _collect(self, sub: Submission, request: Request, timer: RequestTimer) -> Optional[GenerationResult]:
        """Wait for every row of ``sub``; None (rows cancelled) if the client disconnects. The
        request's end is recorded in the metrics (``timer``) whichever way it ends."""
        loop = asyncio.get_running_loop()
        checked = loop.time()
        try:
            while not sub.finished:
                try:
                    await sub.next(timeout=0.25)
                    timer.token()
                except asyncio.TimeoutError:
                    pass
                if loop.time() - checked >= 0.25:  # look for a vanished client 4 times a second
                    checked = loop.time()
                    if await request.is_disconnected():
                        return None
            result = sub.result(self.model.num_layers)
            self.metrics.finish(timer, result)
            return result
        except Exception:
            self.metrics.end(timer, "error")
            raise
        finally:
            if not sub.finished:
                sub.cancel()
            self.metrics.end(timer, "cancelled")  # nothing if recorded above

    async def _stream(self, sub: Submission, job: ValidRequest, timer: RequestTimer) -> AsyncIterator[str]:
        """Server-sent events of one request: text deltas, each row's finish reason, with
        ``stream_options.include_usage`` a last chunk holding ``usage``, then ``data: [DONE]``.
        If the client goes away, the generator is closed and the rows are cancelled. The request's
        end is recorded in the metrics (``timer``): completed, error, or else cancelled."""
        include_usage, kind = job.include_usage, job.kind
        rid = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        created = int(time.time())
        obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
        n = len(sub.requests)

        def sse(choices: list[dict[str, Any]], use: Optional[dict[str, Any]] = None) -> str:
            body = {"id": rid, "object": obj, "created": created, "model": self.model_name, "choices": choices}
            if include_usage:
                body["usage"] = use  # OpenAI: null on every chunk but the last
            return "data: " + dumps(body) + "\n\n"

        sent = [TextOffsets() for _ in range(n)]  # per row, where its next token starts (text_offset)

        def event(i: int, text: str | None = None, finish: str | None = None, role: bool = False,
                  entries: Optional[list] = None) -> str:
            if kind == "chat":
                delta = {"role": "assistant"} if role else ({"content": text} if text else {})
                choice = {"index": i, "delta": delta, "finish_reason": finish}
            else:
                choice = {"index": i, "text": text or "", "finish_reason": finish}
            if entries:
                choice["logprobs"] = self._logprobs(kind, entries, sent[i])  # completions: advances sent[i]
            return sse([choice])

        try:
            if kind == "chat":
                for i in range(n):
                    yield event(i, role=True)
            while not sub.finished:
                items = await sub.next()
                timer.token()
                for i, delta, finished, entries in items:
                    if delta or entries:
                        yield event(i, delta, entries=entries)
                    if finished:
                        yield event(i, finish=_reason(sub.texts[i].reason))
            result = sub.result(self.model.num_layers)
            self.metrics.finish(timer, result)
            if include_usage:
                yield sse([], _usage(result))
        except Exception as e:  # noqa: BLE001 - headers are sent: the error travels as an event
            self.metrics.end(timer, "error")
            yield "data: " + dumps(error_body(f"generation failed ({type(e).__name__})", "server_error")) + "\n\n"
        finally:
            if not sub.finished:
                sub.cancel()
            self.metrics.end(timer, "cancelled")  # the client went away (nothing if recorded above)
        yield "data: [DONE]\n\n"

    async def _respond(self, req, request: Request, body: Callable[[GenerationResult], dict[str, Any]]):
        """Validate and queue ``req``: its event stream, 499 if the client is gone, else ``body(result)``."""
        timer = RequestTimer("chat" if isinstance(req, ChatCompletionRequest) else "completions")  # arrives now
        job = await self._validate(req)  # every check before the queue (and the stream)
        sub = await self._submit(job)
        if job.stream:
            return StreamingResponse(self._stream(sub, job, timer), media_type="text/event-stream")
        result = await self._collect(sub, request, timer)
        if result is None:
            return Response(status_code=499)  # the client is gone
        return body(result)

    def _logprobs(self, kind: str, entries: list, before: bytes | TextOffsets = b"") -> dict[str, Any]:
        """A choice's (or chunk's) ``logprobs`` object in the endpoint's shape (``kind`` "chat" or
        "text"; :mod:`skipdecode.logprobs`), completions' ``text_offset`` after ``before`` (the
        row's earlier tokens' bytes, or a stream's :class:`~skipdecode.logprobs.TextOffsets`)."""
        tok = self.model.tokenizer
        if kind == "chat":
            return chat_logprobs(entries, tok)
        return completion_logprobs(entries, tok, before)

    def _model_card(self) -> dict[str, Any]:
        """The served model as an OpenAI model object."""
        return {"id": self.model_name, "object": "model", "owned_by": "skipdecode"}

    def _completion(self, result: GenerationResult) -> dict[str, Any]:
        """The ``text_completion`` body of a finished completions request."""
        return {
            "id": f"cmpl-{uuid.uuid4().hex[:24]}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": self.model_name,
            "choices": [
                {"index": i, "text": t, "finish_reason": _reason(r),
                 "logprobs": None if result.logprobs is None else self._logprobs("text", result.logprobs[i])}
                for i, (t, r) in enumerate(zip(result.texts, result.finish_reasons))
            ],
            "usage": _usage(result),
        }

    def _chat_completion(self, result: GenerationResult) -> dict[str, Any]:
        """The ``chat.completion`` body of a finished chat request."""
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex[:24]}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.model_name,
            "choices": [
                {
                    "index": i,
                    "message": {"role": "assistant", "content": text},
                    "finish_reason": _reason(result.finish_reasons[i]),
                    "logprobs": None if result.logprobs is None else self._logprobs("chat", result.logprobs[i]),
                }
                for i, text in enumerate(result.texts)
            ],
            "usage": _usage(result),
        }

    async def health(self) -> dict[str, Any]:
        loop = type(asyncio.get_running_loop()).__module__.split(".")[0]  # "uvloop" or "asyncio"
        return {"status": "ok", "num_layers": self.model.num_layers, "policy": self.model.policy.to_dict(),
                "scheduler": self.scheduler.stats(), "event_loop": loop, "compile": self._compile_state()}

    def _compile_state(self) -> dict[str, Any] | None:
        report = getattr(self.model, "compile_report", None)
        if report is None:  # not compiled
            return None
        return {"enabled": report.enabled, "warm_up_seconds": report.compile_seconds,
                "graphs_after_start": compiled_graphs() - self.graphs_at_start}

    def prometheus(self, request: Request) -> Response:
        content, content_type = self.metrics.render(request.headers.get("accept"))
        return Response(content, media_type=content_type)

    def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [self._model_card()]}

    def retrieve_model(self, model_id: str) -> dict[str, Any]:
        if model_id != self.model_name:
            raise unknown_model(model_id, self.model_name)
        return self._model_card()

    async def completions(self, req: CompletionRequest, request: Request):
        return await self._respond(req, request, self._completion)

    async def chat_completions(self, req: ChatCompletionRequest, request: Request):
        return await self._respond(req, request, self._chat_completion)


def create_app(
    model: SkipModel,
    model_name: str = "skipdecode",
    *,
    max_batch_size: int = 32,
    max_waiting: int = 256,
    serial: bool = False,
    max_request_bytes: int = 1_000_000,
    cohort_size: int = 1,
    prefix_cache: bool | int = True,
    align_steps: int = SERVE_ALIGN_STEPS,
    prefill_chunk_tokens: int = SERVE_PREFILL_CHUNK_TOKENS,
    max_cache_bytes: Optional[int] = None,
    stream_interval: int = 1,
    api_key: Optional[str] = None,
    policy_defaults: Optional[Mapping[str, int]] = None,
) -> FastAPI:
    """Build the FastAPI app serving ``model`` under the name ``model_name``.

    Requests share forward passes through one in-flight :class:`~skipdecode.scheduler.Scheduler`
    (``max_batch_size`` rows decode at once, ``max_waiting`` rows may wait for a slot; a full
    queue answers 429; waiting requests join in cohorts of at least ``cohort_size`` rows, see
    :class:`~skipdecode.engine.Engine`; ``align_steps`` > 0 holds them, at most that many steps,
    while every running row is older, :mod:`skipdecode.admission`; default
    :data:`~skipdecode.admission.SERVE_ALIGN_STEPS`, 0 when ``serial``). ``serial`` serves one row at a time (the one-at-a-time design, kept for
    comparison). A body over ``max_request_bytes`` (bytes, by its Content-Length) answers 413
    before it is read. ``prefix_cache`` is the engine's automatic prefix caching (True: the
    default token budget, an integer: that budget, False/0: off; :class:`~skipdecode.engine.Engine`):
    prompts that share a prefix with recent ones prefill only the rest; each response's
    ``usage.prompt_tokens_details.cached_tokens`` counts its reused prompt tokens.
    ``prefill_chunk_tokens`` C (tokens; default
    :data:`~skipdecode.chunked_prefill.SERVE_PREFILL_CHUNK_TOKENS`, 0 when ``serial``; 0: off):
    a prompt with more than C tokens to compute is prefilled C tokens per engine step while the
    running rows go on decoding (:mod:`skipdecode.chunked_prefill`). ``max_cache_bytes`` bounds
    the engine's key/value buffers (bytes; None, the default here: no bound; ``skipdecode serve``
    defaults to a share of the machine's memory): requests that would exceed it wait, and one
    that could not fit alone answers 400 naming ``max_tokens`` (:mod:`skipdecode.kv_budget`). The app's
    ``state.scheduler`` is the scheduler (``/health`` reports it, prefix-cache statistics included);
    ``state.metrics`` the app's :class:`~skipdecode.server_metrics.ServerMetrics`, its own
    Prometheus registry, which ``GET /metrics`` serves.
    With ``api_key``, requests to the ``/v1/`` routes must send ``Authorization: Bearer <api_key>``
    (401 otherwise, :class:`_ApiKey`; OpenAI's and vLLM's ``--api-key``); ``/health`` and
    ``/metrics`` stay open.
    ``policy_defaults`` (keys of :data:`~skipdecode.protocol.SHAPE_FIELDS`: ``warmup_layers``,
    ``horizon``, ``full_depth_steps``) fill those fields of a request that sends another policy field
    (e.g. only ``speedup``), so that the server's ``--horizon`` holds for it too.
    A streamed response sends each row's tokens in events of ``stream_interval`` tokens (its first
    token and its last at once; vLLM's and SGLang's ``--stream-interval``; 1, the default: one
    event per token), :class:`~skipdecode.execution.Submission`.
    On a CPU, load ``model`` through :func:`~skipdecode.scheduler.on_fresh_thread` (as ``skipdecode
    serve`` does): a model loaded on the thread that keeps running leaves a second OpenMP team
    beside the scheduler's, and every decode step pays for it (stop 37: 16-row steps 79-83 against
    61-64 ms on 2 cores).

    Every error answers OpenAI's body ``{"error": {"message", "type", "param", "code": null}}``:
    bad request values (a bad policy, an empty prompt, a prompt longer than the context, a schema
    error, broken JSON, ``stream_options`` without ``stream``) answer HTTP 400 with ``param`` the
    field and a message naming it; a ``model`` other than ``model_name`` answers 404; an
    unexpected exception answers 500 (type ``server_error``).

    Raises:
        ValueError: ``max_batch_size`` < 1, ``max_waiting`` < 0, ``cohort_size`` outside
            [1, ``max_batch_size``], ``align_steps`` < 0, ``prefill_chunk_tokens`` < 0, a bad
            ``max_cache_bytes`` or ``prefix_cache`` (:class:`~skipdecode.scheduler.Scheduler`); ``stream_interval`` not an integer >= 1;
            ``api_key`` as :func:`check_api_key` refuses it; a ``policy_defaults`` key outside
            :data:`~skipdecode.protocol.SHAPE_FIELDS`; ``model_name`` empty or blank (no
            request could name it).
    """
    if not isinstance(model_name, str) or not model_name.strip():
        raise ValueError(f"model_name must be a non-empty string (requests name it in 'model'), got {model_name!r}")
    if api_key is not None:
        api_key = check_api_key(api_key)
    if isinstance(stream_interval, bool) or not isinstance(stream_interval, int) or stream_interval < 1:
        raise ValueError(f"stream_interval must be an integer >= 1 (tokens per streamed event), got {stream_interval!r}")
    policy_defaults = dict(policy_defaults or {})
    unknown = sorted(set(policy_defaults) - set(SHAPE_FIELDS))
    if unknown:
        raise ValueError(f"policy_defaults keys must be among {', '.join(SHAPE_FIELDS)}, got {unknown[0]!r}")
    app = FastAPI(title="skipdecode", description="OpenAI-compatible SkipDecode server",
                  default_response_class=StrictJSONResponse)
    scheduler = Scheduler(model.adapter, 1 if serial else max_batch_size, max_waiting,
                          cohort_size=1 if serial else cohort_size, prefix_cache=prefix_cache,
                          align_steps=0 if serial else align_steps,
                          prefill_chunk_tokens=0 if serial else prefill_chunk_tokens,
                          max_cache_bytes=max_cache_bytes)
    executor = Executor(model, scheduler, stream_interval)
    app.state.scheduler = scheduler
    app.state.metrics = ServerMetrics(scheduler, model.num_layers)
    app.add_middleware(_BodyLimit, max_request_bytes=max_request_bytes)
    if api_key is not None:  # added last: it runs first, so a request without the key is never read
        app.add_middleware(_ApiKey, api_key=api_key)
    _add_error_handlers(app)
    _Routes(model, model_name, scheduler, executor, app.state.metrics, policy_defaults).register(app)
    return app

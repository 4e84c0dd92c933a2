"""OpenAI-compatible HTTP server over the SkipDecode engine (FastAPI + uvicorn).

Endpoints: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions`` (both with
``stream: true`` as server-sent events), ``GET /health``. Besides the OpenAI fields, a request may
carry the SkipDecode fields ``speedup`` or ``max_layers``/``min_layers``/``warmup_layers``/``horizon``;
the response's ``usage`` carries the generation statistics (``skipdecode`` key). A completions
request with a list of prompts runs as one left-padded batch. Requests are served one batch at a
time (a lock around the engine). ``GET /v1/models/{model}`` retrieves the served model.

Streaming: with ``"stream_options": {"include_usage": true}`` (only allowed with ``stream: true``)
one last chunk before ``data: [DONE]`` has ``choices: []`` and the ``usage`` of the non-streamed
response (token counts and the ``skipdecode`` statistics); every other chunk then has
``"usage": null``.

Requests are parsed and checked in full by :mod:`skipdecode.protocol` (OpenAI's fields with their
meaning, unsupported features refused by name, prompts encoded by the one path the library and the
CLI use) before anything reaches the engine; docs/openai-api.md lists what is accepted.

Errors use OpenAI's body ``{"error": {"message", "type", "param", "code": null}}``: HTTP 400 with
type ``invalid_request_error`` for a bad request (schema errors and broken JSON included, not
FastAPI's 422), ``param`` the offending field (null when no field is to blame) and a message that
names it; 404 for an unknown model or route; 500 with type ``server_error`` for a server fault.
"""

from __future__ import annotations

import re
import threading
import time
import uuid
from typing import Any, Iterator, Mapping, Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .generate import GenerationResult, stream_generate
from .jsonio import dumps, json_safe
from .model import SkipModel
from .protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    StreamOptions,
    ValidRequest,
    default_kind,
    error_body,
    unknown_model,
    validate_request,
    validation_message,
)

__all__ = ["create_app", "APIError", "CompletionRequest", "ChatCompletionRequest", "StreamOptions"]


def _error_response(status: int, message: str, param: Optional[str] = None, kind: Optional[str] = None,
                    headers: Optional[Mapping[str, str]] = None) -> JSONResponse:
    kind = kind or default_kind(status)
    return StrictJSONResponse(error_body(message, kind, param), status_code=status, headers=dict(headers or {}))


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


def create_app(model: SkipModel, model_name: str = "skipdecode") -> FastAPI:
    """Build the FastAPI app serving ``model`` under the name ``model_name``.

    Every error answers OpenAI's body ``{"error": {"message", "type", "param", "code": null}}``:
    bad request values (a bad policy, an empty prompt, a prompt longer than the context, a schema
    error, broken JSON, ``stream_options`` without ``stream``) answer HTTP 400 with ``param`` the
    field and a message naming it; a ``model`` other than ``model_name`` answers 404; an
    unexpected exception answers 500 (type ``server_error``).
    """
    app = FastAPI(title="skipdecode", description="OpenAI-compatible SkipDecode server",
                  default_response_class=StrictJSONResponse)
    lock = threading.Lock()

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = validation_message(exc.errors())
        return _error_response(400, message, param)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else dumps(exc.detail)
        return _error_response(exc.status_code, message, getattr(exc, "param", None), getattr(exc, "kind", None),
                               headers=exc.headers)

    @app.exception_handler(Exception)
    async def on_server_error(request: Request, exc: Exception) -> JSONResponse:
        # Starlette still re-raises exc after this answer, so the server logs the traceback.
        return _error_response(500, f"the server had an error while processing the request ({type(exc).__name__})")

    def engine_param(message: str, kind: str) -> Optional[str]:
        """The request field an engine ValueError ``message`` blames (``kind``: "chat" or "text")."""
        prompt_field = "messages" if kind == "chat" else "prompt"
        return _param_in(message, {"max_new_tokens": "max_tokens", "prompts": prompt_field, "stop": "stop"})

    def run(job: ValidRequest):
        sampling = job.sampling
        with lock:
            try:
                return model.generate(
                    job.prompts, max_new_tokens=job.max_new_tokens, policy=job.policy, temperature=sampling.temperature,
                    top_k=sampling.top_k, top_p=sampling.top_p, seed=sampling.seed, stop=job.stop, chat=False,
                )
            except ValueError as e:
                raise APIError(400, str(e), param=engine_param(str(e), job.kind)) from None

    def usage(result) -> dict[str, Any]:
        """OpenAI ``usage`` (tokens) plus ``skipdecode``: the run's statistics (NaN as null)."""
        stats = json_safe(result.stats())
        return {
            "prompt_tokens": stats["prompt_tokens"],
            "completion_tokens": stats["new_tokens"],
            "total_tokens": stats["prompt_tokens"] + stats["new_tokens"],
            "skipdecode": stats,
        }

    def stream(job: ValidRequest) -> Iterator[str]:
        """Server-sent events of one request: text deltas, each row's finish reason, with
        ``stream_options.include_usage`` a last chunk holding ``usage``, then ``data: [DONE]``."""
        prompts, policy, kind, include_usage = job.prompts, job.policy, job.kind, job.include_usage
        rid = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        created = int(time.time())
        with lock:
            record: dict = {}  # filled by stream_generate when it ends: the run's statistics
            chunks = stream_generate(
                model.adapter, model.tokenizer, prompts, policy=policy, sampling=job.sampling,
                max_new_tokens=job.max_new_tokens, stop=job.stop, chat=False, _record=record,
            )
            obj = "chat.completion.chunk" if kind == "chat" else "text_completion"

            def sse(choices: list[dict[str, Any]], use: Optional[dict[str, Any]] = None) -> str:
                body = {"id": rid, "object": obj, "created": created, "model": model_name, "choices": choices}
                if include_usage:
                    body["usage"] = use  # OpenAI: null on every chunk but the last
                return "data: " + dumps(body) + "\n\n"

            def event(i: int, text: str | None = None, finish: str | None = None, role: bool = False) -> str:
                if kind == "chat":
                    delta = {"role": "assistant"} if role else ({"content": text} if text else {})
                    choice = {"index": i, "delta": delta, "finish_reason": finish}
                else:
                    choice = {"index": i, "text": text or "", "finish_reason": finish}
                return sse([choice])

            if kind == "chat":
                for i in range(len(prompts)):
                    yield event(i, role=True)
            ended: set[int] = set()
            try:
                for chunk in chunks:
                    for i, delta in enumerate(chunk.deltas):
                        if delta:
                            yield event(i, delta)
                        if chunk.finished[i] and i not in ended:  # EOS or a stop string
                            ended.add(i)
                            yield event(i, finish="stop")
                for i in range(len(prompts)):
                    if i not in ended:
                        yield event(i, finish="length")
                if include_usage:
                    yield sse([], usage(GenerationResult.from_record(record, model.num_layers, policy)))
            except ValueError as e:  # headers are sent: the error travels as an event
                err = error_body(str(e), "invalid_request_error", engine_param(str(e), kind))
                yield "data: " + dumps(err) + "\n\n"
        yield "data: [DONE]\n\n"

    def reason(r: str) -> str:
        return "length" if r == "length" else "stop"

    @app.get("/health")
    def health() -> dict[str, Any]:
        return {"status": "ok", "num_layers": model.num_layers, "policy": model.policy.to_dict()}

    @app.get("/v1/models")
    def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    def model_card() -> dict[str, Any]:
        return {"id": model_name, "object": "model", "owned_by": "skipdecode"}

    @app.get("/v1/models/{model_id}")
    def retrieve_model(model_id: str) -> dict[str, Any]:
        if model_id != model_name:
            raise unknown_model(model_id, model_name)
        return model_card()

    @app.post("/v1/completions")
    def completions(req: CompletionRequest):
        job = validate_request(req, model, model_name)  # every check before the engine (and the stream)
        if job.stream:
            return StreamingResponse(stream(job), media_type="text/event-stream")
        result = run(job)
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
    def chat_completions(req: ChatCompletionRequest):
        job = validate_request(req, model, model_name)
        if job.stream:
            return StreamingResponse(stream(job), media_type="text/event-stream")
        result = run(job)
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

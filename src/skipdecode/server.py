"""OpenAI-compatible HTTP server over the SkipDecode engine (FastAPI + uvicorn).

Endpoints: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions`` (both with
``stream: true`` as server-sent events), ``GET /health``. Besides the OpenAI fields, a request may
carry the SkipDecode fields ``speedup`` or ``max_layers``/``min_layers``/``warmup_layers``/``horizon``;
the response's ``usage`` carries the generation statistics (``skipdecode`` key). A completions
request with a list of prompts runs as one left-padded batch. Requests are served one batch at a
time (a lock around the engine).
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from typing import Any, Iterator, List, Literal, Optional, Union

from fastapi import FastAPI, HTTPException
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, Field

from .model import SkipModel
from .sampling import SamplingParams

__all__ = ["create_app", "CompletionRequest", "ChatCompletionRequest"]


class SkipFields(BaseModel):
    """SkipDecode extensions accepted by both endpoints (None: the server model's policy)."""

    speedup: Optional[float] = Field(None, description="Target speedup (>= 1).")
    max_layers: Optional[int] = None
    min_layers: Optional[int] = None
    warmup_layers: Optional[int] = None
    horizon: Optional[int] = None


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


def _stops(stop: Optional[Union[str, List[str]]]) -> list[str]:
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else list(stop)


def create_app(model: SkipModel, model_name: str = "skipdecode") -> FastAPI:
    """Build the FastAPI app serving ``model`` under the name ``model_name``.

    Bad request values (a bad policy, an empty prompt, a prompt longer than the context) answer
    HTTP 400 with a message naming the field; schema errors answer 422 (FastAPI).
    """
    app = FastAPI(title="skipdecode", description="OpenAI-compatible SkipDecode server")
    lock = threading.Lock()

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
            raise HTTPException(status_code=400, detail=str(e)) from None

    def sampling_of(req: CommonFields) -> SamplingParams:
        try:
            return SamplingParams(temperature=req.temperature, top_k=req.top_k, top_p=req.top_p, seed=req.seed)
        except ValueError as e:
            raise HTTPException(status_code=400, detail=str(e)) from None

    def chat_prompt(messages: List[ChatMessage]) -> str:
        tok = model.tokenizer
        if not getattr(tok, "chat_template", None):
            raise HTTPException(status_code=400, detail="messages: this model has no chat template; use /v1/completions")
        return tok.apply_chat_template([m.model_dump() for m in messages], add_generation_prompt=True, tokenize=False)

    def run(prompts: list[str], req: CommonFields):
        policy, sampling = policy_of(req), sampling_of(req)
        with lock:
            try:
                return model.generate(
                    prompts, max_new_tokens=req.max_tokens, policy=policy, temperature=sampling.temperature,
                    top_k=sampling.top_k, top_p=sampling.top_p, seed=sampling.seed, stop=_stops(req.stop), chat=False,
                )
            except ValueError as e:
                raise HTTPException(status_code=400, detail=str(e)) from None

    def usage(result) -> dict[str, Any]:
        stats = result.stats()
        return {
            "prompt_tokens": stats["prompt_tokens"],
            "completion_tokens": stats["new_tokens"],
            "total_tokens": stats["prompt_tokens"] + stats["new_tokens"],
            "skipdecode": stats,
        }

    def stream(prompts: list[str], req: CommonFields, kind: str) -> Iterator[str]:
        policy, sampling = policy_of(req), sampling_of(req)
        rid = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        created = int(time.time())
        with lock:
            chunks = model.stream_generate(
                prompts, max_new_tokens=req.max_tokens, policy=policy, temperature=sampling.temperature,
                top_k=sampling.top_k, top_p=sampling.top_p, seed=sampling.seed, stop=_stops(req.stop), chat=False,
            )
            obj = "chat.completion.chunk" if kind == "chat" else "text_completion"

            def event(i: int, text: str | None = None, finish: str | None = None, role: bool = False) -> str:
                if kind == "chat":
                    delta = {"role": "assistant"} if role else ({"content": text} if text else {})
                    choice = {"index": i, "delta": delta, "finish_reason": finish}
                else:
                    choice = {"index": i, "text": text or "", "finish_reason": finish}
                body = {"id": rid, "object": obj, "created": created, "model": model_name, "choices": [choice]}
                return "data: " + json.dumps(body) + "\n\n"

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
            except ValueError as e:
                yield "data: " + json.dumps({"error": {"message": str(e), "type": "invalid_request_error"}}) + "\n\n"
        yield "data: [DONE]\n\n"

    def reason(r: str) -> str:
        return "length" if r == "length" else "stop"

    @app.get("/health")
    def health() -> dict[str, Any]:
        return {"status": "ok", "num_layers": model.num_layers, "policy": model.policy.to_dict()}

    @app.get("/v1/models")
    def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "owned_by": "skipdecode"}]}

    @app.post("/v1/completions")
    def completions(req: CompletionRequest):
        prompts = [req.prompt] if isinstance(req.prompt, str) else list(req.prompt)
        if not prompts:
            raise HTTPException(status_code=400, detail="prompt: must hold at least one string")
        if req.stream:
            policy_of(req), sampling_of(req)  # validate before the stream starts
            return StreamingResponse(stream(prompts, req, "text"), media_type="text/event-stream")
        result = run(prompts, req)
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
        prompt = chat_prompt(req.messages)
        if req.stream:
            policy_of(req), sampling_of(req)
            return StreamingResponse(stream([prompt], req, "chat"), media_type="text/event-stream")
        result = run([prompt], req)
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

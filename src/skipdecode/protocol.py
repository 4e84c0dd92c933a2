"""OpenAI request bodies of the server and their validation, before anything reaches the engine.

The request models follow OpenAI's API reference as the official ``openai`` package types it
(``openai.types.CompletionCreateParams``, ``openai.types.chat.CompletionCreateParams``); a test
checks that every field of those types is handled here. Each field of a request is one of:

- **supported**, with OpenAI's meaning: ``model``, ``prompt`` (a string, a list of strings, a
  list of token ids or a list of token-id lists), ``messages`` (roles ``system``, ``developer``,
  ``user``, ``assistant``; content a string or a list of text parts), ``max_tokens``,
  ``max_completion_tokens`` (chat), ``temperature`` (0..2), ``top_p``, ``seed`` (int64), ``stop``
  (a string or up to 4 non-empty strings), ``frequency_penalty`` and ``presence_penalty`` (-2..2),
  ``stream``, ``stream_options.include_usage``, ``n`` (1..128 choices per prompt), ``logprobs``
  (completions: 0..20 alternatives; chat: true/false, with ``top_logprobs`` 0..20;
  :mod:`skipdecode.logprobs`);
- **ours** (SkipDecode extensions): ``speedup``, ``max_layers``, ``min_layers``,
  ``warmup_layers``, ``horizon``, ``full_depth_steps``, ``top_k``, ``repetition_penalty`` (0.01..100,
  Hugging Face's and vLLM's), and ``ignore_eos`` (vLLM's
  extension of the same name: EOS does not end a row, so it runs to ``max_tokens`` or a stop
  string; load tests use it to give every request the same number of new tokens);
- **ignored**, because it cannot change the answer: ``user``, ``metadata``,
  ``safety_identifier``, the prompt-cache hints, ``parallel_tool_calls`` (no tools here);
- **unsupported**: accepted only with a value that does not ask for the feature (null, or its
  neutral value such as ``logit_bias: {}`` or ``echo: false``); any other value
  answers HTTP 400 naming the field (``echo``, ``best_of``, ``tools``,
  ``response_format``, ``logit_bias``, ...), never a silent default.

A field that is none of these answers 400 naming it, as OpenAI does ("Unrecognized request
argument"). :func:`validate_request` turns a parsed request into a :class:`ValidRequest`: the
prompts encoded to token ids by :func:`skipdecode.prompts.encode_prompt` (the path the library and
the CLI use), the policy, the sampling settings and the token budget, every error an
:class:`APIError` whose ``param`` names the field. docs/openai-api.md lists all of it.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, List, Mapping, Optional, Sequence, Union

from fastapi import HTTPException
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr

from .limits import MAX_STOP_STRINGS, SEED_MAX, SEED_MIN, check_stop
from .logprobs import MAX_LOGPROBS
from .policy import SkipPolicy
from .prompts import encode_prompt
from .sampling import PENALTY_RANGE, REPETITION_PENALTY_RANGE, SamplingParams

__all__ = [
    "APIError",
    "ChatCompletionRequest",
    "ChatMessage",
    "CompletionRequest",
    "ContentPart",
    "DEFAULT_MAX_TOKENS",
    "IGNORED_FIELDS",
    "MAX_STOP_STRINGS",
    "SEED_MAX",
    "SEED_MIN",
    "StreamOptions",
    "UNSUPPORTED_FIELDS",
    "ValidRequest",
    "conversation",
    "error_body",
    "unknown_model",
    "validate_request",
]

#: ``max_tokens`` when a request gives none (tokens); lowered to what the context leaves.
DEFAULT_MAX_TOKENS = 64
# SEED_MIN, SEED_MAX (OpenAI's int64 ``seed``) and the stop-string rule come from
# skipdecode.limits, the one source that the Python API and the CLI use too.


# --------------------------------------------------------------------------------------- errors
class APIError(HTTPException):
    """An HTTP error answered in OpenAI's shape; ``param`` names the request field to blame.

    ``kind`` is OpenAI's error ``type``; by default ``server_error`` for status >= 500, else
    ``invalid_request_error``. ``code``: OpenAI's error ``code`` (e.g. ``model_not_found``; None: null).
    """

    def __init__(self, status_code: int, message: str, param: Optional[str] = None, kind: Optional[str] = None,
                 headers: Optional[Mapping[str, str]] = None, code: Optional[str] = None):
        super().__init__(status_code=status_code, detail=message, headers=dict(headers) if headers else None)
        self.param = param
        self.kind = kind or default_kind(status_code)
        self.code = code


def default_kind(status: int) -> str:
    """OpenAI's error ``type`` for an HTTP status: ``server_error`` from 500, else ``invalid_request_error``."""
    return "server_error" if status >= 500 else "invalid_request_error"


def error_body(message: str, kind: str, param: Optional[str] = None, code: Optional[str] = None) -> dict[str, Any]:
    """OpenAI's error object: ``{"error": {"message", "type", "param", "code"}}`` (``code``: e.g.
    ``"invalid_api_key"``; null for most errors)."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def unknown_model(name: str, served: str) -> APIError:
    """The 404 for a ``model`` other than the ``served`` one (param ``model``)."""
    return APIError(404, f"model: the model {name!r} does not exist; this server serves {served!r}", param="model",
                    code="model_not_found")


def bad(param: str, problem: str) -> APIError:
    """A 400 ``invalid_request_error`` whose message is ``"<param>: <problem>"``."""
    return APIError(400, f"{param}: {problem}", param=param)


#: Most completions per prompt (``n``), OpenAI's limit.
MAX_CHOICES = 128


# ------------------------------------------------------------------------------- field tables
#: Fields accepted and ignored, per place, because they cannot change the answer (identifiers,
#: cache hints, tool-call settings without tools).
IGNORED_FIELDS: dict[str, frozenset[str]] = {
    "completion": frozenset({"user"}),
    "chat": frozenset({"user", "metadata", "safety_identifier", "prompt_cache_key", "prompt_cache_retention",
                       "prompt_cache_options", "parallel_tool_calls"}),
    "message": frozenset(),
    "stream_options": frozenset(),
    "part": frozenset({"prompt_cache_breakpoint"}),
}

#: OpenAI fields this server does not implement, per place, with the values that do not ask for
#: the feature (accepted); any other value answers 400 naming the field.
UNSUPPORTED_FIELDS: dict[str, dict[str, tuple]] = {
    "completion": {
        "logit_bias": (None, {}), "best_of": (None, 1), "echo": (None, False), "suffix": (None, ""),
    },
    "chat": {
        "logit_bias": (None, {}), "audio": (None,),
        "modalities": (None, ["text"]), "tools": (None, []), "tool_choice": (None, "none", "auto"),
        "functions": (None, []), "function_call": (None, "none", "auto"), "response_format": (None, {"type": "text"}),
        "prediction": (None,), "reasoning_effort": (None, "none"), "verbosity": (None,),
        "web_search_options": (None,), "moderation": (None,), "store": (None, False),
        "service_tier": (None, "auto", "default"),
    },
    "message": {"tool_calls": (None, []), "function_call": (None,), "audio": (None,), "refusal": (None,)},
    "stream_options": {"include_obfuscation": (None, False)},
    "part": {},
}


def _neutral(value: Any, allowed: tuple) -> bool:
    """True when ``value`` is one of ``allowed`` (bools are not numbers here: ``"echo": 0`` is
    not false and ``"best_of": true`` is not 1; 0 and 0.0 are the same number)."""
    for a in allowed:
        if a is None or value is None:
            if a is value:
                return True
        elif isinstance(value, bool) == isinstance(a, bool) and value == a:
            return True
    return False


def _check_extras(extras: Optional[Mapping[str, Any]], place: str, prefix: str = "") -> None:
    """Raise :class:`APIError` for a field of ``extras`` (the fields no model declares) that is
    unsupported with a value asking for it, or unknown; ``place`` picks the table."""
    table = UNSUPPORTED_FIELDS[place]
    for name, value in (extras or {}).items():
        path = f"{prefix}{name}"
        if name in IGNORED_FIELDS[place]:
            continue
        if name in table:
            if not _neutral(value, table[name]):
                allowed = " or ".join(json.dumps(a) for a in table[name])
                shown = json.dumps(value, default=str)
                shown = shown if len(shown) <= 60 else shown[:57] + "..."
                raise bad(path, f"not supported by this server (got {shown}); omit it or send {allowed} "
                                "(see docs/openai-api.md)")
            continue
        raise bad(path, "unrecognized request argument (neither an OpenAI field of this endpoint nor a "
                        "SkipDecode one; see docs/openai-api.md)")


# ------------------------------------------------------------------------------------ models
class _Body(BaseModel):
    """Base of the request models: fields no model declares are kept for :func:`_check_extras`."""

    model_config = ConfigDict(extra="allow")


class StreamOptions(_Body):
    """OpenAI ``stream_options``: ``include_usage`` adds a last chunk with the request's usage."""

    include_usage: Optional[StrictBool] = False


class SkipFields(_Body):
    """SkipDecode extensions accepted by both endpoints (None: the server model's policy).

    ``speedup`` is a target ratio (>= 1); the others count layers (``max_layers``,
    ``min_layers`` >= 1, ``warmup_layers`` >= 0) and decode steps (``horizon`` >= 1,
    ``full_depth_steps`` >= 0: first steps at full depth, :class:`~skipdecode.policy.LinearDecayPolicy`); bounds that
    depend on the model (<= num_layers, min <= max) are checked by :func:`validate_request`.
    """

    speedup: Optional[StrictFloat] = Field(None, ge=1, allow_inf_nan=False, description="Target speedup (>= 1).")
    max_layers: Optional[StrictInt] = Field(None, ge=1)
    min_layers: Optional[StrictInt] = Field(None, ge=1)
    warmup_layers: Optional[StrictInt] = Field(None, ge=0)
    horizon: Optional[StrictInt] = Field(None, ge=1)
    full_depth_steps: Optional[StrictInt] = Field(None, ge=0)


class CommonFields(SkipFields):
    """OpenAI fields shared by both endpoints, plus ``top_k``, ``repetition_penalty`` and
    ``ignore_eos`` (ours, as vLLM's). None: the default.

    Defaults: ``max_tokens`` :data:`DEFAULT_MAX_TOKENS` (lowered to what the context leaves),
    ``temperature`` 0 (greedy; OpenAI's default is 1), ``top_p`` 1, ``top_k`` 0 (off; -1 too, vLLM's "off"),
    ``ignore_eos`` false (true: generated EOS tokens do not end a row, as vLLM's ``ignore_eos``;
    the row ends at ``max_tokens`` or a stop string, and EOS tokens are left out of its text).
    """

    model: Optional[StrictStr] = None
    max_tokens: Optional[StrictInt] = Field(None, ge=1, description="Most new tokens per prompt.")
    temperature: Optional[StrictFloat] = Field(None, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: Optional[StrictFloat] = Field(None, ge=0.0, le=1.0, allow_inf_nan=False)
    top_k: Optional[StrictInt] = Field(None, ge=-1)  # -1: off, as vLLM's (0 too)
    seed: Optional[StrictInt] = Field(None, ge=SEED_MIN, le=SEED_MAX)
    frequency_penalty: Optional[StrictFloat] = Field(None, ge=PENALTY_RANGE[0], le=PENALTY_RANGE[1],
                                                     allow_inf_nan=False)
    presence_penalty: Optional[StrictFloat] = Field(None, ge=PENALTY_RANGE[0], le=PENALTY_RANGE[1],
                                                    allow_inf_nan=False)
    repetition_penalty: Optional[StrictFloat] = Field(None, ge=REPETITION_PENALTY_RANGE[0], le=REPETITION_PENALTY_RANGE[1],
                                                      allow_inf_nan=False,
                                                      description="Hugging Face's / vLLM's repetition penalty (1: off).")
    stop: Optional[Union[StrictStr, List[StrictStr]]] = None
    stream: Optional[StrictBool] = False
    stream_options: Optional[StreamOptions] = Field(None, description="Only with stream=true.")
    n: Optional[StrictInt] = Field(None, ge=1, le=MAX_CHOICES, description="Completions per prompt.")
    ignore_eos: Optional[StrictBool] = Field(False, description="EOS does not end a row (vLLM's extension).")


class CompletionRequest(CommonFields):
    """``POST /v1/completions`` body: ``prompt`` is a string, a list of strings (one batch row
    each), a list of token ids, or a list of token-id lists; ``logprobs`` n (0 to
    :data:`~skipdecode.logprobs.MAX_LOGPROBS`) returns each token's log-probability and the n most
    likely alternatives (:mod:`skipdecode.logprobs`)."""

    prompt: Union[StrictStr, List[StrictStr], List[StrictInt], List[List[StrictInt]]]
    logprobs: Optional[StrictInt] = Field(None, ge=0, le=MAX_LOGPROBS,
                                          description="Log-probabilities of each token and this many alternatives.")


class ContentPart(_Body):
    """One part of a message's content; only ``{"type": "text", "text": ...}`` is supported."""

    type: StrictStr
    text: Optional[StrictStr] = None


#: the roles a chat message may have here (OpenAI's ``tool`` and ``function`` need tool calling)
CHAT_ROLES = ("system", "developer", "user", "assistant")


class ChatMessage(_Body):
    """One chat turn (OpenAI roles; ``tool`` and ``function`` turns need tool calling, refused)."""

    role: StrictStr
    content: Optional[Union[StrictStr, List[ContentPart]]] = None
    name: Optional[StrictStr] = None


class ChatCompletionRequest(CommonFields):
    """``POST /v1/chat/completions`` body; ``max_completion_tokens`` is OpenAI's current name of
    ``max_tokens`` (give one, or both equal); ``logprobs: true`` returns each token's
    log-probability and ``top_logprobs`` (0 to :data:`~skipdecode.logprobs.MAX_LOGPROBS`, only
    with ``logprobs``) alternatives (:mod:`skipdecode.logprobs`)."""

    messages: List[ChatMessage] = Field(..., min_length=1)
    max_completion_tokens: Optional[StrictInt] = Field(None, ge=1)
    logprobs: Optional[StrictBool] = Field(None, description="Return each token's log-probability.")
    top_logprobs: Optional[StrictInt] = Field(None, ge=0, le=MAX_LOGPROBS,
                                              description="Alternatives per token (needs logprobs).")


# -------------------------------------------------------------------------------- validation
_POLICY_FIELDS = ("speedup", "max_layers", "min_layers", "warmup_layers", "horizon", "full_depth_steps")
_PENALTY_FIELDS = ("repetition_penalty", "frequency_penalty", "presence_penalty")
_SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "seed", *_PENALTY_FIELDS)


@dataclass(frozen=True)
class ValidRequest:
    """A request checked in full by :func:`validate_request`, ready for the engine.

    Attributes:
        kind: ``"text"`` (``/v1/completions``) or ``"chat"`` (``/v1/chat/completions``).
        prompts: token ids of each batch row (B lists of >= 1 ids), encoded by
            :func:`skipdecode.prompts.encode_prompt`; the engine uses them as given.
        policy: the skip policy of the request (the model's when it gives no SkipDecode field).
        sampling: temperature / top-k / top-p / seed.
        max_new_tokens: most new tokens per row (tokens), >= 1; prompt + it - 1 positions fit
            the model's context.
        stop: stop strings.
        stream: answer as server-sent events.
        include_usage: with ``stream``, a last chunk carries ``usage``.
        ignore_eos: generated EOS tokens do not end a row (it ends at ``max_new_tokens`` or a
            stop string).
        logprobs: None for no log-probabilities, else the alternatives per token (0..20).
        n: completions per prompt (1..:data:`MAX_CHOICES`): choice ``k * n + j`` is prompt k's
            j-th, sampled with seed ``seed + j`` (:func:`~skipdecode.sampling.choice_sampling`).
    """

    kind: str
    prompts: list[list[int]]
    policy: SkipPolicy
    sampling: SamplingParams
    max_new_tokens: int
    stop: list[str]
    stream: bool
    include_usage: bool
    ignore_eos: bool = False
    logprobs: Optional[int] = None
    n: int = 1


def _first_field(message: str, fields: Sequence[str]) -> Optional[str]:
    """The first word of ``message`` that is one of ``fields`` (the policy's and the sampling
    parameters' own messages start with the field they reject), else None."""
    for word in message.replace(",", " ").replace("(", " ").split():
        if word in fields:
            return word
    return None


def _named(error: ValueError, fields: Sequence[str], fallback: str) -> APIError:
    """A 400 for a ValueError of the policy or sampling code, ``param`` the field it names."""
    message = str(error)
    param = _first_field(message, fields) or fallback
    return APIError(400, message if message.startswith(param) else f"{param}: {message}", param=param)


#: The schedule-shape fields a server may default for requests that choose their own policy
#: (``skipdecode serve --warmup-layers/--horizon/--full-depth-steps``); the budget fields
#: (``speedup``, ``max_layers``, ``min_layers``) are each request's own.
SHAPE_FIELDS = ("warmup_layers", "horizon", "full_depth_steps")


def _policy(req: CommonFields, model: Any, defaults: Mapping[str, int]) -> SkipPolicy:
    fields = {k: getattr(req, k) for k in _POLICY_FIELDS}
    given = [k for k, v in fields.items() if v is not None]
    if not given:
        return model.policy
    filled = {k: v for k, v in defaults.items() if fields[k] is None}
    fields.update(filled)
    try:
        return model.policy_for(**fields)
    except ValueError as e:
        error = _named(e, _POLICY_FIELDS, given[0])
        for k, v in filled.items():  # a value the client did not send: say where it came from
            if re.search(rf"\b{k}\b", error.detail):
                option = "--" + k.replace("_", "-")
                error = APIError(400, f"{error.detail} ({k} {v} is the server's {option}; send {k} to override)",
                                 param=error.param)
                break
        raise error from None


def _sampling(req: CommonFields) -> SamplingParams:
    temperature = 0.0 if req.temperature is None else req.temperature
    top_p = 1.0 if req.top_p is None else req.top_p  # 0: greedy (SamplingParams.greedy)
    try:
        penalties = {k: getattr(req, k) for k in _PENALTY_FIELDS if getattr(req, k) is not None}
        top_k = max(req.top_k or 0, 0)  # -1 (vLLM's "off") and 0 are off
        return SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=req.seed, **penalties)
    except ValueError as e:
        raise _named(e, _SAMPLING_FIELDS, "temperature") from None


def _encode(tokenizer: Any, prompt: Any, *, chat: bool, where: str, param: str | None) -> list[int]:
    """``encode_prompt``; a ValueError becomes a 400 whose ``param`` is ``param``, or (None) the
    path the message starts with (``prompt[0]`` for a bad id of a token-id prompt)."""
    try:
        return encode_prompt(tokenizer, prompt, chat=chat, where=where)
    except ValueError as e:
        text = str(e)
        at = param if param is not None else (text.split(" ", 1)[0] if text.startswith(where) else where)
        raise APIError(400, text, param=at) from None


def _text_prompts(req: CompletionRequest, tokenizer: Any) -> list[list[int]]:
    """Token ids of each row of ``prompt``: one string, strings, token ids, token-id lists."""
    prompt = req.prompt
    if isinstance(prompt, str) or (prompt and all(isinstance(t, int) for t in prompt)):
        return [_encode(tokenizer, prompt, chat=False, where="prompt", param=None)]
    if not prompt:
        raise bad("prompt", "must hold at least one prompt (a string, strings, token ids or token-id lists)")
    for i, p in enumerate(prompt):
        if isinstance(p, list) and not p:  # (the library's message would offer chat messages too)
            raise bad(f"prompt[{i}]", "must be a non-empty string or a non-empty list of token ids, got []")
    return [_encode(tokenizer, p, chat=False, where=f"prompt[{i}]", param=None) for i, p in enumerate(prompt)]


def _message_text(msg: ChatMessage, where: str) -> str:
    """The text of one message: its string content, or its text parts joined by newlines."""
    if msg.content is None:
        raise bad(f"{where}.content", "required for this server (a string or a list of text parts)")
    if isinstance(msg.content, str):
        return msg.content
    texts = []
    for j, part in enumerate(msg.content):
        at = f"{where}.content[{j}]"
        if part.type != "text":
            raise bad(f"{at}.type", f"{part.type!r} content parts are not supported by this server; only 'text' parts")
        if part.text is None:
            raise bad(f"{at}.text", "required in a text part")
        _check_extras(part.model_extra, "part", f"{at}.")
        texts.append(part.text)
    return "\n".join(texts)


def conversation(messages: Sequence[ChatMessage], tokenizer: Any) -> list[dict[str, str]]:
    """OpenAI ``messages`` as the chat template's conversation (``role``, ``content``, ``name``).

    ``developer`` turns become ``system`` turns unless the template names the developer role
    (OpenAI: developer messages are the system instructions of newer models); a list of text
    parts becomes one string, parts joined by newlines.

    Raises:
        APIError: 400 naming the message field: a ``tool``/``function`` turn, tool calls, audio
            or a refusal in an assistant turn, a missing content, a part other than text.
    """
    template = str(getattr(tokenizer, "chat_template", "") or "")
    turns = []
    for i, msg in enumerate(messages):
        where = f"messages[{i}]"
        if msg.role in ("tool", "function"):
            raise bad(f"{where}.role", f"{msg.role!r} messages carry tool results; this server does not support "
                                       "tool calling")
        if msg.role not in CHAT_ROLES:
            raise bad(f"{where}.role", f"must be 'system', 'developer', 'user' or 'assistant', got {msg.role!r}")
        _check_extras(msg.model_extra, "message", f"{where}.")
        role = "system" if msg.role == "developer" and "developer" not in template else msg.role
        turn = {"role": role, "content": _message_text(msg, where)}
        if msg.name is not None:
            turn["name"] = msg.name
        turns.append(turn)
    return turns


def _chat_prompt(req: ChatCompletionRequest, tokenizer: Any) -> list[list[int]]:
    turns = conversation(req.messages, tokenizer)
    if not getattr(tokenizer, "chat_template", None):
        raise bad("messages", "this model has no chat template; use /v1/completions")
    return [_encode(tokenizer, turns, chat=True, where="messages", param="messages")]


def _max_new_tokens(req: CommonFields, prompts: list[list[int]], context: Optional[int]) -> int:
    """The token budget: ``max_completion_tokens`` / ``max_tokens``, else :data:`DEFAULT_MAX_TOKENS`
    lowered to what the context leaves. The last generated token is never fed back, so a prompt
    of P tokens and n new tokens need P + n - 1 positions (issue 13 item 6)."""
    chat = isinstance(req, ChatCompletionRequest)
    given, field = req.max_tokens, "max_tokens"
    if chat and req.max_completion_tokens is not None:
        if given is not None and given != req.max_completion_tokens:
            raise bad("max_tokens", f"give max_completion_tokens or max_tokens, not both with different values "
                                    f"({req.max_completion_tokens} and {given})")
        given, field = req.max_completion_tokens, "max_completion_tokens"
    if context is None:
        return DEFAULT_MAX_TOKENS if given is None else given
    longest = max(len(ids) for ids in prompts)
    if longest > context:
        prompt_field = "messages" if chat else "prompt"
        raise bad(prompt_field, f"{longest} prompt tokens exceed the model's context of {context} positions; "
                                "shorten the prompt")
    room = context - longest + 1
    if given is None:
        return min(DEFAULT_MAX_TOKENS, room)
    if given > room:
        raise bad(field, f"{longest} prompt tokens + {given} new tokens need {longest + given - 1} positions, "
                         f"more than the model's context of {context}; {field} can be at most {room} for this "
                         "prompt")
    return given


def _logprobs(req: Union[CompletionRequest, ChatCompletionRequest]) -> Optional[int]:
    """The alternatives per token a request asks for (None: no log-probabilities). Chat's
    ``top_logprobs`` above 0 needs ``logprobs: true`` (OpenAI answers 400 too)."""
    if isinstance(req, CompletionRequest):
        return req.logprobs
    if req.top_logprobs and not req.logprobs:
        raise bad("top_logprobs", "needs logprobs set to true")
    return (req.top_logprobs or 0) if req.logprobs else None


def validate_request(req: Union[CompletionRequest, ChatCompletionRequest], model: Any, model_name: str,
                     policy_defaults: Optional[Mapping[str, int]] = None) -> ValidRequest:
    """Check a parsed request in full and encode its prompts; nothing reaches the engine before.

    Args:
        req: the parsed body (schema checks already done by pydantic).
        model: the served :class:`~skipdecode.model.SkipModel`.
        model_name: the name the server answers to.
        policy_defaults: values of :data:`SHAPE_FIELDS` for a request that sends a policy field
            but not these (``skipdecode serve --horizon`` etc.); a request that sends none runs
            ``model.policy``, the server's default policy, which already holds them.

    Returns:
        A :class:`ValidRequest`.

    Raises:
        APIError: 404 for a ``model`` other than ``model_name``; 400 with ``param`` the field for
            an unsupported or unknown field, ``n`` outside 1..128, ``stream_options`` without ``stream``,
            ``top_logprobs`` without ``logprobs``, a
            bad policy (values out of range for this model), bad sampling settings, more than
            :data:`~skipdecode.limits.MAX_STOP_STRINGS` or empty ``stop`` strings
            (:func:`~skipdecode.limits.check_stop`), a prompt that cannot be encoded, or a prompt
            and token budget that do not fit the context.
    """
    chat = isinstance(req, ChatCompletionRequest)
    _check_extras(req.model_extra, "chat" if chat else "completion")
    if req.stream_options is not None:
        _check_extras(req.stream_options.model_extra, "stream_options", "stream_options.")
    if req.model is not None and req.model != model_name:
        raise unknown_model(req.model, model_name)
    if req.stream_options is not None and not req.stream:
        raise bad("stream_options", "only allowed when stream is true")
    policy, sampling = _policy(req, model, policy_defaults or {}), _sampling(req)
    try:
        stop = check_stop(req.stop, "stop")
    except ValueError as e:
        raise APIError(400, str(e), param="stop") from None
    prompts = _chat_prompt(req, model.tokenizer) if chat else _text_prompts(req, model.tokenizer)
    max_new_tokens = _max_new_tokens(req, prompts, model.adapter.max_positions)
    return ValidRequest(
        kind="chat" if chat else "text", prompts=prompts, policy=policy, sampling=sampling,
        max_new_tokens=max_new_tokens, stop=stop, stream=bool(req.stream),
        include_usage=bool(req.stream and req.stream_options is not None and req.stream_options.include_usage),
        ignore_eos=bool(req.ignore_eos), logprobs=_logprobs(req), n=req.n or 1,
    )

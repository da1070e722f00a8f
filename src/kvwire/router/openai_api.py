"""The OpenAI side of the router, pure: request validation, the chat template, response and error shapes.

kvwire's reference engines speak only ``/v1/completions`` (see the serving API notes): for them chat
requests are rendered into one prompt string with a fixed template, and the engines' completion objects and
chunks are reshaped into ``chat.completion`` / ``chat.completion.chunk`` objects on the way back. Engines
that are full OpenAI servers (``Dialect.openai_server``: vLLM) get chat as chat, the client's messages, so
each applies its model's own chat template; their chat-shaped answers are taken as they are.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import msgspec

from kvwire.errors import KvwireError
from kvwire.router.params import ParamError, chat_logprobs, engine_fields

DEFAULT_MAX_TOKENS = 16


class ApiKind(enum.Enum):
    COMPLETION = "completion"
    CHAT = "chat"


class ErrorType(enum.Enum):
    INVALID_REQUEST = ("invalid_request_error", 400)
    NOT_FOUND = ("not_found_error", 404)
    ENGINE_ERROR = ("engine_error", 502)
    UNAVAILABLE = ("service_unavailable", 503)
    TIMEOUT = ("timeout", 504)
    INTERNAL = ("internal_error", 500)
    # A configuration no retry can cure (engines that disagree, a refused API key): answered with
    # ``x-should-retry: false``, which the openai client obeys (it retries every other 5xx).
    MISCONFIGURED = ("configuration_error", 500)

    @property
    def type_name(self) -> str:
        return self.value[0]

    @property
    def status(self) -> int:
        return self.value[1]


class ApiError(KvwireError):
    """An error answered to the client as OpenAI-style JSON with an HTTP status."""

    def __init__(self, kind: ErrorType, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.param = param

    @property
    def status(self) -> int:
        return self.kind.status

    def headers(self) -> dict[str, str]:
        return {"x-should-retry": "false"} if self.kind is ErrorType.MISCONFIGURED else {}

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.kind.type_name,
                "param": self.param,
                "code": self.kind.status,
            }
        }


@dataclass(frozen=True)
class ParsedRequest:
    kind: ApiKind
    model: str
    prompt: str | list[int]
    max_tokens: int
    stream: bool
    include_usage: bool
    extra: Mapping[str, Any]
    # The engines are full OpenAI servers (``Dialect.openai_server``).
    openai_server: bool = False
    # The client's messages as sent, for such engines' /v1/chat/completions (their own chat template);
    # None: ``prompt`` is sent (for chat, the fixed template's rendering).
    messages: list[Any] | None = None

    def engine_body(self) -> dict[str, Any]:
        """The body both legs start from, completions or chat (the router then sets the leg-specific
        fields)."""
        body: dict[str, Any] = dict(self.extra)
        if self.messages is not None:
            body["messages"] = self.messages
        else:
            body["prompt"] = self.prompt
        body.update(model=self.model, max_tokens=self.max_tokens, stream=self.stream)
        if self.stream and self.openai_server:
            # vLLM sends a stream's usage chunk only when asked: the router always asks, and forwards it
            # to the clients that asked (``stream_chunks``), as kvwire's engines always send it.
            body["stream_options"] = {"include_usage": True}
        return body


def _bad(message: str, param: str | None = None) -> ApiError:
    return ApiError(ErrorType.INVALID_REQUEST, message, param)


def decode_json_object(raw: bytes) -> dict[str, Any]:
    """msgspec rather than ``json``: it refuses a lone surrogate (``json`` took it, and the prompt's
    encode then raised a 500), and deep nesting is a 400, not a 500."""
    try:
        body = msgspec.json.decode(raw)
    except (msgspec.MsgspecError, ValueError, RecursionError) as exc:
        raise _bad(f"request body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise _bad("request body must be a JSON object")
    return body


def _is_token_list(value: object) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def _prompt(body: Mapping[str, Any]) -> str | list[int]:
    prompt = body.get("prompt")
    # OpenAI allows a batch of prompts; the router serves one prompt per request.
    if (
        isinstance(prompt, list)
        and len(prompt) == 1
        and (isinstance(prompt[0], str) or _is_token_list(prompt[0]))
    ):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise _bad("prompt must not be empty", "prompt")
        return prompt
    if _is_token_list(prompt) and prompt:
        if any(t < 0 for t in prompt):
            raise _bad("token ids must be non-negative", "prompt")
        return list(prompt)
    raise _bad("prompt must be a non-empty string or list of token ids (one prompt per request)", "prompt")


def _message_text(message: object, index: int) -> tuple[str, str]:
    if not isinstance(message, dict):
        raise _bad(f"messages[{index}] must be an object", "messages")
    role = message.get("role")
    if role not in ("system", "developer", "user", "assistant", "tool"):
        raise _bad(f"messages[{index}].role {role!r} is not supported", "messages")
    content = message.get("content")
    if content is None:
        content = ""
    if isinstance(content, list):
        parts = []
        for part in content:
            if not (
                isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
            ):
                raise _bad(f"messages[{index}]: only text content parts are supported", "messages")
            parts.append(part["text"])
        content = "".join(parts)
    if not isinstance(content, str):
        raise _bad(f"messages[{index}].content must be a string or text parts", "messages")
    return ("system" if role == "developer" else str(role)), content


def render_chat(messages: object) -> str:
    """The fixed chat template: one ``<|role|>`` header line per message, then the assistant's header."""
    if not isinstance(messages, list) or not messages:
        raise _bad("messages must be a non-empty list", "messages")
    lines = []
    for i, message in enumerate(messages):
        role, text = _message_text(message, i)
        lines.append(f"<|{role}|>\n{text}\n")
    lines.append("<|assistant|>\n")
    return "".join(lines)


def _max_tokens(body: Mapping[str, Any], kind: ApiKind) -> int:
    # Chat's newer name first, as vLLM and OpenAI read them (max_tokens is deprecated there); the error
    # names the one that was read.
    names = ("max_completion_tokens", "max_tokens") if kind is ApiKind.CHAT else ("max_tokens",)
    name = next((n for n in names if body.get(n) is not None), names[-1])
    value = body.get(name)
    if value is None:
        return DEFAULT_MAX_TOKENS
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise _bad(f"{name} must be a positive integer", name)
    return value


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None


def _include_usage(raw: object, stream: bool) -> bool:
    """``stream_options`` as vLLM reads it: an object of booleans, only with ``stream: true``."""
    if raw is None:
        return False
    if not stream:
        raise _bad("stream_options can only be given with stream: true", "stream_options")
    try:
        options = msgspec.convert(raw, StreamOptions)
    except msgspec.ValidationError as exc:
        raise _bad(f"invalid stream_options: {exc}", "stream_options") from None
    if options.continuous_usage_stats:
        # Usage on every chunk: the router forwards D's chunks as they come and D reports usage once.
        raise _bad("stream_options.continuous_usage_stats is not supported", "stream_options")
    return bool(options.include_usage)


def parse_request(
    body: Mapping[str, Any], kind: ApiKind, served_models: frozenset[str], openai_server: bool = False
) -> ParsedRequest:
    """The client's request, checked; ``openai_server``: the engines' ``Dialect.openai_server``."""
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise _bad("model is required", "model")
    if model not in served_models:
        known = ", ".join(sorted(served_models))
        raise ApiError(ErrorType.NOT_FOUND, f"the model {model!r} does not exist (served: {known})", "model")
    n = body.get("n", 1)
    if n not in (1, None):
        raise _bad("only n=1 is supported", "n")
    stream = body.get("stream")
    if stream is None:  # null is "not given", as for every other optional field
        stream = False
    if not isinstance(stream, bool):
        raise _bad("stream must be a boolean", "stream")
    include_usage = _include_usage(body.get("stream_options"), stream)
    native_chat = openai_server and kind is ApiKind.CHAT
    try:
        extra = engine_fields(dict(body), chat=kind is ApiKind.CHAT, native_chat=native_chat)
    except ParamError as exc:
        raise _bad(exc.message, exc.param) from None
    # Rendered for native chat too: it checks the messages, and sizes and hashes the prompt for routing.
    prompt = render_chat(body.get("messages")) if kind is ApiKind.CHAT else _prompt(body)
    return ParsedRequest(
        kind=kind,
        model=model,
        prompt=prompt,
        max_tokens=_max_tokens(body, kind),
        stream=stream,
        include_usage=include_usage,
        extra=extra,
        openai_server=openai_server,
        messages=list(body["messages"]) if native_chat else None,
    )


# -- responses -----------------------------------------------------------------------------------------


def _first_choice(obj: Mapping[str, Any]) -> Mapping[str, Any]:
    choices = obj.get("choices")
    if isinstance(choices, list) and choices and isinstance(choices[0], dict):
        return choices[0]
    return {}


def _is_chat(choice: Mapping[str, Any]) -> bool:
    """Whether an engine's choice is chat-shaped (an OpenAI server's own chat answer) rather than a
    completion's."""
    return "message" in choice or "delta" in choice


def completion_response(
    engine: Mapping[str, Any], req: ParsedRequest, rid: str, created: int
) -> dict[str, Any]:
    """D's completion or chat completion object, as the router's answer (``completion`` or
    ``chat.completion``)."""
    choice = _first_choice(engine)
    usage = engine.get("usage")
    common = {"id": rid, "created": created, "model": req.model, "usage": usage}
    if "timings" in engine:
        common["timings"] = engine["timings"]
    out_choice: dict[str, Any] = {
        "index": 0,
        "finish_reason": choice.get("finish_reason") or "length",
        "logprobs": _logprobs(choice, req),
        "token_ids": choice.get("token_ids"),
    }
    if req.kind is ApiKind.COMPLETION:
        out_choice["text"] = choice.get("text", "")
        return {"object": "text_completion", "choices": [out_choice], **common}
    out_choice["message"] = _message(choice)
    return {"object": "chat.completion", "choices": [out_choice], **common}


def _message(choice: Mapping[str, Any]) -> dict[str, Any]:
    """The assistant's message: a completion's text, or a chat engine's message as it sent it."""
    message = choice.get("message")
    if isinstance(message, dict):
        return {"role": "assistant", "content": "", **message}
    return {"role": "assistant", "content": choice.get("text", "")}


def stream_chunks(
    engine_chunk: Mapping[str, Any], req: ParsedRequest, rid: str, created: int, first: bool
) -> list[dict[str, Any]]:
    """The client chunks for one engine chunk (a chat stream opens with a role-only delta)."""
    choice = _first_choice(engine_chunk)
    usage = engine_chunk.get("usage")
    if not choice and usage is None:
        return []
    common: dict[str, Any] = {"id": rid, "created": created, "model": req.model}
    out: list[dict[str, Any]] = []
    if not choice:
        # A usage-only chunk: forwarded only when the client asked for it, as OpenAI does.
        if req.include_usage:
            out.append({**common, "object": _chunk_object(req), "choices": [], "usage": usage})
        return out
    finish = choice.get("finish_reason")
    if req.kind is ApiKind.COMPLETION:
        piece: dict[str, Any] = {"index": 0, "text": choice.get("text", ""), "finish_reason": finish}
        piece["logprobs"] = _logprobs(choice, req)
        piece["token_ids"] = choice.get("token_ids")
        out.append({**common, "object": "text_completion", "choices": [piece]})
    else:
        out += [
            {**common, "object": "chat.completion.chunk", "choices": [c]}
            for c in _chat_pieces(choice, req, first)
        ]
    if usage is not None and req.include_usage:
        out.append({**common, "object": _chunk_object(req), "choices": [], "usage": usage})
    if "timings" in engine_chunk and out:
        out[-1]["timings"] = engine_chunk["timings"]
    return out


def _chat_pieces(choice: Mapping[str, Any], req: ParsedRequest, first: bool) -> list[dict[str, Any]]:
    """A chat stream's choices for one engine choice: the router's own role-only delta first (a chat
    stream opens with one), then the content delta, if any."""
    pieces: list[dict[str, Any]] = []
    if first:
        pieces.append({"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None})
    delta = _content_delta(choice)
    if delta is not None:
        piece = {"index": 0, "delta": delta, "finish_reason": choice.get("finish_reason")}
        piece["logprobs"] = _logprobs(choice, req)
        piece["token_ids"] = choice.get("token_ids")
        pieces.append(piece)
    return pieces


def _content_delta(choice: Mapping[str, Any]) -> dict[str, Any] | None:
    """The delta of one engine choice without its role; None for a chat engine's role-only opening delta
    (vLLM's first chunk), which would repeat the router's own."""
    delta = choice.get("delta")
    if not isinstance(delta, dict):
        return {"content": choice.get("text", "")}
    rest = {k: v for k, v in delta.items() if k != "role"}
    if any(rest.values()) or choice.get("finish_reason") is not None or choice.get("logprobs"):
        return {"content": "", **rest}
    return None


def _logprobs(choice: Mapping[str, Any], req: ParsedRequest) -> dict[str, Any] | None:
    """The engine's logprobs; a completion's reshaped for chat (a chat engine's are chat's already)."""
    lp = choice.get("logprobs")
    if not isinstance(lp, dict):
        return None
    return lp if req.kind is ApiKind.COMPLETION or _is_chat(choice) else chat_logprobs(lp)


def _chunk_object(req: ParsedRequest) -> str:
    return "text_completion" if req.kind is ApiKind.COMPLETION else "chat.completion.chunk"


def sse(obj: Mapping[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


def models_list(names: list[str], created: int) -> dict[str, Any]:
    data = [{"id": n, "object": "model", "created": created, "owned_by": "kvwire"} for n in names]
    return {"object": "list", "data": data}


def engine_error_kind(status: int, type_name: object = None) -> ErrorType:
    """How the router answers an engine's error: by the engine's error type, else by its status."""
    if type_name == ErrorType.MISCONFIGURED.type_name or status in (401, 403, 404):
        # An engine refusing the router's key (401) or its router token (403), or not serving a model the
        # router serves or a path it posts to (404): the router's configuration, which no retry cures (a
        # missing router token was a retryable 502, a model name the engines do not serve blamed the client).
        return ErrorType.MISCONFIGURED
    if status in (400, 422) or type_name == ErrorType.INVALID_REQUEST.type_name:
        return ErrorType.INVALID_REQUEST
    if status == 503:
        return ErrorType.UNAVAILABLE
    if status == 504:
        return ErrorType.TIMEOUT
    return ErrorType.ENGINE_ERROR

"""Which OpenAI parameters the router accepts, with OpenAI's ranges, as msgspec Structs.

Any other field is refused with a 400 naming it, never ignored. Sampling and output parameters are checked
here (so a bad value is a 400 from the router whatever the engines are) and passed to both legs as given:
each engine honours them or refuses them with a 400 naming them (kvwire's reference engine implements
temperature, top_p, top_k, seed, stop, min_tokens, ignore_eos, logprobs and echo, and refuses penalties,
logit_bias and best_of; vLLM engines honour them all). Fields the router itself reads (model, prompt,
messages, stream, ...) are typed ``Any`` here and checked by ``openai_api`` with their own messages.
"""

from __future__ import annotations

import re
from typing import Annotated, Any

import msgspec

_Meta = msgspec.Meta
MAX_STOPS = 16
MAX_COMPLETION_LOGPROBS = 5  # OpenAI's limit for /v1/completions
MAX_CHAT_TOP_LOGPROBS = 20  # OpenAI's limit for /v1/chat/completions

_Penalty = Annotated[float, _Meta(ge=-2, le=2)]


class _Common(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    model: Any = None
    stream: Any = None
    stream_options: Any = None
    n: Any = None
    max_tokens: Any = None
    # OpenAI's end-user id (for abuse monitoring): vLLM accepts and ignores it, and SDKs send it; so does
    # the router (a 400 for it broke those clients). Not forwarded: kvwire's engines do not take it.
    user: Annotated[str, _Meta(max_length=256)] | None = None
    # -- forwarded to the engines --
    temperature: Annotated[float, _Meta(ge=0, le=2)] | None = None
    top_p: Annotated[float, _Meta(gt=0, le=1)] | None = None
    top_k: Annotated[int, _Meta(ge=-1)] | None = None
    seed: Annotated[int, _Meta(ge=-(2**63), le=2**63 - 1)] | None = None
    stop: str | Annotated[list[str], _Meta(max_length=MAX_STOPS)] | None = None
    min_tokens: Annotated[int, _Meta(ge=0)] | None = None
    ignore_eos: bool | None = None
    presence_penalty: _Penalty | None = None
    frequency_penalty: _Penalty | None = None
    repetition_penalty: Annotated[float, _Meta(gt=0)] | None = None
    logit_bias: dict[str, Annotated[float, _Meta(ge=-100, le=100)]] | None = None


class CompletionParams(_Common, kw_only=True, forbid_unknown_fields=True):
    prompt: Any = None
    logprobs: Annotated[int, _Meta(ge=0, le=MAX_COMPLETION_LOGPROBS)] | None = None
    echo: bool | None = None
    best_of: Annotated[int, _Meta(ge=1)] | None = None


class ChatParams(_Common, kw_only=True, forbid_unknown_fields=True):
    messages: Any = None
    max_completion_tokens: Any = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, _Meta(ge=0, le=MAX_CHAT_TOP_LOGPROBS)] | None = None


_SAMPLING = (
    "temperature", "top_p", "top_k", "seed", "stop", "min_tokens", "ignore_eos",
    "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias",
)  # fmt: skip
_COMPLETION_ONLY = ("logprobs", "echo", "best_of")

_PATH = re.compile(r"at `\$\.(\w+)")
_UNKNOWN = re.compile(r"unknown field `([^`]*)`")


class ParamError(ValueError):
    """A parameter the router refuses: ``param`` names it."""

    def __init__(self, message: str, param: str | None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


def _refusal(msgspec_message: str) -> ParamError:
    unknown = _UNKNOWN.search(msgspec_message)
    if unknown is not None:
        name = unknown.group(1)
        return ParamError(f"unsupported parameter '{name}'", name)
    path = _PATH.search(msgspec_message)
    name = path.group(1) if path is not None else None
    detail = msgspec_message.split(" - at ")[0]
    return ParamError(f"invalid '{name}': {detail}" if name else detail, name)


def engine_fields(body: dict[str, Any], chat: bool, native_chat: bool = False) -> dict[str, Any]:
    """The sampling and output fields of a client's body for the engines (values as the client sent
    them); ``ParamError`` for an unknown field or a value out of range. ``native_chat``: a chat request
    goes to the engines' own /v1/chat/completions, which reads chat's logprobs fields as they are."""
    try:
        params = msgspec.convert(body, ChatParams if chat else CompletionParams)
    except msgspec.ValidationError as exc:
        raise _refusal(str(exc)) from None
    names = _SAMPLING if chat else _SAMPLING + _COMPLETION_ONLY
    out = {k: body[k] for k in names if getattr(params, k) is not None}
    if isinstance(params, ChatParams):
        if params.top_logprobs is not None and not params.logprobs:
            raise ParamError("'top_logprobs' needs 'logprobs': true", "top_logprobs")
        if native_chat:
            out.update({k: body[k] for k in ("logprobs", "top_logprobs") if getattr(params, k) is not None})
        elif params.logprobs:
            # The engines get chat as /v1/completions: its logprobs=k is chat's top_logprobs=k.
            out["logprobs"] = params.top_logprobs or 0
    return out


def _token_bytes(token: str) -> list[int]:
    # A lone byte of a multi-byte character is named "bytes:\xNN" (vLLM's and tiktoken's convention).
    if token.startswith("bytes:"):
        return list(token[len("bytes:") :].encode("latin-1").decode("unicode_escape").encode("latin-1"))
    return list(token.encode("utf-8"))


def chat_logprobs(completion: object) -> dict[str, Any] | None:
    """A completion choice's ``logprobs`` (tokens, token_logprobs, top_logprobs) in chat's shape
    (``content``: one entry per token with its bytes and top alternatives)."""
    if not isinstance(completion, dict):
        return None
    tokens = completion.get("tokens") or []
    values = completion.get("token_logprobs") or []
    tops = completion.get("top_logprobs") or []
    content = []
    for i, token in enumerate(tokens):
        top = tops[i] if i < len(tops) and isinstance(tops[i], dict) else {}
        content.append(
            {
                "token": token,
                "logprob": values[i] if i < len(values) else None,
                "bytes": _token_bytes(str(token)),
                "top_logprobs": [
                    {"token": t, "logprob": v, "bytes": _token_bytes(str(t))} for t, v in top.items()
                ],
            }
        )
    return {"content": content}

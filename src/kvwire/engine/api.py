"""The HTTP body of ``POST /v1/completions`` in and out (OpenAI completions + vLLM's kv_transfer_params).

Sampling is always greedy: ``temperature``, ``top_p`` and other sampling fields are accepted and ignored,
as are unknown fields (the router forwards the client's body as is).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvwire.engine.request import TransferRole
from kvwire.engine.tokenizer import ByteTokenizer
from kvwire.errors import EngineOverloaded, InvalidRequest, KVLoadFailed, TransferAborted

DEFAULT_MAX_TOKENS = 16


@dataclass(frozen=True, slots=True)
class CompletionRequest:
    prompt: list[int]
    max_tokens: int
    stream: bool
    ignore_eos: bool
    model: str | None
    role: TransferRole
    transfer_id: str | None
    kv_transfer_params: Mapping[str, Any]


def _field(body: Mapping[str, Any], name: str, kind: type | tuple[type, ...], default: Any) -> Any:
    value = body.get(name, default)
    if value is None:
        return default
    # bool is an int in Python: refuse it where a number is expected.
    if not isinstance(value, kind) or (isinstance(value, bool) and bool not in _as_tuple(kind)):
        raise InvalidRequest(f"'{name}' must be {_names(kind)}")
    return value


def _as_tuple(kind: type | tuple[type, ...]) -> tuple[type, ...]:
    return kind if isinstance(kind, tuple) else (kind,)


def _names(kind: type | tuple[type, ...]) -> str:
    return " or ".join(k.__name__ for k in _as_tuple(kind))


def parse_completion(body: Any, tokenizer: ByteTokenizer) -> CompletionRequest:
    """Validate a completions body; ``InvalidRequest`` (HTTP 400) says what is wrong."""
    if not isinstance(body, dict):
        raise InvalidRequest("the body must be a JSON object")
    raw = body.get("prompt")
    if isinstance(raw, str):
        prompt = tokenizer.encode(raw)
    elif isinstance(raw, list) and raw and all(isinstance(t, int) and not isinstance(t, bool) for t in raw):
        prompt = list(raw)
    elif isinstance(raw, list) and len(raw) == 1 and isinstance(raw[0], str):
        prompt = tokenizer.encode(raw[0])
    else:
        raise InvalidRequest("'prompt' must be a string or a non-empty list of token ids")
    max_tokens = _field(body, "max_tokens", int, DEFAULT_MAX_TOKENS)
    if max_tokens < 1:
        raise InvalidRequest("'max_tokens' must be at least 1")
    n = _field(body, "n", int, 1)
    if n != 1:
        raise InvalidRequest("only n=1 is supported")
    check_sampling(body)
    params = _field(body, "kv_transfer_params", dict, {})
    role, transfer_id = _transfer(params)
    return CompletionRequest(
        prompt=prompt,
        max_tokens=max_tokens,
        stream=_field(body, "stream", bool, False),
        ignore_eos=_field(body, "ignore_eos", bool, False),
        model=_field(body, "model", str, None),
        role=role,
        transfer_id=transfer_id,
        kv_transfer_params=params,
    )


# Parameters that would change the answer and that the reference engine (greedy decoding) cannot honour:
# refused with a 400 naming them, never silently ignored. Their "no effect" values are accepted.
_UNSUPPORTED: dict[str, Any] = {
    "logprobs": None, "echo": False, "best_of": 1, "presence_penalty": 0, "frequency_penalty": 0,
    "repetition_penalty": 1, "logit_bias": None, "stop": None, "min_tokens": 0,
}  # fmt: skip


def check_sampling(body: Mapping[str, Any]) -> None:
    """OpenAI's ranges for every sampling parameter, and greedy decoding only: a temperature above 0, or a
    parameter of ``_UNSUPPORTED`` set to something that matters, is an ``InvalidRequest`` naming it."""
    temperature = _field(body, "temperature", (int, float), 0.0)
    if not 0 <= temperature <= 2:
        raise InvalidRequest(f"'temperature' must be between 0 and 2, got {temperature}")
    top_p = _field(body, "top_p", (int, float), 1.0)
    if not 0 < top_p <= 1:
        raise InvalidRequest(f"'top_p' must be in (0, 1], got {top_p}")
    top_k = _field(body, "top_k", int, -1)
    if top_k == 0 or top_k < -1:
        raise InvalidRequest(f"'top_k' must be -1 (off) or positive, got {top_k}")
    _field(body, "seed", int, 0)
    if temperature > 0:
        raise InvalidRequest(
            f"the reference engine decodes greedily: 'temperature' must be 0 (got {temperature}); "
            "its weights are random, so sampling would add nothing"
        )
    for name, neutral in _UNSUPPORTED.items():
        value = body.get(name)
        if value is not None and value != neutral and value not in ([], {}, ""):
            raise InvalidRequest(f"'{name}' is not supported by the reference engine (greedy, no logprobs)")


def _transfer(params: Mapping[str, Any]) -> tuple[TransferRole, str | None]:
    decode = params.get("do_remote_decode") is True
    prefill = params.get("do_remote_prefill") is True
    if decode and prefill:
        raise InvalidRequest("kv_transfer_params cannot ask for both do_remote_decode and do_remote_prefill")
    if not (decode or prefill):
        return TransferRole.NONE, None
    tid = params.get("transfer_id")
    if not isinstance(tid, str) or not tid:
        raise InvalidRequest("kv_transfer_params.transfer_id must be a non-empty string")
    if prefill:
        for name, kind in (("remote_engine_id", str), ("remote_host", str), ("remote_port", int)):
            if not isinstance(params.get(name), kind):
                raise InvalidRequest(f"kv_transfer_params.{name} must be {kind.__name__}")
    return (TransferRole.REMOTE_DECODE if decode else TransferRole.REMOTE_PREFILL), tid


def error_status(exc: BaseException) -> tuple[int, str]:
    """HTTP status and OpenAI error type for an exception that ended a request."""
    if isinstance(exc, InvalidRequest):
        return 400, "invalid_request_error"
    if isinstance(exc, KVLoadFailed):
        return 503, "kv_load_failed"
    if isinstance(exc, EngineOverloaded):
        return 503, "overloaded"
    if isinstance(exc, TransferAborted):
        return 503, "aborted"
    return 500, "internal_error"


def error_body(exc: BaseException) -> tuple[int, dict[str, Any]]:
    status, kind = error_status(exc)
    return status, {"error": {"message": str(exc) or type(exc).__name__, "type": kind, "code": status}}


def completion_id() -> str:
    return f"cmpl-{uuid.uuid4().hex}"


def completion_body(
    *,
    cid: str,
    model: str,
    text: str,
    token_ids: list[int],
    finish_reason: str | None,
    prompt_tokens: int,
    kv_transfer_params: Mapping[str, Any] | None,
    timings: Mapping[str, Any] | None,
    created: int | None = None,
    completion_tokens: int | None = None,
) -> dict[str, Any]:
    done = len(token_ids) if completion_tokens is None else completion_tokens
    body: dict[str, Any] = {
        "id": cid,
        "object": "text_completion",
        "created": int(time.time()) if created is None else created,
        "model": model,
        "choices": [
            {
                "index": 0,
                "text": text,
                "token_ids": token_ids,
                "finish_reason": finish_reason,
                "logprobs": None,
            }
        ],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": done,
            "total_tokens": prompt_tokens + done,
        },
        "kv_transfer_params": kv_transfer_params,
    }
    if timings is not None:
        body["timings"] = timings
    return body

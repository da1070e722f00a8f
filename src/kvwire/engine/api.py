"""The HTTP body of ``POST /v1/completions`` in and out (OpenAI completions + vLLM's kv_transfer_params).

The body is decoded into ``CompletionBody``: every field the reference engine knows, with OpenAI's ranges.
An unknown field, a value out of range, or a parameter the engine cannot honour set to anything but its
neutral value is an ``InvalidRequest`` naming it: nothing is silently ignored. Sampling follows
``kvwire.engine.sampling``; ``temperature`` defaults to 0 (greedy), unlike OpenAI's 1, because the reference
model's weights are random and tests compare outputs token for token.
"""

from __future__ import annotations

import re
import secrets
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any

import msgspec

from kvwire.apikey import MAX_BODY_BYTES
from kvwire.engine.request import TransferRole
from kvwire.engine.sampling import GREEDY, SamplingParams, TokenLogprob, token_text
from kvwire.engine.tokenizer import ByteTokenizer, StreamDecoder
from kvwire.errors import (
    EngineOverloaded,
    InvalidRequest,
    KVLoadFailed,
    ModelNotFound,
    RouterOnly,
    TransferAborted,
)
from kvwire.kv_params import FIELD as _KV_PARAMS
from kvwire.kv_params import KvTransferParams

DEFAULT_MAX_TOKENS = 16
MAX_LOGPROBS = 20  # vLLM's default cap; OpenAI's completions allow 5 (the router checks that)
MAX_STOPS = 16


_Penalty = Annotated[float, msgspec.Meta(ge=-2, le=2)]


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None


class CompletionBody(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Every field the engine accepts. ``None`` (JSON null) means "not given", as for OpenAI."""

    prompt: str | list[Any] | None = None
    model: str | None = None
    max_tokens: Annotated[int, msgspec.Meta(ge=1)] | None = None
    min_tokens: Annotated[int, msgspec.Meta(ge=0)] | None = None
    stream: bool | None = None
    # OpenAI's: the last chunk of a stream is always one with usage here; ``include_usage`` adds the
    # usage-only chunk (``choices: []``) OpenAI clients read it from.
    stream_options: StreamOptions | None = None
    n: Annotated[int, msgspec.Meta(ge=1, le=1)] | None = None
    temperature: Annotated[float, msgspec.Meta(ge=0, le=2)] | None = None
    top_p: Annotated[float, msgspec.Meta(gt=0, le=1)] | None = None
    top_k: Annotated[int, msgspec.Meta(ge=-1)] | None = None
    seed: Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)] | None = None
    stop: str | Annotated[list[str], msgspec.Meta(max_length=MAX_STOPS)] | None = None
    logprobs: Annotated[int, msgspec.Meta(ge=0, le=MAX_LOGPROBS)] | None = None
    echo: bool | None = None
    ignore_eos: bool | None = None
    # Typed here, so the body is the one place it is parsed (a malformed value is a 400 naming it).
    kv_transfer_params: KvTransferParams | None = None
    # Known parameters the reference engine cannot honour: accepted only at their neutral value.
    best_of: Annotated[int, msgspec.Meta(ge=1)] | None = None
    presence_penalty: _Penalty | None = None
    frequency_penalty: _Penalty | None = None
    repetition_penalty: Annotated[float, msgspec.Meta(gt=0)] | None = None
    logit_bias: dict[str, float] | None = None
    # What vllm-router (PD mode) adds to every leg, at these values: SGLang's names, neutral here.
    no_stop_trim: bool | None = None
    skip_special_tokens: bool | None = None
    return_hidden_states: bool | None = None


# The neutral value of each parameter the engine cannot honour (an empty logit_bias is neutral too).
_NEUTRAL: dict[str, object] = {
    "best_of": 1, "presence_penalty": 0, "frequency_penalty": 0, "repetition_penalty": 1, "logit_bias": {},
    # The byte tokenizer has no special tokens to skip, and the engine trims nothing off a stop string.
    "no_stop_trim": False, "skip_special_tokens": True, "return_hidden_states": False,
}  # fmt: skip


@dataclass(frozen=True, slots=True)
class CompletionRequest:
    prompt: list[int]
    max_tokens: int
    stream: bool
    ignore_eos: bool
    model: str | None
    role: TransferRole
    transfer_id: str | None
    kv_transfer_params: KvTransferParams | None
    sampling: SamplingParams = GREEDY
    echo: bool = False
    prompt_text: str = ""  # what ``echo`` puts before the completion
    include_usage: bool = False  # stream_options.include_usage: a usage-only chunk ends the stream


_PATH = re.compile(r"at `\$\.(\w+)")
_UNKNOWN = re.compile(r"unknown field `([^`]*)`")


def decode_json(raw: bytes) -> Any:
    """A request body as JSON, or ``InvalidRequest`` (400). msgspec rather than ``json``: it refuses what
    would fail later as a 500 (a 5,000-digit integer, a lone surrogate that no encoder takes), and its
    recursion guard turns deep nesting into an error here instead of deep in a handler."""
    if len(raw) > MAX_BODY_BYTES:
        raise InvalidRequest(f"the body is over the {MAX_BODY_BYTES}-byte limit")
    try:
        return msgspec.json.decode(raw)
    except (msgspec.MsgspecError, RecursionError, ValueError) as exc:
        raise InvalidRequest(f"the body is not valid JSON: {exc}") from None


def _decode(body: Any) -> CompletionBody:
    if not isinstance(body, dict):
        raise InvalidRequest("the body must be a JSON object")
    try:
        return msgspec.convert(body, CompletionBody)
    except msgspec.ValidationError as exc:
        raise _invalid(str(exc)) from None


def _invalid(msgspec_message: str) -> InvalidRequest:
    """msgspec's message as an OpenAI-style one naming the parameter."""
    unknown = _UNKNOWN.search(msgspec_message)
    if unknown is not None:
        name = unknown.group(1)
        return InvalidRequest(f"'{name}' is not a parameter the reference engine supports", name)
    path = _PATH.search(msgspec_message)
    name = path.group(1) if path is not None else None
    detail = msgspec_message.split(" - at ")[0]
    return InvalidRequest(f"invalid '{name}': {detail}" if name else detail, name)


def _prompt(raw: object, tokenizer: ByteTokenizer) -> tuple[list[int], str]:
    if isinstance(raw, list) and len(raw) == 1 and isinstance(raw[0], str):
        raw = raw[0]
    if isinstance(raw, str):
        return tokenizer.encode(raw), raw
    if isinstance(raw, list) and raw and all(isinstance(t, int) and not isinstance(t, bool) for t in raw):
        return list(raw), tokenizer.decode(raw)
    raise InvalidRequest("'prompt' must be a string or a non-empty list of token ids", "prompt")


def _check_neutral(body: CompletionBody) -> None:
    for name, neutral in _NEUTRAL.items():
        value = getattr(body, name)
        if value is not None and value != neutral:
            raise InvalidRequest(f"'{name}' is not supported by the reference engine", name)


def _sampling(body: CompletionBody, tokenizer: ByteTokenizer, max_tokens: int) -> SamplingParams:
    min_tokens = body.min_tokens or 0
    if min_tokens > max_tokens:
        raise InvalidRequest(f"'min_tokens' ({min_tokens}) exceeds max_tokens ({max_tokens})", "min_tokens")
    stops = [body.stop] if isinstance(body.stop, str) else (body.stop or [])
    if any(not s for s in stops):
        raise InvalidRequest("'stop' strings must not be empty", "stop")
    if body.echo and body.logprobs is not None:
        # OpenAI's echo with logprobs scores the prompt too; the engine computes no prompt logprobs.
        raise InvalidRequest("'echo' together with 'logprobs' is not supported", "echo")
    return SamplingParams(
        temperature=body.temperature if body.temperature is not None else 0.0,
        top_p=body.top_p if body.top_p is not None else 1.0,
        top_k=body.top_k if body.top_k is not None else -1,
        # No seed: a random one, drawn once per request, so the rule stays (seed, token index).
        seed=body.seed if body.seed is not None else secrets.randbits(63),
        min_tokens=min_tokens,
        stop=tuple(tuple(tokenizer.encode(s, add_bos=False)) for s in stops),
        logprobs=body.logprobs,
    )


def parse_completion(body: Any, tokenizer: ByteTokenizer) -> CompletionRequest:
    """Validate a completions body; ``InvalidRequest`` (HTTP 400) says what is wrong and names it."""
    parsed = _decode(body)
    prompt, text = _prompt(parsed.prompt, tokenizer)
    _check_neutral(parsed)
    max_tokens = parsed.max_tokens if parsed.max_tokens is not None else DEFAULT_MAX_TOKENS
    params = parsed.kv_transfer_params
    role, transfer_id = _transfer(params)
    if params is not None and role is TransferRole.REMOTE_PREFILL:
        params.check_prompt(len(prompt))
    options = parsed.stream_options
    if options is not None and not parsed.stream:
        raise InvalidRequest("'stream_options' can only be given with stream: true", "stream_options")
    if options is not None and options.continuous_usage_stats:
        raise InvalidRequest("'stream_options.continuous_usage_stats' is not supported", "stream_options")
    return CompletionRequest(
        prompt=prompt,
        max_tokens=max_tokens,
        stream=bool(parsed.stream),
        ignore_eos=bool(parsed.ignore_eos),
        model=parsed.model,
        role=role,
        transfer_id=transfer_id,
        kv_transfer_params=params,
        sampling=_sampling(parsed, tokenizer, max_tokens),
        echo=bool(parsed.echo),
        prompt_text=text,
        include_usage=bool(options is not None and options.include_usage),
    )


def _transfer(params: KvTransferParams | None) -> tuple[TransferRole, str | None]:
    """The request's part in a pair; what the reference engine needs for it (types are msgspec's)."""
    if params is None:
        return TransferRole.NONE, None
    decode, prefill = params.remote_decode, params.remote_prefill
    if decode and prefill:
        raise InvalidRequest(
            "kv_transfer_params cannot ask for both do_remote_decode and do_remote_prefill", _KV_PARAMS
        )
    if not (decode or prefill):
        return TransferRole.NONE, None
    tid = params.transfer_id
    if tid is None and decode:
        # vLLM's proxies and routers (vllm-router's PD mode) name no id in P's leg: P makes one and
        # returns it in its answer, which they hand D as its kv_transfer_params.
        tid = uuid.uuid4().hex
    if not tid:
        raise InvalidRequest("kv_transfer_params.transfer_id must be a non-empty string", _KV_PARAMS)
    if prefill:
        params.remote_address()
    return (TransferRole.REMOTE_DECODE if decode else TransferRole.REMOTE_PREFILL), tid


def error_status(exc: BaseException) -> tuple[int, str]:
    """HTTP status and OpenAI error type for an exception that ended a request."""
    if isinstance(exc, ModelNotFound):
        return 404, "invalid_request_error"
    if isinstance(exc, RouterOnly):
        return 403, "permission_error"
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
    param = exc.param if isinstance(exc, InvalidRequest) else None
    message = str(exc) or type(exc).__name__
    # OpenAI's own code for an unknown model; every other error keeps its status as its code.
    code: int | str = "model_not_found" if isinstance(exc, ModelNotFound) else status
    return status, {"error": {"message": message, "type": kind, "param": param, "code": code}}


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
    kv_transfer_params: KvTransferParams | None,
    timings: Mapping[str, Any] | None,
    created: int | None = None,
    completion_tokens: int | None = None,
    logprobs: dict[str, Any] | None = None,
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
                "logprobs": logprobs,
            }
        ],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": done,
            "total_tokens": prompt_tokens + done,
        },
        "kv_transfer_params": None if kv_transfer_params is None else kv_transfer_params.to_json(),
    }
    if timings is not None:
        body["timings"] = timings
    return body


class TextBuilder:
    """The text and OpenAI completions ``logprobs`` of one request's outputs, chunk by chunk.

    ``text_offset`` is each token's offset, in characters, in the whole answer (echoed prompt included):
    the characters decoded before it, so a stream's chunks continue each other's offsets.
    """

    def __init__(self, creq: CompletionRequest, tokenizer: ByteTokenizer) -> None:
        self._decoder: StreamDecoder = tokenizer.stream_decoder()
        self._echo = creq.prompt_text if creq.echo else ""
        self._offset = len(self._echo)
        self._logprobs = creq.sampling.logprobs is not None

    def chunk(
        self, tokens: tuple[int, ...], entries: tuple[TokenLogprob, ...], final: bool
    ) -> tuple[str, dict[str, Any] | None]:
        """The text of ``tokens`` (after the echoed prompt, the first time) and their logprobs."""
        parts, self._echo = [self._echo], ""
        offsets = []
        for t in tokens:
            offsets.append(self._offset)
            piece = self._decoder.push(t)
            self._offset += len(piece)
            parts.append(piece)
        if final:
            parts.append(self._decoder.flush())
        text = "".join(parts)
        if not self._logprobs:
            return text, None
        return text, {
            "tokens": [token_text(e.token) for e in entries],
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{token_text(t): lp for t, lp in e.top} for e in entries],
            "text_offset": offsets,
        }

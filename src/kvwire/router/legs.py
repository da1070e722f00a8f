"""The two HTTP legs of a disaggregated request: prefill (P, one token) and decode (D, the answer).

HTTP client errors and engine error answers are translated here into ``LegError`` (an ``ApiError`` that knows
which engine failed), so the app above handles one exception type.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import aiohttp
from aiohttp.http_exceptions import HttpProcessingError

from kvwire.errors import InvalidRequest
from kvwire.kv_params import FIELD, KvTransferParams, parse_kv_params
from kvwire.router.engines import HealthInfo
from kvwire.router.http import (
    COMPLETION_BODY_LIMIT,
    SMALL_BODY_LIMIT,
    BodyTooLarge,
    EngineClient,
    json_object,
    parse_json,
    read_bounded,
)
from kvwire.router.openai_api import ApiError, ErrorType, engine_error_kind
from kvwire.router.policy import Role

COMPLETIONS = "/v1/completions"
CHAT_COMPLETIONS = "/v1/chat/completions"
_DRAIN_LIMIT = 64 * 1024  # bytes read after a stream's [DONE] to keep its connection (see _drain)


class LegError(ApiError):
    """A leg's failure. The client's message names the engine's role, never its URL (an internal address);
    ``url`` is for the router's own log and health bookkeeping."""

    def __init__(
        self,
        role: Role,
        url: str,
        kind: ErrorType,
        detail: str,
        unreachable: bool = False,
        param: str | None = None,
    ) -> None:
        super().__init__(kind, f"{role.value} engine: {detail}", param)
        self.role = role
        self.url = url
        self.unreachable = unreachable
        # The connection was refused: the engine never saw the request, another engine may take it.
        self.refused = False


def left_fleet(role: Role, url: str) -> LegError:
    """The picked engine left the fleet before its leg was sent: as a refused connection, the request
    is picked again (``Router._route``)."""
    exc = LegError(role, url, ErrorType.UNAVAILABLE, "left the fleet", unreachable=True)
    exc.refused = True
    return exc


def engine_path(body: Mapping[str, Any]) -> str:
    """Where a leg's body goes: a chat body (``messages``, for engines that are OpenAI servers) to chat,
    any other to completions. Its shape says it, so every leg of a request agrees."""
    return CHAT_COMPLETIONS if "messages" in body else COMPLETIONS


def prefill_body(base: Mapping[str, Any], transfer_id: str) -> dict[str, Any]:
    body = dict(base)
    params = KvTransferParams(do_remote_decode=True, transfer_id=transfer_id)
    body.update(max_tokens=1, stream=False, kv_transfer_params=params.to_json())
    # P's one token: vLLM reads max_completion_tokens before max_tokens, and refuses stream_options
    # without stream.
    body.pop("max_completion_tokens", None)
    body.pop("stream_options", None)
    min_tokens = body.get("min_tokens")
    if isinstance(min_tokens, int) and min_tokens > 1:
        # P answers one token: min_tokens above it is refused (by vLLM too); 1 keeps the first token's rule
        # (no EOS) the same as D's, though the router never uses P's token.
        body["min_tokens"] = 1
    return body


def decode_body(base: Mapping[str, Any], transfer_id: str, p: HealthInfo) -> dict[str, Any]:
    body = dict(base)
    params = KvTransferParams(
        do_remote_prefill=True,
        transfer_id=transfer_id,
        remote_engine_id=p.engine_id,
        remote_incarnation=p.incarnation or None,  # the life the router saw: a restart since is refused
        remote_host=p.side_channel_host,
        remote_port=p.side_channel_port,
        remote_hosts=p.side_channel_hosts or None,
        remote_tp_size=p.tp_size,
        remote_pp_size=p.pp_size,
    )
    body[FIELD] = params.to_json()
    return body


def pull_params(p_url: str, prefilled: Mapping[str, Any]) -> dict[str, Any]:
    """What D's leg needs from P's answer in pull mode: P's block ids and prompt length (and P's own view of
    its address), as JSON fields to merge into D's ``kv_transfer_params``."""
    try:
        kv = parse_kv_params(prefilled.get(FIELD))
    except InvalidRequest as exc:
        raise LegError(Role.PREFILL, p_url, ErrorType.ENGINE_ERROR, f"answer's {exc}") from exc
    if kv is None or kv.remote_block_ids is None:
        detail = "answer has no remote_block_ids (is P in pull mode?)"
        raise LegError(Role.PREFILL, p_url, ErrorType.ENGINE_ERROR, detail)
    # Only where P is and what it holds: D's own flags and transfer id stay the router's.
    picked = KvTransferParams(
        remote_block_ids=kv.remote_block_ids,
        remote_engine_id=kv.remote_engine_id,
        remote_incarnation=kv.remote_incarnation,
        remote_host=kv.remote_host,
        remote_port=kv.remote_port,
        remote_hosts=kv.remote_hosts,
        remote_tp_size=kv.remote_tp_size,
        remote_pp_size=kv.remote_pp_size,
        num_tokens=kv.num_tokens,  # D refuses a prompt of another length (it would read slots P never wrote)
    )
    return picked.to_json()


def _engine_message(payload: object, fallback: str) -> str:
    if isinstance(payload, dict):
        err = payload.get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
        if isinstance(payload.get("detail"), str):
            return str(payload["detail"])
    return fallback


def _error_type(payload: object) -> object:
    err = payload.get("error") if isinstance(payload, dict) else None
    return err.get("type") if isinstance(err, dict) else None


def _kind_of_error_event(err: Mapping[str, Any]) -> ErrorType:
    code = err.get("code")
    return engine_error_kind(code if isinstance(code, int) and 400 <= code <= 599 else 500, err.get("type"))


def _engine_param(payload: object) -> str | None:
    err = payload.get("error") if isinstance(payload, dict) else None
    param = err.get("param") if isinstance(err, dict) else None
    return param if isinstance(param, str) else None


def _error_of_response(role: Role, url: str, status: int, content: bytes) -> LegError:
    try:
        payload: object = parse_json(content)
    except ValueError:
        payload = None
    text = content[:200].decode(errors="replace")
    message = _engine_message(payload, f"HTTP {status}: {text}")
    kind = engine_error_kind(status, _error_type(payload))
    return LegError(role, url, kind, message, param=_engine_param(payload))


def _translate(role: Role, url: str, exc: BaseException) -> LegError:
    """aiohttp's failures (and its timeouts, which are ``TimeoutError``s) as a leg's error."""
    if isinstance(exc, TimeoutError):
        return LegError(role, url, ErrorType.TIMEOUT, f"timed out ({type(exc).__name__})")
    # The engine could not be reached or dropped the connection: its health is worth a look at once.
    unreachable = isinstance(exc, aiohttp.ClientConnectionError | aiohttp.ClientPayloadError)
    err = LegError(role, url, ErrorType.ENGINE_ERROR, f"{type(exc).__name__}: {exc}", unreachable=unreachable)
    err.refused = isinstance(exc, aiohttp.ClientConnectorError)
    return err


async def post_completion(
    client: EngineClient, role: Role, url: str, body: Mapping[str, Any]
) -> dict[str, Any]:
    """A non-streaming leg: the engine's completion (or chat completion) object."""
    try:
        async with client.post(url + engine_path(body), body) as resp:
            status, content = resp.status, await read_bounded(resp, COMPLETION_BODY_LIMIT)
    except (aiohttp.ClientError, TimeoutError, BodyTooLarge) as exc:
        raise _translate(role, url, exc) from exc
    if status != 200:
        raise _error_of_response(role, url, status, content)
    try:
        return json_object(content)
    except ValueError as exc:
        raise LegError(role, url, ErrorType.ENGINE_ERROR, str(exc)) from exc


class DecodeStream:
    """D's streaming leg: SSE events as dicts; an ``error`` event raises ``LegError``."""

    def __init__(self, client: EngineClient, url: str, body: Mapping[str, Any]) -> None:
        self._client = client
        self.url = url
        self._body = body
        self._resp: aiohttp.ClientResponse | None = None
        self._ended = False  # the engine sent [DONE]

    async def open(self) -> None:
        try:
            self._resp = resp = await self._client.post(self.url + engine_path(self._body), self._body)
            if resp.status != 200:
                content = await read_bounded(resp, SMALL_BODY_LIMIT)
                raise _error_of_response(Role.DECODE, self.url, resp.status, content)
        except (aiohttp.ClientError, TimeoutError, BodyTooLarge) as exc:
            raise _translate(Role.DECODE, self.url, exc) from exc

    async def next_event(self) -> dict[str, Any] | None:
        """The next event, or None at ``[DONE]``; a stream that ends without it is the leg's error (an
        engine that closed its answer early: passing that on as a whole answer would hide it)."""
        if self._resp is None:
            raise RuntimeError("DecodeStream.next_event before open")
        try:
            while line := await self._resp.content.readline():
                if not line.startswith(b"data:"):
                    continue  # blank separators, comments, other SSE fields
                data = line[5:].strip()
                if data == b"[DONE]":
                    self._ended = True
                    await self._drain()
                    return None
                return self._event(data)
        except (aiohttp.ClientError, TimeoutError, ValueError, HttpProcessingError) as exc:
            # A line over aiohttp's line limit (512 KiB: an echo of a long prompt) is ValueError in older
            # aiohttp and LineTooLong (an HttpProcessingError, no ClientError) in 3.9+: the leg's error either
            # way, so the client gets a typed error (or an SSE error event mid-stream), not a cut stream.
            raise _translate(Role.DECODE, self.url, exc) from exc
        raise LegError(Role.DECODE, self.url, ErrorType.ENGINE_ERROR, "the stream ended before [DONE]")

    async def _drain(self) -> None:
        """Read what follows ``[DONE]`` (an engine ends its body right there), up to ``_DRAIN_LIMIT``: a
        response whose body has ended lets its connection go back to the pool for the next request (a new
        one costs a TCP handshake); one that keeps sending is closed by ``aclose`` instead."""
        assert self._resp is not None
        drained = 0
        while drained < _DRAIN_LIMIT and (chunk := await self._resp.content.readany()):
            drained += len(chunk)

    def _event(self, data: bytes) -> dict[str, Any]:
        try:
            event = parse_json(data)
        except ValueError as exc:
            raise LegError(Role.DECODE, self.url, ErrorType.ENGINE_ERROR, "bad SSE event") from exc
        if not isinstance(event, dict):
            raise LegError(Role.DECODE, self.url, ErrorType.ENGINE_ERROR, "SSE event is not an object")
        err = event.get("error")
        if isinstance(err, dict):
            message = _engine_message(event, "error event")
            raise LegError(Role.DECODE, self.url, _kind_of_error_event(err), message)
        return event

    async def aclose(self) -> None:
        if self._resp is not None:
            # After [DONE], release(): aiohttp pools the connection if the body has ended, closes it
            # otherwise. Before it, close(): the engine sees the disconnect and aborts its request.
            if self._ended:
                self._resp.release()
            else:
                self._resp.close()
            self._resp = None

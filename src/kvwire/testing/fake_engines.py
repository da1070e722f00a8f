"""Fake prefill and decode engine servers that follow the serving API, for testing the router.

The fakes move no KV: a shared ``FakeCluster`` stands for the side channel and NIXL. D "registers" a
transfer when its leg arrives and waits for P's "done"; P waits for D's registration before it "writes".
So a router that does not send both legs at the same time deadlocks into a 503, as a real push-mode
deployment would stall. Tokens are a deterministic function of the prompt (``fake_tokens``), so answers
can be checked exactly. ``ServerThread`` runs any ASGI apps under uvicorn on a background event loop.

A fake made with ``vllm=True`` answers as a vLLM server would: ``/health`` is a bare 200, ``/v1/models``
names its model, and ``/v1/chat/completions`` applies a "chat template" (``fake_chat_prompt``) and answers
chat-shaped objects and chunks (a role-only first chunk; a usage chunk only when ``stream_options`` asks).
Without it the fake is kvwire's reference engine (completions only), and refuses ``stream_options``: the
router never sends it there (the engine's last chunk always carries the usage).
"""

from __future__ import annotations

import asyncio
import enum
import json
import threading
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.requests import ClientDisconnect

# Bounded waits inside the fakes (seconds): a fake never hangs a test for long.
FENCE_S = 5.0
_POLL_S = 0.02


class Fault(enum.Enum):
    NONE = "none"
    HTTP_500 = "http_500"  # answer the leg with a 500
    HTTP_503 = "http_503"  # answer the leg with a 503 (overloaded / KV load failed)
    HANG = "hang"  # never answer (until the client goes away)
    STREAM_ERROR = "stream_error"  # decode: an SSE error event after the first token


def fake_tokens(prompt: str | list[int], n: int) -> list[int]:
    """The fake model: lowercase letters from a hash of the prompt."""
    ids = list(prompt.encode()) if isinstance(prompt, str) else list(prompt)
    seed = sum((i + 1) * t for i, t in enumerate(ids))
    return [ord("a") + (seed + 7 * k) % 26 for k in range(n)]


@dataclass
class FakeCluster:
    """What the fake P and D engines share, and what the tests inspect afterwards."""

    registered: dict[str, asyncio.Event] = field(default_factory=dict)
    written: dict[str, asyncio.Event] = field(default_factory=dict)
    prefill_bodies: list[dict[str, Any]] = field(default_factory=list)
    decode_bodies: list[dict[str, Any]] = field(default_factory=list)
    cancelled: set[str] = field(default_factory=set)
    prefill_fault: Fault = Fault.NONE
    decode_fault: Fault = Fault.NONE
    # Pull mode: P answers without waiting for D (its KV stays readable); D needs P's block ids.
    pull: bool = False
    order: list[str] = field(default_factory=list)  # "prefill:<tid>" / "decode:<tid>" as legs arrive
    token_gap_s: float = 0.0  # decode streams: the pause after each token
    paths: list[str] = field(default_factory=list)  # "<role> <path>" as legs arrive

    def event(self, table: dict[str, asyncio.Event], transfer_id: str) -> asyncio.Event:
        return table.setdefault(transfer_id, asyncio.Event())


def fake_chat_prompt(messages: list[dict[str, Any]]) -> str:
    """The vLLM fake's chat template: the messages' contents, one a line (tokens come from it)."""
    return "\n".join(str(m.get("content") or "") for m in messages)


@dataclass(frozen=True)
class _Shape:
    """How a leg is answered: chat-shaped (vLLM's /v1/chat/completions), and whether a stream ends with a
    usage-only chunk (vLLM's, when ``stream_options.include_usage`` asks)."""

    chat: bool = False
    usage_chunk: bool = False
    top_logprobs: int | None = None  # chat logprobs asked for (vLLM's chat shape)


def _error(status: int, message: str) -> JSONResponse:
    kind = "invalid_request_error" if status == 400 else "engine_error"
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status)


async def _wait_or_disconnect(event: asyncio.Event, request: Request, timeout_s: float) -> bool | None:
    """True when ``event`` is set, False on timeout, None when the client went away."""
    for _ in range(int(timeout_s / _POLL_S)):
        if event.is_set():
            return True
        if await request.is_disconnected():
            return None
        await asyncio.sleep(_POLL_S)
    return event.is_set()


def _usage(prompt_len: int, n: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_len, "completion_tokens": n, "total_tokens": prompt_len + n}


def _chat_logprobs(tokens: list[int], top: int) -> dict[str, Any]:
    """vLLM's chat logprobs shape: one entry per token, with ``top`` alternatives."""
    entry = [{"token": chr(t), "logprob": -0.5, "bytes": [t]} for t in tokens]
    return {"content": [{**e, "top_logprobs": [e] * top} for e in entry]}


def _completion(
    tokens: list[int], prompt_len: int, kv: dict[str, Any] | None, shape: _Shape = _Shape()
) -> dict[str, Any]:
    text = "".join(chr(t) for t in tokens)
    if shape.chat:  # vLLM's chat completion: no token ids, no timings
        lp = _chat_logprobs(tokens, shape.top_logprobs) if shape.top_logprobs is not None else None
        message: dict[str, Any] = {"role": "assistant", "content": text, "reasoning_content": None}
        message["tool_calls"] = []
        choice = {"index": 0, "message": message, "logprobs": lp, "finish_reason": "length"}
        return {
            "id": "chatcmpl-" + uuid.uuid4().hex, "object": "chat.completion", "created": int(time.time()),
            "model": "fake", "choices": [choice], "usage": _usage(prompt_len, len(tokens)),
            "kv_transfer_params": kv,
        }  # fmt: skip
    return {
        "id": "cmpl-" + uuid.uuid4().hex,
        "object": "text_completion",
        "created": int(time.time()),
        "model": "fake",
        "choices": [
            {"index": 0, "text": text, "token_ids": tokens, "finish_reason": "length", "logprobs": None}
        ],
        "usage": _usage(prompt_len, len(tokens)),
        "kv_transfer_params": kv,
        "timings": {"ttft_ms": 1.0, "kv_transfer_ms": 0.5 if kv is None else None, "kv_bytes": 1024},
    }


def fake_engine_app(
    role: str,
    cluster: FakeCluster,
    side_channel_port: int,
    load: dict[str, int] | None = None,
    vllm: bool = False,
) -> FastAPI:
    """A fake ``prefill`` or ``decode`` engine server (``role``); ``vllm``: one that answers as a vLLM
    server (see the module's docstring)."""
    app = FastAPI()
    engine_id = f"fake-{role}-{uuid.uuid4().hex[:8]}"

    @app.get("/health", response_model=None)
    async def health() -> dict[str, Any] | Response:
        if vllm:
            return Response(status_code=200)  # vLLM's /health: a bare 200
        return {
            "status": "ok", "role": role, "engine_id": engine_id, "incarnation": "1",
            "side_channel_host": "127.0.0.1", "side_channel_port": side_channel_port,
            "tp_size": 1, "pp_size": 1, "model": "fake",
            "load": load or {"running": 0, "waiting": 0, "free_blocks": 100},
        }  # fmt: skip

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": "fake", "object": "model", "owned_by": "fake"}]}

    async def leg(request: Request, chat: bool) -> Response:
        try:
            body = await request.json()
        except ClientDisconnect:
            return Response(status_code=499)
        cluster.paths.append(f"{role} {request.url.path}")
        if "stream_options" in body and not vllm:
            return _error(400, "stream_options: the router sends none to kvwire's engines")
        kv = body.get("kv_transfer_params") or {}
        tid = str(kv.get("transfer_id", ""))
        prompt = fake_chat_prompt(body["messages"]) if chat else body["prompt"]
        cluster.order.append(f"{role}:{tid}")
        if role == "prefill":
            cluster.prefill_bodies.append(body)
            return await _prefill(cluster, request, body, tid, prompt, (engine_id, side_channel_port), chat)
        cluster.decode_bodies.append(body)
        return await _decode(cluster, request, body, tid, prompt, _shape(body, chat))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await leg(request, chat=False)

    if vllm:

        @app.post("/v1/chat/completions")
        async def chat_completions(request: Request) -> Response:
            return await leg(request, chat=True)

    return app


def _shape(body: dict[str, Any], chat: bool) -> _Shape:
    options = body.get("stream_options") or {}
    top = (body.get("top_logprobs") or 0) if chat and body.get("logprobs") else None
    return _Shape(chat=chat, usage_chunk=bool(options.get("include_usage")), top_logprobs=top)


def _prompt_len(prompt: str | list[int]) -> int:
    return len(prompt.encode()) if isinstance(prompt, str) else len(prompt)


async def _fault(fault: Fault, request: Request, tid: str, cluster: FakeCluster) -> Response | None:
    if fault is Fault.HTTP_500:
        return _error(500, "fake engine crashed")
    if fault is Fault.HTTP_503:
        return _error(503, "fake engine overloaded")
    if fault is Fault.HANG:
        if await _wait_or_disconnect(asyncio.Event(), request, 60.0) is None:
            cluster.cancelled.add(tid)
        return _error(500, "hung")
    return None


async def _prefill(
    cluster: FakeCluster,
    request: Request,
    body: dict[str, Any],
    tid: str,
    prompt: str | list[int],
    identity: tuple[str, int],
    chat: bool,
) -> Response:
    kv = body.get("kv_transfer_params") or {}
    if not kv.get("do_remote_decode") or body.get("max_tokens") != 1 or body.get("stream"):
        return _error(400, f"bad prefill leg: {body}")
    if "max_completion_tokens" in body or "stream_options" in body:
        # vLLM would read max_completion_tokens before max_tokens, and refuses stream_options unstreamed.
        return _error(400, f"bad prefill leg: {body}")
    # Faults strike after D registered, as a crash in the middle of a prefill would.
    if not cluster.pull:
        got = await _wait_or_disconnect(cluster.event(cluster.registered, tid), request, FENCE_S)
        if not got:
            return _error(503, f"no push_reg for {tid}")
    failed = await _fault(cluster.prefill_fault, request, tid, cluster)
    if failed is not None:
        return failed
    cluster.event(cluster.written, tid).set()
    engine_id, port = identity
    plen = _prompt_len(prompt)
    params = {
        "transfer_id": tid, "remote_engine_id": engine_id, "remote_host": "127.0.0.1", "remote_port": port,
        "remote_tp_size": 1, "remote_pp_size": 1, "num_tokens": plen, "remote_block_ids": [3, 4],
    }  # fmt: skip
    return JSONResponse(_completion(fake_tokens(prompt, 1), plen, params, _Shape(chat=chat)))


async def _decode(
    cluster: FakeCluster,
    request: Request,
    body: dict[str, Any],
    tid: str,
    prompt: str | list[int],
    shape: _Shape,
) -> Response:
    kv = body.get("kv_transfer_params") or {}
    needed = ("remote_engine_id", "remote_host", "remote_port", "remote_tp_size", "remote_pp_size")
    if not kv.get("do_remote_prefill") or not tid or any(k not in kv for k in needed):
        return _error(400, f"bad decode leg: {kv}")
    if cluster.pull and kv.get("remote_block_ids") != [3, 4]:
        return _error(400, f"pull mode needs P's block ids: {kv}")
    fault = cluster.decode_fault
    if fault is not Fault.STREAM_ERROR:
        failed = await _fault(fault, request, tid, cluster)
        if failed is not None:
            return failed
    cluster.event(cluster.registered, tid).set()
    got = await _wait_or_disconnect(cluster.event(cluster.written, tid), request, FENCE_S)
    if got is None:
        cluster.cancelled.add(tid)
        return _error(499, "client went away")
    if not got:
        return _error(503, f"KV load failed for {tid}: fence expired")
    tokens = fake_tokens(prompt, int(body.get("max_tokens", 16)))
    plen = _prompt_len(prompt)
    if not body.get("stream"):
        return JSONResponse(_completion(tokens, plen, None, shape))
    events = _sse(tokens, fault, cluster.token_gap_s, shape, _usage(plen, len(tokens)))
    return StreamingResponse(events, media_type="text/event-stream")


def _data(obj: object) -> bytes:
    return f"data: {json.dumps(obj)}\n\n".encode()


def _chunk(shape: _Shape, t: int, finish: str | None) -> dict[str, Any]:
    if shape.chat:
        lp = _chat_logprobs([t], shape.top_logprobs) if shape.top_logprobs is not None else None
        choice: dict[str, Any] = {"index": 0, "delta": {"content": chr(t)}, "logprobs": lp}
        return {"object": "chat.completion.chunk", "choices": [{**choice, "finish_reason": finish}]}
    choice = {"index": 0, "text": chr(t), "token_ids": [t], "finish_reason": finish}
    return {"id": "x", "object": "text_completion", "created": 0, "model": "fake", "choices": [choice]}


async def _sse(
    tokens: list[int], fault: Fault, gap_s: float, shape: _Shape, usage: dict[str, int]
) -> AsyncIterator[bytes]:
    if shape.chat:  # vLLM opens a chat stream with a role-only delta
        role = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None}
        yield _data({"object": "chat.completion.chunk", "choices": [{**role, "finish_reason": None}]})
    for k, t in enumerate(tokens):
        if fault is Fault.STREAM_ERROR and k == 1:
            err = {"error": {"message": "KV load failed mid-stream", "type": "engine_error", "code": 503}}
            yield _data(err)
            return
        yield _data(_chunk(shape, t, "length" if k == len(tokens) - 1 else None))
        await asyncio.sleep(gap_s)
    if shape.usage_chunk:
        kind = "chat.completion.chunk" if shape.chat else "text_completion"
        yield _data({"object": kind, "choices": [], "usage": usage})
    yield b"data: [DONE]\n\n"


class ServerThread:
    """Runs ASGI apps under uvicorn on 127.0.0.1, on one event loop in a background thread."""

    def __init__(self, apps: Sequence[tuple[Any, int]]) -> None:
        self._apps = list(apps)
        self._servers: list[uvicorn.Server] = []
        self._thread: threading.Thread | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self._error: BaseException | None = None

    def __enter__(self) -> ServerThread:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self, timeout_s: float = 10.0) -> None:
        self._servers = [
            uvicorn.Server(
                uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on")
            )
            for app, port in self._apps
        ]
        self._thread = threading.Thread(target=self._run, name="kvwire-test-servers", daemon=True)
        self._thread.start()
        for _ in range(int(timeout_s / _POLL_S)):
            if self._error is not None or all(s.started for s in self._servers):
                break
            time.sleep(_POLL_S)
        if self._error is not None or not all(s.started for s in self._servers):
            self.stop()
            raise RuntimeError(f"test servers did not start: {self._error!r}")

    def _run(self) -> None:
        self.loop = asyncio.new_event_loop()
        try:
            self.loop.run_until_complete(self._serve())
        except BaseException as exc:  # reported to start()
            self._error = exc
        finally:
            self.loop.close()

    async def _serve(self) -> None:
        # Off the main thread, uvicorn installs no signal handlers.
        await asyncio.gather(*(s.serve() for s in self._servers))

    def stop(self, timeout_s: float = 10.0) -> None:
        for s in self._servers:
            s.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout_s)

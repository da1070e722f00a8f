"""Fake prefill and decode engine servers that follow the serving API, for testing the router.

The fakes move no KV: a shared ``FakeCluster`` stands for the side channel and NIXL. D "registers" a
transfer when its leg arrives and waits for P's "done"; P waits for D's registration before it "writes".
So a router that does not send both legs at the same time deadlocks into a 503, as a real push-mode
deployment would stall. Tokens are a deterministic function of the prompt (``fake_tokens``), so answers
can be checked exactly. ``ServerThread`` runs any ASGI apps under uvicorn on a background event loop.
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

    def event(self, table: dict[str, asyncio.Event], transfer_id: str) -> asyncio.Event:
        return table.setdefault(transfer_id, asyncio.Event())


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


def _completion(tokens: list[int], prompt_len: int, kv: dict[str, Any] | None) -> dict[str, Any]:
    return {
        "id": "cmpl-" + uuid.uuid4().hex,
        "object": "text_completion",
        "created": int(time.time()),
        "model": "fake",
        "choices": [
            {
                "index": 0,
                "text": "".join(chr(t) for t in tokens),
                "token_ids": tokens,
                "finish_reason": "length",
                "logprobs": None,
            }
        ],
        "usage": {
            "prompt_tokens": prompt_len,
            "completion_tokens": len(tokens),
            "total_tokens": prompt_len + len(tokens),
        },
        "kv_transfer_params": kv,
        "timings": {"ttft_ms": 1.0, "kv_transfer_ms": 0.5 if kv is None else None, "kv_bytes": 1024},
    }


def fake_engine_app(
    role: str, cluster: FakeCluster, side_channel_port: int, load: dict[str, int] | None = None
) -> FastAPI:
    """A fake ``prefill`` or ``decode`` engine server (``role``)."""
    app = FastAPI()
    engine_id = f"fake-{role}-{uuid.uuid4().hex[:8]}"

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {
            "status": "ok", "role": role, "engine_id": engine_id, "incarnation": "1",
            "side_channel_host": "127.0.0.1", "side_channel_port": side_channel_port,
            "tp_size": 1, "pp_size": 1, "model": "fake",
            "load": load or {"running": 0, "waiting": 0, "free_blocks": 100},
        }  # fmt: skip

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        try:
            body = await request.json()
        except ClientDisconnect:
            return Response(status_code=499)
        kv = body.get("kv_transfer_params") or {}
        tid = str(kv.get("transfer_id", ""))
        prompt = body["prompt"]
        plen = len(prompt.encode()) if isinstance(prompt, str) else len(prompt)
        cluster.order.append(f"{role}:{tid}")
        if role == "prefill":
            cluster.prefill_bodies.append(body)
            return await _prefill(cluster, request, body, tid, plen, engine_id, side_channel_port)
        cluster.decode_bodies.append(body)
        return await _decode(cluster, request, body, tid, plen)

    return app


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
    plen: int,
    engine_id: str,
    port: int,
) -> Response:
    kv = body.get("kv_transfer_params") or {}
    if not kv.get("do_remote_decode") or body.get("max_tokens") != 1 or body.get("stream"):
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
    params = {
        "transfer_id": tid, "remote_engine_id": engine_id, "remote_host": "127.0.0.1", "remote_port": port,
        "remote_tp_size": 1, "remote_pp_size": 1, "num_tokens": plen, "remote_block_ids": [3, 4],
    }  # fmt: skip
    return JSONResponse(_completion(fake_tokens(body["prompt"], 1), plen, params))


async def _decode(
    cluster: FakeCluster, request: Request, body: dict[str, Any], tid: str, plen: int
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
    tokens = fake_tokens(body["prompt"], int(body.get("max_tokens", 16)))
    if not body.get("stream"):
        return JSONResponse(_completion(tokens, plen, None))
    return StreamingResponse(_sse(tokens, fault, cluster.token_gap_s), media_type="text/event-stream")


async def _sse(tokens: list[int], fault: Fault, gap_s: float) -> AsyncIterator[bytes]:
    for k, t in enumerate(tokens):
        if fault is Fault.STREAM_ERROR and k == 1:
            err = {"error": {"message": "KV load failed mid-stream", "type": "engine_error", "code": 503}}
            yield f"data: {json.dumps(err)}\n\n".encode()
            return
        last = k == len(tokens) - 1
        choice = {"index": 0, "text": chr(t), "token_ids": [t], "finish_reason": "length" if last else None}
        chunk = {"id": "x", "object": "text_completion", "created": 0, "model": "fake", "choices": [choice]}
        yield f"data: {json.dumps(chunk)}\n\n".encode()
        await asyncio.sleep(gap_s)
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

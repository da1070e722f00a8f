"""The engine's HTTP server (FastAPI): /health, /metrics, /v1/kv_stats, /v1/models, /v1/completions.

The engine runs on its own thread (``EngineLoop``); a handler submits a ``Request`` whose ``on_output``
callback hands each step's output to the handler's asyncio queue (``call_soon_threadsafe``). A stream
waits for the request's first output before answering, so errors before the first token (bad input, KV
load failed) still get a proper status code; later errors are sent as an ``error`` event.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvwire.apikey import (
    CLIENT_CLOSED,
    DISCONNECT_CHECK_S,
    MAX_BODY_BYTES,
    ROUTER_TOKEN_HEADER,
    ApiKeyMiddleware,
    install_openai_refusals,
    read_bounded,
    token_matches,
)
from kvwire.connector.timeline import Stage, Timeline, merged
from kvwire.engine.api import (
    CompletionRequest,
    TextBuilder,
    completion_body,
    completion_id,
    decode_json,
    error_body,
    error_status,
    parse_completion,
)
from kvwire.engine.config import Role
from kvwire.engine.engine import Engine
from kvwire.engine.loop import EngineLoop
from kvwire.engine.request import Request as EngineRequest
from kvwire.engine.request import RequestOutput, TransferRole
from kvwire.errors import (
    EngineOverloaded,
    InvalidRequest,
    KVLoadFailed,
    KvwireError,
    ModelNotFound,
    RouterOnly,
)
from kvwire.kv_params import KvTransferParams
from kvwire.logsetup import transfer_extra
from kvwire.metrics import CONTENT_TYPE, BlockStats, KvMetrics, MetricRole, Outcome, posts_transfers
from kvwire.protocol.messages import FailReason, TransferMode

log = logging.getLogger(__name__)
_SWITCH_INTERVAL_S = 0.0005


class ClientGone(Exception):
    """The HTTP client of a request disconnected while it waited."""


# Attempts at reading the block accounting while the engine thread changes it.
_ACCOUNTING_TRIES = 5
# KV load failures no retry can cure (the two engines disagree), with what to change. They are answered
# 500 with ``x-should-retry: false`` (the openai client retries 503s and other 5xx otherwise).
_PERMANENT_KV = {
    FailReason.UNAUTHORIZED: "the prefill engine refused this engine's credentials: set the same "
    "KVWIRE_SECRET on every engine (or on none)",
    FailReason.INCOMPATIBLE: "the prefill and decode engines differ in model, weights seed, KV layout or "
    "transfer mode (the decode engine's log names the fields): start both with the same --preset, "
    "--seed and --mode",
    FailReason.BAD_REGISTRATION: "the prefill engine refused this engine's block registration (its log "
    "says why): check that both run the same kvwire version and --preset",
    FailReason.SHORT_REGISTRATION: "the prefill engine prefilled more tokens than this engine registered: "
    "send both legs the same prompt",
    FailReason.DIGEST_UNAVAILABLE: "this engine asked for a KV digest (kv_digest_sample) and the prefill "
    "engine cannot compute one (its KV is in device memory): set --kv-digest-sample 0 on this engine",
}
# KV load failures a retry may cure, with what else can cause them: D cannot tell a P that is down from
# one that refuses it, so the client's message names both (the engines' logs say which it was).
_TRANSIENT_KV = {
    FailReason.HANDSHAKE_FAILED: "this engine could not complete its handshake with the prefill engine: it "
    "is down or unreachable, or it refused this engine (a different KVWIRE_SECRET, or a secret on one "
    "side only), or the prefill engine's address is not in this engine's allowed_peers (this engine's log "
    "names the cause)",
    FailReason.OVERLOADED: "the prefill engine had too many registrations waiting for their prefill "
    "(max_early_registrations): retry, or add prefill capacity",
    FailReason.PEER_DEAD: "the prefill engine stopped answering: it crashed or is unreachable, or it could "
    "not handshake back with this engine (e.g. KVWIRE_SECRET set on this side only; its log names it)",
    FailReason.BAD_DONE: "the prefill engine's done did not state this request's registration, so its KV "
    "was not used: a prefill engine older than this one (upgrade prefill engines first), or a replayed or "
    "broken message (this engine's log names the field)",
    FailReason.DIGEST_MISMATCH: "the KV that arrived does not match the prefill engine's digest of it, so "
    "it was not used: if it repeats, the transfer corrupts data or the prefill engine sends no digest "
    "(an older prefill engine with its KV in device memory: set --kv-digest-sample 0)",
}
RETRY_HEADER = "x-should-retry"


def http_error(exc: BaseException) -> tuple[int, dict[str, Any], dict[str, str]]:
    """Status, OpenAI-style body and headers for an exception that ended a request."""
    status, body = error_body(exc)
    if isinstance(exc, KVLoadFailed):
        try:
            reason: FailReason | None = FailReason(exc.reason)
        except ValueError:
            reason = None
        fix = _PERMANENT_KV.get(reason) if reason is not None else None
        if fix is not None:
            body["error"].update(message=f"{exc}: {fix}", type="configuration_error", code=500)
            return 500, body, {RETRY_HEADER: "false"}
        hint = _TRANSIENT_KV.get(reason) if reason is not None else None
        if hint is not None:
            body["error"]["message"] = f"{exc}: {hint}"
    return status, body, {}


@dataclass(frozen=True, slots=True)
class Identity:
    """Who this engine is, as peers and the router see it."""

    role: Role
    engine_id: str
    incarnation: str
    side_channel_host: str = "127.0.0.1"
    side_channel_port: int = 0
    model: str = "kvwire-tiny"
    seed: int = 0
    mode: TransferMode | None = None  # None: colocated (no connector)
    authenticated: bool = False  # KVWIRE_SECRET set: side-channel requests are signed
    # The connector's compat hash (the handshake's; "" colocated): a router pairs only equal ones.
    compat: str = ""
    # Further names the engine answers to (--served-model-name), e.g. the router's --model, which it
    # forwards as the client sent it.
    aliases: tuple[str, ...] = ("kvwire",)

    @property
    def served_models(self) -> tuple[str, ...]:
        return (self.model, *(a for a in self.aliases if a != self.model))


class EngineServer:
    """An engine, its thread, its metrics, and the FastAPI app serving them."""

    def __init__(
        self,
        engine: Engine,
        identity: Identity,
        metrics: KvMetrics | None = None,
        api_key: str | None = None,
        router_token: str | None = None,
    ) -> None:
        self.engine = engine
        self.router_token = router_token or None
        self.identity = identity
        role = MetricRole(identity.role.value)
        self.metrics = (
            metrics
            if metrics is not None
            else KvMetrics(role, identity.model, transfers=posts_transfers(role, identity.mode))
        )
        self.api_key = api_key or None
        self.loop = EngineLoop(engine)
        # Called before /metrics and /v1/kv_stats answer (e.g. to copy a connector's counters).
        self.scrape_hooks: list[Callable[[], None]] = []
        # Each says why the engine cannot serve now (e.g. a connector agent stuck inside NIXL), or None;
        # any reason makes /health answer 503, so that the router stops sending it requests.
        self.health_checks: list[Callable[[], str | None]] = []
        # Each request's steps as this server saw them (the connector keeps its own: see ``timelines``).
        self.timeline = Timeline()
        self._started = False
        # SIGTERM under --discovery (``kvwire.engine.fleet``): still serving, but /health says draining so
        # that routers send nothing new.
        self.draining = False
        self.app = self._build_app()

    def start(self) -> None:
        if not self._started:
            self._started = True
            # The HTTP loop, the engine thread and the connector's loop share one GIL. A thread woken
            # (a notification to drain, a token to send) waits for the holder to yield it, up to the
            # switch interval: Python's 5 ms default put milliseconds on a short request's path.
            sys.setswitchinterval(_SWITCH_INTERVAL_S)
            self.loop.start()

    def stop(self) -> None:
        if self._started:
            self._started = False
            self.loop.stop()

    # -- views ---------------------------------------------------------------------------------------------
    def health(self) -> dict[str, Any]:
        ident, load = self.identity, self.engine.load()
        problems = [p for check in self.health_checks if (p := check()) is not None]
        return {
            "status": _status(self.loop.alive, bool(problems), self.draining),
            "problems": problems,
            "role": ident.role.value,
            "engine_id": ident.engine_id,
            "incarnation": ident.incarnation,
            "side_channel_host": ident.side_channel_host,
            "side_channel_port": ident.side_channel_port,
            "tp_size": self.engine.cfg.tp_size,
            "pp_size": self.engine.cfg.pp_size,
            "model": ident.model,
            "seed": ident.seed,
            "mode": ident.mode.value if ident.mode is not None else None,
            "authenticated": ident.authenticated,
            "compat": ident.compat,
            "load": load.report(),
            "kv_blocks": self.engine.kv.allocator.num_blocks,
            "block_size": self.engine.kv.spec.block_size,
        }

    def refresh_metrics(self) -> None:
        for hook in self.scrape_hooks:
            try:
                hook()
            except Exception:
                log.exception("metrics scrape hook failed")
        alloc, sched = self.engine.kv.allocator, self.engine.scheduler
        in_use = alloc.num_blocks - sched.num_free  # evictable prefix cache blocks are not in use
        fenced = sched.fenced_blocks
        self.metrics.set_blocks(BlockStats(in_use=in_use, quarantined=fenced, total=alloc.num_blocks))

    def accounting(self) -> dict[str, Any]:
        """Where every block is and how many requests are live: leak checks read it once the engine is quiet
        (then ``blocks.free == blocks.total`` unless a block leaked)."""
        for _ in range(_ACCOUNTING_TRIES):
            try:
                return self._accounting()
            except RuntimeError:  # a dict changed size under us: the engine thread moved on, look again
                continue
        return self._accounting()

    def _accounting(self) -> dict[str, Any]:
        # Read from the HTTP thread while the engine thread runs: each figure is a snapshot, not a
        # consistent cut; a quiet engine (what the leak checks wait for) has nothing moving.
        sched, alloc = self.engine.scheduler, self.engine.kv.allocator
        held = sum(len(b) for b in list(sched.held.values()))
        return {
            "blocks": {
                "total": alloc.num_blocks,
                "free": sched.num_free,  # evictable prefix cache blocks are free for the taking
                "in_use": alloc.num_blocks - sched.num_free,
                "quarantined": alloc.num_quarantined,
                "held": held,
                "fenced": sum(len(b) for b in list(sched.fenced.values())),
            },
            "requests": {
                "live": len(sched.waiting) + len(sched.waiting_for_kv) + len(sched.running),
                "waiting": len(sched.waiting),
                "waiting_for_kv": len(sched.waiting_for_kv),
                "running": len(sched.running),
                "held": len(sched.held),
                "fenced": len(sched.fenced),
            },
        }

    def timelines(self, last: int) -> list[dict[str, Any]]:
        """The ``last`` most recent requests' marks (``/v1/kv_stats?timeline=N``), with the connector's."""
        connector = getattr(self.engine.hooks, "connector", None)
        extra = getattr(connector, "timeline", None)
        sources = [self.timeline, *([extra] if isinstance(extra, Timeline) else [])]
        keys = self.timeline.keys()[-last:] if last > 0 else []
        return [merged(key, *sources) for key in keys]

    def _mark(self, creq: CompletionRequest, req: EngineRequest) -> None:
        """Record the engine's marks of a request that produced its first output (set by the engine thread,
        read here after the output crossed over: they no longer change)."""
        key = creq.transfer_id or req.request_id
        # On P the one token it samples ends the prefill: that is when the KV may leave.
        token = Stage.PREFILL_DONE if creq.role is TransferRole.REMOTE_DECODE else Stage.FIRST_TOKEN
        marks = ((Stage.KV_ALLOCATED, req.kv_wait_start), (Stage.KV_READY, req.kv_ready_at),
                 (token, req.first_token_at))  # fmt: skip
        self.timeline.mark(key, Stage.ARRIVED, req.arrival)
        for stage, at in marks:
            if at is not None:
                self.timeline.mark(key, stage, at)
        self.timeline.mark(key, Stage.ANSWERED, time.monotonic())

    def kv_bytes(self, num_prompt_tokens: int) -> int:
        """Bytes of KV a decode leg receives: the prompt's whole blocks, every layer and head."""
        spec = self.engine.kv.spec
        blocks = -(-num_prompt_tokens // spec.block_size)
        return blocks * spec.block_size * spec.bytes_per_token()

    # -- completions ---------------------------------------------------------------------------------------
    def _submit(self, creq: CompletionRequest) -> tuple[EngineRequest, asyncio.Queue[RequestOutput]]:
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        aloop = asyncio.get_running_loop()

        def deliver(out: RequestOutput) -> None:
            aloop.call_soon_threadsafe(queue.put_nowait, out)

        req = EngineRequest(
            request_id=uuid.uuid4().hex,
            prompt=creq.prompt,
            max_tokens=creq.max_tokens,
            ignore_eos=creq.ignore_eos,
            role=creq.role,
            transfer_id=creq.transfer_id,
            kv_transfer_params=creq.kv_transfer_params,
            sampling=creq.sampling,
            on_output=deliver,
        )
        self.engine.submit(req)
        log.debug(
            "request %s accepted: transfer %s, role %s, %d prompt tokens, max_tokens %d",
            req.request_id, creq.transfer_id, creq.role.value, len(creq.prompt), creq.max_tokens,
            extra=transfer_extra(creq.transfer_id),
        )  # fmt: skip
        return req, queue

    def _kv_params_out(self, creq: CompletionRequest, req: EngineRequest) -> KvTransferParams | None:
        if creq.role is not TransferRole.REMOTE_DECODE:
            return None
        ident = self.identity
        prompt_blocks = self.engine.scheduler.prompt_blocks(req)
        return KvTransferParams(
            # As vLLM's connectors answer: a proxy that hands P's answer to D as it is (vllm-router) works.
            do_remote_decode=False,
            do_remote_prefill=True,
            transfer_id=creq.transfer_id,
            remote_engine_id=ident.engine_id,
            remote_incarnation=ident.incarnation,
            remote_host=ident.side_channel_host,
            remote_port=ident.side_channel_port,
            remote_tp_size=self.engine.cfg.tp_size,
            remote_pp_size=self.engine.cfg.pp_size,
            num_tokens=len(creq.prompt),
            remote_block_ids=tuple(req.block_ids[:prompt_blocks]),
        )

    def _timings(self, creq: CompletionRequest, last: RequestOutput) -> dict[str, Any]:
        remote = creq.role is TransferRole.REMOTE_PREFILL
        kv_ms = last.kv_transfer_s * 1e3 if last.kv_transfer_s is not None else None
        return {
            "ttft_ms": last.ttft_s * 1e3 if last.ttft_s is not None else None,
            "kv_transfer_ms": kv_ms,
            "kv_bytes": self.kv_bytes(len(creq.prompt)) if remote and kv_ms is not None else None,
        }

    def _record(
        self, exc: BaseException | None, started: float, ttft_s: float | None, kv_wait_s: float | None = None
    ) -> None:
        if exc is None:
            outcome = Outcome.OK
        else:
            status, _ = error_status(exc)
            outcome = {400: Outcome.BAD_REQUEST, 503: Outcome.UNAVAILABLE}.get(status, Outcome.ENGINE_ERROR)
        self.metrics.record_request(outcome, time.monotonic() - started, ttft_s)
        if kv_wait_s is not None:
            self.metrics.record_kv_wait(kv_wait_s)

    async def completions(self, http: Request) -> Response:
        started = time.monotonic()
        try:
            raw = await read_bounded(http, MAX_BODY_BYTES)
            if raw is None:
                raise InvalidRequest(f"the body is over the {MAX_BODY_BYTES}-byte limit")
            body = decode_json(raw)
            creq = parse_completion(body, self.engine.tokenizer)
            self._check_router_token(http, creq)
            if creq.model is not None and creq.model not in self.identity.served_models:
                served = ", ".join(self.identity.served_models)
                raise ModelNotFound(
                    f"the model {creq.model[:200]!r} does not exist (served: {served})", "model"
                )
            req, queue = self._submit(creq)
        except (InvalidRequest, EngineOverloaded) as exc:
            return self._error(exc, started)
        try:
            first = await self._next(http, queue)
        except (asyncio.CancelledError, ClientGone) as exc:
            # The client hung up (or the router cancelled this leg): a decode leg waiting for KV must not
            # keep its blocks until the fence expires.
            self._gone(req, started)
            if isinstance(exc, ClientGone):
                return Response(status_code=CLIENT_CLOSED)
            raise
        if first.error is not None:
            return self._error(first.error, started, creq.transfer_id)
        self._mark(creq, req)
        if creq.stream:
            return StreamingResponse(
                self._stream(creq, req, queue, first, started), media_type="text/event-stream"
            )
        outs = [first]
        try:
            while not outs[-1].finished:
                outs.append(await self._next(http, queue))
        except (asyncio.CancelledError, ClientGone) as exc:
            self._gone(req, started)
            if isinstance(exc, ClientGone):
                return Response(status_code=CLIENT_CLOSED)
            raise
        last = outs[-1]
        if last.error is not None:
            return self._error(last.error, started, creq.transfer_id)
        tokens = tuple(t for o in outs for t in o.new_token_ids)
        entries = tuple(e for o in outs for e in o.logprobs)
        text, logprobs = TextBuilder(creq, self.engine.tokenizer).chunk(tokens, entries, final=True)
        self._record(None, started, last.ttft_s, last.kv_transfer_s)
        self._log_done(creq, len(tokens), started)
        return JSONResponse(
            completion_body(
                cid=completion_id(),
                model=creq.model or self.identity.model,
                text=text,
                token_ids=list(tokens),
                logprobs=logprobs,
                finish_reason=last.finish_reason.value if last.finish_reason else None,
                prompt_tokens=len(creq.prompt),
                kv_transfer_params=self._kv_params_out(creq, req),
                timings=self._timings(creq, last),
                # Every generated token, as the stream's usage and vLLM count them: a matched stop
                # string's tokens are generated though not shown.
                completion_tokens=last.num_output_tokens,
            )
        )

    async def _stream(
        self,
        creq: CompletionRequest,
        req: EngineRequest,
        queue: asyncio.Queue[RequestOutput],
        first: RequestOutput,
        started: float,
    ) -> AsyncIterator[bytes]:
        cid, created = completion_id(), int(time.time())
        model = creq.model or self.identity.model
        builder = TextBuilder(creq, self.engine.tokenizer)
        out = first
        try:
            while True:
                if out.error is not None:
                    self._record(out.error, started, out.ttft_s)
                    yield _sse(error_body(out.error)[1])
                    yield b"data: [DONE]\n\n"  # as vLLM: an SSE reader waiting for the end gets it
                    return
                text, logprobs = builder.chunk(out.new_token_ids, out.logprobs, out.finished)
                chunk = completion_body(
                    logprobs=logprobs,
                    cid=cid,
                    model=model,
                    text=text,
                    token_ids=list(out.new_token_ids),
                    finish_reason=out.finish_reason.value if out.finish_reason else None,
                    prompt_tokens=len(creq.prompt),
                    kv_transfer_params=self._kv_params_out(creq, req) if out.finished else None,
                    timings=self._timings(creq, out) if out.finished else None,
                    created=created,
                    completion_tokens=out.num_output_tokens,
                )
                if not out.finished or creq.include_usage:
                    usage, chunk["usage"] = chunk["usage"], None  # OpenAI's: then only its own chunk
                yield _sse(chunk)
                if out.finished:
                    self._record(None, started, out.ttft_s, out.kv_transfer_s)
                    self._log_done(creq, out.num_output_tokens, started)
                    if creq.include_usage:
                        last = {"model": model, "choices": [], "usage": usage}
                        yield _sse({"id": cid, "object": "text_completion", "created": created, **last})
                    yield b"data: [DONE]\n\n"
                    return
                out = await queue.get()
        finally:
            if not out.finished:  # the client went away (or the server is stopping), or an error ended it
                self._gone(req, started, counted=out.error is not None)

    def _gone(self, req: EngineRequest, started: float, counted: bool = False) -> None:
        """The request's client went away (or the server is stopping): its work ends, counted ``cancelled``
        as the router counts it (engines counted none: docs/metrics.md names the outcome)."""
        self.engine.abort(req.request_id)
        if not counted:
            self.metrics.record_request(Outcome.CANCELLED, time.monotonic() - started, None)

    @staticmethod
    async def _next(http: Request, queue: asyncio.Queue[Any]) -> Any:
        """The request's next output; ``ClientGone`` once its client disconnected (uvicorn does not cancel
        a plain HTTP handler when the client goes away). Checked every ``DISCONNECT_CHECK_S`` whether
        outputs flow or not: checked only while none came, a client that hung up on a long answer cost
        the whole generation (2,500 tokens, 10 s, after it left at 1.5 s)."""
        state = http.scope.setdefault("kvwire.disconnect_checked", [time.monotonic()])
        while True:
            if time.monotonic() - state[0] >= DISCONNECT_CHECK_S:
                state[0] = time.monotonic()
                if await http.is_disconnected():
                    raise ClientGone
            try:
                return await asyncio.wait_for(queue.get(), DISCONNECT_CHECK_S)
            except TimeoutError:
                continue  # time to check again

    def _check_router_token(self, http: Request, creq: CompletionRequest) -> None:
        """With a router token, kv_transfer_params (a peer to dial, a transfer to join) come from the router
        only: a client of the public API gets 403 for them, whatever else it may ask."""
        if self.router_token is None or creq.kv_transfer_params is None:
            return
        if not token_matches(http.headers.get(ROUTER_TOKEN_HEADER), self.router_token):
            raise RouterOnly(
                "kv_transfer_params are taken from the router only (this engine has a router token)",
                "kv_transfer_params",
            )

    def _error(self, exc: BaseException, started: float, transfer_id: str | None = None) -> JSONResponse:
        status, body, headers = http_error(exc)
        if status >= 500:
            log.warning("request failed (%d): %s", status, exc, extra=transfer_extra(transfer_id))
        else:
            log.debug("request refused (%d): %s", status, exc, extra=transfer_extra(transfer_id))
        self._record(exc, started, None)
        return JSONResponse(body, status_code=status, headers=headers)

    @staticmethod
    def _log_done(creq: CompletionRequest, num_tokens: int, started: float) -> None:
        log.debug(
            "request done: transfer %s, %d tokens in %.1f ms",
            creq.transfer_id, num_tokens, (time.monotonic() - started) * 1e3,
            extra=transfer_extra(creq.transfer_id),
        )  # fmt: skip

    # -- app -----------------------------------------------------------------------------------------------
    def _build_app(self) -> FastAPI:
        @asynccontextmanager
        async def lifespan(app: FastAPI) -> AsyncIterator[None]:
            self.start()
            try:
                yield
            finally:
                self.stop()

        app = FastAPI(title=f"kvwire {self.identity.role.value} engine", lifespan=lifespan)

        @app.get("/health")
        async def health() -> JSONResponse:
            body = self.health()  # draining: 503 too, so a readiness probe or a load balancer stops sending
            return JSONResponse(body, status_code=503 if body["problems"] or self.draining else 200)

        @app.get("/metrics")
        async def metrics() -> Response:
            self.refresh_metrics()
            return Response(self.metrics.render(), media_type=CONTENT_TYPE)

        @app.get("/v1/kv_stats")
        async def kv_stats(timeline: int = 0) -> dict[str, Any]:
            self.refresh_metrics()
            body = {**self.metrics.snapshot(), "accounting": self.accounting()}
            if timeline > 0:
                body["timeline"] = self.timelines(timeline)
            return body

        @app.get("/v1/models")
        async def models() -> dict[str, Any]:
            cards = [
                {"id": name, "object": "model", "created": 0, "owned_by": "kvwire"}
                for name in self.identity.served_models
            ]
            return {"object": "list", "data": cards}

        @app.post("/v1/completions")
        async def completions(http: Request) -> Response:
            return await self.completions(http)

        _install_error_handlers(app)
        if self.api_key is not None:
            app.add_middleware(ApiKeyMiddleware, key=self.api_key, flag="--api-key / KVWIRE_API_KEY")
        return app


def _install_error_handlers(app: FastAPI) -> None:
    """Every answer that is not a success is an OpenAI error object, whatever raised it: FastAPI's own
    refusals (``install_openai_refusals``) and a bug's exception included."""

    @app.exception_handler(KvwireError)
    async def kvwire_error(_: Request, exc: KvwireError) -> JSONResponse:
        status, body, headers = http_error(exc)
        return JSONResponse(body, status_code=status, headers=headers)

    install_openai_refusals(app)


def _status(alive: bool, problems: bool, draining: bool) -> str:
    if not alive:
        return "starting"
    return "unhealthy" if problems else "draining" if draining else "ok"


def _sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"

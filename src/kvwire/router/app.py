"""The OpenAI-compatible router: a thin FastAPI app over ``Router``.

Per request: pick a P and a D (``policy``); under conditional disaggregation, a short prompt (or one arriving
while P's prefill queue is longer than D's) goes to D alone as an ordinary request, prefilled there as on a
colocated engine. Otherwise choose a transfer id, and send both legs **at the same time**
(push mode: D registers its blocks with P while P prefills; in pull mode D needs P's block ids, so P's
leg goes first). The client gets D's answer; P's one-token answer is only
checked. A failure of either leg before D produced its first token cancels the other leg and is answered
as OpenAI-style error JSON (400 bad input, 502 engine failure, 503 nothing healthy or engine overloaded,
504 timeout). After the first streamed token an error can only be sent as an SSE ``error`` event.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import Counter, Gauge

from kvwire.apikey import (
    CANCEL_WAIT_S,
    MAX_BODY_BYTES,
    ApiKeyMiddleware,
    install_openai_refusals,
    read_bounded,
    unless_client_gone,
)
from kvwire.config import RouterConfig
from kvwire.logsetup import transfer_extra
from kvwire.metrics import CONTENT_TYPE, KvMetrics, MetricRole, Outcome
from kvwire.protocol.messages import TransferMode
from kvwire.router import openai_api as api
from kvwire.router.answers import OUTCOME_OF, Latency, event_tokens, unary_latency
from kvwire.router.engines import EngineRegistry, HealthInfo, compat_problem, pair_problem
from kvwire.router.fleet import FleetDiscovery
from kvwire.router.http import EngineClient
from kvwire.router.legs import (
    DecodeStream,
    LegError,
    decode_body,
    left_fleet,
    post_completion,
    prefill_body,
    pull_params,
)
from kvwire.router.openai_api import ApiError, ApiKind, ErrorType, ParsedRequest
from kvwire.router.policy import (
    EngineView,
    NoHealthyEngine,
    PrefillSite,
    Role,
    decide_prefill,
    prompt_tokens,
)
from kvwire.router.prefix import block_hashes

log = logging.getLogger(__name__)

# A stream may carry a few non-token events (a usage chunk, a final chunk) besides one per token.
_EXTRA_EVENTS = 16
# Picks per request when the picked engines refuse connections (each refusal re-checks that engine first).
_PICK_TRIES = 3
_MAX_SEEN_MODELS = 256  # model names remembered for _in_view


@dataclass
class _Trace:
    """What a failed request's log line names: its transfer id, once it has one."""

    transfer_id: str | None = None


def error_response(exc: ApiError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers())


class Router:
    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.client = EngineClient(
            config.connect_timeout_s,
            config.request_timeout_s,
            config.engine_api_key,
            max_connections=2 * config.max_requests,
            router_token=config.router_token,
        )
        self.registry = EngineRegistry(
            self.client, config.prefill_urls, config.decode_urls, config.health_timeout_s, config.engines
        )
        self.registry.max_active = config.max_requests
        self.fleet = FleetDiscovery(config.discovery, self.registry) if config.discovery else None
        self.metrics = KvMetrics(MetricRole.ROUTER, config.model, transfers=False)
        if self.fleet is not None:
            self.fleet.gauges(self.metrics.registry, config.model)
        self._healthy_gauge = Gauge(
            "kvwire_router_engine_healthy",
            "1 if the engine's last health check passed",
            ["role", "model_name", "engine_role", "url"],
            registry=self.metrics.registry,
        )
        self._prefills = Counter(
            "kvwire_router_prefill_decisions",
            "Requests by where their prompt was prefilled (remote: on P; local: on D) and why",
            ["role", "model_name", "site", "reason"],
            registry=self.metrics.registry,
        )
        self.created = int(time.time())
        self._seen_models: set[str] = set()  # every model name the router has served
        self._stop = asyncio.Event()
        self._poller: asyncio.Task[None] | None = None
        self._background: set[asyncio.Task[Any]] = set()

    async def start(self) -> None:
        if self.fleet is not None:
            await self.fleet.start(first_view_s=self.config.health_timeout_s)
        await self.registry.check_all()
        self._poller = asyncio.create_task(self.registry.poll(self.config.health_interval_s, self._stop))

    async def close(self) -> None:
        self._stop.set()
        tasks = [t for t in (self._poller, *self._background) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.registry.close()
        if self.fleet is not None:
            await self.fleet.close()
        await self.client.close()

    # -- status endpoints ----------------------------------------------------------------------------

    def served_models(self) -> list[str]:
        names = {self.config.model} | self.registry.models()
        if len(self._seen_models) < _MAX_SEEN_MODELS:  # bounded: names come from engines and records
            self._seen_models |= names
        return sorted(names)

    def _in_view(self, body: dict[str, Any], served: frozenset[str]) -> None:
        """A model no engine in view serves is a 503 while the router cannot say what the fleet serves (no
        engine in view) or saw it served before (engines restarting, discovery away): a 404 told the
        client the name was wrong, the openai client does not retry one, and it counted as a bad request."""
        name = body.get("model")
        unknown = isinstance(name, str) and name not in served
        if unknown and (name in self._seen_models or not self.registry.models()):
            raise ApiError(ErrorType.UNAVAILABLE, f"no engine serving {str(name)[:200]!r} is in view now")

    def health(self) -> tuple[int, dict[str, Any]]:
        engines = {
            role.value: [e.summary() for e in states] for role, states in self.registry.engines.items()
        }
        ok = all(any(e.view().healthy for e in states) for states in self.registry.engines.values())
        problems, fitting = self.registry.pair_problems(self.config.mode)  # unready only if no pair fits
        status = "ok" if ok and fitting else "misconfigured" if ok and problems else "unavailable"
        body: dict[str, Any] = {"status": status, "role": "router", "problems": problems, **engines}
        body["prefix_blocks"] = dict(self.registry.prefix_blocks)
        if self.fleet is not None:
            body["discovery"] = self.fleet.summary()
        return (200 if status == "ok" else 503), body

    def render_metrics(self) -> bytes:
        self._healthy_gauge.clear()  # engines that left the fleet lose their series
        for role, states in self.registry.engines.items():
            for e in states:
                labels = {"role": "router", "model_name": self.config.model, "engine_role": role.value}
                self._healthy_gauge.labels(**labels, url=e.url).set(1 if e.healthy else 0)
        return self.metrics.render()

    # -- requests --------------------------------------------------------------------------------------

    def count_refused(self) -> None:  # a request refused before it was read whole (its body over the limit)
        self._record(Outcome.BAD_REQUEST, time.monotonic())

    async def serve(self, raw: bytes, kind: ApiKind) -> Response:
        start = time.monotonic()
        trace = _Trace()
        try:
            body, models = api.decode_json_object(raw), frozenset(self.served_models())
            self._in_view(body, models)
            req = api.parse_request(body, kind, models, self.registry.dialect.openai_server)
            response, latency = await self._route(req, start, trace)
        except asyncio.CancelledError:  # its client hung up (``unless_client_gone``), as a stream's can
            self._record(Outcome.CANCELLED, start)
            raise
        except Exception as exc:
            if not isinstance(exc, ApiError):
                log.exception("router error")
                # The exception's text stays in the log: it may name internal addresses.
                exc = ApiError(ErrorType.INTERNAL, f"router error ({type(exc).__name__}): see the router log")
            self._record(OUTCOME_OF[exc.kind], start)
            where = f" ({exc.url})" if isinstance(exc, LegError) else ""
            level = logging.WARNING if exc.status >= 500 else logging.DEBUG
            tid = transfer_extra(trace.transfer_id)
            log.log(level, "request failed (%d): %s%s", exc.status, exc.message, where, extra=tid)
            return error_response(exc)
        if latency is not None:  # a stream records itself when it ends
            self._record(Outcome.OK, start, latency)
        if trace.transfer_id is not None:
            log.debug("transfer %s answered", trace.transfer_id, extra=transfer_extra(trace.transfer_id))
        return response

    async def _route(
        self, req: ParsedRequest, start: float, trace: _Trace
    ) -> tuple[Response, Latency | None]:
        """``_route_once``, again on another pick when an engine refused the connection (it never saw the
        request: a killed engine the health checks have not caught yet, or one that just left the fleet)."""
        for attempt in range(_PICK_TRIES):
            try:
                return await self._route_once(req, start, trace)
            except LegError as exc:
                if not exc.refused or attempt + 1 == _PICK_TRIES:
                    raise
                log.info("%s refused the connection: picking again", exc.url)
                await self.registry.recheck(exc.url)
        raise AssertionError("unreachable")

    async def _route_once(
        self, req: ParsedRequest, start: float, trace: _Trace
    ) -> tuple[Response, Latency | None]:
        """Serve one parsed request: on D alone, or disaggregated. ``(response, None)`` for a stream."""
        tokens = self._tokens(req)
        hashes = block_hashes(req.prompt)
        p, d = await self._pick(hashes, tokens)
        cfg = self.config
        p, d = self.registry.fitting_pair(p, d, cfg.policy, cfg.mode, hashes, tokens)  # the pair that serves
        decision = decide_prefill(cfg.disaggregation, tokens, p, d, cfg.local_prefill_max_tokens)
        self._prefills.labels("router", cfg.model, decision.site.value, decision.reason.value).inc()
        rid = ("cmpl-" if req.kind is ApiKind.COMPLETION else "chatcmpl-") + uuid.uuid4().hex
        if decision.site is PrefillSite.LOCAL:
            log.debug("request %s: prefilled on decode %s (%s)", rid, d.url, decision.reason.value)
            return await self._local(req, rid, d.url, tokens, start)
        p_url, d_url = p.url, d.url
        p_info = await self._pair_info(p_url, d_url)
        trace.transfer_id = transfer_id = uuid.uuid4().hex
        base = req.engine_body()
        legs = (prefill_body(base, transfer_id), decode_body(base, transfer_id, p_info))
        log.debug(
            "request %s: transfer %s, prefill %s, decode %s, stream %s",
            rid, transfer_id, p_url, d_url, req.stream, extra=transfer_extra(transfer_id),
        )  # fmt: skip
        self.registry.begin(p_url, d_url)  # refuses past --max-requests: before P's index records the prompt
        streaming = False  # from _stream on, the stream ends the in-flight counts (its failure or its relay)
        try:
            self.registry.prefix_sent(p_url, hashes)
            prefilled = None
            if cfg.mode is TransferMode.PULL:
                # D reads P's blocks, so it needs their ids: P answers first (vLLM's order).
                prefilled = await self._prefill_first(p_url, legs[0], tokens)
                d_params = legs[1]["kv_transfer_params"]
                d_params.pop("remote_hosts", None)  # P's answer says where its ranks are (absent: one host)
                d_params.update(pull_params(p_url, prefilled))
            if req.stream:
                streaming = True
                return await self._stream(req, rid, p_url, d_url, legs, start, prefilled), None
            return await self._unary(req, rid, (p_url, d_url), legs, prefilled, start)
        finally:
            if not streaming:
                self.registry.end(p_url, d_url)

    def _tokens(self, req: ParsedRequest) -> int:
        return prompt_tokens(req.prompt, self.registry.dialect.bytes_per_token)

    def _record(self, outcome: Outcome, start: float, latency: Latency | None = None) -> None:
        lat = latency or Latency()
        self.metrics.record_request(outcome, time.monotonic() - start, lat.ttft_s, lat.token_gaps_s)

    async def _pick(self, hashes: list[bytes], tokens: int) -> tuple[EngineView, EngineView]:
        """A P and a D (``pick_pair``); a role without a healthy engine is checked again once."""
        rechecked: set[Role] = set()
        while True:
            try:
                return self.registry.pick_pair(self.config.policy, hashes, tokens)
            except NoHealthyEngine as exc:
                if exc.role in rechecked:
                    raise ApiError(ErrorType.UNAVAILABLE, str(exc)) from exc
                rechecked.add(exc.role)
                await self.registry.recheck_role(exc.role)

    async def _pair_info(self, p_url: str, d_url: str) -> HealthInfo:
        """P's identity for D's leg, once P and D are known to be able to work together."""
        info = await self.registry.info_of(p_url)
        for role, url in ((Role.PREFILL, p_url), (Role.DECODE, d_url)):
            if not self.registry.in_view(url):
                raise left_fleet(role, url)  # it left while we awaited: pick again
        if info is None:
            log.warning("prefill engine %s is not healthy", p_url)
            raise ApiError(ErrorType.UNAVAILABLE, "the chosen prefill engine is not healthy")
        d_info = self.registry.get(d_url).info
        problem = pair_problem(info, d_info, self.config.mode) if d_info is not None else None
        if problem is not None:
            raise ApiError(ErrorType.MISCONFIGURED, problem)
        if d_info is not None and (problem := compat_problem(info, d_info)) is not None:
            raise ApiError(ErrorType.UNAVAILABLE, problem)  # an upgrade in progress may mend it: 503
        return info

    def _leg_failed(self, exc: LegError) -> None:
        if exc.unreachable or exc.status >= 500:
            self.registry.suspect(exc.url)

    async def _race(self, p_task: asyncio.Task[Any], d_task: asyncio.Task[Any]) -> Any:
        """D's result; P's failure wins only while D has nothing yet."""
        done, _ = await asyncio.wait({p_task, d_task}, return_when=asyncio.FIRST_COMPLETED)
        if d_task in done or p_task.exception() is None:
            return await d_task
        raise p_task.exception()  # type: ignore[misc]

    async def _legs(self, p_task: asyncio.Task[Any], d_task: asyncio.Task[Any], timeout_s: float) -> Any:
        try:
            async with asyncio.timeout(timeout_s):
                return await self._race(p_task, d_task)
        except TimeoutError as exc:
            raise ApiError(ErrorType.TIMEOUT, f"no answer within {timeout_s:.0f} s") from exc
        except LegError as exc:
            self._leg_failed(exc)
            raise
        finally:
            # Whatever happened, neither leg may outlive the request unattended.
            answered = d_task.done() and not d_task.cancelled() and d_task.exception() is None
            if not d_task.done():
                d_task.cancel()
                await asyncio.wait([d_task], timeout=CANCEL_WAIT_S)
            self._settle_prefill(p_task, cancel=not answered)

    def _settle_prefill(self, p_task: asyncio.Task[Any], cancel: bool) -> None:
        """Cancel P's leg on failure; after success let it finish in the background (P cleans up)."""
        if p_task.done():
            if not p_task.cancelled():
                p_task.exception()  # already reported to the caller, or a success
            return
        if cancel:
            p_task.cancel()
        self._background.add(p_task)
        p_task.add_done_callback(self._prefill_finished)

    def _prefill_finished(self, task: asyncio.Task[Any]) -> None:
        self._background.discard(task)
        if task.cancelled():
            return
        exc = task.exception()
        if isinstance(exc, LegError):
            self._leg_failed(exc)
            log.warning("prefill leg (%s) failed after the decode leg answered: %s", exc.url, exc.message)
        elif exc is not None:
            log.error("prefill leg crashed", exc_info=exc)

    async def _prefill_leg(self, p_url: str, body: dict[str, Any], tokens: int) -> dict[str, Any]:
        """P's leg, counted in P's prefill queue until P answers (its answer follows its prefill)."""
        self.registry.prefill_begin(p_url, tokens)
        try:
            return await post_completion(self.client, Role.PREFILL, p_url, body)
        finally:
            self.registry.prefill_end(p_url, tokens)

    async def _prefill_first(self, p_url: str, body: dict[str, Any], tokens: int) -> dict[str, Any]:
        try:
            async with asyncio.timeout(self.config.request_timeout_s):
                return await self._prefill_leg(p_url, body, tokens)
        except TimeoutError as exc:
            log.warning("prefill engine %s: no answer in time", p_url)
            raise ApiError(ErrorType.TIMEOUT, "prefill engine: no answer in time") from exc
        except LegError as exc:
            self._leg_failed(exc)
            raise

    def _prefill_task(
        self, p_url: str, body: dict[str, Any], prefilled: dict[str, Any] | None, tokens: int
    ) -> asyncio.Task[dict[str, Any]]:
        """P's leg as a task: running (push), or already answered (pull)."""
        if prefilled is None:
            return asyncio.create_task(self._prefill_leg(p_url, body, tokens))

        async def answered() -> dict[str, Any]:
            return prefilled

        return asyncio.create_task(answered())

    async def _unary(
        self,
        req: ParsedRequest,
        rid: str,
        urls: tuple[str, str],
        legs: tuple[dict[str, Any], dict[str, Any]],
        prefilled: dict[str, Any] | None,
        start: float,
    ) -> tuple[Response, Latency]:
        p_url, d_url = urls
        p_task = self._prefill_task(p_url, legs[0], prefilled, self._tokens(req))
        sent_s = time.monotonic() - start
        d_task = asyncio.create_task(post_completion(self.client, Role.DECODE, d_url, legs[1]))
        result = await self._legs(p_task, d_task, self.config.request_timeout_s)
        latency = unary_latency(result, sent_s, time.monotonic() - start)
        return JSONResponse(api.completion_response(result, req, rid, self.created_now())), latency

    @staticmethod
    def created_now() -> int:
        return int(time.time())

    async def _stream(
        self,
        req: ParsedRequest,
        rid: str,
        p_url: str,
        d_url: str,
        legs: tuple[dict[str, Any], dict[str, Any]],
        start: float,
        prefilled: dict[str, Any] | None,
    ) -> Response:
        stream = DecodeStream(self.client, d_url, legs[1])

        async def first_event() -> dict[str, Any] | None:
            await stream.open()
            return await stream.next_event()

        p_task = self._prefill_task(p_url, legs[0], prefilled, self._tokens(req))
        d_task = asyncio.create_task(first_event())
        try:
            first = await self._legs(p_task, d_task, self.config.request_timeout_s)
            if first is None:
                raise LegError(Role.DECODE, d_url, ErrorType.ENGINE_ERROR, "stream ended before any token")
        except BaseException:
            await stream.aclose()
            self.registry.end(p_url, d_url)
            raise
        body = self._relay(req, rid, stream, first, start, (p_url, d_url))
        return StreamingResponse(body, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    async def _local(
        self, req: ParsedRequest, rid: str, d_url: str, tokens: int, start: float
    ) -> tuple[Response, Latency | None]:
        """The request to D alone, without kv_transfer_params: D prefills it as a colocated engine would."""
        body = req.engine_body()
        self.registry.begin(d_url)
        self.registry.prefill_begin(d_url, tokens)
        prefilling = True
        try:
            if req.stream:
                stream = DecodeStream(self.client, d_url, body)
                try:
                    first = await self._bounded(self._first_event(stream))
                except BaseException:
                    await stream.aclose()
                    raise
                self.registry.prefill_end(d_url, tokens)
                prefilling = False
                relay = self._relay(req, rid, stream, first, start, (d_url,))
                headers = {"Cache-Control": "no-cache"}
                return StreamingResponse(relay, media_type="text/event-stream", headers=headers), None
            # A unary answer comes whole, so its prompt counts as queued on D until then (an overestimate
            # of D's prefill queue by its decode time).
            sent_s = time.monotonic() - start
            result = await self._bounded(post_completion(self.client, Role.DECODE, d_url, body))
        except BaseException:
            self.registry.end(d_url)
            raise
        finally:
            if prefilling:
                self.registry.prefill_end(d_url, tokens)
        self.registry.end(d_url)
        latency = unary_latency(result, sent_s, time.monotonic() - start)
        return JSONResponse(api.completion_response(result, req, rid, self.created_now())), latency

    @staticmethod
    async def _first_event(stream: DecodeStream) -> dict[str, Any]:
        await stream.open()
        first = await stream.next_event()
        if first is None:
            raise LegError(Role.DECODE, stream.url, ErrorType.ENGINE_ERROR, "stream ended before any token")
        return first

    async def _bounded(self, leg: Awaitable[dict[str, Any]]) -> dict[str, Any]:
        """One leg within the request timeout; its failure marks its engine suspect."""
        timeout_s = self.config.request_timeout_s
        try:
            async with asyncio.timeout(timeout_s):
                return await leg
        except TimeoutError as exc:
            raise ApiError(ErrorType.TIMEOUT, f"no answer within {timeout_s:.0f} s") from exc
        except LegError as exc:
            self._leg_failed(exc)
            raise

    async def _relay(
        self,
        req: ParsedRequest,
        rid: str,
        stream: DecodeStream,
        first: dict[str, Any],
        start: float,
        urls: tuple[str, ...],
    ) -> AsyncGenerator[bytes, None]:
        created = self.created_now()
        last_token = time.monotonic()
        ttft_s, gaps = last_token - start, list[float]()
        # A chat engine's role-only first chunk comes with its first token (vLLM): no gap before that one.
        owed = 0 if event_tokens(first) else 1
        outcome = Outcome.CANCELLED  # unless the loop below finishes: the client went away
        try:
            for chunk in api.stream_chunks(first, req, rid, created, first=True):
                yield api.sse(chunk)
            ended = Outcome.OK
            async for event in self._rest(stream, req.max_tokens + _EXTRA_EVENTS):
                if isinstance(event, ApiError):
                    ended = OUTCOME_OF[event.kind]
                    yield api.sse(event.body())
                    break
                if tokens := event_tokens(event):
                    now = time.monotonic()
                    gaps += [(now - last_token) / tokens] * (tokens - owed)
                    last_token, owed = now, 0
                for chunk in api.stream_chunks(event, req, rid, created, first=False):
                    yield api.sse(chunk)
            yield api.SSE_DONE  # after an error event too, as vLLM: an SSE reader waits for it
            outcome = ended
        finally:
            await stream.aclose()
            self.registry.end(*urls)
            self._record(outcome, start, Latency(ttft_s, tuple(gaps)))

    async def _rest(self, stream: DecodeStream, max_events: int) -> AsyncIterator[dict[str, Any] | ApiError]:
        """D's remaining events (bounded), ending with an ``ApiError`` if the leg fails. The request
        timeout bounds each wait for the next event, not the stream: a long answer still arriving is
        never cut (it was, at 300 s, with a message blaming D)."""
        idle_s = self.config.request_timeout_s
        for _ in range(max_events):
            try:
                async with asyncio.timeout(idle_s):
                    event = await stream.next_event()
            except TimeoutError:
                yield ApiError(ErrorType.TIMEOUT, f"the decode engine sent nothing for {idle_s:g} s")
                return
            except LegError as exc:
                self._leg_failed(exc)
                yield exc
                return
            if event is None:
                return
            yield event
        yield ApiError(ErrorType.ENGINE_ERROR, "the decode engine sent more events than tokens asked for")


def create_app(config: RouterConfig) -> FastAPI:
    router = Router(config)

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        await router.start()
        try:
            yield
        finally:
            await router.close()

    app = FastAPI(title="kvwire router", lifespan=lifespan)
    app.state.router = router
    install_openai_refusals(app)
    if config.api_key:
        app.add_middleware(ApiKeyMiddleware, key=config.api_key, flag="--api-key / KVWIRE_ROUTER_API_KEY")

    async def body_or_refusal(request: Request, kind: ApiKind) -> Response:
        raw = await read_bounded(request)
        if raw is None:
            router.count_refused()
            return error_response(
                ApiError(ErrorType.INVALID_REQUEST, f"the body is over the {MAX_BODY_BYTES}-byte limit")
            )
        return await unless_client_gone(request, router.serve(raw, kind))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await body_or_refusal(request, ApiKind.COMPLETION)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await body_or_refusal(request, ApiKind.CHAT)

    @app.get("/v1/models")
    async def models() -> Response:
        return JSONResponse(api.models_list(router.served_models(), router.created))

    @app.get("/health")
    async def health() -> Response:
        status, body = router.health()
        return JSONResponse(body, status_code=status)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(router.render_metrics(), media_type=CONTENT_TYPE)

    return app

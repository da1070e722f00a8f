"""Conditional disaggregation: the decision (``decide_prefill``), and the router sending a request to D
alone or to both legs accordingly, against scripted engines on 127.0.0.1 (``kvwire.testing.http_fakes``)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from kvwire.config import Disaggregation, RouterConfig
from kvwire.errors import ConfigError
from kvwire.router.app import Router
from kvwire.router.openai_api import ApiKind
from kvwire.router.policy import (
    EngineView,
    PrefillDecision,
    PrefillReason,
    PrefillSite,
    decide_prefill,
    prompt_tokens,
)
from kvwire.testing.clock import until
from kvwire.testing.http_fakes import Seen, scripted_app, serving_here
from kvwire.testing.procs import free_port

pytestmark = pytest.mark.anyio
P, D = "http://p:1", "http://d:2"
COND = Disaggregation.CONDITIONAL


def view(url: str, prefill_tokens: int = 0) -> EngineView:
    return EngineView(url, True, prefill_tokens=prefill_tokens)


def test_always_disaggregates_whatever_the_prompt() -> None:
    decision = decide_prefill(Disaggregation.ALWAYS, 1, view(P, 10_000), view(D), 256)
    assert decision == PrefillDecision(PrefillSite.REMOTE, PrefillReason.ALWAYS)


@pytest.mark.parametrize(
    ("tokens", "site", "reason"),
    [
        (1, PrefillSite.LOCAL, PrefillReason.SHORT_PROMPT),
        (256, PrefillSite.LOCAL, PrefillReason.SHORT_PROMPT),  # the threshold is inclusive
        (257, PrefillSite.REMOTE, PrefillReason.LONG_PROMPT),
    ],
)
def test_threshold_splits_short_from_long(tokens: int, site: PrefillSite, reason: PrefillReason) -> None:
    assert decide_prefill(COND, tokens, view(P), view(D), 256) == PrefillDecision(site, reason)


def test_a_long_prompt_is_prefilled_on_d_while_p_has_more_queued() -> None:
    queue = PrefillDecision(PrefillSite.LOCAL, PrefillReason.PREFILL_QUEUE)
    assert decide_prefill(COND, 4096, view(P, 2048), view(D, 100), 256) == queue
    # Equal queues: P is not busier, so the transfer pays.
    assert decide_prefill(COND, 4096, view(P, 100), view(D, 100), 256).site is PrefillSite.REMOTE
    # A threshold of 0 keeps only the queue rule.
    assert decide_prefill(COND, 1, view(P), view(D), 0).site is PrefillSite.REMOTE


def test_prompt_tokens_counts_bytes_plus_bos_or_token_ids() -> None:
    assert prompt_tokens("abc", 1.0) == 4
    assert prompt_tokens("é", 1.0) == 3  # two UTF-8 bytes
    assert prompt_tokens([5, 6, 7], 4.0) == 3
    assert prompt_tokens("x" * 400, 4.0) == 101


def test_config_refuses_a_negative_threshold() -> None:
    with pytest.raises(ConfigError, match="local_prefill_max_tokens"):
        RouterConfig((P,), (D,), local_prefill_max_tokens=-1)


# -- the router against scripted engines ---------------------------------------------------------------------
@dataclass
class Fakes:
    """A scripted P and D; records each completion body by role."""

    p: str
    d: str
    bodies: dict[str, list[dict[str, Any]]] = field(default_factory=lambda: {"prefill": [], "decode": []})
    release_p: asyncio.Event = field(default_factory=asyncio.Event)
    hold_p: bool = False
    fail_d: bool = False

    async def handle(self, request: Seen) -> tuple[int, Any]:
        role = "prefill" if request.url == self.p else "decode"
        if request.path == "/health":
            return 200, _health(role)
        body = request.json()
        self.bodies[role].append(body)
        if role == "decode" and self.fail_d:
            return 500, {"error": {"message": "boom", "type": "engine_error"}}
        if role == "prefill" and self.hold_p:
            await self.release_p.wait()
        text = "p" if role == "prefill" else "d"
        choice = {"index": 0, "text": text, "token_ids": [1], "finish_reason": "length"}
        usage = {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}
        return 200, {"choices": [choice], "usage": usage}


def _health(role: str) -> dict[str, Any]:
    return {
        "status": "ok", "role": role, "engine_id": f"{role}-0", "side_channel_host": "127.0.0.1",
        "side_channel_port": 5600, "model": "kvwire", "seed": 0, "mode": "push",
    }  # fmt: skip


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
async def fakes() -> AsyncIterator[Fakes]:
    p_port, d_port = free_port(), free_port()
    fakes = Fakes(f"http://127.0.0.1:{p_port}", f"http://127.0.0.1:{d_port}")
    app = scripted_app(fakes.handle)
    async with serving_here([(app, p_port), (app, d_port)]):
        yield fakes
        fakes.release_p.set()  # a held P leg must not keep the server from stopping


async def _ask(router: Router, prompt: str) -> dict[str, Any]:
    raw = json.dumps({"model": "kvwire", "prompt": prompt, "max_tokens": 1}).encode()
    resp = await router.serve(raw, ApiKind.COMPLETION)
    assert resp.status_code == 200, bytes(resp.body)
    body: dict[str, Any] = json.loads(bytes(resp.body))
    return body


def _decisions(router: Router) -> dict[tuple[str, str], float]:
    out = {}
    for family in router._prefills.collect():
        for s in family.samples:
            if s.name.endswith("_total"):
                out[(s.labels["site"], s.labels["reason"])] = s.value
    return out


async def _router(fakes: Fakes, mode: Disaggregation) -> Router:
    config = RouterConfig((fakes.p,), (fakes.d,), disaggregation=mode, local_prefill_max_tokens=16)
    router = Router(config)
    await router.registry.check_all()
    return router


async def test_short_prompt_goes_to_d_alone_as_an_ordinary_request(fakes: Fakes) -> None:
    router = await _router(fakes, COND)
    try:
        answer = await _ask(router, "short")
        assert answer["choices"][0]["text"] == "d"
        assert fakes.bodies["prefill"] == [] and "kv_transfer_params" not in fakes.bodies["decode"][0]
        await _ask(router, "a prompt longer than sixteen bytes")
        # D's answer may come first: P's leg, sent with it, may still be connecting (health polls warm no
        # connection of the legs' pool).
        await until(lambda: len(fakes.bodies["prefill"]) == 1, "P's leg")
        assert fakes.bodies["decode"][1]["kv_transfer_params"]["do_remote_prefill"]
        assert _decisions(router) == {("local", "short_prompt"): 1.0, ("remote", "long_prompt"): 1.0}
        assert {e.prefill_tokens for s in router.registry.engines.values() for e in s} == {0}
    finally:
        await router.close()


async def test_always_sends_short_prompts_through_p(fakes: Fakes) -> None:
    router = await _router(fakes, Disaggregation.ALWAYS)
    try:
        await _ask(router, "short")
        assert len(fakes.bodies["prefill"]) == 1 and "kv_transfer_params" in fakes.bodies["decode"][0]
    finally:
        await router.close()


async def test_long_prompt_goes_to_d_while_p_is_still_prefilling_another(fakes: Fakes) -> None:
    router = await _router(fakes, COND)
    fakes.hold_p = True
    try:
        long = "x" * 100
        await _ask(router, long)  # D answers; P's leg stays open, its 101 tokens queued on P
        assert router.registry.get(fakes.p).prefill_tokens == 101
        await _ask(router, long)
        assert len(fakes.bodies["prefill"]) == 1 and "kv_transfer_params" not in fakes.bodies["decode"][1]
        assert _decisions(router)[("local", "prefill_queue")] == 1.0
        fakes.release_p.set()
        for _ in range(100):  # P's leg finishes in the background
            if router.registry.get(fakes.p).prefill_tokens == 0:
                break
            await asyncio.sleep(0.01)
        assert router.registry.get(fakes.p).prefill_tokens == 0
    finally:
        await router.close()


async def test_a_failed_local_request_is_an_error_and_leaves_no_count_behind(fakes: Fakes) -> None:
    router = await _router(fakes, COND)
    fakes.fail_d = True
    try:
        raw = json.dumps({"model": "kvwire", "prompt": "short", "max_tokens": 1, "stream": True}).encode()
        resp = await router.serve(raw, ApiKind.COMPLETION)
        assert resp.status_code == 502 and "boom" in bytes(resp.body).decode()
        assert fakes.bodies["prefill"] == []
        d = router.registry.get(fakes.d)
        assert (d.inflight, d.prefill_tokens) == (0, 0)
    finally:
        await router.close()

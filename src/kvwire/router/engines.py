"""The router's view of its engines: health, load and P's side-channel address, from their ``/health``.

Health is polled in the background and refreshed at once when a leg to an engine fails, so a restarted
prefill engine (new engine id, incarnation or side-channel port) is picked up without waiting for the poll.

Picks (``EngineRegistry.pick``) follow ``policy.Picker``'s rules without looking at every engine: the
engines a pick may choose (healthy, not draining) are kept per role in ``Ranking``s by load and by
prefill queue, updated where a load changes, so a pick's cost does not grow with the fleet.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
import urllib.parse
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from kvwire.config import EngineKind, Policy
from kvwire.errors import ConfigError
from kvwire.protocol.messages import TransferMode
from kvwire.router.http import EngineClient, json_object
from kvwire.router.policy import QUEUE_TOKENS, EngineView, Load, NoHealthyEngine, Role, prefill_cost
from kvwire.router.prefix import BLOCK_TOKENS, PrefixIndex
from kvwire.router.ranking import Ranking

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class HealthInfo:
    """The fields of an engine's ``/health`` the router needs."""

    role: str
    engine_id: str
    incarnation: str
    side_channel_host: str
    side_channel_port: int
    tp_size: int
    pp_size: int
    model: str
    load: Load
    # What must agree between P and D, when the engine says (kvwire engines do; vLLM's /health does not).
    seed: int | None = None
    mode: TransferMode | None = None
    authenticated: bool | None = None  # KVWIRE_SECRET set
    kv_tokens: int = 0  # the KV cache's size in tokens, when the engine says (sizes the prefix index)

    @classmethod
    def parse(cls, body: Mapping[str, Any]) -> HealthInfo:
        """Raises ``KeyError``, ``TypeError`` or ``ValueError`` on a body that does not follow the API."""
        load = body.get("load") or {}
        info = cls(
            role=str(body["role"]),
            engine_id=str(body["engine_id"]),
            incarnation=str(body.get("incarnation", "")),
            side_channel_host=str(body["side_channel_host"]),
            side_channel_port=int(body["side_channel_port"]),
            tp_size=int(body.get("tp_size", 1)),
            pp_size=int(body.get("pp_size", 1)),
            model=str(body.get("model", "")),
            load=Load(
                running=int(load.get("running", 0)),
                waiting=int(load.get("waiting", 0)),
                free_blocks=int(load.get("free_blocks", 0)),
            ),
            seed=int(body["seed"]) if body.get("seed") is not None else None,
            mode=TransferMode(body["mode"]) if body.get("mode") is not None else None,
            authenticated=bool(body["authenticated"]) if body.get("authenticated") is not None else None,
            kv_tokens=int(body.get("kv_blocks", 0)) * int(body.get("block_size", 0)),
        )
        if body.get("status", "ok") != "ok":
            raise ValueError(f"status {body.get('status')!r}")
        return info


def pair_problem(p: HealthInfo, d: HealthInfo, mode: TransferMode) -> str | None:
    """Why this P and this D cannot serve a request together, whatever the retries (None: they can)."""
    for info in (p, d):
        if info.mode is not None and info.mode is not mode:
            return (
                f"{info.role} engine {info.engine_id} runs in {info.mode.value} mode and the router in "
                f"{mode.value}: start the engines and the router with the same --mode"
            )
    if p.authenticated is not None and d.authenticated is not None and p.authenticated != d.authenticated:
        has, lacks = (p, d) if p.authenticated else (d, p)
        return (
            f"KVWIRE_SECRET is set on the {has.role} engine {has.engine_id} but not on the {lacks.role} "
            f"engine {lacks.engine_id}: set the same KVWIRE_SECRET on every engine"
        )
    if p.seed is not None and d.seed is not None and (p.model, p.seed) != (d.model, d.seed):
        return (
            f"prefill engine {p.engine_id} serves {p.model} seed {p.seed} and decode engine {d.engine_id} "
            f"{d.model} seed {d.seed}: start both with the same --preset and --seed"
        )
    return None


def split_fragment(url: str) -> tuple[str, str]:
    base, _, fragment = url.partition("#")
    return base, fragment


def static_info(url: str, role: Role) -> HealthInfo:
    """A vLLM engine's identity from its URL's fragment (vLLM's ``/health`` says nothing of kvwire):
    ``engine_id``, ``side_channel=HOST:PORT``, ``tp``, ``pp``. A decode engine needs none of them."""
    base, fragment = split_fragment(url)
    q = {k: v[-1] for k, v in urllib.parse.parse_qs(fragment).items()}
    host, port = "", 0
    if role is Role.PREFILL:
        if "engine_id" not in q or "side_channel" not in q:
            raise ConfigError(
                f"prefill engine {base}: a vLLM prefill URL ends with #engine_id=ID&side_channel=HOST:PORT "
                "(the engine_id of its --kv-transfer-config and its side_channel_host/side_channel_port)"
            )
        host, _, raw_port = q["side_channel"].rpartition(":")
        if not host or not raw_port.isdigit():
            raise ConfigError(f"prefill engine {base}: side_channel={q['side_channel']!r} is not HOST:PORT")
        port = int(raw_port)
    try:
        tp, pp = int(q.get("tp", 1)), int(q.get("pp", 1))
    except ValueError:
        raise ConfigError(f"engine {base}: tp and pp in the URL must be integers") from None
    return HealthInfo(role.value, q.get("engine_id", base), "", host, port, tp, pp, "", Load())


@dataclass
class EngineState:
    url: str  # without the fragment: what legs are sent to
    role: Role
    static: HealthInfo | None = None  # vLLM engines: identity from the configured URL
    healthy: bool = False
    info: HealthInfo | None = None
    inflight: int = 0
    sent: int = 0  # requests this router sent it, ever (a joining engine's first traffic shows here)
    prefill_tokens: int = 0  # see EngineView.prefill_tokens
    error: str | None = None
    checked_at: float = 0.0
    discovered: bool = False  # from etcd: leaves the view when its record goes
    draining: bool = False  # its record says it is draining: finish what it has, send it nothing new
    in_fleet: bool = True  # listed in the registry's engines (a departed one lingers while ours end)
    _refreshing: asyncio.Task[None] | None = field(default=None, repr=False)

    def view(self) -> EngineView:
        load = self.info.load if self.info is not None else Load()
        return EngineView(
            self.url, self.healthy and not self.draining, load, self.inflight, self.prefill_tokens
        )

    @property
    def pickable(self) -> bool:
        return self.in_fleet and self.healthy and not self.draining

    def busy(self) -> int:
        """See ``policy.busy``."""
        load = self.info.load if self.info is not None else None
        return max(load.running + load.waiting, self.inflight) if load is not None else self.inflight

    def load_key(self) -> tuple[int, ...]:
        """``policy.least_loaded``'s order: fewest requests, then most free blocks."""
        return (self.busy(), -self.info.load.free_blocks if self.info is not None else 0)

    def queue_key(self) -> tuple[int, ...]:
        """``policy.prefill_cost`` without the prompt: what P computes before a new prompt."""
        return (self.prefill_tokens + QUEUE_TOKENS * self.busy(),)

    def summary(self) -> dict[str, Any]:
        info = self.info
        return {
            "url": self.url,
            "healthy": self.healthy,
            "draining": self.draining,
            "engine_id": info.engine_id if info else None,
            "inflight": self.inflight,
            "sent": self.sent,
            "prefill_tokens": self.prefill_tokens,
            "load": vars(info.load) if info else None,
            "error": self.error,
        }


def _load_key(state: EngineState) -> tuple[int, ...]:
    return state.load_key()


def _queue_key(state: EngineState) -> tuple[int, ...]:
    return state.queue_key()


def _pickable(state: EngineState) -> bool:
    return state.pickable


class EngineRegistry:
    def __init__(
        self,
        client: EngineClient,
        prefill: Sequence[str],
        decode: Sequence[str],
        timeout_s: float,
        kind: EngineKind = EngineKind.KVWIRE,
    ) -> None:
        self._client = client
        self._timeout_s = timeout_s
        self.kind = kind
        self.engines: dict[Role, list[EngineState]] = {
            role: [self._state(url, role) for url in urls]
            for role, urls in ((Role.PREFILL, prefill), (Role.DECODE, decode))
        }
        self._by_url = {e.url: e for states in self.engines.values() for e in states}
        self._by_load: dict[Role, Ranking[EngineState]] = {r: Ranking(_load_key, _pickable) for r in Role}
        self._by_queue: dict[Role, Ranking[EngineState]] = {r: Ranking(_queue_key, _pickable) for r in Role}
        self._rotation: dict[Role, list[EngineState] | None] = {r: None for r in Role}  # None: to rebuild
        self._turn = {r: 0 for r in Role}
        # What each P probably holds in its prefix cache (kept under every policy, to report hit rates).
        self.prefix = PrefixIndex()
        # Prompt blocks sent to P, and of those the ones P was believed to hold (``/health``).
        self.prefix_blocks = {"hit": 0, "total": 0}

    def _state(self, url: str, role: Role) -> EngineState:
        base, fragment = split_fragment(url)
        if self.kind is EngineKind.KVWIRE:
            if fragment:
                raise ConfigError(f"engine URL {url}: a #fragment is only for --engines vllm")
            return EngineState(base, role)
        return EngineState(base, role, static_info(url, role))

    async def _fetch(self, state: EngineState) -> HealthInfo:
        status, body = await self._client.get(f"{state.url}/health", self._timeout_s)
        if status != 200:
            raise ValueError(f"/health answered {status}")
        if state.static is None:
            return HealthInfo.parse(json_object(body))
        # vLLM: healthy when /health is 200; its served model names come from /v1/models.
        status, body = await self._client.get(f"{state.url}/v1/models", self._timeout_s, api_key=True)
        if status != 200:
            raise ValueError(f"/v1/models answered {status}")
        names = [str(m["id"]) for m in json_object(body).get("data", [])]
        return dataclasses.replace(state.static, model=names[0] if names else "")

    def pair_problems(self, mode: TransferMode) -> list[str]:
        """Every distinct reason a healthy P and a healthy D cannot work together (for ``/health``)."""
        infos = {
            role: [e.info for e in states if e.healthy and e.info is not None]
            for role, states in self.engines.items()
        }
        found = (pair_problem(p, d, mode) for p in infos[Role.PREFILL] for d in infos[Role.DECODE])
        return sorted({problem for problem in found if problem is not None})

    def get(self, url: str) -> EngineState:
        return self._by_url[url]

    def views(self, role: Role) -> list[EngineView]:
        return [e.view() for e in self.engines[role]]

    # -- picks ---------------------------------------------------------------------------------------------
    def _touch(self, state: EngineState) -> None:
        """The state's load, health or membership may have changed: re-rank it."""
        role, ranks = state.role, (self._by_load[state.role], self._by_queue[state.role])
        if state.pickable:
            if state.url not in self._by_load[role]:
                self._rotation[role] = None
            for rank in ranks:
                rank.update(state)
        elif state.url in self._by_load[role]:
            self._rotation[role] = None
            for rank in ranks:
                rank.remove(state.url)

    def pick(
        self, role: Role, policy: Policy, hashes: Sequence[bytes] = (), prompt_tokens: int = 0
    ) -> EngineView:
        """One engine for a request by ``policy`` (``policy.Picker``'s rules): O(1) for round robin and
        least loaded, and for prefix aware O(blocks + the Ps holding the prompt's first block)."""
        turn = self._turn[role]
        self._turn[role] = turn + 1
        if policy is Policy.ROUND_ROBIN:
            rotation = self._rotation[role]
            if rotation is None:
                rotation = self._rotation[role] = [s for s in self.engines[role] if s.pickable]
            if not rotation:
                raise NoHealthyEngine(role)
            chosen = rotation[turn % len(rotation)]
            if not chosen.pickable:  # changed without a _touch (tests set fields): look again
                self._rotation[role] = None
                return self.pick(role, policy, hashes, prompt_tokens)
            return chosen.view()
        if policy is Policy.PREFIX_AWARE and role is Role.PREFILL:
            return self._cheapest_prefill(hashes, prompt_tokens).view()
        best = self._by_load[role].best()
        if best is None:
            raise NoHealthyEngine(role)
        return best.view()

    def _cheapest_prefill(self, hashes: Sequence[bytes], prompt_tokens: int) -> EngineState:
        """The lowest ``prefill_cost``: the P with the shortest queue (the ranking's top), unless a P
        holding some of the prompt costs less (only those are looked at)."""
        best = self._by_queue[Role.PREFILL].best()
        if best is None:
            raise NoHealthyEngine(Role.PREFILL)
        held = self.prefix.overlaps(hashes)

        def cost(state: EngineState) -> int:
            return prefill_cost(state.view(), held.get(state.url, 0) * BLOCK_TOKENS, prompt_tokens)

        best_cost = cost(best)
        for url in held:
            state = self._by_url.get(url)
            if state is not None and state.role is Role.PREFILL and state.pickable:
                c = cost(state)
                if c < best_cost:
                    best, best_cost = state, c
        return best

    def models(self) -> set[str]:
        return {e.info.model for e in self._by_url.values() if e.info is not None and e.info.model}

    async def check(self, state: EngineState) -> None:
        """Fetch one engine's ``/health`` and update its state (never raises for the engine's faults)."""
        try:
            info = await self._fetch(state)
            if info.role != state.role.value:
                raise ValueError(f"configured as {state.role.value} but reports role {info.role!r}")
        except (aiohttp.ClientError, TimeoutError, KeyError, TypeError, ValueError) as exc:
            if state.healthy or state.error is None:
                log.warning("%s engine %s unhealthy: %s", state.role.value, state.url, exc)
            state.healthy, state.error = False, str(exc) or type(exc).__name__
        else:
            if state.info is not None and state.info.incarnation != info.incarnation:
                self.prefix.forget(state.url)  # a new life: its prefix cache starts empty
            if not state.healthy:
                log.info("%s engine %s healthy (engine_id %s)", state.role.value, state.url, info.engine_id)
            state.healthy, state.info, state.error = True, info, None
            self._size_prefix(state)
        state.checked_at = time.monotonic()
        self._touch(state)

    async def check_all(self, role: Role | None = None) -> None:
        states = [*self._by_url.values()] if role is None else [*self.engines[role]]
        await asyncio.gather(*(self.check(s) for s in states))

    def suspect(self, url: str) -> None:
        """A leg to this engine failed: re-check its health now, in the background (deduplicated)."""
        state = self._by_url.get(url)
        if state is None:
            return  # it left the fleet meanwhile
        if state._refreshing is None or state._refreshing.done():
            state._refreshing = asyncio.create_task(self.check(state))

    async def recheck(self, url: str) -> None:
        """Check this engine's health now and wait for the answer (before picking again)."""
        state = self._by_url.get(url)
        if state is not None:
            await self.check(state)

    def in_view(self, url: str) -> bool:
        """Whether the engine is still in the fleet (a discovered one may leave while a request awaits)."""
        state = self._by_url.get(url)
        return state is not None and state.in_fleet

    async def info_of(self, url: str) -> HealthInfo | None:
        state = self._by_url.get(url)
        if state is None:
            return None  # it left the fleet while the request was being placed
        if state.info is None:
            await self.check(state)
        return state.info if state.healthy else None

    # The counts below tolerate a URL already forgotten: the engine left the fleet, and the request that
    # ends on it has nothing left to count.
    def begin(self, *urls: str) -> None:
        """Count a request this router sent to these engines (least-loaded picks see it at once)."""
        for state in filter(None, map(self._by_url.get, urls)):
            state.inflight += 1
            state.sent += 1
            self._touch(state)

    def end(self, *urls: str) -> None:
        for url in urls:
            state = self._by_url.get(url)
            if state is not None:
                state.inflight -= 1
                self._touch(state)
                self._drop_if_gone(url)

    def prefill_begin(self, url: str, tokens: int) -> None:
        """A prompt of ``tokens`` was sent to this engine to prefill (conditional routing compares them)."""
        state = self._by_url.get(url)
        if state is not None:
            state.prefill_tokens += tokens
            self._touch(state)

    def prefill_end(self, url: str, tokens: int) -> None:
        state = self._by_url.get(url)
        if state is not None:
            state.prefill_tokens -= tokens
            self._touch(state)
            self._drop_if_gone(url)

    def prefix_sent(self, url: str, hashes: list[bytes]) -> None:
        """A prompt goes to P ``url``: count the blocks it was believed to hold, then record them there."""
        if not self.in_view(url):
            return  # it left the fleet (its index was forgotten): recording would leak its entries
        self.prefix_blocks["hit"] += self.prefix.overlap(url, hashes)
        self.prefix_blocks["total"] += len(hashes)
        self.prefix.record(url, hashes)

    def cached_tokens(self, hashes: list[bytes]) -> dict[str, int]:
        """Per P URL, the leading tokens of the prompt it is believed to hold."""
        return {url: n * BLOCK_TOKENS for url, n in self.prefix.overlaps(hashes).items()}

    # -- discovery ---------------------------------------------------------------------------------------
    def sync(self, found: Mapping[tuple[Role, str], HealthInfo], draining: Mapping[str, bool]) -> None:
        """Make the discovered engines exactly ``found`` (static ones stay). A new engine, or a new life
        (incarnation) of a known one, is healthy at once: it registered once it served."""
        for (role, url), info in found.items():
            state = self._by_url.get(url)
            if state is None or state.role is not role:
                state = self._by_url[url] = self._discovered(url, role, state)
            if self.kind is EngineKind.VLLM:
                # A vLLM engine's identity is its record's, every life of it: its /health says nothing of
                # it, so a poll must not bring back the static of a previous life. Keep the served model
                # name /v1/models gave (the record's is the compat id) while the life is the same.
                state.static = info
                if state.info is not None and state.info.incarnation == info.incarnation:
                    info = dataclasses.replace(info, model=state.info.model)
            if not state.in_fleet:
                state.in_fleet = True
                self.engines[role].append(state)
            if state.info is None or state.info.incarnation != info.incarnation:
                if state.info is not None:
                    log.info("%s engine %s: new life (incarnation %s)", role.value, url, info.incarnation)
                    self.prefix.forget(url)
                state.healthy, state.error = True, None
            state.info, state.draining = info, draining.get(url, False)
            self._size_prefix(state)
            self._touch(state)
        for role, states in self.engines.items():
            for state in [s for s in states if s.discovered and (role, s.url) not in found]:
                log.info("%s engine %s left the fleet", role.value, state.url)
                states.remove(state)
                state.healthy = state.in_fleet = False
                self._touch(state)
                self.prefix.forget(state.url)
                self._drop_if_gone(state.url)

    @staticmethod
    def _discovered(url: str, role: Role, old: EngineState | None) -> EngineState:
        """A discovered engine's state; one that changed role keeps its counts of requests in flight,
        which end (by URL) on the new state."""
        state = EngineState(url, role, discovered=True, in_fleet=False)
        if old is not None:
            state.inflight, state.prefill_tokens = old.inflight, old.prefill_tokens
        return state

    def _size_prefix(self, state: EngineState) -> None:
        if state.role is Role.PREFILL and state.info is not None and state.info.kv_tokens > 0:
            self.prefix.set_capacity(state.url, state.info.kv_tokens // BLOCK_TOKENS)

    def _drop_if_gone(self, url: str) -> None:
        """Forget a departed engine once no request of ours is on it (the table stays bounded)."""
        state = self._by_url.get(url)
        if state is None or not state.discovered or state.in_fleet:
            return
        if state.inflight <= 0 and state.prefill_tokens <= 0:
            del self._by_url[url]

    async def poll(self, interval_s: float, stop: asyncio.Event) -> None:
        """Re-check every engine each ``interval_s`` until ``stop`` is set."""
        while not stop.is_set():
            await self.check_all()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=interval_s)

    async def close(self) -> None:
        pending = [s._refreshing for s in self._by_url.values() if s._refreshing and not s._refreshing.done()]
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)

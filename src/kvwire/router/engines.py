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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from kvwire.config import Policy
from kvwire.protocol.messages import TransferMode
from kvwire.router import dialects
from kvwire.router.dialects import DEFAULT_KIND
from kvwire.router.health import HealthInfo as HealthInfo
from kvwire.router.health import split_fragment
from kvwire.router.http import EngineClient
from kvwire.router.openai_api import ApiError, ErrorType
from kvwire.router.policy import (
    EngineView,
    Load,
    NoHealthyEngine,
    Role,
    fitting_pair,
    load_order,
    prefill_cost,
    queued_tokens,
)
from kvwire.router.prefix import BLOCK_TOKENS, PrefixIndex
from kvwire.router.ranking import Ranking

log = logging.getLogger(__name__)
_NO_LOAD = Load()  # an engine that has not reported yet


def pair_problem(p: HealthInfo, d: HealthInfo, mode: TransferMode) -> str | None:
    """Why this P and this D cannot serve a request together, whatever the retries (None: they can): a
    setting that differs, which only a restart with the same settings mends (``compat_problem`` aside)."""
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


def compat_problem(p: HealthInfo, d: HealthInfo) -> str | None:
    """Why this P's KV cannot go to this D: their compat hashes (both known) differ, so D's handshake would
    refuse P (``IncompatiblePeer``). Two generations of a rolling upgrade: each pairs within its own."""
    if not p.compat or not d.compat or p.compat == d.compat:
        return None
    return (
        f"prefill engine {p.engine_id} and decode engine {d.engine_id} have different compat hashes "
        f"({p.compat[:12]} and {d.compat[:12]}: model, KV layout, transfer mode or kvwire version differ), "
        "so no KV can move between them: during an upgrade keep a prefill and a decode engine of each "
        "generation serving"
    )


def pair_fits(p: HealthInfo, d: HealthInfo, mode: TransferMode) -> bool:
    return pair_problem(p, d, mode) is None and compat_problem(p, d) is None


Profile = tuple[object, ...]


def profile(info: HealthInfo) -> Profile:
    """The fields ``pair_fits`` reads: engines of one profile pair alike (a fleet has a few)."""
    return (info.mode, info.authenticated, info.model, info.seed, info.compat)


@dataclass
class EngineState:
    url: str  # without the fragment: what legs are sent to
    role: Role
    static: HealthInfo | None = None  # identity from the configured URL or record (``Dialect.static_info``)
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
    seen_profile: Profile | None = field(default=None, repr=False)  # as of the last ``_touch``

    @property
    def load(self) -> Load:
        return self.info.load if self.info is not None else _NO_LOAD

    def view(self) -> EngineView:
        return EngineView(
            self.url, self.healthy and not self.draining, self.load, self.inflight, self.prefill_tokens
        )

    @property
    def pickable(self) -> bool:
        return self.in_fleet and self.healthy and not self.draining

    def load_key(self) -> tuple[int, ...]:
        return load_order(self.load, self.inflight)

    def queue_key(self) -> tuple[int, ...]:
        return (queued_tokens(self.prefill_tokens, self.load, self.inflight),)

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


@dataclass(frozen=True)
class _Pairing:
    mode: TransferMode
    ps: dict[Profile, list[EngineState]]
    ds: dict[Profile, list[EngineState]]
    fitting: set[tuple[Profile, Profile]]
    every_pair_fits: bool


class EngineRegistry:
    def __init__(
        self,
        client: EngineClient,
        prefill: Sequence[str],
        decode: Sequence[str],
        timeout_s: float,
        kind: str = DEFAULT_KIND,
    ) -> None:
        self._client = client
        self._timeout_s = timeout_s
        self.kind = kind
        self.dialect = dialects.lookup(kind)
        self.engines: dict[Role, list[EngineState]] = {
            role: [self._state(url, role) for url in urls]
            for role, urls in ((Role.PREFILL, prefill), (Role.DECODE, decode))
        }
        self._by_url = {e.url: e for states in self.engines.values() for e in states}
        self._by_load: dict[Role, Ranking[EngineState]] = {r: Ranking(_load_key, _pickable) for r in Role}
        self._by_queue: dict[Role, Ranking[EngineState]] = {r: Ranking(_queue_key, _pickable) for r in Role}
        self._rotation: dict[Role, list[EngineState] | None] = {r: None for r in Role}  # None: to rebuild
        self._turn = {r: 0 for r in Role}
        self._refits = 0  # picks made again for a pair that fits (``fitting_pair``'s rotation)
        self._pairing: _Pairing | None = None  # the pickable engines by profile; None: to judge again
        # What each P probably holds in its prefix cache (kept under every policy, to report hit rates).
        self.prefix = PrefixIndex()
        # Prompt blocks sent to P, and of those the ones P was believed to hold (``/health``).
        self.prefix_blocks = {"hit": 0, "total": 0}
        self._rechecks: dict[Role, asyncio.Task[None]] = {}  # recheck(role) in flight, shared
        self.active = 0  # requests between begin and end
        self.max_active = 1 << 30  # the router's --max-requests

    def _state(self, url: str, role: Role) -> EngineState:
        return EngineState(split_fragment(url)[0], role, self.dialect.static_info(url, role))

    async def _fetch(self, state: EngineState) -> HealthInfo:
        return await self.dialect.fetch(self._client, state.url, state.static, self._timeout_s)

    def _profiles(self, role: Role, pickable: bool) -> dict[Profile, list[EngineState]]:
        """The healthy (with ``pickable``: and not draining) engines of a role, by profile."""
        out: dict[Profile, list[EngineState]] = {}
        for e in self.engines[role]:
            if (e.pickable if pickable else e.healthy) and e.info is not None:
                out.setdefault(profile(e.info), []).append(e)
        return out

    def pair_problems(self, mode: TransferMode) -> tuple[list[str], bool]:
        """Every distinct reason a healthy P and a healthy D cannot work together, and whether some P and D
        that may be picked can (for ``/health``). Judged once per pair of profiles, not per pair of
        engines: 2,048 x 2,048 engines took 1.3 s of the router's loop at each probe."""
        out = set()
        ps_by, ds_by = self._profiles(Role.PREFILL, False), self._profiles(Role.DECODE, False)
        for ps in ps_by.values():
            for ds in ds_by.values():
                p, d = ps[0].info, ds[0].info
                assert p is not None and d is not None  # _profiles keeps only engines with info
                problem = pair_problem(p, d, mode) or compat_problem(p, d)
                alike = len(ps) * len(ds) - 1
                if problem is not None:
                    out.add(problem if not alike else f"{problem} (and {alike} other pairs alike)")
        return sorted(out), bool(self._live_fitting(self._pairing_of(mode)))

    @staticmethod
    def _fitting(
        mode: TransferMode, ps: Mapping[Profile, list[EngineState]], ds: Mapping[Profile, list[EngineState]]
    ) -> set[tuple[Profile, Profile]]:
        """The (P profile, D profile) pairs that can work together."""
        out = set()
        for pk, p_group in ps.items():
            for dk, d_group in ds.items():
                p, d = p_group[0].info, d_group[0].info
                if p is not None and d is not None and pair_fits(p, d, mode):
                    out.add((pk, dk))
        return out

    def get(self, url: str) -> EngineState:
        return self._by_url[url]

    def views(self, role: Role) -> list[EngineView]:
        return [e.view() for e in self.engines[role]]

    # -- picks ---------------------------------------------------------------------------------------------
    def _touch(self, state: EngineState) -> None:
        """The state's load, health or membership may have changed: re-rank it."""
        role, ranks = state.role, (self._by_load[state.role], self._by_queue[state.role])
        key = profile(state.info) if state.info is not None else None
        if key != state.seen_profile:  # a new life of another kind (an upgrade): pairs to judge again
            state.seen_profile, self._pairing = key, None
        if state.pickable:
            if state.url not in self._by_load[role]:
                self._rotation[role] = self._pairing = None
            for rank in ranks:
                rank.update(state)
        elif state.url in self._by_load[role]:
            self._rotation[role] = self._pairing = None
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

    def pick_pair(
        self, policy: Policy, hashes: Sequence[bytes] = (), prompt_tokens: int = 0
    ) -> tuple[EngineView, EngineView]:
        """``pick``'s P and D (``NoHealthyEngine`` when a role has none); whether they can work together is
        ``fitting_pair``'s, asked next (the router decides where to prefill on the pair it returns)."""
        return (
            self.pick(Role.PREFILL, policy, hashes, prompt_tokens),
            self.pick(Role.DECODE, policy, hashes, prompt_tokens),
        )

    def fitting_pair(
        self,
        p: EngineView,
        d: EngineView,
        policy: Policy,
        mode: TransferMode,
        hashes: Sequence[bytes] = (),
        prompt_tokens: int = 0,
    ) -> tuple[EngineView, EngineView]:
        """A P and a D that can work together (``pair_fits``). In a fleet whose pickable engines all can
        (one generation): ``p`` and ``d``, ``pick``'s O(1) picks. In a mixed one (a rolling upgrade): the
        policy's pair among those that can (``policy.fitting_pair``, O(engines); every request, not only
        those whose picks do not fit, which would leave the picks' rhythm to starve some engines). When
        none can: ``p`` and ``d`` all the same, which the caller refuses by ``pair_problem`` or
        ``compat_problem`` (they name the cause)."""
        pairing = self._pairing_of(mode)
        if pairing.every_pair_fits:
            return p, d
        views = {
            role: {k: [e.view() for e in g if e.pickable] for k, g in groups.items()}
            for role, groups in ((Role.PREFILL, pairing.ps), (Role.DECODE, pairing.ds))
        }
        ps, ds = views[Role.PREFILL], views[Role.DECODE]
        fitting = self._live_fitting(pairing)
        if not fitting:
            return p, d
        self._refits += 1
        cached = self.cached_tokens(list(hashes)) if policy is Policy.PREFIX_AWARE else {}
        return fitting_pair(policy, ps, ds, fitting, self._refits, cached, prompt_tokens)

    @staticmethod
    def _live_fitting(pairing: _Pairing) -> list[tuple[Profile, Profile]]:
        """The pairing's fitting profile pairs that still have a pickable engine on both sides (a state
        changed without ``_touch``, as tests do, is not picked)."""

        def live(group: list[EngineState]) -> bool:
            return any(e.pickable for e in group)

        return [(pk, dk) for pk, dk in pairing.fitting if live(pairing.ps[pk]) and live(pairing.ds[dk])]

    def _pairing_of(self, mode: TransferMode) -> _Pairing:
        """The pickable engines by profile and which profiles pair, judged again only when an engine
        joins, leaves, goes down or up, or comes back as another kind (``_touch``)."""
        if self._pairing is None or self._pairing.mode is not mode:
            ps, ds = self._profiles(Role.PREFILL, True), self._profiles(Role.DECODE, True)
            fitting = self._fitting(mode, ps, ds)
            self._pairing = _Pairing(mode, ps, ds, fitting, len(fitting) == len(ps) * len(ds))
        return self._pairing

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
            if not info.compat and state.info is not None and state.info.incarnation == info.incarnation:
                # An engine whose /health says no compat hash (an older kvwire): its record's holds.
                info = dataclasses.replace(info, compat=state.info.compat)
            if not state.healthy:
                log.info("%s engine %s healthy (engine_id %s)", state.role.value, state.url, info.engine_id)
            state.healthy, state.info, state.error = True, info, None
            self._size_prefix(state)
        state.checked_at = time.monotonic()
        self._touch(state)

    async def recheck_role(self, role: Role) -> None:
        """``check_all(role)``, one at a time: a burst of requests finding no healthy engine (every engine
        down) shares one round of checks instead of each starting its own."""
        task = self._rechecks.get(role)
        if task is None or task.done():
            task = self._rechecks[role] = asyncio.create_task(self.check_all(role))
        await asyncio.shield(task)

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
        """Count a request this router sends to these engines (least-loaded picks see it at once), before
        its legs start; ``ApiError`` (503) when ``max_active`` requests are already in flight."""
        if self.active >= self.max_active:
            raise ApiError(
                ErrorType.UNAVAILABLE,
                f"the router has {self.active} requests in flight, its limit (--max-requests): retry, add a "
                "router, or raise the limit",
            )
        self.active += 1
        for state in filter(None, map(self._by_url.get, urls)):
            state.inflight += 1
            state.sent += 1
            self._touch(state)

    def end(self, *urls: str) -> None:
        """The end of a request ``begin`` counted (with the same engines)."""
        self.active -= 1
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
        (incarnation) of a known one, or one back in the fleet (its lease lapsed and it registered again), is
        healthy at once: it registered once it served. A URL listed under both roles (a P killed and a D
        started at its address within the lease, or a wrong advertised URL) keeps the role it has here, else
        prefill's, until one record goes: one state per URL, whatever the records say."""
        found = self._one_role_per_url(found)
        for (role, url), info in found.items():
            state = self._by_url.get(url)
            if state is None or state.role is not role:
                state = self._by_url[url] = self._discovered(url, role, state)
            if self.dialect.identity_from_records:
                # Such an engine's identity (vLLM's) is its record's, every life of it: its /health says
                # nothing of it, so a poll must not bring back the static of a previous life. Keep the served
                # model name /v1/models gave (the record's is the compat id) while the life is the same.
                state.static = info
                if state.info is not None and state.info.incarnation == info.incarnation:
                    info = dataclasses.replace(info, model=state.info.model)
            back = not state.in_fleet
            if back:
                state.in_fleet = True
                self.engines[role].append(state)
            if back or state.info is None or state.info.incarnation != info.incarnation:
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

    def _one_role_per_url(
        self, found: Mapping[tuple[Role, str], HealthInfo]
    ) -> dict[tuple[Role, str], HealthInfo]:
        out: dict[tuple[Role, str], HealthInfo] = {}
        for (role, url), info in found.items():
            other = Role.DECODE if role is Role.PREFILL else Role.PREFILL
            if (other, url) in found:
                state = self._by_url.get(url)
                keep = state.role if state is not None and state.in_fleet else Role.PREFILL
                if role is not keep:
                    log.warning("%s is listed as prefill and as decode: kept as %s", url, keep.value)
                    continue
            out[(role, url)] = info
        return out

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
            # A check of it after ``sync`` forgot its index sized it again (``_size_prefix``): one entry per
            # departed URL for good, with engines that come and go under new addresses (found by a review).
            self.prefix.forget(url)

    async def poll(self, interval_s: float, stop: asyncio.Event) -> None:
        """Re-check every engine each ``interval_s`` until ``stop`` is set."""
        while not stop.is_set():
            try:
                await self.check_all()
            except Exception:  # a bug in one check must not end health checking for the whole fleet
                log.exception("router: a health round failed; checking again in %.1f s", interval_s)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=interval_s)

    async def close(self) -> None:
        pending = [s._refreshing for s in self._by_url.values() if s._refreshing and not s._refreshing.done()]
        pending += [task for task in self._rechecks.values() if not task.done()]
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)

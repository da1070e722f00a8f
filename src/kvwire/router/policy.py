"""Which prefill (P) and decode (D) engine serves a request: pure, no I/O.

The router keeps one ``EngineView`` per configured engine (refreshed from its ``/health``) and asks a
``Picker`` for one P and one D per request. Round robin rotates over the healthy engines of a role; least
loaded takes the engine with the fewest running + waiting requests (as last reported, plus the requests this
router has sent it since), breaking ties by the most free blocks, then by rotation so that equal engines
share the work.

Prefix aware (``Policy.PREFIX_AWARE``) picks P by ``prefill_cost``: the prompt tokens P would compute
before this request's first token, i.e. the tokens this router already queued there (``prefill_tokens``)
plus this prompt's tokens that P does not hold in its prefix cache (``PrefixIndex.overlap``), plus
``QUEUE_TOKENS`` per request P reports running or waiting (other routers' work, decode steps). The lowest
cost wins; equal costs rotate. D is the least loaded (fewest requests, then most free KV blocks): a decode
engine's cost is its batch, and the KV it receives never hits a cache.

Under ``Disaggregation.CONDITIONAL`` the router also decides, per request, where its prompt is prefilled
(``decide_prefill``): on D itself when the prompt is short, or when P's prefill queue is longer than D's;
otherwise on P, with the KV sent to D.
"""

from __future__ import annotations

import enum
from collections.abc import Collection, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

from kvwire.config import Disaggregation, Policy
from kvwire.errors import KvwireError


class Role(enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"


class NoHealthyEngine(KvwireError):
    """Every configured engine of a role is down (or none is configured)."""

    def __init__(self, role: Role) -> None:
        super().__init__(f"no healthy {role.value} engine")
        self.role = role


@dataclass(frozen=True)
class Load:
    running: int = 0
    waiting: int = 0
    free_blocks: int = 0


@dataclass(frozen=True)
class EngineView:
    """What the policy may look at: an engine's URL, health, last reported load and our in-flight count."""

    url: str
    healthy: bool
    load: Load = Load()
    inflight: int = 0
    # Prompt tokens of this router's requests sent to the engine and not yet prefilled there: its prefill
    # queue as this router knows it now (``/health``'s load is up to a poll interval old).
    prefill_tokens: int = 0


# What one request running or waiting on P costs a new one, in prompt tokens (one block's worth: a request
# in the batch slows every step a little; the prompt tokens dominate when they are known).
QUEUE_TOKENS = 16


class Picker:
    """Picks one engine per call. Keeps only a rotation counter (per role) as state."""

    def __init__(self, policy: Policy) -> None:
        self.policy = policy
        self._turn: dict[Role, int] = {Role.PREFILL: 0, Role.DECODE: 0}

    def pick(
        self,
        role: Role,
        engines: Sequence[EngineView],
        cached_tokens: Mapping[str, int] | None = None,
        prompt_tokens: int = 0,
    ) -> EngineView:
        """``cached_tokens``: per P URL, the prompt's tokens it holds (prefix aware P picks only)."""
        healthy = [e for e in engines if e.healthy]
        if not healthy:
            raise NoHealthyEngine(role)
        turn = self._turn[role]
        self._turn[role] = turn + 1
        if self.policy is Policy.ROUND_ROBIN:
            return healthy[turn % len(healthy)]
        if self.policy is Policy.PREFIX_AWARE and role is Role.PREFILL:
            return cheapest_prefill(healthy, cached_tokens or {}, prompt_tokens, turn)
        return least_loaded(healthy, turn)


def busy_of(load: Load, inflight: int) -> int:
    """Requests an engine is working on: its last report, or what we sent it since, whichever is more."""
    return max(load.running + load.waiting, inflight)


def load_order(load: Load, inflight: int) -> tuple[int, int]:
    """``least_loaded``'s key: fewest requests, then most free blocks (the router's rankings use it too)."""
    return (busy_of(load, inflight), -load.free_blocks)


def queued_tokens(prefill_tokens: int, load: Load, inflight: int) -> int:
    """``prefill_cost`` before the prompt: what P computes ahead of a new request."""
    return prefill_tokens + QUEUE_TOKENS * busy_of(load, inflight)


def busy(engine: EngineView) -> int:
    return busy_of(engine.load, engine.inflight)


def least_loaded(engines: Sequence[EngineView], turn: int = 0) -> EngineView:
    """The least busy engine; ties go to the most free blocks, then to rotation by ``turn``."""
    if not engines:
        raise ValueError("least_loaded needs at least one engine")
    n = len(engines)
    order = [engines[(turn + i) % n] for i in range(n)]
    # min() keeps the first of equal keys, so rotating the list first spreads ties.
    return min(order, key=lambda e: load_order(e.load, e.inflight))


def prefill_cost(engine: EngineView, cached_tokens: int, prompt_tokens: int) -> int:
    """Prompt tokens ``engine`` computes before this request's first token (see the module's text)."""
    return queued_tokens(engine.prefill_tokens, engine.load, engine.inflight) + max(
        0, prompt_tokens - cached_tokens
    )


def cheapest_prefill(
    engines: Sequence[EngineView], cached_tokens: Mapping[str, int], prompt_tokens: int, turn: int = 0
) -> EngineView:
    n = len(engines)
    order = [engines[(turn + i) % n] for i in range(n)]
    return min(order, key=lambda e: prefill_cost(e, cached_tokens.get(e.url, 0), prompt_tokens))


K = TypeVar("K", bound=Hashable)


def fitting_pair(
    policy: Policy,
    ps: Mapping[K, Sequence[EngineView]],
    ds: Mapping[K, Sequence[EngineView]],
    fitting: Collection[tuple[K, K]],
    turn: int,
    cached_tokens: Mapping[str, int] | None = None,
    prompt_tokens: int = 0,
) -> tuple[EngineView, EngineView]:
    """A P and a D the policy takes among the pairs of groups that ``fitting`` allows (a mixed fleet: each
    group, one generation; ``ps``/``ds`` hold pickable engines). Round robin: the ``turn``-th P able to pair,
    and D rotating once per round of the Ps (so no D is starved by the Ps' rhythm). Otherwise each group's
    best P (least loaded; prefix aware: ``prefill_cost``) and best D (least loaded), and of those pairs the
    one costing least as a whole: P's and D's requests (prefix aware: P's cost in prompt tokens plus
    ``QUEUE_TOKENS`` per request on D), so a pair is not taken for an idle P in front of a busy D."""
    pairs = sorted(fitting, key=lambda f: (_first_url(ps[f[0]]), _first_url(ds[f[1]])))
    if policy is Policy.ROUND_ROBIN:
        p_ok = [(k, e) for k in dict.fromkeys(pk for pk, _ in pairs) for e in ps[k]]
        p_key, p = p_ok[turn % len(p_ok)]
        d_ok = [e for pk, dk in pairs if pk == p_key for e in ds[dk]]
        return p, d_ok[(turn // len(p_ok)) % len(d_ok)]
    cached = cached_tokens or {}
    prefix = policy is Policy.PREFIX_AWARE

    def best_p(group: Sequence[EngineView]) -> EngineView:
        return cheapest_prefill(group, cached, prompt_tokens, turn) if prefix else least_loaded(group, turn)

    def cost(p: EngineView, d: EngineView) -> int:
        if prefix:
            return prefill_cost(p, cached.get(p.url, 0), prompt_tokens) + QUEUE_TOKENS * busy(d)
        return busy(p) + busy(d)

    best = [(best_p(ps[pk]), least_loaded(ds[dk], turn)) for pk, dk in pairs]
    n = len(best)
    return min((best[(turn + i) % n] for i in range(n)), key=lambda pd: cost(*pd))


def _first_url(group: Sequence[EngineView]) -> str:
    return group[0].url if group else ""


class PrefillSite(enum.Enum):
    REMOTE = "remote"  # P prefills, D receives the KV
    LOCAL = "local"  # D prefills the request itself, as a colocated engine would


class PrefillReason(enum.Enum):
    ALWAYS = "always"  # the router disaggregates every request
    SHORT_PROMPT = "short_prompt"  # at most local_prefill_max_tokens: the transfer would cost more
    PREFILL_QUEUE = "prefill_queue"  # P has more prompt tokens waiting to be prefilled than D
    LONG_PROMPT = "long_prompt"  # long, and P is no busier than D: disaggregate


@dataclass(frozen=True)
class PrefillDecision:
    site: PrefillSite
    reason: PrefillReason


def decide_prefill(
    mode: Disaggregation, prompt_tokens: int, p: EngineView, d: EngineView, local_max_tokens: int
) -> PrefillDecision:
    """Where one request is prefilled. Queues are compared in prompt tokens, not requests: one long
    prompt waiting on P delays a new request more than a few short ones waiting on D."""
    if mode is Disaggregation.ALWAYS:
        return PrefillDecision(PrefillSite.REMOTE, PrefillReason.ALWAYS)
    if prompt_tokens <= local_max_tokens:
        return PrefillDecision(PrefillSite.LOCAL, PrefillReason.SHORT_PROMPT)
    if p.prefill_tokens > d.prefill_tokens:
        return PrefillDecision(PrefillSite.LOCAL, PrefillReason.PREFILL_QUEUE)
    return PrefillDecision(PrefillSite.REMOTE, PrefillReason.LONG_PROMPT)


def prompt_tokens(prompt: str | Sequence[int], bytes_per_token: float) -> int:
    """A prompt's length in tokens: exact for token ids; for text, its UTF-8 bytes over
    ``bytes_per_token`` plus one (BOS). kvwire's reference engines tokenize bytes (1.0: exact); a vLLM
    engine's tokenizer is not known to the router, so its count is an estimate."""
    if not isinstance(prompt, str):
        return len(prompt)
    return int(len(prompt.encode()) / bytes_per_token) + 1

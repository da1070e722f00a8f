"""The router's ranked picks: a lazy heap per role that keeps engines in pick order as loads change, so
a pick costs the same at 2 engines as at 64, and picks the same engines as ``policy.Picker``'s rules."""

from __future__ import annotations

import random
import statistics
from dataclasses import dataclass

import pytest

from kvwire.config import Policy
from kvwire.router.engines import EngineRegistry, HealthInfo
from kvwire.router.http import EngineClient
from kvwire.router.policy import Load, Picker, Role, busy, prefill_cost
from kvwire.router.prefix import block_hashes
from kvwire.router.ranking import Ranking
from kvwire_tools.bench.fleet_cost import pick_us


@dataclass
class Item:
    url: str
    key: int
    up: bool = True


def test_ranking_follows_changes_and_drops_what_left() -> None:
    items = [Item(f"u{i}", k) for i, k in enumerate((5, 3, 9))]
    rank: Ranking[Item] = Ranking(lambda it: (it.key,), lambda it: it.up)
    for it in items:
        rank.update(it)
    assert rank.best() is items[1]
    items[1].key = 10
    rank.update(items[1])
    assert rank.best() is items[0]
    rank.remove("u0")
    assert rank.best() is items[2]
    items[2].key = 20  # changed without an update: found moved at the top, put back where it belongs
    assert rank.best() is items[1]
    items[1].up = False  # went down without an update: never picked
    assert rank.best() is items[2]
    assert len(rank) == 1 and "u1" not in rank


def test_ranking_rotates_equal_keys_and_stays_bounded() -> None:
    items = [Item(f"u{i}", 0) for i in range(3)]
    rank: Ranking[Item] = Ranking(lambda it: (it.key,))
    for it in items:
        rank.update(it)
    order = []
    for _ in range(6):  # pick, send (key up), end (key down): equal engines take turns
        chosen = rank.best()
        assert chosen is not None
        order.append(chosen.url)
        chosen.key += 1
        rank.update(chosen)
        chosen.key -= 1
        rank.update(chosen)
    assert order == ["u0", "u1", "u2"] * 2
    for _ in range(10_000):
        it = random.choice(items)
        it.key = random.randint(0, 5)
        rank.update(it)
    assert len(rank._heap) <= 4 * len(items) + 64


def _registry(n: int, seed: int) -> EngineRegistry:
    rng = random.Random(seed)
    reg = EngineRegistry(EngineClient(1.0, 1.0, None), [], [], 1.0)
    found = {}
    for role in (Role.PREFILL, Role.DECODE):
        for i in range(n):
            load = Load(rng.randint(0, 3), rng.randint(0, 2), rng.randint(0, 50))
            info = HealthInfo(role.value, f"{role.value}{i}", "a", "h", 1, 1, 1, "m", load)
            found[(role, f"http://127.0.0.1:{9000 + 100 * (role is Role.DECODE) + i}")] = info
    reg.sync(found, {})
    return reg


@pytest.mark.parametrize("seed", range(5))
def test_ranked_picks_cost_what_the_pickers_rules_say(seed: int) -> None:
    """Under random traffic, every ranked pick is one of the engines ``Picker`` scores best."""
    rng = random.Random(seed)
    reg = _registry(8, seed)
    prompts = [f"[system {g}] " + "shared text " * 30 + f"q{q}" for g in range(4) for q in range(3)]
    inflight: list[tuple[str, str, int]] = []
    for step in range(300):
        prompt = rng.choice(prompts)
        hashes, tokens = block_hashes(prompt), len(prompt) + 1
        p_views, d_views = reg.views(Role.PREFILL), reg.views(Role.DECODE)
        p = reg.pick(Role.PREFILL, Policy.PREFIX_AWARE, hashes, tokens)
        d = reg.pick(Role.DECODE, Policy.PREFIX_AWARE)
        cached = reg.cached_tokens(hashes)
        want_p = Picker(Policy.PREFIX_AWARE).pick(Role.PREFILL, p_views, cached, tokens)

        assert prefill_cost(p, cached.get(p.url, 0), tokens) == prefill_cost(
            want_p, cached.get(want_p.url, 0), tokens
        )
        want_d = Picker(Policy.LEAST_LOADED).pick(Role.DECODE, d_views)
        assert (busy(d), -d.load.free_blocks) == (busy(want_d), -want_d.load.free_blocks)
        reg.prefix_sent(p.url, hashes)
        reg.begin(p.url, d.url)
        reg.prefill_begin(p.url, tokens)
        inflight.append((p.url, d.url, tokens))
        while inflight and rng.random() < 0.5:  # requests end in any order
            pu, du, t = inflight.pop(rng.randrange(len(inflight)))
            reg.prefill_end(pu, t)
            reg.end(pu, du)
        if step % 50 == 49:  # an engine goes down, another comes back
            reg.get(rng.choice(p_views).url).healthy = False
            for state in reg.engines[Role.PREFILL]:
                if not state.healthy and rng.random() < 0.5:
                    state.healthy = True
                    reg._touch(state)


def test_round_robin_and_least_loaded_skip_engines_that_went_down() -> None:
    reg = _registry(3, 0)
    urls = [s.url for s in reg.engines[Role.DECODE]]
    picks = [reg.pick(Role.DECODE, Policy.ROUND_ROBIN).url for _ in range(6)]
    assert picks == urls * 2
    reg.get(urls[1]).healthy = False  # no _touch: the pick still must not choose it
    assert urls[1] not in {reg.pick(Role.DECODE, Policy.ROUND_ROBIN).url for _ in range(6)}
    assert urls[1] not in {reg.pick(Role.DECODE, Policy.LEAST_LOADED).url for _ in range(6)}


def test_router_pick_cost_is_flat_from_2_to_32_engines() -> None:
    """One request's pick and bookkeeping (bench fleet's router_cost, CPU time), 1 P + 1 D against
    16 P + 16 D, measured alternately; medians of 7. Before the rankings: ~1 us more per engine."""
    small, large = [], []
    for _ in range(7):
        small.append(pick_us(1, 300, _COST_PROMPTS))
        large.append(pick_us(16, 300, _COST_PROMPTS))
    assert statistics.median(large) <= 1.3 * statistics.median(small), (small, large)


_COST_PROMPTS = [
    f"[system {g}] " + "shared few-shot text " * 40 + f"question {q}" for g in range(8) for q in range(4)
]

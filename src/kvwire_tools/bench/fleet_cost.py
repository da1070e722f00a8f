"""The router's pick cost per request against the fleet's size (``kvwire bench fleet``'s ``router_cost``).

Timed in process on simulated engines: the registry holds ``n`` discovered prefill and ``n`` decode
engines, each P's prefix index warm with the workload's prompts; one request is what the router does
for it under prefix-aware routing besides its HTTP legs (the same at any fleet size): hash the prompt's
blocks, pick P (``EngineRegistry.pick``: the ranking's shortest queue and the Ps holding the prompt's
first block) and D (the ranking's least loaded), check both are still in the fleet, record the prompt
under P, count the request on both, and end it. CPU time of this process (``time.process_time``): the
router's cost, and what other work on the host does not inflate.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from typing import Any

from kvwire.config import Policy
from kvwire.router.engines import EngineRegistry, HealthInfo
from kvwire.router.http import EngineClient
from kvwire.router.policy import Load, Role
from kvwire.router.prefix import block_hashes


def _registry(n: int) -> EngineRegistry:
    reg = EngineRegistry(EngineClient(1.0, 1.0, None), [], [], 1.0)
    found = {}
    for role in (Role.PREFILL, Role.DECODE):
        for i in range(n):
            url = f"http://10.0.{i // 250}.{i % 250}:{8100 if role is Role.PREFILL else 8200}"
            load = Load(running=i % 3, waiting=0, free_blocks=1000 - i)
            found[(role, url)] = HealthInfo(role.value, f"{role.value}{i}", "a", "h", 1, 1, 1, "m", load)
    reg.sync(found, {})
    return reg


def pick_us(n: int, picks: int, prompts: Sequence[str]) -> float:
    """Mean microseconds of one request's pick and bookkeeping with ``n`` P and ``n`` D engines."""
    reg = _registry(n)
    for i, prompt in enumerate(prompts):  # each P holds some of the prompts
        reg.prefix.record(reg.views(Role.PREFILL)[i % n].url, block_hashes(prompt))
    policy = Policy.PREFIX_AWARE
    start = time.process_time()
    for i in range(picks):
        prompt = prompts[i % len(prompts)]
        hashes = block_hashes(prompt)
        p = reg.pick(Role.PREFILL, policy, hashes, len(prompt) + 1)
        d = reg.pick(Role.DECODE, policy)
        assert reg.in_view(p.url) and reg.in_view(d.url)
        reg.prefix_sent(p.url, hashes)
        reg.begin(p.url, d.url)
        reg.end(p.url, d.url)
    return (time.process_time() - start) / picks * 1e6


ROUNDS = 5  # each size is timed in every round, the sizes in turn: a busy moment of the host hits all


def router_cost(sizes: Sequence[int], picks: int) -> list[dict[str, Any]]:
    """Per fleet size (``n`` P and ``n`` D), the median over ``ROUNDS`` of the mean CPU microseconds per
    request, ``picks`` requests in all."""
    prompts = [
        f"[system {g}] " + "shared few-shot text " * 40 + f"question {q}" for g in range(8) for q in range(4)
    ]
    runs: dict[int, list[float]] = {n: [] for n in sizes}
    for _ in range(ROUNDS):
        for n in sizes:
            runs[n].append(pick_us(n, max(1, picks // ROUNDS), prompts))
    return [{"engines": 2 * n, "pick_us": round(statistics.median(runs[n]), 2)} for n in sizes]

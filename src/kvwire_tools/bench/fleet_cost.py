"""The router's pick cost per request against the fleet's size (``kvwire bench fleet``'s ``router_cost``).

Timed in process on simulated engines: the registry holds ``n`` discovered prefill and ``n`` decode
engines, each P's prefix index warm with the workload's prompts; one request's pick is what
``Router._pick_one`` does for it under prefix-aware routing: hash the prompt's blocks, look up which
Ps hold them (one lookup per block, whatever the fleet's size), score every P, and pick a D. The HTTP
legs, the same at any fleet size, are left out.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from kvwire.config import Policy
from kvwire.router.engines import EngineRegistry, HealthInfo
from kvwire.router.http import EngineClient
from kvwire.router.policy import Load, Picker, Role
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
    """Mean microseconds of one request's pick with ``n`` P and ``n`` D engines."""
    reg = _registry(n)
    picker = Picker(Policy.PREFIX_AWARE)
    for i, prompt in enumerate(prompts):  # each P holds some of the prompts
        reg.prefix.record(reg.views(Role.PREFILL)[i % n].url, block_hashes(prompt))
    start = time.perf_counter()
    for i in range(picks):
        prompt = prompts[i % len(prompts)]
        hashes = block_hashes(prompt)
        views = reg.views(Role.PREFILL)
        cached = reg.cached_tokens(hashes)
        picker.pick(Role.PREFILL, views, cached, len(prompt) + 1)
        picker.pick(Role.DECODE, reg.views(Role.DECODE))
    return (time.perf_counter() - start) / picks * 1e6


def router_cost(sizes: Sequence[int], picks: int) -> list[dict[str, Any]]:
    prompts = [
        f"[system {g}] " + "shared few-shot text " * 40 + f"question {q}" for g in range(8) for q in range(4)
    ]
    return [{"engines": 2 * n, "pick_us": round(pick_us(n, picks, prompts), 2)} for n in sizes]

"""Helpers to build connector topologies and compare KV byte for byte (tests, benchmarks, workers).

A request's KV is handled in its *logical* form, ``[layers, kinds, kv_heads, tokens, head_dim]`` of the
model's dtype: ``scatter_tokens`` writes it into the blocks of a set of ranks (each rank takes its layers
and heads, so replicated heads stay identical), ``gather_tokens`` reads it back from any set of ranks
that together hold every layer and head. Comparing P's logical KV with what D's ranks gather is a byte
comparison that does not reuse the mapping code under test.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import numpy as np

from kvwire.handshake.types import EngineInfo, LocalRank
from kvwire.kv.cache import KVCache
from kvwire.kv.mapping import layer_window
from kvwire.kv.spec import KVSpec, Layout
from kvwire.protocol.messages import TransferMode
from kvwire.transport.base import Agent, make_agent_name, new_incarnation
from kvwire.transport.inproc import InprocFabric
from kvwire.transport.registry import create_agent


@dataclass
class EngineSetup:
    """An engine's identity and its local ranks (agents and caches), not yet started."""

    engine: EngineInfo
    ranks: list[LocalRank]

    def close(self) -> None:
        for rank in self.ranks:
            rank.agent.close()


def build_engine(
    engine_id: str,
    spec: KVSpec,
    *,
    tp: int = 1,
    pp: int = 1,
    num_blocks: int = 64,
    mode: TransferMode = TransferMode.PUSH,
    backend: str = "inproc",
    fabric: InprocFabric | None = None,
    model_id: str = "kvwire-test",
) -> EngineSetup:
    """One engine with ``tp * pp`` ranks; PP stages hold ``layer_window``'s layers (vLLM's split)."""
    incarnation = new_incarnation()
    ranks: list[LocalRank] = []
    for p in range(pp):
        window = layer_window(spec.num_layers, pp, p)
        for t in range(tp):
            name = make_agent_name(engine_id, incarnation, p, t)
            agent: Agent = create_agent(backend, name, fabric=fabric)
            cache = KVCache(
                spec, num_blocks, tp_size=tp, tp_rank=t, first_layer=window.start, num_layers=len(window)
            )
            ranks.append(LocalRank(pp_rank=p, tp_rank=t, agent=agent, cache=cache))
    info = EngineInfo(engine_id, incarnation, model_id, spec, tp, pp, mode)
    return EngineSetup(info, ranks)


def logical_shape(spec: KVSpec, num_tokens: int) -> tuple[int, ...]:
    return (spec.num_layers, len(spec.kinds), spec.kv_heads, num_tokens, spec.head_dim)


def random_kv(spec: KVSpec, num_tokens: int, seed: int) -> np.ndarray:
    """Random bytes shaped as a request's logical KV (any bit pattern: only bytes are compared)."""
    rng = np.random.default_rng(seed)
    shape = logical_shape(spec, num_tokens)
    raw = rng.integers(0, 256, size=int(np.prod(shape)) * spec.itemsize, dtype=np.uint8)
    return raw.view(spec.np_dtype).reshape(shape)


def _positions(spec: KVSpec, block_ids: Sequence[int], tokens: range) -> tuple[np.ndarray, np.ndarray]:
    t = np.arange(tokens.start, tokens.stop)
    ids = np.asarray(block_ids, dtype=np.int64)
    return ids[t // spec.block_size], t % spec.block_size


_ALL = slice(None)


def _slab_tokens(
    cache: KVCache, blocks: np.ndarray, slots: np.ndarray
) -> tuple[tuple[slice | np.ndarray, ...], tuple[int, ...], tuple[int, ...]]:
    """The slab index that picks the given (block, slot)s in every region of ``cache`` at once; the axes
    that bring what it picks into the logical ``[layers, kinds, heads, tokens, head_dim]`` order, and back
    (one numpy call per rank, not one per region: most of the simulator's copying)."""
    if cache.spec.layout is Layout.HND:  # slab [L, K, blocks, heads, bs, hd]: picks [tokens, L, K, h, hd]
        return (_ALL, _ALL, blocks, _ALL, slots), (1, 2, 3, 0, 4), (3, 0, 1, 2, 4)
    return (_ALL, _ALL, blocks, slots), (0, 1, 3, 2, 4), (0, 1, 3, 2, 4)  # picks [L, K, tokens, h, hd]


def scatter_tokens(
    ranks: Sequence[LocalRank],
    block_ids: Sequence[int],
    kv: np.ndarray,
    tokens: range | None = None,
    layers: range | None = None,
) -> None:
    """Write logical KV (tokens ``tokens``, default all of ``kv``; the model's layers ``layers``, default
    all) into each rank's blocks (a layer-wise prefill writes one layer at a time)."""
    tokens = range(kv.shape[3]) if tokens is None else tokens
    positions: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # by block size: the same for most ranks
    for rank in ranks:
        cache = rank.own_cache()
        held = cache.layers
        lo, hi = (
            (held.start, held.stop)
            if layers is None
            else (max(held.start, layers.start), min(held.stop, layers.stop))
        )
        if lo >= hi:
            continue  # this rank (a pipeline stage) holds none of those layers
        bs = cache.spec.block_size
        if bs not in positions:
            positions[bs] = _positions(cache.spec, block_ids, tokens)
        blocks, slots = positions[bs]
        heads = slice(cache.first_head, cache.first_head + cache.heads)
        part = kv[lo:hi, :, heads, tokens.start : tokens.stop, :]
        index, _, back = _slab_tokens(cache, blocks, slots)
        if (lo, hi) != (held.start, held.stop):  # the slab's first axis is the rank's own layers
            index = (slice(lo - held.start, hi - held.start), *index[1:])
        cache.slab[index] = part.transpose(back)


def gather_tokens(ranks: Sequence[LocalRank], block_ids: Sequence[int], tokens: range) -> np.ndarray:
    """Read logical KV for ``tokens`` back from ranks that together hold every layer and head."""
    spec = ranks[0].cache.spec
    out = np.zeros(logical_shape(spec, len(tokens)), dtype=spec.np_dtype)
    seen = np.zeros((spec.num_layers, spec.kv_heads), dtype=bool)
    blocks, slots = _positions(spec, block_ids, tokens)
    for rank in ranks:
        cache = rank.own_cache()
        heads = slice(cache.first_head, cache.first_head + cache.heads)
        layers = cache.layers
        seen[layers.start : layers.stop, heads] = True
        index, axes, _ = _slab_tokens(cache, blocks, slots)
        out[layers.start : layers.stop, :, heads] = cache.slab[index].transpose(axes)
    if not seen.all():
        raise ValueError("these ranks do not hold every layer and head")
    return out


def same_bytes(a: np.ndarray, b: np.ndarray) -> bool:
    """Byte equality (random KV holds NaN patterns, which ``==`` never calls equal)."""
    return a.shape == b.shape and bool(
        np.array_equal(np.ascontiguousarray(a).view(np.uint8), np.ascontiguousarray(b).view(np.uint8))
    )


def untouched_blocks_zero(ranks: Sequence[LocalRank], used: Sequence[int]) -> bool:
    """Whether every block outside ``used`` is still all zeros on every rank (nothing wrote elsewhere)."""
    for rank in ranks:
        mask = np.ones(rank.cache.num_blocks, dtype=bool)
        mask[list(used)] = False
        if np.any(rank.own_cache().slab[:, :, mask]):
            return False
    return True


T = TypeVar("T")


def wait_for(fn: Callable[[], T | None], what: str, timeout_s: float = 10.0) -> T:
    """Poll ``fn`` until it returns something truthy (bounded: the tests' loops stop by themselves)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = fn()
        if got:
            return got
        time.sleep(0.001)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")

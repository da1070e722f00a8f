"""The reference engine's prefix cache: a request served with a hit gives the same tokens and writes the
same KV bytes as one prefilled from position 0; cached blocks are shared, refcounted, evicted LRU (tail
first) only when blocks are needed, and never outgrow the KV pool."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from kvwire.engine.config import EngineConfig, Role, preset
from kvwire.engine.engine import Engine
from kvwire.engine.loopback import LoopbackHub
from kvwire.engine.model import Model, prefill_chunk
from kvwire.engine.paged import PagedKV
from kvwire.engine.prefix_cache import PrefixCache
from kvwire.engine.request import Request, RequestState, TransferRole
from kvwire.kv.allocator import BlockAllocator
from kvwire.kv_params import KvTransferParams

TINY = preset("tiny")
MODEL = Model(TINY, seed=0)
WINDOWED = dataclasses.replace(TINY, name="windowed", num_layers=3, window=24)
WINDOWED_MODEL = Model(WINDOWED, seed=1)
CHUNK = prefill_chunk(TINY)


def tokens(n: int, seed: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, 256, n)]


PREFIX = tokens(3 * CHUNK + 5, seed=1)


def make(
    model: Model, *, cache: bool, tp: int = 1, num_blocks: int = 256, role: Role = Role.COLOCATED
) -> Engine:
    cfg = EngineConfig(model.cfg, role=role, tp_size=tp, num_blocks=num_blocks, prefix_cache=cache)
    return Engine(cfg, model=model)


def prompt_kv(e: Engine, prompt: list[int], max_tokens: int = 4) -> tuple[Request, list[bytes]]:
    """Admit, prefill and step ``prompt`` once; the KV bytes of its prompt positions, per layer and kind."""
    req = Request(f"r{len(prompt)}-{e.scheduler.num_free}", prompt, max_tokens, ignore_eos=True)
    e.submit(req)
    e.step()
    assert req.state is RequestState.RUNNING
    out = []
    for layer in range(e.cfg.model.num_layers):
        k, v = e.kv.read_heads(layer, req.block_ids, 0, len(prompt))
        out += [k.tobytes(), v.tobytes()]
    e.run_until_idle()
    return req, out


@pytest.mark.parametrize(("model", "tp"), [(MODEL, 1), (MODEL, 2), (WINDOWED_MODEL, 1)])
def test_a_prefix_hit_gives_the_same_tokens_and_kv_bytes(model: Model, tp: int) -> None:
    first, second = PREFIX + tokens(30, seed=2), PREFIX + tokens(50, seed=3)
    warm = make(model, cache=True, tp=tp)
    prompt_kv(warm, first)
    hit_req, hit_kv = prompt_kv(warm, second)
    assert hit_req.cached_tokens == 3 * CHUNK  # the prefix's whole chunks, not its partial tail
    stats = warm.scheduler.prefix_cache.stats()  # type: ignore[union-attr]
    assert stats.hit_tokens == 3 * CHUNK and stats.query_tokens == len(first) + len(second)
    cold_req, cold_kv = prompt_kv(make(model, cache=False, tp=tp), second)
    assert cold_req.cached_tokens == 0
    assert hit_kv == cold_kv
    assert hit_req.output_ids == cold_req.output_ids and len(set(cold_req.output_ids)) > 1


def test_a_whole_prompt_from_the_cache_is_exact() -> None:
    """A prompt whose prefill range is all cached chunks prefills nothing: only the step runs."""
    prompt = tokens(2 * CHUNK + 1, seed=4)
    warm = make(MODEL, cache=True)
    prompt_kv(warm, prompt)
    again, kv = prompt_kv(warm, prompt)
    assert again.cached_tokens == 2 * CHUNK
    cold, cold_kv = prompt_kv(make(MODEL, cache=False), prompt)
    assert kv == cold_kv and again.output_ids == cold.output_ids


def test_disaggregated_with_a_prefix_cache_on_p_equals_colocated() -> None:
    prompts = [PREFIX + tokens(n, seed=10 + n) for n in (1, 17, 40, 64, 90)] + [tokens(70, seed=9)] * 2
    reference = make(MODEL, cache=False).generate(prompts, 6, ignore_eos=True)
    hub = LoopbackHub()
    p, d = make(MODEL, cache=True, role=Role.PREFILL), make(MODEL, cache=False, role=Role.DECODE)
    p.set_hooks(hub.producer(p.kv))
    d.set_hooks(hub.consumer(d.kv))
    d_reqs = []
    for i, prompt in enumerate(prompts):
        tid = f"t{i}"
        p.submit(Request(f"p{i}", prompt, 1, role=TransferRole.REMOTE_DECODE, transfer_id=tid))
        d_req = Request(f"d{i}", prompt, 6, ignore_eos=True, role=TransferRole.REMOTE_PREFILL)
        d_req.transfer_id = tid
        d_req.kv_transfer_params = KvTransferParams(transfer_id=tid)
        d.submit(d_req)
        d_reqs.append(d_req)
        for _ in range(50):  # one at a time, so that each finds its predecessors' blocks cached
            p.step()
            d.step()
            if d_req.state.finished and not p.scheduler.has_lent_blocks():
                break
    assert [r.output_ids for r in d_reqs] == reference
    stats = p.scheduler.prefix_cache.stats()  # type: ignore[union-attr]
    assert stats.hit_tokens == 4 * 3 * CHUNK + CHUNK  # four prefix hits, one repeat of the 70-token prompt
    load = p.load().report()
    assert load["prefix_hit_tokens"] == stats.hit_tokens and load["cached_blocks"] == stats.cached_blocks
    # Nothing leaked: every cached block is evictable once the requests are gone.
    assert p.scheduler.num_free == p.kv.allocator.num_blocks
    assert stats.cached_blocks == stats.evictable_blocks > 0


def test_cached_blocks_are_evicted_lru_tail_first_only_when_needed() -> None:
    alloc = BlockAllocator(16)
    cache = PrefixCache(alloc, block_size=16, chunk_tokens=64)
    keys = cache.keys(tokens(2 * 64 + 1, seed=5))  # two chunks: 8 blocks
    assert len(keys) == 8
    blocks = alloc.allocate(8)
    cache.insert(keys, blocks)
    assert [alloc.refcount(b) for b in blocks] == [2] * 8
    cache.released(blocks)
    alloc.free(blocks)  # the order does not matter for refcounts; released() reads them
    cache.released(blocks)
    assert cache.num_evictable == 8 and alloc.num_free == 8
    assert cache.available([]) == 16
    cache.make_room(9)  # one more than free: the prompt's last block goes
    assert alloc.num_free == 9 and cache.num_evictable == 7
    assert cache.match(keys) == blocks[:4]  # the head chunk still matches; the tail chunk lost a block
    cache.make_room(13)  # three more of the tail chunk, then the head chunk's last block
    assert cache.match(keys) == []


def test_shared_blocks_are_not_evicted_while_a_request_uses_them() -> None:
    e = make(MODEL, cache=True, num_blocks=24)
    first = PREFIX + tokens(3, seed=6)  # 14 blocks with its 4 output tokens' room
    prompt_kv(e, first)
    cache = e.scheduler.prefix_cache
    assert cache is not None and cache.num_evictable == 12  # 3 chunks of 4 blocks
    running = Request("running", PREFIX + tokens(20, seed=7), 40, ignore_eos=True)
    e.submit(running)
    e.step()
    assert running.cached_tokens == 3 * CHUNK and cache.num_evictable == 0
    # Another prompt needing every block not held: refused for now rather than evicting shared blocks.
    other = Request("other", tokens(150, seed=8), 10, ignore_eos=True)
    e.submit(other)
    e.step()
    assert other.state is RequestState.WAITING
    e.run_until_idle()
    assert other.state is RequestState.FINISHED_LENGTH and running.state is RequestState.FINISHED_LENGTH
    assert e.scheduler.num_free == 24


def test_prefill_refuses_a_start_off_the_chunk_grid() -> None:
    kv = PagedKV(TINY.kv_spec(), 8, q_heads=TINY.q_heads)
    with pytest.raises(ValueError, match="multiple"):
        MODEL.prefill(kv, list(range(8)), np.zeros(100, dtype=np.int64), start=16)


def test_a_remote_prefill_gets_blocks_the_cache_holds_but_nobody_uses() -> None:
    """``admit`` counts evictable cached blocks as free for every request: a request whose KV comes from a
    prefill engine must get them too (it was popped from the queue and lost on an AllocationError)."""
    e = make(MODEL, cache=True, num_blocks=24)
    prompt_kv(e, PREFIX)  # its whole chunks stay cached, held by nobody
    sched = e.scheduler
    cached = sched.prefix_cache
    assert cached is not None and cached.num_evictable > 0
    remote = Request(
        "remote", tokens(20 * 16 - 1, seed=9), 1, role=TransferRole.REMOTE_PREFILL, transfer_id="t"
    )
    need = sched.blocks_needed(remote)
    assert sched.allocator.num_free < need <= cached.available([])
    sched.add(remote)
    out = sched.admit()
    assert out.remote == [remote] and remote.state is RequestState.WAITING_FOR_KV
    assert len(remote.block_ids) == need and len(set(remote.block_ids)) == need

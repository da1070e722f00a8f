"""Property tests: simulated transfers of every geometry give D exactly P's KV, written once, in bounds.

A random "model" KV (``ref[layer, kind, token, head]``, as raw bytes) is scattered into every P rank's cache
(its PP layers, its TP heads, the request's P blocks); every (P rank, D rank) plan is applied as byte
copies between the caches' slabs (descriptor address minus slab address). D must then hold ``ref`` in the
request's D blocks, for its own heads and layers, from the first uncached token; every other byte of D is
untouched, no byte is written twice, and every byte read lies in the request's moved P blocks.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvwire.kv import KVCache, KVSpec, Layout, RankLayout, layer_window, plan_transfer, source_ranks
from kvwire.kv.descriptors import TransferPlan
from kvwire.kv.mapping import pair_slices


@dataclass(frozen=True)
class Case:
    spec: KVSpec  # block_size is D's
    src_bs: int
    src_tp: int
    src_pp: int
    dst_tp: int
    dst_pp: int
    num_tokens: int
    cached: int
    src_blocks: tuple[int, ...]
    dst_blocks: tuple[int, ...]
    src_num_blocks: int
    dst_num_blocks: int
    seed: int


def _valid_tps(kv_heads: int, mla: bool) -> list[int]:
    return [t for t in range(1, 9) if mla or kv_heads % t == 0 or t % kv_heads == 0]


def _assign(rng: random.Random, needed: int, total: int, mode: str) -> tuple[int, ...]:
    """``needed`` distinct block ids of ``total``: one contiguous run, shuffled, or short runs."""
    if mode == "contiguous":
        start = rng.randrange(total - needed + 1)
        return tuple(range(start, start + needed))
    if mode == "shuffled":
        return tuple(rng.sample(range(total), needed))
    chunks = [list(range(i, min(i + 3, total))) for i in range(0, total, 3)]
    rng.shuffle(chunks)
    return tuple(b for c in chunks for b in c)[:needed]


@st.composite
def cases(draw: st.DrawFn, max_pp: int = 2) -> Case:
    mla = draw(st.booleans())
    kv_heads = 1 if mla else draw(st.sampled_from([1, 2, 3, 4, 6, 8]))
    tps = _valid_tps(kv_heads, mla)
    num_layers = draw(st.integers(1, 3))
    src_bs = dst_bs = draw(st.sampled_from([1, 2, 4]))
    factor = draw(st.sampled_from([1, 2, 3]))
    if draw(st.booleans()):  # D's blocks larger, or P's (a chunk of the smaller size is the unit)
        dst_bs *= factor
    else:
        src_bs *= factor
    spec = KVSpec(
        num_layers=num_layers,
        kv_heads=kv_heads,
        head_dim=draw(st.integers(1, 3)),
        dtype=draw(st.sampled_from(["float16", "float8", "float32"])),
        block_size=dst_bs,
        layout=draw(st.sampled_from(Layout)),
        mla=mla,
    )
    num_tokens = draw(st.integers(1, 20))
    cached = dst_bs * draw(st.integers(0, num_tokens // dst_bs))
    src_needed, dst_needed = -(-num_tokens // src_bs), -(-num_tokens // dst_bs)
    src_total, dst_total = src_needed + draw(st.integers(0, 3)), dst_needed + draw(st.integers(0, 3))
    rng = random.Random(draw(st.integers(0, 2**32)))
    modes = st.sampled_from(["contiguous", "shuffled", "runs"])
    return Case(
        spec=spec,
        src_bs=src_bs,
        src_tp=draw(st.sampled_from(tps)),
        src_pp=draw(st.integers(1, min(max_pp, num_layers))),
        dst_tp=draw(st.sampled_from(tps)),
        dst_pp=draw(st.integers(1, min(max_pp, num_layers))),
        num_tokens=num_tokens,
        cached=cached,
        src_blocks=_assign(rng, src_needed, src_total, draw(modes)),
        dst_blocks=_assign(rng, dst_needed, dst_total, draw(modes)),
        src_num_blocks=src_total,
        dst_num_blocks=dst_total,
        seed=rng.randrange(2**32),
    )


def _elem_view(cache: KVCache, li: int, ki: int) -> np.ndarray:
    """Region ``(li, ki)`` as ``[blocks, *block_shape[:2], head_dim * itemsize]`` raw bytes."""
    raw = cache.slab.view(np.uint8).reshape(*cache.slab.shape[:-1], -1)
    return raw[li, ki]  # type: ignore[no-any-return]


def _scatter(
    cache: KVCache, li: int, ki: int, blocks: np.ndarray, slots: np.ndarray, values: np.ndarray
) -> None:
    """Write ``values[token, head]`` into tokens at (blocks, slots) of one region (all its heads)."""
    view = _elem_view(cache, li, ki)
    if cache.spec.layout is Layout.HND:
        view[blocks, :, slots] = values
    else:
        view[blocks, slots] = values


def _ranks(num_layers: int, pp: int, tp: int) -> list[tuple[int, int, range]]:
    return [(p, t, layer_window(num_layers, pp, p)) for p in range(pp) for t in range(tp)]


def _apply(plan: TransferPlan, src: KVCache, dst: KVCache, read_ok: np.ndarray, writes: np.ndarray) -> None:
    src_raw, dst_raw = src.slab.reshape(-1).view(np.uint8), dst.slab.reshape(-1).view(np.uint8)
    src_base, dst_base = int(src.slab.ctypes.data), int(dst.slab.ctypes.data)
    assert len(plan.src_descs) == len(plan.dst_descs)
    for s, d in zip(plan.src_descs, plan.dst_descs, strict=True):
        assert s.length == d.length > 0
        so, do = s.addr - src_base, d.addr - dst_base
        assert so >= 0 and do >= 0
        assert so + s.length <= src_raw.size and do + d.length <= dst_raw.size
        assert read_ok[so : so + s.length].all(), "read outside the request's moved P blocks"
        dst_raw[do : do + d.length] = src_raw[so : so + s.length]
        writes[do : do + d.length] += 1


def check(case: Case) -> None:
    spec = case.spec
    src_spec = dataclasses.replace(spec, block_size=case.src_bs)
    rng = np.random.default_rng(case.seed)
    elem = spec.head_dim * spec.itemsize
    kinds = len(spec.kinds)
    chunk = min(case.src_bs, spec.block_size)
    t_end = -(-case.num_tokens // chunk) * chunk  # whole chunks move (the smaller block size)
    first_p, last_p = case.cached // case.src_bs, -(-case.num_tokens // case.src_bs)
    ref = rng.integers(0, 256, (spec.num_layers, kinds, t_end, spec.kv_heads, elem), dtype=np.uint8)
    tok = np.arange(t_end)

    # P ranks: random bytes everywhere, the request's tokens from ref.
    srcs: dict[tuple[int, int], tuple[KVCache, RankLayout, np.ndarray]] = {}
    moved = np.array(case.src_blocks[first_p:last_p], dtype=np.int64)
    for pp, tp, window in _ranks(spec.num_layers, case.src_pp, case.src_tp):
        cache = KVCache(
            src_spec,
            case.src_num_blocks,
            tp_size=case.src_tp,
            tp_rank=tp,
            first_layer=window.start,
            num_layers=len(window),
        )
        cache.slab.view(np.uint8)[...] = rng.integers(0, 256, cache.slab.view(np.uint8).shape, dtype=np.uint8)
        heads = slice(cache.first_head, cache.first_head + cache.heads)
        blocks = np.array(case.src_blocks, dtype=np.int64)[tok // case.src_bs]
        read_ok = np.zeros(cache.slab.nbytes, dtype=bool)
        per_block = read_ok.reshape(len(window), kinds, case.src_num_blocks, -1)
        per_block[:, :, moved] = True
        for li, layer in enumerate(window):
            for ki in range(kinds):
                _scatter(cache, li, ki, blocks, tok % case.src_bs, ref[layer, ki, :, heads])
        srcs[(pp, tp)] = (cache, RankLayout.from_cache(cache, case.src_pp, pp), read_ok)

    for dpp, dtp, window in _ranks(spec.num_layers, case.dst_pp, case.dst_tp):
        dst = KVCache(
            spec,
            case.dst_num_blocks,
            tp_size=case.dst_tp,
            tp_rank=dtp,
            first_layer=window.start,
            num_layers=len(window),
        )
        dst.slab.view(np.uint8)[...] = rng.integers(0, 256, dst.slab.view(np.uint8).shape, dtype=np.uint8)
        expected = KVCache(
            spec,
            case.dst_num_blocks,
            tp_size=case.dst_tp,
            tp_rank=dtp,
            first_layer=window.start,
            num_layers=len(window),
        )
        expected.slab[...] = dst.slab
        want_mask = KVCache(
            spec,
            case.dst_num_blocks,
            tp_size=case.dst_tp,
            tp_rank=dtp,
            first_layer=window.start,
            num_layers=len(window),
        )
        layout = RankLayout.from_cache(dst, case.dst_pp, dpp)
        heads = slice(dst.first_head, dst.first_head + dst.heads)
        t = tok[case.cached :]
        blocks = np.array(case.dst_blocks, dtype=np.int64)[t // spec.block_size]
        for li, layer in enumerate(window):
            for ki in range(kinds):
                _scatter(expected, li, ki, blocks, t % spec.block_size, ref[layer, ki, case.cached :, heads])
                _scatter(want_mask, li, ki, blocks, t % spec.block_size, np.ones(1, dtype=np.uint8))

        writes = np.zeros(dst.slab.nbytes, dtype=np.uint16)
        writers = []
        for key, (src, src_layout, read_ok) in srcs.items():
            plan = plan_transfer(
                spec,
                src_layout,
                layout,
                case.src_blocks,
                case.dst_blocks,
                num_tokens=case.num_tokens,
                num_cached_tokens=case.cached,
            )
            assert plan.nbytes == sum(d.length for d in plan.dst_descs)
            assert plan.num_descs == plan.num_runs * plan.num_regions
            if not plan.empty:
                writers.append(key)
            _apply(plan, src, dst, read_ok, writes)

        assert writes.max(initial=0) <= 1, "a byte was written twice"
        want = want_mask.slab.reshape(-1).view(np.uint8) != 0
        assert np.array_equal(writes == 1, want), "bytes written outside (or missing from) the target"
        assert np.array_equal(dst.slab.view(np.uint8), expected.slab.view(np.uint8))
        if case.cached < case.num_tokens:
            # D pairs with every rank that writes, and with the replicas no D rank reads, which move nothing.
            sources = source_ranks(spec, case.src_tp, case.src_pp, layout)
            assert writers == [
                k for k in sources if pair_slices(spec, case.src_tp, layout.tp_size, k[1], layout.tp_rank)
            ]


@pytest.mark.slow  # 3000 examples: ~35 s
@settings(max_examples=3000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_transfers_rebuild_p_cache_exactly_in_d(case: Case) -> None:
    check(case)


@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases(max_pp=3))
def test_transfers_with_deeper_pipelines(case: Case) -> None:
    check(case)

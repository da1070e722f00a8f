import dataclasses
import itertools
import random

import pytest

from kvwire.core.producer_records import expected_d_ranks
from kvwire.errors import BlockRangeError, LayoutError
from kvwire.kv import (
    HeadSlice,
    KVCache,
    KVSpec,
    Layout,
    RankLayout,
    layer_window,
    pair_slices,
    plan_transfer,
    source_ranks,
    tp_map,
    tp_peers,
    tp_sources,
)

LLAMA = KVSpec(num_layers=32, kv_heads=8, head_dim=128, dtype="float16", block_size=16)
MLA = KVSpec(num_layers=1, kv_heads=1, head_dim=4, mla=True)


def test_layer_window_follows_vllm_split() -> None:
    assert [len(layer_window(10, 4, r)) for r in range(4)] == [2, 3, 3, 2]
    assert [layer_window(32, 2, r) for r in range(2)] == [range(0, 16), range(16, 32)]
    assert layer_window(5, 1, 0) == range(5)
    with pytest.raises(LayoutError):
        layer_window(2, 3, 0)
    with pytest.raises(LayoutError):
        layer_window(8, 2, 2)


def test_tp_equal_is_identity() -> None:
    assert tp_peers(LLAMA, 4, 4, 1) == [HeadSlice(1, 1, 0, 0, 2)]


def test_dst_tp_larger_splits_source_heads() -> None:
    assert tp_peers(LLAMA, 2, 8, 1) == [HeadSlice(1, d, d - 4, 0, 1) for d in range(4, 8)]
    assert tp_sources(LLAMA, 2, 8, 5) == [1]


def test_src_tp_larger_fills_slices_of_one_block() -> None:
    assert [tp_peers(LLAMA, 8, 2, r) for r in (0, 5)] == [
        [HeadSlice(0, 0, 0, 0, 1)],
        [HeadSlice(5, 1, 0, 1, 1)],
    ]
    assert tp_sources(LLAMA, 8, 2, 1) == [4, 5, 6, 7]


def test_replicated_heads_are_written_once() -> None:
    spec = KVSpec(num_layers=1, kv_heads=2, head_dim=4)
    # 2 heads on 8 P ranks (4 replicas each) to 1 D rank: one replica per head writes.
    assert [r for r in range(8) if tp_peers(spec, 8, 1, r)] == [0, 4]
    # MLA: D rank d reads from P rank d % P tp.
    mla = KVSpec(num_layers=1, kv_heads=1, head_dim=4, mla=True)
    assert [tp_sources(mla, 2, 4, d) for d in range(4)] == [[0], [1], [0], [1]]
    assert tp_peers(mla, 2, 4, 1) == [HeadSlice(1, 1, 0, 0, 1), HeadSlice(1, 3, 0, 0, 1)]


def test_a_p_rank_no_d_rank_reads_is_told_by_one_d_rank() -> None:
    """The replicas no D rank reads still register with one D rank (``r % D tp``), which moves nothing
    from them: they must hear the request's end to free its blocks."""
    spec = KVSpec(num_layers=1, kv_heads=2, head_dim=4)
    assert tp_sources(spec, 8, 1, 0) == list(range(8))
    assert [pair_slices(spec, 8, 1, r, 0) != [] for r in range(8)] == [r in (0, 4) for r in range(8)]
    mla = KVSpec(num_layers=1, kv_heads=1, head_dim=4, mla=True)
    assert [tp_sources(mla, 4, 2, d) for d in range(2)] == [[0, 2], [1, 3]]
    assert [expected_d_ranks(mla, 4, 2, r) for r in range(4)] == [{0}, {1}, {0}, {1}]


@pytest.mark.parametrize(
    "spec", [LLAMA, KVSpec(num_layers=1, kv_heads=2, head_dim=4), MLA], ids=["8-heads", "2-heads", "mla"]
)
def test_every_p_rank_has_a_d_rank_and_both_sides_agree(spec: KVSpec) -> None:
    """For every TP pair: each P rank registers with at least one D rank, every pair that moves heads
    registers, and P's view (``expected_d_ranks``) is D's (``tp_sources``) transposed."""
    for p_tp, d_tp in itertools.product((1, 2, 4, 8, 16, 64), repeat=2):
        d_view = {(src, d) for d in range(d_tp) for src in tp_sources(spec, p_tp, d_tp, d)}
        p_view = {(r, d) for r in range(p_tp) for d in expected_d_ranks(spec, p_tp, d_tp, r)}
        assert d_view == p_view
        assert {src for src, _ in p_view} == set(range(p_tp))
        assert {(s.src_rank, s.dst_rank) for s in tp_map(spec, p_tp, d_tp)} <= p_view


def test_tp_divisibility_and_range_errors() -> None:
    with pytest.raises(LayoutError):
        tp_peers(LLAMA, 3, 1, 0)
    with pytest.raises(LayoutError):
        tp_peers(LLAMA, 128, 1, 0)  # past MAX_TP (64)
    with pytest.raises(LayoutError):
        tp_peers(LLAMA, 2, 2, 2)


def test_source_ranks_cover_pp_stages_and_tp() -> None:
    spec = KVSpec(num_layers=4, kv_heads=4, head_dim=4)
    dst = RankLayout.from_cache(KVCache(spec, 4, tp_size=2, tp_rank=1))
    assert source_ranks(spec, 4, 2, dst) == [(0, 2), (0, 3), (1, 2), (1, 3)]


def _layouts(spec: KVSpec, n: int = 128, src_bs: int | None = None) -> tuple[RankLayout, RankLayout]:
    src_spec = spec if src_bs is None else dataclasses.replace(spec, block_size=src_bs)
    return RankLayout.from_cache(KVCache(src_spec, n)), RankLayout.from_cache(KVCache(spec, n))


def test_llama_1k_contiguous_is_one_descriptor_per_region() -> None:
    src, dst = _layouts(LLAMA)
    plan = plan_transfer(LLAMA, src, dst, range(64), range(10, 74), num_tokens=1024)
    assert (plan.num_runs, plan.num_regions, plan.num_descs) == (1, 64, 64)
    assert plan.nbytes == 1024 * LLAMA.bytes_per_token()
    assert all(
        s.length == d.length == 64 * src.block_len(LLAMA)
        for s, d in zip(plan.src_descs, plan.dst_descs, strict=True)
    )


def test_llama_1k_fragmented_is_one_descriptor_per_block_and_region() -> None:
    src, dst = _layouts(LLAMA)
    rng = random.Random(1)
    src_blocks, dst_blocks = rng.sample(range(128), 64), rng.sample(range(128), 64)
    plan = plan_transfer(LLAMA, src, dst, src_blocks, dst_blocks, num_tokens=1024)
    runs = 1 + sum(
        1
        for i in range(63)
        if not (src_blocks[i + 1] == src_blocks[i] + 1 and dst_blocks[i + 1] == dst_blocks[i] + 1)
    )
    assert plan.num_runs == runs and plan.num_descs == runs * 64
    assert plan.nbytes == 1024 * LLAMA.bytes_per_token()


def test_prefix_hit_moves_only_the_uncached_suffix() -> None:
    src, dst = _layouts(LLAMA)
    plan = plan_transfer(LLAMA, src, dst, range(64), range(64, 128), num_tokens=1000, num_cached_tokens=320)
    assert plan.nbytes == (63 - 20) * 16 * LLAMA.bytes_per_token()
    assert plan.dst_descs[0].addr == dst.regions[0].base_addr + (64 + 20) * dst.block_len(LLAMA)
    assert plan.src_descs[0].addr == src.regions[0].base_addr + 20 * src.block_len(LLAMA)
    full = plan_transfer(LLAMA, src, dst, range(64), range(64), num_tokens=1024, num_cached_tokens=1024)
    assert full.empty and full.nbytes == 0


def test_token_and_block_errors() -> None:
    src, dst = _layouts(LLAMA)
    with pytest.raises(LayoutError, match="multiple"):
        plan_transfer(LLAMA, src, dst, range(64), range(64), num_tokens=1024, num_cached_tokens=8)
    with pytest.raises(LayoutError):
        plan_transfer(LLAMA, src, dst, range(64), range(64), num_tokens=0)
    with pytest.raises(BlockRangeError):
        plan_transfer(LLAMA, src, dst, range(63), range(64), num_tokens=1024)
    with pytest.raises(BlockRangeError):  # D's list must start at token 0, prefix blocks included
        plan_transfer(LLAMA, src, dst, range(64), range(60), num_tokens=1024, num_cached_tokens=64)
    with pytest.raises(BlockRangeError):
        plan_transfer(LLAMA, src, dst, range(64), [*range(63), 128], num_tokens=1024)
    with pytest.raises(BlockRangeError):
        plan_transfer(LLAMA, src, dst, range(64), [*range(63), 0], num_tokens=1024)


def test_block_size_ratio_rules() -> None:
    src, dst = _layouts(LLAMA, src_bs=24)
    with pytest.raises(LayoutError, match="one must divide the other"):
        plan_transfer(LLAMA, src, dst, range(43), range(64), num_tokens=1024)
    src, dst = _layouts(LLAMA, src_bs=32)  # P's larger: one descriptor per (D block, head) ...
    plan = plan_transfer(LLAMA, src, dst, range(32), range(64), num_tokens=1024)
    # ... except that a P block's last head ends where the next P block's first begins (D's blocks too).
    assert plan.num_runs == 64 * 8 - 31 and plan.nbytes == 1024 * LLAMA.bytes_per_token()
    src, dst = _layouts(LLAMA, src_bs=8)  # HND: one descriptor per (P block, head) when sizes differ
    plan = plan_transfer(LLAMA, src, dst, range(128), range(64), num_tokens=1024)
    # ... except that the last head of a D block's last P block abuts the next D block's first one.
    assert plan.num_runs == 128 * 8 - 63 and plan.nbytes == 1024 * LLAMA.bytes_per_token()
    nhd = dataclasses.replace(LLAMA, layout=Layout.NHD)
    src, dst = _layouts(nhd, src_bs=8)  # NHD: whole token rows are contiguous, so runs still merge
    assert plan_transfer(nhd, src, dst, range(128), range(64), num_tokens=1024).num_runs == 1


def test_nhd_head_slices_use_per_token_descriptors() -> None:
    spec = KVSpec(num_layers=2, kv_heads=4, head_dim=8, layout=Layout.NHD, block_size=4)
    src = RankLayout.from_cache(KVCache(spec, 8, tp_size=1))
    dst = RankLayout.from_cache(KVCache(spec, 8, tp_size=2, tp_rank=1))
    plan = plan_transfer(spec, src, dst, range(3), range(3), num_tokens=10)
    assert plan.num_runs == 12 and plan.num_descs == 12 * 4
    assert {d.length for d in plan.src_descs} == {2 * 8 * 2}


def test_mismatched_region_geometry_is_refused() -> None:
    spec = KVSpec(num_layers=1, kv_heads=2, head_dim=4)
    src = RankLayout.from_cache(KVCache(spec, 4))
    other = RankLayout.from_cache(KVCache(KVSpec(num_layers=1, kv_heads=2, head_dim=8), 4))
    with pytest.raises(LayoutError, match="block_len"):
        plan_transfer(spec, src, other, [0], [0], num_tokens=4)
    with pytest.raises(LayoutError):
        RankLayout(1, 0, 1, 0, 0, 1, 16, 4, regions=(*src.regions, src.regions[0]))


def test_disjoint_layers_give_an_empty_plan() -> None:
    spec = KVSpec(num_layers=4, kv_heads=2, head_dim=4)
    src = RankLayout.from_cache(KVCache(spec, 4, first_layer=0, num_layers=2), pp_size=2, pp_rank=0)
    dst = RankLayout.from_cache(KVCache(spec, 4, first_layer=2, num_layers=2))
    assert plan_transfer(spec, src, dst, [0], [1], num_tokens=4).empty


def test_plan_arrays_match_descriptor_lists() -> None:
    src, dst = _layouts(LLAMA)
    plan = plan_transfer(LLAMA, src, dst, [3, 4, 9], [7, 8, 2], num_tokens=40)
    assert plan.num_runs == 2 and plan.num_descs == 128
    assert [(d.addr, d.length, d.device_id) for d in plan.src_descs] == [
        tuple(r) for r in plan.src_array.tolist()
    ]
    assert [(d.addr, d.length, d.device_id) for d in plan.dst_descs] == [
        tuple(r) for r in plan.dst_array.tolist()
    ]
    assert plan.nbytes == sum(d.length for d in plan.dst_descs) == 3 * 16 * LLAMA.bytes_per_token()


def test_bad_block_ids_are_refused_even_by_a_rank_pair_that_moves_nothing() -> None:
    src = RankLayout.from_cache(KVCache(LLAMA, 8, tp_size=2, tp_rank=0))
    dst = RankLayout.from_cache(KVCache(LLAMA, 8, tp_size=2, tp_rank=1))
    assert plan_transfer(LLAMA, src, dst, [0, 1], [0, 1], num_tokens=20).empty
    with pytest.raises(BlockRangeError):
        plan_transfer(LLAMA, src, dst, [0, 1], [0, 8], num_tokens=20)

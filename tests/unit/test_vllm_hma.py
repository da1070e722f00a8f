"""vLLM's hybrid KV cache manager (``SupportsHMA``) without vLLM: reading the KV cache groups, the
window check on P, and the planner moving each group's layers with that group's blocks (kv/groups.py)."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

from kvwire.errors import BlockRangeError, ConfigError, LayoutError
from kvwire.integrations.vllm.hma import KvGroups, kv_groups
from kvwire.kv import ExternalKV, KVSpec, RankLayout, plan_transfer
from kvwire.kv.digest import payload_bytes
from kvwire.kv.groups import first_token, moved_ids
from kvwire.kv.mapping import pair_slices

BS, W = 16, 32


# vLLM's spec classes are told apart by name (the connector's scheduler logic does not import vLLM).
@dataclass
class FullAttentionSpec:
    block_size: int = BS


@dataclass
class SlidingWindowSpec:
    sliding_window: int = W


@dataclass
class MambaSpec:
    pass


@dataclass
class Group:
    layer_names: list[str]
    kv_cache_spec: Any
    enable_kv_transfer: bool = True


@dataclass
class Config:
    kv_cache_groups: list[Group] = field(default_factory=list)


def _name(i: int) -> str:
    return f"model.layers.{i}.self_attn.attn"


def test_hma_groups_read_full_and_sliding_window_groups() -> None:
    cfg = Config(
        [Group([_name(0), _name(3)], FullAttentionSpec()), Group([_name(1), _name(2)], SlidingWindowSpec())]
    )
    assert kv_groups(cfg, 4) == KvGroups((0, 1, 1, 0), (0, W))
    assert kv_groups(Config([Group([_name(i) for i in range(4)], FullAttentionSpec())]), 4) == KvGroups()


@pytest.mark.parametrize(
    ("groups", "says"),
    [
        ([Group([_name(0)], FullAttentionSpec()), Group([_name(1)], MambaSpec())], "MambaSpec"),
        ([Group([_name(0)], FullAttentionSpec()), Group([_name(1)], SlidingWindowSpec(), False)], "kept out"),
        ([Group([_name(0)], FullAttentionSpec()), Group([_name(0)], SlidingWindowSpec())], "two groups"),
        ([Group([_name(0)], FullAttentionSpec()), Group([_name(2)], SlidingWindowSpec())], "outside"),
    ],
    ids=["mamba", "not-transferred", "layer-twice", "layer-missing"],
)
def test_hma_groups_kvwire_cannot_move_stop_the_engine_naming_them(groups: list[Group], says: str) -> None:
    with pytest.raises(ConfigError, match=says):
        kv_groups(Config(groups), 2)


def test_hma_window_lost_when_p_freed_the_block_d_reads_first() -> None:
    g = KvGroups((0, 1), (0, W))
    # 77 tokens: D recomputes token 76, which reads tokens 45.. (block 2); P freed blocks 0 and 1 (null 0).
    assert first_token(g.spec(BS), 1, 77, 0) == 32
    assert not g.window_lost(([1, 2, 3, 4, 5], [0, 0, 8, 9, 10]), 77, BS, 0)
    # 95 tokens: D reads token 63 (block 3), P freed by token 64: block 3 is gone.
    assert g.window_lost(([1, 2, 3, 4, 5, 6], [0, 0, 0, 0, 9, 10]), 95, BS, 0)
    assert g.flat(([1, 2, 3, 4, 5, 6, 7], [0, 0, 0, 0, 9, 10, 11]), 95, BS) == [
        1,
        2,
        3,
        4,
        5,
        6,
        0,
        0,
        0,
        0,
        9,
        10,
    ]
    with pytest.raises(BlockRangeError):
        g.flat(([1, 2], [3]), 95, BS)
    with pytest.raises(LayoutError):
        g.flat(([1, 2, 3, 4, 5, 6],), 95, BS)


def _cache(spec: KVSpec, blocks: int, seed: int | None) -> tuple[ExternalKV, list[np.ndarray]]:
    """Per layer one K and one V array of ``blocks`` blocks (random words for P, zeros for D)."""
    rng = np.random.default_rng(seed)
    arrays = []
    for _ in range(spec.num_layers * 2):
        a = np.zeros((blocks, spec.block_bytes(spec.kv_heads) // 2), dtype=np.uint16)
        if seed is not None:
            a[...] = rng.integers(1, 1 << 16, size=a.shape, dtype=np.uint16)
        arrays.append(a)
    layers = {ly: arrays[2 * ly : 2 * ly + 2] for ly in range(spec.num_layers)}
    return ExternalKV.from_arrays(spec, layers), arrays


def test_hma_plan_moves_each_group_with_its_own_blocks_and_window() -> None:
    spec = KVSpec(
        num_layers=3, kv_heads=2, head_dim=8, block_size=BS, layer_groups=(0, 1, 0), group_windows=(0, W)
    )
    p, p_arrays = _cache(spec, 24, seed=1)
    d, d_arrays = _cache(spec, 24, seed=None)
    n_tok, n = 77, 5
    p_ids = [1, 2, 3, 4, 5, 0, 0, 8, 9, 10]  # full group, then the window group (two null blocks first)
    d_ids = [11, 12, 13, 14, 15, 0, 0, 18, 19, 20]
    assert moved_ids(spec, d_ids, n_tok, 0) == [11, 12, 13, 14, 15, 18, 19, 20]
    plan = plan_transfer(
        spec, RankLayout.from_cache(p), RankLayout.from_cache(d), p_ids, d_ids, num_tokens=n_tok
    )
    for (sa, ln, _), (da, _, _) in zip(plan.src_array.tolist(), plan.dst_array.tolist(), strict=True):
        ctypes.memmove(da, sa, ln)
    slices = tuple(pair_slices(spec, 1, 1, 0, 0))
    # Layers 0 and 2 (full): five blocks each; layer 1 (window): blocks 2..4, tokens 32..77.
    assert payload_bytes(spec, range(3), slices, 0, n_tok) == 2 * (2 * 77 + 45) * 2 * 8 * 2
    for layer, group in enumerate(spec.layer_groups):
        src_ids, dst_ids = (p_ids, d_ids) if group == 0 else (p_ids[n:], d_ids[n:])
        first = 0 if group == 0 else 2
        for kind in range(2):
            src, dst = p_arrays[2 * layer + kind], d_arrays[2 * layer + kind]
            assert np.array_equal(dst[dst_ids[first:n]], src[src_ids[first:n]])
            untouched = [b for b in range(24) if b not in dst_ids[first:n]]
            assert not dst[untouched].any(), f"layer {layer}: bytes outside its group's blocks"
    with pytest.raises(BlockRangeError, match="KV cache groups"):
        plan_transfer(
            spec, RankLayout.from_cache(p), RankLayout.from_cache(d), p_ids[:9], d_ids, num_tokens=n_tok
        )


def test_hma_hybrid_model_refuses_pp_and_layerwise_push_at_start() -> None:
    """A hybrid model's groups cannot be split by PP stages, and layer-wise push streams one group's rows:
    both stop the engine at start with the fix named; one group (or whole-request push, PP 1) goes ahead."""
    hybrid = KvGroups(layer_groups=(0, 1), group_windows=(0, 64))
    with pytest.raises(ConfigError, match="pipeline_parallel_size 1"):
        hybrid.check_supported(2, layerwise=False)
    with pytest.raises(ConfigError, match='"layerwise": false'):
        hybrid.check_supported(1, layerwise=True)
    hybrid.check_supported(1, layerwise=False)
    KvGroups().check_supported(2, layerwise=True)


@pytest.mark.parametrize(
    ("cached", "tokens", "layers"), [(0, 77, range(3)), (32, 77, range(1, 3)), (64, 64, range(3))]
)
def test_payload_bytes_of_one_group_equals_the_per_layer_count(
    cached: int, tokens: int, layers: range
) -> None:
    """The plain spec's shortcut (every layer from the same token) states what the per-layer rule does."""
    plain = KVSpec(num_layers=3, kv_heads=2, head_dim=8, block_size=BS)
    one_group = KVSpec(
        num_layers=3, kv_heads=2, head_dim=8, block_size=BS, layer_groups=(0, 0, 0), group_windows=(0,)
    )
    slices = tuple(pair_slices(plain, 1, 1, 0, 0))
    want = payload_bytes(one_group, layers, slices, cached, tokens)
    assert payload_bytes(plain, layers, slices, cached, tokens) == want
    assert want == len(layers) * 2 * 2 * (tokens - cached) * plain.head_bytes

"""KV layouts, the paged cache, block allocation, and TP/PP/block-size mapping to descriptors."""

from kvwire.kv.allocator import BlockAllocator, BlockState
from kvwire.kv.cache import KVCache, MemoryBuffer, RegionInfo
from kvwire.kv.descriptors import TransferPlan, plan_transfer
from kvwire.kv.mapping import (
    HeadSlice,
    RankLayout,
    layer_window,
    pair_slices,
    source_ranks,
    tp_contacts,
    tp_map,
    tp_peers,
    tp_sources,
)
from kvwire.kv.regions import CacheMemory, ExternalKV
from kvwire.kv.spec import KVSpec, Layout, RegionKind

__all__ = [
    "BlockAllocator",
    "BlockState",
    "CacheMemory",
    "ExternalKV",
    "HeadSlice",
    "KVCache",
    "KVSpec",
    "Layout",
    "MemoryBuffer",
    "RankLayout",
    "RegionInfo",
    "RegionKind",
    "TransferPlan",
    "layer_window",
    "pair_slices",
    "plan_transfer",
    "source_ranks",
    "tp_contacts",
    "tp_map",
    "tp_peers",
    "tp_sources",
]

"""KV layouts, the paged cache, block allocation, and TP/PP/block-size mapping to descriptors."""

from kvwire.kv.cache import KVCache, RegionInfo
from kvwire.kv.spec import KVSpec, Layout, RegionKind

__all__ = ["KVCache", "KVSpec", "Layout", "RegionInfo", "RegionKind"]

import numpy as np
import pytest

from kvwire.errors import LayoutError
from kvwire.kv import KVCache, KVSpec, Layout, RegionKind


def test_heads_split_across_tp_ranks() -> None:
    spec = KVSpec(num_layers=2, kv_heads=8, head_dim=4)
    assert spec.heads_per_rank(4) == 2
    assert [spec.first_head(4, r) for r in range(4)] == [0, 2, 4, 6]
    with pytest.raises(LayoutError):
        spec.heads_per_rank(3)


def test_regions_are_contiguous_slices_of_one_slab() -> None:
    spec = KVSpec(num_layers=3, kv_heads=2, head_dim=8, layout=Layout.NHD, block_size=4)
    cache = KVCache(spec, num_blocks=5, first_layer=1, num_layers=2)
    regions = cache.regions()
    assert [(r.layer, r.kind) for r in regions] == [
        (1, RegionKind.K),
        (1, RegionKind.V),
        (2, RegionKind.K),
        (2, RegionKind.V),
    ]
    base = int(cache.slab.ctypes.data)
    size = 5 * cache.block_len
    assert [r.base_addr - base for r in regions] == [0, size, 2 * size, 3 * size]
    cache.k(2)[3] = 7
    raw = cache.slab.reshape(-1).view(np.uint8)
    start = 2 * size + 3 * cache.block_len
    assert raw[start : start + cache.block_len].view(np.float16).tolist() == [7.0] * (4 * 2 * 8)
    with pytest.raises(LayoutError):
        cache.k(0)


@pytest.mark.parametrize("layout", [Layout.HND, Layout.NHD])
def test_a_cache_allocates_every_byte_its_regions_advertise(layout: Layout) -> None:
    """A fused cache (a head's row is K then V) allocated half of what its regions said: a transfer or a
    digest over it read and wrote past the slab."""
    kinds = [False, True] if layout is Layout.HND else [False]
    for fused in kinds:
        spec = KVSpec(
            num_layers=2, kv_heads=2, head_dim=4, dtype="float16", block_size=4, kv_fused=fused, layout=layout
        )
        cache = KVCache(spec, 3)
        regions = cache.regions()
        assert sum(r.block_len * r.num_blocks for r in regions) == cache.slab.nbytes
        assert cache.region(0, spec.kinds[0])[0].nbytes == cache.block_len

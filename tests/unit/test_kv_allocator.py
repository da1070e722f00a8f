import numpy as np
import pytest

from kvwire.errors import AllocationError, BlockRangeError
from kvwire.kv import BlockAllocator, BlockState


def test_allocate_free_roundtrip_counts_and_states() -> None:
    a = BlockAllocator(8)
    ids = a.allocate(3)
    assert ids == [0, 1, 2]
    assert (a.num_free, a.num_used, a.num_quarantined) == (5, 3, 0)
    assert all(a.state(b) is BlockState.ALLOCATED and a.refcount(b) == 1 for b in ids)
    a.free(ids)
    assert (a.num_free, a.num_used) == (8, 0)
    assert all(a.state(b) is BlockState.FREE for b in ids)


def test_short_allocation_raises_and_allocates_nothing() -> None:
    a = BlockAllocator(4)
    a.allocate(3)
    with pytest.raises(AllocationError):
        a.allocate(2)
    assert a.num_free == 1
    assert a.allocate(1) == [3]
    with pytest.raises(AllocationError):
        a.allocate(-1)
    assert a.allocate(0) == []


def test_freed_blocks_are_reused_fifo() -> None:
    a = BlockAllocator(4)
    a.allocate(4)
    a.free([2, 0])
    assert a.allocate(2) == [2, 0]


def test_double_free_raises_typed_and_changes_nothing() -> None:
    a = BlockAllocator(4)
    ids = a.allocate(2)
    a.free([ids[0]])
    with pytest.raises(AllocationError, match="free"):
        a.free([ids[1], ids[0]])  # ids[1] is valid, but the call is all or nothing
    assert a.state(ids[1]) is BlockState.ALLOCATED
    with pytest.raises(AllocationError):
        a.free([ids[1], ids[1]])  # one reference, freed twice in one call
    assert a.refcount(ids[1]) == 1


def test_foreign_ids_raise_block_range_error() -> None:
    a = BlockAllocator(4)
    a.allocate(4)
    for bad in (-1, 4, 100):
        with pytest.raises(BlockRangeError):
            a.free([bad])
        with pytest.raises(BlockRangeError):
            a.quarantine([bad])
    with pytest.raises(BlockRangeError):
        a.free([True])
    with pytest.raises(BlockRangeError):
        a.state(4)
    assert a.num_used == 4


def test_numpy_ids_are_accepted() -> None:
    a = BlockAllocator(4)
    a.allocate(2)
    a.free(list(np.array([0, 1])))
    assert a.num_free == 4


def test_incref_shares_until_last_reference() -> None:
    a = BlockAllocator(4)
    (b,) = a.allocate(1)
    a.incref([b, b])
    assert a.refcount(b) == 3
    a.free([b, b])
    assert a.state(b) is BlockState.ALLOCATED
    a.free([b])
    assert a.state(b) is BlockState.FREE and a.num_free == 4
    with pytest.raises(AllocationError):
        a.incref([b])


def test_quarantined_blocks_cannot_be_freed_shared_or_requarantined() -> None:
    a = BlockAllocator(4)
    ids = a.allocate(2)
    a.quarantine(ids)
    assert a.num_quarantined == 2 and a.num_used == 2
    assert all(a.state(b) is BlockState.QUARANTINED for b in ids)
    for op in (a.free, a.incref, a.quarantine):
        with pytest.raises(AllocationError):
            op([ids[0]])
    assert a.num_quarantined == 2 and a.num_free == 2


def test_release_quarantine_returns_to_allocated_or_frees() -> None:
    a = BlockAllocator(4)
    ids = a.allocate(3)
    a.incref([ids[0]])
    a.quarantine(ids)
    a.release_quarantine([ids[2]])
    assert a.state(ids[2]) is BlockState.ALLOCATED and a.num_quarantined == 2
    a.release_quarantine(ids[:2], free=True)
    assert a.state(ids[0]) is BlockState.ALLOCATED and a.refcount(ids[0]) == 1  # was shared
    assert a.state(ids[1]) is BlockState.FREE
    assert (a.num_free, a.num_quarantined) == (2, 0)
    with pytest.raises(AllocationError):
        a.release_quarantine([ids[2]])  # not quarantined


def test_quarantine_of_free_or_listed_twice_raises() -> None:
    a = BlockAllocator(4)
    with pytest.raises(AllocationError):
        a.quarantine([0])
    ids = a.allocate(1)
    with pytest.raises(BlockRangeError):
        a.quarantine([ids[0], ids[0]])
    assert a.num_quarantined == 0


def test_allocator_needs_blocks() -> None:
    with pytest.raises(AllocationError):
        BlockAllocator(0)

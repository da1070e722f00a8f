"""Block allocator for one rank's paged KV cache: refcounted blocks and a quarantined state.

Theory of operation. A block is in one of three states (``BlockState``):

* ``FREE``: on the free queue, refcount 0.
* ``ALLOCATED``: refcount >= 1. ``allocate`` hands out blocks with refcount 1; ``incref`` shares them
  (prefix cache); ``free`` drops one reference and returns the block to the free queue at 0.
* ``QUARANTINED``: an allocated block that is registered to a peer which may still write into (push) or
  read from (pull) it. A posted transfer cannot be recalled, so such a block must not be reused until
  the peer has ended the registration (DESIGN.md §3.2). ``free`` and ``incref`` refuse it;
  ``release_quarantine(ids)`` returns it to ``ALLOCATED`` with its refcount unchanged, and
  ``release_quarantine(ids, free=True)`` also drops one reference (the usual end of an aborted request).

Every call validates all its ids before changing anything, so a call that raises changes nothing.
Foreign ids (outside ``[0, num_blocks)``) raise ``BlockRangeError``; ids in the wrong state (double free,
freeing a quarantined block, quarantining a free block, ...) raise ``AllocationError``.

The free queue is FIFO (a deque): O(1) per block for allocate and free. A fresh allocator hands out
blocks in ascending order, which keeps early requests contiguous (fewer transfer descriptors).
"""

from __future__ import annotations

import enum
from collections import Counter, deque
from collections.abc import Iterable, Sequence
from numbers import Integral

from kvwire.errors import AllocationError, BlockRangeError


class BlockState(enum.Enum):
    FREE = "free"
    ALLOCATED = "allocated"
    QUARANTINED = "quarantined"


class BlockAllocator:
    """Allocates block ids ``0 .. num_blocks-1`` of one rank's cache."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise AllocationError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self._refs = [0] * num_blocks
        self._quarantined: set[int] = set()
        self._free: deque[int] = deque(range(num_blocks))

    # -- queries -------------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        """Blocks not free: allocated and quarantined ones (``num_free + num_used == num_blocks``)."""
        return self.num_blocks - len(self._free)

    @property
    def num_quarantined(self) -> int:
        return len(self._quarantined)

    def state(self, block: int) -> BlockState:
        self._check_range((block,))
        if self._refs[block] == 0:
            return BlockState.FREE
        return BlockState.QUARANTINED if block in self._quarantined else BlockState.ALLOCATED

    def refcount(self, block: int) -> int:
        self._check_range((block,))
        return self._refs[block]

    # -- transitions ---------------------------------------------------------------------------------
    def allocate(self, n: int) -> list[int]:
        """``n`` fresh blocks with refcount 1; ``AllocationError`` (allocating nothing) when short."""
        if n < 0:
            raise AllocationError(f"cannot allocate {n} blocks")
        if n > len(self._free):
            raise AllocationError(f"out of blocks: {n} requested, {len(self._free)} free")
        popleft = self._free.popleft
        ids = [popleft() for _ in range(n)]
        refs = self._refs
        for b in ids:
            refs[b] = 1
        return ids

    def incref(self, ids: Sequence[int]) -> None:
        """Share allocated blocks (one more reference per occurrence in ``ids``)."""
        self._check_state(ids, BlockState.ALLOCATED, "incref")
        for b in ids:
            self._refs[b] += 1

    def free(self, ids: Sequence[int]) -> None:
        """Drop one reference per occurrence in ``ids``; blocks reaching 0 return to the free queue."""
        self._check_state(ids, BlockState.ALLOCATED, "free")
        counts = Counter(ids)
        for b, n in counts.items():
            if n > self._refs[b]:
                raise AllocationError(f"free: block {b} freed {n} times but has {self._refs[b]} references")
        refs = self._refs
        for b in ids:
            refs[b] -= 1
            if refs[b] == 0:
                self._free.append(b)

    def quarantine(self, ids: Sequence[int]) -> None:
        """Mark allocated blocks as registered to a peer: they cannot be freed or shared until released."""
        self._check_state(ids, BlockState.ALLOCATED, "quarantine")
        if len(set(ids)) != len(ids):
            raise BlockRangeError("quarantine: a block id is listed twice")
        self._quarantined.update(ids)

    def release_quarantine(self, ids: Sequence[int], *, free: bool = False) -> None:
        """End quarantine: back to ``ALLOCATED``, or with ``free=True`` also drop one reference."""
        self._check_state(ids, BlockState.QUARANTINED, "release_quarantine")
        if len(set(ids)) != len(ids):
            raise BlockRangeError("release_quarantine: a block id is listed twice")
        self._quarantined.difference_update(ids)
        if free:
            self.free(ids)

    # -- validation ----------------------------------------------------------------------------------
    def _check_range(self, ids: Iterable[int]) -> None:
        n = self.num_blocks
        for b in ids:
            # numpy integers pass (block tables often are numpy arrays); bools and floats do not.
            if isinstance(b, bool) or not isinstance(b, Integral) or not 0 <= b < n:
                raise BlockRangeError(f"block id {b!r} is outside [0, {n})")

    def _check_state(self, ids: Sequence[int], want: BlockState, op: str) -> None:
        self._check_range(ids)
        for b in ids:
            got = self.state(b)
            if got is not want:
                raise AllocationError(f"{op}: block {b} is {got.value}, expected {want.value}")

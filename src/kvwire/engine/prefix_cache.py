"""The reference engine's prefix cache, as vLLM's automatic prefix caching: whole KV blocks of earlier
prompts, found again by the chained hashes of their token ids.

Theory of operation. A block's key is ``blake2b(key of the block before + its token ids)``, so block
``i`` matches only when the whole prompt up to its end matches. After a request's prefill the cache
takes a reference of its own on the request's whole blocks (``insert``); a later request whose prompt
starts with the same blocks shares them (``match``, then ``acquire``: one more reference each) and
prefills only the rest. A cached block that no request references any more is *evictable*: it stays in
the cache, on an LRU (a request's tail blocks go first, so a prefix loses its end before its head), until
a request needs blocks that the free queue does not have (``make_room``). So the cache is bounded by the
KV pool: it only ever holds blocks nobody else needs.

Exactness. Only blocks inside whole prefill chunks are cached, and a hit is cut down to whole chunks
(``model.prefill_chunk``: the model computes each chunk with the same array shapes whatever follows it),
so a request served from the cache writes, and then reads, the same KV bytes as one prefilled from
position 0 (``tests/unit/test_engine_prefix_cache.py``). Blocks are never written after their prefill:
the prefill of the uncached rest starts at the first uncached chunk, and the steps write past the prompt.

Only requests that prefill here use it (P and colocated requests; not D's, whose KV arrives by transfer).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvwire.kv.allocator import BlockAllocator


@dataclass(frozen=True, slots=True)
class PrefixStats:
    cached_blocks: int  # blocks the cache holds (shared with requests or evictable)
    evictable_blocks: int  # cached blocks no request uses: free for the taking
    query_tokens: int  # prompt tokens of the requests admitted with the cache on
    hit_tokens: int  # of which were found in the cache (not prefilled)


class PrefixCache:
    def __init__(self, allocator: BlockAllocator, block_size: int, chunk_tokens: int) -> None:
        self.allocator = allocator
        self.block_size = block_size
        self.chunk_blocks = chunk_tokens // block_size
        self._block_of: dict[bytes, int] = {}
        self._key_of: dict[int, bytes] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()  # least recently used first
        self.query_tokens = 0
        self.hit_tokens = 0

    # -- queries -------------------------------------------------------------------------------------
    def keys(self, prompt: Sequence[int]) -> list[bytes]:
        """Chained keys of the blocks a prefill of ``prompt`` completes in whole chunks (the prefill covers
        ``prompt[:-1]``; the last position is the first step's)."""
        bs, cb = self.block_size, self.chunk_blocks
        n = (len(prompt) - 1) // (bs * cb) * cb
        tokens = np.asarray(prompt[: n * bs], dtype=np.int64)
        out: list[bytes] = []
        prev = b""
        for i in range(n):
            prev = hashlib.blake2b(prev + tokens[i * bs : (i + 1) * bs].tobytes(), digest_size=16).digest()
            out.append(prev)
        return out

    def match(self, keys: Sequence[bytes]) -> list[int]:
        """The cached blocks of the longest cached prefix of ``keys``, cut down to whole chunks."""
        hit: list[int] = []
        for key in keys:
            block = self._block_of.get(key)
            if block is None:
                break
            hit.append(block)
        return hit[: len(hit) // self.chunk_blocks * self.chunk_blocks]

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    def available(self, hit: Sequence[int]) -> int:
        """Blocks a request could get besides ``hit``: free ones and evictable ones not in ``hit``."""
        taken = sum(1 for b in hit if b in self._evictable)
        return self.allocator.num_free + len(self._evictable) - taken

    def stats(self) -> PrefixStats:
        return PrefixStats(len(self._key_of), len(self._evictable), self.query_tokens, self.hit_tokens)

    # -- transitions ---------------------------------------------------------------------------------
    def acquire(self, hit: Sequence[int], prompt_tokens: int) -> None:
        """A request admitted with ``hit`` as its first blocks: share them."""
        self.allocator.incref(hit)
        for b in hit:
            self._evictable.pop(b, None)
        self.query_tokens += prompt_tokens
        self.hit_tokens += len(hit) * self.block_size

    def make_room(self, n: int) -> None:
        """Evict least recently used blocks until ``n`` are free (or nothing more is evictable)."""
        while self.allocator.num_free < n and self._evictable:
            block, _ = self._evictable.popitem(last=False)
            del self._block_of[self._key_of.pop(block)]
            self.allocator.free([block])

    def insert(self, keys: Sequence[bytes], block_ids: Sequence[int]) -> None:
        """After a prefill: cache the request's blocks under ``keys`` (those not cached yet)."""
        for key, block in zip(keys, block_ids, strict=False):
            if key in self._block_of or block in self._key_of:
                continue  # cached already (a hit, or the same prefix prefilled by another request)
            self.allocator.incref([block])
            self._block_of[key] = block
            self._key_of[block] = key

    def released(self, block_ids: Sequence[int]) -> None:
        """A request dropped its references to ``block_ids``: cached blocks nobody else uses become
        evictable, the tail's first."""
        for block in reversed(block_ids):
            if block in self._key_of and self.allocator.refcount(block) == 1:
                self._evictable[block] = None
                self._evictable.move_to_end(block)

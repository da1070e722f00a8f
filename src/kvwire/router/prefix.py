"""What each prefill engine probably holds in its prefix cache: a router-side index of block hashes.

The router hashes a prompt in blocks of ``BLOCK_TOKENS`` tokens (UTF-8 bytes for text, which is exact
for kvwire's byte-level engines and proportional for vLLM's tokenizers; ids for a token prompt). Each
hash chains the one before it, as vLLM's prefix cache does, so block ``i`` matches only when the whole
prompt up to it matches. After sending a prompt to P the router records its hashes under P; before
choosing P it asks, for every P at once, how many leading blocks of the new prompt are recorded there
(``overlaps``).

Each engine's entries are an LRU bounded at its capacity: the KV blocks the engine says it has (its etcd
record or ``/health``: ``kv_blocks`` × ``block_size``), else ``DEFAULT_CAPACITY``; an engine evicts too, and
the router must not grow without bound. A block's holders are also indexed by hash, so a lookup costs
the prompt's blocks times the engines that hold them, not times the fleet. A new life of an engine (new
incarnation) starts with an empty index. This is llm-d's and Dynamo's "approximate" mode: it needs
nothing from the engine, and it is wrong only where the engine evicted blocks the router still lists,
which costs a worse pick, never a wrong answer.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence

BLOCK_TOKENS = 16
DEFAULT_CAPACITY = 16384  # blocks per engine: 256k tokens at 16 per block
MAX_CAPACITY = 1 << 20  # blocks per engine whatever it says (16M tokens): an engine's word sizes no table
MAX_BLOCKS_PER_PROMPT = 8192  # a longer prompt is matched on its first 128k tokens only


def block_hashes(prompt: str | Sequence[int], block_tokens: int = BLOCK_TOKENS) -> list[bytes]:
    """Chained hashes of the prompt's whole blocks (a partial last block is never cached)."""
    n = min(len(prompt) // block_tokens, MAX_BLOCKS_PER_PROMPT)
    if isinstance(prompt, str):
        data = prompt.encode()
        n = min(len(data) // block_tokens, MAX_BLOCKS_PER_PROMPT)
        blocks = [data[i * block_tokens : (i + 1) * block_tokens] for i in range(n)]
    else:
        # Token ids as hex, comma-separated: any int a client sends hashes (no fixed width to overflow,
        # no decimal digit limit); the engine, not the router, judges whether the id is in its vocabulary.
        blocks = [
            b",".join(b"%x" % t for t in prompt[i * block_tokens : (i + 1) * block_tokens]) for i in range(n)
        ]
    out: list[bytes] = []
    prev = b""
    for block in blocks:
        prev = hashlib.blake2b(prev + block, digest_size=12).digest()
        out.append(prev)
    return out


class PrefixIndex:
    """Per engine URL, the block hashes of prompts recently sent there (an LRU per engine)."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        self.capacity = capacity
        self._engines: dict[str, OrderedDict[bytes, None]] = {}
        self._capacity: dict[str, int] = {}
        self._holders: dict[bytes, set[str]] = {}

    def set_capacity(self, url: str, blocks: int) -> None:
        """The engine's cache size in this index's blocks (``BLOCK_TOKENS`` tokens each)."""
        self._capacity[url] = min(max(1, blocks), MAX_CAPACITY)
        self._evict(url)

    def overlaps(self, hashes: Sequence[bytes]) -> dict[str, int]:
        """For every engine holding the first block, how many leading blocks of ``hashes`` it holds."""
        out: dict[str, int] = {}
        alive: set[str] = set()
        for i, h in enumerate(hashes):
            holders = self._holders.get(h)
            now = set(holders) if i == 0 and holders else alive & holders if holders else set()
            for url in alive - now:
                out[url] = i
            alive = now
            if not alive:
                return out
        for url in alive:
            out[url] = len(hashes)
        return out

    def overlap(self, url: str, hashes: Sequence[bytes]) -> int:
        """How many leading blocks of ``hashes`` one engine holds (whatever the other engines hold)."""
        for i, h in enumerate(hashes):
            holders = self._holders.get(h)
            if holders is None or url not in holders:
                return i
        return len(hashes)

    def record(self, url: str, hashes: Sequence[bytes]) -> None:
        held = self._engines.setdefault(url, OrderedDict())
        # Tail first, so a prompt's head block is its most recent entry and eviction takes the tail: a
        # lookup needs block 0, and a chain without its head would be dead weight.
        for h in reversed(hashes):
            if h in held:
                held.move_to_end(h)
            else:
                held[h] = None
                self._holders.setdefault(h, set()).add(url)
        self._evict(url)

    def _evict(self, url: str) -> None:
        held = self._engines.get(url)
        if held is None:
            return
        cap = self._capacity.get(url, self.capacity)
        while len(held) > cap:
            h, _ = held.popitem(last=False)
            self._unhold(h, url)

    def _unhold(self, h: bytes, url: str) -> None:
        holders = self._holders.get(h)
        if holders is not None:
            holders.discard(url)
            if not holders:
                del self._holders[h]

    def forget(self, url: str) -> None:
        """The engine left, or restarted with an empty cache."""
        for h in self._engines.pop(url, {}):
            self._unhold(h, url)
        self._capacity.pop(url, None)

    def size(self, url: str) -> int:
        return len(self._engines.get(url, ()))

    def urls(self) -> set[str]:
        """Every engine URL the index keeps anything for (its blocks or its cache size)."""
        return set(self._engines) | set(self._capacity)

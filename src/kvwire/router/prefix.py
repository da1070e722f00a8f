"""What each prefill engine probably holds in its prefix cache: a router-side index of block hashes.

The router hashes a prompt in blocks of ``BLOCK_TOKENS`` tokens (UTF-8 bytes for text, which is exact
for kvwire's byte-level engines and proportional for vLLM's tokenizers; ids for a token prompt). Each
hash chains the one before it, as vLLM's prefix cache does, so block ``i`` matches only when the whole
prompt up to it matches. After sending a prompt to P the router records its hashes under P; before
choosing P it counts, per P, how many leading blocks of the new prompt are recorded there (``overlap``).
Each engine's index is an LRU bounded at ``capacity`` blocks (an engine evicts too, and the router must
not grow without bound); a new life of an engine (new incarnation) starts with an empty index.
This is llm-d's and Dynamo's "approximate" mode: it needs nothing from the engine, and it is wrong only
where the engine evicted blocks the router still lists, which costs a worse pick, never a wrong answer.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence

BLOCK_TOKENS = 16
DEFAULT_CAPACITY = 16384  # blocks per engine: 256k tokens at 16 per block
MAX_BLOCKS_PER_PROMPT = 8192  # a longer prompt is matched on its first 128k tokens only


def block_hashes(prompt: str | Sequence[int], block_tokens: int = BLOCK_TOKENS) -> list[bytes]:
    """Chained hashes of the prompt's whole blocks (a partial last block is never cached)."""
    data = (
        prompt.encode() if isinstance(prompt, str) else b"".join(int(t).to_bytes(4, "little") for t in prompt)
    )
    unit = block_tokens * (1 if isinstance(prompt, str) else 4)
    out: list[bytes] = []
    prev = b""
    for start in range(0, min(len(data) // unit, MAX_BLOCKS_PER_PROMPT) * unit, unit):
        prev = hashlib.blake2b(prev + data[start : start + unit], digest_size=12).digest()
        out.append(prev)
    return out


class PrefixIndex:
    """Per engine URL, the block hashes of prompts recently sent there (LRU, ``capacity`` per engine)."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        self.capacity = capacity
        self._engines: dict[str, OrderedDict[bytes, None]] = {}

    def overlap(self, url: str, hashes: Sequence[bytes]) -> int:
        """How many leading blocks of ``hashes`` this engine is believed to hold."""
        held = self._engines.get(url)
        if not held:
            return 0
        n = 0
        for h in hashes:
            if h not in held:
                break
            n += 1
        return n

    def record(self, url: str, hashes: Sequence[bytes]) -> None:
        held = self._engines.setdefault(url, OrderedDict())
        for h in hashes[-self.capacity :]:
            held[h] = None
            held.move_to_end(h)
        while len(held) > self.capacity:
            held.popitem(last=False)

    def forget(self, url: str) -> None:
        """The engine left, or restarted with an empty cache."""
        self._engines.pop(url, None)

    def size(self, url: str) -> int:
        return len(self._engines.get(url, ()))

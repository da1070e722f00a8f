"""The engine's paged KV: one ``KVCache`` per (pp, tp) rank, one block allocator for all of them.

Every rank uses the same block ids for a request (as vLLM's workers do), so one allocator serves the
engine. A layer lives in the cache of its PP stage; a KV head lives in the cache of every TP rank that
holds it (heads are replicated when there are more TP ranks than KV heads).

Reads return per-query-head arrays assembled from the rank that serves each query head (as real TP
would), in the model's head order and always with the same shape, so the attention math that follows does
not depend on the TP or PP layout: this is what makes a transferred cache give bit-identical results.
"""

from __future__ import annotations

import numpy as np

from kvwire.errors import LayoutError
from kvwire.kv.allocator import BlockAllocator
from kvwire.kv.cache import KVCache
from kvwire.kv.mapping import layer_window
from kvwire.kv.spec import KVSpec, Layout


class PagedKV:
    def __init__(self, spec: KVSpec, num_blocks: int, *, q_heads: int, tp_size: int = 1, pp_size: int = 1):
        self.spec = spec
        self.num_blocks = num_blocks
        self.tp_size = tp_size
        self.pp_size = pp_size
        self.q_heads = q_heads
        self.stages = [layer_window(spec.num_layers, pp_size, p) for p in range(pp_size)]
        self.caches: dict[tuple[int, int], KVCache] = {
            (pp, tp): KVCache(
                spec,
                num_blocks,
                tp_size=tp_size,
                tp_rank=tp,
                first_layer=self.stages[pp].start,
                num_layers=len(self.stages[pp]),
            )
            for pp in range(pp_size)
            for tp in range(tp_size)
        }
        self.allocator = BlockAllocator(num_blocks)
        self._stage_of = [s for s, layers in enumerate(self.stages) for _ in layers]
        # Query heads each TP rank serves, and how many of them share one of its KV heads.
        self._q_per_rank = q_heads // tp_size
        heads = spec.heads_per_rank(tp_size)
        if self._q_per_rank % heads:
            raise LayoutError(f"{q_heads} query heads cannot be spread over tp_size={tp_size}")
        self._q_per_kv = self._q_per_rank // heads

    def cache(self, layer: int, tp_rank: int) -> KVCache:
        return self.caches[(self._stage_of[layer], tp_rank)]

    @property
    def block_size(self) -> int:
        return self.spec.block_size

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.spec.block_size)

    # -- writes ------------------------------------------------------------------------------------------
    def write(self, layer: int, block_ids: list[int], start: int, k: np.ndarray, v: np.ndarray) -> None:
        """Store K and V (``[kv_heads, n, head_dim]``, model head order) at positions ``start..start+n``."""
        n = k.shape[1]
        for tp in range(self.tp_size):
            c = self.cache(layer, tp)
            hs = slice(c.first_head, c.first_head + c.heads)
            for region, src in ((c.k(layer), k[hs]), (c.v(layer), v[hs])):
                self._write_region(region, block_ids, start, n, src)

    def _write_region(
        self, region: np.ndarray, block_ids: list[int], start: int, n: int, src: np.ndarray
    ) -> None:
        bs = self.spec.block_size
        hnd = self.spec.layout is Layout.HND
        pos, end = start, start + n
        # Whole blocks in one fancy-indexed assignment; a partial head and tail block by slices.
        b0, off = divmod(pos, bs)
        if off:
            take = min(bs - off, end - pos)
            self._put(region, block_ids[b0], off, src[:, :take], hnd)
            pos += take
        full = (end - pos) // bs
        if full:
            b = pos // bs
            part = src[:, pos - start : pos - start + full * bs].reshape(src.shape[0], full, bs, -1)
            ids = block_ids[b : b + full]
            region[ids] = part.transpose(1, 0, 2, 3) if hnd else part.transpose(1, 2, 0, 3)
            pos += full * bs
        if pos < end:
            self._put(region, block_ids[pos // bs], 0, src[:, pos - start :], hnd)

    @staticmethod
    def _put(region: np.ndarray, block: int, off: int, part: np.ndarray, hnd: bool) -> None:
        take = part.shape[1]
        if hnd:
            region[block, :, off : off + take] = part
        else:
            region[block, off : off + take] = part.transpose(1, 0, 2)

    # -- reads -------------------------------------------------------------------------------------------
    def read_heads(self, layer: int, block_ids: list[int], lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
        """K and V of positions ``[lo, hi)`` per KV head, in the cache dtype: ``[kv_heads, hi-lo, head_dim]``
        (each head from the first TP rank holding it)."""
        ks: list[np.ndarray] = []
        vs: list[np.ndarray] = []
        seen = 0
        for tp in range(self.tp_size):
            c = self.cache(layer, tp)
            if c.first_head + c.heads <= seen:
                continue  # a replica of heads already read
            for region, out in ((c.k(layer), ks), (c.v(layer), vs)):
                out.append(self._positions(region, c.heads, block_ids, lo, hi))
            seen = c.first_head + c.heads
        return np.concatenate(ks, axis=0), np.concatenate(vs, axis=0)

    def _positions(
        self, region: np.ndarray, heads: int, block_ids: list[int], lo: int, hi: int
    ) -> np.ndarray:
        """``[heads, hi-lo, head_dim]`` of one region (a copy, in the cache dtype)."""
        bs = self.spec.block_size
        first_b, last_b = lo // bs, -(-hi // bs)
        blocks = region[block_ids[first_b:last_b]]  # [nb, heads, bs, d] (HND) or [nb, bs, heads, d] (NHD)
        if self.spec.layout is Layout.HND:
            seq = blocks.transpose(1, 0, 2, 3).reshape(heads, -1, self.spec.head_dim)
        else:
            seq = blocks.reshape(-1, heads, self.spec.head_dim).transpose(1, 0, 2)
        out: np.ndarray = seq[:, lo - first_b * bs : hi - first_b * bs]
        return out

    def read(self, layer: int, block_ids: list[int], lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
        """K and V of positions ``[lo, hi)`` per query head: two float32 ``[q_heads, hi-lo, head_dim]``."""
        ks: list[np.ndarray] = []
        vs: list[np.ndarray] = []
        for tp in range(self.tp_size):
            c = self.cache(layer, tp)
            for region, out in ((c.k(layer), ks), (c.v(layer), vs)):
                seq = self._positions(region, c.heads, block_ids, lo, hi)
                out.append(np.repeat(seq, self._q_per_kv, axis=0))
        k = np.concatenate(ks, axis=0).astype(np.float32)
        v = np.concatenate(vs, axis=0).astype(np.float32)
        return k, v

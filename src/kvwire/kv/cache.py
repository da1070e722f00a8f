"""A paged KV cache on numpy: one slab, registered once, viewed as one region per (layer, kind).

Slab shape: ``[layers, kinds, num_blocks, *block_shape]``. Region (layer, kind) is the contiguous slice
``slab[layer - first_layer, kind_index]``: ``num_blocks`` blocks of ``block_len`` bytes each, so block ``b``
of a region starts at ``region.base_addr + b * block_len``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from kvwire.errors import LayoutError
from kvwire.kv.spec import KVSpec, RegionKind
from kvwire.protocol.types import MemKind


@dataclass(frozen=True, slots=True)
class RegionInfo:
    """What a peer needs to address one region (wire contract v1 ``regions`` entry)."""

    layer: int
    kind: RegionKind
    base_addr: int
    block_len: int
    num_blocks: int
    device_id: int = 0


@dataclass(frozen=True, slots=True)
class MemoryBuffer:
    """One contiguous byte range to register with the transport. ``owner`` keeps it alive."""

    addr: int
    length: int
    kind: MemKind = MemKind.DRAM
    device_id: int = 0
    owner: object = field(default=None, compare=False, repr=False)


class KVCache:
    """The KV cache of one (pp, tp) rank: the layers of its PP stage, the heads of its TP rank."""

    def __init__(
        self,
        spec: KVSpec,
        num_blocks: int,
        *,
        tp_size: int = 1,
        tp_rank: int = 0,
        first_layer: int = 0,
        num_layers: int | None = None,
    ) -> None:
        if num_blocks <= 0:
            raise LayoutError(f"num_blocks must be positive, got {num_blocks}")
        layers = spec.num_layers - first_layer if num_layers is None else num_layers
        if first_layer < 0 or layers <= 0 or first_layer + layers > spec.num_layers:
            raise LayoutError(f"layers [{first_layer}, {first_layer + layers}) outside the model")
        self.spec = spec
        self.num_blocks = num_blocks
        self.tp_size = tp_size
        self.tp_rank = tp_rank
        self.first_layer = first_layer
        self.num_layers = layers
        self.heads = spec.heads_per_rank(tp_size)
        self.first_head = spec.first_head(tp_size, tp_rank)
        self.block_shape = spec.block_shape(self.heads)
        self.block_len = spec.block_bytes(self.heads)
        shape = (layers, len(spec.kinds), num_blocks, *self.block_shape)
        self.slab: np.ndarray = np.zeros(shape, dtype=spec.np_dtype)
        self._regions: tuple[RegionInfo, ...] | None = None  # the slab never moves: computed once

    @property
    def layers(self) -> range:
        return range(self.first_layer, self.first_layer + self.num_layers)

    def region(self, layer: int, kind: RegionKind) -> np.ndarray:
        """``[num_blocks, *block_shape]`` view of one region."""
        if layer not in self.layers:
            raise LayoutError(f"layer {layer} is not held here (layers {self.layers})")
        return self.slab[layer - self.first_layer, self.spec.kinds.index(kind)]  # type: ignore[no-any-return]

    def k(self, layer: int) -> np.ndarray:
        return self.region(layer, RegionKind.KV if self.spec.mla else RegionKind.K)

    def v(self, layer: int) -> np.ndarray:
        return self.region(layer, RegionKind.KV if self.spec.mla else RegionKind.V)

    def regions(self) -> list[RegionInfo]:
        if self._regions is None:  # asked per digest (kv/digest.py): a view and its address per region
            self._regions = tuple(
                RegionInfo(
                    layer, kind, int(self.region(layer, kind).ctypes.data), self.block_len, self.num_blocks
                )
                for layer in self.layers
                for kind in self.spec.kinds
            )
        return list(self._regions)

    @property
    def mem_kind(self) -> MemKind:
        return MemKind.DRAM

    def buffers(self) -> list[MemoryBuffer]:
        """What to register: the one slab."""
        return [MemoryBuffer(int(self.slab.ctypes.data), int(self.slab.nbytes), MemKind.DRAM, 0, self.slab)]

    def block_bytes_view(self, layer: int, kind: RegionKind, block: int) -> np.ndarray:
        """The raw bytes of one block (for comparing caches byte for byte)."""
        raw: np.ndarray = self.region(layer, kind)[block].reshape(-1).view(np.uint8)
        return raw

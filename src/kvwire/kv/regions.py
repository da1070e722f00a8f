"""KV memory kvwire does not own: an engine's own cache described as regions, registered zero copy.

An engine (vLLM, SGLang, a test) hands kvwire what it already allocated: per (layer, kind) a region of
``num_blocks`` blocks of ``block_len`` bytes (block ``b`` at ``base_addr + b * block_len``), and the
buffers that hold those regions (what gets registered with NIXL, once each). ``KVCache`` (kvwire's own
numpy slab) and ``ExternalKV`` (anything else: numpy arrays, torch tensors on CPU or GPU, raw addresses)
both satisfy ``CacheMemory``, the one shape the connector, the handshake server and the planner read.

kvwire never copies or frees this memory; the engine must keep it alive and in place until the
connector is closed. ``ExternalKV`` keeps a reference to every array or tensor it was built from.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from kvwire.errors import LayoutError
from kvwire.kv.cache import MemoryBuffer, RegionInfo
from kvwire.kv.spec import KVSpec, RegionKind
from kvwire.protocol.types import MemKind


class CacheMemory(Protocol):
    """What kvwire reads of one (pp, tp) rank's KV memory (``KVCache`` and ``ExternalKV`` both are)."""

    @property
    def spec(self) -> KVSpec: ...
    @property
    def num_blocks(self) -> int: ...
    @property
    def tp_size(self) -> int: ...
    @property
    def tp_rank(self) -> int: ...
    @property
    def first_layer(self) -> int: ...
    @property
    def num_layers(self) -> int: ...
    @property
    def block_len(self) -> int: ...
    @property
    def mem_kind(self) -> MemKind: ...
    @property
    def layers(self) -> range: ...
    def regions(self) -> list[RegionInfo]: ...
    def buffers(self) -> list[MemoryBuffer]: ...


@dataclass(frozen=True, slots=True)
class BufferView:
    """Address, size and placement of an array or tensor, read without importing torch."""

    addr: int
    nbytes: int
    kind: MemKind
    device_id: int
    strides: tuple[int, ...]  # in bytes
    shape: tuple[int, ...]
    itemsize: int


def view_of(obj: Any) -> BufferView:
    """A numpy array or a torch tensor (duck-typed: ``data_ptr``, ``element_size``, ``device``)."""
    if isinstance(obj, np.ndarray):
        return BufferView(
            int(obj.ctypes.data), int(obj.nbytes), MemKind.DRAM, 0, tuple(obj.strides), obj.shape,
            int(obj.itemsize),
        )  # fmt: skip
    if hasattr(obj, "data_ptr") and hasattr(obj, "element_size") and hasattr(obj, "device"):
        item = int(obj.element_size())
        device = obj.device
        cuda = getattr(device, "type", "cpu") == "cuda"
        return BufferView(
            addr=int(obj.data_ptr()),
            nbytes=int(obj.numel()) * item,
            kind=MemKind.VRAM if cuda else MemKind.DRAM,
            device_id=int(device.index or 0) if cuda else 0,
            strides=tuple(int(s) * item for s in obj.stride()),
            shape=tuple(int(d) for d in obj.shape),
            itemsize=item,
        )
    raise LayoutError(f"cannot describe a {type(obj).__name__} as KV memory: give a numpy array or a tensor")


def _is_dense(v: BufferView) -> bool:
    """Whether the elements fill ``nbytes`` from ``addr`` with no gaps (C order)."""
    expected = v.itemsize
    for dim, stride in zip(reversed(v.shape), reversed(v.strides), strict=True):
        if dim != 1 and stride != expected:
            return False
        expected *= dim
    return True


class ExternalKV:
    """One rank's KV held in memory the engine allocated; satisfies ``CacheMemory``.

    ``regions`` are (layer, kind, base address) with this rank's block length (from the spec and its TP
    share of heads) and block count; ``buffers`` cover every region and do not overlap.
    """

    def __init__(
        self,
        spec: KVSpec,
        num_blocks: int,
        regions: Iterable[tuple[int, RegionKind, int]],
        buffers: Sequence[MemoryBuffer],
        *,
        tp_size: int = 1,
        tp_rank: int = 0,
    ) -> None:
        if num_blocks <= 0:
            raise LayoutError(f"num_blocks must be positive, got {num_blocks}")
        if not buffers:
            raise LayoutError("no memory to register")
        kinds = {b.kind for b in buffers}
        if len(kinds) != 1:
            raise LayoutError(
                f"one rank's KV must be all DRAM or all VRAM, got {sorted(k.value for k in kinds)}"
            )
        self.spec = spec
        self.num_blocks = num_blocks
        self.tp_size = tp_size
        self.tp_rank = tp_rank
        self.heads = spec.heads_per_rank(tp_size)
        self.block_len = spec.block_bytes(self.heads)
        self.mem_kind = kinds.pop()
        self._buffers = list(buffers)
        self._regions = self._check(list(regions))
        layers = sorted({r.layer for r in self._regions})
        self.first_layer = layers[0]
        self.num_layers = len(layers)

    def _check(self, regions: list[tuple[int, RegionKind, int]]) -> list[RegionInfo]:
        if not regions:
            raise LayoutError("no KV regions")
        seen = {(layer, kind) for layer, kind, _ in regions}
        if len(seen) != len(regions):
            raise LayoutError("a (layer, kind) region is given twice")
        layers = sorted({layer for layer, _, _ in regions})
        if layers != list(range(layers[0], layers[-1] + 1)) or layers[-1] >= self.spec.num_layers:
            raise LayoutError(f"layers {layers} are not one window of the model's {self.spec.num_layers}")
        if seen != {(ly, k) for ly in layers for k in self.spec.kinds}:
            raise LayoutError(f"every layer needs exactly the regions {[k.value for k in self.spec.kinds]}")
        size = self.num_blocks * self.block_len
        spans = sorted((b.addr, b.addr + b.length) for b in self._buffers)
        for (_, end), (start, _) in itertools.pairwise(spans):
            if start < end:
                raise LayoutError("registered buffers overlap")
        out = []
        for layer, kind, base in sorted(regions, key=lambda r: (r[0], self.spec.kinds.index(r[1]))):
            dev = self._covering(base, size, layer, kind)
            out.append(RegionInfo(layer, kind, base, self.block_len, self.num_blocks, dev.device_id))
        return out

    def _covering(self, base: int, size: int, layer: int, kind: RegionKind) -> MemoryBuffer:
        for b in self._buffers:
            if b.addr <= base and base + size <= b.addr + b.length:
                return b
        raise LayoutError(
            f"region {layer}/{kind.value} [{base:#x}, +{size}) is not inside one registered buffer "
            f"({self.num_blocks} blocks of {self.block_len} B)"
        )

    @property
    def layers(self) -> range:
        return range(self.first_layer, self.first_layer + self.num_layers)

    def regions(self) -> list[RegionInfo]:
        return list(self._regions)

    def buffers(self) -> list[MemoryBuffer]:
        return list(self._buffers)

    @classmethod
    def from_arrays(
        cls,
        spec: KVSpec,
        layers: Mapping[int, Sequence[Any]],
        *,
        tp_size: int = 1,
        tp_rank: int = 0,
    ) -> ExternalKV:
        """Per layer, one dense array or tensor per kind (``[k, v]``, or ``[kv]`` for MLA), each
        ``[num_blocks, ...]`` with blocks of this rank's block length. Every array is registered."""
        regions: list[tuple[int, RegionKind, int]] = []
        buffers: list[MemoryBuffer] = []
        counts: set[int] = set()
        block_len = spec.block_bytes(spec.heads_per_rank(tp_size))
        for layer, arrays in layers.items():
            if len(arrays) != len(spec.kinds):
                raise LayoutError(f"layer {layer}: {len(arrays)} arrays, expected {len(spec.kinds)}")
            for kind, arr in zip(spec.kinds, arrays, strict=True):
                v = view_of(arr)
                if not _is_dense(v) or v.nbytes % block_len:
                    raise LayoutError(
                        f"layer {layer} {kind.value}: {v.nbytes} B is not a dense run of {block_len} B blocks"
                    )
                counts.add(v.nbytes // block_len)
                regions.append((int(layer), kind, v.addr))
                buffers.append(MemoryBuffer(v.addr, v.nbytes, v.kind, v.device_id, arr))
        if len(counts) != 1:
            raise LayoutError(f"regions hold different block counts: {sorted(counts)}")
        return cls(spec, counts.pop(), regions, buffers, tp_size=tp_size, tp_rank=tp_rank)

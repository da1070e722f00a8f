"""vLLM's per-layer KV tensors as kvwire regions (no vLLM import: tensors are read by duck typing).

vLLM gives one tensor per attention layer, and the layout is read from its strides, not its shape:
* vLLM 0.34, every backend, and the 0.32 CPU backend: ``[num_blocks, kv_heads, block_size, 2 * head_dim]``
  (K and V share the last dimension; the layers may be views into one buffer). In the LBHNC order, which
  KvwireConnector asks vLLM for, each head's block is one contiguous run holding K and V (FlashAttention:
  ``[K|V]`` per token row; CPU: a K tile then a V tile): one fused region per layer (``KVSpec.kv_fused``).
* Older FlashAttention: ``[2, num_blocks, block_size, kv_heads, head_dim]``: K and V as two regions,
  NHD or HND by the strides (``kv_cache_stride_order``).
* FlashInfer's ``[num_blocks, 2, ...]`` (K and V interleaved per block outside the heads) is refused
  with a ``LayoutError`` naming the fix. MLA (``[num_blocks, block_size, latent_dim]``, or vLLM's 4-D
  ``[num_blocks, 1, block_size, latent_dim]``): one region.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvwire.errors import LayoutError
from kvwire.kv.cache import MemoryBuffer
from kvwire.kv.regions import BufferView, ExternalKV, view_of
from kvwire.kv.spec import KVSpec, Layout, RegionKind

_LAYER_INDEX = re.compile(r"(?:^|\.)(\d+)(?:\.|$)")
_DTYPES = {
    "float16": "float16",
    "half": "float16",
    "bfloat16": "bfloat16",
    "float32": "float32",
    "float": "float32",
    "float8_e4m3fn": "float8",
    "float8_e5m2": "float8",
    "uint8": "float8",
}


def layer_index(name: str) -> int:
    """The model's layer index in a vLLM attention layer name (``model.layers.7.self_attn.attn``)."""
    m = _LAYER_INDEX.search(name)
    if m is None:
        raise LayoutError(f"no layer index in KV cache name {name!r}")
    return int(m.group(1))


def dtype_name(tensor: Any) -> str:
    """kvwire's dtype name of a tensor's or array's dtype (``torch.bfloat16`` -> ``bfloat16``)."""
    raw = str(tensor.dtype).removeprefix("torch.")
    try:
        return _DTYPES[raw]
    except KeyError:
        raise LayoutError(f"KV dtype {raw} is not supported; one of {sorted(set(_DTYPES))}") from None


@dataclass(frozen=True, slots=True)
class LayerLayout:
    """Where a layer's regions start (byte offsets from the tensor's first byte) and its block layout."""

    offsets: tuple[int, ...]  # one per region kind: (K, V), or (KV,) for MLA
    block_len: int
    num_blocks: int
    layout: Layout
    kv_fused: bool = False


def _physical(v: BufferView) -> list[int]:
    """Logical dims ordered outermost first in memory; raises when the tensor has gaps or overlaps."""
    order = sorted(range(len(v.shape)), key=lambda d: -v.strides[d])
    expected = v.itemsize
    for d in reversed(order):
        if v.shape[d] != 1 and v.strides[d] != expected:
            raise LayoutError(f"KV tensor {v.shape} with strides {v.strides} is not dense")
        expected *= v.shape[d]
    return order


def _mla_layout(v: BufferView, block_size: int, head_dim: int) -> LayerLayout:
    """MLA's latent cache: ``[num_blocks, block_size, latent]``, or the 4-D ``[B, H, N, C]`` view vLLM's
    KV cache interface gives every spec (0.32's CPU build and 0.34), whose H is 1 for MLA. Each block one
    dense run of token rows."""
    inner = tuple(v.shape[1:])
    if inner not in ((block_size, head_dim), (1, block_size, head_dim)):
        raise LayoutError(
            f"MLA KV tensor {v.shape}: expected [num_blocks, {block_size}, {head_dim}] "
            f"or [num_blocks, 1, {block_size}, {head_dim}]"
        )
    row = head_dim * v.itemsize
    if v.strides[-1] != v.itemsize or v.strides[-2] != row or v.strides[0] != block_size * row:
        raise LayoutError(f"MLA KV tensor {v.shape} with strides {v.strides}: a block is not one run of rows")
    return LayerLayout((0,), v.strides[0], v.shape[0], Layout.NHD)


def layer_layout(
    v: BufferView, block_size: int, heads: int, head_dim: int, *, mla: bool = False
) -> LayerLayout:
    """Read one layer tensor's layout from its shape and strides (see the module doc)."""
    order = _physical(v)
    if mla:
        return _mla_layout(v, block_size, head_dim)
    if len(v.shape) == 4 and v.shape[1:] == (heads, block_size, 2 * head_dim):
        # vLLM >= 0.34 (every backend) and the 0.32 CPU backend: [blocks, heads, tokens, K and V].
        if order != [0, 1, 2, 3]:
            raise LayoutError(
                f"KV tensor {v.shape} with strides {v.strides}: kvwire needs vLLM's LBHNC (HND) layout, "
                "which KvwireConnector requests; another connector or VLLM_KV_CACHE_LAYOUT overrode it"
            )
        return LayerLayout((0,), v.strides[0], v.shape[0], Layout.HND, kv_fused=True)
    if len(v.shape) != 5 or 2 not in v.shape[:2]:
        raise LayoutError(
            f"KV tensor {v.shape}: expected [2, num_blocks, ...] with block, head and head_dim dims"
        )
    kv_dim = 0 if v.shape[0] == 2 else 1
    blocks_dim = 1 - kv_dim
    if order[:2] != [kv_dim, blocks_dim]:
        raise LayoutError(
            f"KV tensor {v.shape}: K and V are interleaved inside each block (FlashInfer's layout); kvwire "
            "needs K and V as separate runs of blocks: use the FLASH_ATTN attention backend"
        )
    inner = [d - 2 for d in order[2:]]  # within a block: 0 tokens, 1 heads, 2 head_dim (logical)
    sizes = v.shape[2:]
    if sizes[2] != head_dim or sorted(sizes[:2]) != sorted((block_size, heads)):
        raise LayoutError(f"KV tensor {v.shape}: block {sizes} is not ({block_size}, {heads}, {head_dim})")
    if inner[2] != 2:
        raise LayoutError(f"KV tensor {v.shape}: head_dim is not innermost in memory")
    # Logical order is [tokens, heads] (FlashAttention) unless the sizes say heads come first.
    tokens_first = sizes[0] == block_size if block_size != heads else True
    tok_dim = 0 if tokens_first else 1
    layout = Layout.NHD if inner[0] == tok_dim else Layout.HND
    return LayerLayout((0, v.strides[kv_dim]), v.strides[blocks_dim], v.shape[blocks_dim], layout)


def kv_from_vllm(
    kv_caches: Mapping[str, Any],
    *,
    num_layers: int,
    kv_heads: int,
    head_dim: int,
    block_size: int,
    tp_size: int = 1,
    tp_rank: int = 0,
    mla: bool = False,
    layout: Layout | None = None,
    kv_tiles: bool = False,
    layer_groups: tuple[int, ...] = (),
    group_windows: tuple[int, ...] = (),
) -> ExternalKV:
    """One vLLM worker's ``kv_caches`` (layer name -> tensor, as ``register_kv_caches`` gets them) as an
    ``ExternalKV``: each layer tensor registered once, K and V as regions, zero copy. ``num_layers`` and
    ``kv_heads`` are the model's totals; ``layout`` forces a layout when the tensor cannot tell (heads ==
    block_size). ``kv_tiles``: a fused cache holds per head a K tile then a V tile (vLLM's CPU backend),
    not ``[K|V]`` token rows (the GPU backends); the strides cannot tell, the platform does.
    ``layer_groups``/``group_windows``: a hybrid model's KV cache groups (``kv/groups.py``), whose layers
    share tensors (a block belongs to one group at a time): a tensor shared by several layers is
    registered once."""
    if not kv_caches:
        raise LayoutError("vLLM gave no KV cache tensors")
    spec0: KVSpec | None = None
    regions: list[tuple[int, RegionKind, int]] = []
    buffers: list[MemoryBuffer] = []
    num_blocks: set[int] = set()
    shared: set[tuple[int, int]] = set()  # (address, size) of the buffers registered so far
    heads = 1 if mla else KVSpec(1, kv_heads, head_dim).heads_per_rank(tp_size)  # this rank's share
    for name, tensor in sorted(kv_caches.items(), key=lambda kv: layer_index(kv[0])):
        v = view_of(tensor)
        ll = layer_layout(v, block_size, heads, head_dim, mla=mla)
        spec = KVSpec(
            num_layers=num_layers,
            kv_heads=kv_heads,
            head_dim=head_dim,
            dtype=dtype_name(tensor),
            block_size=block_size,
            layout=layout or ll.layout,
            mla=mla,
            kv_fused=ll.kv_fused,
            kv_tiles=kv_tiles and ll.kv_fused,
            layer_groups=tuple(layer_groups),
            group_windows=tuple(group_windows),
        )
        if spec0 is not None and spec != spec0:
            raise LayoutError(f"layer {name}: {spec} differs from the first layer's {spec0}")
        spec0 = spec
        if ll.block_len != spec.block_bytes(heads):
            raise LayoutError(
                f"layer {name}: block stride {ll.block_len} B != block length {spec.block_bytes(heads)} B"
            )
        num_blocks.add(ll.num_blocks)
        idx = layer_index(name)
        regions.extend((idx, kind, v.addr + off) for kind, off in zip(spec.kinds, ll.offsets, strict=True))
        if (v.addr, v.nbytes) not in shared:
            shared.add((v.addr, v.nbytes))
            buffers.append(MemoryBuffer(v.addr, v.nbytes, v.kind, v.device_id, tensor))
    if len(num_blocks) != 1 or spec0 is None:
        raise LayoutError(f"layers hold different block counts: {sorted(num_blocks)}")
    return ExternalKV(spec0, num_blocks.pop(), regions, buffers, tp_size=tp_size, tp_rank=tp_rank)

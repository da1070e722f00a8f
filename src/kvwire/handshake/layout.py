"""Validation of a full ``metadata`` reply against this engine: O(regions), no descriptor per block.

What vLLM's full path does per (region, block) — prepare a remote descriptor list — kvwire leaves to the
producer, which posts explicit coalesced descriptors built per request from each region's base address
(``base_addr + block * block_len``). What must hold for that to be safe is checked here once: the model
geometry, TP and PP of the peer, and that every region has the block length and block count they imply.
"""

from __future__ import annotations

from kvwire.errors import IncompatiblePeer, LayoutError
from kvwire.handshake.types import EngineInfo, LocalRank
from kvwire.kv.cache import RegionInfo
from kvwire.kv.mapping import RankLayout, layer_window, tp_map
from kvwire.kv.spec import RegionKind
from kvwire.protocol.messages import Metadata, RegionMsg

_MAX_DESC = 2**63 - 1  # a descriptor's fields are int64


def validate_layout(engine: EngineInfo, local: LocalRank, md: Metadata) -> RankLayout:
    """The peer rank's RankLayout, or ``IncompatiblePeer`` naming what does not match."""
    where = f"{md.engine_id} pp{md.pp_rank}/tp{md.tp_rank}"
    try:
        _check_model(engine, md)
        layout = RankLayout(
            tp_size=md.tp_size,
            tp_rank=md.tp_rank,
            pp_size=md.pp_size,
            pp_rank=md.pp_rank,
            first_layer=md.kv.first_layer,
            num_layers=md.kv.num_layers,
            block_size=md.kv.block_size,
            num_blocks=md.num_blocks,
            regions=tuple(_region(r) for r in md.regions),
        )
        _check_geometry(engine, local, md, layout)
    except (LayoutError, IncompatiblePeer) as exc:
        raise IncompatiblePeer(f"{where}: {exc}") from exc
    return layout


def _check_model(engine: EngineInfo, md: Metadata) -> None:
    spec, kv = engine.spec, md.kv
    theirs = (kv.kv_heads, kv.head_dim, kv.dtype, kv.layout, kv.mla, kv.kv_fused, kv.kv_tiles)
    ours = (
        spec.kv_heads,
        spec.head_dim,
        spec.dtype,
        spec.layout.value,
        spec.mla,
        spec.kv_fused,
        spec.kv_tiles,
    )
    if theirs != ours:
        raise IncompatiblePeer(
            f"KV geometry (heads, head_dim, dtype, layout, mla, kv_fused, kv_tiles) {theirs} != ours {ours}"
        )
    groups = (tuple(kv.layer_groups), tuple(kv.group_windows))
    if groups != (spec.layer_groups, spec.group_windows):
        raise IncompatiblePeer(
            f"KV cache groups (layer groups, sliding windows) {groups} != ours "
            f"{(spec.layer_groups, spec.group_windows)}"
        )


def _region(r: RegionMsg) -> RegionInfo:
    try:
        kind = RegionKind(r.kind)
    except ValueError:
        raise LayoutError(f"unknown region kind {r.kind!r}") from None
    return RegionInfo(r.layer, kind, r.base_addr, r.block_len, r.num_blocks, r.device_id)


def _check_geometry(engine: EngineInfo, local: LocalRank, md: Metadata, layout: RankLayout) -> None:
    spec = engine.spec
    # Raises LayoutError when the two TP sizes cannot be mapped (head divisibility, 1..MAX_TP).
    tp_map(spec, md.tp_size, engine.tp_size)
    window = layer_window(spec.num_layers, md.pp_size, md.pp_rank)
    if layout.layers != window:
        raise LayoutError(f"layers {layout.layers} are not PP stage {md.pp_rank}/{md.pp_size}'s {window}")
    expected = layout.num_layers * len(spec.kinds)
    if len(md.regions) != expected:
        raise LayoutError(f"{len(md.regions)} regions, expected {expected} ({layout.num_layers} layers)")
    block_len = layout.block_len(spec)
    for r in layout.regions:
        if r.kind not in spec.kinds:
            raise LayoutError(f"region kind {r.kind.value} in a {'MLA' if spec.mla else 'K/V'} cache")
        if r.block_len != block_len:
            raise LayoutError(f"region {r.layer}/{r.kind.value}: block_len {r.block_len} != {block_len}")
        if r.base_addr + r.num_blocks * r.block_len > _MAX_DESC or r.device_id > _MAX_DESC:
            # Descriptors are int64 rows (NIXL's, and the planner's arrays): a region past them raised
            # OverflowError out of every plan for the peer, uncounted (found by a review).
            raise LayoutError(
                f"region {r.layer}/{r.kind.value}: base_addr {r.base_addr} + {r.num_blocks} blocks or "
                f"device_id {r.device_id} do not fit a descriptor (at most 2**63 - 1)"
            )
    small, large = sorted((layout.block_size, local.cache.spec.block_size))
    if large % small:
        raise LayoutError(f"block sizes {layout.block_size} and {local.cache.spec.block_size} do not divide")
    if spec.layer_groups and small != large:
        # Each group's blocks are planned against the other side's in token order (kv/groups.py): one size.
        raise LayoutError(
            f"a hybrid model's KV cache groups need one block size on P and D, got {layout.block_size} and "
            f"{local.cache.spec.block_size}: start both with the same --block-size"
        )

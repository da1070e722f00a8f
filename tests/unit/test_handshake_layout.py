"""Validation of full metadata replies: O(regions) checks that make per-request descriptors safe."""

from __future__ import annotations

import dataclasses

import msgspec
import pytest

from kvwire.errors import IncompatiblePeer
from kvwire.handshake.layout import validate_layout
from kvwire.handshake.server import SideChannelServer
from kvwire.kv.spec import KVSpec, Layout
from kvwire.protocol.messages import GetMetadata, KVInfo, Metadata
from kvwire.testing.handshake_env import build_registered_engine
from kvwire.transport.inproc import InprocFabric

SPEC = KVSpec(num_layers=4, kv_heads=4, head_dim=8, block_size=4)


def reply(tp_size: int = 2, pp_size: int = 2, pp_rank: int = 1, spec: KVSpec = SPEC) -> Metadata:
    fabric = InprocFabric()
    info, ranks = build_registered_engine(
        "P", spec, 16, fabric.create_agent, tp_size=tp_size, pp_size=pp_size
    )
    md = SideChannelServer(info, ranks).answer(GetMetadata(pp_rank=pp_rank, tp_rank=0))
    assert isinstance(md, Metadata)
    return md


def local(tp_size: int = 1, spec: KVSpec = SPEC):  # type: ignore[no-untyped-def]
    fabric = InprocFabric()
    info, ranks = build_registered_engine("D", spec, 8, fabric.create_agent, tp_size=tp_size)
    return info, ranks[0]


def test_valid_reply_gives_the_rank_layout() -> None:
    md = reply()
    layout = validate_layout(*local(), md)
    assert (layout.tp_size, layout.pp_rank, layout.first_layer, layout.num_layers) == (2, 1, 2, 2)
    assert [r.base_addr for r in layout.regions] == [r.base_addr for r in md.regions]
    assert layout.block_len(SPEC) == md.regions[0].block_len


def _with_region(md: Metadata, i: int, **changes: object) -> Metadata:
    regions = list(md.regions)
    regions[i] = msgspec.structs.replace(regions[i], **changes)
    return msgspec.structs.replace(md, regions=regions)


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (lambda md: _with_region(md, 1, block_len=md.regions[1].block_len * 2), "block_len"),
        (lambda md: _with_region(md, 0, num_blocks=3), "blocks"),
        (lambda md: _with_region(md, 0, layer=0), "outside"),
        (lambda md: _with_region(md, 0, kind="kv"), "kind"),
        (lambda md: _with_region(md, 0, kind="q"), "unknown region kind"),
        (lambda md: msgspec.structs.replace(md, regions=md.regions[:-1]), "regions"),
        (lambda md: msgspec.structs.replace(md, regions=[*md.regions, md.regions[0]]), "twice"),
        (lambda md: msgspec.structs.replace(md, pp_rank=0), "PP stage"),
        (lambda md: msgspec.structs.replace(md, kv=msgspec.structs.replace(md.kv, head_dim=16)), "geometry"),
        (lambda md: msgspec.structs.replace(md, kv=msgspec.structs.replace(md.kv, layout="NHD")), "geometry"),
        (lambda md: msgspec.structs.replace(md, kv=msgspec.structs.replace(md.kv, block_size=3)), "block"),
        (lambda md: msgspec.structs.replace(md, tp_size=3), "divisible"),
        (lambda md: msgspec.structs.replace(md, pp_rank=5), "range"),
        (lambda md: _with_region(md, 0, base_addr=2**64 - 1), "do not fit a descriptor"),
        (lambda md: _with_region(md, 0, base_addr=2**63 - 8), "do not fit a descriptor"),  # its blocks pass
        (lambda md: _with_region(md, 0, device_id=2**63), "do not fit a descriptor"),
    ],
    ids=[
        "block-len",
        "num-blocks",
        "layer",
        "mla-kind",
        "bad-kind",
        "missing-region",
        "duplicate",
        "pp-window",
        "head-dim",
        "layout",
        "block-size-ratio",
        "tp-divisibility",
        "pp-rank",
        "address-past-int64",  # planning raised OverflowError, uncounted, for every request to the peer
        "blocks-past-int64",
        "device-past-int64",
    ],
)
def test_bad_geometry_is_incompatible(mutate, match: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(IncompatiblePeer, match=match):
        validate_layout(*local(), mutate(reply()))


def test_other_tp_and_block_size_are_accepted() -> None:
    # D tp=2 against P tp=1, and P's block of 2 tokens against D's 4: mapped, not refused.
    p_spec = KVSpec(num_layers=4, kv_heads=4, head_dim=8, block_size=2)
    md = reply(tp_size=1, pp_size=1, pp_rank=0, spec=p_spec)
    layout = validate_layout(*local(tp_size=2), md)
    assert layout.block_size == 2 and layout.tp_size == 1


def test_mla_cache_has_one_region_per_layer() -> None:
    spec = KVSpec(num_layers=2, kv_heads=1, head_dim=16, mla=True, layout=Layout.HND)
    md = reply(tp_size=2, pp_size=1, pp_rank=0, spec=spec)
    assert isinstance(md.kv, KVInfo) and md.kv.mla
    layout = validate_layout(*local(tp_size=1, spec=spec), md)
    assert len(layout.regions) == 2


def test_a_hybrid_model_with_other_block_sizes_is_refused_at_the_handshake() -> None:
    """Either side larger is mapped for one KV cache group, but a hybrid model's groups are planned in
    one block size: refused at the handshake, naming the fix, not every request at planning."""
    hybrid = KVSpec(num_layers=4, kv_heads=4, head_dim=8, block_size=4, layer_groups=(0, 1, 0, 1),
                    group_windows=(0, 8))  # fmt: skip
    md = reply(tp_size=1, pp_size=1, pp_rank=0, spec=dataclasses.replace(hybrid, block_size=8))
    with pytest.raises(IncompatiblePeer, match="same --block-size"):
        validate_layout(*local(spec=hybrid), md)
    layout = validate_layout(*local(spec=hybrid), reply(tp_size=1, pp_size=1, pp_rank=0, spec=hybrid))
    assert layout.block_size == 4
    # P's blocks larger than D's, one group: mapped.
    wide = reply(tp_size=1, pp_size=1, pp_rank=0, spec=dataclasses.replace(SPEC, block_size=8))
    assert validate_layout(*local(), wide).block_size == 8

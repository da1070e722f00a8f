"""Model identity in the compatibility check: the handshake's metadata carries the compat hash's fields,
and a side that finds the hashes differ names the fields that differ (weights' seed, revision, dtype...)."""

from __future__ import annotations

import asyncio
import dataclasses
from types import SimpleNamespace

import msgspec
import pytest

from kvwire.errors import IncompatiblePeer
from kvwire.handshake.client import fetch_metadata
from kvwire.handshake.server import SideChannelServer, engine_compat_hash
from kvwire.handshake.types import PeerAddress
from kvwire.integrations.vllm.identity import vllm_model_id
from kvwire.kv.spec import KVSpec
from kvwire.protocol.codec import FRAME_HEADER_BYTES, decode_side, encode_frame
from kvwire.protocol.compat import compat_fields, compat_hash, describe_mismatch, fields_hash, fields_of
from kvwire.protocol.messages import KVInfo, Metadata, TransferMode
from kvwire.testing.handshake_env import build_registered_engine
from kvwire.transport.inproc import InprocFabric

SPEC = KVSpec(num_layers=4, kv_heads=4, head_dim=8, block_size=4)


def test_fields_hash_is_the_compat_hash() -> None:
    fields = compat_fields(model_id="m", spec=SPEC, transfer_mode=TransferMode.PUSH)
    digest = compat_hash(model_id="m", spec=SPEC, transfer_mode=TransferMode.PUSH)
    assert fields_hash(fields) == digest and fields_of(digest) == fields
    assert fields_of("0" * 64) is None


def test_describe_mismatch_names_each_differing_field() -> None:
    ours = compat_fields(model_id="kvwire-tiny/seed1", spec=SPEC, transfer_mode=TransferMode.PUSH)
    theirs = compat_fields(
        model_id="kvwire-tiny/seed2",
        spec=dataclasses.replace(SPEC, dtype="float32"),
        transfer_mode=TransferMode.PULL,
    )
    text = describe_mismatch(ours, theirs, "P")
    assert text == (
        "model_id 'kvwire-tiny/seed1' here vs 'kvwire-tiny/seed2' at P; dtype 'float16' here vs 'float32' "
        "at P; transfer_mode push here vs pull at P"
    )
    assert "same fields" in describe_mismatch(ours, ours)


def test_structured_model_ids_name_their_parts() -> None:
    a = compat_fields(
        model_id="model=llama;revision=main;dtype=bfloat16", spec=SPEC, transfer_mode=TransferMode.PUSH
    )
    b = msgspec.structs.replace(a, model_id="model=llama;revision=abc123;dtype=float16")
    assert describe_mismatch(a, b).endswith("(its dtype, revision differ)")


def test_metadata_without_fields_still_decodes() -> None:
    """Peers that predate ``Metadata.compat`` (wire v1) omit it: it decodes as None."""
    kv = KVInfo(
        num_layers=1,
        first_layer=0,
        kv_heads=1,
        head_dim=2,
        dtype="float16",
        block_size=4,
        layout="HND",
        mla=False,
    )
    md = Metadata(engine_id="e", incarnation="i", compat_hash="h", tp_size=1, tp_rank=0, pp_size=1, pp_rank=0,
                  agent_name="a", agent_metadata=b"", kv=kv, num_blocks=1)  # fmt: skip
    raw = msgspec.msgpack.decode(encode_frame(md)[FRAME_HEADER_BYTES:])
    assert "compat" in raw
    del raw["compat"]
    old = decode_side(msgspec.msgpack.encode(raw))
    assert isinstance(old, Metadata) and old.compat is None


@pytest.mark.parametrize("notif_only", [True, False])
def test_different_weights_are_refused_naming_the_model_id(notif_only: bool) -> None:
    """Two reference engines started with different --seed: different model ids, and the handshake's
    refusal says which values differ (not only that two hashes do)."""

    async def body() -> None:
        fabric = InprocFabric()
        p_info, p_ranks = build_registered_engine(
            "P", SPEC, 8, fabric.create_agent, model_id="kvwire-tiny/seed1"
        )
        d_info, _ = build_registered_engine("D", SPEC, 8, fabric.create_agent, model_id="kvwire-tiny/seed2")
        async with SideChannelServer(p_info, p_ranks) as server:
            addr = PeerAddress("127.0.0.1", server.port, 0, 0)
            with pytest.raises(IncompatiblePeer) as refused:
                await fetch_metadata(
                    addr, notif_only=notif_only, compat_hash=engine_compat_hash(d_info), timeout_s=5
                )
        message = str(refused.value)
        assert "model_id 'kvwire-tiny/seed2' here vs 'kvwire-tiny/seed1' at the peer" in message
        assert "dtype" not in message and "(P)" in message

    asyncio.run(asyncio.wait_for(body(), 20))


def test_vllm_model_id_covers_name_revision_and_dtype() -> None:
    base = SimpleNamespace(
        served_model_name=["llama-8b"], model="/models/llama", revision=None, dtype="torch.bfloat16"
    )
    assert vllm_model_id(base) == "model=llama-8b;revision=main;dtype=bfloat16"
    other = SimpleNamespace(**{**vars(base), "revision": "abc123", "dtype": "torch.float16"})
    a, b = (
        compat_fields(model_id=vllm_model_id(c), spec=SPEC, transfer_mode=TransferMode.PUSH)
        for c in (base, other)
    )
    assert fields_hash(a) != fields_hash(b)
    text = describe_mismatch(a, b)
    assert "revision=main" in text and "revision=abc123" in text and "(its dtype, revision differ)" in text

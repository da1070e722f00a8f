"""Remote addresses are authorised: ``allowed_peers`` decides which addresses an engine dials at all."""

from __future__ import annotations

import asyncio

import pytest

from kvwire.connector import ConnectorConfig
from kvwire.errors import ConfigError, PeerNotAllowed
from kvwire.handshake.manager import HandshakeManager
from kvwire.integrations.vllm.params import settings_from_extra
from kvwire.kv.spec import KVSpec
from kvwire.protocol.allow import PeerAllowList
from kvwire.testing.handshake_env import SilentListener, build_registered_engine
from kvwire.transport.base import PeerMode
from kvwire.transport.inproc import InprocFabric

SPEC = KVSpec(num_layers=2, kv_heads=2, head_dim=8, block_size=4)


def test_networks_addresses_and_names() -> None:
    allow = PeerAllowList.parse("10.0.0.0/8, 192.168.1.7 ,fd00::/8,p0.cluster.local.")
    assert allow.allows("10.200.3.4") and allow.allows("192.168.1.7") and allow.allows("[fd00::1]")
    assert allow.allows("P0.Cluster.Local")  # names compare case-insensitively, trailing dot or not
    assert not allow.allows("192.168.1.8") and not allow.allows("11.0.0.1") and not allow.allows("::1")
    assert not allow.allows("p1.cluster.local") and not allow.allows("evil.example")
    assert PeerAllowList.parse("").allows("203.0.113.9")  # no list: any address


@pytest.mark.parametrize("bad", ["10.0.0.0/33", "host name", "a/b", "x;rm"])
def test_a_bad_entry_is_a_config_error_naming_it(bad: str) -> None:
    with pytest.raises(ConfigError, match="allowed_peers"):
        ConnectorConfig(allowed_peers=f"127.0.0.1,{bad}")
    with pytest.raises(ConfigError, match="allowed_peers"):
        settings_from_extra({"allowed_peers": bad})
    assert (
        settings_from_extra({"allowed_peers": "10.0.0.0/8"}).connector_config().allowed_peers == "10.0.0.0/8"
    )


def test_an_address_outside_the_list_is_never_dialled() -> None:
    async def body() -> None:
        fabric = InprocFabric()
        d_info, d_ranks = build_registered_engine("D", SPEC, 16, fabric.create_agent)
        allowed = PeerAllowList.parse("10.0.0.0/8")
        mgr = HandshakeManager(d_info, d_ranks[0], timeout_s=0.5, retries=0, allowed=allowed)
        async with SilentListener() as listener:
            with pytest.raises(PeerNotAllowed):
                await mgr.ensure("127.0.0.1", listener.port, 0, 0, PeerMode.NOTIF_ONLY)
            await asyncio.sleep(0.05)
            assert listener.accepted == 0  # not even a TCP connection
        assert mgr.stats.not_allowed == 1
        await mgr.close()

    asyncio.run(body())

"""Start-up checks an operator meets first: a missing NIXL, an address no peer can dial, the version."""

from __future__ import annotations

import sys

import pytest

from kvwire.cli import main
from kvwire.connector import ConnectorConfig, Consumer
from kvwire.errors import ConfigError
from kvwire.kv.spec import KVSpec
from kvwire.testing.engines import build_engine
from kvwire.transport.inproc import InprocFabric

SPEC = KVSpec(num_layers=2, kv_heads=2, head_dim=8, block_size=4)


def test_missing_nixl_names_the_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvwire.transport import nixl

    monkeypatch.setitem(sys.modules, "nixl._api", None)  # what an environment without NIXL looks like
    with pytest.raises(ConfigError, match=r"pip install --no-deps nixl==1\.5\.1 nixl-cu12==1\.5\.1"):
        nixl._nixl()


def test_wildcard_side_channel_needs_an_address_to_advertise() -> None:
    setup = build_engine("d-wild", SPEC, fabric=InprocFabric())
    try:
        with pytest.raises(ConfigError, match="KVWIRE_SIDE_CHANNEL_HOST"):
            Consumer(setup.engine, setup.ranks, ConnectorConfig(), host="0.0.0.0")
        consumer = Consumer(
            setup.engine, setup.ranks, ConnectorConfig(), host="0.0.0.0", advertise_host="127.0.0.1"
        )
        assert consumer.host == "127.0.0.1"  # what push_regs tell P to dial
    finally:
        setup.close()


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.startswith("kvwire ")

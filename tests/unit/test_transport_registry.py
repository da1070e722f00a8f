"""The transport registry: names, lazy lookup, an out-of-tree transport, the narrow interface."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from kvwire.errors import ConfigError, TransportError
from kvwire.transport import registry
from kvwire.transport.base import Agent, FullAgent, Registration, XferHandle, XferStatus, as_full
from kvwire.transport.inproc import InprocAgent, InprocFabric


def test_builtin_names_and_lookup() -> None:
    assert registry.names()[:2] == ("nixl", "inproc")
    for name in registry.BUILTIN:
        assert registry.lookup(name).name == name
    with pytest.raises(ConfigError, match="known: nixl, inproc"):
        registry.lookup("carrier-pigeon")


def test_importing_the_registry_loads_no_transport() -> None:
    code = (
        "import sys, kvwire.transport.registry as r;"
        "mods = ('kvwire.transport.nixl', 'kvwire.transport.inproc', 'nixl');"
        "print(sorted(m for m in sys.modules if m in mods))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


class _Narrow(Agent):
    """A transport with only the connector's interface: every abstract method, nothing more."""

    def __init__(self, name: str) -> None:
        self.name = name

    def register_range(
        self, addr: int, length: int, kind: object = None, device_id: int = 0, *, owner: object = None
    ) -> Registration:
        return Registration(addr, length)

    def deregister(self, reg: Registration) -> None: ...
    def metadata(self) -> bytes:
        return self.name.encode()

    def conn_metadata(self) -> bytes:
        return self.name.encode()

    def add_peer(self, metadata: bytes) -> str:
        return metadata.decode()

    def remove_peer(self, peer: str) -> None: ...
    def post_array(self, *args: object, **kw: object) -> XferHandle:
        raise TransportError("no data path")

    def status(self, handle: XferHandle) -> XferStatus:
        return XferStatus.DONE

    def release(self, handle: XferHandle) -> None: ...
    def send_notif(self, peer: str, msg: bytes) -> None: ...
    def drain_notifs(self) -> dict[str, list[bytes]]:
        return {}

    def close(self) -> None: ...


def test_an_out_of_tree_transport_registers_and_creates_agents(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(registry, "_extra", {})  # leave no test transport behind

    def fresh() -> registry.FullAgentFactory:
        return InprocFabric().create_agent

    registry.register(registry.Transport("narrow-test", lambda name, _opts: _Narrow(name), fresh))
    assert "narrow-test" in registry.names()
    agent = registry.create_agent("narrow-test", "a/x/pp0/tp0")
    assert isinstance(agent, _Narrow) and agent.name == "a/x/pp0/tp0"
    agent.warm_up()  # the default: nothing to pay
    assert agent.stalled_s() == 0.0 and agent.register(np.zeros(8, np.uint8)).length == 8
    with pytest.raises(TransportError, match="no prepared lists"):
        as_full(agent)
    with pytest.raises(ConfigError, match="built in"):
        registry.register(registry.Transport("nixl", lambda name, _opts: _Narrow(name), fresh))


def test_the_connector_interface_is_narrower_than_the_bench_one() -> None:
    narrow = set(Agent.__abstractmethods__)
    extras = set(FullAgent.__abstractmethods__) - narrow
    assert len(narrow) == 12 and "post_array" in narrow
    assert extras == {
        "peer_mode",
        "prep_local",
        "prep_remote",
        "release_dlist",
        "post_prepped",
        "post",
        "progress",
    }
    inproc = registry.create_agent("inproc", "b/x/pp0/tp0", fabric=InprocFabric())
    assert isinstance(inproc, InprocAgent) and as_full(inproc) is inproc

"""Discovery sources by URL scheme (``kvwire.discovery.source``): etcd is one; the registrar and the
watcher take any ``Store``."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvwire.discovery import source
from kvwire.discovery.etcd import EtcdClient, EtcdUnavailable, WatchIdle
from kvwire.errors import ConfigError


def test_the_scheme_picks_the_source() -> None:
    store = source.open_store("etcd://127.0.0.1:2379/fleet-a", 1.5)
    assert isinstance(store, EtcdClient) and store.target.prefix == "/fleet-a" and store.timeout_s == 1.5
    source.check_target("etcd://127.0.0.1:2379")
    with pytest.raises(ConfigError, match=r"expected one of etcd://"):
        source.check_target("consul://127.0.0.1:8500")
    with pytest.raises(ConfigError, match="port"):
        source.check_target("etcd://127.0.0.1:notaport")


def test_etcd_errors_are_the_sources() -> None:
    # The registrar and the watcher catch the source's errors, whatever the source.
    assert issubclass(EtcdUnavailable, source.SourceUnavailable)
    assert issubclass(WatchIdle, source.WatchIdle) and issubclass(WatchIdle, EtcdUnavailable)


def test_importing_the_source_table_loads_no_client() -> None:
    code = (
        "import sys, kvwire.discovery.source;"
        "print('aiohttp' in sys.modules, 'kvwire.discovery.etcd' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


def test_each_source_is_a_typed_source_of_its_scheme(monkeypatch: pytest.MonkeyPatch) -> None:
    # As transports and dialects: a module's SOURCE, typed (mypy checks its store against Store), where
    # bare module attributes were looked up before.
    for scheme, module in source.SOURCES.items():
        found = getattr(__import__(module, fromlist=["SOURCE"]), "SOURCE", None)
        assert isinstance(found, source.Source) and scheme in found.schemes
    monkeypatch.setitem(source.SOURCES, "nosource", "kvwire.discovery.record")  # a module with no SOURCE
    with pytest.raises(ConfigError, match=r"kvwire\.discovery\.record\.SOURCE is not the Source"):
        source.check_target("nosource://h:1")


@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("etcd://root:pw@127.0.0.1:2379", "a password in the URL is refused.*KVWIRE_ETCD_PASSWORD"),
        ("etcd://root@127.0.0.1:2379/p", "needs its password in KVWIRE_ETCD_PASSWORD"),
        ("etcd://127.0.0.1:99999", "the port is out of range"),
        ("etcd://127.0.0.1:0", "the port is out of range"),  # before: taken for "no port", 2379 dialled
        ("etcd://127.0.0.1:x", "the port is not a number"),
        ("etcd://h1:2379,h2:2379", "one etcd endpoint only"),
    ],
)
def test_etcd_targets_kvwire_cannot_honour_are_refused_by_cause(
    url: str, why: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KVWIRE_ETCD_PASSWORD", raising=False)
    with pytest.raises(ConfigError, match=why) as exc:
        source.check_target(url, client=True)
    assert "pw" not in str(exc.value)


def test_redact_hides_userinfo_only() -> None:
    assert source.redact("etcd://u:pw@h:1/p") == "etcd://***@h:1/p"
    assert source.redact("etcd://h:1/a@b") == "etcd://h:1/a@b"
    assert source.redact("consul://u:pw@h") == "consul://***@h"
    with pytest.raises(ConfigError) as exc:
        source.check_target("consul://u:pw@h:1")
    assert "pw" not in str(exc.value)

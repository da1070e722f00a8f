"""Discovery on a real etcd that serves only TLS and requires client certificates (``--client-cert-auth``):
an engine registers and a router's watcher follows over ``etcds://``; a client without a certificate, or
speaking plain HTTP, gets a typed ``EtcdUnavailable``; bad TLS settings are refused at start naming the
file. Run them with ``-k "etcd or discovery"``."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvwire.discovery.etcd import EtcdClient, EtcdUnavailable, parse_target
from kvwire.discovery.record import FleetRole, engine_key
from kvwire.discovery.registrar import Registrar
from kvwire.discovery.source import check_target
from kvwire.discovery.watcher import FleetWatcher
from kvwire.errors import ConfigError
from kvwire.testing.clock import until
from kvwire.testing.etcd import EtcdServer, FleetView, engine_record
from kvwire.testing.tls import CertFiles, make_certs


@pytest.fixture
def certs(tmp_path: Path) -> CertFiles:
    return make_certs(tmp_path / "certs")


@pytest.fixture
def etcd(tmp_path: Path, certs: CertFiles) -> Iterator[EtcdServer]:
    with EtcdServer(tmp_path / "etcd", tls=certs) as server:
        yield server


def _url(etcd: EtcdServer, prefix: str, **files: Path) -> str:
    query = "&".join(f"{k}={v}" for k, v in files.items())
    return f"etcds://127.0.0.1:{etcd.client_port}{prefix}" + (f"?{query}" if query else "")


def test_an_engine_registers_and_a_router_follows_over_mutual_tls(etcd: EtcdServer, certs: CertFiles) -> None:
    url = _url(etcd, "/tls", ca=certs.ca, cert=certs.client_cert, key=certs.client_key)
    check_target(url)  # what start-up checks

    async def body() -> None:
        target = parse_target(url)
        assert target.base_url.startswith("https://") and str(target).startswith("etcds://")
        reg = Registrar(EtcdClient(target), engine_record, ttl_s=3, interval_s=0.1)
        view = FleetView()
        watcher = FleetWatcher(EtcdClient(target), view)
        task = asyncio.create_task(watcher.run())
        reg.start()
        key = engine_key("/tls", FleetRole.PREFILL, "http://127.0.0.1:8100")
        await until(lambda: key in view.records, "the registration, over TLS")
        assert view.records[key] == engine_record()
        await reg.close()
        await until(lambda: not view.records, "the deregistration", timeout_s=2.0)
        watcher.stop()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await watcher.client.close()
        await asyncio.sleep(0.25)  # TLS transports close a loop turn after their session (aiohttp's advice)

    asyncio.run(asyncio.wait_for(body(), 20))


def test_without_a_client_certificate_or_over_plain_http_etcd_is_unavailable(
    etcd: EtcdServer, certs: CertFiles
) -> None:
    async def body() -> None:
        for url in (_url(etcd, "/tls", ca=certs.ca), f"etcd://127.0.0.1:{etcd.client_port}/tls"):
            client = EtcdClient(parse_target(url))
            try:
                with pytest.raises(EtcdUnavailable):
                    await client.grant(5)
            finally:
                await client.close()
                await asyncio.sleep(0.25)  # aiohttp closes a refused TLS transport a loop turn after

    asyncio.run(asyncio.wait_for(body(), 20))


def test_bad_tls_settings_are_refused_at_start_naming_the_cause(tmp_path: Path, certs: CertFiles) -> None:
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate")
    base = "etcds://127.0.0.1:2379/p"
    cases = {
        f"etcd://127.0.0.1:2379/p?ca={certs.ca}": "for etcds://",
        f"{base}?cert={certs.client_cert}": "both cert= and key=",
        f"{base}?ca={tmp_path / 'missing.pem'}": "is not a readable file",
        f"{base}?ca={junk}": "cannot load the TLS files",
        f"{base}?ca={certs.ca}&ca={certs.ca}": "repeated",
        f"{base}?cafile={certs.ca}": "unknown",
        f"{base}?ca=&cert=&key=": "is empty",  # unset shell variables: not "no certificate"
    }
    for url, why in cases.items():
        with pytest.raises(ConfigError, match=why):
            check_target(url)
    # A file name is taken as written ('+' is not a space); '%26' stands for '&'.
    odd = tmp_path / "ca+1&2.pem"
    odd.write_bytes(certs.ca.read_bytes())
    tls = parse_target(f"{base}?ca={str(odd).replace('&', '%26')}").tls
    assert tls is not None and tls.ca == str(odd)
    # An '@' in a file name is not a user: errors still name the host.
    with pytest.raises(ConfigError) as err:
        check_target("etcds://etcd-host:2379/p?cert=me@corp.pem&key=k.pem")
    assert "etcd-host" in str(err.value)

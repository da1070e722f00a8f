"""Start-up checks of the fleet options (``--discovery``, ``--discovery-ttl``, ``--drain-timeout``,
``--advertise-url``) as real processes: one line on stderr naming the value, exit status 2, before anything
listens; and a router stopped by SIGTERM exits 0, as an engine does."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from kvwire.startup import EXIT_CONFIG


def _clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("KVWIRE_")}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _one_line(*args: str) -> str:
    """``kvwire ARGS``'s one stderr line; it must exit 2 without a traceback and without listening."""
    proc = subprocess.run([sys.executable, "-m", "kvwire.cli", *args], env=_clean_env(),
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert proc.returncode == EXIT_CONFIG, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr  # nothing started: no agent, no summary, no registration
    return lines[0]


def _engine(*args: str) -> str:
    port = str(_free_port())
    return _one_line("serve", "prefill", "--backend", "inproc", "--port", port, *args)


@pytest.mark.parametrize("ttl", ["0", "-3"])
def test_a_discovery_ttl_under_one_second_is_refused_at_start(ttl: str) -> None:
    # Before: a traceback (the registrar's ValueError) and exit 1, after NIXL was built and the port bound.
    line = _engine("--discovery", "etcd://127.0.0.1:1", "--discovery-ttl", ttl)
    assert f"--discovery-ttl {ttl}" in line and "at least 1 s" in line


def test_a_negative_drain_timeout_is_refused_at_start() -> None:
    line = _engine("--discovery", "etcd://127.0.0.1:1", "--drain-timeout", "-1")
    assert "--drain-timeout -1" in line


@pytest.mark.parametrize("url", ["127.0.0.1:8100", "tcp://h:1", "http://h:99999", "http://h:1/v1"])
def test_an_advertise_url_routers_cannot_dial_is_refused_at_start(url: str) -> None:
    # Before: 127.0.0.1:PORT was registered, and the router failed the first request sent to it (502).
    line = _engine("--discovery", "etcd://127.0.0.1:1", "--advertise-url", url)
    assert f"--advertise-url {url!r}" in line and "http://HOST:PORT" in line


def test_credentials_in_the_discovery_url_are_refused_and_never_shown() -> None:
    # Before: taken, dropped (every etcd call then refused by an etcd with auth on), and the password
    # logged in clear at start-up.
    line = _engine("--discovery", "etcd://root:s3cr3t@127.0.0.1:2379")
    assert "password in the URL is refused" in line and "KVWIRE_ETCD_PASSWORD" in line
    assert "s3cr3t" not in line and "root" not in line
    line = _one_line("serve", "router", "--port", str(_free_port()), "--discovery", "etcd://u:s3cr3t@h:1")
    assert "password in the URL" in line and "s3cr3t" not in line


def test_a_discovery_port_out_of_range_and_a_member_list_are_named() -> None:
    assert "the port is out of range" in _engine("--discovery", "etcd://127.0.0.1:99999")
    line = _engine("--discovery", "etcd://10.0.0.1:2379,10.0.0.2:2379")
    assert "one etcd endpoint only" in line and "load balancer or a DNS name" in line


def test_the_router_exits_0_after_a_sigterm() -> None:
    # Before: uvicorn re-raised SIGTERM to the default handler after its clean shutdown: status 143.
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvwire.cli", "serve", "router", "--port", str(port),
         "--prefill", "127.0.0.1:9", "--decode", "127.0.0.1:10"],
        env=_clean_env(), stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # until it answers at all (503: no healthy engine)
            with contextlib.suppress(httpx.HTTPError):
                httpx.get(f"http://127.0.0.1:{port}/health", timeout=1.0)
                break
            time.sleep(0.1)
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err[-2000:]
    assert "router stopped by signal 15" in err

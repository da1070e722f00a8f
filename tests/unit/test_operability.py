"""Start-up checks an operator meets first: a missing NIXL, an address no peer can dial, the version, a
port in use, an exposed engine without a secret, a bad option; the start-up line and JSON logs."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import pytest

from kvwire.cli import main
from kvwire.connector import ConnectorConfig, Consumer
from kvwire.errors import ConfigError
from kvwire.kv.spec import KVSpec
from kvwire.startup import EXIT_CONFIG, check_exposure
from kvwire.testing.engines import build_engine
from kvwire.transport.base import MemKind
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


def test_digest_with_kv_in_device_memory_is_refused_at_start(monkeypatch: pytest.MonkeyPatch) -> None:
    """The digest reads host memory: a D whose KV is in VRAM asking for it would fail every sampled
    request (digest_mismatch), so the connector refuses to start, naming the fix."""
    setup = build_engine("d-vram", SPEC, fabric=InprocFabric())
    try:
        for rank in setup.ranks:
            monkeypatch.setattr(type(rank.cache), "mem_kind", property(lambda self: MemKind.VRAM))
        with pytest.raises(ConfigError, match="set kv_digest_sample to 0"):
            Consumer(setup.engine, setup.ranks, ConnectorConfig(kv_digest_sample=0.5), host="127.0.0.1")
        Consumer(setup.engine, setup.ranks, ConnectorConfig(kv_digest_sample=0.0), host="127.0.0.1").close()
    finally:
        setup.close()


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.startswith("kvwire ")


# -- misconfigurations as real processes: one line on stderr naming cause and fix, exit status 2 -------------


def _clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("KVWIRE_")}


def _kvwire(
    *args: str, env: dict[str, str] | None = None, timeout_s: float = 60.0
) -> subprocess.CompletedProcess[str]:
    """``kvwire ARGS`` as a child process, with no KVWIRE_* variable of this environment."""
    return subprocess.run(
        [sys.executable, "-m", "kvwire.cli", *args],
        env={**_clean_env(), **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )


def _one_line(proc: subprocess.CompletedProcess[str]) -> str:
    assert proc.returncode == EXIT_CONFIG, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert "Traceback" not in proc.stderr
    assert len(lines) == 1, proc.stderr
    return lines[0]


@contextlib.contextmanager
def _listener() -> Iterator[tuple[socket.socket, int]]:
    """A socket listening on a free 127.0.0.1 port (what another program holding the port looks like)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock, sock.getsockname()[1]


def _accepted(sock: socket.socket) -> bool:
    sock.settimeout(0.2)
    try:
        conn, _ = sock.accept()
    except TimeoutError:
        return False
    conn.close()
    return True


def test_busy_http_port_is_one_line_before_anything_starts() -> None:
    with _listener() as (_, port):
        line = _one_line(_kvwire("serve", "prefill", "--backend", "inproc", "--port", str(port)))
    assert f"HTTP port {port} on 127.0.0.1 is already in use" in line and "--port" in line


def test_busy_side_channel_port_is_one_line() -> None:
    with _listener() as (_, busy), _listener() as (http_sock, http_port):
        http_sock.close()  # free again: the HTTP port is not the problem here
        args = (
            "serve",
            "decode",
            "--backend",
            "inproc",
            "--port",
            str(http_port),
            "--side-channel-port",
            str(busy),
        )
        line = _one_line(_kvwire(*args))
    assert (
        f"side-channel port {busy} on 127.0.0.1 is already in use" in line and "--side-channel-port" in line
    )


def test_router_with_its_port_taken_exits_before_probing_any_engine() -> None:
    with _listener() as (_, busy), _listener() as (engine, engine_port):
        url = f"http://127.0.0.1:{engine_port}"
        line = _one_line(
            _kvwire("serve", "router", "--port", str(busy), "--prefill", url, "--decode", url + "1")
        )
        assert f"HTTP port {busy} on 127.0.0.1 is already in use" in line
        assert not _accepted(engine), "the router probed an engine although it could not serve"


def test_router_refuses_its_own_address_as_an_engine() -> None:
    with _listener() as (sock, port):
        sock.close()
        args = (
            "serve",
            "router",
            "--port",
            str(port),
            "--prefill",
            f"localhost:{port}",
            "--decode",
            "127.0.0.1:1",
        )
        line = _one_line(_kvwire(*args))
    assert "this router's own address" in line


def test_no_secret_refuses_a_non_loopback_address_unless_insecure() -> None:
    line = _one_line(_kvwire("serve", "decode", "--backend", "inproc", "--host", "0.0.0.0", "--port", "1"))
    assert "KVWIRE_SECRET" in line and "--insecure" in line
    check_exposure("127.0.0.1", None, insecure=False)
    check_exposure("localhost", None, insecure=False)
    check_exposure("10.0.0.1", b"s3cret", insecure=False)
    check_exposure("10.0.0.1", None, insecure=True)
    for host in ("0.0.0.0", "10.0.0.1", "::"):
        with pytest.raises(ConfigError, match="--insecure"):
            check_exposure(host, None, insecure=False)


def test_a_short_secret_is_named_at_start(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="kvwire"):
        check_exposure("127.0.0.1", b"s3cret", insecure=False)
        check_exposure("127.0.0.1", bytes(range(32)), insecure=False)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "6 bytes" in warnings[0] and "openssl rand -hex 32" in warnings[0]


def test_bad_option_values_are_one_line() -> None:
    line = _one_line(_kvwire("serve", "decode", "--backend", "inproc", env={"KVWIRE_FENCE_MS": "soon"}))
    assert "KVWIRE_FENCE_MS='soon'" in line
    line = _one_line(_kvwire("serve", "decode", "--backend", "inproc", "--liveness-timeout-s", "0.5"))
    assert "liveness_timeout_s" in line  # ConnectorConfig's own check, as one line


def _wait_healthy(url: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url + "/health", timeout=1.0).status_code == 200:
                return
        time.sleep(0.1)
    raise AssertionError(f"{url} never became healthy")


def test_engine_start_up_summary_and_json_logs() -> None:
    """One INFO line says who the engine is and how it is exposed; with --log-format json, all is JSON."""
    with _listener() as (sock, port):
        sock.close()
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvwire.cli", "serve", "decode", "--backend", "inproc",
             "--port", str(port), "--log-format", "json", "--api-key", "k"],
            env=_clean_env(), stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        try:
            assert proc.stderr is not None
            first = json.loads(proc.stderr.readline())
            warning = json.loads(proc.stderr.readline())
            _wait_healthy(f"http://127.0.0.1:{port}")
        finally:
            proc.send_signal(signal.SIGTERM)
            _, rest = proc.communicate(timeout=30)
    assert proc.returncode == 0
    assert (first["level"], first["logger"]) == ("info", "kvwire.serve")
    for part in ("decode engine decode-", f"http://127.0.0.1:{port}", "mode push", "backend inproc",
                 "secret not set", "api key set"):  # fmt: skip
        assert part in first["msg"]
    assert warning["level"] == "warning" and "KVWIRE_SECRET" in warning["msg"]
    for line in rest.splitlines():
        json.loads(line)  # nothing else prints plain text on stderr


def test_router_start_up_summary() -> None:
    with _listener() as (sock, port):
        sock.close()
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvwire.cli", "serve", "router", "--port", str(port),
             "--prefill", "127.0.0.1:9", "--decode", "127.0.0.1:10"],
            env={**_clean_env(), "KVWIRE_API_KEY": "e"},
            stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        try:
            assert proc.stderr is not None
            first = proc.stderr.readline()
            _wait_healthy_or_503(f"http://127.0.0.1:{port}")
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.communicate(timeout=30)
    assert "INFO kvwire.router: router serving http://127.0.0.1:" in first
    for part in ("prefill http://127.0.0.1:9", "mode push", "api key not set", "engine api key set"):
        assert part in first


def _wait_healthy_or_503(url: str, timeout_s: float = 30.0) -> None:
    """Until the server answers /health at all (a router without healthy engines answers 503)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            httpx.get(url + "/health", timeout=1.0)
            return
        time.sleep(0.1)
    raise AssertionError(f"{url} never answered")


def test_vllm_connector_refuses_an_exposed_side_channel_without_secret(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from kvwire.integrations.vllm.params import settings_from_extra

    monkeypatch.delenv("KVWIRE_SECRET", raising=False)
    with pytest.raises(ConfigError, match='set "insecure": true'):
        settings_from_extra({"side_channel_host": "10.0.0.1"})
    assert settings_from_extra({"side_channel_host": "10.0.0.1", "insecure": True}).insecure
    monkeypatch.setenv("KVWIRE_SECRET", "s3cret")
    assert settings_from_extra({"side_channel_host": "10.0.0.1"}).side_channel_host == "10.0.0.1"


def test_vllm_connector_refuses_settings_it_would_get_wrong(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvwire.integrations.vllm.params import settings_from_extra

    monkeypatch.setenv("KVWIRE_SECRET", "s3cret")
    # A wildcard bind address is also what D was told to dial: D dialled itself.
    for host in ("0.0.0.0", "::"):
        with pytest.raises(ConfigError, match="D is told to dial"):
            settings_from_extra({"side_channel_host": host})
    # Accepted and ignored before: under vLLM, vLLM's own kv_transfer_config decides what a failed load does.
    with pytest.raises(ConfigError, match="set it in kv_transfer_config"):
        settings_from_extra({"kv_load_failure_policy": "recompute"})


def test_vllm_deployments_kvwire_does_not_move_are_refused_by_name() -> None:
    """Speculative decoding (the drafter's layers were refused with a layout error naming nothing) and
    context parallelism (every load failed at run time) stop the engine at start, naming the setting;
    an idle wait past a second is refused."""
    from kvwire.integrations.vllm.params import check_deployment, settings_from_extra

    check_deployment(speculative=False, decode_cp=1, prefill_cp=1)
    with pytest.raises(ConfigError, match="speculative decoding with a drafter"):
        check_deployment(speculative=True, decode_cp=1, prefill_cp=1)
    for dcp, pcp in ((2, 1), (1, 2)):
        with pytest.raises(ConfigError, match="decode_context_parallel_size"):
            check_deployment(speculative=False, decode_cp=dcp, prefill_cp=pcp)
    with pytest.raises(ConfigError, match="idle_step_wait_ms"):
        settings_from_extra({"idle_step_wait_ms": 1e9})


def test_each_vllm_data_parallel_engine_takes_its_own_side_channel_ports() -> None:
    """vLLM starts every DP engine from one kv_transfer_config: each bound the same ports, and the second
    died at start (address in use)."""
    from kvwire.integrations.vllm.params import KvRole, for_dp_engine, settings_from_extra

    s = settings_from_extra({"side_channel_port": 6000})
    assert for_dp_engine(s, 0, 2, 1, KvRole.PRODUCER) is s
    ports = [
        for_dp_engine(s, dp, 2, 1, KvRole.PRODUCER).rank_port(0, t, 2) for dp in range(3) for t in range(2)
    ]
    assert ports == [6000, 6001, 6002, 6003, 6004, 6005]
    assert for_dp_engine(s, 1, 2, 2, KvRole.BOTH).side_channel_port == 6008  # producer and consumer: 8 each
    with pytest.raises(ConfigError, match="no room"):
        for_dp_engine(settings_from_extra({"side_channel_port": 65530}), 2, 4, 1, KvRole.PRODUCER)
    with pytest.raises(ConfigError, match="data parallelism"):
        for_dp_engine(settings_from_extra({"discovery": "etcd://127.0.0.1:2379", "discovery_url": "http://h:1"}),
                      1, 1, 1, KvRole.PRODUCER)  # fmt: skip

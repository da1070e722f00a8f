"""Issue 23, end to end: one request names a peer whose UCX port is blackholed; real requests go on.

Namespace A runs a real prefill engine whose side channel answers and whose every other TCP port (its UCX
listener included) drops every packet. Namespace B runs the pair under test (P, D, router) and a driver:
real requests through the router at a steady rate, and once, directly to D, a decode leg whose
``kv_transfer_params`` name A's engine. D's handshake with A fetches metadata fine, then loads an agent
whose UCX address nobody answers.

With UCX's blocking connect (``UCX_TCP_CONN_NB=n``, the kernel's 6 SYN retries: kvwire before issue 23) the
load holds D's agent ~130 s: /health 503, the real requests fail. With kvwire's UCX defaults only the
attacking request fails. Each run prints its figures (docs/reliability.md has them).

This file is also the driver program: ``python test_blackholed_request.py drive ...`` (inside B).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

LOAD_S = 20.0
RATE_PER_S = 8.0
ATTACK_AT_S = 2.0
MAX_P99_S = 2.0  # the bound on added p99 (the no-attack p99 is ~0.1 s)
BEFORE = {"UCX_TCP_CONN_NB": "n", "UCX_TCP_SYN_CNT": "6"}  # UCX's blocking connect: kvwire before issue 23
_TABLE = "kvwire_ucx_block"


# ---------------------------------------------------------------------------------------------------
# The driver (inside namespace B)
# ---------------------------------------------------------------------------------------------------


def _engine(group: Any, role: str, advertise: str | None = None) -> Any:
    """A tiny engine on 127.0.0.1; with ``advertise``, on every address, its side channel advertised as
    ``advertise`` (a peer in the other namespace must dial it)."""
    from kvwire.testing.procs import free_port, kvwire_command

    port = free_port()
    host = "127.0.0.1" if advertise is None else "0.0.0.0"
    args = ["serve", role, "--host", host, "--port", str(port), "--preset", "tiny",
            "--side-channel-port", str(free_port())]  # fmt: skip
    if advertise is None:
        return group.start(role, args, port)
    env = {"KVWIRE_SIDE_CHANNEL_HOST": advertise}
    return group.start_argv(role, kvwire_command(*args, "--insecure"), port, env=env)


def _one(client: Any, url: str, i: int) -> tuple[float, int]:
    t0 = time.monotonic()
    try:
        body = {"model": "kvwire", "prompt": f"request {i} " * 4, "max_tokens": 4, "ignore_eos": True}
        status = client.post(f"{url}/v1/completions", json=body, timeout=60.0).status_code
    except Exception:
        status = -1
    return time.monotonic() - t0, status


def _attack(client: Any, d_url: str, bad_host: str, bad_side_port: int) -> tuple[float, int]:
    params = {
        "do_remote_prefill": True,
        "transfer_id": "attack-1",
        "remote_engine_id": "prefill-bad",
        "remote_host": bad_host,
        "remote_port": bad_side_port,
        "remote_tp_size": 1,
        "remote_pp_size": 1,
    }
    body = {"prompt": "attack " * 4, "max_tokens": 2, "kv_transfer_params": params}
    t0 = time.monotonic()
    try:
        status = client.post(f"{d_url}/v1/completions", json=body, timeout=60.0).status_code
    except Exception:
        status = -1
    return time.monotonic() - t0, status


def _side_port(server: Any) -> int:
    return int(server.argv[server.argv.index("--side-channel-port") + 1])


def _rogue_push_reg(p_side: int, bad_host: str, bad_side: int) -> tuple[float, int]:
    """One push_reg to P from a rogue NIXL agent named as the blackholed D's life, naming that D: P checks
    the sender against the message, fetches D's metadata (compatible: a real decode engine), and dials it.
    Returns the seconds it took and 0 (the rogue gets no answer it could wait on)."""
    import asyncio

    from kvwire.handshake.client import fetch_metadata
    from kvwire.handshake.types import PeerAddress
    from kvwire_tools.bench.flood_rogue import Rogue, fetch_p_metadata, p_compat_hash

    t0 = time.monotonic()
    bad = asyncio.run(
        fetch_metadata(PeerAddress(bad_host, bad_side, 0, 0), notif_only=True, compat_hash=p_compat_hash(),
                       timeout_s=10.0)
    ).metadata  # fmt: skip
    rogue = Rogue(fetch_p_metadata("127.0.0.1", p_side, None), bad_side, host=bad_host,
                  engine_id=bad.engine_id, incarnation=bad.incarnation)  # fmt: skip
    try:
        rogue.agent.send_notif(rogue.peer, rogue.push_reg(0))
        for _ in range(50):  # notifications leave on progress (no progress thread)
            rogue.agent.progress()
            time.sleep(0.01)
    finally:
        rogue.close()
    return time.monotonic() - t0, 0


def _health(client: Any, url: str, stop: threading.Event, out: list[int]) -> None:
    while not stop.is_set():
        try:
            out.append(client.get(f"{url}/health", timeout=2.0).status_code)
        except Exception:
            out.append(-1)
        stop.wait(0.25)


def _load(client: Any, router_url: str) -> list[tuple[float, int]]:
    futures = []
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        start = time.monotonic()
        for i in range(int(LOAD_S * RATE_PER_S)):
            time.sleep(max(0.0, start + i / RATE_PER_S - time.monotonic()))
            futures.append(pool.submit(_one, client, router_url, i))
        return [f.result() for f in futures]


def _handshakes(log_text: str, host: str) -> tuple[list[float], int]:
    """The durations (s) of the handshakes with ``host`` a kvwire log tells of, and how many failed."""
    done, failed = [], 0
    for line in log_text.splitlines():
        if "kvwire.handshake" in line and f"-> {host}:" in line:
            total = re.search(r"total=([\d.]+)ms", line)
            if " failed: " in line:
                failed += 1
            elif total is not None:
                done.append(float(total.group(1)) / 1e3)
    return done, failed


def _drive(bad_host: str, bad_http: int, bad_side: int, attack_kind: str, d_host: str | None) -> None:
    """``attack_kind``: ``kv_params`` (a decode leg sent to D names the blackholed engine), ``push_reg``
    (a rogue's push_reg to P names it), ``none``, or ``remote_p`` (no attack: the engine in A is the
    pair's P, and D advertises ``d_host`` to it). /health is probed on the engine attacked (D for
    ``remote_p``)."""
    import httpx

    from kvwire.testing.procs import ServerGroup, free_port

    with tempfile.TemporaryDirectory() as tmp, ServerGroup(Path(tmp)) as group, httpx.Client() as client:
        remote_p = attack_kind == "remote_p"
        p, d = None if remote_p else _engine(group, "prefill"), _engine(group, "decode", d_host)
        group.wait_healthy([d] if p is None else [p, d], 120.0)
        for _ in range(600):  # the engine in A, before its ports are blocked
            with contextlib.suppress(Exception):
                if client.get(f"http://{bad_host}:{bad_http}/health", timeout=1.0).status_code == 200:
                    break
            time.sleep(0.2)
        port = free_port()
        p_url = f"http://{bad_host}:{bad_http}" if p is None else p.url
        router = group.start("router", ["serve", "router", "--port", str(port), "--prefill", p_url,
                                        "--decode", d.url], port)  # fmt: skip
        group.wait_healthy([router], 60.0)
        print("READY", flush=True)
        sys.stdin.readline()  # the parent blocked A's ports
        stop, health = threading.Event(), list[int]()
        target = p if attack_kind == "push_reg" and p is not None else d
        prober = threading.Thread(target=_health, args=(client, target.url, stop, health), daemon=True)
        prober.start()
        attack: list[tuple[float, int]] = []
        attacks = {
            "kv_params": lambda: _attack(client, d.url, bad_host, bad_side),
            "push_reg": lambda: _rogue_push_reg(_side_port(p or d), bad_host, bad_side),
        }
        attacking = attack_kind in attacks
        timer = threading.Timer(ATTACK_AT_S, lambda: attack.append(attacks[attack_kind]()))
        if attacking:
            timer.start()
        results = _load(client, router.url)
        if attacking:
            timer.join()
        stop.set()
        prober.join()
        log_text = target.log_path.read_text(errors="replace")
        told = [ln for ln in log_text.splitlines() if bad_host in ln or "stuck" in ln or " ERROR " in ln]
        for line in told[:12]:  # what the engine made of it
            print(f"{target.name}: {line}", file=sys.stderr)
        handshakes_s, handshakes_failed = _handshakes(log_text, bad_host)
        lat = sorted(t for t, s in results if s == 200)
        print("RESULT " + json.dumps({
            "requests": len(results),
            "failed": sum(1 for _, s in results if s != 200),
            "p50_s": lat[len(lat) // 2] if lat else None,
            "p99_s": lat[int(0.99 * (len(lat) - 1))] if lat else None,
            "attack": attack,
            "health_not_200": sum(1 for s in health if s != 200),
            "health_probes": len(health),
            "first_s": results[0][0],
            "handshakes_s": handshakes_s,
            "handshakes_failed": handshakes_failed,
        }), flush=True)  # fmt: skip


# ---------------------------------------------------------------------------------------------------
# The test (host namespace)
# ---------------------------------------------------------------------------------------------------

pytestmark = [pytest.mark.nixl, pytest.mark.slow]

if __name__ != "__main__":
    from netns_env import netns_pair

    from kvwire.testing.netns import NetnsPair, Side
    from kvwire.testing.procs import free_port


@pytest.fixture(scope="module")
def net() -> Iterator[NetnsPair]:
    yield from netns_pair(nixl=True)


def _env(side: Side, extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("UCX_TCP_")}
    env.update(UCX_TLS="tcp", UCX_MODULES="^ib*", UCX_NET_DEVICES=side.ifname, PYTHONUNBUFFERED="1")
    return {**env, **extra}


def _block_all_tcp_but(net: NetnsPair, port: int, http_port: int) -> None:
    """Drop A's TCP but its side channel's; new connections to any port but those two (its UCX listener)
    are counted first (``_dialled_bad``)."""
    a, chain = net.a, f"inet {_TABLE}"
    rules = (
        f"add table inet {_TABLE}\n"
        f"add chain {chain} in {{ type filter hook input priority 0; policy accept; }}\n"
        f"add chain {chain} out {{ type filter hook output priority 0; policy accept; }}\n"
        f'add rule {chain} in iifname "{a.ifname}" tcp dport != {{ {port}, {http_port} }} '
        "tcp flags & (syn | ack) == syn counter drop\n"
        f'add rule {chain} in iifname "{a.ifname}" tcp dport != {port} drop\n'
        f'add rule {chain} out oifname "{a.ifname}" tcp sport != {port} drop\n'
    )
    cmd = net.command(a, ["nft", "-f", "-"])
    done = subprocess.run(cmd, input=rules, capture_output=True, text=True, timeout=10, check=False)
    assert done.returncode == 0, done.stderr


def _kill_namespaces(net: NetnsPair) -> None:
    """Every process left in either namespace (the driver's servers run in their own sessions)."""
    for side in (net.a, net.b):
        pids = subprocess.run(["ip", "netns", "pids", side.ns], capture_output=True, text=True, check=False)
        for pid in pids.stdout.split():
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid), 9)


def _read_tagged(proc: subprocess.Popen[bytes], tag: str, timeout_s: float) -> str:
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = proc.stdout.readline().decode(errors="replace")
        if not line:
            raise AssertionError(f"the driver exited ({proc.wait(5)}) before {tag}")
        if line.startswith(tag):
            return line[len(tag) :].strip()
    raise AssertionError(f"no {tag} within {timeout_s} s")


def _dialled_bad(net: NetnsPair) -> int:
    """SYNs A's rules dropped to a port but its side channel's and HTTP's: dials of its UCX listener."""
    listing = net.run(net.a, ["nft", "list", "chain", "inet", _TABLE, "in"])
    return sum(int(n) for n in re.findall(r"counter packets (\d+)", listing))


def _run_case(
    net: NetnsPair, tmp_path: Path, ucx: dict[str, str], attack: str, bad_role: str
) -> dict[str, Any]:
    """A's engine (``bad_role``) up, the driver's pair and router up in B, A's ports but its side channel
    blocked, the load run with ``attack`` (the driver's kinds); the driver's figures and A's drop count."""
    log = open(tmp_path / "children.log", "wb")  # noqa: SIM115 (closed in the finally below)
    bad_http, bad_side = free_port(), free_port()
    try:
        bad = ["serve", bad_role, "--host", net.a.addr, "--port", str(bad_http), "--preset", "tiny",
               "--side-channel-port", str(bad_side), "--engine-id", f"{bad_role}-bad",
               "--insecure"]  # fmt: skip
        net.popen(
            net.a, [sys.executable, "-m", "kvwire.cli", *bad], env=_env(net.a, {}), stdout=log, stderr=log
        )
        argv = [sys.executable, str(Path(__file__).resolve()), "drive", net.a.addr, str(bad_http),
                str(bad_side), attack]  # fmt: skip
        driver = net.popen(net.b, argv, env=_env(net.b, ucx), stderr=log)
        _read_tagged(driver, "READY", 240.0)
        _block_all_tcp_but(net, bad_side, bad_http)
        assert driver.stdin is not None
        driver.stdin.write(b"go\n")
        driver.stdin.flush()
        r: dict[str, Any] = json.loads(_read_tagged(driver, "RESULT", LOAD_S + 120.0))
        r["dialled_bad"] = _dialled_bad(net)
        print(f"blackholed {bad_role}, {ucx or 'kvwire defaults'}, attack {attack}: {json.dumps(r)}")
        return r
    finally:
        net.kill_processes()
        _kill_namespaces(net)
        subprocess.run(net.command(net.a, ["nft", "delete", "table", "inet", _TABLE]), check=False)
        log.close()
        print((tmp_path / "children.log").read_text(errors="replace")[-4000:])


def _assert_only_the_attack_failed(r: dict[str, Any], before: bool) -> None:
    assert r["dialled_bad"] > 0, r  # the attacked engine did dial the blackholed UCX port
    if before:  # the engine is held, the real requests fail with it
        assert r["failed"] > r["requests"] / 10, r
        return
    assert r["failed"] <= r["requests"] // 100, r  # the goal: <= 1 % of real requests fail
    assert r["health_not_200"] == 0, r
    assert r["p99_s"] is not None and r["p99_s"] <= MAX_P99_S, r  # and <= 2 s of added p99


@pytest.mark.parametrize(
    ("ucx", "attacking"),
    [(BEFORE, True), ({}, True), ({}, False)],
    ids=["before-blocking-connect", "kvwire-defaults", "no-attack-baseline"],
)
def test_one_blackholed_request_fails_alone(
    net: NetnsPair, tmp_path: Path, ucx: dict[str, str], attacking: bool
) -> None:
    r = _run_case(net, tmp_path, ucx, "kv_params" if attacking else "none", "prefill")
    if not attacking:  # the figures without the attack, for comparison
        assert r["failed"] == 0 and r["health_not_200"] == 0, r
        return
    assert r["attack"] and r["attack"][0][1] != 200, r  # the attacking request itself fails
    _assert_only_the_attack_failed(r, before=bool(ucx))


@pytest.mark.parametrize("ucx", [BEFORE, {}], ids=["before-blocking-connect", "kvwire-defaults"])
def test_one_push_reg_naming_a_blackholed_decode_costs_p_nothing(
    net: NetnsPair, tmp_path: Path, ucx: dict[str, str]
) -> None:
    """A rogue NIXL agent, named as a real D's life, sends P one push_reg naming that D, whose UCX port is
    blackholed: P checks it, fetches D's (compatible) metadata and dials; P's /health and the real
    requests through P must not notice."""
    r = _run_case(net, tmp_path, ucx, "push_reg", "decode")
    assert r["attack"], r  # the rogue's push_reg was sent
    _assert_only_the_attack_failed(r, before=bool(ucx))


def _second_link(net: NetnsPair) -> tuple[str, str]:
    """A second veth between A and B (its /30 next to the first's) whose every packet A drops (SYNs
    counted): a network both hosts are on that is firewalled between them. Its two interface names."""
    a2, b2 = f"{net.a.ifname}x", f"{net.b.ifname}x"
    octet = net.a.addr.split(".")[2]
    net.run(net.a, ["ip", "link", "add", a2, "type", "veth", "peer", "name", b2])
    net.run(net.a, ["ip", "link", "set", b2, "netns", net.b.ns])
    for side, ifname, host in ((net.a, a2, 1), (net.b, b2, 2)):
        net.run(side, ["ip", "addr", "add", f"10.214.{octet}.{host}/30", "dev", ifname])
        net.run(side, ["ip", "link", "set", ifname, "up"])
    chain = f"inet {_TABLE}"
    rules = (
        f"add table inet {_TABLE}\n"
        f"add chain {chain} in {{ type filter hook input priority 0; policy accept; }}\n"
        f"add chain {chain} out {{ type filter hook output priority 0; policy accept; }}\n"
        f'add rule {chain} in iifname "{a2}" tcp flags & (syn | ack) == syn counter drop\n'
        f'add rule {chain} in iifname "{a2}" drop\n'
        f'add rule {chain} out oifname "{a2}" tcp flags & (syn | ack) == syn counter drop\n'
        f'add rule {chain} out oifname "{a2}" drop\n'
    )
    done = subprocess.run(net.command(net.a, ["nft", "-f", "-"]), input=rules, capture_output=True,
                          text=True, timeout=10, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr
    return a2, b2


def _syns(net: NetnsPair, chain: str) -> int:
    listing = net.run(net.a, ["nft", "list", "chain", "inet", _TABLE, chain])
    return sum(int(n) for n in re.findall(r"counter packets (\d+)", listing))


def _run_multihomed(net: NetnsPair, tmp_path: Path, ucx: dict[str, str], p_devices: str | None,
                    d_devices: str | None) -> dict[str, Any]:  # fmt: skip
    """P in A on both links, D, the router and the load in B; ``*_devices``: each one's UCX_NET_DEVICES
    (``both``: its two interfaces; None: unset, kvwire's choice)."""
    a2, b2 = _second_link(net)
    log = open(tmp_path / "children.log", "wb")  # noqa: SIM115 (closed in the finally below)
    p_http, p_side = free_port(), free_port()

    def env(side: Side, second: str, devices: str | None) -> dict[str, str]:
        out = _env(side, ucx)
        del out["UCX_NET_DEVICES"]
        if devices is not None:
            out["UCX_NET_DEVICES"] = f"{side.ifname},{second}" if devices == "both" else devices
        return out

    try:
        p = ["serve", "prefill", "--host", net.a.addr, "--port", str(p_http), "--preset", "tiny",
             "--side-channel-port", str(p_side), "--engine-id", "prefill-multi", "--insecure"]  # fmt: skip
        p_env = env(net.a, a2, p_devices)
        net.popen(net.a, [sys.executable, "-m", "kvwire.cli", *p], env=p_env, stdout=log, stderr=log)
        argv = [sys.executable, str(Path(__file__).resolve()), "drive", net.a.addr, str(p_http),
                str(p_side), "remote_p", net.b.addr]  # fmt: skip
        driver = net.popen(net.b, argv, env=env(net.b, b2, d_devices), stderr=log)
        _read_tagged(driver, "READY", 240.0)
        assert driver.stdin is not None
        driver.stdin.write(b"go\n")
        driver.stdin.flush()
        r: dict[str, Any] = json.loads(_read_tagged(driver, "RESULT", LOAD_S + 300.0))
        r["syns_to_p_dropped"], r["syns_from_p_dropped"] = _syns(net, "in"), _syns(net, "out")
        print(f"multi-homed P, {ucx or 'kvwire defaults'}, P {p_devices}, D {d_devices}: {json.dumps(r)}")
        return r
    finally:
        net.kill_processes()
        _kill_namespaces(net)
        subprocess.run(net.command(net.a, ["nft", "delete", "table", "inet", _TABLE]), check=False)
        subprocess.run(net.command(net.a, ["ip", "link", "del", a2]), check=False)
        log.close()
        print((tmp_path / "children.log").read_text(errors="replace")[-4000:])


@pytest.mark.parametrize(
    ("ucx", "p_devices", "d_devices"),
    [(BEFORE, "all", "all"), ({}, None, None), ({}, "both", None)],
    ids=["before-ucx-defaults", "kvwire-defaults", "p-advertises-both"],
)
def test_a_p_advertising_an_interface_d_cannot_reach(
    net: NetnsPair, tmp_path: Path, ucx: dict[str, str], p_devices: str | None, d_devices: str | None
) -> None:
    """P and D are on two networks, the second firewalled between them (A drops it). Before, with UCX's
    own defaults (every interface, blocking connect), D dialled P's second address: its handshake hung
    and the requests failed. With kvwire's, each engine's UCX uses the interface of its side channel's
    address, and D's, even when P advertises both (UCX routes the second address off that interface),
    never dials the dropped one: no request fails, handshakes take milliseconds, D's /health stays 200."""
    r = _run_multihomed(net, tmp_path, ucx, p_devices, d_devices)
    if ucx:
        assert r["syns_to_p_dropped"] > 0, r  # D dialled P's unreachable address
        assert r["failed"] > r["requests"] / 10, r
        return
    assert r["syns_to_p_dropped"] == 0 and r["syns_from_p_dropped"] == 0, r
    assert r["failed"] <= r["requests"] // 100, r
    assert r["health_not_200"] == 0, r
    assert r["handshakes_failed"] == 0 and r["handshakes_s"], r
    assert max(r["handshakes_s"]) <= MAX_P99_S and r["p99_s"] <= MAX_P99_S, r


if __name__ == "__main__":
    _drive(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5], (sys.argv[6:] or [None])[0])

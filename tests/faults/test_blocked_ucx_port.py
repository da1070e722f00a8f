"""A peer whose UCX port drops every packet while its side channel answers (issue 11, finding 2).

P (namespace A) serves its side channel; nftables in A drops every other TCP packet on the veth, so D
(namespace B) fetches P's metadata fine, and NIXL's ``add_remote_agent`` then blocks inside UCX's blocking
``connect()`` until the kernel gives up its SYN retries (~130 s). Before the fix that call ran on the
handshake loop, which stopped for all that time (the engine's whole side channel with it) and
``handshake_timeout_s`` bounded nothing.

What is asserted, from inside D's process: the handshake fails with ``HandshakeTimeout`` within
``handshake_timeout_s`` + slack; meanwhile D's loop never stops for long and D's own side channel answers
each probe in under a second; the stuck load is reported (``stalled_s``, ``stuck_loads``) and a second
handshake on that agent is refused at once (``AgentBusy``) instead of queueing behind it. On code that
loads on the loop, D prints nothing for ~130 s, and the test fails at ``RESULT_WAIT_S``.

This file is also the child program: ``python test_blocked_ucx_port.py p|d ...``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import select
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import pytest

HANDSHAKE_TIMEOUT_S = 2.0
SLACK_S = 1.5
PROBE_LIMIT_S = 1.0  # D's side channel must answer each probe within this, all along
RESULT_WAIT_S = 15.0  # from D's READY; loading on the loop blocks ~130 s: fail here, not wait it out
READY_S = 60.0
_TABLE = "kvwire_ucx_block"


# ---------------------------------------------------------------------------------------------------
# The two processes (children)
# ---------------------------------------------------------------------------------------------------


def _engine(engine_id: str) -> tuple[Any, list[Any]]:
    from kvwire.kv.spec import KVSpec
    from kvwire.testing.handshake_env import build_registered_engine
    from kvwire.transport.nixl import NixlAgent

    spec = KVSpec(num_layers=2, kv_heads=2, head_dim=8, block_size=4)
    return build_registered_engine(engine_id, spec, 8, NixlAgent)


async def _child_p(host: str) -> None:
    """P: serve the side channel on ``host`` until stdin closes."""
    from kvwire.handshake.server import SideChannelServer

    info, ranks = _engine("P")
    server = SideChannelServer(info, ranks, host=host, port=0)
    port = await server.start()
    print(f"READY {port}", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    os._exit(0)  # no teardown: nothing of P matters once the test has its figures


async def _probe(port: int, compat: str, stop: asyncio.Event, lat: list[float], gaps: list[float]) -> None:
    """Ask D's own side channel for its metadata every 50 ms (what a peer of D would do), and time it."""
    from kvwire.handshake.client import fetch_metadata
    from kvwire.handshake.types import PeerAddress

    addr = PeerAddress("127.0.0.1", port, 0, 0)
    last = time.monotonic()
    while not stop.is_set():
        t0 = time.monotonic()
        gaps.append(t0 - last)  # from one probe's start to the next: 50 ms plus a round trip when all is well
        last = t0
        await fetch_metadata(addr, notif_only=True, compat_hash=compat, timeout_s=600.0)
        lat.append(time.monotonic() - t0)
        await asyncio.sleep(0.05)


async def _handshake(mgr: Any, host: str, port: int) -> tuple[str, float, str]:
    from kvwire.transport.base import PeerMode

    t0 = time.monotonic()
    try:
        await mgr.ensure(host, port, 0, 0, PeerMode.NOTIF_ONLY)
        error, message = "none", ""
    except Exception as exc:
        error, message = type(exc).__name__, str(exc)
    return error, time.monotonic() - t0, message


async def _child_d(p_host: str, p_port: int, timeout_s: float) -> None:
    """D: handshake with P while probing its own side channel; print one RESULT line."""
    from kvwire.handshake.manager import HandshakeManager
    from kvwire.handshake.server import SideChannelServer, engine_compat_hash

    info, ranks = _engine("D")
    server = SideChannelServer(info, ranks, host="127.0.0.1", port=0)
    d_port = await server.start()
    mgr = HandshakeManager(info, ranks[0], timeout_s=timeout_s, retries=0, clock_samples=1)
    stop, lat, gaps = asyncio.Event(), list[float](), list[float]()
    prober = asyncio.create_task(_probe(d_port, engine_compat_hash(info), stop, lat, gaps))
    await asyncio.sleep(0.3)  # a few probes on a quiet loop first
    print("READY", flush=True)
    error, took, message = await _handshake(mgr, p_host, p_port)
    stalled = float(getattr(mgr, "stalled_s", lambda: -1.0)())
    second, second_took, _ = await _handshake(mgr, p_host, p_port)
    await asyncio.sleep(0.5)  # probes while the load is still stuck
    stop.set()
    await prober
    result = {
        "error": error,
        "message": message,
        "took_s": took,
        "stalled_s": stalled,
        "stuck_loads": int(getattr(mgr, "stuck_loads", -1)),
        "second_error": second,
        "second_took_s": second_took,
        "probes": len(lat),
        "max_probe_s": max(lat),
        "max_probe_gap_s": max(gaps),
    }
    print("RESULT " + json.dumps(result), flush=True)
    os._exit(0)  # the stuck load is still inside UCX: no agent teardown under it


async def _child_good_p(host: str) -> None:
    """A reachable P: serve the side channel, count the notifications that arrive; GOT n at stdin's end."""
    from kvwire.handshake.server import SideChannelServer

    info, ranks = _engine("P2")
    server = SideChannelServer(info, ranks, host=host, port=0)
    print(f"READY {await server.start()}", flush=True)
    agent, got = ranks[0].agent, 0
    eof = asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    while not eof.done():
        got += sum(len(msgs) for msgs in agent.drain_notifs().values())
        await asyncio.sleep(0.01)
    got += sum(len(msgs) for msgs in agent.drain_notifs().values())
    print(f"GOT {got}", flush=True)
    os._exit(0)


async def _traffic(agent: Any, peer: str, stop: asyncio.Event, lat: list[float], failed: list[str]) -> None:
    """D's real work with a reachable peer: a notification and a progress call every 20 ms, timed."""
    n = 0
    while not stop.is_set():
        t0 = time.monotonic()
        try:
            agent.send_notif(peer, b"ping %d" % n)
            agent.progress()
        except Exception as exc:
            failed.append(type(exc).__name__)
        lat.append(time.monotonic() - t0)
        n += 1
        await asyncio.sleep(0.02)
    for _ in range(20):  # let the last notifications leave (they go on progress calls)
        with contextlib.suppress(Exception):
            agent.progress()
        await asyncio.sleep(0.01)


async def _child_d_isolated(bad: str, bad_port: int, good: str, good_port: int, timeout_s: float) -> None:
    """D: traffic with the good P all along, one handshake with the blackholed one in the middle."""
    from kvwire.handshake.manager import HandshakeManager
    from kvwire.transport.base import PeerMode

    info, ranks = _engine("D")
    mgr = HandshakeManager(info, ranks[0], timeout_s=timeout_s, retries=0, clock_samples=1)
    peer = await mgr.ensure(good, good_port, 0, 0, PeerMode.NOTIF_ONLY)
    print("READY", flush=True)
    stop, lat, failed = asyncio.Event(), list[float](), list[str]()
    traffic = asyncio.create_task(_traffic(ranks[0].agent, peer.agent_name, stop, lat, failed))
    await asyncio.sleep(0.5)
    error, took, message = await _handshake(mgr, bad, bad_port)
    await asyncio.sleep(timeout_s + 1.0)  # whatever the bad load left behind, traffic goes on meanwhile
    stop.set()
    await traffic
    ordered = sorted(lat)
    result = {
        "error": error,
        "message": message,
        "took_s": took,
        "stuck_loads": mgr.stuck_loads,
        "sent": len(lat),
        "failed": len(failed),
        "failures": sorted(set(failed)),
        "p99_ms": ordered[int(0.99 * (len(ordered) - 1))] * 1e3,
        "max_ms": ordered[-1] * 1e3,
    }
    print("RESULT " + json.dumps(result), flush=True)
    os._exit(0)


def _child(argv: list[str]) -> None:
    if argv[0] == "p":
        asyncio.run(_child_p(argv[1]))
    elif argv[0] == "good-p":
        asyncio.run(_child_good_p(argv[1]))
    elif argv[0] == "d-isolated":
        asyncio.run(_child_d_isolated(argv[1], int(argv[2]), argv[3], int(argv[4]), float(argv[5])))
    else:
        asyncio.run(_child_d(argv[1], int(argv[2]), float(argv[3])))


# ---------------------------------------------------------------------------------------------------
# The test (parent, in the host namespace)
# ---------------------------------------------------------------------------------------------------

pytestmark = pytest.mark.nixl

if __name__ != "__main__":
    from netns_env import netns_pair

    from kvwire.testing.netns import NetnsPair, Side


@pytest.fixture(scope="module")
def net() -> Iterator[NetnsPair]:
    yield from netns_pair(nixl=True)


def _env(side: Side, conn_nb: str | None = "n") -> dict[str, str]:
    """``conn_nb="n"`` is UCX's own default, a blocking connect, which kvwire replaces with ``y`` where
    the user has not chosen (``transport/ucx_env.py``): pinned here, this test checks the fallback that
    bounds a load anyway; ``None`` leaves kvwire's choice."""
    env = {**os.environ}
    if conn_nb is not None:
        env["UCX_TCP_CONN_NB"] = conn_nb
    return {
        **env,
        "UCX_TLS": "tcp",
        "UCX_MODULES": "^ib*",
        "UCX_NET_DEVICES": side.ifname,
        "PYTHONUNBUFFERED": "1",
    }


def _block_all_tcp_but(net: NetnsPair, port: int) -> None:
    """In A, drop every TCP packet crossing the veth except those of A's side channel ``port``."""
    a = net.a
    rules = (
        f"add table inet {_TABLE}\n"
        f"add chain inet {_TABLE} in {{ type filter hook input priority 0; policy accept; }}\n"
        f"add chain inet {_TABLE} out {{ type filter hook output priority 0; policy accept; }}\n"
        f'add rule inet {_TABLE} in iifname "{a.ifname}" tcp dport != {port} counter drop\n'
        f'add rule inet {_TABLE} out oifname "{a.ifname}" tcp sport != {port} counter drop\n'
    )
    done = subprocess.run(
        net.command(a, ["nft", "-f", "-"]),
        input=rules,
        capture_output=True,
        text=True,
        timeout=10,
        check=False,
    )
    assert done.returncode == 0, done.stderr


_unread: dict[int, bytes] = {}  # per child pid: what was read past the line a _line call returned


def _line(proc: subprocess.Popen[bytes], tag: str, timeout_s: float, what: str) -> str:
    """The rest of the next stdout line of ``proc`` that starts with the word ``tag``."""
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    deadline = time.monotonic() + timeout_s
    buf = _unread.pop(proc.pid, b"")
    while True:
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            words = line.decode(errors="replace").split(" ", 1)
            if words[0] == tag:
                _unread[proc.pid] = buf
                return words[1] if len(words) > 1 else ""
        left = deadline - time.monotonic()
        if left <= 0:
            raise AssertionError(f"{what} printed no {tag} line within {timeout_s:.0f} s")
        ready, _, _ = select.select([fd], [], [], min(left, 0.5))
        if ready:
            chunk = os.read(fd, 65536)
            if not chunk:
                raise AssertionError(f"{what} exited ({proc.wait(5)}) before printing {tag}")
            buf += chunk


def _start(
    net: NetnsPair, side: Side, args: list[str], log: IO[Any], conn_nb: str | None = "n"
) -> subprocess.Popen[bytes]:
    argv = [sys.executable, str(Path(__file__).resolve()), *args]
    return net.popen(side, argv, env=_env(side, conn_nb), stderr=log)  # killed when the pair closes, too


def test_unreachable_ucx_port_fails_the_handshake_in_time_and_never_stalls_the_loop(
    net: NetnsPair, tmp_path: Path
) -> None:
    log = open(tmp_path / "children.log", "wb")  # noqa: SIM115 (closed in the finally below)
    procs: list[subprocess.Popen[bytes]] = []
    try:
        procs.append(_start(net, net.a, ["p", net.a.addr], log))
        p_port = int(_line(procs[0], "READY", READY_S, "P"))
        _block_all_tcp_but(net, p_port)
        args = ["d", net.a.addr, str(p_port), str(HANDSHAKE_TIMEOUT_S)]
        procs.append(_start(net, net.b, args, log))
        _line(procs[1], "READY", READY_S, "D")
        r = json.loads(_line(procs[1], "RESULT", RESULT_WAIT_S, "D (its loop blocked?)"))
        print(f"blocked UCX port: {json.dumps(r)}")
        assert r["error"] == "HandshakeTimeout", r
        assert HANDSHAKE_TIMEOUT_S * 0.8 <= r["took_s"] <= HANDSHAKE_TIMEOUT_S + SLACK_S, r
        assert r["stuck_loads"] == 1 and r["stalled_s"] >= HANDSHAKE_TIMEOUT_S * 0.5, r
        assert r["second_error"] == "AgentBusy" and r["second_took_s"] < PROBE_LIMIT_S, r
        # The loop answered its own side channel all along: well over a probe per second, none slow.
        assert r["max_probe_s"] < PROBE_LIMIT_S and r["max_probe_gap_s"] < PROBE_LIMIT_S, r
        assert r["probes"] >= (HANDSHAKE_TIMEOUT_S + 0.8) / (0.05 + PROBE_LIMIT_S), r
        listing = net.run(net.a, ["nft", "list", "table", "inet", _TABLE])
        assert sum(int(n) for n in re.findall(r"counter packets (\d+)", listing)) > 0, listing
    finally:
        net.kill_processes()
        subprocess.run(net.command(net.a, ["nft", "delete", "table", "inet", _TABLE]), check=False)
        log.close()
        print((tmp_path / "children.log").read_text(errors="replace")[-3000:])


@pytest.mark.parametrize("conn_nb", ["n", None], ids=["ucx-blocking-connect", "kvwire-defaults"])
def test_one_blackholed_peer_costs_other_peers_nothing(
    net: NetnsPair, tmp_path: Path, conn_nb: str | None
) -> None:
    """Issue 23: D keeps sending to a reachable P (in D's namespace) while one handshake names a peer
    whose UCX port is blackholed. UCX's blocking connect holds D's agent, and the good peer's traffic
    fails, until the kernel gives up; with kvwire's UCX defaults nothing of it is lost or slowed."""
    log = open(tmp_path / "children.log", "wb")  # noqa: SIM115 (closed in the finally below)
    procs: list[subprocess.Popen[bytes]] = []
    try:
        procs.append(_start(net, net.a, ["p", net.a.addr], log))
        bad_port = int(_line(procs[0], "READY", READY_S, "P"))
        _block_all_tcp_but(net, bad_port)
        procs.append(_start(net, net.b, ["good-p", net.b.addr], log))
        good_port = int(_line(procs[1], "READY", READY_S, "good P"))
        args = ["d-isolated", net.a.addr, str(bad_port), net.b.addr, str(good_port), str(HANDSHAKE_TIMEOUT_S)]
        procs.append(_start(net, net.b, args, log, conn_nb))
        _line(procs[2], "READY", READY_S, "D")
        r = json.loads(_line(procs[2], "RESULT", RESULT_WAIT_S, "D"))
        assert procs[1].stdin is not None
        procs[1].stdin.close()
        r["received"] = int(_line(procs[1], "GOT", 10.0, "good P"))
        print(f"one blackholed peer, UCX_TCP_CONN_NB={conn_nb or 'kvwire default'}: {json.dumps(r)}")
        if conn_nb == "n":  # the baseline: the agent is held past the deadline, the good peer starves
            assert r["error"] == "HandshakeTimeout" and r["stuck_loads"] == 1, r
            assert r["failed"] > r["sent"] / 2 and r["received"] < r["sent"] - r["failed"] + 1, r
        else:
            assert r["stuck_loads"] == 0 and r["took_s"] < HANDSHAKE_TIMEOUT_S, r
            assert r["failed"] == 0 and r["received"] == r["sent"], r
            assert r["p99_ms"] < 50, r
    finally:
        net.kill_processes()
        subprocess.run(net.command(net.a, ["nft", "delete", "table", "inet", _TABLE]), check=False)
        log.close()
        print((tmp_path / "children.log").read_text(errors="replace")[-3000:])


if __name__ == "__main__":
    _child(sys.argv[1:])

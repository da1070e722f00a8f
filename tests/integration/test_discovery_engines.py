"""Engine servers and a router as real processes on a real etcd: the router starts with no engine URL,
finds P and D through etcd, serves a request, serves on while etcd is down and resyncs when it is back;
SIGTERM drains P (draining, then deregistered, exit 0);
kill -9 of D leaves the view when its lease expires. ``-k "etcd or discovery"`` finds it."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvwire.testing.etcd import EtcdServer
from kvwire.testing.procs import Server, ServerGroup, free_port, server_env

pytestmark = pytest.mark.nixl


def view(router: Server) -> dict[str, dict[str, Any]]:
    body = httpx.get(router.url + "/health", timeout=5.0).json()
    return {e["url"]: e for role in ("prefill", "decode") for e in body[role]}


def discovery(router: Server) -> dict[str, Any]:
    body: dict[str, Any] = httpx.get(router.url + "/health", timeout=5.0).json()["discovery"]
    return body


def view_id(router: Server, url: str) -> str:
    return str(view(router)[url]["engine_id"])


def wait_until(cond: Callable[[], bool], what: str, timeout_s: float = 15.0) -> float:
    start = time.monotonic()
    while not cond():
        if time.monotonic() - start > timeout_s:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)
    return time.monotonic() - start


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[tuple[ServerGroup, EtcdServer, dict[str, Server]]]:
    with EtcdServer(tmp_path / "etcd") as etcd, ServerGroup(tmp_path / "logs", server_env()) as group:
        servers: dict[str, Server] = {}
        for role in ("prefill", "decode"):
            port = free_port()
            args = ["serve", role, "--port", str(port), "--num-blocks", "128", "--discovery", etcd.url]
            servers[role] = group.start(role, [*args, "--discovery-ttl", "1"], port)
        port = free_port()
        servers["router"] = group.start(
            "router", ["serve", "router", "--port", str(port), "--discovery", etcd.url], port
        )
        group.wait_healthy(list(servers.values()), 90.0)
        yield group, etcd, servers


def test_discovery_fleet_processes_join_drain_and_die(
    fleet: tuple[ServerGroup, EtcdServer, dict[str, Server]],
) -> None:
    group, etcd, s = fleet
    router, p, d = s["router"], s["prefill"], s["decode"]
    wait_until(lambda: {p.url, d.url} <= set(view(router)), "the router to find both engines")
    body = {"model": "kvwire-tiny", "prompt": "a fleet found through etcd", "max_tokens": 6, "temperature": 0}
    got = httpx.post(router.url + "/v1/completions", json=body, timeout=30.0)
    assert got.status_code == 200, got.text
    assert view(router)[p.url]["sent"] == 1 and view(router)[d.url]["sent"] == 1
    metrics = httpx.get(router.url + "/metrics", timeout=5.0).text.splitlines()
    figures = {
        line.split("{")[0]: line.rsplit(" ", 1)[1]
        for line in metrics
        if line.startswith("kvwire_router_disc")
    }
    assert figures == {
        "kvwire_router_discovery_synced": "1.0",
        "kvwire_router_discovery_engines": "2.0",
        "kvwire_router_discovery_resyncs": "0.0",
        "kvwire_router_discovery_rejected": "0.0",
    }
    # etcd down: the router keeps its view and the engines serve on; etcd back: the view resyncs.
    etcd.kill()
    wait_until(lambda: not discovery(router)["synced"], "the router to notice etcd is gone", 5.0)
    down = httpx.post(router.url + "/v1/completions", json=body, timeout=30.0)
    assert down.status_code == 200 and down.json()["choices"][0]["text"] == got.json()["choices"][0]["text"]
    etcd.start()
    wait_until(lambda: discovery(router)["synced"] and discovery(router)["engines"] == 2, "the resync", 15.0)
    assert discovery(router)["resyncs"] >= 1 and {p.url, d.url} <= set(view(router))
    # SIGTERM drains P: the router sees it draining, then gone; the process exits 0.
    p_old = view_id(router, p.url)
    assert p.proc is not None
    p.proc.send_signal(signal.SIGTERM)
    wait_until(lambda: view(router).get(p.url, {}).get("draining", False), "the draining mark", 5.0)
    assert p.proc.wait(timeout=20) == 0
    wait_until(lambda: p.url not in view(router), "P's record to go")
    refused = httpx.post(router.url + "/v1/completions", json=body, timeout=30.0)
    assert refused.status_code == 503  # no prefill engine left: nothing healthy, said so
    # P again on the same port: a new life, whose identity (not the old one's) D's legs carry.
    group.restart(p)
    wait_until(lambda: view(router).get(p.url, {}).get("healthy", False), "P's new life", 60.0)
    again = httpx.post(router.url + "/v1/completions", json=body, timeout=30.0)
    assert again.status_code == 200, again.text
    assert again.json()["choices"][0]["text"] == got.json()["choices"][0]["text"]
    assert view_id(router, p.url) != p_old  # the router holds the new life's identity
    # kill -9 of D: nobody deregisters; the lease (1 s) expires and D leaves the view.
    group.kill(d)
    took = wait_until(lambda: d.url not in view(router), "D's lease to expire", 10.0)
    assert took < 5.0


def test_a_drain_that_times_out_answers_live_requests_and_refuses_late_ones(tmp_path: Path) -> None:
    """--drain-timeout reached with a request still generating: uvicorn cancelled its handler at shutdown
    (a bare 500 in plain text), and a request arriving after the drain's grace was taken and cut the same
    way. Now the engine ends the live one (its typed 503) and refuses the late one (503) at once."""
    with EtcdServer(tmp_path / "etcd") as etcd, ServerGroup(tmp_path / "logs", server_env()) as group:
        port = free_port()
        args = ["serve", "decode", "--port", str(port), "--num-blocks", "1024", "--discovery", etcd.url,
                "--discovery-ttl", "2", "--drain-timeout", "1"]  # fmt: skip
        d = group.start("decode", args, port)
        group.wait_healthy([d], 90.0)
        body = {"model": "kvwire-tiny", "prompt": "x", "max_tokens": 6000, "ignore_eos": True}  # ~15 s
        answers: dict[str, httpx.Response] = {}

        def ask(name: str) -> None:
            answers[name] = httpx.post(d.url + "/v1/completions", json=body, timeout=60.0)

        live = threading.Thread(target=ask, args=("live",))
        live.start()
        wait_until(lambda: _live_requests(d) == 1, "the request to run")
        assert d.proc is not None
        d.proc.send_signal(signal.SIGTERM)
        time.sleep(0.8)  # past the drain's 0.5 s grace
        health = httpx.get(d.url + "/health", timeout=5.0)  # 503 while draining: probes and balancers stop
        assert (health.status_code, health.json()["status"]) == (503, "draining")
        ask("late")
        # A decode leg continuing a transfer (pull mode sends it once P answered, maybe after the grace) is
        # no new work: judged as any other (here: its P is unreachable), not refused as the late one.
        leg = {"do_remote_prefill": True, "transfer_id": "t-late", "remote_engine_id": "P",
               "remote_host": "127.0.0.1", "remote_port": 1}  # fmt: skip
        answers["leg"] = httpx.post(
            d.url + "/v1/completions", json={**body, "max_tokens": 2, "kv_transfer_params": leg}, timeout=30.0
        )
        assert d.proc.wait(timeout=20) == 0
        live.join(20)
    for name, says in (("late", "the engine is draining"), ("live", "the engine is shutting down")):
        assert answers[name].status_code == 503, answers[name].text
        assert answers[name].json()["error"]["message"].startswith(says)
    assert not answers["leg"].json()["error"]["message"].startswith("the engine is draining"), answers[
        "leg"
    ].text


def _live_requests(server: Server) -> int:
    accounting = httpx.get(server.url + "/v1/kv_stats", timeout=5.0).json()["accounting"]
    return int(accounting["requests"]["live"])

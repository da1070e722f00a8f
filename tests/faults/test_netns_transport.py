"""Two "hosts": P and D in different network namespaces, real NIXL over UCX's tcp transport.

With default transports UCX moves data by ``cma`` even across namespaces (it still sees one node), so
every worker runs with ``UCX_TLS=tcp`` and ``UCX_NET_DEVICES`` set to its end of the veth. What these
tests pin down (shared/reference/nixl-faults.md): loss and a bandwidth cap only slow a transfer down; a
partition, a frozen D and a killed P are never reported by NIXL (the write stays IN_PROGRESS, D hears
nothing), so only kvwire's own heartbeats and transfer deadline end the request, within the liveness
timeout + 2 s. A killed D, by contrast, is reported by NIXL itself.

TODO(connector): these drive ``kvwire.testing.faultnet`` workers, which carry the same guards as the
connector (heartbeats, liveness timeout, transfer deadline); switch them to Producer/Consumer workers
once a cross-namespace connector worker exists.
"""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import pytest

from kvwire.testing.faultnet import FaultWorker
from kvwire.testing.netns import NetnsPair, Side, unavailable_reason

pytestmark = pytest.mark.nixl

NBYTES = 32 << 20
SEED = 20261203
LIVENESS_S = 1.5
# What the issue allows between a peer's death and the end of D's request, beyond the liveness timeout.
SLACK_S = 2.0
CLEAN_DEADLINE_S = 30.0  # generous: a 32 MiB WRITE takes ~1.4 s under the 200 Mbit cap


@pytest.fixture(scope="module")
def net() -> Iterator[NetnsPair]:
    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(f"network namespaces unavailable: {reason}")
    with NetnsPair() as pair:
        yield pair


def _env(side: Side) -> dict[str, str]:
    return {"UCX_TLS": "tcp", "UCX_MODULES": "^ib*", "UCX_NET_DEVICES": side.ifname, "PYTHONUNBUFFERED": "1"}


@dataclass
class Link:
    net: NetnsPair
    p: FaultWorker
    d: FaultWorker
    d_on_p: str  # D's agent name as loaded in P
    p_on_d: str

    def write(
        self,
        tag: str,
        *,
        transfer_timeout_s: float,
        liveness_timeout_s: float = LIVENESS_S,
        nbytes: int = NBYTES,
    ) -> None:
        self.p.start_write(
            self.d_on_p,
            self.d,
            nbytes,
            tag,
            transfer_timeout_s=transfer_timeout_s,
            liveness_timeout_s=liveness_timeout_s,
        )

    def await_done(self, tag: str, *, max_s: float, liveness_timeout_s: float = LIVENESS_S) -> None:
        self.d.start_await(self.p_on_d, tag, liveness_timeout_s=liveness_timeout_s, max_s=max_s)


@pytest.fixture
def link(net: NetnsPair, tmp_path: Path) -> Iterator[Link]:
    log: IO[Any] = open(tmp_path / "workers.log", "wb")  # noqa: SIM115 (closed in the finally below)
    workers: list[FaultWorker] = []

    def start(side: Side, name: str, seed: int | None) -> FaultWorker:
        def popen(argv: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
            return net.popen(side, argv, env=env, stderr=log)

        worker = FaultWorker.launch(popen, name, NBYTES, seed=seed, env=_env(side))
        workers.append(worker)
        return worker

    try:
        p = start(net.a, "P/netns", SEED)
        d = start(net.b, "D/netns", None)
        p.wait_ready()
        d.wait_ready()
        link = Link(net, p, d, p.add_peer(d), d.add_peer(p))
        # Warm up both connections while the link is clean (UCX connects lazily): a small WRITE P -> D,
        # and the heartbeats both ways.
        p.start_write(link.d_on_p, d, 4096, "warm", transfer_timeout_s=10.0, liveness_timeout_s=10.0)
        d.start_await(link.p_on_d, "warm", liveness_timeout_s=10.0, max_s=10.0)
        assert d.reply(20.0)["outcome"] == "done"
        assert p.reply(20.0)["outcome"] == "done"
        d.call({"cmd": "zero"})
        yield link
    finally:
        net.clear()
        for worker in workers:
            worker.stop()
        net.kill_processes()
        log.close()


def _push_completes(link: Link, tag: str, nbytes: int = NBYTES) -> dict[str, Any]:
    link.write(tag, transfer_timeout_s=CLEAN_DEADLINE_S, liveness_timeout_s=CLEAN_DEADLINE_S, nbytes=nbytes)
    link.await_done(tag, max_s=CLEAN_DEADLINE_S, liveness_timeout_s=CLEAN_DEADLINE_S)
    on_d = link.d.reply(CLEAN_DEADLINE_S + 10)
    on_p = link.p.reply(CLEAN_DEADLINE_S + 10)
    assert on_p["outcome"] == "done", on_p
    assert on_d["outcome"] == "done", on_d
    assert link.d.bad_bytes(SEED, nbytes, NBYTES) == 0
    print(f"push {tag}: {on_p['elapsed_s']:.3f} s")
    return on_p


def test_push_completes_under_random_loss(link: Link) -> None:
    link.net.loss(5)  # 5% of the offload super-packets the veth carries
    _push_completes(link, "loss")
    assert link.net.dropped_packets() > 0


def test_push_completes_under_random_loss_of_wire_sized_packets(link: Link) -> None:
    # 5% of MTU-sized packets: TCP crawls (RTO-bound; 32 MiB took ~17 s), so a smaller push here.
    link.net.wire_sized_packets()
    link.net.loss(5)
    _push_completes(link, "wireloss", nbytes=2 << 20)
    assert link.net.dropped_packets() > 0


def test_push_completes_under_bandwidth_cap(link: Link) -> None:
    link.net.rate_limit(200)
    on_p = _push_completes(link, "tbf")
    # 32 MiB cannot cross a 200 Mbit/s link in under ~1.3 s: the cap was really in the path.
    assert on_p["elapsed_s"] > 1.0


def test_partition_is_silent_in_nixl_and_ended_by_kvwire(link: Link) -> None:
    link.net.partition()
    # P: no liveness guard, only the transfer deadline, to show what NIXL itself reports: nothing.
    link.write("part", transfer_timeout_s=LIVENESS_S + 1.0, liveness_timeout_s=60.0)
    link.await_done("part", max_s=30.0)
    on_d = link.d.reply(40.0)
    on_p = link.p.reply(40.0)
    print("partition:", on_p, on_d)
    assert on_p["outcome"] == "timeout", on_p
    assert on_p["state"] == "IN_PROGRESS"  # NIXL never failed it
    assert on_d["outcome"] == "peer_dead", on_d
    assert on_d["elapsed_s"] <= LIVENESS_S + SLACK_S
    assert link.net.dropped_packets() > 0
    # The released write never delivers its notification, even once the link heals.
    link.net.heal()
    assert link.d.call({"cmd": "poll_notif", "peer": link.p_on_d, "notif": "part"})["found"] is False
    link.d.call({"cmd": "zero"})
    _push_completes(link, "healed")


def test_frozen_decode_is_detected_by_heartbeats(link: Link) -> None:
    link.d.signal(signal.SIGSTOP)
    try:
        link.write("frozen", transfer_timeout_s=30.0)
        on_p = link.p.reply(40.0)
    finally:
        link.d.signal(signal.SIGCONT)
    print("frozen D:", on_p)
    assert on_p["outcome"] == "peer_dead", on_p
    assert on_p["state"] == "IN_PROGRESS"  # NIXL saw nothing wrong in all that time
    assert on_p["elapsed_s"] <= LIVENESS_S + SLACK_S
    # The thawed D is healthy and reachable again.
    link.d.call({"cmd": "zero"})
    _push_completes(link, "thawed")


def test_prefill_killed_mid_transfer_ends_decode_request(link: Link) -> None:
    link.net.rate_limit(50)  # ~5 s for 32 MiB: P surely dies mid-transfer
    link.write("killed", transfer_timeout_s=30.0)
    link.await_done("killed", max_s=30.0)
    time.sleep(0.3)
    killed_at = time.monotonic()
    link.p.kill()
    on_d = link.d.reply(40.0)
    ended_after = time.monotonic() - killed_at
    print("killed P:", on_d, f"ended {ended_after:.3f} s after the kill")
    assert on_d["outcome"] == "peer_dead", on_d
    assert ended_after <= LIVENESS_S + SLACK_S


def test_decode_killed_mid_transfer_is_reported_by_nixl(link: Link) -> None:
    link.net.rate_limit(50)
    link.write("dkilled", transfer_timeout_s=30.0, liveness_timeout_s=60.0)
    time.sleep(0.3)
    link.d.kill()
    on_p = link.p.reply(40.0)
    print("killed D:", on_p)
    # A killed process's sockets are closed by its kernel: UCX sees the reset, unlike a partition.
    assert on_p["outcome"] in {"failed", "peer_dead"}, on_p
    assert on_p["state"] in {"FAILED", "IN_PROGRESS"}
    assert on_p["elapsed_s"] <= LIVENESS_S + SLACK_S

"""Push and pull over real NIXL, P and D in separate processes; D's blocks compared byte for byte.

Two worker processes (one P host, one D host) serve every case: each case builds fresh engines (new
agents, new incarnations) in them, so the spawn and NIXL start-up are paid once.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from kvwire.kv.spec import KVSpec
from kvwire.testing.connector_worker import ConnectorWorker
from kvwire.testing.engines import random_kv, same_bytes

pytestmark = pytest.mark.nixl

SPEC = KVSpec(num_layers=4, kv_heads=4, head_dim=16, block_size=16)
SPEC_KW = {f.name: getattr(SPEC, f.name) for f in dataclasses.fields(SPEC)}
NUM_BLOCKS = 64
_case = iter(range(1000))


@pytest.fixture(scope="module")
def hosts() -> Iterator[tuple[ConnectorWorker, ConnectorWorker]]:
    p, d = ConnectorWorker(), ConnectorWorker()
    try:
        yield p, d
    finally:
        p.close()
        d.close()


class Engines:
    def __init__(
        self,
        hosts: tuple[ConnectorWorker, ConnectorWorker],
        *,
        p_tp: int = 1,
        p_pp: int = 1,
        d_tp: int = 1,
        mode: str = "push",
        secret: bytes | None = None,
        keys: tuple[dict[str, bytes], dict[str, bytes]] | None = None,
    ) -> None:
        """``keys``: P's and D's own ``secret`` / ``accept_secret`` (else both ``secret``)."""
        self.p, self.d = hosts
        n = next(_case)
        common: dict[str, Any] = {
            "spec": SPEC_KW | {"layout": SPEC.layout},
            "num_blocks": NUM_BLOCKS,
            "mode": mode,
        }
        p_keys, d_keys = keys or ({"secret": secret} if secret else {}, {"secret": secret} if secret else {})
        self.p_info = self.p.call("engine", role="p", engine_id=f"P{n}", tp=p_tp, pp=p_pp, **common, **p_keys)
        self.d_info = self.d.call("engine", role="d", engine_id=f"D{n}", tp=d_tp, pp=1, **common, **d_keys)
        self.p_tp, self.p_pp = p_tp, p_pp

    def remote(self, block_ids: list[int] | None = None) -> dict[str, Any]:
        return {
            "engine_id": self.p_info["engine_id"],
            "host": "127.0.0.1",
            "port": self.p_info["port"],
            "tp_size": self.p_tp,
            "pp_size": self.p_pp,
            "block_ids": block_ids or [],
        }

    def request(
        self,
        tid: str,
        p_blocks: list[int],
        d_blocks: list[int],
        n: int,
        *,
        cached: int = 0,
        reg_first: bool = True,
        pull: bool = False,
        seed: int = 3,
    ) -> np.ndarray:
        self.p.call("fill", block_ids=p_blocks, num_tokens=n, seed=seed)
        remote = self.remote(p_blocks if pull else None)
        steps: list[tuple[str, ConnectorWorker, dict[str, Any]]] = [
            ("finish", self.p, {"tid": tid, "block_ids": p_blocks, "num_tokens": n}),
            (
                "allocate",
                self.d,
                {"tid": tid, "block_ids": d_blocks, "num_tokens": n, "cached": cached, "remote": remote},
            ),
        ]
        for cmd, host, kw in steps[::-1] if reg_first else steps:
            host.call(cmd, **kw)
        assert self.d.call("wait", tid=tid) == ["ready"]
        assert self.p.call("wait", tid=tid) == ["pulled" if pull else "sent"]
        return random_kv(SPEC, n, seed)

    def check(self, d_blocks: list[int], kv: np.ndarray, start: int = 0) -> None:
        n = kv.shape[3]
        got = self.d.call("gather", block_ids=d_blocks, start=start, stop=n)
        assert same_bytes(got, kv[:, :, :, start:])

    def close(self) -> None:
        self.p.call("close_engine")
        self.d.call("close_engine")


@pytest.mark.parametrize(("p_tp", "p_pp", "d_tp"), [(1, 1, 1), (2, 1, 1), (1, 1, 2), (1, 2, 1)])
def test_push_bytes_equal(
    hosts: tuple[ConnectorWorker, ConnectorWorker], p_tp: int, p_pp: int, d_tp: int
) -> None:
    eng = Engines(hosts, p_tp=p_tp, p_pp=p_pp, d_tp=d_tp)
    try:
        d_blocks = [9, 3, 4, 40]
        kv = eng.request("r", [1, 2, 7, 8], d_blocks, 60)
        eng.check(d_blocks, kv)
        assert eng.d.call("untouched", used=d_blocks)
    finally:
        eng.close()


def test_registration_before_and_after_finish(hosts: tuple[ConnectorWorker, ConnectorWorker]) -> None:
    eng = Engines(hosts)
    try:
        kv1 = eng.request("before", [0, 1, 2], [10, 11, 12], 40, reg_first=True, seed=5)
        kv2 = eng.request("after", [3, 4, 5], [20, 21, 22], 48, reg_first=False, seed=6)
        eng.check([10, 11, 12], kv1)
        eng.check([20, 21, 22], kv2)
        stats = eng.p.call("stats")
        assert stats["transfers_done"] == 2
        assert stats["descs"] == 2 * SPEC.num_layers * 2  # contiguous blocks: one descriptor per region
    finally:
        eng.close()


def test_prefix_hit_trims_to_the_uncached_suffix(hosts: tuple[ConnectorWorker, ConnectorWorker]) -> None:
    eng = Engines(hosts)
    try:
        d_blocks, cached, n = [30, 31, 32, 33], 32, 50
        eng.d.call("fill", block_ids=d_blocks, num_tokens=n, seed=99, tokens=(0, cached))  # D's own prefix
        eng.p.call("fill", block_ids=[0, 1, 2, 3], num_tokens=n, seed=7)
        eng.d.call(
            "allocate", tid="hit", block_ids=d_blocks, num_tokens=n, cached=cached, remote=eng.remote()
        )
        eng.p.call("finish", tid="hit", block_ids=[0, 1, 2, 3], num_tokens=n)
        assert eng.d.call("wait", tid="hit") == ["ready"]
        eng.check(d_blocks, random_kv(SPEC, n, 7), start=cached)
        prefix = eng.d.call("gather", block_ids=d_blocks, start=0, stop=cached)
        assert same_bytes(prefix, random_kv(SPEC, n, 99)[:, :, :, :cached])
        assert eng.p.call("stats")["bytes"] == 2 * SPEC.num_layers * 2 * SPEC.block_bytes(SPEC.kv_heads)
    finally:
        eng.close()


def test_pull_bytes_equal(hosts: tuple[ConnectorWorker, ConnectorWorker]) -> None:
    eng = Engines(hosts, mode="pull")
    try:
        kv = eng.request("pull", [5, 6, 7], [1, 2, 3], 40, pull=True)
        eng.check([1, 2, 3], kv)
    finally:
        eng.close()


OLD, NEW = b"rotation-old-0123456789abcdef012345", b"rotation-new-0123456789abcdef012345"


@pytest.mark.parametrize("mode", ["push", "pull"])
@pytest.mark.parametrize(
    ("p_keys", "d_keys"),
    [
        # One secret on both sides: sealed replies open, tagged notifications (sent, and attached to the
        # WRITE) are taken on both sides.
        ({"secret": OLD}, {"secret": OLD}),
        # The first roll: each engine in turn takes the new secret too, still signing with the old.
        ({"secret": OLD}, {"secret": OLD, "accept_secret": NEW}),
        # The second roll: each engine in turn signs with the new one, still taking the old.
        ({"secret": OLD, "accept_secret": NEW}, {"secret": NEW, "accept_secret": OLD}),
        ({"secret": NEW, "accept_secret": OLD}, {"secret": OLD, "accept_secret": NEW}),
        # The last roll: the old one dropped.
        ({"secret": NEW}, {"secret": NEW, "accept_secret": OLD}),
    ],
    ids=["one-secret", "roll1", "roll2-d-first", "roll2-p-first", "roll3"],
)
def test_the_secret_rotates_in_rolls_with_every_pair_moving_exact_bytes(
    hosts: tuple[ConnectorWorker, ConnectorWorker],
    mode: str,
    p_keys: dict[str, bytes],
    d_keys: dict[str, bytes],
) -> None:
    """KVWIRE_SECRET_ACCEPT: every pair of engines a rolling rotation puts side by side authenticates
    (requests signed under either secret verify, replies are sealed under the requester's, tagged
    notifications open under either) and moves exact bytes, with no notification dropped."""
    eng = Engines(hosts, p_tp=2, mode=mode, keys=(p_keys, d_keys))
    try:
        p_blocks, d_blocks = [1, 2, 7], [9, 3, 4]
        kv = eng.request("rot", p_blocks, d_blocks, 40, pull=mode == "pull")
        eng.check(d_blocks, kv)
        for host in (eng.p, eng.d):
            assert host.call("stats")["dropped"].get("unauthenticated", 0) == 0
    finally:
        eng.close()


def test_switching_the_secret_without_accepting_the_other_fails_the_pair(
    hosts: tuple[ConnectorWorker, ConnectorWorker],
) -> None:
    """Why more than one roll: a D that signs with the new secret beside a P that knows only the old one is
    refused (the load fails, typed), so a one-step switch fails every request across the two generations."""
    eng = Engines(hosts, keys=({"secret": OLD}, {"secret": NEW}))
    try:
        eng.p.call("fill", block_ids=[1, 2], num_tokens=20, seed=3)
        remote = eng.remote()
        eng.d.call("allocate", tid="split", block_ids=[3, 4], num_tokens=20, cached=0, remote=remote)
        eng.p.call("finish", tid="split", block_ids=[1, 2], num_tokens=20)
        assert eng.d.call("wait", tid="split")[0] == "failed:unauthorized"
    finally:
        eng.close()


def test_push_handshakes_are_asymmetric(hosts: tuple[ConnectorWorker, ConnectorWorker]) -> None:
    eng = Engines(hosts)
    try:
        eng.request("asym", [0, 1], [0, 1], 32)
        p_agent, d_agent = eng.p_info["agents"][0], eng.d_info["agents"][0]
        assert eng.d.call("peer_modes") == {d_agent: {p_agent: "notif_only"}}
        assert eng.p.call("peer_modes") == {p_agent: {d_agent: "full"}}
        # D holds no descriptor of P's memory: a READ of P's first block is refused, typed.
        addr, block_len = eng.p.call("regions")[0]
        assert eng.d.call("try_read", peer=p_agent, addr=addr, length=block_len) == "NotAddressable"
        # P can address D's memory: the same READ from P's side is accepted.
        d_addr, _ = eng.d.call("regions")[0]
        assert eng.p.call("try_read", peer=d_agent, addr=d_addr, length=block_len) == "ok"
    finally:
        eng.close()

"""The ``transfer`` suite's KV cases: one 1k-token Llama-3-8B-shaped request (128 MiB) pushed from this
process (P) into a peer process (D), contiguous and fragmented, against raw NIXL and ``np.copyto``.

Columns, each the median of ``reps`` runs taken round-robin (one run of every column per round, so that
the shared machine's noise hits them alike), after one warm-up each:

* ``nixl``: raw NIXL WRITE with the same descriptors as kvwire's plan: one transfer initialized once
  and reposted (``transfer()`` + polling to DONE), so no per-request cost at all;
* ``memcpy``: ``np.copyto`` of the same byte count, contiguous, inside this process;
* ``kvwire``: the connector's data path without its control plane: ``plan_transfer`` +
  ``Agent.post_array`` + polling ``Agent.status`` to DONE (a new transfer per request, as a push does);
* ``kvwire_lanes2``: the same, the descriptors split into two transfers of about equal bytes posted
  back to back (lanes), both waited for.

* ``connector``: the real thing: a ``Producer`` in this process pushes into a ``Consumer`` in a child
  process (its own cache, real NIXL, the side channel, handshakes done in the warm-up), timed from P's
  loop thread taking the ``push_reg`` to D's loop thread emitting READY (issue 7, item 1). The ratios
  ``ratio_vs_nixl`` and ``ratio_vs_memcpy`` are this column's (``ratios_of``); the data path's ratio to
  raw NIXL is ``datapath_ratio_vs_nixl``.
* ``connector_digest``: the same with a second Consumer that checks every request's bytes against P's
  digest (``kv_digest_sample=1``: P digests its source before posting, D the landed bytes before READY);
  ``digest_ratio_vs_connector`` is ``connector_ms / connector_digest_ms`` and
  ``digest_added_ms_per_gib`` what the check adds per GiB of KV, both from the same rounds;
* ``digest``: one side's ``kv_digest`` of the request (P's source), in this process.

``PUSHES`` maps a column name to a callable doing one request with the bench's agent (more data-path
variants can be added there).
D (the peer process, and the Consumer) verifies every byte of each case after it is timed. Ratios are
throughput ratios (``x_ms / push_ms``).
"""

from __future__ import annotations

import functools
import itertools
import statistics
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from kvwire.connector import (
    ConnectorConfig,
    Consumer,
    ConsumerEvent,
    ConsumerEventKind,
    Producer,
    RemoteEngine,
)
from kvwire.core.io import Action, Emit, Input, NotifIn
from kvwire.errors import TransferFailed
from kvwire.kv.digest import DigestScope, kv_digest
from kvwire.kv.spec import KVSpec
from kvwire.protocol.codec import decode_notif
from kvwire.protocol.messages import PushReg
from kvwire.testing.buffer_peer import BufferPeer
from kvwire.testing.child import spawn_child, stop_child
from kvwire.testing.engines import (
    build_engine,
    gather_tokens,
    random_kv,
    same_bytes,
    scatter_tokens,
    untouched_blocks_zero,
)
from kvwire.transport import XferOp, make_agent_name, new_incarnation
from kvwire.transport.nixl import NixlAgent
from kvwire_tools.bench.cases import repost_raw
from kvwire_tools.bench.common import gbps
from kvwire_tools.bench.kvrequest import (
    Assignment,
    Endpoints,
    Request,
    block_assignment,
    endpoints,
    post_lanes,
    wait_all,
)

POLL_LIMIT_S = 30.0
CASES = (("contiguous", Assignment.CONTIGUOUS), ("fragmented", Assignment.SCATTERED))

Blocks = tuple[list[int], list[int]]
PushFn = Callable[[NixlAgent, Endpoints, Blocks, str], None]


def push_kvwire(agent: NixlAgent, ep: Endpoints, blocks: Blocks, peer: str) -> None:
    plan = ep.plan(*blocks)
    wait_all(agent, [agent.post_array(XferOp.WRITE, plan.src_array, plan.dst_array, peer)])


def push_lanes2(agent: NixlAgent, ep: Endpoints, blocks: Blocks, peer: str) -> None:
    wait_all(agent, post_lanes(agent, ep.plan(*blocks), peer, 2))


PUSHES: dict[str, PushFn] = {"kvwire": push_kvwire, "kvwire_lanes2": push_lanes2}


class _RawRepost:
    """A raw NIXL WRITE of one plan's descriptors, initialized once, reposted per run."""

    def __init__(self, agent: NixlAgent, ep: Endpoints, blocks: Blocks, peer: str) -> None:
        self.raw = agent.raw_agent
        plan = ep.plan(*blocks)
        local = self.raw.get_xfer_descs(plan.src_array.view(np.uint64), "DRAM")
        remote = self.raw.get_xfer_descs(plan.dst_array.view(np.uint64), "DRAM")
        self.handle = self.raw.initialize_xfer(XferOp.WRITE.value, local, remote, peer, b"")

    def __call__(self) -> None:
        repost_raw(self.raw, self.handle, "raw NIXL WRITE", POLL_LIMIT_S)

    def close(self) -> None:
        self.raw.release_xfer_handle(self.handle)


def _round_robin(fns: dict[str, Callable[[], float | None]], reps: int) -> dict[str, float]:
    """Median seconds per function, runs interleaved across functions. A function that returns a float
    times itself (the connector's push, timed between two events); the others are timed around the call."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(max(1, reps)):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            own = fn()
            times[name].append(own if own is not None else time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def _case(
    name: str,
    assignment: Assignment,
    agent: NixlAgent,
    ep: Endpoints,
    peer: BufferPeer,
    reps: int,
    conns: dict[str, ConnectorPush],
) -> dict[str, Any]:
    blocks = block_assignment(assignment, ep.req.blocks)
    plan = ep.plan(*blocks)
    nbytes = plan.nbytes
    src = ep.cache.slab.reshape(-1).view(np.uint8)[:nbytes]
    dst = np.zeros(nbytes, dtype=np.uint8)  # pages touched by the warm-up run, not in the timed ones
    peer.call(("zero",))
    for conn in conns.values():
        conn.prepare(blocks)
    raw = _RawRepost(agent, ep, blocks, peer.name)
    spec, tokens = ep.req.spec, ep.req.num_tokens
    whole = DigestScope(range(spec.num_layers), ((0, spec.kv_heads),), tuple(blocks[0]), 0, tokens)
    try:
        fns: dict[str, Callable[[], float | None]] = {
            "nixl": raw,
            "memcpy": lambda: np.copyto(dst, src),
            "digest": lambda: _none(kv_digest(ep.cache, whole)),  # one side's digest of the request
        }
        for col, push in PUSHES.items():
            fns[col] = functools.partial(push, agent, ep, blocks, peer.name)
        for col, conn in conns.items():
            fns[col] = functools.partial(conn.push, blocks)
        med = _round_robin(fns, reps)
    finally:
        raw.close()
    ep.verify(peer, *blocks)
    for conn in conns.values():
        conn.check(blocks)
    out: dict[str, Any] = {
        "case": f"llama3-8b-1k-{name}" if ep.req.num_tokens == 1024 else f"kv-{ep.req.num_tokens}t-{name}",
        "bytes": nbytes,
        "descriptors": plan.num_descs,
        "reps": reps,
    }
    return _figures(out, med, nbytes)


def _figures(out: dict[str, Any], med: dict[str, float], nbytes: int) -> dict[str, Any]:
    """A case's columns (ms, GB/s) and ratios, all from the same rounds."""
    for col, seconds in med.items():
        out[f"{col}_ms"] = seconds * 1e3
        out[f"{col}_gbps"] = gbps(nbytes, seconds)
    # The figure is the connector's push (push_reg on P to READY on D); without it (--no-connector),
    # the data path's.
    col = "connector" if "connector" in med else "kvwire"
    out["ratio_vs_nixl"] = med["nixl"] / med[col]
    out["ratio_vs_memcpy"] = med["memcpy"] / med[col]
    out["ratios_of"] = col
    out["datapath_ratio_vs_nixl"] = med["nixl"] / med["kvwire"]
    out["lanes2_vs_1"] = med["kvwire"] / med["kvwire_lanes2"]
    if "connector_digest" in med:
        # What D's kv_digest_sample=1 costs a request: P digests its source before posting, D the bytes
        # that landed before READY (both on the request's path).
        out["digest_ratio_vs_connector"] = med["connector"] / med["connector_digest"]
        out["digest_added_ms_per_gib"] = (med["connector_digest"] - med["connector"]) * 1e3 / (nbytes / 2**30)
    return out


def _none(_: object) -> None:
    return None


def run_kv_cases(req: Request, reps: int, connector: bool = True) -> list[dict[str, Any]]:
    results: list[dict[str, Any]] = []
    with BufferPeer(make_agent_name("bench-kv-d", new_incarnation(), 0, 0), req.cache_bytes) as peer:
        ep = endpoints(req, peer)
        agent = NixlAgent(make_agent_name("bench-kv-p", new_incarnation(), 0, 0))
        conns: dict[str, ConnectorPush] = {}
        try:
            if connector:
                conns["connector"] = ConnectorPush(req)
                conns["connector_digest"] = ConnectorPush(req, digest=True)
            agent.register(ep.cache.slab)
            agent.add_peer(peer.metadata)
            for name, assignment in CASES:
                results.append(_case(name, assignment, agent, ep, peer, reps, conns))
        finally:
            for conn in conns.values():
                conn.close()
            agent.close()
    return results


# -- the connector's own push: Producer here, Consumer in a child process -------------------------------
# Timed from P's loop thread taking the push_reg to D's loop thread emitting READY: both stamps are
# time.monotonic() (CLOCK_MONOTONIC, one clock for every process on the host).
_FILL_SEED = 11


class _StampedProducer(Producer):
    push_reg_at: dict[str, float]

    def _apply(self, now: float, inp: Input) -> None:
        if isinstance(inp, NotifIn):
            msg = decode_notif(inp.raw)
            if isinstance(msg, PushReg):
                self.push_reg_at.setdefault(msg.transfer_id, time.monotonic())
        super()._apply(now, inp)


class _StampedConsumer(Consumer):
    ended_at: dict[str, float]

    def _execute(self, action: Action) -> None:
        if isinstance(action, Emit) and isinstance(action.event, ConsumerEvent):
            self.ended_at.setdefault(action.event.transfer_id, time.monotonic())
        super()._execute(action)


def _consumer_child(conn: Connection, spec: KVSpec, num_blocks: int, digest: bool = False) -> None:
    """D: a Consumer on real NIXL; commands ``("push", tid, blocks, tokens, remote)``, ``("check", ...)``.
    ``digest``: it checks every request's bytes against P's digest."""
    setup = build_engine("bench-D", spec, num_blocks=num_blocks, backend="nixl")
    config = ConnectorConfig(kv_digest_sample=1.0 if digest else 0.0)
    consumer = _StampedConsumer(setup.engine, setup.ranks, config)
    consumer.ended_at = {}
    try:
        consumer.start()
        conn.send(("ready", None))
        while True:
            cmd = conn.recv()
            if cmd[0] == "stop":
                return
            if cmd[0] == "push":
                _, tid, blocks, tokens, remote = cmd
                consumer.request_allocated(tid, blocks, tokens, 0, remote)
                conn.send(_await_consumer(consumer, tid))
            elif cmd[0] == "check":
                _, blocks, tokens = cmd
                got = gather_tokens(setup.ranks, blocks, range(tokens))
                ok = same_bytes(got, random_kv(spec, tokens, _FILL_SEED))
                conn.send(("ok", ok and untouched_blocks_zero(setup.ranks, blocks)))
            elif cmd[0] == "zero":
                for rank in setup.ranks:
                    rank.own_cache().slab[...] = 0
                conn.send(("ok", None))
    finally:
        consumer.close()
        setup.close()


def _await_consumer(consumer: _StampedConsumer, tid: str) -> tuple[str, Any]:
    deadline = time.monotonic() + POLL_LIMIT_S
    while time.monotonic() < deadline:
        for ev in consumer.poll():
            if ev.transfer_id == tid:
                if ev.kind is ConsumerEventKind.READY:
                    return ("ok", consumer.ended_at.pop(tid))
                return ("err", f"{tid}: D got {ev.kind.value} ({ev.reason})")
        time.sleep(0.0005)
    return ("err", f"{tid}: D saw no event within {POLL_LIMIT_S} s")


class ConnectorPush:
    """Producer (this process) pushing into a Consumer (a child process) over NIXL and the side channel."""

    def __init__(self, req: Request, *, digest: bool = False) -> None:
        self.req = req
        self.setup = build_engine("bench-P", req.spec, num_blocks=req.cache_blocks, backend="nixl")
        self.producer = _StampedProducer(self.setup.engine, self.setup.ranks, ConnectorConfig())
        self.producer.push_reg_at = {}
        port = self.producer.start()
        self.remote = RemoteEngine(self.setup.engine.engine_id, "127.0.0.1", port)
        self._proc, self._conn = spawn_child(_consumer_child, req.spec, req.cache_blocks, digest)
        self._ask(None)
        self._ids = itertools.count()

    def _ask(self, cmd: tuple[Any, ...] | None) -> Any:
        if cmd is not None:
            self._conn.send(cmd)
        if not self._conn.poll(POLL_LIMIT_S * 2):
            raise TransferFailed(f"the consumer process did not answer {cmd and cmd[0]}")
        status, value = self._conn.recv()
        if status == "err":
            raise TransferFailed(str(value))
        return value

    def prepare(self, blocks: Blocks) -> None:
        """P's blocks hold a known KV; D's cache is zeroed."""
        kv = random_kv(self.req.spec, self.req.num_tokens, _FILL_SEED)
        scatter_tokens(self.setup.ranks, blocks[0], kv)
        self._ask(("zero",))

    def push(self, blocks: Blocks) -> float:
        """One request; seconds from P taking the push_reg to D's READY."""
        tid = f"bench-{next(self._ids)}"
        self.producer.request_finished(tid, blocks[0], self.req.num_tokens)
        ready_at = self._ask(("push", tid, blocks[1], self.req.num_tokens, self.remote))
        deadline = time.monotonic() + POLL_LIMIT_S
        while time.monotonic() < deadline:  # P's one event: the blocks are free again
            if any(e.transfer_id == tid for e in self.producer.poll()):
                break
            time.sleep(0.0005)
        return float(ready_at - self.producer.push_reg_at.pop(tid))

    def check(self, blocks: Blocks) -> None:
        if not self._ask(("check", blocks[1], self.req.num_tokens)):
            raise TransferFailed("D's Consumer found wrong bytes after the connector's push")

    def close(self) -> None:
        try:
            stop_child(self._proc, self._conn, ("stop",))
        finally:
            self.producer.close()
            self.setup.close()

"""``kvwire bench handshake``: notif-only vs full handshakes over real NIXL, and a dead peer among many.

Per cache shape, P's side-channel server runs in a child process
(``kvwire.testing.side_channel_peer``) with one NIXL agent and a registered cache; this process is D.
Measured in one run, each a median of ``--reps``:

* ``notif_only_ms``: kvwire's notif-only handshake (connect, request + clock samples, load the agent from
  connection-only metadata), from a cold cache entry;
* ``full_ms``: kvwire's full handshake (full metadata, load the agent, validate the layout: O(regions));
* ``nixl_add_agent_ms``: bare NIXL ``add_remote_agent`` of the metadata notif-only loads (a separate agent);
* ``prep_all_blocks_ms``: what vLLM's full path adds: ``prep_xfer_dlist`` of one descriptor per
  (region, block) of P's cache, from a prebuilt Nx3 array (the list build is reported apart).

Then ``many_peers``: D handshakes (notif-only) ``--peers`` P engines at once, each an in-process server with
its own NIXL agent, one of them dead (a listener that accepts and never answers): the time until every
healthy handshake is done, against the same healthy peers with no dead one.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvwire.handshake.client import fetch_metadata
from kvwire.handshake.manager import HandshakeManager
from kvwire.handshake.server import SideChannelServer, engine_compat_hash
from kvwire.handshake.types import EngineInfo, LocalRank, PeerAddress
from kvwire.kv.spec import KVSpec
from kvwire.testing.handshake_env import SilentListener, build_registered_engine
from kvwire.testing.side_channel_peer import SideChannelPeer
from kvwire.transport.base import Agent, PeerMode, make_agent_name, new_incarnation
from kvwire_tools.bench.common import bar_plot, envelope, print_table, write_json

HOST = "127.0.0.1"


@dataclass(frozen=True, slots=True)
class Shape:
    """A cache shape; ``kv_heads=1, head_dim=8, block_size=1`` in float16 gives 16-byte blocks."""

    name: str
    layers: int
    kv_heads: int
    head_dim: int
    block_size: int
    blocks: int

    @property
    def spec(self) -> KVSpec:
        return KVSpec(self.layers, self.kv_heads, self.head_dim, block_size=self.block_size)

    @property
    def regions(self) -> int:
        return self.layers * 2

    def peer_args(self) -> list[str]:
        return [
            "--engine-id", "P", "--layers", str(self.layers), "--kv-heads", str(self.kv_heads),
            "--head-dim", str(self.head_dim), "--block-size", str(self.block_size),
            "--blocks", str(self.blocks),
        ]  # fmt: skip


SMALL = Shape("small", layers=4, kv_heads=2, head_dim=16, block_size=4, blocks=512)
LLAMA = Shape("llama3-8b", layers=32, kv_heads=1, head_dim=8, block_size=1, blocks=29_000)
QUICK_LARGE = Shape("large-quick", layers=32, kv_heads=1, head_dim=8, block_size=1, blocks=2_000)


def _nixl_agent(name: str) -> Agent:
    from kvwire.transport.nixl import NixlAgent

    return NixlAgent(name)


async def _median_ms(fn: Callable[[], Awaitable[float]], reps: int) -> float:
    await fn()  # warm-up
    return statistics.median([await fn() for _ in range(max(1, reps))]) * 1e3


def _median_sync_ms(fn: Callable[[], float], reps: int) -> float:
    fn()
    return statistics.median([fn() for _ in range(max(1, reps))]) * 1e3


# -- one cache shape ------------------------------------------------------------------------------------


async def _kvwire_timings(mgr: HandshakeManager, port: int, reps: int) -> dict[str, float]:
    async def cold(mode: PeerMode) -> float:
        mgr.forget("P")
        t0 = time.perf_counter()
        await mgr.ensure(HOST, port, 0, 0, mode)
        return time.perf_counter() - t0

    async def upgrade() -> float:
        mgr.forget("P")
        await mgr.ensure(HOST, port, 0, 0, PeerMode.NOTIF_ONLY)
        t0 = time.perf_counter()
        await mgr.ensure(HOST, port, 0, 0, PeerMode.FULL)
        return time.perf_counter() - t0

    notif = await _median_ms(lambda: cold(PeerMode.NOTIF_ONLY), reps)
    full = await _median_ms(lambda: cold(PeerMode.FULL), reps)
    up = await _median_ms(upgrade, reps)
    mgr.forget("P")
    return {"notif_only_ms": notif, "full_ms": full, "upgrade_ms": up}


def _bare_nixl_timings(
    raw: Any, conn_md: bytes, full_md: bytes, regions: list[Any], reps: int, prep_reps: int
) -> dict[str, float]:
    """Raw NIXL calls on an agent kvwire does not manage: add_remote_agent, and a per-block prep."""
    from kvwire.transport.nixl import unwrap_metadata

    def add(md: bytes) -> Callable[[], float]:
        def once() -> float:
            t0 = time.perf_counter()
            name = raw.add_remote_agent(unwrap_metadata(md)[0])
            elapsed = time.perf_counter() - t0
            raw.remove_remote_agent(name)
            return elapsed

        return once

    add_conn = _median_sync_ms(add(conn_md), reps)
    add_full = _median_sync_ms(add(full_md), reps)
    name = raw.add_remote_agent(unwrap_metadata(full_md)[0])
    array = _per_block_descs(regions)

    def prep_vllm() -> float:
        # vLLM's full path: a Python list of (addr, len, device) per (region, block), then prep_xfer_dlist.
        t0 = time.perf_counter()
        blocks = [
            (r.base_addr + b * r.block_len, r.block_len, r.device_id)
            for r in regions
            for b in range(r.num_blocks)
        ]
        handle = raw.prep_xfer_dlist(name, raw.get_xfer_descs(blocks, "DRAM"))
        elapsed = time.perf_counter() - t0
        raw.release_dlist_handle(handle)
        return elapsed

    def prep_array() -> float:
        # The cheapest per-block preparation NIXL allows: a prebuilt Nx3 array.
        t0 = time.perf_counter()
        handle = raw.prep_xfer_dlist(name, array, "DRAM")
        elapsed = time.perf_counter() - t0
        raw.release_dlist_handle(handle)
        return elapsed

    prep_ms = _median_sync_ms(prep_vllm, prep_reps)
    array_ms = _median_sync_ms(prep_array, prep_reps)
    raw.remove_remote_agent(name)
    return {
        "nixl_add_agent_ms": add_conn,
        "nixl_add_full_ms": add_full,
        "prep_all_blocks_ms": prep_ms,
        "prep_array_ms": array_ms,
        "descriptors": len(array),
    }


def _per_block_descs(regions: list[Any]) -> np.ndarray:
    """One (addr, len, device) row per (region, block), as vLLM's full path prepares them."""
    parts = []
    for r in regions:
        addrs = r.base_addr + np.arange(r.num_blocks, dtype=np.uint64) * np.uint64(r.block_len)
        part = np.empty((r.num_blocks, 3), dtype=np.uint64)
        part[:, 0], part[:, 1], part[:, 2] = addrs, r.block_len, r.device_id
        parts.append(part)
    return np.concatenate(parts)


async def measure_shape(shape: Shape, reps: int, prep_reps: int) -> dict[str, Any]:
    spec = shape.spec
    incarnation = new_incarnation()
    with SideChannelPeer(*shape.peer_args()) as p:
        d_info, d_ranks = build_registered_engine("D", spec, 16, _nixl_agent, incarnation=incarnation)
        base = _nixl_agent(make_agent_name("bench-bare", incarnation, 0, 0))
        mgr = HandshakeManager(d_info, d_ranks[0])
        try:
            kvw = await _kvwire_timings(mgr, p.port, reps)
            addr = PeerAddress(HOST, p.port, 0, 0)
            compat = engine_compat_hash(d_info)
            conn = await fetch_metadata(addr, notif_only=True, compat_hash=compat, timeout_s=10)
            full = await fetch_metadata(addr, notif_only=False, compat_hash=compat, timeout_s=10)
            bare = _bare_nixl_timings(
                base.raw_agent,  # type: ignore[attr-defined]
                conn.metadata.agent_metadata,
                full.metadata.agent_metadata,
                list(full.metadata.regions),
                reps,
                prep_reps,
            )
        finally:
            await mgr.close()
            base.close()
            d_ranks[0].agent.close()
    return {"case": shape.name, "regions": shape.regions, "blocks": shape.blocks, **kvw, **bare}


# -- many peers, one dead -------------------------------------------------------------------------------


async def _healthy_done_ms(mgr: HandshakeManager, ports: list[int], dead_port: int | None) -> float:
    """Time until every handshake with ``ports`` is done; a dead peer's handshake runs meanwhile."""
    for eid in {p.engine_id for p in mgr.peers()}:
        mgr.forget(eid)
    t0 = time.perf_counter()
    dead = (
        asyncio.create_task(mgr.ensure(HOST, dead_port, 0, 0, PeerMode.NOTIF_ONLY))
        if dead_port is not None
        else None
    )
    await asyncio.gather(*(mgr.ensure(HOST, port, 0, 0, PeerMode.NOTIF_ONLY) for port in ports))
    elapsed = time.perf_counter() - t0
    if dead is not None:
        assert not dead.done(), "the dead peer answered"
        dead.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await dead
    return elapsed


async def measure_many_peers(peers: int, reps: int) -> dict[str, Any]:
    spec = SMALL.spec
    healthy = peers - 1
    engines: list[tuple[EngineInfo, list[LocalRank]]] = [
        build_registered_engine(f"P{i}", spec, 64, _nixl_agent) for i in range(healthy)
    ]
    servers = [SideChannelServer(info, ranks) for info, ranks in engines]
    d_info, d_ranks = build_registered_engine("D", spec, 16, _nixl_agent)
    mgr = HandshakeManager(d_info, d_ranks[0])
    silent = SilentListener()
    try:
        ports = [await s.start() for s in servers]
        dead_port = await silent.start()
        with_dead, without = [], []
        await _healthy_done_ms(mgr, ports, None)  # warm-up: first connections of every agent
        for _ in range(max(1, reps)):  # interleaved, so drift hits both alike
            with_dead.append(await _healthy_done_ms(mgr, ports, dead_port))
            without.append(await _healthy_done_ms(mgr, ports, None))
    finally:
        await mgr.close()
        await silent.close()
        for s in servers:
            await s.close()
        for _, ranks in engines:
            for r in ranks:
                r.agent.close()
        d_ranks[0].agent.close()
    return {
        "peers": peers,
        "dead": 1,
        "healthy_ms": statistics.median(with_dead) * 1e3,
        "no_dead_ms": statistics.median(without) * 1e3,
        "dead_kind": "accepts, never answers",
    }


# -- command ----------------------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--reps", type=int, default=9, help="timed runs per figure (median reported)")
    parser.add_argument("--prep-reps", type=int, default=3, help="timed per-block preparations")
    parser.add_argument("--peers", type=int, default=16, help="peers in the many-peers case (one is dead)")
    parser.add_argument("--quick", action="store_true", help="small shapes and few peers, for smoke tests")
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON")
    parser.add_argument("--plot", metavar="PATH", help="write a PNG bar plot")


async def _run_all(args: argparse.Namespace) -> dict[str, Any]:
    shapes = (SMALL, QUICK_LARGE) if args.quick else (SMALL, LLAMA)
    reps = min(args.reps, 3) if args.quick else args.reps
    prep_reps = 1 if args.quick else args.prep_reps
    peers = min(args.peers, 4) if args.quick else args.peers
    cases = [await measure_shape(s, reps, prep_reps) for s in shapes]
    many = await measure_many_peers(peers, reps)
    doc = envelope("handshake", cases)
    doc["many_peers"] = many
    return doc


def run(args: argparse.Namespace) -> int:
    os.environ.setdefault("UCX_MODULES", "^ib*")
    if args.peers < 2:
        raise SystemExit("--peers must be at least 2 (one of them is dead)")
    doc = asyncio.run(_run_all(args))
    cases, many = doc["cases"], doc["many_peers"]
    columns = ("case", "regions", "blocks", "notif-only ms", "full ms", "upgrade ms", "NIXL add ms",
               "NIXL add full ms", "per-block prep ms", "prep from array ms", "descriptors")  # fmt: skip
    rows = [
        (c["case"], c["regions"], c["blocks"], c["notif_only_ms"], c["full_ms"], c["upgrade_ms"],
         c["nixl_add_agent_ms"], c["nixl_add_full_ms"], c["prep_all_blocks_ms"], c["prep_array_ms"],
         c["descriptors"])
        for c in cases
    ]  # fmt: skip
    print_table(
        f"handshake: kvwire vs bare NIXL (D here, P in a child process), median of {args.reps}", columns, rows
    )
    print_table(
        f"{many['peers']} peers, {many['dead']} dead ({many['dead_kind']})",
        ("healthy peers", "with the dead one ms", "without it ms", "ratio"),
        [
            (
                many["peers"] - many["dead"],
                many["healthy_ms"],
                many["no_dead_ms"],
                many["healthy_ms"] / many["no_dead_ms"],
            )
        ],
    )
    if args.json:
        write_json(args.json, doc)
    if args.plot:
        series = {
            "kvwire notif-only": [c["notif_only_ms"] for c in cases],
            "kvwire full": [c["full_ms"] for c in cases],
            "NIXL add_remote_agent": [c["nixl_add_agent_ms"] for c in cases],
            "per-block prep (vLLM full)": [c["prep_all_blocks_ms"] for c in cases],
        }
        labels = [f"{c['case']}\n{c['regions']}x{c['blocks']}" for c in cases]
        bar_plot(args.plot, "handshake cost", labels, series, "ms")
    return 0

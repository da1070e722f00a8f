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

``PUSHES`` maps a column name to a callable doing one request; the connector's ``Producer`` path can be
added there as one more column (its callable: hand it the block ids and wait for the ``done``).
D verifies every byte of each case after it is timed. Ratios are throughput ratios (``x_ms / kvwire_ms``).
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from kvwire.bench.common import gbps
from kvwire.bench.kvrequest import (
    Assignment,
    Endpoints,
    Request,
    block_assignment,
    endpoints,
    post_lanes,
    wait_all,
)
from kvwire.bench.peer import PeerProcess
from kvwire.errors import TransferFailed
from kvwire.transport import XferOp, make_agent_name, new_incarnation
from kvwire.transport.nixl import NixlAgent

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
        state = self.raw.transfer(self.handle)
        deadline = time.monotonic() + POLL_LIMIT_S
        while state == "PROC" and time.monotonic() < deadline:
            state = self.raw.check_xfer_state(self.handle)
        if state != "DONE":
            raise TransferFailed(f"raw NIXL WRITE ended {state}")

    def close(self) -> None:
        self.raw.release_xfer_handle(self.handle)


def _round_robin(fns: dict[str, Callable[[], None]], reps: int) -> dict[str, float]:
    """Median seconds per function, runs interleaved across functions."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(max(1, reps)):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def _case(
    name: str, assignment: Assignment, agent: NixlAgent, ep: Endpoints, peer: PeerProcess, reps: int
) -> dict[str, Any]:
    blocks = block_assignment(assignment, ep.req.blocks)
    plan = ep.plan(*blocks)
    nbytes = plan.nbytes
    src = ep.cache.slab.reshape(-1).view(np.uint8)[:nbytes]
    dst = np.zeros(nbytes, dtype=np.uint8)  # pages touched by the warm-up run, not in the timed ones
    peer.call(("zero",))
    raw = _RawRepost(agent, ep, blocks, peer.name)
    try:
        fns: dict[str, Callable[[], None]] = {"nixl": raw, "memcpy": lambda: np.copyto(dst, src)}
        for col, push in PUSHES.items():
            fns[col] = functools.partial(push, agent, ep, blocks, peer.name)
        med = _round_robin(fns, reps)
    finally:
        raw.close()
    ep.verify(peer, *blocks)
    out: dict[str, Any] = {
        "case": f"llama3-8b-1k-{name}" if ep.req.num_tokens == 1024 else f"kv-{ep.req.num_tokens}t-{name}",
        "bytes": nbytes,
        "descriptors": plan.num_descs,
        "reps": reps,
    }
    for col, seconds in med.items():
        out[f"{col}_ms"] = seconds * 1e3
        out[f"{col}_gbps"] = gbps(nbytes, seconds)
    out["ratio_vs_nixl"] = med["nixl"] / med["kvwire"]
    out["ratio_vs_memcpy"] = med["memcpy"] / med["kvwire"]
    out["lanes2_vs_1"] = med["kvwire"] / med["kvwire_lanes2"]
    return out


def run_kv_cases(req: Request, reps: int) -> list[dict[str, Any]]:
    results: list[dict[str, Any]] = []
    with PeerProcess(make_agent_name("bench-kv-d", new_incarnation(), 0, 0), req.cache_bytes) as peer:
        ep = endpoints(req, peer)
        agent = NixlAgent(make_agent_name("bench-kv-p", new_incarnation(), 0, 0))
        try:
            agent.register(ep.cache.slab)
            agent.add_peer(peer.metadata)
            for name, assignment in CASES:
                results.append(_case(name, assignment, agent, ep, peer, reps))
        finally:
            agent.close()
    return results

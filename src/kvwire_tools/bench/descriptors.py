"""``kvwire bench descriptors``: what descriptor count costs per request, from planning to DONE.

One 1k-token Llama-3-8B-shaped request (``kvwire_tools.bench.kvrequest``: 64 regions, 64 blocks of 32 KiB
each, 128 MiB) is moved from this process (P) into a peer process (D) over real NIXL, with the blocks
assigned contiguously, half-fragmented and fully scattered on both sides. Per assignment, medians of
``--reps`` runs after a warm-up:

* ``plan_us``: ``plan_transfer`` (run coalescing, the ``[n, 3]`` arrays) run back to back, and
  ``plan_in_flow_us`` the same inside the request flow below, right after the previous request's bytes
  went through the CPU caches (slower: what a request really pays);
* ``desc_lists_us``: turning those arrays into ``Desc`` lists (the cost ``post_array`` avoids);
* ``init_us``: NIXL ``get_xfer_descs`` on both arrays plus ``initialize_xfer``;
* ``setup_us`` = plan in flow + init: the per-request CPU cost before any byte moves (goal: fragmented
  <= 2x contiguous, ``setup_vs_contiguous``);
* ``transfer_call_ms``: NIXL's ``transfer()`` call (with UCX's ``cma`` on one host it copies the bytes
  before returning, so this is mostly data movement), ``complete_ms``: from before planning to DONE;
* ``push_ms`` / ``push_list_ms``: ``plan_transfer`` + ``Agent.post_array`` / ``Agent.post`` (``Desc``
  lists) + waiting DONE through kvwire's agent.

D verifies every byte of each assignment after its runs.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from kvwire.errors import TransferFailed
from kvwire.testing.buffer_peer import BufferPeer
from kvwire.transport import XferOp, make_agent_name, new_incarnation
from kvwire.transport.nixl import NixlAgent
from kvwire_tools.bench.common import bar_plot, envelope, print_table, write_json
from kvwire_tools.bench.kvrequest import (
    Assignment,
    Endpoints,
    Request,
    block_assignment,
    endpoints,
    request_for,
    wait_all,
)

POLL_LIMIT_S = 30.0


def _median_us(samples: list[float]) -> float:
    return statistics.median(samples) * 1e6


def _timed(fn: Callable[[], None], reps: int) -> list[float]:
    fn()
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def _raw_phases(
    agent: NixlAgent, ep: Endpoints, blocks: tuple[list[int], list[int]], peer: str
) -> list[float]:
    """One request through raw NIXL calls: [plan, init, transfer call, completion] in seconds."""
    raw = agent.raw_agent
    t0 = time.perf_counter()
    plan = ep.plan(*blocks)
    t1 = time.perf_counter()
    local = raw.get_xfer_descs(plan.src_array.view(np.uint64), "DRAM")
    remote = raw.get_xfer_descs(plan.dst_array.view(np.uint64), "DRAM")
    handle = raw.initialize_xfer(XferOp.WRITE.value, local, remote, peer, b"")
    t2 = time.perf_counter()
    try:
        state = raw.transfer(handle)
        t3 = time.perf_counter()
        deadline = time.monotonic() + POLL_LIMIT_S
        while state == "PROC" and time.monotonic() < deadline:
            state = raw.check_xfer_state(handle)
        t4 = time.perf_counter()
    finally:
        raw.release_xfer_handle(handle)
    if state != "DONE":
        raise TransferFailed(f"raw NIXL WRITE ended {state}")
    return [t1 - t0, t2 - t1, t3 - t2, t4 - t0]


def measure(
    agent: NixlAgent, ep: Endpoints, peer: BufferPeer, assignment: Assignment, reps: int
) -> dict[str, Any]:
    blocks = block_assignment(assignment, ep.req.blocks)
    peer.call(("zero",))
    plan = ep.plan(*blocks)

    def plan_only() -> None:
        ep.plan(*blocks)

    plan_s = _timed(plan_only, max(reps, 20))

    def lists() -> None:
        fresh = ep.plan(*blocks)
        t0 = time.perf_counter()
        _ = fresh.src_descs, fresh.dst_descs
        lists_s.append(time.perf_counter() - t0)

    lists_s: list[float] = []
    _timed(lists, reps)
    _raw_phases(agent, ep, blocks, peer.name)  # warm-up
    phases = np.array([_raw_phases(agent, ep, blocks, peer.name) for _ in range(reps)])

    def push() -> None:
        p = ep.plan(*blocks)
        wait_all(agent, [agent.post_array(XferOp.WRITE, p.src_array, p.dst_array, peer.name)])

    def push_list() -> None:
        p = ep.plan(*blocks)
        wait_all(agent, [agent.post(XferOp.WRITE, p.src_descs, p.dst_descs, peer.name)])

    push_s, push_list_s = _timed(push, reps), _timed(push_list, reps)
    ep.verify(peer, *blocks)
    med = np.median(phases, axis=0)
    return {
        "case": assignment.value,
        "descriptors": plan.num_descs,
        "runs": plan.num_runs,
        "regions": plan.num_regions,
        "bytes": plan.nbytes,
        "plan_us": _median_us(plan_s),
        "plan_in_flow_us": float(med[0]) * 1e6,
        "desc_lists_us": _median_us(lists_s),
        "init_us": float(med[1]) * 1e6,
        "setup_us": float(med[0] + med[1]) * 1e6,
        "transfer_call_ms": float(med[2]) * 1e3,
        "complete_ms": float(med[3]) * 1e3,
        "push_ms": statistics.median(push_s) * 1e3,
        "push_list_ms": statistics.median(push_list_s) * 1e3,
        "reps": reps,
    }


def run_cases(req: Request, reps: int) -> list[dict[str, Any]]:
    results: list[dict[str, Any]] = []
    with BufferPeer(make_agent_name("bench-d", new_incarnation(), 0, 0), req.cache_bytes) as peer:
        ep = endpoints(req, peer)
        agent = NixlAgent(make_agent_name("bench-p", new_incarnation(), 0, 0))
        try:
            agent.register(ep.cache.slab)
            agent.add_peer(peer.metadata)
            for assignment in Assignment:
                results.append(measure(agent, ep, peer, assignment, reps))
        finally:
            agent.close()
    base = results[0]["setup_us"]
    for r in results:
        r["setup_vs_contiguous"] = r["setup_us"] / base
    return results


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--reps", type=int, default=9, help="timed runs per assignment (median reported)")
    parser.add_argument("--quick", action="store_true", help="a 4-layer 256-token request, 3 runs (smoke)")
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON")
    parser.add_argument("--plot", metavar="PATH", help="write a PNG bar plot")


def run(args: argparse.Namespace) -> int:
    req = request_for(args.quick)
    reps = min(args.reps, 3) if args.quick else args.reps
    results = run_cases(req, reps)
    keys = (
        "case", "descriptors", "plan_us", "plan_in_flow_us", "desc_lists_us", "init_us", "setup_us",
        "setup_vs_contiguous", "transfer_call_ms", "complete_ms", "push_ms", "push_list_ms",
    )  # fmt: skip
    columns = (
        "assignment", "descs", "plan us", "plan flow us", "lists us", "init us", "setup us",
        "x contig", "xfer() ms", "complete ms", "push ms", "push list ms",
    )  # fmt: skip
    rows = [tuple(r[k] for k in keys) for r in results]
    title = f"descriptors: {req.spec.num_layers}-layer {req.num_tokens}-token request, median of {reps}"
    print_table(title, columns, rows)
    if args.json:
        doc = envelope("descriptors", results)
        doc["request"] = {"layers": req.spec.num_layers, "tokens": req.num_tokens, "bytes": req.nbytes}
        write_json(args.json, doc)
    if args.plot:
        series = {
            "setup (plan + init), us": [r["setup_us"] for r in results],
            "Desc lists, us": [r["desc_lists_us"] for r in results],
        }
        bar_plot(args.plot, title, [f"{r['case']}\n{r['descriptors']} descs" for r in results], series, "us")
    return 0

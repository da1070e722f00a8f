"""``kvwire bench transfer``: raw NIXL WRITE between two processes against an in-process ``np.copyto``,
and kvwire's push of a Llama-3-8B-shaped request against both (``kvwire_tools.bench.transfer_kv``).

P (this process) writes into D (a ``kvwire.testing.buffer_peer`` child) over real NIXL. The NIXL figure times
``transfer()`` plus polling until DONE on a transfer prepared once and reposted (raw NIXL, no kvwire
bookkeeping); the memcpy figure copies the same bytes (the same scatter for the scattered case) inside
one process. Each figure is the median of ``--reps`` runs after one warm-up. D verifies every byte of
each case after it is timed.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvwire.errors import TransferFailed
from kvwire.testing.buffer_peer import BufferPeer, pattern
from kvwire.transport import Desc, XferOp, make_agent_name, new_incarnation
from kvwire_tools.bench.cases import Case, Layout, buffer_bytes, layout, repost_raw
from kvwire_tools.bench.common import bar_plot, envelope, gbps, median_seconds, print_table, write_json
from kvwire_tools.bench.kvrequest import request_for
from kvwire_tools.bench.transfer_kv import run_kv_cases

SEED = 3
POLL_LIMIT_S = 30.0


FULL_CASES = (
    Case("1MiB", 1, 1 << 20, False),
    Case("16MiB", 1, 16 << 20, False),
    Case("256MiB", 1, 256 << 20, False),
    Case("4096x16KiB-scattered", 4096, 16 << 10, True),
)
# For smoke tests: the same shapes, small.
SMALL_CASES = (
    Case("64KiB", 1, 64 << 10, False),
    Case("1MiB", 1, 1 << 20, False),
    Case("256x4KiB-scattered", 256, 4 << 10, True),
)


class RawNixlWriter:
    """Raw NIXL WRITEs from P into a peer process: one prepared transfer per case, reposted each run."""

    def __init__(self, peer: BufferPeer, src: np.ndarray) -> None:
        from kvwire.transport.nixl import NixlAgent

        self.peer = peer
        self.src = src
        self.agent = NixlAgent(make_agent_name("bench-p", new_incarnation(), 0, 0))
        self.agent.register(src)
        self.agent.add_peer(peer.metadata)

    def time_case(self, case: Case, lay: Layout, dst_bytes: int, reps: int) -> float:
        a = self.agent
        n_src, n_dst = self.src.nbytes // case.block, dst_bytes // case.block
        local = a.prep_local([Desc(self.src.ctypes.data + i * case.block, case.block) for i in range(n_src)])
        remote = a.prep_remote(
            self.peer.name, [Desc(self.peer.addr + i * case.block, case.block) for i in range(n_dst)]
        )
        raw = a.raw_agent
        xfer = raw.make_prepped_xfer(
            XferOp.WRITE.value,
            local.raw,
            lay.src_idx.astype(np.int32),
            remote.raw,
            lay.dst_idx.astype(np.int32),
            b"",
        )

        try:
            what = f"{case.name}: NIXL WRITE"
            return median_seconds(lambda: repost_raw(raw, xfer, what, POLL_LIMIT_S), reps)
        finally:
            raw.release_xfer_handle(xfer)
            a.release_dlist(local)
            a.release_dlist(remote)

    def close(self) -> None:
        self.agent.close()


def time_memcpy(case: Case, lay: Layout, src: np.ndarray, dst: np.ndarray, reps: int) -> float:
    if not case.scattered:
        return median_seconds(lambda: np.copyto(dst[: case.nbytes], src[: case.nbytes]), reps)
    src_blocks = src.reshape(-1, case.block)[: case.blocks]
    dst_blocks = dst.reshape(-1, case.block)

    def scatter() -> None:
        dst_blocks[lay.dst_idx] = src_blocks[lay.src_idx]

    return median_seconds(scatter, reps)


def run_cases(cases: Sequence[Case], reps: int) -> list[dict[str, Any]]:
    size = buffer_bytes(cases)
    src = pattern(size, SEED)
    local_dst = np.zeros(size, dtype=np.uint8)
    rng = np.random.default_rng(SEED)
    results = []
    with BufferPeer(make_agent_name("bench-d", new_incarnation(), 0, 0), size) as peer:
        writer = RawNixlWriter(peer, src)
        try:
            for case in cases:
                lay = layout(case, size, rng)
                peer.call(("zero",))
                nixl_s = writer.time_case(case, lay, size, reps)
                check = peer.verify(case.block, SEED, size, lay.src_idx.tolist(), lay.dst_idx.tolist())
                if check["bad_blocks"] or check["dirty_untouched_blocks"]:
                    raise TransferFailed(f"{case.name}: D found wrong bytes: {check}")
                memcpy_s = time_memcpy(case, lay, src, local_dst, reps)
                results.append(
                    {
                        "case": case.name,
                        "bytes": case.nbytes,
                        "nixl_gbps": gbps(case.nbytes, nixl_s),
                        "memcpy_gbps": gbps(case.nbytes, memcpy_s),
                        "nixl_ms": nixl_s * 1e3,
                        "memcpy_ms": memcpy_s * 1e3,
                        "reps": reps,
                    }
                )
        finally:
            writer.close()
    return results


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--reps", type=int, default=7, help="timed runs per case (median reported)")
    parser.add_argument("--small", action="store_true", help="tiny sizes, for smoke tests")
    parser.add_argument("--no-kv", action="store_true", help="skip the Llama-3-8B kvwire push cases")
    parser.add_argument(
        "--no-connector", action="store_true", help="skip the Producer/Consumer column of the push cases"
    )
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON")
    parser.add_argument("--plot", metavar="PATH", help="write a PNG bar plot")


def run(args: argparse.Namespace) -> int:
    cases = SMALL_CASES if args.small else FULL_CASES
    results = run_cases(cases, args.reps)
    kv_results = (
        []
        if args.no_kv
        else run_kv_cases(request_for(args.small), args.reps, connector=not args.no_connector)
    )
    rows = [
        (r["case"], r["bytes"], r["nixl_ms"], r["nixl_gbps"], r["memcpy_ms"], r["memcpy_gbps"])
        for r in results
    ]
    columns = ("case", "bytes", "NIXL ms", "NIXL GB/s", "memcpy ms", "memcpy GB/s")
    print_table(f"transfer: raw NIXL WRITE (2 processes) vs np.copyto, median of {args.reps}", columns, rows)
    if kv_results:
        print_kv_table(kv_results, args.reps)
    everything = results + kv_results
    if args.json:
        write_json(args.json, envelope("transfer", everything))
    if args.plot:
        series = {
            "NIXL WRITE": [r["nixl_gbps"] for r in everything],
            "np.copyto": [r["memcpy_gbps"] for r in everything],
            "kvwire data path": [r.get("kvwire_gbps", float("nan")) for r in everything],
            "Producer->Consumer": [r.get("connector_gbps", float("nan")) for r in everything],
        }
        bar_plot(args.plot, "transfer throughput", [r["case"] for r in everything], series, "GB/s")
    return 0


def print_kv_table(results: Sequence[dict[str, Any]], reps: int) -> None:
    keys = (
        "case", "descriptors", "nixl_gbps", "memcpy_gbps", "kvwire_gbps", "kvwire_lanes2_gbps",
        "connector_gbps", "connector_ms", "ratio_vs_nixl", "ratio_vs_memcpy", "datapath_ratio_vs_nixl",
    )  # fmt: skip
    columns = (
        "case", "descs", "NIXL GB/s", "memcpy GB/s", "path GB/s", "2 lanes GB/s", "P->C GB/s", "P->C ms",
        "x NIXL", "x memcpy", "path x NIXL",
    )  # fmt: skip
    rows = [tuple(r.get(k, "-") for k in keys) for r in results]
    title = (
        "transfer: kvwire push (path: plan + post_array + DONE; P->C: Producer push_reg to Consumer READY), "
        f"median of {reps}"
    )
    print_table(title, columns, rows)
    print_digest_table(results, reps)


def print_digest_table(results: Sequence[dict[str, Any]], reps: int) -> None:
    keys = ("case", "bytes", "digest_gbps", "connector_ms", "connector_digest_ms",
            "digest_ratio_vs_connector", "digest_added_ms_per_gib")  # fmt: skip
    columns = ("case", "bytes", "digest GB/s (one side)", "P->C ms", "P->C ms, digest checked",
               "x no digest", "added ms/GiB")  # fmt: skip
    rows = [tuple(r.get(k, "-") for k in keys) for r in results if "connector_digest_ms" in r]
    if rows:
        print_table(f"transfer: the digest check (kv_digest_sample=1), median of {reps}", columns, rows)

"""``kvwire transport-demo``: two processes, one NIXL WRITE with a notification, every byte verified.

P (this process) writes ``--blocks`` blocks of ``--block-size`` bytes into scattered blocks of D's
buffer (a spawned ``kvwire.testing.buffer_peer`` process) with a notification attached; D waits for the
notification, then checks every written byte against the pattern and that nothing else was touched.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from kvwire.errors import KvwireError
from kvwire.testing.buffer_peer import BufferPeer, pattern
from kvwire.transport import Desc, XferOp, XferStatus, make_agent_name, new_incarnation

SEED = 7
WAIT_S = 30.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--blocks", type=int, default=4096, help="blocks written (default 4096)")
    parser.add_argument("--block-size", type=int, default=16 << 10, help="bytes per block (default 16 KiB)")


def _write_and_verify(blocks: int, block: int) -> tuple[dict[str, int], float, float]:
    from kvwire.transport.nixl import NixlAgent

    incarnation = new_incarnation()
    d_blocks = 2 * blocks
    with BufferPeer(make_agent_name("demo-d", incarnation, 0, 0), d_blocks * block) as d:
        p = NixlAgent(make_agent_name("demo-p", incarnation, 0, 0))
        try:
            src = pattern(blocks * block, SEED)
            p.register(src)
            p.add_peer(d.metadata)
            rng = np.random.default_rng(SEED)
            src_idx = rng.permutation(blocks)
            dst_idx = rng.choice(d_blocks, size=blocks, replace=False)
            local = p.prep_local([Desc(src.ctypes.data + i * block, block) for i in range(blocks)])
            remote = p.prep_remote(d.name, [Desc(d.addr + i * block, block) for i in range(d_blocks)])
            # Connect before timing: the first operation on a new connection pays the UCX wire-up.
            p.raw_agent.make_connection(d.name)
            t0 = time.perf_counter()
            handle = p.post_prepped(
                XferOp.WRITE, local, src_idx.tolist(), remote, dst_idx.tolist(), b"demo:1"
            )
            deadline = time.monotonic() + WAIT_S
            state = p.status(handle)
            while state is XferStatus.IN_PROGRESS and time.monotonic() < deadline:
                state = p.status(handle)
            elapsed = time.perf_counter() - t0
            if state is not XferStatus.DONE:
                raise KvwireError(f"WRITE ended {state.value}: {handle.failed_reason}")
            notifs = d.wait_notif(p.name, WAIT_S, pump=p.progress)
            notif_s = time.perf_counter() - t0
            if notifs != [b"demo:1"]:
                raise KvwireError(f"D received {notifs!r} instead of the attached notification")
            p.release(handle)
            result = d.verify(block, SEED, src.nbytes, src_idx.tolist(), dst_idx.tolist())
            return result, elapsed, notif_s
        finally:
            p.close()


def run(args: argparse.Namespace) -> int:
    blocks, block = int(args.blocks), int(args.block_size)
    nbytes = blocks * block
    try:
        result, elapsed, notif_s = _write_and_verify(blocks, block)
    except KvwireError as exc:
        print(f"transport-demo FAILED: {exc}")
        return 1
    ok = result["bad_blocks"] == 0 and result["dirty_untouched_blocks"] == 0
    print(
        f"transport-demo: P wrote {blocks} x {block} B = {nbytes / 2**20:.1f} MiB into scattered blocks of D"
    )
    print(
        f"  WRITE done in {elapsed * 1e3:.2f} ms ({nbytes / elapsed / 1e9:.2f} GB/s; cold: first WRITE to D)"
    )
    print(f"  notification at D after {notif_s * 1e3:.2f} ms")
    print(
        f"  D checked {result['checked_blocks']} blocks: {result['bad_blocks']} wrong, "
        f"{result['dirty_untouched_blocks']} untouched blocks dirty -> {'OK' if ok else 'MISMATCH'}"
    )
    return 0 if ok else 1

"""A side-channel server in its own process, for integration tests and benchmarks over real NIXL.

``python -m kvwire.testing.side_channel_peer --engine-id P ...`` builds an engine (one NIXL agent and a
registered KV cache filled with ``pattern_bytes(seed)`` per rank), serves its side channel, and prints:

* ``READY <port> <incarnation>`` once it listens;
* ``NOTIF <sender> <hex>`` for every notification its agents receive (the loop keeps progressing them).

It exits when its stdin closes, or after ``--lifetime-s``. ``SideChannelPeer`` drives it from a test or
a bench.
(``kvwire.testing.buffer_peer.BufferPeer`` is the other peer process: a bare NIXL buffer, no engine.)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

import numpy as np

from kvwire.handshake.server import SideChannelServer
from kvwire.kv.cache import KVCache
from kvwire.kv.spec import KVSpec
from kvwire.testing.handshake_env import build_registered_engine
from kvwire.transport.base import Agent

_POLL_S = 0.002


def fill_pattern(cache: KVCache, seed: int) -> None:
    """Deterministic bytes in the whole cache, so another process can check what it read."""
    raw = cache.slab.reshape(-1).view(np.uint8)
    raw[:] = np.random.default_rng(seed).integers(0, 256, raw.size, dtype=np.uint8)


def _spec(args: argparse.Namespace) -> KVSpec:
    return KVSpec(
        num_layers=args.layers, kv_heads=args.kv_heads, head_dim=args.head_dim, block_size=args.block_size
    )


async def _serve(args: argparse.Namespace) -> None:
    from kvwire.transport.nixl import NixlAgent

    agents: list[Agent] = []

    def make_agent(name: str) -> Agent:
        agents.append(NixlAgent(name))
        return agents[-1]

    info, ranks = build_registered_engine(
        args.engine_id, _spec(args), args.blocks, make_agent, tp_size=args.tp, pp_size=args.pp
    )
    for i, rank in enumerate(ranks):
        fill_pattern(rank.own_cache(), args.seed + i)
    secret = bytes.fromhex(args.secret) if args.secret else None
    server = SideChannelServer(info, ranks, port=args.port, secret=secret)
    port = await server.start()
    print(f"READY {port} {info.incarnation}", flush=True)
    loop = asyncio.get_running_loop()
    stdin_closed = loop.run_in_executor(None, sys.stdin.read)
    deadline = time.monotonic() + args.lifetime_s
    try:
        while not stdin_closed.done() and time.monotonic() < deadline:
            for agent in agents:
                for sender, msgs in agent.drain_notifs().items():
                    for msg in msgs:
                        print(f"NOTIF {sender} {msg.hex()}", flush=True)
            await asyncio.sleep(_POLL_S)
    finally:
        await server.close()
        for agent in agents:
            agent.close()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvwire.testing.side_channel_peer")
    parser.add_argument("--engine-id", default="P")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=16)
    parser.add_argument("--block-size", type=int, default=4)
    parser.add_argument("--blocks", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--secret", default="", help="shared secret, hex")
    parser.add_argument("--lifetime-s", type=float, default=300.0)
    args = parser.parse_args(argv)
    asyncio.run(_serve(args))
    return 0


class SideChannelPeer:
    """Runs this module (``main``) in a child process; always kills it on exit."""

    def __init__(self, *args: str, ready_s: float = 60.0) -> None:
        env = dict(os.environ)
        env.setdefault("UCX_MODULES", "^ib*")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvwire.testing.side_channel_peer", *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._reader = threading.Thread(target=self._pump, daemon=True)
        self._reader.start()
        self.port = 0
        self.incarnation = ""
        try:
            words = self.expect("READY", ready_s)
            self.port, self.incarnation = int(words[1]), words[2]
        except BaseException:
            self.close()
            raise

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def expect(self, tag: str, timeout_s: float) -> list[str]:
        """The next stdout line starting with ``tag``, split in words (TimeoutError if none comes)."""
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            try:
                line = self._lines.get(timeout=left)
            except queue.Empty:
                break
            if line is None:
                raise RuntimeError(f"peer process exited ({self.proc.poll()}) before printing {tag}")
            if line.startswith(tag):
                return line.split()
        raise TimeoutError(f"peer process printed no {tag} line within {timeout_s} s")

    def close(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(OSError):
                assert self.proc.stdin is not None
                self.proc.stdin.close()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self._reader.join(5)
        if self.proc.stdout is not None and not self._reader.is_alive():
            self.proc.stdout.close()

    def __enter__(self) -> SideChannelPeer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


if __name__ == "__main__":
    sys.exit(main())

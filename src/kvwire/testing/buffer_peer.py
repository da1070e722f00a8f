"""A bare NIXL buffer in another process, the target of two-process transfers (bench, tests, transport demo).

The child owns a NIXL agent and one registered, zeroed buffer; the parent drives it through a pipe with
small command tuples and reads replies. While idle the child keeps progressing its agent. Contents are
checked against ``pattern(nbytes, seed)``, which both sides can compute, so the child verifies every
byte itself instead of shipping the buffer back.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from kvwire.errors import KvwireError, TransportError
from kvwire.testing.child import spawn_child, stop_child

READY_TIMEOUT_S = 60.0


def pattern(nbytes: int, seed: int) -> np.ndarray:
    """Deterministic pseudo-random bytes, cheap to regenerate in another process."""
    return np.random.default_rng(seed).integers(0, 256, size=nbytes, dtype=np.uint8)


def _verify(
    buf: np.ndarray, block: int, seed: int, src_nbytes: int, src_idx: Any, dst_idx: Any
) -> dict[str, int]:
    blocks = buf.reshape(-1, block)
    want = pattern(src_nbytes, seed).reshape(-1, block)[np.asarray(src_idx)]
    got = blocks[np.asarray(dst_idx)]
    bad = int(np.count_nonzero((got != want).any(axis=1)))
    untouched = np.ones(blocks.shape[0], dtype=bool)
    untouched[np.asarray(dst_idx)] = False
    dirty = int(np.count_nonzero(blocks[untouched].any(axis=1)))
    return {"checked_blocks": int(got.shape[0]), "bad_blocks": bad, "dirty_untouched_blocks": dirty}


def serve(conn: Connection, name: str, nbytes: int) -> None:
    """Child entry point: register ``nbytes`` of zeroes, publish metadata, then obey commands."""
    from kvwire.transport.nixl import NixlAgent

    agent = NixlAgent(name)
    buf = np.zeros(nbytes, dtype=np.uint8)
    # Touch every page now: np.zeros maps them lazily, and faulting them in during the first WRITE costs
    # ~20 us a page on a VM (a first 64 MiB WRITE took 350 ms instead of 15 ms).
    buf.fill(0)
    agent.register(buf)
    conn.send(("ready", agent.metadata(), int(buf.ctypes.data)))
    inbox: list[tuple[str, bytes]] = []
    try:
        while True:
            if not conn.poll(0.0005):
                inbox.extend((s, m) for s, msgs in agent.drain_notifs().items() for m in msgs)
                continue
            cmd = conn.recv()
            if cmd[0] == "stop":
                conn.send(("bye",))
                return
            if cmd[0] == "zero":
                buf[:] = 0
                conn.send(("ok",))
            elif cmd[0] == "wait_notif":
                _, sender, timeout_s = cmd
                deadline = time.monotonic() + timeout_s
                while not any(s == sender for s, _ in inbox) and time.monotonic() < deadline:
                    inbox.extend((s, m) for s, msgs in agent.drain_notifs().items() for m in msgs)
                found = [m for s, m in inbox if s == sender]
                inbox = [(s, m) for s, m in inbox if s != sender]
                conn.send(("notif", found) if found else ("timeout",))
            elif cmd[0] == "verify":
                _, block, seed, src_nbytes, src_idx, dst_idx = cmd
                conn.send(("verified", _verify(buf, block, seed, src_nbytes, src_idx, dst_idx)))
            else:
                conn.send(("error", f"unknown command {cmd[0]!r}"))
    finally:
        agent.close()


class BufferPeer:
    """The parent's handle on a ``serve`` child (spawned). Use as a context manager: it always reaps."""

    def __init__(self, name: str, nbytes: int) -> None:
        self.name = name
        self._proc, self._conn = spawn_child(serve, name, nbytes)
        try:
            reply = self._reply(READY_TIMEOUT_S)
        except BaseException:
            self.close()
            raise
        self.metadata: bytes = reply[1]
        self.addr: int = reply[2]

    def __enter__(self) -> BufferPeer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _reply(self, timeout_s: float, pump: Callable[[], None] | None = None) -> tuple[Any, ...]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._conn.poll(0.0005 if pump else 0.05):
                reply: tuple[Any, ...] = self._conn.recv()
                if reply[0] == "error":
                    raise KvwireError(f"peer {self.name}: {reply[1]}")
                return reply
            if not self._proc.is_alive():
                raise TransportError(f"peer process {self.name} exited with {self._proc.exitcode}")
            if pump is not None:
                pump()
        raise TransportError(f"peer process {self.name} did not answer within {timeout_s} s")

    def call(
        self, cmd: Sequence[Any], timeout_s: float = 30.0, pump: Callable[[], None] | None = None
    ) -> tuple[Any, ...]:
        """Send a command and wait for its reply; ``pump`` runs while waiting (e.g. the sender's progress)."""
        self._conn.send(tuple(cmd))
        return self._reply(timeout_s, pump)

    def wait_notif(
        self, sender: str, timeout_s: float, pump: Callable[[], None] | None = None
    ) -> list[bytes]:
        reply = self.call(("wait_notif", sender, timeout_s), timeout_s + 5.0, pump)
        if reply[0] != "notif":
            raise TransportError(f"peer {self.name} got no notification from {sender} in {timeout_s} s")
        found: list[bytes] = reply[1]
        return found

    def verify(
        self, block: int, seed: int, src_nbytes: int, src_idx: Sequence[int], dst_idx: Sequence[int]
    ) -> dict[str, int]:
        reply = self.call(("verify", block, seed, src_nbytes, list(src_idx), list(dst_idx)), 120.0)
        result: dict[str, int] = reply[1]
        return result

    def kill(self) -> None:
        """SIGKILL the child (fault tests): it dies without closing its agent."""
        self._proc.kill()
        self._proc.join(5.0)

    def close(self) -> None:
        """Ask the child to stop; kill it if it does not within a few seconds. Idempotent."""
        stop_child(self._proc, self._conn, ("stop",), 5.0)

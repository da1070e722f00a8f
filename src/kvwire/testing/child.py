"""A spawned child process driven over a pipe: how the benches and tests run a peer in another process.

Spawned, not forked: NIXL and UCX state must not be inherited from the parent.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any


def spawn_child(target: Callable[..., Any], *args: Any) -> tuple[BaseProcess, Connection]:
    """Start ``target(conn, *args)`` in a spawned daemon process; returns it and the parent's end."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=target, args=(child, *args), daemon=True)
    proc.start()
    child.close()
    return proc, parent


def stop_child(proc: BaseProcess, conn: Connection, stop_msg: object, timeout_s: float = 10.0) -> None:
    """Ask the child to stop with ``stop_msg``; kill it if it has not within ``timeout_s``. Idempotent."""
    try:
        if proc.is_alive():
            conn.send(stop_msg)
            proc.join(timeout_s)
    except (OSError, EOFError):
        pass  # the child is already gone: its end of the pipe is closed
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join(5.0)
        conn.close()


def serve_commands(
    conn: Connection, host: Any, close: Callable[[], None], idle: Callable[[], None] | None = None
) -> None:
    """The child's loop: ``(cmd, kwargs)`` in, ``("ok", host.cmd(**kwargs))`` or ``("err", text)`` out,
    until ``("exit", ...)``; ``close`` runs whatever happened. ``idle``, when given, runs between commands
    (every 0.5 ms): a NIXL agent without a progress thread must progress for a peer's transfers to finish."""
    try:
        while True:
            if idle is not None and not conn.poll(0.0005):
                idle()
                continue
            cmd, kwargs = conn.recv()
            if cmd == "exit":
                break
            try:
                conn.send(("ok", getattr(host, cmd)(**kwargs)))
            except Exception as exc:
                conn.send(("err", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    finally:
        close()
        conn.close()


class CommandChild:
    """The parent's handle on a child running ``serve_commands``: ``call`` one command, or ``send`` to
    several children before ``recv``-ing their answers (their work then overlaps)."""

    def __init__(self, serve: Callable[[Connection], None], call_timeout_s: float = 60.0) -> None:
        # UCX's ib modules crash processes at exit on hosts without InfiniBand (the children inherit it).
        os.environ.setdefault("UCX_MODULES", "^ib*")
        self._timeout_s = call_timeout_s
        self._proc, self._conn = spawn_child(serve)

    def send(self, cmd: str, **kwargs: Any) -> None:
        self._conn.send((cmd, kwargs))

    def recv(self, cmd: str, timeout_s: float | None = None) -> Any:
        wait = self._timeout_s if timeout_s is None else timeout_s
        if not self._conn.poll(wait):
            raise TimeoutError(f"worker did not answer {cmd} within {wait} s")
        status, value = self._conn.recv()
        if status != "ok":
            raise RuntimeError(f"worker {cmd} failed: {value}")
        return value

    def call(self, cmd: str, timeout_s: float | None = None, **kwargs: Any) -> Any:
        self.send(cmd, **kwargs)
        return self.recv(cmd, timeout_s)

    def close(self) -> None:
        stop_child(self._proc, self._conn, ("exit", {}))

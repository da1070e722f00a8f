"""Server processes for the demo, the benches, chaos and the tests: start, wait for ``/health``, and always
stop (SIGTERM, then SIGKILL).

Every child runs in its own session so that a stop also reaches anything it spawned, and its output goes
to a log file whose tail is shown when it fails.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import httpx

from kvwire.errors import KvwireError

_POLL_S = 0.1
_TAIL_BYTES = 4000


class ServerFailed(KvwireError):
    """A demo server exited or never became healthy."""


# Ports are picked below Linux's default ephemeral range (32768-60999): a port picked there can be taken
# as the source port of any outgoing connection between the check and the server's bind, or its rebind
# after a restart on the same port (seen: `kvwire chaos` restarting a killed engine).
_PORTS = range(20000, 32000)


# The ports this process handed out lately: two picks before either server binds must differ (a CI chaos
# run drew one port for D's HTTP listener and its side channel, and D could not start). Bounded.
_GIVEN: collections.deque[int] = collections.deque(maxlen=1024)


def free_port() -> int:
    """A port that is free now on 127.0.0.1 (the server binds it a moment later), and not one this process
    handed out lately."""
    for _ in range(200):
        port = random.choice(_PORTS)
        if port in _GIVEN:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _GIVEN.append(port)
        return port
    raise ServerFailed(f"no free port on 127.0.0.1 in {_PORTS.start}-{_PORTS.stop - 1} after 200 tries")


def server_env() -> dict[str, str]:
    """What every server process of a local topology gets on top of this process's environment."""
    # UCX_MODULES: avoid UCX's crash at exit where ibverbs-providers is installed (no InfiniBand here).
    return {"UCX_MODULES": os.environ.get("UCX_MODULES", "^ib*"), "PYTHONUNBUFFERED": "1"}


def kvwire_command(*args: str) -> list[str]:
    """Run a kvwire command with this interpreter (works without the console script on PATH)."""
    return [sys.executable, "-m", "kvwire.cli", *args]


@dataclass
class Server:
    name: str
    argv: list[str]
    port: int
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None
    env: dict[str, str] = field(default_factory=dict)
    _log: IO[bytes] | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_tail(self) -> str:
        try:
            data = self.log_path.read_bytes()
        except OSError:
            return ""
        return data[-_TAIL_BYTES:].decode(errors="replace")


class ServerGroup:
    """The demo's processes. Use as a context manager: leaving it stops every one of them."""

    def __init__(self, log_dir: Path, env: dict[str, str] | None = None) -> None:
        self.log_dir = log_dir
        self.servers: list[Server] = []
        self._env = {**os.environ, **(env or {})}

    def __enter__(self) -> ServerGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_all()

    def start(self, name: str, args: Sequence[str], port: int) -> Server:
        """Start ``kvwire ARGS`` as server ``name`` listening on ``port``."""
        return self.start_argv(name, kvwire_command(*args), port)

    def start_argv(
        self, name: str, argv: Sequence[str], port: int, env: dict[str, str] | None = None
    ) -> Server:
        """Start ``argv`` as server ``name``; ``env`` adds to the group's environment for this one."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        server = Server(name, list(argv), port, self.log_dir / f"{name}.log")
        server.env = env or {}
        self.servers.append(server)
        return self._launch(server, "wb")

    def kill(self, server: Server, timeout_s: float = 10.0) -> None:
        """SIGKILL ``server`` (and anything it spawned) and reap it: a crash, not a shutdown."""
        if server.proc is None:
            return
        _signal_group(server, signal.SIGKILL)
        server.proc.wait(timeout=timeout_s)

    def restart(self, server: Server) -> Server:
        """Start ``server`` again with the same command line and port (killing it first if it runs).

        The log is appended to, so one file tells the story of every life; ``servers.json`` lists the new pid.
        """
        if server.proc is not None and server.proc.poll() is None:
            self.kill(server)
        if server._log is not None:
            server._log.close()
        return self._launch(server, "ab")

    def _launch(self, server: Server, log_mode: str) -> Server:
        """Run ``server``'s command line in a session of its own, its output into its log (``wb``: a new
        log, ``ab``: appended to, for a restart), and list it in ``servers.json``."""
        server._log = server.log_path.open(log_mode)
        server.proc = subprocess.Popen(
            server.argv,
            stdin=subprocess.DEVNULL,
            stdout=server._log,
            stderr=subprocess.STDOUT,
            env={**self._env, **server.env},
            start_new_session=True,
        )
        self._write_index()
        return server

    def _write_index(self) -> None:
        """``servers.json`` in the log directory: who runs where (for debugging, and for leak checks)."""
        index = [
            {"name": s.name, "pid": s.proc.pid if s.proc else None, "port": s.port} for s in self.servers
        ]
        (self.log_dir / "servers.json").write_text(json.dumps(index, indent=1) + "\n")

    def wait_healthy(self, servers: Sequence[Server], timeout_s: float) -> None:
        """Poll each server's ``/health`` until all answer 200; raise if one exits or time runs out."""
        deadline = time.monotonic() + timeout_s
        pending = list(servers)
        with httpx.Client(timeout=2.0) as client:
            while pending:
                for server in list(pending):
                    self._check_alive(server)
                    if _healthy(client, server.url):
                        pending.remove(server)
                if pending and time.monotonic() > deadline:
                    names = ", ".join(s.name for s in pending)
                    tail = pending[0].log_tail()
                    raise ServerFailed(
                        f"not healthy after {timeout_s:.0f} s: {names}\n--- {pending[0].name} log ---\n{tail}"
                    )
                if pending:
                    time.sleep(_POLL_S)

    def check_all_alive(self) -> None:
        for server in self.servers:
            self._check_alive(server)

    @staticmethod
    def _check_alive(server: Server) -> None:
        if server.proc is not None and server.proc.poll() is not None:
            raise ServerFailed(
                f"{server.name} exited with status {server.proc.returncode}\n"
                f"--- {server.name} log ({server.log_path}) ---\n{server.log_tail()}"
            )

    def stop_all(self, timeout_s: float = 10.0) -> list[str]:
        """SIGTERM every server, wait, SIGKILL the ones left. Returns the names that had to be killed."""
        running = [s for s in self.servers if s.proc is not None and s.proc.poll() is None]
        for s in running:
            _signal_group(s, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        killed = []
        for s in running:
            assert s.proc is not None
            try:
                s.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                killed.append(s.name)
                _signal_group(s, signal.SIGKILL)
                s.proc.wait(timeout=timeout_s)
        for s in self.servers:
            if s.proc is None:
                continue
            # Anything a server spawned (TP ranks) and left behind goes with its session.
            _signal_group(s, signal.SIGKILL)
            s.proc.wait(timeout=timeout_s)
            if s._log is not None:
                s._log.close()
                s._log = None
        return killed


def _healthy(client: httpx.Client, url: str) -> bool:
    try:
        resp = client.get(url + "/health")
        # kvwire's servers answer {"status": "ok", ...}; vLLM's answer 200 with an empty body.
        return resp.status_code == 200 and (not resp.content or resp.json().get("status") == "ok")
    except (httpx.HTTPError, ValueError, AttributeError):
        return False


def _signal_group(server: Server, sig: signal.Signals) -> None:
    assert server.proc is not None
    # The child leads its own session: its process group id is its pid.
    with contextlib.suppress(ProcessLookupError):
        os.killpg(server.proc.pid, sig)

"""A transfer worker for fault tests across network namespaces, and the parent's handle on it.

``python -m kvwire.testing.faultnet --name N --nbytes B [--seed S]`` owns one NIXL agent (kvwire's
``NixlAgent``) and one registered buffer (the pattern ``pattern(B, S)`` when a seed is given, zeroes
otherwise). It talks to its parent over stdin/stdout (pipes cross namespaces; the side channel would not
reach the host namespace), one JSON object per line, stdout lines prefixed with ``KVWT``.

NIXL reports neither a frozen nor a partitioned peer, nor (across hosts) a killed writer
(shared/reference/nixl-faults.md), so the worker keeps kvwire's own guards, the ones the connector has:
every loaded peer gets a heartbeat notification every ``heartbeat_s``; a peer silent for
``liveness_timeout_s`` (or one NIXL reports disconnected) is dead; a write still in progress after
``transfer_timeout_s`` is released and reported as timed out. Every wait is bounded.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvwire.errors import KvwireError, TransportError
from kvwire.testing.buffer_peer import pattern

HEARTBEAT = b"KVWT-HB"
_LINE_PREFIX = b"KVWT "
DEFAULT_HEARTBEAT_S = 0.2


# ---------------------------------------------------------------------------------------------------
# The worker (child side)
# ---------------------------------------------------------------------------------------------------


@dataclass
class _Worker:
    name: str
    buf: np.ndarray
    heartbeat_s: float
    agent: Any = None
    last_seen: dict[str, float] = field(default_factory=dict)
    dead: dict[str, str] = field(default_factory=dict)
    notifs: list[tuple[str, bytes]] = field(default_factory=list)
    next_beat: float = 0.0

    def pump(self) -> None:
        """Progress the agent, record who spoke, keep our heartbeats going."""
        now = time.monotonic()
        try:
            drained = self.agent.drain_notifs()
        except TransportError as exc:
            _log(f"drain failed: {exc}")
            drained = {}
        for sender, msgs in drained.items():
            self.last_seen[sender] = now
            self.notifs.extend((sender, m) for m in msgs if m != HEARTBEAT)
        if now >= self.next_beat:
            self.next_beat = now + self.heartbeat_s
            for peer in list(self.last_seen):
                if peer in self.dead:
                    continue
                try:
                    self.agent.send_notif(peer, HEARTBEAT)
                except TransportError as exc:  # NIXL saw the connection die: no need to wait for silence
                    self.dead[peer] = f"send_notif: {type(exc).__name__}"

    def silence(self, peer: str) -> float:
        return time.monotonic() - self.last_seen.get(peer, time.monotonic())

    def take_notif(self, peer: str, msg: bytes) -> bool:
        for i, (sender, m) in enumerate(self.notifs):
            if sender == peer and m == msg:
                del self.notifs[i]
                return True
        return False


def _log(msg: str) -> None:
    print(f"[faultnet {os.getpid()}] {msg}", file=sys.stderr, flush=True)


def _reply(obj: dict[str, Any]) -> None:
    sys.stdout.buffer.write(_LINE_PREFIX + json.dumps(obj).encode() + b"\n")
    sys.stdout.buffer.flush()


def _cmd_write(w: _Worker, cmd: dict[str, Any]) -> dict[str, Any]:
    from kvwire.transport.base import Desc, XferOp, XferStatus

    peer, nbytes = str(cmd["peer"]), int(cmd["nbytes"])
    local = [Desc(int(w.buf.ctypes.data), nbytes)]
    remote = [Desc(int(cmd["addr"]), nbytes)]
    transfer_timeout_s, liveness_s = float(cmd["transfer_timeout_s"]), float(cmd["liveness_timeout_s"])
    start = time.monotonic()
    try:
        handle = w.agent.post(XferOp.WRITE, local, remote, peer, str(cmd["notif"]).encode())
    except KvwireError as exc:
        return {"outcome": "post_failed", "error": type(exc).__name__, "elapsed_s": time.monotonic() - start}
    outcome = ""
    state = handle.state
    while not outcome:
        state = w.agent.status(handle)
        w.pump()
        elapsed = time.monotonic() - start
        if state is XferStatus.DONE:
            outcome = "done"
        elif state is XferStatus.FAILED:
            outcome = "failed"
        elif peer in w.dead or w.silence(peer) > liveness_s:
            outcome = "peer_dead"
        elif elapsed > transfer_timeout_s:
            outcome = "timeout"
        else:
            time.sleep(0.0005)
    # A posted write cannot be recalled: releasing cancels it (its notification is then never sent).
    w.agent.release(handle)
    return {
        "outcome": outcome,
        "state": state.value,
        "reason": handle.failed_reason,
        "elapsed_s": time.monotonic() - start,
        "dead_reason": w.dead.get(peer),
    }


def _cmd_await(w: _Worker, cmd: dict[str, Any]) -> dict[str, Any]:
    peer, msg = str(cmd["peer"]), str(cmd["notif"]).encode()
    liveness_s, max_s = float(cmd["liveness_timeout_s"]), float(cmd["max_s"])
    start = time.monotonic()
    while True:
        w.pump()
        if w.take_notif(peer, msg):
            outcome = "done"
        elif peer in w.dead or w.silence(peer) > liveness_s:
            outcome = "peer_dead"
        elif time.monotonic() - start > max_s:
            outcome = "timeout"
        else:
            time.sleep(0.0005)
            continue
        return {"outcome": outcome, "elapsed_s": time.monotonic() - start, "silence_s": w.silence(peer)}


def _handle(w: _Worker, cmd: dict[str, Any]) -> dict[str, Any] | None:
    op = cmd.get("cmd")
    if op == "add_peer":
        name = w.agent.add_peer(base64.b64decode(cmd["metadata"]))
        w.last_seen[name] = time.monotonic()
        w.dead.pop(name, None)
        return {"peer": name}
    if op == "write":
        return _cmd_write(w, cmd)
    if op == "await":
        return _cmd_await(w, cmd)
    if op == "poll_notif":
        peer, msg = str(cmd["peer"]), str(cmd["notif"]).encode()
        w.pump()
        return {"found": w.take_notif(peer, msg)}
    if op == "verify":
        nbytes = int(cmd["nbytes"])
        want = pattern(int(cmd.get("pattern_nbytes", nbytes)), int(cmd["seed"]))[:nbytes]
        bad = int(np.count_nonzero(w.buf[:nbytes] != want))
        return {"bad_bytes": bad, "checked_bytes": nbytes}
    if op == "zero":
        w.buf[:] = 0
        return {}
    if op == "stop":
        return None
    return {"error": f"unknown command {op!r}"}


def worker_main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvwire.testing.faultnet")
    parser.add_argument("--name", required=True)
    parser.add_argument("--nbytes", type=int, required=True)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--heartbeat-s", type=float, default=DEFAULT_HEARTBEAT_S)
    args = parser.parse_args(argv)
    from kvwire.transport.nixl import NixlAgent

    if args.seed is not None:
        buf = pattern(args.nbytes, args.seed)
    else:
        buf = np.zeros(args.nbytes, np.uint8)
        buf.fill(0)  # fault every page in now, not during the first WRITE (np.zeros maps them lazily)
    w = _Worker(args.name, buf, args.heartbeat_s, agent=NixlAgent(args.name))
    try:
        w.agent.register(buf)
        _reply(
            {
                "ready": True,
                "metadata": base64.b64encode(w.agent.metadata()).decode(),
                "addr": buf.ctypes.data,
            }
        )
        stdin = sys.stdin.buffer
        while True:
            readable, _, _ = select.select([stdin], [], [], 0.002)
            if not readable:
                w.pump()
                continue
            line = stdin.readline()
            if not line:  # the parent went away
                return 0
            result = _handle(w, json.loads(line))
            if result is None:
                _reply({"bye": True})
                return 0
            _reply(result)
    finally:
        w.agent.close()


# ---------------------------------------------------------------------------------------------------
# The parent's handle
# ---------------------------------------------------------------------------------------------------


class FaultWorker:
    """A worker process started by ``launch`` (e.g. ``NetnsPair.popen``); replies are read with timeouts."""

    def __init__(self, proc: subprocess.Popen[bytes], name: str) -> None:
        self.proc = proc
        self.name = name
        self._buf = b""
        self.metadata = b""
        self.addr = 0

    def wait_ready(self, timeout_s: float = 60.0) -> FaultWorker:
        """Wait for the worker's agent and buffer (started separately so that workers start in parallel)."""
        ready = self.reply(timeout_s)
        self.metadata = base64.b64decode(ready["metadata"])
        self.addr = int(ready["addr"])
        return self

    def add_peer(self, other: FaultWorker, timeout_s: float = 30.0) -> str:
        """Load ``other``'s full metadata; returns its agent name as loaded here."""
        reply = self.call(
            {"cmd": "add_peer", "metadata": base64.b64encode(other.metadata).decode()}, timeout_s
        )
        return str(reply["peer"])

    @classmethod
    def launch(
        cls,
        start: Callable[[list[str], dict[str, str]], subprocess.Popen[bytes]],
        name: str,
        nbytes: int,
        *,
        seed: int | None = None,
        env: dict[str, str] | None = None,
    ) -> FaultWorker:
        """Start a worker (not waiting for it: see ``wait_ready``)."""
        argv = [sys.executable, "-m", "kvwire.testing.faultnet", "--name", name, "--nbytes", str(nbytes)]
        if seed is not None:
            argv += ["--seed", str(seed)]
        return cls(start(argv, {**os.environ, **(env or {})}), name)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def send(self, cmd: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd).encode() + b"\n")
        self.proc.stdin.flush()

    def reply(self, timeout_s: float) -> dict[str, Any]:
        """The next reply line; ``TransportError`` when the worker exits or stays silent past the timeout."""
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout_s
        while True:
            while b"\n" in self._buf:
                line, self._buf = self._buf.split(b"\n", 1)
                if line.startswith(_LINE_PREFIX):
                    reply: dict[str, Any] = json.loads(line[len(_LINE_PREFIX) :])
                    if "error" in reply:
                        raise KvwireError(f"worker {self.name}: {reply['error']}")
                    return reply
            left = deadline - time.monotonic()
            if left <= 0:
                raise TransportError(f"worker {self.name} did not answer within {timeout_s} s")
            readable, _, _ = select.select([fd], [], [], min(left, 0.1))
            if readable:
                chunk = os.read(fd, 65536)
                if not chunk:
                    raise TransportError(f"worker {self.name} exited ({self.proc.wait(5.0)})")
                self._buf += chunk

    def call(self, cmd: dict[str, Any], timeout_s: float = 30.0) -> dict[str, Any]:
        self.send(cmd)
        return self.reply(timeout_s)

    def start_write(
        self,
        peer: str,
        dst: FaultWorker,
        nbytes: int,
        tag: str,
        *,
        transfer_timeout_s: float,
        liveness_timeout_s: float,
    ) -> None:
        """Post a WRITE of this worker's first ``nbytes`` into ``dst``'s buffer, ``tag`` attached; the
        outcome (done, failed, post_failed, peer_dead, timeout) comes with ``reply``."""
        self.send(
            {
                "cmd": "write",
                "peer": peer,
                "addr": dst.addr,
                "nbytes": nbytes,
                "notif": tag,
                "transfer_timeout_s": transfer_timeout_s,
                "liveness_timeout_s": liveness_timeout_s,
            }
        )

    def start_await(self, peer: str, tag: str, *, liveness_timeout_s: float, max_s: float) -> None:
        """Wait (in the worker) for notification ``tag`` from ``peer``: done, peer_dead or timeout."""
        self.send(
            {
                "cmd": "await",
                "peer": peer,
                "notif": tag,
                "liveness_timeout_s": liveness_timeout_s,
                "max_s": max_s,
            }
        )

    def bad_bytes(self, seed: int, nbytes: int, pattern_nbytes: int | None = None) -> int:
        """Bytes of the buffer's first ``nbytes`` that differ from those of
        ``pattern(pattern_nbytes or nbytes, seed)`` (the writer's whole buffer)."""
        cmd = {"cmd": "verify", "seed": seed, "nbytes": nbytes, "pattern_nbytes": pattern_nbytes or nbytes}
        return int(self.call(cmd, 60.0)["bad_bytes"])

    def signal(self, sig: signal.Signals) -> None:
        os.kill(self.proc.pid, sig)

    def kill(self) -> None:
        """SIGKILL (the worker dies without closing its agent)."""
        if self.proc.poll() is None:
            self.signal(signal.SIGKILL)
            self.proc.wait(5.0)

    def stop(self, timeout_s: float = 5.0) -> None:
        """Ask the worker to exit; kill it if it does not in time. Idempotent."""
        if self.proc.poll() is None:
            try:
                os.kill(self.proc.pid, signal.SIGCONT)
                self.call({"cmd": "stop"}, timeout_s)
                self.proc.wait(timeout_s)
            except (KvwireError, OSError, subprocess.TimeoutExpired):
                self.kill()


if __name__ == "__main__":
    sys.exit(worker_main())

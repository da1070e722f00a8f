"""Two network namespaces joined by a veth pair: "two hosts" on one machine, with faults on the link.

Why namespaces: with default transports UCX sees one node and moves data by ``cma``, so only processes in
different namespaces with ``UCX_TLS=tcp`` exercise what a cross-host transfer does. This kernel has no
``netem``, so faults are made with what exists (shared/reference/nixl-faults.md):

* random loss and partitions: an nftables table in namespace A whose input and output chains drop packets
  on the veth (``numgen random mod 100 < N drop``, or ``drop`` for a partition); every packet crossing the
  link passes A once, so ``loss(5)`` drops about 5% in each direction. Note that the filters see TCP
  offload super-packets (up to 64 KiB) unless ``wire_sized_packets`` is called;
* a bandwidth cap: ``tc qdisc ... tbf`` on both ends of the veth.

The /30 is private to the two namespaces (nothing is added to the host's namespace), and ``close`` always
deletes both namespaces, which deletes the veth pair too; namespaces left by a process that died are
deleted by the next ``NetnsPair`` (their names carry the creator's pid).
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import IO, Any

from kvwire.errors import KvwireError

PREFIX = "kvwt"
_TABLE = "kvwire_fault"
_CMD_TIMEOUT_S = 10.0
_REQUIRED = ("ip", "nft", "tc")
_DEFAULT_GSO_SEGS = "65535"  # a new veth's value


class NetnsError(KvwireError):
    """A namespace, link or fault rule could not be set up or removed."""


@dataclass(frozen=True, slots=True)
class Side:
    """One end of the link: its namespace, veth interface and address."""

    ns: str
    ifname: str
    addr: str


def _run(argv: Sequence[str], timeout_s: float = _CMD_TIMEOUT_S) -> subprocess.CompletedProcess[str]:
    try:
        done = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout_s, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise NetnsError(f"{' '.join(argv)}: {exc}") from exc
    if done.returncode != 0:
        raise NetnsError(f"{' '.join(argv)} exited {done.returncode}: {done.stderr.strip()}")
    return done


_probe_result: list[str | None] = []


def unavailable_reason() -> str | None:
    """Why ``NetnsPair`` cannot work here (not root, a missing binary, namespaces refused), or None.

    The probe (creating and deleting one namespace) runs once per process.
    """
    if _probe_result:
        return _probe_result[0]
    reason: str | None = None
    missing = [b for b in _REQUIRED if shutil.which(b) is None]
    if os.geteuid() != 0:
        reason = "network namespaces need root (ip netns add)"
    elif missing:
        hint = " (apt-get install nftables)" if "nft" in missing else ""
        reason = f"missing {', '.join(missing)}{hint}"
    else:
        probe = f"{PREFIX}-{os.getpid()}-probe"
        try:
            _run(["ip", "netns", "add", probe])
            _run(["ip", "netns", "exec", probe, "nft", "list", "tables"])
        except NetnsError as exc:
            reason = f"ip netns / nft unusable here: {exc}"
        finally:
            with contextlib.suppress(NetnsError):
                _run(["ip", "netns", "del", probe])
    _probe_result.append(reason)
    return reason


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def reap_stale_namespaces() -> list[str]:
    """Delete kvwire test namespaces whose creating process is gone; returns their names."""
    try:
        listing = _run(["ip", "netns", "list"]).stdout
    except NetnsError:
        return []
    reaped = []
    for line in listing.splitlines():
        name = line.split()[0] if line.split() else ""
        parts = name.split("-")
        if len(parts) < 3 or parts[0] != PREFIX or not parts[1].isdigit():
            continue
        if _pid_alive(int(parts[1])):
            continue
        with contextlib.suppress(NetnsError):
            _run(["ip", "netns", "del", name])
            reaped.append(name)
    return reaped


class NetnsPair:
    """Namespaces A and B joined by veth, addresses ``10.213.X.1`` (A) and ``10.213.X.2`` (B) in a /30.

    Use as a context manager. Processes started with ``popen`` are killed on close.
    """

    def __init__(self, subnet_octet: int | None = None) -> None:
        reason = unavailable_reason()
        if reason is not None:
            raise NetnsError(reason)
        token = secrets.token_hex(3)
        octet = subnet_octet if subnet_octet is not None else secrets.randbelow(250) + 1
        self.a = Side(f"{PREFIX}-{os.getpid()}-{token}-a", f"{PREFIX}{token}a", f"10.213.{octet}.1")
        self.b = Side(f"{PREFIX}-{os.getpid()}-{token}-b", f"{PREFIX}{token}b", f"10.213.{octet}.2")
        self._procs: list[subprocess.Popen[Any]] = []
        self._created: list[str] = []
        self._closed = False

    def __enter__(self) -> NetnsPair:
        try:
            self._create()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _create(self) -> None:
        reap_stale_namespaces()
        for side in (self.a, self.b):
            _run(["ip", "netns", "add", side.ns])
            self._created.append(side.ns)
        # Created in A, B's end then moved: the host namespace never keeps an end of the pair.
        _run(
            [
                "ip",
                "-n",
                self.a.ns,
                "link",
                "add",
                self.a.ifname,
                "type",
                "veth",
                "peer",
                "name",
                self.b.ifname,
            ]
        )
        _run(["ip", "-n", self.a.ns, "link", "set", self.b.ifname, "netns", self.b.ns])
        for side in (self.a, self.b):
            _run(["ip", "-n", side.ns, "addr", "add", f"{side.addr}/30", "dev", side.ifname])
            _run(["ip", "-n", side.ns, "link", "set", side.ifname, "up"])
            _run(["ip", "-n", side.ns, "link", "set", "lo", "up"])

    # -- processes -----------------------------------------------------------------------------------
    def command(self, side: Side, argv: Sequence[str]) -> list[str]:
        """``argv`` prefixed to run inside ``side``'s namespace (``ip netns exec`` execs, keeping the pid)."""
        return ["ip", "netns", "exec", side.ns, *argv]

    def run(self, side: Side, argv: Sequence[str], timeout_s: float = _CMD_TIMEOUT_S) -> str:
        """Run a command inside a namespace to completion; returns its stdout."""
        return _run(self.command(side, argv), timeout_s).stdout

    def popen(
        self,
        side: Side,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        stdin: int | IO[Any] | None = subprocess.PIPE,
        stdout: int | IO[Any] | None = subprocess.PIPE,
        stderr: int | IO[Any] | None = None,
    ) -> subprocess.Popen[bytes]:
        """Start a process inside a namespace; it is killed (SIGKILL) when the pair closes."""
        proc = subprocess.Popen(
            self.command(side, argv),
            env=dict(env) if env is not None else None,
            stdin=stdin,
            stdout=stdout,
            stderr=stderr,
            start_new_session=True,
        )
        self._procs.append(proc)
        return proc

    # -- faults --------------------------------------------------------------------------------------
    def _nft_drop(self, verdict: str) -> None:
        self.clear_filter()
        a = self.a
        rules = (
            f"add table inet {_TABLE}\n"
            f"add chain inet {_TABLE} in {{ type filter hook input priority 0; policy accept; }}\n"
            f"add chain inet {_TABLE} out {{ type filter hook output priority 0; policy accept; }}\n"
            f'add rule inet {_TABLE} in iifname "{a.ifname}" {verdict}\n'
            f'add rule inet {_TABLE} out oifname "{a.ifname}" {verdict}\n'
        )
        try:
            done = subprocess.run(
                self.command(a, ["nft", "-f", "-"]),
                input=rules,
                capture_output=True,
                text=True,
                timeout=_CMD_TIMEOUT_S,
                check=False,
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise NetnsError(f"nft in {a.ns}: {exc}") from exc
        if done.returncode != 0:
            raise NetnsError(f"nft in {a.ns} exited {done.returncode}: {done.stderr.strip()}")

    def loss(self, percent: int) -> None:
        """Drop a random ``percent``% of the packets crossing the link, in each direction."""
        if not 0 < percent <= 100:
            raise ValueError(f"loss percent must be in 1..100, got {percent}")
        self._nft_drop(f"numgen random mod 100 < {percent} counter drop")

    def partition(self) -> None:
        """Drop every packet crossing the link (both directions) until ``heal``."""
        self._nft_drop("counter drop")

    def dropped_packets(self) -> int:
        """Packets the current loss or partition rules dropped (0 when none are set)."""
        try:
            listing = self.run(self.a, ["nft", "list", "table", "inet", _TABLE])
        except NetnsError:
            return 0
        return sum(int(n) for n in re.findall(r"counter packets (\d+)", listing))

    def wire_sized_packets(self, on: bool = True) -> None:
        """Make the kernel hand MTU-sized packets to the filters, as a wire would carry them.

        By default a veth passes TCP segmentation-offload "super-packets" of up to 64 KiB: a 5% loss rule
        then drops 5% of those, which TCP recovers from far faster than from 5% of wire packets (measured
        with 32 MiB: 0.1-0.3 s against ~17 s).
        """
        segs = "1" if on else _DEFAULT_GSO_SEGS
        for side in (self.a, self.b):
            self.run(side, ["ip", "link", "set", "dev", side.ifname, "gso_max_segs", segs])

    def clear_filter(self) -> None:
        """Remove loss or partition rules (idempotent)."""
        with contextlib.suppress(NetnsError):
            self.run(self.a, ["nft", "delete", "table", "inet", _TABLE])

    heal = clear_filter

    def rate_limit(self, mbit: int) -> None:
        """Cap each direction of the link at ``mbit`` Mbit/s (token bucket on both veth ends)."""
        if mbit <= 0:
            raise ValueError(f"rate must be positive, got {mbit}")
        # The bucket must hold at least one timer tick of traffic or tbf cannot reach its rate.
        burst_kb = max(64, mbit * 1000 // 8 // 100)
        for side in (self.a, self.b):
            tbf = ["tbf", "rate", f"{mbit}mbit", "burst", f"{burst_kb}kb", "latency", "100ms"]
            self.run(side, ["tc", "qdisc", "replace", "dev", side.ifname, "root", *tbf])

    def clear_rate(self) -> None:
        """Remove bandwidth caps (idempotent)."""
        for side in (self.a, self.b):
            with contextlib.suppress(NetnsError):
                self.run(side, ["tc", "qdisc", "del", "dev", side.ifname, "root"])

    def clear(self) -> None:
        """Remove every fault: the link is clean again."""
        self.clear_filter()
        self.clear_rate()
        with contextlib.suppress(NetnsError):
            self.wire_sized_packets(False)

    # -- teardown ------------------------------------------------------------------------------------
    def kill_processes(self) -> None:
        for proc in self._procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, 9)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(5.0)
            for stream in (proc.stdin, proc.stdout, proc.stderr):
                if stream is not None:
                    with contextlib.suppress(OSError):
                        stream.close()
        self._procs.clear()

    def close(self) -> None:
        """Kill the processes started here and delete both namespaces (and so the veth). Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self.kill_processes()
        finally:
            errors = []
            for ns in self._created:
                try:
                    _run(["ip", "netns", "del", ns])
                except NetnsError as exc:
                    errors.append(str(exc))
            self._created.clear()
            if errors:
                raise NetnsError("; ".join(errors))

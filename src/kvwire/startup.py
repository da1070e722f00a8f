"""Start-up checks of the server processes: each failure is one ``ConfigError`` line naming cause and fix.

The servers bind their HTTP socket here, before anything else starts (a connector, a health probe), so a
port in use ends the process at once with one line instead of a traceback after it said it serves.
"""

from __future__ import annotations

import errno
import ipaddress
import logging
import signal
import socket
import sys
from typing import Protocol

from kvwire.errors import ConfigError

log = logging.getLogger("kvwire")

EXIT_CONFIG = 2  # what argparse uses for a bad command line: a configuration the process cannot run with


def in_use_message(what: str, host: str, port: int, fix: str) -> str:
    return f"{what} port {port} on {host} is already in use (another kvwire or another program): {fix}"


def bind_tcp(host: str, port: int, what: str, fix: str) -> socket.socket:
    """A listening socket on (host, port); ``ConfigError`` naming ``what`` and ``fix`` when it cannot be."""
    if not 0 <= port <= 65535:  # 70000 bound 4464 (the kernel takes it modulo 65536); -1 "did not resolve"
        raise ConfigError(f"{what} port {port} is out of range (0-65535; 0: any free port)")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        detail = exc.strerror
        raise ConfigError(f"{what} address {host!r} does not resolve ({detail}): check --host") from None
    family, _, _, _, addr = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise ConfigError(in_use_message(what, host, port, fix)) from None
        if exc.errno == errno.EADDRNOTAVAIL:
            raise ConfigError(f"{what} address {host} is not an address of this host: check --host") from None
        if exc.errno == errno.EACCES:
            raise ConfigError(f"{what} port {port}: permission denied (ports below 1024 need root)") from None
        raise ConfigError(f"cannot listen on {what} {host}:{port}: {exc.strerror}") from None
    return sock


def is_loopback(host: str) -> bool:
    """Whether every address ``host`` names is a loopback address (a wildcard is not)."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None)
    except socket.gaierror:
        return False
    return bool(infos) and all(ipaddress.ip_address(str(i[4][0])).is_loopback for i in infos)


MIN_SECRET_BYTES = 32


def check_exposure(
    host: str,
    secret: bytes | None,
    insecure: bool,
    where: str = "--host",
    override: str = "pass --insecure",
    accept: bytes | None = None,
) -> None:
    """Without a shared secret the side channel answers anyone with the cache's region map, and a peer
    holding that map can write into D's KV: such an engine binds a loopback address only, unless told.
    ``accept``: ``KVWIRE_SECRET_ACCEPT``, trusted as fully as the secret (its length is checked alike)."""
    for name, key in (("KVWIRE_SECRET", secret), ("KVWIRE_SECRET_ACCEPT", accept)):
        if key is not None and len(key) < MIN_SECRET_BYTES:
            # Not refused (tests and loopback demos use short ones), but said at start: one captured signed
            # request is enough to guess a short secret offline.
            log.warning(
                "%s is %d bytes: use at least %d random ones (e.g. `openssl rand -hex 32`)",
                name,
                len(key),
                MIN_SECRET_BYTES,
            )
    if secret is None and not insecure and not is_loopback(host):
        raise ConfigError(
            f"{where} {host} without KVWIRE_SECRET would let anyone who reaches it read the KV layout and "
            f"write into the decode engine's KV: set KVWIRE_SECRET (the same on every engine), or {override} "
            "on a trusted network"
        )


def fail(prog: str, exc: BaseException) -> int:
    """Print one line on stderr and return the exit status of a configuration error."""
    print(f"{prog}: error: {exc}", file=sys.stderr)
    return EXIT_CONFIG


class _Stoppable(Protocol):
    """What ``record_stops`` needs of a uvicorn ``Server``."""

    started: bool
    should_exit: bool


def record_stops(server: _Stoppable) -> list[int]:
    """Install SIGINT/SIGTERM handlers for a uvicorn server about to run: the signals received, recorded
    (uvicorn re-raises the ones it handled to these after its graceful shutdown, so a requested stop
    exits 0), and one that comes before uvicorn installs its own handlers (its start-up) stops it once
    started: it was recorded and nothing else, and the server served until a second signal (a
    supervisor's SIGKILL at the end of its grace period; found by a review)."""
    stopped_by: list[int] = []

    def on_signal(signum: int, _frame: object) -> None:
        stopped_by.append(signum)
        if not server.started:
            server.should_exit = True

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    return stopped_by

"""D's claims (pull mode) over a few kept connections per P side channel.

Each claim used to open its own TCP connection. A burst of pull requests then opened as many connections
to one P rank at once, past its side channel's budget per peer address (``max_connections_per_host``,
32, without a secret), and the connections over it were refused: measured with 50 requests allocated at
once on one D, 14 loads failed ``handshake_failed`` (300 at once: 185). Claims now queue for one of
``per_address`` connections to each P address, kept open between claims (the side channel serves
several requests per connection), which also saves a TCP connect per claim.

A kept connection the server closed meanwhile (its idle timeout, its requests-per-connection bound) is
found closed on its next use: the claim is signed again (a new nonce: the server's replay guard took the
first) and sent on a fresh connection, once. A claim granted twice only renews P's hold.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from dataclasses import dataclass, field

from kvwire.errors import HandshakeTimeout, NobodyListens, PeerUnreachable
from kvwire.handshake.client import roundtrip
from kvwire.handshake.types import PeerAddress
from kvwire.protocol.auth import sign
from kvwire.protocol.messages import Claim, SideMessage

# Connections kept per P address: a vLLM D runs one process per rank on one host, each with its own
# lines, and without a secret the side channel takes at most 32 connections from one address.
PER_ADDRESS = 2
# Closed by this side once unused this long: the side channel closes idle ones after 10 s.
IDLE_S = 5.0


@dataclass
class _Line:
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    last_used: float
    uses: int = 0

    def close(self) -> None:
        self.writer.close()

    @property
    def broken(self) -> bool:
        return self.writer.is_closing() or self.reader.at_eof()


@dataclass
class _Address:
    slots: asyncio.Semaphore
    idle: collections.deque[_Line] = field(default_factory=collections.deque)


class ClaimLines:
    """Claims sent on kept connections, at most ``per_address`` at once to one P address (the rest wait
    for a free one). One event loop's: create, use and close it on the connector's loop."""

    def __init__(self, per_address: int = PER_ADDRESS, idle_s: float = IDLE_S) -> None:
        self._per_address = per_address
        self._idle_s = idle_s
        self._addresses: dict[tuple[str, int], _Address] = {}
        self.opened = 0  # connections opened, in all (for tests and stats)

    async def send(
        self, addr: PeerAddress, claim: Claim, *, timeout_s: float, secret: bytes | None
    ) -> tuple[SideMessage, Claim]:
        """P's reply to ``claim`` and the claim as sent (signed: the reply's seal is bound to it), within
        ``timeout_s``, waiting for a line included; the network's failures as ``kvwire.errors``."""
        entry = self._addresses.get((addr.host, addr.port))
        if entry is None:
            entry = self._addresses[(addr.host, addr.port)] = _Address(asyncio.Semaphore(self._per_address))
        try:
            async with asyncio.timeout(timeout_s), entry.slots:
                return await self._on_a_line(entry, addr, claim, secret)
        except TimeoutError:
            raise HandshakeTimeout(f"{addr}: no answer to a claim within {timeout_s:.3g} s") from None
        except ConnectionRefusedError as exc:
            raise NobodyListens(f"{addr}: {type(exc).__name__}: {exc}") from None
        except (OSError, asyncio.IncompleteReadError) as exc:
            raise PeerUnreachable(f"{addr}: {type(exc).__name__}: {exc}") from None

    async def _on_a_line(
        self, entry: _Address, addr: PeerAddress, claim: Claim, secret: bytes | None
    ) -> tuple[SideMessage, Claim]:
        loop = asyncio.get_running_loop()
        line = self._kept(entry, loop.time())
        for fresh in (line is None, True):
            if line is None:
                line = await self._open(addr, loop.time())
            signed = sign(claim, secret, target=f"{addr.host}:{addr.port}") if secret else claim
            try:
                reply = await roundtrip(line.reader, line.writer, addr, signed)
            except (OSError, asyncio.IncompleteReadError):
                line.close()
                if fresh:
                    raise
                line = None  # the server closed a kept line: once more on a new one
                continue
            except BaseException:
                line.close()  # a timeout mid-reply: its answer would come to the next claim
                raise
            line.uses += 1
            line.last_used = loop.time()
            entry.idle.append(line)
            return reply, signed
        raise AssertionError("unreachable")  # pragma: no cover

    def _kept(self, entry: _Address, now: float) -> _Line | None:
        while entry.idle:
            line = entry.idle.pop()  # the most recently used: the least likely closed by the server
            if not line.broken and now - line.last_used < self._idle_s:
                return line
            line.close()
        return None

    async def _open(self, addr: PeerAddress, now: float) -> _Line:
        try:
            reader, writer = await asyncio.open_connection(addr.host, addr.port)
        except ValueError as exc:  # a host no resolver takes
            raise PeerUnreachable(f"{addr}: bad host: {type(exc).__name__}: {exc}") from None
        self.opened += 1
        return _Line(reader, writer, now)

    async def close(self) -> None:
        for entry in self._addresses.values():
            while entry.idle:
                line = entry.idle.pop()
                line.close()
                with contextlib.suppress(OSError):
                    await line.writer.wait_closed()
        self._addresses.clear()

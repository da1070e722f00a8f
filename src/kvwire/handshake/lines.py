"""D's claims (pull mode) over a few kept connections per P side channel.

Each claim used to open its own TCP connection. A burst of pull requests then opened as many connections
to one P rank at once, past its side channel's budget per peer address (``max_connections_per_host``,
32, without a secret), and the connections over it were refused: measured with 50 requests allocated at
once on one D, 14 loads failed ``handshake_failed`` (300 at once: 185). Claims now queue for one of
``per_address`` connections to each P address; a connection is kept for the next claim only while one
waits for it (the side channel serves several requests per connection), and closed when none does: a
kept idle connection sat in CLOSE_WAIT once the server timed it out, and under a secret (authenticated
connections are never evicted) D processes keeping theirs filled a P listener's 256.

A kept connection the server closed meanwhile (its idle timeout, its requests-per-connection bound) is
found closed on its next use: the claim is signed again (a new nonce: the server's replay guard took the
first) and sent on a fresh connection, once. A claim granted twice only renews P's hold.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from dataclasses import dataclass, field

from kvwire.errors import HandshakeTimeout
from kvwire.handshake.client import network_error, open_stream, roundtrip
from kvwire.handshake.types import PeerAddress
from kvwire.protocol.auth import sign
from kvwire.protocol.messages import Claim, SideMessage

# Connections at once per P address: a vLLM D runs one process per rank on one host (8 ranks: 24), and
# without a secret the side channel takes at most 32 connections from one address.
PER_ADDRESS = 3


@dataclass
class _Line:
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter

    def close(self) -> None:
        self.writer.close()

    @property
    def broken(self) -> bool:
        return self.writer.is_closing() or self.reader.at_eof()


@dataclass
class _Address:
    slots: asyncio.Semaphore
    idle: collections.deque[_Line] = field(default_factory=collections.deque)
    wanted: int = 0  # claims waiting for a line or on one: a line is kept only while this is above 0


def claim_timeout(addr: PeerAddress, timeout_s: float) -> HandshakeTimeout:
    """A claim that got no answer within ``timeout_s`` (this module's, or its caller's whole budget)."""
    return HandshakeTimeout(f"{addr}: no answer to a claim within {timeout_s:.3g} s")


class ClaimLines:
    """Claims sent on kept connections, at most ``per_address`` at once to one P address (the rest wait
    for a free one). One event loop's: create, use and close it on the connector's loop."""

    def __init__(self, per_address: int = PER_ADDRESS) -> None:
        self._per_address = per_address
        self._addresses: dict[tuple[str, int], _Address] = {}
        self.opened = 0  # connections opened, in all (for tests and stats)

    async def send(
        self, addr: PeerAddress, claim: Claim, *, timeout_s: float, secret: bytes | None
    ) -> tuple[SideMessage, Claim]:
        """P's reply to ``claim`` and the claim as sent (signed: the reply's seal is bound to it), within
        ``timeout_s``, waiting for a line included; the network's failures as ``kvwire.errors``."""
        key = (addr.host, addr.port)
        entry = self._addresses.get(key)
        if entry is None:
            entry = self._addresses[key] = _Address(asyncio.Semaphore(self._per_address))
        entry.wanted += 1
        try:
            async with asyncio.timeout(timeout_s), entry.slots:
                return await self._on_a_line(entry, addr, claim, secret)
        except TimeoutError:
            raise claim_timeout(addr, timeout_s) from None
        except (OSError, asyncio.IncompleteReadError) as exc:
            raise network_error(addr, exc) from None
        finally:
            entry.wanted -= 1
            if not entry.wanted:  # nobody left for the kept lines: closed, and the address forgotten
                while entry.idle:
                    entry.idle.pop().close()
                if self._addresses.get(key) is entry:
                    del self._addresses[key]

    async def _on_a_line(
        self, entry: _Address, addr: PeerAddress, claim: Claim, secret: bytes | None
    ) -> tuple[SideMessage, Claim]:
        line = self._kept(entry)
        for fresh in (line is None, True):
            if line is None:
                line = await self._open(addr)
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
            entry.idle.append(line)  # for a claim waiting now; closed in ``send`` when none is
            return reply, signed
        raise AssertionError("unreachable")  # pragma: no cover

    def _kept(self, entry: _Address) -> _Line | None:
        while entry.idle:
            line = entry.idle.pop()
            if not line.broken:
                return line
            line.close()
        return None

    async def _open(self, addr: PeerAddress) -> _Line:
        reader, writer = await open_stream(addr)
        self.opened += 1
        return _Line(reader, writer)

    async def close(self) -> None:
        for entry in self._addresses.values():
            while entry.idle:
                line = entry.idle.pop()
                line.close()
                with contextlib.suppress(OSError):
                    await line.writer.wait_closed()
        self._addresses.clear()

"""SideChannelServer.close() racing connections that were just accepted.

A connection accepted in the same loop step as ``close()`` has a handler task that has not run yet: if it
is cancelled before its first step its ``finally`` never runs, so the server itself must close the
socket, or the GC finds it open (a ResourceWarning, an error under pytest). Many rounds make the race
certain to happen; every socket must be closed by ``close()``.
"""

from __future__ import annotations

import asyncio
import gc
import socket
import warnings

from kvwire.handshake.server import SideChannelServer
from kvwire.kv.spec import KVSpec
from kvwire.testing.handshake_env import build_registered_engine
from kvwire.transport.inproc import InprocFabric

SPEC = KVSpec(num_layers=2, kv_heads=2, head_dim=4, block_size=4)
ROUNDS = 150


async def _round(server_args: tuple[object, ...], clients: int, yields: int) -> None:
    info, ranks = server_args
    server = SideChannelServer(info, ranks)  # type: ignore[arg-type]
    port = await server.start()
    # Plain blocking sockets: the kernel completes their handshakes from the backlog, so the loop
    # accepts them only when it next polls; ``yields`` steps later close() lands between the accept,
    # the protocol's connection_made and the handler's first step.
    socks = [socket.create_connection(("127.0.0.1", port), timeout=5.0) for _ in range(clients)]
    try:
        for _ in range(yields):
            await asyncio.sleep(0)
        await server.close()
    finally:
        for sock in socks:
            sock.close()


def test_close_closes_every_accepted_connection() -> None:
    fabric = InprocFabric()
    info, ranks = build_registered_engine("P", SPEC, 4, fabric.create_agent)

    async def main() -> None:
        for i in range(ROUNDS):
            await _round((info, ranks), 1 + i % 3, i % 8)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        asyncio.run(asyncio.wait_for(main(), 30))
        gc.collect()
    leaked = [w for w in caught if issubclass(w.category, ResourceWarning)]
    assert not leaked, f"{len(leaked)} sockets left open, e.g. {leaked[0].message}"
    for rank in ranks:
        rank.agent.close()

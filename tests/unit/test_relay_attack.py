"""The relay attack of issue 11, replayed step by step against a P and a D that share a secret.

An outsider knowing no secret, with listeners of its own on 127.0.0.1, once wrote into D's cache: it made D
sign a ``get_metadata`` to its listener (a decode leg naming it as P), relayed that request to P and got
P's metadata; it made P sign a full ``get_metadata`` (a ``push_reg`` naming its listener) and relayed that
to D for D's region map; then it wrote. Each step must now fail, and a real request still work after it.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from kvwire.connector import ConsumerEvent, ConsumerEventKind, RemoteEngine
from kvwire.handshake.server import engine_compat_hash
from kvwire.kv.spec import KVSpec
from kvwire.protocol.codec import (
    FRAME_HEADER_BYTES,
    decode_side,
    encode_frame,
    encode_notif,
    parse_frame_header,
)
from kvwire.protocol.messages import (
    ErrorCode,
    ErrorReply,
    FailReason,
    GetMetadata,
    KVInfo,
    Metadata,
    PushReg,
)
from kvwire.protocol.seal import NotifSeal
from kvwire.testing.connector_env import Pair, wait_for
from kvwire.testing.engines import same_bytes, untouched_blocks_zero
from kvwire.transport.base import make_agent_name

SPEC = KVSpec(num_layers=2, kv_heads=2, head_dim=8, block_size=4)
SECRET = b"cluster-secret-0123456789abcdef"


@dataclass
class Listener:
    """The outsider's side-channel listener: records what engines send it and answers with
    ``answer(request_frame) -> reply_frame`` (a relay to a real engine, or a forgery)."""

    pair: Pair
    answer: object = None
    requests: list[GetMetadata] = field(default_factory=list)
    replies: list[object] = field(default_factory=list)
    connections: int = 0
    port: int = 0

    def start(self) -> int:
        async def go() -> int:
            self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
            return int(self._server.sockets[0].getsockname()[1])

        self.port = self.pair.loop.run(go(), 5.0)
        return self.port

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            header = await reader.readexactly(FRAME_HEADER_BYTES)
            frame = header + await reader.readexactly(parse_frame_header(header))
            req = decode_side(frame[FRAME_HEADER_BYTES:])
            assert isinstance(req, GetMetadata)
            self.requests.append(req)
            if callable(self.answer):
                reply = await self.answer(frame)
                self.replies.append(decode_side(reply[FRAME_HEADER_BYTES:]))
                writer.write(reply)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    def close(self) -> None:
        async def stop() -> None:
            self._server.close()

        self.pair.loop.run(stop(), 5.0)


async def _relay(port: int, frame: bytes) -> bytes:
    """Send one captured frame to a real side channel and return its answer, as the outsider did."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(frame)
    await writer.drain()
    header = await reader.readexactly(FRAME_HEADER_BYTES)
    body = await reader.readexactly(parse_frame_header(header))
    writer.close()
    return header + body


def _decode_leg_to(pair: Pair, tid: str, port: int, d_blocks: list[int]) -> list[ConsumerEvent]:
    """What an outsider's POST of a decode leg does: D allocates and handshakes with the named address."""
    p = pair.p.engine
    pair.consumer.request_allocated(tid, d_blocks, 8, 0, RemoteEngine(p.engine_id, "127.0.0.1", port))
    return list(pair.d_event(tid))


def test_every_step_of_the_relay_attack_fails_and_real_requests_still_work() -> None:
    pair = Pair(SPEC, secret=SECRET)
    relay = Listener(pair)
    forger = Listener(pair)
    sink = Listener(pair)
    try:
        # Step 1: D signs a request to the outsider's listener, which relays it to P. P refuses it: it was
        # signed for another side channel. D gets P's refusal (plain: it grants nothing) and fails the leg.
        relay.answer = lambda frame: _relay(pair.p_port, frame)
        events = _decode_leg_to(pair, "atk-1", relay.start(), [1, 2])
        assert len(relay.requests) == 1 and relay.requests[0].target == f"127.0.0.1:{relay.port}"
        assert isinstance(relay.replies[0], ErrorReply) and relay.replies[0].code is ErrorCode.UNAUTHORIZED
        assert "not for this side channel" in relay.replies[0].message
        assert events[0].kind is ConsumerEventKind.FAILED and events[0].reason is FailReason.UNAUTHORIZED
        assert pair.producer.stats.transfers_started == 0

        # Step 1, forged: the outsider answers D itself with metadata of its own (an agent it controls).
        # Without the secret it cannot seal it, so D refuses it before loading anything.
        rogue = pair.fabric.create_agent("rogue/x/pp0/tp0")
        fake = Metadata(
            engine_id=pair.p.engine.engine_id,
            incarnation=pair.p.engine.incarnation,
            compat_hash=engine_compat_hash(pair.p.engine),
            tp_size=1,
            tp_rank=0,
            pp_size=1,
            pp_rank=0,
            agent_name=rogue.name,
            agent_metadata=rogue.metadata(),
            kv=KVInfo(
                num_layers=SPEC.num_layers,
                first_layer=0,
                kv_heads=SPEC.kv_heads,
                head_dim=SPEC.head_dim,
                dtype=SPEC.dtype,
                block_size=SPEC.block_size,
                layout=SPEC.layout.value,
                mla=False,
            ),
            num_blocks=pair.num_blocks,
        )

        async def forged(frame: bytes) -> bytes:
            return encode_frame(fake)

        forger.answer = forged
        events = _decode_leg_to(pair, "atk-2", forger.start(), [3, 4])
        assert events[0].kind is ConsumerEventKind.FAILED and events[0].reason is FailReason.UNAUTHORIZED

        # Step 2: a push_reg naming the outsider's second listener, sent to P from an agent named like a
        # D life: P drops it unauthenticated (unsealed, or sealed under a guessed key) and dials nobody.
        d = pair.d.engine
        posing = pair.fabric.create_agent(make_agent_name(d.engine_id, "other-life", 0, 0))
        pair.on_loop(lambda: posing.add_peer(pair.p_agent().conn_metadata()))
        reg = PushReg(
            transfer_id="atk-3",
            engine_id=d.engine_id,
            incarnation="other-life",
            tp_rank=0,
            tp_size=1,
            host="127.0.0.1",
            port=sink.start(),
            block_ids=[5, 6],
            num_tokens=8,
        )
        p_name = pair.p_agent().name
        unsealed = encode_notif(reg)
        guessed = NotifSeal(b"a guess").seal(posing.name, p_name, unsealed)
        for raw in (unsealed, guessed):
            pair.on_loop(lambda r=raw: posing.send_notif(p_name, r))
        dropped = pair.producer.stats.dropped_notifs
        wait_for(lambda: dropped["unauthenticated"] == 2, "both forged push_regs dropped")
        assert sink.connections == 0 and pair.producer.stats.handshakes_started == 0

        # Nothing was written into D, and a real request between the two engines still works.
        assert untouched_blocks_zero(pair.d.ranks, [])
        kv = pair.fill_p([0, 1], 8)
        pair.consumer.request_allocated("real", [7, 8], 8, 0, pair.remote())
        pair.producer.request_finished("real", [0, 1], 8)
        assert [e.kind for e in pair.d_event("real")] == [ConsumerEventKind.READY]
        assert same_bytes(pair.d_tokens([7, 8], range(8)), kv)
        assert dropped["unauthenticated"] == 2  # the real, sealed notifications were all taken
        assert pair.consumer.stats.dropped_notifs["unauthenticated"] == 0
    finally:
        for listener in (relay, forger, sink):
            if listener.port:
                listener.close()
        pair.close()

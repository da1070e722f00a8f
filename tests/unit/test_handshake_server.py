"""The side-channel server: replies per wire contract v1, and an error frame for every refusal."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import msgspec
import pytest

from kvwire.config import env_config
from kvwire.errors import AuthError, ConfigError
from kvwire.handshake.manager import HandshakeManager
from kvwire.handshake.server import SideChannelServer
from kvwire.kv.spec import KVSpec
from kvwire.protocol.auth import sign
from kvwire.protocol.codec import FrameDecoder, decode_side, encode_frame
from kvwire.protocol.compat import compat_hash
from kvwire.protocol.messages import (
    MAX_FRAME_BYTES,
    ErrorCode,
    ErrorReply,
    GetMetadata,
    Metadata,
    Sealed,
    SideMessage,
    TransferMode,
)
from kvwire.protocol.seal import NotifGate, ReplySeal
from kvwire.startup import check_exposure
from kvwire.testing.handshake_env import build_registered_engine
from kvwire.transport.base import PeerMode
from kvwire.transport.inproc import InprocFabric

SPEC = KVSpec(num_layers=4, kv_heads=4, head_dim=8, block_size=4)
SECRET = b"s3cret"


def run(coro_fn: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(coro_fn(), 20))  # type: ignore[arg-type]


def make_server(secret: bytes | None = None, tp_size: int = 2, pp_size: int = 2) -> SideChannelServer:
    fabric = InprocFabric()
    info, ranks = build_registered_engine(
        "P", SPEC, 16, fabric.create_agent, tp_size=tp_size, pp_size=pp_size
    )
    return SideChannelServer(info, ranks, secret=secret)


async def exchange(port: int, payload: bytes, expect: int = 1) -> tuple[list[SideMessage], bool]:
    """Send raw bytes, read ``expect`` replies, then report whether the server closed the connection."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(payload)
    await writer.drain()
    decoder = FrameDecoder()
    out: list[SideMessage] = []
    closed = False
    for _ in range(100):
        quiet = 5.0 if len(out) < expect else 0.05
        try:
            chunk = await asyncio.wait_for(reader.read(65536), quiet)
        except TimeoutError:
            break
        if not chunk:
            closed = True
            break
        out += decoder.feed(chunk)
    writer.close()
    await writer.wait_closed()
    return out, closed


def test_full_request_gets_regions_and_full_metadata() -> None:
    async def body() -> None:
        async with make_server() as server:
            replies, closed = await exchange(server.port, encode_frame(GetMetadata(pp_rank=1, tp_rank=1)))
            assert not closed and len(replies) == 1
            md = replies[0]
            assert isinstance(md, Metadata)
            rank = next(r for r in server._ranks.values() if (r.pp_rank, r.tp_rank) == (1, 1))
            assert md.agent_name == rank.agent.name
            assert md.agent_metadata == rank.agent.metadata()
            assert not md.notif_only
            assert (md.engine_id, md.incarnation) == (server.engine.engine_id, server.engine.incarnation)
            assert md.compat_hash == compat_hash(
                model_id="test-model", spec=SPEC, transfer_mode=TransferMode.PUSH
            )
            assert (md.tp_size, md.tp_rank, md.pp_size, md.pp_rank) == (2, 1, 2, 1)
            assert (md.kv.first_layer, md.kv.num_layers, md.kv.kv_heads) == (2, 2, 4)
            got = [(r.layer, r.kind, r.base_addr, r.block_len, r.num_blocks) for r in md.regions]
            want = [
                (r.layer, r.kind.value, r.base_addr, r.block_len, r.num_blocks) for r in rank.cache.regions()
            ]
            assert got == want and len(got) == 4
            assert md.server_time > 0

    run(body)


def test_notif_only_request_gets_connection_metadata_and_no_regions() -> None:
    async def body() -> None:
        async with make_server() as server:
            req = GetMetadata(pp_rank=0, tp_rank=1, notif_only=True)
            replies, _ = await exchange(server.port, encode_frame(req))
            md = replies[0]
            assert isinstance(md, Metadata)
            rank = server._ranks[(0, 1)]
            assert md.notif_only and md.regions == []
            assert md.agent_metadata == rank.agent.conn_metadata() != rank.agent.metadata()
            assert server.stats.replies["notif_only"] == 1

    run(body)


def test_several_requests_share_a_connection() -> None:
    async def body() -> None:
        async with make_server() as server:
            payload = b"".join(encode_frame(GetMetadata(pp_rank=0, tp_rank=t % 2)) for t in range(5))
            replies, closed = await exchange(server.port, payload, expect=5)
            assert not closed
            assert [m.tp_rank for m in replies if isinstance(m, Metadata)] == [0, 1, 0, 1, 0]
            assert server.stats.connections == 1

    run(body)


def test_unknown_rank_is_refused_and_connection_stays_usable() -> None:
    async def body() -> None:
        async with make_server() as server:
            payload = encode_frame(GetMetadata(pp_rank=0, tp_rank=7)) + encode_frame(
                GetMetadata(pp_rank=0, tp_rank=0)
            )
            replies, closed = await exchange(server.port, payload, expect=2)
            assert isinstance(replies[0], ErrorReply) and replies[0].code is ErrorCode.NO_SUCH_RANK
            assert isinstance(replies[1], Metadata) and not closed

    run(body)


ENC = msgspec.msgpack.Encoder()


def frame(body: bytes) -> bytes:
    return len(body).to_bytes(4, "big") + body


@pytest.mark.parametrize(
    ("payload", "code"),
    [
        (frame(b"\xc1garbage"), ErrorCode.BAD_REQUEST),
        (
            frame(ENC.encode({"type": "get_metadata", "version": 1, "pp_rank": "x", "tp_rank": 0})),
            ErrorCode.BAD_REQUEST,
        ),
        (
            frame(ENC.encode({"type": "get_metadata", "version": 1, "pp_rank": -1, "tp_rank": 0})),
            ErrorCode.BAD_REQUEST,
        ),
        (frame(ENC.encode({"type": "launch_missiles", "version": 1})), ErrorCode.BAD_REQUEST),
        (
            frame(ENC.encode({"type": "get_metadata", "version": 2, "pp_rank": 0, "tp_rank": 0})),
            ErrorCode.INCOMPATIBLE,
        ),
        (frame(ENC.encode([1, 2, 3])), ErrorCode.BAD_REQUEST),
        ((MAX_FRAME_BYTES + 1).to_bytes(4, "big"), ErrorCode.BAD_REQUEST),
        ((0).to_bytes(4, "big"), ErrorCode.BAD_REQUEST),
        (
            encode_frame(ErrorReply(code=ErrorCode.BAD_REQUEST, message="a reply is no request")),
            ErrorCode.BAD_REQUEST,
        ),
    ],
    ids=[
        "garbage",
        "wrong-type",
        "negative-rank",
        "unknown-type",
        "newer-version",
        "not-a-map",
        "oversized",
        "empty",
        "reply-as-request",
    ],
)
def test_bad_frames_get_an_error_then_the_connection_closes(payload: bytes, code: ErrorCode) -> None:
    async def body() -> None:
        async with make_server() as server:
            # A valid request after the bad frame must not be answered: the stream is out of sync.
            replies, closed = await exchange(
                server.port, payload + encode_frame(GetMetadata(pp_rank=0, tp_rank=0))
            )
            assert closed
            assert len(replies) == 1
            assert isinstance(replies[0], ErrorReply) and replies[0].code is code
            # The server survived: a new connection is served.
            replies, _ = await exchange(server.port, encode_frame(GetMetadata(pp_rank=0, tp_rank=0)))
            assert isinstance(replies[0], Metadata)

    run(body)


def test_truncated_frame_then_eof_does_not_crash_the_server() -> None:
    async def body() -> None:
        async with make_server() as server:
            whole = encode_frame(GetMetadata(pp_rank=0, tp_rank=0))
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            writer.write(whole[:-3])
            writer.write_eof()
            assert await asyncio.wait_for(reader.read(), 5) == b""
            writer.close()
            replies, _ = await exchange(server.port, whole)
            assert isinstance(replies[0], Metadata)

    run(body)


def test_idle_connection_is_closed() -> None:
    async def body() -> None:
        fabric = InprocFabric()
        info, ranks = build_registered_engine("P", SPEC, 16, fabric.create_agent)
        async with SideChannelServer(info, ranks, idle_timeout_s=0.2) as server:
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            assert await asyncio.wait_for(reader.read(), 5) == b""
            writer.close()

    run(body)


def test_auth_good_missing_wrong_and_replayed() -> None:
    async def body() -> None:
        async with make_server(secret=SECRET) as server:
            me = f"127.0.0.1:{server.port}"
            good = sign(GetMetadata(pp_rank=0, tp_rank=0), SECRET, target=me)
            replies, _ = await exchange(server.port, encode_frame(good))
            # The answer goes sealed: it opens, with the secret, as the metadata of that request only.
            assert isinstance(replies[0], Sealed)
            opened = decode_side(ReplySeal(SECRET).open(replies[0], good))
            assert isinstance(opened, Metadata) and opened.engine_id == server.engine.engine_id
            other = sign(GetMetadata(pp_rank=0, tp_rank=0), SECRET, target=me)
            with pytest.raises(AuthError):
                ReplySeal(SECRET).open(replies[0], other)
            with pytest.raises(AuthError):
                ReplySeal(b"other").open(replies[0], good)
            for bad in (
                GetMetadata(pp_rank=0, tp_rank=0),  # missing
                sign(GetMetadata(pp_rank=0, tp_rank=0), b"other", target=me),  # wrong secret
                msgspec.structs.replace(good, tp_rank=1),  # tampered after signing
                good,  # replayed
                # signed by a real peer for another side channel (an outsider's), relayed here
                sign(GetMetadata(pp_rank=0, tp_rank=0), SECRET, target="127.0.0.1:1"),
                # made long ago (a captured request, the guard of that time gone with a restart)
                sign(GetMetadata(pp_rank=0, tp_rank=0), SECRET, target=me, now_ms=1_000),
            ):
                replies, closed = await exchange(server.port, encode_frame(bad))
                assert isinstance(replies[0], ErrorReply), bad
                assert replies[0].code is ErrorCode.UNAUTHORIZED
                # Then the connection closes: one that cannot prove the secret gets no second try on it (it
                # kept the slot, later requests with the long idle deadline: a lock-out from the address).
                assert closed
            assert server.stats.replies[ErrorCode.UNAUTHORIZED.value] == 6

    run(body)


def test_close_drops_open_connections_and_is_idempotent() -> None:
    async def body() -> None:
        server = make_server()
        port = await server.start()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        await server.close()
        assert await asyncio.wait_for(reader.read(), 5) == b""
        writer.close()
        await server.close()
        with pytest.raises(OSError):
            await asyncio.open_connection("127.0.0.1", port)

    run(body)


def test_rank_whose_agent_is_closed_is_refused_not_crashed() -> None:
    async def body() -> None:
        async with make_server() as server:
            server._ranks[(0, 1)].agent.close()
            payload = encode_frame(GetMetadata(pp_rank=0, tp_rank=1)) + encode_frame(
                GetMetadata(pp_rank=0, tp_rank=0)
            )
            replies, closed = await exchange(server.port, payload, expect=2)
            assert isinstance(replies[0], ErrorReply) and replies[0].code is ErrorCode.NO_SUCH_RANK
            assert "unavailable" in replies[0].message
            assert isinstance(replies[1], Metadata) and not closed

    run(body)


def test_a_newcomer_over_the_per_host_cap_evicts_the_oldest_idle_connection() -> None:
    """A peer holding connections open cannot keep a newcomer out: past the cap the oldest connection that
    waits for a request is closed (counted) to admit the new one, which is served."""

    async def body() -> None:
        fabric = InprocFabric()
        info, ranks = build_registered_engine("P", SPEC, 16, fabric.create_agent)
        async with SideChannelServer(info, ranks, max_connections_per_host=3) as server:
            held = [await asyncio.open_connection("127.0.0.1", server.port) for _ in range(3)]
            await asyncio.sleep(0.05)  # let the server accept them
            replies, _ = await exchange(server.port, encode_frame(GetMetadata(pp_rank=0, tp_rank=0)))
            assert isinstance(replies[0], Metadata)
            assert await asyncio.wait_for(held[0][0].read(), 5) == b""  # the oldest idle one went
            assert server.stats.evicted_connections == 1 and server.stats.refused_connections == 0
            for _, w in held:
                w.close()

    run(body)


def test_a_newcomer_evicts_the_connection_whose_frame_began_first_when_none_is_idle() -> None:
    """Connections that begin a frame and trickle it (no secret needed) used to be unevictable: the host's
    slots stayed theirs and the peer's real handshakes from that address were refused."""

    async def body() -> None:
        fabric = InprocFabric()
        info, ranks = build_registered_engine("P", SPEC, 16, fabric.create_agent)
        async with SideChannelServer(info, ranks, max_connections_per_host=3) as server:
            held = []
            for _ in range(3):
                held.append(await asyncio.open_connection("127.0.0.1", server.port))
                held[-1][1].write((100).to_bytes(4, "big") + b"\x80")  # a frame begun, then a trickle
                await asyncio.sleep(0.05)
            replies, _ = await exchange(server.port, encode_frame(GetMetadata(pp_rank=0, tp_rank=0)))
            assert isinstance(replies[0], Metadata)
            assert await asyncio.wait_for(held[0][0].read(), 5) == b""  # the first frame begun went
            assert server.stats.evicted_connections == 1 and server.stats.refused_connections == 0
            for _, w in held:
                w.close()

    run(body)


@pytest.mark.parametrize("secret", [None, SECRET], ids=["no-secret", "secret"])
def test_idle_connections_from_the_peers_address_do_not_stop_a_real_handshake(secret: bytes | None) -> None:
    """Issue 23: 40 idle connections from 127.0.0.1 (over the 32 a host may hold) and a real handshake from
    the same address, with no retry: it is served."""

    async def body() -> None:
        fabric = InprocFabric()
        info, ranks = build_registered_engine("P", SPEC, 16, fabric.create_agent)
        d_info, d_ranks = build_registered_engine("D", SPEC, 16, fabric.create_agent)
        async with SideChannelServer(info, ranks, secret=secret) as server:
            idle = [await asyncio.open_connection("127.0.0.1", server.port) for _ in range(40)]
            await asyncio.sleep(0.05)
            mgr = HandshakeManager(
                d_info, d_ranks[0], timeout_s=2.0, retries=0, secret=secret, clock_samples=1
            )
            peer = await mgr.ensure("127.0.0.1", server.port, 0, 0, PeerMode.NOTIF_ONLY)
            assert peer.engine_id == "P"
            assert server.stats.evicted_connections >= 9 and server.stats.refused_connections == 0
            assert server.stats.authenticated_connections == (1 if secret else 0)
            await mgr.close()
            for _, w in idle:
                w.close()

    run(body)


def test_an_authenticated_connection_is_never_evicted() -> None:
    async def body() -> None:
        async with make_server(secret=SECRET) as server:
            server._max_per_host = 2
            me = f"127.0.0.1:{server.port}"
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            for round_ in range(2):
                if round_:  # between the two requests: more idle newcomers than the host may hold
                    idle = [await asyncio.open_connection("127.0.0.1", server.port) for _ in range(6)]
                    await asyncio.sleep(0.05)
                writer.write(encode_frame(sign(GetMetadata(pp_rank=0, tp_rank=0), SECRET, target=me)))
                decoder, got = FrameDecoder(), list[SideMessage]()
                while not got:
                    chunk = await asyncio.wait_for(reader.read(65536), 5)
                    assert chunk, "the authenticated connection was closed"
                    got = decoder.feed(chunk)
                assert isinstance(got[0], Sealed)
            assert server.stats.authenticated_connections == 1 and server.stats.evicted_connections >= 4
            writer.close()
            for _, w in idle:
                w.close()

    run(body)


@pytest.mark.parametrize("later", [False, True], ids=["first", "later"])
def test_a_request_that_trickles_is_closed_after_the_short_deadline(later: bool) -> None:
    """The first request has 0.2 s from accept; a later one may begin after an idle wait (up to 30 s here),
    and its body then has the same 0.2 s (before, a trickling later request held its slot 30 s)."""

    async def body() -> None:
        fabric = InprocFabric()
        info, ranks = build_registered_engine("P", SPEC, 16, fabric.create_agent)
        async with SideChannelServer(info, ranks, idle_timeout_s=30, first_request_timeout_s=0.2) as server:
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            if later:
                writer.write(encode_frame(GetMetadata(pp_rank=0, tp_rank=0)))
                assert FrameDecoder().feed(await asyncio.wait_for(reader.read(65536), 5))
                await asyncio.sleep(0.5)  # idle between requests: the idle timeout applies
                writer.write((100).to_bytes(4, "big") + b"\x80")  # the next frame begins, then a trickle
            else:
                writer.write(b"\x00\x00")  # a trickle: half a header, then nothing
            t0 = asyncio.get_running_loop().time()
            assert await asyncio.wait_for(reader.read(), 5) == b""
            assert asyncio.get_running_loop().time() - t0 < 2.0
            writer.close()

    run(body)


def test_an_accepted_second_secret_verifies_and_seals_under_the_requesters_secret() -> None:
    """KVWIRE_SECRET_ACCEPT: a request signed with the accepted secret verifies, and its reply is sealed
    under that secret (the one the requester holds), not under the server's own; a third secret is
    refused as before."""
    new = b"rotated-secret-0123456789abcdef01"

    async def body() -> None:
        fabric = InprocFabric()
        info, ranks = build_registered_engine("P", SPEC, 16, fabric.create_agent, tp_size=1, pp_size=1)
        async with SideChannelServer(info, ranks, secret=SECRET, accept_secret=new) as server:
            me = f"127.0.0.1:{server.port}"
            for key in (SECRET, new):
                req = sign(GetMetadata(pp_rank=0, tp_rank=0), key, target=me)
                replies, _ = await exchange(server.port, encode_frame(req))
                assert isinstance(replies[0], Sealed)
                assert isinstance(decode_side(ReplySeal(key).open(replies[0], req)), Metadata)
                other = new if key == SECRET else SECRET
                with pytest.raises(AuthError):
                    ReplySeal(other).open(replies[0], req)
            third = sign(GetMetadata(pp_rank=0, tp_rank=0), b"third-secret-0123456789abcdef0123", target=me)
            replies, _ = await exchange(server.port, encode_frame(third))
            assert isinstance(replies[0], ErrorReply) and replies[0].code is ErrorCode.UNAUTHORIZED

    run(body)


def test_notifications_are_tagged_with_the_own_secret_and_taken_under_either() -> None:
    new = b"rotated-secret-0123456789abcdef01"
    rotating, old_only, new_only = NotifGate(SECRET, new), NotifGate(SECRET), NotifGate(new)
    sealed = rotating.outgoing("a", "b", b"hello")
    assert old_only.incoming("a", "b", sealed) == b"hello"  # signs with its own (the old) secret only
    with pytest.raises(AuthError):
        new_only.incoming("a", "b", sealed)
    assert rotating.incoming("a", "b", new_only.outgoing("a", "b", b"hi")) == b"hi"
    with pytest.raises(AuthError):  # a third secret, or a tag made for another receiver: refused
        rotating.incoming("a", "c", new_only.outgoing("a", "b", b"hi"))


def test_the_accepted_secret_needs_an_own_one() -> None:
    with pytest.raises(ConfigError, match="KVWIRE_SECRET_ACCEPT is set but KVWIRE_SECRET is not"):
        env_config({"KVWIRE_SECRET_ACCEPT": "x" * 32})
    env = env_config({"KVWIRE_SECRET": "a" * 32, "KVWIRE_SECRET_ACCEPT": "a" * 32})
    assert env.accept_secret is None  # the same secret twice: nothing more to accept
    env = env_config({"KVWIRE_SECRET": "a" * 32, "KVWIRE_SECRET_ACCEPT": "b" * 32})
    assert (env.secret, env.accept_secret) == (b"a" * 32, b"b" * 32)


def test_a_short_accepted_secret_is_warned_of_like_a_short_secret(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="kvwire"):
        check_exposure("127.0.0.1", b"s" * 32, False, accept=b"abc")
    assert [r.getMessage()[:33] for r in caplog.records] == ["KVWIRE_SECRET_ACCEPT is 3 bytes: "]

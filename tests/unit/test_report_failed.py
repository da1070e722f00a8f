"""D is told at once when P cannot complete its handshake with D (issue 11, item 5): P's ``failed`` goes
to D's side channel as a ``report_failed``, since no notification can reach a D that P could not load."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import msgspec
import pytest

from kvwire.connector import ConnectorConfig, ConsumerEventKind, ProducerOutcome
from kvwire.connector.reports import Reporter
from kvwire.core.io import ReportFailure
from kvwire.errors import HandshakeError, NoSuchRank, Unauthorized
from kvwire.handshake.client import send_report
from kvwire.handshake.types import PeerAddress
from kvwire.kv.spec import KVSpec
from kvwire.protocol.auth import sign
from kvwire.protocol.codec import (
    FRAME_HEADER_BYTES,
    decode_side,
    encode_body,
    encode_frame,
    encode_notif,
    parse_frame_header,
)
from kvwire.protocol.messages import (
    Ack,
    ErrorCode,
    ErrorReply,
    Failed,
    FailReason,
    PushReg,
    ReportFailed,
    Sealed,
)
from kvwire.protocol.seal import ReplySeal
from kvwire.testing.connector_env import Pair, wait_for
from kvwire.testing.engines import same_bytes, untouched_blocks_zero
from kvwire.transport.base import make_agent_name

SPEC = KVSpec(num_layers=2, kv_heads=2, head_dim=8, block_size=4)
SECRET = b"report-secret-0123456789abcdef00"
CFG = ConnectorConfig(handshake_timeout_s=0.5, liveness_timeout_s=20.0, heartbeat_interval_s=1.0)


def test_p_handshake_timeout_with_d_fails_d_at_once_not_at_its_liveness() -> None:
    pair = Pair(SPEC, config=CFG, secret=SECRET)
    try:
        # P's loads of D's agent hang (an unreachable UCX port): P's handshake with D times out.
        pair.p_agent().faults.stall_loads_s = 5.0
        pair.fill_p([0, 1], 8)
        start = time.monotonic()
        pair.consumer.request_allocated("r1", [2, 3], 8, 0, pair.remote())
        pair.producer.request_finished("r1", [0, 1], 8)
        events = pair.d_event("r1")
        took = time.monotonic() - start
        assert [e.kind for e in events] == [ConsumerEventKind.FAILED, ConsumerEventKind.RELEASED]
        assert events[0].reason is FailReason.HANDSHAKE_FAILED
        # Within the handshake timeout and some slack; D's liveness verdict would take 20 s.
        assert took < CFG.handshake_timeout_s + 3.0, took
        assert pair.p_event("r1").outcome is ProducerOutcome.FAILED
        assert pair.consumer.stats.peers_declared_dead == 0
    finally:
        pair.close()


def _report(pair: Pair, tid: str, **kw: object) -> ReportFailed:
    p = pair.p.engine
    fields: dict[str, object] = {
        "pp_rank": 0,
        "tp_rank": 0,
        "to_incarnation": pair.d.engine.incarnation,
        "transfer_id": tid,
        "engine_id": p.engine_id,
        "incarnation": p.incarnation,
        "from_pp_rank": 0,
        "from_tp_rank": 0,
        "reason": FailReason.INCOMPATIBLE.value,
    }
    fields.update(kw)
    return ReportFailed(**fields)  # type: ignore[arg-type]


def _send(pair: Pair, report: ReportFailed, secret: bytes | None) -> None:
    addr = PeerAddress("127.0.0.1", pair.consumer.port, report.pp_rank, report.tp_rank)
    pair.loop.run(send_report(addr, report, timeout_s=2.0, secret=secret), 5.0)


def test_reports_are_authenticated_checked_and_taken_as_the_failed_they_stand_for() -> None:
    pair = Pair(SPEC, config=CFG, secret=SECRET)
    try:
        # Hold the request in D: P never finishes it, so D waits for P.
        pair.consumer.request_allocated("r2", [2, 3], 8, 0, pair.remote())
        wait_for(
            lambda: pair.producer.stats.transfers_started == 0 and pair.consumer.stats.handshakes_started, ""
        )
        # Without the secret, or for a rank D does not serve: refused, nothing changes.
        with pytest.raises(Unauthorized):
            _send(pair, _report(pair, "r2"), None)
        with pytest.raises(Unauthorized):
            _send(pair, _report(pair, "r2"), b"another secret")
        with pytest.raises(NoSuchRank):
            _send(pair, _report(pair, "r2", tp_rank=3), SECRET)
        with pytest.raises(HandshakeError, match="not this one"):  # for an earlier life of D
            _send(pair, _report(pair, "r2", to_incarnation="earlier-life"), SECRET)
        # Claiming another P life, or a transfer D does not hold: taken by the side channel, dropped by the
        # core exactly as the notification would be.
        _send(pair, _report(pair, "r2", incarnation="old-life"), SECRET)
        _send(pair, _report(pair, "nope"), SECRET)
        dropped = pair.consumer.stats.dropped_notifs
        wait_for(lambda: sum(dropped.values()) == 2, "both dropped")
        assert pair.consumer.poll() == []
        # The real one ends the request with P's reason.
        _send(pair, _report(pair, "r2"), SECRET)
        events = pair.d_event("r2")
        assert events[0].kind is ConsumerEventKind.FAILED and events[0].reason is FailReason.INCOMPATIBLE
    finally:
        pair.close()


def test_p_takes_no_reports() -> None:
    pair = Pair(SPEC, config=CFG)
    try:
        addr = PeerAddress("127.0.0.1", pair.p_port, 0, 0)
        with pytest.raises(Exception, match="takes no report_failed"):
            pair.loop.run(send_report(addr, _report(pair, "x"), timeout_s=2.0), 5.0)
    finally:
        pair.close()


def _action(tid: str, port: int) -> ReportFailure:
    reason = FailReason.INCOMPATIBLE
    failed = Failed(transfer_id=tid, engine_id="p", incarnation="i", tp_rank=0, pp_rank=0, reason=reason)
    return ReportFailure((0, 0), "127.0.0.1", port, (0, 0), failed, "d-life")


def test_reports_to_one_address_go_one_at_a_time_and_stop_when_nobody_answers() -> None:
    """A burst of failed registrations naming one address opens one connection at a time there; once
    nobody answers, the rest of that address's queue is dropped (counted), never a hang."""

    async def body() -> None:
        live, peak, served = 0, 0, 0

        async def ack(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            nonlocal live, peak, served
            live += 1
            peak = max(peak, live)
            header = await reader.readexactly(FRAME_HEADER_BYTES)
            req = decode_side(await reader.readexactly(parse_frame_header(header)))
            assert isinstance(req, ReportFailed)
            await asyncio.sleep(0.002)
            writer.write(encode_frame(Ack()))
            await writer.drain()
            served += 1
            live -= 1
            writer.close()

        server = await asyncio.start_server(ack, "127.0.0.1", 0)
        port = int(server.sockets[0].getsockname()[1])
        reporter = Reporter(timeout_s=2.0, secret=None)
        tasks = [t for t in (reporter.submit(_action(f"t{i}", port)) for i in range(20)) if t is not None]
        assert len(tasks) == 1
        await asyncio.gather(*tasks)
        assert (served, peak, reporter.delivered, reporter.dropped) == (20, 1, 20, 0)
        server.close()

        tasks = [t for t in (reporter.submit(_action(f"u{i}", 1)) for i in range(5)) if t is not None]
        await asyncio.gather(*tasks)
        assert (reporter.delivered, reporter.dropped) == (20, 5)
        # That address stays off for the backoff: a flood naming it opens no connection per message.
        assert reporter.submit(_action("v", 1)) is None and reporter.dropped == 6
        # Without a secret an overload is never reported: the address came in an unauthenticated push_reg.
        over = _action("w", port)
        over = msgspec.structs.replace(
            over, failed=msgspec.structs.replace(over.failed, reason=FailReason.OVERLOADED)
        )
        assert reporter.submit(over) is None and reporter.dropped == 7

    asyncio.run(body())


def test_a_refused_report_does_not_stop_the_next_ones() -> None:
    """D answered (it refused one report, e.g. for a rank it does not serve): the queue goes on."""

    async def body() -> None:
        answers = [ErrorReply(code=ErrorCode.NO_SUCH_RANK, message="no"), Ack(), Ack()]

        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            header = await reader.readexactly(FRAME_HEADER_BYTES)
            await reader.readexactly(parse_frame_header(header))
            writer.write(encode_frame(answers.pop(0)))
            await writer.drain()
            writer.close()

        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        port = int(server.sockets[0].getsockname()[1])
        reporter = Reporter(timeout_s=2.0, secret=None)
        tasks = [t for t in (reporter.submit(_action(f"t{i}", port)) for i in range(3)) if t is not None]
        await asyncio.gather(*tasks)
        assert (reporter.delivered, reporter.dropped) == (2, 1)
        server.close()

    asyncio.run(body())


def test_a_push_reg_of_a_gone_d_life_is_never_written_and_the_new_life_is_told_nothing_it_holds() -> None:
    """A ``push_reg`` from D's previous life (delayed, or replayed by someone naming that life) reaches P
    after D restarted at the same address: P's handshake names that life, the new one answers, so P
    writes nothing; its report names the old life, and the new one refuses it."""
    pair = Pair(SPEC, config=CFG)
    try:
        d = pair.d.engine
        old_agent = make_agent_name(d.engine_id, d.incarnation, 0, 0)
        port = pair.consumer.port
        pair.restart_d()
        ghost = pair.fabric.create_agent(old_agent)  # the old life's name, free again
        pair.on_loop(lambda: ghost.add_peer(pair.p_agent().conn_metadata()))
        reg = PushReg(
            transfer_id="old",
            engine_id=d.engine_id,
            incarnation=d.incarnation,
            tp_rank=0,
            tp_size=1,
            host="127.0.0.1",
            port=port,
            block_ids=[2, 3],
            num_tokens=8,
        )
        pair.fill_p([0, 1], 8)
        pair.producer.request_finished("old", [0, 1], 8)
        pair.on_loop(lambda: ghost.send_notif(pair.p_agent().name, encode_notif(reg)))
        assert pair.p_event("old").outcome is ProducerOutcome.FAILED
        assert pair.producer.stats.transfers_started == 0 and pair.producer.stats.handshakes_failed == 1
        # The report names the old life: the new one refuses it (answered, so P's reporter counts a drop).
        wait_for(lambda: pair.producer.reporter.dropped == 1, "the new life refuses the report")
        assert pair.producer.reporter.delivered == 0 and not pair.consumer.stats.dropped_notifs
        assert untouched_blocks_zero(pair.d.ranks, [])
    finally:
        pair.close()


def test_a_push_reg_p_has_no_room_for_fails_at_d_at_once_as_overloaded() -> None:
    """P's table of registrations waiting for their prefill is full: P drops the push_reg and tells D,
    which fails the request ``overloaded`` at once instead of calling a busy P dead at its liveness.
    (With a secret: without one, P does not dial the address an unauthenticated push_reg names.)"""
    pair = Pair(SPEC, config=dataclasses.replace(CFG, max_early_registrations=1), secret=SECRET)
    try:
        pair.consumer.request_allocated("first", [2, 3], 8, 0, pair.remote())
        wait_for(lambda: pair.on_loop(lambda: pair.producer.core.early_registrations) == 1, "first held")
        start = time.monotonic()
        pair.consumer.request_allocated("second", [4, 5], 8, 0, pair.remote())
        events = pair.d_event("second")
        assert events[0].kind is ConsumerEventKind.FAILED and events[0].reason is FailReason.OVERLOADED
        assert time.monotonic() - start < 3.0
        assert pair.producer.stats.dropped_notifs["overload"] == 1
        # The held one is still served.
        kv = pair.fill_p([0, 1], 8)
        pair.producer.request_finished("first", [0, 1], 8)
        assert [e.kind for e in pair.d_event("first")] == [ConsumerEventKind.READY]
        assert same_bytes(pair.d_tokens([2, 3], range(8)), kv)
    finally:
        pair.close()


@pytest.mark.parametrize("secret", [None, SECRET], ids=["plain", "secret"])
def test_a_report_with_a_reason_d_does_not_know_fails_d_at_once_as_the_notification_would(
    secret: bytes | None,
) -> None:
    """A newer P's reason: D takes the report (acked) and fails the request ``unknown`` at once, counted,
    as it does for the same reason in a ``failed`` notification; it used to refuse the report as
    malformed and wait for its liveness verdict on P (20 s here)."""
    pair = Pair(SPEC, config=CFG, secret=secret)
    try:
        pair.consumer.request_allocated("r3", [2, 3], 8, 0, pair.remote())
        # D has loaded P and registered (a report before that is dropped as from an unknown sender).
        wait_for(lambda: pair.on_loop(lambda: pair.producer.core.early_registrations) == 1, "registered")
        start = time.monotonic()
        _send(pair, _report(pair, "r3", reason="reason_of_a_newer_version"), secret)
        events = pair.d_event("r3")
        assert events[0].kind is ConsumerEventKind.FAILED and events[0].reason is FailReason.UNKNOWN
        assert time.monotonic() - start < 3.0
        assert pair.consumer.stats.failures[FailReason.UNKNOWN] == 1
    finally:
        pair.close()


def _raw_reply(port: int, req: ReportFailed) -> object:
    """D's reply frame to ``req``, as it went on the wire (not opened)."""

    async def ask() -> object:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(encode_frame(req))
        await writer.drain()
        header = await reader.readexactly(FRAME_HEADER_BYTES)
        reply = decode_side(await reader.readexactly(parse_frame_header(header)))
        writer.close()
        return reply

    return asyncio.run(ask())


def test_d_seals_its_refusals_of_a_verified_report_and_sends_its_ack_plain() -> None:
    """docs/protocol.md §4: with a secret, only ``unauthorized`` and the refusals of undecodable frames go
    plain; D sent a verified report's ``no_such_rank`` and ``bad_request`` (another life) plain."""
    pair = Pair(SPEC, config=CFG, secret=SECRET)
    try:
        port = pair.consumer.port
        target = f"127.0.0.1:{port}"
        for bad in (_report(pair, "x", tp_rank=3), _report(pair, "x", to_incarnation="earlier")):
            assert isinstance(_raw_reply(port, sign(bad, SECRET, target=target)), Sealed)
        unsigned = _raw_reply(port, _report(pair, "x"))
        assert isinstance(unsigned, ErrorReply) and unsigned.code is ErrorCode.UNAUTHORIZED
        assert isinstance(_raw_reply(port, sign(_report(pair, "x"), SECRET, target=target)), Ack)
    finally:
        pair.close()


def test_p_opens_a_sealed_refusal_and_rejects_a_plain_one_under_a_secret() -> None:
    """P used to take any plain refusal and reject every sealed one ("Sealed is no ack"): the rule is the
    metadata request's, a refusal other than ``unauthorized``/``bad_request``/``incompatible`` must come
    sealed for this very request."""
    seal = ReplySeal(SECRET)

    async def body() -> None:
        how: list[str] = []

        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            header = await reader.readexactly(FRAME_HEADER_BYTES)
            req = decode_side(await reader.readexactly(parse_frame_header(header)))
            assert isinstance(req, ReportFailed)
            refusal = ErrorReply(code=ErrorCode.NO_SUCH_RANK, message="no rank")
            kind = how.pop(0)
            if req.nonce is None:  # an unsigned request: sealed all the same, as a peer with a secret would
                req = sign(req, SECRET, target="127.0.0.1:1")
            reply = seal.seal(encode_body(refusal), req) if kind == "sealed" else refusal
            writer.write(encode_frame(reply))
            await writer.drain()
            writer.close()

        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        addr = PeerAddress("127.0.0.1", int(server.sockets[0].getsockname()[1]), 0, 0)
        report = ReportFailed(
            pp_rank=0, tp_rank=0, to_incarnation="d", transfer_id="t", engine_id="p", incarnation="i",
            from_pp_rank=0, from_tp_rank=0, reason=FailReason.HANDSHAKE_FAILED.value,
        )  # fmt: skip
        how.append("sealed")
        with pytest.raises(NoSuchRank, match="no rank"):
            await send_report(addr, report, timeout_s=2.0, secret=SECRET)
        how.append("plain")
        with pytest.raises(Unauthorized, match="unsealed no_such_rank"):
            await send_report(addr, report, timeout_s=2.0, secret=SECRET)
        how.append("sealed")  # a secret on one side only
        with pytest.raises(Unauthorized, match="seals its replies"):
            await send_report(addr, report, timeout_s=2.0, secret=None)
        server.close()

    asyncio.run(body())


def test_p_never_dials_a_d_outside_allowed_peers_not_even_to_report() -> None:
    p_cfg = dataclasses.replace(CFG, allowed_peers="10.0.0.0/8")
    pair = Pair(SPEC, config=p_cfg, d_config=CFG, secret=SECRET)
    try:
        server = pair.consumer.side_channel_stats
        assert server is not None
        pair.fill_p([0, 1], 8)
        pair.consumer.request_allocated("r1", [2, 3], 8, 0, pair.remote())
        pair.producer.request_finished("r1", [0, 1], 8)
        assert pair.p_event("r1").outcome is ProducerOutcome.FAILED  # its handshake with D: not allowed
        wait_for(lambda: pair.producer.stats.dropped_notifs["report_undelivered"] == 1, "report dropped")
        assert sum(m.stats.not_allowed for m in pair.producer.managers.values()) == 1
        assert server.replies["report"] == 0 and server.connections == 0  # P opened no connection to D
        assert untouched_blocks_zero(pair.d.ranks, [])
    finally:
        pair.close()


def test_a_report_naming_an_id_no_notification_may_carry_is_refused_not_acked() -> None:
    """A report's ids are bounded as the notification's are: one with a 2,000-character transfer id was
    acked, then dropped as malformed when D re-encoded it as the ``failed`` it stands for."""
    pair = Pair(SPEC, config=CFG)
    try:
        with pytest.raises(HandshakeError, match=r"bad_request: .*length <= 1024 - at `\$.transfer_id`"):
            _send(pair, _report(pair, "x" * 2000), None)
        stats = pair.consumer.side_channel_stats
        assert stats is not None and stats.replies["bad_request"] == 1 and stats.replies["ack"] == 0
        assert sum(pair.consumer.stats.dropped_notifs.values()) == 0
    finally:
        pair.close()

"""Bad input at the connector (DESIGN.md §3 items 1 and 5): bad registrations refused before any write,
and malformed, stale, foreign or unexpected notifications dropped and counted by reason, with no crash
and no byte of either cache touched."""

from __future__ import annotations

import dataclasses
import itertools
import random

import pytest

from kvwire.connector import (
    ConnectorConfig,
    Consumer,
    ConsumerEventKind,
    Producer,
    ProducerOutcome,
    RemoteEngine,
)
from kvwire.errors import ConfigError, TransferIdReused
from kvwire.handshake.server import SideChannelServer
from kvwire.kv.spec import KVSpec
from kvwire.protocol.codec import decode_notif, encode_notif
from kvwire.protocol.messages import (
    Cancel,
    Done,
    Failed,
    FailReason,
    Notification,
    PushReg,
)
from kvwire.testing.connector_env import Pair, wait_for
from kvwire.testing.engines import build_engine, same_bytes, untouched_blocks_zero
from kvwire.transport.base import make_agent_name
from kvwire.transport.inproc import InprocAgent, InprocFabric

SPEC = KVSpec(num_layers=2, kv_heads=2, head_dim=8, block_size=4)
D_BLOCKS = 16
_n = itertools.count()


class BareD:
    """A D engine with its side channel and its agent but no Consumer: the test speaks for it, so it can
    send what a Consumer never would (D validates its own block ids before they reach the wire)."""

    def __init__(self, pair: Pair) -> None:
        self.pair = pair
        self.setup = build_engine(f"bare-d{next(_n)}", SPEC, num_blocks=D_BLOCKS, fabric=pair.fabric)
        rank = self.setup.ranks[0]
        agent = rank.agent
        assert isinstance(agent, InprocAgent)
        self.agent = agent
        pair.on_loop(lambda: agent.register(rank.cache.slab))
        self.server = SideChannelServer(self.setup.engine, self.setup.ranks)
        self.port = pair.loop.run(self.server.start(), 5.0)
        p_md = pair.p_agent().conn_metadata()
        pair.on_loop(lambda: agent.add_peer(p_md))
        self.inbox: list[Notification] = []

    def push_reg(self, tid: str, block_ids: list[int], num_tokens: int) -> None:
        e = self.setup.engine
        msg = PushReg(
            transfer_id=tid,
            engine_id=e.engine_id,
            incarnation=e.incarnation,
            tp_rank=0,
            tp_size=1,
            host="127.0.0.1",
            port=self.port,
            block_ids=block_ids,
            num_tokens=num_tokens,
        )
        p_name = self.pair.p_agent().name
        self.pair.on_loop(lambda: self.agent.send_notif(p_name, encode_notif(msg)))

    def received(self) -> list[Notification]:
        for msgs in self.pair.on_loop(self.agent.drain_notifs).values():
            self.inbox += [decode_notif(m) for m in msgs]
        return self.inbox

    def close(self) -> None:
        self.pair.loop.run(self.server.close(), 5.0)
        self.setup.close()


@pytest.mark.parametrize(
    "d_blocks", [[0, D_BLOCKS], [3, 3], [0, 1, 99]], ids=["out-of-range", "duplicate", "trailing-bad"]
)
@pytest.mark.parametrize("finish_first", [True, False], ids=["finished-first", "registered-first"])
def test_bad_block_ids_are_refused_with_failed_and_nothing_written(
    d_blocks: list[int], finish_first: bool
) -> None:
    pair = Pair(SPEC)
    bare = BareD(pair)
    try:
        pair.fill_p([2, 3], 8)
        if finish_first:
            pair.producer.request_finished("bad", [2, 3], 8)
        bare.push_reg("bad", d_blocks, 8)
        failed = wait_for(lambda: [m for m in bare.received() if isinstance(m, Failed)], "failed to D")
        assert [(m.transfer_id, m.reason, m.tp_rank) for m in failed] == [
            ("bad", FailReason.BAD_REGISTRATION, 0)
        ]
        if not finish_first:
            pair.producer.request_finished("bad", [2, 3], 8)
        assert pair.p_event("bad").outcome is ProducerOutcome.FAILED
        assert pair.producer.stats.failures[FailReason.BAD_REGISTRATION] == 1
        assert pair.producer.stats.transfers_started == 0
        assert untouched_blocks_zero(bare.setup.ranks, [])  # not one byte of D's cache written
        assert not [m for m in bare.received() if isinstance(m, Done)]
    finally:
        bare.close()
        pair.close()


def test_duplicate_push_reg_is_dropped_and_the_first_one_served() -> None:
    pair = Pair(SPEC)
    bare = BareD(pair)
    try:
        pair.fill_p([2, 3], 8)
        pair.producer.request_finished("dup", [2, 3], 8)
        bare.push_reg("dup", [5, 6], 8)
        bare.push_reg("dup", [7, 8], 8)  # a second registration of the same D rank: never written
        wait_for(lambda: [m for m in bare.received() if isinstance(m, Done)], "done to D")
        # Counted on P's loop thread, which may not have polled the second one yet when the done lands.
        wait_for(lambda: pair.producer.stats.dropped_notifs["duplicate"] == 1, "the duplicate dropped")
        wait_for(lambda: pair.producer.stats.transfers_done == 1, "P saw its write end")
        assert pair.producer.stats.transfers_started == 1
        assert untouched_blocks_zero(bare.setup.ranks, [5, 6])
    finally:
        bare.close()
        pair.close()


def _rogue(pair: Pair, name: str, *targets: InprocAgent) -> InprocAgent:
    agent = pair.fabric.create_agent(name)
    for target in targets:
        md = target.conn_metadata()
        pair.on_loop(lambda md=md: agent.add_peer(md))
    return agent


def _done(tid: str, engine_id: str, incarnation: str, tp_rank: int = 0) -> bytes:
    return encode_notif(
        Done(
            transfer_id=tid,
            engine_id=engine_id,
            incarnation=incarnation,
            tp_rank=tp_rank,
            pp_rank=0,
            num_blocks=2,
        )
    )


def test_bad_notifications_to_d_are_dropped_by_reason_and_touch_nothing() -> None:
    pair = Pair(SPEC)
    try:
        d_agent = pair.d.ranks[0].agent
        assert isinstance(d_agent, InprocAgent)
        p_agent = pair.p_agent()
        p_id, p_inc = pair.p.engine.engine_id, pair.p.engine.incarnation
        pair.consumer.request_allocated("live", [0, 1], 8, 0, pair.remote())
        # P loads D (full) once it has the push_reg: from then on P's own agent can reach D.
        wait_for(lambda: pair.on_loop(lambda: p_agent.peer_mode(d_agent.name)), "P loaded D")
        rogue = _rogue(pair, "rogue/r1/pp0/tp0", d_agent)
        ghost = _rogue(pair, make_agent_name(p_id, "0ld", 0, 0), d_agent)  # an earlier life of P
        valid = _done("live", "rogue", "r1")
        corpus: list[tuple[InprocAgent, bytes, str]] = [
            (rogue, b"\x00garbage", "malformed"),
            (rogue, b"KVW1", "malformed"),
            (rogue, valid[:-3], "malformed"),  # truncated
            (rogue, b"KVW9" + valid[4:], "malformed"),  # wrong magic
            (rogue, valid.replace(b"done", b"dune"), "malformed"),  # unknown type
            (rogue, valid.replace(b"num_blocks\x02", b"num_blocks\xa1x"), "malformed"),  # wrong type
            (rogue, b"KVW1" + bytes(1 << 20), "malformed"),  # oversized junk
            (rogue, _done("live", p_id, p_inc), "wrong_sender"),  # claims to be P
            (rogue, valid, "wrong_sender"),  # honest, but not the P rank the request waits on
            (ghost, _done("live", p_id, "0ld"), "stale_incarnation"),
            (ghost, _done("gone", p_id, "0ld"), "unknown_transfer"),
            (p_agent, _done("nope", p_id, p_inc), "unknown_transfer"),
            (p_agent, _done("live", p_id, p_inc, tp_rank=1), "wrong_sender"),  # a rank D never registered
            (
                rogue,
                encode_notif(Cancel(transfer_id="live", engine_id="rogue", incarnation="r1")),
                "unexpected",
            ),
        ]
        for sender, raw, _ in corpus:
            pair.on_loop(lambda s=sender, r=raw: s.send_notif(d_agent.name, r))
        want: dict[str, int] = {}
        for _, _, why in corpus:
            want[why] = want.get(why, 0) + 1
        dropped = pair.consumer.stats.dropped_notifs
        wait_for(lambda: sum(dropped.values()) == len(corpus), "every bad notification dropped")
        assert dict(dropped) == want
        # The request is untouched by all that, and completes with P's bytes only.
        kv = pair.fill_p([4, 5], 8)
        pair.producer.request_finished("live", [4, 5], 8)
        assert [e.kind for e in pair.d_event("live")] == [ConsumerEventKind.READY]
        assert same_bytes(pair.d_tokens([0, 1], range(8)), kv)
        assert untouched_blocks_zero(pair.d.ranks, [0, 1])
    finally:
        pair.close()


def test_bad_notifications_to_p_are_dropped_by_reason() -> None:
    pair = Pair(SPEC)
    try:
        p_agent = pair.p_agent()
        rogue = _rogue(pair, "rogue/r2/pp0/tp0", p_agent)
        # (A cancel of a transfer P has not seen is not among them: it is taken, as a D that declined the
        # request before P finished, docs/protocol.md §3; tests/unit/test_decline.py bounds them.)
        corpus: list[tuple[bytes, str]] = [
            (b"KVW1\xff\x00", "malformed"),
            (_done("x", "rogue", "r2"), "unexpected"),  # P gets no done in push mode
            (_done("x", "other", "r2"), "wrong_sender"),
        ]
        for raw, _ in corpus:
            pair.on_loop(lambda r=raw: rogue.send_notif(p_agent.name, r))
        dropped = pair.producer.stats.dropped_notifs
        wait_for(lambda: sum(dropped.values()) == len(corpus), "every bad notification dropped")
        assert dict(dropped) == {"malformed": 1, "unexpected": 1, "wrong_sender": 1}
    finally:
        pair.close()


def test_mutated_notifications_never_crash_or_write() -> None:
    pair = Pair(SPEC)
    try:
        d_agent = pair.d.ranks[0].agent
        assert isinstance(d_agent, InprocAgent)
        rogue = _rogue(pair, "rogue/r3/pp0/tp0", d_agent, pair.p_agent())
        rng = random.Random(7)
        seeds = [
            _done("m", "rogue", "r3"),
            encode_notif(Cancel(transfer_id="m", engine_id="rogue", incarnation="r3")),
        ]
        sent = {d_agent.name: 0, pair.p_agent().name: 0}
        for i in range(400):
            raw = bytearray(rng.choice(seeds))
            for _ in range(rng.randint(1, 4)):
                raw[rng.randrange(len(raw))] = rng.randrange(256)
            target = d_agent.name if i % 2 else pair.p_agent().name
            sent[target] += 1
            pair.on_loop(lambda t=target, r=bytes(raw): rogue.send_notif(t, r))
        # P takes a cancel that still decodes, of a transfer it has not seen (a D that declined it): each
        # leaves one record, an ended request holding nothing; every other one is dropped.
        wait_for(
            lambda: (
                sum(pair.consumer.stats.dropped_notifs.values()) == sent[d_agent.name]
                and sum(pair.producer.stats.dropped_notifs.values())
                + pair.on_loop(lambda: pair.producer.core.records[0])
                == sent[pair.p_agent().name]
            ),
            "every mutated notification dropped, or taken as a cancel",
        )
        assert pair.on_loop(lambda: pair.producer.core.live_requests) == 0
        kv = pair.fill_p([2, 3], 8)
        pair.consumer.request_allocated("after", [0, 1], 8, 0, pair.remote())
        pair.producer.request_finished("after", [2, 3], 8)
        assert [e.kind for e in pair.d_event("after")] == [ConsumerEventKind.READY]
        assert same_bytes(pair.d_tokens([0, 1], range(8)), kv)
        assert untouched_blocks_zero(pair.d.ranks, [0, 1])
    finally:
        pair.close()


def test_a_flood_of_early_push_regs_is_bounded_and_counted() -> None:
    """One peer registering many transfers P never finished: past the bound they are dropped (counted as
    overload) before any state, handshake or log line; a real request is still served afterwards."""
    cap = 8
    pair = Pair(SPEC, config=ConnectorConfig(max_early_registrations=cap))
    bare = BareD(pair)
    try:
        for i in range(3 * cap):
            bare.push_reg(f"flood{i}", [1], 4)
        wait_for(lambda: pair.producer.stats.dropped_notifs["overload"] == 2 * cap, "the overload drops")
        assert pair.on_loop(lambda: pair.producer.core.live_requests) == cap
        pair.fill_p([2], 4)
        pair.producer.request_finished("flood0", [2], 4)  # one of the admitted ones is real (4 tokens)
        wait_for(lambda: [m for m in bare.received() if isinstance(m, Done)], "done for the real request")
        assert pair.on_loop(lambda: pair.producer.core.early_registrations) == cap - 1
    finally:
        bare.close()
        pair.close()


def _bombs() -> list[bytes]:
    """Deeply nested notifications of about 5 KB: arrays, maps, and a ``failed`` whose unknown field
    nests (the shape that made the old fallback decode raise RecursionError inside the tick)."""
    arrays = b"KVW1" + b"\x91" * 5000 + b"\xc0"
    maps = b"KVW1" + b"\x81\xa1a" * 1700 + b"\xc0"
    failed = b"KVW1\x83\xa4type\xa6failed\xa6reason\xa3new\xa1x" + b"\x91" * 5000 + b"\xc0"
    return [arrays, maps, failed]


def test_nested_bombs_in_a_batch_cost_only_themselves(caplog: pytest.LogCaptureFixture) -> None:
    pair = Pair(SPEC)
    try:
        d_agent = pair.d.ranks[0].agent
        assert isinstance(d_agent, InprocAgent)
        pair.consumer.request_allocated("live", [0, 1], 8, 0, pair.remote())
        rogue = _rogue(pair, "rogue/r5/pp0/tp0", d_agent)
        cancel = encode_notif(Cancel(transfer_id="live", engine_id="rogue", incarnation="r5"))
        batch = [_done("nope", "rogue", "r5"), *_bombs(), _done("live", "rogue", "r5"), *_bombs(), cancel]

        def send_all() -> None:  # one loop callback: D drains them all in one tick
            for raw in batch:
                rogue.send_notif(d_agent.name, raw)

        pair.on_loop(send_all)
        dropped = pair.consumer.stats.dropped_notifs
        wait_for(lambda: sum(dropped.values()) == len(batch), "every notification of the batch judged")
        # The good-format ones after the bombs were decoded and judged on their merits.
        want = {"unknown_transfer": 1, "malformed": 6, "wrong_sender": 1, "unexpected": 1}
        assert dict(dropped) == want
        assert not [r for r in caplog.records if r.levelname == "ERROR"]
        # Nine drops, one log line: the rest wait for the next line the throttle allows.
        assert len([r for r in caplog.records if "dropped" in r.getMessage()]) == 1
        kv = pair.fill_p([4, 5], 8)
        pair.producer.request_finished("live", [4, 5], 8)
        assert [e.kind for e in pair.d_event("live")] == [ConsumerEventKind.READY]
        assert same_bytes(pair.d_tokens([0, 1], range(8)), kv)
    finally:
        pair.close()


def test_a_second_request_finished_under_a_held_id_is_refused_at_the_call() -> None:
    """The core drops a second Finished for a held id with no event, so the engine would hold that
    request's blocks for good: the call refuses it (the first is untouched), and once the first's event was
    polled the id may be used again."""
    pair = Pair(SPEC, config=ConnectorConfig(kv_lease_duration_s=0.3))
    try:
        pair.producer.request_finished("t-held", [1], 4)
        with pytest.raises(TransferIdReused):
            pair.producer.request_finished("t-held", [2], 4)
        events = []
        wait_for(lambda: events.extend(pair.producer.poll()) or bool(events), "the first request's event")
        assert [(e.transfer_id, e.outcome) for e in events] == [("t-held", ProducerOutcome.EXPIRED)]
        pair.producer.request_finished("t-held", [2], 4)  # polled: the id is free again
    finally:
        pair.close()


def test_engine_calls_before_start_or_after_close_leave_no_trace() -> None:
    """A call refused because the connector was not running recorded its transfer id first: the same call
    after start() was then refused as a reuse (and P kept the id for good). A closed connector's start()
    answered its old port, which nothing served; a closed layer-wise P's step_over raised into the step."""
    fabric = InprocFabric()
    p = build_engine(f"lc-p{next(_n)}", SPEC, num_blocks=8, fabric=fabric)
    d = build_engine(f"lc-d{next(_n)}", SPEC, num_blocks=8, fabric=fabric)
    cfg = ConnectorConfig()
    producer = Producer(p.engine, p.ranks, dataclasses.replace(cfg, layerwise=True), warm_up=False)
    consumer = Consumer(d.engine, d.ranks, cfg, warm_up=False)
    remote = RemoteEngine(p.engine.engine_id, "127.0.0.1", 1)
    try:
        with pytest.raises(ConfigError, match="call start"):
            producer.request_finished("t1", [1], 4)
        with pytest.raises(ConfigError, match="call start"):
            consumer.request_allocated("t1", [1], 4, 0, remote)
        producer.start()
        consumer.start()
        producer.request_finished("t1", [1], 4)  # refused as a reuse before
        consumer.request_allocated("t1", [1], 4, 0, remote)
    finally:
        producer.close()
        consumer.close()
    for conn in (producer, consumer):
        with pytest.raises(ConfigError, match="closed and cannot start again"):
            conn.start()
    with pytest.raises(ConfigError, match="is closed"):
        producer.request_finished("t2", [2], 4)
    assert producer.step_over(["t1"], 0.1)  # nothing can land after close
    p.close()
    d.close()

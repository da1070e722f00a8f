"""The state machines, driven without I/O: every legal edge, every illegal pair, and the safety rule."""

from __future__ import annotations

import contextlib
import enum
import itertools
from collections import deque
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvwire.errors import IllegalTransition, KvwireError, UnexpectedSender
from kvwire.protocol.messages import TransferMode
from kvwire.protocol.ranks import RankEnd, RankKey, RankTracker
from kvwire.protocol.states import (
    ALL_TABLES,
    CONSUMER_TABLES,
    FAIL_REASONS,
    HANDSHAKE_TABLE,
    PRODUCER_TABLE,
    ConsumerRequest,
    ConsumerState,
    ConsumerTrigger,
    HandshakeEvent,
    HandshakeState,
    PeerHandshake,
    ProducerRegistration,
    ProducerState,
    ProducerTrigger,
    TransitionTable,
)
from kvwire.protocol.tables_md import render_all

CS, CE = ConsumerState, ConsumerTrigger
PS, PE = ProducerState, ProducerTrigger
HS, HE = HandshakeState, HandshakeEvent
RANKS: list[RankKey] = [(pp, tp) for pp in range(2) for tp in range(2)]


def _machine(table: TransitionTable[Any, Any], state: enum.Enum) -> Any:
    if table is HANDSHAKE_TABLE:
        return PeerHandshake(state)
    if table is PRODUCER_TABLE:
        return ProducerRegistration(state)
    mode = next(m for m, t in CONSUMER_TABLES.items() if t is table)
    return ConsumerRequest(mode, RANKS, state)


def _pairs(legal: bool) -> list[tuple[TransitionTable[Any, Any], enum.Enum, enum.Enum]]:
    return [
        (t, s, e)
        for t in ALL_TABLES
        for s, e in itertools.product(t.states, t.events)
        if ((s, e) in t.transitions) == legal
    ]


def _id(p: tuple[TransitionTable[Any, Any], enum.Enum, enum.Enum]) -> str:
    return f"{p[0].role}:{p[1].name}x{p[2].name}"


@pytest.mark.parametrize("pair", _pairs(legal=False), ids=_id)
def test_every_illegal_pair_raises_naming_role_state_event(
    pair: tuple[TransitionTable[Any, Any], enum.Enum, enum.Enum],
) -> None:
    table, state, event = pair
    m = _machine(table, state)
    assert not m.accepts(event)
    with pytest.raises(IllegalTransition) as info:
        m.handle(event)
    assert (info.value.role, info.value.state, info.value.event) == (table.role, state.name, event.name)
    assert table.role in str(info.value) and state.name in str(info.value) and event.name in str(info.value)
    assert m.state is state  # a refused event changes nothing


@pytest.mark.parametrize("pair", _pairs(legal=True), ids=_id)
def test_every_legal_edge(pair: tuple[TransitionTable[Any, Any], enum.Enum, enum.Enum]) -> None:
    table, state, event = pair
    m = _machine(table, state)
    assert m.accepts(event)
    assert m.handle(event) is table.transitions[(state, event)] is m.state


@pytest.mark.parametrize("table", ALL_TABLES, ids=lambda t: t.role)
def test_tables_are_well_formed(table: TransitionTable[Any, Any]) -> None:
    # Every state reachable from the initial one, and a terminal state reachable from every state.
    edges: dict[enum.Enum, set[enum.Enum]] = {s: set() for s in table.states}
    for (s, _), n in table.transitions.items():
        edges[s].add(n)
    seen, todo = {table.initial}, deque([table.initial])
    while todo:
        for n in edges[todo.popleft()] - seen:
            seen.add(n)
            todo.append(n)
    # The consumer enum is shared by both modes; each mode leaves the other's own state out.
    unused = {"consumer/push": {CS.READING}, "consumer/pull": {CS.WAITING}}.get(table.role, set())
    assert seen == set(table.states) - unused
    assert not any(edges[s] for s in unused)
    for state in seen:
        reach, todo = {state}, deque([state])
        while todo:
            for n in edges[todo.popleft()] - reach:
                reach.add(n)
                todo.append(n)
        assert reach & table.terminal, f"{state.name} cannot terminate"
    for state in table.terminal:
        assert not edges[state], f"terminal {state.name} has exits"


# --- handshake -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("events", "end", "notify", "full"),
    [
        ([HE.FETCH, HE.LOADED_NOTIF_ONLY], HS.NOTIF_ONLY, True, False),
        ([HE.FETCH, HE.LOADED_FULL], HS.FULL, True, True),
        ([HE.FETCH, HE.LOADED_NOTIF_ONLY, HE.UPGRADE, HE.LOADED_FULL], HS.FULL, True, True),
        ([HE.FETCH, HE.LOADED_NOTIF_ONLY, HE.UPGRADE], HS.UPGRADING, True, False),
        ([HE.FETCH, HE.LOADED_NOTIF_ONLY, HE.UPGRADE, HE.UPGRADE_FAILED], HS.NOTIF_ONLY, True, False),
        ([HE.FETCH, HE.FETCH_FAILED], HS.FAILED, False, False),
        ([HE.FETCH, HE.FETCH_FAILED, HE.FETCH, HE.LOADED_FULL], HS.FULL, True, True),
        ([HE.FETCH, HE.LOADED_FULL, HE.REMOVE], HS.REMOVED, False, False),
        ([HE.FETCH, HE.REMOVE], HS.REMOVED, False, False),
    ],
)
def test_handshake_paths(events: list[HandshakeEvent], end: HandshakeState, notify: bool, full: bool) -> None:
    hs = PeerHandshake()
    assert hs.state is HS.UNKNOWN and not hs.can_notify
    for ev in events:
        hs.handle(ev)
    assert (hs.state, hs.can_notify, hs.addressable) == (end, notify, full)
    assert hs.is_terminal == (end is HS.REMOVED)


# --- producer --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("events", "end"),
    [
        ([PE.PUSH_REG, PE.PREFILL_DONE, PE.WRITES_POSTED, PE.WRITES_COMPLETE, PE.RELEASE], PS.FREED),
        ([PE.PREFILL_DONE, PE.PUSH_REG, PE.WRITES_POSTED, PE.WRITES_COMPLETE, PE.RELEASE], PS.FREED),
        ([PE.PUSH_REG, PE.FENCE_EXPIRED], PS.FAILED),
        ([PE.PUSH_REG, PE.PREFILL_DONE, PE.FENCE_EXPIRED], PS.FAILED),
        ([PE.PREFILL_DONE, PE.LEASE_EXPIRED, PE.RELEASE], PS.FREED),
        ([PE.PUSH_REG, PE.PREFILL_DONE, PE.WRITES_POSTED, PE.WRITE_FAILED], PS.FAILED),
        ([PE.PUSH_REG, PE.PREFILL_DONE, PE.WRITES_POSTED, PE.CANCEL, PE.WRITES_COMPLETE], PS.DONE_SENT),
        (
            [PE.PUSH_REG, PE.PREFILL_DONE, PE.WRITES_POSTED, PE.CANCEL, PE.CANCEL, PE.WRITE_FAILED],
            PS.CANCELLED,
        ),
        ([PE.PUSH_REG, PE.CANCEL], PS.CANCELLED),
        ([PE.PUSH_REG, PE.PREFILL_DONE, PE.WRITES_POSTED, PE.WRITES_COMPLETE, PE.CANCEL], PS.DONE_SENT),
        ([PE.PREFILL_DONE, PE.PUSH_REG, PE.HANDSHAKE_FAILED, PE.RELEASE], PS.FREED),
    ],
)
def test_producer_paths(events: list[ProducerTrigger], end: ProducerState) -> None:
    p = ProducerRegistration()
    for ev in events:
        p.handle(ev)
    assert p.state is end


def test_producer_cancel_waits_for_writes_in_flight() -> None:
    p = ProducerRegistration(PS.WRITING)
    assert p.writes_in_flight and not p.registration_ended
    assert p.handle(PE.CANCEL) is PS.CANCEL_PENDING
    assert p.writes_in_flight and not p.registration_ended  # no cancel_ack yet
    for ev in (PE.LEASE_EXPIRED, PE.ABORT, PE.PEER_DEAD, PE.FENCE_EXPIRED):
        assert not p.accepts(ev)
    # The write completed: the done attached to it is the registration's one ending message.
    assert p.handle(PE.WRITES_COMPLETE) is PS.DONE_SENT
    assert p.registration_ended and not p.writes_in_flight
    failed = ProducerRegistration(PS.CANCEL_PENDING)
    assert failed.handle(PE.WRITE_FAILED) is PS.CANCELLED  # no done went: cancel_ack


def test_every_way_into_producer_failed_has_a_reason() -> None:
    into_failed = {e for (s, e), n in PRODUCER_TABLE.transitions.items() if n is PS.FAILED}
    assert into_failed == set(FAIL_REASONS)


# --- consumer --------------------------------------------------------------------------------------


def test_consumer_push_happy_path() -> None:
    c = ConsumerRequest(TransferMode.PUSH, RANKS)
    assert c.state is CS.ALLOCATED and not c.blocks_quarantined
    for i, rank in enumerate(RANKS):
        assert c.push_reg_sent(rank) is (CS.WAITING if i == len(RANKS) - 1 else CS.REGISTERING)
        assert c.blocks_quarantined
    for i, rank in enumerate(RANKS):
        assert c.rank_ended(rank, RankEnd.DONE) is (CS.READY if i == len(RANKS) - 1 else CS.WAITING)
    assert not c.blocks_quarantined and not c.may_free_blocks
    assert c.handle(CE.RELEASE) is CS.FINISHED and c.may_free_blocks


def test_consumer_done_before_last_push_reg() -> None:
    c = ConsumerRequest(TransferMode.PUSH, [(0, 0), (0, 1)])
    c.push_reg_sent((0, 0))
    assert c.rank_ended((0, 0), RankEnd.DONE) is CS.REGISTERING
    assert c.push_reg_sent((0, 1)) is CS.WAITING
    assert c.rank_ended((0, 1), RankEnd.DONE) is CS.READY


def test_consumer_failure_drains_every_rank_before_freeing() -> None:
    c = ConsumerRequest(TransferMode.PUSH, RANKS)
    for rank in RANKS:
        c.push_reg_sent(rank)
    c.rank_ended(RANKS[0], RankEnd.DONE)
    assert c.rank_ended(RANKS[1], RankEnd.FAILED) is CS.FAILING
    assert c.ranks.pending == {RANKS[2], RANKS[3]}  # these get `cancel`
    assert c.blocks_quarantined and not c.may_free_blocks
    assert c.rank_ended(RANKS[2], RankEnd.CANCEL_ACKED) is CS.FAILING
    assert c.rank_ended(RANKS[3], RankEnd.DEAD) is CS.FAILED
    assert c.may_free_blocks and not c.blocks_quarantined


def test_consumer_cancel_while_registering_counts_unsent_ranks_as_ended() -> None:
    c = ConsumerRequest(TransferMode.PUSH, RANKS)
    c.push_reg_sent(RANKS[0])
    assert c.cancel() is CS.CANCELLING
    assert not c.may_send_push_reg
    with pytest.raises(IllegalTransition):
        c.push_reg_sent(RANKS[1])
    assert c.ranks.pending == {RANKS[0]}
    assert c.rank_ended(RANKS[0], RankEnd.DONE) is CS.ABORTED  # a done that crossed the cancel
    assert c.ranks.ended[RANKS[1]] is RankEnd.NOT_REGISTERED


def test_consumer_cancel_before_anything_sent_aborts_at_once() -> None:
    c = ConsumerRequest(TransferMode.PUSH, RANKS)
    assert c.cancel() is CS.ABORTED and c.may_free_blocks


def test_consumer_timeout_and_handshake_failure_drain() -> None:
    c = ConsumerRequest(TransferMode.PUSH, RANKS[:2])
    c.push_reg_sent(RANKS[0])
    assert c.fail(CE.HANDSHAKE_FAILED) is CS.FAILING
    assert c.rank_ended(RANKS[0], RankEnd.CANCEL_ACKED) is CS.FAILED
    c = ConsumerRequest(TransferMode.PUSH, RANKS[:1])
    c.push_reg_sent(RANKS[0])
    assert c.fail(CE.TIMEOUT) is CS.FAILING
    assert c.rank_ended(RANKS[0], RankEnd.FAILED) is CS.FAILED


def test_consumer_duplicate_and_foreign_ranks_refused() -> None:
    c = ConsumerRequest(TransferMode.PUSH, RANKS[:2])
    c.push_reg_sent(RANKS[0])
    with pytest.raises(UnexpectedSender):
        c.push_reg_sent(RANKS[0])
    c.push_reg_sent(RANKS[1])
    c.rank_ended(RANKS[0], RankEnd.DONE)
    with pytest.raises(UnexpectedSender, match="already ended"):
        c.rank_ended(RANKS[0], RankEnd.DONE)
    with pytest.raises(UnexpectedSender, match="not one this request expects"):
        c.rank_ended((5, 5), RankEnd.DONE)
    with pytest.raises(IllegalTransition):  # cancel_ack without a cancel: tracker left untouched
        c.rank_ended(RANKS[1], RankEnd.CANCEL_ACKED)
    assert c.ranks.pending == {RANKS[1]} and c.state is CS.WAITING


def test_consumer_late_message_after_terminal_is_illegal() -> None:
    c = ConsumerRequest(TransferMode.PUSH, RANKS[:1])
    c.push_reg_sent(RANKS[0])
    c.rank_ended(RANKS[0], RankEnd.DONE)
    c.handle(CE.RELEASE)
    with pytest.raises(IllegalTransition):
        c.rank_ended(RANKS[0], RankEnd.FAILED)


def test_consumer_pull_paths() -> None:
    c = ConsumerRequest(TransferMode.PULL, RANKS[:1])
    assert not c.may_send_push_reg
    for ev in (CE.REGISTER, CE.READ_POSTED, CE.DONE_ALL, CE.RELEASE):
        c.handle(ev)
    assert c.state is CS.FINISHED
    c = ConsumerRequest(TransferMode.PULL, RANKS[:1])
    c.handle(CE.REGISTER)
    c.handle(CE.READ_POSTED)
    assert c.fail(CE.READ_FAILED) is CS.FAILING  # other READs may still land
    assert c.blocks_quarantined
    assert c.handle(CE.ENDED_ALL) is CS.FAILED
    with pytest.raises(IllegalTransition):
        ConsumerRequest(TransferMode.PULL, RANKS[:1], CS.REGISTERING).push_reg_sent(RANKS[0])


def test_rank_tracker_needs_ranks() -> None:
    with pytest.raises(UnexpectedSender):
        RankTracker([])
    t = RankTracker([(0, 0)])
    with pytest.raises(UnexpectedSender):  # ending a rank never registered
        t.end((0, 0), RankEnd.DONE)


_ENDS = [e for e in RankEnd if e is not RankEnd.NOT_REGISTERED]
_OPS = st.one_of(
    st.tuples(st.just("reg"), st.sampled_from(RANKS)),
    st.tuples(st.just("end"), st.sampled_from(RANKS), st.sampled_from(_ENDS)),
    st.tuples(st.just("cancel")),
    st.tuples(st.just("fail"), st.sampled_from([CE.TIMEOUT, CE.HANDSHAKE_FAILED])),
    st.tuples(st.just("release")),
)


@settings(max_examples=1500, deadline=None)
@given(st.lists(_OPS, max_size=24))
def test_consumer_never_frees_blocks_a_rank_may_write(ops: list[tuple[Any, ...]]) -> None:
    """DESIGN §3 item 2, for any order of events: free only when no registered rank is still pending."""
    c = ConsumerRequest(TransferMode.PUSH, RANKS)
    for op in ops:
        with contextlib.suppress(KvwireError):
            if op[0] == "reg":
                c.push_reg_sent(op[1])
            elif op[0] == "end":
                c.rank_ended(op[1], op[2])
            elif op[0] == "cancel":
                c.cancel()
            elif op[0] == "fail":
                c.fail(op[1])
            else:
                c.handle(CE.RELEASE)
        if c.may_free_blocks or c.state in (CS.READY, CS.ALLOCATED):
            assert not c.ranks.pending
        if c.state in (CS.READY, CS.FINISHED):
            assert c.ranks.all_done
        # Draining always settles as soon as nothing is pending.
        assert not (c.state in (CS.CANCELLING, CS.FAILING) and c.ranks.all_ended)


def test_docs_protocol_md_matches_the_tables() -> None:
    doc = (Path(__file__).parents[2] / "docs" / "protocol.md").read_text()
    body = doc.split("<!-- tables:begin -->")[1].split("<!-- tables:end -->")[0]
    assert body.strip() == render_all().strip(), "regenerate with: python -m kvwire.protocol.tables_md"

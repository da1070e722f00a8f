"""The handshake core in virtual time: no sockets, no agent, no sleeps. Each test feeds inputs at chosen
``now`` values and checks the actions and the state the rules leave."""

from __future__ import annotations

import dataclasses

import pytest

from kvwire.core.breaker import Breaker
from kvwire.core.handshake import (
    HandshakeCore,
    failure_reason,
    refusal,
)
from kvwire.core.handshake_io import (
    Answered,
    Attempt,
    Close,
    Fail,
    Failed,
    Fetch,
    FetchErr,
    FetchOk,
    ForgetAgent,
    Forgot,
    HsAction,
    Join,
    Load,
    Loaded,
    LoadOk,
    Lookup,
    Ready,
    Reap,
    Reaped,
    Refuse,
    Sleep,
    Start,
    Touch,
    Unload,
    Want,
)
from kvwire.core.types import PeerAddress, PeerRank
from kvwire.errors import (
    CircuitOpen,
    HandshakeTimeout,
    NoSuchRank,
    PeerNotAllowed,
    PeerReplaced,
    PeerUnreachable,
)
from kvwire.protocol.allow import PeerAllowList
from kvwire.protocol.messages import FailReason
from kvwire.protocol.states import HandshakeState
from kvwire.protocol.types import PeerMode

ADDR = PeerAddress("10.0.0.1", 7000, 0, 0)
NOTIF, FULL = PeerMode.NOTIF_ONLY, PeerMode.FULL


def _peer(
    incarnation: str = "P-1", mode: PeerMode = NOTIF, offset: float = 0.0, engine: str = "P"
) -> PeerRank:
    return PeerRank(
        engine_id=engine,
        incarnation=incarnation,
        host=ADDR.host,
        port=ADDR.port,
        tp_size=1,
        tp_rank=0,
        pp_size=1,
        pp_rank=0,
        agent_name=f"{engine}/{incarnation}/pp0/tp0",
        mode=mode,
        layout=None,
        num_blocks=8,
        clock_offset_s=offset,
    )


def _one(actions: list[HsAction]) -> HsAction:
    assert len(actions) == 1, actions
    return actions[0]


def _load(core: HandshakeCore, now: float, peer: PeerRank, mode: PeerMode = NOTIF) -> PeerRank:
    """Drive one whole successful flight at ``now``: Want, Attempt, FetchOk, LoadOk; the peer cached."""
    assert isinstance(_one(core.handle(now, Want(ADDR, mode, incarnation=None))), Start)
    fetch = _one(core.handle(now, Attempt(ADDR)))
    assert isinstance(fetch, Fetch) and fetch.notif_only is (mode is NOTIF)
    out = core.handle(now, FetchOk(ADDR, peer.engine_id, peer.incarnation))
    assert isinstance(out[-1], Load) and out[-1].mode is mode
    done = _one(core.handle(now, LoadOk(ADDR, dataclasses.replace(peer, mode=mode))))
    assert isinstance(done, Loaded)
    return done.peer


def test_a_hit_answers_at_once_and_a_second_caller_joins_the_flight() -> None:
    core = HandshakeCore()
    assert core.handle(0.0, Lookup(ADDR, NOTIF, dial=True)) == []  # nothing cached: handshake
    assert isinstance(_one(core.handle(0.0, Want(ADDR, NOTIF))), Start)
    assert _one(core.handle(0.0, Want(ADDR, NOTIF))) == Join(ADDR)
    assert core.stats.deduped == 1 and core.state(ADDR) is HandshakeState.FETCHING
    core.handle(0.0, Attempt(ADDR))
    core.handle(0.0, FetchOk(ADDR, "P", "P-1"))
    core.handle(0.1, LoadOk(ADDR, _peer()))
    assert _one(core.handle(0.2, Lookup(ADDR, NOTIF))) == Ready(_peer())
    assert core.stats.cache_hits == 1 and core.state(ADDR) is HandshakeState.NOTIF_ONLY
    assert list(core.stats.durations_s[NOTIF]) == [pytest.approx(0.1)]


def test_an_upgrade_keeps_the_measured_clock_offset() -> None:
    core = HandshakeCore()
    _load(core, 0.0, _peer(offset=0.25))
    assert isinstance(_one(core.handle(1.0, Want(ADDR, FULL))), Start)
    assert core.state(ADDR) is HandshakeState.UPGRADING
    fetch = _one(core.handle(1.0, Attempt(ADDR)))
    assert isinstance(fetch, Fetch) and fetch.samples == 1  # an upgrade measures no new offset
    core.handle(1.0, FetchOk(ADDR, "P", "P-1"))
    done = _one(core.handle(1.0, LoadOk(ADDR, _peer(mode=FULL, offset=9.0))))
    assert isinstance(done, Loaded) and done.upgrade and done.peer.clock_offset_s == 0.25
    assert core.stats.upgrades == 1 and core.state(ADDR) is HandshakeState.FULL
    assert _one(core.handle(1.0, Lookup(ADDR, NOTIF))) == Ready(done.peer)  # FULL serves notif-only


def test_a_reply_from_another_life_replaces_the_entry_and_unloads_the_old_agent() -> None:
    core = HandshakeCore()
    old = _load(core, 0.0, _peer("P-1"))
    # The caller knows of P-2: the entry is refreshed, and stays in service until the reply.
    assert isinstance(_one(core.handle(1.0, Want(ADDR, NOTIF, incarnation="P-2"))), Start)
    assert core.state(ADDR) is HandshakeState.NOTIF_ONLY and core.peers[ADDR] == old
    core.handle(1.0, Attempt(ADDR))
    out = core.handle(1.0, FetchOk(ADDR, "P", "P-2"))
    assert out[0] == Unload(old.agent_name) and isinstance(out[1], Load)
    assert ADDR not in core.peers and core.stats.replaced == 1
    done = _one(core.handle(1.0, LoadOk(ADDR, _peer("P-2"))))
    assert isinstance(done, Loaded) and core.state(ADDR) is HandshakeState.NOTIF_ONLY
    # A caller that asked for P-1 and waited on this flight gets P-2: the peer's answer wins.
    assert _one(core.handle(1.0, Answered(NOTIF, None, done.peer))) == Ready(done.peer)


def test_retries_back_off_within_the_deadline_then_fail_and_trip_the_breaker() -> None:
    core = HandshakeCore(timeout_s=1.0, retries=3, backoff_s=0.1)
    core.handle(0.0, Want(ADDR, NOTIF))
    now, pauses = 0.0, []
    for _ in range(3):
        fetch = _one(core.handle(now, Attempt(ADDR)))
        # Half the time left while another attempt may follow (a hung connection costs half the budget).
        assert isinstance(fetch, Fetch) and fetch.timeout_s == pytest.approx((1.0 - now) / 2)
        sleep = _one(core.handle(now, FetchErr(ADDR, PeerUnreachable("reset"), jitter=1.0)))
        assert isinstance(sleep, Sleep)
        pauses.append(sleep.seconds)
        now += sleep.seconds
    assert pauses == pytest.approx([0.1, 0.2, 0.4]) and core.stats.retries == 3
    last = _one(core.handle(now, Attempt(ADDR)))
    assert isinstance(last, Fetch) and last.timeout_s == pytest.approx(
        1.0 - now
    )  # the last: all that is left
    fail = _one(core.handle(now, FetchErr(ADDR, PeerUnreachable("reset"))))  # the last attempt
    assert isinstance(fail, Fail) and isinstance(fail.error, PeerUnreachable)
    assert core.state(ADDR) is HandshakeState.FAILED and not core.flights
    refused = _one(core.handle(now + 0.5, Want(ADDR, NOTIF)))  # the breaker holds the address
    assert isinstance(refused, Refuse) and isinstance(refused.error, CircuitOpen)
    assert isinstance(_one(core.handle(now + 1.01, Want(ADDR, NOTIF))), Start)  # the window passed


def test_an_unanswered_attempt_is_retried_on_a_new_connection_within_the_deadline() -> None:
    core = HandshakeCore(timeout_s=2.0, retries=3, backoff_s=0.1)
    core.handle(0.0, Want(ADDR, NOTIF))
    first = _one(core.handle(0.0, Attempt(ADDR)))
    assert isinstance(first, Fetch) and first.timeout_s == pytest.approx(1.0)
    sleep = _one(core.handle(1.0, FetchErr(ADDR, HandshakeTimeout("no answer"), jitter=1.0)))
    assert isinstance(sleep, Sleep) and core.stats.retries == 1  # not a failure yet
    second = _one(core.handle(1.0 + sleep.seconds, Attempt(ADDR)))
    assert isinstance(second, Fetch) and second.attempt == first.attempt + 1
    assert core.state(ADDR) is HandshakeState.FETCHING


def test_no_retry_past_the_deadline_and_a_late_attempt_times_out() -> None:
    core = HandshakeCore(timeout_s=1.0, retries=5, backoff_s=0.5)
    core.handle(0.0, Want(ADDR, NOTIF))
    core.handle(0.0, Attempt(ADDR))
    assert isinstance(_one(core.handle(0.9, FetchErr(ADDR, PeerUnreachable("x")))), Fail)  # 0.9 + 0.5 > 1
    core.handle(5.0, Want(ADDR, NOTIF))  # unreachable trips the breaker for 1 s only
    fail = _one(core.handle(6.1, Attempt(ADDR)))
    assert isinstance(fail, Fail) and isinstance(fail.error, HandshakeTimeout)


def test_a_refusal_does_not_trip_the_breaker_and_a_cancel_counts_nothing() -> None:
    core = HandshakeCore()
    core.handle(0.0, Want(ADDR, NOTIF))
    core.handle(0.0, Attempt(ADDR))
    fail = _one(core.handle(0.0, FetchErr(ADDR, NoSuchRank("no rank"))))
    assert isinstance(fail, Fail) and len(core.breaker) == 0 and sum(core.stats.failures.values()) == 1
    core.handle(0.0, Want(ADDR, NOTIF))
    fail = _one(core.handle(0.0, Failed(ADDR, KeyboardInterrupt())))
    assert isinstance(fail, Fail) and fail.reason is None and sum(core.stats.failures.values()) == 1


@pytest.mark.parametrize("answer", ["P", "Q"])
def test_a_caller_naming_another_engine_refreshes_the_entry_and_the_reply_decides(answer: str) -> None:
    # A restarted engine usually has a new id: the cached one may be the stale entry, so a caller naming
    # Q is not refused from the cache; the address is asked again. Q there now: served. P still there:
    # the engine Q named is not (restarted again, or another took its address): ``PeerReplaced``, whose
    # request fails ``peer_dead`` (its KV is gone; a retry may cure it), not ``incompatible``.
    core = HandshakeCore(allowed=PeerAllowList.parse("10.0.0.0/8"))
    old = _load(core, 0.0, _peer())
    assert core.handle(0.0, Lookup(ADDR, NOTIF, engine_id="Q", dial=True)) == []  # a miss: dial
    assert isinstance(_one(core.handle(0.0, Want(ADDR, NOTIF, engine_id="Q"))), Start)
    assert core.peers[ADDR] == old  # the entry serves until the reply says whose it is
    core.handle(0.0, Attempt(ADDR))
    out = core.handle(0.0, FetchOk(ADDR, answer, f"{answer}-1"))
    assert isinstance(out[-1], Load) and (Unload(old.agent_name) in out) is (answer == "Q")
    done = _one(core.handle(0.0, LoadOk(ADDR, _peer(engine=answer, incarnation=f"{answer}-1"))))
    assert isinstance(done, Loaded) and core.peers[ADDR] == done.peer
    got = _one(core.handle(0.0, Answered(NOTIF, "Q", done.peer)))
    if answer == "Q":
        assert got == Ready(done.peer)
    else:
        assert isinstance(got, Refuse) and isinstance(got.error, PeerReplaced)
        assert refusal(got.error) is FailReason.PEER_DEAD and failure_reason(got.error).value == "replaced"
        assert core.stats.failures[failure_reason(got.error)] == 1  # counted by reason, as other failures are


def test_a_disallowed_address_is_refused() -> None:
    core = HandshakeCore(allowed=PeerAllowList.parse("10.0.0.0/8"))
    far = PeerAddress("192.168.0.1", 1, 0, 0)
    refused = _one(core.handle(0.0, Lookup(far, NOTIF, dial=True)))
    assert isinstance(refused, Refuse) and isinstance(refused.error, PeerNotAllowed)
    assert core.stats.not_allowed == 1


def test_idle_peers_are_reaped_and_live_ones_kept() -> None:
    core = HandshakeCore()
    peer = _load(core, 100.0, _peer())
    assert core.handle(150.0, Reap(frozenset(), 60.0)) == []
    assert core.handle(200.0, Reap(frozenset({"P"}), 60.0)) == []  # in use at 200: kept
    out = core.handle(261.0, Reap(frozenset(), 60.0))
    assert out == [Unload(peer.agent_name), Reaped("P")] and not core.peers
    assert core.state(ADDR) is HandshakeState.REMOVED and core.stats.forgotten == 1


def test_reaping_keeps_no_entry_for_an_engine_id_this_rank_never_loaded() -> None:
    """A decode leg names P's engine id; 400 requests naming made-up ids of about 1 KB at an address that
    never answers left 400 entries (393 KiB) kept for ``engine_ttl_s`` (an hour)."""
    core = HandshakeCore()
    _load(core, 0.0, _peer())
    core.handle(1.0, Reap(frozenset({"P"} | {f"made-up-{i}" for i in range(400)}), 60.0))
    assert set(core.last_used) == {"P"} and core.last_used["P"] == 1.0


def test_a_gone_agent_is_forgotten_through_the_core() -> None:
    core = HandshakeCore()
    peer = _load(core, 0.0, _peer())
    assert core.handle(1.0, ForgetAgent("nobody")) == []
    out = core.handle(1.0, ForgetAgent(peer.agent_name))
    assert out == [Unload(peer.agent_name), Forgot("P", "P-1")] and not core.peers


def test_close_ends_flights_that_never_ran_and_unloads_everything() -> None:
    core = HandshakeCore()
    peer = _load(core, 0.0, _peer())
    other = PeerAddress("10.0.0.2", 7000, 0, 0)
    core.handle(0.0, Want(other, NOTIF))
    assert core.handle(1.0, Close()) == [Unload(peer.agent_name)]
    assert not core.flights and not core.machines and not core.peers


def test_the_breaker_holds_only_the_life_that_tripped_it() -> None:
    b = Breaker(base_s=1.0)
    b.failed_at(0.0, "h", 1, "P-1")
    with pytest.raises(CircuitOpen):
        b.check_at(0.5, "h", 1, "P-1")
    b.check_at(0.5, "h", 1, "P-2")
    b.check_at(1.0, "h", 1, "P-1")


def test_a_word_from_the_engine_closes_its_circuit() -> None:
    """A partition outlasted the handshake's deadline and tripped the breaker; the peer's first word after
    the heal (``Touch``, from an authenticated notification) closes the circuit before the window ends."""
    core = HandshakeCore(timeout_s=1.0, retries=0)
    core.handle(0.0, Want(ADDR, NOTIF, engine_id="P"))
    core.handle(0.0, Attempt(ADDR))
    assert isinstance(_one(core.handle(1.0, FetchErr(ADDR, PeerUnreachable("timeout")))), Fail)
    refused = _one(core.handle(1.2, Want(ADDR, NOTIF, engine_id="P")))
    assert isinstance(refused, Refuse) and isinstance(refused.error, CircuitOpen)
    core.handle(1.3, Touch("Q"))  # another engine's word does not
    assert isinstance(_one(core.handle(1.4, Want(ADDR, NOTIF, engine_id="P"))), Refuse)
    core.handle(1.5, Touch("P"))
    assert isinstance(_one(core.handle(1.6, Want(ADDR, NOTIF, engine_id="P"))), Start)  # window ends at 2.0
    assert core.breaker.closed_by_word == 1


def test_a_word_from_an_engine_never_loaded_adds_no_entry() -> None:
    # A heartbeat names its sender's engine id (any name, without a secret): each used to add a last_used
    # entry kept engine_ttl_s (an hour), so a stream of made-up ids grew the table.
    core = HandshakeCore(timeout_s=1.0, retries=0)
    for i in range(300):
        core.handle(float(i), Touch(f"ghost-{i}"))
    assert core.last_used == {}


def test_handshake_machines_stay_bounded_when_peers_name_many_addresses(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each address a peer names gets a handshake machine; failed ones are dropped oldest first beyond the
    bound, while an address with a loaded peer or a handshake in flight keeps its machine."""
    import kvwire.core.handshake as hs

    monkeypatch.setattr(hs, "MAX_MACHINES", 8)
    core = HandshakeCore(timeout_s=1.0, retries=0)
    core.handle(0.0, Want(ADDR, NOTIF))  # stays in flight throughout
    for port in range(100):
        addr = PeerAddress("10.0.0.9", 8000 + port, 0, 0)
        core.handle(0.0, Want(addr, NOTIF))
        core.handle(0.0, Attempt(addr))
        assert isinstance(_one(core.handle(0.0, FetchErr(addr, PeerUnreachable("reset")))), Fail)
        assert len(core.machines) <= 8
    assert core.state(ADDR) is HandshakeState.FETCHING and ADDR in core.flights
    assert core.state(PeerAddress("10.0.0.9", 8099, 0, 0)) is HandshakeState.FAILED  # the newest kept
    assert core.state(PeerAddress("10.0.0.9", 8000, 0, 0)) is HandshakeState.UNKNOWN  # the oldest gone

"""Pull mode's claims (docs/protocol.md §3): D claims P's blocks before it reads them, and takes the read
only if it ended while the grant lasted. Before, a D that came after P's lease read blocks P had freed and
reused, and answered another request's KV as this one's (HTTP 200, wrong tokens), and a client could name
any of P's blocks in remote_block_ids; and with several D ranks reading one P rank, the first rank's
``done`` freed the blocks under the others' reads."""

from __future__ import annotations

import asyncio
import time

import msgspec
import pytest

from kvwire.connector import ConnectorConfig, ConsumerEventKind
from kvwire.connector.sidecalls import claim_until_finished
from kvwire.core.base import DropReason, Refused
from kvwire.core.events import ProducerOutcome
from kvwire.core.io import (
    Abort,
    AnswerClaim,
    ClaimAnswered,
    ClaimArrived,
    Finished,
    PostRead,
    Send,
    SendClaim,
)
from kvwire.core.types import PeerAddress
from kvwire.errors import HandshakeTimeout
from kvwire.handshake.lines import ClaimLines
from kvwire.handshake.server import ClaimVerdict
from kvwire.kv.spec import KVSpec
from kvwire.protocol.messages import (
    Claim,
    Done,
    ErrorCode,
    ErrorReply,
    Failed,
    FailReason,
    Granted,
    TransferMode,
)
from kvwire.testing.connector_env import Pair
from kvwire.testing.core_harness import events, one, protocol
from kvwire.testing.cores_env import BLOCKS, CFG, FAILED, PULL, READY, RELEASED, TID, TOKENS, D, P, ev, freed
from kvwire.testing.handshake_env import SilentListener, manager_pair


def _claim(d_rank: int = 0, blocks: tuple[int, ...] = BLOCKS, life: str = "D-life1", tp: int = 1) -> Claim:
    return Claim(
        pp_rank=0,
        tp_rank=0,
        to_incarnation="P-life1",
        transfer_id=TID,
        block_ids=list(blocks),
        engine_id="D",
        incarnation=life,
        from_pp_rank=0,
        from_tp_rank=d_rank,
        tp_size=tp,
    )


def _verdict(t: P, now: float, claim: Claim, token: int = 1) -> AnswerClaim:
    return one(t.h.at(now, ClaimArrived(token, claim)), AnswerClaim)


def _end(ok: bool, d_rank: int = 0) -> Done | Failed:
    common = {"transfer_id": TID, "engine_id": "D", "incarnation": "D-life1", "tp_rank": d_rank, "pp_rank": 0}
    if ok:
        return Done(num_blocks=2, **common)  # type: ignore[arg-type]
    return Failed(reason=FailReason.WRITE_FAILED, **common)  # type: ignore[arg-type]


# -- P ----------------------------------------------------------------------------------------------------


def test_p_grants_only_what_it_holds_and_a_grant_keeps_the_blocks() -> None:
    t = P(mode=PULL)
    early = _verdict(t, 0.0, _claim())  # not finished here yet: nothing held, D asks again
    assert (early.lease_s, early.code) == (None, ErrorCode.NOT_YET)
    t.h.at(0.0, Finished(TID, BLOCKS, TOKENS))
    other = _verdict(t, 1.0, _claim(blocks=(3, 9)), token=2)  # block 9 is not this request's
    assert (other.lease_s, other.code) == (None, ErrorCode.BAD_REQUEST)
    granted = _verdict(t, 20.0, _claim(), token=3)
    assert (granted.token, granted.lease_s, granted.code) == (3, CFG.kv_lease_duration_s, None)
    # The grant runs from P's answer (20 + 30), past the lease from the finish (30): not freed at 30.
    assert events(t.h.ticks(49.75, 0.25)) == []
    assert events(t.h.tick(50.0)) == [freed(ProducerOutcome.EXPIRED)]
    assert t.core.stats.failures[FailReason.LEASE_EXPIRED] == 1  # counted, as in push
    late = _verdict(t, 51.0, _claim(), token=4)  # the lease ran out: a late D reads nothing
    assert (late.lease_s, late.code) == (None, ErrorCode.GONE)


def test_p_holds_the_blocks_until_every_claimer_ended() -> None:
    t = P(mode=PULL)
    t.h.at(0.0, Finished(TID, BLOCKS, TOKENS))
    for rank in (0, 1):  # D at TP 2: both ranks read P's one rank (a head each)
        assert _verdict(t, 0.5, _claim(d_rank=rank, tp=2), token=rank + 1).lease_s == CFG.kv_lease_duration_s
    assert events(t.from_d(1.0, _end(True, d_rank=0))) == []  # rank 1 still reads: held
    assert t.from_d(1.0, _end(True, d_rank=0)) == []  # its word to another P rank: nothing new
    with pytest.raises(Refused) as stray:  # a rank that reads nothing of ours may not end a hold
        t.from_d(1.0, _end(True, d_rank=5))
    assert stray.value.reason is DropReason.UNEXPECTED
    assert events(t.from_d(1.5, _end(True, d_rank=1))) == [freed(ProducerOutcome.PULLED)]


def test_p_waits_for_a_d_rank_that_has_not_claimed_yet() -> None:
    """D's rank 0 claims, reads and says done before rank 1's claim arrives (one worker process per rank,
    one a few ms behind): the blocks stay held for rank 1, whose claim is then granted (it was refused
    ``gone`` and the load failed)."""
    t = P(mode=PULL)
    t.h.at(0.0, Finished(TID, BLOCKS, TOKENS))
    assert _verdict(t, 0.010, _claim(d_rank=0, tp=2)).lease_s is not None
    assert events(t.from_d(0.012, _end(True, d_rank=0))) == []
    assert _verdict(t, 0.013, _claim(d_rank=1, tp=2), token=2).lease_s is not None
    assert events(t.from_d(0.020, _end(True, d_rank=1))) == [freed(ProducerOutcome.PULLED)]
    other = P(mode=PULL)
    other.h.at(0.0, Finished(TID, BLOCKS, TOKENS))
    _verdict(other, 0.1, _claim(tp=2))
    refused = _verdict(other, 0.2, _claim(d_rank=1, life="D-life2", tp=2), token=2)  # another D life
    assert refused.code is ErrorCode.BAD_REQUEST


def test_a_failed_load_frees_at_once_though_a_rank_never_claimed() -> None:
    """D's rank 0 claimed, then the load failed (its read, or rank 1's handshake) before rank 1 claimed:
    P frees at once on rank 0's ``failed`` (it held to its lease, waiting for a claim that never comes)."""
    t = P(mode=PULL)
    t.h.at(0.0, Finished(TID, BLOCKS, TOKENS))
    assert _verdict(t, 0.5, _claim(d_rank=0, tp=2)).lease_s is not None
    assert events(t.from_d(0.6, _end(False, d_rank=0))) == [freed(ProducerOutcome.FAILED)]
    late = _verdict(t, 0.7, _claim(d_rank=1, tp=2), token=2)
    assert late.code is ErrorCode.GONE


def test_p_fails_the_hold_when_one_claimer_failed() -> None:
    t = P(mode=PULL)
    t.h.at(0.0, Finished(TID, BLOCKS, TOKENS))
    for rank in (0, 1):
        _verdict(t, 0.5, _claim(d_rank=rank, tp=2), token=rank + 1)
    assert events(t.from_d(1.0, _end(False, d_rank=1))) == []
    assert events(t.from_d(1.5, _end(True, d_rank=0))) == [freed(ProducerOutcome.FAILED)]
    assert t.core.stats.failures[FailReason.WRITE_FAILED] == 1 and t.core.stats.transfers_done == 0


# -- D ----------------------------------------------------------------------------------------------------


def test_d_reads_nothing_of_a_refused_claim() -> None:
    t = D(mode=PULL)
    claim = one(t.start(0.0, lease_s=None), SendClaim)
    assert (claim.host, claim.port, claim.claim.to_incarnation) == ("127.0.0.1", 5000, "P-life1")
    out = t.h.at(0.2, ClaimAnswered(claim.token, None, FailReason.LEASE_EXPIRED, "gone: not held"))
    assert not any(isinstance(a, PostRead) for a in out)
    assert events(out) == [ev(FAILED, FailReason.LEASE_EXPIRED), ev(RELEASED, FailReason.LEASE_EXPIRED)]
    assert not any(isinstance(a, Send) for a in protocol(out))  # P holds nothing for us: nothing to tell


def test_d_takes_a_read_only_if_it_ended_within_the_grant() -> None:
    t = D(mode=PULL)
    claim = one(t.start(0.0, lease_s=None), SendClaim)
    read = one(t.h.at(0.1, ClaimAnswered(claim.token, 2.0)), PostRead)  # granted at 0.0 + 2 s
    out = t.h.ended(2.5, read.token)  # it ended after P may have let the blocks go
    assert ev(READY) not in events(out)
    assert events(out)[0] == ev(FAILED, FailReason.LEASE_EXPIRED)
    ok = D(mode=PULL)
    read = one(ok.start(0.0, lease_s=2.0), PostRead)
    assert events(ok.h.ended(1.9, read.token)) == [ev(READY)]


def test_a_claim_granted_after_d_gave_up_is_ended_at_once() -> None:
    t = D(mode=PULL)
    claim = one(t.start(0.0, lease_s=None), SendClaim)
    t.h.at(0.1, Abort(TID))
    out = t.h.at(0.2, ClaimAnswered(claim.token, 30.0))  # P holds the blocks for us now
    assert not any(isinstance(a, PostRead) for a in out)
    assert t.to_p(False, FailReason.ABORTED) in out  # so P frees them now, not at its lease's end


def test_a_claim_without_answer_is_told_failed_with_the_others() -> None:
    """No trusted answer (a timeout): P may have granted it, so D tells it ``failed`` once it gives up;
    after a refusal it tells nothing (P holds nothing for it)."""
    t = D(mode=PULL)
    claim = one(t.start(0.0, lease_s=None), SendClaim)
    out = t.h.at(5.0, ClaimAnswered(claim.token, None, FailReason.HANDSHAKE_FAILED, "TimeoutError"))
    assert t.to_p(False, FailReason.HANDSHAKE_FAILED) in protocol(out)


def test_a_claim_without_answer_after_the_request_ended_is_told_failed() -> None:
    t = D(mode=PULL)
    claim = one(t.start(0.0, lease_s=None), SendClaim)
    t.h.at(0.1, Abort(TID))  # nothing in flight: the request ends now
    out = t.h.at(5.0, ClaimAnswered(claim.token, None, FailReason.HANDSHAKE_FAILED, "TimeoutError"))
    assert t.to_p(False, FailReason.ABORTED) in out  # P may have granted it
    refused = D(mode=PULL)
    claim = one(refused.start(0.0, lease_s=None), SendClaim)
    refused.h.at(0.1, Abort(TID))
    out = refused.h.at(0.2, ClaimAnswered(claim.token, None, FailReason.LEASE_EXPIRED, "gone"))
    assert not [a for a in out if isinstance(a, Send)]  # a refusal: P holds nothing for us


def test_d_asks_again_while_p_has_not_finished_the_request_yet() -> None:
    """P's answer can reach D before P's worker got the request's end (a step later; with PP on P, a
    later stage later still: a real two-stage P refused such a claim and failed the load). D asks again
    while P says ``not_yet``, within the claim's budget, over a real side channel."""
    spec = KVSpec(2, 2, 16, "float32", 16)
    answers: list[ErrorCode | None] = [ErrorCode.NOT_YET, ErrorCode.NOT_YET, None]

    def judge(claim: Claim) -> ClaimVerdict:
        code = answers.pop(0) if answers else ErrorCode.NOT_YET
        return Granted(lease_ms=30_000) if code is None else (code, "not finished here (yet)")

    async def run(budget_s: float) -> Granted | ErrorReply:
        async with manager_pair(spec) as mp:
            mp.server.on_claim = judge
            claim = msgspec.structs.replace(_claim(), to_incarnation=mp.p_info.incarnation)
            return await claim_until_finished(PeerAddress("127.0.0.1", mp.port, 0, 0), claim, budget_s, None)

    assert asyncio.run(run(2.0)) == Granted(lease_ms=30_000) and answers == []
    late = asyncio.run(run(0.1))  # never finished within the budget: the refusal stands
    assert isinstance(late, ErrorReply) and late.code is ErrorCode.NOT_YET


def test_a_read_d_cannot_plan_tells_p_at_once() -> None:
    """D refuses to read (P's block ids out of P's cache, or a geometry it cannot map): it never claims,
    and was never telling P, which held the prompt's blocks to its lease (30 s) for every such request."""
    cfg = ConnectorConfig(mode=TransferMode.PULL, kv_lease_duration_s=30.0)
    pair = Pair(KVSpec(num_layers=2, kv_heads=2, head_dim=8, block_size=4), mode=TransferMode.PULL,
                num_blocks=40, config=cfg)  # fmt: skip
    try:
        pair.producer.request_finished("unplanned", [1, 2, 3], 10)
        pair.consumer.request_allocated("unplanned", [10, 11, 12], 10, 0, pair.remote((1, 2, 500)))
        assert next(e.kind for e in pair.d_event("unplanned")) is ConsumerEventKind.FAILED
        started = time.monotonic()
        assert pair.p_event("unplanned").outcome is ProducerOutcome.FAILED
        assert time.monotonic() - started < 5.0  # the lease is 30 s
    finally:
        pair.close()


@pytest.mark.parametrize("secret", [None, b"claims-secret-0123456789abcdef0123"], ids=["plain", "secret"])
def test_a_burst_of_pull_loads_claims_on_a_few_kept_connections(secret: bytes | None) -> None:
    """Each claim opened its own connection: 50 loads allocated at once on one D opened 50 to one P rank,
    past the side channel's 32 per peer address, and 14 failed handshake_failed (300 at once: 185).
    Claims now queue for three connections per P address, kept while claims wait for them; the server's
    bound of requests per connection (64) closes them along the way, and the claims go on on new ones;
    once none waits, none is kept (an idle kept one sat in CLOSE_WAIT, and under a secret D processes'
    kept connections filled the listener's 256)."""
    n = 200
    cfg = ConnectorConfig(mode=TransferMode.PULL)
    pair = Pair(KVSpec(num_layers=2, kv_heads=2, head_dim=8, block_size=4), mode=TransferMode.PULL,
                num_blocks=n + 8, config=cfg, secret=secret)  # fmt: skip
    try:
        for i in range(n):
            pair.producer.request_finished(f"b{i}", [1 + i], 4)
        for i in range(n):
            pair.consumer.request_allocated(f"b{i}", [1 + i], 4, 0, pair.remote((1 + i,)))
        finals = [pair.d_event(f"b{i}")[-1].kind for i in range(n)]
        assert finals == [ConsumerEventKind.READY] * n
        lines = pair.consumer._claim_lines
        assert lines is not None and 4 <= lines.opened <= 3 * (n // 64 + 2)  # reconnected, never 200
        assert lines._addresses == {}  # nothing kept once no claim waits
        assert pair.producer._server is not None and pair.producer._server.stats.refused_connections == 0
    finally:
        pair.close()


def test_a_claim_nobody_answers_is_a_typed_timeout_naming_the_address() -> None:
    """The claim's whole budget fired before the try's own deadline (same length, started first):
    asyncio's bare TimeoutError, message empty, and D logged "P refused the claim: TimeoutError: "."""
    claim = Claim(
        pp_rank=0, tp_rank=0, to_incarnation="P-life1", transfer_id="t1", block_ids=[1, 2], engine_id="D",
        incarnation="D-life1", from_pp_rank=0, from_tp_rank=0, tp_size=1,
    )  # fmt: skip

    async def body() -> None:
        async with SilentListener() as silent:
            addr = PeerAddress("127.0.0.1", silent.port, 0, 0)
            for lines in (ClaimLines(), None):
                with pytest.raises(HandshakeTimeout, match=rf"127.0.0.1:{silent.port}.*no answer to a claim"):
                    await claim_until_finished(addr, claim, 0.3, None, lines)

    asyncio.run(body())

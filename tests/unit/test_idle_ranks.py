"""P ranks that no D rank reads (replicated heads, P TP > D TP) hear the request's end, driven by hand.

One KV head on P's two ranks, D with one rank: D reads the head from P rank 0 and registers with P rank 1
too (``tp_contacts``), which moves nothing. Inside vLLM each P rank is a worker with its own core, and a
request's blocks are freed once every worker reported it: rank 1 must end with rank 0, not at its lease.
The real-NIXL case is ``tests/integration/test_vllm_worker_geometry.py``.
"""

from __future__ import annotations

import msgspec

from kvwire.core.consumer import PushConsumerCore
from kvwire.core.events import ConsumerEvent, ConsumerEventKind, ProducerEvent, ProducerOutcome
from kvwire.core.io import (
    Allocated,
    Emit,
    Finished,
    NotifIn,
    Outcome,
    PostWrite,
    RemoteEngine,
    Send,
    StartHandshake,
)
from kvwire.core.producer_push import PushProducerCore
from kvwire.kv.spec import KVSpec
from kvwire.protocol.codec import encode_notif
from kvwire.protocol.messages import Cancel, Done, Failed, FailReason, PushReg
from kvwire.protocol.ranks import RankKey
from kvwire.testing.core_harness import CoreHarness, TestEngine, events, only
from kvwire.testing.cores_env import CFG, D_BLOCKS, TID, TOKENS
from kvwire.transport.base import PeerMode

ONE_HEAD = KVSpec(num_layers=2, kv_heads=1, head_dim=4, dtype="float8", block_size=4)
P_BLOCKS = (3, 4)


def _d_registered() -> tuple[CoreHarness, TestEngine, dict[int, PushReg]]:
    """D (TP1) allocated for a request of P (TP2), both handshakes done: its push_reg to each P rank."""
    p = TestEngine.build("P", tp=2, spec=ONE_HEAD, port=5000)
    d = TestEngine.build("D", spec=ONE_HEAD, port=6000)
    h = CoreHarness(PushConsumerCore(d.info, d.layouts, d.num_blocks, CFG, port=6000))
    remote = RemoteEngine("P", "127.0.0.1", 5000, tp_size=2)
    starts = only(h.at(0.0, Allocated(TID, tuple(D_BLOCKS), TOKENS, 0, remote)), StartHandshake)
    assert sorted(s.remote for s in starts) == [(0, 0), (0, 1)]
    regs: dict[int, PushReg] = {}
    for s in starts:
        for send in only(h.done(0.0, s.token, p.peer_rank(s.remote, PeerMode.NOTIF_ONLY)), Send):
            assert isinstance(send.msg, PushReg) and send.peer == p.agent(s.remote)
            regs[s.remote[1]] = send.msg
    assert sorted(regs) == [0, 1]
    return h, p, regs


def _from_p(rank: int, **fields: object) -> dict[str, object]:
    return {
        "transfer_id": TID,
        "engine_id": "P",
        "incarnation": "P-life1",
        "tp_rank": rank,
        "pp_rank": 0,
        **fields,
    }


def test_d_is_ready_when_the_idle_rank_says_done_with_nothing_moved() -> None:
    h, p, regs = _d_registered()
    nbytes = TOKENS * ONE_HEAD.bytes_per_token()
    done0 = Done(num_blocks=2, reg_nonce=regs[0].reg_nonce, nbytes=nbytes, **_from_p(0))  # type: ignore[arg-type]
    done1 = Done(num_blocks=2, reg_nonce=regs[1].reg_nonce, nbytes=0, **_from_p(1))  # type: ignore[arg-type]
    assert h.at(0.5, p.notif(done1, rank=(0, 1))) == []
    assert h.at(0.5, p.notif(done0, rank=(0, 0))) == [Emit(ConsumerEvent(TID, ConsumerEventKind.READY))]


def test_d_takes_an_older_ps_refusal_from_the_idle_rank_as_its_end() -> None:
    """A P from before idle ranks were told refuses that registration (``bad_registration``): it moves
    nothing, so the load goes on; the same refusal from the rank that writes fails it."""
    h, p, regs = _d_registered()
    refusal = Failed(reason=FailReason.BAD_REGISTRATION, **_from_p(1))  # type: ignore[arg-type]
    assert h.at(0.5, p.notif(refusal, rank=(0, 1))) == []
    nbytes = TOKENS * ONE_HEAD.bytes_per_token()
    done0 = Done(num_blocks=2, reg_nonce=regs[0].reg_nonce, nbytes=nbytes, **_from_p(0))  # type: ignore[arg-type]
    assert h.at(0.5, p.notif(done0, rank=(0, 0))) == [Emit(ConsumerEvent(TID, ConsumerEventKind.READY))]

    h, p, regs = _d_registered()
    refusal0 = Failed(reason=FailReason.BAD_REGISTRATION, **_from_p(0))  # type: ignore[arg-type]
    out = h.at(0.5, p.notif(refusal0, rank=(0, 0)))
    failed = ConsumerEvent(TID, ConsumerEventKind.FAILED, FailReason.BAD_REGISTRATION)
    assert Emit(failed) in out


def test_the_idle_p_rank_ends_the_request_on_d_s_registration_not_at_its_lease() -> None:
    """P rank 1's own core (one worker of a TP2 P, as inside vLLM): D's rank 0 registers, P answers a bare
    ``done`` (nothing to write) and frees the request's blocks at once."""
    p = TestEngine.build("P", tp=2, spec=ONE_HEAD, port=5000)
    d = TestEngine.build("D", spec=ONE_HEAD, port=6000)
    rank1 = {(0, 1): p.layouts[(0, 1)]}
    h = CoreHarness(PushProducerCore(p.info, rank1, p.num_blocks, CFG))
    assert h.at(0.0, Finished(TID, P_BLOCKS, TOKENS)) == []
    hs = only(h.at(0.25, d.notif(_push_reg(d), to=(0, 1))), StartHandshake)
    assert [(s.key, s.remote) for s in hs] == [((0, 1), (0, 0))]
    out = h.done(0.25, hs[0].token, d.peer_rank(mode=PeerMode.FULL))
    sends = only(out, Send)
    assert [type(s.msg) for s in sends] == [Done] and isinstance(sends[0].msg, Done)
    assert sends[0].msg.nbytes == 0 and sends[0].msg.tp_rank == 1
    freed = Emit(ProducerEvent(TID, ProducerOutcome.SENT))
    assert freed in out or freed in h.at(0.25, Outcome(sends[0].token, True))


def _push_reg(d: TestEngine, *, idle_ranks: bool = True, engine_id: str = "D") -> PushReg:
    return PushReg(
        transfer_id=TID, engine_id=engine_id, incarnation=f"{engine_id}-life1", tp_rank=0, tp_size=1,
        host=d.host, port=d.port, block_ids=D_BLOCKS, num_tokens=TOKENS, fence_ms=2_000,
        idle_ranks=idle_ranks,
    )  # fmt: skip


def _written(h: CoreHarness, d: TestEngine, reg: PushReg, key: RankKey) -> list[object]:
    """``reg`` reaches local rank ``key``, the handshake with D succeeds, the write (if any) ends: the events
    that came of it."""
    (hs,) = only(h.at(0.25, d.notif(reg, to=key, rank=(0, reg.tp_rank))), StartHandshake)
    out = h.done(0.25, hs.token, d.peer_rank((0, reg.tp_rank), mode=PeerMode.FULL))
    for post in only(out, PostWrite):  # (the harness feeds each tokened action's Outcome itself)
        out += h.ended(0.25, post.token)
    return events(out)


def test_a_p_core_with_every_rank_frees_at_the_readers_end_for_a_d_that_tells_no_idle_rank() -> None:
    """kvwire's own engine runs one core for all its ranks. A D from before idle ranks were told
    (``idle_ranks`` false) registers with the reading rank only: P frees when that write ends, not at its
    lease (the review found it waited 30 s); a D that tells them is waited for."""
    p = TestEngine.build("P", tp=2, spec=ONE_HEAD, port=5000)
    d = TestEngine.build("D", spec=ONE_HEAD, port=6000)
    h = CoreHarness(PushProducerCore(p.info, p.layouts, p.num_blocks, CFG))
    h.at(0.0, Finished(TID, P_BLOCKS, TOKENS))
    sent = [ProducerEvent(TID, ProducerOutcome.SENT)]
    assert _written(h, d, _push_reg(d, idle_ranks=False), (0, 0)) == sent

    h = CoreHarness(PushProducerCore(p.info, p.layouts, p.num_blocks, CFG))
    h.at(0.0, Finished(TID, P_BLOCKS, TOKENS))
    assert _written(h, d, _push_reg(d), (0, 0)) == []  # the idle rank's word is still to come
    assert _written(h, d, _push_reg(d), (0, 1)) == sent


def test_a_cancel_from_another_d_does_not_end_a_request_its_d_is_loading() -> None:
    """D (TP 2 here: rank 1 not registered yet) holds a finished write on P rank 0; a stray cancel of the
    same transfer from another D life must not end it (the review showed P then failed rank 1)."""
    p = TestEngine.build("P", spec=ONE_HEAD, port=5000)
    d = TestEngine.build("D", tp=2, spec=ONE_HEAD, port=6000)
    h = CoreHarness(PushProducerCore(p.info, p.layouts, p.num_blocks, CFG))
    h.at(0.0, Finished(TID, P_BLOCKS, TOKENS))
    reg0 = msgspec.structs.replace(_push_reg(d), tp_size=2)
    assert _written(h, d, reg0, (0, 0)) == []  # rank 1 of D still to register
    stray = Cancel(transfer_id=TID, engine_id="D2", incarnation="D2-life1")
    out = h.at(0.25, NotifIn((0, 0), "D2/D2-life1/pp0/tp0", encode_notif(stray)))
    assert events(out) == [] and h.core.live_requests == 1
    reg1 = msgspec.structs.replace(reg0, tp_rank=1)
    assert _written(h, d, reg1, (0, 0)) == [ProducerEvent(TID, ProducerOutcome.SENT)]


def test_a_refused_registration_of_another_d_does_not_keep_its_d_from_giving_the_request_up() -> None:
    """Another D life's push_reg, refused at once (bad token counts), makes it no owner of the request:
    the real D's decline still frees P's blocks at once (a second review found them held to the lease)."""
    p = TestEngine.build("P", spec=ONE_HEAD, port=5000)
    d2 = TestEngine.build("D2", spec=ONE_HEAD, port=6100)
    h = CoreHarness(PushProducerCore(p.info, p.layouts, p.num_blocks, CFG))
    h.at(0.0, Finished(TID, P_BLOCKS, TOKENS))
    bad = msgspec.structs.replace(_push_reg(d2, engine_id="D2"), num_cached_tokens=99)
    assert _written(h, d2, bad, (0, 0)) == []
    declined = Cancel(transfer_id=TID, engine_id="D", incarnation="D-life1")
    out = h.at(0.25, NotifIn((0, 0), "D/D-life1/pp0/tp0", encode_notif(declined)))
    assert events(out) == [ProducerEvent(TID, ProducerOutcome.ABORTED)]

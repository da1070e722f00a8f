"""Fail closed (issue 20 items 1-3), in the cores and in virtual time: a request's identity is single-use on
D, a ``done`` must state what P wrote for this very registration (and, when D asks, match a digest of the
bytes that landed), and P refuses a ``push_reg`` that does not cover its prompt. Each case ends in a typed
failure or a counted drop, never READY on bytes D cannot trust.

The digest itself (``kv.digest.kv_digest``) is checked on real caches: P's source and D's blocks after a
real copy of ``plan_transfer``'s descriptors agree across block sizes and TP maps, and one byte changed in
the payload changes it."""

from __future__ import annotations

import ctypes
import dataclasses

import msgspec
import numpy as np
import pytest

from kvwire.core.base import DropReason, Refused
from kvwire.core.consumer_liveness import NOTHING_POSTED
from kvwire.core.consumer_records import UsedIds, sampled
from kvwire.core.io import (
    Abort,
    Allocated,
    Digest,
    Finished,
    PostRead,
    PostWrite,
    RemoteEngine,
    Send,
    StartHandshake,
)
from kvwire.errors import TransferIdReused
from kvwire.kv.cache import KVCache
from kvwire.kv.descriptors import plan_transfer
from kvwire.kv.digest import DigestScope, kv_digest, pair_heads, payload_bytes
from kvwire.kv.mapping import HeadSlice, RankLayout
from kvwire.kv.spec import KVSpec, Layout
from kvwire.protocol.codec import decode_notif
from kvwire.protocol.messages import Cancel, Done, Failed, FailReason, PushReg, TransferMode
from kvwire.testing.core_harness import TestEngine, events, one, only, sent
from kvwire.testing.cores_env import (
    BLOCKS,
    CFG,
    D_BLOCKS,
    FAILED,
    PULL,
    PUSH,
    READY,
    RELEASED,
    TID,
    TOKENS,
    D,
    P,
    ev,
)
from kvwire.transport.base import PeerMode

DIGEST_CFG = dataclasses.replace(CFG, kv_digest_sample=1.0)

# -- 1. single-use transfer ids ---------------------------------------------------------------------------


def test_d_refuses_a_transfer_id_it_is_serving_or_has_served() -> None:
    t = D()
    t.start(0.0)
    with pytest.raises(TransferIdReused, match=TID):  # live
        t.h.at(0.25, t.allocated())
    assert events(t.from_p(0.5, t.done())) == [ev(READY)]
    with pytest.raises(TransferIdReused, match=TID):  # served
        t.h.at(0.75, t.allocated())
    assert t.core.live_requests == 0


def test_a_replayed_done_for_a_reused_transfer_id_never_completes_it() -> None:
    """The issue's case: a captured done replayed for a second request under the same transfer_id. The
    second registration is refused; past the table's bound it is taken, but gets a new reg_nonce, so the
    replay (the first registration's nonce) fails it instead of making it READY."""
    t = D(dataclasses.replace(CFG, max_served_ids=2))
    t.start(0.0)
    captured = t.done()
    assert events(t.from_p(0.25, captured)) == [ev(READY)]
    with pytest.raises(Refused) as late:  # the replay while D remembers the id: dropped (counted)
        t.from_p(0.5, captured)
    assert late.value.reason is DropReason.ENDED_TRANSFER
    for tid in ("other-1", "other-2"):  # the first id falls out of the bounded table
        t.start(0.5, tid)
    t.start(0.75)
    assert t.nonce() != captured.reg_nonce
    assert events(t.from_p(1.0, captured)) == [
        ev(FAILED, FailReason.BAD_DONE),
        ev(RELEASED, FailReason.BAD_DONE),
    ]


def test_a_done_for_a_transfer_never_registered_is_dropped_as_unknown() -> None:
    t = D()
    t.start(0.0)
    with pytest.raises(Refused) as err:
        t.from_p(0.25, t.done("never"))
    assert err.value.reason is DropReason.UNKNOWN_TRANSFER
    assert t.core.live_requests == 1


def test_used_ids_are_bounded_oldest_first() -> None:
    ids = UsedIds(3)
    assert all(ids.add(f"t{i}") for i in range(3)) and not ids.add("t0")
    assert ids.add("t3") and len(ids) == 3 and "t0" not in ids and "t1" in ids


# -- 2. done states what P wrote --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"reg_nonce": 0, "nbytes": None}, "an old peer's done (states nothing)"),
        ({"reg_nonce": 99}, "another registration's done"),
        ({"nbytes": 16}, "fewer bytes than the registration needs"),
        ({"num_blocks": 1}, "fewer blocks"),
    ],
)
def test_a_done_that_does_not_state_this_registration_fails_the_request(
    change: dict[str, object], why: str
) -> None:
    t = D()
    t.start(0.0)
    bad = msgspec.structs.replace(t.done(), **change)
    out = t.from_p(0.25, bad)
    assert events(out) == [ev(FAILED, FailReason.BAD_DONE), ev(RELEASED, FailReason.BAD_DONE)], why
    assert t.core.stats.failures[FailReason.BAD_DONE] == 1


def test_a_repeated_bad_done_is_refused_late_and_counted_once() -> None:
    p2 = TestEngine.build("P", tp=2, port=5000)
    t = D()
    remote = RemoteEngine("P", "127.0.0.1", 5000, tp_size=2)
    for hs in only(t.h.at(0.0, Allocated(TID, tuple(D_BLOCKS), TOKENS, 0, remote)), StartHandshake):
        t.h.done(0.0, hs.token, p2.peer_rank(hs.remote, PeerMode.NOTIF_ONLY))
    old_peer = Done(transfer_id=TID, engine_id="P", incarnation="P-life1", tp_rank=0, pp_rank=0, num_blocks=2)
    out = t.h.at(0.25, p2.notif(old_peer))
    assert events(out) == [ev(FAILED, FailReason.BAD_DONE)]  # rank 1 still registered: cancelled, drains
    with pytest.raises(Refused) as err:
        t.h.at(0.5, p2.notif(old_peer))
    assert err.value.reason is DropReason.LATE
    assert t.core.stats.failures[FailReason.BAD_DONE] == 1


def test_p_states_the_nonce_and_bytes_of_the_registration_it_serves() -> None:
    t = P()
    for now, tid, nonce, blocks in ((0.0, TID, 41, BLOCKS), (0.5, "req-2", 42, (5, 6))):
        reg = msgspec.structs.replace(t.push_reg(tid), reg_nonce=nonce)
        hs = one(t.from_d(now, reg), StartHandshake)
        t.h.done(now, hs.token, t.d.peer_rank(mode=PeerMode.FULL))
        w = one(t.h.at(now + 0.25, Finished(tid, blocks, TOKENS)), PostWrite)
        done = decode_notif(w.notif)
        # 8 tokens x (2 layers x K,V x 2 heads x 4 bytes): the payload, whatever the descriptors were
        assert isinstance(done, Done) and (done.reg_nonce, done.nbytes, done.digest) == (nonce, 256, None)


# -- 2. the digest --------------------------------------------------------------------------------------


def digest_d() -> tuple[D, PushReg]:
    t = D(DIGEST_CFG)
    out = t.start(0.0)
    reg = sent(out, PushReg)[0]
    assert reg.want_digest and reg.reg_nonce > 0
    return t, reg


def test_d_checks_the_landed_bytes_against_p_digest() -> None:
    t, _ = digest_d()
    asked: list[Digest] = []

    def digest(action: Digest) -> bytes:
        asked.append(action)
        return b"\x01\x02\x03\x04"

    t.h.digest = digest
    out = t.from_p(0.25, msgspec.structs.replace(t.done(), digest=b"\x01\x02\x03\x04"))
    assert events(out) == [ev(READY)]
    (d,) = asked
    assert d.scope == DigestScope(range(0, 2), ((0, 2),), tuple(D_BLOCKS), 0, TOKENS)


@pytest.mark.parametrize("stated", [b"\x00\x00\x00\x00", None], ids=["differs", "none-stated"])
def test_a_digest_mismatch_fails_the_request(stated: bytes | None) -> None:
    t, _ = digest_d()
    t.h.digest = lambda a: b"\x01\x02\x03\x04"
    out = t.from_p(0.25, msgspec.structs.replace(t.done(), digest=stated))
    assert events(out) == [ev(FAILED, FailReason.DIGEST_MISMATCH), ev(RELEASED, FailReason.DIGEST_MISMATCH)]


def test_d_whose_memory_cannot_be_read_fails_closed_when_it_asked_for_a_digest() -> None:
    t, _ = digest_d()  # the harness answers None: device memory
    out = t.from_p(0.25, msgspec.structs.replace(t.done(), digest=b"\x01\x02\x03\x04"))
    assert events(out)[0] == ev(FAILED, FailReason.DIGEST_MISMATCH)


def test_d_checks_the_digest_of_a_done_that_arrives_while_another_rank_registers() -> None:
    """P TP2: rank 0's push_reg went out while rank 1's handshake is pending (D still REGISTERING); a
    done from rank 0 then may not skip the digest (it did: the request went READY on a wrong digest)."""
    p2 = TestEngine.build("P", tp=2, port=5000)
    t = D(DIGEST_CFG)
    remote = RemoteEngine("P", "127.0.0.1", 5000, tp_size=2)
    hs0, hs1 = only(t.h.at(0.0, Allocated(TID, tuple(D_BLOCKS), TOKENS, 0, remote)), StartHandshake)
    reg = one(t.h.done(0.0, hs0.token, p2.peer_rank(hs0.remote, PeerMode.NOTIF_ONLY)), Send)
    assert isinstance(reg.msg, PushReg) and reg.msg.want_digest
    asked: list[Digest] = []

    def digest(action: Digest) -> bytes:
        asked.append(action)
        return b"\x00\x00\x00\x00"

    t.h.digest = digest
    spec = t.d.info.spec
    half = TOKENS * spec.num_layers * len(spec.kinds) * spec.head_bytes  # each P rank holds one of 2 heads
    done = Done(
        transfer_id=TID, engine_id="P", incarnation="P-life1", tp_rank=0, pp_rank=0, num_blocks=2,
        reg_nonce=reg.msg.reg_nonce, nbytes=half, digest=b"\xde\xad\xbe\xef",
    )  # fmt: skip
    out = t.h.at(0.25, p2.notif(done, rank=(0, 0)))
    assert len(asked) == 1 and asked[0].scope.heads == ((0, 1),)
    # rank 1 was never registered with P: nothing to drain, the blocks are released at once
    assert events(out) == [ev(FAILED, FailReason.DIGEST_MISMATCH), ev(RELEASED, FailReason.DIGEST_MISMATCH)]
    t.h.done(0.5, hs1.token, p2.peer_rank(hs1.remote, PeerMode.NOTIF_ONLY))
    assert ev(READY) not in events(t.h.log)


def test_p_attaches_the_digest_of_its_source_when_d_asks() -> None:
    t = P()
    t.h.digest = lambda a: b"\xaa\xbb\xcc\xdd"
    hs = one(
        t.from_d(0.0, msgspec.structs.replace(t.push_reg(), want_digest=True, reg_nonce=7)), StartHandshake
    )
    t.h.done(0.0, hs.token, t.d.peer_rank(mode=PeerMode.FULL))
    out = t.h.at(0.25, Finished(TID, BLOCKS, TOKENS))
    d, w = one(out, Digest), one(out, PostWrite)
    assert out.index(d) < out.index(w)  # computed before the write is posted (its done carries it)
    assert d.scope == DigestScope(range(0, 2), ((0, 2),), BLOCKS, 0, TOKENS)
    done = decode_notif(w.notif)
    assert isinstance(done, Done) and (done.digest, done.reg_nonce) == (b"\xaa\xbb\xcc\xdd", 7)


def test_p_that_cannot_compute_an_asked_digest_says_so_and_writes_nothing() -> None:
    """A P whose KV is in device memory (the harness answers None): D would otherwise get a done with no
    digest and report digest_mismatch, blaming the transfer for a configuration problem."""
    t = P()
    hs = one(
        t.from_d(0.0, msgspec.structs.replace(t.push_reg(), want_digest=True, reg_nonce=7)), StartHandshake
    )
    t.h.done(0.0, hs.token, t.d.peer_rank(mode=PeerMode.FULL))
    out = t.h.at(0.25, Finished(TID, BLOCKS, TOKENS))
    assert not [a for a in out if isinstance(a, PostWrite)]
    assert t.failed(FailReason.DIGEST_UNAVAILABLE) in out
    assert t.core.stats.failures[FailReason.DIGEST_UNAVAILABLE] == 1


def test_d_fails_with_the_reason_p_gives_when_it_cannot_compute_the_digest() -> None:
    t, _ = digest_d()
    out = t.from_p(0.25, t.failed(FailReason.DIGEST_UNAVAILABLE))
    assert events(out)[0] == ev(FAILED, FailReason.DIGEST_UNAVAILABLE)


def test_sampling_is_deterministic_and_honours_its_share() -> None:
    ids = [f"req-{i}" for i in range(4000)]
    picked = [i for i in ids if sampled(i, 0.25)]
    assert 800 < len(picked) < 1200 and picked == [i for i in ids if sampled(i, 0.25)]
    assert not any(sampled(i, 0.0) for i in ids) and all(sampled(i, 1.0) for i in ids)


# -- 3. a push_reg short of the prompt ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("tokens", "blocks"), [(TOKENS - 1, D_BLOCKS), (4, D_BLOCKS[:1]), (TOKENS, D_BLOCKS[:1])],
    ids=["one-token-short", "half-the-prompt", "too-few-blocks"],
)  # fmt: skip
def test_p_refuses_a_push_reg_that_does_not_cover_its_prompt(tokens: int, blocks: list[int]) -> None:
    t = P()
    reg = msgspec.structs.replace(t.push_reg(), num_tokens=tokens, block_ids=blocks)
    hs = one(t.from_d(0.0, reg), StartHandshake)
    t.h.done(0.0, hs.token, t.d.peer_rank(mode=PeerMode.FULL))
    out = t.h.at(0.25, Finished(TID, BLOCKS, TOKENS))
    assert not any(isinstance(a, PostWrite) for a in out)  # not a byte written
    (failed,) = sent(out, Failed)
    assert failed.reason is FailReason.SHORT_REGISTRATION
    assert t.core.stats.failures[FailReason.SHORT_REGISTRATION] == 1


def test_d_fails_the_request_on_p_short_registration() -> None:
    t = D()
    t.start(0.0)
    msg = Failed(reason=FailReason.SHORT_REGISTRATION, **t._common(TID))  # type: ignore[arg-type]
    assert events(t.from_p(0.25, msg)) == [
        ev(FAILED, FailReason.SHORT_REGISTRATION),
        ev(RELEASED, FailReason.SHORT_REGISTRATION),
    ]


# -- 4. blocks a write P released may still reach ----------------------------------------------------------
GRACE = CFG.dead_peer_grace_s


@pytest.mark.parametrize("reason", list(FailReason), ids=lambda r: r.value)
def test_d_holds_the_blocks_of_a_rank_p_failed_after_it_may_have_posted(reason: FailReason) -> None:
    """P's ``failed`` after a write it recalled may come over a new connection while the old one drains
    (after a partition): FAILED at once, the blocks RELEASED only a grace after the word. A reason that
    says nothing was posted frees them at once."""
    t = D()
    t.start(0.0)
    out = t.from_p(0.5, t.failed(reason))
    if reason in NOTHING_POSTED:
        assert events(out) == [ev(FAILED, reason), ev(RELEASED, reason)]
        return
    assert events(out) == [ev(FAILED, reason)]
    assert t.core.wake_at() <= 0.5 + GRACE  # the driver ticks in time to release them
    assert events(t.h.ticks(0.5 + GRACE - 0.05, 0.1)) == []
    assert t.core.live_requests == 1
    assert events(t.h.tick(0.5 + GRACE)) == [ev(RELEASED, reason)]
    assert t.core.live_requests == 0


@pytest.mark.parametrize("wrote", [False, True])
def test_d_holds_the_blocks_a_cancelled_write_may_still_reach(wrote: bool) -> None:
    t = D()
    t.start(0.0)
    assert t.h.at(0.25, Abort(TID)) == [t.cancel()]
    out = t.from_p(0.5, t.cancel_ack(wrote=wrote))
    if not wrote:
        assert events(out) == [ev(RELEASED)]
        return
    assert events(out) == []
    assert events(t.h.ticks(0.5 + GRACE - 0.05, 0.1)) == []
    assert events(t.h.tick(0.5 + GRACE)) == [ev(RELEASED)]


def test_a_replayed_failed_does_not_extend_the_hold() -> None:
    t = D()
    t.start(0.0)
    assert events(t.from_p(0.5, t.failed(FailReason.WRITE_FAILED))) == [ev(FAILED, FailReason.WRITE_FAILED)]
    with pytest.raises(Refused) as late:  # the rank has ended: dropped, counted, holds nothing
        t.from_p(1.25, t.failed(FailReason.WRITE_FAILED))
    assert late.value.reason is DropReason.LATE
    assert events(t.h.tick(0.5 + GRACE)) == [ev(RELEASED, FailReason.WRITE_FAILED)]


def test_pull_d_holds_the_blocks_of_a_read_whose_post_failed() -> None:
    """NIXL may have issued part of a READ whose post then failed."""
    t = D(mode=PULL)
    t.h.accept = lambda a: not isinstance(a, PostRead)
    assert events(t.start(0.0)) == [ev(FAILED, FailReason.POST_FAILED)]
    assert events(t.h.ticks(GRACE - 0.05, 0.1)) == []
    assert events(t.h.tick(GRACE)) == [ev(RELEASED, FailReason.POST_FAILED)]


def test_a_closing_d_releases_held_blocks_at_once() -> None:
    t = D()
    t.start(0.0)
    t.from_p(0.5, t.failed(FailReason.TRANSFER_TIMEOUT))
    assert events(t.core.shutdown(0.6)) == [ev(RELEASED, FailReason.TRANSFER_TIMEOUT)]
    assert t.core.live_requests == 0


@pytest.mark.parametrize("mode", [PUSH, PULL])
def test_a_closing_d_releases_a_request_still_waiting_for_p(mode: TransferMode) -> None:
    """A request registered with P (push: waiting for its write; pull: its READ posted) when D closes:
    its cancel asks for an answer no loop will read, so it stayed cancelling, with no event for the engine
    and counted live for good (a review found it)."""
    t = D(mode=mode)
    t.start(0.0)
    assert t.core.live_requests == 1
    out = t.core.shutdown(0.6)
    assert events(out) == [ev(RELEASED)]  # as an abort: D gave the request up (and P is told so)
    assert t.core.live_requests == 0
    if mode is PUSH:  # P is still told to stop writing
        assert [m.transfer_id for m in sent(out, Cancel)] == [TID]
    else:  # P is told D gave it up: aborted, not a failure it counts (a restart is no fault of P's)
        assert [(m.transfer_id, m.reason) for m in sent(out, Failed)] == [(TID, FailReason.ABORTED)]


# -- the digest over real memory ------------------------------------------------------------------------


def _scope(
    slices: tuple[HeadSlice, ...], src: bool, blocks: list[int], cached: int, tokens: int
) -> DigestScope:
    heads = tuple((s.src_head if src else s.dst_head, s.num_heads) for s in slices)
    return DigestScope(range(0, 2), heads, tuple(blocks), cached, tokens)


def _copy(plan_src: np.ndarray, plan_dst: np.ndarray) -> None:
    for (sa, n, _), (da, _, _) in zip(plan_src.tolist(), plan_dst.tolist(), strict=True):
        ctypes.memmove(da, sa, n)


@pytest.mark.parametrize(
    ("layout", "p_bs", "d_bs", "p_tp", "d_tp"),
    [
        (Layout.HND, 4, 4, 1, 1),
        (Layout.HND, 4, 8, 2, 1),
        (Layout.NHD, 4, 8, 1, 2),
        (Layout.HND, 4, 4, 2, 2),
    ],
)
def test_p_and_d_digests_agree_after_a_real_copy_and_catch_one_changed_byte(
    layout: Layout, p_bs: int, d_bs: int, p_tp: int, d_tp: int
) -> None:
    base = KVSpec(num_layers=2, kv_heads=4, head_dim=4, dtype="float16", layout=layout)
    p_spec, d_spec = (dataclasses.replace(base, block_size=b) for b in (p_bs, d_bs))
    rng = np.random.default_rng(0)
    tokens, cached = 21, d_bs  # a partial last block, and a prefix hit on D
    p_blocks = [5, 2, 7, 1, 3, 6]
    d_blocks = [9, 4, 0, 6, 1, 2]
    for p_rank in range(p_tp):
        for d_rank in range(d_tp):
            pc = KVCache(p_spec, 10, tp_size=p_tp, tp_rank=p_rank)
            dc = KVCache(d_spec, 10, tp_size=d_tp, tp_rank=d_rank)
            pc.slab.view(np.uint16)[...] = rng.integers(0, 65535, pc.slab.shape, dtype=np.uint16)
            pl, dl = RankLayout.from_cache(pc), RankLayout.from_cache(dc)
            plan = plan_transfer(
                base, pl, dl, p_blocks, d_blocks, num_tokens=tokens, num_cached_tokens=cached
            )
            _copy(plan.src_array, plan.dst_array)
            slices = pair_heads(base, p_tp, d_tp, p_rank, d_rank)
            mine = kv_digest(pc, _scope(slices, True, p_blocks, cached, tokens))
            landed = kv_digest(dc, _scope(slices, False, d_blocks, cached, tokens))
            assert mine is not None and mine == landed
            assert payload_bytes(base, range(0, 2), slices, cached, tokens) <= plan.nbytes
            if not slices:
                assert plan.empty
                continue
            # A byte of the payload (last token, last layer, V or fused half) changed on D: detected.
            region = dc.region(1, base.kinds[-1]).view(np.uint16)
            last_block = d_blocks[(tokens - 1) // d_bs]
            head = slices[-1].dst_head
            cell = (head, (tokens - 1) % d_bs) if layout is Layout.HND else ((tokens - 1) % d_bs, head)
            region[last_block][cell][-1] ^= 1
            assert kv_digest(dc, _scope(slices, False, d_blocks, cached, tokens)) != mine
            region[last_block][cell][-1] ^= 1
            # Bytes past num_tokens are not the payload: what P's last block carries there does not matter.
            if (tokens % d_bs) and layout is Layout.HND:
                region[last_block][head, d_bs - 1] ^= 1
                assert kv_digest(dc, _scope(slices, False, d_blocks, cached, tokens)) == mine


def test_an_oversized_digest_is_refused_as_malformed() -> None:
    t, _ = digest_d()
    with pytest.raises(Refused) as err:
        t.from_p(0.25, msgspec.structs.replace(t.done(), digest=b"x" * 65))
    assert err.value.reason is DropReason.MALFORMED and t.core.live_requests == 1


def test_the_knobs_reach_the_connector_from_vllm_extra_config_and_are_checked() -> None:
    from kvwire.core.config import ConnectorConfig
    from kvwire.errors import ConfigError
    from kvwire.integrations.vllm.params import settings_from_extra

    cfg = settings_from_extra({"kv_digest_sample": 0.01, "max_served_ids": 1000}).connector_config()
    assert (cfg.kv_digest_sample, cfg.max_served_ids) == (0.01, 1000)
    assert ConnectorConfig().kv_digest_sample == 0.0  # production: off unless asked
    for bad in ({"kv_digest_sample": 1.5}, {"kv_digest_sample": -0.1}, {"max_served_ids": 0}):
        with pytest.raises(ConfigError):
            ConnectorConfig(**bad)  # type: ignore[arg-type]

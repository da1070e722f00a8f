"""The scheduler and the connector hooks: admission, holding and fencing blocks, failure policies."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from kvwire.core.config import LoadFailurePolicy
from kvwire.engine.config import EngineConfig, Role, preset
from kvwire.engine.engine import Engine
from kvwire.engine.hooks import (
    ConsumerEvent,
    ConsumerEventKind,
    HookEvents,
    ProducerEvent,
    ProducerOutcome,
    TransferRequest,
)
from kvwire.engine.loopback import LoopbackHub
from kvwire.engine.model import Model
from kvwire.engine.paged import PagedKV
from kvwire.engine.request import FinishReason, Request, RequestState, TransferRole
from kvwire.engine.tokenizer import EOS
from kvwire.errors import (
    BlockRangeError,
    EngineOverloaded,
    InvalidRequest,
    KVLoadFailed,
    KvwireError,
)
from kvwire.kv.allocator import BlockState
from kvwire.protocol.messages import FailReason

TINY = preset("tiny")
MODEL = Model(TINY, seed=0)
PROMPT = [int(t) for t in np.random.default_rng(3).integers(0, 256, 37)]  # 3 blocks of 16


class ScriptedHooks:
    """Records the engine's calls; the test decides which events ``poll`` returns."""

    def __init__(self, take: bool = True, refuse: bool = False) -> None:
        self.take = take
        self.refuse = refuse
        self.finished: list[TransferRequest] = []
        self.allocated: list[TransferRequest] = []
        self.aborted: list[str] = []
        self.declined: list[str] = []
        self.pending = HookEvents()
        self.closed = False

    def bind(self, wake: Callable[[], None]) -> None:
        self.wake = wake

    def request_finished(self, req: TransferRequest) -> bool:
        self.finished.append(req)
        return self.take

    def request_allocated(self, req: TransferRequest) -> None:
        if self.refuse:
            raise BlockRangeError("refused")
        self.allocated.append(req)

    def abort(self, transfer_id: str) -> None:
        self.aborted.append(transfer_id)

    def decline(self, req: TransferRequest) -> None:
        self.declined.append(req.transfer_id)

    def poll(self) -> HookEvents:
        out, self.pending = self.pending, HookEvents()
        return out

    def close(self) -> None:
        self.closed = True

    def consumer(self, tid: str, kind: ConsumerEventKind, reason: FailReason | None = None) -> None:
        self.pending = HookEvents(consumer=[*self.pending.consumer, ConsumerEvent(tid, kind, reason)])


def make(role: Role = Role.COLOCATED, hooks: ScriptedHooks | None = None, **kw: object) -> Engine:
    cfg = EngineConfig(TINY, role=role, num_blocks=kw.pop("num_blocks", 64), **kw)  # type: ignore[arg-type]
    e = Engine(cfg, model=MODEL)
    if hooks is not None:
        e.set_hooks(hooks)
    return e


def d_request(tid: str = "t1", max_tokens: int = 4) -> Request:
    return Request(
        "d-" + tid,
        list(PROMPT),
        max_tokens,
        ignore_eos=True,
        role=TransferRole.REMOTE_PREFILL,
        transfer_id=tid,
    )


def reference(max_tokens: int = 4) -> list[int]:
    return make().generate([PROMPT], max_tokens, ignore_eos=True)[0]


# -- prefill side -------------------------------------------------------------------------------------------
def test_prefill_holds_blocks_until_the_producer_event() -> None:
    hooks = ScriptedHooks()
    e = make(Role.PREFILL, hooks)
    req = Request("p", list(PROMPT), 50, role=TransferRole.REMOTE_DECODE, transfer_id="t1")
    e.submit(req)
    outs = e.step()
    assert req.state is RequestState.FINISHED_LENGTH and len(req.output_ids) == 1  # capped to one token
    assert outs[0].finished and outs[0].new_token_ids == tuple(req.output_ids)
    (tr,) = hooks.finished
    assert tr.transfer_id == "t1" and tr.num_tokens == len(PROMPT) and len(tr.block_ids) == 3
    assert e.kv.allocator.num_free == 64 - 3
    assert all(e.kv.allocator.state(b) is BlockState.ALLOCATED for b in tr.block_ids)
    e.step()
    assert e.kv.allocator.num_free == 61  # nothing frees them but the connector
    hooks.pending = HookEvents(producer=[ProducerEvent("t1", ProducerOutcome.SENT)])
    e.step()
    assert e.kv.allocator.num_free == 64
    assert not e.scheduler.has_lent_blocks()


def test_prefill_frees_at_once_when_the_connector_declines() -> None:
    hooks = ScriptedHooks(take=False)
    e = make(Role.PREFILL, hooks)
    e.submit(Request("p", list(PROMPT), 1, role=TransferRole.REMOTE_DECODE, transfer_id="t1"))
    e.step()
    assert len(hooks.finished) == 1 and e.kv.allocator.num_free == 64


# -- decode side --------------------------------------------------------------------------------------------
def test_decode_waits_for_kv_then_runs() -> None:
    hooks = ScriptedHooks()
    e = make(Role.DECODE, hooks)
    req = d_request(max_tokens=16)  # 37 + 15 positions: 4 blocks, 3 of them the prompt's
    e.submit(req)
    assert e.step() == []
    assert req.state is RequestState.WAITING_FOR_KV
    (tr,) = hooks.allocated
    assert tr.block_ids == tuple(req.block_ids[:3]) and tr.num_tokens == len(PROMPT)
    # prompt blocks are lent (quarantined); the block for decoding beyond the prompt is not
    assert [e.kv.allocator.state(b) for b in req.block_ids] == [BlockState.QUARANTINED] * 3 + [
        BlockState.ALLOCATED
    ]
    for _ in range(3):
        assert e.step() == []
    hooks.consumer("t1", ConsumerEventKind.READY)
    outs = e.step()
    assert (
        req.state is RequestState.RUNNING and len(req.output_ids) == 1 and outs[0].kv_transfer_s is not None
    )
    e.run_until_idle()
    assert req.state is RequestState.FINISHED_LENGTH and len(req.output_ids) == 16
    assert e.kv.allocator.num_free == 64


def test_kv_failure_fails_the_request_and_fences_blocks_until_released() -> None:
    hooks = ScriptedHooks()
    e = make(Role.DECODE, hooks)
    req = d_request()
    e.submit(req)
    e.step()
    prompt_blocks = req.block_ids[:3]
    hooks.consumer("t1", ConsumerEventKind.FAILED, FailReason.PEER_DEAD)
    (out,) = e.step()
    assert out.finished and out.finish_reason is FinishReason.ERROR
    assert isinstance(out.error, KVLoadFailed) and out.error.reason == "peer_dead"
    assert all(e.kv.allocator.state(b) is BlockState.QUARANTINED for b in prompt_blocks)
    assert e.scheduler.fenced_blocks == 3 and e.kv.allocator.num_free == 61
    hooks.consumer("t1", ConsumerEventKind.RELEASED)
    e.step()
    assert e.kv.allocator.num_free == 64 and e.scheduler.fenced_blocks == 0


def test_kv_failure_with_recompute_policy_prefills_locally_after_release() -> None:
    hooks = ScriptedHooks()
    e = make(Role.DECODE, hooks, kv_load_failure_policy=LoadFailurePolicy.RECOMPUTE)
    req = d_request()
    e.submit(req)
    e.step()
    hooks.consumer("t1", ConsumerEventKind.FAILED, FailReason.WRITE_FAILED)
    assert e.step() == []
    assert req.state is RequestState.RECOMPUTE_PENDING  # must not write into fenced blocks yet
    hooks.consumer("t1", ConsumerEventKind.RELEASED)
    e.run_until_idle()
    assert req.state is RequestState.FINISHED_LENGTH and req.output_ids == reference()
    assert e.kv.allocator.num_free == 64


def test_abort_while_waiting_for_kv_tells_the_connector_and_waits_for_release() -> None:
    hooks = ScriptedHooks()
    e = make(Role.DECODE, hooks)
    req = d_request()
    e.submit(req)
    e.step()
    e.abort(req.request_id)
    (out,) = e.step()
    assert out.finish_reason is FinishReason.ABORT and hooks.aborted == ["t1"]
    assert e.kv.allocator.num_free == 61  # the prompt's blocks may still be written by P
    hooks.consumer("t1", ConsumerEventKind.RELEASED)
    e.step()
    assert e.kv.allocator.num_free == 64


def test_abort_while_queued_before_allocation_declines_so_p_frees_its_blocks() -> None:
    """Dropped before any block was allocated (still queued): nothing to release here, but P holds the
    prompt's blocks for it: the connector is told (``decline``), and no abort is sent."""
    hooks = ScriptedHooks()
    e = make(Role.DECODE, hooks)
    req = d_request()
    e.submit(req)
    e.abort(req.request_id)
    (out,) = e.step()
    assert out.finish_reason is FinishReason.ABORT
    assert (hooks.declined, hooks.aborted, hooks.allocated) == (["t1"], [], [])
    assert e.kv.allocator.num_free == 64


def test_connector_refusal_fails_the_request_and_frees_blocks() -> None:
    hooks = ScriptedHooks(refuse=True)
    e = make(Role.DECODE, hooks)
    req = d_request()
    e.submit(req)
    (out,) = e.step()
    assert out.finish_reason is FinishReason.ERROR and isinstance(out.error, BlockRangeError)
    assert e.kv.allocator.num_free == 64 and not e.scheduler.has_lent_blocks()


def test_duplicate_transfer_id_is_refused() -> None:
    hooks = ScriptedHooks()
    e = make(Role.DECODE, hooks)
    e.submit(d_request("t1"))
    e.step()
    second = d_request("t1")
    e.submit(second)
    (out,) = e.step()
    assert isinstance(out.error, InvalidRequest)


# -- loopback: the whole flow with real bytes ----------------------------------------------------------------
def _pair(policy: LoadFailurePolicy = LoadFailurePolicy.FAIL) -> tuple[Engine, Engine, LoopbackHub]:
    hub = LoopbackHub()
    p = make(Role.PREFILL)
    d = make(Role.DECODE, kv_load_failure_policy=policy)
    p.set_hooks(hub.producer(p.kv))
    d.set_hooks(hub.consumer(d.kv))
    return p, d, hub


def _run_pair(p: Engine, d: Engine, req: Request) -> None:
    p.submit(Request("p", list(PROMPT), 1, role=TransferRole.REMOTE_DECODE, transfer_id=req.transfer_id))
    d.submit(req)
    for _ in range(100):
        p.step()
        d.step()
        if req.state.finished and not (p.scheduler.has_lent_blocks() or d.scheduler.has_lent_blocks()):
            return
    raise AssertionError("the pair did not settle")


def test_loopback_failure_with_fail_policy() -> None:
    p, d, hub = _pair()
    hub.fail_next = 1
    req = d_request()
    _run_pair(p, d, req)
    assert isinstance(req.error, KVLoadFailed) and req.output_ids == []
    assert p.kv.allocator.num_free == 64 and d.kv.allocator.num_free == 64


def test_loopback_failure_with_recompute_policy_matches_colocated() -> None:
    p, d, hub = _pair(LoadFailurePolicy.RECOMPUTE)
    hub.fail_next = 1
    req = d_request()
    _run_pair(p, d, req)
    assert hub.transfers == 0 and req.output_ids == reference()


def test_decode_really_uses_the_transferred_kv(monkeypatch: pytest.MonkeyPatch) -> None:
    """Corrupting what arrives changes the answer: D does not recompute the prompt."""
    import kvwire.engine.loopback as lb

    real = lb.copy_kv

    def corrupting(src: PagedKV, sb: tuple[int, ...], dst: PagedKV, db: tuple[int, ...]) -> int:
        n = real(src, sb, dst, db)
        dst.cache(0, 0).v(0)[db[-1]] *= -4.0
        return n

    monkeypatch.setattr(lb, "copy_kv", corrupting)
    p, d, _ = _pair()
    req = d_request(max_tokens=4)
    _run_pair(p, d, req)
    assert req.state is RequestState.FINISHED_LENGTH
    assert req.output_ids != reference()


# -- admission and limits ------------------------------------------------------------------------------------
def test_requests_wait_for_blocks_and_join_between_steps() -> None:
    e = make(num_blocks=8)
    a = Request("a", list(PROMPT), 20, ignore_eos=True)  # ceil((37+19)/16) = 4 blocks
    b = Request("b", list(PROMPT), 20, ignore_eos=True)
    c = Request("c", list(PROMPT), 20, ignore_eos=True)
    for r in (a, b, c):
        e.submit(r)
    e.step()
    assert a.state is b.state is RequestState.RUNNING and c.state is RequestState.WAITING
    assert e.kv.allocator.num_free == 0
    e.run_until_idle()
    assert a.output_ids == b.output_ids == c.output_ids == reference(20)


def test_max_num_seqs_limits_the_batch() -> None:
    e = make(max_num_seqs=2)
    reqs = [Request(f"r{i}", list(PROMPT), 3, ignore_eos=True) for i in range(3)]
    for r in reqs:
        e.submit(r)
    e.step()
    assert [r.state for r in reqs] == [RequestState.RUNNING, RequestState.RUNNING, RequestState.WAITING]
    e.run_until_idle()
    assert all(r.output_ids == reference(3) for r in reqs)


def test_queue_limit_refuses_with_overloaded() -> None:
    e = make(num_blocks=4, max_waiting=2)
    big = [Request(f"r{i}", list(PROMPT), 20, ignore_eos=True) for i in range(3)]
    for r in big:
        e.submit(r)
    outs = e.step()
    assert big[0].state is RequestState.RUNNING and big[1].state is RequestState.WAITING
    assert [type(o.error) for o in outs if o.finished] == [EngineOverloaded]


def test_abort_running_and_waiting_requests_frees_blocks() -> None:
    e = make(num_blocks=4)
    a = Request("a", list(PROMPT), 20, ignore_eos=True)
    b = Request("b", list(PROMPT), 20, ignore_eos=True)
    e.submit(a)
    e.submit(b)
    e.step()
    e.abort("a")
    e.abort("b")
    e.abort("unknown")
    outs = e.step()
    assert {o.request_id: o.finish_reason for o in outs if o.finished} == {
        "a": FinishReason.ABORT,
        "b": FinishReason.ABORT,
    }
    assert e.kv.allocator.num_free == 4 and not e.scheduler.has_unfinished()


def test_eos_stops_unless_ignored() -> None:
    class EosModel(Model):
        def step(self, kv: PagedKV, block_ids: list[int], token: int, pos: int) -> np.ndarray:
            logits = super().step(kv, block_ids, token, pos)
            logits[EOS] = logits.max() + 1.0
            return logits

    e = Engine(EngineConfig(TINY, num_blocks=64), model=EosModel(TINY))
    stop = Request("s", list(PROMPT), 5)
    go = Request("g", list(PROMPT), 5, ignore_eos=True)
    e.submit(stop)
    e.submit(go)
    e.run_until_idle()
    assert stop.output_ids == [EOS] and stop.state is RequestState.FINISHED_STOPPED
    assert go.output_ids == [EOS] * 5 and go.state is RequestState.FINISHED_LENGTH


@pytest.mark.parametrize(
    ("role", "req", "hooks"),
    [
        (Role.COLOCATED, Request("x", [], 4), None),
        (Role.COLOCATED, Request("x", [300], 4), None),
        (Role.COLOCATED, Request("x", [1], 0), None),
        (Role.COLOCATED, Request("x", [1] * 8000, 500), None),
        (Role.COLOCATED, Request("x", [1] * 2000, 1), None),  # more blocks than the cache's 64
        (Role.COLOCATED, Request("x", [1], 4, role=TransferRole.REMOTE_DECODE), None),  # no transfer id
        (Role.DECODE, Request("x", [1], 4, role=TransferRole.REMOTE_PREFILL, transfer_id="t"), None),
        (
            Role.PREFILL,
            Request("x", [1], 4, role=TransferRole.REMOTE_PREFILL, transfer_id="t"),
            ScriptedHooks(),
        ),
        (
            Role.DECODE,
            Request("x", [1], 4, role=TransferRole.REMOTE_DECODE, transfer_id="t"),
            ScriptedHooks(),
        ),
    ],
)
def test_invalid_requests_are_refused_at_submit(
    role: Role, req: Request, hooks: ScriptedHooks | None
) -> None:
    e = make(role, hooks)
    with pytest.raises(InvalidRequest):
        e.submit(req)


def test_close_ends_live_requests_and_closes_the_connector() -> None:
    hooks = ScriptedHooks()
    e = make(Role.DECODE, hooks)
    req = d_request()
    got = []
    req.on_output = got.append
    e.submit(req)
    e.step()
    e.close()
    assert hooks.closed and isinstance(got[-1].error, EngineOverloaded)
    with pytest.raises(KvwireError):
        e.submit(d_request("t2"))


def test_a_second_queued_decode_leg_under_one_transfer_id_is_refused() -> None:
    """Two decode legs with one transfer id, both queued: admitting both put the second in the first's place,
    so the first was never answered, its blocks stayed fenced, and its later abort raised out of the step
    (losing the rest of that inbox batch). Now the second is refused at once (400) and the first is served."""
    hooks = ScriptedHooks()
    e = make(Role.DECODE, hooks, max_num_seqs=1)
    blocker = Request("blocker", [5] * 8, 4)  # holds the only slot: the legs queue behind it
    a, b = d_request(), d_request()
    a.request_id, b.request_id = "A", "B"
    e.submit(blocker)
    e.step()
    e.submit(a)
    e.submit(b)
    e.step()
    assert b.state is RequestState.FINISHED_ERROR and "already in use" in str(b.error)
    for _ in range(20):
        e.step()
        if a.state is RequestState.WAITING_FOR_KV:
            break
    hooks.consumer("t1", ConsumerEventKind.READY)
    e.run_until_idle()
    assert a.state is RequestState.FINISHED_LENGTH and blocker.state.finished
    assert [tr.transfer_id for tr in hooks.allocated] == ["t1"] and e.kv.allocator.num_free == 64

"""The vLLM connector's scheduler and worker logic (no vLLM needed) over real NIXL in one process:
vLLM-shaped per-layer tensors wrapped zero copy, P and D driven as vLLM drives them, bytes compared."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest

from kvwire.integrations.vllm import scheduler
from kvwire.integrations.vllm.params import KvRole, OpKind, parse_params, settings_from_extra
from kvwire.integrations.vllm.scheduler import LocalEngine, SchedulerSide
from kvwire.integrations.vllm.worker import Finished, RankPlace, WorkerSide
from kvwire.testing.procs import free_port

pytestmark = pytest.mark.nixl

LAYERS, HEADS, HEAD_DIM, BS, NUM_BLOCKS = 3, 4, 16, 16, 40


SHAPES = {
    "flash": (2, NUM_BLOCKS, BS, HEADS, HEAD_DIM),  # FlashAttention: [2, N, bs, H, D], NHD
    "flash-hnd": (2, NUM_BLOCKS, HEADS, BS, HEAD_DIM),  # K/V outermost, HND blocks
    "cpu": (NUM_BLOCKS, HEADS, BS, 2 * HEAD_DIM),  # vLLM's CPU backend: per head a K tile then a V tile
    "v034": (NUM_BLOCKS, HEADS, BS, 2 * HEAD_DIM),  # vLLM 0.34 LBHNC: the same, every layer in one buffer
}


def vllm_tensors(layout: str, seed: int | None) -> dict[str, np.ndarray]:
    """Per-layer caches shaped as vLLM allocates them; random bytes when seeded, zeros otherwise."""
    shape = SHAPES[layout]
    rng = np.random.default_rng(seed)
    out = {}
    backing = np.zeros((LAYERS, *shape), dtype=np.float16)
    for i in range(LAYERS):
        t = backing[i] if layout == "v034" else np.zeros(shape, dtype=np.float16)
        if seed is not None:
            t.view(np.uint16)[...] = rng.integers(0, 1 << 16, size=shape, dtype=np.uint16)
        out[f"model.layers.{i}.self_attn.attn"] = t
    return out


def blockwise(t: np.ndarray) -> np.ndarray:
    """[kinds, blocks, bytes of a block] as uint16 words, whatever the layout."""
    words = t.view(np.uint16)
    if words.shape[0] == 2:  # K/V outermost
        return words.reshape(2, NUM_BLOCKS, -1)
    return words.reshape(1, NUM_BLOCKS, -1)


class Side:
    def __init__(self, role: KvRole, layout: str, mode: str, seed: int | None) -> None:
        port = free_port()
        self.settings = settings_from_extra(
            {"mode": mode, "side_channel_port": port, "liveness_timeout_s": 2.0}
        )
        eid = f"{role.value}-{port}"
        self.place = RankPlace(eid, "inc1", "tiny", 1, 0, 1, 0, LAYERS, HEADS, HEAD_DIM, BS)
        self.sched = SchedulerSide(role, self.settings, LocalEngine(eid, "127.0.0.1", port, 1, 1), BS)
        self.worker = WorkerSide(role, self.settings, self.place)
        self.tensors = vllm_tensors(layout, seed)
        self.worker.register(self.tensors)
        self.reported = Finished()

    def step(self) -> None:
        """One vLLM step: the scheduler's ops go to the worker, the worker's report comes back."""
        self.worker.apply(self.sched.take_ops())
        got = self.worker.finished()
        self.sched.transfers_ended(got.sending, got.recving)
        self.reported.sending |= got.sending
        self.reported.recving |= got.recving
        self.reported.failed_recving |= got.failed_recving


@pytest.fixture(
    params=[("flash", "push"), ("flash-hnd", "push"), ("cpu", "push"), ("v034", "push"), ("v034", "pull")],
    ids=str,
)
def pd(request: pytest.FixtureRequest) -> Iterator[tuple[Side, Side]]:
    layout, mode = request.param
    p = Side(KvRole.PRODUCER, layout, mode, seed=7)
    d = Side(KvRole.CONSUMER, layout, mode, seed=None)
    try:
        yield p, d
    finally:
        p.worker.close()
        d.worker.close()


def run_until(p: Side, d: Side, done: Callable[[], bool], timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        p.step()
        d.step()
        if done():
            return
        time.sleep(0.002)
    raise AssertionError(f"timed out: P {p.reported}, D {d.reported}")


def test_p_to_d_moves_exact_blocks_and_frees_once(pd: tuple[Side, Side]) -> None:
    p, d = pd
    n = 5 * BS - 3  # the last block is partial
    p_blocks, d_blocks = [4, 5, 6, 20, 9], [33, 2, 3, 10, 11]
    delay, params = p.sched.finished(
        "req-p", {"do_remote_decode": True, "transfer_id": "t1"}, p_blocks, n, False
    )
    assert delay and params is not None and params["remote_port"] == p.settings.side_channel_port
    assert d.sched.matched_tokens("req-d", params, n, 0) == (n, True)
    d.sched.allocated("req-d", d_blocks, n, n)
    assert d.sched.num_loading == 1
    run_until(p, d, lambda: "req-d" in d.reported.recving and "req-p" in p.reported.sending)
    assert d.reported.failed_recving == set()
    assert not p.sched.has_pending_sends() and d.sched.num_loading == 0
    for name, src in p.tensors.items():
        src_blocks, dst_blocks = blockwise(src), blockwise(d.tensors[name])
        for pb, db in zip(p_blocks, d_blocks, strict=True):
            assert np.array_equal(src_blocks[:, pb], dst_blocks[:, db])
        others = [b for b in range(NUM_BLOCKS) if b not in d_blocks]
        assert not dst_blocks[:, others].any(), "bytes landed outside the request's blocks"
    # Each request is reported exactly once: more steps add nothing.
    for _ in range(5):
        p.step()
        d.step()
    assert p.reported.sending == {"req-p"} and d.reported.recving == {"req-d"}


def test_d_abort_before_p_finishes_releases_blocks_once(pd: tuple[Side, Side]) -> None:
    p, d = pd
    n = 2 * BS
    params = {
        "do_remote_prefill": True, "transfer_id": "t2", "remote_engine_id": p.place.engine_id,
        "remote_host": "127.0.0.1", "remote_port": p.settings.side_channel_port,
    }  # fmt: skip
    if p.settings.mode.value == "pull":
        params["remote_block_ids"] = [1, 2]
    assert d.sched.matched_tokens("req-d", params, n, 0) == (n, True)
    d.sched.allocated("req-d", [7, 8], n, n)
    d.step()
    # vLLM aborts the waiting request: it keeps the blocks itself until finished_recving.
    assert d.sched.finished("req-d", params, [7, 8], n, True) == (False, None)
    ops = d.sched.take_ops()
    assert [o.kind for o in ops] == [OpKind.ABORT]
    d.worker.apply(ops)
    run_until(p, d, lambda: "req-d" in d.reported.recving)
    assert d.reported.failed_recving == set()
    assert not blockwise(d.tensors["model.layers.0.self_attn.attn"])[:, [7, 8]].any()


def test_bad_settings_stop_the_engine_and_bad_params_are_served_locally(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A wrong kv_connector_extra_config is the operator's: the engine refuses to start, naming it. Wrong
    kv_transfer_params are a client's: inside vLLM's scheduler an exception would kill the engine, so the
    request is prefilled locally, logged and counted."""
    from kvwire.errors import ConfigError, InvalidRequest
    from kvwire.integrations.vllm.params import parse_params

    with pytest.raises(ConfigError, match="unknown_knob"):
        settings_from_extra({"unknown_knob": 1})
    with pytest.raises(ConfigError, match="mode"):
        settings_from_extra({"mode": "teleport"})
    with pytest.raises(InvalidRequest, match="remote_port"):
        parse_params({"do_remote_prefill": True, "remote_port": "x"})
    both = SchedulerSide(KvRole.BOTH, settings_from_extra({}), LocalEngine("e", "h", 1, 1, 1), BS)
    for i, bad in enumerate(
        (
            {"do_remote_prefill": True},
            {"do_remote_prefill": True, "remote_port": "x"},
            {"transfer_id": 7},
        )
    ):
        assert both.matched_tokens(f"r{i}", bad, 10, 0) == (0, False)
    assert both.finished("r3", {"do_remote_decode": "maybe"}, [1], 10, False) == (False, None)
    assert both.rejected == 4 and both.take_ops() == []
    assert "prefilled locally" in caplog.text


# A decode leg's kv_transfer_params naming P (each test adds its transfer id and what it varies).
D_LEG = {"do_remote_prefill": True, "remote_engine_id": "P", "remote_host": "127.0.0.1", "remote_port": 5700}


def test_a_refused_request_is_counted_and_logged_once_however_often_vllm_asks(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """vLLM asks ``get_num_new_matched_tokens`` at every step a request waits for blocks: a request with
    bad kv_transfer_params was counted and logged at each (12 for one request; 13 on kv_both, whose
    ``finished`` counted it again). A D leg naming no transfer id, or another prompt length than P's, is
    refused the same way (before, it loaded under its own request id, which no P holds, until P's fence)."""
    both = SchedulerSide(KvRole.BOTH, settings_from_extra({}), LocalEngine("e", "h", 1, 1, 1), BS)
    leg = D_LEG
    cases = {
        "bad-port": {**leg, "remote_port": "x", "transfer_id": "t0"},
        "no-id": leg,
        "longer-than-p": {**leg, "transfer_id": "t2", "num_tokens": 8},
    }
    for req_id, params in cases.items():
        for _ in range(12):
            assert both.matched_tokens(req_id, params, 10, 0) == (0, False)
        assert both.finished(req_id, params, [1], 10, False) == (False, None)
    assert both.rejected == 3
    # P is told to free its blocks where it can be named (another prompt length); the others name no P
    # or no transfer it could hold.
    assert [(op.kind, op.transfer_id) for op in both.take_ops()] == [(OpKind.DECLINE, "t2")]
    assert caplog.text.count("is prefilled locally") == 3
    assert "need transfer_id" in caplog.text and "P prefilled 8 tokens, this prompt has 10" in caplog.text
    # The id is free again once the request finished: another request under it is judged afresh.
    assert both.matched_tokens("bad-port", cases["bad-port"], 10, 0) == (0, False)
    assert both.rejected == 4
    # P's prompt length matching D's loads as before.
    assert both.matched_tokens("ok", {**leg, "transfer_id": "t3", "num_tokens": 10}, 10, 0) == (10, True)


@pytest.mark.parametrize("registered_first", [True, False])
def test_p_aborted_before_finishing_fails_d_at_once(registered_first: bool) -> None:
    """Both legs at once (push); P's request is aborted (its client went away) before it finished: D
    hears it from P at once (failed_recving, then vLLM's kv_load_failure_policy), not after the fence."""
    p = Side(KvRole.PRODUCER, "v034", "push", seed=7)
    d = Side(KvRole.CONSUMER, "v034", "push", seed=None)
    try:
        _p_aborted(p, d, registered_first)
    finally:
        p.worker.close()
        d.worker.close()


def _p_aborted(p: Side, d: Side, registered_first: bool) -> None:
    n = 2 * BS
    params = {
        "do_remote_prefill": True, "transfer_id": "t-drop", "remote_engine_id": p.place.engine_id,
        "remote_host": "127.0.0.1", "remote_port": p.settings.side_channel_port,
    }  # fmt: skip
    p_params = {"do_remote_decode": True, "transfer_id": "t-drop"}
    started = time.monotonic()
    if not registered_first:  # P's abort lands first: the registration meets a tombstone
        assert p.sched.finished("req-p", p_params, [1, 2], n, True) == (False, None)
        p.step()
    assert d.sched.matched_tokens("req-d", params, n, 0) == (n, True)
    d.sched.allocated("req-d", [7, 8], n, n)
    if registered_first:
        producer = p.worker.producer
        assert producer is not None
        run_until(p, d, lambda: producer.stats.handshakes_started > 0)  # D's push_reg reached P
        assert p.sched.finished("req-p", p_params, [1, 2], n, True) == (False, None)
    run_until(p, d, lambda: "req-d" in d.reported.recving)
    assert d.reported.failed_recving == {"req-d"}
    assert time.monotonic() - started < 5.0  # the fence is 30 s
    assert not blockwise(d.tensors["model.layers.0.self_attn.attn"])[:, [7, 8]].any()


def test_refused_operations_hand_the_blocks_back_at_once(pd: tuple[Side, Side]) -> None:
    """Block ids kvwire refuses (outside the cache): vLLM gets the request back in the same step, and
    nothing stays tracked (no idle step waits for a transfer that never started)."""
    p, d = pd
    assert p.sched.finished(
        "req-p", {"do_remote_decode": True, "transfer_id": "bad"}, [NUM_BLOCKS + 5], 8, False
    )[0]
    p.step()
    assert p.reported.sending == {"req-p"} and not p.worker._sends
    params = {"do_remote_prefill": True, "transfer_id": "bad-d", "remote_engine_id": p.place.engine_id,
              "remote_host": "127.0.0.1", "remote_port": p.settings.side_channel_port,
              "remote_block_ids": [1]}  # fmt: skip
    assert d.sched.matched_tokens("req-d", params, 8, 0) == (8, True)
    d.sched.allocated("req-d", [NUM_BLOCKS + 1], 8, 8)
    d.step()
    assert d.reported.recving == {"req-d"} and d.reported.failed_recving == {"req-d"} and not d.worker._loads


def test_a_second_load_under_a_live_transfer_id_is_refused_and_the_first_completes() -> None:
    """Two vLLM requests on D naming one transfer id (issue 20): the second is refused in its step
    (failed_recving: vLLM recomputes or errors it), and the first still gets P's bytes: the refusal does
    not take the first request's place in the worker's table."""
    p = Side(KvRole.PRODUCER, "flash-hnd", "push", seed=7)
    d = Side(KvRole.CONSUMER, "flash-hnd", "push", seed=None)
    try:
        n, p_blocks, d_blocks = 2 * BS, [4, 5], [10, 11]
        _, params = p.sched.finished(
            "req-p", {"do_remote_decode": True, "transfer_id": "t-dup"}, p_blocks, n, False
        )
        assert params is not None
        for rid, blocks in (("req-d1", d_blocks), ("req-d2", [20, 21])):
            assert d.sched.matched_tokens(rid, params, n, 0) == (n, True)
            d.sched.allocated(rid, blocks, n, n)
        d.step()
        assert d.reported.failed_recving == {"req-d2"}
        run_until(p, d, lambda: "req-d1" in d.reported.recving)
        assert d.reported.failed_recving == {"req-d2"}
        name = "model.layers.0.self_attn.attn"
        src, dst = blockwise(p.tensors[name]), blockwise(d.tensors[name])
        assert np.array_equal(src[:, p_blocks], dst[:, d_blocks])
        assert not dst[:, [20, 21]].any()
    finally:
        p.worker.close()
        d.worker.close()


@pytest.mark.parametrize("second", ["held", "aborted"])
def test_a_second_send_under_a_held_transfer_id_leaves_the_first_whole(second: str) -> None:
    """Two P legs naming one transfer id, both held at once (a client's retry while the first waits for
    D). The second used to overwrite the first in the worker's table: the first request's blocks were
    never reported (held for the engine's life) and its event went to the second. Aborted, the second's
    drop aborted the first's transfer. Now the scheduler refuses the second (no kv_transfer_params go out,
    so no D leg can be served from, or in pull mode read, the first's blocks; vLLM frees its blocks), and
    the first is sent to D whole."""
    p = Side(KvRole.PRODUCER, "flash-hnd", "push", seed=7)
    d = Side(KvRole.CONSUMER, "flash-hnd", "push", seed=None)
    try:
        n, p_blocks, d_blocks = 2 * BS, [4, 5], [10, 11]
        kv = {"do_remote_decode": True, "transfer_id": "t-dup"}
        _, params = p.sched.finished("req-p1", kv, p_blocks, n, False)
        assert params is not None
        p.step()
        assert p.sched.finished("req-p2", kv, [20, 21], n, second == "aborted") == (False, None)
        p.step()
        assert d.sched.matched_tokens("req-d", params, n, 0) == (n, True)
        d.sched.allocated("req-d", d_blocks, n, n)
        run_until(p, d, lambda: "req-d" in d.reported.recving and "req-p1" in p.reported.sending)
        assert not d.reported.failed_recving
        name = "model.layers.0.self_attn.attn"
        src, dst = blockwise(p.tensors[name]), blockwise(d.tensors[name])
        assert np.array_equal(src[:, p_blocks], dst[:, d_blocks])
    finally:
        p.worker.close()
        d.worker.close()


def test_p_refuses_a_transfer_id_sent_before_and_hashes_a_request_id_too_long_for_the_wire() -> None:
    """A transfer id sent again after its transfer ended was answered with params (the client told the
    prefill was sent) while kvwire's core only replayed the first transfer's end, and D refused the load
    as a reuse. A vLLM request id past 1,024 characters (a client's X-Request-Id) went out as the transfer
    id, which every D refuses, while P held the blocks to its lease."""
    p = SchedulerSide(KvRole.PRODUCER, settings_from_extra({}), LocalEngine("e", "h", 1, 1, 1), BS)
    send = {"do_remote_decode": True, "transfer_id": "t-once"}
    delay, params = p.finished("r1", send, [1, 2], 10, False)
    assert delay and params is not None and params["transfer_id"] == "t-once"
    assert params["num_tokens"] == 10  # D checks its prompt against it
    p.transfers_ended(["r1"], [])
    assert p.finished("r2", send, [3, 4], 10, False) == (False, None)
    assert p.rejected == 1 and [op.req_id for op in p.take_ops()] == ["r1"]
    long_id = "x" * 2000
    delay, params = p.finished(long_id, {"do_remote_decode": True}, [5], 10, False)
    assert delay and params is not None
    tid = params["transfer_id"]
    assert tid.startswith("req-sha256-") and len(tid) <= 1024 and tid == params["remote_request_id"]
    assert parse_params({**params, "do_remote_prefill": True}) is not None  # what D parses, it takes
    assert [op.transfer_id for op in p.take_ops()] == [tid]


def test_a_full_table_refuses_for_now_and_p_does_not_answer_block_ids_no_d_takes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A request refused because the table of requests waiting for remote KV was full is asked again (room
    may free: it loads then); refusals for its params are remembered. P in pull mode does not answer more
    block ids than D's and routers' bound (they refused them while P held the blocks to its lease)."""
    monkeypatch.setattr(scheduler, "_MAX_TRACKED", 2)
    d = SchedulerSide(KvRole.CONSUMER, settings_from_extra({}), LocalEngine("e", "h", 1, 1, 1), BS)
    leg = D_LEG
    for i in range(2):
        assert d.matched_tokens(f"w{i}", {**leg, "transfer_id": f"t{i}"}, 10, 0) == (10, True)
    third = {**leg, "transfer_id": "t2"}
    assert d.matched_tokens("w2", third, 10, 0) == (0, False)  # full
    d.allocated("w0", [1], 10, 10)  # room again
    assert d.matched_tokens("w2", third, 10, 0) == (10, True)
    monkeypatch.setattr(scheduler, "MAX_REMOTE_BLOCK_IDS", 4)
    p = SchedulerSide(
        KvRole.PRODUCER, settings_from_extra({"mode": "pull"}), LocalEngine("e", "h", 1, 1, 1), BS
    )
    assert p.finished("p0", {"do_remote_decode": True}, [1, 2, 3, 4, 5], 80, False) == (False, None)
    assert p.rejected == 1 and p.take_ops() == []
    delay, params = p.finished("p1", {"do_remote_decode": True}, [1, 2, 3, 4], 64, False)
    assert delay and params is not None and params["remote_block_ids"] == [1, 2, 3, 4]


def test_a_transfer_id_sent_before_is_not_streamed_layer_by_layer() -> None:
    """Layer-wise push streams a request's layers from the step that computes them, under its transfer
    id: one sent before would stream and then be refused at ``finished``, its writes started for nothing."""
    p = SchedulerSide(KvRole.PRODUCER, settings_from_extra({}), LocalEngine("e", "h", 1, 1, 1), BS)
    assert p.reserve("r1", "t-once")
    delay, _ = p.finished("r1", {"do_remote_decode": True, "transfer_id": "t-once"}, [1], 10, False)
    assert delay
    p.transfers_ended(["r1"], [])
    assert not p.reserve("r2", "t-once")  # sent before: not streamed
    assert p.reserve("r3", "t-new")

"""``StreamPlanner`` (layer-wise push, vLLM's scheduler side) on scheduler outputs shaped as vLLM 0.34's
and 0.32's (``resumed_req_ids``), and ``bench vllm``'s layer-wise summary. No vLLM import: the outputs
are plain namespaces with vLLM's field names (the real scheduler runs in vllm_tests/)."""

from __future__ import annotations

from types import SimpleNamespace as NS
from typing import Any

from kvwire.integrations.vllm.layerwise import StreamPlanner
from kvwire.integrations.vllm.params import KvRole, Op, OpKind, settings_from_extra
from kvwire.integrations.vllm.scheduler import LocalEngine, SchedulerSide
from kvwire_tools.bench.vllm import layerwise_gain

P_LEG = {"do_remote_decode": True, "transfer_id": "t1"}


def output(new: list[Any] = (), cached: list[Any] = (), resumed: set[str] | None = None, **n: int) -> NS:  # type: ignore[assignment]
    c = NS(
        req_ids=[x[0] for x in cached],
        new_block_ids=[x[1] for x in cached],
        num_computed_tokens=[x[2] for x in cached],
    )
    if resumed is not None:
        c.resumed_req_ids = resumed
    return NS(scheduled_new_reqs=list(new), scheduled_cached_reqs=c, num_scheduled_tokens=n)


def free(_req_id: str, _transfer_id: str) -> bool:
    return True  # the scheduler side's reservation: no other request holds the id


def new_req(rid: str, blocks: list[int], computed: int = 0) -> NS:
    return NS(req_id=rid, block_ids=(blocks,), num_computed_tokens=computed)


def test_a_prompt_prefilled_in_one_step_streams_in_that_step() -> None:
    sp = StreamPlanner(block_size=16)
    sp.watch("r1", P_LEG, 40, 1)
    sp.watch("r1", P_LEG, 40, 1)  # vLLM may look at a waiting request again
    assert sp.ops(output([new_req("r1", [5, 6, 7])], r1=40), free) == [
        Op(OpKind.STREAM, "r1", "t1", [5, 6, 7], 40)
    ]
    assert sp.ops(output(cached=[("r1", None, 40)], r1=1), free) == []  # streamed once


def test_a_chunked_prefill_streams_in_its_last_chunk_with_every_block() -> None:
    sp = StreamPlanner(block_size=16)
    sp.watch("r1", P_LEG, 40, 1)
    assert sp.ops(output([new_req("r1", [5, 6])], r1=20), free) == []
    got = sp.ops(output(cached=[("r1", ([9],), 20)], r1=20), free)
    assert got == [Op(OpKind.STREAM, "r1", "t1", [5, 6, 9], 40)]


def test_a_resumed_request_replaces_its_blocks_on_vllm_032() -> None:
    sp = StreamPlanner(block_size=16)
    sp.watch("r1", P_LEG, 40, 1)
    sp.ops(output([new_req("r1", [5, 6])], r1=20), free)
    got = sp.ops(output(cached=[("r1", ([1, 2, 3],), 0)], resumed={"r1"}, r1=40), free)
    assert got == [Op(OpKind.STREAM, "r1", "t1", [1, 2, 3], 40)]


def test_only_single_token_p_legs_are_streamed() -> None:
    sp = StreamPlanner(block_size=16)
    sp.watch("long", P_LEG, 40, 2)  # may decode (and be preempted) after its prefill
    sp.watch("plain", None, 40, 1)
    sp.watch("d-leg", {"do_remote_prefill": True, "transfer_id": "x"}, 40, 1)
    sp.watch("bad", {"do_remote_decode": "maybe"}, 40, 1)  # malformed: never raises
    reqs = [new_req(r, [1, 2, 3]) for r in ("long", "plain", "d-leg", "bad")]
    assert sp.ops(output(reqs, long=40, plain=40, **{"d-leg": 40, "bad": 40}), free) == []


def test_a_finished_request_is_forgotten() -> None:
    sp = StreamPlanner(block_size=16)
    sp.watch("r1", P_LEG, 40, 1)
    sp.forget("r1")
    assert sp.ops(output([new_req("r1", [5, 6, 7])], r1=40), free) == []


def test_a_transfer_id_another_request_holds_is_not_streamed() -> None:
    """Two P legs under one transfer id (a client's retry) finishing their prefill in one step were both
    streamed: the producer was handed the second's blocks under the shared id, then the first's SEND
    carried other blocks, and the first's decode failed. The id is reserved at STREAM time."""
    held: dict[str, str] = {}

    def reserve(req_id: str, transfer_id: str) -> bool:
        return held.setdefault(transfer_id, req_id) == req_id

    sp = StreamPlanner(block_size=16)
    sp.watch("a", P_LEG, 40, 1)
    sp.watch("b", P_LEG, 40, 1)
    got = sp.ops(output([new_req("a", [1, 2, 3]), new_req("b", [5, 6, 7])], a=40, b=40), reserve)
    assert got == [Op(OpKind.STREAM, "a", "t1", [1, 2, 3], 40)] and held == {"t1": "a"}


def test_bench_layerwise_share_is_what_disaggregation_adds_over_colocated() -> None:
    def row(conn: str, mode: str, ms: float) -> dict[str, Any]:
        return {"connector": conn, "mode": mode, "prompt_tokens": 8192, "concurrency": 1, "ttft_p50_ms": ms}

    cases = [
        row("colocated", "-", 1000.0),
        row("kvwire", "push", 1200.0),
        row("kvwire", "push-layerwise", 1080.0),
    ]
    (got,) = layerwise_gain(cases)
    assert (got["whole_over_ms"], got["layerwise_over_ms"]) == (200.0, 80.0)
    assert got["layerwise_share"] == 0.4


def test_the_scheduler_side_holds_a_streamed_id_until_its_send_takes_it_over_or_lets_it_go() -> None:
    sched = SchedulerSide(
        KvRole.PRODUCER, settings_from_extra({}), LocalEngine("p", "127.0.0.1", 7000, 1, 1), 16
    )
    params = {"do_remote_decode": True, "transfer_id": "t1"}
    assert sched.reserve("a", "t1") and sched.reserve("a", "t1") and not sched.reserve("b", "t1")
    assert sched.finished("b", params, [5, 6], 20, aborted=False) == (False, None)  # refused: a holds it
    sent, out = sched.finished("a", params, [1, 2], 20, aborted=False)
    assert sent and out is not None and out["transfer_id"] == "t1"
    assert not sched.reserve("c", "t1")  # held by a's SEND now
    sched.transfers_ended(["a"], [])
    assert not sched.reserve("c", "t1")  # sent before: a transfer id is single-use (its SEND is refused)
    fresh = {"do_remote_decode": True, "transfer_id": "t2"}
    assert sched.reserve("c", "t2")
    assert sched.finished("c", fresh, [1, 2], 20, aborted=True) == (False, None)  # aborted: let go
    assert sched.reserve("d", "t2")  # never sent: free again

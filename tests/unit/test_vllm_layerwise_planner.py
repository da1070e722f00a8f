"""``StreamPlanner`` (layer-wise push, vLLM's scheduler side) on scheduler outputs shaped as vLLM 0.34's
and 0.32's (``resumed_req_ids``), and ``bench vllm``'s layer-wise summary. No vLLM import: the outputs
are plain namespaces with vLLM's field names (the real scheduler runs in vllm_tests/)."""

from __future__ import annotations

from types import SimpleNamespace as NS
from typing import Any

from kvwire.integrations.vllm.layerwise import StreamPlanner
from kvwire.integrations.vllm.params import Op, OpKind
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


def new_req(rid: str, blocks: list[int], computed: int = 0) -> NS:
    return NS(req_id=rid, block_ids=(blocks,), num_computed_tokens=computed)


def test_a_prompt_prefilled_in_one_step_streams_in_that_step() -> None:
    sp = StreamPlanner(block_size=16)
    sp.watch("r1", P_LEG, 40, 1)
    sp.watch("r1", P_LEG, 40, 1)  # vLLM may look at a waiting request again
    assert sp.ops(output([new_req("r1", [5, 6, 7])], r1=40)) == [Op(OpKind.STREAM, "r1", "t1", [5, 6, 7], 40)]
    assert sp.ops(output(cached=[("r1", None, 40)], r1=1)) == []  # streamed once


def test_a_chunked_prefill_streams_in_its_last_chunk_with_every_block() -> None:
    sp = StreamPlanner(block_size=16)
    sp.watch("r1", P_LEG, 40, 1)
    assert sp.ops(output([new_req("r1", [5, 6])], r1=20)) == []
    got = sp.ops(output(cached=[("r1", ([9],), 20)], r1=20))
    assert got == [Op(OpKind.STREAM, "r1", "t1", [5, 6, 9], 40)]


def test_a_resumed_request_replaces_its_blocks_on_vllm_032() -> None:
    sp = StreamPlanner(block_size=16)
    sp.watch("r1", P_LEG, 40, 1)
    sp.ops(output([new_req("r1", [5, 6])], r1=20))
    got = sp.ops(output(cached=[("r1", ([1, 2, 3],), 0)], resumed={"r1"}, r1=40))
    assert got == [Op(OpKind.STREAM, "r1", "t1", [1, 2, 3], 40)]


def test_only_single_token_p_legs_are_streamed() -> None:
    sp = StreamPlanner(block_size=16)
    sp.watch("long", P_LEG, 40, 2)  # may decode (and be preempted) after its prefill
    sp.watch("plain", None, 40, 1)
    sp.watch("d-leg", {"do_remote_prefill": True, "transfer_id": "x"}, 40, 1)
    sp.watch("bad", {"do_remote_decode": "maybe"}, 40, 1)  # malformed: never raises
    reqs = [new_req(r, [1, 2, 3]) for r in ("long", "plain", "d-leg", "bad")]
    assert sp.ops(output(reqs, long=40, plain=40, **{"d-leg": 40, "bad": 40})) == []


def test_a_finished_request_is_forgotten() -> None:
    sp = StreamPlanner(block_size=16)
    sp.watch("r1", P_LEG, 40, 1)
    sp.forget("r1")
    assert sp.ops(output([new_req("r1", [5, 6, 7])], r1=40)) == []


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

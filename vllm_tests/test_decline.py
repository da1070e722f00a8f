"""A decode request D drops before it loads: two real vLLM 0.34 schedulers over NIXL. P prefilled and holds
the prompt's blocks for D; D's client goes away while the request still queues (never scheduled, so no
blocks and no LOAD). Before, P was never told and held the blocks to its lease (30 s by default), so
an overloaded D, which drops requests exactly then, filled P's cache with KV nobody would read. Now D's
scheduler sends DECLINE, each worker tells the P ranks it pairs with (push: ``cancel``; pull: ``failed``),
and P frees the blocks at once, as vLLM's own NIXL connector does with an empty read."""

from __future__ import annotations

import time

import pytest
from harness import MakeEngine, finish_prefill, prompt, run
from vllm.v1.request import RequestStatus

from kvwire.connector import ProducerOutcome
from kvwire.integrations.vllm.params import KvRole, OpKind

pytestmark = [pytest.mark.nixl, pytest.mark.timeout(120)]


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_a_request_d_drops_while_it_queues_frees_ps_blocks_at_once(
    make_engine: MakeEngine, mode: str
) -> None:
    p = make_engine(KvRole.PRODUCER, mode)  # the default lease: 30 s
    d = make_engine(KvRole.CONSUMER, mode)
    params = finish_prefill(p, "p1", prompt(40, 3), "t-dropped")
    d.add("d1", prompt(40, 3), 2, params)
    d.sched.finish_requests("d1", RequestStatus.FINISHED_ABORTED)  # before any step of D's
    t0 = time.monotonic()
    run([p, d], lambda: p.gone("p1"), "P to free the blocks", timeout_s=10)
    assert time.monotonic() - t0 < 5, "P held the blocks as if nobody had told it"
    kinds = [op.kind for op in d.ops if op.req_id == "d1"]
    assert kinds == [OpKind.DECLINE]  # no LOAD: D never allocated, nothing was read or written
    assert p.p_outcomes("t-dropped") == [ProducerOutcome.ABORTED]  # D gave it up: not a failed transfer
    assert p.reported.sending == {"p1"}
    consumer = d.worker.consumer
    assert consumer is not None and consumer.stats.bytes_moved == 0 and consumer.stats.declined == 1
    p.assert_clean()
    d.assert_clean()


def test_a_second_request_after_a_decline_still_moves(make_engine: MakeEngine) -> None:
    """The decline tells P about its own transfer only: the next request from the same pair moves."""
    p, d = make_engine(KvRole.PRODUCER), make_engine(KvRole.CONSUMER)
    params = finish_prefill(p, "p1", prompt(40, 4), "t-first")
    d.add("d1", prompt(40, 4), 2, params)
    d.sched.finish_requests("d1", RequestStatus.FINISHED_ABORTED)
    run([p, d], lambda: p.gone("p1"), "P to free the first", timeout_s=10)
    params = finish_prefill(p, "p2", prompt(40, 5), "t-second")
    d.add("d2", prompt(40, 5), 2, params)
    run([p, d], lambda: p.gone("p2") and d.gone("d2"), "the second transfer")
    assert p.p_outcomes("t-second") == [ProducerOutcome.SENT]
    assert "d2" in d.reported.recving and d.reported.failed_recving == set()
    p.assert_clean()
    d.assert_clean()

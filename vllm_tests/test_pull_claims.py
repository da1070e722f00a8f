"""Pull mode between two real vLLM 0.34 schedulers over NIXL: a D that comes after P's lease reads
nothing. P's blocks went back to vLLM at the lease's end and hold another request's KV by the time D's
request is scheduled; before claims D read them, said READY and decoded another request's KV as this
one's. Now P refuses D's claim and D's load fails (vLLM's ``failed_recving``), nothing of P's read."""

from __future__ import annotations

import numpy as np
import pytest
from harness import MakeEngine, assert_delivered, assert_moved, finish_prefill, prompt, run

from kvwire.connector import ConsumerEventKind
from kvwire.integrations.vllm.params import KvRole, OpKind

pytestmark = [pytest.mark.nixl, pytest.mark.timeout(120)]


def test_a_d_after_ps_lease_reads_nothing_and_fails_the_load(make_engine: MakeEngine) -> None:
    p = make_engine(KvRole.PRODUCER, "pull", extra={"kv_lease_duration_s": 0.5}, prefix_caching=False)
    d = make_engine(KvRole.CONSUMER, "pull")
    tokens = prompt(40, 1)
    params = finish_prefill(p, "p1", tokens, "t-late")
    run([p], lambda: p.gone("p1"), "P's lease")  # expired: the blocks are vLLM's again
    lent = p.op(OpKind.SEND, "p1").block_ids
    p.kv[:, lent] ^= np.uint32(0xDEADBEEF)  # what another request's prefill wrote there since
    d.add("d1", tokens, 2, params)
    run([p, d], lambda: d.gone("d1"), "D's request")
    assert "d1" in d.reported.failed_recving  # the load failed: vLLM does not decode it
    assert d.d_events("t-late") == [ConsumerEventKind.FAILED, ConsumerEventKind.RELEASED]
    load = d.op(OpKind.LOAD, "d1")
    assert not d.kv[:, load.block_ids].any()  # nothing of P's blocks was read into D's
    assert d.worker.consumer is not None and d.worker.consumer.stats.bytes_moved == 0


def test_a_d_in_time_claims_reads_and_frees_ps_blocks(make_engine: MakeEngine) -> None:
    p = make_engine(KvRole.PRODUCER, "pull")
    d = make_engine(KvRole.CONSUMER, "pull")
    tokens = prompt(40, 2)
    params = finish_prefill(p, "p2", tokens, "t-claimed")
    d.add("d2", tokens, 2, params)
    run([p, d], lambda: d.gone("d2") and p.gone("p2"), "the pull")
    assert_moved(p, "p2", d, "d2")
    assert_delivered(p, d, "t-claimed", mode="pull")
    assert p.worker.producer is not None and p.worker.producer.side_channel_stats is not None
    assert p.worker.producer.side_channel_stats.replies["granted"] == 1
    p.assert_clean()
    d.assert_clean()

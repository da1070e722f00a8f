"""Layer-wise push (``"layerwise": true`` on P) inside a real vLLM 0.34 ``Scheduler``: kvwire's
``StreamPlanner`` picks, from the scheduler's own output, the step that ends each P leg's prefill (also
after a chunked prefill), the worker streams the layers of that step, and D loads every byte.
"""

from __future__ import annotations

from typing import Any

import pytest
from harness import (
    MakeEngine,
    assert_d_decoded,
    assert_delivered,
    assert_moved,
    assert_zero_except,
    d_params,
    p_params,
    prompt,
    registration_reached_p,
    run,
)

from kvwire.integrations.vllm.params import KvRole, OpKind

pytestmark = [pytest.mark.nixl, pytest.mark.timeout(120)]


def test_layerwise_streams_in_the_step_that_ends_each_prefill(make_engine: MakeEngine) -> None:
    p = make_engine(KvRole.PRODUCER, extra={"layerwise": True})
    d = make_engine(KvRole.CONSUMER)
    # Two prompts of 150 tokens, one step's budget 256: "b" is prefilled in two chunks.
    reqs = {"a": (prompt(150, 11), "t-lw-a"), "b": (prompt(150, 12), "t-lw-b")}
    for rid, (tokens, tid) in reqs.items():
        d.add(f"d{rid}", tokens, 2, d_params(p, tid))
    run([d], lambda: all(registration_reached_p(p, tid) for _, tid in reqs.values()), "D's push_regs at P")
    streamed: list[tuple[str, tuple[int, ...]]] = []  # what the forward's save_kv_layer calls handed over
    producer = p.worker.producer
    assert producer is not None
    handed = producer.layers_ready

    def recording(tid: str, block_ids: Any, num_tokens: int, layers: Any) -> None:
        streamed.append((tid, tuple(layers)))
        handed(tid, block_ids, num_tokens, layers)

    producer.layers_ready = recording  # type: ignore[method-assign]
    for rid, (tokens, tid) in reqs.items():
        p.add(f"p{rid}", tokens, 1, p_params(tid))
    run([p, d], lambda: all(p.gone(f"p{r}") and d.gone(f"d{r}") for r in reqs), "the transfers")
    assert p.scheduled["pb"] == [106, 44]  # chunked: 256 - 150 tokens, then the rest
    # Each layer went during the forward of the step that ended its prefill: the STREAM op is bound before
    # the forward (vLLM 0.34 calls start_load_kv after it; applied there, nothing streamed).
    assert sorted(streamed) == sorted((tid, (layer,)) for _, tid in reqs.values() for layer in (0, 1))
    for rid, (tokens, tid) in reqs.items():
        stream, send = p.op(OpKind.STREAM, f"p{rid}"), p.op(OpKind.SEND, f"p{rid}")
        # One STREAM, in the step that ended the prefill, for the blocks the request finishes with.
        assert (stream.transfer_id, stream.num_tokens) == (tid, len(tokens))
        assert stream.block_ids == send.block_ids
        assert p.ops.index(stream) < p.ops.index(send)
        assert_d_decoded(d, f"d{rid}", 2)
        assert_moved(p, f"p{rid}", d, f"d{rid}")
        assert_delivered(p, d, tid)
    # Two layers each: layer 0 went alone, layer 1 with the done.
    assert producer.stats.transfers_done == 2 and producer.stats.descriptors_posted >= 4
    assert_zero_except(d, [b for r in reqs for b in d.op(OpKind.LOAD, f"d{r}").block_ids])
    p.assert_clean()
    d.assert_clean()


def test_layerwise_leaves_longer_generations_to_whole_request_push(make_engine: MakeEngine) -> None:
    """A P request that generates more than one token may be preempted after its prefill (vLLM then
    reuses its blocks): it is not streamed, and is sent whole when it finishes."""
    p = make_engine(KvRole.PRODUCER, extra={"layerwise": True})
    d = make_engine(KvRole.CONSUMER)
    tokens, tid = prompt(40, 13), "t-lw-long"
    d.add("d1", tokens, 2, d_params(p, tid))
    run([d], lambda: registration_reached_p(p, tid), "D's push_reg at P")
    p.add("p1", tokens, 3, p_params(tid))
    run([p, d], lambda: p.gone("p1") and d.gone("d1"), "the transfer")
    assert [o.kind for o in p.ops if o.req_id == "p1"] == [OpKind.SEND]
    assert_moved(p, "p1", d, "d1")
    p.assert_clean()
    d.assert_clean()

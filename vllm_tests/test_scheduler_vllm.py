"""kvwire as the KV connector of two real vLLM 0.34 ``Scheduler``s, P (kv_producer) and D (kv_consumer).

vLLM builds ``KvwireConnector`` (scheduler role) from the config by name, as it does in a server. Behind
each scheduler sits a real kvwire ``WorkerSide`` over NIXL, registered with numpy KV caches shaped as vLLM
0.34 allocates them (one buffer; per layer a ``[blocks, kv_heads, block_size, K|V]`` view). The test is
the model runner: it hands each step's connector ops to the worker, samples a fixed token, and reports
what the worker says finished. Each case checks request states, the bytes of every block D was given,
and that every block went back to its pool exactly once.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
from harness import (
    STEP_SLEEP_S,
    TOKEN,
    MakeEngine,
    assert_aborted_on_d,
    assert_d_decoded,
    assert_delivered,
    assert_moved,
    assert_p_expired,
    assert_params_for_d,
    assert_zero_except,
    d_params,
    finish_prefill,
    load_and_abort_in_one_step,
    p_params,
    prompt,
    registration_reached_p,
    run,
)
from vllm.v1.request import RequestStatus

from kvwire.connector import ConsumerEventKind, ProducerOutcome
from kvwire.integrations.vllm.params import KvRole, OpKind

pytestmark = [pytest.mark.nixl, pytest.mark.timeout(120)]


def test_push_d_registers_before_p_finishes(make_engine: MakeEngine) -> None:
    p, d = make_engine(KvRole.PRODUCER), make_engine(KvRole.CONSUMER)
    tokens, tid = prompt(40, 1), "t-early"
    d.add("d1", tokens, 2, d_params(p, tid))
    run([d], lambda: registration_reached_p(p, tid), "D's push_reg at P")
    assert d.reqs["d1"].status is RequestStatus.WAITING_FOR_REMOTE_KVS
    load = d.op(OpKind.LOAD, "d1")
    assert load.block_ids == d.blocks_of("d1") and load.num_cached_tokens == 0 and load.num_tokens == 40
    assert d.held() == 3 and "p1" not in p.reqs

    p.add("p1", tokens, 1, p_params(tid))
    run([p, d], lambda: p.gone("p1") and d.gone("d1"), "the transfer")
    assert_params_for_d(dict(p.outputs["p1"].kv_transfer_params or {}), p, "p1", tid, "push")
    assert p.reported.sending == {"p1"}
    assert_d_decoded(d, "d1", 2)
    assert_moved(p, "p1", d, "d1")
    assert_delivered(p, d, tid)
    assert_zero_except(d, load.block_ids)
    p.assert_clean()
    d.assert_clean()


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_p_finishes_before_d_request_arrives(make_engine: MakeEngine, mode: str) -> None:
    p, d = make_engine(KvRole.PRODUCER, mode), make_engine(KvRole.CONSUMER, mode)
    tokens, tid = prompt(40, 2), f"t-late-{mode}"
    params = finish_prefill(p, "p1", tokens, tid)
    assert_params_for_d(params, p, "p1", tid, mode)
    for _ in range(20):
        p.step()
        time.sleep(STEP_SLEEP_S)
    assert "p1" in p.sched.requests and p.held() == 3, "P let go without D"

    d.add("d1", tokens, 2, params)  # the proxy forwards P's kv_transfer_params as they are
    run([p, d], lambda: p.gone("p1") and d.gone("d1"), "the transfer")
    assert p.reported.sending == {"p1"}
    assert_d_decoded(d, "d1", 2)
    assert_moved(p, "p1", d, "d1")
    assert_delivered(p, d, tid, mode)
    assert_zero_except(d, d.op(OpKind.LOAD, "d1").block_ids)
    p.assert_clean()
    d.assert_clean()


def test_d_abort_before_registration_reaches_p(make_engine: MakeEngine) -> None:
    lease = 0.5
    p = make_engine(KvRole.PRODUCER, extra={"kv_lease_duration_s": lease})
    d = make_engine(KvRole.CONSUMER)
    tokens, tid = prompt(40, 3), "t-abort-early"
    d.add("d1", tokens, 2, d_params(p, tid))
    load_and_abort_in_one_step(d, "d1")
    run([d], lambda: d.gone("d1"), "D's release of the aborted request")
    assert_aborted_on_d(d, "d1")
    assert d.worker.consumer is not None and d.worker.consumer.stats.transfers_started == 0, "push_reg sent"
    assert not d.kv.any(), "an aborted request's blocks were written"
    assert d.d_events(tid) == [ConsumerEventKind.RELEASED]
    d.assert_clean()

    # P's request finishes later; no registration ever reaches it, so its lease frees the blocks.
    assert not registration_reached_p(p, tid)
    finish_prefill(p, "p1", tokens, tid)
    assert_p_expired(p, "p1", tid, lease)
    p.assert_clean()


@pytest.mark.parametrize("when", ["handshaking", "registered"])
def test_d_abort_after_p_finished_before_ready(make_engine: MakeEngine, when: str) -> None:
    lease = 0.5  # P's hold when D's abort overtakes its push_reg; else P must let go long before
    p = make_engine(KvRole.PRODUCER, extra={"kv_lease_duration_s": lease if when == "handshaking" else 30})
    d = make_engine(KvRole.CONSUMER)
    tokens, tid = prompt(40, 4), f"t-abort-late-{when}"
    params = finish_prefill(p, "p1", tokens, tid)
    d.add("d1", tokens, 2, params)
    if when == "handshaking":
        d_blocks = load_and_abort_in_one_step(d, "d1")
        run([d], lambda: d.gone("d1"), "D's release of the aborted request")
        assert not d.kv.any(), "an aborted request's blocks were written"
        assert d.d_events(tid) == [ConsumerEventKind.RELEASED]
        assert_p_expired(p, "p1", tid, lease)
    else:
        # The LOAD went out and D's push_reg reached P, but vLLM has not heard of READY (the worker is
        # not polled) when the abort comes.
        d.step(poll=False)
        assert d.reqs["d1"].status is RequestStatus.WAITING_FOR_REMOTE_KVS
        d_blocks = d.blocks_of("d1")
        run([d], lambda: registration_reached_p(p, tid), "D's push_reg at P", poll=False)
        d.sched.finish_requests("d1", RequestStatus.FINISHED_ABORTED)
        assert "d1" in d.sched.requests and d.held() == len(d_blocks), "vLLM freed blocks kvwire may write"
        run([p, d], lambda: p.gone("p1") and d.gone("d1"), "both ends to let go")
        # P's write raced D's cancel. kvwire posts one write per request and answers a cancel only once no
        # write is in flight, so the write landed whole (seen here: it was in flight, then cancel_ack, D
        # RELEASED, P ABORTED; or READY came first) or never started. Either way P let go at once, not at
        # the end of its lease.
        send = p.op(OpKind.SEND, "p1")
        landed = np.array_equal(p.kv[:, send.block_ids], d.kv[:, d_blocks])
        assert landed or not d.kv.any(), "part of P's write landed"
        assert d.d_events(tid) in ([ConsumerEventKind.READY], [ConsumerEventKind.RELEASED])
        assert p.p_outcomes(tid) in ([ProducerOutcome.SENT], [ProducerOutcome.ABORTED])
        if d.d_events(tid) == [ConsumerEventKind.READY]:  # D's kvwire had the KV before the abort
            assert landed and p.p_outcomes(tid) == [ProducerOutcome.SENT]
        if not landed:  # the cancel overtook the write, which never started
            assert p.p_outcomes(tid) == [ProducerOutcome.ABORTED]
        assert p.reported.sending == {"p1"}
    assert_aborted_on_d(d, "d1")
    assert_zero_except(d, d_blocks)
    p.assert_clean()
    d.assert_clean()


def test_d_preempts_running_request_while_another_waits_for_kv(make_engine: MakeEngine) -> None:
    # 7 usable blocks (block 0 is vLLM's null block): "remote" takes 3 while it waits for P; "local" grows
    # past the other 4 and must be preempted; the waiting request is never a victim and keeps its blocks.
    p, d = make_engine(KvRole.PRODUCER), make_engine(KvRole.CONSUMER, num_blocks=8)
    tokens, tid = prompt(40, 5), "t-preempt"
    d.add("remote", tokens, 2, d_params(p, tid))
    d.step()
    assert d.reqs["remote"].status is RequestStatus.WAITING_FOR_REMOTE_KVS
    waiting_blocks = d.blocks_of("remote")
    assert len(waiting_blocks) == 3

    local = d.add("local", prompt(16, 6), 60, None)  # 76 tokens: 5 blocks, only 4 left
    run([d], lambda: local.num_preemptions > 0, "the preemption of the local request")
    assert d.reqs["remote"].status is RequestStatus.WAITING_FOR_REMOTE_KVS
    assert d.blocks_of("remote") == waiting_blocks
    assert local.status is RequestStatus.PREEMPTED and d.held() == 3, "the preempted request kept blocks"
    assert [o.kind for o in d.ops] == [OpKind.LOAD], "the preemption reached kvwire"

    p.add("p1", tokens, 1, p_params(tid))
    run([p, d], lambda: p.gone("p1") and d.gone("remote", "local"), "the transfer and the local request")
    assert_d_decoded(d, "remote", 2)
    assert d.op(OpKind.LOAD, "remote").block_ids == waiting_blocks
    assert_moved(p, "p1", d, "remote")
    assert_delivered(p, d, tid)
    assert (
        local.status is RequestStatus.FINISHED_LENGTH_CAPPED and list(local.output_token_ids) == [TOKEN] * 60
    )
    assert [o.kind for o in d.ops] == [OpKind.LOAD], "the local request went through kvwire"
    p.assert_clean()
    d.assert_clean()


def test_d_prefix_hit_loads_only_the_suffix(make_engine: MakeEngine) -> None:
    p, d = make_engine(KvRole.PRODUCER), make_engine(KvRole.CONSUMER)
    shared = prompt(32, 7)
    first, second = [*shared, *prompt(8, 8)], [*shared, *prompt(16, 9)]
    p.add("p1", first, 1, p_params("t-first"))
    d.add("d1", first, 2, d_params(p, "t-first"))
    run([p, d], lambda: p.gone("p1") and d.gone("d1"), "the first transfer")
    assert_moved(p, "p1", d, "d1")
    d1_blocks = d.op(OpKind.LOAD, "d1").block_ids
    before = d.kv[:, d1_blocks[:2]].copy()

    p.add("p2", second, 1, p_params("t-second"))
    d.add("d2", second, 2, d_params(p, "t-second"))
    run([p, d], lambda: p.gone("p2") and d.gone("d2"), "the second transfer")
    load = d.op(OpKind.LOAD, "d2")
    # D's own cache holds the 2 shared blocks: it asks P only for the rest.
    assert load.num_cached_tokens == 32 and load.num_tokens == 48
    assert load.block_ids[:2] == d1_blocks[:2]
    assert_d_decoded(d, "d2", 2, local_hit=32)
    assert_moved(p, "p2", d, "d2", first_block=2)
    assert np.array_equal(d.kv[:, d1_blocks[:2]], before), "P wrote into D's prefix-hit blocks"
    # P hit its own cache too: the shared blocks are the first request's, so D's prefix is P's bytes.
    assert p.op(OpKind.SEND, "p2").block_ids[:2] == p.op(OpKind.SEND, "p1").block_ids[:2]
    assert_moved(p, "p2", d, "d2")
    assert_delivered(p, d, "t-first")
    assert_delivered(p, d, "t-second")
    assert_zero_except(d, [*d1_blocks, *load.block_ids])
    p.assert_clean()
    d.assert_clean()


def test_p_lease_expires_when_d_never_registers(make_engine: MakeEngine) -> None:
    lease = 0.5
    p = make_engine(KvRole.PRODUCER, extra={"kv_lease_duration_s": lease})
    finish_prefill(p, "p1", prompt(40, 10), "t-lease")
    assert_p_expired(p, "p1", "t-lease", lease)
    p.assert_clean()


def test_d_preempts_a_request_whose_kv_arrived(make_engine: MakeEngine) -> None:
    # 7 usable blocks, no prefix cache on D (else the preempted request's own cached blocks hide the bug).
    # "local" runs first; "remote" loads 40 tokens from P, then both decode until the pool runs out and
    # vLLM preempts the newest running request: "remote". It must recompute locally, not load again.
    p = make_engine(KvRole.PRODUCER)
    d = make_engine(KvRole.CONSUMER, num_blocks=8, prefix_caching=False)
    local = d.add("local", prompt(16, 11), 60, None)
    d.step()
    assert local.status is RequestStatus.RUNNING
    tokens, tid = prompt(40, 12), "t-preempt-loaded"
    params = finish_prefill(p, "p1", tokens, tid)
    remote = d.add("remote", tokens, 40, params)  # with "local": more than 7 blocks, however timed
    run([p, d], lambda: RequestStatus.RUNNING in d.history["remote"], "the load")
    assert_moved(p, "p1", d, "remote")
    run([p, d], lambda: remote.num_preemptions > 0 or d.gone("remote"), "the preemption of the KV's owner")
    assert remote.num_preemptions > 0, "no preemption: the pool was not small enough"

    def loaded_again_or_ended() -> bool:
        return len(d.ops) > 1 or (p.gone("p1") and d.gone("local", "remote"))

    run([p, d], loaded_again_or_ended, "a second LOAD, or both requests to end")
    assert [o.kind for o in d.ops] == [OpKind.LOAD], "the preempted request asked P again"
    assert (
        remote.status is RequestStatus.FINISHED_LENGTH_CAPPED
        and list(remote.output_token_ids) == [TOKEN] * 40
    )
    assert local.status is RequestStatus.FINISHED_LENGTH_CAPPED
    p.assert_clean()
    d.assert_clean()


@pytest.mark.parametrize("role", [KvRole.PRODUCER, KvRole.CONSUMER])
def test_a_prompt_embeds_request_is_judged_without_raising(make_engine: MakeEngine, role: KvRole) -> None:
    """A prompt-embeds request has no prompt_token_ids (None): kvwire took len() of it in
    get_num_new_matched_tokens, which vLLM calls for every new request, and killed the engine core."""
    import torch
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    engine = make_engine(role)
    sp = SamplingParams(max_tokens=1)
    sp.extra_args = {"kv_transfer_params": {"do_remote_decode": True, "transfer_id": "t-embeds"}}
    req = Request("embeds", None, sp, None, prompt_embeds=torch.zeros(40, 8))
    assert req.prompt_token_ids is None and req.num_prompt_tokens == 40
    connector = engine.sched.connector
    assert connector is not None
    assert connector.get_num_new_matched_tokens(req, 0) == (0, False)

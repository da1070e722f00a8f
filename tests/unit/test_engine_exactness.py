"""The exactness rule: disaggregated greedy output equals colocated, token for token.

P prefills, the loopback hooks copy its KV blocks (np.copyto) into D's blocks, D runs the step for the
last prompt position and decodes. Compared with one colocated engine, across TP sizes on either side, PP
on P, and different batch compositions.
"""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest

from kvwire.engine.config import EngineConfig, Role, preset
from kvwire.engine.engine import Engine
from kvwire.engine.loopback import LoopbackHub
from kvwire.engine.model import Model
from kvwire.engine.request import Request, RequestState, TransferRole
from kvwire.kv.spec import RegionKind
from kvwire.kv_params import KvTransferParams

TINY = preset("tiny")
MODEL = Model(TINY, seed=0)
PROMPT_LENS = (1, 2, 15, 16, 17, 40, 97)
MAX_TOKENS = 6


def prompts(lens: tuple[int, ...] = PROMPT_LENS, seed: int = 7) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(0, 256, n)] for n in lens]


def engine(role: Role, tp: int = 1, pp: int = 1, num_blocks: int = 256) -> Engine:
    cfg = EngineConfig(TINY, role=role, tp_size=tp, pp_size=pp, num_blocks=num_blocks)
    return Engine(cfg, model=MODEL)


def colocated(ps: list[list[int]], max_tokens: int = MAX_TOKENS) -> list[list[int]]:
    return engine(Role.COLOCATED).generate(ps, max_tokens, ignore_eos=True)


def disaggregated(
    ps: list[list[int]], *, p_tp: int = 1, p_pp: int = 1, d_tp: int = 1, max_tokens: int = MAX_TOKENS
) -> tuple[list[list[int]], Engine, Engine, LoopbackHub]:
    hub = LoopbackHub()
    p, d = engine(Role.PREFILL, p_tp, p_pp), engine(Role.DECODE, d_tp)
    p.set_hooks(hub.producer(p.kv))
    d.set_hooks(hub.consumer(d.kv))
    d_reqs = []
    for i, prompt in enumerate(ps):
        tid = f"t{i}"
        params = KvTransferParams(transfer_id=tid)
        p.submit(Request(f"p{i}", prompt, 1, role=TransferRole.REMOTE_DECODE, transfer_id=tid))
        d_req = Request(
            f"d{i}", prompt, max_tokens, ignore_eos=True, role=TransferRole.REMOTE_PREFILL, transfer_id=tid
        )
        d_req.kv_transfer_params = params
        d.submit(d_req)
        d_reqs.append(d_req)
    for _ in range(1000):
        d.step()
        p.step()
        if all(r.state.finished for r in d_reqs) and not p.scheduler.has_lent_blocks():
            break
    assert all(r.state is RequestState.FINISHED_LENGTH for r in d_reqs)
    return [r.output_ids for r in d_reqs], p, d, hub


REFERENCE = colocated(prompts())


@pytest.mark.parametrize(("p_tp", "p_pp", "d_tp"), [(1, 1, 1), (2, 1, 1), (1, 1, 4), (4, 2, 2), (8, 1, 2)])
def test_disaggregated_equals_colocated(p_tp: int, p_pp: int, d_tp: int) -> None:
    out, p, d, hub = disaggregated(prompts(), p_tp=p_tp, p_pp=p_pp, d_tp=d_tp)
    assert out == REFERENCE
    assert hub.transfers == len(PROMPT_LENS)
    # Every block went back: P freed after the transfer, D after decoding.
    assert p.kv.allocator.num_free == p.kv.allocator.num_blocks
    assert d.kv.allocator.num_free == d.kv.allocator.num_blocks


def test_output_is_not_constant() -> None:
    """Guard against a degenerate model that would make the comparisons above vacuous."""
    assert len({tuple(o) for o in REFERENCE}) > 3
    assert len({t for o in REFERENCE for t in o}) > 5


def test_batch_composition_does_not_change_results() -> None:
    ps = prompts()
    alone = [colocated([p])[0] for p in ps]
    assert alone == REFERENCE
    # Staggered arrivals: requests join a running batch between steps.
    e = engine(Role.COLOCATED)
    reqs = [Request(f"r{i}", p, MAX_TOKENS, ignore_eos=True) for i, p in enumerate(ps)]
    for r in reqs:
        e.submit(r)
        e.step()
    e.run_until_idle()
    assert [r.output_ids for r in reqs] == REFERENCE


def test_tp_and_pp_colocated_equal_single_rank() -> None:
    for tp, pp in itertools.product((2, 4, 8), (1, 2)):
        e = Engine(EngineConfig(TINY, tp_size=tp, pp_size=pp, num_blocks=256), model=MODEL)
        assert e.generate(prompts(), MAX_TOKENS, ignore_eos=True) == REFERENCE


def test_transferred_kv_matches_colocated_cache_bytes() -> None:
    """The KV D received equals the KV a colocated engine computed, byte for byte, for every position."""
    n = 40
    ps = prompts((n,))
    _, _, d, _ = disaggregated(ps, p_tp=2, d_tp=4, max_tokens=1)
    ref = engine(Role.COLOCATED)
    req = Request("r", ps[0], 1)
    ref.submit(req)
    ref.step()
    # Both engines had fresh allocators: the request got blocks 0.. on each side.
    blocks = list(range(ref.scheduler.prompt_blocks(req)))

    def positions(region: np.ndarray) -> np.ndarray:  # HND blocks -> [heads, n, head_dim]
        got = region[blocks]
        return got.transpose(1, 0, 2, 3).reshape(got.shape[1], -1, got.shape[3])[:, :n]

    for layer in range(TINY.num_layers):
        for kind in (RegionKind.K, RegionKind.V):
            whole = positions(ref.kv.cache(layer, 0).region(layer, kind))
            assert np.any(whole != 0)
            for tp in range(4):
                c = d.kv.cache(layer, tp)
                got = positions(c.region(layer, kind))
                want = whole[c.first_head : c.first_head + c.heads]
                assert got.tobytes() == want.tobytes()


def test_windowed_model_disaggregated_equals_colocated() -> None:
    """kv-heavy's path (sliding window, prefill in slices that read the window back) on a small geometry."""
    cfg = dataclasses.replace(TINY, name="windowed", num_layers=3, window=24)
    model = Model(cfg, seed=1)
    ps = prompts((5, 30, 600), seed=11)

    def eng(role: Role, tp: int, pp: int = 1) -> Engine:
        return Engine(EngineConfig(cfg, role=role, tp_size=tp, pp_size=pp, num_blocks=128), model=model)

    want = eng(Role.COLOCATED, 1).generate(ps, 8, ignore_eos=True)
    assert len({tuple(w) for w in want}) == 3
    hub = LoopbackHub()
    p, d = eng(Role.PREFILL, 2, 3), eng(Role.DECODE, 4)
    p.set_hooks(hub.producer(p.kv))
    d.set_hooks(hub.consumer(d.kv))
    reqs = []
    for i, prompt in enumerate(ps):
        p.submit(Request(f"p{i}", prompt, 1, role=TransferRole.REMOTE_DECODE, transfer_id=f"w{i}"))
        reqs.append(
            Request(
                f"d{i}", prompt, 8, ignore_eos=True, role=TransferRole.REMOTE_PREFILL, transfer_id=f"w{i}"
            )
        )
        d.submit(reqs[-1])
    for _ in range(200):
        p.step()
        d.step()
        if all(r.state.finished for r in reqs):
            break
    assert [r.output_ids for r in reqs] == want


def test_an_abort_racing_ready_frees_the_decode_legs_blocks() -> None:
    """D's client leaves in the step where its KV landed: the abort fenced the prompt's blocks, awaiting a
    RELEASED that never comes (READY was the connector's last word). Before, those blocks stayed
    quarantined for the engine's life; now READY frees them."""
    hub = LoopbackHub()
    p, d = engine(Role.PREFILL, num_blocks=32), engine(Role.DECODE, num_blocks=32)
    p.set_hooks(hub.producer(p.kv))
    d.set_hooks(hub.consumer(d.kv))
    prompt, outs = [1] * 40, []
    d.submit(
        Request("d1", prompt, 4, role=TransferRole.REMOTE_PREFILL, transfer_id="t1", on_output=outs.append)
    )
    d.step()  # D lends its blocks: WAITING_FOR_KV
    p.submit(Request("p1", prompt, 4, role=TransferRole.REMOTE_DECODE, transfer_id="t1"))
    p.step()  # the KV lands: READY waits for D's next poll
    d.abort("d1")  # in that same D step, before the poll
    for _ in range(20):
        d.step()
        p.step()
    assert [(o.finished, o.finish_reason.value if o.finish_reason else None) for o in outs] == [
        (True, "abort")
    ]
    assert d.scheduler.fenced == {} and d.kv.allocator.num_quarantined == 0 and d.scheduler.num_free == 32

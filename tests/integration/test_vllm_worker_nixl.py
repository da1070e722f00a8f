"""The vLLM connector's worker side over real NIXL, one process per TP rank as vLLM runs them.

Each worker process holds a ``WorkerSide`` registered with CPU torch tensors allocated as vLLM 0.34 does
(one zeroed int8 buffer, per layer an LBHNC ``as_strided`` view cast to fp16/bf16). This process plays
both engines' schedulers: each step's ops go to every rank of the engine, and a request is reported
finished to the scheduler side only once every rank reported it. D's ranks together must hold exactly
P's logical KV for the request's tokens, and no byte outside the request's blocks.

Four worker processes (two for P, two for D) serve every case; each case builds fresh engines in them.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import pytest

# torch is not a kvwire dependency but `make venv` installs the CPU build: without it this fails, by design.
import torch  # noqa: F401

from kvwire.integrations.vllm.params import KvRole
from kvwire.integrations.vllm.worker import Finished
from kvwire.testing.vllm_worker import (
    Aggregator,
    Model,
    VllmEngine,
    VllmWorker,
    logical_kv,
    run_steps,
)

pytestmark = pytest.mark.nixl

MODEL = Model(num_layers=3, kv_heads=4, head_dim=64, block_size=16, num_blocks=64)
N = 5 * MODEL.block_size - 3  # the last block is partial
P_BLOCKS = [4, 5, 6, 20, 9]
D_BLOCKS = [33, 2, 3, 10, 11]
_case = itertools.count()
# `cuda` on a GPU machine (scripts/gpu-check.sh runs this file so): the same checks with the KV in VRAM.
DEVICE = os.environ.get("KVWIRE_TEST_DEVICE", "cpu")


@dataclass
class Pool:
    p: list[VllmWorker]
    d: list[VllmWorker]


@pytest.fixture(scope="module")
def pool() -> Iterator[Pool]:
    workers = [VllmWorker() for _ in range(4)]  # spawned together: their start-ups overlap
    try:
        yield Pool(workers[:2], workers[2:])
    finally:
        with ThreadPoolExecutor(len(workers)) as ex:  # each exit waits for NIXL/UCX to shut down
            list(ex.map(VllmWorker.close, workers))


def _check_vllm_layout(engine: VllmEngine, dtype: str) -> None:
    """The tensors each rank registered are vLLM 0.34's LBHNC views of one buffer."""
    heads = MODEL.kv_heads // engine.tp_size
    c = 2 * MODEL.head_dim
    layer_elems = MODEL.num_blocks * heads * MODEL.block_size * c
    for rank, info in enumerate(engine.infos):
        assert info["shape"] == [MODEL.num_blocks, heads, MODEL.block_size, c]
        assert info["strides"] == [heads * MODEL.block_size * c, MODEL.block_size * c, c, 1]
        assert info["dtype"] == f"torch.{dtype}"
        assert info["storages"] == 1  # every layer a view of one backing buffer
        assert info["layer_offsets"] == [i * layer_elems * 2 for i in range(MODEL.num_layers)]
        assert info["heads"] == [rank * heads, (rank + 1) * heads]
        assert info["block_len"] == heads * MODEL.block_size * c * 2


@pytest.mark.parametrize(
    ("p_tp", "d_tp", "mode", "dtype"),
    [
        (1, 1, "push", "float16"),
        (2, 1, "push", "bfloat16"),
        (1, 2, "push", "float16"),
        (1, 1, "pull", "bfloat16"),
    ],
    ids=["push-1to1-fp16", "push-2to1-bf16", "push-1to2-fp16", "pull-1to1-bf16"],
)
def test_d_ranks_hold_p_logical_kv(pool: Pool, p_tp: int, d_tp: int, mode: str, dtype: str) -> None:
    n = next(_case)
    seed = 100 + n
    kw = {"model": MODEL, "mode": mode, "dtype": dtype, "device": DEVICE}
    p = VllmEngine(KvRole.PRODUCER, pool.p[:p_tp], engine_id=f"P{n}", **kw)
    try:
        d = VllmEngine(KvRole.CONSUMER, pool.d[:d_tp], engine_id=f"D{n}", **kw)
    except BaseException:
        p.close()
        raise
    try:
        _check_vllm_layout(p, dtype)
        _check_vllm_layout(d, dtype)
        # P's prefill wrote the request's KV (each rank its heads); every other byte of P is noise, so a
        # wrong source block or a stray tail shows up on D.
        p.call_all("fill", block_ids=P_BLOCKS, num_tokens=N, seed=seed, noise_seed=seed + 1)
        # P's request finished: vLLM calls request_finished once and keeps the blocks.
        delay, params = p.sched.finished("req-p", {"do_remote_decode": True}, P_BLOCKS, N, False)
        assert delay and params is not None
        assert params["remote_tp_size"] == p_tp and params["remote_port"] == p.port
        assert ("remote_block_ids" in params) == (mode == "pull")
        # The proxy hands P's kv_transfer_params to D, which loads the whole prompt asynchronously.
        assert d.sched.matched_tokens("req-d", params, N, 0) == (N, True)
        d.sched.allocated("req-d", D_BLOCKS, N, N)
        run_steps([p, d], lambda: "req-d" in d.reported.recving and "req-p" in p.reported.sending)
        assert d.reported.failed_recving == set()
        assert not p.sched.has_pending_sends() and d.sched.num_loading == 0

        want = logical_kv(MODEL, N, seed)
        got = d.gather(D_BLOCKS, N)
        assert got.shape == want.shape == (MODEL.num_layers, MODEL.kv_heads, N, 2 * MODEL.head_dim)
        assert np.array_equal(got, want), f"{int((got != want).sum())} of {want.size} KV words differ"
        assert d.call_all("dirty_blocks", used=D_BLOCKS) == [[] for _ in range(d_tp)], (
            "bytes landed outside the request's blocks"
        )
        # Each request is reported exactly once: more steps report nothing.
        for _ in range(5):
            for e in (p, d):
                got_step = e.step()
                assert not (got_step.sending or got_step.recving or got_step.failed_recving)
        assert p.reported.sending == {"req-p"} and d.reported.recving == {"req-d"}
    finally:
        p.close()
        d.close()


def test_aggregator_reports_only_when_every_rank_did() -> None:
    agg = Aggregator(2)
    first = agg.aggregate([Finished(sending={"a"}, recving={"b"}, failed_recving={"b"}), Finished()])
    assert first == Finished()
    second = agg.aggregate([Finished(), Finished(sending={"a"}, recving={"b"})])
    assert second == Finished(sending={"a"}, recving={"b"}, failed_recving={"b"})
    assert agg.aggregate([Finished(), Finished()]) == Finished()

"""Layer-wise push through the vLLM connector's worker side over real NIXL, one process per TP rank.

P's worker runs a prefill step as vLLM does with ``"layerwise": true``: the step's ``STREAM`` operation,
then per layer the layer's KV computed into the request's blocks and ``save_kv_layer``, then
``wait_for_save``. Before the step P's blocks hold other KV (a wrong seed), so a layer written before it
was computed shows on D. D must end up with exactly P's logical KV, become READY before P's
``request_finished``, and hold no byte outside the request's blocks.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import msgspec
import numpy as np
import pytest

# torch is not a kvwire dependency but `make venv` installs the CPU build: without it this fails, by design.
import torch  # noqa: F401

from kvwire.integrations.vllm.params import KvRole, Op, OpKind
from kvwire.testing.engines import wait_for
from kvwire.testing.vllm_worker import Model, VllmEngine, VllmWorker, logical_kv, run_steps

pytestmark = pytest.mark.nixl

MODEL = Model(num_layers=3, kv_heads=4, head_dim=64, block_size=16, num_blocks=64)
N = 5 * MODEL.block_size - 3
P_BLOCKS = [4, 5, 6, 20, 9]
D_BLOCKS = [33, 2, 3, 10, 11]
# One layer of the request on a TP1 rank: 5 whole blocks of [4 heads, 16 tokens, K and V of 64] fp16.
LAYER_BYTES = len(P_BLOCKS) * MODEL.kv_heads * MODEL.block_size * 2 * MODEL.head_dim * 2
_case = itertools.count()
# `cuda` on a GPU machine (scripts/gpu-check.sh runs this file so): KV in VRAM, layers fenced by CUDA events.
DEVICE = os.environ.get("KVWIRE_TEST_DEVICE", "cpu")


@pytest.fixture(scope="module")
def pool() -> Iterator[list[VllmWorker]]:
    workers = [VllmWorker() for _ in range(3)]  # P, and D's two ranks
    try:
        yield workers
    finally:
        with ThreadPoolExecutor(len(workers)) as ex:
            list(ex.map(VllmWorker.close, workers))


class Pair:
    """A layer-wise P (TP1) and a D (TP ``d_tp``), one request ``req-p`` / ``req-d``."""

    def __init__(self, pool: list[VllmWorker], d_tp: int) -> None:
        n = next(_case)
        self.seed = 300 + n
        kw: dict[str, Any] = {"model": MODEL, "mode": "push", "dtype": "float16", "device": DEVICE}
        self.p = VllmEngine(KvRole.PRODUCER, pool[:1], engine_id=f"LP{n}", extra={"layerwise": True}, **kw)
        try:
            self.d = VllmEngine(KvRole.CONSUMER, pool[1 : 1 + d_tp], engine_id=f"LD{n}", **kw)
        except BaseException:
            self.p.close()
            raise
        # P's blocks hold another request's KV until the step computes each layer.
        seeds = {"seed": self.seed + 7, "noise_seed": self.seed + 1}
        self.p.call_all("fill", block_ids=P_BLOCKS, num_tokens=N, **seeds)
        self.stream = msgspec.msgpack.encode([Op(OpKind.STREAM, "req-p", "req-p", P_BLOCKS, N)])

    def register_d(self) -> None:
        """The router sends both legs at once: D registers with P (push_reg) without waiting for it."""
        params = {
            "do_remote_prefill": True, "transfer_id": "req-p", "remote_engine_id": self.p.engine_id,
            "remote_host": "127.0.0.1", "remote_port": self.p.port, "remote_tp_size": 1, "remote_pp_size": 1,
        }  # fmt: skip
        assert self.d.sched.matched_tokens("req-d", params, N, 0) == (N, True)
        self.d.sched.allocated("req-d", D_BLOCKS, N, N)
        self.d.step()  # LOAD: the push_reg goes out

    def prefill(self, layers: list[int], *, first: bool, end: bool) -> list[int]:
        ops = self.stream if first else msgspec.msgpack.encode([])
        out = self.p.workers[0].call(
            "prefill", ops=ops, layers=layers, block_ids=P_BLOCKS, num_tokens=N, seed=self.seed, end=end
        )
        moved: list[int] = out["moved"]
        return moved

    def moved_at_least(self, nbytes: int) -> int:
        got: int = self.p.workers[0].call("wait_moved", nbytes=nbytes)
        return got

    def finish_p(self) -> None:
        delay, params = self.p.sched.finished("req-p", {"do_remote_decode": True}, P_BLOCKS, N, False)
        assert delay and params is not None

    def check_d(self, want: np.ndarray) -> None:
        got = self.d.gather(D_BLOCKS, N)
        assert np.array_equal(got, want), f"{int((got != want).sum())} of {want.size} KV words differ"
        assert self.d.call_all("dirty_blocks", used=D_BLOCKS) == [[] for _ in self.d.workers]

    def close(self) -> None:
        self.p.close()
        self.d.close()


@pytest.mark.parametrize("d_tp", [1, 2], ids=["1to1", "1to2"])
def test_layerwise_each_layer_lands_while_the_prefill_runs(pool: list[VllmWorker], d_tp: int) -> None:
    t = Pair(pool, d_tp)
    try:
        t.register_d()
        assert t.prefill([0], first=True, end=False) in ([0], [LAYER_BYTES])
        # Layer 0 is written while layers 1 and 2 are not computed yet (only layer 0, whole).
        assert t.moved_at_least(LAYER_BYTES) == LAYER_BYTES
        moved = t.prefill([1, 2], first=False, end=True)
        assert moved[-1] == 3 * LAYER_BYTES  # wait_for_save returned: every layer written, done sent
        # D is READY from the layer writes alone, before P's request_finished (no SEND yet).
        run_steps([t.d], lambda: "req-d" in t.d.reported.recving)
        assert t.d.reported.failed_recving == set()
        t.check_d(logical_kv(MODEL, N, t.seed))
        t.finish_p()  # request_finished: P's blocks go back at once, nothing more to write
        run_steps([t.p], lambda: "req-p" in t.p.reported.sending)
        assert t.moved_at_least(0) == 3 * LAYER_BYTES
    finally:
        t.close()


def test_layerwise_push_reg_arriving_mid_prefill_gets_the_computed_layers(pool: list[VllmWorker]) -> None:
    t = Pair(pool, 1)
    try:
        assert t.prefill([0], first=True, end=False) == [0]  # no push_reg yet: layer 0 waits
        t.register_d()
        assert t.moved_at_least(LAYER_BYTES) == LAYER_BYTES  # written as soon as D registered
        assert t.prefill([1, 2], first=False, end=True)[-1] == 3 * LAYER_BYTES
        run_steps([t.d], lambda: "req-d" in t.d.reported.recving)
        assert t.d.reported.failed_recving == set()
        t.check_d(logical_kv(MODEL, N, t.seed))
        t.finish_p()
        run_steps([t.p], lambda: "req-p" in t.p.reported.sending)
    finally:
        t.close()


def test_layerwise_d_abort_mid_layers_stops_the_writes_cleanly(pool: list[VllmWorker]) -> None:
    """D's request is aborted after layer 0 landed: P acks once that write ended, writes nothing more,
    and D gets its blocks back only then (RELEASED); layers 1 and 2 never reach D."""
    t = Pair(pool, 1)
    try:
        t.register_d()
        t.prefill([0], first=True, end=False)
        assert t.moved_at_least(LAYER_BYTES) == LAYER_BYTES
        delay, _ = t.d.sched.finished("req-d", None, D_BLOCKS, N, True)  # D's client went away
        assert not delay
        run_steps([t.d], lambda: "req-d" in t.d.reported.recving)  # after P's cancel_ack only
        assert t.d.reported.failed_recving == set()  # an abort, not a failed load
        assert t.prefill([1, 2], first=False, end=True)[-1] == LAYER_BYTES  # nothing more written
        t.finish_p()
        run_steps([t.p], lambda: "req-p" in t.p.reported.sending)
        want = logical_kv(MODEL, N, t.seed)
        want[1:] = 0  # D's cache starts zeroed: only layer 0 ever landed
        t.check_d(want)
        wait_for(lambda: t.moved_at_least(0) == LAYER_BYTES, "P's count to stay", 1.0)
    finally:
        t.close()

"""The vLLM connector's worker side over real NIXL, for geometries that differ between P and D: D's blocks
larger than P's with vLLM >= 0.34's fused K/V layout (FlashAttention's ``[K|V]`` rows and the CPU
backend's K and V tiles), and a pipeline-parallel P (two stages) into a D without PP.

As in test_vllm_worker_nixl.py: one process per rank, tensors allocated as vLLM 0.34 does, this process
plays both schedulers; D's ranks together must hold exactly P's logical KV of the request's tokens (every
KV word compared, read back in D's own block layout), and no byte outside the request's blocks.
"""

from __future__ import annotations

import itertools
import os
import socket
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

import numpy as np
import pytest

# torch is not a kvwire dependency but `make venv` installs the CPU build: without it this fails, by design.
import torch  # noqa: F401

from kvwire.integrations.vllm.params import KvRole
from kvwire.testing.vllm_worker import Model, VllmEngine, VllmWorker, logical_kv, run_steps

pytestmark = pytest.mark.nixl

P_MODEL = Model(num_layers=3, kv_heads=4, head_dim=64, block_size=16, num_blocks=64)
N = 5 * 16 - 3  # five P blocks, the last partial
P_BLOCKS = [4, 5, 6, 20, 9]
_case = itertools.count()
# `cuda` on a GPU machine (scripts/gpu-check.sh runs this file so): the same transfers with the KV in VRAM.
DEVICE = os.environ.get("KVWIRE_TEST_DEVICE", "cpu")


@dataclass
class Pool:
    p: list[VllmWorker]
    d: list[VllmWorker]


@pytest.fixture(scope="module")
def pool() -> Iterator[Pool]:
    workers = [VllmWorker() for _ in range(4)]
    try:
        yield Pool(workers[:2], workers[2:])
    finally:
        with ThreadPoolExecutor(len(workers)) as ex:
            list(ex.map(VllmWorker.close, workers))


def _transfer(
    pool: Pool,
    p_model: Model,
    d_model: Model,
    *,
    p_tp: int = 1,
    p_pp: int = 1,
    d_tp: int = 1,
    mode: str = "push",
    dtype: str = "float16",
    p_hosts: tuple[str, ...] = (),
) -> None:
    """P prefills ``P_BLOCKS``, D loads into its own blocks; D's KV compared word for word with P's.
    ``p_hosts``: each P rank's host (its worker's ``KVWIRE_SIDE_CHANNEL_HOST``), as on a multi-node P."""
    n = next(_case)
    seed = 300 + n
    d_blocks = [33, 2, 3, 10, 11][: -(-N // d_model.block_size)]
    p_blocks = P_BLOCKS[: -(-N // p_model.block_size)]
    p = VllmEngine(
        KvRole.PRODUCER, pool.p[: p_tp * p_pp], engine_id=f"P{n}", model=p_model, mode=mode, dtype=dtype,
        pp_size=p_pp, device=DEVICE, hosts=p_hosts,
    )  # fmt: skip
    try:
        d = VllmEngine(
            KvRole.CONSUMER,
            pool.d[:d_tp],
            engine_id=f"D{n}",
            model=d_model,
            mode=mode,
            dtype=dtype,
            device=DEVICE,
        )
    except BaseException:
        p.close()
        raise
    silent = []  # each P rank not on 127.0.0.1: its port there accepts and never answers
    try:
        for r, host in enumerate(p_hosts):
            if host != "127.0.0.1":
                silent.append(socket.create_server(("127.0.0.1", p.port + r)))
        p.call_all("fill", block_ids=p_blocks, num_tokens=N, seed=seed, noise_seed=seed + 1)
        delay, params = p.sched.finished("req-p", {"do_remote_decode": True}, p_blocks, N, False)
        assert delay and params is not None
        assert (params["remote_tp_size"], params["remote_pp_size"]) == (p_tp, p_pp)
        assert params.get("remote_hosts", []) == [h for h in p_hosts if len(set(p_hosts)) > 1]
        assert d.sched.matched_tokens("req-d", params, N, 0) == (N, True)
        d.sched.allocated("req-d", d_blocks, N, N)
        run_steps([p, d], lambda: "req-d" in d.reported.recving and "req-p" in p.reported.sending)
        assert d.reported.failed_recving == set()
        want = logical_kv(p_model, N, seed)
        got = d.gather(d_blocks, N)
        assert got.shape == want.shape
        assert np.array_equal(got, want), f"{int((got != want).sum())} of {want.size} KV words differ"
        assert d.call_all("dirty_blocks", used=d_blocks) == [[] for _ in range(d_tp)], (
            "bytes landed outside the request's blocks"
        )
    finally:
        for sock in silent:
            sock.close()
        p.close()
        d.close()


@pytest.mark.parametrize(
    ("d_block", "tiles", "p_tp", "mode"),
    [
        (32, False, 1, "push"),
        (64, False, 2, "push"),
        (32, True, 1, "push"),
        (64, True, 2, "push"),
        (32, False, 1, "pull"),
        (32, True, 1, "pull"),
    ],
    ids=[
        "rows-16to32-1to1",
        "rows-16to64-2to1",
        "tiles-16to32-1to1",
        "tiles-16to64-2to1",
        "rows-pull",
        "tiles-pull",
    ],
)
def test_block_size_of_d_larger_than_p_with_fused_kv(
    pool: Pool, d_block: int, tiles: bool, p_tp: int, mode: str
) -> None:
    """vLLM's block_size differs (P 16, D 32 or 64): each P block lands in its token slot of D's block,
    per head in rows (K and V together) or in each of the K and V tiles."""
    p_model = replace(P_MODEL, kv_tiles=tiles)
    d_model = replace(p_model, block_size=d_block, num_blocks=48)
    _transfer(pool, p_model, d_model, p_tp=p_tp, mode=mode, dtype="bfloat16" if tiles else "float16")


@pytest.mark.parametrize(("d_tp", "mode"), [(1, "push"), (2, "push"), (1, "pull")])
def test_pipeline_parallel_p_into_d_without_pp(pool: Pool, d_tp: int, mode: str) -> None:
    """P runs two PP stages (layers 0-1 and 2 of 3, vLLM's split), one worker each; D has no PP: each
    stage writes its layers, D is READY only once both stages' done arrived."""
    _transfer(pool, P_MODEL, P_MODEL, p_pp=2, d_tp=d_tp, mode=mode)


@pytest.mark.parametrize(("d_tp", "mode"), [(1, "push"), (2, "pull")])
def test_pipeline_stages_of_p_on_two_hosts(pool: Pool, d_tp: int, mode: str) -> None:
    """A multi-node P: stage 1's worker runs on a second host (127.0.0.2, from its environment's
    KVWIRE_SIDE_CHANNEL_HOST; vLLM starts every node from one kv_transfer_config). On the first host,
    stage 1's port belongs to a listener that accepts and never answers: D reaches each rank only at the
    host P's answer names for it (``remote_hosts``, learnt from the workers as vLLM gathers their
    handshake metadata). Before, every rank bound side_channel_host: stage 1 could not start there."""
    _transfer(pool, P_MODEL, P_MODEL, p_pp=2, d_tp=d_tp, mode=mode, p_hosts=("127.0.0.1", "127.0.0.2"))


@pytest.mark.parametrize(
    ("p_block", "tiles", "p_tp", "mode"),
    [(32, False, 1, "push"), (64, False, 2, "push"), (32, True, 2, "push"), (32, False, 1, "pull"),
     (64, True, 1, "pull")],
    ids=["rows-32to16-1to1", "rows-64to16-2to1", "tiles-32to16-2to1", "rows-pull", "tiles-64to16-pull"],
)  # fmt: skip
def test_block_size_of_p_larger_than_d(pool: Pool, p_block: int, tiles: bool, p_tp: int, mode: str) -> None:
    """P's blocks larger than D's (a prefill backend with 32- or 64-token pages into a decode with 16, as
    vLLM's NIXL connector supports): each of D's blocks takes its token slot of one P block, per head in
    rows or in each tile. Refused before 2026-12-07 (D's load failed)."""
    d_model = replace(P_MODEL, kv_tiles=tiles)
    p_model = replace(d_model, block_size=p_block, num_blocks=24)
    _transfer(pool, p_model, d_model, p_tp=p_tp, mode=mode, dtype="bfloat16" if tiles else "float16")


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_p_rank_that_no_d_rank_reads_frees_the_request_with_the_others(pool: Pool, mode: str) -> None:
    """One KV head replicated on P's two ranks (as MLA's latent is on every rank), D with one rank: D
    reads the head from P rank 0 only. P rank 1 must hear the request's end all the same: vLLM frees a
    request's blocks only once every worker reported it sent, and rank 1 held them to its lease (30 s,
    past this test's 20 s bound)."""
    model = replace(P_MODEL, kv_heads=1)
    _transfer(pool, model, model, p_tp=2, mode=mode)

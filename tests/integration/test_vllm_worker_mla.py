"""MLA through the vLLM connector's worker side over real NIXL (no vLLM needed): vLLM's MLA cache is one
latent tensor per layer, ``[num_blocks, block_size, kv_lora_rank + rope_dim]`` (every TP rank holds all
of it), registered zero copy; P and D driven as vLLM drives them, every latent word compared, at equal
block sizes and with D's blocks twice P's. vLLM's KV cache interface (0.32's CPU build, 0.34) hands each
layer as a 4-D ``[num_blocks, 1, block_size, latent]`` view (H is 1 for MLA); the 3-D shape is older
vLLM's."""

from __future__ import annotations

import time

import numpy as np
import pytest

from kvwire.integrations.vllm.params import KvRole, settings_from_extra
from kvwire.integrations.vllm.scheduler import LocalEngine, SchedulerSide
from kvwire.integrations.vllm.worker import Finished, RankPlace, WorkerSide
from kvwire.testing.procs import free_port

pytestmark = pytest.mark.nixl

LAYERS, LATENT, NUM_BLOCKS = 3, 576, 24  # DeepSeek's kv_lora_rank 512 + qk_rope_head_dim 64


class MlaSide:
    def __init__(self, role: KvRole, mode: str, block_size: int, seed: int | None, dims: int = 4) -> None:
        port = free_port()
        self.settings = settings_from_extra({"mode": mode, "side_channel_port": port})
        eid = f"{role.value}-{port}"
        place = RankPlace(eid, "inc1", "tiny-mla", 1, 0, 1, 0, LAYERS, 1, LATENT, block_size, mla=True)
        self.sched = SchedulerSide(role, self.settings, LocalEngine(eid, "127.0.0.1", port, 1, 1), block_size)
        self.worker = WorkerSide(role, self.settings, place)
        self.backing = np.zeros((LAYERS, NUM_BLOCKS, block_size, LATENT), dtype=np.float16)
        if seed is not None:
            words = self.backing.view(np.uint16)
            words[...] = np.random.default_rng(seed).integers(1, 1 << 16, size=words.shape, dtype=np.uint16)
        views = [self.backing[i][:, None] if dims == 4 else self.backing[i] for i in range(LAYERS)]
        self.worker.register({f"model.layers.{i}.self_attn.attn": v for i, v in enumerate(views)})
        self.block_size = block_size
        self.reported = Finished()

    def step(self) -> None:
        self.worker.apply(self.sched.take_ops())
        got = self.worker.finished()
        self.sched.transfers_ended(got.sending, got.recving)
        self.reported.sending |= got.sending
        self.reported.recving |= got.recving
        self.reported.failed_recving |= got.failed_recving

    def tokens(self, blocks: list[int], n: int) -> np.ndarray:
        """``[layers, n, latent]`` words of the request's tokens, read from its blocks."""
        words = self.backing.view(np.uint16)[:, blocks]
        return words.reshape(LAYERS, len(blocks) * self.block_size, LATENT)[:, :n]


@pytest.mark.parametrize(
    ("mode", "d_block", "dims"), [("push", 16, 4), ("pull", 16, 4), ("push", 32, 4), ("push", 16, 3)], ids=str
)
def test_mla_latent_cache_moves_every_word(mode: str, d_block: int, dims: int) -> None:
    p = MlaSide(KvRole.PRODUCER, mode, 16, seed=5, dims=dims)
    d = MlaSide(KvRole.CONSUMER, mode, d_block, seed=None, dims=dims)
    try:
        assert p.worker.kv is not None and p.worker.kv.spec.mla and len(p.worker.kv.regions()) == LAYERS
        n = 5 * 16 - 3
        p_blocks = [4, 5, 6, 20, 9]
        d_blocks = [13, 2, 3, 10, 11][: -(-n // d_block)]
        _, params = p.sched.finished("req-p", {"do_remote_decode": True}, p_blocks, n, False)
        assert params is not None and d.sched.matched_tokens("req-d", params, n, 0) == (n, True)
        d.sched.allocated("req-d", d_blocks, n, n)
        deadline = time.monotonic() + 20
        while not ("req-d" in d.reported.recving and "req-p" in p.reported.sending):
            assert time.monotonic() < deadline, f"timed out: P {p.reported}, D {d.reported}"
            p.step()
            d.step()
            time.sleep(0.002)
        assert d.reported.failed_recving == set()
        assert np.array_equal(d.tokens(d_blocks, n), p.tokens(p_blocks, n))
        others = [b for b in range(NUM_BLOCKS) if b not in d_blocks]
        assert not d.backing[:, others].any(), "bytes landed outside the request's blocks"
    finally:
        p.worker.close()
        d.worker.close()

"""The layer-wise fence thread (GPU workers): a callback that raises must not stop the thread that every
later ``wait_for_save`` drains, and a drain that cannot finish returns False in its time instead of
blocking vLLM's worker. The CUDA event itself needs a GPU (scripts/gpu-check.sh); here callbacks are
queued with no event, as ``drain`` queues its own marker."""

from __future__ import annotations

import threading

from kvwire.integrations.vllm.layerwise import _CudaFence


def test_layer_fence_survives_a_failing_callback_and_drains() -> None:
    fence = _CudaFence()
    ran: list[int] = []

    def boom() -> None:
        raise RuntimeError("loop closed")

    try:
        fence._queue.put((None, boom))
        fence._queue.put((None, lambda: ran.append(1)))
        assert fence.drain(5.0)
        assert ran == [1]
    finally:
        fence.close()


def test_layer_fence_drain_gives_up_in_its_time() -> None:
    fence = _CudaFence()
    release = threading.Event()

    def stuck() -> None:
        release.wait(10.0)

    try:
        fence._queue.put((None, stuck))
        assert not fence.drain(0.2)  # the stuck callback holds the queue: False, not a hang
        release.set()
        assert fence.drain(5.0)
    finally:
        release.set()
        fence.close()

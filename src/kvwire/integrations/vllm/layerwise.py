"""Layer-wise push inside vLLM (``"layerwise": true``), without vLLM: which requests stream, and the worker's
per-layer hand-off to kvwire's ``Producer``.

* Scheduler process (``StreamPlanner``): a P request with ``do_remote_decode`` and ``max_tokens == 1`` (a
  P leg: it ends in the step that ends its prefill, so ``request_finished`` then holds its blocks) is
  streamed in the step that computes the last of its prompt: a ``STREAM`` operation with its blocks
  (tracked from the scheduler's output across chunked-prefill steps) goes to the workers in that step's
  metadata. Other requests (longer P generations, preempted ones) keep whole-request push.
* Each worker (``LayerStreamer``): ``save_kv_layer`` (called by vLLM as each attention layer finished)
  tells the producer that layer is ready for every streamed request of the step; the producer writes it
  to each D that registered (``kvwire.core.producer_layers``). ``wait_for_save`` (end of the step) waits
  for those writes, as vLLM's contract asks of a connector that does not hold the blocks: after it, no
  write reads the blocks of a streamed request before its ``request_finished`` (``Producer.step_over``).
  On a GPU the layer's KV is written by kernels still queued when ``save_kv_layer`` returns: a CUDA event
  per layer is waited for on a thread of ours before the producer hears of the layer.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvwire.connector import Producer
from kvwire.errors import InvalidRequest, KvwireError
from kvwire.integrations.vllm.memory import layer_index
from kvwire.integrations.vllm.params import Op, OpKind, parse_params, send_id

log = logging.getLogger("kvwire.vllm")

_MAX_TRACKED = 1 << 16  # candidates at most: vLLM holds at most its running + waiting requests


@dataclass(slots=True)
class _Candidate:
    transfer_id: str
    num_tokens: int
    blocks: list[int] = field(default_factory=list)
    computed: int = 0


class StreamPlanner:
    """Scheduler side: which requests finish their prefill in this step, with their blocks."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._cands: dict[str, _Candidate] = {}

    def watch(self, req_id: str, raw: object, num_prompt_tokens: int, max_tokens: int | None) -> None:
        """A waiting request vLLM looks at (``get_num_new_matched_tokens``, maybe several times). Never
        raises: malformed parameters are the whole-request path's to refuse."""
        if req_id in self._cands or max_tokens != 1 or len(self._cands) >= _MAX_TRACKED:
            return
        try:
            params = parse_params(raw)
        except InvalidRequest:
            return
        if params is not None and params.do_remote_decode:
            self._cands[req_id] = _Candidate(send_id(params, req_id), num_prompt_tokens)

    def forget(self, req_id: str) -> None:
        self._cands.pop(req_id, None)

    def ops(self, out: Any, reserve: Callable[[str, str], bool]) -> list[Op]:
        """``STREAM`` operations for this step's ``SchedulerOutput`` (vLLM 0.32 and 0.34 shapes);
        ``reserve(req_id, transfer_id)`` holds the id from here (a request whose id another one holds, a
        client's retry, is not streamed: it would be handed the other's blocks under one id)."""
        if not self._cands:
            return []
        for new in out.scheduled_new_reqs:
            c = self._cands.get(new.req_id)
            if c is not None:
                c.blocks, c.computed = list(new.block_ids[0]), int(new.num_computed_tokens)
        cached = out.scheduled_cached_reqs
        resumed = getattr(cached, "resumed_req_ids", None) or ()
        for i, rid in enumerate(cached.req_ids):
            c = self._cands.get(rid)
            if c is None:
                continue
            more = cached.new_block_ids[i]
            if more is not None:
                c.blocks = list(more[0]) if rid in resumed else c.blocks + list(more[0])
            c.computed = int(cached.num_computed_tokens[i])
        ops: list[Op] = []
        for rid, n in out.num_scheduled_tokens.items():
            c = self._cands.get(rid)
            if c is None or c.computed + int(n) < c.num_tokens:
                continue
            need = -(-c.num_tokens // self.block_size)
            if len(c.blocks) >= need and reserve(rid, c.transfer_id):
                ops.append(Op(OpKind.STREAM, rid, c.transfer_id, c.blocks[:need], c.num_tokens))
            del self._cands[rid]  # streamed once; a later SEND finishes it either way
        return ops


class LayerStreamer:
    """Worker side: this step's streamed requests, each layer handed to the producer as it is computed."""

    def __init__(self, producer: Producer, wait_s: float) -> None:
        self.producer = producer
        self.wait_s = wait_s
        self._step: dict[str, Op] = {}  # transfer id -> STREAM op of this step
        self._fence: _CudaFence | None = None

    @property
    def active(self) -> bool:
        return bool(self._step)

    def stream(self, op: Op) -> None:
        self._step[op.transfer_id] = op

    def layer_saved(self, layer_name: str, kv_layer: Any) -> None:
        if not self._step:
            return
        layer = layer_index(layer_name)
        ops = list(self._step.values())
        if getattr(kv_layer, "is_cuda", False):
            if self._fence is None:
                self._fence = _CudaFence()
            self._fence.after_kernels(lambda: self._ready(ops, layer))
        else:
            self._ready(ops, layer)  # CPU: the layer's KV is written when the attention call returns

    def _ready(self, ops: list[Op], layer: int) -> None:
        for op in ops:
            try:
                self.producer.layers_ready(op.transfer_id, op.block_ids, op.num_tokens, (layer,))
            except KvwireError as exc:  # bad local input: the whole-request SEND still comes
                log.warning("kvwire: streaming %s refused: %s", op.req_id, exc)

    def step_over(self) -> None:
        """vLLM's ``wait_for_save``: this step's streamed writes end before the step does."""
        if not self._step:
            return
        if self._fence is not None and not self._fence.drain(self.wait_s):
            log.warning("kvwire: layer fences not reached within %.1f s", self.wait_s)
        tids = sorted(self._step)
        self._step.clear()
        if not self.producer.step_over(tids, self.wait_s):
            log.warning("kvwire: layer writes of %d request(s) still in flight after %.1f s: released",
                        len(tids), self.wait_s)  # fmt: skip

    def close(self) -> None:
        if self._fence is not None:
            self._fence.close()


class _CudaFence:
    """Runs callbacks, in order, once the GPU work queued before each was done (a CUDA event each)."""

    def __init__(self) -> None:
        self._queue: queue.Queue[tuple[Any, Callable[[], None]] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="kvwire-layer-fence", daemon=True)
        self._thread.start()

    def after_kernels(self, fn: Callable[[], None]) -> None:
        import torch  # only on a GPU worker, where vLLM has imported it

        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record()
        self._queue.put((event, fn))

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            event, fn = item
            try:
                if event is not None:
                    event.synchronize()  # releases the GIL while the GPU works
                fn()
            except Exception:  # one failed layer must not stop the thread every later drain waits on
                log.exception("kvwire: a layer's fence or hand-off failed")

    def drain(self, timeout_s: float) -> bool:
        """Wait until every callback queued so far ran; False if that took over ``timeout_s``."""
        done = threading.Event()
        self._queue.put((None, done.set))
        return done.wait(timeout_s)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=5.0)

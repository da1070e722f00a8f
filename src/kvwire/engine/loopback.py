"""In-process KV transfer between two engines (``np.copyto`` between their caches): the reference
implementation of the hooks, for tests and for checking the engine flow without a transport.

A ``LoopbackHub`` pairs a producer engine's hooks with a consumer engine's hooks. A transfer happens when
both sides have announced it (P's ``request_finished`` and D's ``request_allocated``, in either order):
for every layer, K and V, and KV head, the prompt's blocks are copied from a P rank that holds the head
into every D rank that holds it. ``fail_next`` makes the next transfers fail instead (D gets FAILED then
RELEASED, P its ProducerEvent with outcome FAILED).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from kvwire.engine.hooks import (
    ConsumerEvent,
    ConsumerEventKind,
    HookEvents,
    ProducerEvent,
    ProducerOutcome,
    TransferRequest,
)
from kvwire.engine.paged import PagedKV
from kvwire.errors import BlockRangeError, LayoutError
from kvwire.kv.spec import Layout
from kvwire.protocol.messages import FailReason


def copy_kv(src: PagedKV, src_blocks: tuple[int, ...], dst: PagedKV, dst_blocks: tuple[int, ...]) -> int:
    """Copy whole blocks of every layer and head from ``src`` to ``dst``; returns the bytes copied."""
    if src.spec.block_size != dst.spec.block_size or src.spec.layout is not dst.spec.layout:
        raise LayoutError("loopback copies need the same block size and layout on both sides")
    if len(dst_blocks) != len(src_blocks):
        raise BlockRangeError(f"{len(src_blocks)} source blocks for {len(dst_blocks)} destination blocks")
    s_idx, d_idx = list(src_blocks), list(dst_blocks)
    hnd = src.spec.layout is Layout.HND
    nbytes = 0
    for layer in range(src.spec.num_layers):
        for dtp in range(dst.tp_size):
            dc = dst.cache(layer, dtp)
            lo = dc.first_head  # the next head to copy: each from the first source rank holding it
            for stp in range(src.tp_size):
                sc = src.cache(layer, stp)
                lo = max(lo, sc.first_head)
                hi = min(dc.first_head + dc.heads, sc.first_head + sc.heads)
                if lo >= hi:
                    continue
                s_heads = slice(lo - sc.first_head, hi - sc.first_head)
                d_heads = slice(lo - dc.first_head, hi - dc.first_head)
                for s_region, d_region in ((sc.k(layer), dc.k(layer)), (sc.v(layer), dc.v(layer))):
                    if hnd:
                        part = s_region[s_idx, s_heads]
                        d_region[d_idx, d_heads] = part
                    else:
                        part = s_region[s_idx, :, s_heads]
                        d_region[d_idx, :, d_heads] = part
                    nbytes += part.nbytes
                lo = hi
    return nbytes


class LoopbackHub:
    """Matches P's finished requests with D's allocated ones by transfer id, and copies."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.producer_kv: PagedKV | None = None
        self.consumer_kv: PagedKV | None = None
        self._finished: dict[str, TransferRequest] = {}
        self._allocated: dict[str, TransferRequest] = {}
        self._producer_events: list[ProducerEvent] = []
        self._consumer_events: list[ConsumerEvent] = []
        self.wakes: list[Callable[[], None]] = []
        self.fail_next = 0
        self.bytes_copied = 0
        self.transfers = 0

    def producer(self, kv: PagedKV) -> LoopbackHooks:
        self.producer_kv = kv
        return LoopbackHooks(self, producer=True)

    def consumer(self, kv: PagedKV) -> LoopbackHooks:
        self.consumer_kv = kv
        return LoopbackHooks(self, producer=False)

    def finished(self, req: TransferRequest) -> None:
        with self._lock:
            self._finished[req.transfer_id] = req
            self._match(req.transfer_id)

    def allocated(self, req: TransferRequest) -> None:
        with self._lock:
            self._allocated[req.transfer_id] = req
            self._match(req.transfer_id)

    def abort(self, transfer_id: str) -> None:
        with self._lock:
            if self._allocated.pop(transfer_id, None) is not None:
                self._consumer_events.append(ConsumerEvent(transfer_id, ConsumerEventKind.RELEASED))

    def decline(self, transfer_id: str) -> None:
        """D will not load it: P's held blocks go back (``aborted``)."""
        with self._lock:
            if self._finished.pop(transfer_id, None) is not None:
                self._producer_events.append(ProducerEvent(transfer_id, ProducerOutcome.ABORTED))

    def take(self, producer: bool) -> HookEvents:
        with self._lock:
            if producer:
                p, self._producer_events = self._producer_events, []
                return HookEvents(producer=p)
            c, self._consumer_events = self._consumer_events, []
            return HookEvents(consumer=c)

    def _match(self, tid: str) -> None:
        if tid not in self._finished or tid not in self._allocated:
            return
        p, d = self._finished.pop(tid), self._allocated.pop(tid)
        assert self.producer_kv is not None and self.consumer_kv is not None
        if self.fail_next > 0:
            self.fail_next -= 1
            self._producer_events.append(ProducerEvent(tid, ProducerOutcome.FAILED))
            self._consumer_events.append(
                ConsumerEvent(tid, ConsumerEventKind.FAILED, FailReason.WRITE_FAILED)
            )
            self._consumer_events.append(ConsumerEvent(tid, ConsumerEventKind.RELEASED))
        else:
            self.bytes_copied += copy_kv(self.producer_kv, p.block_ids, self.consumer_kv, d.block_ids)
            self.transfers += 1
            self._producer_events.append(ProducerEvent(tid, ProducerOutcome.SENT))
            self._consumer_events.append(ConsumerEvent(tid, ConsumerEventKind.READY))
        for wake in self.wakes:
            wake()


class LoopbackHooks:
    """One side's hooks on a ``LoopbackHub``."""

    def __init__(self, hub: LoopbackHub, *, producer: bool) -> None:
        self.hub = hub
        self.is_producer = producer

    def bind(self, wake: Callable[[], None]) -> None:
        self.hub.wakes.append(wake)

    def request_finished(self, req: TransferRequest) -> bool:
        self.hub.finished(req)
        return True

    def request_allocated(self, req: TransferRequest) -> None:
        self.hub.allocated(req)

    def abort(self, transfer_id: str) -> None:
        self.hub.abort(transfer_id)

    def decline(self, req: TransferRequest) -> None:
        self.hub.decline(req.transfer_id)

    def poll(self) -> HookEvents:
        return self.hub.take(self.is_producer)

    def close(self) -> None:
        return None

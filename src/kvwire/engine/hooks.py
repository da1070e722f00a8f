"""Where a KV connector plugs into the engine.

Theory of operation. The engine owns its blocks; the connector borrows some of them:

* P (a request with ``do_remote_decode``): when the request has finished prefill (its KV for every
  prompt position is in the cache and its one token is sampled), the engine calls
  ``request_finished``. If the connector answers True, it has taken the request's blocks: the engine
  keeps them (unfreed, unchanged) until ``poll`` returns a ``ProducerEvent`` for that transfer id.
* D (a request with ``do_remote_prefill``): the engine allocates the request's blocks, marks the prompt's
  blocks quarantined and calls ``request_allocated``; the request waits (``WAITING_FOR_KV``) until
  ``poll`` returns a ``ConsumerEvent``: READY (the KV is in the blocks: decoding starts), or FAILED
  (then RELEASED later: only after RELEASED may the blocks be freed, or recomputed into). After the
  engine's ``abort`` of a waiting request, the connector ends it with RELEASED.

All calls come from the engine thread. ``poll`` must not block; a connector with news can call the
``wake`` callback it was given (``bind``) so the engine polls without waiting for its next tick.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from kvwire.core.events import ConsumerEvent, ConsumerEventKind, ProducerEvent, ProducerOutcome
from kvwire.kv_params import KvTransferParams

__all__ = [
    "ConsumerEvent",
    "ConsumerEventKind",
    "HookEvents",
    "KVTransferHooks",
    "ProducerEvent",
    "ProducerOutcome",
    "TransferRequest",
]


@dataclass(frozen=True, slots=True)
class TransferRequest:
    """What the connector needs to know about one request's KV."""

    transfer_id: str
    block_ids: tuple[int, ...]  # the prompt's blocks, in token order
    num_tokens: int  # prompt tokens whose KV moves (every prompt position)
    params: KvTransferParams | None = None  # the request's kv_transfer_params


@dataclass(frozen=True, slots=True)
class HookEvents:
    producer: Sequence[ProducerEvent] = ()
    consumer: Sequence[ConsumerEvent] = ()


class KVTransferHooks(Protocol):
    def bind(self, wake: Callable[[], None]) -> None:
        """Called once by the engine: ``wake()`` (thread-safe) makes the engine poll soon."""

    def request_finished(self, req: TransferRequest) -> bool:
        """P: the request's KV is complete. True: the connector holds the blocks until a ProducerEvent."""

    def request_allocated(self, req: TransferRequest) -> None:
        """D: blocks are allocated for the prompt's KV; register them with the producer."""

    def abort(self, transfer_id: str) -> None:
        """D: the request waiting for this KV was aborted; end the transfer, then report RELEASED."""

    def decline(self, req: TransferRequest) -> None:
        """D: a request was dropped before its blocks were allocated: tell its P (which then frees the
        prompt's blocks at once, not at its lease). No event follows."""

    def poll(self) -> HookEvents:
        """News since the last poll (non-blocking)."""

    def close(self) -> None:
        """The engine is stopping: release everything."""

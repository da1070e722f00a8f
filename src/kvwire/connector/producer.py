"""The producer (P side): writes finished requests' KV into D's blocks (push), or lends it to D (pull).

Engine call sites (any thread; none waits on the network):

* ``start() -> port``: registers every local rank's cache with its agent, starts the side channel.
* ``request_finished(transfer_id, block_ids, num_tokens)``: prefill is over; the connector now holds the
  blocks (the same block ids on every local rank) until it reports them freeable.
* ``poll() -> list[ProducerEvent]``: exactly one event per ``request_finished``: its blocks may be freed.
* ``layers_ready(transfer_id, block_ids, num_tokens, layers)`` (``layerwise`` push only): those layers'
  KV is computed in the prefill's last step; each is written to D as soon as D registered, before
  ``request_finished`` (``kvwire.core.producer_layers``).
* ``step_over(transfer_ids, timeout_s)`` (layerwise): the engine step that computed them ends; waits
  for their layer writes in flight (vLLM's ``wait_for_save``); none starts then before
  ``request_finished``.
* ``abort(transfer_id)``: the engine drops the request; no new write starts for it (writes in flight
  finish first, then the event comes).
* ``close()``.

The rules (registrations, fences, leases, tombstones, liveness, recall) are the core's:
``kvwire.core.producer_push.PushProducerCore`` and ``kvwire.core.producer.PullProducerCore``. This class
only runs them on the connector's loop thread (``ConnectorBase``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Sequence

from kvwire.connector._base import ConnectorBase
from kvwire.core.events import ProducerEvent
from kvwire.core.io import Abort, Finished, LayersReady, StepEnded
from kvwire.core.producer import ProducerCore, PullProducerCore
from kvwire.core.producer_layers import LayerwisePushProducerCore
from kvwire.core.producer_push import PushProducerCore
from kvwire.errors import BlockRangeError, ConfigError, TransferIdReused
from kvwire.kv.groups import moved_ids
from kvwire.kv.mapping import RankLayout
from kvwire.protocol.messages import TransferMode
from kvwire.protocol.ranks import RankKey

log = logging.getLogger(__name__)
_STEP_SLACK_S = 5.0  # beyond step_over's own wait: the loop thread's other work before it runs


class Producer(ConnectorBase[ProducerEvent]):
    """P side of kvwire for one engine and all its local (pp, tp) ranks."""

    role = "producer"
    core: ProducerCore

    def _make_core(self, layouts: dict[RankKey, RankLayout], num_blocks: int) -> ProducerCore:
        # The engine thread's record of the ids it handed over and has not polled the event of: a second
        # request_finished for a held id is refused at the call (the core would drop it, with no event, and
        # the engine would never free that request's blocks).
        self._held: set[str] = set()
        self._held_lock = threading.Lock()
        kind: type[ProducerCore] = PullProducerCore
        self.takes_claims = self.config.mode is TransferMode.PULL  # D claims our blocks before it reads
        if self.config.mode is TransferMode.PUSH:
            kind = LayerwisePushProducerCore if self.config.layerwise else PushProducerCore
        return kind(self.engine, layouts, num_blocks, self.config, host=self.host)

    def request_finished(self, transfer_id: str, block_ids: Sequence[int], num_tokens: int) -> None:
        """Raises ``TransferIdReused`` while another request holds ``transfer_id`` (its event not polled)."""
        ids = self._checked(transfer_id, block_ids, num_tokens)
        self._check_running()
        with self._held_lock:
            if transfer_id in self._held:
                raise TransferIdReused(transfer_id, "prefill")
            self._held.add(transfer_id)
        self._call(Finished(transfer_id, ids, int(num_tokens)))

    def poll(self) -> list[ProducerEvent]:
        out = super().poll()
        with self._held_lock:
            self._held.difference_update(e.transfer_id for e in out)
        return out

    def layers_ready(
        self, transfer_id: str, block_ids: Sequence[int], num_tokens: int, layers: Sequence[int]
    ) -> None:
        if not isinstance(self.core, LayerwisePushProducerCore):
            raise ConfigError("layers_ready needs a push producer with layerwise=True")
        ids = self._checked(transfer_id, block_ids, num_tokens)
        self._call(LayersReady(transfer_id, ids, int(num_tokens), tuple(int(x) for x in layers)))

    def step_over(self, transfer_ids: Sequence[str], timeout_s: float) -> bool:
        """The engine step that computed these requests' layers ends: wait (at most ``timeout_s``) until none
        of their layer-wise writes is in flight, then tell the core, in the same loop callback, that no new
        one may start before ``request_finished`` (the engine may reuse the blocks of a request that does not
        finish). False when writes were still in flight (they are released and their registrations fail)."""
        core = self.core
        if not transfer_ids or not isinstance(core, LayerwisePushProducerCore) or self._bg is None:
            return True
        if self._closed:  # its writes were released and its memory deregistered: nothing lands after this
            return True
        tids = frozenset(transfer_ids)

        async def settle() -> bool:
            deadline = self._clock() + timeout_s  # the connector's one clock (virtual in tests)
            while core.streaming(tids) and self._clock() < deadline:
                await asyncio.sleep(self.config.poll_interval_s)
            settled = not core.streaming(tids)
            for tid in sorted(tids):
                self._apply(self._clock(), StepEnded(tid))
            return settled

        try:
            return self._bg.run(settle(), timeout_s + _STEP_SLACK_S)
        except concurrent.futures.TimeoutError:
            # The loop thread is late: never raise into the engine's step (vLLM's wait_for_save). ``settle``
            # still runs and ends the step for the core when the loop gets to it.
            log.warning("producer: the step's layer writes not settled within %.1f s (loop late)", timeout_s)
            return False

    def _checked(self, transfer_id: str, block_ids: Sequence[int], num_tokens: int) -> tuple[int, ...]:
        ids = tuple(int(b) for b in block_ids)
        num_blocks = self.core.num_blocks
        used = moved_ids(self.engine.spec, ids, int(num_tokens), 0)  # a hybrid model's: its groups' blocks
        bad = [b for b in used if not 0 <= b < num_blocks]
        if bad or len(set(used)) != len(used):
            raise BlockRangeError(f"{transfer_id}: bad or repeated local block ids {bad[:4] or ids[:8]}")
        return ids

    def abort(self, transfer_id: str) -> None:
        self._call(Abort(transfer_id))

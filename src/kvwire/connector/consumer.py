"""The consumer (D side): gets a request's KV into its blocks, by registration (push) or by reading (pull).

Engine call sites (any thread; none waits on the network):

* ``start() -> port``: registers every local rank's cache with its agent, starts the side channel.
* ``request_allocated(transfer_id, block_ids, num_tokens, num_cached_tokens, remote)``: D allocated the
  request's blocks (the same ids on every local rank, in token order, prefix-hit blocks included);
  ``remote`` names P (and, in pull mode, P's block ids).
* ``poll() -> list[ConsumerEvent]``: READY (decode may start), or FAILED then RELEASED, or (after
  ``abort``) RELEASED. After FAILED the blocks stay fenced until RELEASED.
* ``abort(transfer_id)``: the engine drops the request; RELEASED follows once no P rank can still write.
* ``decline(transfer_id, remote)``: the engine will not load a request it was given (dropped before its
  blocks were allocated, or its local prefix hit covers the prompt): P is told, and frees the prompt's
  blocks now instead of at its lease. No event follows (nothing of D's was involved).
* ``close()``.

The rules (registration, draining, liveness, grace, reads) are the core's:
``kvwire.core.consumer.PushConsumerCore`` and ``kvwire.core.consumer_pull.PullConsumerCore``. This class
only runs them on the connector's loop thread (``ConnectorBase``).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from kvwire.connector._base import ConnectorBase
from kvwire.core.consumer import ConsumerCore, PushConsumerCore
from kvwire.core.consumer_pull import PullConsumerCore
from kvwire.core.consumer_records import UsedIds, check_allocation
from kvwire.core.events import ConsumerEvent
from kvwire.core.io import Abort, Allocated, Decline, RemoteEngine
from kvwire.errors import TransferIdReused
from kvwire.kv.mapping import RankLayout
from kvwire.protocol.messages import TransferMode
from kvwire.protocol.ranks import RankKey

__all__ = ["Consumer", "RemoteEngine"]


class Consumer(ConnectorBase[ConsumerEvent]):
    """D side of kvwire for one engine and all its local ranks."""

    role = "consumer"
    takes_reports = True
    core: ConsumerCore

    def _make_core(self, layouts: dict[RankKey, RankLayout], num_blocks: int) -> ConsumerCore:
        self._make_claims()
        kind = PushConsumerCore if self.config.mode is TransferMode.PUSH else PullConsumerCore
        return kind(self.engine, layouts, num_blocks, self.config, host=self.host)

    def watched_peers(self) -> list[tuple[str, str]]:
        """(engine_id, incarnation) of the P lives whose liveness D tracks now (only those live requests
        wait on: the map is pruned at every heartbeat period)."""
        return self.core.watched_peers()

    def _make_claims(self) -> None:
        # The engine thread's own record of the ids handed to the core (which runs on the loop thread):
        # a reused id is refused here, at once, as the engine's error for that request (HTTP 400).
        self._claims = UsedIds(self.config.max_served_ids)
        self._claims_lock = threading.Lock()

    def request_allocated(
        self,
        transfer_id: str,
        block_ids: Sequence[int],
        num_tokens: int,
        num_cached_tokens: int,
        remote: RemoteEngine,
    ) -> None:
        inp = Allocated(
            transfer_id, tuple(int(b) for b in block_ids), int(num_tokens), int(num_cached_tokens), remote
        )
        check_allocation(self.engine, self.core.num_blocks, inp)  # raise to the engine, not in the loop
        self._check_running()
        with self._claims_lock:
            if not self._claims.add(inp.transfer_id):
                raise TransferIdReused(inp.transfer_id)
        self._call(inp)

    def abort(self, transfer_id: str) -> None:
        self._call(Abort(transfer_id))

    def decline(self, transfer_id: str, remote: RemoteEngine) -> None:
        self._call(Decline(transfer_id, remote))

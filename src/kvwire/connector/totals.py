"""A connector's cumulative counters as one flat mapping, and what rose since the last look.

Two exporters read them: the engine server's ``/metrics`` (``engine.connector_hooks.ConnectorMetrics``)
and kvwire inside vLLM (``integrations.vllm.stats``), which hands vLLM each step's change. Both read from
another thread than the connector's loop, so every counter is copied in one step first (``dict(c)`` runs
under the GIL without yielding): an insert on the loop thread never breaks an iteration here.
"""

from __future__ import annotations

from typing import Any

from kvwire.connector._base import ConnectorBase
from kvwire.connector.producer import Producer
from kvwire.core.handshake_io import FailureReason
from kvwire.protocol.messages import ErrorCode, TransferMode
from kvwire.transport.base import PeerMode


def guard_totals(connector: ConnectorBase[Any]) -> dict[str, int]:
    """The side channel's refusals and the handshakes' failures, over this connector's ranks."""
    server = connector.side_channel_stats
    managers = list(connector.managers.values())
    replies = dict(server.replies) if server is not None else {}
    totals = {
        "refused:over_limit": server.refused_connections if server is not None else 0,
        "refused:evicted_idle": server.evicted_connections if server is not None else 0,
        "circuit_open": sum(m.breaker.fast_failures for m in managers),
    }
    for code in ErrorCode:  # the side channel's refusals, by code
        totals[f"refusal:{code.value}"] = replies.get(code.value, 0)
    for reason in FailureReason:  # this engine's failed handshakes, over its ranks
        totals[f"handshake:{reason.value}"] = sum(dict(m.stats.failures).get(reason, 0) for m in managers)
    return totals


def posts_transfers(connector: ConnectorBase[Any]) -> bool:
    """A transfer is counted by the side that posts it: P in push mode, D in pull mode."""
    return isinstance(connector, Producer) == (connector.config.mode is TransferMode.PUSH)


def counter_totals(connector: ConnectorBase[Any]) -> dict[str, int]:
    """Every counter an exporter shows, by key: ``transfers``, ``bytes`` (the posting side only),
    ``failure:<FailReason>``, ``dropped:<why>``, ``handshakes:<mode>``, ``digests``, ``declined``,
    ``peers_declared_dead`` and ``guard_totals``'s keys."""
    st = connector.stats
    posts = posts_transfers(connector)
    totals = {
        "transfers": st.transfers_done if posts else 0,
        "bytes": st.bytes_moved if posts else 0,
        "digests": st.digests,
        "declined": st.declined,
        "peers_declared_dead": st.peers_declared_dead,
    }
    totals.update({f"failure:{r.value}": n for r, n in dict(st.failures).items()})
    totals.update({f"dropped:{why}": n for why, n in dict(st.dropped_notifs).items()})
    managers = list(connector.managers.values())
    for mode in PeerMode:
        totals[f"handshakes:{mode.value}"] = sum(dict(m.stats.handshakes).get(mode, 0) for m in managers)
    totals.update(guard_totals(connector))
    return totals


class Deltas:
    """What rose in a mapping of cumulative totals since the previous ``take`` (every key, 0 included)."""

    def __init__(self) -> None:
        self._seen: dict[str, int] = {}

    def take(self, totals: dict[str, int]) -> dict[str, int]:
        out = {key: max(0, total - self._seen.get(key, 0)) for key, total in totals.items()}
        self._seen.update(totals)
        return out

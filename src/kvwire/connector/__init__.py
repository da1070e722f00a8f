"""kvwire's public API for engines: ``Producer`` (P side) and ``Consumer`` (D side).

See ``docs/connector.md`` for the call sites, the events and the guarantees.
"""

from kvwire.connector.consumer import Consumer, RemoteEngine
from kvwire.connector.producer import Producer
from kvwire.core.config import ConnectorConfig, LoadFailurePolicy
from kvwire.core.events import (
    ConnectorStats,
    ConsumerEvent,
    ConsumerEventKind,
    ProducerEvent,
    ProducerOutcome,
)

__all__ = [
    "ConnectorConfig",
    "ConnectorStats",
    "Consumer",
    "ConsumerEvent",
    "ConsumerEventKind",
    "LoadFailurePolicy",
    "Producer",
    "ProducerEvent",
    "ProducerOutcome",
    "RemoteEngine",
]

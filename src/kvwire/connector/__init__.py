"""kvwire's public API for engines: ``Producer`` (P side) and ``Consumer`` (D side).

See ``docs/connector.md`` for the call sites, the events and the guarantees.
"""

from kvwire.connector.config import ConnectorConfig, LoadFailurePolicy
from kvwire.connector.consumer import Consumer, RemoteEngine
from kvwire.connector.events import (
    ConnectorStats,
    ConsumerEvent,
    ConsumerEventKind,
    ProducerEvent,
    ProducerOutcome,
)
from kvwire.connector.producer import Producer

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

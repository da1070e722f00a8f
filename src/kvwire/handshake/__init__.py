"""Side-channel handshakes: the metadata server, and cached, deduplicated handshakes with peers."""

from kvwire.handshake.loop import BackgroundLoop
from kvwire.handshake.manager import HandshakeManager
from kvwire.handshake.server import SideChannelServer
from kvwire.handshake.types import (
    EngineInfo,
    FailureReason,
    HandshakeManagerStats,
    LocalRank,
    PeerAddress,
    PeerRank,
)

__all__ = [
    "BackgroundLoop",
    "EngineInfo",
    "FailureReason",
    "HandshakeManager",
    "HandshakeManagerStats",
    "LocalRank",
    "PeerAddress",
    "PeerRank",
    "SideChannelServer",
]

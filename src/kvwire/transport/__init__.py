"""Transfer agents: the typed interface over NIXL, and the backends that implement it."""

from kvwire.transport.base import (
    Agent,
    Desc,
    DescListHandle,
    MemKind,
    PeerMode,
    Registration,
    XferHandle,
    XferOp,
    XferStatus,
    array_desc,
    make_agent_name,
    new_incarnation,
)

__all__ = [
    "Agent",
    "Desc",
    "DescListHandle",
    "MemKind",
    "PeerMode",
    "Registration",
    "XferHandle",
    "XferOp",
    "XferStatus",
    "array_desc",
    "make_agent_name",
    "new_incarnation",
]

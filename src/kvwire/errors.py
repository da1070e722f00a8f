"""One error hierarchy for kvwire, branched by phase.

Foreign exceptions (NIXL's, msgspec's, OS errors) are translated into these at the boundary where they
are raised, so callers above that boundary catch only ``KvwireError`` subclasses.
"""

from __future__ import annotations


class KvwireError(Exception):
    """Root of every error kvwire raises on purpose."""


class ConfigError(KvwireError):
    """A configuration value is missing, malformed or inconsistent."""


# --- protocol (sans-IO core) -------------------------------------------------------------------------


class ProtocolError(KvwireError):
    """A message or frame broke the wire contract."""


class MalformedMessage(ProtocolError):
    """Bytes that do not decode into a valid message (truncated, wrong magic, wrong types, ...)."""


class UnknownMessageType(MalformedMessage):
    """A well-formed message whose ``type`` this version does not know."""


class FrameTooLarge(ProtocolError):
    """A side-channel frame announced a length above the limit."""


class VersionMismatch(ProtocolError):
    """The peer speaks another major version of the wire contract."""


class StaleMessage(ProtocolError):
    """A message from an older incarnation of a peer, or for a transfer that is no longer known."""


class AuthError(ProtocolError):
    """A side-channel request without valid authentication while a shared secret is configured."""


class IllegalTransition(ProtocolError):
    """A state machine was given an event that its current state does not accept."""

    def __init__(self, role: str, state: str, event: str) -> None:
        super().__init__(f"{role}: event {event} is illegal in state {state}")
        self.role = role
        self.state = state
        self.event = event


class UnexpectedSender(ProtocolError):
    """A rank's message that the request does not expect: a rank it never registered with, or one that
    already ended the registration (duplicate ``done``, ``failed`` or ``cancel_ack``)."""


# --- kv layout and allocation ------------------------------------------------------------------------


class KVError(KvwireError):
    """KV layout, mapping or allocation error."""


class LayoutError(KVError):
    """A layout or TP/PP/block-size combination that kvwire cannot map."""


class AllocationError(KVError):
    """Out of blocks, double free, foreign block id, or a block used in the wrong state."""


class BlockRangeError(KVError):
    """A block id outside the peer's cache, or listed twice."""


# --- transport (NIXL boundary) -----------------------------------------------------------------------


class TransportError(KvwireError):
    """The transfer engine refused or failed an operation."""


class PeerNotFound(TransportError):
    """The remote agent is not loaded (never added, removed, or reaped)."""


class NotAddressable(TransportError):
    """The peer is loaded notif-only (or its memory is unknown): its memory cannot be read or written."""


class PeerDisconnected(TransportError):
    """The peer's connection is gone (NIXL_ERR_REMOTE_DISCONNECT)."""


class TransferFailed(TransportError):
    """A posted transfer ended in failure, or could not be posted."""


class HandleReleased(TransportError):
    """A transfer or descriptor-list handle was used after it was released."""


class RegistrationError(TransportError):
    """Memory could not be registered or deregistered."""


class AgentClosed(TransportError):
    """The local agent was closed."""


class AgentBusy(TransportError):
    """The local agent is held by a call waiting on the network (a peer load stuck on an unreachable UCX
    port): a call that would wait behind it is refused rather than stall its caller."""


class AgentStalled(AgentBusy):
    """A call on the local agent that waits on the network did not return within its deadline. It is left
    running, counted stuck, and undone if it ever succeeds: its result is never used."""


# --- handshake ---------------------------------------------------------------------------------------


class HandshakeError(KvwireError):
    """The side-channel handshake with a peer failed."""


class HandshakeTimeout(HandshakeError):
    """The peer did not answer the side channel within the per-peer timeout."""


class IncompatiblePeer(HandshakeError):
    """Compat hash, layout, TP/PP or block geometry does not match."""


class PeerReplaced(HandshakeError):
    """Another engine than the one named answers at the peer's address: the named one restarted under a
    new engine id (kvwire serve's and vLLM's default) or another process took its port. Its requests' KV
    is gone with it (the request fails ``peer_dead``, which a retry may cure); not a misconfiguration."""


class Unauthorized(HandshakeError):
    """The peer refused our credentials (or we refused theirs)."""


class NoSuchRank(HandshakeError):
    """The peer does not serve the requested (pp, tp) rank."""


class PeerUnreachable(HandshakeError):
    """The peer's side channel refused or dropped the connection before answering (worth retrying)."""


class NobodyListens(PeerUnreachable):
    """Connection refused: no process listens at the peer's side-channel address (gone, or not started)."""


class PeerNotAllowed(HandshakeError):
    """The address is not in ``allowed_peers``: the engine does not dial it. Not ``Unauthorized``: no
    credential was refused, and a request failing on it is ``handshake_failed`` (its message names
    ``allowed_peers``), not a "set the same KVWIRE_SECRET" configuration error."""


class CircuitOpen(HandshakeError):
    """Refused at once: the last handshakes with this address failed on the network, and its backoff
    window has not passed (``kvwire.core.breaker``)."""


# --- requests and transfers --------------------------------------------------------------------------


class RequestError(KvwireError):
    """A request's KV transfer ended badly."""


class TransferAborted(RequestError):
    """The request was aborted (by the client, the router or a fence)."""


class KVLoadFailed(RequestError):
    """D could not obtain the request's KV: the reason says why (peer dead, write failed, fence expired)."""

    def __init__(self, transfer_id: str, reason: str, detail: str | None = None) -> None:
        more = f" ({detail})" if detail else ""
        super().__init__(f"KV load for {transfer_id} failed: {reason}{more}")
        self.transfer_id = transfer_id
        self.reason = reason
        self.detail = detail


class UnknownTransfer(RequestError):
    """A message named a transfer id this side does not hold."""


class InvalidRequest(RequestError):
    """An engine refused a request as malformed or impossible to serve (HTTP 400).

    ``param`` names the request field at fault, when there is one (OpenAI's error ``param``).
    """

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class TransferIdReused(InvalidRequest):
    """D was asked to load KV under a ``transfer_id`` it has served (or is serving) in this life, or P to
    hold KV under one it still holds (its event not polled): a request's identity is single-use, so a
    ``done`` meant for the other request cannot complete this one (HTTP 400)."""

    def __init__(self, transfer_id: str, engine: str = "decode") -> None:
        super().__init__(
            f"transfer_id {transfer_id!r} was already used on this {engine} engine: each request needs a "
            "new one",
            "kv_transfer_params",
        )
        self.transfer_id = transfer_id


class ModelNotFound(InvalidRequest):
    """The request names a model this engine does not serve (HTTP 404, OpenAI's ``model_not_found``)."""


class RouterOnly(InvalidRequest):
    """A request part that only the router may send (kv_transfer_params, with a router token set)."""


class EngineOverloaded(RequestError):
    """An engine refused a request because its queue is full or it is shutting down (HTTP 503)."""

"""D tells P it will not load a request P prefilled for it (``Decline``): the engine dropped the request
before allocating its blocks (a client gone while it queued, an overloaded D), or its local prefix hit
covers the prompt. Without a word, P holds the prompt's blocks until its lease ends (30 s by default), and
in overload, exactly when D drops requests, P's cache fills with KV nobody will read. vLLM's own NIXL
connector tells P the same way (an empty read).

Each local rank handshakes the P ranks it pairs with (``source_ranks``) and sends one word to each:
``cancel`` in push mode (P ends a request that holds no live registration once a D gave it up) and
``failed``/``aborted`` in pull mode (P ends a request no claim holds). Nothing is kept but the handshakes
in flight, bounded: past the bound, or when a handshake fails or finds another P life, P's lease ends
the request as before. Plain data and functions; the consumer core runs them.
"""

from __future__ import annotations

from collections.abc import Callable, Container

from kvwire.core.consumer_records import UsedIds, wrong_peer
from kvwire.core.io import Decline, HandshakeDone, RemoteEngine, StartHandshake
from kvwire.core.types import EngineInfo
from kvwire.errors import LayoutError
from kvwire.kv.mapping import RankLayout, source_ranks
from kvwire.protocol.messages import Cancel, Failed, FailReason, Notification, TransferMode
from kvwire.protocol.ranks import RankKey
from kvwire.protocol.types import PeerMode

MAX_DECLINES = 1024  # handshakes in flight for declined requests (a rank pair each)


class Declines:
    """The handshakes in flight to tell P ranks of declined requests, by token."""

    def __init__(self, engine: EngineInfo, layouts: dict[RankKey, RankLayout], mode: PeerMode) -> None:
        self._engine = engine
        self._layouts = layouts
        self._mode = mode
        self._flights: dict[int, tuple[str, RankKey, RemoteEngine]] = {}
        self.dropped = 0  # rank pairs not told: the table was full (P's lease ends those)
        # The last declined transfers P was told of (push: P acks each cancel), oldest first.
        self._told = UsedIds(MAX_DECLINES)

    def __contains__(self, token: int) -> bool:
        return token in self._flights

    def start(self, inp: Decline, new_token: Callable[[], int], live: Container[str]) -> list[StartHandshake]:
        """A handshake with every P rank the local ranks pair with; none for a request ``live`` holds (the
        engine allocated it after all, and aborts it instead) or a geometry kvwire cannot map."""
        remote, spec = inp.remote, self._engine.spec
        if inp.transfer_id in live:
            return []
        try:
            pairs = [
                (key, src)
                for key, layout in self._layouts.items()
                for src in source_ranks(spec, remote.tp_size, remote.pp_size, layout)
            ]
        except LayoutError:
            return []
        out = []
        for key, src in pairs:
            if len(self._flights) >= MAX_DECLINES:
                self.dropped += 1
                continue
            token = new_token()
            self._flights[token] = (inp.transfer_id, key, remote)
            host, port = remote.host_of(src), remote.port_of(src)
            out.append(StartHandshake(token, key, host, port, src, self._mode, remote.engine_id))
        return out

    def told(self, transfer_id: str) -> bool:
        """Whether a P rank was told of declined ``transfer_id`` lately (its ``cancel_ack`` is expected)."""
        return transfer_id in self._told

    def answered(self, inp: HandshakeDone) -> tuple[RankKey, str, Notification] | None:
        """What to send (from which local rank, to which agent), or None: the handshake failed, or found
        another P life than the one that prefilled (it holds nothing of this request)."""
        transfer_id, key, remote = self._flights.pop(inp.token)
        peer = inp.peer
        if peer is None or wrong_peer(peer, remote) is not None:
            return None
        e = self._engine
        msg: Notification
        self._told.add(transfer_id)
        if e.transfer_mode is TransferMode.PUSH:
            msg = Cancel(transfer_id=transfer_id, engine_id=e.engine_id, incarnation=e.incarnation)
        else:
            msg = Failed(
                transfer_id=transfer_id,
                engine_id=e.engine_id,
                incarnation=e.incarnation,
                tp_rank=key[1],
                pp_rank=key[0],
                reason=FailReason.ABORTED,
            )
        return key, peer.agent_name, msg

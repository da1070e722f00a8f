"""Bugs planted in the real cores, to show the simulator finds each (``kvwire sim --plant NAME``).

Each is a subclass that changes one rule of a real core, the kind of change a well-meant refactor makes.
``PLANTS`` maps a name to the ``Plant`` and to the fault mix that exposes it; ``tests/unit/test_sim.py``
runs each and asserts the invariant it breaks is reported (and that the real cores report nothing).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import msgspec

from kvwire.core.consumer import PushConsumerCore
from kvwire.core.consumer_pull import PullConsumerCore
from kvwire.core.consumer_records import PeerLife
from kvwire.core.consumer_records import Request as ConsumerRequest
from kvwire.core.io import (
    Action,
    Allocated,
    ClaimAnswered,
    HandshakeDone,
    Input,
    LayersReady,
    SendClaim,
    StartHandshake,
    XferEnded,
)
from kvwire.core.producer_layers import LayerwisePushProducerCore
from kvwire.core.producer_push import PushProducerCore
from kvwire.core.producer_records import Reg, Request
from kvwire.protocol.messages import Cancel, Failed, Notification, TransferMode
from kvwire.protocol.ranks import RankKey
from kvwire.protocol.states import ProducerState, ProducerTrigger
from kvwire.testing.sim.net import Faults
from kvwire.testing.sim.run import Plant


class AckBeforeWritesEnd(PushProducerCore):
    """P answers a cancel with ``cancel_ack`` while its write is still in flight (the rule it breaks: a
    posted write cannot be recalled, so the ack waits in CANCEL_PENDING). D frees the blocks on the ack."""

    def _on_cancel(self, now: float, key: RankKey, sender: str, msg: Cancel | Failed) -> None:
        req = self._requests.get(msg.transfer_id)
        reg = None if req is None else req.regs.get((key, sender))
        if req is not None and reg is not None and reg.state is ProducerState.WRITING:
            reg.machine.handle(ProducerTrigger.CANCEL)
            self._cancel_ack(req, reg, wrote=False)
            return
        super()._on_cancel(now, key, sender, msg)


class AckAfterDone(PushProducerCore):
    """P answers a cancel that came during its write with ``cancel_ack`` once the write completes, although
    the write delivered its ``done`` (what kvwire did before issue 20: two ending messages)."""

    def _on_xfer_ended(self, now: float, inp: XferEnded) -> None:
        reg = self._inflight.get(inp.token)
        pending = reg is not None and reg.state is ProducerState.CANCEL_PENDING
        super()._on_xfer_ended(now, inp)
        if reg is not None and pending and inp.ok:
            self._cancel_ack(self._requests[reg.msg.transfer_id], reg, wrote=True)


class AcceptStaleIncarnation(PushProducerCore):
    """P serves a ``push_reg`` of an earlier D life with whatever life now answers at D's address (the
    rule it breaks: a registration belongs to one incarnation)."""

    def handle(self, now: float, inp: Input) -> list[Action]:
        out = super().handle(now, inp)
        return [
            msgspec.structs.replace(a, incarnation=None) if isinstance(a, StartHandshake) else a for a in out
        ]

    def _on_d_handshake(self, now: float, req: Request, reg: Reg, inp: HandshakeDone) -> None:
        if inp.peer is not None:
            reg.sender = inp.peer.agent_name
            reg.msg = msgspec.structs.replace(reg.msg, incarnation=inp.peer.incarnation)
        super()._on_d_handshake(now, req, reg, inp)


class ServeQueuedPushRegsAfterFreeze(PushProducerCore):
    """P serves the push_regs that queued up while it was frozen (what kvwire did before the simulator
    found it: D had declared the frozen P dead and reused the blocks those push_regs name)."""

    def _on_stale_notif(self, now: float, key: RankKey, sender: str, msg: Notification) -> None:
        self._stale_ticks = 0
        self._on_notif(now, key, sender, msg)


class ReuseAfterGraceOnly(PushConsumerCore):
    """D reuses a dead P life's blocks once the grace passed, unconfirmed (what kvwire did before: a P
    frozen past D's verdict landed part of a write as it recalled it after the thaw)."""

    def _release_at(self, life: PeerLife, dead_at: float) -> float:
        return dead_at + self.config.dead_peer_grace_s


class ReleaseAtPeerWord(PushConsumerCore):
    """D frees a rank's blocks as soon as P's ``failed`` (or ``cancel_ack``, wrote) ends it (what kvwire
    did before: the word may come ahead of what the released write still drains)."""

    def _settle(self, now: float, req: ConsumerRequest) -> None:
        req.hold_until = 0.0
        super()._settle(now, req)


class ReadAnyLife(PullConsumerCore):
    """D reads from whichever P life answers at the address, without claiming the blocks first (kvwire
    before P's answer named its life, and before claims: a P that crashed and restarted during a D
    freeze lent the new life's blocks to the old requests)."""

    def _on_input(self, now: float, inp: Input) -> None:
        if isinstance(inp, Allocated):
            inp = msgspec.structs.replace(inp, remote=msgspec.structs.replace(inp.remote, incarnation=None))
        super()._on_input(now, inp)

    def _do(self, action: Action) -> None:
        if isinstance(action, SendClaim):  # read at once, as if P granted it for ever
            self._claim_answered(self._now, ClaimAnswered(action.token, math.inf))
            return
        super()._do(action)


class StreamUnreadyLayers(LayerwisePushProducerCore):
    """P takes the first ``LayersReady`` of a request for all of its layers (the rule it breaks: a layer is
    written only once the step computed it), so D gets the bytes a block held before the prefill."""

    def _layers_ready(self, now: float, inp: LayersReady) -> None:
        everything = tuple(range(self.engine.spec.num_layers))
        super()._layers_ready(now, msgspec.structs.replace(inp, layers=everything))


class StreamAfterStepEnd(LayerwisePushProducerCore):
    """P keeps writing a request's layers after the engine's step ended (the rule it breaks: between the
    step's end and ``request_finished`` nothing holds the blocks; an aborted request's may be reused)."""

    def _step_ended(self, now: float, transfer_id: str) -> None:
        return


@dataclass(frozen=True)
class Planted:
    plant: Plant
    faults: Faults
    breaks: str  # a substring of the violation it must cause
    seed: int = 1  # a seed whose schedule exposes it
    mode: TransferMode = TransferMode.PUSH
    layerwise: bool = False  # run with layer-wise push (the plant is a ``LayerwisePushProducerCore``)


PLANTS: dict[str, Planted] = {
    "ack-before-writes-end": Planted(
        Plant(producer=AckBeforeWritesEnd),
        Faults(abort=0.3, slow_write=0.5, slow_write_max_s=0.05),
        "C1",
    ),
    "ack-after-done": Planted(
        Plant(producer=AckAfterDone),
        Faults(abort=0.3, slow_write=0.5, slow_write_max_s=0.05),
        "one ending message",
    ),
    "accept-stale-incarnation": Planted(
        Plant(producer=AcceptStaleIncarnation),
        Faults(delay=0.5, delay_max_s=0.05, crash=2.0),
        "C1",
    ),
    # Masked by D's quarantine (defence in depth): planted with the quarantine removed too, which alone
    # this seed's schedule does not expose (tests/unit/test_sim.py checks both halves).
    "serve-queued-push-regs-after-freeze": Planted(
        Plant(producer=ServeQueuedPushRegsAfterFreeze, consumer=ReuseAfterGraceOnly),
        Faults(pause=2.0),
        "C1",
        seed=4,
    ),
    "reuse-after-grace-only": Planted(
        Plant(consumer=ReuseAfterGraceOnly),
        Faults(pause=3.0, release_lands=1.0, slow_write=1.0, slow_write_max_s=0.5),
        "C1",
        seed=4,
    ),
    "release-at-peer-word": Planted(
        Plant(consumer=ReleaseAtPeerWord),
        Faults(stuck_write=0.2, release_lands=1.0, release_drain_max_s=0.5),
        "C1",
    ),
    "stream-unready-layers": Planted(
        Plant(producer=StreamUnreadyLayers), Faults(), "READY with bytes that are not P's", layerwise=True
    ),
    "stream-after-step-end": Planted(
        Plant(producer=StreamAfterStepEnd),
        Faults(abort=0.5, delay=0.5, delay_max_s=0.02),
        "S1",
        layerwise=True,
    ),
    "read-any-life": Planted(
        Plant(consumer=ReadAnyLife),
        Faults(crash=0.5, pause=0.5),
        "S1",  # the read copies blocks the new life never lent: before, caught as READY with wrong bytes
        seed=5,
        mode=TransferMode.PULL,
    ),
}

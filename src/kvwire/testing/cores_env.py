"""The two cores under test and their one peer, for ``test_cores_producer.py`` and ``test_cores_consumer.py``:
a P or D core driven by ``CoreHarness``, the constants both sides agree on, and builders of the messages
the peer would send."""

from __future__ import annotations

import dataclasses

from kvwire.core.config import ConnectorConfig
from kvwire.core.consumer import PushConsumerCore
from kvwire.core.consumer_pull import PullConsumerCore
from kvwire.core.events import ConsumerEvent, ConsumerEventKind, ProducerEvent, ProducerOutcome
from kvwire.core.io import (
    Action,
    Allocated,
    ClaimAnswered,
    Finished,
    PostWrite,
    RemoteEngine,
    Send,
    SendClaim,
    StartHandshake,
)
from kvwire.core.producer import PullProducerCore
from kvwire.core.producer_push import PushProducerCore
from kvwire.protocol.messages import (
    Cancel,
    CancelAck,
    Done,
    Failed,
    FailReason,
    Heartbeat,
    PushReg,
    TransferMode,
)
from kvwire.testing.core_harness import CoreHarness, TestEngine, one
from kvwire.transport.base import PeerMode

PUSH, PULL = TransferMode.PUSH, TransferMode.PULL
CFG = ConnectorConfig(
    kv_lease_duration_s=30.0,
    fence_ms=2_000,
    heartbeat_interval_s=1.0,
    liveness_timeout_s=5.0,
    dead_peer_grace_s=1.0,
    transfer_timeout_s=10.0,
    tombstone_s=60.0,
)
TID = "req-1"
BLOCKS = (3, 4)  # P's blocks for TID
D_BLOCKS = [7, 8]  # D's
TOKENS = 8  # two blocks of 4


# -- P (push) ---------------------------------------------------------------------------------------------


class P:
    """A push (or pull) producer core with one D peer, both TP1/PP1."""

    def __init__(self, cfg: ConnectorConfig = CFG, mode: TransferMode = PUSH) -> None:
        self.p = TestEngine.build("P", mode=mode, port=5000)
        self.d = TestEngine.build("D", mode=mode, port=6000)
        cfg = dataclasses.replace(cfg, mode=mode)
        kind = PushProducerCore if mode is PUSH else PullProducerCore
        self.core = kind(self.p.info, self.p.layouts, self.p.num_blocks, cfg)
        self.h = CoreHarness(self.core)

    def push_reg(self, tid: str = TID, fence_ms: int = 2_000, blocks: list[int] | None = None) -> PushReg:
        return PushReg(
            transfer_id=tid,
            engine_id=self.d.engine_id,
            incarnation=self.d.incarnation,
            tp_rank=0,
            tp_size=1,
            host=self.d.host,
            port=self.d.port,
            block_ids=D_BLOCKS if blocks is None else blocks,
            num_tokens=TOKENS,
            fence_ms=fence_ms,
        )

    def from_d(self, now: float, msg: PushReg | Cancel | Heartbeat | Done | Failed) -> list[Action]:
        return self.h.at(now, self.d.notif(msg))

    def cancel(self, tid: str = TID) -> Cancel:
        return Cancel(transfer_id=tid, engine_id=self.d.engine_id, incarnation=self.d.incarnation)

    def heartbeat(self, *tids: str) -> Heartbeat:
        return Heartbeat(
            transfer_id="",
            engine_id=self.d.engine_id,
            incarnation=self.d.incarnation,
            transfer_ids=list(tids),
        )

    def p_heartbeat(self, *tids: str) -> Heartbeat:
        return Heartbeat(transfer_id="", engine_id="P", incarnation="P-life1", transfer_ids=list(tids))

    def registered(self, now: float, tid: str = TID, fence_ms: int = 2_000) -> None:
        """D's push_reg arrives at ``now`` and P's full handshake with D succeeds at once."""
        hs = one(self.from_d(now, self.push_reg(tid, fence_ms)), StartHandshake)
        assert (hs.key, hs.host, hs.port, hs.remote, hs.mode) == (
            (0, 0),
            "127.0.0.1",
            6000,
            (0, 0),
            PeerMode.FULL,
        )
        assert (hs.engine_id, hs.incarnation) == ("D", "D-life1")
        assert self.h.done(now, hs.token, self.d.peer_rank(mode=PeerMode.FULL)) == []

    def writing(self, now: float, tid: str = TID) -> PostWrite:
        """Registered and handshaken at ``now``, prefill ends at ``now``: the write is posted."""
        self.registered(now, tid)
        return one(self.h.at(now, Finished(tid, BLOCKS, TOKENS)), PostWrite)

    def failed(self, reason: FailReason, tid: str = TID) -> Send:
        msg = Failed(
            transfer_id=tid, engine_id="P", incarnation="P-life1", tp_rank=0, pp_rank=0, reason=reason
        )
        return Send((0, 0), self.d.agent(), msg)

    def cancel_ack(self, wrote: bool, tid: str = TID) -> Send:
        msg = CancelAck(
            transfer_id=tid, engine_id="P", incarnation="P-life1", tp_rank=0, pp_rank=0, wrote=wrote
        )
        return Send((0, 0), self.d.agent(), msg)


def freed(how: ProducerOutcome, tid: str = TID) -> ProducerEvent:
    return ProducerEvent(tid, how)


# -- D (push) ---------------------------------------------------------------------------------------------


CLAIM_LEASE_S = 30.0  # what P grants a pull claim in these tests


class D:
    """A consumer core with one P peer, both TP1/PP1."""

    def __init__(self, cfg: ConnectorConfig = CFG, mode: TransferMode = PUSH) -> None:
        self.p = TestEngine.build("P", mode=mode, port=5000)
        self.d = TestEngine.build("D", mode=mode, port=6000)
        cfg = dataclasses.replace(cfg, mode=mode)
        kind = PushConsumerCore if mode is PUSH else PullConsumerCore
        self.core = kind(self.d.info, self.d.layouts, self.d.num_blocks, cfg, port=6000)
        self.h = CoreHarness(self.core)
        self.mode = mode

    @property
    def push_core(self) -> PushConsumerCore:
        assert isinstance(self.core, PushConsumerCore)
        return self.core

    def allocated(self, tid: str = TID) -> Allocated:
        remote = RemoteEngine("P", "127.0.0.1", 5000, block_ids=BLOCKS if self.mode is PULL else ())
        return Allocated(tid, tuple(D_BLOCKS), TOKENS, 0, remote)

    def start(self, now: float, tid: str = TID, lease_s: float | None = CLAIM_LEASE_S) -> list[Action]:
        """Allocated at ``now``; the handshake with P succeeds at once: what follows it (pull: and P
        answers the claim at once, granted for ``lease_s``; None: what follows the handshake alone)."""
        hs = one(self.h.at(now, self.allocated(tid)), StartHandshake)
        mode = PeerMode.NOTIF_ONLY if self.mode is PUSH else PeerMode.FULL
        assert (hs.key, hs.port, hs.remote, hs.mode, hs.engine_id) == ((0, 0), 5000, (0, 0), mode, "P")
        out = self.h.done(now, hs.token, self.p.peer_rank(mode=mode))
        if self.mode is PUSH or lease_s is None:
            return out
        claim = one(out, SendClaim)
        assert (claim.claim.transfer_id, claim.claim.block_ids, claim.remote) == (tid, list(BLOCKS), (0, 0))
        return self.h.at(now, ClaimAnswered(claim.token, lease_s))

    def nonce(self, tid: str = TID) -> int:
        """The reg_nonce of the last push_reg D sent for ``tid`` (0: none sent)."""
        regs = [a.msg for a in self.h.log if isinstance(a, Send) and isinstance(a.msg, PushReg)]
        return next((r.reg_nonce for r in reversed(regs) if r.transfer_id == tid), 0)

    def from_p(self, now: float, msg: Done | Failed | CancelAck | Heartbeat | Cancel) -> list[Action]:
        return self.h.at(now, self.p.notif(msg))

    def _common(self, tid: str) -> dict[str, object]:
        return {"transfer_id": tid, "engine_id": "P", "incarnation": "P-life1", "tp_rank": 0, "pp_rank": 0}

    def done(self, tid: str = TID) -> Done:
        """P's done for D's push_reg of ``tid``: what a TP1/PP1 P states for the whole prompt."""
        nbytes = TOKENS * self.d.info.spec.bytes_per_token()
        return Done(num_blocks=2, reg_nonce=self.nonce(tid), nbytes=nbytes, **self._common(tid))  # type: ignore[arg-type]

    def failed(self, reason: FailReason, tid: str = TID) -> Failed:
        return Failed(reason=reason, **self._common(tid))  # type: ignore[arg-type]

    def cancel_ack(self, tid: str = TID, wrote: bool = False) -> CancelAck:
        return CancelAck(wrote=wrote, **self._common(tid))  # type: ignore[arg-type]

    def heartbeat(self) -> Heartbeat:
        return Heartbeat(transfer_id="", engine_id="P", incarnation="P-life1", transfer_ids=[TID])

    def cancel(self, tid: str = TID) -> Send:
        return Send((0, 0), self.p.agent(), Cancel(transfer_id=tid, engine_id="D", incarnation="D-life1"))

    def to_p(self, ok: bool, reason: FailReason | None = None) -> Send:
        """D's done (or failed) to P (pull: P may free its blocks)."""
        common = {"transfer_id": TID, "engine_id": "D", "incarnation": "D-life1", "tp_rank": 0, "pp_rank": 0}
        msg = Done(num_blocks=2, **common) if ok else Failed(reason=reason, **common)  # type: ignore[arg-type]
        return Send((0, 0), self.p.agent(), msg)


def ev(kind: ConsumerEventKind, reason: FailReason | None = None, tid: str = TID) -> ConsumerEvent:
    return ConsumerEvent(tid, kind, reason)


READY, FAILED, RELEASED = ConsumerEventKind.READY, ConsumerEventKind.FAILED, ConsumerEventKind.RELEASED

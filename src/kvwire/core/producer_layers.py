"""P's layer-wise push core: each layer's KV goes to D as soon as the engine computed it.

The engine says ``LayersReady(transfer_id, block_ids, num_tokens, layers)`` from inside the prefill's
last step (vLLM: ``save_kv_layer``), before its ``Finished``. A registration that is ready to write
(``push_reg`` in, D loaded, fence open) then gets one WRITE per batch of ready layers, without a
notification; the layers that become ready before D's ``push_reg`` arrives are written when it does.
The request's last layer is kept for the end: it is posted with ``done`` attached only once every
layer is ready and every earlier write of the registration has completed, so D's one ``done`` (same
``nbytes``, same digest, computed over the whole payload) still follows every byte, and D becomes READY
only when every layer landed.

Every rule of ``PushProducerCore`` holds per registration: a write is started only before the fence;
a ``cancel`` while layer writes are in flight is answered once they ended (``cancel_ack`` with
``wrote``), or by the ``done`` if the last write carried it; a failed post or write releases the
registration's other writes and sends ``failed``; an engine ``Abort`` stops new writes and answers
``failed``/``aborted`` once the posted ones ended; a freeze, a dead D or a write past
``transfer_timeout_s`` releases every write of the registration. The blocks become freeable only
after ``Finished``, as in whole-request push.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field

import numpy as np

from kvwire.core.io import Digest, Input, LayersReady, Outcome, PostWrite, Release, StepEnded, XferEnded
from kvwire.core.producer_push import PushProducerCore
from kvwire.core.producer_records import Phase, Reg, Request
from kvwire.errors import BlockRangeError, IllegalTransition, LayoutError
from kvwire.kv.descriptors import TransferPlan
from kvwire.kv.digest import DigestScope, common_layers, pair_heads
from kvwire.kv.groups import grouped
from kvwire.protocol.codec import encode_notif
from kvwire.protocol.messages import Cancel, Done, Failed, FailReason, PushReg
from kvwire.protocol.ranks import RankKey
from kvwire.protocol.states import ProducerState
from kvwire.protocol.states import ProducerTrigger as PT

_PS = ProducerState
_MAX_ENDED_EARLY = 4096  # requests whose step ended before their first LayersReady, remembered
_OPEN = (_PS.CONNECTING, _PS.WRITING, _PS.CANCEL_PENDING)


@dataclass(slots=True)
class _Stream:
    """What the engine said of a request still prefilling: its blocks and the layers computed."""

    block_ids: tuple[int, ...]
    num_tokens: int
    ready: set[int] = field(default_factory=set)
    complete: bool = False  # Finished came: every layer is computed, the connector holds the blocks
    step_over: bool = False  # the computing step ended: the blocks are safe to read again only once complete


@dataclass(slots=True)
class _Lane:
    """One registration's layer-wise writes: the whole plan, cut into layers as they become ready."""

    plan: TransferPlan
    done: Done
    layers: range  # the layers both ranks hold (the plan's rows, layer-major)
    rows: int  # descriptors per layer
    started_at: float
    posted: set[int] = field(default_factory=set)
    tokens: set[int] = field(default_factory=set)  # writes in flight
    final: int = 0  # the write that carries done (0: not posted)

    def take(self, layers: list[int]) -> tuple[np.ndarray, np.ndarray, int]:
        idx = np.concatenate(
            [np.arange(i * self.rows, (i + 1) * self.rows) for i in (ly - self.layers.start for ly in layers)]
        )
        src, dst = self.plan.src_array[idx], self.plan.dst_array[idx]
        return src, dst, int(src[:, 1].sum())


class LayerwisePushProducerCore(PushProducerCore):
    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        if grouped(self.engine.spec):
            # Lanes cut the plan into equal layer-major rows; a hybrid model's plan is per group (a
            # sliding window's shorter): a lane would post layers not computed yet. Whole-request push.
            raise LayoutError("layer-wise push of a hybrid model (several KV cache groups) is not supported")
        self._streams: dict[str, _Stream] = {}
        # Steps that ended before any layer of theirs was reported (a late GPU fence): a layer reported
        # after its step ended is not safe to read (the engine may reuse the blocks). Bounded, oldest out.
        self._ended_early: dict[str, None] = {}
        self._lanes: dict[Reg, _Lane] = {}
        self._lane_posts: dict[
            int, tuple[Request, Reg, list[int], bool]
        ] = {}  # token -> post awaiting Outcome

    # -- inputs ----------------------------------------------------------------------------------------------
    def _on_transfer_input(self, now: float, inp: Input) -> None:
        if isinstance(inp, LayersReady):
            self._layers_ready(now, inp)
        elif isinstance(inp, StepEnded):
            self._step_ended(now, inp.transfer_id)
        elif isinstance(inp, Outcome) and inp.token in self._lane_posts:
            self._lane_outcome(now, inp)
        elif (
            isinstance(inp, XferEnded)
            and inp.token in self._inflight
            and self._inflight[inp.token] in self._lanes
        ):
            self._lane_ended(now, inp)
        else:
            super()._on_transfer_input(now, inp)

    def _layers_ready(self, now: float, inp: LayersReady) -> None:
        req = self._requests.get(inp.transfer_id)
        if req is not None and req.phase is not Phase.PREFILLING:
            return  # Finished already (written whole), or aborted: nothing more to stream
        ids = tuple(int(b) for b in inp.block_ids)
        if any(not 0 <= b < self.num_blocks for b in ids) or len(set(ids)) != len(ids) or inp.num_tokens <= 0:
            raise BlockRangeError(f"{inp.transfer_id}: bad or repeated local block ids {ids[:8]}")
        stream = self._streams.get(inp.transfer_id)
        if stream is None:
            req = self._request(inp.transfer_id)
            stream = self._streams[inp.transfer_id] = _Stream(ids, inp.num_tokens)
            if inp.transfer_id in self._ended_early:  # its step is over: written whole at Finished
                del self._ended_early[inp.transfer_id]
                stream.step_over = True
            req.block_ids, req.num_tokens = list(ids), inp.num_tokens
        elif (stream.block_ids, stream.num_tokens) != (ids, inp.num_tokens):
            raise IllegalTransition(self.role, "STREAMING", "LAYERS_READY with other blocks")
        assert req is not None
        stream.ready.update(inp.layers)
        self._stream_regs(now, req)

    def _step_ended(self, now: float, transfer_id: str) -> None:
        stream = self._streams.get(transfer_id)
        req = self._requests.get(transfer_id)
        if stream is None:
            self._ended_early[transfer_id] = None
            if len(self._ended_early) > _MAX_ENDED_EARLY:
                del self._ended_early[next(iter(self._ended_early))]
            return
        stream.step_over = True
        if req is None:
            return
        for reg in [r for r in req.regs.values() if r in self._lanes and self._lanes[r].tokens]:
            self._recall(req, reg, FailReason.TRANSFER_TIMEOUT)  # the engine's wait for them timed out
        self._settle(now, req)

    def streaming(self, transfer_ids: Collection[str]) -> bool:
        """Whether a layer-wise write of these requests is in flight (or being posted)."""
        return any(
            (lane.tokens or reg.posting) and reg.msg.transfer_id in transfer_ids
            for reg, lane in self._lanes.items()
        )

    def _stream_regs(self, now: float, req: Request) -> None:
        for reg in list(req.regs.values()):
            if reg.machine.accepts(PT.PREFILL_DONE):
                reg.machine.handle(PT.PREFILL_DONE)
            if reg in self._lanes:
                self._pump(now, req, reg)
            else:
                self._advance(now, req, reg)
        self._settle(now, req)

    def _on_push_reg(
        self, now: float, key: RankKey, sender: str, msg: PushReg, *, stale: bool = False
    ) -> None:
        super()._on_push_reg(now, key, sender, msg, stale=stale)
        req = self._requests.get(msg.transfer_id)
        reg = None if req is None else req.regs.get((key, sender))
        # A push_reg for a request that is streaming: its layers are written once D is loaded.
        if reg is not None and msg.transfer_id in self._streams and reg.machine.accepts(PT.PREFILL_DONE):
            reg.machine.handle(PT.PREFILL_DONE)

    def _on_cancel(self, now: float, key: RankKey, sender: str, msg: Cancel | Failed) -> None:
        super()._on_cancel(now, key, sender, msg)
        req = self._requests.get(msg.transfer_id)
        reg = None if req is None else req.regs.get((key, sender))
        if req is not None and reg is not None and reg in self._lanes:
            self._pump(now, req, reg)  # between two layers nothing is in flight: acked now
            self._settle(now, req)

    def _prefill_done(self, now: float, req: Request) -> None:
        stream = self._streams.get(req.transfer_id)
        if stream is not None:
            stream.complete = True  # Finished: every layer is computed
            need = len(stream.block_ids)
            if (tuple(req.block_ids[:need]), req.num_tokens) != (stream.block_ids, stream.num_tokens):
                # The engine finished the request with other blocks than it streamed: written bytes may
                # be wrong, so no registration of it ends with done.
                self._log_warning("%s finished with other blocks than it streamed", req.transfer_id)
                for reg in [r for r in req.regs.values() if r in self._lanes]:
                    self._recall(req, reg, FailReason.WRITE_FAILED)
        super()._prefill_done(now, req)
        for reg in [r for r in req.regs.values() if r in self._lanes]:
            self._pump(now, req, reg)

    def _abort_regs(self, now: float, req: Request) -> None:
        super()._abort_regs(now, req)
        for reg in [r for r in req.regs.values() if r in self._lanes]:
            self._pump(now, req, reg)

    # -- writing ---------------------------------------------------------------------------------------------
    def _write(self, now: float, req: Request, reg: Reg) -> None:
        if req.transfer_id not in self._streams:
            super()._write(now, req, reg)
            return
        planned = self._plan_write(req, reg)
        if planned is None:
            return
        plan, done = planned
        peer = reg.peer
        assert peer is not None and peer.layout is not None
        layers = common_layers(self.layouts[reg.key].layers, peer.layout.layers)
        if plan.empty or not layers:
            self._begin_write(now, req, reg, plan, done)  # nothing moves: done alone, as whole-request
            return
        self._lanes[reg] = _Lane(plan, done, layers, plan.num_descs // len(layers), now)
        self._pump(now, req, reg)

    def _stop(self, now: float, req: Request, reg: Reg) -> FailReason | None:
        """Why no further layer of this registration may be written (None: it may)."""
        if reg.state is _PS.CANCEL_PENDING:
            return FailReason.ABORTED  # answered cancel_ack by _write_failed
        if req.aborted:
            return FailReason.ABORTED
        if now > reg.fence_at:
            return FailReason.FENCE_EXPIRED
        return None

    def _pump(self, now: float, req: Request, reg: Reg) -> None:
        """Post what is ready: the ready layers but the last, or the rest with done once every layer is
        ready and nothing else of this registration is in flight. End the registration when it must stop
        and nothing is in flight."""
        lane = self._lanes.get(reg)
        if lane is None or reg.posting or lane.final or reg.state not in _OPEN:
            return
        stop = self._stop(now, req, reg)
        if stop is not None:
            if not lane.tokens:
                self._write_failed(req, reg, stop)
            return
        stream = self._streams[req.transfer_id]
        if stream.step_over and not stream.complete:
            return  # between the engine's step and its Finished nothing protects the blocks
        todo = [ly for ly in lane.layers if ly not in lane.posted]
        ready = [ly for ly in todo if stream.complete or ly in stream.ready]
        if len(ready) == len(todo):
            if not lane.tokens:
                self._final(now, req, reg, lane, todo)
            return
        early = [ly for ly in ready if ly != lane.layers[-1]]
        if early:
            self._post_layers(now, req, reg, early, None)

    def _final(self, now: float, req: Request, reg: Reg, lane: _Lane, todo: list[int]) -> None:
        if not reg.msg.want_digest:
            self._post_layers(now, req, reg, todo, lane.done)
            return
        # D checks the payload against a digest of the source: every layer is final now.
        reg.posting, reg.posted_at = True, now
        msg, spec = reg.msg, self.engine.spec
        token = self._new_token()
        self._digesting[token] = (req, reg, lane.plan, lane.done)
        slices = pair_heads(spec, self.engine.tp_size, msg.tp_size, reg.key[1], msg.tp_rank)
        heads = tuple((s.src_head, s.num_heads) for s in slices)
        blocks = tuple(req.block_ids)
        self._do(
            Digest(
                token, reg.key, DigestScope(lane.layers, heads, blocks, msg.num_cached_tokens, msg.num_tokens)
            )
        )

    def _post_write(self, req: Request, reg: Reg, plan: TransferPlan, done: Done) -> None:
        lane = self._lanes.get(reg)
        if lane is None:
            super()._post_write(req, reg, plan, done)
            return
        # The digest came back (the Digested handler posts): the rest of the layers, with done.
        reg.posting = False
        todo = [ly for ly in lane.layers if ly not in lane.posted]
        self._post_layers(reg.posted_at, req, reg, todo, done)

    def _post_layers(self, now: float, req: Request, reg: Reg, layers: list[int], done: Done | None) -> None:
        lane = self._lanes[reg]
        src, dst, nbytes = lane.take(layers)
        token = self._new_token()
        self._lane_posts[token] = (req, reg, layers, done is not None)
        reg.posting, reg.posted_at = True, now
        self._sizes[token] = nbytes
        self.stats.descriptors_posted += len(src)
        notif = None if done is None else encode_notif(done)
        self._do(PostWrite(token, reg.key, reg.sender, src, dst, notif, nbytes, req.transfer_id))

    def _lane_outcome(self, now: float, inp: Outcome) -> None:
        req, reg, layers, final = self._lane_posts.pop(inp.token)
        lane = self._lanes[reg]
        reg.posting = False
        if inp.ok:
            if reg.state is _PS.CONNECTING:
                reg.machine.handle(PT.WRITES_POSTED)
                self.stats.transfers_started += 1
            lane.posted.update(layers)
            lane.tokens.add(inp.token)
            self._inflight[inp.token] = reg
            reg.token = inp.token
            if final:
                lane.final = inp.token
        else:
            self._sizes.pop(inp.token, None)
            self._log_info("posting %s to %s failed: %s", req.transfer_id, reg.sender, inp.detail)
            self._recall(req, reg, FailReason.POST_FAILED)
        self._settle(now, req)

    def _lane_ended(self, now: float, inp: XferEnded) -> None:
        reg = self._inflight.pop(inp.token)
        lane = self._lanes[reg]
        self._do(Release(inp.token))
        nbytes = self._sizes.pop(inp.token, 0)
        lane.tokens.discard(inp.token)
        reg.token = next(iter(lane.tokens), 0)
        req = self._requests[reg.msg.transfer_id]
        if not inp.ok:
            if inp.detail:
                self._log_info("write %s to %s failed: %s", req.transfer_id, reg.sender, inp.detail)
            self._recall(req, reg, FailReason.WRITE_FAILED)
        else:
            reg.wrote = True
            self.stats.bytes_moved += nbytes
            if inp.token == lane.final:
                # The done went with the last write, after every other write of this registration ended.
                self.stats.transfers_done += 1
                self.stats.record_duration(now - lane.started_at)
                reg.machine.handle(PT.WRITES_COMPLETE)
            else:
                self._pump(now, req, reg)
        self._settle(now, req)

    def _recall(self, req: Request, reg: Reg, reason: FailReason) -> None:
        """Release every write of the registration in flight, then end it (``failed``, or ``cancel_ack``
        when D had cancelled)."""
        lane = self._lanes.get(reg)
        if lane is None:
            super()._recall(req, reg, reason)
            return
        for token in sorted(lane.tokens):
            self._do(Release(token))
            self._inflight.pop(token, None)
            self._sizes.pop(token, None)
        lane.tokens.clear()
        reg.token = 0
        self._write_failed(req, reg, reason)

    # -- ending and time -------------------------------------------------------------------------------------
    def _settle(self, now: float, req: Request) -> None:
        stream = self._streams.get(req.transfer_id)
        if stream is not None and req.phase is Phase.PREFILLING and not req.aborted:
            return  # the engine's Finished (same step) decides; another D rank may still register
        super()._settle(now, req)
        if req.phase is Phase.ENDED:
            self._forget_lanes(req)

    def _forget_lanes(self, req: Request) -> None:
        for reg in [r for r in req.regs.values() if r in self._lanes]:
            if not self._lanes[reg].tokens and not reg.posting and reg.machine.registration_ended:
                del self._lanes[reg]
        if not any(r in self._lanes for r in req.regs.values()):
            self._streams.pop(req.transfer_id, None)

    def _before(self, now: float, inp: Input) -> None:
        cfg = self.config
        frozen = now - self._last_input > cfg.liveness_timeout_s - cfg.heartbeat_interval_s
        super()._before(now, inp)
        if not frozen:
            return
        # D may have declared this P dead during the freeze and reused the blocks: no further layer goes.
        for reg, lane in list(self._lanes.items()):
            req = self._requests.get(reg.msg.transfer_id)
            if req is not None and not lane.final and reg.state in _OPEN:
                self._recall(req, reg, FailReason.TRANSFER_TIMEOUT)
                self._settle(now, req)

    def _timers(self, now: float) -> None:
        super()._timers(now)
        timeout = self.config.transfer_timeout_s
        for reg, lane in list(self._lanes.items()):
            req = self._requests.get(reg.msg.transfer_id)
            if req is None or lane.final or lane.tokens or reg.state not in _OPEN:
                continue
            if now - lane.started_at > timeout:  # layers that never come
                self._write_failed(req, reg, FailReason.TRANSFER_TIMEOUT)
            else:
                self._pump(now, req, reg)  # the fence
            self._settle(now, req)
        for tid in [t for t in self._streams if t not in self._requests]:
            del self._streams[tid]

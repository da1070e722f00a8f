"""The scheduler side of the vLLM connector, without vLLM: which requests load or send KV, and the
operations each step hands the workers.

vLLM calls (through ``KvwireConnector``) ``matched_tokens`` when it looks at a waiting request,
``allocated`` once blocks exist, ``finished`` exactly once when a request ends (before its blocks are
freed), ``take_ops`` once per step, and ``transfers_ended`` with what the workers reported.

Block ownership follows vLLM's contract, with kvwire's fence on top:
* P (``SEND``): ``finished`` answers "delay the free"; the blocks go back to vLLM only when every worker
  reports the request in ``finished_sending``, which a worker does only on kvwire's ``ProducerEvent``
  (written, failed, lease expired: P's writes are then done or released).
* D (``LOAD``): the request waits in vLLM's WAITING_FOR_REMOTE_KVS until every worker reports it in
  ``finished_recving``: on READY, or, on a failure, only once kvwire RELEASED the blocks (then also in
  ``failed_recving``, and vLLM applies its ``kv_load_failure_policy``). An abort while waiting makes vLLM
  itself keep the blocks until ``finished_recving``; the worker aborts in kvwire and reports it only on
  RELEASED, so no late write from P can land in a block vLLM reuses.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from kvwire.core.consumer_records import UsedIds
from kvwire.errors import ConfigError, InvalidRequest
from kvwire.integrations.api import remote_engine
from kvwire.integrations.vllm.params import (
    KvRole,
    Op,
    OpKind,
    RankChannel,
    Settings,
    load_id,
    parse_params,
    send_id,
)
from kvwire.integrations.vllm.stats import REJECTED, payload
from kvwire.kv_params import MAX_REMOTE_BLOCK_IDS, KvTransferParams
from kvwire.protocol.messages import TransferMode

log = logging.getLogger("kvwire.vllm")

# Bounds: vLLM holds at most its running + waiting requests; a leak here would show as a bound hit.
_MAX_TRACKED = 1 << 16


@dataclass(frozen=True, slots=True)
class LocalEngine:
    """What D must be told to reach this engine's side channels (returned in P's kv_transfer_params)."""

    engine_id: str
    host: str
    port: int
    tp_size: int
    pp_size: int
    incarnation: str | None = None  # this start's (P's answer names it: D refuses another life's blocks)
    # Each rank's host (index pp * tp_size + tp) when they are not all ``host`` (a multi-node engine):
    # learnt from the workers at start (``SchedulerSide.set_channels``), named in P's answer.
    hosts: tuple[str, ...] = ()

    def rank_host(self, pp_rank: int, tp_rank: int) -> str:
        return self.hosts[pp_rank * self.tp_size + tp_rank] if self.hosts else self.host


@dataclass(slots=True)
class _Pending:
    params: KvTransferParams
    num_cached_tokens: int


class SchedulerSide:
    def __init__(self, role: KvRole, settings: Settings, local: LocalEngine, block_size: int) -> None:
        self.role = role
        self.settings = settings
        self.local = local
        self.block_size = block_size
        self._pending: dict[str, _Pending] = {}  # D: matched, blocks not yet allocated
        self._loading: set[str] = set()  # D: LOAD sent to the workers, not yet reported finished
        self._sending: dict[str, str] = {}  # P: SEND sent, not yet reported finished: req id -> transfer id
        self._held_tids: dict[str, str] = {}  # ...and the other way: a transfer id is held by one request
        # D: requests whose LOAD (or DECLINE) went out, until they end. vLLM asks again after a preemption
        # (or a failed load under kv_load_failure_policy=recompute): P has let go by then, so D recomputes
        # locally. A decode request that ends without either tells P (DECLINE), as vLLM's NIXL connector does.
        self._loaded: set[str] = set()
        self._ops: list[Op] = []
        self.rejected = 0  # requests whose kv_transfer_params were malformed (served locally instead)
        self._rejected_told = 0  # ...of which step_stats has reported
        # D: requests refused (counted and logged once: vLLM asks matched_tokens at every step a request
        # waits, and each asked counted and logged it again); forgotten when they finish.
        self._refused: set[str] = set()
        # P: transfer ids sent in this life. One sent again was acknowledged with params and SENT while
        # kvwire's core only replayed the first one's end: D then refused it as reused (a review found it).
        self._sent_ids = UsedIds(_MAX_TRACKED)

    def set_channels(self, channels: Mapping[tuple[int, int], RankChannel]) -> None:
        """The workers' side channels, keyed (pp_rank, tp_rank), as vLLM gathers them at start: the
        hosts P's answers name. A rank that reported none listens at ``side_channel_host`` (its node set
        no address of its own). ``ConfigError`` when a rank listens on another port than the one D will
        dial (the nodes were started with different side_channel_port)."""
        local, hosts = self.local, []
        for pp in range(local.pp_size):
            for tp in range(local.tp_size):
                ch = channels.get((pp, tp))
                if ch is None:
                    hosts.append(self.settings.side_channel_host)
                    continue
                port = self.settings.rank_port(pp, tp, local.tp_size)
                if ch.port != port:
                    raise ConfigError(
                        f"kvwire: rank pp{pp}/tp{tp} listens on port {ch.port}, not {port} "
                        f"(side_channel_port {self.settings.side_channel_port} + its rank): start every node "
                        "with the same kv_connector_extra_config"
                    )
                hosts.append(ch.host)
        spread = tuple(hosts) if any(h != local.host for h in hosts) else ()
        where = ", ".join(f"{h}:{local.port + r}" for r, h in enumerate(hosts))  # ports checked above
        log.info("kvwire: %s's rank side channels: %s", local.engine_id, where)
        self.local = dataclasses.replace(local, hosts=spread)

    # -- D ---------------------------------------------------------------------------------------------
    def matched_tokens(
        self, req_id: str, raw: dict[str, Any] | None, num_prompt_tokens: int, num_computed_tokens: int
    ) -> tuple[int, bool]:
        """Tokens the remote P provides beyond vLLM's local prefix hit, and whether they load async.

        Never raises: this runs inside vLLM's scheduler, where an exception kills the engine. A request
        with malformed ``kv_transfer_params`` (a client's input) is prefilled locally, logged and counted
        in ``rejected``."""
        if not self.role.consumes:
            return 0, False
        if req_id in self._refused:
            return 0, False
        try:
            params = parse_params(raw)
            if params is None or not params.do_remote_prefill or req_id in self._loaded:
                return 0, False
            remote_engine(params, rank_ports=True)  # malformed remote parameters: refused here
            load_id(params)
            params.check_prompt(num_prompt_tokens)
        except InvalidRequest as exc:
            self._refuse(req_id, f"kvwire: {req_id} is prefilled locally: {exc}")
            return 0, False
        if len(self._pending) >= _MAX_TRACKED:
            # Not remembered: room may free before vLLM asks again (the params are fine).
            self.rejected += 1
            log.warning("kvwire: %s is prefilled locally: more than %d requests wait for remote KV", req_id,
                        _MAX_TRACKED)  # fmt: skip
            return 0, False
        count = num_prompt_tokens - num_computed_tokens
        # A local prefix hit is used only in whole blocks (kvwire trims P's writes to D's uncached suffix).
        cached = num_computed_tokens - num_computed_tokens % self.block_size
        # Kept with nothing to load too: vLLM then allocates with no external tokens, and P is told.
        self._pending[req_id] = _Pending(params, cached)
        return (count, True) if count > 0 else (0, False)

    def allocated(self, req_id: str, block_ids: list[int], num_prompt_tokens: int, num_external: int) -> None:
        """Blocks exist for the request (prefix-hit blocks first, in token order)."""
        pending = self._pending.pop(req_id, None)
        if pending is None:
            return  # not a remote load, or the second call after the load finished
        params = pending.params
        self._loaded.add(req_id)
        if num_external == 0:  # the local prefix hit covers the prompt: nothing of P's is read
            self._decline(req_id, params)
            return
        self._loading.add(req_id)
        self._ops.append(
            Op(
                OpKind.LOAD,
                req_id,
                load_id(params),  # checked in matched_tokens
                list(block_ids),
                num_prompt_tokens,
                pending.num_cached_tokens,
                params,
            )
        )

    # -- both ------------------------------------------------------------------------------------------
    def finished(
        self,
        req_id: str,
        raw: dict[str, Any] | None,
        block_ids: list[int],
        num_prompt_tokens: int,
        aborted: bool,
    ) -> tuple[bool, dict[str, Any] | None]:
        """vLLM's ``request_finished``: (delay freeing the blocks, kv_transfer_params for the client)."""
        pending = self._pending.pop(req_id, None)
        handled = req_id in self._loaded
        self._loaded.discard(req_id)
        refused = req_id in self._refused
        self._refused.discard(req_id)
        if req_id in self._loading:
            # vLLM keeps the blocks of a request aborted while waiting for KV until finished_recving.
            self._ops.append(Op(OpKind.ABORT, req_id, req_id))
            return False, None
        if self.role.consumes and not handled:
            self._decline_unloaded(req_id, raw, pending)
        if not self.role.produces:
            return False, None
        try:
            params = parse_params(raw)
        except InvalidRequest as exc:  # never raise inside vLLM's scheduler (see matched_tokens)
            if not refused:  # kv_both: counted once, when it was matched
                self.rejected += 1
                log.warning("kvwire: %s is not sent to a D: %s", req_id, exc)
            return False, None
        if params is None or not params.do_remote_decode:
            return False, None
        tid = send_id(params, req_id)
        if self._held_tids.get(tid) == req_id:
            del self._held_tids[tid]  # reserved when it streamed (``reserve``): taken again below
        if aborted or not block_ids:
            # D may already have registered (both legs go at once): tell kvwire, so D hears at once
            # instead of waiting for P's fence.
            self._ops.append(Op(OpKind.DROP, req_id, tid))
            return False, None
        if tid in self._held_tids:
            # Another held request has this id (a client's retry): its D leg would be served from, or in
            # pull mode read, the other request's blocks. Refused here, before any params go out.
            self.rejected += 1
            log.warning(
                "kvwire: %s is not sent: transfer id %s is held by %s", req_id, tid, self._held_tids[tid]
            )
            return False, None
        if self.settings.mode is TransferMode.PULL and len(block_ids) > MAX_REMOTE_BLOCK_IDS:
            # D and routers refuse longer params: P would hold the blocks to its lease for nothing.
            self.rejected += 1
            log.warning("kvwire: %s is not sent: %d blocks, more than a D takes (%d)", req_id, len(block_ids),
                        MAX_REMOTE_BLOCK_IDS)  # fmt: skip
            return False, None
        if not self._sent_ids.add(tid):
            self.rejected += 1
            log.warning("kvwire: %s is not sent: transfer id %s was sent before (each needs a new one)",
                        req_id, tid)  # fmt: skip
            return False, None
        self._sending[req_id], self._held_tids[tid] = tid, req_id
        self._ops.append(Op(OpKind.SEND, req_id, tid, list(block_ids), num_prompt_tokens))
        return True, self._params_for_d(tid, block_ids, num_prompt_tokens)

    def _refuse(self, req_id: str, why: str) -> None:
        """A decode request refused: counted and logged once (``_refused``, bounded as the other tables)."""
        if len(self._refused) < _MAX_TRACKED:
            self._refused.add(req_id)
        self.rejected += 1
        log.warning("%s", why)

    def _decline_unloaded(self, req_id: str, raw: dict[str, Any] | None, pending: _Pending | None) -> None:
        """A decode request that ends without its LOAD (dropped while it queued, or never scheduled):
        P is told, or it holds the prompt's blocks to its lease. Never raises (vLLM's scheduler)."""
        try:
            params = pending.params if pending is not None else parse_params(raw)
        except InvalidRequest:
            return  # malformed: it named no P we could tell (counted when it was matched)
        if params is not None and params.do_remote_prefill:
            self._decline(req_id, params)

    def _decline(self, req_id: str, params: KvTransferParams) -> None:
        try:
            remote_engine(params, rank_ports=True)
        except InvalidRequest:
            return
        try:
            tid = load_id(params)
        except InvalidRequest:
            return  # no id a P could hold
        self._ops.append(Op(OpKind.DECLINE, req_id, tid, remote=params))

    def reserve(self, req_id: str, transfer_id: str) -> bool:
        """Hold ``transfer_id`` for ``req_id`` from the step that streams its layers (False: another
        request holds it, and must not be streamed into: its Finished would carry other blocks). The
        request's ``finished`` then takes the id over, or lets it go."""
        if transfer_id in self._sent_ids:  # sent before: its SEND will be refused (counted then)
            log.warning("kvwire: %s is not streamed: transfer id %s was sent before", req_id, transfer_id)
            return False
        if self._held_tids.setdefault(transfer_id, req_id) != req_id:  # counted when its SEND is refused
            log.warning("kvwire: %s is not streamed: transfer id %s is held by %s", req_id, transfer_id,
                        self._held_tids[transfer_id])  # fmt: skip
            return False
        return True

    def sends(self, raw: dict[str, Any] | None) -> bool:
        """Whether ``finished`` would send this request's KV to a D (P's role, ``do_remote_decode``)."""
        if not self.role.produces:
            return False
        try:
            params = parse_params(raw)
        except InvalidRequest:
            return False
        return params is not None and bool(params.do_remote_decode)

    def _params_for_d(self, transfer_id: str, block_ids: list[int], num_tokens: int) -> dict[str, Any]:
        pull = self.settings.mode is TransferMode.PULL
        params = KvTransferParams(
            # do_remote_decode written as false: vLLM's proxies forward P's params to D as they are.
            do_remote_prefill=True,
            do_remote_decode=False,
            transfer_id=transfer_id,
            remote_request_id=transfer_id,
            remote_engine_id=self.local.engine_id,
            remote_incarnation=self.local.incarnation,
            remote_host=self.local.host,
            remote_port=self.local.port,
            remote_hosts=self.local.hosts or None,
            remote_tp_size=self.local.tp_size,
            remote_pp_size=self.local.pp_size,
            remote_block_ids=tuple(block_ids) if pull else None,
            num_tokens=num_tokens,  # D refuses another prompt's length (matched_tokens)
        )
        # vLLM hands the client a dict (the OpenAI server serializes it): the struct's JSON form.
        return params.to_json()

    def take_ops(self) -> list[Op]:
        ops, self._ops = self._ops, []
        return ops

    def step_stats(self) -> dict[str, Any] | None:
        """Requests rejected since the last call, as ``stats``' payload (None when none were)."""
        new, self._rejected_told = self.rejected - self._rejected_told, self.rejected
        return payload({REJECTED: new}) if new > 0 else None

    def transfers_ended(self, sending: Iterable[str], recving: Iterable[str]) -> None:
        for req_id in sending:
            tid = self._sending.pop(req_id, None)
            if tid is not None and self._held_tids.get(tid) == req_id:
                del self._held_tids[tid]
        self._loading.difference_update(recving)

    def has_pending_sends(self) -> bool:
        """P holds blocks for D: vLLM must keep stepping so the workers report the end."""
        return bool(self._sending)

    @property
    def num_loading(self) -> int:
        return len(self._loading)

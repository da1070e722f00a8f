"""Continuous batching: who runs in the next engine step, and who holds which blocks.

Queues: ``waiting`` (FIFO, no blocks), ``waiting_for_kv`` (D: blocks lent to the connector, by transfer
id), ``running`` (one step each per engine step). New requests join between steps. A request gets every
block it can ever need when admitted (prompt plus ``max_tokens``), so a running request never runs out of
blocks and nothing is preempted. Blocks lent to a connector are tracked until it gives them back:
``held`` (P: finished requests whose KV is being sent) and ``fenced`` (D: failed or aborted loads waiting
for RELEASED). With a prefix cache (``engine.prefix_cache``), a request that prefills here starts with the
cached blocks of its prompt's longest cached prefix and gets fresh blocks for the rest; evictable cached
blocks count as free.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from kvwire.engine.config import EngineConfig
from kvwire.engine.model import prefill_chunk
from kvwire.engine.prefix_cache import PrefixCache
from kvwire.engine.request import Request, RequestState, TransferRole
from kvwire.errors import EngineOverloaded, InvalidRequest, UnknownTransfer
from kvwire.kv.allocator import BlockAllocator


@dataclass
class Admitted:
    prefills: list[Request] = field(default_factory=list)  # to prefill locally in this step
    remote: list[Request] = field(default_factory=list)  # D: to hand to the connector


class Scheduler:
    def __init__(self, cfg: EngineConfig, allocator: BlockAllocator) -> None:
        self.cfg = cfg
        self.allocator = allocator
        self.block_size = cfg.model.block_size
        self.waiting: deque[Request] = deque()
        self.waiting_for_kv: dict[str, Request] = {}
        self.running: list[Request] = []
        self.held: dict[str, list[int]] = {}
        self.fenced: dict[str, list[int]] = {}
        self.prefix_cache = (
            PrefixCache(allocator, self.block_size, prefill_chunk(cfg.model)) if cfg.prefix_cache else None
        )

    # -- sizes ---------------------------------------------------------------------------------------------
    def blocks_needed(self, req: Request) -> int:
        # KV is written for every prompt position and every sampled token but the last.
        return -(-(len(req.prompt) + req.max_tokens - 1) // self.block_size)

    def prompt_blocks(self, req: Request) -> int:
        return -(-len(req.prompt) // self.block_size)

    @property
    def num_active(self) -> int:
        return len(self.running) + len(self.waiting_for_kv)

    @property
    def fenced_blocks(self) -> int:
        return sum(len(b) for b in self.fenced.values())

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.waiting_for_kv or self.running)

    @property
    def num_free(self) -> int:
        """Blocks a request can get: free ones and evictable cached ones."""
        cache = self.prefix_cache
        return self.allocator.num_free + (cache.num_evictable if cache is not None else 0)

    def has_lent_blocks(self) -> bool:
        return bool(self.waiting_for_kv or self.held or self.fenced)

    # -- admission -----------------------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        need, have = self.blocks_needed(req), self.allocator.num_blocks
        if need > have:
            raise InvalidRequest(f"request needs {need} KV blocks; the cache has {have}")
        if len(self.waiting) >= self.cfg.max_waiting:
            raise EngineOverloaded(f"{len(self.waiting)} requests already waiting")
        tid = req.transfer_id
        if req.role is TransferRole.REMOTE_PREFILL and (
            tid in self.waiting_for_kv
            or tid in self.fenced
            or any(w.transfer_id == tid and w.role is TransferRole.REMOTE_PREFILL for w in self.waiting)
        ):  # a queued one too: admitting both would put the second in the first's place
            raise InvalidRequest(f"transfer id {req.transfer_id!r} is already in use here")
        req.state = RequestState.WAITING
        self.waiting.append(req)

    def admit(self) -> Admitted:
        """Move waiting requests in FIFO order while blocks, slots and the prefill budget allow."""
        out = Admitted()
        budget = self.cfg.max_prefill_tokens
        while self.waiting and self.num_active < self.cfg.max_num_seqs:
            req = self.waiting[0]
            local = req.role is not TransferRole.REMOTE_PREFILL
            hit = self._cached_prefix(req) if local else []
            need = self.blocks_needed(req) - len(hit)
            uncached = len(req.prompt) - len(hit) * self.block_size
            cache = self.prefix_cache
            free = cache.available(hit) if cache is not None else self.allocator.num_free
            if need > free or (local and out.prefills and uncached > budget):
                break
            self.waiting.popleft()
            req.block_ids = self._allocate(req, hit, need)
            if local:
                budget -= uncached
                req.state = RequestState.RUNNING
                self.running.append(req)
                out.prefills.append(req)
            else:
                assert req.transfer_id is not None
                self.allocator.quarantine(req.block_ids[: self.prompt_blocks(req)])
                req.state = RequestState.WAITING_FOR_KV
                self.waiting_for_kv[req.transfer_id] = req
                out.remote.append(req)
        return out

    def _cached_prefix(self, req: Request) -> list[int]:
        cache = self.prefix_cache
        if cache is None:
            return []
        if req.prefix_keys is None:
            req.prefix_keys = cache.keys(req.prompt)
        return cache.match(req.prefix_keys)

    def _allocate(self, req: Request, hit: list[int], need: int) -> list[int]:
        cache = self.prefix_cache
        if cache is None:
            return self.allocator.allocate(need)
        if req.role is TransferRole.REMOTE_PREFILL:
            # ``admit`` counted evictable cached blocks as free for every request: make them free here too.
            cache.make_room(need)
            return self.allocator.allocate(need)
        cache.acquire(hit, len(req.prompt))
        cache.make_room(need)
        req.cached_tokens = len(hit) * self.block_size
        return hit + self.allocator.allocate(need)

    def _free(self, blocks: list[int]) -> None:
        self.allocator.free(blocks)
        if self.prefix_cache is not None:
            self.prefix_cache.released(blocks)

    def prefilled(self, req: Request) -> None:
        """The request's prefill wrote its blocks: the prefix cache may keep them."""
        if self.prefix_cache is not None and req.prefix_keys:
            self.prefix_cache.insert(req.prefix_keys, req.block_ids)

    # -- transfer events -----------------------------------------------------------------------------------
    def kv_ready(self, transfer_id: str) -> Request | None:
        """D: the KV landed. The request runs its step for the last prompt position next; None for one
        aborted since (the engine fenced its blocks): READY is the connector's last word on it (no
        RELEASED follows), so its blocks are free now."""
        blocks = self.fenced.pop(transfer_id, None)
        if blocks is not None:
            self.allocator.release_quarantine(blocks, free=True)
            return None
        req = self._pop_waiting_for_kv(transfer_id)
        self.allocator.release_quarantine(req.block_ids[: self.prompt_blocks(req)])
        req.needs_prefill = False
        req.state = RequestState.RUNNING
        self.running.append(req)
        return req

    def kv_failed(self, transfer_id: str, *, recompute: bool) -> Request:
        """D: the KV will not come. Its blocks stay fenced until released."""
        req = self._pop_waiting_for_kv(transfer_id)
        if recompute:
            req.state = RequestState.RECOMPUTE_PENDING
            self.waiting_for_kv[transfer_id] = req
        else:
            self._fence(req)
        return req

    def kv_released(self, transfer_id: str, *, recompute: bool) -> Request | None:
        """D: no peer touches the blocks any more: free them, or start the pending recompute.

        Returns the request if it was still waiting (a request released with neither READY nor FAILED
        before stays WAITING_FOR_KV, without blocks, unless ``recompute``); None for a fenced one.
        """
        blocks = self.fenced.pop(transfer_id, None)
        if blocks is not None:
            self.allocator.release_quarantine(blocks, free=True)
            return None
        req = self._pop_waiting_for_kv(transfer_id)
        self.allocator.release_quarantine(req.block_ids[: self.prompt_blocks(req)])
        if req.state is RequestState.RECOMPUTE_PENDING or recompute:
            req.needs_prefill = True
            req.state = RequestState.RUNNING
            self.running.append(req)
        else:
            # Released with neither READY nor FAILED before: the load ended without KV.
            self.allocator.free(req.block_ids)
            req.block_ids = []
        return req

    def producer_done(self, transfer_id: str) -> None:
        blocks = self.held.pop(transfer_id, None)
        if blocks is None:
            raise UnknownTransfer(f"producer event for transfer {transfer_id!r}, which holds no blocks")
        self._free(blocks)

    # -- ends ----------------------------------------------------------------------------------------------
    def finish(self, req: Request, state: RequestState, *, hold: bool = False) -> None:
        """End a running or waiting request; ``hold`` keeps its blocks for the connector (P)."""
        if req.state is RequestState.RUNNING:
            self.running.remove(req)
        elif req.state is RequestState.WAITING:
            self.waiting.remove(req)
        req.state = state
        if hold:
            # The request keeps naming its blocks (P reports them to the router for pull mode).
            assert req.transfer_id is not None
            self.held[req.transfer_id] = req.block_ids
            return
        if req.block_ids:
            self._free(req.block_ids)
        req.block_ids = []

    def abort_waiting_for_kv(self, transfer_id: str, state: RequestState) -> Request:
        """D: end a request whose blocks the connector still holds; they stay fenced until released."""
        req = self._pop_waiting_for_kv(transfer_id)
        self._fence(req)
        req.state = state
        return req

    def _fence(self, req: Request) -> None:
        assert req.transfer_id is not None
        prompt = self.prompt_blocks(req)
        # Decode-only blocks were never lent: free them now; the prompt's stay quarantined.
        if req.block_ids[prompt:]:
            self.allocator.free(req.block_ids[prompt:])
        self.fenced[req.transfer_id] = req.block_ids[:prompt]
        req.block_ids = []

    def _pop_waiting_for_kv(self, transfer_id: str) -> Request:
        req = self.waiting_for_kv.pop(transfer_id, None)
        if req is None:
            raise UnknownTransfer(f"no request waits for the KV of transfer {transfer_id!r}")
        return req

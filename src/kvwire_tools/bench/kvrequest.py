"""The benchmarked request: a Llama-3-8B-shaped KV cache on P, the same geometry in a peer process (D),
and block assignments of one request from contiguous to fully scattered.

P's cache is a ``KVCache`` in this process, filled with ``pattern(nbytes, seed)`` so that D can verify
what it received; D's cache is the peer's flat buffer cut into the same regions (one per (layer, kind),
``num_blocks`` blocks each, the ``KVCache`` slab order), so block ``b`` of region ``r`` is flat block
``r * num_blocks + b`` on both sides. Both caches hold twice the request's blocks, so a scattered
assignment has room to leave gaps.
"""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass

import numpy as np

from kvwire.errors import TransferFailed
from kvwire.kv import KVCache, KVSpec, RankLayout, RegionInfo, plan_transfer
from kvwire.kv.descriptors import TransferPlan
from kvwire.testing.buffer_peer import BufferPeer, pattern
from kvwire.transport import Agent, XferHandle, XferOp, XferStatus

# 32 layers, K and V, 8 KV heads x 128, bf16, 16-token blocks: 32 KiB a block per region, 128 KiB of KV a
# token, 128 MiB for 1k tokens.
LLAMA3_8B = KVSpec(num_layers=32, kv_heads=8, head_dim=128, dtype="bfloat16", block_size=16)
FULL_TOKENS = 1024
# --quick: the same per-block geometry with fewer layers and tokens (8 MiB a request).
QUICK_SPEC = KVSpec(num_layers=4, kv_heads=8, head_dim=128, dtype="bfloat16", block_size=16)
QUICK_TOKENS = 256
SEED = 5
WAIT_S = 30.0


class Assignment(enum.Enum):
    CONTIGUOUS = "contiguous"
    HALF = "half-fragmented"  # the first half of the blocks in one run, the rest scattered
    SCATTERED = "scattered"  # no two consecutive blocks adjacent: one run per block


@dataclass(frozen=True, slots=True)
class Request:
    spec: KVSpec
    num_tokens: int

    @property
    def blocks(self) -> int:
        return -(-self.num_tokens // self.spec.block_size)

    @property
    def cache_blocks(self) -> int:
        return 2 * self.blocks

    @property
    def block_len(self) -> int:
        return self.spec.block_bytes(self.spec.kv_heads)

    @property
    def regions(self) -> int:
        return self.spec.num_layers * len(self.spec.kinds)

    @property
    def nbytes(self) -> int:
        return self.regions * self.blocks * self.block_len

    @property
    def cache_bytes(self) -> int:
        return self.regions * self.cache_blocks * self.block_len


def request_for(quick: bool) -> Request:
    return Request(QUICK_SPEC, QUICK_TOKENS) if quick else Request(LLAMA3_8B, FULL_TOKENS)


def assign(assignment: Assignment, n: int, rng: np.random.Generator) -> np.ndarray:
    """``n`` block ids out of ``2 * n`` in token order."""
    if assignment is Assignment.CONTIGUOUS:
        return np.arange(n, dtype=np.int64)
    if assignment is Assignment.SCATTERED:
        return rng.permutation(np.arange(0, 2 * n, 2, dtype=np.int64))
    head = n // 2
    tail = rng.permutation(np.arange(head + 1, 2 * n, 2, dtype=np.int64))[: n - head]
    return np.concatenate([np.arange(head, dtype=np.int64), tail])


def block_assignment(assignment: Assignment, n: int, seed: int = SEED) -> tuple[list[int], list[int]]:
    """(P's blocks, D's blocks) of one request: both sides fragmented alike, with different orders."""
    rng = np.random.default_rng(seed)
    return assign(assignment, n, rng).tolist(), assign(assignment, n, rng).tolist()


def source_cache(req: Request) -> KVCache:
    """P's cache, its bytes set to ``pattern(cache_bytes, SEED)`` (what the peer verifies against)."""
    cache = KVCache(req.spec, req.cache_blocks)
    cache.slab.reshape(-1).view(np.uint8)[:] = pattern(req.cache_bytes, SEED)
    return cache


def peer_layout(req: Request, base_addr: int) -> RankLayout:
    """D's rank layout over a peer's flat buffer at ``base_addr`` (the ``KVCache`` slab order)."""
    region_bytes = req.cache_blocks * req.block_len
    regions = tuple(
        RegionInfo(
            layer,
            kind,
            base_addr + (layer * len(req.spec.kinds) + k) * region_bytes,
            req.block_len,
            req.cache_blocks,
        )
        for layer in range(req.spec.num_layers)
        for k, kind in enumerate(req.spec.kinds)
    )
    return RankLayout(1, 0, 1, 0, 0, req.spec.num_layers, req.spec.block_size, req.cache_blocks, regions)


@dataclass(slots=True)
class Endpoints:
    """P's cache and layout, and D's layout, for one request geometry."""

    req: Request
    cache: KVCache
    src: RankLayout
    dst: RankLayout

    def plan(self, src_blocks: list[int], dst_blocks: list[int]) -> TransferPlan:
        return plan_transfer(
            self.req.spec, self.src, self.dst, src_blocks, dst_blocks, num_tokens=self.req.num_tokens
        )

    def flat_blocks(self, blocks: list[int]) -> list[int]:
        """Flat block indices (region-major) of ``blocks`` in every region, for ``BufferPeer.verify``."""
        ids = np.asarray(blocks, dtype=np.int64)
        regions = np.arange(self.req.regions, dtype=np.int64)[:, None] * self.req.cache_blocks
        out: list[int] = (regions + ids[None, :]).reshape(-1).tolist()
        return out

    def verify(self, peer: BufferPeer, src_blocks: list[int], dst_blocks: list[int]) -> None:
        check = peer.verify(
            self.req.block_len,
            SEED,
            self.req.cache_bytes,
            self.flat_blocks(src_blocks),
            self.flat_blocks(dst_blocks),
        )
        if check["bad_blocks"] or check["dirty_untouched_blocks"]:
            raise TransferFailed(f"D found wrong bytes: {check}")


def endpoints(req: Request, peer: BufferPeer) -> Endpoints:
    cache = source_cache(req)
    return Endpoints(req, cache, RankLayout.from_cache(cache), peer_layout(req, peer.addr))


def wait_all(agent: Agent, handles: list[XferHandle]) -> None:
    """Poll until every handle is DONE (bounded); release them. ``TransferFailed`` otherwise."""
    deadline = time.monotonic() + WAIT_S
    pending = list(handles)
    while pending and time.monotonic() < deadline:
        pending = [h for h in pending if agent.status(h) is XferStatus.IN_PROGRESS]
    for h in handles:
        state = agent.status(h)
        agent.release(h)
        if state is not XferStatus.DONE:
            raise TransferFailed(f"{h.op.value} to {h.peer} ended {state.value}: {h.failed_reason}")


def post_lanes(
    agent: Agent, plan: TransferPlan, peer: str, lanes: int, notif: bytes | None = None
) -> list[XferHandle]:
    """Post a plan's WRITEs as ``lanes`` transfers of about equal byte counts (``notif`` on the last)."""
    if lanes <= 1 or plan.num_descs < lanes:
        return [agent.post_array(XferOp.WRITE, plan.src_array, plan.dst_array, peer, notif)]
    cum = np.cumsum(plan.src_array[:, 1])
    cuts = np.searchsorted(cum, cum[-1] * np.arange(1, lanes) / lanes, side="left") + 1
    bounds = [0, *np.unique(np.clip(cuts, 1, plan.num_descs - 1)).tolist(), plan.num_descs]
    handles = []
    for i, (lo, hi) in enumerate(itertools.pairwise(bounds)):
        last = i == len(bounds) - 2
        handles.append(
            agent.post_array(
                XferOp.WRITE, plan.src_array[lo:hi], plan.dst_array[lo:hi], peer, notif if last else None
            )
        )
    return handles

"""TP and PP mapping between a producer's (P) ranks and a consumer's (D) ranks.

TP. Non-MLA caches are sharded by KV head: TP rank ``r`` of ``tp`` holds ``spec.heads_per_rank(tp)`` heads
starting at model head ``spec.first_head(tp, r)``; with fewer heads than ranks a head is replicated on
``tp // kv_heads`` consecutive ranks. Each head a D rank holds must be written exactly once, so for every
(D rank ``d``, model head ``h``) one source is chosen among the P ranks holding ``h`` (in rank order):
``candidates[d % len(candidates)]``. This gives:

* P tp == D tp: rank ``r`` writes its whole blocks to rank ``r``;
* D tp > P tp: a P rank writes a head slice into each of several D ranks;
* P tp > D tp: several P ranks each write their heads into a slice of one D rank's block;
* replicated heads (MLA, or kv_heads < tp): D rank ``d`` gets the block from P rank ``d % k`` of the
  ``k`` ranks that hold it (MLA: ``k = P tp``), spreading the load over P's replicas. With more P ranks
  than D ranks some replicas are read by no D rank: D rank ``r % D tp`` registers with such a P rank
  ``r`` all the same (nothing moves) and tells it the request's end (``tp_contacts``), so it frees the
  request's blocks with the others.

A ``HeadSlice`` gives the head offset inside each side's block and the number of heads; the byte offsets
depend on the layout (``kvwire.kv.descriptors``).

PP. P's stages split the model's layers with vLLM's rule (``layer_window``); a P stage writes only the
layers it holds that D's rank also holds, and a D rank expects ``done`` from every (pp, tp) P rank that
``source_ranks`` lists.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvwire.errors import LayoutError
from kvwire.kv.cache import RegionInfo
from kvwire.kv.regions import CacheMemory
from kvwire.kv.spec import KVSpec, RegionKind

# The largest TP size either side may have: two 8-GPU nodes' TP 16 (an MLA model's prefill, say) and
# beyond, bounded because a request names P's (its maps are built per request and cached).
MAX_TP = 64


def layer_window(num_layers: int, pp_size: int, pp_rank: int) -> range:
    """The layers PP stage ``pp_rank`` of ``pp_size`` holds.

    vLLM's split (``get_pp_indices``): ``num_layers // pp_size`` each; the remainder goes one layer each
    to the stages just before the last one (the last stage also runs the LM head, so it gets no extra).
    E.g. 10 layers on 4 stages: 2, 3, 3, 2.
    """
    if pp_size <= 0 or not 0 <= pp_rank < pp_size:
        raise LayoutError(f"pp_rank {pp_rank} out of range for pp_size {pp_size}")
    if num_layers < pp_size:
        raise LayoutError(f"{num_layers} layers cannot be split over {pp_size} PP stages")
    base, extra = divmod(num_layers, pp_size)
    sizes = [base] * pp_size
    for i in range(2, extra + 2):
        sizes[-i] += 1
    start = sum(sizes[:pp_rank])
    return range(start, start + sizes[pp_rank])


@dataclass(frozen=True, slots=True)
class HeadSlice:
    """Heads P rank ``src_rank`` writes into D rank ``dst_rank``, as offsets inside each side's block."""

    src_rank: int
    dst_rank: int
    src_head: int  # first head, counted within the source rank's heads
    dst_head: int  # first head, counted within the destination rank's heads
    num_heads: int


def _rank_heads(spec: KVSpec, tp: int, rank: int) -> range:
    first = spec.first_head(tp, rank)
    return range(first, first + spec.heads_per_rank(tp))


@functools.lru_cache(maxsize=256)
def tp_map(spec: KVSpec, src_tp: int, dst_tp: int) -> tuple[HeadSlice, ...]:
    """Every head slice between P's ``src_tp`` ranks and D's ``dst_tp`` ranks (see the module doc)."""
    for tp in (src_tp, dst_tp):
        if not 1 <= tp <= MAX_TP:
            raise LayoutError(f"TP size {tp} outside 1..{MAX_TP}")
    src_heads = [_rank_heads(spec, src_tp, r) for r in range(src_tp)]  # raises on bad divisibility
    slices: list[HeadSlice] = []
    for d in range(dst_tp):
        dst_heads = _rank_heads(spec, dst_tp, d)
        run: list[int] = []  # [src rank, src offset, dst offset, count] of the slice being grown
        for h in dst_heads:
            cands = [r for r in range(src_tp) if h in src_heads[r]]
            s = cands[d % len(cands)]
            so, do = h - src_heads[s].start, h - dst_heads.start
            if run and run[0] == s and run[1] + run[3] == so and run[2] + run[3] == do:
                run[3] += 1
                continue
            if run:
                slices.append(HeadSlice(run[0], d, run[1], run[2], run[3]))
            run = [s, so, do, 1]
        slices.append(HeadSlice(run[0], d, run[1], run[2], run[3]))
    return tuple(slices)


@functools.lru_cache(maxsize=256)
def tp_contacts(spec: KVSpec, src_tp: int, dst_tp: int) -> tuple[tuple[int, int], ...]:
    """The (P rank, D rank) pairs that exchange a registration and its end: every pair with a head slice,
    and, for each P rank that no D rank reads, D rank ``src_rank % dst_tp``. Such a rank exists with
    replicated heads when P has more ranks than D (MLA with P tp 2 and D tp 1: D reads rank 0 only); it
    moves nothing, but must hear the request's end like the others: inside vLLM each rank is a worker,
    and a request's blocks are freed only once every worker reported it, so one rank left waiting held
    every request's blocks on P to the lease."""
    pairs = {(s.src_rank, s.dst_rank) for s in tp_map(spec, src_tp, dst_tp)}
    read = {src for src, _ in pairs}
    pairs.update((src, src % dst_tp) for src in range(src_tp) if src not in read)
    return tuple(sorted(pairs))


def tp_peers(spec: KVSpec, src_tp: int, dst_tp: int, src_rank: int) -> list[HeadSlice]:
    """The D ranks P rank ``src_rank`` writes, each with its head slice (in D rank order)."""
    if not 0 <= src_rank < src_tp:
        raise LayoutError(f"src_rank {src_rank} out of range for tp {src_tp}")
    return [s for s in tp_map(spec, src_tp, dst_tp) if s.src_rank == src_rank]


def tp_sources(spec: KVSpec, src_tp: int, dst_tp: int, dst_rank: int) -> list[int]:
    """The P TP ranks D rank ``dst_rank`` registers with (ascending): those that write into it, and those
    no D rank reads that it tells the request's end (``tp_contacts``)."""
    if not 0 <= dst_rank < dst_tp:
        raise LayoutError(f"dst_rank {dst_rank} out of range for tp {dst_tp}")
    return [src for src, dst in tp_contacts(spec, src_tp, dst_tp) if dst == dst_rank]


def pair_slices(spec: KVSpec, src_tp: int, dst_tp: int, src_rank: int, dst_rank: int) -> list[HeadSlice]:
    return [s for s in tp_map(spec, src_tp, dst_tp) if s.src_rank == src_rank and s.dst_rank == dst_rank]


@dataclass(frozen=True)
class RankLayout:
    """One (pp, tp) rank's cache as a peer sees it (built from a ``Metadata`` reply or a local cache).

    ``regions`` holds one entry per (layer, kind) of the rank; block ``b`` of a region starts at
    ``base_addr + b * block_len``. ``block_size`` is this rank's (``KVSpec.block_size`` is not used when
    planning: P and D may differ).
    """

    tp_size: int
    tp_rank: int
    pp_size: int
    pp_rank: int
    first_layer: int
    num_layers: int
    block_size: int
    num_blocks: int
    regions: tuple[RegionInfo, ...]
    # Keyed by kind.value: hashing a str is much cheaper than hashing an Enum member (plan_transfer hot path).
    _by_key: Mapping[tuple[int, str], RegionInfo] = field(init=False, repr=False, compare=False, hash=False)
    # region_table results per (other layout, layers, kinds); the other layout is kept to check identity.
    _tables: dict[tuple[int, int, int, tuple[str, ...]], tuple[RankLayout, np.ndarray]] = field(
        init=False, repr=False, compare=False, hash=False
    )

    # Per region table (by id): the table and what the planner derived from it (table_memo).
    _memos: dict[int, tuple[np.ndarray, dict[Any, Any]]] = field(
        init=False, repr=False, compare=False, hash=False
    )

    def __post_init__(self) -> None:
        if not 0 <= self.tp_rank < self.tp_size or not 0 <= self.pp_rank < self.pp_size:
            raise LayoutError(f"rank (pp {self.pp_rank}, tp {self.tp_rank}) out of range")
        if self.block_size <= 0 or self.num_blocks <= 0 or self.num_layers <= 0 or self.first_layer < 0:
            raise LayoutError(f"bad rank geometry: {self}")
        by_key = {(r.layer, r.kind.value): r for r in self.regions}
        if len(by_key) != len(self.regions):
            raise LayoutError("a (layer, kind) region is listed twice")
        for r in self.regions:
            if r.layer not in self.layers:
                raise LayoutError(f"region of layer {r.layer} outside this rank's layers {self.layers}")
            if r.num_blocks != self.num_blocks:
                raise LayoutError(
                    f"region {r.layer}/{r.kind.value} has {r.num_blocks} blocks, not {self.num_blocks}"
                )
        object.__setattr__(self, "_by_key", by_key)
        object.__setattr__(self, "_tables", {})
        object.__setattr__(self, "_memos", {})

    @classmethod
    def from_cache(cls, cache: CacheMemory, pp_size: int = 1, pp_rank: int = 0) -> RankLayout:
        return cls(
            tp_size=cache.tp_size,
            tp_rank=cache.tp_rank,
            pp_size=pp_size,
            pp_rank=pp_rank,
            first_layer=cache.first_layer,
            num_layers=cache.num_layers,
            block_size=cache.spec.block_size,
            num_blocks=cache.num_blocks,
            regions=tuple(cache.regions()),
        )

    @property
    def layers(self) -> range:
        return range(self.first_layer, self.first_layer + self.num_layers)

    def heads(self, spec: KVSpec) -> int:
        return spec.heads_per_rank(self.tp_size)

    def first_head(self, spec: KVSpec) -> int:
        return spec.first_head(self.tp_size, self.tp_rank)

    def block_len(self, spec: KVSpec) -> int:
        """Bytes of one block of one region on this rank."""
        return self.heads(spec) * self.block_size * spec.head_bytes

    def region_pairs(
        self, other: RankLayout, layers: range, kinds: tuple[RegionKind, ...]
    ) -> list[tuple[RegionInfo, RegionInfo]]:
        """(this rank's region, ``other``'s region) for every (layer, kind), layer-major."""
        values = [k.value for k in kinds]
        try:
            return [(self._by_key[(ly, v)], other._by_key[(ly, v)]) for ly in layers for v in values]
        except KeyError as e:
            raise LayoutError(f"a rank has no region for (layer, kind) {e.args[0]}") from None

    def region_table(self, other: RankLayout, layers: range, kinds: tuple[RegionKind, ...]) -> np.ndarray:
        """``region_pairs`` as an int64 ``[n, 6]`` array of (base_addr, device_id, block_len) of this rank's
        region then ``other``'s, cached per ``other`` (the plan_transfer hot path builds it once per peer).
        Read-only."""
        values = tuple(k.value for k in kinds)
        key = (id(other), layers.start, layers.stop, values)
        hit = self._tables.get(key)
        if hit is not None and hit[0] is other:
            return hit[1]
        pairs = self.region_pairs(other, layers, kinds)
        table = np.array(
            [
                (a.base_addr, a.device_id, a.block_len, b.base_addr, b.device_id, b.block_len)
                for a, b in pairs
            ],
            dtype=np.int64,
        ).reshape(-1, 6)
        table.setflags(write=False)
        if len(self._tables) >= 64:  # peers come and go: keep the cache bounded
            self._tables.clear()
            self._memos.clear()
        self._tables[key] = (other, table)
        return table

    def table_memo(self, table: np.ndarray) -> dict[Any, Any]:
        """A dict the planner keeps what it derives from ``table`` (a ``region_table`` result) in; it lives
        as long as the table stays cached."""
        hit = self._memos.get(id(table))
        if hit is None or hit[0] is not table:
            # The entry holds the table, so its id cannot be reused while the entry exists.
            hit = self._memos[id(table)] = (table, {})
        return hit[1]

    def region(self, layer: int, kind: RegionKind) -> RegionInfo:
        try:
            return self._by_key[(layer, kind.value)]
        except KeyError:
            raise LayoutError(f"rank has no region for layer {layer} kind {kind.value}") from None


def source_ranks(spec: KVSpec, src_tp: int, src_pp: int, dst: RankLayout) -> list[tuple[int, int]]:
    """(pp_rank, tp_rank) of every P rank that writes into D rank ``dst``: the ranks D registers with and
    expects ``done`` from. Uses ``layer_window`` for P's stages."""
    tps = tp_sources(spec, src_tp, dst.tp_size, dst.tp_rank)
    out: list[tuple[int, int]] = []
    for pp in range(src_pp):
        window = layer_window(spec.num_layers, src_pp, pp)
        if window.start < dst.layers.stop and dst.layers.start < window.stop:
            out.extend((pp, tp) for tp in tps)
    return out

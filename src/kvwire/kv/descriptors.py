"""Transfer descriptors for one request between one P rank and one D rank, with run coalescing.

``plan_transfer`` maps P's blocks to D's blocks token by token and returns paired descriptor lists:
push posts ``WRITE(local=src_descs, remote=dst_descs)`` on P; pull posts ``READ(local=dst_descs,
remote=src_descs)`` on D.

Rules:

* Tokens. ``src_blocks`` and ``dst_blocks`` are the request's blocks on each side in token order, both from
  token 0 (D's list includes its prefix-hit blocks); extra trailing blocks are ignored. Only tokens
  ``[num_cached_tokens, num_tokens)`` move, from P's blocks at the same token positions;
  ``num_cached_tokens`` must be a multiple of D's block size. The unit of copy is a chunk of the smaller
  block size's tokens: the last one moves whole, so D's positions past ``num_tokens`` inside it receive
  P's (unused) bytes.
* Block sizes. One must divide the other. Chunk ``k`` is slot ``k % rp`` of P block ``k // rp`` and slot
  ``k % rd`` of D block ``k // rd`` (``rp``, ``rd``: chunks per block; the smaller side's is 1): D's
  blocks larger (P block ``i`` lands in a slot of D block ``i // r``), or P's (each of D's blocks takes
  a slot of one P block; vLLM's NIXL connector supports both, vLLM PR 26759). A fused K/V cache
  (vLLM >= 0.34) splits too: with ``[K|V]`` token rows a head's chunk is one run of the other side's
  head rows; with a K tile then a V tile per head (``spec.kv_tiles``, vLLM's CPU backend) each tile is
  planned as a head of its own, so a head's chunk is two runs (its K rows, its V rows).
* Layouts. Both sides use ``spec.layout``. HND (``[heads, tokens, head_dim]``): a head slice of a block is
  contiguous, so one descriptor per block (per head when block sizes differ). NHD
  (``[tokens, heads, head_dim]``): whole blocks are contiguous, but a head slice (TP sizes differ) is
  strided: it is moved with one descriptor per (P block, token). That is correct but costly; prefer HND
  when P's and D's TP sizes differ.
* Coalescing. Consecutive units that are adjacent in both P's and D's memory merge into one run; the same
  runs apply to every (layer, kind) region both ranks hold, so the descriptor count is
  ``num_runs * num_regions``.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import numpy as np

from kvwire.errors import BlockRangeError, LayoutError
from kvwire.kv.groups import first_token, grouped, layer_runs, num_groups, segment
from kvwire.kv.mapping import HeadSlice, RankLayout, pair_slices
from kvwire.kv.spec import KVSpec, Layout
from kvwire.protocol.types import Desc

_I64 = np.int64
# P blocks moved at most, for the pure-Python planner (its cost grows with the units; numpy's is flat).
_SMALL_BLOCKS = 8
# Or units (pieces contiguous on both sides, before coalescing) at most: the Python planner's cost follows
# the units, numpy's is flat (12-32 blocks of one unit each: 55-110 us against 130-225, Python faster).
_SMALL_UNITS = 32
# Descriptors at most, for building them with one broadcast add per side.
_SMALL_DESCS = 512


class TransferPlan:
    """Paired descriptors: ``src_descs[i]`` and ``dst_descs[i]`` have the same length.

    ``src_array`` / ``dst_array`` hold the same descriptors as ``[n, 3]`` int64 arrays of (addr, length,
    device id), the form NIXL's ``get_xfer_descs`` takes without a Python loop; the ``Desc`` lists are
    built from them on first use (building them is most of the planning cost of a fragmented request).
    """

    __slots__ = ("_dst", "_src", "dst_array", "nbytes", "num_regions", "num_runs", "src_array")

    def __init__(
        self,
        src_array: np.ndarray | None = None,
        dst_array: np.ndarray | None = None,
        *,
        num_runs: int = 0,
        num_regions: int = 0,
        nbytes: int | None = None,
    ) -> None:
        self.src_array: np.ndarray = np.zeros((0, 3), dtype=_I64) if src_array is None else src_array
        self.dst_array: np.ndarray = np.zeros((0, 3), dtype=_I64) if dst_array is None else dst_array
        self.nbytes = int(self.src_array[:, 1].sum()) if nbytes is None else nbytes
        self.num_runs = num_runs  # runs per region pair
        self.num_regions = num_regions  # (layer, kind) region pairs both ranks hold
        self._src: list[Desc] | None = None
        self._dst: list[Desc] | None = None

    @property
    def src_descs(self) -> list[Desc]:
        if self._src is None:
            self._src = _to_descs(self.src_array)
        return self._src

    @property
    def dst_descs(self) -> list[Desc]:
        if self._dst is None:
            self._dst = _to_descs(self.dst_array)
        return self._dst

    @property
    def empty(self) -> bool:
        return len(self.src_array) == 0

    @property
    def num_descs(self) -> int:
        return len(self.src_array)

    def __repr__(self) -> str:
        return (
            f"TransferPlan(num_descs={self.num_descs}, num_runs={self.num_runs}, "
            f"num_regions={self.num_regions}, nbytes={self.nbytes})"
        )


def _to_descs(arr: np.ndarray) -> list[Desc]:
    cols = arr.T.tolist()
    return [Desc(a, n, d) for a, n, d in zip(*cols, strict=True)]


@dataclass(frozen=True, slots=True)
class _Geometry:
    """Byte geometry of one slice transfer: block lengths and the per-head-token element size."""

    layout: Layout
    elem: int  # bytes of one (token, head): head_dim * itemsize
    src_heads: int
    dst_heads: int
    src_bs: int
    dst_bs: int
    tiles: bool = False  # K and V tiles planned as heads of their own (heads and slices doubled)

    @property
    def src_block_len(self) -> int:
        return self.src_heads * self.src_bs * self.elem

    @property
    def dst_block_len(self) -> int:
        return self.dst_heads * self.dst_bs * self.elem

    @property
    def chunk(self) -> int:
        """Tokens of the unit of copy: the smaller block size (one side's block, a slot of the other's)."""
        return min(self.src_bs, self.dst_bs)


def plan_transfer(
    spec: KVSpec,
    src: RankLayout,
    dst: RankLayout,
    src_blocks: Sequence[int],
    dst_blocks: Sequence[int],
    *,
    num_tokens: int,
    num_cached_tokens: int = 0,
) -> TransferPlan:
    """Descriptors moving one request's KV from P rank ``src`` into D rank ``dst`` (module doc: rules).

    Empty when the ranks share no heads or no layers, or D's prefix hit covers every P block.
    Raises ``LayoutError`` for an unsupported geometry and ``BlockRangeError`` for block ids outside
    either cache or a block listed twice. A hybrid model's KV cache groups (``kv/groups.py``): each run of
    layers of one group is planned with that group's blocks and first token.
    """
    if not grouped(spec):
        return _plan(spec, src, dst, src_blocks, dst_blocks, num_tokens, num_cached_tokens, None)
    if src.block_size != dst.block_size:
        raise LayoutError(
            f"a hybrid model's KV cache groups need one block size on P and D, got {src.block_size} and "
            f"{dst.block_size}"
        )
    common = range(max(src.first_layer, dst.first_layer), min(src.layers.stop, dst.layers.stop))
    runs = layer_runs(spec, common)
    parts: list[TransferPlan] = []
    for g in range(num_groups(spec)):
        s_ids = segment(spec, src_blocks, g, num_tokens, src.block_size)
        d_ids = segment(spec, dst_blocks, g, num_tokens, dst.block_size)
        first = first_token(spec, g, num_tokens, num_cached_tokens)
        mine = [r for gg, r in runs if gg == g] or [range(0)]  # range(0): the ids are still checked
        parts += [_plan(spec, src, dst, s_ids, d_ids, num_tokens, first, r) for r in mine]
    parts = [p for p in parts if not p.empty]
    if not parts:
        return TransferPlan()
    return TransferPlan(
        np.concatenate([p.src_array for p in parts]),
        np.concatenate([p.dst_array for p in parts]),
        num_runs=sum(p.num_runs for p in parts),
        num_regions=sum(p.num_regions for p in parts),
        nbytes=sum(p.nbytes for p in parts),
    )


def _plan(
    spec: KVSpec,
    src: RankLayout,
    dst: RankLayout,
    src_blocks: Sequence[int],
    dst_blocks: Sequence[int],
    num_tokens: int,
    num_cached_tokens: int,
    only_layers: range | None,
) -> TransferPlan:
    """``plan_transfer`` for one block list (one group), over ``only_layers`` when given. The unit is a
    chunk of the smaller block size: chunk ``k`` is slot ``k % rp`` of P block ``k // rp`` and slot
    ``k % rd`` of D block ``k // rd`` (one of ``rp``, ``rd`` is 1)."""
    first, last, rp, rd = _token_range(src, dst, num_tokens, num_cached_tokens)
    if len(src_blocks) < -(-num_tokens // src.block_size):
        raise BlockRangeError(
            f"{num_tokens} tokens need {-(-num_tokens // src.block_size)} P blocks, got {len(src_blocks)}"
        )
    if len(dst_blocks) < -(-num_tokens // dst.block_size):
        raise BlockRangeError(
            f"{num_tokens} tokens need {-(-num_tokens // dst.block_size)} D blocks, got {len(dst_blocks)}"
        )
    s_first, s_last, d_first, d_last = first // rp, -(-last // rp), first // rd, -(-last // rd)
    small = last - first <= _SMALL_BLOCKS or (last - first) * _units_per_block(spec, src, dst) <= _SMALL_UNITS
    # Validate the ids even when this rank pair moves nothing: a bad registration is refused by every rank.
    check = _block_ids_py if small else _block_ids
    src_used = check(src_blocks[s_first:s_last], src.num_blocks, "P")
    dst_used = check(dst_blocks[d_first:d_last], dst.num_blocks, "D")
    slices = _pair_slices(spec, src.tp_size, dst.tp_size, src.tp_rank, dst.tp_rank)
    layers = range(max(src.first_layer, dst.first_layer), min(src.layers.stop, dst.layers.stop))
    if only_layers is not None:
        layers = range(
            max(layers.start, only_layers.start), max(layers.start, min(layers.stop, only_layers.stop))
        )
    if not slices or not layers or first >= last:
        return TransferPlan()
    geo = _geometry(spec, src, dst)
    if geo.tiles:
        slices = _tile_slices(slices)
    if small:
        # A few blocks: numpy's per-call overhead (dozens of tiny arrays) costs more than the Python loop.
        s_py, d_py = cast("list[int]", src_used), cast("list[int]", dst_used)
        chunks = [
            (s_py[k // rp - s_first], k % rp, d_py[k // rd - d_first], k % rd) for k in range(first, last)
        ]
        rs: list[int] = []
        rdst: list[int] = []
        rl: list[int] = []
        for s in slices:
            _coalesce_py(*_units_py(geo, s, chunks), rs, rdst, rl)
        run_src, run_dst, run_len = (np.array(x, dtype=_I64) for x in (rs, rdst, rl))
        return _build_plan(spec, src, dst, layers, geo, run_src, run_dst, run_len, sum(rl))
    k = np.arange(first, last, dtype=_I64)
    src_ids = cast(np.ndarray, src_used)[k // rp - s_first]
    dst_ids = cast(np.ndarray, dst_used)[k // rd - d_first]
    runs = [_coalesce(*_units(geo, s, src_ids, k % rp, dst_ids, k % rd)) for s in slices]
    run_src, run_dst, run_len = (np.concatenate([r[i] for r in runs]) for i in range(3))
    return _build_plan(spec, src, dst, layers, geo, run_src, run_dst, run_len, None)


def _units_per_block(spec: KVSpec, src: RankLayout, dst: RankLayout) -> int:
    """Units per chunk and head slice (``_units``): one where a slice is contiguous in a block on both
    sides (HND with equal block sizes, NHD moving whole blocks), else one per head (HND) or token (NHD)."""
    if spec.layout is Layout.HND:
        return 1 if src.block_size == dst.block_size else spec.heads_per_rank(max(src.tp_size, dst.tp_size))
    return 1 if src.tp_size == dst.tp_size else min(src.block_size, dst.block_size)


@functools.lru_cache(maxsize=256)
def _pair_slices(
    spec: KVSpec, src_tp: int, dst_tp: int, src_rank: int, dst_rank: int
) -> tuple[HeadSlice, ...]:
    return tuple(pair_slices(spec, src_tp, dst_tp, src_rank, dst_rank))


@functools.lru_cache(maxsize=256)
def _geometry_of(spec: KVSpec, src_tp: int, src_bs: int, dst_tp: int, dst_bs: int) -> _Geometry:
    if spec.kv_tiles and src_bs != dst_bs:
        # A head's block is a K tile then a V tile, each [block_size, head_dim]: as two heads of half the
        # width, the HND sub-block rule moves each tile's rows into the same tile of D's larger block.
        return _Geometry(
            spec.layout,
            spec.head_bytes // 2,
            2 * spec.heads_per_rank(src_tp),
            2 * spec.heads_per_rank(dst_tp),
            src_bs,
            dst_bs,
            tiles=True,
        )
    return _Geometry(
        spec.layout,
        spec.head_bytes,
        spec.heads_per_rank(src_tp),
        spec.heads_per_rank(dst_tp),
        src_bs,
        dst_bs,
    )


def _tile_slices(slices: tuple[HeadSlice, ...]) -> tuple[HeadSlice, ...]:
    """Head slices in tiles (two per head: K, V) for ``_Geometry.tiles``."""
    return tuple(
        HeadSlice(s.src_rank, s.dst_rank, 2 * s.src_head, 2 * s.dst_head, 2 * s.num_heads) for s in slices
    )


def _geometry(spec: KVSpec, src: RankLayout, dst: RankLayout) -> _Geometry:
    return _geometry_of(spec, src.tp_size, src.block_size, dst.tp_size, dst.block_size)


def _token_range(src: RankLayout, dst: RankLayout, num_tokens: int, cached: int) -> tuple[int, int, int, int]:
    """(first chunk moved, end chunk, chunks per P block, chunks per D block): a chunk is the smaller
    block size's tokens, so one side's blocks are its chunks and the other's hold several."""
    small, large = sorted((src.block_size, dst.block_size))
    if large % small:
        raise LayoutError(f"block sizes P {src.block_size} and D {dst.block_size}: one must divide the other")
    if num_tokens <= 0 or not 0 <= cached <= num_tokens:
        raise LayoutError(f"bad token counts: num_tokens={num_tokens}, num_cached_tokens={cached}")
    if cached % dst.block_size:
        raise LayoutError(f"num_cached_tokens={cached} is not a multiple of D's block size {dst.block_size}")
    return cached // small, -(-num_tokens // small), src.block_size // small, dst.block_size // small


def _block_ids(ids: Sequence[int], num_blocks: int, side: str) -> np.ndarray:
    arr = np.asarray(ids, dtype=_I64)
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) >= num_blocks):
        bad = next(int(b) for b in arr if not 0 <= b < num_blocks)
        raise BlockRangeError(f"{side} block id {bad} outside [0, {num_blocks})")
    if arr.size > 1:
        ordered = np.sort(arr)  # cheaper than np.unique for the few dozen ids of a request
        if bool((ordered[1:] == ordered[:-1]).any()):
            raise BlockRangeError(f"a {side} block id is listed twice")
    return arr


def _block_ids_py(ids: Sequence[int], num_blocks: int, side: str) -> list[int]:
    """``_block_ids`` for a few ids, as a list (same checks, same errors)."""
    out = [int(b) for b in ids]
    for b in out:
        if not 0 <= b < num_blocks:
            raise BlockRangeError(f"{side} block id {b} outside [0, {num_blocks})")
    if len(set(out)) != len(out):
        raise BlockRangeError(f"a {side} block id is listed twice")
    return out


def _units_py(
    geo: _Geometry, s: HeadSlice, chunks: list[tuple[int, int, int, int]]
) -> tuple[list[int], list[int], int]:
    """``_units`` in pure Python, for a few chunks ``(P block, P slot, D block, D slot)`` (same pieces,
    same order)."""
    e, c, bs, bd = geo.elem, geo.chunk, geo.src_bs, geo.dst_bs
    sbl, dbl = geo.src_block_len, geo.dst_block_len
    if geo.layout is Layout.HND:
        if bs == bd:
            so, do = s.src_head * bs * e, s.dst_head * bd * e
            src = [a * sbl + so for a, _, _, _ in chunks]
            return src, [b * dbl + do for _, _, b, _ in chunks], s.num_heads * bs * e
        ks = range(s.num_heads)
        src_off = [a * sbl + (s.src_head + k) * bs * e + sp * c * e for a, sp, _, _ in chunks for k in ks]
        dst_off = [b * dbl + (s.dst_head + k) * bd * e + sd * c * e for _, _, b, sd in chunks for k in ks]
        return src_off, dst_off, c * e
    sh, dh = geo.src_heads, geo.dst_heads
    if s.num_heads == sh == dh:
        src = [a * sbl + sp * c * sh * e for a, sp, _, _ in chunks]
        return src, [b * dbl + sd * c * dh * e for _, _, b, sd in chunks], c * sh * e
    src_off = [a * sbl + ((sp * c + o) * sh + s.src_head) * e for a, sp, _, _ in chunks for o in range(c)]
    dst_off = [b * dbl + ((sd * c + o) * dh + s.dst_head) * e for _, _, b, sd in chunks for o in range(c)]
    return src_off, dst_off, s.num_heads * e


def _coalesce_py(
    src_off: list[int], dst_off: list[int], unit: int, rs: list[int], rd: list[int], rl: list[int]
) -> None:
    """``_coalesce`` in pure Python, appending the runs to ``rs``/``rd``/``rl``."""
    first = len(rl)
    for a, b in zip(src_off, dst_off, strict=True):
        if len(rl) > first and a == rs[-1] + rl[-1] and b == rd[-1] + rl[-1]:
            rl[-1] += unit
        else:
            rs.append(a)
            rd.append(b)
            rl.append(unit)


def _units(
    geo: _Geometry,
    s: HeadSlice,
    src_ids: np.ndarray,
    src_slot: np.ndarray,
    dst_ids: np.ndarray,
    dst_slot: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, int]:
    """Region-relative (src offsets, dst offsets, unit length) of the smallest pieces contiguous on both
    sides, in copy order (chunk, then head or token); chunk ``i`` is at slot ``src_slot[i]`` of P block
    ``src_ids[i]`` and slot ``dst_slot[i]`` of D block ``dst_ids[i]``."""
    e, c, bs, bd = geo.elem, geo.chunk, geo.src_bs, geo.dst_bs
    src_base = src_ids * geo.src_block_len
    dst_base = dst_ids * geo.dst_block_len
    if geo.layout is Layout.HND:
        if bs == bd:  # the slice's heads are adjacent on both sides: one piece per block
            return src_base + s.src_head * bs * e, dst_base + s.dst_head * bd * e, s.num_heads * bs * e
        k = np.arange(s.num_heads, dtype=_I64)
        src_off = (src_base + src_slot * c * e)[:, None] + (s.src_head + k)[None, :] * bs * e
        dst_off = (dst_base + dst_slot * c * e)[:, None] + (s.dst_head + k)[None, :] * bd * e
        return src_off.reshape(-1), dst_off.reshape(-1), c * e
    sh, dh = geo.src_heads, geo.dst_heads
    if s.num_heads == sh == dh:  # NHD, whole blocks: token rows are contiguous
        return src_base + src_slot * c * sh * e, dst_base + dst_slot * c * dh * e, c * sh * e
    o = np.arange(c, dtype=_I64)
    src_tok = src_slot[:, None] * c + o[None, :]
    dst_tok = dst_slot[:, None] * c + o[None, :]
    src_off = src_base[:, None] + (src_tok * sh + s.src_head) * e
    dst_off = dst_base[:, None] + (dst_tok * dh + s.dst_head) * e
    return src_off.reshape(-1), dst_off.reshape(-1), s.num_heads * e


def _coalesce(
    src_off: np.ndarray, dst_off: np.ndarray, unit: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Merge consecutive units adjacent on both sides: (run src offsets, run dst offsets, run lengths)."""
    n = src_off.size
    brk = np.empty(n, dtype=bool)
    brk[0] = True
    np.not_equal(src_off[1:], src_off[:-1] + unit, out=brk[1:])
    brk[1:] |= dst_off[1:] != dst_off[:-1] + unit
    starts = np.flatnonzero(brk)
    lengths = np.diff(np.append(starts, n)) * unit
    return src_off[starts], dst_off[starts], lengths


def _build_plan(
    spec: KVSpec,
    src: RankLayout,
    dst: RankLayout,
    layers: range,
    geo: _Geometry,
    run_src: np.ndarray,
    run_dst: np.ndarray,
    run_len: np.ndarray,
    run_bytes: int | None,
) -> TransferPlan:
    """Apply the region-relative runs to every region pair (layer-major, then kind, then run).
    ``run_bytes``: ``run_len``'s sum when the caller knows it."""
    src_bases, dst_bases = _region_bases(spec, src, dst, layers, geo)
    n_pairs, n_runs = src_bases.shape[0], len(run_len)
    if n_pairs * n_runs <= _SMALL_DESCS:
        # Each descriptor is its region's (base, 0, device) plus its run's (offset, length, 0): one
        # broadcast add per side (its inner loop is 3 long, so this only pays for few descriptors).
        runs = np.zeros((2, n_runs, 3), dtype=_I64)
        runs[0, :, 0] = run_src
        runs[1, :, 0] = run_dst
        runs[:, :, 1] = run_len
        src_arr = (src_bases + runs[0]).reshape(-1, 3)
        dst_arr = (dst_bases + runs[1]).reshape(-1, 3)
    else:
        src_arr, dst_arr = _fill(src_bases, run_src, run_len), _fill(dst_bases, run_dst, run_len)
    nbytes = None if run_bytes is None else run_bytes * n_pairs
    return TransferPlan(src_arr, dst_arr, num_runs=n_runs, num_regions=n_pairs, nbytes=nbytes)


def _fill(bases: np.ndarray, run_off: np.ndarray, run_len: np.ndarray) -> np.ndarray:
    """``[pairs * runs, 3]`` descriptors, column by column (inner loops as long as the runs)."""
    out = np.empty((bases.shape[0], len(run_len), 3), dtype=_I64)
    out[:, :, 0] = bases[:, :, 0] + run_off
    out[:, :, 1] = run_len
    out[:, :, 2] = bases[:, :, 2]
    return out.reshape(-1, 3)


def _region_bases(
    spec: KVSpec, src: RankLayout, dst: RankLayout, layers: range, geo: _Geometry
) -> tuple[np.ndarray, np.ndarray]:
    """``[pairs, 1, 3]`` (base address, 0, device id) of P's and of D's regions, checked against the
    geometry's block lengths once per (region table, geometry)."""
    table = src.region_table(dst, layers, spec.kinds)  # [pairs, 6]: P's then D's (base, device, block_len)
    src_len, dst_len = geo.src_block_len, geo.dst_block_len
    memo = src.table_memo(table)
    hit: tuple[np.ndarray, np.ndarray] | None = memo.get((src_len, dst_len))
    if hit is not None:
        return hit
    wrong = np.flatnonzero((table[:, 2] != src_len) | (table[:, 5] != dst_len))
    if wrong.size:
        sr, dr = src.region_pairs(dst, layers, spec.kinds)[int(wrong[0])]
        raise LayoutError(
            f"layer {sr.layer} {sr.kind.value}: block_len P {sr.block_len} / D {dr.block_len}, "
            f"expected {src_len} / {dst_len} for this geometry"
        )
    bases = np.zeros((2, table.shape[0], 1, 3), dtype=_I64)
    bases[0, :, 0, 0], bases[0, :, 0, 2] = table[:, 0], table[:, 1]
    bases[1, :, 0, 0], bases[1, :, 0, 2] = table[:, 3], table[:, 4]
    bases.setflags(write=False)
    memo[(src_len, dst_len)] = hit = (bases[0], bases[1])
    return hit

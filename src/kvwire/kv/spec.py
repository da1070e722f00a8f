"""KV cache geometry: what a block of one layer holds, and how it is laid out in memory."""

from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np

from kvwire.errors import LayoutError


class Layout(enum.Enum):
    """Order of one block's dimensions. HND: [heads, tokens, head_dim]; NHD: [tokens, heads, head_dim]."""

    HND = "HND"
    NHD = "NHD"


class RegionKind(enum.Enum):
    K = "k"
    V = "v"
    KV = "kv"  # MLA: one latent cache per layer


# bfloat16 has no numpy dtype: it moves as 2-byte words, which is all a transfer needs.
_DTYPES: dict[str, np.dtype[np.generic]] = {
    "float16": np.dtype(np.float16),
    "bfloat16": np.dtype(np.uint16),
    "float32": np.dtype(np.float32),
    "float8": np.dtype(np.uint8),
}


@dataclass(frozen=True, slots=True)
class KVSpec:
    """The model's KV geometry. ``kv_heads`` is the model's total; a TP rank holds a slice of it."""

    num_layers: int
    kv_heads: int
    head_dim: int
    dtype: str = "float16"
    block_size: int = 16
    layout: Layout = Layout.HND
    mla: bool = False
    # K and V of one head stored together in each block (vLLM's CPU backend: a block is, per head, a
    # [block_size, head_dim] K tile then a V tile): one region per layer whose head unit is twice as wide.
    kv_fused: bool = False
    # How a fused head's block holds K and V: False, each token row is K then V (FlashAttention and the
    # other GPU backends of vLLM >= 0.34); True, a [block_size, head_dim] K tile then a V tile (vLLM's CPU
    # backend). The same bytes move either way when P and D share a block size; a split by tokens (D's
    # blocks larger than P's) needs to know which.
    kv_tiles: bool = False
    # A hybrid model's KV cache groups (kv/groups.py): each layer's group, each group's sliding window in
    # tokens (0: full attention). Empty: one group.
    layer_groups: tuple[int, ...] = ()
    group_windows: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPES:
            raise LayoutError(f"unsupported dtype {self.dtype!r}; one of {sorted(_DTYPES)}")
        for name in ("num_layers", "kv_heads", "head_dim", "block_size"):
            if getattr(self, name) <= 0:
                raise LayoutError(f"{name} must be positive, got {getattr(self, name)}")
        if self.kv_fused and (self.mla or self.layout is not Layout.HND):
            raise LayoutError("a fused K/V cache is HND and not MLA")
        if self.kv_tiles and not self.kv_fused:
            raise LayoutError("kv_tiles describes a fused K/V cache (kv_fused)")
        if self.mla and self.kv_heads != 1:
            raise LayoutError("an MLA cache has one latent head (kv_heads=1)")
        self._check_groups()

    def _check_groups(self) -> None:
        if not self.layer_groups and not self.group_windows:
            return
        if len(self.layer_groups) != self.num_layers:
            raise LayoutError(f"layer_groups names {len(self.layer_groups)} layers, not {self.num_layers}")
        if sorted(set(self.layer_groups)) != list(range(len(self.group_windows))):
            raise LayoutError(
                f"layer_groups {self.layer_groups} do not use groups 0..{len(self.group_windows) - 1}"
            )
        if any(w < 0 for w in self.group_windows):
            raise LayoutError(f"negative sliding window in {self.group_windows}")

    @property
    def np_dtype(self) -> np.dtype[np.generic]:
        return _DTYPES[self.dtype]

    @property
    def itemsize(self) -> int:
        return int(self.np_dtype.itemsize)

    @property
    def kinds(self) -> tuple[RegionKind, ...]:
        return (RegionKind.KV,) if self.mla or self.kv_fused else (RegionKind.K, RegionKind.V)

    @property
    def head_bytes(self) -> int:
        """Bytes of one (token, head) in one region: K's or V's row, or both when fused."""
        return self.head_dim * self.itemsize * (2 if self.kv_fused else 1)

    def heads_per_rank(self, tp_size: int) -> int:
        """KV heads one TP rank holds (MLA and fewer heads than ranks: replicated)."""
        if tp_size <= 0:
            raise LayoutError(f"tp_size must be positive, got {tp_size}")
        if self.mla:
            return 1
        if self.kv_heads >= tp_size:
            if self.kv_heads % tp_size:
                raise LayoutError(f"kv_heads={self.kv_heads} is not divisible by tp_size={tp_size}")
            return self.kv_heads // tp_size
        if tp_size % self.kv_heads:
            raise LayoutError(f"tp_size={tp_size} is not a multiple of kv_heads={self.kv_heads}")
        return 1

    def first_head(self, tp_size: int, tp_rank: int) -> int:
        """The model's index of the first KV head that ``tp_rank`` holds."""
        if not 0 <= tp_rank < tp_size:
            raise LayoutError(f"tp_rank {tp_rank} out of range for tp_size {tp_size}")
        if self.mla:
            return 0
        per = self.heads_per_rank(tp_size)
        if self.kv_heads >= tp_size:
            return tp_rank * per
        return tp_rank // (tp_size // self.kv_heads)

    def block_shape(self, heads: int) -> tuple[int, int, int]:
        """One block of one region as an array: a fused head's row holds K and V (``head_bytes``)."""
        row = self.head_dim * (2 if self.kv_fused else 1)
        if self.layout is Layout.HND:
            return (heads, self.block_size, row)
        return (self.block_size, heads, row)

    def block_bytes(self, heads: int) -> int:
        return heads * self.block_size * self.head_bytes

    def bytes_per_token(self) -> int:
        """Bytes of KV one token takes across the whole model (all layers, heads, K and V)."""
        return self.num_layers * len(self.kinds) * self.kv_heads * self.head_bytes

"""vLLM's hybrid KV cache manager (``SupportsHMA``) for the connector, without vLLM (duck-typed).

With HMA, vLLM keeps one block table per KV cache group (full-attention layers, sliding-window layers,
...) and hands the connector a block list per group. kvwire moves each group's layers with that group's
blocks (``kv/groups.py``): ``KvGroups`` reads the groups from vLLM's ``KVCacheConfig`` once at start,
turns per-group block lists into kvwire's flat list, and tells whether P still holds every block of a
sliding window that D needs.

Supported groups: full attention and sliding window (MLA's full attention too). Anything else (Mamba and
other state-space layers, chunked local attention, a group kept out of transfers) stops the engine at
start with a ``ConfigError`` naming it: kvwire would otherwise move a state it does not understand.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvwire.errors import ConfigError, LayoutError
from kvwire.integrations.vllm.memory import layer_index
from kvwire.kv.groups import first_token, flatten
from kvwire.kv.spec import KVSpec

_FULL = ("FullAttentionSpec", "MLAAttentionSpec")
_WINDOW = ("SlidingWindowSpec",)


@dataclass(frozen=True, slots=True)
class KvGroups:
    """Each model layer's group and each group's sliding window (tokens, 0: full); empty: one group."""

    layer_groups: tuple[int, ...] = ()
    group_windows: tuple[int, ...] = ()

    @property
    def hybrid(self) -> bool:
        return bool(self.group_windows)

    def check_supported(self, pp_size: int, layerwise: bool) -> None:
        """Refuse at start what kvwire cannot move for a hybrid model: PP (its stages split the groups), and
        layer-wise push (its streams and write lanes are one group's layer-major rows; a hybrid model's
        plan is group after group, so an early layer's write would carry other layers' rows)."""
        if self.hybrid and pp_size > 1:
            raise ConfigError(
                "kvwire moves a hybrid model's KV cache groups without PP (pipeline_parallel_size 1)"
            )
        if self.hybrid and layerwise:
            raise ConfigError(
                'kv_connector_extra_config: "layerwise": true moves one KV cache group; this hybrid model '
                'has several: set "layerwise": false (whole-request push)'
            )

    def flat(self, block_ids: Sequence[Sequence[int]], num_tokens: int, block_size: int) -> list[int]:
        """vLLM's per-group block lists as kvwire's one list (one group: its list as it is)."""
        if not self.hybrid:
            return list(block_ids[0]) if block_ids else []
        if len(block_ids) != len(self.group_windows):
            raise LayoutError(f"{len(block_ids)} block lists for {len(self.group_windows)} KV cache groups")
        return flatten(block_ids, num_tokens, block_size)

    def window_lost(
        self, block_ids: Sequence[Sequence[int]], num_tokens: int, block_size: int, null_block: int
    ) -> bool:
        """Whether a sliding-window group of P's finished request has already freed a block D needs
        (vLLM frees a window's blocks by the token after the prompt, D recomputes the prompt's last
        token: when the window's first token starts a block, that block is gone on P)."""
        if not self.hybrid:
            return False
        spec = self.spec(block_size)
        n = -(-num_tokens // block_size)
        for g, ids in enumerate(block_ids):
            first = first_token(spec, g, num_tokens, 0) // block_size
            if null_block in list(ids[first:n]) or len(ids) < n:
                return True
        return False

    def spec(self, block_size: int) -> KVSpec:
        """A spec carrying only the groups (what ``kv/groups.py`` reads)."""
        return KVSpec(
            len(self.layer_groups), 1, 1, block_size=block_size,
            layer_groups=self.layer_groups, group_windows=self.group_windows,
        )  # fmt: skip


def kv_groups(kv_cache_config: Any, num_layers: int) -> KvGroups:
    """The groups of vLLM's ``KVCacheConfig`` (``kv_cache_groups``: layer names and a spec each)."""
    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or [])
    if len(groups) <= 1:
        return KvGroups()
    layer_groups = [-1] * num_layers
    windows: list[int] = []
    for g, group in enumerate(groups):
        spec = group.kv_cache_spec
        kind = type(spec).__name__
        if not getattr(group, "enable_kv_transfer", True):
            raise ConfigError(
                f"KV cache group {g} ({kind}) is kept out of transfers: kvwire moves every group"
            )
        if kind in _FULL:
            windows.append(0)
        elif kind in _WINDOW:
            windows.append(int(spec.sliding_window))
        else:
            raise ConfigError(
                f"KV cache group {g} is {kind}: kvwire moves full-attention and sliding-window groups only "
                "(start vLLM with --disable-hybrid-kv-cache-manager, or without kvwire)"
            )
        for name in group.layer_names:
            i = layer_index(name)
            if not 0 <= i < num_layers or layer_groups[i] != -1:
                raise ConfigError(f"KV cache group {g}: layer {name!r} is outside the model or in two groups")
            layer_groups[i] = g
    if -1 in layer_groups:
        raise ConfigError(
            f"layers {[i for i, g in enumerate(layer_groups) if g == -1]} are in no KV cache group"
        )
    return KvGroups(tuple(layer_groups), tuple(windows))

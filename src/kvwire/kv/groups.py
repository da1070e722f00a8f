"""KV cache groups: a hybrid model's layers split into groups that each have their own blocks (vLLM's
hybrid KV cache manager, ``SupportsHMA``), e.g. full-attention layers and sliding-window layers.

``KVSpec.layer_groups`` gives each model layer's group and ``KVSpec.group_windows`` each group's sliding
window in tokens (0: full attention); both empty for a model with one group (the usual case, where
nothing here changes anything). For a grouped spec a request's block list, on P and on D alike, is every
group's list one after the other, each exactly ``ceil(num_tokens / block_size)`` long (``flatten``).

A sliding-window group moves only the tokens D still reads: D recomputes the prompt's last token, which
attends to the ``window`` tokens ending there, so the group's tokens move from the block holding token
``num_tokens - window`` on (``first_token``); its earlier entries (vLLM's null block for what the window
left behind) are never read, checked or written. Grouped transfers need one block size on P and D.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvwire.errors import BlockRangeError
from kvwire.kv.spec import KVSpec


def grouped(spec: KVSpec) -> bool:
    return bool(spec.layer_groups)


def num_groups(spec: KVSpec) -> int:
    return len(spec.group_windows) if grouped(spec) else 1


def first_token(spec: KVSpec, group: int, num_tokens: int, num_cached_tokens: int) -> int:
    """The first token of the request a group moves (module doc); a multiple of the block size."""
    window = spec.group_windows[group] if grouped(spec) else 0
    if not window or num_tokens <= window:
        return num_cached_tokens
    bs = spec.block_size
    return max(num_cached_tokens, (num_tokens - window) // bs * bs)


def layer_first_token(spec: KVSpec, layer: int, num_tokens: int, num_cached_tokens: int) -> int:
    group = spec.layer_groups[layer] if grouped(spec) else 0
    return first_token(spec, group, num_tokens, num_cached_tokens)


def segment(
    spec: KVSpec, block_ids: Sequence[int], group: int, num_tokens: int, block_size: int
) -> Sequence[int]:
    """One group's blocks in a request's flattened list (the whole list when the spec has one group)."""
    if not grouped(spec):
        return block_ids
    n = -(-num_tokens // block_size)
    if len(block_ids) != n * num_groups(spec):
        raise BlockRangeError(
            f"{len(block_ids)} block ids for {num_groups(spec)} KV cache groups of {n} blocks "
            f"({num_tokens} tokens)"
        )
    return block_ids[group * n : (group + 1) * n]


def layer_runs(spec: KVSpec, layers: range) -> list[tuple[int, range]]:
    """``layers`` as maximal runs of consecutive layers of one group: (group, run)."""
    if not grouped(spec):
        return [(0, layers)] if len(layers) else []
    runs: list[tuple[int, range]] = []
    for layer in layers:
        g = spec.layer_groups[layer]
        if runs and runs[-1][0] == g and runs[-1][1].stop == layer:
            runs[-1] = (g, range(runs[-1][1].start, layer + 1))
        else:
            runs.append((g, range(layer, layer + 1)))
    return runs


def moved_ids(spec: KVSpec, block_ids: Sequence[int], num_tokens: int, num_cached_tokens: int) -> list[int]:
    """The block ids a request's KV occupies (what range and repetition checks apply to): the whole list
    for one group; for a grouped spec each group's blocks from its first moved token on."""
    if not grouped(spec):
        return list(block_ids)
    bs = spec.block_size
    out: list[int] = []
    for g in range(num_groups(spec)):
        seg = segment(spec, block_ids, g, num_tokens, bs)
        out.extend(seg[first_token(spec, g, num_tokens, num_cached_tokens) // bs :])
    return out


def flatten(groups: Sequence[Sequence[int]], num_tokens: int, block_size: int) -> list[int]:
    """A request's per-group block lists (vLLM's ``get_block_ids()``) as one list: each group's first
    ``ceil(num_tokens / block_size)`` blocks (the ones holding the tokens), group after group."""
    n = -(-num_tokens // block_size)
    out: list[int] = []
    for ids in groups:
        if len(ids) < n:
            raise BlockRangeError(f"a KV cache group holds {len(ids)} blocks, {num_tokens} tokens need {n}")
        out.extend(ids[:n])
    return out

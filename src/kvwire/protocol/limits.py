"""Shape limits checked on a peer's bytes before anything decodes them untyped.

msgspec guards its recursion with the interpreter's recursion limit: a deeply nested body (5 KB of nested
one-element arrays is 5,000 levels) raises ``RecursionError`` part-way through a decode, wherever the caller
happens to be on the stack, and an interpreter whose limit was raised (some engines do) may overflow the C
stack instead. ``nesting_depth`` walks the msgpack encoding without recursing and without building objects,
so a body can be refused as malformed by its shape alone. The walk is pure Python (about 0.2 us an item),
and it runs on the event loop before any authentication, so it stops after ``MAX_WALK_ITEMS`` items: a
16 MiB frame of 16 million nils would otherwise hold the loop for seconds.
"""

from __future__ import annotations

# No message of wire contract v1 nests deeper than 6 (a metadata reply: map > list of ranks > map > list of
# regions > map > list). 32 leaves room for fields a later version may add.
MAX_DEPTH = 32
# A notification carries ids, never KV: a push_reg for a million-token prompt is a few hundred KB.
MAX_NOTIF_BYTES = 4 * 1024 * 1024
# An id (transfer, engine, incarnation) in characters: a uuid is 36, vLLM's request ids about 50. Ids are
# keys of bounded tables (timeline, tombstones): each entry's size is bounded too.
MAX_ID_CHARS = 1024
# Transfer ids in one heartbeat: its sender splits a longer live set, its receiver looks each one up (so a
# heartbeat costs its receiver a few milliseconds at most, whoever sent it).
MAX_HEARTBEAT_IDS = 16_384
# Items the shape walk reads before giving up (about 15 ms). It only runs on bodies that already failed the
# typed decode, to explain why; a body with more items than this is refused as malformed unexplained.
MAX_WALK_ITEMS = 1 << 16


def _fixed_sizes() -> tuple[int, ...]:
    """Bytes after the first one, for every type byte whose item has a fixed size and holds no items;
    -1 for the variable-length and container types, -2 for the byte msgpack never uses (0xc1)."""
    size = [0] * 256
    for b in range(0x80, 0xA0):
        size[b] = -1  # fixmap, fixarray
    for b in range(0xA0, 0xC0):
        size[b] = b & 0x1F  # fixstr
    fixed = {0xC0: 0, 0xC2: 0, 0xC3: 0, 0xCA: 4, 0xCB: 8, 0xCC: 1, 0xCD: 2, 0xCE: 4, 0xCF: 8}
    fixed |= {0xD0: 1, 0xD1: 2, 0xD2: 4, 0xD3: 8, 0xD4: 2, 0xD5: 3, 0xD6: 5, 0xD7: 9, 0xD8: 17}
    for b, n in fixed.items():
        size[b] = n
    for b in (0xC4, 0xC5, 0xC6, 0xC7, 0xC8, 0xC9, 0xD9, 0xDA, 0xDB, 0xDC, 0xDD, 0xDE, 0xDF):
        size[b] = -1
    size[0xC1] = -2
    return tuple(size)


_SIZE = _fixed_sizes()
# Variable-length types: (bytes of the length field, extra bytes after it (an ext's type byte)).
_LENGTH_PREFIXED = {
    0xC4: (1, 0),
    0xC5: (2, 0),
    0xC6: (4, 0),
    0xD9: (1, 0),
    0xDA: (2, 0),
    0xDB: (4, 0),
    0xC7: (1, 1),
    0xC8: (2, 1),
    0xC9: (4, 1),
}
# Containers with a count field: (bytes of the count, items per count: 2 for a map's key and value).
_CONTAINERS = {0xDC: (2, 1), 0xDD: (4, 1), 0xDE: (2, 2), 0xDF: (4, 2)}


def nesting_depth(body: bytes, limit: int = MAX_DEPTH, max_items: int = MAX_WALK_ITEMS) -> int | None:
    """The deepest container nesting of the msgpack items in ``body``, counting only up to ``limit + 1``
    (the walk stops as soon as ``limit`` is exceeded, so a caller compares the result with ``limit``);
    None when the walk met more than ``max_items`` items first (its cost, not the body, is then the limit).

    Truncated or invalid bytes end the walk early with the depth seen so far: judging them is the typed
    decoder's job, this only makes sure that decoder never meets more than ``limit`` levels."""
    pending: list[int] = []  # items still to read in each open container, innermost last
    pos, end, deepest, budget = 0, len(body), 0, max_items
    while pos < end:
        budget -= 1
        if budget < 0:
            return None
        b = body[pos]
        size = _SIZE[b]
        pos += 1
        opened = 0
        if size >= 0:
            pos += size
        elif size == -2:
            break
        elif b < 0xA0:
            opened = (b & 0x0F) * (2 if b < 0x90 else 1)
            if opened == 0:
                opened = -1  # an empty container still counts as a level
        elif b in _CONTAINERS:
            width, per = _CONTAINERS[b]
            opened = int.from_bytes(body[pos : pos + width], "big") * per or -1
            pos += width
        else:
            width, extra = _LENGTH_PREFIXED[b]
            pos += width + extra + int.from_bytes(body[pos : pos + width], "big")
        if opened:
            if len(pending) + 1 > deepest:
                deepest = len(pending) + 1
                if deepest > limit:
                    return deepest
            if opened > 0:
                pending.append(opened)
                continue
        # One item ended (a scalar or an empty container): close every container it completes.
        while pending:
            pending[-1] -= 1
            if pending[-1]:
                break
            pending.pop()
    return deepest

"""The last incompatibility each peer's side channel showed this process, in words, for HTTP errors.

Why this exists: a decode engine whose handshake with P is refused learns the reason in the handshake
layer (``IncompatiblePeer``: which compat fields differ), while the connector reports the failed KV load to
the engine by reason code only (``FailReason``). The engine looks the words up here by P's address, so the
client's error names the differing fields (``model_id 'kvwire-tiny/seed2' here vs ... at the peer``)
instead of a bare ``handshake_failed``. A later successful handshake with the same address clears it.
Only the field comparison is kept, never an address (the text reaches HTTP clients).
"""

from __future__ import annotations

import threading

_MAX = 256  # peers remembered; a process talks to a handful
# Characters kept per peer: the text quotes the peer's own fields (its model id...), which it chooses.
MAX_DETAIL = 512
_lock = threading.Lock()
_last: dict[tuple[str, int], str] = {}


def clip(detail: str) -> str:
    """``detail``, cut to ``MAX_DETAIL`` characters."""
    return detail if len(detail) <= MAX_DETAIL else detail[: MAX_DETAIL - 3] + "..."


def record(host: str, port: int, detail: str) -> None:
    detail = clip(detail)
    with _lock:
        _last.pop((host, port), None)
        if len(_last) >= _MAX:
            del _last[next(iter(_last))]
        _last[(host, port)] = detail


def clear(host: str, port: int) -> None:
    with _lock:
        _last.pop((host, port), None)


def incompatibility(host: str, port: int) -> str | None:
    """Why the side channel at ``host:port`` was last found incompatible (None: it was not, or a later
    handshake with it succeeded)."""
    with _lock:
        return _last.get((host, port))

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
_lock = threading.Lock()
_last: dict[tuple[str, int], str] = {}


def record(host: str, port: int, detail: str) -> None:
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

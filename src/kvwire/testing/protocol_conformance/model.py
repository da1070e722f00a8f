"""What a conformance check is, what it returns, and the context checks share."""

from __future__ import annotations

import enum
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from kvwire.protocol.messages import Metadata
from kvwire.testing.protocol_conformance.wire import CheckFailed, Target, fetch_metadata


class Role(enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"


class Status(enum.Enum):
    PASS = "pass"
    FAIL = "fail"
    SKIP = "skip"


@dataclass
class Context:
    """What the checks of one run share: the target, its role, and its metadata once fetched."""

    target: Target
    role: Role
    listen_host: str = "127.0.0.1"  # where the kit's own side channel listens (notification checks)
    shared: dict[str, object] = field(default_factory=dict)  # what one check leaves for the next
    closers: list[Callable[[], Awaitable[None]]] = field(default_factory=list)  # run once all ended
    _metadata: Metadata | None = field(default=None, repr=False)

    async def metadata(self) -> Metadata:
        """The target's full metadata (fetched once; a failure fails every check that needs it)."""
        if self._metadata is None:
            try:
                self._metadata = await fetch_metadata(self.target, notif_only=False)
            except CheckFailed as exc:
                raise CheckFailed(f"needs the target's metadata, which failed: {exc}") from None
        return self._metadata


@dataclass(frozen=True)
class Check:
    """One rule of docs/protocol.md and how to test it over the wire. ``run`` returns what it saw when
    the peer follows the rule, raises ``CheckFailed`` when it does not, ``Skipped`` when it cannot tell."""

    name: str
    rule: str  # the section of docs/protocol.md that states it
    run: Callable[[Context], Awaitable[str]]
    roles: frozenset[Role] = frozenset(Role)
    secret: bool | None = None  # True: only with a secret; False: only without; None: either way
    slow: bool = False  # takes the protocol's own timers (seconds): only with --slow


class Skipped(Exception):
    """The check cannot run here (e.g. no NIXL): reported, never a pass."""


@dataclass(frozen=True)
class Result:
    name: str
    rule: str
    status: Status
    detail: str
    seconds: float

    def as_json(self) -> dict[str, object]:
        return {
            "name": self.name,
            "rule": self.rule,
            "status": self.status.value,
            "detail": self.detail,
            "seconds": round(self.seconds, 3),
        }

"""Counting which P ranks of a request are registered and how each ended its registration (D side)."""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping

from kvwire.errors import UnexpectedSender

RankKey = tuple[int, int]  # (pp_rank, tp_rank) of a P rank


class RankEnd(enum.Enum):
    """How a P rank ended a registration."""

    DONE = "done"
    FAILED = "failed"
    CANCEL_ACKED = "cancel_acked"
    DEAD = "dead"  # no heartbeat within the liveness timeout, and the grace period passed
    NOT_REGISTERED = "not_registered"  # push_reg never sent: that rank cannot write


class RankTracker:
    """Which expected P ranks are registered and which ended, and how; refuses duplicates."""

    def __init__(self, expected: Iterable[RankKey]) -> None:
        self._expected = frozenset(expected)
        if not self._expected:
            raise UnexpectedSender("a request must expect at least one P rank")
        self._registered: set[RankKey] = set()
        self._ended: dict[RankKey, RankEnd] = {}
        self._pending: frozenset[RankKey] | None = None  # ``pending``, until a rank registers or ends

    @property
    def expected(self) -> frozenset[RankKey]:
        return self._expected

    @property
    def ended(self) -> Mapping[RankKey, RankEnd]:
        return dict(self._ended)

    @property
    def pending(self) -> frozenset[RankKey]:
        """Registered ranks that have not ended: the ones that may still write (and must get ``cancel``)."""
        pending = self._pending
        if pending is None:  # asked at every timer pass of every live request: computed once per change
            pending = self._pending = frozenset(self._registered - self._ended.keys())
        return pending

    @property
    def all_registered(self) -> bool:
        return self._registered == self._expected

    @property
    def all_done(self) -> bool:
        return len(self._ended) == len(self._expected) and all(
            e is RankEnd.DONE for e in self._ended.values()
        )

    @property
    def all_ended(self) -> bool:
        return len(self._ended) == len(self._expected)

    def _check_known(self, rank: RankKey) -> None:
        if rank not in self._expected:
            raise UnexpectedSender(f"rank (pp={rank[0]}, tp={rank[1]}) is not one this request expects")
        if rank in self._ended:
            raise UnexpectedSender(
                f"rank (pp={rank[0]}, tp={rank[1]}) already ended ({self._ended[rank].value})"
            )

    def register(self, rank: RankKey) -> None:
        self._check_known(rank)
        if rank in self._registered:
            raise UnexpectedSender(f"rank (pp={rank[0]}, tp={rank[1]}) is already registered")
        self._registered.add(rank)
        self._pending = None

    def end(self, rank: RankKey, how: RankEnd) -> None:
        self._check_known(rank)
        if how is RankEnd.NOT_REGISTERED or rank not in self._registered:
            raise UnexpectedSender(f"rank (pp={rank[0]}, tp={rank[1]}) cannot end as {how.value}")
        self._ended[rank] = how
        self._pending = None

    def abandon_unregistered(self) -> None:
        """No more ``push_reg`` will be sent: ranks never registered count as ended."""
        for rank in self._expected - self._registered:
            self._ended.setdefault(rank, RankEnd.NOT_REGISTERED)
        self._pending = None

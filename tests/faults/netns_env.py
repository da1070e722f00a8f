"""The namespace pair the netns fault tests share (their ``net`` fixtures yield from ``netns_pair``)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvwire.testing.netns import NetnsPair, unavailable_reason


def netns_pair(*, nixl: bool) -> Iterator[NetnsPair]:
    """A fresh pair of namespaces, skipped with the reason where this host cannot make one (no root, no
    ip netns or nft) or, with ``nixl``, where the NIXL backend is not installed."""
    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(f"network namespaces unavailable: {reason}")
    if nixl:
        pytest.importorskip("nixl._api", reason="the NIXL backend is not installed")
    with NetnsPair() as pair:
        yield pair

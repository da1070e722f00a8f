"""Transfer cases shared by ``bench transfer`` and ``bench gpu-check``: a case's shape, the one buffer size
that fits a list of them, which blocks move, and the raw-NIXL baseline's repost. numpy only, so the GPU
check imports nothing heavier."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvwire.errors import TransferFailed


@dataclass(frozen=True, slots=True)
class Case:
    name: str
    blocks: int
    block: int
    scattered: bool

    @property
    def nbytes(self) -> int:
        return self.blocks * self.block


def buffer_bytes(cases: Sequence[Case]) -> int:
    """One buffer size for P's source and D's target that fits every case (a scatter spans 2x)."""
    return max(c.nbytes * (2 if c.scattered else 1) for c in cases)


@dataclass(slots=True)
class Layout:
    """Which blocks move for one case: indices into P's and D's buffers cut into ``case.block`` blocks."""

    src_idx: np.ndarray
    dst_idx: np.ndarray


def layout(case: Case, dst_bytes: int, rng: np.random.Generator) -> Layout:
    if not case.scattered:
        return Layout(np.zeros(1, dtype=np.int64), np.zeros(1, dtype=np.int64))
    n_dst = dst_bytes // case.block
    return Layout(np.arange(case.blocks), rng.choice(n_dst, size=case.blocks, replace=False))


def repost_raw(raw: Any, handle: Any, what: str, limit_s: float) -> None:
    """Post a prepared raw NIXL transfer (``nixl_agent`` handle) again and poll it to DONE: the baseline
    every bench compares kvwire's path with (no kvwire code between the two)."""
    state = raw.transfer(handle)
    deadline = time.monotonic() + limit_s
    while state == "PROC" and time.monotonic() < deadline:
        state = raw.check_xfer_state(handle)
    if state != "DONE":
        raise TransferFailed(f"{what} ended {state}")

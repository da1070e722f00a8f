"""One chaos request: send it through the router, classify how it ended, judge its tokens.

Every request ends in exactly one final state. An answer that completed is compared token for token with
the colocated reference; so is the part of an answer that broke off mid-stream (what arrived must be a
prefix of the reference). Anything else is ``corrupted``: a request served with wrong KV.
"""

from __future__ import annotations

import enum
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

# Lines a stream may carry per requested token (one chunk each), plus the final chunks and blank lines.
_LINES_PER_TOKEN = 4
_EXTRA_LINES = 64
_CONNECT_TIMEOUT_S = 5.0


class Final(enum.Enum):
    OK = "ok"
    CORRUPTED = "corrupted"
    HTTP_ERROR = "http"  # an error status before any token: the detail is the status and error type
    STREAM_ERROR = "stream_error"  # an SSE error event after some tokens
    TRUNCATED = "truncated"  # the stream ended without [DONE] or carried something unreadable
    TIMEOUT = "timeout"
    CONNECTION_ERROR = "connection_error"  # the router itself could not be reached or dropped us
    NOT_RUN = "not_run"  # the run's deadline passed before the request started


@dataclass
class RequestRecord:
    index: int
    prompt_id: int
    start: float = 0.0
    end: float = 0.0
    final: Final = Final.NOT_RUN
    detail: str = ""
    token_ids: list[int] = field(default_factory=list)

    @property
    def state(self) -> str:
        """The key this request is counted under in ``by_state`` (corrupted ones all under one key)."""
        name: str = self.final.value
        if self.final is Final.CORRUPTED or not self.detail:
            return name
        return f"{name}_{self.detail}"

    @property
    def ran(self) -> bool:
        return self.final is not Final.NOT_RUN


def _error_type(resp: httpx.Response) -> str:
    try:
        err = resp.json().get("error")
        return str(err.get("type") or "error") if isinstance(err, dict) else "error"
    except (ValueError, AttributeError):
        return "unreadable"


def send(
    client: httpx.Client, url: str, model: str, prompt: str, max_tokens: int, timeout_s: float
) -> tuple[Final, str, list[int]]:
    """POST one streaming completion; return how it ended, a detail, and the token ids received."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True, "temperature": 0}
    tokens: list[int] = []
    deadline = time.monotonic() + timeout_s
    timeout = httpx.Timeout(timeout_s, connect=min(timeout_s, _CONNECT_TIMEOUT_S))
    try:
        with client.stream("POST", url + "/v1/completions", json=body, timeout=timeout) as resp:
            if resp.status_code != 200:
                resp.read()
                return Final.HTTP_ERROR, f"{resp.status_code}_{_error_type(resp)}", tokens
            lines = resp.iter_lines()
            for _ in range(max_tokens * _LINES_PER_TOKEN + _EXTRA_LINES):
                if time.monotonic() > deadline:
                    return Final.TIMEOUT, "", tokens
                line = next(lines, None)
                if line is None:
                    return Final.TRUNCATED, "", tokens
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    return Final.OK, "", tokens
                ended = _take(json.loads(data), tokens)
                if ended is not None:
                    return Final.STREAM_ERROR, ended, tokens
            return Final.TRUNCATED, "too_many_events", tokens
    except httpx.TimeoutException:
        return Final.TIMEOUT, "", tokens
    except httpx.HTTPError as exc:
        return Final.CONNECTION_ERROR, type(exc).__name__, tokens
    except (ValueError, TypeError, AttributeError):
        return Final.TRUNCATED, "malformed", tokens


def _take(event: Any, tokens: list[int]) -> str | None:
    """Add an event's token ids; the error type if it is an error event."""
    err = event.get("error")
    if err is not None:
        return str(err.get("type") or "error") if isinstance(err, dict) else "error"
    choices = event.get("choices")
    if isinstance(choices, list) and choices:
        tokens.extend(int(t) for t in choices[0].get("token_ids") or ())
    return None


def judge(record: RequestRecord, reference: Sequence[int]) -> None:
    """Mark the record corrupted if its tokens disagree with the reference (all of it, or a prefix)."""
    got, want = record.token_ids, list(reference)
    # A complete answer must equal the reference; a broken-off one must be a prefix of it.
    expected = want if record.final is Final.OK else want[: len(got)]
    if got != expected:
        record.detail = record.state  # how it ended, for the error lines
        record.final = Final.CORRUPTED


def first_difference(got: Sequence[int], want: Sequence[int]) -> str:
    for i, (a, b) in enumerate(zip(got, want, strict=False)):
        if a != b:
            return f"token {i}: {a} != {b} (reference)"
    return f"{len(got)} tokens, the reference has {len(want)}"

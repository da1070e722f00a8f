"""What the client saw of one answer, for the router's metrics: its outcome (an error's type mapped to a
request outcome) and its latency (time to first token, the gaps between tokens), from a unary result or
from the events of a stream."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvwire.metrics import Outcome
from kvwire.router.openai_api import ErrorType

# The outcome counted for a request answered with an error of this type.
OUTCOME_OF = {
    ErrorType.INVALID_REQUEST: Outcome.BAD_REQUEST,
    ErrorType.NOT_FOUND: Outcome.BAD_REQUEST,
    ErrorType.ENGINE_ERROR: Outcome.ENGINE_ERROR,
    ErrorType.INTERNAL: Outcome.ENGINE_ERROR,
    ErrorType.UNAVAILABLE: Outcome.UNAVAILABLE,
    ErrorType.TIMEOUT: Outcome.TIMEOUT,
    ErrorType.MISCONFIGURED: Outcome.ENGINE_ERROR,
}


@dataclass(frozen=True)
class Latency:
    """What the client saw of one answered request: time to its first token and the gaps between tokens."""

    ttft_s: float | None = None
    token_gaps_s: tuple[float, ...] = ()


def unary_latency(result: Mapping[str, Any], sent_s: float, total_s: float) -> Latency:
    """A non-streamed answer's latencies: D's own time to first token (its ``timings``) after the router
    sent D's leg, and the rest of the request spread evenly over the other tokens."""
    timings = result.get("timings")
    ttft_ms = timings.get("ttft_ms") if isinstance(timings, dict) else None
    ttft_s = min(sent_s + ttft_ms / 1e3, total_s) if isinstance(ttft_ms, int | float) else total_s
    usage = result.get("usage")
    tokens = usage.get("completion_tokens") if isinstance(usage, dict) else None
    if not isinstance(tokens, int) or tokens < 2:
        return Latency(ttft_s)
    gap = (total_s - ttft_s) / (tokens - 1)
    return Latency(ttft_s, (gap,) * (tokens - 1))


def event_tokens(event: Mapping[str, Any]) -> int:
    """Output tokens in one engine SSE event (kvwire sends their ids; otherwise one per text chunk, or
    per chat delta with content: a chat engine's role-only opening delta is no token)."""
    choices = event.get("choices")
    choice = choices[0] if isinstance(choices, list) and choices and isinstance(choices[0], dict) else {}
    ids = choice.get("token_ids")
    if isinstance(ids, list):
        return len(ids)
    delta = choice.get("delta")
    if isinstance(delta, dict):
        return 1 if any(v for k, v in delta.items() if k != "role") else 0
    return 1 if choice.get("text") else 0

"""The demo's requests: deterministic prompts of varied lengths, and one timed streaming completion.

Prompts are ASCII, so with the engine's byte-level tokenizer a prompt of ``n - 1`` characters is ``n``
tokens (one BOS). Lengths are spread geometrically from the shortest to the longest (both included), so
short and long prompts are both well represented, then shuffled by the seed.
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass, field

import httpx

from kvwire.errors import KvwireError

_TEXT = (
    "the quick brown fox jumps over a lazy dog while kv caches move from prefill to decode engines over "
    "nixl in push mode so decode registers blocks and prefill writes them then notifies with done and "
    "every token matches the colocated reference bit for bit"
)
_WORDS = tuple(_TEXT.split(" "))


class RequestFailed(KvwireError):
    """A demo request got an error answer or a malformed stream."""


def prompt_lengths(n: int, shortest: int, longest: int, seed: int) -> list[int]:
    """``n`` prompt lengths in tokens, geometric from ``shortest`` to ``longest``, shuffled by ``seed``."""
    if n == 1:
        return [longest]
    ratio = longest / shortest
    lengths = [round(shortest * ratio ** (i / (n - 1))) for i in range(n)]
    random.Random(seed).shuffle(lengths)
    return lengths


def make_prompt(num_tokens: int, rng: random.Random) -> str:
    """ASCII text of exactly ``num_tokens - 1`` characters (the engine adds BOS)."""
    size = max(1, num_tokens - 1)
    words: list[str] = []
    joined = -1  # length of " ".join(words)
    while joined < size:
        word = rng.choice(_WORDS)
        words.append(word)
        joined += len(word) + 1
    return " ".join(words)[:size]


def make_prompts(n: int, shortest: int, longest: int, seed: int) -> list[str]:
    rng = random.Random(seed + 1)
    return [make_prompt(k, rng) for k in prompt_lengths(n, shortest, longest, seed)]


@dataclass
class Result:
    """One streamed completion, timed at the client."""

    prompt_tokens: int
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    ttft_s: float = 0.0
    total_s: float = 0.0
    timings: dict[str, object] | None = None

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first."""
        n = len(self.token_ids)
        return (self.total_s - self.ttft_s) / (n - 1) if n > 1 else None


def stream_completion(
    client: httpx.Client, url: str, model: str, prompt: str, max_tokens: int, timeout_s: float
) -> Result:
    """POST a streaming completion to ``url`` and collect its tokens, TTFT and total time."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True, "temperature": 0}
    result = Result(prompt_tokens=len(prompt.encode()) + 1)
    start = time.perf_counter()
    with client.stream("POST", url + "/v1/completions", json=body, timeout=timeout_s) as resp:
        if resp.status_code != 200:
            resp.read()
            raise RequestFailed(f"{url}: HTTP {resp.status_code}: {resp.text[:300]}")
        for line in resp.iter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            _take_event(result, json.loads(data), start)
    result.total_s = time.perf_counter() - start
    if not result.token_ids and not result.text:
        raise RequestFailed(f"{url}: the stream carried no tokens")
    return result


def _take_event(result: Result, event: dict[str, object], start: float) -> None:
    err = event.get("error")
    if err is not None:
        raise RequestFailed(f"stream error: {err}")
    choices = event.get("choices")
    if isinstance(event.get("timings"), dict):
        result.timings = event["timings"]  # type: ignore[assignment]
    if not isinstance(choices, list) or not choices:
        return
    choice = choices[0]
    ids = choice.get("token_ids") or []
    text = choice.get("text") or ""
    if (ids or text) and not result.token_ids and not result.text:
        result.ttft_s = time.perf_counter() - start
    result.token_ids.extend(int(t) for t in ids)
    result.text += text

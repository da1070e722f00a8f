"""Sampling for the reference engine: temperature, top-k, top-p, seeds, ``min_tokens``, stop strings and
logprobs.

Exactness rule: a token depends only on the logits, the request's ``SamplingParams`` and its index in the
output. The random draw for output token ``i`` comes from a generator seeded with ``(seed, i)``, created for
that token alone, so which engine samples it (P's first token, D's decode, a colocated engine), in which
step batch and after how many other requests, never changes it: disaggregated output equals colocated
output for the same seed, as it does for greedy decoding.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvwire.engine.tokenizer import BOS, EOS

_SEED_MODULUS = 2**64  # SeedSequence takes non-negative entropy; OpenAI seeds may be negative


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """A request's sampling, resolved (``stop`` as token ids, ``seed`` always set)."""

    temperature: float = 0.0  # 0: greedy (argmax), the other fields but stops and min_tokens unused
    top_p: float = 1.0
    top_k: int = -1  # <= 0: off
    seed: int = 0
    min_tokens: int = 0
    stop: tuple[tuple[int, ...], ...] = ()
    logprobs: int | None = None  # None: none; n: the sampled token's and the n most likely


GREEDY = SamplingParams()


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """One output token's log-probability under the model (raw logits, before temperature or top-k/p, as
    vLLM reports them) and the ``n`` most likely tokens at its position."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]


def _masked(logits: np.ndarray, params: SamplingParams, index: int) -> np.ndarray:
    if index < params.min_tokens:
        # min_tokens: EOS cannot be chosen before it (vLLM masks the stop tokens the same way).
        logits = logits.copy()
        logits[EOS] = -np.inf
    return logits


def sample(logits: np.ndarray, params: SamplingParams, index: int) -> int:
    """The output token at ``index`` (0 for the first): argmax at temperature 0, else a seeded draw."""
    x = _masked(logits, params, index).astype(np.float64)
    if params.temperature == 0:
        return int(np.argmax(x))
    x /= params.temperature
    # A stable sort: equal logits keep token order, so the candidate list is the same everywhere.
    order = np.argsort(-x, kind="stable")
    if params.top_k > 0:
        order = order[: params.top_k]
    probs = np.exp(x[order] - x[order[0]])
    probs /= probs.sum()
    cdf = np.cumsum(probs)
    if params.top_p < 1.0:
        # The smallest prefix whose mass reaches top_p (at least one token).
        keep = min(int(np.searchsorted(cdf, params.top_p)) + 1, len(order))
        order, cdf = order[:keep], cdf[:keep] / cdf[keep - 1]
    u = np.random.default_rng((params.seed % _SEED_MODULUS, index)).random()
    pick = min(int(np.searchsorted(cdf, u, side="right")), len(order) - 1)
    return int(order[pick])


def token_logprob(logits: np.ndarray, token: int, n: int) -> TokenLogprob:
    """``token``'s log-probability and the ``n`` most likely tokens (stable order on ties)."""
    x = logits.astype(np.float64)
    shifted = x - x.max()
    logp = shifted - np.log(np.exp(shifted).sum())
    top = np.argsort(-logp, kind="stable")[:n]
    return TokenLogprob(token, float(logp[token]), tuple((int(t), float(logp[t])) for t in top))


class StopMatcher:
    """The stop sequences against an output that grows a token at a time: each one's longest prefix the
    output ends with (Knuth-Morris-Pratt), O(1) a token amortized. Comparing slices at every step cost
    O(len(stop)^2) a step, on the engine's one thread: 16 stops of 8,000 characters held it 2.4 s a
    step at 4,000 output tokens, every other request waiting."""

    def __init__(self, stops: Sequence[Sequence[int]]) -> None:
        self.stops = [tuple(s) for s in stops]
        self._fail = [_failure(s) for s in self.stops]
        self._state = [0] * len(self.stops)

    def feed(self, token: int) -> int | None:
        """Advance by ``token``; the length of the first stop sequence the output now ends with, if any."""
        hit = None
        for i, stop in enumerate(self.stops):
            k, fail = self._state[i], self._fail[i]
            while k and stop[k] != token:
                k = fail[k - 1]
            if stop[k] == token:
                k += 1
            if k == len(stop):
                hit = len(stop) if hit is None else hit
                k = fail[k - 1]
            self._state[i] = k
        return hit

    @property
    def held(self) -> int:
        """How many trailing tokens could still begin a stop sequence (a stream holds them back)."""
        return max(self._state, default=0)


def _failure(stop: Sequence[int]) -> list[int]:
    """KMP's table: for each prefix of ``stop``, the length of its longest proper border."""
    fail, k = [0] * len(stop), 0
    for i in range(1, len(stop)):
        while k and stop[i] != stop[k]:
            k = fail[k - 1]
        if stop[i] == stop[k]:
            k += 1
        fail[i] = k
    return fail


def token_text(token: int) -> str:
    """The name of a byte token in logprobs: the character for ASCII, ``bytes:\\xNN`` otherwise (a lone
    byte of a multi-byte character is no text), ``<|bos|>``/``<|eos|>`` for the special tokens."""
    if token == BOS:
        return "<|bos|>"
    if token == EOS:
        return "<|eos|>"
    if 0 <= token < 128:
        return chr(token)
    return f"bytes:\\x{token:02x}"

"""Sampling in the reference engine: seeded draws that depend only on (seed, token index), top-k/top-p,
min_tokens, stop strings (cut, and held back while a stream could still match one), logprobs."""

from __future__ import annotations

import time

import numpy as np
import pytest

from kvwire.engine.config import EngineConfig, Role, preset
from kvwire.engine.engine import Engine
from kvwire.engine.loopback import LoopbackHub
from kvwire.engine.model import Model
from kvwire.engine.request import Request, RequestOutput, RequestState, TransferRole
from kvwire.engine.sampling import SamplingParams, StopMatcher, sample, token_logprob, token_text
from kvwire.engine.tokenizer import EOS, ByteTokenizer
from kvwire.kv_params import KvTransferParams

TINY = preset("tiny")
MODEL = Model(TINY, seed=0)
TOK = ByteTokenizer()
HOT = SamplingParams(temperature=1.0, seed=1234)


def engine(role: Role = Role.COLOCATED) -> Engine:
    return Engine(EngineConfig(TINY, role=role, num_blocks=256), model=MODEL)


def colocated(prompt: str, n: int, params: SamplingParams, *, alone: bool = True) -> list[int]:
    ps = [TOK.encode(prompt)] if alone else [TOK.encode("other " * k) for k in (1, 5)] + [TOK.encode(prompt)]
    return engine().generate(ps, n, ignore_eos=True, sampling=params)[-1]


def test_temperature_zero_is_greedy_and_the_seed_does_not_matter() -> None:
    greedy = colocated("abc", 8, SamplingParams())
    assert colocated("abc", 8, SamplingParams(seed=99)) == greedy
    # top_k=1 leaves only the argmax, whatever the temperature
    assert colocated("abc", 8, SamplingParams(temperature=2.0, top_k=1, seed=5)) == greedy


def test_same_seed_same_tokens_whatever_the_batch() -> None:
    alone = colocated("sample me", 10, HOT)
    assert alone == colocated("sample me", 10, HOT, alone=False)
    assert alone != colocated("sample me", 10, SamplingParams(temperature=1.0, seed=1235))
    assert alone != colocated("sample me", 10, SamplingParams())


def test_disaggregated_sampling_equals_colocated() -> None:
    """P samples the first token (and the router drops it), D samples every token again: same rule."""
    prompt = TOK.encode("a prompt that spans more than one block of sixteen tokens")
    params = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=7, logprobs=2)
    hub = LoopbackHub()
    p, d = engine(Role.PREFILL), engine(Role.DECODE)
    p.set_hooks(hub.producer(p.kv))
    d.set_hooks(hub.consumer(d.kv))
    p_req = Request("p", prompt, 1, role=TransferRole.REMOTE_DECODE, transfer_id="t", sampling=params)
    d_req = Request(
        "d", prompt, 12, ignore_eos=True, role=TransferRole.REMOTE_PREFILL, transfer_id="t", sampling=params
    )
    d_req.kv_transfer_params = KvTransferParams(transfer_id="t")
    p.submit(p_req)
    d.submit(d_req)
    for _ in range(200):
        d.step()
        p.step()
        if d_req.state.finished and not p.scheduler.has_lent_blocks():
            break
    assert d_req.state is RequestState.FINISHED_LENGTH
    ref = Request("c", prompt, 12, ignore_eos=True, sampling=params)
    c = engine()
    c.submit(ref)
    c.run_until_idle()
    assert d_req.output_ids == ref.output_ids
    assert p_req.output_ids == ref.output_ids[:1]
    assert d_req.token_logprobs == ref.token_logprobs


def test_top_p_keeps_the_smallest_nucleus() -> None:
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05]))
    picks = {sample(logits, SamplingParams(temperature=1.0, top_p=0.75, seed=s), 0) for s in range(200)}
    assert picks == {0, 1}
    picks = {sample(logits, SamplingParams(temperature=1.0, top_k=3, seed=s), 0) for s in range(200)}
    assert picks == {0, 1, 2}


def test_min_tokens_masks_eos() -> None:
    logits = np.zeros(TINY.vocab_size)
    logits[EOS] = 100.0
    params = SamplingParams(min_tokens=2)
    assert sample(logits, params, 0) != EOS and sample(logits, params, 1) != EOS
    assert sample(logits, params, 2) == EOS


def test_logprobs_are_the_model_distribution() -> None:
    logits = np.array([2.0, 1.0, 0.0, 3.0])
    lp = token_logprob(logits, 1, 2)
    ref = logits - np.log(np.exp(logits).sum())
    assert lp.logprob == pytest.approx(ref[1])
    assert [t for t, _ in lp.top] == [3, 0]
    assert [token_text(t) for t in (65, 0xE2, EOS)] == ["A", "bytes:\\xe2", "<|eos|>"]


def _stop_start(output: list[int], stops: list[list[int]]) -> int | None:
    """Where a stop sequence ending the output begins, by comparing slices (the reference)."""
    for stop in stops:
        if len(output) >= len(stop) and output[len(output) - len(stop) :] == stop:
            return len(output) - len(stop)
    return None


def _held_back(output: list[int], stops: list[list[int]]) -> int:
    """The longest proper prefix of a stop sequence the output ends with, by comparing slices."""
    return max(
        (k for stop in stops for k in range(1, min(len(stop) - 1, len(output)) + 1)
         if output[len(output) - k :] == stop[:k]),
        default=0,
    )  # fmt: skip


def test_the_stop_matcher_agrees_with_comparing_slices() -> None:
    rng = np.random.default_rng(5)
    for _ in range(300):
        stops = [
            list(rng.integers(0, 3, size=int(rng.integers(1, 6)))) for _ in range(int(rng.integers(1, 4)))
        ]
        matcher, out = StopMatcher(stops), []
        for token in rng.integers(0, 3, size=40).tolist():
            out.append(token)
            hit = matcher.feed(token)
            start = _stop_start(out, stops)
            assert (None if hit is None else len(out) - hit) == start, (stops, out)
            assert matcher.held == _held_back(out, stops), (stops, out)


def test_the_stop_matcher_costs_no_more_per_token_with_long_stops() -> None:
    """16 stops of 8,000 of one token against an output of that token: comparing slices at every step
    cost seconds a step at 4,000 output tokens; the matcher is amortized O(1) a token per stop."""
    stops = [[7] * 8000 for _ in range(16)]
    matcher = StopMatcher(stops)
    start = time.perf_counter()
    for _ in range(4000):
        assert matcher.feed(7) is None
    assert matcher.held == 4000 and time.perf_counter() - start < 1.0


def _run(prompt: list[int], n: int, params: SamplingParams) -> tuple[Request, list[RequestOutput]]:
    outs: list[RequestOutput] = []
    req = Request("r", prompt, n, ignore_eos=True, sampling=params, on_output=outs.append)
    e = engine()
    e.submit(req)
    e.run_until_idle()
    return req, outs


def test_stop_string_cuts_the_output_and_a_stream_never_shows_part_of_it() -> None:
    prompt = TOK.encode("stop here")
    full = colocated("stop here", 12, SamplingParams())
    stop = tuple(full[5:8])  # three bytes in the middle of the greedy answer
    req, outs = _run(prompt, 12, SamplingParams(stop=(stop,)))
    assert req.state is RequestState.FINISHED_STOPPED and outs[-1].finish_reason is not None
    streamed = [t for o in outs for t in o.new_token_ids]
    assert streamed == full[:5]
    # the stop's first bytes were held back (not sent) until the match was certain
    assert all(len(o.new_token_ids) <= 1 for o in outs)
    assert [len(o.new_token_ids) for o in outs[-3:]] == [0, 0, 0]


def test_stop_string_not_matched_releases_held_tokens() -> None:
    prompt = TOK.encode("stop here")
    full = colocated("stop here", 6, SamplingParams())
    stop = (full[4], 1000)  # its first byte appears, the rest never does
    req, outs = _run(prompt, 6, SamplingParams(stop=(stop,)))
    assert req.state is RequestState.FINISHED_LENGTH
    assert [t for o in outs for t in o.new_token_ids] == full


def test_stop_strings_wait_for_min_tokens() -> None:
    full = colocated("stop here", 8, SamplingParams())
    req, _ = _run(TOK.encode("stop here"), 8, SamplingParams(stop=((full[0],),), min_tokens=3))
    # the stop matches the first token, but is only looked for from the third on
    assert len(req.output_ids) >= 3 and req.output_ids[0] == full[0]

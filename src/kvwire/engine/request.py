"""A request inside the engine: its state machine, its blocks, and what it reports after each step."""

from __future__ import annotations

import dataclasses
import enum
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvwire.engine.sampling import GREEDY, SamplingParams, StopMatcher, TokenLogprob
from kvwire.kv_params import KvTransferParams


class RequestState(enum.Enum):
    WAITING = "waiting"  # queued, no blocks yet
    WAITING_FOR_KV = "waiting_for_kv"  # D: blocks allocated and handed to the connector
    RECOMPUTE_PENDING = "recompute_pending"  # D: load failed; waits for the blocks' release to prefill
    RUNNING = "running"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"
    FINISHED_ERROR = "finished_error"

    @property
    def finished(self) -> bool:
        return self in _FINISHED


_FINISHED = frozenset(
    {
        RequestState.FINISHED_STOPPED,
        RequestState.FINISHED_LENGTH,
        RequestState.FINISHED_ABORTED,
        RequestState.FINISHED_ERROR,
    }
)


class TransferRole(enum.Enum):
    """The request's part in a disaggregated pair (vLLM's names)."""

    NONE = "none"
    REMOTE_DECODE = "do_remote_decode"  # on P: prefill here, the KV goes to a decoder
    REMOTE_PREFILL = "do_remote_prefill"  # on D: the KV comes from a prefiller


class FinishReason(enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"


_REASON = {
    RequestState.FINISHED_STOPPED: FinishReason.STOP,
    RequestState.FINISHED_LENGTH: FinishReason.LENGTH,
    RequestState.FINISHED_ABORTED: FinishReason.ABORT,
    RequestState.FINISHED_ERROR: FinishReason.ERROR,
}


@dataclass(frozen=True, slots=True)
class RequestOutput:
    """New tokens of one request after one engine step (or its end)."""

    request_id: str
    new_token_ids: tuple[int, ...]
    finished: bool
    finish_reason: FinishReason | None = None
    error: Exception | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    ttft_s: float | None = None
    kv_transfer_s: float | None = None
    logprobs: tuple[TokenLogprob, ...] = ()  # of ``new_token_ids``, when the request asked for them


@dataclass(eq=False)
class Request:
    request_id: str
    prompt: list[int]
    max_tokens: int
    ignore_eos: bool = False
    role: TransferRole = TransferRole.NONE
    transfer_id: str | None = None
    kv_transfer_params: KvTransferParams | None = None  # parsed where the request came in
    sampling: SamplingParams = GREEDY
    on_output: Callable[[RequestOutput], None] | None = None
    # -- engine state --
    state: RequestState = RequestState.WAITING
    block_ids: list[int] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)
    needs_prefill: bool = True
    prefix_keys: list[bytes] | None = None  # prefix cache keys of the prompt's whole chunks (P, colocated)
    cached_tokens: int = 0  # leading prompt tokens found in the prefix cache: not prefilled
    error: Exception | None = None
    arrival: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None
    kv_wait_start: float | None = None
    kv_ready_at: float | None = None
    token_logprobs: list[TokenLogprob] = field(default_factory=list)
    released: int = 0  # output tokens already reported (a stream holds back a possible stop string)
    stop_at: int | None = None  # a stop string matched: the output ends before this index
    _stops: StopMatcher | None = None  # made at the first token when the sampling has stop strings
    _stop_hit: int | None = None  # the length of the stop string the output ends with, after the last token

    @property
    def next_position(self) -> int:
        """The position the next ``step`` computes: the last prompt token, then each sampled token."""
        return len(self.prompt) - 1 + len(self.output_ids)

    @property
    def next_token(self) -> int:
        return self.output_ids[-1] if self.output_ids else self.prompt[-1]

    @property
    def finish_reason(self) -> FinishReason | None:
        return _REASON.get(self.state)

    def add_token(self, token: int) -> None:
        """A sampled token joins the output (every one: the stop matcher follows the whole output)."""
        self.output_ids.append(token)
        if self.sampling.stop:
            if self._stops is None:
                self._stops = StopMatcher(self.sampling.stop)
            self._stop_hit = self._stops.feed(token)

    def matched_stop(self) -> bool:
        """Whether the output now ends with a stop string (not looked for before ``min_tokens``)."""
        if self._stop_hit is None or len(self.output_ids) < self.sampling.min_tokens:
            return False
        self.stop_at = len(self.output_ids) - self._stop_hit
        return True

    def release(self) -> RequestOutput:
        """The output of this step: the tokens no stop string can claim any more (all, once finished)."""
        if self.state.finished:
            end = self.stop_at if self.stop_at is not None else len(self.output_ids)
        else:
            end = len(self.output_ids) - (self._stops.held if self._stops is not None else 0)
        start, self.released = self.released, max(self.released, end)
        out = self.output(tuple(self.output_ids[start:end]))
        if self.sampling.logprobs is None:
            return out
        return dataclasses.replace(out, logprobs=tuple(self.token_logprobs[start:end]))

    def output(self, new: tuple[int, ...]) -> RequestOutput:
        ttft = None if self.first_token_at is None else self.first_token_at - self.arrival
        kv = None
        if self.kv_wait_start is not None and self.kv_ready_at is not None:
            kv = self.kv_ready_at - self.kv_wait_start
        return RequestOutput(
            request_id=self.request_id,
            new_token_ids=new,
            finished=self.state.finished,
            finish_reason=self.finish_reason,
            error=self.error,
            num_prompt_tokens=len(self.prompt),
            num_output_tokens=len(self.output_ids),
            ttft_s=ttft,
            kv_transfer_s=kv,
        )

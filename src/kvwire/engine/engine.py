"""The engine: a scheduler, a model and a paged cache, advanced one step at a time by one thread.

``submit`` and ``abort`` may be called from any thread (they queue and wake the engine); everything
else runs on the engine thread (``step``). Results go to each request's ``on_output`` callback, called
on the engine thread after every step that produced something for it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvwire.core.config import LoadFailurePolicy
from kvwire.engine.config import EngineConfig, Role
from kvwire.engine.hooks import ConsumerEvent, ConsumerEventKind, KVTransferHooks, TransferRequest
from kvwire.engine.model import Model
from kvwire.engine.paged import PagedKV
from kvwire.engine.request import Request, RequestOutput, RequestState, TransferRole
from kvwire.engine.sampling import GREEDY, SamplingParams, sample, token_logprob
from kvwire.engine.scheduler import Scheduler
from kvwire.engine.tokenizer import EOS, ByteTokenizer
from kvwire.errors import EngineOverloaded, InvalidRequest, KVLoadFailed, KvwireError, UnknownTransfer
from kvwire.handshake import refusals
from kvwire.protocol.messages import FailReason

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Load:
    running: int
    waiting: int
    free_blocks: int  # free and evictable cached blocks
    cached_blocks: int = 0  # blocks the prefix cache holds
    prefix_query_tokens: int = 0  # prompt tokens admitted with the prefix cache on, since start
    prefix_hit_tokens: int = 0  # of which were found there (not prefilled)
    prefix_cache: bool = False

    def report(self) -> dict[str, int]:
        """``/health``'s and the etcd record's ``load`` (the prefix cache's figures when it is on)."""
        out = {"running": self.running, "waiting": self.waiting, "free_blocks": self.free_blocks}
        if self.prefix_cache:
            out |= {
                "cached_blocks": self.cached_blocks,
                "prefix_query_tokens": self.prefix_query_tokens,
                "prefix_hit_tokens": self.prefix_hit_tokens,
            }
        return out


def _load_failed(req: Request, reason: str) -> KVLoadFailed:
    """The request's error; a failed handshake with an incompatible P says what differs (the connector
    reports a reason code only, the handshake layer kept the words: ``handshake.refusals``)."""
    assert req.transfer_id is not None
    params = req.kv_transfer_params
    host, port = (params.remote_host, params.remote_port) if params is not None else (None, None)
    if reason in _HANDSHAKE_REASONS and host is not None and port is not None:
        detail = refusals.incompatibility(host, port)
        if detail is not None:
            return KVLoadFailed(req.transfer_id, FailReason.INCOMPATIBLE.value, detail)
    return KVLoadFailed(req.transfer_id, reason)


_HANDSHAKE_REASONS = frozenset({FailReason.HANDSHAKE_FAILED.value, FailReason.INCOMPATIBLE.value})


class Engine:
    def __init__(
        self,
        cfg: EngineConfig,
        hooks: KVTransferHooks | None = None,
        *,
        model: Model | None = None,
        prefault: bool = False,
    ) -> None:
        self.cfg = cfg
        self.model = model if model is not None else Model(cfg.model, cfg.seed)
        self.kv = PagedKV(
            cfg.model.kv_spec(),
            cfg.num_blocks,
            q_heads=cfg.model.q_heads,
            tp_size=cfg.tp_size,
            pp_size=cfg.pp_size,
        )
        if prefault:
            # Touch every page now: otherwise the first requests pay the kernel's page faults (1 GiB
            # for kv-heavy), which shows up as prefill time and transfer time.
            for cache in self.kv.caches.values():
                cache.slab.fill(0)
        self.scheduler = Scheduler(cfg, self.kv.allocator)
        self.tokenizer = ByteTokenizer()
        self._lock = threading.Lock()
        self._inbox: deque[Request | str] = deque()  # a Request to add, or a request id to abort
        self._wake = threading.Event()
        self._live: dict[str, Request] = {}
        self._closed = False
        self.hooks: KVTransferHooks | None = None
        if hooks is not None:
            self.set_hooks(hooks)

    def set_hooks(self, hooks: KVTransferHooks) -> None:
        """Plug a connector in (before the first step): it usually needs ``self.kv`` to be built first."""
        self.hooks = hooks
        hooks.bind(self.wake)

    # -- any thread ----------------------------------------------------------------------------------------
    def validate(self, req: Request) -> None:
        """Raise ``InvalidRequest`` for a request this engine can never serve."""
        m = self.cfg.model
        if not req.prompt:
            raise InvalidRequest("the prompt is empty", "prompt")
        if any(not 0 <= t < m.vocab_size for t in req.prompt):
            raise InvalidRequest(f"prompt token ids must be in [0, {m.vocab_size})", "prompt")
        if req.max_tokens < 1:
            raise InvalidRequest("max_tokens must be at least 1", "max_tokens")
        if len(req.prompt) + req.max_tokens > m.max_model_len:
            raise InvalidRequest(
                f"prompt ({len(req.prompt)}) + max_tokens ({req.max_tokens}) exceeds {m.max_model_len}",
                "max_tokens",
            )
        if self.scheduler.blocks_needed(req) > self.cfg.num_blocks:
            raise InvalidRequest(f"the request needs more than the cache's {self.cfg.num_blocks} blocks")
        if req.role is not TransferRole.NONE and not req.transfer_id:
            raise InvalidRequest("kv_transfer_params needs a transfer_id")
        if req.role is TransferRole.REMOTE_PREFILL:
            if self.cfg.role is Role.PREFILL:
                raise InvalidRequest("a prefill engine does not take do_remote_prefill requests")
            if self.hooks is None:
                raise InvalidRequest("this engine has no KV connector: do_remote_prefill is unavailable")
        if req.role is TransferRole.REMOTE_DECODE and self.cfg.role is Role.DECODE:
            raise InvalidRequest("a decode engine does not take do_remote_decode requests")

    def submit(self, req: Request) -> None:
        if req.role is TransferRole.REMOTE_DECODE:
            req.max_tokens = 1  # P produces one token; the decoder produces the rest
        self.validate(req)
        with self._lock:
            if self._closed:
                raise EngineOverloaded("the engine is shutting down")
            self._inbox.append(req)
        self._wake.set()

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._inbox.append(request_id)
        self._wake.set()

    def wake(self) -> None:
        self._wake.set()

    def load(self) -> Load:
        s = self.scheduler
        queued = len(s.waiting) + len(s.waiting_for_kv)
        if s.prefix_cache is None:
            return Load(len(s.running), queued, s.num_free)
        st = s.prefix_cache.stats()
        hits = (st.cached_blocks, st.query_tokens, st.hit_tokens)
        return Load(len(s.running), queued, s.num_free, *hits, prefix_cache=True)

    # -- engine thread -------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One iteration: take new requests and aborts, poll the connector, admit, run one token each."""
        outputs: list[tuple[Request, RequestOutput]] = []
        self._drain_inbox(outputs)
        self._poll(outputs)
        admitted = self.scheduler.admit()
        for req in admitted.remote:
            self._lend(req, outputs)
        for req in list(self.scheduler.running):
            self._advance(req, outputs)
        for req, out in outputs:
            if out.finished:
                self._live.pop(req.request_id, None)
            if req.on_output is not None:
                try:
                    req.on_output(out)
                except Exception:
                    log.exception("output callback of %s failed", req.request_id)
        return [out for _, out in outputs]

    def busy(self) -> bool:
        """Work to do now (as opposed to waiting for the connector or new requests)."""
        return bool(self._inbox or self.scheduler.running)

    def wait(self, timeout: float) -> None:
        """Sleep until woken or ``timeout``, unless there is work already."""
        self._wake.clear()
        if not self.busy():
            self._wake.wait(timeout)

    def close(self) -> list[RequestOutput]:
        """Refuse new requests, end every live one with an error, release the connector."""
        with self._lock:
            self._closed = True
            self._inbox.clear()
        outputs: list[RequestOutput] = []
        for req in list(self._live.values()):
            if req.on_output is not None and not req.state.finished:
                req.state = RequestState.FINISHED_ERROR
                req.error = EngineOverloaded("the engine is shutting down")
                out = req.output(())
                outputs.append(out)
                req.on_output(out)
        self._live.clear()
        if self.hooks is not None:
            self.hooks.close()
        return outputs

    def _transfer_request(self, req: Request) -> TransferRequest:
        assert req.transfer_id is not None
        blocks = tuple(req.block_ids[: self.scheduler.prompt_blocks(req)])
        return TransferRequest(req.transfer_id, blocks, len(req.prompt), req.kv_transfer_params)

    def _lend(self, req: Request, outputs: list[tuple[Request, RequestOutput]]) -> None:
        """D: hand the request's prompt blocks to the connector; a refusal fails the request at once."""
        assert self.hooks is not None and req.transfer_id is not None
        req.kv_wait_start = time.monotonic()
        try:
            self.hooks.request_allocated(self._transfer_request(req))
        except KvwireError as exc:
            log.warning("connector refused %s: %s", req.transfer_id, exc)
            # Nothing was registered: the blocks come straight back.
            self.scheduler.kv_released(req.transfer_id, recompute=False)
            req.state, req.error = RequestState.FINISHED_ERROR, exc
            outputs.append((req, req.output(())))

    def _drain_inbox(self, outputs: list[tuple[Request, RequestOutput]]) -> None:
        with self._lock:
            items = list(self._inbox)
            self._inbox.clear()
        for item in items:
            if isinstance(item, str):
                try:  # one abort's trouble must not cost the rest of the batch
                    self._abort(item, outputs)
                except KvwireError as exc:
                    log.warning("abort of %s: %s", item, exc)
                continue
            try:
                self.scheduler.add(item)
            except KvwireError as exc:
                item.state, item.error = RequestState.FINISHED_ERROR, exc
                outputs.append((item, item.output(())))
                continue
            self._live[item.request_id] = item

    def _abort(self, request_id: str, outputs: list[tuple[Request, RequestOutput]]) -> None:
        req = self._live.get(request_id)
        if req is None or req.state.finished:
            return
        if req.state in (RequestState.WAITING_FOR_KV, RequestState.RECOMPUTE_PENDING):
            assert req.transfer_id is not None
            tell_connector = req.state is RequestState.WAITING_FOR_KV
            self.scheduler.abort_waiting_for_kv(req.transfer_id, RequestState.FINISHED_ABORTED)
            if tell_connector and self.hooks is not None:
                self.hooks.abort(req.transfer_id)
        else:
            queued_remote = req.role is TransferRole.REMOTE_PREFILL and req.state is RequestState.WAITING
            self.scheduler.finish(req, RequestState.FINISHED_ABORTED)
            if queued_remote and self.hooks is not None:  # no blocks yet: P is told it may free its own
                try:
                    self.hooks.decline(self._transfer_request(req))
                except KvwireError as exc:
                    log.warning("could not tell P that %s was dropped: %s", req.transfer_id, exc)
        outputs.append((req, req.output(())))

    def _poll(self, outputs: list[tuple[Request, RequestOutput]]) -> None:
        if self.hooks is None or not self.scheduler.has_lent_blocks():
            return
        events = self.hooks.poll()
        for pe in events.producer:
            try:
                self.scheduler.producer_done(pe.transfer_id)
            except UnknownTransfer:
                log.warning("producer event for unknown transfer %s (%s)", pe.transfer_id, pe.outcome)
        for ce in events.consumer:
            try:
                self._consumer_event(ce, outputs)
            except UnknownTransfer:
                log.warning("consumer event %s for unknown transfer %s", ce.kind, ce.transfer_id)

    def _consumer_event(self, ce: ConsumerEvent, outputs: list[tuple[Request, RequestOutput]]) -> None:
        recompute = self.cfg.kv_load_failure_policy is LoadFailurePolicy.RECOMPUTE
        tid = ce.transfer_id
        reason = ce.reason.value if ce.reason is not None else "released without data"
        if ce.kind is ConsumerEventKind.READY:
            ready = self.scheduler.kv_ready(tid)
            if ready is not None:  # None: aborted since, its blocks now free
                ready.kv_ready_at = time.monotonic()
        elif ce.kind is ConsumerEventKind.FAILED:
            req = self.scheduler.kv_failed(tid, recompute=recompute)
            log.warning("KV load of %s failed (%s)%s", tid, reason, "; recomputing" if recompute else "")
            if not recompute:
                req.state, req.error = RequestState.FINISHED_ERROR, _load_failed(req, reason)
                outputs.append((req, req.output(())))
        else:
            released = self.scheduler.kv_released(tid, recompute=recompute)
            if released is not None and released.state is RequestState.WAITING_FOR_KV:
                released.state, released.error = RequestState.FINISHED_ERROR, _load_failed(released, reason)
                outputs.append((released, released.output(())))

    def _advance(self, req: Request, outputs: list[tuple[Request, RequestOutput]]) -> None:
        try:
            if req.needs_prefill:
                tokens = np.asarray(req.prompt[:-1], dtype=np.int64)
                self.model.prefill(self.kv, req.block_ids, tokens, req.cached_tokens)
                req.needs_prefill = False
                self.scheduler.prefilled(req)
            logits = self.model.step(self.kv, req.block_ids, req.next_token, req.next_position)
        except Exception as exc:  # a bug in the model must end one request, not the engine
            log.exception("request %s failed in the model", req.request_id)
            req.error = exc
            self.scheduler.finish(req, RequestState.FINISHED_ERROR)
            outputs.append((req, req.output(())))
            return
        token = self._sample(req, logits)
        if req.first_token_at is None:
            req.first_token_at = time.monotonic()
        state = None
        if (token == EOS and not req.ignore_eos) or req.matched_stop():
            state = RequestState.FINISHED_STOPPED
        elif len(req.output_ids) >= req.max_tokens:
            state = RequestState.FINISHED_LENGTH
        if state is not None:
            hold = False
            if req.role is TransferRole.REMOTE_DECODE and self.hooks is not None:
                hold = self.hooks.request_finished(self._transfer_request(req))
            self.scheduler.finish(req, state, hold=hold)
        outputs.append((req, req.release()))

    @staticmethod
    def _sample(req: Request, logits: np.ndarray) -> int:
        """The next token by the request's sampling rule (the same on P, D and colocated engines)."""
        params, index = req.sampling, len(req.output_ids)
        token = sample(logits, params, index)
        req.add_token(token)
        if params.logprobs is not None:
            req.token_logprobs.append(token_logprob(logits, token, params.logprobs))
        return token

    # -- synchronous use (tests, benchmarks, the demo's reference) ------------------------------------------
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_tokens: int,
        *,
        ignore_eos: bool = False,
        sampling: SamplingParams = GREEDY,
    ) -> list[list[int]]:
        """Run ``prompts`` to completion on this thread; the generated token ids of each (a stop string
        that ended one is left out, as in its HTTP answer)."""
        results: dict[str, list[int]] = {}
        reqs = []
        for i, p in enumerate(prompts):
            rid = f"gen-{i}-{time.monotonic_ns()}"
            results[rid] = []
            reqs.append(Request(rid, list(p), max_tokens, ignore_eos=ignore_eos, sampling=sampling))
            self.submit(reqs[-1])
        self.run_until_idle()
        for r in reqs:
            if r.state is RequestState.FINISHED_ERROR:
                raise r.error if r.error is not None else KvwireError(f"{r.request_id} failed")
        return [list(r.output_ids[: r.stop_at]) for r in reqs]

    def run_until_idle(self, max_steps: int = 1_000_000) -> None:
        for _ in range(max_steps):
            if not (self._inbox or self.scheduler.has_unfinished()):
                return
            self.step()
        raise KvwireError(f"engine still busy after {max_steps} steps")

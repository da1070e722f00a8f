"""The harness of the vLLM scheduler-level tests: real vLLM 0.34 Schedulers with kvwire's connector and
real kvwire workers over NIXL (see test_scheduler_vllm.py)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import EngineCoreOutput
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec
from vllm.v1.metrics.stats import PrefillStats
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

from kvwire.connector import ConsumerEvent, ConsumerEventKind, ProducerEvent, ProducerOutcome
from kvwire.integrations.vllm.params import KvRole, Op, OpKind, settings_from_extra
from kvwire.integrations.vllm.worker import Finished, RankPlace, WorkerSide
from kvwire.testing.procs import free_port

# The tiny Llama below: 2 layers, 2 KV heads of 16 (hidden 64 / 4 heads), float32 KV, 16-token blocks.


# The tiny Llama: 2 layers, 2 KV heads of 16 (hidden 64 / 4 heads), float32 KV, 16-token blocks.
LAYERS, KV_HEADS, HEAD_DIM, BS = 2, 2, 16, 16


LAYER_NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]


MAX_LEN = 256


TOKEN = 7  # what the fake model samples, every time


STEP_SLEEP_S = 0.001


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama config and tokenizer on disk: vLLM's ModelConfig wants a model it can inspect offline."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, PreTrainedTokenizerFast

    d = tmp_path_factory.mktemp("tiny-llama")
    LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=512,
        torch_dtype="float32",
        architectures=["LlamaForCausalLM"],  # without it vLLM cannot inspect the model
    ).save_pretrained(d)
    vocab = {f"t{i}": i for i in range(124)} | {"<unk>": 124, "<s>": 125, "</s>": 126, "<pad>": 127}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    ).save_pretrained(d)
    return d


def build_scheduler(
    model_dir: Path,
    role: KvRole,
    engine_id: str,
    num_blocks: int,
    extra: dict[str, Any],
    prefix_caching: bool,
    window: int = 0,
) -> Scheduler:
    """vLLM's scheduler as EngineCore builds it, on CPU, with kvwire named in the KV transfer config.
    ``window``: a hybrid model, layer 0 full attention and layer 1 a sliding window of that many tokens,
    with vLLM's hybrid KV cache manager on (two KV cache groups)."""
    model_config = ModelConfig(
        model=str(model_dir),
        tokenizer=str(model_dir),
        dtype="float32",
        max_model_len=MAX_LEN,
        seed=0,
        skip_tokenizer_init=True,
    )
    scheduler_config = SchedulerConfig(
        max_num_seqs=8,
        max_num_batched_tokens=MAX_LEN,
        max_model_len=MAX_LEN,
        is_encoder_decoder=False,
        enable_chunked_prefill=True,
        disable_hybrid_kv_cache_manager=None if window else True,
    )
    cache_config = CacheConfig(block_size=BS, cache_dtype="auto", enable_prefix_caching=prefix_caching)
    kv_transfer_config = KVTransferConfig(
        kv_connector="KvwireConnector",
        kv_connector_module_path="kvwire.integrations.vllm",
        kv_role=role.value,
        engine_id=engine_id,
        kv_connector_extra_config=extra,
    )
    vllm_config = VllmConfig(
        model_config=model_config,
        cache_config=cache_config,
        scheduler_config=scheduler_config,
        device_config=DeviceConfig("cpu"),
        kv_transfer_config=kv_transfer_config,
    )
    vllm_config.cache_config.num_gpu_blocks = num_blocks
    if window:
        # vLLM turns HMA off on a CPU platform (support_hybrid_kv_cache); a GPU's keeps it on, as here.
        vllm_config.scheduler_config.disable_hybrid_kv_cache_manager = False
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=KV_HEADS, head_size=HEAD_DIM, dtype=torch.float32)
    groups = [KVCacheGroupSpec(LAYER_NAMES, spec)]
    if window:
        sw = SlidingWindowSpec(
            block_size=BS, num_kv_heads=KV_HEADS, head_size=HEAD_DIM, dtype=torch.float32,
            sliding_window=window,
        )  # fmt: skip
        groups = [KVCacheGroupSpec(LAYER_NAMES[:1], spec), KVCacheGroupSpec(LAYER_NAMES[1:], sw)]
    kv_cache_config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups)
    return Scheduler(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=BS,
        log_stats=True,
    )


class Engine:
    """A vLLM engine minus the model: the real scheduler, kvwire's worker side, the KV cache memory."""

    def __init__(
        self,
        model_dir: Path,
        role: KvRole,
        mode: str,
        num_blocks: int,
        extra: dict[str, Any],
        prefix_caching: bool = True,
        window: int = 0,
    ) -> None:
        self.port = free_port()
        self.engine_id = f"{role.name.lower()}-{self.port}"
        # One incarnation for the scheduler and the worker side, as vLLM derives one for both processes (P's
        # answer names it; D refuses another life).
        settings = {"mode": mode, "side_channel_port": self.port, "incarnation": f"inc-{self.port}", **extra}
        self.sched = build_scheduler(
            model_dir, role, self.engine_id, num_blocks, settings, prefix_caching, window
        )
        self.pool = self.sched.kv_cache_manager.block_pool
        self._guard_double_free()
        self.free0 = self.pool.get_num_free_blocks()
        cache = self.sched.vllm_config.cache_config
        init_none_hash(get_hash_fn_by_name(cache.prefix_caching_hash_algo))  # as EngineCore does
        self.hasher = get_request_block_hasher(BS, get_hash_fn_by_name(cache.prefix_caching_hash_algo))
        # vLLM 0.34 (LBHNC): one buffer for all layers; layer l is backing[l], [blocks, heads, tokens, K|V].
        self.backing = np.zeros((LAYERS, num_blocks, KV_HEADS, BS, 2 * HEAD_DIM), dtype=np.float32)
        if role.produces:
            rng = np.random.default_rng(self.port)
            words = self.backing.view(np.uint32)
            words[...] = rng.integers(0, 1 << 32, size=words.shape, dtype=np.uint32)
        place = RankPlace(
            self.engine_id, f"inc-{self.port}", "tiny-llama", 1, 0, 1, 0, LAYERS, KV_HEADS, HEAD_DIM, BS,
            layer_groups=(0, 1) if window else (), group_windows=(0, window) if window else (),
        )  # fmt: skip
        self.worker = WorkerSide(role, settings_from_extra(settings), place)
        # A hybrid model's groups share tensors, as vLLM allocates them (a block is one group's at a time).
        layers = {name: self.backing[0 if window else i] for i, name in enumerate(LAYER_NAMES)}
        self.worker.register(layers)
        self.events: list[ProducerEvent | ConsumerEvent] = []  # what kvwire told the worker, in order
        self._record_events()
        self.reqs: dict[str, Request] = {}
        self.history: dict[str, list[RequestStatus]] = {}  # each request's statuses, as steps saw them
        self.scheduled: dict[str, list[int]] = {}  # tokens scheduled per step, per request
        self.ops: list[Op] = []  # every op the scheduler handed the worker
        self.sent_at: dict[str, float] = {}  # when P's worker got each SEND (kvwire's lease starts there)
        self.reported = Finished()  # everything the worker reported to vLLM
        self.outputs: dict[str, EngineCoreOutput] = {}  # the finishing output of each request
        self.prefill: dict[str, PrefillStats] = {}  # vLLM's own account of each request's first prefill

    def _guard_double_free(self) -> None:
        """vLLM 0.34's BlockPool.free_blocks does not check: a second free drives ref_cnt below 0."""
        pool, free_blocks = self.pool, self.pool.free_blocks

        def checked(ordered_blocks: Any, evict_first: bool = False) -> Any:
            blocks = list(ordered_blocks)
            twice = [b.block_id for b in blocks if not b.is_null and b.ref_cnt <= 0]
            assert not twice, f"blocks {twice} freed twice"
            return free_blocks(blocks, evict_first)

        pool.free_blocks = checked

    def _record_events(self) -> None:
        """Keep every event the worker polls from kvwire: how each hold or load ended, not only when."""
        for conn in (self.worker.producer, self.worker.consumer):
            if conn is None:
                continue
            poll = conn.poll

            def recording(poll: Callable[[], list[Any]] = poll) -> list[Any]:
                got = poll()
                self.events.extend(got)
                return got

            conn.poll = recording  # type: ignore[method-assign]

    def p_outcomes(self, tid: str) -> list[ProducerOutcome]:
        return [e.outcome for e in self.events if isinstance(e, ProducerEvent) and e.transfer_id == tid]

    def d_events(self, tid: str) -> list[ConsumerEventKind]:
        return [e.kind for e in self.events if isinstance(e, ConsumerEvent) and e.transfer_id == tid]

    @property
    def kv(self) -> np.ndarray:
        """The cache as 32-bit words: [layers, blocks, heads, tokens, K|V] (bytes compare exactly)."""
        return self.backing.view(np.uint32)

    def add(self, rid: str, tokens: Sequence[int], max_tokens: int, params: dict[str, Any] | None) -> Request:
        sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        if params is not None:
            sp.extra_args = {"kv_transfer_params": dict(params)}  # how the OpenAI server passes them
        req = Request(
            request_id=rid,
            prompt_token_ids=list(tokens),
            sampling_params=sp,
            pooling_params=None,
            block_hasher=self.hasher,
        )
        self.sched.add_request(req)
        self.reqs[rid] = req
        self.history[rid] = [req.status]
        self.scheduled[rid] = []
        return req

    # -- one engine step: schedule, the "model runner" (kvwire's worker), update ----------------------
    def schedule(self) -> tuple[SchedulerOutput, list[Op]]:
        out = self.sched.schedule()
        meta = out.kv_connector_metadata
        ops = list(meta.ops) if meta is not None else []
        self.ops.extend(ops)
        now = time.monotonic()
        self.sent_at.update((o.req_id, now) for o in ops if o.kind is OpKind.SEND)
        for rid, n in out.num_scheduled_tokens.items():
            self.scheduled[rid].append(n)
        self._note()
        return out, ops

    def update(self, out: SchedulerOutput, fin: Finished) -> None:
        for got, seen in (
            (fin.sending, self.reported.sending),
            (fin.recving, self.reported.recving),
            (fin.failed_recving, self.reported.failed_recving),
        ):
            assert not got & seen, f"{got & seen} reported twice"
            seen |= got
        req_ids = list(out.num_scheduled_tokens)
        # The runner samples for a request whose prompt is complete after this step (not a partial prefill).
        sampled = [[TOKEN] if self._complete(rid) else [] for rid in req_ids]
        mro = ModelRunnerOutput(
            req_ids=req_ids,
            sampled_token_ids=sampled,
            logprobs=None,
            prompt_logprobs_dict={},
            pooler_output=None,
            kv_connector_output=KVConnectorOutput(
                finished_sending=fin.sending or None,
                finished_recving=fin.recving or None,
                failed_recving=fin.failed_recving,
            ),
        )
        for outs in self.sched.update_from_output(out, mro).values():
            for o in outs.outputs:
                if o.finish_reason is not None:
                    self.outputs[o.request_id] = o
                if o.prefill_stats is not None:
                    self.prefill.setdefault(o.request_id, o.prefill_stats)
        self._note()

    def step(self, poll: bool = True) -> None:
        """One vLLM step; ``poll=False``: the worker has not seen anything finish yet this step."""
        if not self.sched.has_requests():
            return  # EngineCore idles then: the worker is not polled, so kvwire must not need it to be
        out, ops = self.schedule()
        # vLLM 0.34's order: bind_connector_metadata before the forward, start_load_kv after it (no kvwire
        # load is synchronous), then wait_for_save.
        self.worker.bind(ops)
        self._forward(lambda: self.worker.start(ops))
        # As KvwireConnector.get_transfer_results: a step with nothing scheduled waits for kvwire's news.
        idle = bool(getattr(out.kv_connector_metadata, "idle", False))
        wait_s = self.worker.settings.idle_step_wait_ms / 1e3 if idle else 0.0
        self.update(out, self.worker.finished(wait_s) if poll else Finished())

    def _forward(self, start_load_kv: Callable[[], None]) -> None:
        """The model's layers, as KvwireConnector sees them: ``save_kv_layer`` per layer (layer-wise push
        streams the step's requests), then ``start_load_kv``, then ``wait_for_save``. The fake model
        computes nothing: P's cache holds its bytes from the start."""
        streamer = self.worker.streamer
        if streamer is not None and streamer.active:
            for i, name in enumerate(LAYER_NAMES):
                streamer.layer_saved(name, self.backing[i])
        start_load_kv()
        if streamer is not None:
            streamer.step_over()

    def _complete(self, rid: str) -> bool:
        req = self.sched.requests[rid]
        return bool(req.num_computed_tokens >= req.num_tokens)

    def _note(self) -> None:
        for rid, req in self.reqs.items():
            if self.history[rid][-1] != req.status:
                self.history[rid].append(req.status)

    # -- what the checks read ----------------------------------------------------------------------------
    def op(self, kind: OpKind, rid: str) -> Op:
        found = [o for o in self.ops if o.kind is kind and o.req_id == rid]
        assert len(found) == 1, f"{kind.value} ops for {rid}: {found}"
        return found[0]

    def gone(self, *rids: str) -> bool:
        """vLLM is done with these requests: finished and their blocks returned."""
        return all(rid in self.reqs and rid not in self.sched.requests for rid in rids)

    def blocks_of(self, rid: str, group: int = 0) -> list[int]:
        return list(self.sched.kv_cache_manager.get_blocks(rid).get_block_ids()[group])

    def held(self) -> int:
        return int(self.free0 - self.pool.get_num_free_blocks())

    def assert_clean(self) -> None:
        """Every request ended, every block back in the pool once, nothing pending in kvwire."""
        assert not self.sched.requests, f"{self.engine_id} still holds {sorted(self.sched.requests)}"
        assert self.pool.get_num_free_blocks() == self.free0
        assert [b.block_id for b in self.pool.blocks if not b.is_null and b.ref_cnt != 0] == []
        side = self.sched.connector._sched
        assert side is not None and not side.has_pending_sends() and side.num_loading == 0
        assert not side._pending, f"matched but never allocated: {side._pending}"
        assert not self.worker._sends and not self.worker._loads, (self.worker._sends, self.worker._loads)

    def close(self) -> None:
        self.worker.close()
        self.sched.shutdown()


MakeEngine = Callable[..., Engine]


@pytest.fixture
def make_engine(model_dir: Path) -> Iterator[MakeEngine]:
    made: list[Engine] = []

    def make(
        role: KvRole,
        mode: str = "push",
        num_blocks: int = 32,
        extra: dict[str, Any] | None = None,
        prefix_caching: bool = True,
        window: int = 0,
    ) -> Engine:
        engine = Engine(model_dir, role, mode, num_blocks, extra or {}, prefix_caching, window)
        made.append(engine)
        return engine

    yield make
    for engine in made:
        engine.close()


def run(
    engines: Sequence[Engine],
    until: Callable[[], bool],
    what: str,
    timeout_s: float = 20.0,
    poll: bool = True,
) -> float:
    """Step every engine (as their EngineCore loops would) until ``until``; returns the seconds taken."""
    t0 = time.monotonic()
    while True:
        for e in engines:
            e.step(poll)
        if until():
            return time.monotonic() - t0
        if time.monotonic() - t0 > timeout_s:
            states = {rid: r.status.name for e in engines for rid, r in e.reqs.items()}
            raise AssertionError(f"timed out waiting for {what}: {states}")
        time.sleep(STEP_SLEEP_S)


def prompt(n: int, seed: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, 120, size=n)]


def p_params(tid: str) -> dict[str, Any]:
    return {"do_remote_decode": True, "transfer_id": tid}


def d_params(p: Engine, tid: str, **more: Any) -> dict[str, Any]:
    """What the proxy gives D when it did not wait for P's answer (push mode)."""
    return {
        "do_remote_prefill": True,
        "transfer_id": tid,
        "remote_engine_id": p.engine_id,
        "remote_host": "127.0.0.1",
        "remote_port": p.port,
        "remote_tp_size": 1,
        **more,
    }


def finish_prefill(p: Engine, rid: str, tokens: Sequence[int], tid: str) -> dict[str, Any]:
    """P runs ``rid`` (max_tokens 1) until it finished and its SEND reached the worker; P's params for D."""
    p.add(rid, tokens, 1, p_params(tid))
    run([p], lambda: rid in p.outputs and any(o.req_id == rid for o in p.ops), f"P's prefill of {rid}")
    out = p.outputs[rid]
    assert out.finish_reason is not None and out.finish_reason.name == "LENGTH"
    assert out.new_token_ids == [TOKEN]
    assert p.sched.requests[rid].status is RequestStatus.FINISHED_LENGTH_CAPPED
    # P holds the blocks for D: vLLM keeps them until kvwire reports the send ended.
    send = p.op(OpKind.SEND, rid)
    assert send.num_tokens == len(tokens) and len(send.block_ids) == -(-len(tokens) // BS)
    assert p.held() == len(send.block_ids)
    params = out.kv_transfer_params
    assert params is not None
    return dict(params)


def assert_params_for_d(params: dict[str, Any], p: Engine, p_rid: str, tid: str, mode: str) -> None:
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert params["transfer_id"] == tid and params["remote_engine_id"] == p.engine_id
    assert (params["remote_host"], params["remote_port"]) == ("127.0.0.1", p.port)
    assert params["remote_tp_size"] == 1
    if mode == "pull":
        assert params["remote_block_ids"] == p.op(OpKind.SEND, p_rid).block_ids
    else:
        assert "remote_block_ids" not in params


def assert_moved(p: Engine, p_rid: str, d: Engine, d_rid: str, first_block: int = 0) -> None:
    """D's blocks for ``d_rid`` (from its LOAD op) hold P's bytes of ``p_rid``, every layer, from
    ``first_block`` (D's prefix hit before it) to the end of the prompt; kvwire moves whole blocks, the
    prompt's partial last one included."""
    send, load = p.op(OpKind.SEND, p_rid), d.op(OpKind.LOAD, d_rid)
    n = -(-load.num_tokens // BS)
    assert load.num_tokens == send.num_tokens and len(load.block_ids) == n == len(send.block_ids)
    src = p.kv[:, send.block_ids[first_block:]]
    dst = d.kv[:, load.block_ids[first_block:]]
    for layer in range(LAYERS):
        assert np.array_equal(src[layer], dst[layer]), f"layer {layer}: D's blocks differ from P's"


def assert_delivered(p: Engine, d: Engine, tid: str, mode: str = "push") -> None:
    """kvwire's own account: D's load ended READY and P's hold ended by the transfer, nothing else."""
    assert d.d_events(tid) == [ConsumerEventKind.READY]
    assert p.p_outcomes(tid) == [ProducerOutcome.PULLED if mode == "pull" else ProducerOutcome.SENT]


def assert_zero_except(d: Engine, block_ids: Sequence[int]) -> None:
    """Nothing but the loaded blocks was ever written on D (the fake model writes nothing)."""
    others = [b for b in range(d.kv.shape[1]) if b not in set(block_ids)]
    assert not d.kv[:, others].any(), "bytes landed outside the blocks D's requests loaded"


def assert_d_decoded(d: Engine, rid: str, max_tokens: int, local_hit: int = 0) -> None:
    """D used the loaded KV: after WAITING_FOR_REMOTE_KVS it computed only the last prompt token."""
    stats, n = d.prefill[rid], len(d.reqs[rid].prompt_token_ids or ())
    assert (stats.num_local_cached_tokens, stats.num_external_cached_tokens) == (local_hit, n - local_hit)
    assert d.history[rid][:2] == [RequestStatus.WAITING, RequestStatus.WAITING_FOR_REMOTE_KVS]
    assert RequestStatus.RUNNING in d.history[rid]
    assert d.history[rid][-1] is RequestStatus.FINISHED_LENGTH_CAPPED
    assert d.scheduled[rid] == [1] * max_tokens
    assert list(d.reqs[rid].output_token_ids) == [TOKEN] * max_tokens
    assert rid in d.reported.recving and rid not in d.reported.failed_recving


def registration_reached_p(p: Engine, tid: str) -> bool:
    """P's producer holds a push_reg for ``tid`` (kvwire counts none it received: its table is read)."""
    producer = p.worker.producer
    return producer is not None and producer.core.registrations(tid) > 0


def load_and_abort_in_one_step(d: Engine, rid: str) -> list[int]:
    """The API server aborts ``rid`` while the step that allocated its blocks runs, so the worker gets the
    LOAD and the ABORT in one batch (as when the abort overtakes D's handshake with P). Returns the blocks
    vLLM gave the request."""
    out1, ops1 = d.schedule()
    assert d.reqs[rid].status is RequestStatus.WAITING_FOR_REMOTE_KVS
    assert [o.kind for o in ops1] == [OpKind.LOAD]
    blocks = d.blocks_of(rid)
    d.sched.finish_requests(rid, RequestStatus.FINISHED_ABORTED)
    # vLLM keeps an aborted loading request's blocks until the worker reports it in finished_recving.
    assert rid in d.sched.requests and d.held() == len(blocks)
    out2, ops2 = d.schedule()  # nothing runs on D, so a second schedule before the update is harmless
    assert [o.kind for o in ops2] == [OpKind.ABORT]
    d.worker.apply(ops1 + ops2)
    d.update(out1, Finished())
    d.update(out2, d.worker.finished())
    return blocks


def assert_aborted_on_d(d: Engine, rid: str) -> None:
    assert d.reqs[rid].status is RequestStatus.FINISHED_ABORTED and list(d.reqs[rid].output_token_ids) == []
    assert RequestStatus.RUNNING not in d.history[rid]
    # Reported once the blocks are D's again (kvwire's RELEASED, or READY if P's write won the race).
    assert d.reported.recving == {rid} and d.reported.failed_recving == set()


def assert_p_expired(p: Engine, rid: str, tid: str, lease: float) -> None:
    """P heard nothing from D: it held the blocks for the lease, then let them go."""
    run([p], lambda: p.gone(rid), "P's lease expiry", timeout_s=lease + 10)
    assert time.monotonic() - p.sent_at[rid] >= lease, "P let go before its lease ran out"
    assert p.reported.sending == {rid}
    assert p.p_outcomes(tid) == [ProducerOutcome.EXPIRED]

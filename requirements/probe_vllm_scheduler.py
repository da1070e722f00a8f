"""Probe: drive a real vLLM 0.34 v1 Scheduler on CPU with an out-of-tree
KV connector, no network, no GPU.

Run with:  .venv-vllm/bin/python requirements/probe_vllm_scheduler.py

It writes a tiny Llama config + tokenizer into a temp dir, builds a VllmConfig
(DeviceConfig("cpu")), a KVTransferConfig naming the connector class below
(kv_connector_module_path="__main__" works because the module is already
imported), a KVCacheConfig with one FullAttention group and no tensors, then
runs the scheduler loop with hand-made ModelRunnerOutputs:

  1. producer (kv_producer): request prefill + 3 decode tokens -> finishes,
     request_finished returns (True, params) -> blocks held until the
     KVConnectorOutput reports finished_sending.
  2. consumer-style remote prefill: get_num_new_matched_tokens returns
     (n, True) -> WAITING_FOR_REMOTE_KVS -> finished_recving moves it on.
"""

import os
import sys
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402

from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # noqa: E402
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

CALLS: list[tuple[str, object]] = []


class ProbeMeta(KVConnectorMetadata):
    def __init__(self, reqs):
        self.reqs = reqs


class ProbeConnector(KVConnectorBase_V1):
    """Minimal out-of-tree connector recording every scheduler-side call."""

    def __init__(self, vllm_config, role, kv_cache_config):
        super().__init__(vllm_config, role, kv_cache_config)
        CALLS.append(("__init__", (role, kv_cache_config.num_blocks)))
        self.extra = vllm_config.kv_transfer_config.kv_connector_extra_config
        self.pending: dict[str, tuple[list[int], int]] = {}

    # ---- worker side (unused here) ----
    def start_load_kv(self, forward_context, **kwargs):
        pass

    def wait_for_layer_load(self, layer_name):
        pass

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
        pass

    def wait_for_save(self):
        pass

    # ---- scheduler side ----
    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        p = request.kv_transfer_params or {}
        if p.get("do_remote_prefill"):
            # like NixlConnector: claim the whole prompt; when the load
            # finishes the scheduler rewinds num_computed_tokens by one so
            # the last prompt token is recomputed locally to sample from.
            n = len(request.prompt_token_ids) - num_computed_tokens
            CALLS.append(("get_num_new_matched_tokens", (request.request_id, n, True)))
            return n, True
        CALLS.append(("get_num_new_matched_tokens", (request.request_id, 0, False)))
        return 0, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        ids = blocks.get_block_ids()
        CALLS.append(
            ("update_state_after_alloc", (request.request_id, ids, num_external_tokens))
        )
        if num_external_tokens > 0:
            self.pending[request.request_id] = (ids, num_external_tokens)
            p = request.kv_transfer_params
            p["do_remote_prefill"] = False  # only once, like NixlConnector

    def build_connector_meta(self, scheduler_output):
        meta = ProbeMeta(dict(self.pending))
        self.pending.clear()
        CALLS.append(("build_connector_meta", sorted(meta.reqs)))
        return meta

    def update_connector_output(self, connector_output):
        CALLS.append(
            (
                "update_connector_output",
                (connector_output.finished_sending, connector_output.finished_recving),
            )
        )

    def request_finished(self, request, block_ids):
        CALLS.append(("request_finished", (request.request_id, block_ids)))
        if self._kv_transfer_config.is_kv_producer and (
            (request.kv_transfer_params or {}).get("do_remote_decode")
        ):
            return True, {"remote_block_ids": block_ids, "remote_engine_id": "p0"}
        return False, None


def make_model_dir() -> str:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, PreTrainedTokenizerFast

    d = tempfile.mkdtemp(prefix="tiny-llama-")
    cfg = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        torch_dtype="float32",
        architectures=["LlamaForCausalLM"],
    )
    cfg.save_pretrained(d)
    vocab = {f"t{i}": i for i in range(124)}
    vocab.update({"<unk>": 124, "<s>": 125, "</s>": 126, "<pad>": 127})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
    )
    fast.save_pretrained(d)
    return d


def build(model_dir: str, role: str, num_blocks: int = 64, block_size: int = 16):
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KVTransferConfig,
        ModelConfig,
        SchedulerConfig,
        VllmConfig,
    )
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
    )
    from vllm.v1.structured_output import StructuredOutputManager

    model_config = ModelConfig(
        model=model_dir,
        tokenizer=model_dir,
        dtype="float32",
        max_model_len=256,
        seed=0,
        skip_tokenizer_init=True,
    )
    scheduler_config = SchedulerConfig(
        max_num_seqs=8,
        max_num_batched_tokens=256,
        max_model_len=256,
        is_encoder_decoder=False,
        enable_chunked_prefill=True,
        disable_hybrid_kv_cache_manager=True,
    )
    cache_config = CacheConfig(
        block_size=block_size,
        gpu_memory_utilization=0.9,
        cache_dtype="auto",
        enable_prefix_caching=True,
    )
    cache_config.num_gpu_blocks = num_blocks
    kv_transfer_config = KVTransferConfig(
        kv_connector="ProbeConnector",
        kv_connector_module_path="__main__",
        kv_role=role,
        kv_connector_extra_config={"probe": 1},
    )
    vllm_config = VllmConfig(
        model_config=model_config,
        cache_config=cache_config,
        scheduler_config=scheduler_config,
        device_config=DeviceConfig("cpu"),
        kv_transfer_config=kv_transfer_config,
    )
    kv_cache_config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(
                ["layer0", "layer1"],
                FullAttentionSpec(
                    block_size=block_size,
                    num_kv_heads=2,
                    head_size=16,
                    dtype=torch.float32,
                ),
            )
        ],
    )
    vllm_config.cache_config.num_gpu_blocks = num_blocks
    sched = Scheduler(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=block_size,
        log_stats=True,
    )
    return vllm_config, sched


def make_request(req_id: str, n_prompt: int, max_tokens: int, kv_params=None):
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    if kv_params is not None:
        sp.extra_args = {"kv_transfer_params": dict(kv_params)}
    return Request(
        request_id=req_id,
        prompt_token_ids=[i % 100 for i in range(n_prompt)],
        sampling_params=sp,
        pooling_params=None,
    )


def mro_output(sched_out, finished_sending=None, finished_recving=None):
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

    req_ids = []
    sampled = []
    for r in sched_out.scheduled_new_reqs:
        req_ids.append(r.req_id)
    req_ids += list(sched_out.scheduled_cached_reqs.req_ids)
    for rid in req_ids:
        sampled.append([7])
    return ModelRunnerOutput(
        req_ids=req_ids,
        sampled_token_ids=sampled,
        logprobs=None,
        prompt_logprobs_dict={},
        pooler_output=None,
        kv_connector_output=KVConnectorOutput(
            finished_sending=finished_sending, finished_recving=finished_recving
        ),
    )


def run_producer(model_dir):
    from vllm.v1.request import RequestStatus

    CALLS.clear()
    _, sched = build(model_dir, "kv_producer")
    conn = sched.connector
    assert isinstance(conn, ProbeConnector), type(conn)
    req = make_request("p-1", 40, 3, {"do_remote_decode": True})
    sched.add_request(req)
    free0 = sched.kv_cache_manager.block_pool.get_num_free_blocks()
    finished_sending = None
    for step in range(20):
        so = sched.schedule()
        out = mro_output(so, finished_sending=finished_sending)
        finished_sending = None
        eco = sched.update_from_output(so, out)
        for outs in eco.values():
            for o in outs.outputs:
                if o.finished:
                    print(
                        f"[producer] step {step}: {o.request_id} finished "
                        f"reason={o.finish_reason} kv_transfer_params={o.kv_transfer_params}"
                    )
                    # blocks are still held (delay_free=True) until the
                    # 'worker' reports the send done on the next step
                    held = sched.kv_cache_manager.block_pool.get_num_free_blocks()
                    print(f"[producer] free blocks while send pending={held}")
                    assert held < free0
                    assert o.request_id in sched.requests
                    finished_sending = {o.request_id}
        if "p-1" not in sched.requests:
            break
    free1 = sched.kv_cache_manager.block_pool.get_num_free_blocks()
    print(f"[producer] free blocks before={free0} after={free1}; steps={step + 1}")
    assert "p-1" not in sched.requests
    assert free1 == free0
    assert req.status == RequestStatus.FINISHED_LENGTH_CAPPED
    return [c[0] for c in CALLS]


def run_consumer(model_dir):
    from vllm.v1.request import RequestStatus

    CALLS.clear()
    _, sched = build(model_dir, "kv_consumer")
    req = make_request(
        "d-1",
        40,
        2,
        {
            "do_remote_prefill": True,
            "remote_engine_id": "p0",
            "remote_block_ids": [0, 1, 2],
            "remote_host": "127.0.0.1",
            "remote_port": 1,
        },
    )
    sched.add_request(req)
    finished_recving = None
    reported = False
    statuses = []
    for step in range(20):
        so = sched.schedule()
        statuses.append(str(req.status))
        out = mro_output(so, finished_recving=finished_recving)
        finished_recving = None
        if req.status == RequestStatus.WAITING_FOR_REMOTE_KVS and not reported:
            # the 'worker' reports the load done (exactly once) in this step's
            # KVConnectorOutput; the request moves on at the next schedule()
            out.kv_connector_output.finished_recving = {"d-1"}
            reported = True
        sched.update_from_output(so, out)
        if "d-1" not in sched.requests:
            break
    print(f"[consumer] statuses per step: {statuses}")
    assert "WAITING_FOR_REMOTE_KVS" in statuses
    assert "d-1" not in sched.requests
    return [c[0] for c in CALLS]


def run_consumer_abort(model_dir, fail_instead=False):
    """Abort (or failed load) while WAITING_FOR_REMOTE_KVS."""
    from vllm.v1.request import RequestStatus

    CALLS.clear()
    _, sched = build(model_dir, "kv_consumer")
    pool = sched.kv_cache_manager.block_pool
    free0 = pool.get_num_free_blocks()
    req = make_request(
        "d-2", 40, 2, {"do_remote_prefill": True, "remote_engine_id": "p0"}
    )
    sched.add_request(req)
    so = sched.schedule()
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    sched.update_from_output(so, mro_output(so))
    held = pool.get_num_free_blocks()
    if not fail_instead:
        sched.finish_requests("d-2", RequestStatus.FINISHED_ABORTED)
        after_abort = pool.get_num_free_blocks()
        names = [c[0] for c in CALLS]
        print(
            f"[abort] free before={free0} loading={held} after abort={after_abort} "
            f"request_finished called={'request_finished' in names} "
            f"still tracked={'d-2' in sched.requests} "
            f"args={[c[1] for c in CALLS if c[0] == 'request_finished']}"
        )
        # the worker must still report the (cancelled) load as finished
        so = sched.schedule()
        out = mro_output(so)
        out.kv_connector_output.finished_recving = {"d-2"}
        sched.update_from_output(so, out)
        print(
            f"[abort] after finished_recving: free={pool.get_num_free_blocks()} "
            f"tracked={'d-2' in sched.requests}"
        )
        assert pool.get_num_free_blocks() == free0 and "d-2" not in sched.requests
    else:
        # load failed: report it in failed_recving AND finished_recving
        so = sched.schedule()
        out = mro_output(so)
        out.kv_connector_output.failed_recving = {"d-2"}
        out.kv_connector_output.finished_recving = {"d-2"}
        eco = sched.update_from_output(so, out)
        reasons = [
            (o.request_id, str(o.finish_reason))
            for v in eco.values()
            for o in v.outputs
        ]
        print(
            f"[fail policy={sched.vllm_config.kv_transfer_config.kv_load_failure_policy}] "
            f"outputs={reasons} status={req.status} "
            f"tracked={'d-2' in sched.requests} free={pool.get_num_free_blocks()}"
        )


def main():
    model_dir = make_model_dir()
    prod_calls = run_producer(model_dir)
    print("[producer] connector calls:", prod_calls)
    for m in (
        "__init__",
        "get_num_new_matched_tokens",
        "update_state_after_alloc",
        "build_connector_meta",
        "update_connector_output",
        "request_finished",
    ):
        assert m in prod_calls, m
    cons_calls = run_consumer(model_dir)
    print("[consumer] connector calls:", cons_calls)
    for line in CALLS:
        if line[0] in ("update_state_after_alloc", "get_num_new_matched_tokens"):
            print("   ", line)
    run_consumer_abort(model_dir)
    run_consumer_abort(model_dir, fail_instead=True)
    print("PROBE OK")


if __name__ == "__main__":
    sys.exit(main())

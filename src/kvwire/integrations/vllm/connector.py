"""``KvwireConnector``: kvwire as a vLLM KV connector (the only module here that imports vLLM).

Turn it on with one line (see docs/vllm.md)::

    --kv-transfer-config '{"kv_connector": "KvwireConnector",
                           "kv_connector_module_path": "kvwire.integrations.vllm",
                           "kv_role": "kv_producer", "kv_connector_extra_config": {"mode": "push"}}'

vLLM builds this class in its scheduler process (role SCHEDULER) and in every worker process (role
WORKER). The scheduler side decides which requests send or load KV (``scheduler.SchedulerSide``); each
worker moves its own rank's KV with kvwire (``worker.WorkerSide``). This module only adapts vLLM's types.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)

from kvwire.config import env_config
from kvwire.discovery.source import check_target
from kvwire.errors import ConfigError, KvwireError, LayoutError
from kvwire.integrations.vllm.cpu_tiles import allow_amx_tiles
from kvwire.integrations.vllm.discovery import BackgroundRegistrar, start_registration, vllm_record
from kvwire.integrations.vllm.hma import kv_groups
from kvwire.integrations.vllm.identity import vllm_model_id
from kvwire.integrations.vllm.layerwise import StreamPlanner
from kvwire.integrations.vllm.params import (
    KvRole,
    Op,
    RankChannel,
    check_deployment,
    for_dp_engine,
    incarnation_of,
    rank_host,
    settings_from_extra,
)
from kvwire.integrations.vllm.prom import KvwirePromMetrics, KvwireStats
from kvwire.integrations.vllm.scheduler import LocalEngine, SchedulerSide
from kvwire.integrations.vllm.worker import RankPlace, WorkerSide
from kvwire.logsetup import Throttle

try:  # vLLM's label for where cached prompt tokens came from (0.32 and 0.34 have it)
    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    _P2P: Any = CacheHitSource.P2P
except ImportError:  # pragma: no cover - an older vLLM counts them under its default
    _P2P = None

if TYPE_CHECKING:
    from vllm.config import VllmConfig

log = logging.getLogger("kvwire.vllm")
_STATS_LOG = Throttle(60.0)


class KvwireMetadata(KVConnectorMetadata):  # type: ignore[misc]
    """One step's operations, from the scheduler process to every worker."""

    def __init__(self, ops: list[Op], idle: bool = False) -> None:
        self.ops = ops
        self.idle = idle  # nothing scheduled this step: the worker may wait for kvwire's next event


def _configure_logging() -> None:
    """vLLM configures only its own loggers: give kvwire's a handler (level from ``KVWIRE_LOG_LEVEL``,
    default info) so that its start-up lines and failures show in the engine's log."""
    logger = logging.getLogger("kvwire")
    if logger.handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s [kvwire %(name)s] %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(env_config().log_level.upper())
    logger.propagate = False


def _tp_pp_rank() -> tuple[int, int]:
    from vllm.distributed.parallel_state import get_pp_group, get_tensor_model_parallel_rank

    return int(get_tensor_model_parallel_rank()), int(get_pp_group().rank_in_group)


def _drafter_has_kv(spec: Any) -> bool:
    """Whether speculative decoding adds KV cache layers of its own (vLLM's ``uses_draft_kv_cache``;
    n-gram and suffix decoding add none)."""
    if spec is None:
        return False
    uses = getattr(spec, "uses_draft_kv_cache", None)
    return bool(uses()) if callable(uses) else getattr(spec, "draft_model_config", None) is not None


def _cpu_backend() -> bool:
    """vLLM's CPU attention backend stores a fused head block as a K tile then a V tile; its GPU backends
    as ``[K|V]`` token rows (kvwire splits blocks by tokens when P's and D's block sizes differ)."""
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


class KvwireConnector(KVConnectorBase_V1, SupportsHMA):  # type: ignore[misc]
    if _P2P is not None:
        _cache_hit_source = _P2P  # KV from a peer engine (vllm:prompt_tokens_cached_by_source)

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        _configure_logging()
        ktc = vllm_config.kv_transfer_config
        settings = settings_from_extra(ktc.kv_connector_extra_config)
        try:
            kv_role = KvRole(ktc.kv_role)
        except ValueError:
            raise ConfigError(f"kv_role {ktc.kv_role!r}: one of kv_producer, kv_consumer, kv_both") from None
        pc, mc = vllm_config.parallel_config, vllm_config.model_config
        check_deployment(
            speculative=_drafter_has_kv(getattr(vllm_config, "speculative_config", None)),
            decode_cp=int(getattr(pc, "decode_context_parallel_size", 1)),
            prefill_cp=int(getattr(pc, "prefill_context_parallel_size", 1)),
        )
        engine_id = str(ktc.engine_id)
        incarnation = settings.incarnation or incarnation_of(engine_id, str(vllm_config.instance_id))
        block_size = int(vllm_config.cache_config.block_size)
        tp, pp = int(pc.tensor_parallel_size), int(pc.pipeline_parallel_size)
        dp_index = int(getattr(pc, "data_parallel_index", getattr(pc, "data_parallel_rank", 0)) or 0)
        settings = for_dp_engine(settings, dp_index, tp, pp, kv_role)
        # vLLM's hybrid KV cache manager: one block list per group (full attention, sliding window).
        self._groups = kv_groups(kv_cache_config, int(mc.hf_text_config.num_hidden_layers))
        self._groups.check_supported(pp, settings.layerwise)
        self._null_block = 0  # vLLM's null block (BlockPool.null_block); bound in bind_gpu_block_pool
        self._block_size = block_size
        self._sched: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        self._fleet: BackgroundRegistrar | None = None
        self._register: Callable[[], BackgroundRegistrar | None] | None = None  # until it ran
        self._streams: StreamPlanner | None = None  # layerwise push: which P requests stream this step
        if role == KVConnectorRole.SCHEDULER:
            if settings.layerwise and kv_role.produces:
                self._streams = StreamPlanner(block_size)
            host, port = rank_host(settings), settings.side_channel_port
            local = LocalEngine(engine_id, host, port, tp, pp, incarnation)
            sched = self._sched = SchedulerSide(kv_role, settings, local, block_size)
            model = settings.model_id or vllm_model_id(mc)
            # Registered once vLLM handed over the workers' side channels (a multi-node engine's record
            # names each rank's host from the first put); checked now, in the engine's start.
            self._register = lambda: start_registration(settings, kv_role, lambda: sched.local, model)
            if settings.discovery:
                vllm_record(settings, kv_role, local, model)
                check_target(settings.discovery, client=True)  # this process registers: its credentials
            return
        tp_rank, pp_rank = _tp_pp_rank()
        if _cpu_backend():
            # before the first step: vLLM's tile attention kernel would die of SIGILL (cpu_tiles)
            log.info("kvwire: AMX tile state for this worker: %s", allow_amx_tiles().value)
        mla = bool(getattr(mc, "use_mla", False))
        place = RankPlace(
            engine_id=engine_id,
            incarnation=incarnation,
            model_id=settings.model_id or vllm_model_id(mc),
            tp_size=tp,
            tp_rank=tp_rank,
            pp_size=pp,
            pp_rank=pp_rank,
            num_layers=int(mc.hf_text_config.num_hidden_layers),
            # MLA caches one latent "head" per token (vLLM's get_head_size: kv_lora_rank + rope dim); the
            # config's num_key_value_heads counts the query-side heads the latent expands to.
            kv_heads=1 if mla else int(mc.get_total_num_kv_heads()),
            head_dim=int(mc.get_head_size()),
            block_size=block_size,
            mla=mla,
            kv_tiles=_cpu_backend(),
            layer_groups=self._groups.layer_groups,
            group_windows=self._groups.group_windows,
        )
        self._worker = WorkerSide(kv_role, settings, place)

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        """Heads outermost inside each layer's block (LBHNC): a TP head slice is one contiguous run."""
        mc = vllm_config.model_config
        return None if mc is None or getattr(mc, "use_mla", False) else "LBHNC"

    # -- scheduler side --------------------------------------------------------------------------------
    def _s(self) -> SchedulerSide:
        assert self._sched is not None, "a scheduler-side method was called on a worker"
        return self._sched

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """save_kv_layer runs between the layers: not inside a captured full CUDA graph."""
        try:
            return settings_from_extra(extra_config).layerwise  # "false" is false, as kvwire reads it
        except ConfigError:
            return True  # the connector refuses the config at start anyway

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        """No: kvwire keeps its registration of the KV cache for the engine's life, and sleep mode
        releases the memory under it (peers would write into released pages)."""
        return False

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        n = _prompt_len(request)
        if self._streams is not None:
            self._streams.watch(request.request_id, request.kv_transfer_params, n, request.max_tokens)
        return self._s().matched_tokens(
            request.request_id, request.kv_transfer_params, n, num_computed_tokens
        )

    def bind_gpu_block_pool(self, gpu_block_pool: Any) -> None:
        null = getattr(gpu_block_pool, "null_block", None)
        self._null_block = int(null.block_id) if null is not None else 0

    def get_loaded_kv_cache_group_ids(self, request: Any) -> tuple[int, ...]:
        """D loads every group's blocks of the request (a hybrid model's sliding-window groups too)."""
        ids = getattr(self._kv_cache_config, "transfer_group_ids", None)
        return tuple(ids) if ids is not None else tuple(super().get_loaded_kv_cache_group_ids(request))

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        n = _prompt_len(request)
        ids: list[int] = []
        try:
            ids = (
                self._groups.flat(blocks.get_block_ids(), n, self._block_size) if num_external_tokens else []
            )
        except KvwireError as exc:  # never raise in vLLM's scheduler: no blocks, the worker fails the load
            log.warning("kvwire: %s: %s", request.request_id, exc)
        self._s().allocated(request.request_id, ids, n, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KvwireMetadata:
        self._start_fleet()  # a vLLM that never handed over the workers' metadata: register at the first step
        idle = int(getattr(scheduler_output, "total_num_scheduled_tokens", 1)) == 0
        ops = self._s().take_ops()
        if self._streams is not None:
            ops += self._streams.ops(scheduler_output, self._s().reserve)
        return KvwireMetadata(ops, idle=idle)

    def update_connector_output(self, connector_output: Any) -> None:
        self._s().transfers_ended(
            connector_output.finished_sending or (), connector_output.finished_recving or ()
        )

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished_all_groups(request, (block_ids,))

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """``SupportsHMA``: the request's blocks per KV cache group (one group without HMA)."""
        status = str(getattr(request.status, "name", request.status))
        aborted = "ABORT" in status or "ERROR" in status
        if self._streams is not None:
            self._streams.forget(request.request_id)
        n, bs = _prompt_len(request), self._block_size
        ids: list[int] = []
        try:
            sends = self._s().sends(request.kv_transfer_params)
            if sends and not aborted and self._groups.window_lost(block_ids, n, bs, self._null_block):
                # P no longer holds a block D's sliding window needs: D is told at once and recomputes.
                raise LayoutError("a sliding window's first block is already freed on P: not sent")
            ids = self._groups.flat(block_ids, n, bs) if not aborted else []
        except KvwireError as exc:  # never raise in vLLM's scheduler: D's registration fails at once
            log.warning("kvwire: %s: %s", request.request_id, exc)
            aborted = True
        return self._s().finished(request.request_id, request.kv_transfer_params, ids, n, aborted)

    def has_pending_push_work(self) -> bool:
        return self._sched is not None and self._sched.has_pending_sends()

    def set_xfer_handshake_metadata_pp_aware(self, metadata: dict[tuple[int, int], Any]) -> None:
        """Every worker's side channel, gathered by vLLM at start (``get_handshake_metadata``): where
        each rank of a multi-node engine listens, named in P's answers."""
        if self._sched is not None:
            # Inside vLLM's MultiConnector the metadata may be another sub-connector's: not ours, ignored.
            self._sched.set_channels({k: v for k, v in metadata.items() if isinstance(v, RankChannel)})
            self._start_fleet()

    def _start_fleet(self) -> None:
        if self._register is not None:
            register, self._register = self._register, None
            self._fleet = register()

    def set_xfer_handshake_metadata(self, metadata: dict[int, Any]) -> None:
        self.set_xfer_handshake_metadata_pp_aware({(0, tp): m for tp, m in metadata.items()})

    # -- worker side -----------------------------------------------------------------------------------
    def _w(self) -> WorkerSide:
        assert self._worker is not None, "a worker-side method was called on the scheduler"
        return self._worker

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        self._w().register(kv_caches)

    def get_handshake_metadata(self) -> RankChannel | None:
        return self._worker.channel() if self._worker is not None else None

    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        super().bind_connector_metadata(connector_metadata)
        if (
            isinstance(connector_metadata, KvwireMetadata)
            and connector_metadata.ops
            and self._worker is not None
        ):
            self._worker.bind(connector_metadata.ops)  # layer-wise: before the forward's save_kv_layer calls

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if isinstance(meta, KvwireMetadata) and meta.ops:
            self._w().start(meta.ops)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """KV arrives before the request is scheduled (async load): nothing to wait for per layer."""

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        """Layerwise: this layer of the step's streamed requests is computed (whole-request push: nothing,
        P sends a finished request's blocks on the scheduler's SEND)."""
        streamer = self._worker.streamer if self._worker is not None else None
        if streamer is not None and streamer.active:
            streamer.layer_saved(layer_name, kv_layer)

    def wait_for_save(self) -> None:
        """Layerwise: the step's layer writes end before it does (whole-request push: nothing to wait for,
        P's blocks stay held until kvwire reports the request)."""
        streamer = self._worker.streamer if self._worker is not None else None
        if streamer is not None:
            streamer.step_over()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        res = self.get_transfer_results(finished_req_ids)
        return res.finished_sending or None, res.finished_recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        meta = self._connector_metadata
        worker = self._w()
        idle = isinstance(meta, KvwireMetadata) and meta.idle
        done = worker.finished(worker.settings.idle_step_wait_ms / 1e3 if idle else 0.0)
        return KVConnectorTransferResults(
            finished_sending=done.sending, finished_recving=done.recving, failed_recving=done.failed_recving
        )

    # -- both sides: vLLM's stats path (docs/vllm.md, "Metrics") ---------------------------------------
    def get_kv_connector_stats(self) -> KvwireStats | None:
        """What kvwire did since vLLM last asked (this worker's ranks, or the scheduler's rejections)."""
        try:
            data = self._worker.step_stats() if self._worker is not None else self._s().step_stats()
        except Exception as exc:  # a counter must never stop vLLM's step
            _STATS_LOG.log(log, logging.WARNING, "kvwire: stats not taken this step: %r", exc)
            return None
        return KvwireStats(data=data) if data is not None else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KvwireStats:
        return KvwireStats(data=data or {})

    @classmethod
    def build_prom_metrics(
        cls, vllm_config: VllmConfig, metric_types: Any, labelnames: list[str], per_engine_labelvalues: Any
    ) -> KvwirePromMetrics:
        return KvwirePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()
        if self._fleet is not None:
            self._fleet.close()


def _prompt_len(request: Any) -> int:
    """The prompt's length in tokens: ``num_prompt_tokens`` (a prompt-embeds request has no
    ``prompt_token_ids``: its ``len`` raised inside vLLM's scheduler and killed the engine core)."""
    n = getattr(request, "num_prompt_tokens", None)
    return int(n) if n is not None else len(request.prompt_token_ids or ())

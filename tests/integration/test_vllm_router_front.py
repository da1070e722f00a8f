"""vLLM's Rust router (``vllm-router``, PD mode) in front of kvwire's reference engines, unchanged.

``vllm-router --vllm-pd-disaggregation`` sends P a copy of the request with ``max_tokens`` 1, no stream and
``kv_transfer_params`` ``{"do_remote_decode": true, ...nulls}``, waits for P's answer, then sends D the
client's request with P's ``kv_transfer_params`` as they are (vLLM's proxy protocol). kvwire's P names
the transfer and answers D's parameters (``do_remote_prefill``, P's side channel; in pull mode its
blocks), so D loads the prompt's KV from P. Every answer must equal a colocated engine's, and D's
``timings`` must show a KV transfer (D computed only the last prompt token).

The router comes from ``make vllm-router-env`` (``.venv-vllm-router``) or ``KVWIRE_VLLM_ROUTER``
(``kvwire.testing.vllm_router``). tests/vllm/test_vllm_engines_router_front.py puts it in front of whole
vLLM engines.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from kvwire.protocol.messages import TransferMode
from kvwire.testing.procs import Server, ServerGroup, free_port
from kvwire.testing.vllm_router import router_binary, start_pd_router
from kvwire_tools.demo.config import DemoConfig
from kvwire_tools.demo.runner import _engine_args

pytestmark = [pytest.mark.nixl, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]
PROMPTS = ["hello", "x" * 31, "the quick brown fox " * 20, "0123456789" * 70]


@dataclass
class Front:
    router: str
    colocated: str


@pytest.fixture(scope="module", params=[TransferMode.PUSH, TransferMode.PULL], ids=["push", "pull"])
def front(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Front]:
    cfg = DemoConfig(mode=request.param)
    with ServerGroup(tmp_path_factory.mktemp(f"vllm-router-{request.param.value}")) as group:
        engines: list[Server] = []
        for role in ("prefill", "decode", "colocated"):
            port = free_port()
            engines.append(group.start(role, _engine_args(cfg, role, port, 1), port))
        group.wait_healthy(engines, 120)
        p, d, colocated = engines
        router = start_pd_router(group, router_binary(ROOT), p, d)
        yield Front(router.url, colocated.url)


@pytest.mark.parametrize("prompt", PROMPTS, ids=[str(len(p)) for p in PROMPTS])
def test_vllm_router_pd_mode_serves_kvwire_engines(front: Front, prompt: str) -> None:
    body = {"model": "kvwire-tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    got = httpx.post(f"{front.router}/v1/completions", json=body, timeout=60)
    want = httpx.post(f"{front.colocated}/v1/completions", json=body, timeout=60)
    assert got.status_code == 200 and want.status_code == 200, (got.text[:300], want.text[:300])
    answer = got.json()
    assert answer["choices"][0]["token_ids"] == want.json()["choices"][0]["token_ids"]
    # D's own account (the router passes D's body through): the prompt's KV came from P.
    assert answer["timings"]["kv_transfer_ms"] is not None and answer["timings"]["kv_bytes"] > 0

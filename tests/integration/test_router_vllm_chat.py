"""The router in front of vLLM servers (``--engines vllm``), with the official ``openai`` client, against
fakes that answer as vLLM does (``fake_engine_app(..., vllm=True)``): chat goes to the engines' own
/v1/chat/completions with the client's messages (each applies its model's chat template), and a stream
asks D for its usage chunk, which reaches the clients that asked for it. With kvwire's reference engines
chat still goes to /v1/completions with the fixed template's prompt.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvwire.config import EngineKind, RouterConfig
from kvwire.router.app import create_app
from kvwire.router.openai_api import render_chat
from kvwire.testing.fake_engines import (
    FakeCluster,
    ServerThread,
    fake_chat_prompt,
    fake_engine_app,
    fake_tokens,
)
from kvwire.testing.procs import free_port

P_SIDE = "127.0.0.1:45021"
CHAT = "/v1/chat/completions"
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]


@dataclass
class Stack:
    vllm: FakeCluster
    vllm_router: str
    kvwire: FakeCluster
    kvwire_router: str


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    vllm, kvwire = FakeCluster(), FakeCluster()
    vp, vd, vr, kp, kd, kr = (free_port() for _ in range(6))

    def router(prefill: str, decode: int, engines: str) -> object:
        config = RouterConfig(
            prefill_urls=(prefill,),
            decode_urls=(f"http://127.0.0.1:{decode}",),
            request_timeout_s=30.0,
            health_interval_s=0.5,
            engines=EngineKind(engines),
        )
        return create_app(config)

    apps = [
        (fake_engine_app("prefill", vllm, 45_021, vllm=True), vp),
        (fake_engine_app("decode", vllm, 45_022, vllm=True), vd),
        (router(f"http://127.0.0.1:{vp}#engine_id=p0&side_channel={P_SIDE}", vd, "vllm"), vr),
        (fake_engine_app("prefill", kvwire, 45_023), kp),
        (fake_engine_app("decode", kvwire, 45_024), kd),
        (router(f"http://127.0.0.1:{kp}", kd, "kvwire"), kr),
    ]
    with ServerThread(apps):
        yield Stack(vllm, f"http://127.0.0.1:{vr}", kvwire, f"http://127.0.0.1:{kr}")


def _clear(cluster: FakeCluster) -> FakeCluster:
    cluster.prefill_bodies.clear()
    cluster.decode_bodies.clear()
    cluster.paths.clear()
    return cluster


@pytest.fixture
def vllm(stack: Stack) -> FakeCluster:
    return _clear(stack.vllm)


@pytest.fixture
def kvwire(stack: Stack) -> FakeCluster:
    return _clear(stack.kvwire)


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


def _one_leg_each(cluster: FakeCluster, path: str) -> tuple[dict[str, Any], dict[str, Any]]:
    assert sorted(cluster.paths) == [f"decode {path}", f"prefill {path}"]
    (p_body,), (d_body,) = cluster.prefill_bodies, cluster.decode_bodies
    return p_body, d_body


def test_chat_goes_to_the_engines_chat_api_with_the_messages(stack: Stack, vllm: FakeCluster) -> None:
    out = client(stack.vllm_router).chat.completions.create(
        model="fake",
        messages=MESSAGES,  # type: ignore[arg-type]
        max_completion_tokens=6,
    )
    assert out.object == "chat.completion" and out.id.startswith("chatcmpl-")
    assert out.choices[0].message.role == "assistant"
    # The engines' own template, not the router's fixed one.
    assert out.choices[0].message.content == expected(fake_chat_prompt(MESSAGES), 6)
    assert out.usage is not None and out.usage.completion_tokens == 6
    p_body, d_body = _one_leg_each(vllm, CHAT)
    for body in (p_body, d_body):
        assert body["messages"] == MESSAGES and "prompt" not in body
        assert "max_completion_tokens" not in body and "stream_options" not in body
    assert (p_body["max_tokens"], p_body["stream"]) == (1, False)
    assert p_body["kv_transfer_params"]["do_remote_decode"] is True
    assert d_body["max_tokens"] == 6
    kv = d_body["kv_transfer_params"]
    assert (kv["remote_engine_id"], f"{kv['remote_host']}:{kv['remote_port']}") == ("p0", P_SIDE)


@pytest.mark.parametrize("include_usage", [True, False])
def test_a_chat_stream_has_one_role_chunk_and_usage_only_when_asked(
    stack: Stack, vllm: FakeCluster, include_usage: bool
) -> None:
    chunks = list(
        client(stack.vllm_router).chat.completions.create(  # type: ignore[call-overload]
            model="fake",
            messages=MESSAGES,
            max_tokens=5,
            stream=True,
            stream_options={"include_usage": include_usage},
        )
    )
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    # The router opens the stream with its own role chunk; vLLM's role-only first chunk is not repeated.
    roles = [c for c in chunks if c.choices and c.choices[0].delta.role]
    assert roles == [chunks[0]]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected(fake_chat_prompt(MESSAGES), 5)
    usage = [c.usage for c in chunks if c.usage is not None]
    if include_usage:
        assert not chunks[-1].choices and usage == [chunks[-1].usage]
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 5
    else:
        assert usage == [] and chunks[-1].choices[0].finish_reason == "length"
    p_body, d_body = _one_leg_each(vllm, CHAT)
    # D is asked for usage whatever the client asked (the router filters it); P's unstreamed leg is not.
    assert d_body["stream"] is True and d_body["stream_options"] == {"include_usage": True}
    assert p_body["stream"] is False and "stream_options" not in p_body


def test_a_completion_stream_through_vllm_gets_its_usage(stack: Stack, vllm: FakeCluster) -> None:
    chunks = list(
        client(stack.vllm_router).completions.create(
            model="fake", prompt="count", max_tokens=3, stream=True, stream_options={"include_usage": True}
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected("count", 3)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 3
    _p_body, d_body = _one_leg_each(vllm, "/v1/completions")
    assert d_body["prompt"] == "count" and d_body["stream_options"] == {"include_usage": True}


@pytest.mark.parametrize("stream", [False, True])
def test_chat_logprobs_go_as_given_and_come_back_once_shaped(
    stack: Stack, vllm: FakeCluster, stream: bool
) -> None:
    out = client(stack.vllm_router).chat.completions.create(
        model="fake",
        messages=MESSAGES,  # type: ignore[arg-type]
        max_tokens=3,
        logprobs=True,
        top_logprobs=2,
        stream=stream,
    )
    if stream:
        pieces = [c.choices[0] for c in out if c.choices and c.choices[0].logprobs]  # type: ignore[union-attr]
        content = [e for p in pieces for e in (p.logprobs.content or [])]  # type: ignore[union-attr]
    else:
        content = out.choices[0].logprobs.content or []  # type: ignore[union-attr]
    assert "".join(e.token for e in content) == expected(fake_chat_prompt(MESSAGES), 3)
    assert all(len(e.top_logprobs) == 2 for e in content)
    _p_body, d_body = _one_leg_each(vllm, CHAT)
    assert (d_body["logprobs"], d_body["top_logprobs"]) == (True, 2)


def _inter_token_count(url: str) -> float:
    for family in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for s in family.samples:
            if s.name == "kvwire_inter_token_latency_seconds_count":
                return s.value
    return 0.0


def test_a_role_only_chunk_is_not_a_token_in_the_latency_metrics(stack: Stack, vllm: FakeCluster) -> None:
    before = _inter_token_count(stack.vllm_router)
    for _ in client(stack.vllm_router).chat.completions.create(
        model="fake",
        messages=MESSAGES,  # type: ignore[arg-type]
        max_tokens=4,
        stream=True,
    ):
        pass
    assert _inter_token_count(stack.vllm_router) - before == 3  # 3 gaps between 4 tokens


@pytest.mark.parametrize("stream", [False, True])
def test_kvwire_engines_still_get_chat_as_a_rendered_completion(
    stack: Stack, kvwire: FakeCluster, stream: bool
) -> None:
    out = client(stack.kvwire_router).chat.completions.create(
        model="fake",
        messages=MESSAGES,  # type: ignore[arg-type]
        max_tokens=4,
        stream=stream,
        stream_options={"include_usage": True} if stream else None,
    )
    if stream:
        text = "".join(c.choices[0].delta.content or "" for c in out if c.choices)  # type: ignore[union-attr]
    else:
        text = out.choices[0].message.content or ""  # type: ignore[union-attr]
    assert text == expected(render_chat(MESSAGES), 4)
    _p_body, d_body = _one_leg_each(kvwire, "/v1/completions")
    # kvwire's engines always send their usage and refuse stream_options: the router never sends it.
    assert d_body["prompt"] == render_chat(MESSAGES) and "messages" not in d_body
    assert "stream_options" not in d_body

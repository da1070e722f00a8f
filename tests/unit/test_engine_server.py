"""The engine server's HTTP API, in process (httpx against the ASGI app; the engine thread runs)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from engine_server_env import make_server, reference
from prometheus_client.parser import text_string_to_metric_families

from kvwire.apikey import MAX_BODY_BYTES
from kvwire.engine.server import EngineServer
from kvwire.errors import KvwireError

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
async def client() -> AsyncIterator[tuple[httpx.AsyncClient, EngineServer]]:
    server = make_server()
    server.start()
    try:
        transport = httpx.ASGITransport(app=server.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://engine") as c:
            yield c, server
    finally:
        server.stop()


async def test_health(client: tuple[httpx.AsyncClient, EngineServer]) -> None:
    c, _ = client
    r = await c.get("/health")
    assert r.status_code == 200
    body = r.json()
    assert body["role"] == "colocated" and body["engine_id"] == "colocated-test"
    assert body["side_channel_port"] == 5600 and body["tp_size"] == 1 and body["pp_size"] == 1
    assert body["load"] == {"running": 0, "waiting": 0, "free_blocks": 128}


async def test_completion_matches_engine(client: tuple[httpx.AsyncClient, EngineServer]) -> None:
    c, _ = client
    r = await c.post(
        "/v1/completions", json={"prompt": "Hello, kvwire!", "max_tokens": 8, "ignore_eos": True}
    )
    assert r.status_code == 200, r.text
    body = r.json()
    choice = body["choices"][0]
    assert body["object"] == "text_completion"
    assert choice["token_ids"] == reference("Hello, kvwire!", 8)
    assert choice["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": 15, "completion_tokens": 8, "total_tokens": 23}
    assert body["kv_transfer_params"] is None
    assert body["timings"]["ttft_ms"] > 0


async def test_token_id_prompt_and_unknown_fields(client: tuple[httpx.AsyncClient, EngineServer]) -> None:
    c, server = client
    ids = server.engine.tokenizer.encode("abc")
    body = {"prompt": ids, "max_tokens": 3, "ignore_eos": True, "top_p": 0.9, "temperature": 0}
    r = await c.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["token_ids"] == reference("abc", 3)
    # an unknown field is refused, naming it (never silently ignored)
    r = await c.post("/v1/completions", json={**body, "user": "x"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "user"


async def test_stream(client: tuple[httpx.AsyncClient, EngineServer]) -> None:
    c, _ = client
    body = {"prompt": "stream me", "max_tokens": 5, "stream": True, "ignore_eos": True}
    async with c.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line[len("data: ") :] async for line in r.aiter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert [t for ch in chunks for t in ch["choices"][0]["token_ids"]] == reference("stream me", 5)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all(ch["choices"][0]["finish_reason"] is None for ch in chunks[:-1])
    assert chunks[-1]["timings"]["ttft_ms"] > 0
    assert chunks[-1]["usage"]["completion_tokens"] == 5


async def test_stream_options_include_usage_ends_with_a_usage_chunk(
    client: tuple[httpx.AsyncClient, EngineServer],
) -> None:
    """As OpenAI's and vLLM's: the engine refused stream_options (a 400 for any client that asks)."""
    c, _ = client
    body = {"prompt": "stream me", "max_tokens": 3, "stream": True, "ignore_eos": True}
    for options, usage_chunks in ((None, 0), ({"include_usage": True}, 1), ({"include_usage": False}, 0)):
        sent = body if options is None else {**body, "stream_options": options}
        async with c.stream("POST", "/v1/completions", json=sent) as r:
            assert r.status_code == 200
            events = [line[6:] async for line in r.aiter_lines() if line.startswith("data: ")]
        chunks = [json.loads(e) for e in events[:-1]]
        only_usage = [ch for ch in chunks if ch["choices"] == []]
        assert len(only_usage) == usage_chunks and events[-1] == "[DONE]"
        if usage_chunks:  # then, as OpenAI's, only that chunk carries usage (clients sum it otherwise)
            assert chunks[-1] is only_usage[0] and only_usage[0]["usage"]["completion_tokens"] == 3
            assert all(ch["usage"] is None for ch in chunks[:-1])
        else:  # the router reads it from the last content chunk
            assert chunks[-1]["usage"]["completion_tokens"] == 3
    for bad in ({**body, "stream": False, "stream_options": {"include_usage": True}},
                {**body, "stream_options": {"continuous_usage_stats": True}},
                {**body, "stream_options": {"include_usage": "yes"}}):  # fmt: skip
        r = await c.post("/v1/completions", json=bad)
        assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options", r.text


async def test_an_error_mid_stream_is_an_error_event_then_done(
    client: tuple[httpx.AsyncClient, EngineServer], monkeypatch: pytest.MonkeyPatch
) -> None:
    c, server = client
    submit = server._submit

    def fail_after_first(creq: Any) -> Any:
        """The request's outputs, its second replaced by a failure (a KV or engine fault mid-answer)."""
        req, queue = submit(creq)
        got, seen = queue.get, []

        async def get() -> Any:
            out = await got()
            seen.append(out)
            if len(seen) > 1 and out.new_token_ids:
                return dataclasses.replace(out, error=KvwireError("KV lost mid-answer"), finished=True)
            return out

        monkeypatch.setattr(queue, "get", get)
        return req, queue

    monkeypatch.setattr(server, "_submit", fail_after_first)
    body = {"prompt": "stream me", "max_tokens": 5, "stream": True, "ignore_eos": True}
    async with c.stream("POST", "/v1/completions", json=body) as r:
        events = [line[len("data: ") :] async for line in r.aiter_lines() if line.startswith("data: ")]
    # As vLLM: the error event, then [DONE] for a reader that waits for the end (it had to see EOF).
    assert json.loads(events[-2])["error"]["message"] == "KV lost mid-answer" and events[-1] == "[DONE]"
    assert "choices" in json.loads(events[0])


@pytest.mark.parametrize(
    "body",
    [
        {"max_tokens": 4},
        {"prompt": [], "max_tokens": 4},
        {"prompt": [1, "a"]},
        {"prompt": [999999]},
        {"prompt": "x", "max_tokens": 0},
        {"prompt": "x", "max_tokens": "4"},
        {"prompt": "x", "max_tokens": True},
        {"prompt": "x", "stream": "yes"},
        {"prompt": "x", "n": 2},
        {"prompt": "x", "max_tokens": 100000},
        {"prompt": "x", "kv_transfer_params": {"do_remote_decode": True, "transfer_id": ""}},
        {"prompt": "x", "kv_transfer_params": {"do_remote_prefill": True, "transfer_id": "t"}},
        {"prompt": "x", "no_stop_trim": True},  # vllm-router's SGLang-named fields: only at their neutral
        {"prompt": "x", "skip_special_tokens": False},
        {"prompt": "x", "kv_transfer_params": "nope"},
        [1, 2],
        # sampling: out of range, or something the engine cannot honour (never silently ignored)
        {"prompt": "x", "temperature": -1},
        {"prompt": "x", "top_p": 1.5},
        {"prompt": "x", "top_k": -2},
        {"prompt": "x", "logprobs": 21},
        {"prompt": "x", "echo": True, "logprobs": 1},
        {"prompt": "x", "stop": [""]},
        {"prompt": "x", "max_tokens": 2, "min_tokens": 3},
        {"prompt": "x", "presence_penalty": 0.5},
        {"prompt": "x", "logit_bias": {"5": 10}},
        {"prompt": "x", "suffix": "y"},
    ],
)
async def test_bad_input_is_400(client: tuple[httpx.AsyncClient, EngineServer], body: object) -> None:
    c, _ = client
    r = await c.post("/v1/completions", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["code"] == 400 and err["message"]
    if isinstance(body, dict) and len(body) == 2 and body.get("prompt") == "x":
        # one parameter besides the prompt: the error names it
        (name,) = set(body) - {"prompt"}
        assert err["param"] == name and name in err["message"]


async def test_neutral_sampling_values_are_accepted(client: tuple[httpx.AsyncClient, EngineServer]) -> None:
    c, _ = client
    body = {"prompt": "x", "max_tokens": 2, "temperature": 0, "top_p": 1, "top_k": -1, "seed": 3,
            "logprobs": None, "echo": False, "stop": [], "presence_penalty": 0, "best_of": 1}  # fmt: skip
    r = await c.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text


async def test_invalid_json_is_400(client: tuple[httpx.AsyncClient, EngineServer]) -> None:
    c, _ = client
    r = await c.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400


def _openai_error(r: httpx.Response, status: int, kind: str) -> dict[str, object]:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["type"] == kind and error["code"] == status and error["message"]
    return dict(error)


@pytest.mark.parametrize(
    "raw",
    [
        b'{"prompt": "hi", "max_tokens": ' + b"7" * 5000 + b"}",  # Python's int() refuses 4,300+ digits
        b'{"prompt": "\\ud800 lone surrogate", "max_tokens": 2}',
        b'{"prompt": "hi", "stop": ' + b"[" * 50_000 + b"]" * 50_000 + b"}",
        b'{"prompt": "hi", "max_tokens": 1e999}',
        b'{"prompt": "\xff\xfe not utf-8"}',
    ],
    ids=["5000-digits", "lone-surrogate", "deep-nesting", "inf", "bad-utf8"],
)
async def test_hostile_json_is_an_openai_400(
    client: tuple[httpx.AsyncClient, EngineServer], raw: bytes
) -> None:
    c, _ = client
    r = await c.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
    _openai_error(r, 400, "invalid_request_error")
    # The engine is unharmed: the next request is served.
    ok = await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert ok.status_code == 200 and len(ok.json()["choices"][0]["token_ids"]) == 2


async def test_an_unknown_model_is_404_model_not_found(
    client: tuple[httpx.AsyncClient, EngineServer],
) -> None:
    c, _ = client
    r = await c.post("/v1/completions", json={"model": "gpt-9", "prompt": "hi", "max_tokens": 2})
    assert r.status_code == 404, r.text
    error = r.json()["error"]
    assert error["code"] == "model_not_found" and error["param"] == "model" and "gpt-9" in error["message"]
    for name in ("kvwire-tiny", "kvwire", None):  # its own id, its alias (the router's default), none
        body = {"prompt": "hi", "max_tokens": 2, **({"model": name} if name else {})}
        ok = await c.post("/v1/completions", json=body)
        assert ok.status_code == 200 and ok.json()["model"] == (name or "kvwire-tiny"), ok.text
    ids = [m["id"] for m in (await c.get("/v1/models")).json()["data"]]
    assert ids == ["kvwire-tiny", "kvwire"]


async def test_an_oversized_body_is_refused_unbuffered(
    client: tuple[httpx.AsyncClient, EngineServer],
) -> None:
    c, _ = client
    big = b'{"prompt": "' + b"a" * (MAX_BODY_BYTES + 1) + b'"}'
    r = await c.post("/v1/completions", content=big)
    assert "limit" in str(_openai_error(r, 400, "invalid_request_error")["message"])


async def test_framework_refusals_are_openai_shaped(client: tuple[httpx.AsyncClient, EngineServer]) -> None:
    c, _ = client
    _openai_error(await c.get("/v1/nothing-here"), 404, "not_found_error")
    _openai_error(await c.get("/v1/completions"), 405, "invalid_request_error")
    _openai_error(await c.get("/v1/kv_stats", params={"timeline": "many"}), 400, "invalid_request_error")


async def test_prompt_larger_than_cache_is_400(client: tuple[httpx.AsyncClient, EngineServer]) -> None:
    c, _ = client
    r = await c.post("/v1/completions", json={"prompt": "y" * (128 * 16 + 1), "max_tokens": 1})
    assert r.status_code == 400
    assert "blocks" in r.json()["error"]["message"]


async def test_metrics_and_kv_stats(client: tuple[httpx.AsyncClient, EngineServer]) -> None:
    c, _ = client
    await c.post("/v1/completions", json={"prompt": "count me", "max_tokens": 2})
    await c.post("/v1/completions", json={"prompt": "", "max_tokens": 0})
    text = (await c.get("/metrics")).text
    samples = {
        (s.name, s.labels.get("outcome")): (s.labels["role"], s.labels["model_name"], s.value)
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    assert samples[("kvwire_requests_total", "ok")] == ("colocated", "kvwire-tiny", 1.0)
    assert samples[("kvwire_requests_total", "bad_request")] == ("colocated", "kvwire-tiny", 1.0)
    assert samples[("kvwire_blocks_total", None)] == ("colocated", "kvwire-tiny", 128.0)
    # The colocated engine has no connector: no transfer or handshake family, not even an empty one.
    assert "kvwire_transfer" not in text and "kvwire_handshake" not in text
    stats = (await c.get("/v1/kv_stats")).json()
    assert stats["blocks_in_use"] == 0 and stats["blocks_quarantined"] == 0
    models = (await c.get("/v1/models")).json()
    assert models["data"][0]["id"] == "kvwire-tiny"

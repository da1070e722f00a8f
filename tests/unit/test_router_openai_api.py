from __future__ import annotations

from typing import Any

import pytest

from kvwire.router.engines import HealthInfo
from kvwire.router.legs import decode_body, prefill_body
from kvwire.router.openai_api import (
    ApiError,
    ApiKind,
    ErrorType,
    completion_response,
    decode_json_object,
    parse_request,
    render_chat,
    stream_chunks,
)

MODELS = frozenset({"kvwire", "tiny"})


def parse(body: dict[str, Any], kind: ApiKind = ApiKind.COMPLETION) -> Any:
    return parse_request(body, kind, MODELS)


def test_parse_completion_defaults_and_forwarded_fields() -> None:
    req = parse({"model": "tiny", "prompt": "hi", "temperature": 0, "top_p": None})
    assert (req.prompt, req.max_tokens, req.stream, req.include_usage) == ("hi", 16, False, False)
    body = req.engine_body()
    assert body == {"model": "tiny", "prompt": "hi", "max_tokens": 16, "stream": False, "temperature": 0}


@pytest.mark.parametrize(
    ("kind", "field"),
    [
        (ApiKind.COMPLETION, "user"),
        (ApiKind.COMPLETION, "suffix"),
        (ApiKind.COMPLETION, "top_logprobs"),
        (ApiKind.CHAT, "tools"),
        (ApiKind.CHAT, "response_format"),
        (ApiKind.CHAT, "echo"),
    ],
)
def test_unknown_parameters_are_refused_naming_them(kind: ApiKind, field: str) -> None:
    base: dict[str, Any] = {"model": "tiny", "prompt": "hi", "messages": [{"role": "user", "content": "x"}]}
    base.pop("messages" if kind is ApiKind.COMPLETION else "prompt")
    with pytest.raises(ApiError) as exc:
        parse({**base, field: 1}, kind)
    assert exc.value.kind is ErrorType.INVALID_REQUEST and exc.value.param == field
    assert field in exc.value.message


def test_chat_logprobs_become_completion_logprobs_and_back() -> None:
    msgs = [{"role": "user", "content": "x"}]
    body = parse({"model": "tiny", "messages": msgs, "logprobs": True, "top_logprobs": 2}, ApiKind.CHAT)
    assert body.engine_body()["logprobs"] == 2
    with pytest.raises(ApiError) as exc:
        parse({"model": "tiny", "messages": msgs, "top_logprobs": 2}, ApiKind.CHAT)
    assert exc.value.param == "top_logprobs"
    req = parse({"model": "tiny", "messages": msgs, "logprobs": True}, ApiKind.CHAT)
    engine = {
        "choices": [
            {
                "text": "A\u00e9",
                "logprobs": {
                    "tokens": ["A", "bytes:\\xc3"],
                    "token_logprobs": [-0.5, -1.0],
                    "top_logprobs": [{"A": -0.5}, {"bytes:\\xc3": -1.0, "B": -2.0}],
                    "text_offset": [0, 1],
                },
            }
        ]
    }
    lp = completion_response(engine, req, "id", 0)["choices"][0]["logprobs"]
    assert [e["token"] for e in lp["content"]] == ["A", "bytes:\\xc3"]
    assert lp["content"][1]["bytes"] == [0xC3] and lp["content"][0]["bytes"] == [65]
    assert [t["token"] for t in lp["content"][1]["top_logprobs"]] == ["bytes:\\xc3", "B"]
    completion = parse({"model": "tiny", "prompt": "x", "logprobs": 1})
    got = completion_response(engine, completion, "id", 0)["choices"][0]["logprobs"]
    assert got == engine["choices"][0]["logprobs"]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", -1), ("temperature", 2.5), ("top_p", 0), ("top_p", 1.5), ("top_p", "x"),
        ("top_k", -2), ("seed", "s"), ("stop", [1]), ("logprobs", 6), ("echo", "yes"), ("min_tokens", -1),
        ("presence_penalty", 3), ("logit_bias", {"1": 200}), ("best_of", 0), ("ignore_eos", 1),
    ],
)  # fmt: skip
def test_out_of_range_sampling_is_refused_by_the_router(field: str, value: object) -> None:
    with pytest.raises(ApiError) as exc:
        parse({"model": "tiny", "prompt": "hi", field: value})
    assert exc.value.kind is ErrorType.INVALID_REQUEST and exc.value.param == field


def test_sampling_parameters_reach_the_engines() -> None:
    body = parse({"model": "tiny", "prompt": "hi", "top_k": 5, "logprobs": 2, "stop": ["."]}).engine_body()
    assert (body["top_k"], body["logprobs"], body["stop"]) == (5, 2, ["."])


def test_parse_accepts_single_prompt_batches_and_token_ids() -> None:
    assert parse({"model": "kvwire", "prompt": ["one"]}).prompt == "one"
    assert parse({"model": "kvwire", "prompt": [[1, 2, 3]]}).prompt == [1, 2, 3]
    assert parse({"model": "kvwire", "prompt": [4, 5]}).prompt == [4, 5]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": "kvwire"}, "prompt"),
        ({"model": "kvwire", "prompt": ""}, "prompt"),
        ({"model": "kvwire", "prompt": ["a", "b"]}, "prompt"),
        ({"model": "kvwire", "prompt": [1, -2]}, "prompt"),
        ({"model": "kvwire", "prompt": [True]}, "prompt"),
        ({"model": "kvwire", "prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"model": "kvwire", "prompt": "x", "max_tokens": "3"}, "max_tokens"),
        ({"model": "kvwire", "prompt": "x", "n": 2}, "n"),
        ({"model": "kvwire", "prompt": "x", "stream": "yes"}, "stream"),
        ({"prompt": "x"}, "model"),
    ],
)
def test_parse_rejects_bad_requests_with_400(body: dict[str, Any], param: str) -> None:
    with pytest.raises(ApiError) as err:
        parse(body)
    assert err.value.kind is ErrorType.INVALID_REQUEST and err.value.status == 400
    assert err.value.param == param
    assert err.value.body()["error"]["type"] == "invalid_request_error"


def test_unknown_model_is_404() -> None:
    with pytest.raises(ApiError) as err:
        parse({"model": "gpt-9", "prompt": "x"})
    assert err.value.status == 404


def test_decode_json_object_refuses_non_objects() -> None:
    assert decode_json_object(b'{"a": 1}') == {"a": 1}
    nested = b"[" * 100_000 + b"]" * 100_000
    lone_surrogate = b'{"prompt": "\\ud800"}'  # json took it; the prompt's encode was then a 500
    for raw in (b"[1]", b"{", b"\xff", nested, b'{"n": ' + b"7" * 5000 + b"}", lone_surrogate):
        with pytest.raises(ApiError):
            decode_json_object(raw)


def test_chat_template_and_max_completion_tokens() -> None:
    messages = [
        {"role": "developer", "content": "rules"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None},
    ]
    assert render_chat(messages) == "<|system|>\nrules\n<|user|>\nab\n<|assistant|>\n\n<|assistant|>\n"
    req = parse({"model": "kvwire", "messages": messages, "max_completion_tokens": 3}, ApiKind.CHAT)
    assert req.max_tokens == 3 and req.kind is ApiKind.CHAT
    for bad in (
        [],
        [{"role": "wizard", "content": "x"}],
        [{"role": "user", "content": [{"type": "image_url"}]}],
    ):
        with pytest.raises(ApiError):
            render_chat(bad)


def _engine_obj(text: str, ids: list[int], finish: str | None = "length") -> dict[str, Any]:
    choice = {"index": 0, "text": text, "token_ids": ids, "finish_reason": finish}
    return {
        "choices": [choice],
        "usage": {"prompt_tokens": 2, "completion_tokens": len(ids), "total_tokens": 5},
    }


def test_completion_and_chat_response_shapes() -> None:
    comp = parse({"model": "tiny", "prompt": "x"})
    out = completion_response(_engine_obj("abc", [97, 98, 99]), comp, "cmpl-1", 7)
    assert out["object"] == "text_completion" and out["model"] == "tiny" and out["id"] == "cmpl-1"
    assert out["choices"][0]["text"] == "abc" and out["choices"][0]["token_ids"] == [97, 98, 99]
    chat = parse({"model": "tiny", "messages": [{"role": "user", "content": "x"}]}, ApiKind.CHAT)
    out = completion_response(_engine_obj("abc", [97, 98, 99]), chat, "chatcmpl-1", 7)
    assert out["object"] == "chat.completion"
    assert out["choices"][0]["message"] == {"role": "assistant", "content": "abc"}
    assert out["usage"]["completion_tokens"] == 3


def test_chat_stream_opens_with_role_delta_and_usage_only_when_asked() -> None:
    chat = parse(
        {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "stream": True}, ApiKind.CHAT
    )
    first = stream_chunks(_engine_obj("a", [97], None), chat, "c", 1, first=True)
    assert [c["choices"][0]["delta"] for c in first] == [
        {"role": "assistant", "content": ""},
        {"content": "a"},
    ]
    later = stream_chunks(_engine_obj("b", [98]), chat, "c", 1, first=False)
    assert len(later) == 1 and later[0]["choices"][0]["finish_reason"] == "length"
    assert stream_chunks({"usage": {"total_tokens": 3}}, chat, "c", 1, first=False) == []
    asked = parse({"model": "tiny", "prompt": "x", "stream": True, "stream_options": {"include_usage": True}})
    usage = stream_chunks({"choices": [], "usage": {"total_tokens": 3}}, asked, "c", 1, first=False)
    assert usage == [{"id": "c", "created": 1, "model": "tiny", "object": "text_completion", "choices": [],
                      "usage": {"total_tokens": 3}}]  # fmt: skip


def test_leg_bodies_follow_the_serving_api() -> None:
    base = parse({"model": "tiny", "prompt": "x", "max_tokens": 9, "stream": True}).engine_body()
    p = prefill_body(base, "t1")
    assert p["max_tokens"] == 1 and p["stream"] is False
    assert p["kv_transfer_params"] == {"do_remote_decode": True, "transfer_id": "t1"}
    health: dict[str, object] = {"status": "ok", "role": "prefill", "engine_id": "P", "incarnation": "i"}
    health["model"] = "tiny"
    health.update(side_channel_host="10.0.0.1", side_channel_port=7000, tp_size=2, pp_size=1)
    info = HealthInfo.parse(health)
    d = decode_body(base, "t1", info)
    assert d["max_tokens"] == 9 and d["stream"] is True
    assert d["kv_transfer_params"] == {
        "do_remote_prefill": True, "transfer_id": "t1", "remote_engine_id": "P", "remote_host": "10.0.0.1",
        "remote_port": 7000, "remote_tp_size": 2, "remote_pp_size": 1, "remote_incarnation": "i",
    }  # fmt: skip
    assert base["max_tokens"] == 9  # the legs are copies


def test_health_info_refuses_incomplete_bodies() -> None:
    with pytest.raises(ValueError, match="engine_id"):
        HealthInfo.parse({"status": "ok", "role": "prefill"})
    with pytest.raises(ValueError):
        HealthInfo.parse({"status": "starting", "role": "prefill", "engine_id": "P", "side_channel_host": "h",
                          "side_channel_port": 1})  # fmt: skip


def test_a_bad_max_completion_tokens_is_named_as_sent() -> None:
    with pytest.raises(ApiError) as err:
        parse({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0},
              ApiKind.CHAT)  # fmt: skip
    assert err.value.param == "max_completion_tokens" and "max_completion_tokens" in err.value.message


def test_null_optionals_are_not_given_and_chat_reads_max_completion_tokens_first() -> None:
    # SDKs that send every unset optional as null: stream too (it was a 400 "stream must be a boolean").
    nulls = {"stream": None, "stream_options": None, "n": None, "max_tokens": None, "temperature": None}
    req = parse({"model": "tiny", "prompt": "hi", **nulls})
    assert (req.stream, req.include_usage, req.max_tokens) == (False, False, 16)
    msgs = [{"role": "user", "content": "x"}]
    both = {"model": "tiny", "messages": msgs, "max_tokens": 2, "max_completion_tokens": 5}
    assert parse(both, ApiKind.CHAT).max_tokens == 5  # as vLLM and OpenAI: max_tokens is deprecated there
    assert parse({**both, "max_completion_tokens": None}, ApiKind.CHAT).max_tokens == 2


@pytest.mark.parametrize(
    ("options", "stream", "says"),
    [
        ({"include_usage": True}, False, "only be given with stream: true"),
        ({"include_usage": "false"}, True, "Expected `bool | null`"),  # a string was truthy: usage sent
        ({"include_usage": True, "colour": 1}, True, "unknown field"),
        ({"continuous_usage_stats": True}, True, "not supported"),
        ([True], True, "Expected `object`"),
    ],
)
def test_stream_options_are_checked_not_ignored(options: object, stream: bool, says: str) -> None:
    with pytest.raises(ApiError) as err:
        parse({"model": "tiny", "prompt": "hi", "stream": stream, "stream_options": options})
    assert err.value.status == 400 and err.value.param == "stream_options" and says in err.value.message
    ok = parse({"model": "tiny", "prompt": "hi", "stream": True, "stream_options": {"include_usage": True}})
    assert ok.include_usage is True

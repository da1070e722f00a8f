from __future__ import annotations

from typing import Any

import pytest

from kvwire.router.answers import event_tokens
from kvwire.router.engines import HealthInfo
from kvwire.router.legs import decode_body, engine_path, prefill_body
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
        (ApiKind.COMPLETION, "functions"),
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


# -- engines that are OpenAI servers (``Dialect.openai_server``: vLLM) --------------------------------------

MSGS = [{"role": "user", "content": "x"}]


def native(body: dict[str, Any], kind: ApiKind = ApiKind.CHAT) -> Any:
    return parse_request(body, kind, MODELS, openai_server=True)


def test_native_chat_sends_the_messages_to_chat_and_asks_a_stream_for_its_usage() -> None:
    req = native({"model": "tiny", "messages": MSGS, "max_completion_tokens": 4, "stream": True})
    assert req.prompt == render_chat(MSGS)  # still rendered: the router sizes and hashes it
    base = req.engine_body()
    assert base == {
        "model": "tiny", "messages": MSGS, "max_tokens": 4, "stream": True,
        "stream_options": {"include_usage": True},
    }  # fmt: skip
    assert engine_path(base) == "/v1/chat/completions"
    p = prefill_body({**base, "max_completion_tokens": 4}, "t1")
    assert (p["max_tokens"], p["stream"], p["messages"]) == (1, False, MSGS)
    assert "stream_options" not in p and "max_completion_tokens" not in p
    unary = native({"model": "tiny", "messages": MSGS}).engine_body()
    assert "stream_options" not in unary
    completion = native({"model": "tiny", "prompt": "hi", "stream": True}, ApiKind.COMPLETION).engine_body()
    assert engine_path(completion) == "/v1/completions" and completion["prompt"] == "hi"
    assert completion["stream_options"] == {"include_usage": True}
    kvwire = parse({"model": "tiny", "messages": MSGS, "stream": True}, ApiKind.CHAT).engine_body()
    assert (
        kvwire["prompt"] == render_chat(MSGS) and "messages" not in kvwire and "stream_options" not in kvwire
    )
    assert engine_path(kvwire) == "/v1/completions"


def test_native_chat_logprobs_go_as_given() -> None:
    body = native({"model": "tiny", "messages": MSGS, "logprobs": True, "top_logprobs": 3}).engine_body()
    assert (body["logprobs"], body["top_logprobs"]) == (True, 3)
    assert "top_logprobs" not in native({"model": "tiny", "messages": MSGS, "logprobs": True}).engine_body()
    with pytest.raises(ApiError) as exc:
        native({"model": "tiny", "messages": MSGS, "top_logprobs": 2})
    assert exc.value.param == "top_logprobs"


_CHAT_LP = {"content": [{"token": "a", "logprob": -0.5, "bytes": [97], "top_logprobs": []}]}


def test_a_chat_shaped_answer_is_taken_as_it_is() -> None:
    req = native({"model": "tiny", "messages": MSGS, "logprobs": True})
    message: dict[str, Any] = {"role": "assistant", "content": "ab", "reasoning_content": None}
    message["tool_calls"] = []
    engine = {
        "choices": [{"index": 0, "message": message, "logprobs": _CHAT_LP, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3},
        "kv_transfer_params": None,
    }
    out = completion_response(engine, req, "chatcmpl-1", 7)
    assert out["object"] == "chat.completion" and out["id"] == "chatcmpl-1" and out["model"] == "tiny"
    choice = out["choices"][0]
    assert choice["message"] == message and choice["finish_reason"] == "stop"
    assert choice["logprobs"] == _CHAT_LP  # chat's shape already: not reshaped again
    assert out["usage"]["completion_tokens"] == 2


def _chat_chunk(delta: dict[str, Any], finish: str | None = None, lp: object = None) -> dict[str, Any]:
    choice = {"index": 0, "delta": delta, "logprobs": lp, "finish_reason": finish}
    return {"object": "chat.completion.chunk", "choices": [choice]}


def test_chat_shaped_chunks_keep_one_role_chunk_and_their_logprobs() -> None:
    req = native({"model": "tiny", "messages": MSGS, "stream": True, "logprobs": True})
    role_only = _chat_chunk({"role": "assistant", "content": ""})
    # vLLM's role-only first chunk: the router's own role chunk, not a second one.
    assert [c["choices"][0]["delta"] for c in stream_chunks(role_only, req, "c", 1, first=True)] == [
        {"role": "assistant", "content": ""}
    ]
    assert stream_chunks(role_only, req, "c", 1, first=False) == []
    (piece,) = stream_chunks(_chat_chunk({"content": "a"}, lp=_CHAT_LP), req, "c", 1, first=False)
    assert piece["object"] == "chat.completion.chunk" and piece["id"] == "c"
    assert piece["choices"][0]["delta"] == {"content": "a"} and piece["choices"][0]["logprobs"] == _CHAT_LP
    (last,) = stream_chunks(_chat_chunk({}, finish="stop"), req, "c", 1, first=False)
    assert last["choices"][0]["delta"] == {"content": ""} and last["choices"][0]["finish_reason"] == "stop"
    usage_only = {"object": "chat.completion.chunk", "choices": [], "usage": {"total_tokens": 3}}
    assert stream_chunks(usage_only, req, "c", 1, first=False) == []
    asked = native(
        {"model": "tiny", "messages": MSGS, "stream": True, "stream_options": {"include_usage": True}}
    )
    (usage,) = stream_chunks(usage_only, asked, "c", 1, first=False)
    assert usage["choices"] == [] and usage["usage"] == {"total_tokens": 3}


def test_a_role_only_delta_is_no_token() -> None:
    assert event_tokens(_chat_chunk({"role": "assistant", "content": ""})) == 0
    assert event_tokens(_chat_chunk({"content": "a"})) == 1
    assert event_tokens(_chat_chunk({}, finish="stop")) == 0
    assert event_tokens(_engine_obj("ab", [97, 98])) == 2
    assert event_tokens({"choices": [], "usage": {"total_tokens": 3}}) == 0


@pytest.mark.parametrize("kind", [ApiKind.COMPLETION, ApiKind.CHAT])
def test_the_openai_user_field_is_accepted_and_not_forwarded(kind: ApiKind) -> None:
    body: dict[str, Any] = {"model": "tiny", "user": "end-user-42"}
    body |= {"messages": MSGS} if kind is ApiKind.CHAT else {"prompt": "hi"}
    assert "user" not in parse(body, kind).engine_body()
    with pytest.raises(ApiError) as err:
        parse({**body, "user": "x" * 257}, kind)
    assert err.value.param == "user"

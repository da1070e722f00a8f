"""OpenAI parameters end to end with the official ``openai`` client: a router in front of a prefill and a
decode reference engine, compared with a colocated reference engine.

The engines run in this process on real ports (127.0.0.1); P's KV reaches D through the loopback hooks
(``np.copyto`` between their caches), so what is checked is the engines' and the router's handling of the
parameters, not a transport: sampled output equal disaggregated and colocated for the same seed, greedy at
temperature 0, stop strings cut, logprobs returned, and unknown or invalid parameters refused with a 400
that names them and no internal address.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import openai
import pytest

from kvwire.config import RouterConfig
from kvwire.engine.config import EngineConfig, Role, preset
from kvwire.engine.engine import Engine
from kvwire.engine.loopback import LoopbackHub
from kvwire.engine.model import Model
from kvwire.engine.server import EngineServer, Identity
from kvwire.engine.tokenizer import ByteTokenizer
from kvwire.router.app import create_app
from kvwire.testing.fake_engines import ServerThread
from kvwire.testing.procs import free_port

TINY = preset("tiny")
MODEL = Model(TINY, seed=0)
TOK = ByteTokenizer()
PROMPT = "The KV cache moves"
HOT: dict[str, Any] = {"temperature": 0.9, "top_p": 0.95, "seed": 42}


@dataclass
class Stack:
    router: openai.OpenAI
    colocated: openai.OpenAI


def _server(role: Role, hub: LoopbackHub | None) -> EngineServer:
    engine = Engine(EngineConfig(TINY, role=role, num_blocks=256), model=MODEL)
    if hub is not None:
        engine.set_hooks(hub.producer(engine.kv) if role is Role.PREFILL else hub.consumer(engine.kv))
    return EngineServer(engine, Identity(role, f"{role.value}-sampling", "inc0"))


def _client(port: int) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    hub = LoopbackHub()
    p, d, c = _server(Role.PREFILL, hub), _server(Role.DECODE, hub), _server(Role.COLOCATED, None)
    pp, dp, cp, rp = (free_port() for _ in range(4))
    config = RouterConfig(
        prefill_urls=(f"http://127.0.0.1:{pp}",),
        decode_urls=(f"http://127.0.0.1:{dp}",),
        request_timeout_s=60,
    )
    apps = [(p.app, pp), (d.app, dp), (c.app, cp), (create_app(config), rp)]
    with ServerThread(apps):
        router, colocated = _client(rp), _client(cp)
        yield Stack(router, colocated)
        router.close()
        colocated.close()


def _complete(c: openai.OpenAI, **kw: Any) -> Any:
    extra = {"ignore_eos": True, **kw.pop("extra_body", {})}
    return c.completions.create(model="kvwire-tiny", prompt=PROMPT, extra_body=extra, **kw)


def _token_ids(choice: Any) -> list[int]:
    assert choice.model_extra is not None
    return list(choice.model_extra["token_ids"])


def test_same_seed_same_text_disaggregated_and_colocated(stack: Stack) -> None:
    routed = _complete(stack.router, max_tokens=12, **HOT).choices[0]
    local = _complete(stack.colocated, max_tokens=12, **HOT).choices[0]
    assert routed.text == local.text and _token_ids(routed) == _token_ids(local)
    streamed = _complete(stack.router, max_tokens=12, stream=True, **HOT)
    assert "".join(ch.choices[0].text for ch in streamed) == local.text
    greedy = _complete(stack.router, max_tokens=12).choices[0]
    other_seed = _complete(stack.router, max_tokens=12, **{**HOT, "seed": 43}).choices[0]
    assert _token_ids(greedy) != _token_ids(routed) != _token_ids(other_seed)


def test_temperature_zero_is_greedy(stack: Stack) -> None:
    reference = Engine(EngineConfig(TINY, num_blocks=64), model=MODEL)
    greedy = reference.generate([TOK.encode(PROMPT)], 10, ignore_eos=True)[0]
    got = _complete(stack.router, max_tokens=10, temperature=0, seed=5).choices[0]
    assert _token_ids(got) == greedy and got.text == TOK.decode(greedy)
    assert got.finish_reason == "length"


def test_stop_strings_cut_the_text(stack: Stack) -> None:
    full = _token_ids(_complete(stack.router, max_tokens=16, **HOT).choices[0])
    # an ASCII byte of the answer as the stop string (the random weights' bytes may not be UTF-8)
    k = next(i for i, t in enumerate(full) if 0 < t < 128)
    stop = chr(full[k])
    for c in (stack.router, stack.colocated):
        answer = _complete(c, max_tokens=16, stop=[stop], **HOT)
        got = answer.choices[0]
        assert got.text == TOK.decode(full[:k]) and got.finish_reason == "stop"
        # Usage counts every generated token, the stop string's too, as vLLM does (and as the stream did:
        # unary said k).
        assert answer.usage is not None and answer.usage.completion_tokens == k + 1
    usage = {"include_usage": True}
    chunks = list(_complete(stack.router, max_tokens=16, stop=stop, stream=True, stream_options=usage, **HOT))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == TOK.decode(full[:k])
    assert chunks[-2].choices[0].finish_reason == "stop"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == k + 1


def test_logprobs_are_returned(stack: Stack) -> None:
    routed = _complete(stack.router, max_tokens=6, logprobs=2, **HOT).choices[0]
    local = _complete(stack.colocated, max_tokens=6, logprobs=2, **HOT).choices[0]
    lp = routed.logprobs
    assert lp is not None and len(lp.tokens) == 6 and len(lp.token_logprobs) == 6
    assert all(v <= 0 for v in lp.token_logprobs)
    assert all(len(top) == 2 for top in lp.top_logprobs)
    assert lp.model_dump() == local.logprobs.model_dump()
    chat = stack.router.chat.completions.create(
        model="kvwire-tiny",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=4,
        logprobs=True,
        top_logprobs=3,
        extra_body={"ignore_eos": True},
    )
    assert chat.choices[0].logprobs is not None
    content = chat.choices[0].logprobs.content or []
    assert len(content) == 4 and all(len(e.top_logprobs) == 3 and e.bytes for e in content)


def test_echo_and_min_tokens(stack: Stack) -> None:
    got = _complete(stack.router, max_tokens=3, echo=True).choices[0]
    assert got.text.startswith(PROMPT) and len(got.text) > len(PROMPT)
    kept = stack.router.completions.create(
        model="kvwire-tiny", prompt=PROMPT, max_tokens=5, extra_body={"min_tokens": 5}
    )
    assert len(_token_ids(kept.choices[0])) == 5


@pytest.mark.parametrize(
    ("kw", "param"),
    [
        ({"extra_body": {"foo": 1}}, "foo"),
        ({"user": "x" * 300}, "user"),  # taken up to 256 characters, as an id (vLLM ignores it)
        ({"suffix": "!"}, "suffix"),
        ({"presence_penalty": 0.5}, "presence_penalty"),  # known, forwarded, refused by the engines
        ({"best_of": 2}, "best_of"),
        ({"logit_bias": {"65": 5}}, "logit_bias"),
        ({"temperature": 3}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"logprobs": 6}, "logprobs"),
        ({"extra_body": {"top_k": -5}}, "top_k"),
        ({"max_tokens": 9000}, "max_tokens"),  # beyond the model's context: the engines refuse it
    ],
)
def test_unknown_and_invalid_parameters_are_refused_naming_them(
    stack: Stack, kw: dict[str, Any], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        _complete(stack.router, **kw)
    assert bad.value.status_code == 400
    assert bad.value.param == param and param in bad.value.message
    assert "127.0.0.1" not in bad.value.message and "http" not in bad.value.message


def test_the_openai_user_field_is_taken(stack: Stack) -> None:
    got = _complete(stack.router, max_tokens=4, temperature=0, seed=5, user="end-user-42").choices[0]
    assert got.text == _complete(stack.router, max_tokens=4, temperature=0, seed=5).choices[0].text


def test_chat_refuses_what_it_cannot_do(stack: Stack) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        stack.router.chat.completions.create(
            model="kvwire-tiny",
            messages=[{"role": "user", "content": "hi"}],
            response_format={"type": "json_object"},
        )
    assert bad.value.param == "response_format"

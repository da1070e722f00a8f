"""The router's engine kinds (``kvwire.router.dialects``): one module each, found by name."""

from __future__ import annotations

import pytest

from kvwire.errors import ConfigError
from kvwire.router import dialects
from kvwire.router.cli import router_options
from kvwire.router.engines import EngineRegistry
from kvwire.router.http import EngineClient
from kvwire.router.policy import Role


def test_every_kind_is_found_by_its_name() -> None:
    # A superset: adding a kind (docs/architecture.md's recipe) must not mean editing this test.
    assert {"kvwire", "vllm"} <= set(dialects.names()) and dialects.DEFAULT_KIND == "kvwire"
    for name in dialects.names():
        assert dialects.lookup(name).name == name
    with pytest.raises(ConfigError, match="known: ") as refused:
        dialects.lookup("sglang-not-yet")
    assert all(name in str(refused.value) for name in dialects.names())


def test_engines_option_lists_each_kind_and_its_help() -> None:
    (engines,) = [o for o in router_options() if o.name == "engines"]
    assert engines.choices == dialects.names()
    for name in dialects.names():
        assert f"{name}: {dialects.lookup(name).summary}" in engines.help


def test_kvwire_refuses_a_fragment_and_vllm_needs_one_for_prefill() -> None:
    kvwire, vllm = dialects.lookup("kvwire"), dialects.lookup("vllm")
    assert kvwire.static_info("http://a:1", Role.PREFILL) is None
    with pytest.raises(ConfigError, match="only for --engines vllm"):
        kvwire.static_info("http://a:1#engine_id=p", Role.PREFILL)
    info = vllm.static_info("http://a:1#engine_id=p0&side_channel=10.0.0.1:5700&tp=2", Role.PREFILL)
    assert info is not None
    assert (info.engine_id, info.side_channel_host, info.side_channel_port, info.tp_size) == (
        "p0",
        "10.0.0.1",
        5700,
        2,
    )
    with pytest.raises(ConfigError, match="side_channel"):
        vllm.static_info("http://a:1#engine_id=p0", Role.PREFILL)
    assert kvwire.bytes_per_token == 1.0 and vllm.bytes_per_token == 4.0
    # vLLM servers take chat as chat (their model's template); kvwire's engines only completions.
    assert vllm.openai_server and not kvwire.openai_server


def test_the_registry_takes_its_kind_from_the_name() -> None:
    client = EngineClient(1.0, 1.0, None)
    reg = EngineRegistry(client, ["http://a:1#engine_id=p0&side_channel=h:5"], ["http://b:2"], 1.0, "vllm")
    assert reg.dialect is dialects.lookup("vllm")
    assert reg.engines[Role.PREFILL][0].url == "http://a:1"
    with pytest.raises(ConfigError):
        EngineRegistry(client, ["http://a:1#engine_id=p0"], [], 1.0, "kvwire")

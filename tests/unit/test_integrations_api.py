"""The engine-integration API (``kvwire.integrations.api``): what vLLM's adapter and the reference engine
share, so a second engine starts from it."""

from __future__ import annotations

from typing import Any

import pytest

from kvwire.errors import ConfigError, InvalidRequest
from kvwire.integrations import api
from kvwire.kv.cache import KVCache
from kvwire.kv.spec import KVSpec
from kvwire.kv_params import KvTransferParams
from kvwire.transport import registry
from kvwire.transport.inproc import InprocAgent

SPEC = KVSpec(num_layers=2, kv_heads=2, head_dim=8, block_size=4)


def _params(**kw: Any) -> KvTransferParams:
    base: dict[str, Any] = {"do_remote_prefill": True, "transfer_id": "t", "remote_engine_id": "P"}
    return KvTransferParams(**(base | {"remote_host": "10.0.0.1", "remote_port": 5700} | kw))


def test_remote_engine_reads_the_params_once_for_every_engine() -> None:
    kvwire_p = api.remote_engine(_params(remote_tp_size=2))
    vllm_p = api.remote_engine(_params(remote_tp_size=2), rank_ports=True)
    assert (kvwire_p.engine_id, kvwire_p.host, kvwire_p.tp_size) == ("P", "10.0.0.1", 2)
    # kvwire's engines serve every rank on one port; vLLM runs one side channel per rank.
    assert kvwire_p.port_of((0, 1)) == 5700 and vllm_p.port_of((0, 1)) == 5701
    with pytest.raises(InvalidRequest):
        api.remote_engine(None)
    with pytest.raises(InvalidRequest, match="remote_host"):
        api.remote_engine(KvTransferParams(do_remote_prefill=True, remote_engine_id="P"))


def test_rank_ports_past_65535_are_refused_with_the_request() -> None:
    """vLLM's ranks listen on port + rank: P named at 65535 with two ranks put rank 1 at 65536, and the
    handshake raised ``OverflowError`` (not kvwire's, not counted) for every such request."""
    last_fits = api.remote_engine(_params(remote_port=65534, remote_tp_size=2), rank_ports=True)
    assert last_fits.port_of((0, 1)) == 65535
    with pytest.raises(InvalidRequest, match="runs past port 65535"):
        api.remote_engine(_params(remote_port=65535, remote_tp_size=2), rank_ports=True)
    with pytest.raises(InvalidRequest, match="runs past port 65535"):
        api.remote_engine(_params(remote_port=65530, remote_tp_size=2, remote_pp_size=4), rank_ports=True)
    # One listener for every rank (kvwire's engines): 65535 is P's one port, fine.
    assert api.remote_engine(_params(remote_port=65535, remote_tp_size=2)).port_of((0, 1)) == 65535


def test_open_ranks_pairs_agents_with_caches_and_closes_on_failure(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    caches = [((0, tp), KVCache(SPEC, 4)) for tp in range(2)]
    agents, ranks = api.open_ranks("inproc", "E", "life1", caches)
    assert [a.name for a in agents] == ["E/life1/pp0/tp0", "E/life1/pp0/tp1"]
    assert [(r.tp_rank, r.cache) for r in ranks] == [(0, caches[0][1]), (1, caches[1][1])]
    api.close_all((), agents)

    made: list[InprocAgent] = []
    real = registry.create_agent

    def second_fails(backend: str, name: str, **kw: Any) -> Any:
        if made:
            raise ConfigError("no second agent")
        made.append(real(backend, name, **kw))  # type: ignore[arg-type]
        return made[-1]

    monkeypatch.setattr(api, "create_agent", second_fails)
    with pytest.raises(ConfigError):
        api.open_ranks("inproc", "F", "life1", caches)
    assert len(made) == 1 and not made[0].alive  # the first agent was closed, not leaked

"""Fail closed over real NIXL (issue 20): ``kvwire serve prefill|decode`` processes, D checking every
request's bytes against P's digest. Two P ranks write into D's one: their digests, computed over P's
source and over what landed in D, agree, and the answer matches the colocated one; a second request that
reuses the transfer id is answered 400 naming it (never decoded from the first request's KV)."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Iterator

import httpx
import pytest
from test_engine_server_procs import start, wait_healthy

from kvwire.engine.config import EngineConfig, preset
from kvwire.engine.engine import Engine
from kvwire.testing.procs import free_port

pytestmark = pytest.mark.nixl
PROMPT = "fail closed over NIXL " * 20


@pytest.fixture
def pd() -> Iterator[tuple[str, str, dict[str, object]]]:
    pp, dp = free_port(), free_port()
    procs = [
        start("prefill", pp, "--tp", "2"),
        start("decode", dp, "--engine-id", "dec-fc", "--kv-digest-sample", "1"),
    ]
    try:
        p_url, d_url = f"http://127.0.0.1:{pp}", f"http://127.0.0.1:{dp}"
        p_health = wait_healthy(p_url, procs[0])
        wait_healthy(d_url, procs[1])
        yield p_url, d_url, p_health
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(timeout=30)
            except Exception:
                proc.kill()
                proc.wait(timeout=10)
            if proc.stderr:
                proc.stderr.close()


def test_digests_agree_over_nixl_and_a_reused_transfer_id_is_refused(
    pd: tuple[str, str, dict[str, object]],
) -> None:
    p_url, d_url, ph = pd
    dparams = {
        "do_remote_prefill": True, "transfer_id": "fc-1", "remote_engine_id": ph["engine_id"],
        "remote_host": ph["side_channel_host"], "remote_port": ph["side_channel_port"],
        "remote_tp_size": ph["tp_size"], "remote_pp_size": ph["pp_size"],
    }  # fmt: skip
    d_body = {"prompt": PROMPT, "max_tokens": 8, "ignore_eos": True, "kv_transfer_params": dparams}
    p_body = {"prompt": PROMPT, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True,
                                                                         "transfer_id": "fc-1"}}  # fmt: skip

    async def main() -> tuple[httpx.Response, httpx.Response]:
        async with httpx.AsyncClient(timeout=60) as client:
            rd, rp = await asyncio.gather(
                client.post(d_url + "/v1/completions", json=d_body),
                client.post(p_url + "/v1/completions", json=p_body),
            )
            assert rp.status_code == 200, rp.text
            again = await client.post(d_url + "/v1/completions", json=d_body)
            return rd, again

    first, again = asyncio.run(main())
    ref = Engine(EngineConfig(preset("tiny"), num_blocks=256))
    assert first.status_code == 200, first.text
    assert (
        first.json()["choices"][0]["token_ids"]
        == ref.generate([ref.tokenizer.encode(PROMPT)], 8, ignore_eos=True)[0]
    )
    assert again.status_code == 400, again.text
    err = again.json()["error"]
    assert err["param"] == "kv_transfer_params" and "fc-1" in err["message"]
    metrics = httpx.get(d_url + "/metrics").text
    # D compared the landed bytes of each of P's two ranks with their digests; none differed.
    assert 'kvwire_kv_digests_total{model_name="kvwire-tiny",role="decode"} 2.0' in metrics, metrics
    assert 'reason="digest_mismatch"' not in metrics

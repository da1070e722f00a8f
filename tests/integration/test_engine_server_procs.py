"""`kvwire serve prefill|decode` as real processes over real NIXL: both legs at once, then SIGTERM."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import pytest

from kvwire.engine.config import EngineConfig, preset
from kvwire.engine.engine import Engine
from kvwire.testing.procs import free_port

pytestmark = pytest.mark.nixl


def start(role: str, port: int, *extra: str) -> subprocess.Popen[bytes]:
    # One BLAS thread: the engine does small per-sequence matmuls; threads only fight P, D and the router.
    env = {**os.environ, "UCX_MODULES": "^ib*", "KVWIRE_LOG_LEVEL": "warning", "OPENBLAS_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        "-m",
        "kvwire.cli",
        "serve",
        role,
        "--port",
        str(port),
        "--num-blocks",
        "256",
        *extra,
    ]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def wait_healthy(url: str, proc: subprocess.Popen[bytes], timeout_s: float = 60.0) -> dict[str, object]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            err = proc.stderr.read().decode() if proc.stderr else ""
            raise AssertionError(f"server exited with {proc.returncode}: {err[-2000:]}")
        try:
            r = httpx.get(url + "/health", timeout=1.0)
            if r.status_code == 200 and r.json()["status"] == "ok":
                body: dict[str, object] = r.json()
                return body
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"{url} not healthy within {timeout_s} s")


@pytest.fixture
def pd() -> Iterator[tuple[str, str, dict[str, object]]]:
    pp, dp = free_port(), free_port()
    procs = [start("prefill", pp, "--tp", "2"), start("decode", dp, "--engine-id", "dec-it")]
    try:
        p_url, d_url = f"http://127.0.0.1:{pp}", f"http://127.0.0.1:{dp}"
        p_health = wait_healthy(p_url, procs[0])
        wait_healthy(d_url, procs[1])
        yield p_url, d_url, p_health
        for proc in procs:  # clean shutdown on SIGTERM
            proc.send_signal(signal.SIGTERM)
        for proc in procs:
            assert proc.wait(timeout=30) == 0
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
            if proc.stderr:
                proc.stderr.close()


def test_disaggregated_processes_match_colocated(pd: tuple[str, str, dict[str, object]]) -> None:
    p_url, d_url, ph = pd
    # Both report their handshake's compat hash, equal though the TP sizes differ (not in it): what the
    # router pairs engines by (kvwire.router.engines.compat_problem).
    assert len(str(ph["compat"])) == 64 and ph["compat"] == httpx.get(d_url + "/health").json()["compat"]
    tiny = preset("tiny")
    ref = Engine(EngineConfig(tiny, num_blocks=256))
    prompts = ["Hello over NIXL", "z" * 700]

    async def legs(client: httpx.AsyncClient, i: int, prompt: str) -> dict[str, object]:
        tid = f"it-{i}"
        dparams = {
            "do_remote_prefill": True,
            "transfer_id": tid,
            "remote_engine_id": ph["engine_id"],
            "remote_host": ph["side_channel_host"],
            "remote_port": ph["side_channel_port"],
            "remote_tp_size": ph["tp_size"],
            "remote_pp_size": ph["pp_size"],
        }
        d_body = {"prompt": prompt, "max_tokens": 8, "ignore_eos": True, "kv_transfer_params": dparams}
        p_body = {
            "prompt": prompt,
            "max_tokens": 1,
            "kv_transfer_params": {"do_remote_decode": True, "transfer_id": tid},
        }
        rd, rp = await asyncio.gather(
            client.post(d_url + "/v1/completions", json=d_body),
            client.post(p_url + "/v1/completions", json=p_body),
        )
        assert rp.status_code == 200, rp.text
        assert rd.status_code == 200, rd.text
        body: dict[str, object] = rd.json()
        return body

    async def main() -> list[dict[str, object]]:
        async with httpx.AsyncClient(timeout=60) as client:
            return list(await asyncio.gather(*(legs(client, i, p) for i, p in enumerate(prompts))))

    answers = asyncio.run(main())
    for prompt, ans in zip(prompts, answers, strict=True):
        want = ref.generate([ref.tokenizer.encode(prompt)], 8, ignore_eos=True)[0]
        assert ans["choices"][0]["token_ids"] == want  # type: ignore[index]
    stats = httpx.get(p_url + "/v1/kv_stats").json()
    assert stats["transfers"] == 2 * 2 and stats["bytes"] > 0
    assert "kvwire_handshakes_total" in httpx.get(p_url + "/metrics").text

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


def kill_all(procs: list[subprocess.Popen[bytes]]) -> None:
    for proc in procs:
        proc.kill()
        proc.wait(timeout=10)
        if proc.stderr:
            proc.stderr.close()


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


def test_a_rolling_upgrade_through_the_router_pairs_each_generation_within_itself() -> None:
    # Two generations of weights (seed 1 and seed 2), a P and a D of each, behind one round-robin router.
    # Before, the router paired P and D independently: every other request went to a P and a D of different
    # weights and failed (500, not retried). Now every answer is 200, and each is its generation's.
    from kvwire.config import RouterConfig
    from kvwire.router.app import create_app
    from kvwire.testing.fake_engines import ServerThread

    ports = {(role, seed): free_port() for role in ("prefill", "decode") for seed in (1, 2)}
    procs = [start(role, port, "--seed", str(seed)) for (role, seed), port in ports.items()]
    url = {key: f"http://127.0.0.1:{port}" for key, port in ports.items()}
    router_port = free_port()
    config = RouterConfig(
        prefill_urls=(url["prefill", 1], url["prefill", 2]),
        decode_urls=(url["decode", 2], url["decode", 1]),  # round robin's first pair does not fit
        health_interval_s=0.5,
    )
    try:
        for key, proc in zip(ports, procs, strict=True):
            wait_healthy(url[key], proc)
        refs = {seed: Engine(EngineConfig(preset("tiny"), num_blocks=64, seed=seed)) for seed in (1, 2)}
        prompt = "a rolling upgrade"
        want = {
            seed: ref.tokenizer.decode(ref.generate([ref.tokenizer.encode(prompt)], 8, ignore_eos=True)[0])
            for seed, ref in refs.items()
        }
        assert want[1] != want[2]  # the generations answer differently: each answer says which served it
        with ServerThread([(create_app(config), router_port)]):
            body = {"model": "kvwire", "prompt": prompt, "max_tokens": 8, "ignore_eos": True}
            got = [
                httpx.post(f"http://127.0.0.1:{router_port}/v1/completions", json=body, timeout=60)
                for _ in range(8)
            ]
        assert [r.status_code for r in got] == [200] * 8, [r.text for r in got if r.status_code != 200]
        texts = [r.json()["choices"][0]["text"] for r in got]
        assert set(texts) == {want[1], want[2]}, texts  # both generations served, each its own weights
    finally:
        kill_all(procs)


def test_a_decode_leg_dropped_while_queued_frees_ps_blocks_at_once() -> None:
    """D runs one request at a time; a second request's decode leg queues behind it, and its client gives
    up. D drops it before allocating anything and tells P (``decline``): P's held blocks for it come back
    within seconds, not at P's lease (30 s). Real processes over real NIXL."""
    pp, dp = free_port(), free_port()
    procs = [start("prefill", pp), start("decode", dp, "--max-num-seqs", "1")]
    try:
        p_url, d_url = f"http://127.0.0.1:{pp}", f"http://127.0.0.1:{dp}"
        ph = wait_healthy(p_url, procs[0])
        wait_healthy(d_url, procs[1])

        def params(tid: str) -> dict[str, object]:
            return {
                "do_remote_prefill": True, "transfer_id": tid, "remote_engine_id": ph["engine_id"],
                "remote_host": ph["side_channel_host"], "remote_port": ph["side_channel_port"],
                "remote_tp_size": ph["tp_size"], "remote_pp_size": ph["pp_size"],
            }  # fmt: skip

        def p_leg(tid: str) -> None:
            body = {"prompt": f"prompt of {tid} " * 20, "max_tokens": 1,
                    "kv_transfer_params": {"do_remote_decode": True, "transfer_id": tid}}  # fmt: skip
            assert httpx.post(p_url + "/v1/completions", json=body, timeout=30).status_code == 200

        def p_held() -> int:
            held: int = httpx.get(p_url + "/v1/kv_stats").json()["accounting"]["requests"]["held"]
            return held

        async def main() -> None:
            async with httpx.AsyncClient(timeout=60) as client:
                # A: D's one slot, decoding long enough for B to queue behind it.
                p_leg("busy")
                long = {"prompt": "prompt of busy " * 20, "max_tokens": 3000, "ignore_eos": True,
                        "kv_transfer_params": params("busy")}  # fmt: skip
                busy = asyncio.create_task(client.post(d_url + "/v1/completions", json=long))
                await asyncio.sleep(0.5)
                p_leg("dropped")  # P holds B's blocks for D now
                assert p_held() == 1
                short = {"prompt": "prompt of dropped " * 20, "max_tokens": 4,
                         "kv_transfer_params": params("dropped")}  # fmt: skip
                with pytest.raises(httpx.TimeoutException):  # B's client gives up while B queues on D
                    await client.post(d_url + "/v1/completions", json=short, timeout=0.5)
                t0 = time.monotonic()
                while p_held() and time.monotonic() - t0 < 10:
                    await asyncio.sleep(0.05)
                assert p_held() == 0, "P still holds the dropped request's blocks"
                assert time.monotonic() - t0 < 5  # the lease is 30 s
                assert not busy.done()  # B was dropped while A still held D's one slot
                busy.cancel()

        asyncio.run(main())
        assert httpx.get(d_url + "/v1/kv_stats").json()["accounting"]["requests"]["waiting"] == 0
        assert (
            'kvwire_declined_total{model_name="kvwire-tiny",role="decode"} 1.0'
            in httpx.get(d_url + "/metrics").text
        )
    finally:
        kill_all(procs)

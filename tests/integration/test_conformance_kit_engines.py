"""``kvwire conformance`` passes against kvwire's own reference P and D over real NIXL, with and without
a secret: every check that applies runs (none skipped), notifications included against P."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvwire.cli import main
from kvwire.engine.config import EngineConfig, Role, preset
from kvwire.engine.connector_hooks import ConnectorSettings, attach_connector
from kvwire.engine.engine import Engine

pytestmark = pytest.mark.nixl

SECRET = "conformance-integration-secret-0123456789"


@pytest.mark.parametrize("role", [Role.PREFILL, Role.DECODE])
@pytest.mark.parametrize("secret", [None, SECRET], ids=["plain", "secret"])
def test_the_kit_passes_against_kvwires_reference_engines(
    role: Role, secret: str | None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("UCX_MODULES", "^ib*")
    engine = Engine(EngineConfig(preset("tiny"), role=role, num_blocks=64, seed=1))
    settings = ConnectorSettings(
        f"{role.value}-conf", "inc1", "kvwire-tiny/seed1", secret=secret.encode() if secret else None
    )
    hooks = attach_connector(engine, settings)
    out = tmp_path / "conformance.json"
    argv = ["conformance", "--role", role.value, "--target", f"127.0.0.1:{hooks.connector.port}"]
    argv += ["--json", str(out)]
    if secret:
        monkeypatch.setenv("KVWIRE_CONFORMANCE_SECRET", secret)
        argv += ["--secret-env", "KVWIRE_CONFORMANCE_SECRET"]
    try:
        status = main(argv)
    finally:
        hooks.connector.close()
    report = json.loads(out.read_text())
    bad = [c for c in report["checks"] if c["status"] == "fail"]
    assert status == 0 and not bad, bad
    names = {c["name"] for c in report["checks"] if c["status"] == "pass"}
    # What did not run is listed with why: only what needs a secret (without one) and --slow.
    skipped = {c["name"]: c["detail"] for c in report["checks"] if c["status"] == "skip"}
    assert all("--slow" in why or "--secret-env" in why for why in skipped.values()), skipped
    assert "handshake.full_load" in names
    if role is Role.PREFILL:
        want = {
            "notif.push_reg_handshake",
            "notif.heartbeats",
            "notif.cancel_acked_once",
            "notif.fence_expired",
        }
        assert want | {"notif.report_when_incompatible"} <= names
        assert ("notif.unauthenticated_dropped" in names) == (secret is not None)
    else:
        assert {"report.unknown_reason", "report.other_life"} <= names
    # P's answers to the kit's D: fence_expired after the 1 s fence, not before.
    fence = next((c for c in report["checks"] if c["name"] == "notif.fence_expired"), None)
    assert fence is None or "failed/fence_expired 1." in fence["detail"]

"""The conformance kit's side-channel checks pass against kvwire's own listener, with and without a secret,
and each deliberately broken listener fails exactly the checks of the rule it breaks (no NIXL needed:
in-process agents; the notification checks run against real engines in
tests/integration/test_conformance_kit_engines.py)."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest

from kvwire.cli import main
from kvwire.errors import ProtocolError
from kvwire.handshake.loop import BackgroundLoop
from kvwire.handshake.server import SideChannelServer
from kvwire.kv.spec import KVSpec
from kvwire.protocol.auth import SignedRequest
from kvwire.protocol.messages import (
    Ack,
    Done,
    ErrorCode,
    ErrorReply,
    GetMetadata,
    Metadata,
    Notification,
    PushReg,
    ReportFailed,
)
from kvwire.protocol.seal import NotifGate
from kvwire.testing.handshake_env import build_registered_engine
from kvwire.testing.protocol_conformance import Result, Role, Status, Target, run_checks
from kvwire.testing.protocol_conformance.notif_checks import KitDecode, _check_from_p
from kvwire.testing.protocol_conformance.side_checks import SIDE_CHECKS, documented_compat_hash
from kvwire.testing.protocol_conformance.wire import CheckFailed
from kvwire.transport.inproc import InprocFabric

SPEC = KVSpec(num_layers=2, kv_heads=2, head_dim=8, block_size=4)
SECRET = b"conformance-secret-0123456789abcdef"


class WrongAgentName(SideChannelServer):
    """Names its agent otherwise than §2 says (a peer checking senders would drop every notification)."""

    def _metadata(self, rank: object, *, notif_only: bool) -> Metadata:
        md = super()._metadata(rank, notif_only=notif_only)  # type: ignore[arg-type]
        return msgspec.structs.replace(md, agent_name="decode-engine-0")


class NoVersionCheck(SideChannelServer):
    """Blames the fields of a newer version's request instead of its version."""

    def _error_for(self, exc: ProtocolError) -> ErrorReply:
        return self._refuse(ErrorCode.BAD_REQUEST, str(exc))


class PlainRefusals(SideChannelServer):
    """Sends every refusal plain under a secret (anyone could forge one on the path)."""

    def sealed(self, req: SignedRequest, reply: Metadata | ErrorReply | Ack) -> object:  # type: ignore[override]
        return reply if isinstance(reply, ErrorReply) else super().sealed(req, reply)


class OneRegion(SideChannelServer):
    """Lists one of its regions (a peer would write layers it was never told where to put)."""

    def _metadata(self, rank: object, *, notif_only: bool) -> Metadata:
        md = super()._metadata(rank, notif_only=notif_only)  # type: ignore[arg-type]
        return msgspec.structs.replace(md, regions=md.regions[:1])


class NoCompat(SideChannelServer):
    """An older peer: no ``compat`` map beside its hash (§2: nil by default), otherwise conforming."""

    def _metadata(self, rank: object, *, notif_only: bool) -> Metadata:
        md = super()._metadata(rank, notif_only=notif_only)  # type: ignore[arg-type]
        return msgspec.structs.replace(md, compat=None)


class RefusesNewReasons(SideChannelServer):
    """Refuses a report whose reason it does not know, as kvwire did before (D then waits for liveness)."""

    def report(self, req: ReportFailed) -> Ack | ErrorReply:
        if req.reason == "kvwire_conformance_future_reason":
            return self._refuse(ErrorCode.BAD_REQUEST, f"unknown reason {req.reason}")
        return super().report(req)


def _listener(
    cls: type[SideChannelServer], *, secret: bytes | None, role: Role, **kw: object
) -> SideChannelServer:
    fabric = InprocFabric()
    info, ranks = build_registered_engine("decode", SPEC, 16, fabric.create_agent)
    on_report = (lambda _r: None) if role is Role.DECODE else None
    return cls(info, ranks, secret=secret, on_report=on_report, **kw)  # type: ignore[arg-type]


@pytest.fixture
def loop() -> Iterator[BackgroundLoop]:
    with BackgroundLoop(name="conformance-test") as bg:
        yield bg


def _run(
    loop: BackgroundLoop, server: SideChannelServer, role: Role, secret: bytes | None
) -> dict[str, Result]:
    port = loop.run(server.start(), 5.0)
    try:
        target = Target("127.0.0.1", port, secret, timeout_s=2.0)
        results = loop.run(run_checks(target, role, checks=SIDE_CHECKS), 60.0)
    finally:
        loop.run(server.close(), 5.0)
    return {r.name: r for r in results}


def _failed(results: dict[str, Result]) -> set[str]:
    return {name for name, r in results.items() if r.status is Status.FAIL}


def _ran(results: dict[str, Result]) -> set[str]:
    return {name for name, r in results.items() if r.status is not Status.SKIP}


@pytest.mark.parametrize("role", list(Role))
@pytest.mark.parametrize("secret", [None, SECRET], ids=["plain", "secret"])
def test_kvwire_listener_passes_every_side_channel_check(
    loop: BackgroundLoop, role: Role, secret: bytes | None
) -> None:
    results = _run(loop, _listener(SideChannelServer, secret=secret, role=role), role, secret)
    assert _failed(results) == set(), {n: results[n].detail for n in _failed(results)}
    # What ran is what applies: refusals of reports only on D, authentication only with a secret.
    ran = _ran(results)
    assert ("report.unknown_reason" in results) == (role is Role.DECODE)
    assert ("report.refused_by_prefill" in results) == (role is Role.PREFILL)
    assert ("auth.replay" in ran) == (secret is not None)
    assert ("metadata.plain_without_secret" in ran) == (secret is None)
    assert len(ran) >= 16
    # What does not run here is listed, with why: a peer without authentication must not read as one
    # that passed §4 (before, those checks were absent from the table and the counts).
    if secret is None:
        assert "--secret-env" in results["auth.replay"].detail
    assert "--slow" in results["side.idle_timeout"].detail


@pytest.mark.parametrize(
    ("cls", "kw", "secret", "broken", "why"),
    [
        (WrongAgentName, {}, None, {"metadata.full"}, "agent_name 'decode-engine-0'"),
        (NoVersionCheck, {}, None, {"bad.newer_version"}, "want error incompatible"),
        (SideChannelServer, {"max_requests_per_conn": 1000}, None, {"side.requests_per_connection"}, "65"),
        (
            PlainRefusals,
            {},
            SECRET,
            # A plain bad_request may refuse a frame the server could not decode, not a request it read
            # (report.other_life passed before).
            {"error.no_such_rank", "report.no_such_rank", "report.other_life"},
            "plain",
        ),
        (RefusesNewReasons, {}, SECRET, {"report.unknown_reason"}, "want ack, got error bad_request"),
        (OneRegion, {}, None, {"metadata.full"}, "1 of 4 regions"),  # passed before
        (NoCompat, {}, None, set(), "no compat map"),  # failed before, though §2 allows it
    ],
    ids=[
        "agent-name",
        "version",
        "requests-per-connection",
        "plain-refusals",
        "unknown-reason",
        "one-region",
        "no-compat",
    ],
)
def test_a_broken_listener_fails_the_checks_of_the_rule_it_breaks(
    loop: BackgroundLoop,
    cls: type[SideChannelServer],
    kw: dict[str, object],
    secret: bytes | None,
    broken: set[str],
    why: str,
) -> None:
    results = _run(loop, _listener(cls, secret=secret, role=Role.DECODE, **kw), Role.DECODE, secret)
    assert _failed(results) == broken, {n: results[n].detail for n in _failed(results)}
    assert all(results[n].status is Status.FAIL for n in broken)
    details = [results[n].detail for n in broken or {"metadata.full"}]
    assert any(why in d for d in details), details


def test_the_command_prints_the_table_writes_json_and_exits_non_zero_on_failure(
    loop: BackgroundLoop, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("CONFORMANCE_SECRET", SECRET.decode())
    for cls, want in ((PlainRefusals, 1), (SideChannelServer, 0)):
        server = _listener(cls, secret=SECRET, role=Role.DECODE)
        port = loop.run(server.start(), 5.0)
        out = tmp_path / f"{cls.__name__}.json"
        try:
            argv = ["conformance", "--role", "decode", "--target", f"127.0.0.1:{port}"]
            argv += ["--secret-env", "CONFORMANCE_SECRET", "--json", str(out), "--side-channel-only"]
            assert main(argv) == want
        finally:
            loop.run(server.close(), 5.0)
        report = json.loads(out.read_text())
        statuses = {c["name"]: c["status"] for c in report["checks"]}
        assert report["secret"] is True and report["role"] == "decode"
        assert (statuses["error.no_such_rank"] == "fail") == (want == 1)
        assert report["failed"] == sum(s == "fail" for s in statuses.values())
        assert set(statuses) >= {"metadata.full", "auth.replay", "report.unknown_reason"}
        assert statuses["handshake.full_load"] == "skip"  # --side-channel-only: listed, not run
    printed = capsys.readouterr().out
    assert "error.no_such_rank" in printed and "fail" in printed
    # Without the secret, against a listener with one: every refusal is unauthorized; one hint says why.
    server = _listener(SideChannelServer, secret=SECRET, role=Role.DECODE)
    port = loop.run(server.start(), 5.0)
    try:
        argv = ["conformance", "--role", "decode", "--target", f"127.0.0.1:{port}", "--side-channel-only"]
        assert main([*argv, "--json", str(tmp_path / "plain.json")]) == 1
    finally:
        loop.run(server.close(), 5.0)
    assert "hint:" in capsys.readouterr().out
    (hint,) = json.loads((tmp_path / "plain.json").read_text())["hints"]
    assert "it has a secret; run with --secret-env" in hint
    assert main(["conformance", "--role", "decode", "--target", "nowhere"]) == 2
    # A --json nowhere to write is a bad argument, said at once (it was a traceback after the whole run).
    argv = ["conformance", "--role", "decode", "--target", "127.0.0.1:1", "--json", str(tmp_path / "no/x")]
    assert main(argv) == 2
    argv[-1] = str(tmp_path)  # a directory: it crashed writing the report after the whole run
    assert main(argv) == 2


@pytest.mark.parametrize("fused", [False, True])
def test_the_documented_compat_hash_is_kvwires_fused_or_not(fused: bool) -> None:
    """docs/protocol.md §5 as the kit computes it (one more array element, ``"kv_fused"``, when fused)
    gives the hash kvwire sends."""
    spec = KVSpec(num_layers=2, kv_heads=2, head_dim=8, block_size=4, kv_fused=fused)
    info, ranks = build_registered_engine("p", spec, 4, InprocFabric().create_agent, model_id="m;rev=1")
    md = SideChannelServer(info, ranks).answer(GetMetadata(pp_rank=0, tp_rank=0))
    assert isinstance(md, Metadata) and md.compat is not None and md.compat.kv_fused is fused
    assert documented_compat_hash(md) == md.compat_hash


def test_the_kits_push_regs_carry_fresh_nonzero_reg_nonces_and_a_done_is_held_to_them() -> None:
    """§3: D never gives reg_nonce 0 (a P checking it may refuse the kit's push_regs), and a done must
    echo it and state nbytes (the kit cannot make P send one, but judges one that comes)."""
    fabric = InprocFabric()
    p_info, p_ranks = build_registered_engine("p", SPEC, 8, fabric.create_agent)
    md = SideChannelServer(p_info, p_ranks).answer(GetMetadata(pp_rank=0, tp_rank=0))
    assert isinstance(md, Metadata)
    info, ranks = build_registered_engine("kit", SPEC, 8, fabric.create_agent)
    kit = KitDecode(ranks[0], SideChannelServer(info, ranks), "127.0.0.1", NotifGate(None), md)
    sent: list[Notification] = []
    kit.send = sent.append  # type: ignore[method-assign]
    for tid in ("t1", "t2"):
        kit.push_reg(tid)
    nonces = [m.reg_nonce for m in sent if isinstance(m, PushReg)]
    assert len(set(nonces)) == 2 and 0 not in nonces and nonces == [kit.nonces["t1"], kit.nonces["t2"]]
    ids = {"engine_id": md.engine_id, "incarnation": md.incarnation, "tp_rank": 0, "pp_rank": 0}
    good = Done(transfer_id="t1", num_blocks=2, reg_nonce=nonces[0], nbytes=64, **ids)  # type: ignore[arg-type]
    _check_from_p(kit, good)
    for bad in (
        msgspec.structs.replace(good, reg_nonce=nonces[1]),
        msgspec.structs.replace(good, nbytes=None),
    ):
        with pytest.raises(CheckFailed, match="reg_nonce echoed"):
            _check_from_p(kit, bad)


def test_an_mla_listener_passes_metadata_full(loop: BackgroundLoop) -> None:
    # An MLA cache has one latent region per layer ("kv", as KVSpec.kinds): the kit wanted k and v.
    fabric = InprocFabric()
    mla = KVSpec(num_layers=2, kv_heads=1, head_dim=8, block_size=4, mla=True)
    info, ranks = build_registered_engine("decode", mla, 16, fabric.create_agent)
    server = SideChannelServer(info, ranks, secret=None, on_report=lambda _r: None)
    results = _run(loop, server, Role.DECODE, None)
    assert results["metadata.full"].status is Status.PASS, results["metadata.full"].detail


def test_a_silent_peer_costs_one_timeout_per_check_not_one_per_request(loop: BackgroundLoop) -> None:
    # A listener that takes connections and never answers: 64 requests on one connection each waited the
    # whole timeout (65 x 5 s: five minutes for one check, about eight for the run, nothing printed).
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)  # the kernel completes the connections; nobody ever reads them
    try:
        target = Target("127.0.0.1", silent.getsockname()[1], None, timeout_s=0.5)
        check = next(c for c in SIDE_CHECKS if c.name == "side.requests_per_connection")
        seen: list[Result] = []
        results = loop.run(run_checks(target, Role.DECODE, checks=[check], on_result=seen.append), 30.0)
    finally:
        silent.close()
    (result,) = results
    assert seen == results  # each result is reported as it comes
    assert result.status is Status.FAIL and "0 of the first 64" in result.detail
    assert result.seconds < 2.0

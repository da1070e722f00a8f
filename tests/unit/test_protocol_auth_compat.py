"""Request signing, the compat hash, and the protocol package's import purity."""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import subprocess
import sys

import msgspec
import pytest

from kvwire.errors import AuthError, ConfigError
from kvwire.kv.spec import KVSpec, Layout
from kvwire.protocol.auth import ReplayGuard, sign, signed_bytes, verify
from kvwire.protocol.codec import FrameDecoder, encode_frame
from kvwire.protocol.compat import compat_hash
from kvwire.protocol.messages import GetMetadata, TransferMode

SECRET = b"cluster-secret"
NONCE = bytes(range(16))
T = "10.0.0.1:5600"


def test_sign_then_verify_round_trips_over_the_wire() -> None:
    req = sign(GetMetadata(pp_rank=1, tp_rank=2, notif_only=True), SECRET, target=T)
    assert req.nonce is not None and len(req.nonce) == 16 and req.auth is not None
    (back,) = FrameDecoder().feed(encode_frame(req))
    assert isinstance(back, GetMetadata)
    verify(back, SECRET)


def test_signature_is_hmac_sha256_over_canonical_fields() -> None:
    req = sign(GetMetadata(pp_rank=1, tp_rank=2), SECRET, target=T, nonce=NONCE, now_ms=1234)
    canonical = msgspec.msgpack.encode([b"kvwire/get_metadata/2", 1, 1, 2, False, NONCE, T, 1234])
    assert signed_bytes(req) == canonical
    assert req.auth == hmac.new(SECRET, canonical, hashlib.sha256).digest()


def test_fresh_nonce_each_time() -> None:
    base = GetMetadata(pp_rank=0, tp_rank=0)
    assert sign(base, SECRET, target=T).nonce != sign(base, SECRET, target=T).nonce


@pytest.mark.parametrize("field", ["pp_rank", "tp_rank", "notif_only", "version", "nonce", "target", "ts_ms"])
def test_any_tampered_field_fails(field: str) -> None:
    req = sign(GetMetadata(pp_rank=0, tp_rank=0), SECRET, target=T, nonce=NONCE)
    changed = {"pp_rank": 1, "tp_rank": 3, "notif_only": True, "version": 2, "nonce": b"x" * 16,
               "target": "10.0.0.9:5600", "ts_ms": 1}[field]  # fmt: skip
    with pytest.raises(AuthError, match="signature"):
        verify(msgspec.structs.replace(req, **{field: changed}), SECRET)


def test_wrong_secret_missing_or_bad_auth_fail() -> None:
    req = sign(GetMetadata(pp_rank=0, tp_rank=0), SECRET, target=T)
    with pytest.raises(AuthError):
        verify(req, b"other")
    with pytest.raises(AuthError, match="not authenticated"):
        verify(GetMetadata(pp_rank=0, tp_rank=0), SECRET)
    with pytest.raises(AuthError, match="not authenticated"):
        verify(msgspec.structs.replace(req, nonce=None), SECRET)
    with pytest.raises(AuthError, match="nonce"):
        verify(msgspec.structs.replace(req, nonce=b"short"), SECRET)
    with pytest.raises(AuthError):
        verify(msgspec.structs.replace(req, auth=b""), SECRET)
    with pytest.raises(AuthError):
        sign(req, b"", target=T)
    with pytest.raises(AuthError):
        sign(req, SECRET, target=T, nonce=b"short")


def test_request_relayed_to_another_side_channel_or_stale_is_refused() -> None:
    """The relay: an engine signs a request to an address an outsider named; the outsider forwards it to
    another engine. That engine sees the request was signed for someone else."""
    req = sign(GetMetadata(pp_rank=0, tp_rank=0), SECRET, target="127.0.0.1:40001")
    verify(req, SECRET, is_mine=lambda t: t == "127.0.0.1:40001")
    with pytest.raises(AuthError, match=r"signed for 127\.0\.0\.1:40001"):
        verify(req, SECRET, is_mine=lambda t: t == "127.0.0.1:5600")
    assert req.ts_ms is not None
    with pytest.raises(AuthError, match="stale"):
        verify(req, SECRET, now_ms=req.ts_ms + 31_000)
    verify(req, SECRET, now_ms=req.ts_ms + 29_000)
    unbound = msgspec.structs.replace(req, target=None)
    with pytest.raises(AuthError, match="not bound"):
        verify(unbound, SECRET)


def test_no_secret_accepts_anything() -> None:
    verify(GetMetadata(pp_rank=0, tp_rank=0), None)
    verify(GetMetadata(pp_rank=0, tp_rank=0, auth=b"junk"), b"")


def test_replay_guard_refuses_repeats_and_is_bounded() -> None:
    guard = ReplayGuard(capacity=2)
    reqs = [sign(GetMetadata(pp_rank=0, tp_rank=0), SECRET, target=T) for _ in range(3)]
    guard.check(reqs[0])
    with pytest.raises(AuthError, match="replayed"):
        guard.check(reqs[0])
    guard.check(reqs[1])
    guard.check(reqs[2])
    assert len(guard) == 2
    guard.check(reqs[0])  # evicted: bounded memory is the trade-off
    with pytest.raises(AuthError):
        guard.check(GetMetadata(pp_rank=0, tp_rank=0))
    with pytest.raises(ConfigError):
        ReplayGuard(0)


# --- compat hash -----------------------------------------------------------------------------------

SPEC = KVSpec(num_layers=32, kv_heads=8, head_dim=128, dtype="bfloat16", block_size=16)
BASE = {"model_id": "meta-llama/Llama-3-8B", "spec": SPEC, "transfer_mode": TransferMode.PUSH}


def test_compat_hash_is_stable_hex() -> None:
    h = compat_hash(**BASE)  # type: ignore[arg-type]
    assert h == compat_hash(**BASE)  # type: ignore[arg-type]
    assert len(h) == 64 and int(h, 16) >= 0


@pytest.mark.parametrize(
    "change",
    [
        {"model_id": "meta-llama/Llama-3-70B"},
        {"transfer_mode": TransferMode.PULL},
        {"spec": dataclasses.replace(SPEC, dtype="float16")},
        {"spec": dataclasses.replace(SPEC, num_layers=31)},
        {"spec": dataclasses.replace(SPEC, kv_heads=4)},
        {"spec": dataclasses.replace(SPEC, head_dim=64)},
        {"spec": dataclasses.replace(SPEC, layout=Layout.NHD)},
        {"spec": dataclasses.replace(SPEC, kv_heads=1, mla=True)},
    ],
    ids=["model", "mode", "dtype", "layers", "kv_heads", "head_dim", "layout", "mla"],
)
def test_compat_hash_covers_each_field(change: dict[str, object]) -> None:
    assert compat_hash(**{**BASE, **change}) != compat_hash(**BASE)  # type: ignore[arg-type]


def test_mla_flag_alone_changes_the_hash() -> None:
    one_head = dataclasses.replace(SPEC, kv_heads=1)
    a = compat_hash(**{**BASE, "spec": one_head})  # type: ignore[arg-type]
    b = compat_hash(**{**BASE, "spec": dataclasses.replace(one_head, mla=True)})  # type: ignore[arg-type]
    assert a != b


def test_compat_hash_ignores_what_kvwire_maps() -> None:
    assert compat_hash(**{**BASE, "spec": dataclasses.replace(SPEC, block_size=32)}) == compat_hash(**BASE)  # type: ignore[arg-type]


# --- import purity ---------------------------------------------------------------------------------


def test_protocol_package_imports_no_io() -> None:
    # `_socket` (the C module) is left out: msgspec's typing_extensions import pulls it in, harmlessly.
    code = (
        "import sys\n"
        "import kvwire.protocol, kvwire.protocol.codec, kvwire.protocol.auth, kvwire.protocol.compat\n"
        "import kvwire.protocol.states, kvwire.protocol.ranks, kvwire.protocol.messages\n"
        "banned = ('asyncio', 'socket', 'threading', 'nixl', 'nixl_cu12', 'selectors', 'concurrent')\n"
        "print(','.join(sorted(m for m in sys.modules if m.split('.')[0] in banned)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == ""

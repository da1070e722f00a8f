"""The compat hash: one string two engines compare before any KV moves between them.

It covers exactly what must be equal on both sides for P's bytes to mean the same thing in D's blocks:
the wire version, the model, dtype, layer count, the model's KV heads and head dim, the layout family
(HND | NHD), MLA, and the transfer mode. Block size, TP and PP sizes are left out on purpose: kvwire maps
between different ones (and checks them separately, from the handshake's metadata).

The fields themselves (``CompatFields``) travel beside the hash in the handshake's ``Metadata``, so a side
that finds the hashes differ names what differs (``describe_mismatch``): the model id (weights included:
the reference engine puts its weights' seed in it, the vLLM connector the model's revision and dtype),
the KV geometry or the transfer mode.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

import msgspec

from kvwire.protocol.messages import VERSION, CompatFields, TransferMode

if TYPE_CHECKING:
    # Only attributes are read; a type-only import keeps numpy out of the protocol package's imports.
    from kvwire.kv.spec import KVSpec

_DOMAIN = "kvwire/compat"
_ENCODER = msgspec.msgpack.Encoder()
# Hashes this process computed, with their inputs: a handshake that finds the peer's hash differs from
# ours explains the difference field by field (the peer sends its fields beside its hash). Bounded: a
# process computes a handful (one per engine it hosts); tests may compute more.
_KNOWN: dict[str, CompatFields] = {}
_KNOWN_MAX = 256


def compat_fields(*, model_id: str, spec: KVSpec, transfer_mode: TransferMode) -> CompatFields:
    """The values the hash covers, as sent in ``Metadata.compat``."""
    return CompatFields(
        model_id=model_id,
        dtype=spec.dtype,
        num_layers=spec.num_layers,
        kv_heads=spec.kv_heads,
        head_dim=spec.head_dim,
        layout=spec.layout.value,
        mla=spec.mla,
        transfer_mode=transfer_mode,
        kv_fused=spec.kv_fused,
    )


def _inputs(f: CompatFields) -> list[object]:
    return [
        _DOMAIN,
        VERSION,
        f.model_id,
        f.dtype,
        f.num_layers,
        f.kv_heads,
        f.head_dim,
        f.layout,
        f.mla,
        f.transfer_mode.value,
        # Appended only when set, so the hashes of unfused caches stay what wire contract v1 says.
        *(["kv_fused"] if f.kv_fused else []),
        # Pull mode's D claims P's blocks before it reads them (``claim``): a P or D from before claims
        # would fail every pull request with a newer peer, so they no longer pair (push is unchanged).
        *(["pull_claims"] if f.transfer_mode is TransferMode.PULL else []),
    ]


def compat_inputs(*, model_id: str, spec: KVSpec, transfer_mode: TransferMode) -> list[object]:
    """The values the hash covers, in their canonical order."""
    return _inputs(compat_fields(model_id=model_id, spec=spec, transfer_mode=transfer_mode))


def fields_hash(fields: CompatFields) -> str:
    """SHA-256 (hex) of the canonical msgpack encoding of the fields' inputs."""
    digest = hashlib.sha256(_ENCODER.encode(_inputs(fields))).hexdigest()
    if digest not in _KNOWN:
        if len(_KNOWN) >= _KNOWN_MAX:
            del _KNOWN[next(iter(_KNOWN))]
        _KNOWN[digest] = fields
    return digest


def compat_hash(*, model_id: str, spec: KVSpec, transfer_mode: TransferMode) -> str:
    """SHA-256 (hex) of the canonical msgpack encoding of ``compat_inputs``."""
    return fields_hash(compat_fields(model_id=model_id, spec=spec, transfer_mode=transfer_mode))


def fields_of(digest: str) -> CompatFields | None:
    """The fields behind a hash this process computed (None for any other)."""
    return _KNOWN.get(digest)


def _show(value: object) -> str:
    if isinstance(value, TransferMode):
        return value.value
    return repr(value) if isinstance(value, str) else str(value)


def _model_parts(model_id: str) -> dict[str, str] | None:
    """``key=value;key=value`` model ids (the vLLM connector's) by key; None for any other form."""
    parts = [p.partition("=") for p in model_id.split(";")]
    return {k: v for k, _, v in parts} if all(sep for _, sep, _ in parts) else None


def describe_mismatch(ours: CompatFields, theirs: CompatFields, peer: str = "the peer") -> str:
    """Which compat fields differ, e.g. ``model_id 'kvwire-tiny/seed1' here vs 'kvwire-tiny/seed2' at
    the peer; transfer_mode push here vs pull at the peer``."""
    diffs = []
    for name in CompatFields.__struct_fields__:
        a, b = getattr(ours, name), getattr(theirs, name)
        if a == b:
            continue
        line = f"{name} {_show(a)} here vs {_show(b)} at {peer}"
        pa, pb = (_model_parts(a), _model_parts(b)) if name == "model_id" else (None, None)
        if pa is not None and pb is not None:
            keys = sorted(k for k in pa.keys() | pb.keys() if pa.get(k) != pb.get(k))
            line += f" (its {', '.join(keys)} differ{'s' if len(keys) == 1 else ''})"
        diffs.append(line)
    if not diffs:
        return f"same fields but another compat hash at {peer} (another wire version or kvwire release?)"
    return "; ".join(diffs)

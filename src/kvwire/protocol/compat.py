"""The compat hash: one string two engines compare before any KV moves between them.

It covers exactly what must be equal on both sides for P's bytes to mean the same thing in D's blocks:
the wire version, the model, dtype, layer count, the model's KV heads and head dim, the layout family
(HND | NHD), MLA, and the transfer mode. Block size, TP and PP sizes are left out on purpose: kvwire maps
between different ones (and checks them separately, from the handshake's metadata).
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

import msgspec

from kvwire.protocol.messages import VERSION, TransferMode

if TYPE_CHECKING:
    # Only attributes are read; a type-only import keeps numpy out of the protocol package's imports.
    from kvwire.kv.spec import KVSpec

_DOMAIN = "kvwire/compat"
_ENCODER = msgspec.msgpack.Encoder()


def compat_inputs(*, model_id: str, spec: KVSpec, transfer_mode: TransferMode) -> list[object]:
    """The values the hash covers, in their canonical order (also what a mismatch report can show)."""
    return [
        _DOMAIN,
        VERSION,
        model_id,
        spec.dtype,
        spec.num_layers,
        spec.kv_heads,
        spec.head_dim,
        spec.layout.value,
        spec.mla,
        transfer_mode.value,
        # Appended only when set, so the hashes of unfused caches stay what wire contract v1 says.
        *(["kv_fused"] if spec.kv_fused else []),
    ]


def compat_hash(*, model_id: str, spec: KVSpec, transfer_mode: TransferMode) -> str:
    """SHA-256 (hex) of the canonical msgpack encoding of ``compat_inputs``."""
    data = _ENCODER.encode(compat_inputs(model_id=model_id, spec=spec, transfer_mode=transfer_mode))
    return hashlib.sha256(data).hexdigest()

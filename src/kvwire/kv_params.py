"""``kv_transfer_params``: a request's disaggregation parameters, as one typed value (vLLM's names).

The router, the reference engine and the vLLM connector all use ``KvTransferParams``: the router builds
it for both legs, an engine parses it once where the request comes in (the HTTP body, vLLM's scheduler
hook) and hands the typed value on, so nothing further in reads a dict.

A field left at ``None`` was not given, and is not written back: ``to_json`` emits only the fields that
are set, so the JSON on the wire is what each side wrote when it built its own dict (the prefill leg
``{"do_remote_decode": true, "transfer_id": ...}``; P's answer with an explicit ``"do_remote_decode":
false`` for vLLM). Keys this struct does not know are ignored, as vLLM ignores them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any

import msgspec

from kvwire.errors import InvalidRequest
from kvwire.protocol.messages import HostText, IdText, Port

FIELD = "kv_transfer_params"  # the request body's key, and the parameter an error names
# P's geometry a request may name: TP as kvwire maps (kv.mapping.MAX_TP), and ranks in all, each one a
# handshake D makes for the request: a hostile TP 64 x PP 61 cost D 3,904 handshakes for one request
# (512: TP 8 x PP 61, the most one could name before TP went past 8, 488).
MAX_REMOTE_TP = 64
MAX_REMOTE_RANKS = 512
# A prompt's blocks on P: a 16M-token prompt in 16-token blocks, or a 4M-token one over four KV cache groups
# (P checks it before it answers: vLLM's scheduler side).
MAX_REMOTE_BLOCK_IDS = 1 << 20
_Tp = Annotated[int, msgspec.Meta(ge=1, le=MAX_REMOTE_TP)]
_Pp = Annotated[int, msgspec.Meta(ge=1, le=MAX_REMOTE_RANKS)]


class KvTransferParams(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    # P's leg: prefill here and keep the KV for a remote decoder.
    do_remote_decode: bool | None = None
    # D's leg: the prompt's KV comes from a remote prefiller (the remote_* fields say which).
    do_remote_prefill: bool | None = None
    # Ids go on the wire, where they are at most MAX_ID_CHARS: a longer one is refused here (400), before
    # any leg starts, not by P's core after D registered.
    transfer_id: IdText | None = None  # kvwire's id of the transfer, the same in both legs
    remote_request_id: IdText | None = None  # vLLM's name for it (P's request id): read if transfer_id is not
    remote_engine_id: IdText | None = None
    # The life (incarnation) of P that prefilled and holds the KV: a P restarted since holds none, and D
    # must not read (pull) or wait on (push) its new life's blocks. Not given: not checked (older peers).
    remote_incarnation: IdText | None = None
    remote_host: HostText | None = None  # where P's side channel listens
    remote_port: Port | None = None
    # P's ranks on several hosts (multi-node PP): rank (pp, tp)'s host at index pp * remote_tp_size + tp,
    # one per rank. Not given: every rank at remote_host (one host).
    remote_hosts: Annotated[tuple[HostText, ...], msgspec.Meta(max_length=MAX_REMOTE_RANKS)] | None = None
    remote_tp_size: _Tp | None = None  # P's parallelism; not given: 1
    remote_pp_size: _Pp | None = None
    # Pull mode: P's blocks of the prompt, in token order (bounded: 2,000,000 ids were taken, 16 MB kept per
    # request, until P refused the claim).
    remote_block_ids: Annotated[tuple[int, ...], msgspec.Meta(max_length=MAX_REMOTE_BLOCK_IDS)] | None = None
    num_tokens: int | None = None  # P's answer (reference engine): the prompt's tokens

    @property
    def remote_decode(self) -> bool:
        return self.do_remote_decode is True

    @property
    def remote_prefill(self) -> bool:
        return self.do_remote_prefill is True

    @property
    def tp_size(self) -> int:
        """P's TP size (1 when not given)."""
        return self.remote_tp_size or 1

    @property
    def pp_size(self) -> int:
        """P's PP size (1 when not given)."""
        return self.remote_pp_size or 1

    def remote_address(self) -> tuple[str, str, int]:
        """(remote_engine_id, remote_host, remote_port), which a decode leg needs; ``InvalidRequest``
        naming what is missing."""
        if self.remote_engine_id is None or self.remote_host is None or self.remote_port is None:
            missing = [
                name
                for name in ("remote_engine_id", "remote_host", "remote_port")
                if getattr(self, name) is None
            ]
            raise InvalidRequest(f"{FIELD} with do_remote_prefill need {', '.join(missing)}", FIELD)
        return self.remote_engine_id, self.remote_host, self.remote_port

    def rank_hosts(self) -> tuple[str, ...]:
        """``remote_hosts`` checked against P's rank count (``()`` when not given); ``InvalidRequest`` when
        it names another count of ranks, or P has more than ``MAX_REMOTE_RANKS``."""
        hosts = self.remote_hosts or ()
        if self.tp_size * self.pp_size > MAX_REMOTE_RANKS:
            raise InvalidRequest(
                f"{FIELD}: P of remote_tp_size {self.tp_size} x remote_pp_size {self.pp_size} ranks: at most "
                f"{MAX_REMOTE_RANKS} ranks",
                FIELD,
            )
        if hosts and len(hosts) != self.tp_size * self.pp_size:
            raise InvalidRequest(
                f"{FIELD} remote_hosts names {len(hosts)} hosts for P's {self.tp_size * self.pp_size} ranks "
                f"(remote_tp_size {self.tp_size} x remote_pp_size {self.pp_size}): one per rank",
                FIELD,
            )
        return hosts

    def check_prompt(self, num_tokens: int) -> None:
        """D's leg: ``InvalidRequest`` when P's answer names another prompt length than D's (``num_tokens``,
        when given). P's KV is its prompt's: a longer prompt on D read slots P never wrote for it as KV
        (pull; push refused it at P), a shorter one a prefix of another prompt's."""
        if self.num_tokens is not None and self.num_tokens != num_tokens:
            raise InvalidRequest(
                f"{FIELD}: P prefilled {self.num_tokens} tokens, this prompt has {num_tokens}: send D the "
                "prompt P prefilled (the same tokenizer and chat template)",
                FIELD,
            )

    def to_json(self) -> dict[str, Any]:
        """The JSON object: the fields that are set, under vLLM's names (plain JSON types: lists, not
        tuples, so it compares equal to what a client decodes)."""
        out: dict[str, Any] = msgspec.json.decode(msgspec.json.encode(self))
        return out


def parse_kv_params(raw: object, *, strict: bool = True) -> KvTransferParams | None:
    """A request's ``kv_transfer_params`` (a decoded JSON object), typed; None when absent or empty.

    ``InvalidRequest`` naming the field when malformed. ``strict=False`` takes numbers and booleans
    written as strings too (vLLM's connector, whose params may come from any client library)."""
    if raw is None:
        return None
    if not isinstance(raw, Mapping):
        raise InvalidRequest(f"{FIELD} must be an object", FIELD)
    if not raw:
        return None
    try:
        return msgspec.convert(dict(raw), KvTransferParams, strict=strict)
    except msgspec.ValidationError as exc:
        raise InvalidRequest(f"{FIELD}: {exc}", FIELD) from exc

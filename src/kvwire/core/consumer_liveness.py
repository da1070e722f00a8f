"""D's view of the P lives its requests wait on, and which links a liveness pass must visit.

The pass runs at every timer tick (50 Hz). Visiting every live request each time made it the costliest
part of D's core (issue 21), so ``Lives`` keeps what lets a pass skip, exactly (the simulator's outcomes
are unchanged, seed for seed):

* a P life can be declared dead only once it is silent past the timeout since its last word *and* since
  its oldest registration still open (``PeerLife.oldest_reg``: a registration's silence is counted from
  when it was sent);
* a dead life's links get their verdict in the pass that declares it or the next one (``_unswept``), or
  the pass after a link registers with a life already dead;
* a verdict ends its rank at a known time (grace, quarantine) or after a word that confirms the dead life
  (``_verdicts_wake``, ``_verdicts_dirty``).

A pass with none of these visits no request.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterator, Mapping

from kvwire.core.config import ConnectorConfig
from kvwire.core.consumer_records import Link, LocalPart, PeerLife, Request
from kvwire.core.io import HandshakeDone
from kvwire.core.types import EngineInfo, PeerRank
from kvwire.protocol.messages import CancelAck, Failed, FailReason, Heartbeat, id_batches
from kvwire.protocol.ranks import RankKey

Beat = tuple[RankKey, str, Heartbeat]  # from local rank, to P agent, the message

LifeKey = tuple[str, str]  # (engine_id, incarnation) of a P engine
_VERDICTS_KEPT = 8  # per life: the verdicts whose confirmation is remembered (PeerLife.confirmed)


def release_at(life: PeerLife, dead_at: float, grace_s: float, quarantine_s: float) -> float:
    """When blocks a dead P life may still write can go back: the grace after the verdict (at ``dead_at``)
    and after the life's confirmation (it spoke again, or another life answered at its address), and never
    later than the quarantine bound. A word is taken as the sign that the writes are recalled (a thawed P
    recalls before it speaks), not that their bytes have landed: after a partition heals, the word comes
    over a new connection while the old one still drains what the kernels held (a netns run saw 114 KB
    land after RELEASED when the grace ran from the verdict only)."""
    bound = dead_at + grace_s + quarantine_s  # at most, confirmed or not
    confirmed = life.confirmed.get(dead_at)
    if confirmed is not None:
        return min(max(dead_at, confirmed) + grace_s, bound)
    return bound


# The ``failed`` reasons by which P says no write of the registration is under way: it never posted one
# (or, layer-wise, ``digest_unavailable`` comes after every earlier WRITE completed). Any other (a write
# recalled or failed, an abort or shutdown while writing, a reason this version does not know) may leave
# bytes on their way: fail closed.
NOTHING_POSTED = frozenset(
    {
        FailReason.BAD_REGISTRATION,
        FailReason.INCOMPATIBLE,
        FailReason.HANDSHAKE_FAILED,
        FailReason.OVERLOADED,
        FailReason.SHORT_REGISTRATION,
        FailReason.DIGEST_UNAVAILABLE,
    }
)


def drain_hold(msg: Failed | CancelAck, now: float, grace_s: float) -> float:
    """Until when D keeps the blocks of a rank that P ended with ``msg`` (0.0: free them at once).

    P sends a ``failed`` or a ``cancel_ack`` (wrote) after it released a write that did not complete, and
    its bytes may still be on their way: on the same connection they arrive before the word, but after a
    partition the word can come over a new connection while the old one drains what the kernels held
    (the path D's liveness verdict covers with the same grace, when D had declared P dead; here it had
    not). So the blocks wait ``dead_peer_grace_s`` from the word, as after a verdict's confirmation."""
    posted = msg.wrote if isinstance(msg, CancelAck) else msg.reason not in NOTHING_POSTED
    return now + grace_s if posted else 0.0


def life_key(peer: PeerRank) -> LifeKey:
    return (peer.engine_id, peer.incarnation)


def quarantined(requests: Mapping[str, Request]) -> int:
    """Requests with a link holding a verdict: their blocks wait on a dead P life's confirmation."""
    return sum(
        1
        for req in requests.values()
        if any(lk.dead_at is not None for part in req.parts.values() for lk in part.links.values())
    )


class Lives:
    """The P lives live requests wait on, with what a liveness pass needs to skip."""

    def __init__(self) -> None:
        self.table: dict[LifeKey, PeerLife] = {}
        self._unswept: set[LifeKey] = set()  # dead lives whose links may not all hold their verdict
        self._verdicts_wake = math.inf  # the earliest grace or quarantine end of a verdict
        self._verdicts_dirty = False  # a word came that may confirm a dead life
        self.ranks_heard: dict[str, float] = {}  # P agent -> its last heartbeat (push: ``forgotten``)
        self._last_input = math.inf  # when D's core last had an input (``input_at``)

    def input_at(self, now: float, frozen_after_s: float) -> None:
        """Before each input of D's core. A gap over ``frozen_after_s`` since the last one was D's own
        freeze (a driver feeds a core at least every heartbeat period), not the silence of the P lives it
        waits on: their silence clocks restart now, so the thaw's first tick declares none of them dead
        before the words they sent meanwhile, queued behind the freeze, are read. Found by a fuzzing
        helper (the simulator, heavy pauses): that tick's verdict, then a heartbeat P sent before it froze
        read as the proof of its recall, freed blocks a frozen P still had a write posted to (C1)."""
        gap, self._last_input = now - self._last_input, now
        if gap > frozen_after_s:
            for life in self.table.values():
                if life.dead_at is None:
                    life.last_seen = max(life.last_seen, now)

    @staticmethod
    def live_links(requests: Mapping[str, Request]) -> dict[tuple[RankKey, str], list[str]]:
        """(local rank, P agent) -> transfer ids of the requests waiting on that P rank (D's heartbeats)."""
        live: dict[tuple[RankKey, str], list[str]] = defaultdict(list)
        for req in requests.values():
            for part in req.parts.values():
                for link in part.links.values():
                    if link.peer is not None and link.dead_at is None:
                        live[(part.key, link.peer.agent_name)].append(req.transfer_id)
        return live

    def heartbeats(
        self, requests: Mapping[str, Request], engine: EngineInfo
    ) -> Iterator[tuple[RankKey, str, Heartbeat]]:
        """D's heartbeats: to each live P rank, from each local rank, the transfers waiting on it (in
        batches of ``id_batches``), as (local rank, P agent, message)."""
        for (key, agent_name), tids in self.live_links(requests).items():
            for batch in id_batches(tids):
                hb = Heartbeat(transfer_id="", engine_id=engine.engine_id, incarnation=engine.incarnation,
                               transfer_ids=batch)  # fmt: skip
                yield key, agent_name, hb

    def note_listed(
        self, requests: Mapping[str, Request], key: RankKey, sender: str, tids: list[str], now: float
    ) -> None:
        """A heartbeat from P agent ``sender`` (of a watched life) to local rank ``key`` names the
        registrations that P rank holds; the rank itself is heard."""
        self.ranks_heard[sender] = now
        for tid in tids:
            req = requests.get(tid)
            part = None if req is None else req.parts.get(key)
            for link in () if part is None else part.links.values():
                if link.peer is not None and link.peer.agent_name == sender:
                    link.listed_at = now

    def forgotten(
        self, requests: Mapping[str, Request], now: float, cfg: ConnectorConfig
    ) -> list[tuple[Request, LocalPart, Link]]:
        """Registrations whose P rank no longer holds them: that rank is alive (its heartbeat came within the
        liveness timeout) and has not named them since D registered, for longer than P may need before it
        names a registration (its handshake with D: named once D is loaded) or while it stops naming one
        whose write is still posted (an ended request's, recalled at ``transfer_timeout_s``), plus the
        liveness timeout and two heartbeats. P ended them and its ending word (``done``, ``failed``,
        ``cancel_ack``) was lost, or it never had them (a lost ``push_reg``): its heartbeats for other
        registrations keep the life alive, so liveness alone would never end them. The window uses this
        side's settings: P's should be the same (docs/configuration.md)."""
        window = max(cfg.handshake_timeout_s * (cfg.handshake_retries + 1), cfg.transfer_timeout_s)
        window += cfg.liveness_timeout_s + 2 * cfg.heartbeat_interval_s
        out, heard, named = [], self.ranks_heard, set()
        for req in requests.values():
            for part in req.parts.values():
                pending = part.machine.ranks.pending
                for link in part.links.values():
                    peer = link.peer
                    if peer is None or link.dead_at is not None or link.src not in pending:
                        continue
                    named.add(peer.agent_name)
                    if now - max(link.registered_at, link.listed_at) <= window:
                        continue
                    life = self.table.get(life_key(peer))
                    rank_alive = now - heard.get(peer.agent_name, -math.inf) < cfg.liveness_timeout_s
                    if life is not None and life.dead_at is None and rank_alive:
                        out.append((req, part, link))
        self.ranks_heard = {a: t for a, t in heard.items() if a in named}  # only ranks live links wait on
        return out

    def heard(self, life: PeerLife, now: float) -> None:
        """A notification from ``life``: a sign of life, and maybe the proof that it recalled its writes."""
        life.last_seen = max(life.last_seen, now)
        self._confirm(life, now)

    def probed(self, life: tuple[str, str], inp: HandshakeDone, now: float) -> None:
        """The answer to a probe of a dead life's address (``ConsumerCore._declare_dead``): a refused
        connection or another life there confirms it gone; a timeout or the same life confirms nothing."""
        known = self.table.get(life)
        peer = inp.peer
        other = peer is not None and (peer.engine_id, peer.incarnation) != life
        if known is not None and (inp.nobody_listens or other):
            self.gone(known, now)

    def gone(self, life: PeerLife, now: float) -> None:
        """Another life (or nobody) answers at its address, not from a cache: the process is over."""
        life.gone = True
        self._confirm(life, now)

    def answered(self, life: PeerLife, peer: PeerRank, now: float, *, fresh: bool) -> None:
        """``life`` answered a handshake as ``peer``. From the address itself (``fresh``), not a cache: any
        other life of that engine, or that held that address, is over. Matched by address too, not by
        engine id alone: kvwire serve and vLLM give a restarted engine a new id by default. A cached answer
        proves nothing (one rank's cache may still name an older life after another rank loaded the new
        one: it would call a live, or a frozen and declared dead, newer life gone, and release its blocks
        at the grace)."""
        where = (peer.host, peer.port)
        life.addresses.add(where)
        if not fresh:
            return
        for (engine_id, _), other in self.table.items():
            if other is not life and (engine_id == peer.engine_id or where in other.addresses):
                self.gone(other, now)

    def _confirm(self, life: PeerLife, now: float) -> None:
        for verdict, word in life.confirmed.items():
            if word is None:
                life.confirmed[verdict] = now
        self._verdicts_dirty |= life.verdicts

    def registered(self, peer: PeerRank, now: float) -> None:
        """A registration was sent to ``peer``: its silence counts from now."""
        life = self.table.get(life_key(peer))
        if life is None:
            return
        life.oldest_reg = min(life.oldest_reg, now)
        if life.dead_at is not None:
            self._unswept.add(life_key(peer))  # registered with a life already dead: the next pass ends it

    def declared_dead(self, peer: PeerRank, life: PeerLife, now: float) -> None:
        life.dead_at = now
        life.confirmed[now] = now if life.gone else None  # a new verdict waits for a new word
        if len(life.confirmed) > _VERDICTS_KEPT:  # a flapping life: its oldest verdict ends at the bound
            del life.confirmed[next(iter(life.confirmed))]
        self._unswept.add(life_key(peer))  # links the declaring pass visited before: the next pass

    def give_verdict(self, link: Link, life: PeerLife) -> None:
        link.dead_at, life.verdicts = life.dead_at, True

    def verdict_waits(self, until: float) -> None:
        self._verdicts_wake = min(self._verdicts_wake, until)

    def prune(self, requests: Mapping[str, Request]) -> None:
        """Forget the P lives no live request waits on (the table would grow with every restart)."""
        referenced = {
            life_key(link.peer)
            for req in requests.values()
            for part in req.parts.values()
            for link in part.links.values()
            if link.peer is not None
        }
        for key in [k for k in self.table if k not in referenced]:
            del self.table[key]

    def due(
        self, now: float, requests: Mapping[str, Request], timeout_s: float
    ) -> Iterator[tuple[Request, list[tuple[LocalPart, Link, PeerLife]]]]:
        """The requests with links that may act at ``now``, each with those links (lazily: the caller
        acts on one request before the next is looked at). Exhaust it: the last step records each silent
        life's oldest registration."""
        table = self.table
        silent = {
            k
            for k, life in table.items()
            if life.dead_at is None and now - max(life.last_seen, life.oldest_reg) > timeout_s
        }
        dead = {k for k in self._unswept if (life := table.get(k)) is not None and life.dead_at is not None}
        self._unswept = set()
        verdicts_due = self._verdicts_dirty or now >= self._verdicts_wake
        if verdicts_due:
            self._verdicts_dirty, self._verdicts_wake = False, math.inf
        elif not silent and not dead:
            return  # the common pass: one look at each P life
        oldest = dict.fromkeys(silent, math.inf)  # recomputed: every link of a silent life is visited
        for req in list(requests.values()):
            links: list[tuple[LocalPart, Link, PeerLife]] = []
            for part in req.parts.values():
                for src in part.machine.ranks.pending:
                    link = part.links[src]
                    if link.peer is None:
                        continue
                    key = life_key(link.peer)
                    if key in oldest:
                        oldest[key] = min(oldest[key], link.registered_at)
                    elif key not in dead if link.dead_at is None else not verdicts_due:
                        continue
                    links.append((part, link, table[key]))
            if links:
                yield req, links
        for key, first in oldest.items():
            table[key].oldest_reg = first

"""``Lives.due``: which links a liveness pass visits. The pass runs at 50 Hz over every live request, so
the cheap answer must also be the right one: every link that can act is yielded, and none while none can."""

from __future__ import annotations

import math

from kvwire.core.consumer_liveness import Lives, life_key
from kvwire.core.consumer_records import Link, LocalPart, PeerLife, Request
from kvwire.core.io import RemoteEngine
from kvwire.core.types import PeerRank
from kvwire.protocol.messages import TransferMode
from kvwire.protocol.states import ConsumerRequest
from kvwire.protocol.types import PeerMode

TIMEOUT = 5.0
P = PeerRank("p0", "life-1", "127.0.0.1", 7000, 1, 0, 1, 0, "p0-agent", PeerMode.NOTIF_ONLY, None, 64, 0.0)


def _request(tid: str, lives: Lives, registered_at: float, peer: PeerRank = P) -> Request:
    machine = ConsumerRequest(TransferMode.PUSH, [(0, 0)])
    machine.push_reg_sent((0, 0))
    link = Link((0, 0), peer=peer, registered_at=registered_at)
    req = Request(tid, [0], 4, 0, RemoteEngine("p0", "127.0.0.1", 7000))
    req.parts[(0, 0)] = LocalPart((0, 0), machine, {(0, 0): link})
    lives.registered(peer, registered_at)
    return req


def _visited(lives: Lives, now: float, requests: dict[str, Request]) -> list[str]:
    return [req.transfer_id for req, _links in lives.due(now, requests, TIMEOUT)]


def test_a_pass_with_every_life_speaking_visits_no_request() -> None:
    lives = Lives()
    lives.table[life_key(P)] = PeerLife(last_seen=0.0)
    requests = {f"r{i}": _request(f"r{i}", lives, registered_at=0.0) for i in range(500)}
    lives.heard(lives.table[life_key(P)], 4.0)
    assert _visited(lives, 8.9, requests) == []  # heard at 4.0: silent 4.9 s < 5 s


def test_a_silent_life_is_visited_once_its_oldest_registration_is_past_the_timeout() -> None:
    lives = Lives()
    life = lives.table[life_key(P)] = PeerLife(last_seen=0.0)
    requests = {
        "old": _request("old", lives, registered_at=1.0),
        "new": _request("new", lives, registered_at=3.0),
    }
    assert _visited(lives, 5.9, requests) == []  # the oldest registration is 4.9 s old
    assert _visited(lives, 6.1, requests) == ["old", "new"]  # every link of the silent life
    assert life.oldest_reg == 1.0
    del requests["old"]  # that request ended: the pass that visits the life recomputes its oldest
    assert _visited(lives, 6.2, requests) == ["new"]
    assert life.oldest_reg == 3.0
    assert _visited(lives, 7.9, requests) == []
    assert _visited(lives, 8.1, requests) == ["new"]


def test_a_dead_life_is_swept_the_next_pass_and_its_verdicts_wait_for_their_time() -> None:
    lives = Lives()
    life = lives.table[life_key(P)] = PeerLife(last_seen=0.0)
    requests = {"a": _request("a", lives, registered_at=0.0)}
    lives.declared_dead(P, life, 6.0)
    assert _visited(lives, 6.02, requests) == ["a"]  # the link gets its verdict
    link = requests["a"].parts[(0, 0)].links[(0, 0)]
    lives.give_verdict(link, life)
    lives.verdict_waits(7.0)  # the grace ends at 7.0
    assert _visited(lives, 6.04, requests) == []
    assert _visited(lives, 6.99, requests) == []
    assert _visited(lives, 7.0, requests) == ["a"]
    lives.verdict_waits(37.0)  # unconfirmed: the quarantine bound
    assert _visited(lives, 7.02, requests) == []
    lives.heard(life, 8.0)  # the dead life speaks: its word may confirm the recall
    assert _visited(lives, 8.02, requests) == ["a"]


def test_a_registration_with_a_life_already_dead_is_swept() -> None:
    lives = Lives()
    life = lives.table[life_key(P)] = PeerLife(last_seen=0.0)
    requests = {"a": _request("a", lives, registered_at=0.0)}
    lives.declared_dead(P, life, 6.0)
    assert _visited(lives, 6.02, requests) == ["a"]
    lives.give_verdict(requests["a"].parts[(0, 0)].links[(0, 0)], life)
    lives.verdict_waits(math.inf)
    requests["b"] = _request("b", lives, registered_at=6.03)
    assert _visited(lives, 6.04, requests) == ["b"]  # not "a": its verdict is not due

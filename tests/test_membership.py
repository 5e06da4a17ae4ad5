"""Suspicion in the member view (coordinator/membership.py): a peer that failed to answer is routed around until
it refreshes its record, and a record it stored before it failed does not count as a refresh."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

from diloco.coordinator.membership import Membership
from diloco.coordinator.wire import MemberRecord
from diloco.protocol.identity import Identity

from .swarm_utils import tiny_run

TTL = 6.0


class RecordsDHT:
    """The member records a poll reads: peer_id -> (value, expiration), as `DHTNode.get(latest=True)` returns."""

    def __init__(self, identity: Identity) -> None:
        self.identity = identity
        self.records: dict[str, tuple[bytes, float]] = {}

    async def get(self, key: str, *, latest: bool = False) -> dict[str, tuple[bytes, float]]:
        return dict(self.records)

    def stored(self, peer_id: str, at: float) -> None:
        """`peer_id` stored its record at time `at` (its expiration is `at` + the TTL)."""
        record = MemberRecord("http://127.0.0.1:9", "", False, 0, 0.0, 0.0, True)
        self.records[peer_id] = (record.encode(), at + TTL)


def view() -> tuple[Membership, RecordsDHT, str]:
    me, other = Identity.generate(), Identity.generate().peer_id
    dht = RecordsDHT(me)
    record = MemberRecord("http://127.0.0.1:1", "", False, 0, 0.0, 0.0, True)
    members = Membership(SimpleNamespace(identity=me), tiny_run().spec, lambda: record, ttl_s=TTL)
    members.dht = dht
    return members, dht, other


def live(members: Membership, peer: str) -> bool:
    return peer in members.live_learners()


def test_a_suspect_stays_one_through_a_record_it_stored_before_it_failed_and_not_through_a_later_one():
    members, dht, other = view()
    now = time.time()
    dht.stored(other, now - 3.0)
    asyncio.run(members.poll())
    assert live(members, other)
    members.suspect(other)  # (a refused connection: the process is dead)
    assert not live(members, other)
    # it had stored a newer record between our last poll and its death: the DHT hands it to us only now
    dht.stored(other, now - 0.5)
    asyncio.run(members.poll())
    assert not live(members, other) and other in members.suspects
    asyncio.run(members.poll())
    assert not live(members, other)
    # a record stored after the suspicion: it is alive again
    dht.stored(other, time.time() + 0.01)
    asyncio.run(members.poll())
    assert live(members, other) and other not in members.suspects


def test_a_suspect_that_refreshes_after_the_suspicion_is_live_at_the_next_poll_and_one_whose_clock_lags_one_refresh_later():
    members, dht, other = view()
    dht.stored(other, time.time() - 3.0)
    asyncio.run(members.poll())
    members.suspect(other)
    dht.stored(other, time.time() + 0.01)
    asyncio.run(members.poll())
    assert live(members, other)

    # a peer whose clock runs 2 s behind ours: its first refresh after the suspicion looks older than it, and
    # is passed over once; its next one clears it
    members, dht, other = view()
    dht.stored(other, time.time() - 5.0)
    asyncio.run(members.poll())
    members.suspect(other)
    dht.stored(other, time.time() + 0.5 - 2.0)
    asyncio.run(members.poll())
    assert not live(members, other)
    dht.stored(other, time.time() + 2.5 - 2.0)
    asyncio.run(members.poll())
    assert live(members, other)


def test_a_suspect_whose_record_is_gone_is_forgotten_and_a_distrusted_peer_stays_one_while_it_refreshes():
    members, dht, other = view()
    dht.stored(other, time.time())
    asyncio.run(members.poll())
    members.suspect(other)
    del dht.records[other]
    asyncio.run(members.poll())
    assert other not in members.suspects and not live(members, other)

    dht.stored(other, time.time())
    asyncio.run(members.poll())
    members.distrust(other)
    for _ in range(2):
        dht.stored(other, time.time() + 0.01)
        asyncio.run(members.poll())
        assert not live(members, other)

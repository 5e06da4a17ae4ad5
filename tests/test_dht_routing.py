"""Routing table rules: XOR order, k per bucket, LRU eviction with replacement cache, no self, no client mode."""

from __future__ import annotations

import random
from dataclasses import dataclass

from hypothesis import given, settings
from hypothesis import strategies as st

from diloco.protocol.dht import NodeInfo, RoutingTable, bucket_index, key_id
from diloco.protocol.dht.routing import ID_BITS, ID_SPACE
from diloco.protocol.identity import Identity


@dataclass(frozen=True)
class Peer:
    """A stand-in contact whose id the test chooses (a real NodeInfo's id is a hash)."""

    node_id: int
    client_mode: bool = False
    timestamp_ms: int = 0


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


SELF = 0x5A5A << 144
ids = st.integers(0, ID_SPACE - 1)
# Distances spread over every bucket, not just the far ones a uniform id would land in.
distances = st.builds(
    lambda shift, r: (r >> shift) or 1, st.integers(0, ID_BITS - 1), st.integers(1, ID_SPACE - 1)
)


def in_bucket(i: int, n: int, start: int = 0) -> list[Peer]:
    """n distinct peers in bucket i of SELF's table (i must be large enough to hold them)."""
    return [Peer(SELF ^ ((1 << i) | (start + j))) for j in range(n)]


def test_key_id_is_first_160_bits_of_sha256():
    import hashlib

    assert key_id("run:x:members") == int(hashlib.sha256(b"run:x:members").hexdigest()[:40], 16)
    assert 0 <= key_id("é") < ID_SPACE


@settings(max_examples=60, deadline=None)
@given(ds=st.lists(distances, max_size=80, unique=True), target=ids, n=st.integers(0, 30))
def test_closest_equals_brute_force_when_nothing_overflows(ds, target, n):
    table = RoutingTable(SELF, k=1000)
    peers = [Peer(SELF ^ d) for d in ds]
    for p in peers:
        assert table.update(p) is None
    expected = sorted(peers, key=lambda p: p.node_id ^ target)[:n]
    assert table.closest(target, n) == expected


@settings(max_examples=60, deadline=None)
@given(
    ds=st.lists(distances, max_size=120, unique=True),
    target=ids,
    n=st.integers(1, 25),
    k=st.integers(1, 4),
    data=st.data(),
)
def test_closest_equals_brute_force_over_kept_contacts_and_buckets_hold_at_most_k(ds, target, n, k, data):
    table = RoutingTable(SELF, k=k, replacements=2)
    for d in ds:
        table.update(Peer(SELF ^ d))
    kept = list(table)
    assert len(kept) == len(table) == len({p.node_id for p in kept})
    assert all(len(table.bucket(i)) <= k for i in range(ID_BITS))
    exclude = set(data.draw(st.lists(st.sampled_from([p.node_id for p in kept]))) if kept else [])
    expected = sorted((p for p in kept if p.node_id not in exclude), key=lambda p: p.node_id ^ target)[:n]
    assert table.closest(target, n, exclude) == expected


def test_every_contact_sits_in_the_bucket_of_its_distance():
    table = RoutingTable(SELF, k=3)
    rng = random.Random(1)
    for _ in range(300):
        table.update(Peer(SELF ^ (rng.getrandbits(rng.randrange(1, ID_BITS + 1)) or 1)))
    for i in range(ID_BITS):
        for p in table.bucket(i):
            assert 2**i <= p.node_id ^ SELF < 2 ** (i + 1) and bucket_index(SELF, p.node_id) == i


def test_full_bucket_returns_least_recently_seen_and_keeps_newcomer_out():
    table = RoutingTable(SELF, k=3)
    a, b, c, d = in_bucket(10, 4)
    for p in (a, b, c):
        assert table.update(p) is None
    assert table.update(a) is None  # refresh: a becomes most recently seen
    assert table.bucket(10) == [b, c, a]
    assert table.update(d) == b  # the caller should PING b
    assert d not in table and d.node_id not in table and table.replacement_cache(10) == [d]
    assert len(table) == 3


def test_pinged_contact_that_answers_stays_and_newcomer_waits():
    table = RoutingTable(SELF, k=2)
    a, b, c = in_bucket(10, 3)
    table.update(a), table.update(b)
    assert table.update(c) == a
    assert table.update(a) is None  # a answered the PING
    assert table.bucket(10) == [b, a] and c.node_id not in table


def test_removing_a_dead_contact_promotes_the_most_recent_replacement():
    table = RoutingTable(SELF, k=2, replacements=2)
    a, b, c, d, e = in_bucket(10, 5)
    for p in (a, b, c, d, e):
        table.update(p)
    assert table.replacement_cache(10) == [d, e]  # bounded: c was pushed out
    assert table.remove(a.node_id) == a
    assert table.bucket(10) == [b, e] and table.replacement_cache(10) == [d]
    assert table.remove(a.node_id) is None


def test_table_never_holds_itself():
    table = RoutingTable(SELF)
    assert table.update(Peer(SELF)) is None
    assert len(table) == 0 and SELF not in table and table.closest(SELF, 5) == []


def test_table_never_holds_a_client_mode_node():
    me, client, server = Identity.generate(), Identity.generate(), Identity.generate()
    table: RoutingTable[NodeInfo] = RoutingTable(me.node_id)
    assert table.update(NodeInfo.create(client, "", "eu", client_mode=True)) is None
    assert client.node_id not in table and len(table) == 0
    assert table.update(NodeInfo.create(me, "http://127.0.0.1:1", "eu")) is None
    assert len(table) == 0
    assert table.update(NodeInfo.create(server, "http://127.0.0.1:2", "eu")) is None
    assert table.closest(0, 20) == [table.get(server.node_id)]


def test_newer_client_mode_info_removes_a_known_node_and_older_one_does_not():
    table = RoutingTable(SELF)
    table.update(Peer(SELF ^ 7, timestamp_ms=5))
    table.update(Peer(SELF ^ 7, client_mode=True, timestamp_ms=4))
    assert (SELF ^ 7) in table
    table.update(Peer(SELF ^ 7, client_mode=True, timestamp_ms=6))
    assert (SELF ^ 7) not in table


def test_older_contact_info_never_replaces_newer():
    table = RoutingTable(SELF)
    table.update(Peer(SELF ^ 7, timestamp_ms=5))
    table.update(Peer(SELF ^ 7, timestamp_ms=3))
    assert table.get(SELF ^ 7).timestamp_ms == 5
    table.update(Peer(SELF ^ 7, timestamp_ms=9))
    assert table.get(SELF ^ 7).timestamp_ms == 9


def test_stale_buckets_give_ids_inside_each_stale_bucket_range():
    clock = FakeClock()
    table = RoutingTable(SELF, clock=clock, rng=random.Random(3))
    assert table.stale_buckets(0) == []  # empty table: bootstrap, do not refresh
    for i in (150, 155, 159):
        table.update(in_bucket(i, 1)[0])
    clock.t += 3600
    table.update(in_bucket(155, 1, start=1)[0])  # a contact keeps its bucket fresh
    table.touch_bucket_for(SELF ^ (1 << 157))  # so does a lookup
    stale = table.stale_buckets(3600)
    assert sorted(bucket_index(SELF, t) for t in stale) == [i for i in range(150, 160) if i not in (155, 157)]
    clock.t += 10
    assert len(table.stale_buckets(3600)) == len(stale)  # asking again does not mark them fresh
    assert table.stale_buckets(1e9) == []


def test_closest_honours_n_and_exclude():
    table = RoutingTable(SELF)
    peers = in_bucket(20, 5)
    for p in peers:
        table.update(p)
    assert table.closest(SELF, 0) == []
    assert table.closest(SELF, 2) == peers[:2]
    assert table.closest(SELF, 10, exclude={peers[0].node_id}) == peers[1:]

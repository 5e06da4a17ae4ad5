"""Rendezvous ownership (docs/architecture.md §2): stable, deterministic, never a client-mode peer."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from diloco.coordinator.ownership import assignment, owners, roles_of, score
from diloco.coordinator.version import GENESIS, Version, is_newer
from diloco.protocol import canonical
from diloco.protocol.errors import Malformed

RUN = hashlib.sha256(b"test-run").digest()
P = 64


@dataclass(frozen=True)
class Member:
    peer_id: str
    client_mode: bool = False


def members(n: int, clients: int = 0) -> list[Member]:
    return [Member(f"peer-{i}") for i in range(n)] + [Member(f"client-{i}", True) for i in range(clients)]


def test_score_is_sha256_of_canonical_run_fragment_peer():
    expected = int.from_bytes(hashlib.sha256(canonical.packb([RUN, 3, "peer-1"])).digest(), "big")
    assert score(RUN, 3, "peer-1") == expected
    assert score(RUN, 3, "peer-1") != score(RUN, 4, "peer-1") != score(b"other", 4, "peer-1")


def test_owner_is_the_highest_score_then_replicas_in_score_order():
    ms = members(6)
    for p in range(8):
        ranked = sorted((m.peer_id for m in ms), key=lambda peer: score(RUN, p, peer), reverse=True)
        assert owners(RUN, p, ms, replicas=2) == ranked[:3]


def test_assignment_is_independent_of_member_order_and_duplicates():
    ms = members(7)
    assert assignment(RUN, P, ms) == assignment(RUN, P, list(reversed(ms)) + ms[:3])


def test_removing_a_member_moves_only_fragments_it_held_first():
    ms = members(8)
    before = assignment(RUN, P, ms, replicas=0)
    gone = ms[2].peer_id
    after = assignment(RUN, P, [m for m in ms if m.peer_id != gone], replicas=0)
    moved = {p for p in range(P) if before[p] != after[p]}
    assert moved == {p for p in range(P) if before[p] == [gone]}
    assert moved  # with 64 fragments and 8 peers it owned some


def test_when_an_owner_leaves_its_first_replica_takes_over():
    ms = members(8)
    before = assignment(RUN, P, ms, replicas=1)
    gone = ms[5].peer_id
    after = assignment(RUN, P, [m for m in ms if m.peer_id != gone], replicas=1)
    for p in range(P):
        if before[p][0] == gone:
            assert after[p][0] == before[p][1]
        else:
            assert after[p][0] == before[p][0]


def test_adding_a_member_moves_only_fragments_it_now_tops():
    ms = members(8)
    before = assignment(RUN, P, ms, replicas=0)
    newcomer = Member("peer-new")
    after = assignment(RUN, P, [*ms, newcomer], replicas=0)
    for p in range(P):
        assert after[p] == before[p] or after[p] == [newcomer.peer_id]


def test_client_mode_peers_never_own_or_replicate():
    ms = members(3, clients=5)
    for holders in assignment(RUN, P, ms, replicas=2):
        assert all(h.startswith("peer-") for h in holders)
    assert owners(RUN, 0, members(0, clients=3)) == []


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 12), replicas=st.integers(0, 4), p=st.integers(0, 1000))
def test_replicas_are_distinct_and_as_many_as_live_candidates_allow(n, replicas, p):
    holders = owners(RUN, p, members(n, clients=2), replicas=replicas)
    assert len(holders) == len(set(holders)) == min(n, 1 + replicas)


def test_ownership_spreads_over_members():
    counts: dict[str, int] = {}
    for holders in assignment(RUN, 400, members(4), replicas=0):
        counts[holders[0]] = counts.get(holders[0], 0) + 1
    assert len(counts) == 4 and min(counts.values()) > 60


def test_roles_of_lists_owned_and_replicated_fragments():
    table = assignment(RUN, P, members(5), replicas=1)
    roles = roles_of("peer-0", table)
    assert all(table[p][rank] == "peer-0" for p, rank in roles.items())
    assert set(roles) == {p for p in range(P) if "peer-0" in table[p]}


def test_negative_replicas_are_refused():
    with pytest.raises(ValueError):
        owners(RUN, 0, members(3), replicas=-1)


# Versions (coordinator/version.py): the ordering that makes failover safe. They live here, next to the
# takeover rule, because the brief allowed no separate test file.


def test_versions_order_by_term_then_version():
    assert Version(1, 0) > Version(0, 99)
    assert Version(2, 5) > Version(2, 4)
    assert is_newer(Version(0, 1), GENESIS) and not is_newer(Version(3, 3), Version(3, 3))


def test_takeover_outranks_anything_the_old_term_publishes():
    held = Version(4, 17)
    taken = held.takeover()
    assert taken == Version(5, 17) and is_newer(taken.next(), held.next().next())


def test_version_wire_form_round_trips_and_bad_ones_are_malformed():
    v = Version(3, 9)
    assert Version.from_wire(canonical.unpackb(canonical.packb(v.to_wire()))) == v
    for bad in ([1], [1, -1], [True, 2], ["1", 2], [1, 2**63], None):
        with pytest.raises(Malformed):
            Version.from_wire(bad)

"""Only the peer that may own a fragment publishes it: a correctly signed update, certificate or replication
from any other member is refused with 403 and changes nothing (coordinator/authority.py)."""

from __future__ import annotations

import time

import pytest
import torch

from diloco.coordinator.authority import (
    TERM_BLOCKS_AHEAD,
    TERM_MAX,
    TERM_SLOTS,
    Unauthorized,
    check_replication,
    check_term,
    check_update,
    next_term,
    term_slot,
)
from diloco.coordinator.version import Version
from diloco.coordinator.wire import (
    REPLICATE,
    ROUTE_REPLICATE,
    ROUTE_UPDATE,
    UPDATE,
    ReplicateFields,
    UpdateFields,
    anchor_digest,
    momentum_digest,
)
from diloco.protocol.codecs import get_codec
from diloco.protocol.envelope import join_bytes, seal
from diloco.protocol.identity import Identity

from .hostile import post
from .swarm_utils import LocalLearner, tiny_run, wait_until

ALICE, MALLORY = Identity.generate().peer_id, Identity.generate().peer_id


def own_term(peer: str, block: int = 1) -> int:
    return block * TERM_SLOTS + term_slot(peer)


def owner_is(*peers: str):
    return lambda p, peer: peer in peers


def test_a_term_belongs_to_the_slot_of_the_peer_that_took_the_fragment_over():
    check_term(own_term(ALICE), ALICE)
    for term in (own_term(ALICE), 0, TERM_MAX + term_slot(MALLORY)):
        with pytest.raises(Unauthorized):
            check_term(term, MALLORY)
    assert next_term(own_term(ALICE, 5), MALLORY) == own_term(MALLORY, 6)
    with pytest.raises(ValueError):
        next_term(TERM_MAX, ALICE)


def test_an_update_is_one_step_a_bounded_takeover_and_a_new_term_only_from_an_owner_or_replica():
    base = Version(own_term(ALICE), 7)
    live = owner_is(ALICE)
    check_update(0, base, base.next(), ALICE, live, lambda _: True, pushed=True)  # the owner's next version
    takeover = Version(own_term(MALLORY, 2), 8)
    check_update(0, base, takeover, MALLORY, owner_is(ALICE, MALLORY), lambda _: True, pushed=True)
    refused = [
        (base, Version(base.term, 9), ALICE, True),  # two steps at once
        (base, Version((1 + TERM_BLOCKS_AHEAD + 1) * TERM_SLOTS + term_slot(ALICE), 8), ALICE, True),
        (base, takeover, MALLORY, True),  # a takeover pushed by a member that may not own p here
        (base, Version(base.term, 8), MALLORY, True),  # in Alice's term
        (base, Version(2**63 - 1, 8), MALLORY, True),
    ]
    for b, new, signer, pushed in refused:
        with pytest.raises(Unauthorized):
            check_update(0, b, new, signer, live, lambda _: True, pushed)
    # fetched from a holder: a takeover by a publisher that has since left is history, not an attack
    check_update(0, base, takeover, MALLORY, live, lambda _: False, pushed=False)
    with pytest.raises(Unauthorized):
        check_update(0, base, takeover, MALLORY, live, lambda _: True, pushed=False)


def test_a_replication_comes_from_the_owner_in_its_own_term_or_is_a_hand_over_of_its_own_version():
    term = own_term(ALICE, 2)
    check_replication(0, term, Version(term, 4), False, ALICE, owner_is(ALICE))
    check_replication(0, term, Version(term, 4), True, ALICE, owner_is())  # hand-over after losing p
    for args in [(term, Version(term, 4), False, MALLORY, owner_is(ALICE, MALLORY)),  # Alice's term
                 (term, Version(term, 4), False, ALICE, owner_is()),  # not an owner, not a hand-over
                 (own_term(ALICE, 1), Version(term, 4), True, ALICE, owner_is(ALICE)),  # label above the term
                 (own_term(ALICE, 3 + TERM_BLOCKS_AHEAD), Version(term, 4), False, ALICE, owner_is(ALICE))]:
        with pytest.raises(Unauthorized):
            check_replication(0, *args)


@pytest.fixture
def swarm():
    genesis = tiny_run(quorum=2)
    nodes = []
    try:
        a = LocalLearner(genesis, 0).start()
        nodes.append(a)
        nodes += [LocalLearner(genesis, i, [a.url]).start() for i in (1, 2)]
        wait_until(lambda: all(len(n.learner.swarm.members.live()) == 3 for n in nodes), 30, "3 live members")
        wait_until(lambda: all(n.learner.swarm.members.roles(0)[0] == nodes[0].learner.swarm.members.roles(0)[0]
                               for n in nodes), 10, "one owner of fragment 0 everywhere")
        yield genesis, nodes
    finally:
        for n in nodes:
            n.learner.close()


def test_a_member_that_may_not_own_a_fragment_cannot_publish_or_replicate_it(swarm):
    """Three learners; the one that is neither owner nor replica of a fragment signs a well-formed update of
    it (in a term of its own, in the owner's term, and at the largest term) and a replication with a huge
    term: every one is refused with 403 at the owner's replica, and its label and terms are unchanged."""
    genesis, nodes = swarm
    spec = genesis.spec
    members = nodes[0].learner.swarm.members
    p = 0
    owner, replica = members.roles(p)
    target = next(n for n in nodes if n.learner.swarm.identity.peer_id == replica)
    mallory = next(n for n in nodes if n.learner.swarm.identity.peer_id not in (owner, replica))
    key = mallory.learner.swarm.identity
    store = target.learner.swarm.store
    for _ in range(3):
        for n in nodes:
            n.train(10)
    wait_until(lambda: store.label(p).term > 0, 30, "a first version of the fragment")
    # no training from here on: once the rounds already under way are published, nothing else moves p
    seen = {"labels": None, "since": 0.0}

    def quiet() -> bool:
        labels = [list(n.learner.labels) for n in nodes]
        if labels != seen["labels"]:
            seen["labels"], seen["since"] = labels, time.monotonic()
        return all(x == labels[0] for x in labels) and time.monotonic() - seen["since"] >= 3.0

    wait_until(quiet, 40, "the same versions at every learner, unchanged for 3 s")
    base = store.label(p)
    anchor = store.read(p)[0].clone()
    move = torch.full_like(anchor, 1000.0)
    int8 = get_codec("int8")
    meta, payload = int8.encode(move)
    digest = anchor_digest(anchor + int8.decode(meta, payload))

    def update(new: Version) -> bytes:
        fields = UpdateFields(p, base, new, digest, meta, (key.peer_id,)).to_fields()
        return seal(key, UPDATE, spec.run_id, fields, payload).to_bytes()

    forged = [Version(next_term(base.term, key.peer_id), base.version + 1),  # a takeover of its own
              base.next(),  # in the owner's term
              Version(2**63 - 1, 2**63 - 1)]
    for new in forged:
        assert post(target.url, ROUTE_UPDATE, update(new)) == 403, new
    terms_before = target.learner.swarm.shard.replication.terms_seen[p]
    fields = ReplicateFields(p, 2**63 - 1, Version(2**63 - 1, base.version + 1), False, 0, None).to_fields()
    assert post(target.url, ROUTE_REPLICATE, seal(key, REPLICATE, spec.run_id, fields, join_bytes()).to_bytes()) \
        == 403
    assert store.label(p) == base and torch.equal(store.read(p)[0], anchor)
    assert target.learner.swarm.shard.replication.terms_seen[p] == terms_before
    stats = target.learner.swarm.sync.stats
    assert stats["updates_unauthorized"] == len(forged)
    # the real owner still publishes, and everyone follows it
    for _ in range(3):
        for n in nodes:
            n.train(10)
    wait_until(lambda: all(n.learner.swarm.store.label(p) > base for n in nodes), 30, "the owner's next version")
    assert all(n.learner.swarm.store.label(p).term % TERM_SLOTS == term_slot(owner) for n in nodes)


def test_a_takeover_published_while_this_peer_was_away_may_be_fetched_or_handed_back_but_not_pushed():
    """A peer that comes back (a restart, a partition) finds p taken over while it was away by the member next
    in line, who may still be live and, now that this peer is back, neither owner nor replica here. Its
    version must be reachable by catch-up, or this peer, owner again, publishes the same version number over it
    and the deltas merged into it are lost (a chaos sweep's fork); pushed, it is still refused."""
    import collections
    from types import SimpleNamespace

    from diloco.coordinator.membership import Member, Membership
    from diloco.coordinator.ownership import owners
    from diloco.coordinator.replication import Replication
    from diloco.coordinator.sync import FragmentSync
    from diloco.coordinator.wire import MemberRecord

    spec = tiny_run().spec
    me, others = Identity.generate(), {i.peer_id: i for i in (Identity.generate() for _ in range(3))}
    record = MemberRecord("http://127.0.0.1:1", "", False, 0, 0.0, 0.0, True)
    members = Membership(SimpleNamespace(identity=me), spec, lambda: record)
    members.members = {peer: Member(peer, record, time.time() + 60) for peer in others}
    roles = 1 + spec.replicas
    p = next(p for p in range(10_000)  # a fragment where this peer holds a role: the next in line stands in
             if me.peer_id in owners(spec.run_id, p, members._unexpired(suspects=True), spec.replicas))
    ranked = owners(spec.run_id, p, members._unexpired(suspects=True), len(others))
    stand_in, outsider = ranked[roles], ranked[roles + 1]
    assert not members.may_own(p, stand_in) and members.may_have_owned(p, stand_in)
    assert not members.may_have_owned(p, outsider)
    sync = SimpleNamespace(members=members, stats=collections.Counter())

    def authorize(signer: str, pushed: bool) -> None:
        f = SimpleNamespace(p=p, base=Version(own_term(ALICE), 7), new=Version(own_term(signer, 2), 8))
        FragmentSync.authorize(sync, f, others[signer].public_key, pushed)

    authorize(stand_in, pushed=False)  # fetched from a holder: reachable
    for signer, pushed in ((stand_in, True), (outsider, False)):  # pushed by it; or nobody's owner here
        with pytest.raises(Unauthorized):
            authorize(signer, pushed)
    assert sync.stats["updates_unauthorized"] == 2

    # its state handed back (a full replicate, in the term it took p over in, of the version it held): kept;
    # a plain replication from it, or a hand-over from the member after it, is not
    replication = SimpleNamespace(members=members, stats=collections.Counter())

    def replicate(signer: str, full: bool) -> None:
        term = own_term(signer, 2)
        f = SimpleNamespace(p=p, term=term, label=Version(own_term(ALICE), 7) if full else Version(term, 8),
                            full=full)
        Replication.authorize(replication, f, others[signer].public_key)

    replicate(stand_in, full=True)
    for signer, full in ((stand_in, False), (outsider, True)):
        with pytest.raises(Unauthorized):
            replicate(signer, full)
    assert replication.stats["replications_unauthorized"] == 2


def test_a_replication_whose_trailer_does_not_hold_together_is_refused_and_changes_nothing(swarm):
    """A `replicate`'s update and delta frames follow its frame, outside its signature (docs/protocol.md
    §7.6): each is checked on its own, and bound to the signed header by its lengths, its signer, fragment
    and version, and the momentum by `mdigest`. Signed by the owner itself, a replication whose trailer is
    short, whose update is of another version, or whose `mdigest` is not its payload's, answers 400 at the
    replica, which keeps what it held."""
    genesis, nodes = swarm
    spec, p = genesis.spec, 0
    roles = nodes[0].learner.swarm.members.roles(p)
    by_id = {n.learner.swarm.identity.peer_id: n for n in nodes}
    owner, replica = by_id[roles[0]], by_id[roles[1]]
    key = owner.learner.swarm.identity
    wait_until(lambda: p in owner.learner.swarm.shard.owners, 10, "the owner's ownership of fragment 0")
    term = owner.learner.swarm.shard.owners[p].term
    store, replication = replica.learner.swarm.store, replica.learner.swarm.shard.replication
    base = store.label(p)
    anchor = store.read(p)[0].clone()
    int8 = get_codec("int8")
    meta, payload = int8.encode(torch.full_like(anchor, 1e-3))
    mmeta, mbytes = int8.encode(torch.zeros_like(anchor))
    new = Version(term, base.version + 1)
    update = seal(key, UPDATE, spec.run_id, UpdateFields(p, base, new, anchor_digest(anchor + int8.decode(meta, payload)),
                                                         meta, (key.peer_id,)).to_fields(), payload).to_bytes()

    def replicate(label: Version, trailer: bytes, mdigest: bytes | None = None, update_len: int | None = None):
        fields = ReplicateFields(p, term, label, False, len(update) if update_len is None else update_len, mmeta,
                                 (), mdigest or momentum_digest(mbytes)).to_fields()
        return seal(key, REPLICATE, spec.run_id, fields, mbytes).to_bytes() + trailer

    kept = replication.kept.get(p)
    cases = {
        "short": replicate(new, update[:-1]),  # (the body ends before the trailer its fields announce)
        "long": replicate(new, update, update_len=len(update) - 1),
        "another version": replicate(Version(term, base.version + 2), update),
        "mdigest": replicate(new, update, mdigest=bytes(32)),
    }
    for name, body in cases.items():
        assert post(replica.url, ROUTE_REPLICATE, body) == 400, name
    assert store.label(p) == base and torch.equal(store.read(p)[0], anchor)
    assert replication.kept.get(p) is kept and replication.stats["replications_received"] == 0
    # the same replication, whole: held (the frames are the owner's own and fill the trailer)
    assert post(replica.url, ROUTE_REPLICATE, replicate(new, update)) == 200
    assert store.label(p) == new and replication.kept[p][0] == new and replication.stats["replications_received"] == 1

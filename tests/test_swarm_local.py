"""Learners in one process (one swarm thread each): the fragment protocol end to end, fast."""

import pytest

from diloco.coordinator.fragments import anchor_digest

from .swarm_utils import LocalLearner, tiny_run, wait_until


@pytest.fixture
def fleet():
    started: list[LocalLearner] = []

    def make(genesis, n, **cfg):
        first = LocalLearner(genesis, 0, **cfg).start()
        started.append(first)
        for i in range(1, n):
            started.append(LocalLearner(genesis, i, peers=[first.url], **cfg).start())
        return started

    yield make
    for ll in started:
        ll.learner.close()


@pytest.mark.timeout(120)
def test_learners_and_owners_hold_bit_identical_fragments(fleet):
    genesis = tiny_run()
    learners = fleet(genesis, 3)
    wait_until(lambda: all(len(ll.learner.swarm.members.live()) == 3 for ll in learners), 20, "3 live members")
    for _ in range(6):
        for ll in learners:
            ll.train(10)
    P = genesis.spec.fragments

    def settled() -> bool:
        labels = [ll.learner.labels for ll in learners]
        return all(lab == labels[0] for lab in labels) and all(v.version > 0 for v in labels[0])

    wait_until(settled, 30, "every learner to hold the same version of every fragment")
    for p in range(P):
        digests = {anchor_digest(ll.learner.swarm.store.held[p].anchor) for ll in learners}
        assert len(digests) == 1, f"fragment {p} differs between learners"
    owners = sum(len(ll.learner.swarm.shard.owners) for ll in learners)
    assert owners == P, "every fragment has exactly one owner"

"""The watch: a learner that missed versions catches up from the members' GET /v1/versions, without reading
the DHT at every round (its frag records are read every DHT_WATCH_EVERY-th watch only)."""

from __future__ import annotations

import pytest

from diloco.node import swarm as swarm_mod

from .swarm_utils import LocalLearner, tiny_run, wait_until


@pytest.mark.timeout(120)
def test_a_learner_that_missed_the_pushes_catches_up_from_the_members_versions(monkeypatch):
    monkeypatch.setattr(swarm_mod, "DHT_WATCH_EVERY", 10_000)  # the DHT's frag records: never in this test
    genesis = tiny_run(fragments=2, quorum=1)
    first = LocalLearner(genesis, 0).start()
    deaf = LocalLearner(genesis, 1, peers=[first.url]).start()  # never trains: it sends no delta (no 409)
    try:
        wait_until(lambda: all(len(ll.learner.swarm.members.live()) == 2 for ll in (first, deaf)), 20,
                   "2 live members")
        read_dht = []

        async def newest_versions():
            read_dht.append(1)
            return [None] * len(deaf.learner.swarm.store)

        deaf.learner.swarm.sync.newest_versions = newest_versions
        deaf_id = deaf.learner.swarm.identity.peer_id
        for ll in (first, deaf):  # every push to the deaf learner is lost on the way
            shard = ll.learner.swarm.shard
            shard._push = lambda env, exclude, push=shard._push: push(env, exclude | {deaf_id})
        first.train(40)
        wait_until(lambda: all(v.version >= 2 for v in first.learner.labels), 30, "versions at the first learner")
        target = first.learner.labels
        wait_until(lambda: all(b >= a for a, b in zip(target, deaf.learner.labels, strict=True)), 20,
                   "the deaf learner to catch up through the watch")
        assert not read_dht, "the watch read the DHT's frag records"
    finally:
        for ll in (first, deaf):
            ll.learner.close()

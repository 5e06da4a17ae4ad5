"""A restarted learner finds its swarm again, and a swarm split in two becomes one (docs/architecture.md §5.6).

The chaos sweep's seed 6 saw two learners killed together come back with only each other's URLs as `--peers`:
they made a DHT of their own, and both halves published the same version numbers under different terms. A
checkpoint now remembers the members' URLs, and a peer pings the members it saw that are no longer in its view.
"""

from __future__ import annotations

import contextlib
import socket

import pytest

from diloco.node import swarm as swarm_module
from diloco.node.checkpoint import load_latest
from diloco.protocol.identity import Identity

from .swarm_utils import LocalLearner, tiny_run, wait_until


@pytest.fixture
def learners():
    made: list[LocalLearner] = []
    yield made
    for n in made:
        if n.learner.swarm is not None:
            n.learner.swarm.stop()


def _free_port() -> int:
    with contextlib.closing(socket.socket()) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _live(n: LocalLearner) -> set[str]:
    return {m.peer_id for m in n.learner.swarm.members.live()}


@pytest.mark.timeout(120)
def test_a_learner_restarted_without_peers_finds_the_swarm_its_checkpoint_remembers(tmp_path, learners):
    genesis = tiny_run(quorum=2)
    key = Identity.generate()
    a = LocalLearner(genesis, 0).start()
    b = LocalLearner(genesis, 1, [a.url]).start()
    c = LocalLearner(genesis, 2, [a.url], learner_kw={"identity": key, "checkpoint_dir": tmp_path}).start()
    learners += [a, b, c]
    wait_until(lambda: all(len(_live(n)) == 3 for n in (a, b, c)), 20, "3 live members")
    c.learner.save_checkpoint(wait=True)
    assert set(load_latest(tmp_path).meta["peers"]) == {a.url, b.url}
    c.learner.swarm.stop()
    back = LocalLearner(genesis, 2, [], learner_kw={"identity": key, "checkpoint_dir": tmp_path}).start()
    learners.append(back)
    ids = {n.learner.swarm.identity.peer_id for n in (a, b)}
    wait_until(lambda: ids <= _live(back), 20, "the restarted learner sees the others")
    for _ in range(3):
        for n in (a, b, back):
            n.train(10)
    wait_until(lambda: back.learner.labels == a.learner.labels and any(v.version for v in a.learner.labels), 30,
               "one swarm: the same versions everywhere")


@pytest.mark.timeout(120)
def test_two_halves_of_a_split_swarm_find_each_other_again(tmp_path, learners, monkeypatch):
    """B starts alone, remembering a URL where nobody listens yet; A then opens the same run there, alone. Two
    swarms of one run, until B's next watch pings the URL it remembers."""
    monkeypatch.setattr(swarm_module, "DHT_WATCH_EVERY", 1)
    genesis = tiny_run(quorum=1)
    port = _free_port()
    b = LocalLearner(genesis, 1, [], known_peers=[f"http://127.0.0.1:{port}"]).start()
    learners.append(b)
    a = LocalLearner(genesis, 0, [], port=port).start()
    learners.append(a)
    assert len(_live(a)) == 1 and a.url == f"http://127.0.0.1:{port}"
    wait_until(lambda: len(_live(a)) == 2 and len(_live(b)) == 2, 20, "both halves see each other")

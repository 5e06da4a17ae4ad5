"""The synchronous baseline in the same code (docs/architecture.md §10): strict quorum, learners wait for merges."""

import threading

import pytest

from diloco.coordinator.grace import QuorumTracker
from diloco.node.learner import SyncTimeout
from diloco.protocol.errors import Malformed

from .swarm_utils import LocalLearner, tiny_run, wait_until


def test_strict_quorum_never_steps_below_k_even_when_every_live_learner_reported():
    now = [0.0]
    loose = QuorumTracker(["a", "b"], K=3, gamma=0, tau=0, cap_s=0, clock=lambda: now[0])
    strict = QuorumTracker(["a", "b"], K=3, gamma=0, tau=0, cap_s=0, clock=lambda: now[0], strict=True)
    for t in (loose, strict):
        t.add("a")
        t.add("b")
    assert loose.ready() and not strict.ready()
    strict.add("c")
    assert strict.ready()


def test_a_synchronous_spec_has_no_grace_window():
    with pytest.raises(Malformed, match="grace"):
        tiny_run(synchronous=True, quorum=3)
    tiny_run(synchronous=True, quorum=3, grace_gamma=0.0, grace_cap_s=0.0)


def _start_together(genesis) -> list[LocalLearner]:
    """A synchronous run starts once all its learners are in (a rendezvous): start them concurrently."""
    learners = [LocalLearner(genesis, 0)]
    threads = [threading.Thread(target=learners[0].start)]
    threads[0].start()
    wait_until(lambda: learners[0].learner.swarm is not None and learners[0].learner.swarm.url, 30,
               "the first learner's server")
    for i in (1, 2):
        learners.append(LocalLearner(genesis, i, peers=[learners[0].url]))
        threads.append(threading.Thread(target=learners[-1].start))
        threads[-1].start()
    for t in threads:
        t.join(60)
    assert all(ll.learner.swarm is not None and ll.learner.swarm.progress.synced for ll in learners)
    return learners


def _train_in_threads(learners: list[LocalLearner], steps: int) -> list[BaseException]:
    errors: list[BaseException] = []

    def run(ll: LocalLearner) -> None:
        try:
            ll.train(steps)
        except BaseException as e:  # noqa: BLE001 - reported to the test
            errors.append(e)

    threads = [threading.Thread(target=run, args=(ll,)) for ll in learners]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    assert not any(t.is_alive() for t in threads), "a synchronous learner hung past its deadline"
    return errors


@pytest.mark.timeout(120)
def test_synchronous_learners_merge_every_delta_and_checkpoint_the_same_versions(tmp_path):
    genesis = tiny_run(synchronous=True, quorum=3, grace_gamma=0.0, grace_cap_s=0.0, inner_steps=8)
    learners = _start_together(genesis)
    try:
        wait_until(lambda: all(len(ll.learner.swarm.members.live()) == 3 for ll in learners), 20, "3 live members")
        for i, ll in enumerate(learners):
            ll.learner.checkpoint_dir, ll.learner.checkpoint_every = tmp_path / str(i), 16
        assert not _train_in_threads(learners, 40)
        P, H = genesis.spec.fragments, genesis.spec.inner_steps
        for ll in learners:
            # every delta sent before the last round of each fragment was merged, with all three learners in it
            assert ll.learner.swarm.store.merged_steps >= P * (40 - H)
        from diloco.node.checkpoint import load_latest

        ckpts = [load_latest(tmp_path / str(i)) for i in range(3)]
        assert {c.step for c in ckpts} == {32}
        assert ckpts[0].labels == ckpts[1].labels == ckpts[2].labels, "the barrier checkpoints one global state"
        assert all(c.counters["merged_steps"] > 0 for c in ckpts)
    finally:
        for ll in learners:
            ll.learner.close()


@pytest.mark.timeout(120)
def test_a_missing_learner_stalls_the_synchronous_round_until_its_deadline():
    genesis = tiny_run(synchronous=True, quorum=3, grace_gamma=0.0, grace_cap_s=0.0, inner_steps=8)
    learners = _start_together(genesis)
    try:
        wait_until(lambda: all(len(ll.learner.swarm.members.live()) == 3 for ll in learners), 20, "3 live members")
        for ll in learners[:2]:
            ll.learner.sync_timeout_s = 3.0
        errors = _train_in_threads(learners[:2], 20)  # the third learner never trains
        assert len(errors) == 2 and all(isinstance(e, SyncTimeout) for e in errors)
        assert "restart every learner from its last checkpoint" in str(errors[0])
    finally:
        for ll in learners:
            ll.learner.close()

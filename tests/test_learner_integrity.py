"""The learner's side of every round: what a step applies to θ, and a background loop that dies."""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from diloco.coordinator.buffers import BufferPool
from diloco.coordinator.fragments import FragmentStore
from diloco.coordinator.version import Version
from diloco.node.learner import Learner
from diloco.node.swarm import SwarmFailed
from diloco.node.theta import Theta
from diloco.node.train import task_of

from .swarm_utils import LocalLearner, tiny_run, wait_until


def offline_learner(fragments: int = 2) -> tuple[Learner, FragmentStore]:
    """A learner whose store is real and whose network is absent: the step boundary on its own."""
    genesis = tiny_run(fragments=fragments)
    task = task_of(genesis.spec)
    model = task.build_model()
    learner = Learner(model, task.optimizer(model), genesis)
    anchors = [learner.plan.flatten(p, learner.params) for p in range(fragments)]
    store = FragmentStore(anchors, "me")
    pool = BufferPool(max(a.numel() for a in anchors))
    learner.swarm = SimpleNamespace(store=store, pool=pool)
    learner.theta = Theta(store, learner.plan, learner.params, pool, learner._submit, learner._overwritten)
    return learner, store


def test_an_update_landing_while_an_installed_fragment_is_copied_into_theta_is_applied_once():
    learner, store = offline_learner()
    p, numel = 0, store.numel(0)
    installed = torch.randn(numel)
    store.install(p, installed, Version(1, 1), b"cert")
    update = torch.full((numel,), 0.5)
    take = store.take_changes

    def an_update_lands_right_after(*args, **kwargs):
        changes = take(*args, **kwargs)
        # the event loop applies the next version here, between taking the changes and anything after it
        store.advance(p, Version(1, 1), Version(1, 2), update.clone(), b"f", b"c")
        return changes

    store.take_changes = an_update_lands_right_after
    learner._apply_new_versions()
    store.take_changes = take
    learner._apply_new_versions()
    theta = learner.plan.flatten(p, learner.params)
    assert torch.equal(theta, installed + update), "θ got the update twice (in the copy and as a move)"
    assert learner.base[p] == Version(1, 2)


@pytest.fixture
def alone():
    started: list[LocalLearner] = []

    def make() -> LocalLearner:
        ll = LocalLearner(tiny_run(), 0).start()
        started.append(ll)
        return ll

    yield make
    for ll in started:
        ll.learner.close()


@pytest.mark.timeout(60)
def test_a_background_loop_stopped_from_outside_is_reported_by_the_next_step(alone):
    ll = alone()
    ll.train(3)
    assert ll.learner.healthy and ll.learner.error is None
    loop = ll.learner.swarm._loop
    loop.call_soon_threadsafe(loop.stop)  # the loop dies under the learner
    wait_until(lambda: not ll.learner.healthy, 10, "the learner to notice its loop is gone")
    with pytest.raises(SwarmFailed, match="swarm loop died"):
        ll.train(1)
    assert ll.learner.error is not None


@pytest.mark.timeout(60)
def test_a_background_task_that_crashes_is_reported_by_the_next_step_with_its_cause(alone):
    ll = alone()
    swarm = ll.learner.swarm

    async def broken(*args, **kwargs):
        raise ValueError("a bug in the watch")

    # the watch loop raises at its next round (watch_s = 1 s), whichever way it reads the versions
    swarm.sync.newest_versions = swarm.sync.held_above = broken
    wait_until(lambda: swarm.error is not None, 10, "the crash of the watch loop to be recorded")
    with pytest.raises(SwarmFailed, match="_watch.*ValueError: a bug in the watch") as raised:
        ll.train(1)
    assert isinstance(raised.value.__cause__, ValueError)
    assert ll.learner.status()["healthy"] is False and "a bug in the watch" in ll.learner.status()["error"]


@pytest.fixture
def pair():
    started: list[LocalLearner] = []

    def make() -> list[LocalLearner]:
        genesis = tiny_run(fragments=2, quorum=2)
        first = LocalLearner(genesis, 0).start()
        started.append(first)
        started.append(LocalLearner(genesis, 1, peers=[first.url]).start())
        wait_until(lambda: all(len(ll.learner.swarm.members.live()) == 2 for ll in started), 20, "2 live members")
        return started

    yield make
    for ll in started:
        ll.learner.close()


def _slowest_step_s(learners: list[LocalLearner], steps: int) -> float:
    worst = 0.0
    for _ in range(steps):
        for ll in learners:
            t0 = time.monotonic()
            ll.train(1)
            worst = max(worst, time.monotonic() - t0)
    return worst


@pytest.mark.timeout(120)
def test_no_step_waits_while_a_holder_hashes_an_update(pair, monkeypatch):
    from diloco.coordinator import replication, shard, sync, wire

    learners = pair()
    real = wire.anchor_digest
    armed, inside, release = threading.Event(), threading.Event(), threading.Event()

    def slow_digest(anchor):  # a hash that takes 8 s (a huge fragment), wherever a holder checks one
        if armed.is_set():
            inside.set()
            release.wait(8)
        return real(anchor)

    for module in (sync, replication, shard):
        monkeypatch.setattr(module, "anchor_digest", slow_digest)
    _slowest_step_s(learners, 10)
    armed.set()
    try:
        deadline = time.monotonic() + 60
        while not inside.is_set() and time.monotonic() < deadline:
            _slowest_step_s(learners, 1)
        assert inside.is_set(), "no holder checked an update's digest"
        worst = _slowest_step_s(learners, 20)  # hashes keep stalling meanwhile (each 8 s)
    finally:
        release.set()
    assert worst < 1.0, f"a step waited {worst:.2f} s on a holder's hash"


@pytest.mark.timeout(120)
def test_no_step_waits_for_an_owner_that_answers_after_5_s(pair, monkeypatch):
    from diloco.coordinator.shard import Shard

    accept = Shard._on_delta

    async def slow(self, env, request):
        await asyncio.sleep(5.0)  # an owner far away, or busy: every delta it takes is answered after 5 s
        return await accept(self, env, request)

    monkeypatch.setattr(Shard, "_on_delta", slow)  # (before the learners: their routes bind it)
    learners = pair()
    worst = _slowest_step_s(learners, 40)  # 4 sends of each fragment by each learner
    sent = sum(ll.learner.swarm.sync.stats["deltas_sent"] for ll in learners)
    assert sent >= 4, "no delta went through the slow owner"
    assert worst < 1.0, f"a step waited {worst:.2f} s on a slow owner"


@pytest.mark.skipif(not hasattr(__import__("os"), "setpriority"), reason="per-thread nice is Linux's")
def test_the_swarms_worker_threads_run_below_the_training_threads_priority_and_its_loop_does_not(alone):
    import os

    from diloco.node.niceness import BACKGROUND_NICE

    ll = alone()
    mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    ll.train(12)  # (θ's threads and the loop's workers have work by now)
    named = {t.name: t for t in threading.enumerate() if t.native_id}
    assert {"diloco-swarm", "diloco-theta", "diloco-theta-copy"} <= set(named), sorted(named)
    workers = [t for name, t in named.items() if name.startswith("swarm-worker_")]
    assert workers, sorted(named)
    for t in [named["diloco-theta"], named["diloco-theta-copy"], *workers]:
        assert os.getpriority(os.PRIO_PROCESS, t.native_id) == min(19, mine + BACKGROUND_NICE), t.name
    # (the loop holds the GIL while it runs: preempted, it would hold the training thread up with it)
    assert os.getpriority(os.PRIO_PROCESS, named["diloco-swarm"].native_id) == mine, "the event loop is untouched"
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == mine, "the training thread is untouched"

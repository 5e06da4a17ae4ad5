"""Quorum and adaptive grace window (docs/architecture.md §6.1), on a fake clock."""

from __future__ import annotations

import pytest

from diloco.coordinator.grace import Ewma, QuorumTracker, grace_window


class FakeClock:
    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def tracker(expected=("a", "b", "c", "d"), K=2, gamma=0.5, tau=10.0, cap_s=30.0, step_s=1.0, sync_s=2.0):
    clock = FakeClock()
    t = QuorumTracker(set(expected), K, gamma, tau, cap_s, clock)
    if step_s is not None:
        t.observe_step_time(step_s)
    if sync_s is not None:
        t.observe_sync_time(sync_s)
    return t, clock


def test_grace_is_gamma_times_overlap_budget_left_after_quorum_and_sync():
    # ξ_grace = clip(γ·(τ·ξ_step − (ξ_quorum + ξ_sync)), 0, cap)
    window = grace_window(step_s=1.0, quorum_s=3.0, sync_s=2.0, gamma=0.5, tau=10.0, cap_s=30.0)
    assert window == 0.5 * (10 * 1.0 - (3.0 + 2.0))
    assert grace_window(1.0, 9.0, 2.0, 0.5, 10.0, 30.0) == 0.0  # budget spent: clipped at 0
    assert grace_window(10.0, 0.0, 0.0, 1.0, 10.0, 30.0) == 30.0  # clipped at the cap


def test_ewma_starts_at_first_sample_then_moves_by_alpha():
    e = Ewma(alpha=0.25)
    assert e.value is None
    assert e.update(8.0) == 8.0
    assert e.update(4.0) == 8.0 * 0.75 + 4.0 * 0.25


def test_not_ready_before_quorum_and_no_deadline():
    t, clock = tracker()
    t.add("a")
    clock.advance(1000)
    assert not t.ready() and t.deadline() is None


def test_ready_when_grace_window_after_quorum_has_passed():
    t, clock = tracker()  # ξ_step 1, ξ_sync 2, γ 0.5, τ 10
    t.add("a")
    clock.advance(3.0)
    t.add("b")  # quorum after ξ_quorum = 3 → window 0.5·(10 − 5) = 2.5
    assert t.quorum_wait == 3.0 and t.grace_s == 2.5
    assert t.deadline() == clock.now + 2.5
    assert not t.ready()
    clock.advance(2.4)
    assert not t.ready()
    clock.advance(0.1)
    assert t.ready()


def test_ready_at_once_when_every_live_learner_reported():
    t, clock = tracker(expected=("a", "b", "c"), K=2)
    for learner in ("a", "b"):
        t.add(learner)
        clock.advance(0.5)
    assert not t.ready()
    t.add("c")
    assert t.ready() and t.deadline() == clock.now


def test_slow_quorum_leaves_no_grace():
    t, clock = tracker(K=2)
    t.add("a")
    clock.advance(20.0)  # longer than τ·ξ_step
    t.add("b")
    assert t.grace_s == 0.0 and t.ready()


def test_duplicates_do_not_count_toward_quorum():
    t, _ = tracker(K=2)
    assert t.add("a") and not t.add("a")
    assert t.quorum_at is None and t.deadline() is None


def test_learners_outside_the_expected_set_count_toward_quorum():
    t, _ = tracker(expected=("a",), K=2, step_s=None)
    t.add("new-1")
    t.add("new-2")
    assert t.ready()  # no ξ_step yet: window 0


def test_window_is_zero_until_step_time_is_observed():
    t, _ = tracker(step_s=None, sync_s=None)
    t.add("a")
    t.add("b")
    assert t.grace_s == 0.0 and t.ready()


def test_a_learner_leaving_can_complete_the_round():
    t, clock = tracker(expected=("a", "b", "c"), K=3)
    t.add("a")
    t.add("b")
    assert t.deadline() is None
    clock.advance(1.0)
    t.set_expected({"a", "b"})  # c's member record expired
    assert t.ready() and t.deadline() == clock.now


def test_a_learner_joining_waits_for_the_window_again():
    t, _ = tracker(expected=("a", "b"), K=2)
    t.add("a")
    t.add("b")
    assert t.ready()
    t.set_expected({"a", "b", "c"})
    assert t.deadline() == t.quorum_at + t.grace_s


def test_no_expected_learners_never_counts_as_everyone_reported():
    t, _ = tracker(expected=(), K=2)
    t.add("a")
    assert not t.ready()


def test_reset_starts_a_new_round_and_keeps_the_estimates():
    t, _ = tracker()
    t.add("a")
    t.add("b")
    t.reset()
    assert t.reported == set() and t.deadline() is None and t.quorum_wait is None
    assert t.step_time.value == 1.0 and t.sync_time.value == 2.0


def test_window_is_fixed_when_quorum_is_reached():
    t, clock = tracker()
    t.add("a")
    t.add("b")  # window 0.5·(10 − 2) = 4
    t.observe_step_time(100.0)
    assert t.grace_s == 4.0 and t.deadline() == clock.now + 4.0


def test_bad_parameters_are_refused():
    with pytest.raises(ValueError):
        QuorumTracker({"a"}, 0, 0.5, 1.0, 1.0)
    with pytest.raises(ValueError):
        QuorumTracker({"a"}, 1, -0.5, 1.0, 1.0)

"""Goodput accounting and the swarm invariants on hand-made incarnation logs (docs/architecture.md §10)."""

import pytest

from diloco.node import goodput as gp
from diloco.node.chaos import fault_schedule
from diloco.node.goodput import Incarnation


def inc(slot, launched, joined, start, last, epoch=0, accepted=(), tokens=(0, 0)):
    return Incarnation(slot, launched, epoch=epoch, joined_at=joined, start_merged=start, last_merged=last,
                       start_tokens=tokens[0], last_tokens=tokens[1], accepted=list(accepted))


def test_decoupled_goodput_counts_what_every_incarnation_merged_over_all_allocated_time():
    P = 4
    incs = [
        inc(0, 0, 1, 0, 400 * P),  # slot 0: 400 steps merged, never failed
        inc(1, 0, 1, 0, 150 * P),  # slot 1: 150 steps merged, killed at ~t=20 ...
        inc(1, 30, 31, 100 * P, 300 * P),  # ... resumed from a checkpoint holding 100, merged 200 more
    ]
    # allocated: both slots from t=1 to t=101: 100 s each at 5 steps/s nominal = 1000 possible steps
    g = gp.goodput(incs, P, {0: 5.0, 1: 5.0}, end=101.0, rollback=False)
    assert g == pytest.approx((400 + 150 + 200) / 1000)


def test_sync_goodput_keeps_only_what_survived_the_rollbacks():
    P = 4
    incs = [
        inc(0, 0, 1, 0, 300 * P),  # merged 300, then the job aborted ...
        inc(0, 40, 42, 200 * P, 500 * P, epoch=1),  # ... and restarted from the checkpoint at 200: 100 lost
    ]
    assert gp.merged_steps(incs, P, rollback=True) == {0: 500}
    assert gp.merged_steps(incs, P, rollback=False) == {0: 600}
    assert gp.goodput(incs, P, {0: 10.0}, end=101.0, rollback=True) == pytest.approx(500 / 1000)


def test_an_incarnation_that_never_joined_adds_nothing_but_its_slot_still_pays():
    incs = [inc(0, 0, 10, 0, 40), inc(0, 50, None, 0, 0)]
    assert gp.allocated_s(incs, end=110.0) == {0: 100.0}
    assert gp.merged_steps(incs, 4, rollback=False) == {0: 10.0}


def test_merged_tokens_follow_the_same_rules():
    incs = [inc(0, 0, 1, 0, 0, tokens=(0, 1000)), inc(0, 5, 6, 0, 0, epoch=1, tokens=(600, 1500))]
    assert gp.merged_tokens(incs, rollback=False) == 1000 + 900
    assert gp.merged_tokens(incs, rollback=True) == 1500


def test_a_version_regression_is_a_lower_label_than_one_the_slot_held_in_the_same_epoch():
    incs = [
        inc(0, 0, 1, 0, 0, accepted=[(0, 1, 5), (0, 1, 6), (1, 1, 2)]),
        inc(0, 10, 11, 0, 0, accepted=[(0, 1, 4), (0, 2, 7)]),  # (1, 4) < (1, 6): regression
        inc(0, 20, 21, 0, 0, epoch=1, accepted=[(0, 1, 3)]),  # a new epoch (sync rollback): allowed
        inc(1, 0, 1, 0, 0, accepted=[(0, 1, 1)]),  # another slot's history is its own
    ]
    assert gp.version_regressions(incs) == 1


def test_a_lost_accepted_update_is_one_version_number_accepted_under_two_terms():
    incs = [
        inc(0, 0, 1, 0, 0, accepted=[(0, 1, 5), (0, 1, 6)]),
        inc(1, 0, 1, 0, 0, accepted=[(0, 1, 5), (0, 2, 6), (0, 2, 7)]),  # (2, 6) forked from (1, 6)
        inc(1, 9, 10, 0, 0, epoch=1, accepted=[(0, 3, 6)]),  # after a rollback: another epoch
    ]
    assert gp.lost_accepted_updates(incs) == 1


def _timed(slot, joined, ended, accepted):
    """An incarnation with its acceptances at times: accepted = [((p, term, version), at), ...]."""
    return Incarnation(slot, joined - 1, joined_at=joined, ended_at=ended, accepted=[a for a, _ in accepted],
                       accepted_at=[t for _, t in accepted])


def test_a_fork_is_a_defect_when_a_holder_was_up_and_counted_apart_when_every_holder_was_down():
    # slots 0 and 1 accept (1, 6) and die at t=20; slot 2 comes back at t=30 and publishes (2, 6) at t=31
    down = [_timed(0, 1, 20, [((0, 1, 6), 10)]), _timed(1, 1, 20, [((0, 1, 6), 11)]),
            _timed(2, 30, None, [((0, 2, 6), 31)])]
    assert (gp.lost_accepted_updates(down), gp.lost_with_every_holder_down(down)) == (0, 1)
    # the same, but slot 1's relaunch (its journal holds (1, 6)) had joined at t=29: the owner should have
    # reached it
    up = down + [_timed(1, 29, None, [])]
    assert (gp.lost_accepted_updates(up), gp.lost_with_every_holder_down(up)) == (1, 0)
    # a relaunch that joins only after the fork does not make it avoidable
    late = down + [_timed(1, 32, None, [])]
    assert (gp.lost_accepted_updates(late), gp.lost_with_every_holder_down(late)) == (0, 1)


def test_a_version_is_lost_when_the_competing_branch_began_not_when_its_own_number_came_up():
    # slots 0 and 1 accept (1, 6) and (1, 7) and die at t=20; slot 2 publishes (2, 6) at t=31, while both are
    # down: from then on (1, 7) is lost too. Slot 1's relaunch joins at t=33 (it takes (2, 6): the higher
    # term), and (2, 7) appears at t=35 while it is up: too late to matter, so not a defect
    down = [_timed(0, 1, 20, [((0, 1, 6), 10), ((0, 1, 7), 12)]), _timed(1, 1, 20, [((0, 1, 6), 11), ((0, 1, 7), 13)]),
            _timed(2, 30, None, [((0, 2, 6), 31), ((0, 2, 7), 35)]), _timed(1, 33, None, [((0, 2, 6), 34)])]
    assert (gp.lost_accepted_updates(down), gp.lost_with_every_holder_down(down)) == (0, 2)
    # the same branch beginning while slot 1's relaunch was up (joined at t=29): both versions are defects
    up = down[:3] + [_timed(1, 29, None, [((0, 2, 6), 34)])]
    assert (gp.lost_accepted_updates(up), gp.lost_with_every_holder_down(up)) == (2, 0)


def test_loss_at_tokens_interpolates_a_smoothed_curve_and_clamps_at_its_ends():
    pts = [(0, 4.0), (100, 3.0), (200, 2.0)]
    assert gp.loss_at_tokens(pts, 150, window=1) == pytest.approx(2.5)
    assert gp.loss_at_tokens(pts, -5, window=1) == 4.0 and gp.loss_at_tokens(pts, 1e9, window=1) == 2.0
    assert gp.loss_at_tokens(pts, 200, window=2) == pytest.approx(2.5)
    assert gp.loss_at_tokens([], 10) is None


def test_the_fault_schedule_is_seeded_and_keeps_each_learner_down_between_its_failures():
    a = fault_schedule(4, 600, 60, 10, seed=3)
    assert a == fault_schedule(4, 600, 60, 10, seed=3) and a != fault_schedule(4, 600, 60, 10, seed=4)
    assert all(0 < f.at < 600 for f in a) and [f.at for f in a] == sorted(f.at for f in a)
    for slot in range(4):
        times = [f.at for f in a if f.slot == slot]
        assert all(b - x >= 10 for x, b in zip(times, times[1:], strict=False))
    assert len(a) == pytest.approx(4 * 600 / 70, rel=0.5)
    assert fault_schedule(4, 600, 0, 10, seed=0) == []

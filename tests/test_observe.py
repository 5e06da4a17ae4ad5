"""The operator's view (node/observe.py): alert rules, goodput and staleness figures, history sampling, on
made-up readings and a fake clock (the readings' own times)."""

import math

import pytest

from diloco.coordinator.version import Version
from diloco.node import observe
from diloco.node.observe import (
    ERROR,
    FRAGMENT_STALLED,
    HISTORY_EVERY_S,
    HISTORY_KEPT,
    NONFINITE_LOSS,
    PEER_SILENT,
    STALENESS,
    STALL_ROUNDS,
    WARNING,
    Alert,
    AlertBook,
    Observer,
    Reading,
    SinceVersion,
)
from diloco.protocol.errors import Malformed
from diloco.protocol.transport import RouteCounter

V = Version


def reading(t: float, step: int = 0, **kw) -> Reading:
    fields = dict(t=t, step=step, tokens=100 * step, loss=2.0, eval_loss=None, tokens_per_s=0.0,
                  step_time_s=0.1, labels=[V(1, 0), V(1, 0)], newest=[V(1, 0), V(1, 0)], peers=2,
                  merged_steps=0, delta_sent=False, me="me")
    return Reading(**{**fields, **kw})


def test_routes_are_named_by_their_pattern_and_both_sides_add_up():
    assert observe.route_of("/v1/updates/3?after=1.2") == "/v1/updates/{p}"
    assert observe.route_of("/v1/fragment/12") == "/v1/fragment/{p}"
    assert observe.route_of("/v1/momentum/0/") == "/v1/momentum/{p}/"
    assert observe.route_of("/v1/dht") == "/v1/dht"
    served = {"/v1/delta": RouteCounter(2, 0, 1000, 4), "/v1/fragment/{p}": RouteCounter(1, 0, 0, 0)}
    sent = {"/v1/delta": RouteCounter(1, 0, 2, 500), "/v1/fragment/0": RouteCounter(1, 0, 300, 0),
            "/v1/fragment/1": RouteCounter(1, 0, 200, 0)}
    assert observe.traffic(served, sent) == {"/v1/delta": {"in": 1002, "out": 504},
                                             "/v1/fragment/{p}": {"in": 500, "out": 0}}


def test_goodput_counts_merged_fragment_steps_since_the_first_reading():
    assert observe.goodput(0, 10, 4, (0, 0), delta_sent=False) is None  # (no delta yet)
    assert observe.goodput(0, 0, 4, (0, 0), delta_sent=True) is None  # (no step since)
    assert observe.goodput(5, 10, 4, None, delta_sent=True) is None
    assert observe.goodput(20, 10, 4, (0, 0), delta_sent=True) == 0.5
    assert observe.goodput(120, 110, 4, (100, 100), delta_sent=True) == 0.5  # (a resumed learner's counters)
    assert observe.goodput(50, 10, 4, (0, 0), delta_sent=True) == 1.0  # (capped)


def test_the_newest_version_comes_from_the_label_the_members_or_the_dht_and_staleness_counts_versions():
    labels = [V(5, 3), V(5, 7), V(0, 0)]
    reported = [[V(5, 4), V(5, 7), V(0, 0)], [V(5, 3), V(9, 6), V(0, 0)]]
    announced = [None, None, V(3, 2)]
    newest = observe.newest_versions(labels, reported, announced)
    assert newest == [V(5, 4), V(9, 6), V(3, 2)]
    assert [observe.staleness(n, h) for n, h in zip(newest, labels, strict=True)] == [1, 0, 2]
    assert observe.newest_versions(labels, [], [None] * 3) == labels


def test_a_member_is_silent_once_its_record_expired_without_leaving():
    heard = {"a": 100.0, "b": 100.0, "me": 0.0, "c": 125.0}
    alerts = observe.silent_peers(heard, recorded={"b"}, me="me", ttl_s=30.0, now=140.0)
    assert [(a.kind, a.peer_id, a.severity, a.since) for a in alerts] == [(PEER_SILENT, "a", WARNING, 130.0)]
    # within the TTL (a poll that missed the record), or still recorded (a suspect that refreshes): not silent
    assert observe.silent_peers({"a": 100.0}, recorded=set(), me="me", ttl_s=30.0, now=129.0) == []
    assert observe.silent_peers({"a": 0.0}, recorded={"a"}, me="me", ttl_s=30.0, now=500.0) == []


def test_a_fragment_stalls_when_both_time_and_this_learners_steps_pass_five_rounds():
    H, step_time = 10, 0.5  # a round: 5 s
    since = [SinceVersion(0.0, 0), SinceVersion(20.0, 40)]
    limit_s, limit_steps = STALL_ROUNDS * H * step_time, STALL_ROUNDS * H
    alerts = observe.stalled_fragments(since, limit_steps, H, step_time, limit_s + 1)
    assert [(a.kind, a.fragment, a.severity) for a in alerts] == [(FRAGMENT_STALLED, 0, WARNING)]
    assert observe.stalled_fragments(since, limit_steps - 1, H, step_time, limit_s + 1) == []  # paused
    assert observe.stalled_fragments(since, 10 * limit_steps, H, step_time, limit_s - 1) == []  # fast learner
    assert observe.stalled_fragments(since, 10 * limit_steps, H, 0.0, 1e9) == []  # no step time measured


def test_a_nan_or_infinite_loss_is_an_error():
    assert observe.nonfinite_losses(2.0, 3.0) == [] and observe.nonfinite_losses(None, None) == []
    [a] = observe.nonfinite_losses(math.nan, None)
    assert (a.kind, a.severity) == (NONFINITE_LOSS, ERROR) and "loss nan" in a.message
    [a] = observe.nonfinite_losses(1.0, math.inf)
    assert "eval_loss inf" in a.message


def test_a_fragment_held_more_than_max_staleness_versions_behind_is_stale():
    labels, newest = [V(1, 5), V(1, 5), V(1, 5)], [V(1, 7), V(1, 8), V(2, 5)]
    assert [(a.kind, a.fragment) for a in observe.stale_fragments(labels, newest, 2)] == [(STALENESS, 1)]
    assert observe.stale_fragments(labels, labels, 0) == []


def test_an_alert_keeps_the_time_it_was_first_raised_until_it_clears():
    book = AlertBook()
    a = Alert(STALENESS, WARNING, "m", fragment=1)
    assert book.update([a], 10.0)[0].since == 10.0
    assert book.update([a], 11.0)[0].since == 10.0
    assert book.update([], 12.0) == []
    assert book.update([a], 13.0)[0].since == 13.0
    assert book.update([Alert(PEER_SILENT, WARNING, "m", since=5.0, peer_id="x")], 14.0)[0].since == 5.0


def test_history_is_sampled_every_five_seconds_and_capped():
    obs = Observer(fragments=2, inner_steps=10, max_staleness=4, member_ttl_s=30.0)
    for i in range(11):  # one reading a second, 100 tokens a step, 10 steps a second
        obs.observe(reading(1000.0 + i, step=10 * i))
    history = obs.history()
    assert [s["t"] for s in history] == [1000.0, 1005.0, 1010.0]
    assert history[1]["tokens_per_s"] == pytest.approx(1000.0)  # (over the interval)
    assert set(history[0]) == {"t", "step", "tokens", "loss", "eval_loss", "tokens_per_s", "goodput", "peers",
                               "bytes"}
    assert [s["t"] for s in obs.history(after=1005.0)] == [1010.0]
    for i in range(HISTORY_KEPT + 10):
        obs.observe(reading(2000.0 + HISTORY_EVERY_S * i, step=200 + i))
    history = obs.history()
    assert len(history) == HISTORY_KEPT and history[-1]["step"] == 200 + HISTORY_KEPT + 9


def test_the_observer_times_version_moves_and_raises_and_clears_alerts():
    obs = Observer(fragments=2, inner_steps=10, max_staleness=1, member_ttl_s=30.0)
    obs.observe(reading(0.0))
    assert obs.version_age(0, 5.0) is None and obs.alerts() == []
    obs.observe(reading(1.0, step=5, labels=[V(1, 1), V(1, 0)]))
    assert obs.version_age(0, 4.0) == 3.0 and obs.version_age(1, 4.0) is None
    # 5 rounds of 1 s and 50 steps later: fragment 1 (never moved) stalls, 0 is 2 versions behind
    obs.observe(reading(5.5, step=55, labels=[V(1, 1), V(1, 0)], newest=[V(1, 3), V(1, 0)]))
    assert {(a.kind, a.fragment) for a in obs.alerts()} == {(FRAGMENT_STALLED, 1), (STALENESS, 0)}
    obs.observe(reading(7.0, step=60, labels=[V(1, 3), V(1, 0)], newest=[V(1, 3), V(1, 0)]))
    assert {(a.kind, a.fragment) for a in obs.alerts()} == {(FRAGMENT_STALLED, 1)}
    obs.observe(reading(11.0, step=70, labels=[V(1, 3), V(1, 1)], loss=math.nan))
    assert [a.kind for a in obs.alerts()] == [NONFINITE_LOSS]
    assert obs.history()[-1]["loss"] is None  # (JSON has no NaN)


def test_goodput_of_the_observer_starts_at_its_first_reading():
    obs = Observer(fragments=4, inner_steps=10, max_staleness=4, member_ttl_s=30.0)
    obs.observe(reading(0.0, step=0, merged_steps=0))
    assert obs.goodput(merged_steps=30, step=10, delta_sent=True) == 0.75


def test_member_states_and_the_history_query_parameter():
    untrusted, suspects = {"d"}, {"s": 12.0, "d": math.inf}
    assert [observe.member_state(p, synced, suspects, untrusted)
            for p, synced in (("t", True), ("j", False), ("s", True), ("d", True))] == \
        ["training", "joining", "suspect", "distrusted"]
    assert observe.history_after(None) is None and observe.history_after("12.5") == 12.5
    for bad in ("soon", "nan", "inf"):
        with pytest.raises(Malformed):
            observe.history_after(bad)

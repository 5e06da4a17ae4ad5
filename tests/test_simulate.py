"""The fleet goodput simulator: closed forms in limiting cases, the DES against them, replay, the CLI."""

import json
import math
import time
from dataclasses import replace

import pytest
from click.testing import CliRunner

from diloco.node.cli import main
from diloco.node.simulate import (
    DEFAULT_CHIPS,
    DEFAULT_LEARNERS,
    MODES,
    YEAR_S,
    SimParams,
    checkpoint_interval,
    expected_goodput,
    parse_counts,
    replay,
    simulate,
    table,
    with_overrides,
)

INF = math.inf
# small costs so that a short horizon holds many failures
SMALL = SimParams(step_s=0.5, inner_steps=20, fragments=4, detect_s=10, downtime_s=20, restart_s=30, reconfig_s=5,
                  ckpt_write_s=2, merge_latency_s=4, horizon_s=20_000)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("learners", [1, 2, 16])
def test_no_failures_is_one_with_ideal_efficiency_and_no_horizon(mode, learners):
    for params in (SimParams(horizon_s=INF), SimParams(horizon_s=INF, ckpt_write_s=0.0), replace(SMALL, horizon_s=INF)):
        assert expected_goodput(mode, 2_400_000, learners, INF, params) == pytest.approx(1.0, abs=1e-12)


def test_no_failures_at_a_finite_horizon_loses_only_the_end_effects():
    p = SMALL
    tau = checkpoint_interval(p, 0.0)
    assert tau == p.horizon_s - p.ckpt_write_s  # one checkpoint, finishing at the horizon
    assert expected_goodput("dp", 64, 4, INF, p) == pytest.approx(tau / p.horizon_s, rel=1e-4)
    assert expected_goodput("dp_elastic", 64, 4, INF, p) == pytest.approx(1.0)
    assert expected_goodput("decoupled", 64, 4, INF, p) == pytest.approx(1 - p.unmerged_s / p.horizon_s)
    fixed = SimParams(ckpt_interval_s=300, ckpt_write_s=7, horizon_s=1000)  # 3 blocks of 307 s by t = 1000,
    # and 79 s of the fourth: never rolled back, it counts (at τ/B of its time)
    assert expected_goodput("dp", 8, 2, INF, fixed) == pytest.approx((900 + 79 * 300 / 307) / 1000, rel=1e-4)


def test_efficiencies_multiply_useful_time():
    p = SimParams(horizon_s=INF, sync_efficiency=0.9, decoupled_efficiency=0.8)
    n, m, mtbi = 150_000, 8, YEAR_S
    base = SimParams(horizon_s=INF)
    for mode, eff in (("dp", 0.9), ("dp_elastic", 0.9), ("decoupled", 0.8)):
        assert expected_goodput(mode, n, m, mtbi, p) == pytest.approx(eff * expected_goodput(mode, n, m, mtbi, base))


@pytest.mark.parametrize("horizon", [INF, 20_000.0, 700.0])
@pytest.mark.parametrize("mtbi", [200.0, 3000.0, 1e6])
def test_one_learner_makes_every_mode_dp(horizon, mtbi):
    p = replace(SMALL, horizon_s=horizon)
    g = [expected_goodput(mode, 1, 1, mtbi, p) for mode in MODES]
    assert g[0] == g[1] == g[2]
    if horizon != INF:
        assert len({simulate(mode, 1, 1, mtbi, p, seed=3, runs=3) for mode in MODES}) == 1
        assert len({replay(mode, 1, [[50.0, 400.0]], p) for mode in MODES}) == 1


def test_long_run_closed_forms():
    p = SimParams(horizon_s=INF)
    n, m, mtbi = 300_000, 4, 2 * YEAR_S
    lam, big_lam = n / m / mtbi, n / mtbi
    assert expected_goodput("decoupled", n, m, mtbi, p) == pytest.approx(
        math.exp(-lam * (p.downtime_s + p.restart_s + p.inner_steps * p.step_s / 2 + p.merge_latency_s)))
    r = p.detect_s + p.downtime_s + p.restart_s
    q = math.exp(-lam * r)
    cost = lam * q * ((m - 1) * q * (p.detect_s + 2 * p.reconfig_s + p.step_s) + p.step_s + p.reconfig_s)
    assert expected_goodput("dp_elastic", n, m, mtbi, p) == pytest.approx(q - cost)
    tau = checkpoint_interval(p, big_lam)
    b = tau + p.ckpt_write_s
    assert expected_goodput("dp", n, m, mtbi, p) == pytest.approx(
        tau * big_lam * math.exp(-big_lam * r) / math.expm1(big_lam * b))


def test_finite_horizon_tends_to_the_long_run_rate():
    for mode in MODES:
        far = expected_goodput(mode, 150_000, 4, YEAR_S, SimParams(horizon_s=1e9))
        assert far == pytest.approx(expected_goodput(mode, 150_000, 4, YEAR_S, SimParams(horizon_s=INF)), abs=1e-5)


def test_the_automatic_checkpoint_period_is_the_optimum():
    p = SimParams(horizon_s=INF)
    big_lam = 150_000 / YEAR_S
    tau = checkpoint_interval(p, big_lam)
    assert tau == pytest.approx(math.sqrt(2 * p.ckpt_write_s / big_lam), rel=0.1)  # Young/Daly to first order
    best = expected_goodput("dp", 150_000, 2, YEAR_S, p)
    for k in (0.8, 0.95, 1.05, 1.25):
        other = SimParams(horizon_s=INF, ckpt_interval_s=k * tau)
        assert expected_goodput("dp", 150_000, 2, YEAR_S, other) < best


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("chips", "learners", "mtbi", "horizon"), [
    (64, 4, 64 * 1500.0, 20_000.0),  # each learner fails every 1500 s, the job every 375 s
    (8, 2, 8 * 400.0, 20_000.0),     # failures about as frequent as the recovery is long
    (16, 16, 16 * 3000.0, 20_000.0),
    (64, 4, 64 * 1500.0, 1_500.0),   # a short run: the cold start and the end of run matter
])
def test_the_discrete_event_simulation_agrees_with_the_closed_form(mode, chips, learners, mtbi, horizon):
    p = replace(SMALL, horizon_s=horizon)
    runs = 400 if horizon > 10_000 else 1500
    des = simulate(mode, chips, learners, mtbi, p, seed=1, runs=runs)
    assert des == pytest.approx(expected_goodput(mode, chips, learners, mtbi, p), abs=0.005)


@pytest.mark.parametrize("mode", MODES)
def test_replay_of_an_empty_schedule_is_the_no_failure_value(mode):
    assert replay(mode, 4, [[], [], [], []], SMALL) == pytest.approx(expected_goodput(mode, 64, 4, INF, SMALL))


def test_replay_of_one_failure_matches_the_hand_computed_value():
    p = SimParams(step_s=1, inner_steps=10, detect_s=5, downtime_s=10, restart_s=20, reconfig_s=3,
                  ckpt_interval_s=50, ckpt_write_s=0, merge_latency_s=5, horizon_s=1000)
    sched = [[300.0], []]
    # decoupled: learner 0 is up 0-300 and 330-1000 and loses L = 10/2·1 + 5 = 10 s at its failure and at the end;
    # learner 1 loses only the 10 s at the end
    assert replay("decoupled", 2, sched, p) == pytest.approx((290 + 660 + 990) / 2000)
    # dp: blocks of 50 s; 2 done before the failure at 120 (the 20 s after them are lost), recovery 35 s,
    # then 845 s that nothing rolls back
    assert replay("dp", 2, [[120.0], []], p) == pytest.approx((2 * 50 + 845) / 1000)
    # elastic: learner 0 is in the group for 120 + 845 s, loses its in-flight step (1) and stalls 3 when it
    # rejoins at 155; learner 1 pays detect + reconfig + step (9) for the departure and 3 for the rejoin
    assert replay("dp_elastic", 2, [[120.0], []], p) == pytest.approx((965 - 4 + 1000 - 12) / 2000)
    # a second failure during the recovery restarts it: back at 130 + 35 = 165 instead of 155
    assert replay("dp", 2, [[120.0], [130.0]], p) == pytest.approx((2 * 50 + 835) / 1000)
    assert replay("dp_elastic", 2, [[120.0, 130.0], []], p) == pytest.approx((955 - 4 + 1000 - 12) / 2000)


@pytest.mark.parametrize("mode", MODES)
def test_goodput_grows_with_the_time_between_interruptions(mode):
    values = [expected_goodput(mode, 600_000, 8, y * YEAR_S, SimParams()) for y in (0.5, 1, 2, 4, 8, 16)]
    assert values == sorted(values) and values[-1] > values[0]


def test_decoupled_depends_only_on_the_learner_size():
    p = SimParams()
    assert expected_goodput("decoupled", 150_000, 2, YEAR_S, p) == expected_goodput("decoupled", 300_000, 4, YEAR_S, p)


def test_default_table_is_fast_and_complete():
    t0 = time.perf_counter()
    rows = table(DEFAULT_CHIPS, DEFAULT_LEARNERS, YEAR_S, SimParams())
    assert time.perf_counter() - t0 < 10
    assert len(rows) == len(DEFAULT_CHIPS) * len(DEFAULT_LEARNERS) * len(MODES)
    assert all(0 <= r["goodput"] <= 1 for r in rows)


def test_parsing_of_counts_and_overrides():
    assert parse_counts("150k, 2.4M,16") == [150_000, 2_400_000, 16]
    for bad in ("", "1.5", "x", "0"):
        with pytest.raises(ValueError):
            parse_counts(bad)
    p = with_overrides(SimParams(), ["restart_s=300", "inner-steps=50", "horizon_s=inf"])
    assert (p.restart_s, p.inner_steps, p.horizon_s) == (300, 50, INF) and isinstance(p.inner_steps, int)
    for bad in ("restart_s", "nope=1", "restart_s=abc", "inner_steps=2.5", "step_s=-1", "sync_efficiency=2"):
        with pytest.raises(ValueError):
            with_overrides(SimParams(), [bad])


def test_cli_json_last_line_has_rows_and_params():
    r = CliRunner().invoke(main, ["simulate", "--chips", "150k,300000", "--learners", "2,16", "--mtbi-years", "2",
                                  "--param", "restart_s=300", "--json"])
    assert r.exit_code == 0, r.output
    lines = r.output.strip().splitlines()
    assert "dp_elastic" in lines[2] and "150,000" in r.output  # the readable table comes first
    out = json.loads(lines[-1])
    assert set(out) == {"rows", "params"} and len(out["rows"]) == 2 * 2 * 3
    assert all(set(row) == {"mode", "chips", "learners", "goodput"} for row in out["rows"])
    assert {row["mode"] for row in out["rows"]} == set(MODES)
    assert out["params"]["restart_s"] == 300 and out["params"]["mtbi_years"] == pytest.approx(2)
    row = next(x for x in out["rows"] if (x["mode"], x["chips"], x["learners"]) == ("decoupled", 300_000, 16))
    p = SimParams(restart_s=300)
    assert row["goodput"] == pytest.approx(expected_goodput("decoupled", 300_000, 16, 2 * YEAR_S, p))


def test_cli_default_table_prints_every_row():
    r = CliRunner().invoke(main, ["simulate"])
    assert r.exit_code == 0, r.output
    assert len([x for x in r.output.splitlines() if x.strip()[:1].isdigit()]) == 20


@pytest.mark.parametrize("args", [["--param", "bogus=1"], ["--param", "restart_s=soon"], ["--chips", "lots"],
                                  ["--chips", "8", "--learners", "16"], ["--des", "--param", "horizon_s=inf"]])
def test_cli_bad_input_is_one_line(args):
    r = CliRunner().invoke(main, ["simulate", *args])
    assert r.exit_code != 0 and "Traceback" not in r.output
    assert len(r.output.strip().splitlines()) == 1 and r.output.startswith("Error:")

"""Chaos runs for real: learners killed with SIGKILL on a schedule, in both modes (docs/architecture.md §10)."""

import json
import subprocess
import sys

import pytest
from click.testing import CliRunner

from diloco.node.chaos_run import PREDICTION_KEYS, RESULT_KEYS, ChaosOptions, run_chaos
from diloco.node.cli import main


def _no_learner_left(out) -> None:
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert str(out) not in ps, "a learner process of this run is still alive"


def _assert_invariants(mode: dict) -> None:
    assert mode["version_regressions"] == 0
    assert mode["unloadable_checkpoints"] == 0
    assert mode["lost_accepted_updates"] == 0
    assert mode["unexpected_exits"] == 0, "a learner died on its own (see its log in the output folder)"


def _assert_goodput_counted_within_the_pace(mode: dict, opts: ChaosOptions) -> None:
    """Goodput divides by the rate the calibration measured; a loaded machine can measure it low there and
    give the fleet more CPU later (a killed learner's share, a neighbour's job done), so goodput itself may
    pass 1 without anything miscounted. What no counting can pass is the pace: no learner steps faster than
    `pace_s` × its slowdown, so the merged steps stay within allocated time × that rate."""
    by_slot = mode["allocated_s_by_slot"]
    ceiling = sum(a / (opts.pace_s * opts.stragglers.get(int(s), 1.0)) for s, a in by_slot.items())
    assert len(by_slot) == opts.peers and 0 < mode["merged_steps"] <= 1.02 * ceiling, (mode, ceiling)
    assert mode["merged_tokens"] > 0


@pytest.mark.timeout(120)
def test_a_short_decoupled_chaos_run_restarts_killed_learners_and_keeps_every_invariant(tmp_path):
    opts = ChaosOptions(peers=3, minutes=0.4, mtbf_s=15.0, downtime_s=1.0, seed=1, out=tmp_path, calibrate_s=8.0,
                        checkpoint_every=40, eval_every=40, no_failure=False, mode="decoupled", owner_every=2,
                        stragglers={1: 1.5}, throttle={2: 20.0})
    result = run_chaos(opts, say=lambda _: None)
    _no_learner_left(tmp_path)
    mode = result["decoupled"]
    assert mode["failures"] >= 2, "the schedule killed fewer than two learners"
    _assert_invariants(mode)
    assert mode["goodput"] > 0.3
    _assert_goodput_counted_within_the_pace(mode, opts)
    events = [json.loads(line) for line in (tmp_path / "decoupled" / "events.jsonl").read_text().splitlines()]
    assert any(e["event"] == "fault" and e["owner_of"] is not None for e in events), "no owner was killed"
    assert sum(e["event"] == "launch" for e in events) > opts.peers, "killed learners were restarted"
    link = next(e for e in events if e["event"] == "throttled_link")
    assert link["slot"] == 2 and link["forwarded_bytes"] > 0, "nobody reached learner 2 through its throttled link"
    assert 0 < mode["predicted_goodput"] <= 1 and 0 < mode["replayed_goodput"] <= 1
    assert mode["prediction_params"]["restart_s"] > 0, "the calibration measured no start-up"
    assert mode["prediction_params"]["horizon_s"] == opts.minutes * 60  # configured, not the run's own length


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_short_chaos_run_keeps_every_invariant_in_both_modes(tmp_path):
    opts = ChaosOptions(peers=3, minutes=0.5, mtbf_s=20.0, downtime_s=2.0, seed=1, out=tmp_path, calibrate_s=6.0,
                        checkpoint_every=40, eval_every=40, no_failure=False)
    result = run_chaos(opts, say=lambda _: None)
    _no_learner_left(tmp_path)
    for name in ("decoupled", "sync"):
        mode = result[name]
        assert set(RESULT_KEYS) <= set(mode)
        assert mode["failures"] >= 1, "the schedule killed nobody"
        _assert_invariants(mode)
        assert mode["goodput"] > 0
        _assert_goodput_counted_within_the_pace(mode, opts)
    assert result["sync"]["aborts"] == result["sync"]["failures"], "every sync failure rolls the whole job back"
    events = [json.loads(line) for line in (tmp_path / "decoupled" / "events.jsonl").read_text().splitlines()]
    kills = [e for e in events if e["event"] == "kill" and e["why"] == "fault"]
    launches = [e for e in events if e["event"] == "launch"]
    assert kills and len(launches) > opts.peers, "killed learners were restarted"
    assert (tmp_path / "schedule.json").exists() and (tmp_path / "metrics.jsonl").exists()


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_chaos_command_prints_its_json_and_plots(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "diloco.node.cli", "chaos", "--peers", "3", "--minutes", "0.75", "--mtbf", "40",
         "--downtime", "3", "--checkpoint-every", "50", "--out", str(tmp_path), "--json"],
        capture_output=True, text=True, timeout=850)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(result) == {"decoupled", "sync", "no_failure_eval_loss"}
    for name in ("decoupled", "sync"):
        assert set(result[name]) == {*RESULT_KEYS, *PREDICTION_KEYS}
        assert result[name]["version_regressions"] == result[name]["lost_accepted_updates"] == 0
        assert result[name]["unloadable_checkpoints"] == 0
    assert (tmp_path / "loss_vs_time.png").stat().st_size > 0 and (tmp_path / "goodput_vs_time.png").exists()
    _no_learner_left(tmp_path)


def test_chaos_refuses_a_malformed_straggler_with_one_line():
    r = CliRunner().invoke(main, ["chaos", "--straggler", "fast"])
    assert r.exit_code != 0 and "SLOT:FACTOR" in r.output and "Traceback" not in r.output
    r = CliRunner().invoke(main, ["chaos", "--peers", "3", "--straggler", "7:2"])
    assert r.exit_code != 0 and "SLOT must be 0..2" in r.output


def test_the_throttle_relay_forwards_both_ways_at_its_rate():
    import socket
    import threading
    import time

    from diloco.node.chaos import _free_port
    from diloco.node.throttle import ThrottleRelay

    server = socket.create_server(("127.0.0.1", 0))
    target = server.getsockname()[1]

    def echo():
        conn, _ = server.accept()
        with conn:
            while data := conn.recv(65536):
                conn.sendall(data)

    threading.Thread(target=echo, daemon=True).start()
    relay = ThrottleRelay(_free_port(), target, rate_bytes_s=1_000_000).start()
    try:
        payload = bytes(range(256)) * 2048  # 512 KiB each way, at 1 MB/s after a 64 KiB burst
        with socket.create_connection(("127.0.0.1", relay.port)) as c:
            t0 = time.monotonic()
            threading.Thread(target=c.sendall, args=(payload,), daemon=True).start()
            got = bytearray()
            while len(got) < len(payload):
                got += c.recv(65536)
            elapsed = time.monotonic() - t0
        assert bytes(got) == payload
        assert 0.4 < elapsed < 2.0, f"512 KiB through a 1 MB/s link took {elapsed:.2f} s"
    finally:
        relay.stop()
        server.close()


def test_restart_s_is_the_median_from_a_relaunch_to_its_first_inner_step():
    from diloco.node.chaos import FleetRun
    from diloco.node.chaos_run import restart_s, restart_times, sync_restart_s
    from diloco.node.goodput import Incarnation

    def inc(slot, launched, first_step, joined=None, epoch=0):
        return Incarnation(slot, launched, epoch=epoch, joined_at=first_step - 0.5 if joined is None else joined,
                           first_step_at=first_step)

    run = FleetRun("decoupled", incarnations=[
        inc(0, 50.0, 53.0, joined=52.9),  # relaunches (listed out of order): 3 s, 2 s and 14 s to the first step
        inc(0, 0.0, 20.0), inc(1, 0.0, 21.0),  # the first launches are not restarts
        inc(1, 60.0, 62.0), inc(0, 90.0, 104.0),
        Incarnation(1, 100.0, ended_at=101.0, ended_by="fault"),  # killed before its first step: left out
    ])
    assert sorted(restart_times(run)) == [2.0, 3.0, 14.0]
    assert restart_s(run) == 3.0  # the median (the mean, 6.3 s, is the simulator's input)
    assert restart_s(FleetRun("no_failure", incarnations=[inc(0, 0.0, 5.0)])) == 0.0
    sync = FleetRun("sync", incarnations=[inc(0, 0.0, 9.0), inc(1, 0.0, 9.5), inc(0, 100.0, 108.0, epoch=1),
                                          inc(1, 100.2, 109.0, epoch=1)])
    assert sync_restart_s(sync) == 9.0  # the whole job: first relaunch to the last learner's first step


def test_the_harness_records_first_steps_and_leaves_a_starting_learner_a_cpu(tmp_path):
    import os
    import time

    from diloco.node.chaos import Fleet
    from diloco.node.goodput import Incarnation

    fleet = Fleet("decoupled", tmp_path / "run.spec", tmp_path / "w", peers=3, pace_s=0.1, checkpoint_every=10,
                  eval_every=0)
    procs = []
    try:
        inc = Incarnation(0, time.monotonic())
        startup = {"imports": 2.1, "model": 0.01, "learner": 0.7, "join": 0.2, "first_step": 0.1, "total": 3.1,
                   "cpu": {"total": 3.0}}
        fleet._apply(fleet.slots[0], inc, {"event": "first_step", "step": 101, "startup_s": startup})
        assert inc.first_step_at is not None and inc.startup == startup
        if not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2:
            pytest.skip("needs CPU affinity and two CPUs")
        cpus = sorted(os.sched_getaffinity(0))
        for slot in fleet.slots:  # stand-ins for learner processes, with a thread each
            slot.proc = subprocess.Popen([sys.executable, "-c", "import threading, time\n"
                                          "threading.Thread(target=time.sleep, args=(30,)).start()"])
            slot.inc = Incarnation(slot.index, time.monotonic(), first_step_at=time.monotonic())
            procs.append(slot.proc)
        time.sleep(0.5)

        def affinity(slot):
            tasks = os.listdir(f"/proc/{slot.proc.pid}/task")
            assert len(tasks) == 2
            return {frozenset(os.sched_getaffinity(int(t))) for t in tasks}

        fleet.slots[2].inc = Incarnation(2, time.monotonic())  # slot 2 restarts: no first step yet
        fleet.share_cpus()
        assert affinity(fleet.slots[0]) == affinity(fleet.slots[1]) == {frozenset(cpus[1:])}
        assert affinity(fleet.slots[2]) == {frozenset(cpus)}
        fleet.slots[2].inc.first_step_at = time.monotonic()  # it trains: everyone anywhere again
        fleet.share_cpus()
        assert all(affinity(s) == {frozenset(cpus)} for s in fleet.slots)
    finally:
        fleet.log.close()
        for proc in procs:
            proc.kill()
            proc.wait()


@pytest.mark.timeout(60)
def test_at_the_end_of_a_run_each_learner_is_down_from_the_moment_its_own_process_exits(tmp_path):
    # who was up when a competing version appeared decides whether a fork is a defect (node/goodput.py): a
    # learner that drained and exited at once must not count as up while a slower one is still draining
    import time

    from diloco.node.chaos import Fleet
    from diloco.node.goodput import Incarnation

    fleet = Fleet("decoupled", tmp_path / "run.spec", tmp_path / "w", peers=2, pace_s=0.1, checkpoint_every=10,
                  eval_every=0)
    try:
        for slot, linger in zip(fleet.slots, (3.0, 0.2), strict=True):  # the first one takes longest to stop
            slot.proc = subprocess.Popen([sys.executable, "-c", "import signal, time\n"
                                          f"signal.signal(signal.SIGINT, lambda *a: (time.sleep({linger}), exit(0)))\n"
                                          "time.sleep(30)"])
            slot.inc = Incarnation(slot.index, time.monotonic())
        time.sleep(0.5)  # (their handlers installed)
        t0 = time.monotonic()
        fleet.stop()
        slow, quick = (s.inc.ended_at - t0 for s in fleet.slots)
        assert quick < 1.5 < slow, (quick, slow)
    finally:
        fleet.log.close()
        for slot in fleet.slots:
            if slot.proc is not None:
                slot.proc.kill()
                slot.proc.wait()


def test_a_learner_reports_where_its_start_up_went_with_its_first_step(tmp_path, capsys):
    from diloco.node.swarm import SwarmConfig
    from diloco.node.train import TrainOptions, new_run, train
    from diloco.protocol.identity import Identity

    genesis = new_run(Identity.generate(), "startup", task="markov", inner_steps=10, fragments=2)
    train(genesis, Identity.generate(), SwarmConfig(), TrainOptions(steps=2, json=True, standalone=True))
    events = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [e["event"] for e in events] == ["joined", "first_step", "done"]
    first = events[1]["startup_s"]
    assert events[1]["step"] == 1
    assert {"imports", "model", "first_step", "total", "cpu"} <= set(first)
    assert first["total"] >= first["imports"] > 0 and first["cpu"]["total"] > 0


def test_the_prediction_uses_only_what_is_known_before_the_run():
    """predicted_goodput (node/chaos_run.py `forecast`): the calibration's step time and start-up, the
    schedule's MTBF and down time, the options; it matches the model's mean over the harness's own schedules."""
    import statistics

    from diloco.node.chaos import FleetRun, fault_schedule
    from diloco.node.chaos_run import calibration_restart_s, forecast
    from diloco.node.goodput import Incarnation
    from diloco.node.simulate import SimParams, replay

    def inc(slot, launched, first_step, cpu):
        return Incarnation(slot, launched, joined_at=first_step - 0.3, first_step_at=first_step,
                           startup={"total": first_step - launched, "cpu": {"total": cpu}})

    calib = FleetRun("standalone", incarnations=[inc(0, 0.0, 9.0, 4.0), inc(1, 0.1, 9.6, 4.4),
                                                 inc(2, 0.2, 8.8, 4.2), inc(3, 0.2, 10.1, 4.6)])
    # a decoupled relaunch gets a core of its own: its start-up's CPU seconds (median); a sync relaunch starts
    # every learner at once, as the calibration did: first launch to the last first step
    assert calibration_restart_s(calib, sync=False) == pytest.approx(4.3)
    assert calibration_restart_s(calib, sync=True) == pytest.approx(10.1)
    no_cpu = FleetRun("standalone", incarnations=[Incarnation(0, 1.0, first_step_at=6.0)])
    assert calibration_restart_s(no_cpu, sync=False) == 5.0  # no CPU report: the wall time
    nominal = dict.fromkeys(range(4), 8.0)
    opts = ChaosOptions(peers=4, minutes=5, mtbf_s=130.0, downtime_s=3.0)
    for mode, sim_mode, tolerance in (("decoupled", "decoupled", 0.005), ("sync", "dp", 0.02)):
        f = forecast(opts, calib, nominal, mode)
        p = f["prediction_params"]
        assert (p["step_s"], p["downtime_s"], p["horizon_s"]) == (0.125, 3.0, 300.0)
        assert p["restart_s"] == pytest.approx(calibration_restart_s(calib, mode == "sync"), abs=1e-4)
        params = SimParams(**p)
        replays = []
        for seed in range(400):
            faults = fault_schedule(4, 300.0, opts.mtbf_s, opts.downtime_s, seed, owner_every=0)
            replays.append(replay(sim_mode, 4, [[x.at for x in faults if x.slot == s] for s in range(4)], params))
        assert f["predicted_goodput"] == pytest.approx(statistics.fmean(replays), abs=tolerance)
    assert forecast(ChaosOptions(peers=3, mtbf_s=0.0), calib, nominal, "decoupled")["predicted_goodput"] > 0.99


def test_a_calibration_that_could_not_hold_the_pace_is_named():
    from diloco.node.chaos_run import short_of_pace

    # pace 0.12 s: 8.33 steps/s; learner 1 is a 1.5× straggler (5.56 steps/s is its whole pace)
    nominal = {0: 8.2, 1: 5.5, 2: 6.0}
    assert short_of_pace(nominal, 0.12, {1: 1.5}) == {2: pytest.approx(0.72)}
    assert short_of_pace({0: 8.3, 1: 5.6}, 0.12, {1: 1.5}) == {}

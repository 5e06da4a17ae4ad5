"""`diloco-node chaos`: decoupled vs synchronous goodput on one fault schedule, and what it all means.

The steps, all in one run and one output folder:
1. write a creator key and two run specs of the same task and model: decoupled (the defaults users run,
   quorum 2) and sync (`synchronous`, quorum = every learner);
2. measure the nominal rate: the M learners training standalone side by side, paced like the fleets;
3. draw one seeded fault schedule and run each requested mode on it (`node/chaos.py`);
4. run the decoupled fleet once more without faults: its eval loss at the decoupled run's merged tokens is
   `no_failure_eval_loss` (quality compared at equal tokens, as in the paper);
5. compute goodput and the invariants from the learners' reports (`node/goodput.py`), what the fleet simulator
   (`node/simulate_restart.py`, profile `localhost`) says of the same fleet, and draw the plots
   (`node/chaos_plot.py`). Two simulator figures per mode, both in docs/chaos.md: `predicted_goodput`, made
   before any fleet runs from the calibration, the schedule's MTBF and the configured down time only; and
   `replayed_goodput`, the run's own kill schedule replayed with the costs measured in that very run (a check
   of the model, not a prediction).
"""

from __future__ import annotations

import json
import math
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from . import goodput as gp
from .chaos import Fleet, FleetRun, fault_schedule

MODES = ("decoupled", "sync")
RESULT_KEYS = ("goodput", "final_eval_loss", "merged_tokens", "failures", "version_regressions",
               "unloadable_checkpoints", "lost_accepted_updates")
PREDICTION_KEYS = ("predicted_goodput", "replayed_goodput")


@dataclass
class ChaosOptions:
    peers: int = 4
    minutes: float = 5.0
    mtbf_s: float = 130.0  # per learner, counted while it is up
    downtime_s: float = 3.0
    mode: str = "both"
    seed: int = 0
    out: Path | None = None
    json: bool = False
    pace_s: float = 0.12  # the emulated chip: 4 learners × ~35 ms of compute per step fit 2 cores with room
    inner_steps: int = 30  # H
    fragments: int = 4  # P
    checkpoint_every: int = 100  # inner steps (12 s at the default pace)
    eval_every: int = 100
    calibrate_s: float = 20.0
    owner_every: int = 3  # every third fault is aimed at a fragment's current owner
    stragglers: dict[int, float] = field(default_factory=dict)  # slot -> step-time factor
    throttle: dict[int, float] = field(default_factory=dict)  # slot -> Mbit/s of the link into it
    no_failure: bool = True


def make_specs(out: Path, opts: ChaosOptions) -> dict[str, Path]:
    from diloco.protocol.identity import Identity

    from .train import new_run

    creator = Identity.generate()
    common = dict(task="markov", inner_steps=opts.inner_steps, fragments=opts.fragments, codec="int8")
    specs = {
        "decoupled": new_run(creator, "chaos-decoupled", quorum=min(2, opts.peers), **common),
        "sync": new_run(creator, "chaos-sync", quorum=opts.peers, synchronous=True, grace_gamma=0.0,
                        grace_cap_s=0.0, **common),
    }
    return {mode: g.save(out / f"{mode}.spec") for mode, g in specs.items()}


def _steps_after_warmup(inc: gp.Incarnation, warmup_s: float) -> tuple[float, float] | None:
    """(inner steps, seconds) of an incarnation's progress after its first `warmup_s`; None if too short."""
    pts = [(t, s) for t, s, _ in inc.progress if t >= inc.progress[0][0] + warmup_s] if inc.progress else []
    if len(pts) < 2 or pts[-1][0] <= pts[0][0]:
        return None
    return pts[-1][1] - pts[0][1], pts[-1][0] - pts[0][0]


def nominal_rates(run: FleetRun, warmup_s: float = 3.0) -> dict[int, float]:
    """Steps/s of each standalone learner after a short warm-up."""
    rates = {}
    for inc in run.incarnations:
        if (span := _steps_after_warmup(inc, warmup_s)) is not None:
            rates[inc.slot] = span[0] / span[1]
    return rates


def short_of_pace(nominal: dict[int, float], pace_s: float, slowdown: dict[int, float],
                  share: float = 0.9) -> dict[int, float]:
    """Slot -> the share of its pace (1 / (pace_s × its slowdown) steps/s) that it held in the calibration,
    for the slots below `share` of it: the machine was short of CPU then. Goodput divides by the calibration's
    rate, so if the fleet later gets more CPU than the calibration had, goodput passes 1 without anything
    miscounted."""
    held = {slot: rate * pace_s * slowdown.get(slot, 1.0) for slot, rate in nominal.items()}
    return {slot: h for slot, h in sorted(held.items()) if h < share}


def summarize(run: FleetRun, fragments: int, nominal: dict[int, float]) -> dict[str, Any]:
    rollback = run.mode == "sync"
    incs = run.incarnations
    finals = [i.final_eval_loss for i in incs if i.final_eval_loss is not None and i.ended_by == "finished"]
    allocated = gp.allocated_s(incs, run.ended_at)
    return {
        "goodput": round(gp.goodput(incs, fragments, nominal, run.ended_at, rollback), 4),
        "final_eval_loss": round(statistics.fmean(finals), 4) if finals else None,
        "merged_tokens": gp.merged_tokens(incs, rollback),
        "failures": run.failures,
        "version_regressions": gp.version_regressions(incs),
        "unloadable_checkpoints": len(run.corrupt_checkpoints),
        "lost_accepted_updates": gp.lost_accepted_updates(incs),
        "lost_with_every_holder_down": gp.lost_with_every_holder_down(incs),
        "aborts": run.aborts,
        "unexpected_exits": run.unexpected_exits,
        "merged_steps": round(sum(gp.merged_steps(incs, fragments, rollback).values()), 1),
        "allocated_s": round(sum(allocated.values()), 1),
        "allocated_s_by_slot": {str(k): round(v, 1) for k, v in sorted(allocated.items())},
        "restart_s": round(restart_s(run), 2),
    }


def restart_times(run: FleetRun) -> list[float]:
    """Per relaunch (every incarnation of a slot but its first), the seconds from the harness starting the
    process to the learner's report of its first inner step: interpreter and imports, numba kernels, model,
    checkpoint, join and downloads, and that step. A relaunch killed before its first step is left out."""
    first: dict[int, gp.Incarnation] = {}
    for inc in sorted(run.incarnations, key=lambda i: i.launched_at):
        first.setdefault(inc.slot, inc)
    return [i.first_step_at - i.launched_at for i in run.incarnations
            if i.first_step_at is not None and first[i.slot] is not i]


def restart_s(run: FleetRun) -> float:
    """The summary's `restart_s`: the median of `restart_times` (0 if nothing was relaunched)."""
    times = restart_times(run)
    return statistics.median(times) if times else 0.0


def step_efficiency(run: FleetRun, nominal: dict[int, float], warmup_s: float = 3.0) -> float:
    """Failure-free speed: inner steps/s of the learners while they ran, after a short warm-up per incarnation,
    ÷ their nominal rate (time-weighted). Synchronous learners wait for merges: it shows here."""
    steps = possible = 0.0
    for inc in run.incarnations:
        if (span := _steps_after_warmup(inc, warmup_s)) is not None:
            steps += span[0]
            possible += span[1] * nominal[inc.slot]
    return steps / possible if possible else 1.0


def unmerged_at_end_s(run: FleetRun, fragments: int, step_s: float) -> float:
    """Mean work still unmerged when the run ended (inner steps taken but not yet in a version), in seconds."""
    ends = [(i.steps - (i.last_merged - i.start_merged) / fragments) for i in run.incarnations
            if i.ended_by == "finished" and i.joined_at is not None and i.start_merged == 0]
    return statistics.fmean(ends) * step_s if ends else 0.0


def sync_restart_s(run: FleetRun) -> float:
    """Mean time from a synchronous job's relaunch to every learner's first inner step (the rendezvous
    included)."""
    spans = []
    for epoch in {i.epoch for i in run.incarnations if i.epoch > 0}:
        incs = [i for i in run.incarnations if i.epoch == epoch]
        if all(i.first_step_at is not None for i in incs):
            spans.append(max(i.first_step_at for i in incs) - min(i.launched_at for i in incs))
    return statistics.fmean(spans) if spans else 0.0


def calibration_restart_s(calib: FleetRun, sync: bool) -> float:
    """The restart time a prediction may use, measured in the calibration (no fault, no fleet yet).

    Sync: from the first launch to every learner's first inner step, as a synchronous relaunch (all learners at
    once, sharing the CPUs) waits for all of them. Decoupled: the median CPU seconds of a learner's start-up,
    which is what a relaunch takes in wall time with a core of its own (the harness gives it one, docs/chaos.md);
    its wall time when the learner did not report them."""
    incs = [i for i in calib.incarnations if i.first_step_at is not None]
    if not incs:
        return 0.0
    if sync:
        return max(i.first_step_at for i in incs) - min(i.launched_at for i in incs)
    cpu = [float(i.startup["cpu"]["total"]) for i in incs if isinstance(i.startup.get("cpu"), dict)
           and "total" in i.startup["cpu"]]
    return statistics.median(cpu) if cpu else statistics.median(i.first_step_at - i.launched_at for i in incs)


def forecast(opts: ChaosOptions, calib: FleetRun, nominal: dict[int, float], mode: str) -> dict[str, Any]:
    """The simulator's goodput for a fleet that has not run yet: its expectation (`localhost` profile) from
    what is known before the run. Measured in the calibration: step time (1 / nominal rate) and restart time
    (`calibration_restart_s`). From the options: the schedule's MTBF (every learner's MTBI, one "chip" per
    learner), down time, run length, H, P and checkpoint period. Defaults, since nothing before the run measures
    them: failure-free efficiency 1 (the calibration's own rate is the nominal one), merge latency 0, detection
    0 (the harness aborts a sync job at once). Nothing here comes from the faulty run."""
    from .simulate import SimParams, expected_goodput

    sync = mode == "sync"
    step_s = 1.0 / statistics.fmean(nominal.values())
    params = SimParams(step_s=step_s, inner_steps=opts.inner_steps, fragments=opts.fragments, detect_s=0.0,
                       downtime_s=opts.downtime_s, restart_s=calibration_restart_s(calib, sync), reconfig_s=0.0,
                       ckpt_interval_s=opts.checkpoint_every * step_s, ckpt_write_s=0.0, merge_latency_s=0.0,
                       horizon_s=opts.minutes * 60)
    mtbi = opts.mtbf_s if opts.mtbf_s > 0 else math.inf
    g = expected_goodput("dp" if sync else "decoupled", opts.peers, opts.peers, mtbi, params)
    return {"predicted_goodput": round(g, 4), "prediction_params": _rounded(params)}


def replay_goodput(run: FleetRun, opts: ChaosOptions, nominal: dict[int, float]) -> dict[str, Any]:
    """The simulator's goodput for this very fleet after the fact: its kill schedule replayed with the costs
    measured in this run.

    Measured inputs: step time (1 / nominal rate), restart time (process start to first inner step, the
    simulator's `restart_s`; its mean), failure-free step efficiency, and (decoupled)
    the work still unmerged at the end of the run, which sets L = H/2 steps + merge latency. Configured: down
    time, checkpoint period (checkpoint_every steps), H, P. Detection costs 0: the harness aborts a sync job at
    once. A check of the model, so none of the inputs is the goodput itself; not a prediction, since half of
    them come from the run it describes (that is `forecast`)."""
    from .simulate import SimParams, replay

    step_s = 1.0 / statistics.fmean(nominal.values())
    t0_wall = next(e["t"] for e in run.events if e["event"] == "fleet_up")
    failures: list[list[float]] = [[] for _ in range(opts.peers)]
    for e in run.events:
        if e["event"] in ("fault", "fault_while_down", "unexpected_exit"):
            failures[e["slot"]].append(e["t"] - t0_wall)
    sync = run.mode == "sync"
    merge_latency = 0.0 if sync else max(0.0, unmerged_at_end_s(run, opts.fragments, step_s)
                                         - opts.inner_steps / 2 * step_s)
    times = restart_times(run)  # the simulator charges every restart the same: their mean
    restart = sync_restart_s(run) if sync else statistics.fmean(times) if times else 0.0
    efficiency = min(1.0, step_efficiency(run, nominal))  # a hair above 1 is timing noise
    params = SimParams(step_s=step_s, inner_steps=opts.inner_steps, fragments=opts.fragments, detect_s=0.0,
                       downtime_s=opts.downtime_s, restart_s=restart, reconfig_s=0.0,
                       ckpt_interval_s=opts.checkpoint_every * step_s, ckpt_write_s=0.0,
                       merge_latency_s=merge_latency, sync_efficiency=efficiency, decoupled_efficiency=efficiency,
                       horizon_s=run.ended_at - run.started_at)
    g = replay("dp" if sync else "decoupled", opts.peers, failures, params)
    return {"replayed_goodput": round(g, 4), "replay_params": _rounded(params)}


def _rounded(params: Any) -> dict[str, Any]:
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in asdict(params).items()}


def run_chaos(opts: ChaosOptions, say: Callable[[str], None] = print) -> dict[str, Any]:
    out = Path(opts.out) if opts.out else Path(tempfile.mkdtemp(prefix="diloco-chaos-"))
    out.mkdir(parents=True, exist_ok=True)
    modes = MODES if opts.mode == "both" else (opts.mode,)
    specs = make_specs(out, opts)
    seconds = opts.minutes * 60
    faults = fault_schedule(opts.peers, seconds, opts.mtbf_s, opts.downtime_s, opts.seed, opts.owner_every,
                            opts.fragments)
    (out / "schedule.json").write_text(json.dumps({"options": _jsonable(opts), "faults": [asdict(f) for f in faults]},
                                                  indent=1))
    say(f"chaos: {opts.peers} learners, {opts.minutes:g} min per mode, MTBF {opts.mtbf_s:g} s, down time "
        f"{opts.downtime_s:g} s: {len(faults)} faults scheduled; output in {out}")

    from diloco.protocol.codecs import load_kernels

    load_kernels()  # a stale numba cache is rebuilt once, here, not by every learner at once (~6 s each): the
    # learners, and every restart, then only load the kernels from the cache on disk

    def fleet(mode: str, spec: str, workdir: str, **kw: Any) -> Fleet:
        return Fleet(mode, specs[spec], out / workdir, opts.peers, opts.pace_s, opts.checkpoint_every,
                     opts.eval_every, slowdown=opts.stragglers, throttle_mbit=opts.throttle, **kw)

    say(f"measuring the nominal rate: {opts.peers} standalone learners side by side for {opts.calibrate_s:g} s")
    calib = fleet("standalone", "decoupled", "standalone", standalone=True).run_for(opts.calibrate_s, [], 0.0)
    nominal = nominal_rates(calib)
    if len(nominal) != opts.peers:
        raise RuntimeError(f"calibration measured {len(nominal)} of {opts.peers} learners; see {out / 'standalone'}")
    say("nominal steps/s: " + ", ".join(f"{r:.2f}" for _, r in sorted(nominal.items())))
    for slot, held in short_of_pace(nominal, opts.pace_s, opts.stragglers).items():
        say(f"warning: learner {slot} held {held:.0%} of its pace in the calibration (the machine is short of "
            f"CPU); goodput is measured against that rate, and reads high if the fleets get more CPU later")

    forecasts = {mode: forecast(opts, calib, nominal, mode) for mode in modes}  # before any fleet runs
    say("predicted goodput: " + ", ".join(f"{m} {f['predicted_goodput']:.3f}" for m, f in forecasts.items()))

    runs: dict[str, FleetRun] = {}
    result: dict[str, Any] = {}
    for mode in modes:
        t = time.monotonic()
        say(f"running {mode} for {opts.minutes:g} min")
        runs[mode] = fleet(mode, mode, mode).run_for(seconds, faults, opts.downtime_s)
        result[mode] = summarize(runs[mode], opts.fragments, nominal)
        result[mode].update(forecasts[mode])
        result[mode].update(replay_goodput(runs[mode], opts, nominal))
        say(f"{mode}: {json.dumps(result[mode])}  ({time.monotonic() - t:.0f} s)")
    if opts.no_failure:
        say(f"running decoupled without faults for {opts.minutes:g} min (eval loss at equal tokens)")
        runs["no_failure"] = fleet("no_failure", "decoupled", "no_failure").run_for(seconds, [], opts.downtime_s)
        points = [(tok, loss) for _, tok, loss in runs["no_failure"].evals]
        at = result.get("decoupled", {}).get("merged_tokens")
        loss = gp.loss_at_tokens(points, at) if at is not None else None
        result["no_failure_eval_loss"] = round(loss, 4) if loss is not None else None
        result["no_failure"] = summarize(runs["no_failure"], opts.fragments, nominal)
    result["nominal_steps_per_s"] = {str(k): round(v, 3) for k, v in sorted(nominal.items())}
    result["out"] = str(out)
    (out / "summary.json").write_text(json.dumps(result, indent=1))
    _write_metrics(out, runs)
    try:
        from .chaos_plot import plot

        for path in plot(out, runs, nominal, opts.fragments):
            say(f"plot: {path}")
    except ImportError as e:
        say(f"no plots ({e.name} is missing): pip install 'diloco-node[plots]'")
    return result


def _write_metrics(out: Path, runs: dict[str, FleetRun]) -> None:
    """Per learner incarnation: what it reported (the input of every figure), one JSON line each."""
    with open(out / "metrics.jsonl", "w") as f:
        for mode, run in runs.items():
            for inc in run.incarnations:
                row = {k: v for k, v in asdict(inc).items() if k not in ("accepted", "progress")}
                f.write(json.dumps({"mode": mode, **row, "accepted_versions": len(inc.accepted)}) + "\n")


def _jsonable(opts: ChaosOptions) -> dict:
    d = asdict(opts)
    d["out"] = str(d["out"]) if d["out"] else None
    d["stragglers"] = {str(k): v for k, v in opts.stragglers.items()}
    d["throttle"] = {str(k): v for k, v in opts.throttle.items()}
    return d

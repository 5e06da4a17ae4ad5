"""Step-latency benchmark (issue 13): does the swarm make a learner's inner steps late, or stall them?

    python benchmarks/step_latency.py [--quick] [--json] [--inner-steps H] [--stop-s S]

Two learner processes (one torch thread each, on loopback), each holding a 100M-float32 stand-in model (8 equal
matrices, one per fragment: the 25M stand-in of benchmarks/swarm.py scaled up), int8 codec, quorum 2, loopback
membership timings (the tests' poll 0.5 s and watch 1 s; a member TTL of 10 s, refreshed every 2 s: longer than
the freeze of phase 3, so that the frozen learner is a slow owner, not a dead one; --member-ttl 4, the tests'
TTL, makes it a dead one, and on this 2-core machine also lets the two learners drop out of each other's view
in phase 2), H = 100 inner steps by default, the RunSpec's default (8 fragments: a 50 MB fragment goes out
every 12.5 steps; `--inner-steps 16`, a fragment every 2 steps, is a harsher load than a run would use). The inner step is paced at 50 ms: a little real work (a noise chunk added to a rotating 1/16 of every
matrix, as an optimizer step moves the parameters: a few ms), a sleep until 50 ms after the step started (the
stand-in for the accelerator's compute), then `learner.step()` (benchmarks/_step_latency_worker.py). Whatever
`step()` costs therefore adds to the step; nothing hides it.

A step's time is the wall time of one whole iteration of that loop, from the start of one inner step to the
start of the next: work + pacing sleep + `learner.step()` (50 ms plus however late the loop is). Its parts:
`in_step` (the time inside `learner.step()`), of which `apply` (new versions added into the model, a slice per
step: node/theta.py), `flatten` (a due fragment copied out of the model into a work buffer: by the
copier thread while training goes on, which also hands the snapshot to the loop; in the step only a fragment
of at most one slice is copied) and `lock` (waiting for the fragment store's lock: `store.take_changes` and `store.begin_send`, before a
delta goes out); `late` (how far past its 50 ms mark the loop
woke from its sleep: CPU contention, or work that overran the pace). `loop_lag` is measured apart, every 20 ms:
how long a callback scheduled on the swarm's event loop from another thread waits before it runs (anything
the loop thread does synchronously delays every message: a lag of seconds makes peers time out on each other).

Phases, all with the same two processes:
  1 standalone  no swarm (no Learner yet), both processes side by side, N steps each (after 10 warm-up steps)
  2 swarm       the first opens a swarm, the second joins it (peers=[the first's url]) before either steps;
                then both step, and are measured once every fragment has gone 3 versions further at both (the
                warm-up; cut at a time limit, the rounds made are reported), for N steps of each learner (or a
                time limit, whichever comes first)
  3 slow owner  one learner is frozen with SIGSTOP for S seconds (default 6: an unresponsive owner, whose
                deltas, pushes and replications hang for their 5 s deadline; with S > the member TTL it then
                turns into a dead one whose fragments the other takes over), then SIGCONT, and the swarm heals; the learner that keeps running is measured from
                the SIGSTOP until some seconds after the SIGCONT. The full mode does it twice, once each way.
--quick: N = 100, phase 2 at most 10 s, one freeze (about a minute); full: N = 800, at most 50 s, two freezes.

Keys of the last stdout line (steps in ms; percentiles pooled over the measured learners):
  standalone_p99_ms   p99 step time in phase 1 (both learners)
  swarm_p99_ms        p99 step time in phase 2 (both learners)
  slow_owner_p99_ms   p99 step time in phase 3 (the learner that kept running)
  max_stall_ms        the longest single step seen in phases 2 and 3 (measured learners only)
  ratio               swarm_p99_ms / standalone_p99_ms
  (targets: ratio <= 1.10, max_stall_ms <= 2 x standalone_p99_ms)
  *_p50_ms, *_steps   the medians and the step counts of each phase
  swarm_{in_step,apply,lock,flatten,late,runq}_p99_ms  the parts of phase 2's steps (runq: the training thread
                      waiting for a CPU, from its sleep's end to the end of learner.step(); standalone_runq_p99_ms
                      the same in phase 1)
  swarm_slowest_1pct_runq_share  of the slowest 1% of phase 2's steps, the share of their excess over the
                      standalone median that the training thread spent waiting for a CPU (both cores taken by
                      other threads: the kernel's scheduling on this 2-core machine, not work of the step)
  slow_owner_in_step_max_ms, slow_owner_late_max_ms  the parts of the longest step of phase 3
  swarm_rounds, slow_owner_rounds  outer rounds completed at the measured learners during the phase (fragment
                      versions gained / 8, mean over learners): how much the swarm really did meanwhile
  slow_owner_steps_during_stop  inner steps the running learner made while the other was frozen
  swarm_both_live, swarm_two_owners  fractions of phase 2's progress reports (every 0.5 s, both learners) in which
                      the learner saw both members live, and the 8 fragments split between two owners
  swarm_same_term_fragments  fragments whose versions at the end of phase 2 have the same term at both learners
                      (8: one lineage per fragment; fewer: each learner owned and published them on its own)
  swarm_cores_busy    CPU-seconds per second of both processes in phase 2 (out of the machine's 2 cores)
  other_processes_cores_busy  the most CPU the machine's other processes used in any phase (this machine is
                      shared: figures taken while others keep it busy are not comparable)
  swarm_loop_lag_p99_ms, swarm_loop_lag_max_ms, slow_owner_loop_lag_max_ms  the event loop's lag
Per-phase percentiles of every part, CPU per phase, the longest steps and the swarm counters are on stderr.
STEP_LATENCY_STACKS=N makes each worker print every thread's stack the first N times its loop lags > 0.5 s.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "NUMBA_NUM_THREADS": "1",
       "PYTHONUNBUFFERED": "1"}
PACE_S = 0.05
FRAGMENTS = 8
WARMUP_VERSIONS = 3  # phase 2 starts once every fragment has gone this many versions further at both learners
STANDALONE_WARMUP = 10  # steps of phase 1 not counted (first touches of the noise and the matrices)


def log(*a: object) -> None:
    print(*a, file=sys.stderr, flush=True)


def _die_with_parent() -> None:
    """Linux: the worker gets SIGKILL when this benchmark process dies, however it dies."""
    import ctypes

    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class Worker:
    """A worker process; its stdout JSON lines are read by a thread into a queue (progress lines kept last)."""

    def __init__(self, name: str, args: list[str]) -> None:
        self.name = name
        self.proc = subprocess.Popen([sys.executable, str(HERE / "_step_latency_worker.py"), *args],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=sys.stderr, text=True,
                                     env=ENV, cwd=HERE.parent, preexec_fn=_die_with_parent)
        self.events: queue.Queue[dict | None] = queue.Queue()
        self.progress: dict | None = None
        self.history: list[dict] = []  # every progress event
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            if not line.startswith("{"):
                continue
            ev = json.loads(line)
            if ev.get("event") == "progress":
                self.progress = ev
                self.history.append(ev)
            else:
                self.events.put(ev)
        self.events.put(None)

    def event(self, name: str, timeout: float = 120) -> dict:
        try:
            ev = self.events.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"{self.name} did not say {name!r} within {timeout:.0f}s") from None
        if ev is None:
            raise RuntimeError(f"{self.name} exited with {self.proc.wait()} before saying {name!r}")
        if ev.get("event") != name:
            raise RuntimeError(f"{self.name} said {ev} instead of {name!r}")
        return ev

    def send(self, line: str) -> None:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)  # (a stopped process takes SIGKILL too; this is for clarity)
            self.proc.kill()
        self.proc.wait()


def wait_until(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout:.0f}s for {what}")
        time.sleep(0.05)


def min_version(w: Worker) -> int:
    return w.progress["min_version"] if w.progress else -1


def steps_of(w: Worker) -> int:
    return w.progress["steps"] if w.progress else 0


def cpu_s(pid: int) -> tuple[float, float]:
    """CPU seconds (user + system) of the whole process and of its main thread (the training loop)."""
    tick = os.sysconf("SC_CLK_TCK")

    def read(path: str) -> float:
        with open(path) as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / tick

    return read(f"/proc/{pid}/stat"), read(f"/proc/{pid}/task/{pid}/stat")


def machine_busy_s() -> float:
    """CPU seconds the whole machine has been busy (not idle, not waiting for I/O), all processes."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return (sum(v[:8]) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK")


class CpuMeter:
    """CPU used by the workers between `start` and `stop`, per wall second (2.0 = both cores busy), and by
    every other process of the machine meanwhile (this machine is shared: others' load slows the workers)."""

    def __init__(self, workers: list[Worker]) -> None:
        self.workers = workers

    def start(self) -> None:
        self.t0, self.m0 = time.monotonic(), machine_busy_s()
        self.c0 = [cpu_s(w.proc.pid) for w in self.workers]

    def stop(self) -> dict[str, float]:
        wall = time.monotonic() - self.t0
        c1 = [cpu_s(w.proc.pid) for w in self.workers]
        total = sum(b[0] - a[0] for a, b in zip(self.c0, c1, strict=True)) / wall
        main = sum(b[1] - a[1] for a, b in zip(self.c0, c1, strict=True)) / wall
        others = (machine_busy_s() - self.m0) / wall - total
        return {"cores_busy": total, "training_threads": main, "other_threads": total - main,
                "other_processes": max(others, 0.0)}


class Records:
    """One worker's per-step records (see the worker's docstring), as numpy arrays; periods in seconds."""

    def __init__(self, path: Path) -> None:
        raw = json.loads(path.read_text())
        self.__dict__.update({k: np.asarray(v, dtype=np.float64) for k, v in raw.items()})
        # a step lasts from its start to the next one's start; the last step has no end and is dropped
        self.period = np.diff(self.start)
        self.lag_t = getattr(self, "lag_t", np.zeros(0))
        self.lag = getattr(self, "lag", np.zeros(0))

    def lags(self, t0: float, t1: float) -> np.ndarray:
        """The loop lags probed in [t0, t1], the wait included (a process frozen after t1 is not counted)."""
        return self.lag[(self.lag_t >= t0) & (self.lag_t + self.lag <= t1)]

    def window(self, t0: float, t1: float | None = None, n: int | None = None) -> np.ndarray:
        """Indices of the complete steps that lie within [t0, t1] (at most the first n of them): a step that was
        still running at t1 is not counted (at the end of phase 2 the frozen learner's last step lasts as long
        as the freeze)."""
        idx = np.nonzero(self.start[:-1] >= t0)[0]
        if t1 is not None:
            idx = idx[self.start[idx + 1] <= t1]
        if n is not None:
            idx = idx[:n]
        return idx


def ms(x: np.ndarray, q: float) -> float:
    return float(np.percentile(x, q) * 1000) if len(x) else float("nan")


def describe(phase: str, parts: dict[str, np.ndarray]) -> None:
    for name, x in parts.items():
        if len(x):
            log(f"  {phase:<11} {name:<8} n={len(x):<5} p50 {ms(x, 50):7.2f}  p90 {ms(x, 90):7.2f}  "
                f"p99 {ms(x, 99):7.2f}  max {float(x.max()) * 1000:8.2f} ms")


def pooled(recs: list[Records], idxs: list[np.ndarray], attr: str) -> np.ndarray:
    return np.concatenate([getattr(r, attr)[i] for r, i in zip(recs, idxs, strict=True)])


def run(tmp: Path, n_steps: int, swarm_cap_s: float, episodes: int, stop_s: float, recover_s: float,
        warmup_cap_s: float, settle_cap_s: float = 20.0) -> dict:
    spec = tmp / "run.spec"
    a = Worker("learner A", [str(spec), str(tmp / "a.json"), "--create"])
    b: Worker | None = None
    workers = [a]
    try:
        a.event("built", timeout=180)  # (A writes the spec before it says so: B reads it only when joining)
        b = Worker("learner B", [str(spec), str(tmp / "b.json")])
        workers.append(b)
        b.event("built", timeout=180)

        # -- phase 1: standalone, both side by side --------------------------------------------------------
        log(f"phase 1: {n_steps} standalone steps in each of the two processes")
        cpu = CpuMeter(workers)
        cpu.start()
        for w in workers:
            w.send(f"standalone {n_steps + STANDALONE_WARMUP + 1}")  # (n periods need n + 1 starts)
        for w in workers:
            w.event("standalone_done", timeout=n_steps * PACE_S * 4 + 60)
        cpu_of = {"standalone": cpu.stop()}
        alone = [Records(tmp / "a.json"), Records(tmp / "b.json")]
        alone_idx = [np.arange(STANDALONE_WARMUP, len(r.period)) for r in alone]

        # -- phase 2: the swarm ----------------------------------------------------------------------------
        t_open = time.monotonic()
        a.send("open")
        url = a.event("ready", timeout=120)["url"]
        b.send(f"join {url}")
        joined = b.event("ready", timeout=120)
        t_go = time.monotonic()
        for w in workers:  # both step from now on (a learner stepping alone would merge alone meanwhile)
            w.send("go")
        log(f"phase 2: B joined A at {url} in {joined['t'] - t_open:.1f}s; warming up")
        wait_until(lambda: a.progress and b.progress, 30, "progress from both learners")
        base = max(min_version(a), min_version(b))
        try:
            wait_until(lambda: min(min_version(a), min_version(b)) >= base + WARMUP_VERSIONS, warmup_cap_s,
                       f"{WARMUP_VERSIONS} outer rounds at both learners")
        except TimeoutError:  # measured anyway: the rounds made are reported (swarm_rounds)
            log(f"phase 2: warm-up cut at {warmup_cap_s:.0f}s, versions A {a.progress['versions']}, "
                f"B {b.progress['versions']}")
        t2 = time.monotonic()
        log(f"phase 2: warm-up done {t2 - joined['t']:.1f}s after the join; measuring {n_steps} steps each "
            f"(at most {swarm_cap_s:.0f}s)")
        s0 = (steps_of(a), steps_of(b))
        cpu.start()
        with contextlib.suppress(TimeoutError):
            wait_until(lambda: steps_of(a) >= s0[0] + n_steps + 2 and steps_of(b) >= s0[1] + n_steps + 2,
                       swarm_cap_s, "the steps of phase 2")
        t2_end = time.monotonic()
        cpu_of["swarm"] = cpu.stop()
        labels_end2 = (a.progress["versions"], b.progress["versions"])

        # -- phase 3: one learner frozen (slow, then dead, owner), the other measured ----------------------
        windows: list[tuple[str, float, float, float]] = []  # (measured worker, t0, resumed at, t1)
        pairs = [(b, a), (a, b)][:episodes]
        for k, (frozen, measured) in enumerate(pairs):
            if k:  # let the swarm settle first: every fragment moves on at both
                base = max(min_version(a), min_version(b))
                try:
                    wait_until(lambda base=base: min(min_version(a), min_version(b)) >= base + 2, settle_cap_s,
                               "the swarm to heal after the previous freeze")
                except TimeoutError:
                    log(f"phase 3: the swarm had not moved every fragment on by 2 versions after "
                        f"{settle_cap_s:.0f}s (A {a.progress['versions']}, B {b.progress['versions']}); going on")
            t3 = time.monotonic()
            log(f"phase 3: SIGSTOP {frozen.name} for {stop_s:.0f}s, measuring {measured.name}")
            cpu.start()
            frozen.signal(signal.SIGSTOP)
            time.sleep(stop_s)
            resumed = time.monotonic()
            frozen.signal(signal.SIGCONT)
            time.sleep(recover_s)
            windows.append((measured.name, t3, resumed, time.monotonic()))
            cpu_of[f"slow_owner_{k}"] = cpu.stop()
            log(f"phase 3: {frozen.name} resumed; versions since: A {a.progress['versions']}, "
                f"B {b.progress['versions']}")

        for w in workers:
            w.send("stop")
        done = {w.name: w.event("done", timeout=60) for w in workers}
        for name, ev in done.items():
            log(f"{name}: {ev['steps']} steps; shard {ev['shard']}; sync {ev['sync']}; due fragments whose "
                f"moves were applied at once after waiting {ev['settled_at_once']}")
        recs = {"learner A": Records(tmp / "a.json"), "learner B": Records(tmp / "b.json")}
    finally:
        for w in workers:
            w.stop()

    swarm_recs = list(recs.values())
    swarm_idx = [r.window(t2, t2_end, n=n_steps) for r in swarm_recs]
    slow_recs = [recs[name] for name, *_ in windows]
    slow_idx = [r.window(t0, t1) for r, (_, t0, _, t1) in zip(slow_recs, windows, strict=True)]
    during_stop = sum(len(r.window(t0, t_res)) for r, (_, t0, t_res, _) in zip(slow_recs, windows, strict=True))

    phases = {"standalone": (alone, alone_idx), "swarm": (swarm_recs, swarm_idx), "slow_owner": (slow_recs, slow_idx)}
    out: dict = {}
    log("step times (ms):")
    parts_of = {}
    for phase, (rs, ix) in phases.items():
        parts = {attr: pooled(rs, ix, attr)
                 for attr in ("period", "in_step", "apply", "lock", "flatten", "late", "work", "runq")}
        parts_of[phase] = parts
        describe(phase, parts)
        out[f"{phase}_p99_ms"] = ms(parts["period"], 99)
        out[f"{phase}_p50_ms"] = ms(parts["period"], 50)
        out[f"{phase}_steps"] = int(len(parts["period"]))
    sw, so = parts_of["swarm"], parts_of["slow_owner"]
    out["max_stall_ms"] = float(max(sw["period"].max(), so["period"].max()) * 1000)
    out["ratio"] = out["swarm_p99_ms"] / out["standalone_p99_ms"]
    for attr in ("in_step", "apply", "lock", "flatten", "late", "runq"):
        out[f"swarm_{attr}_p99_ms"] = ms(sw[attr], 99)
    out["standalone_runq_p99_ms"] = ms(parts_of["standalone"]["runq"], 99)
    # the slowest 1% of phase 2's steps (those that set its p99): how much of their excess over the standalone
    # median was the training thread waiting for a CPU
    slow = np.argsort(sw["period"])[-max(1, len(sw["period"]) // 100):]
    excess = float(np.sum(sw["period"][slow] - out["standalone_p50_ms"] / 1000))
    out["swarm_slowest_1pct_runq_share"] = float(np.sum(sw["runq"][slow]) / excess) if excess > 0 else 0.0
    worst = int(np.argmax(so["period"]))
    out["slow_owner_in_step_max_ms"] = float(so["in_step"][worst] * 1000)
    out["slow_owner_late_max_ms"] = float(so["late"][worst] * 1000)

    def rounds(rs: list[Records], ix: list[np.ndarray]) -> float:
        return float(np.mean([(r.versions[i[-1]] - r.versions[i[0]]) / FRAGMENTS for r, i in zip(rs, ix, strict=True)
                              if len(i)]))

    out["swarm_rounds"] = rounds(swarm_recs, swarm_idx)
    out["slow_owner_rounds"] = rounds(slow_recs, slow_idx)
    out["slow_owner_steps_during_stop"] = during_stop
    for phase, c in cpu_of.items():
        log(f"  CPU {phase}: {c['cores_busy']:.2f} of 2 cores busy (training threads {c['training_threads']:.2f}, "
            f"swarm and other threads {c['other_threads']:.2f}); other processes of the machine "
            f"{c['other_processes']:.2f}")
    # Did the two really train as one swarm? Each learner's view: both members live, fragments split between
    # two owners; and at the end of phase 2, the fragments both hold under the same term (one lineage).
    samples = [e for w in workers for e in w.history if t2 <= e["t"] <= t2_end]
    out["swarm_both_live"] = sum(e["live"] == 2 for e in samples) / max(len(samples), 1)
    out["swarm_two_owners"] = sum(e["owners"] == 2 for e in samples) / max(len(samples), 1)
    out["swarm_same_term_fragments"] = sum(x.split(".")[0] == y.split(".")[0] for x, y in zip(*labels_end2, strict=True))
    log(f"  phase 2: both members live in {out['swarm_both_live']:.0%} of the learners' views, fragments split "
        f"between two owners in {out['swarm_two_owners']:.0%}; at its end A {labels_end2[0]}, B {labels_end2[1]}")
    for w in workers:  # when each learner's view of the swarm changed, from the first step on
        changes, last = [], None
        for e in w.history:
            if (e["live"], e["owners"]) != last:
                last = (e["live"], e["owners"])
                changes.append(f"+{e['t'] - t_go:.1f}s: {e['live']} live, {e['owners']} owners")
        log(f"  {w.name}'s view (phase 2 from +{t2 - t_go:.1f}s to +{t2_end - t_go:.1f}s): " + "; ".join(changes))
    out["swarm_cores_busy"] = cpu_of["swarm"]["cores_busy"]
    out["other_processes_cores_busy"] = max(c["other_processes"] for c in cpu_of.values())
    lag2 = np.concatenate([r.lags(t2, t2_end) for r in swarm_recs])
    lag3 = np.concatenate([r.lags(t0, t1) for r, (_, t0, _, t1) in zip(slow_recs, windows, strict=True)])
    describe("swarm", {"loop_lag": lag2})
    describe("slow_owner", {"loop_lag": lag3})
    out["swarm_loop_lag_p99_ms"] = ms(lag2, 99)
    out["swarm_loop_lag_max_ms"] = float(lag2.max() * 1000) if len(lag2) else float("nan")
    out["slow_owner_loop_lag_max_ms"] = float(lag3.max() * 1000) if len(lag3) else float("nan")
    # the longest steps of phases 2-3, where they fell
    for phase, names, rs, ix in (("swarm", list(recs), swarm_recs, swarm_idx),
                                 ("slow_owner", [name for name, *_ in windows], slow_recs, slow_idx)):
        for name, r, i in zip(names, rs, ix, strict=True):
            if len(i):
                top = i[np.argsort(r.period[i])[-3:]][::-1]
                log(f"  {phase} {name}: longest steps " + ", ".join(
                    f"{r.period[j] * 1000:.0f} ms (in_step {r.in_step[j] * 1000:.0f}, apply {r.apply[j] * 1000:.0f},"
                    f" lock {r.lock[j] * 1000:.0f}, flatten {r.flatten[j] * 1000:.0f}, late {r.late[j] * 1000:.0f},"
                    f" runq {r.runq[j] * 1000:.0f}) at "
                    f"+{r.start[j] - r.start[i[0]]:.2f}s" for j in top))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="100 steps per phase, one freeze (about a minute)")
    ap.add_argument("--json", action="store_true", help="only the JSON line matters (it is always the last)")
    ap.add_argument("--stop-s", type=float, default=6.0, help="how long a learner is frozen in phase 3")
    ap.add_argument("--member-ttl", type=float, default=10.0, help="member record TTL in seconds (refreshed "
                    "every TTL/5); below --stop-s the frozen learner of phase 3 is taken for dead")
    ap.add_argument("--inner-steps", type=int, default=100, help="H of the RunSpec (default 100, the RunSpec's "
                    "default: a fragment every 12.5 steps); a smaller H means more swarm work per inner step")
    args = ap.parse_args()
    ENV["STEP_LATENCY_H"] = str(args.inner_steps)
    ENV["STEP_LATENCY_TTL_S"] = str(args.member_ttl)
    # (steps per phase, phase 2's time cap, freezes, seconds measured after a SIGCONT, warm-up's time cap)
    n_steps, swarm_cap_s, episodes, recover_s, warmup_cap_s = \
        (100, 10.0, 1, 3.0, 10.0) if args.quick else (800, 50.0, 2, 8.0, 30.0)
    with tempfile.TemporaryDirectory() as tmp:
        t = time.monotonic()
        out = run(Path(tmp), n_steps, swarm_cap_s, episodes, args.stop_s, recover_s, warmup_cap_s)
        log(f"total {time.monotonic() - t:.0f}s")
    log(f"ratio {out['ratio']:.3f} (target <= 1.10); max_stall_ms {out['max_stall_ms']:.1f} vs "
        f"2 x standalone p99 {2 * out['standalone_p99_ms']:.1f} (target: at most that)")
    print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in out.items()}))


if __name__ == "__main__":
    main()

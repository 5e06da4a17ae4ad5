"""Fault injection: a fleet of learner processes on this machine, killed and restarted on a seeded schedule.

`diloco-node chaos` runs the same fleet, on the same fault schedule, in two modes (docs/architecture.md §10):

- decoupled: the run as users run it; a killed learner comes back after the down time, resumes from its local
  checkpoint and re-downloads what changed; the others never wait for it.
- sync: the synchronous baseline in the same code (`RunSpec.synchronous`: quorum = every learner, no grace
  window, learners wait for their merges and checkpoint at a barrier). Like non-elastic data parallel, any
  failure aborts the job: every learner is killed, and after the down time all restart from their last
  checkpoint.

and a third time without faults, for the eval loss at equal tokens. Before that it measures the nominal step
rate: the same learners training standalone side by side (`join --standalone`), under the same CPU contention.

Every learner is paced to a fixed step time (`join --pace`), like an accelerator of fixed speed: on a shared
2-core machine a learner would otherwise speed up whenever a crashed neighbour frees CPU, and goodput would
count that as progress. Faults: per learner, exponential times between failures (mean `mtbf_s`, counted while
it is up), down for `downtime_s`; a share of them is aimed at whoever owns a fragment at that moment. Every
event goes to `events.jsonl`; goodput and the invariants are computed by `node/goodput.py` from the learners'
own reports.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from .checkpoint import CheckpointCorrupt, load_checkpoint
from .config import child_env
from .goodput import Incarnation, merged_tokens
from .throttle import ThrottleRelay

JOIN_WAIT_S = 120.0  # a learner that has not joined by then is a harness error
STOP_WAIT_S = 30.0  # after SIGINT: evaluate, print "done", exit


class ChaosError(Exception):
    """The harness could not run the fleet (a learner that never joined, a crash it cannot explain)."""


@dataclass(frozen=True)
class Fault:
    at: float  # seconds after the fleet is up
    slot: int  # the learner to kill (unless `owner_of` names a fragment whose owner is up)
    owner_of: int | None = None


def fault_schedule(peers: int, seconds: float, mtbf_s: float, downtime_s: float, seed: int,
                   owner_every: int = 3, fragments: int = 4) -> list[Fault]:
    """Per learner: up for Exp(mean mtbf_s), killed, down for downtime_s, again. Every `owner_every`-th fault
    (in time order; 0: none) is aimed at whoever owns a fragment then, instead of its scheduled learner."""
    rng = random.Random(seed)
    faults = []
    for slot in range(peers):
        t = 0.0
        while True:
            t += rng.expovariate(1.0 / mtbf_s) if mtbf_s > 0 else float("inf")
            if t >= seconds:
                break
            faults.append(Fault(round(t, 3), slot))
            t += downtime_s
    faults.sort(key=lambda f: f.at)
    return [Fault(f.at, f.slot, rng.randrange(fragments)) if owner_every and i % owner_every == owner_every - 1
            else f for i, f in enumerate(faults)]


@dataclass
class Slot:
    index: int
    key: Path
    ckpt_dir: Path
    proc: subprocess.Popen | None = None
    inc: Incarnation | None = None
    url: str = ""
    peer_id: str = ""
    restart_at: float | None = None
    port: int = 0  # fixed, so a restarted learner has the same address
    relay: ThrottleRelay | None = None  # a throttled link: other peers reach this learner through it

    @property
    def fixed_url(self) -> str:
        return f"http://127.0.0.1:{self.relay.port if self.relay else self.port}"


@dataclass
class FleetRun:
    """What one mode's run produced, for `goodput` and the report."""

    mode: str
    incarnations: list[Incarnation] = field(default_factory=list)
    events: list[dict] = field(default_factory=list)
    evals: list[tuple[float, float, float]] = field(default_factory=list)  # (t, fleet merged tokens, eval loss)
    started_at: float = 0.0  # the fleet is up: every learner joined
    ended_at: float = 0.0
    corrupt_checkpoints: set[str] = field(default_factory=set)
    failures: int = 0
    aborts: int = 0
    unexpected_exits: int = 0


class Fleet:
    """M learner processes of one run spec, started, killed and restarted by the harness."""

    def __init__(self, mode: str, spec: Path, workdir: Path, peers: int, pace_s: float, checkpoint_every: int,
                 eval_every: int, slowdown: dict[int, float] | None = None, standalone: bool = False,
                 throttle_mbit: dict[int, float] | None = None) -> None:
        self.mode, self.spec, self.workdir = mode, spec, workdir
        self.pace_s, self.checkpoint_every, self.eval_every = pace_s, checkpoint_every, eval_every
        self.slowdown, self.standalone = slowdown or {}, standalone
        workdir.mkdir(parents=True, exist_ok=True)
        from diloco.protocol.identity import Identity

        self.slots = []
        for i in range(peers):
            key = workdir.parent / f"learner-{i}.key"
            if not key.exists():
                Identity.generate().save(key)
            self.slots.append(Slot(i, key, workdir / f"ckpt-{i}", port=_free_port()))
        for i, mbit in (throttle_mbit or {}).items():
            if not standalone:
                s = self.slots[i]
                s.relay = ThrottleRelay(_free_port(), s.port, mbit * 1e6 / 8).start()
        self.run = FleetRun(mode)
        if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
            # started in the background by a shell: SIGINT is ignored and children would inherit that, and
            # never stop, evaluate and report at the end of the run
            signal.signal(signal.SIGINT, signal.default_int_handler)
        self.lock = threading.Lock()
        self._cpu_lock = threading.Lock()
        self.log = open(workdir / "events.jsonl", "a", buffering=1)  # noqa: SIM115 - closed in close()
        self.epoch = 0

    # -- processes ------------------------------------------------------------------------------------------

    def event(self, kind: str, **fields) -> None:
        ev = {"t": time.time(), "event": kind, "mode": self.mode, **fields}
        with self.lock:
            self.run.events.append(ev)
        self.log.write(json.dumps(ev) + "\n")

    def launch(self, slot: Slot, peers: list[str]) -> None:
        self._check_checkpoints(slot)
        cmd = [sys.executable, "-m", "diloco.node.cli", "join", "--run", str(self.spec),
               "--listen", f"127.0.0.1:{slot.port}", "--wait-for-peers", str(JOIN_WAIT_S / 2),
               "--key", str(slot.key), "--json", "--fast-membership", "--progress-every", "10",
               "--pace", str(self.pace_s), "--eval-every", str(self.eval_every)]
        if self.standalone:
            cmd.append("--standalone")
        else:
            cmd += ["--checkpoint-dir", str(slot.ckpt_dir), "--checkpoint-every", str(self.checkpoint_every)]
        for url in peers:
            cmd += ["--peers", url]
        if slot.relay is not None:
            cmd += ["--announce", slot.fixed_url]
        if slot.index in self.slowdown:
            cmd += ["--slowdown", str(self.slowdown[slot.index])]
        env = dict(child_env(os.environ), OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", NUMBA_NUM_THREADS="1",
                   PYTHONUNBUFFERED="1")
        with open(self.workdir / f"learner-{slot.index}.log", "ab") as err:
            slot.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=err, text=True,
                                         bufsize=1, env=env, start_new_session=True)
        slot.inc = Incarnation(slot.index, time.monotonic(), epoch=self.epoch)
        slot.restart_at = None
        with self.lock:
            self.run.incarnations.append(slot.inc)
        self.event("launch", slot=slot.index, pid=slot.proc.pid, peers=peers, epoch=self.epoch)
        threading.Thread(target=self._read, args=(slot, slot.inc, slot.proc), daemon=True).start()
        self.share_cpus()

    def _read(self, slot: Slot, inc: Incarnation, proc: subprocess.Popen) -> None:
        with open(self.workdir / f"learner-{slot.index}.jsonl", "a", buffering=1) as out:
            for line in proc.stdout:
                out.write(line)
                try:
                    ev = json.loads(line)
                except ValueError:
                    continue
                self._apply(slot, inc, ev)
                if ev.get("event") == "first_step":
                    self.share_cpus()

    def _apply(self, slot: Slot, inc: Incarnation, ev: dict) -> None:
        kind, now = ev.get("event"), time.monotonic()
        with self.lock:
            if kind == "joined":
                inc.joined_at = now
                inc.start_merged = inc.last_merged = int(ev.get("merged_steps", 0))
                inc.start_tokens = inc.last_tokens = int(ev.get("merged_tokens", 0))
                if slot.inc is inc:
                    slot.url, slot.peer_id = ev.get("url") or "standalone", ev.get("peer_id", "")
            if kind == "first_step":
                inc.first_step_at = now
                inc.startup = dict(ev.get("startup_s") or {})
            if kind in ("progress", "merged", "done"):
                inc.steps = int(ev.get("step", ev.get("steps", inc.steps)))
                inc.last_merged = int(ev.get("merged_steps", inc.last_merged))
                inc.last_tokens = int(ev.get("merged_tokens", inc.last_tokens))
                accepted = [tuple(a) for a in ev.get("accepted", [])]
                inc.accepted.extend(accepted)
                inc.accepted_at.extend([now] * len(accepted))
                inc.progress.append((now, inc.steps, inc.last_merged))
            if kind == "eval" or (kind == "done" and "eval_loss" in ev):
                fleet_tokens = self._fleet_merged_tokens()
                self.run.evals.append((now, fleet_tokens, float(ev["eval_loss"])))
            if kind == "done":
                inc.final_eval_loss = ev.get("eval_loss")

    def _fleet_merged_tokens(self) -> float:  # holds the lock
        return merged_tokens(self.run.incarnations, rollback=self.mode == "sync")

    def kill(self, slot: Slot, why: str) -> None:
        if slot.proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(slot.proc.pid, signal.SIGKILL)
        slot.proc.wait()
        slot.inc.ended_at, slot.inc.ended_by = time.monotonic(), why
        self.event("kill", slot=slot.index, pid=slot.proc.pid, why=why)
        slot.proc, slot.url = None, ""
        self.share_cpus()

    def share_cpus(self) -> None:
        """While some learners start and others train, the training ones run on all CPUs but the first k (k: the
        number starting, at most all CPUs but one); otherwise every learner may run anywhere.

        Each learner stands for a machine of its own, but here they share a few cores. A start-up (imports, numba,
        model, checkpoint, join: ~4.5 CPU seconds, one thread) would otherwise get 1/(M + 1) of the machine while
        the others train, and take several times longer than on a machine of its own (4 learners on 2 cores: 12 s
        instead of 5). This leaves it a core; the training learners share the others as before, equally."""
        cpus = sorted(_cpus())
        with self._cpu_lock:
            live = [(s.proc, s.inc) for s in self.slots]  # (each read once: other threads launch and kill)
            live = [(proc, inc) for proc, inc in live if proc is not None and inc is not None and proc.poll() is None]
            starting = sum(inc.first_step_at is None for _, inc in live)
            training = [proc for proc, inc in live if inc.first_step_at is not None]
            keep = min(starting, len(cpus) - 1) if training else 0
            for proc in training:
                _set_affinity(proc.pid, set(cpus[keep:]))

    def _check_checkpoints(self, slot: Slot) -> None:
        """Every checkpoint a learner left must load and verify (kill -9 may strike in the middle of a write)."""
        for path in sorted(slot.ckpt_dir.glob("step-*")) if slot.ckpt_dir.exists() else []:
            try:
                load_checkpoint(path)
            except CheckpointCorrupt as e:
                self.run.corrupt_checkpoints.add(str(path))
                self.event("corrupt_checkpoint", slot=slot.index, path=str(path), reason=e.reason)

    def up(self) -> list[Slot]:
        return [s for s in self.slots if s.proc is not None and s.url]

    def wait_joined(self, slots: list[Slot]) -> None:
        deadline = time.monotonic() + JOIN_WAIT_S
        while not all(s.url for s in slots):
            for s in slots:
                if s.proc is not None and s.proc.poll() is not None:
                    raise ChaosError(f"learner {s.index} exited with {s.proc.returncode} before joining: see "
                                     f"{self.workdir / f'learner-{s.index}.log'}")
            if time.monotonic() > deadline:
                raise ChaosError(f"learners {[s.index for s in slots if not s.url]} did not join in {JOIN_WAIT_S:.0f} s")
            time.sleep(0.05)

    def start_all(self, wait: bool = True) -> None:
        """Learner 0 opens the swarm (or resumes it from its checkpoint); the others, started at the same time,
        join through it."""
        first = self.slots[0]
        for s in self.slots:
            self.launch(s, [] if self.standalone or s is first else [first.fixed_url])
        if wait:
            self.wait_joined(self.slots)

    def owner_slot(self, p: int) -> Slot | None:
        """Who owns fragment p now, as a live learner sees it."""
        for s in self.up():
            try:
                with urllib.request.urlopen(s.url + "/v1/status", timeout=2) as r:
                    roles = json.loads(r.read())["fragments"][p]["roles"]
            except (OSError, ValueError, KeyError, IndexError):
                continue
            return next((o for o in self.up() if roles and o.peer_id == roles[0]), None)
        return None

    # -- one run --------------------------------------------------------------------------------------------

    def run_for(self, seconds: float, faults: list[Fault], downtime_s: float) -> FleetRun:
        try:
            self.start_all()
            t0 = self.run.started_at = time.monotonic()
            self.event("fleet_up", slots=[s.index for s in self.slots])
            pending = list(faults)
            while time.monotonic() < t0 + seconds:
                now = time.monotonic()
                while pending and t0 + pending[0].at <= now:
                    self._fault(pending.pop(0), downtime_s)
                self._restarts(now)
                self._reap_unexpected(downtime_s)
                time.sleep(0.02)
            self.run.ended_at = time.monotonic()
            self.event("end")
            self.stop()
        finally:
            for s in self.slots:
                self.kill(s, "cleanup")
                if s.relay is not None:
                    s.relay.stop()
                    self.event("throttled_link", slot=s.index, mbit=s.relay.rate * 8 / 1e6,
                               forwarded_bytes=s.relay.forwarded)
            self.log.close()
        for s in self.slots:
            self._check_checkpoints(s)
        return self.run

    def _fault(self, f: Fault, downtime_s: float) -> None:
        target = self.owner_slot(f.owner_of) if f.owner_of is not None else None
        target = target or self.slots[f.slot]
        self.run.failures += 1
        restart_at = time.monotonic() + downtime_s
        if target.proc is None:  # already down: the failure lengthens its down time
            self.event("fault_while_down", slot=target.index, scheduled=f.at)
        else:
            self.event("fault", slot=target.index, scheduled=f.at, owner_of=f.owner_of)
            self.kill(target, "fault")
        target.restart_at = max(target.restart_at or 0.0, restart_at)
        if self.mode == "sync":
            self._abort(target.restart_at)

    def _abort(self, restart_at: float) -> None:
        """Non-elastic: the whole job goes down and restarts, from its checkpoints, when the failed one can."""
        self.run.aborts += 1
        self.epoch += 1
        for s in self.slots:
            if s.proc is not None:
                self.kill(s, "abort")
            s.restart_at = max(s.restart_at or 0.0, restart_at)
        self.event("abort", epoch=self.epoch, restart_in=round(restart_at - time.monotonic(), 3))

    def _restarts(self, now: float) -> None:
        if self.mode == "sync":
            if all(s.proc is None and s.restart_at is not None and s.restart_at <= now for s in self.slots):
                self.start_all(wait=False)
            return
        for s in self.slots:
            if s.proc is None and s.restart_at is not None and s.restart_at <= now:
                up = [o.url for o in self.up()]
                self.launch(s, up or [o.fixed_url for o in self.slots if o is not s])

    def _reap_unexpected(self, downtime_s: float) -> None:
        """A learner that exits on its own is a finding: logged, and restarted like a failed one."""
        for s in self.slots:
            if s.proc is not None and s.proc.poll() is not None:
                rc = s.proc.returncode
                s.inc.ended_at, s.inc.ended_by = time.monotonic(), "exited"
                s.proc, s.url = None, ""
                self.run.unexpected_exits += 1
                self.event("unexpected_exit", slot=s.index, returncode=rc)
                self.share_cpus()
                s.restart_at = time.monotonic() + downtime_s
                if self.mode == "sync":
                    self._abort(s.restart_at)

    def stop(self) -> None:
        """SIGINT: every learner stops, evaluates and prints "done"; the stragglers are killed."""
        live = [s for s in self.slots if s.proc is not None]
        for s in live:
            with contextlib.suppress(ProcessLookupError):
                os.kill(s.proc.pid, signal.SIGINT)
        deadline = time.monotonic() + STOP_WAIT_S
        while live and time.monotonic() < deadline:  # (each one's end when it ends: the invariants ask who was
            for s in [s for s in live if s.proc.poll() is not None]:  # up when, to the tenth of a second)
                s.inc.ended_at, s.inc.ended_by = time.monotonic(), "finished"
                s.proc = None
                live.remove(s)
            time.sleep(0.05)
        time.sleep(0.2)  # the reader threads drain the last lines


def _cpus() -> set[int]:
    """The CPUs this process may run on (all of them where the OS cannot say)."""
    try:
        return os.sched_getaffinity(0)
    except AttributeError:  # not Linux
        return set(range(os.cpu_count() or 1))


def _set_affinity(pid: int, cpus: set[int]) -> None:
    """Every thread of process `pid` (Linux sets affinity per thread; new threads inherit their creator's)."""
    if not hasattr(os, "sched_setaffinity"):
        return
    try:
        threads = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        threads = [pid]
    for tid in threads:
        with contextlib.suppress(OSError):  # it exited meanwhile
            os.sched_setaffinity(tid, cpus)


def _free_port() -> int:
    with contextlib.closing(socket.socket()) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

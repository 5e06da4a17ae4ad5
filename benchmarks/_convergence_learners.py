"""The DiLoCo side of benchmarks/convergence.py: M `diloco-node join` processes on loopback, followed through
their JSON events until each has printed "done"; every process is killed and reaped before `run_diloco` returns."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

JOIN_WAIT_S = 120.0


class LearnerProcess:
    """One `join` process: its JSON events arrive through a reader thread; stderr goes to a log file."""

    def __init__(self, index: int, cmd: list[str], log_file: Path, events: queue.Queue) -> None:
        self.index, self.log_file = index, log_file
        env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", NUMBA_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        with open(log_file, "ab") as err:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=err,
                                         text=True, bufsize=1, env=env, start_new_session=True)
        self.joined: dict[str, Any] | None = None
        self.done: dict[str, Any] | None = None
        self.progress: list[dict[str, Any]] = []
        self.eof = False
        self.thread = threading.Thread(target=self._read, args=(events,), daemon=True, name=f"learner-{index}")
        self.thread.start()

    def _read(self, events: queue.Queue) -> None:
        try:
            for line in self.proc.stdout:
                events.put((self.index, line))
        except (OSError, ValueError):
            pass
        finally:
            events.put((self.index, None))

    def apply(self, line: str | None) -> None:
        if line is None:
            self.eof = True
            return
        try:
            ev = json.loads(line)
        except ValueError:
            return
        kind = ev.get("event") if isinstance(ev, dict) else None
        if kind == "joined":
            self.joined = ev
        elif kind == "progress":
            self.progress.append(ev)
        elif kind == "done":
            self.done = ev

    def tail(self, n: int = 15) -> str:
        with contextlib.suppress(OSError):
            lines = self.log_file.read_text(errors="replace").splitlines()[-n:]
            return "\n".join(f"  learner {self.index} | {x}" for x in lines)
        return ""

    def stop(self) -> None:
        """SIGKILL if still running, then reap (by pid: only the process this object started)."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)
        with contextlib.suppress(OSError):
            self.proc.stdout.close()
        self.thread.join(timeout=2)


def run_diloco(steps: int, learners: int, workdir: Path, progress_every: int, timeout_s: float,
               run_fields: dict[str, Any], log: Callable[..., None]) -> dict[str, Any]:
    """Start `learners` join processes at the default RunSpec plus `run_fields` and follow them until each
    has printed "done"."""
    from diloco.node.train import new_run
    from diloco.protocol.identity import Identity

    workdir.mkdir(parents=True, exist_ok=True)
    genesis = new_run(Identity.generate(), f"convergence-{time.strftime('%Y%m%d-%H%M%S')}", **run_fields)
    spec_path = genesis.save(workdir / "run.spec")
    s = genesis.spec
    spec = {"task": s.task, "fragments": s.fragments, "inner_steps": s.inner_steps, "quorum": s.quorum,
            "codec": s.codec, "outer_lr": s.outer_lr, "outer_momentum": s.outer_momentum, "grace_gamma": s.grace_gamma,
            "overlap": s.overlap, "grace_cap_s": s.grace_cap_s, "max_staleness": s.max_staleness}
    log(f"DiLoCo run {s.name}: " + ", ".join(f"{k} {v}" for k, v in spec.items()))

    def command(i: int, bootstrap: str | None) -> list[str]:
        key = Identity.generate().save(workdir / f"learner-{i}.key", overwrite=True)
        cmd = [sys.executable, "-m", "diloco.node.cli", "join", "--run", str(spec_path), "--listen", "127.0.0.1:0",
               "--steps", str(steps), "--json", "--fast-membership", "--progress-every", str(progress_every),
               "--key", str(key)]
        return cmd + (["--peers", bootstrap] if bootstrap else [])

    events: queue.Queue = queue.Queue()
    procs: list[LearnerProcess] = []

    def pump(timeout: float) -> None:
        with contextlib.suppress(queue.Empty):
            index, line = events.get(timeout=timeout)
            procs[index].apply(line)
            while True:
                index, line = events.get_nowait()
                procs[index].apply(line)

    def check_alive() -> None:
        for p in procs:
            if p.eof and p.done is None:
                p.proc.wait(timeout=10)
                raise RuntimeError(f"learner {p.index} exited (code {p.proc.returncode}) before finishing:\n{p.tail()}")

    t0 = time.monotonic()
    try:
        procs.append(LearnerProcess(0, command(0, None), workdir / "learner-0.log", events))
        while procs[0].joined is None:
            pump(0.25)
            check_alive()
            if time.monotonic() - t0 > JOIN_WAIT_S:
                raise RuntimeError(f"learner 0 printed no 'joined' event in {JOIN_WAIT_S:.0f}s:\n{procs[0].tail()}")
        url = procs[0].joined["url"]
        for i in range(1, learners):
            procs.append(LearnerProcess(i, command(i, url), workdir / f"learner-{i}.log", events))
        last_report = time.monotonic()
        while not all(p.done is not None for p in procs):
            pump(0.5)
            check_alive()
            if time.monotonic() - t0 > timeout_s:
                behind = [f"{p.index} (step {p.progress[-1]['step'] if p.progress else 0})" for p in procs if p.done is None]
                raise RuntimeError(f"the learners did not finish in {timeout_s:.0f}s; still running: {', '.join(behind)}")
            if time.monotonic() - last_report > 15:
                last_report = time.monotonic()
                log(f"  [{time.monotonic() - t0:5.0f}s] " + "  ".join(
                    f"L{p.index} step {p.progress[-1]['step']} loss {p.progress[-1]['loss']:.3f} v{p.progress[-1]['versions']}"
                    if p.progress else f"L{p.index} starting" for p in procs))
        wall_s = time.monotonic() - t0
    finally:
        for p in procs:
            p.stop()
    return {"wall_s": wall_s, "done": [p.done for p in procs], "progress": [p.progress for p in procs],
            "join_s": [p.joined["join_s"] for p in procs if p.joined], "spec": spec}

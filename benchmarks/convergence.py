"""Convergence benchmark: Decoupled DiLoCo (M real learner processes) vs synchronous data parallel, same tokens.

    python benchmarks/convergence.py [--quick] [--json] [--steps S] [--learners M]

What is compared, on the built-in synthetic Markov task ("markov": tiny GPT, batch B = 16 sequences of T = 64
tokens, AdamW at a constant lr as in `diloco-node join`):

* DiLoCo: M (default 4) `diloco-node join` processes on loopback, one torch thread each (OMP_NUM_THREADS=1),
  each with its own fresh key, at the DEFAULT RunSpec (P=4 fragments, H=100 inner steps, int8 codec, quorum 2,
  outer Nesterov lr 0.7 momentum 0.9; only the run's name is set). The first opens the swarm, the others join
  through its URL; each trains S inner steps at batch B on its own data stream and evaluates its live model at
  the end. DiLoCo's loss is the mean over learners of their "done" eval_loss (at the end the live models are
  within H steps of the last merged version of each fragment).
* Data parallel: one model in this process, the same init (same task seed), the same inner optimizer and lr,
  batch M·B (one batch from each of M data streams `task.batches(learner=i)`, i < M, concatenated), S steps:
  the same total tokens M·S·B·T. It runs AFTER the learners have finished, so it takes no CPU from them.

Both are evaluated with `evaluate(model, task)` on the task's fixed held-out batches; the Markov source's entropy
rate (the loss of the true chain, no model does better) is reported as the floor. The last line of stdout is one
JSON object: {"dp_eval_loss", "diloco_eval_loss", "entropy_floor", "parity", "tokens", ...} with
parity = diloco_eval_loss / dp_eval_loss (target: <= 1.03 at the default steps; not expected at --quick) and
tokens the total training tokens of each side. Human-readable lines go to stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import queue
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

TASK = "markov"
PARITY_TARGET = 1.03
FULL_STEPS = 1000
QUICK_STEPS = 100
JOIN_WAIT_S = 120.0


def log(*a: object) -> None:
    print(*a, file=sys.stderr, flush=True)


class Learner:
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
            return "\n".join(f"  learner {self.index} | {x}" for x in self.log_file.read_text(errors="replace").splitlines()[-n:])
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
               run_fields: dict[str, Any] | None = None) -> dict[str, Any]:
    """Start `learners` join processes at the default RunSpec (plus `run_fields`, for experiments only) and
    follow them until each has printed "done"; every process is killed and reaped before this returns."""
    from diloco.node.train import new_run
    from diloco.protocol.identity import Identity

    genesis = new_run(Identity.generate(), f"convergence-{time.strftime('%Y%m%d-%H%M%S')}", **(run_fields or {}))
    spec_path = genesis.save(workdir / "run.spec")
    s = genesis.spec
    log(f"DiLoCo run {s.name}: task {s.task}, P={s.fragments}, H={s.inner_steps}, quorum {s.quorum}, codec "
        f"{s.codec}, outer lr {s.outer_lr} momentum {s.outer_momentum}, max staleness {s.max_staleness}")

    def command(i: int, bootstrap: str | None) -> list[str]:
        key = Identity.generate().save(workdir / f"learner-{i}.key", overwrite=True)
        cmd = [sys.executable, "-m", "diloco.node.cli", "join", "--run", str(spec_path), "--listen", "127.0.0.1:0",
               "--steps", str(steps), "--json", "--fast-membership", "--progress-every", str(progress_every),
               "--key", str(key)]
        return cmd + (["--peers", bootstrap] if bootstrap else [])

    events: queue.Queue = queue.Queue()
    procs: list[Learner] = []

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
        procs.append(Learner(0, command(0, None), workdir / "learner-0.log", events))
        while procs[0].joined is None:
            pump(0.25)
            check_alive()
            if time.monotonic() - t0 > JOIN_WAIT_S:
                raise RuntimeError(f"learner 0 printed no 'joined' event in {JOIN_WAIT_S:.0f}s:\n{procs[0].tail()}")
        url = procs[0].joined["url"]
        for i in range(1, learners):
            procs.append(Learner(i, command(i, url), workdir / f"learner-{i}.log", events))
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
            "join_s": [p.joined["join_s"] for p in procs if p.joined]}


def run_dp(steps: int, learners: int) -> dict[str, Any]:
    """Synchronous data parallel in this process: batch learners·B from learners streams, same init and AdamW."""
    import torch

    from diloco.node.tasks import evaluate, make_task

    torch.set_num_threads(min(2, os.cpu_count() or 1))  # the learners are done: use the cores they left
    task = make_task(TASK, seed=0)
    model = task.build_model()
    opt = task.optimizer(model)
    streams = [task.batches(learner=i) for i in range(learners)]
    t0, tokens, curve = time.monotonic(), 0, []
    for step in range(1, steps + 1):
        xs, ys = zip(*(next(s) for s in streams), strict=True)
        x, y = torch.cat(xs), torch.cat(ys)
        _, loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        tokens += x.numel()
        if step % max(steps // 6, 1) == 0 or step == steps:
            curve.append((step, evaluate(model, task)))
            log(f"  DP step {step}/{steps}: eval loss {curve[-1][1]:.4f} ({time.monotonic() - t0:.0f}s)")
    return {"eval_loss": curve[-1][1], "tokens": tokens, "wall_s": time.monotonic() - t0, "curve": curve}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help=f"{QUICK_STEPS} steps (under a minute; parity not expected)")
    ap.add_argument("--json", action="store_true", help="only the JSON line on stdout (it is always the last line)")
    ap.add_argument("--steps", type=int, default=None, help=f"S: inner steps per learner (default {FULL_STEPS})")
    ap.add_argument("--learners", type=int, default=4, help="M: learner processes (default 4)")
    ap.add_argument("--timeout", type=float, default=900.0, help="give up on the learners after this many seconds")
    ap.add_argument("--workdir", type=Path, default=None, help="keep the run spec, keys and learner logs here")
    args = ap.parse_args()
    steps = args.steps or (QUICK_STEPS if args.quick else FULL_STEPS)
    if steps < 1 or args.learners < 1:
        ap.error("--steps and --learners must be at least 1")

    from diloco.node.tasks import make_task

    task = make_task(TASK, seed=0)
    floor = task.data.entropy_rate_nats()
    B, T = task.batch_size, task.context
    log(f"convergence: {args.learners} DiLoCo learner processes × {steps} steps × batch {B}×{T} vs data parallel "
        f"{steps} steps × batch {args.learners * B}×{T}, task {TASK}, entropy floor {floor:.4f} nats")

    t_start = time.monotonic()
    tmp = None if args.workdir else tempfile.TemporaryDirectory(prefix="diloco-convergence-")
    workdir = args.workdir or Path(tmp.name)
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        dl = run_diloco(steps, args.learners, workdir, progress_every=max(steps // 20, 1), timeout_s=args.timeout)
    finally:
        if tmp is not None:
            tmp.cleanup()
    done = dl["done"]
    evals = [d["eval_loss"] for d in done]
    diloco_loss = statistics.fmean(evals)
    diloco_tokens = sum(int(d["tokens"]) for d in done)
    log(f"DiLoCo: {args.learners} learners done in {dl['wall_s']:.1f}s (join {max(dl['join_s']):.1f}s); eval losses "
        + ", ".join(f"{e:.4f}" for e in evals) + f"; mean {diloco_loss:.4f}")
    for i, d in enumerate(done):
        log(f"  learner {i}: {d['steps']} steps in {d['train_s']:.1f}s, outer steps {d['outer_steps']}, versions "
            f"{' '.join(d['versions'])}, sent steps {d['sent_steps']}, overwritten steps {d['overwritten_steps']}, "
            f"shard {d.get('shard', {})}, sync {d.get('sync', {})}")

    log(f"data parallel: {steps} steps at batch {args.learners * B}×{T}, after the learners finished")
    dp = run_dp(steps, args.learners)
    log(f"data parallel: eval loss {dp['eval_loss']:.4f} in {dp['wall_s']:.1f}s")

    parity = diloco_loss / dp["eval_loss"]
    if diloco_tokens != dp["tokens"]:
        log(f"warning: DiLoCo trained {diloco_tokens} tokens, data parallel {dp['tokens']}")
    excess = (diloco_loss - floor) / max(dp["eval_loss"] - floor, 1e-9)
    met = parity <= PARITY_TARGET
    log(f"result: DiLoCo {diloco_loss:.4f} vs data parallel {dp['eval_loss']:.4f} at {dp['tokens']} tokens each "
        f"(floor {floor:.4f}): parity {parity:.4f} ({'meets' if met else 'misses'} the target <= {PARITY_TARGET}"
        f"{', not expected at --quick' if args.quick else ''}); excess over the floor ×{excess:.2f}; "
        f"total {time.monotonic() - t_start:.0f}s")
    result = {"dp_eval_loss": dp["eval_loss"], "diloco_eval_loss": diloco_loss, "entropy_floor": floor,
              "parity": parity, "tokens": dp["tokens"], "diloco_tokens": diloco_tokens, "steps": steps,
              "learners": args.learners, "parity_met": met, "diloco_wall_s": dl["wall_s"], "dp_wall_s": dp["wall_s"]}
    if not args.json:
        print(f"parity {parity:.4f}: DiLoCo {diloco_loss:.4f} vs data parallel {dp['eval_loss']:.4f}, floor {floor:.4f}")
    print(json.dumps(result), flush=True)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # SIGTERM unwinds like Ctrl-C, so the finally blocks reap the learners


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        main()
    except KeyboardInterrupt:
        log("interrupted: every learner process was stopped")
        sys.exit(130)

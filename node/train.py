"""The built-in training loop behind `diloco-node join`: a task from the RunSpec, a Learner, progress lines.

This is an ordinary user of the Python API (`Learner`), the same loop an example script would write.
Two options exist for the fault-injection harness (`node/chaos.py`): `pace_s` makes every inner step last at
least that long, like an accelerator of fixed speed, so a learner does not speed up when a crashed neighbour
frees CPU on a shared machine; `standalone` trains the same loop without any swarm (the nominal step rate of
docs/architecture.md §10).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from diloco.coordinator.runspec import Genesis, RunSpec, codec_defaults
from diloco.protocol.identity import Identity

from . import preempt
from .learner import Learner, create_run
from .swarm import SwarmConfig
from .tasks import CorpusError, Task, evaluate, make_task

if TYPE_CHECKING:
    from .live import LearnerView

log = logging.getLogger(__name__)


def task_of(spec: RunSpec, data: str | None = None) -> Task:
    """The run's task, optionally on the learner's own data (`--data file:PATH`), same model and seed."""
    task = make_task(spec.task, seed=spec.seed, **spec.model)
    if data is not None and data != spec.task:
        own = make_task(data, seed=spec.seed)  # (only its data is used)
        if own.data.vocab_size != task.data.vocab_size:
            raise CorpusError(f"--data {data} has vocabulary {own.data.vocab_size}, the run's model {task.data.vocab_size}")
        task.data = own.data
    return task


def new_run(creator: Identity, name: str, **fields: Any) -> Genesis:
    """A signed RunSpec of a built-in task, pinned to the task's model (see `learner.create_run`)."""
    return create_run(creator, name, task_of(RunSpec(name, **codec_defaults(fields))).build_model(), **fields)


@dataclass
class TrainOptions:
    steps: int = 0  # 0: until interrupted
    data: str | None = None
    device: str = "cpu"
    progress_every: int = 10
    eval_every: int = 0
    json: bool = False
    checkpoint_dir: Path | None = None
    checkpoint_every: int = 0
    slowdown: float = 1.0  # straggler emulation: sleep (slowdown − 1) × step time after each step
    pace_s: float = 0.0  # every inner step lasts at least this long (an emulated fixed-speed chip)
    standalone: bool = False  # no swarm: the same loop alone (nominal steps/s)
    fsdp: bool = False  # under torchrun: FSDP2 shards instead of DDP replicas (node/train_ranks.py)
    drain_s: float = 25.0  # SIGTERM, SIGINT or a metadata notice: drain within this long (node/preempt.py)
    preemption_notice: str | None = None  # "aws" or "gcp": also poll that cloud's metadata for a notice
    metadata_url: str | None = None  # the metadata endpoint's base URL (tests: a fake one on loopback)
    precision: str = "fp32"  # "bf16": the forward under bf16 autocast (parameters, θ and the swarm stay fp32)
    out: Path | None = None  # `join --out DIR`: every event also as a JSON line in DIR/events.jsonl
    view: LearnerView | None = None  # a terminal's live view (node/live.py `join_view`): it draws the progress

    @property
    def records(self) -> bool:
        """Events for a program (JSON on stdout, or --out): they carry the version moves too."""
        return self.json or self.out is not None


def emit(opts: TrainOptions, event: str, **fields: Any) -> None:
    line = json.dumps({"event": event, "t": time.time(), **fields}) if opts.records else ""
    if opts.out is not None:  # opened per event: a learner killed at any moment leaves whole lines behind
        with open(opts.out / "events.jsonl", "a") as f:
            f.write(line + "\n")
    if opts.json:  # (one write: an unbuffered print writes the newline apart, and a log line on a shared
        sys.stdout.write(line + "\n")  # stderr could land between the two, spoiling the JSON line)
        sys.stdout.flush()
    else:
        body = " ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}" for k, v in fields.items()
                        if k != "accepted")  # (version moves: machine data, in the JSON lines only)
        if opts.view is not None:  # (progress into the live view; any other event printed above it)
            opts.view.feed(event, fields, f"[{event}] {body}")
        else:
            print(f"[{event}] {body}", flush=True)


def process_age_s() -> float | None:
    """Seconds since this process started (Linux: /proc, 10 ms resolution); None where unknown."""
    try:
        with open("/proc/self/stat", "rb") as f:
            start_ticks = int(f.read().rsplit(b")", 1)[1].split()[19])  # field 22, starttime
        with open("/proc/uptime", "rb") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


class Startup:
    """Where a learner's start-up went, from process start to its first inner step, reported in its "first_step"
    event: wall seconds per phase (`imports`: the interpreter and every import before `train` is called), their
    `total`, and under `cpu` the same phases in CPU seconds of the whole process (CPU ÷ wall: the share of a
    core it had)."""

    def __init__(self) -> None:
        age = process_age_s()
        self._t, self._c = time.monotonic(), _cpu_s()
        self._t0 = self._t - (age or 0.0)
        self.wall: dict[str, float] = {"imports": round(age, 3)} if age is not None else {}
        self.cpu: dict[str, float] = {"imports": round(self._c, 3)} if age is not None else {}

    def mark(self, phase: str) -> None:
        now, cpu = time.monotonic(), _cpu_s()
        self.wall[phase], self.cpu[phase] = round(now - self._t, 3), round(cpu - self._c, 3)
        self._t, self._c = now, cpu

    def report(self) -> dict[str, Any]:
        return {**self.wall, "total": round(self._t - self._t0, 3),
                "cpu": {**self.cpu, "total": round(self._c, 3)}}


def _cpu_s() -> float:
    times = os.times()
    return times.user + times.system


def train(genesis: Genesis, identity: Identity, config: SwarmConfig, opts: TrainOptions) -> dict[str, Any]:
    """Join the run and train until `opts.steps`; returns the summary it also emits. Under torchrun, the
    ranks of one learner (node/train_ranks.py)."""
    from .train_ranks import train_ranks, world_size

    if world_size() > 1 and not opts.standalone:
        return train_ranks(genesis, identity, config, opts)
    startup = Startup()
    torch.set_num_threads(1)
    spec = genesis.spec
    task = task_of(spec, opts.data)
    model = task.build_model().to(opts.device)
    optimizer = task.optimizer(model)
    startup.mark("model")
    if opts.standalone:
        return _train_alone(spec, task, model, optimizer, identity, opts, startup)
    learner = Learner(model, optimizer, genesis, identity=identity, config=config,
                      checkpoint_dir=opts.checkpoint_dir, checkpoint_every=opts.checkpoint_every)
    startup.mark("learner")  # numba kernels, fragment plan, anchor memory
    t0 = time.monotonic()
    learner.start()
    startup.mark("join")  # checkpoint load, DHT bootstrap, members, fragment downloads
    store = learner.swarm.store
    if opts.records:
        store.record_versions()  # report every version this learner moves to (the chaos harness checks them)
    emit(opts, "joined", peer_id=identity.peer_id, url=learner.swarm.url, join_s=time.monotonic() - t0,
         step=learner.t, versions=[str(v) for v in learner.labels], merged_steps=store.merged_steps,
         merged_tokens=store.merged_tokens, tokens=learner.tokens)
    shard = int.from_bytes(hashlib.sha256(identity.public_key).digest()[:4], "big")
    batches = task.batches(learner=shard, seed=spec.seed + learner.t)
    start, losses, reported = time.monotonic(), [], store.merged_steps
    storage_error: str | None = None  # the last checkpoint failure reported (a full disk: training goes on)
    notice = preempt.Notice()
    unwatch = preempt.watch(notice, opts.preemption_notice, opts.metadata_url)
    try:
        while (not opts.steps or learner.t < opts.steps) and not notice.requested:
            step_start = time.monotonic()
            loss = _inner_step(task, model, optimizer, batches, opts)
            learner.step(tokens=task.tokens_per_batch, loss=loss)
            losses.append(loss)
            if opts.view is not None:
                opts.view.poll(learner.status)
            if startup is not None:
                startup.mark("first_step")
                emit(opts, "first_step", step=learner.t, startup_s=startup.report())
                startup = None
            _pace(opts, step_start)
            if opts.records and store.merged_steps != reported and learner.t % opts.progress_every:
                # a version merged our delta: say so now (a learner killed before its next progress line
                # would otherwise take these merges with it)
                emit(opts, "merged", step=learner.t, merged_steps=store.merged_steps,
                     merged_tokens=store.merged_tokens, accepted=store.take_accepted())
            reported = store.merged_steps
            if learner.checkpoint_error != storage_error:
                storage_error = learner.checkpoint_error
                if storage_error is not None:
                    emit(opts, "checkpoint_failed", step=learner.t, error=storage_error,
                         last_checkpoint_step=learner.last_checkpoint_step)
            if learner.t % opts.progress_every == 0:
                st = learner.swarm
                emit(opts, "progress", step=learner.t, loss=_mean(losses[-opts.progress_every:]),
                     tokens=learner.tokens, versions=sum(v.version for v in learner.labels),
                     peers=len(st.members.live()), bytes=sum(st.bytes_total().values()),
                     steps_per_s=1 / st.progress.step_time_s if st.progress.step_time_s else 0.0,
                     merged_steps=store.merged_steps, merged_tokens=store.merged_tokens,
                     **({"accepted": store.take_accepted()} if opts.records else {}))
            if opts.eval_every and learner.t % opts.eval_every == 0:
                learner.swarm.progress.eval_loss = evaluate(model, task)  # (in /v1/status and /metrics)
                emit(opts, "eval", step=learner.t, eval_loss=learner.swarm.progress.eval_loss, tokens=learner.tokens,
                     merged_tokens=store.merged_tokens)
    except KeyboardInterrupt:
        pass
    drained = _drain(learner, opts, notice) if notice.requested else None
    summary = {
        "peer_id": identity.peer_id,
        "steps": learner.t,
        "params": sum(p.numel() for p in model.parameters()),
        "tokens": learner.tokens,
        "final_loss": _mean(losses[-20:]),
        "eval_loss": evaluate(model, task),
        "global_eval_loss": evaluate(learner.global_model(), task),  # every fragment at its anchor
        "outer_steps": sum(learner.swarm.shard.outer_steps) if learner.swarm.shard else 0,
        # median seconds of this peer's published rounds: deltas taken -> version pushed to every learner
        "owner_round_s": statistics.median(learner.swarm.shard.round_s) if learner.swarm.shard and
        learner.swarm.shard.round_s else None,
        "versions": [str(v) for v in learner.labels],
        "bytes": learner.swarm.bytes_total(),
        "bytes_by_route": learner.swarm.bytes_by_route(),
        "sent_steps": learner.sent_steps,
        "merged_steps": store.merged_steps,
        "merged_tokens": store.merged_tokens,
        "overwritten_steps": learner.overwritten_steps,
        "train_s": time.monotonic() - start,
        "shard": dict(learner.swarm.shard.stats) if learner.swarm.shard else {},
        "sync": dict(learner.swarm.sync.stats),
        **({"accepted": store.take_accepted()} if opts.records else {}),
    }
    emit(opts, "done", **summary)
    learner.close(checkpoint=drained is None)
    unwatch()
    sys.stdout.flush()
    if drained is not None and drained.checkpoint is False:
        raise preempt.DrainIncomplete(f"the drain ended without its final checkpoint ({'; '.join(drained.skipped)}"
                                      f" skipped); a restart resumes from step {learner.last_checkpoint_step} "
                                      "and the versions journaled since")
    return summary


def _drain(learner: Learner, opts: TrainOptions, notice: preempt.Notice) -> preempt.DrainReport:
    """A notice came: leave within `opts.drain_s` of it (`Learner.drain`), and say what was done."""
    log.warning("%s: draining within %g s (a second signal exits at once)", notice.reason, opts.drain_s)
    report = learner.drain(notice.at + opts.drain_s, reason=notice.reason or "")
    report.seconds = round(time.monotonic() - notice.at, 3)
    if report.skipped:
        log.warning("drain incomplete after %.1f s, skipped: %s", report.seconds, "; ".join(report.skipped))
    emit(opts, "drained", **report.fields())
    return report


def _train_alone(spec: RunSpec, task: Task, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 identity: Identity, opts: TrainOptions, startup: Startup | None = None) -> dict[str, Any]:
    """The same inner loop with no swarm: this learner alone (the nominal rate of docs/architecture.md §10)."""
    shard = int.from_bytes(hashlib.sha256(identity.public_key).digest()[:4], "big")
    batches = task.batches(learner=shard, seed=spec.seed)
    emit(opts, "joined", peer_id=identity.peer_id, url="", join_s=0.0, step=0, standalone=True)
    start, steps, losses = time.monotonic(), 0, []
    try:
        while not opts.steps or steps < opts.steps:
            step_start = time.monotonic()
            losses.append(_inner_step(task, model, optimizer, batches, opts))
            steps += 1
            if startup is not None:
                startup.mark("first_step")
                emit(opts, "first_step", step=steps, startup_s=startup.report())
                startup = None
            _pace(opts, step_start)
            if steps % opts.progress_every == 0:
                emit(opts, "progress", step=steps, loss=_mean(losses[-opts.progress_every:]),
                     tokens=steps * task.tokens_per_batch, steps_per_s=steps / (time.monotonic() - start))
            if opts.eval_every and steps % opts.eval_every == 0:  # same cost as in the swarm
                emit(opts, "eval", step=steps, eval_loss=evaluate(model, task), tokens=steps * task.tokens_per_batch)
    except KeyboardInterrupt:
        pass
    summary = {"peer_id": identity.peer_id, "steps": steps, "params": sum(p.numel() for p in model.parameters()),
               "tokens": steps * task.tokens_per_batch,
               "final_loss": _mean(losses[-20:]), "train_s": time.monotonic() - start, "standalone": True}
    emit(opts, "done", **summary)
    return summary


def _inner_step(task: Task, model: torch.nn.Module, optimizer: torch.optim.Optimizer, batches: Any,
                opts: TrainOptions) -> float:
    x, y = next(batches)
    with autocast(opts):
        loss = task.loss(model, x.to(opts.device), y.to(opts.device))
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return loss.item()


def autocast(opts: TrainOptions) -> torch.autocast:
    """The inner step's forward in bf16 where `opts.precision` says so; the backward follows its casts."""
    return torch.autocast(torch.device(opts.device).type, dtype=torch.bfloat16, enabled=opts.precision == "bf16")


def _pace(opts: TrainOptions, step_start: float) -> None:
    """Make the step last `slowdown` × (the paced step time, or else the step's own time)."""
    took = time.monotonic() - step_start
    target = max(opts.pace_s, took) * max(opts.slowdown, 1.0)
    if target > took:
        time.sleep(target - took)


def _mean(xs: list[float]) -> float:
    return sum(xs) / max(len(xs), 1)

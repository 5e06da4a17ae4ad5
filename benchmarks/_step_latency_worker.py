"""Worker process of benchmarks/step_latency.py: one learner holding a 100M-parameter stand-in, stepping at a
fixed 50 ms pace.

    python benchmarks/_step_latency_worker.py SPEC_PATH RECORDS_PATH [--create]

With `--create` the worker builds the RunSpec for its model (`create_run`) and writes it to SPEC_PATH; otherwise
it loads it from there when told to join. Commands come on stdin, one per line; reports are JSON lines on stdout:

  standalone N   N paced inner steps without any swarm (no Learner); their records go to RECORDS_PATH, the model
                 is reset to its initial values bit for bit (it must still match the run's genesis digest) and the
                 worker says {"event": "standalone_done"}
  open           creates the Learner, opens the swarm, says {"event": "ready", "url": ...}
  join URL       the same, joining through the peer at URL
  go             (after open or join) starts stepping, and probing the swarm's event loop for lag: every 20 ms a
                 callback is scheduled on it from another thread and the wait until it runs is recorded
  stop           (while stepping) ends the loop, writes every step's record to RECORDS_PATH, says "done"

While stepping, {"event": "progress", ...} reports every 0.5 s the step count, the fragments' versions, how many
live members this learner sees (itself included) and how many distinct owners its view gives the 8 fragments.

One inner step: a little real work (a precomputed noise chunk is added to a rotating 1/16 of every parameter
matrix, as an optimizer step would move them: ~6M floats, a few ms), then a sleep until PACE_S after the step's
start, then `learner.step()`. Each record is (start, work, late, in_step, apply, lock, flatten, runq, versions): seconds
from the step's start to the end of the work, how late the loop came out of its sleep (past the pace; > 0 also
when the work overran it), the time inside `learner.step()`, the parts of it spent adding new versions into
the model (`Theta._apply`, and `Theta._settle` when a due fragment's moves are applied at once) and copying due
fragments out of it (`Theta._copy`; node/theta.py: the costly things `step` does), `lock`: in
`store.take_changes` and `store.begin_send`, i.e. waiting for the fragment store's lock, `runq`: how long the
training thread waited for a CPU (runnable, not running: the kernel's schedstat) from the end of the work to
the end of `learner.step()`, i.e. while waking from the sleep and inside the step, and the sum of the
fragments' versions after the step.

Environment (set by step_latency.py): STEP_LATENCY_NUMEL (parameters, default 100M), STEP_LATENCY_H (the RunSpec's
inner_steps, for --create), STEP_LATENCY_TTL_S (member TTL), STEP_LATENCY_PACE_S, STEP_LATENCY_STACKS (see
step_latency.py), LOGLEVEL (the library's logging, on stderr).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time

import torch

FRAGMENTS = 8
NUMEL = int(os.environ.get("STEP_LATENCY_NUMEL", 100_000_000))
COLS = 1000
PACE_S = float(os.environ.get("STEP_LATENCY_PACE_S", 0.05))
INNER_STEPS = int(os.environ.get("STEP_LATENCY_H", 100))
LAG_PROBE_S = 0.02  # how often the swarm's event loop is probed for lag
CHUNKS = 16  # the work perturbs one of this many row blocks of every matrix per step


class StandIn(torch.nn.Module):
    """NUMEL float32 parameters in 8 equal matrices: the plan puts one in each fragment."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        rows = NUMEL // FRAGMENTS // COLS
        self.blocks = torch.nn.ParameterList(
            [torch.nn.Parameter(torch.randn(rows, COLS, generator=g) * 0.02) for _ in range(FRAGMENTS)]
        )

    def reset(self) -> None:
        """Back to the initial values, bit for bit, in place (the run's genesis, after the standalone steps)."""
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in self.blocks:
                torch.randn(p.shape, generator=g, out=p.data)
                p.data.mul_(0.02)


def run_delay_s() -> float:
    """Seconds this thread has spent runnable but waiting for a CPU (Linux schedstat), since it started."""
    with open("/proc/thread-self/schedstat") as f:
        return int(f.read().split()[1]) / 1e9


def say(**fields) -> None:
    print(json.dumps(fields), flush=True)


class Loop:
    """The paced inner loop; `learner` None: standalone."""

    def __init__(self, model: StandIn, seed: int) -> None:
        self.model = model
        self.blocks = [p.data for p in model.blocks]
        rows = self.blocks[0].shape[0]
        self.chunk_rows = -(-rows // CHUNKS)
        g = torch.Generator().manual_seed(seed)
        self.noise = torch.randn(self.chunk_rows, COLS, generator=g) * 1e-4
        self.i = 0
        self.records: list[tuple[float, ...]] = []
        self.timers = {"apply": 0.0, "lock": 0.0, "flatten": 0.0}

    def work(self) -> None:
        """What an optimizer step does to the parameters, on a rotating 1/CHUNKS of them."""
        k = self.i % CHUNKS
        with torch.no_grad():
            for b in self.blocks:
                part = b[k * self.chunk_rows : (k + 1) * self.chunk_rows]
                part.add_(self.noise[: part.shape[0]])
        self.i += 1

    def step(self, learner) -> None:
        t0 = time.monotonic()
        self.work()
        t_work = time.monotonic() - t0
        target = t0 + PACE_S
        q0 = run_delay_s()
        now = time.monotonic()
        if now < target:
            time.sleep(target - now)
        t1 = time.monotonic()
        versions = 0
        self.timers = dict.fromkeys(self.timers, 0.0)
        if learner is not None:
            learner.step(tokens=1, loss=0.0)
        t2 = time.monotonic()
        runq = run_delay_s() - q0
        if learner is not None:  # (the worker's bookkeeping: not part of the step's time)
            versions = sum(v.version for v in learner.labels)
        tm = self.timers
        self.records.append((t0, t_work, t1 - target, t2 - t1, tm["apply"], tm["lock"], tm["flatten"], runq,
                             versions))

    def dump(self, path: str, **extra: list[float]) -> None:
        keys = ("start", "work", "late", "in_step", "apply", "lock", "flatten", "runq", "versions")
        with open(path, "w") as f:
            json.dump({**{k: [r[i] for r in self.records] for i, k in enumerate(keys)}, **extra}, f)


def timed(loop: Loop, key: str, fn):
    """`fn` with its wall time added to loop.timers[key] (the worker's own instrumentation, no library change)."""

    def wrapper(*a, **kw):
        t = time.monotonic()
        try:
            return fn(*a, **kw)
        finally:
            loop.timers[key] += time.monotonic() - t

    return wrapper


def main() -> None:
    import logging

    logging.basicConfig(level=os.environ.get("LOGLEVEL", "WARNING"), stream=sys.stderr,
                        format=f"[worker {os.getpid()}] %(relativeCreated)d %(name)s %(message)s")
    torch.set_num_threads(1)
    spec_path, records_path = sys.argv[1], sys.argv[2]
    from diloco.node.heap import return_large_buffers_to_os

    return_large_buffers_to_os()  # what a learner sets; the standalone phase gets it too
    model = StandIn()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # stateless: the stand-in's "training" is Loop.work
    if "--create" in sys.argv[3:]:
        from diloco.node.learner import create_run
        from diloco.protocol.identity import Identity

        create_run(Identity.generate(), "step-latency", model, task="stand-in", fragments=FRAGMENTS,
                   inner_steps=INNER_STEPS, quorum=2, codec="int8").save(spec_path)
    loop = Loop(model, seed=os.getpid())
    say(event="built")

    stop = threading.Event()
    learner = None
    for line in sys.stdin:
        cmd, *args = line.split()
        if cmd == "standalone":
            n = int(args[0])
            for _ in range(n):
                loop.step(None)
            loop.dump(records_path)
            loop.records.clear()
            model.reset()
            say(event="standalone_done")
        elif cmd in ("open", "join"):
            from diloco.coordinator.runspec import Genesis
            from diloco.node.learner import Learner
            from diloco.node.swarm import SwarmConfig

            # loopback timings: the tests' poll and watch (tests/swarm_utils.py fast_config), a member TTL of
            # STEP_LATENCY_TTL_S (step_latency.py --member-ttl), refreshed 5 times per TTL
            ttl = float(os.environ.get("STEP_LATENCY_TTL_S", 10.0))
            cfg = SwarmConfig(peers=args[:1], member_ttl_s=ttl, member_refresh_s=ttl / 5, member_poll_s=0.5,
                              watch_s=1.0, join_timeout_s=60)
            learner = Learner(model, opt, Genesis.load(spec_path), config=cfg)
            learner.start()
            theta = learner.theta
            theta._apply = timed(loop, "apply", theta._apply)
            theta._settle = timed(loop, "apply", theta._settle)
            theta._copy = timed(loop, "flatten", theta._copy)
            store = learner.swarm.store
            store.take_changes = timed(loop, "lock", store.take_changes)
            store.begin_send = timed(loop, "lock", store.begin_send)
            say(event="ready", url=learner.swarm.url, t=time.monotonic())
        elif cmd == "go" and learner is not None:
            break
        else:
            return

    def commands() -> None:
        for line in sys.stdin:
            if line.strip() == "stop":
                break
        stop.set()

    threading.Thread(target=commands, daemon=True).start()
    lags: list[tuple[float, float]] = []

    def probe_loop_lag() -> None:
        """How long a callback waits for the swarm's event loop (anything run on the loop thread delays it).
        With STEP_LATENCY_STACKS=N, the stacks of every thread go to stderr (faulthandler's watchdog thread, which
        needs no GIL) the first N times a callback waits more than 0.5 s."""
        import faulthandler

        aloop = learner.swarm._loop
        dumps = int(os.environ.get("STEP_LATENCY_STACKS", 0))
        while not stop.is_set():
            t = time.monotonic()
            ran = threading.Event()

            def probe(t=t, ran=ran) -> None:
                lags.append((t, time.monotonic() - t))
                ran.set()

            if dumps:
                faulthandler.dump_traceback_later(0.5, repeat=False, file=sys.stderr)
            aloop.call_soon_threadsafe(probe)
            if dumps:
                if not ran.wait(0.5 + 0.05):
                    dumps -= 1
                    ran.wait()
                faulthandler.cancel_dump_traceback_later()
            time.sleep(LAG_PROBE_S)

    threading.Thread(target=probe_loop_lag, daemon=True).start()
    next_report = 0.0
    while not stop.is_set():
        loop.step(learner)
        now = time.monotonic()
        if now >= next_report:
            next_report = now + 0.5
            labels = learner.labels
            members = learner.swarm.members
            owners = {r[0] for p in range(FRAGMENTS) if (r := members.roles(p))}
            say(event="progress", t=now, steps=loop.i, min_version=min(v.version for v in labels),
                versions=[str(v) for v in labels], live=len(members.live()), owners=len(owners))
    loop.dump(records_path, lag_t=[t for t, _ in lags], lag=[x for _, x in lags])
    st = learner.status()
    say(event="done", steps=loop.i, shard=st.get("shard"), sync=st.get("sync"),
        settled_at_once=learner.theta.settled_at_once)
    learner.swarm.stop(timeout=3)


if __name__ == "__main__":
    main()

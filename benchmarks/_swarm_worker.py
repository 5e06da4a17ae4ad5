"""Worker process of benchmarks/swarm.py: one learner holding the 25M-parameter stand-in model.

    python benchmarks/_swarm_worker.py ROLE SPEC_PATH [PEER_URL]

ROLE is `tiny` (the built-in tiny GPT trained standalone for `SPEC_PATH` steps, no swarm: the speed baseline
of `overhead_ratio`), `learner` (joins, then reads commands from stdin: "prepare" perturbs its parameters as
training would; "go" hands every fragment's delta to the swarm at once, "stagger" one after the other as the
schedule does, and both report when it holds every new version), `joiner`
(times `Learner.start()` plus its first `step()`: first contact to first inner step) or `standalone` (the same
model and optimizer, no swarm: the RSS baseline). Every report is one JSON line on stdout.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time

import torch

FRAGMENTS, NUMEL = 8, int(os.environ.get("STANDIN_NUMEL", 25_000_000))


class StandIn(torch.nn.Module):
    """25M float32 parameters in 8 equal matrices: the plan puts one in each fragment."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        rows = NUMEL // FRAGMENTS // 1000
        self.blocks = torch.nn.ParameterList(
            [torch.nn.Parameter(torch.randn(rows, 1000, generator=g) * 0.02) for _ in range(FRAGMENTS)]
        )


def model_and_optimizer() -> tuple[StandIn, torch.optim.Optimizer]:
    model = StandIn()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)  # zero grads leave θ as is
    for p in model.parameters():  # one step so that AdamW's state exists, as in training
        p.grad = torch.zeros_like(p)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return model, opt


def current_rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def say(**fields) -> None:
    print(json.dumps({**fields, "maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}), flush=True)


def tiny_standalone(steps: int) -> None:
    """The loop of `diloco-node join` (node/train.py) without the Learner: inner steps/s alone."""
    from diloco.node.tasks import make_task

    task = make_task("markov")
    model = task.build_model()
    opt = task.optimizer(model)
    batches = task.batches(learner=0)
    warm = steps // 10
    for i in range(steps):
        if i == warm:
            t0 = time.perf_counter()
        x, y = next(batches)
        _, loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        loss.item()
    say(event="done", steps_per_s=(steps - warm) / (time.perf_counter() - t0))


def main() -> None:
    import logging

    logging.basicConfig(level=os.environ.get("LOGLEVEL", "WARNING"), format="%(relativeCreated)d %(name)s %(message)s")
    torch.set_num_threads(1)
    role, spec_path = sys.argv[1], sys.argv[2]
    peers = sys.argv[3:]
    if role == "tiny":
        tiny_standalone(int(spec_path))
        return
    from diloco.node.heap import return_large_buffers_to_os

    return_large_buffers_to_os()  # the allocator setting a learner makes: the baseline gets it too
    model, opt = model_and_optimizer()
    if role == "standalone":
        say(event="ready")
        return
    from diloco.coordinator.runspec import Genesis
    from diloco.node.learner import Learner
    from diloco.node.swarm import SwarmConfig

    cfg = SwarmConfig(peers=peers, member_ttl_s=6, member_refresh_s=2, member_poll_s=1, watch_s=2)
    learner = Learner(model, opt, Genesis.load(spec_path), config=cfg)
    t0 = time.perf_counter()
    learner.start()
    learner.step(tokens=1)
    join_s = time.perf_counter() - t0
    say(event="ready", url=learner.swarm.url, join_s=join_s, versions=[str(v) for v in learner.labels])
    if role == "joiner":
        learner.close()
        return
    g = torch.Generator().manual_seed(hash(learner.identity.peer_id) % 2**31)
    store = learner.swarm.store
    for line in sys.stdin:
        command = line.strip()
        if command == "prepare":  # training's share of a round, before the clock starts (all learners at once)
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(torch.randn(p.shape, generator=g) * 1e-3)
            learner._apply_new_versions()
            say(event="prepared")
            continue
        if command not in ("go", "stagger"):
            break
        target = [v.version + 1 for v in learner.labels]
        sent, cpu0 = time.time(), time.process_time()
        for p in range(FRAGMENTS):  # "go": every fragment at once; "stagger": one after the other, as scheduled
            snapshot = learner.plan.flatten(p, learner.params, out=learner.swarm.pool.take(learner.plan.fragments[p].numel))
            learner.swarm.submit_delta(p, snapshot, learner.base[p], 1, 1)
            stop = time.monotonic() + 60
            while command == "stagger" and store.label(p).version < target[p] and time.monotonic() < stop:
                time.sleep(0.002)
        deadline = time.monotonic() + 120
        while any(store.label(p).version < target[p] for p in range(FRAGMENTS)) and time.monotonic() < deadline:
            time.sleep(0.002)
        if time.monotonic() >= deadline:
            st = learner.status()
            say(event="stalled", labels=[str(v) for v in learner.labels], target=target, shard=st["shard"],
                sync=st["sync"])
            break
        learner._apply_new_versions()
        say(event="round", sent=sent, have=time.time(), rss=current_rss(), cpu_s=time.process_time() - cpu0,
            shard=learner.swarm.shard.stats if learner.swarm.shard else {}, sync=learner.swarm.sync.stats)
    learner.close()


if __name__ == "__main__":
    main()

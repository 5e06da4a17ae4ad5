"""`join` under torchrun: one learner of WORLD_SIZE data-parallel ranks (DDP or FSDP2 inside, the swarm outside).

    torchrun --nproc-per-node N -m diloco.node join --spec run.spec --peers HOST:PORT [--fsdp] ...

Every rank builds the run's model, wraps it in DistributedDataParallel (or shards it with FSDP2's
`fully_shard`, `--fsdp`) and trains on its own share of the data; rank 0 is the swarm member
(`DistributedLearner`, node/distributed.py) and alone prints events, listens on `--listen` and writes
checkpoints. gloo on the CPU, NCCL with `--device cuda` (each rank on its LOCAL_RANK). SIGTERM or SIGINT (to
torchrun, which forwards it, or to the ranks) drains the learner as it drains a single process
(docs/preemption.md): the ranks stop at the same step and rank 0 leaves within `--drain-s`; keep that under
torchrun's own wait before it kills its workers (30 s).
"""

from __future__ import annotations

import datetime
import hashlib
import os
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from diloco.coordinator.runspec import Genesis
from diloco.protocol.identity import Identity

from . import preempt
from .distributed import DistributedLearner
from .fsdp import shard_model
from .swarm import SwarmConfig
from .tasks import evaluate

COLLECTIVE_TIMEOUT_S = 300.0  # a rank waits this long at most for the others (a dead rank fails it sooner)


def world_size() -> int:
    """WORLD_SIZE as torchrun sets it (1 outside torchrun)."""
    try:
        return max(1, int(os.environ.get("WORLD_SIZE", "1")))
    except ValueError:
        return 1


def train_ranks(genesis: Genesis, identity: Identity, config: SwarmConfig, opts: Any) -> dict[str, Any]:
    from .train import _mean, autocast, emit, task_of  # (train.py dispatches here: imported late, no cycle)

    torch.set_num_threads(1)
    device = opts.device
    if device == "cuda":
        device = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.startswith("cuda") else "gloo",
                            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    rank, world = dist.get_rank(), dist.get_world_size()
    say = emit if rank == 0 else (lambda *a, **k: None)
    spec = genesis.spec
    task = task_of(spec, opts.data)
    model = task.build_model().to(device)
    ddp = shard_model(model) if opts.fsdp else DistributedDataParallel(model)
    optimizer = task.optimizer(model)
    learner = DistributedLearner(ddp, optimizer, genesis, identity=identity, config=config,
                                 checkpoint_dir=opts.checkpoint_dir if rank == 0 else None,
                                 checkpoint_every=opts.checkpoint_every)
    t0 = time.monotonic()
    learner.start()
    member = learner.learner
    if member is not None:
        say(opts, "joined", peer_id=identity.peer_id, url=member.swarm.url, join_s=time.monotonic() - t0,
            step=learner.t, ranks=world, versions=[str(v) for v in member.labels])
    shard = int.from_bytes(hashlib.sha256(identity.public_key).digest()[:4], "big")
    batches = task.batches(learner=shard * world + rank, seed=spec.seed + learner.t)
    start, losses = time.monotonic(), []
    # every rank hears SIGTERM/SIGINT (torchrun forwards them; Ctrl-C and systemd reach the whole group, so a
    # rank may hear one twice: `ECHO_S`); rank 0 alone polls the cloud's metadata. The ranks agree at a step.
    notice = preempt.Notice()
    unwatch = preempt.watch(notice, opts.preemption_notice if rank == 0 else None, opts.metadata_url,
                            echo_s=preempt.ECHO_S)
    try:
        while (not opts.steps or learner.t < opts.steps) and not learner.leaving:
            x, y = next(batches)
            with autocast(opts):
                loss = task.loss(ddp, x.to(device), y.to(device))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
            learner.step(tokens=task.tokens_per_batch, loss=losses[-1], leaving=notice.requested)
            if member is not None and learner.t % opts.progress_every == 0:
                say(opts, "progress", step=learner.t, loss=_mean(losses[-opts.progress_every:]),
                    tokens=learner.tokens, versions=sum(v.version for v in member.labels),
                    peers=len(member.swarm.members.live()), ranks=world)
            if opts.eval_every and learner.t % opts.eval_every == 0:
                say(opts, "eval", step=learner.t, eval_loss=evaluate(model, task), tokens=learner.tokens)
    except KeyboardInterrupt:
        pass
    drained = None
    if learner.leaving:
        at = notice.at if notice.at is not None else time.monotonic()  # (told by another rank only)
        drained = learner.drain(at + opts.drain_s, reason=notice.reason or "another rank's notice")
        if drained is not None:
            drained.seconds = round(time.monotonic() - at, 3)
            say(opts, "drained", **drained.fields())
    summary = {"peer_id": identity.peer_id, "ranks": world, "steps": learner.t, "tokens": learner.tokens,
               "final_loss": _mean(losses[-20:]), "eval_loss": evaluate(model, task),
               "versions": [str(v) for v in member.labels] if member is not None else [],
               "train_s": time.monotonic() - start}
    say(opts, "done", **summary)
    learner.close(checkpoint=not learner.leaving)
    unwatch()
    dist.destroy_process_group()
    sys.stdout.flush()
    if drained is not None and drained.checkpoint is False:
        raise preempt.DrainIncomplete(f"the drain ended without its final checkpoint ({'; '.join(drained.skipped)}"
                                      " skipped)")
    return summary

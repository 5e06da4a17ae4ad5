"""One rank of a 2-rank learner (gloo, CPU; DDP, or FSDP2 with `fsdp`), started by torchrun from
tests/test_distributed.py.

    python -m torch.distributed.run --nproc-per-node 2 tests/_ddp_worker.py RUN.spec PEER_URL OUT_DIR STEPS [fsdp]

Writes OUT_DIR/rank-<r>.json: the SHA-256 of all its parameters after every step at which the swarm changed θ
(DDP: the rank's own; FSDP2: its shard), its eval loss before and after, its step and token counts, and under
FSDP2 the SHA-256 of the whole θ gathered after `close` (which rank 0 has just checkpointed) and of the whole
optimizer state right after `start` and after `close` (rank 0's report).
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from diloco.coordinator.runspec import Genesis
from diloco.node.distributed import DistributedLearner
from diloco.node.fsdp import shard_model
from diloco.node.swarm import SwarmConfig
from diloco.node.tasks import evaluate
from diloco.node.train import task_of


def digest(tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        t = t.to_local() if isinstance(t, DTensor) else t
        h.update(t.detach().reshape(-1).contiguous().view(torch.uint8).numpy())
    return h.hexdigest()


def optimizer_digest(model, opt) -> str | None:
    """FSDP2, every rank: SHA-256 of the whole optimizer state (gathered on rank 0; None elsewhere), parameter by
    parameter in the model's order, each one's state by key."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    full = get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if not full:
        return None
    state = full["state"]
    return digest(state[n][k] for n, _ in model.named_parameters() if n in state for k in sorted(state[n]))


def main() -> None:
    spec_path, peer, out, steps = sys.argv[1], sys.argv[2], Path(sys.argv[3]), int(sys.argv[4])
    fsdp = sys.argv[5:] == ["fsdp"]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    genesis = Genesis.load(spec_path)
    task = task_of(genesis.spec)
    model = task.build_model()
    ddp = shard_model(model) if fsdp else DistributedDataParallel(model)
    opt = task.optimizer(model)
    config = SwarmConfig(peers=[peer], member_ttl_s=4.0, member_refresh_s=1.0, member_poll_s=0.5, watch_s=1.0)
    ckpt = dict(checkpoint_dir=out / "ckpt", checkpoint_every=40) if fsdp else {}
    learner = DistributedLearner(ddp, opt, genesis, config=config, **ckpt).start()
    started_optimizer = optimizer_digest(model, opt) if fsdp else None
    before = evaluate(model, task)
    (out / f"pid-{rank}").write_text(str(os.getpid()))
    batches = task.batches(learner=100 + rank)
    changed = [[learner.t, digest(model.parameters())]]
    for _ in range(steps):
        x, y = next(batches)
        _, loss = ddp(x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if learner.step(tokens=x.numel(), loss=loss.item()):
            changed.append([learner.t, digest(model.parameters())])
    result = {"rank": rank, "digests": changed, "eval_before": before, "eval_after": evaluate(model, task),
              "t": learner.t, "tokens": learner.tokens, "tokens_per_batch": task.tokens_per_batch,
              "versions": [v.version for v in learner.learner.labels] if learner.is_member else None}
    learner.close()
    if fsdp:  # θ whole as the ranks hold it, in the checkpoint's order
        with torch.no_grad():
            full = {n: t.full_tensor() for n, t in model.named_parameters()}
        result["closed_digest"] = digest(full[n] for n in sorted(full))
        result["started_optimizer"], result["closed_optimizer"] = started_optimizer, optimizer_digest(model, opt)
    (out / f"rank-{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()
    # Everything is written. Interpreter finalization aborted an FSDP2 rank now and then in full CI runs
    # ("terminate called without an active exception": a C++ thread or gloo work torn down with the interpreter,
    # never reproduced alone; README, Chaos): it would fail the test for nothing the test checks
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()

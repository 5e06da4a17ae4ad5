"""One rank of a 2-rank DDP learner (gloo, CPU), started by torchrun from tests/test_distributed.py.

    python -m torch.distributed.run --nproc-per-node 2 tests/_ddp_worker.py RUN.spec PEER_URL OUT_DIR STEPS

Writes OUT_DIR/rank-<r>.json: the SHA-256 of all its parameters after every step at which the swarm changed θ,
its eval loss before and after, and its step and token counts.
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
from torch.nn.parallel import DistributedDataParallel

from diloco.coordinator.runspec import Genesis
from diloco.node.distributed import DistributedLearner
from diloco.node.swarm import SwarmConfig
from diloco.node.tasks import evaluate
from diloco.node.train import task_of


def digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for t in model.parameters():
        h.update(t.detach().contiguous().view(torch.uint8).numpy())
    return h.hexdigest()


def main() -> None:
    spec_path, peer, out, steps = sys.argv[1], sys.argv[2], Path(sys.argv[3]), int(sys.argv[4])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    genesis = Genesis.load(spec_path)
    task = task_of(genesis.spec)
    model = task.build_model()
    ddp = DistributedDataParallel(model)
    opt = task.optimizer(model)
    config = SwarmConfig(peers=[peer], member_ttl_s=4.0, member_refresh_s=1.0, member_poll_s=0.5, watch_s=1.0)
    learner = DistributedLearner(ddp, opt, genesis, config=config).start()
    before = evaluate(model, task)
    (out / f"pid-{rank}").write_text(str(os.getpid()))
    batches = task.batches(learner=100 + rank)
    changed = [[learner.t, digest(model)]]
    for _ in range(steps):
        x, y = next(batches)
        _, loss = ddp(x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if learner.step(tokens=x.numel(), loss=loss.item()):
            changed.append([learner.t, digest(model)])
    result = {"rank": rank, "digests": changed, "eval_before": before, "eval_after": evaluate(model, task),
              "t": learner.t, "tokens": learner.tokens, "tokens_per_batch": task.tokens_per_batch,
              "versions": [v.version for v in learner.learner.labels] if learner.is_member else None}
    learner.close()
    (out / f"rank-{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""An FSDP2 learner's inner optimizer state in rank 0's checkpoints.

Under `fully_shard` every rank's optimizer holds the state of its own shards, and rank 0's `Learner` (which
writes the checkpoints) holds no optimizer at all. `GatheredOptimizer` stands in for it there: at every
checkpoint step all ranks gather the whole state into rank 0's host memory (`gather`, torch's full-state-dict
API, one parameter at a time and offloaded to the CPU), and the learner's checkpoint takes it like any
optimizer's `state_dict()`; when a learner resumes, rank 0's `restore` hands the saved state to
`load_state_dict` and `scatter` gives every rank its shards of it. Without this a relaunched FSDP2 learner
restarted AdamW's moments from zero.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn


def _api():
    # (torch.distributed.checkpoint costs an import only where a sharded learner checkpoints)
    from torch.distributed.checkpoint import state_dict as api

    return api


class GatheredOptimizer:
    """Every rank builds one around its model and optimizer; rank 0's is its `Learner`'s optimizer."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model, self.optimizer = model, optimizer
        self.names = [name for name, _ in model.named_parameters()]
        self._full: dict[str, Any] | None = None  # the last gather (rank 0), keyed by parameter name
        self._loaded: dict[str, Any] | None = None  # a checkpoint's state (rank 0), until `scatter`

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups  # (what `checkpoint.restore` compares and merges hyperparameters with)

    def gather(self) -> None:
        """Every rank, at the same step: the whole optimizer state into rank 0's host memory."""
        api = _api()
        full = api.get_optimizer_state_dict(self.model, self.optimizer,
                                            options=api.StateDictOptions(full_state_dict=True, cpu_offload=True))
        self._full = full if full else None  # (the other ranks get nothing)

    def state_dict(self) -> dict[str, Any]:
        """The last gathered state in torch's form (parameters by index), as `Optimizer.state_dict()` gives."""
        if self._full is None:
            return {"state": {}, "param_groups": []}
        index = {name: i for i, name in enumerate(self.names)}
        return {"state": {index[name]: s for name, s in self._full["state"].items()},
                "param_groups": [{**g, "params": [index[n] for n in g["params"]]} for g in self._full["param_groups"]]}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Keep a checkpoint's state (rank 0) for `scatter`."""
        self._loaded = {"state": {self.names[int(i)]: s for i, s in sd["state"].items()},
                        "param_groups": [{**g, "params": [self.names[int(i)] for i in g["params"]]}
                                         for g in sd["param_groups"]]}

    def scatter(self, src: int, group: dist.ProcessGroup | None = None) -> bool:
        """Every rank, after the start: rank 0's loaded state, each rank keeping its own shards. False (and the
        optimizer as it was) when the checkpoint held none."""
        box: list[Any] = [self._loaded]
        dist.broadcast_object_list(box, src=src, group=group)
        self._loaded = None
        if box[0] is None or not box[0]["state"]:
            return False
        api = _api()
        self.optimizer.zero_grad(set_to_none=True)
        api._init_optim_state(self.optimizer)  # (loading needs a state to shard into: torch's own zero-grad step)
        api.set_optimizer_state_dict(self.model, self.optimizer, optim_state_dict=box[0],
                                     options=api.StateDictOptions(full_state_dict=True))
        return True

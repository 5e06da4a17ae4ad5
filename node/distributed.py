"""A learner of several ranks (torchrun; DDP or FSDP2): rank 0 is the swarm member, the ranks hold one θ.

Inside a learner, data parallelism is the user's (DistributedDataParallel all-reduces the gradients, so every
rank's optimizer makes the same step). The swarm sees one learner with one identity: rank 0 runs the `Learner`
(anchors, deltas, versions, checkpoints); the other ranks hold no anchors and open no port.

Why rank 0 alone talks to the swarm: under DDP every rank holds the whole model, identical, so one copy of each
pseudo-gradient is all there is to send; N ranks sending shards would N-fold the connections and owners'
bookkeeping for the same bytes. What must cross ranks is what the swarm changes in θ: at every
`step`, rank 0 records the ranges of θ its `Theta` wrote (versions applied a slice per step, fragments
replaced whole) and broadcasts them, and every other rank writes the same values, so all ranks are bit-identical
again before the next forward. A `start` (checkpoint, downloads) is followed by a broadcast of every parameter,
the optimizer state and the step counters. Token counts are summed over ranks.

Under FSDP2 (`fully_shard`) no rank holds θ whole: rank 0's `Learner` works on a full host copy, filled
from the shards when it reads a fragment, and every rank replays on its own shard what the swarm wrote into
that copy (node/fsdp.py); the pseudo-gradient never needs the whole model on one GPU. The inner optimizer's
state is each rank's own; at every checkpoint step the ranks gather it into rank 0's host memory for the
checkpoint, and a resumed learner gives every rank its shards of it again (node/fsdp_optim.py).

A rank that dies makes the next collective fail on the others (gloo and NCCL see the closed connection), which
raises out of `step`: the job ends, torchrun stops every rank, and the learner comes back as one learner from
rank 0's checkpoint. Give `init_process_group` a timeout that suits you; collectives wait that long at most.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from diloco.coordinator.plan import FragmentPlan

from .fsdp import Shards, is_sharded
from .fsdp_optim import GatheredOptimizer
from .learner import Learner, due_at, step_hook
from .preempt import DrainReport


class DistributedLearner:
    """Every rank constructs one, with its own model (DDP-wrapped or not, or sharded by `fully_shard`) and
    optimizer, and calls `start`, `step` and `close` at the same points of the loop. `learner_kwargs` go to
    rank 0's `Learner`."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, run: Any, *,
                 group: dist.ProcessGroup | None = None, src: int = 0, **learner_kwargs: Any) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("DistributedLearner needs torch.distributed initialized (init_process_group)")
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            model = model.module  # the parameters' own names, as the run's plan has them
        self.model, self.optimizer, self.group = model, optimizer, group
        self.rank, self.src = dist.get_rank(group), src
        self.world_size = dist.get_world_size(group)
        self.device = next(model.parameters()).device
        self.params = dict(model.named_parameters())
        self.learner: Learner | None = None
        spec = run.spec if hasattr(run, "spec") else run
        self.plan = FragmentPlan.from_module(model, spec.fragments)
        self.shards = Shards(model, self.plan) if is_sharded(model) else None
        self._full: dict[str, torch.Tensor] | None = None  # rank 0 of an FSDP2 learner: θ whole (node/fsdp.py)
        self._optim = GatheredOptimizer(model, optimizer) if self.shards is not None else None
        if self.rank == src:
            if self.shards is not None:
                self._full = self.shards.full_copy()
                self.learner = Learner(model, self._optim, run, params=self._full, **learner_kwargs)
            else:
                self.learner = Learner(model, optimizer, run, **learner_kwargs)
            self.learner.on_theta_write = self._record
        self._writes: list[tuple[int, int, int]] = []
        self._values: list[torch.Tensor] = []  # FSDP2: what each write put into θ (or added to it)
        self._adds: list[bool] = []
        self._buffers: dict[int, torch.Tensor] = {}
        self._gathers: dict[str, Any] = {}  # FSDP2: when rank 0's learner reads θ (`_reads_at`)
        self.t = 0
        self.tokens = 0
        self.leaving = False  # a rank was told to leave: every rank stops at the same step (`step`, `drain`)

    @property
    def is_member(self) -> bool:
        """True on the rank that talks to the swarm."""
        return self.learner is not None

    def _record(self, p: int, start: int, stop: int, values: torch.Tensor, add: bool) -> None:
        self._writes.append((p, start, stop))
        if self.shards is not None:  # (the buffer is reused once this returns)
            self._values.append(values[start:stop].clone())
            self._adds.append(add)

    # -- lifecycle ------------------------------------------------------------------------------------------

    def start(self) -> DistributedLearner:
        """Rank 0 joins (checkpoint, downloads); then every rank takes rank 0's parameters, optimizer state and
        counters."""
        error: list[str | None] = [None]
        if self.shards is not None:  # rank 0's learner starts from the model as the ranks hold it
            self.shards.gather(range(len(self.plan)), self._full)
        if self.learner is not None:
            try:
                self.learner.start()
            except BaseException as e:  # the other ranks must not wait for a broadcast that never comes
                error[0] = f"{type(e).__name__}: {e}"
                dist.broadcast_object_list(error, src=self.src, group=self.group)
                raise
        dist.broadcast_object_list(error, src=self.src, group=self.group)
        if error[0] is not None:
            raise RuntimeError(f"rank {self.src} could not join the swarm: {error[0]}")
        self._clear()
        if self.shards is not None:
            self.shards.scatter(self._full, self.src, self.group)
            self._optim.scatter(self.src, self.group)
        else:
            with torch.no_grad():
                for t in self.params.values():
                    dist.broadcast(t.data, src=self.src, group=self.group)
        self._broadcast_state()
        return self

    def _clear(self) -> None:
        self._writes.clear()
        self._values.clear()
        self._adds.clear()

    def _broadcast_state(self) -> None:
        """The optimizer state and counters rank 0 resumed with (a checkpoint restores them on rank 0 only)."""
        state: list[Any] = [None]
        if self.learner is not None:
            state[0] = {"t": self.learner.t, "tokens": self.learner.tokens, "offsets": self.learner.offsets,
                        "inner_steps": self.learner.spec.inner_steps,
                        "checkpoints": self.learner.checkpoint_dir is not None,
                        "checkpoint_every": self.learner.checkpoint_every}
            if self.shards is None:
                state[0]["optimizer"] = self.optimizer.state_dict()
        dist.broadcast_object_list(state, src=self.src, group=self.group,
                                   device=self.device if self.device.type == "cuda" else None)
        if self.learner is None and self.shards is None:
            self.optimizer.load_state_dict(state[0]["optimizer"])
        self.t, self.tokens = state[0]["t"], state[0]["tokens"]
        self._gathers = state[0]

    def _checkpoints_at(self, t: int) -> bool:
        """Rank 0's learner checkpoints at step t (the same rule as `Learner.step`, known to every rank)."""
        g = self._gathers
        return bool(g["checkpoints"] and g["checkpoint_every"] and t % g["checkpoint_every"] == 0)

    def _reads_at(self, t: int) -> list[int]:
        """FSDP2: the fragments rank 0's learner reads at step t: those due to be sent, every one before a
        checkpoint."""
        if self._checkpoints_at(t):
            return list(range(len(self.plan)))
        g = self._gathers
        return due_at(t, g["offsets"], g["inner_steps"])

    def close(self, checkpoint: bool = True) -> None:
        """Every rank: rank 0 leaves the swarm (after a last checkpoint, which an FSDP2 learner gathers first;
        `checkpoint=False` after a `drain`, which wrote it)."""
        gathers = checkpoint and self.shards is not None and self._gathers.get("checkpoints")
        if gathers:
            self._gather_all()
        if self.learner is not None:
            self._clear()
            self.learner.close(checkpoint=checkpoint)
        if gathers:
            self._replay_writes()  # what the last checkpoint's flush wrote: the shards end as it saved them

    def _gather_all(self) -> None:
        """FSDP2, every rank: θ whole and the optimizer's state into rank 0 (what a checkpoint or a drain reads)."""
        self.shards.gather(range(len(self.plan)), self._full)
        self._optim.gather()

    def drain(self, deadline: float, reason: str = "") -> DrainReport | None:
        """Every rank, once `leaving`: rank 0 leaves the swarm cleanly by `deadline` (time.monotonic() on rank
        0: `Learner.drain`, its deltas sent, its fragments handed over, `left`, a final checkpoint) while the
        other ranks wait for it; an FSDP2 learner's ranks first gather θ and the optimizer's state into rank 0,
        which the deltas and the checkpoint read. Then `close(checkpoint=False)` on every rank. Returns rank
        0's report (None on the others)."""
        if self.shards is not None:
            self._gather_all()
        report = None
        if self.learner is not None:
            self._clear()
            report = self.learner.drain(deadline, reason)
        dist.barrier(group=self.group)
        return report

    # -- the training-loop hook -----------------------------------------------------------------------------

    def step(self, tokens: int, loss: float | None = None, *, leaving: bool = False) -> list[tuple[int, int, int]]:
        """After every `optimizer.step()`, on every rank: `tokens` are this rank's (summed over ranks), `loss`
        its loss (averaged); `leaving`: this rank was told to leave (a preemption notice). Once any rank was,
        `self.leaving` is True on every rank after the same step: stop there and `drain` on every rank.
        Returns the ranges of θ the swarm wrote at this step, (p, start, stop)."""
        counts = torch.tensor([float(tokens), float(loss) if loss is not None else 0.0, float(leaving)],
                              dtype=torch.float64, device=self.device)
        dist.all_reduce(counts, group=self.group)
        total, mean_loss = int(counts[0].item()), counts[1].item() / self.world_size
        self.leaving = self.leaving or counts[2].item() > 0
        self.t += 1
        self.tokens += total
        if self.shards is not None:
            self.shards.gather(self._reads_at(self.t), self._full)
            if self._checkpoints_at(self.t):
                self._optim.gather()
        if self.learner is not None:
            self._clear()
            self.learner.step(tokens=total, loss=mean_loss if loss is not None else None)
        return self._share_writes() if self.shards is None else self._replay_writes()

    def _broadcast_rows(self, rows: list[tuple[int, ...]], width: int) -> list[tuple[int, ...]]:
        """Rank 0's `rows` of `width` integers, on every rank."""
        n = torch.tensor([len(rows)], dtype=torch.int64, device=self.device)
        dist.broadcast(n, src=self.src, group=self.group)
        if not int(n.item()):
            return []
        if self.learner is not None:
            table = torch.tensor(rows, dtype=torch.int64, device=self.device)
        else:
            table = torch.empty((int(n.item()), width), dtype=torch.int64, device=self.device)
        dist.broadcast(table, src=self.src, group=self.group)
        return [tuple(int(v) for v in r) for r in table.tolist()]

    def _share_writes(self) -> list[tuple[int, int, int]]:
        writes = self._broadcast_rows(self._writes, 3)
        for p, start, stop in writes:
            flat = self._buffer(p)
            if self.learner is not None:
                self.plan.copy_range(p, self.params, flat, start, stop)
            dist.broadcast(flat[start:stop], src=self.src, group=self.group)
            if self.learner is None:
                self.plan.set_range(p, flat, self.params, start, stop)
        return writes

    def _replay_writes(self) -> list[tuple[int, int, int]]:
        """FSDP2: every rank makes rank 0's writes into its copy of θ on its own shard."""
        ops = self._broadcast_rows([(p, a, b, int(add)) for (p, a, b), add in zip(self._writes, self._adds,
                                                                                   strict=True)], 4)
        if not ops:
            return []
        if self.learner is not None:
            values = torch.cat(self._values).to(self.device)
        else:
            values = torch.empty(sum(b - a for _, a, b, _ in ops), dtype=torch.float32, device=self.device)
        dist.broadcast(values, src=self.src, group=self.group)
        self.shards.apply(ops, values)
        self._clear()
        return [(p, start, stop) for p, start, stop, _ in ops]

    def _buffer(self, p: int) -> torch.Tensor:
        """A flat fp32 buffer of fragment p's size on this rank's device (one per fragment size, reused)."""
        n = self.plan.fragments[p].numel
        buf = self._buffers.get(n)
        if buf is None:
            buf = self._buffers[n] = torch.empty(n, dtype=torch.float32, device=self.device)
        return buf

    def attach(self, optimizer: torch.optim.Optimizer | None = None, *,
               tokens: int | Callable[[], int], loss: Callable[[], float | None] | None = None):
        """`Learner.attach` for every rank: `step` runs after each `optimizer.step()`; returns the hook's handle."""
        optimizer = optimizer if optimizer is not None else self.optimizer
        return optimizer.register_step_post_hook(step_hook(self.step, tokens, loss))

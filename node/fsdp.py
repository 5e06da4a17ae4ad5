"""Where an FSDP2 learner's θ lives: each rank holds a shard of every parameter, the member rank a full copy.

Under `fully_shard` no rank holds the model, so the member rank's `Learner` works on a full-size host copy
of θ instead (`full_copy`), and the ranks' shards follow it:

- a fragment's values are gathered into the copy (`gather`) when the learner will read them: when the
  fragment is due to be sent (its pseudo-gradient is the copy minus its anchor) and before a checkpoint. One
  parameter is gathered at a time, so no GPU ever holds more than one whole parameter beyond its shard;
- everything the swarm writes into the copy (a version's sum added, a fragment replaced whole) is replayed
  on every rank's shard (`apply`): an addition adds the same values, a replacement sets them, element by
  element, on whichever rank holds the element.

Between two gathers the copy's values of a fragment lag behind the shards by the inner steps made since, but
the learner reads a fragment only right after its gather and writes it only by additions and replacements,
which the shards receive as such: the pseudo-gradient of every element is still Θ_base − θ at one moment
(node/theta.py), and the progress made since stays in the shards for the next one.

Supported layouts: every parameter a DTensor sharded on dim 0 and/or replicated (`fully_shard`, HSDP), or a
plain tensor (replicated).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from diloco.coordinator.plan import FragmentPlan


def _loaded(module: str):
    """`module` if some code already imported it, else None. A model can only be sharded once
    torch.distributed.tensor is imported, and importing it costs about 0.65 s of every learner's start."""
    return sys.modules.get(module)


def _is_dtensor(t: Tensor) -> bool:
    mod = _loaded("torch.distributed.tensor")
    return mod is not None and isinstance(t, mod.DTensor)


def is_sharded(model: nn.Module) -> bool:
    """True when some parameter of `model` is a DTensor (FSDP2's `fully_shard`)."""
    return any(_is_dtensor(t) for t in model.parameters())


@dataclass(frozen=True)
class _Piece:
    """This rank's part of one parameter: its flat elements [lo, hi), at `offset` in its fragment."""

    name: str
    offset: int
    lo: int
    hi: int


def _local_range(name: str, t: Tensor) -> tuple[int, int]:
    """The flat range of parameter `t` that this rank holds."""
    if not _is_dtensor(t):
        return 0, t.numel()
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if any(not (isinstance(pl, Replicate) or (isinstance(pl, Shard) and pl.dim == 0)) for pl in t.placements):
        raise TypeError(f"parameter {name!r} is placed as {t.placements}: a learner holds parameters sharded on "
                        "dim 0 or replicated (fully_shard's layout), nothing else")
    shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    row = math.prod(t.shape[1:]) if t.dim() else 1
    lo = (offset[0] if t.dim() else 0) * row
    return lo, lo + math.prod(shape)


def _local(t: Tensor) -> Tensor:
    """The flat tensor of this rank's elements of `t`, sharing its storage."""
    local = t.to_local() if _is_dtensor(t) else t
    if not local.is_contiguous():
        raise TypeError("a sharded parameter's local tensor is not contiguous")
    return local.detach().view(-1)


class Shards:
    """The ranks' shards of θ, laid out by the fragment plan (every rank builds one, collectively)."""

    def __init__(self, model: nn.Module, plan: FragmentPlan) -> None:
        self.model, self.plan = model, plan
        params = self._params()
        for name, t in params.items():
            if t.dtype != torch.float32:
                raise TypeError(f"parameter {name!r} is {t.dtype}: a learner trains fp32 parameters (use autocast "
                                "or FSDP2's MixedPrecisionPolicy for lower-precision compute)")
        self.pieces: list[list[_Piece]] = []
        for fragment in plan.fragments:
            pieces, offset = [], 0
            for name, shape in zip(fragment.names, fragment.shapes, strict=True):
                lo, hi = _local_range(name, params[name])
                pieces.append(_Piece(name, offset, lo, hi))
                offset += math.prod(shape)
            self.pieces.append(pieces)

    def _params(self) -> dict[str, Tensor]:
        """The sharded parameters (a forward without backward, such as an evaluation, leaves the root's
        gathered: FSDP2 swaps the module's parameters, so they are looked up each time)."""
        reshard(self.model)
        return dict(self.model.named_parameters())

    def full_copy(self) -> dict[str, Tensor]:
        """Full-size fp32 host tensors, one per parameter (the member rank's θ), not yet filled."""
        return {n: torch.empty(s, dtype=torch.float32) for f in self.plan.fragments
                for n, s in zip(f.names, f.shapes, strict=True)}

    def gather(self, fragments: Iterable[int], into: dict[str, Tensor] | None) -> None:
        """Collective: these fragments' full values into `into` (the member rank's copy; None on the others)."""
        params = self._params()
        with torch.no_grad():
            for p in fragments:
                for piece in self.pieces[p]:
                    t = params[piece.name]
                    full = t.full_tensor() if _is_dtensor(t) else t
                    if into is not None:
                        into[piece.name].copy_(full)
                    del full

    def scatter(self, full: dict[str, Tensor] | None, src: int, group=None) -> None:
        """Collective: every rank's shards := `full` (the member rank's copy, given on rank `src` only), one
        parameter at a time."""
        import torch.distributed as dist

        params = self._params()
        with torch.no_grad():
            for fragment, pieces in zip(self.plan.fragments, self.pieces, strict=True):
                for piece, shape in zip(pieces, fragment.shapes, strict=True):
                    local = _local(params[piece.name])
                    buf = (full[piece.name].to(local.device) if full is not None
                           else torch.empty(shape, dtype=torch.float32, device=local.device))
                    dist.broadcast(buf, src=src, group=group)
                    local.copy_(buf.view(-1)[piece.lo:piece.hi])

    def apply(self, writes: Iterable[tuple[int, int, int, int]], values: Tensor) -> None:
        """For each write (p, start, stop, add), in order: θ[p][start:stop] += (add) or := its stop − start
        values, the next ones of `values`, on the elements this rank holds."""
        params = self._params()
        at = 0
        with torch.no_grad():
            for p, start, stop, add in writes:
                mine = values[at: at + stop - start]
                at += stop - start
                for piece in self.pieces[p]:
                    lo, hi = max(start, piece.offset + piece.lo), min(stop, piece.offset + piece.hi)
                    if lo >= hi:
                        continue
                    local = _local(params[piece.name])
                    part = local[lo - piece.offset - piece.lo: hi - piece.offset - piece.lo]
                    src = mine[lo - start: hi - start].to(part.device, non_blocking=True)
                    if add:
                        part.add_(src)
                    else:
                        part.copy_(src)


def reshard(model: nn.Module) -> None:
    """Free what FSDP2 left gathered after a forward with no backward; nothing for other models."""
    fsdp = _loaded("torch.distributed.fsdp")
    if fsdp is None:
        return
    for module in model.modules():
        if isinstance(module, fsdp.FSDPModule):
            module.reshard()


def shard_model(model: nn.Module) -> nn.Module:
    """FSDP2 the usual way: `fully_shard` every block of each `nn.ModuleList` (a transformer's layers), then
    the whole model (the rest: embeddings, final norm, head)."""
    from torch.distributed.fsdp import fully_shard

    for module in list(model.modules()):
        if isinstance(module, nn.ModuleList):
            for block in module:
                fully_shard(block)
    fully_shard(model)
    return model

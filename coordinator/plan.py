"""The fragment plan: which parameter tensors travel together as fragment p (docs/architecture.md §5.1).

Tensors are packed whole (never split) into P fragments by greedy balanced bin packing, largest first (the LPT
rule: each tensor goes to the currently lightest fragment), ties broken by name. The plan depends only on the
set of (name, shape, is_embedding) triples and P, not on the order they were given in, so every peer that
builds the same model builds the same plan; `digest()` is folded into the run id so peers that disagree
refuse each other. This module must never touch the network or hold training state.

Embeddings (merged with the weighted mean, everything else with RDA; merge.py): packing ignores the flag,
so a fragment may mix both kinds. Inside a fragment the embedding tensors come first, so they form a prefix
of the flat fragment of `embedding_numel` elements, which merge() treats with the weighted mean and the rest
with RDA. `Fragment.is_embedding` says whether a fragment holds any embedding. (Keeping embeddings in
fragments of their own instead would cost balance badly whenever they are a small share of the model.)
"""

from __future__ import annotations

import hashlib
import heapq
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from diloco.protocol import canonical

EMBEDDING_NAME_PARTS = ("wte", "wpe", "embed")

EmbeddingRule = Callable[[str, "nn.Module | None"], bool]


def default_embedding_rule(name: str, module: nn.Module | None = None) -> bool:
    """An embedding is a parameter of an `nn.Embedding`/`nn.EmbeddingBag`, or one whose name says so."""
    if isinstance(module, nn.Embedding | nn.EmbeddingBag):
        return True
    lowered = name.lower()
    return any(part in lowered for part in EMBEDDING_NAME_PARTS)


@dataclass(frozen=True)
class Fragment:
    """One fragment: its tensors in plan order (the order of `flatten`), their shapes and total size."""

    index: int
    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    numel: int
    is_embedding: bool  # holds at least one embedding tensor
    embedding_numel: int  # the embedding tensors are the first `embedding_numel` elements of the fragment


class FragmentPlan:
    """P fragments over a model's named tensors; build with `from_module` or `from_shapes`."""

    def __init__(self, entries: Iterable[tuple[str, Iterable[int], bool]], P: int) -> None:
        tensors: dict[str, tuple[tuple[int, ...], bool]] = {}
        for name, shape, is_embedding in entries:
            if name in tensors:
                raise ValueError(f"tensor name {name!r} appears twice in the fragment plan")
            dims = tuple(int(d) for d in shape)
            if any(d < 0 for d in dims):
                raise ValueError(f"tensor {name!r} has a negative dimension: {dims}")
            tensors[name] = (dims, bool(is_embedding))
        if not isinstance(P, int) or P < 1:
            raise ValueError(f"fragment count P must be a positive integer, got {P!r}")
        if P > len(tensors):
            raise ValueError(
                f"fragment count P={P} exceeds the {len(tensors)} parameter tensors of the model; "
                f"tensors are never split, so choose P <= {len(tensors)}"
            )
        self.P = P
        self._shapes = {name: dims for name, (dims, _) in tensors.items()}
        self._embedding = {name: emb for name, (_, emb) in tensors.items()}
        # LPT: largest first, ties by name; each tensor joins the lightest fragment, ties by (count, index),
        # so the first P tensors open the P fragments even if some have zero elements.
        order = sorted(tensors, key=lambda n: (-math.prod(self._shapes[n]), n))
        bins: list[list[str]] = [[] for _ in range(P)]
        heap = [(0, 0, i) for i in range(P)]
        for name in order:
            load, count, i = heapq.heappop(heap)
            bins[i].append(name)
            heapq.heappush(heap, (load + math.prod(self._shapes[name]), count + 1, i))
        self.fragments = []
        for i, placed in enumerate(bins):
            names = sorted(placed, key=lambda n: not self._embedding[n])  # stable: embeddings first
            self.fragments.append(
                Fragment(
                    index=i,
                    names=tuple(names),
                    shapes=tuple(self._shapes[n] for n in names),
                    numel=sum(math.prod(self._shapes[n]) for n in names),
                    is_embedding=any(self._embedding[n] for n in names),
                    embedding_numel=sum(math.prod(self._shapes[n]) for n in names if self._embedding[n]),
                )
            )
        self._fragment_of = {n: f.index for f in self.fragments for n in f.names}

    @classmethod
    def from_shapes(cls, entries: Iterable[tuple[str, Iterable[int], bool]], P: int) -> FragmentPlan:
        """Build from `(name, shape, is_embedding)` triples."""
        return cls(entries, P)

    @classmethod
    def from_module(
        cls, model: nn.Module, P: int, embedding_rule: EmbeddingRule = default_embedding_rule
    ) -> FragmentPlan:
        """Build from every parameter of `model.named_parameters()` (shared parameters once, frozen ones too)."""
        owner = {}
        for mod_name, module in model.named_modules():
            for p_name, _ in module.named_parameters(recurse=False):
                owner.setdefault(f"{mod_name}.{p_name}" if mod_name else p_name, module)
        return cls(
            ((n, p.shape, embedding_rule(n, owner.get(n))) for n, p in model.named_parameters()),
            P,
        )

    @classmethod
    def from_named_parameters(
        cls,
        named: Iterable[tuple[str, Tensor]],
        P: int,
        embedding_rule: EmbeddingRule = default_embedding_rule,
    ) -> FragmentPlan:
        """Build from `named_parameters()`-like pairs; embeddings are recognised by name only."""
        return cls(((n, t.shape, embedding_rule(n, None)) for n, t in named), P)

    def __len__(self) -> int:
        return self.P

    @property
    def names(self) -> list[str]:
        """All tensor names, fragment by fragment, in plan order."""
        return [n for f in self.fragments for n in f.names]

    def fragment_of(self, name: str) -> int:
        """The index of the fragment that holds tensor `name`."""
        try:
            return self._fragment_of[name]
        except KeyError:
            raise KeyError(f"tensor {name!r} is not in the fragment plan") from None

    def is_embedding(self, name: str) -> bool:
        return self._embedding[name]

    def digest(self) -> bytes:
        """SHA-256 of the canonical msgpack of P, every (name, shape, is_embedding) and the assignment."""
        tensors = [
            [n, list(self._shapes[n]), self._embedding[n]] for n in sorted(self._shapes, key=str.encode)
        ]
        doc = {"P": self.P, "tensors": tensors, "fragments": [list(f.names) for f in self.fragments]}
        return hashlib.sha256(b"diloco/fragment-plan/v1\x00" + canonical.packb(doc)).digest()

    def balance(self) -> float:
        """Largest fragment ÷ the ideal mean (1.0 is perfect balance)."""
        total = sum(f.numel for f in self.fragments)
        if total == 0:
            return 1.0
        return max(f.numel for f in self.fragments) / (total / self.P)

    def _tensors(self, p: int, params: Mapping[str, Tensor]) -> list[Tensor]:
        fragment = self.fragments[p]
        out = []
        for name, shape in zip(fragment.names, fragment.shapes, strict=True):
            if name not in params:
                raise KeyError(f"fragment {p} needs tensor {name!r}, which the model does not have")
            t = params[name]
            if tuple(t.shape) != shape:
                raise ValueError(f"tensor {name!r} has shape {tuple(t.shape)}, the plan says {shape}")
            out.append(t)
        return out

    def flatten(self, p: int, params: Mapping[str, Tensor], out: Tensor | None = None) -> Tensor:
        """Fragment p of `params` as one 1-D fp32 CPU tensor (where the anchors live, whatever the model's
        device), tensors concatenated in plan order: a new one, or written into `out` (a flat fp32 buffer of the
        fragment's size)."""
        if out is not None:
            self._each_slice(p, out, params, lambda t, part: part.copy_(t))
            return out
        with torch.no_grad():
            return torch.cat([t.detach().reshape(-1).to("cpu", torch.float32) for t in self._tensors(p, params)])

    def add_into(self, p: int, flat: Tensor, params: Mapping[str, Tensor]) -> None:
        """params[fragment p] += flat, tensor by tensor, in place: no flat copy of the fragment is made."""
        self._each_slice(p, flat, params, _add)

    def unflatten_into(self, p: int, flat: Tensor, params: Mapping[str, Tensor]) -> None:
        """Copy a 1-D fragment back into the tensors of `params`, in place (dtype cast, no reallocation)."""
        self._each_slice(p, flat, params, Tensor.copy_)

    def copy_range(self, p: int, params: Mapping[str, Tensor], out: Tensor, start: int, stop: int) -> int:
        """out[start:stop] := fragment p of `params` there (`out` a flat fp32 buffer of the fragment's size), for
        copying a fragment out a slice at a time. A tensor that is not contiguous is copied whole, from the
        slice that holds its first element; returns the end of what was copied (≥ `stop`)."""
        return self._each_range(p, out, params, start, stop, lambda t, part: part.copy_(t))

    def set_range(self, p: int, flat: Tensor, params: Mapping[str, Tensor], start: int, stop: int) -> int:
        """params[fragment p][start:stop] := flat[start:stop] (`flat` the whole flat fragment), in place: the
        inverse of `copy_range`, with its rule for tensors that are not contiguous."""
        return self._each_range(p, flat, params, start, stop, Tensor.copy_)

    def add_range(self, p: int, flat: Tensor, params: Mapping[str, Tensor], start: int, stop: int) -> int:
        """params[fragment p][start:stop] += flat[start:stop] (`flat` the whole flat fragment), in place; the
        same rule for tensors that are not contiguous as `copy_range`."""
        return self._each_range(p, flat, params, start, stop, _add)

    def _each_range(self, p: int, flat: Tensor, params: Mapping[str, Tensor], start: int, stop: int, op) -> int:
        fragment = self.fragments[p]
        if flat.dim() != 1 or flat.numel() != fragment.numel:
            raise ValueError(
                f"fragment {p} holds {fragment.numel} elements, got a tensor of shape {tuple(flat.shape)}"
            )
        end = start
        with torch.no_grad():
            offset = 0
            for t in self._tensors(p, params):
                n = t.numel()
                lo, hi = max(start, offset), min(stop, offset + n)
                if lo < hi:
                    if t.is_contiguous():
                        op(t.view(-1)[lo - offset : hi - offset], flat[lo:hi])
                        end = max(end, hi)
                    elif lo == offset:  # whole, once: from the range that holds its first element
                        op(t, flat[offset : offset + n].view(t.shape))
                        end = max(end, offset + n)
                    else:
                        end = max(end, offset + n)  # copied with an earlier range
                offset += n
        return max(end, min(stop, fragment.numel))

    def _each_slice(self, p: int, flat: Tensor, params: Mapping[str, Tensor], op) -> None:
        """op(tensor, its slice of `flat`) for every tensor of fragment p, in plan order."""
        fragment = self.fragments[p]
        if flat.dim() != 1 or flat.numel() != fragment.numel:
            raise ValueError(
                f"fragment {p} holds {fragment.numel} elements, got a tensor of shape {tuple(flat.shape)}"
            )
        with torch.no_grad():
            offset = 0
            for t in self._tensors(p, params):
                n = t.numel()
                op(t, flat[offset : offset + n].view(t.shape))
                offset += n


def _add(t: Tensor, part: Tensor) -> None:
    """t += part, `part` first moved to t's device (a CPU slice into a CUDA parameter: torch refuses to mix)."""
    t.add_(part.to(t.device))

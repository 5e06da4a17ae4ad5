"""The merge rule of one fragment's outer step (docs/architecture.md §6.2): many learners' deltas in, one delta out.

Pure tensor math, no network and no state. Each contribution is weighted by the tokens behind it and
discounted by its staleness, no share above a cap; non-finite deltas are refused; outlier norms are clipped to
c·median (this round's norms and the owner's recent ones); then
non-embedding fragments use radial-directional averaging (RDA) and embedding fragments the weighted mean.
Deltas are 1-D fragments (plan.py); arithmetic is fp32 with fp64 norms and scalar weights. Loops run over
contributions, never over elements. A contribution's delta may be a callable that produces it, optionally into
a buffer it is given (an owner decodes from the bytes it holds): `merge` then streams, holding one decoded
delta at a time instead of all M at once. RDA needs one pass (clipping changes a delta's norm, not its
direction, so only the radius waits for the median); a weighted-mean part needs a second.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from diloco.protocol.codecs import l2_norm
from diloco.protocol.errors import Malformed

# Below this norm x/‖x‖ is not representable in fp32 (the smallest normal fp32), so φ(x) is taken as 0.
_TINY = torch.finfo(torch.float32).tiny
_EPS = torch.finfo(torch.float32).eps


class InvalidContribution(Malformed, ValueError):
    """A contribution that must not be merged (bad shape, dtype or counters). The caller drops and counts it."""


class NonFiniteDelta(InvalidContribution):
    """A delta holding NaN or ±inf (or whose norm overflows)."""


@dataclass(frozen=True)
class Contribution:
    """One learner's pseudo-gradient Δ = Θ_anchor − θ_local for a fragment, with the counters behind it."""

    delta: Tensor | Callable[[Tensor | None], Tensor]  # or what produces it (into the buffer given, if one
    # is), called once per pass of `merge`
    tokens: int
    steps: int
    staleness: int = 0
    learner: str = ""


@dataclass(frozen=True)
class MergeResult:
    delta: Tensor  # the merged 1-D fp32 delta
    weights: list[float]  # the shares: normalised weights w_m / Σ w (capped at `max_share`), in contribution order
    clipped: int  # how many deltas had their norm clipped to c·median
    total_tokens: int
    norms: list[float]  # ‖s_m Δ_m‖, the norms merged (after clipping): the next rounds' clipping reference
    limit: float = math.inf  # λ, the norm every delta was clipped to (published: a replica recomputes with it)


def token_weight(tokens: int, steps: int, staleness: int = 0) -> float:
    """w_m = c_tokens·(c_tokens/c_steps) · 1/(1+s): Decoupled DiLoCo 2604.21428 token weights, discounted by
    staleness (docs/architecture.md §6.2)."""
    return tokens * (tokens / steps) / (1 + staleness)


def delta_of(c: Contribution, out: Tensor | None = None) -> Tensor:
    """The contribution's delta; a callable one is asked to produce it into `out` (a flat fp32 buffer)."""
    return c.delta(out) if callable(c.delta) else c.delta


def validate(c: Contribution, numel: int | None = None, delta: Tensor | None = None) -> float:
    """Check one contribution and return ‖Δ‖ (fp64); raise `InvalidContribution`/`NonFiniteDelta`."""
    d = delta_of(c) if delta is None else delta
    who = f"contribution of {c.learner!r}" if c.learner else "contribution"
    if not isinstance(d, Tensor) or d.dim() != 1 or not d.is_floating_point():
        raise InvalidContribution(f"{who}: delta must be a 1-D floating tensor")
    if numel is not None and d.numel() != numel:
        raise InvalidContribution(f"{who}: delta has {d.numel()} elements, the fragment has {numel}")
    for field in ("tokens", "steps"):
        value = getattr(c, field)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise InvalidContribution(f"{who}: {field} must be a positive integer, got {value!r}")
    if isinstance(c.staleness, bool) or not isinstance(c.staleness, int) or c.staleness < 0:
        raise InvalidContribution(f"{who}: staleness must be a non-negative integer, got {c.staleness!r}")
    # One pass: the norm is finite iff every element is (fp64 so that large finite fp32 values do not overflow).
    norm = l2_norm(d)
    if not math.isfinite(norm):
        raise NonFiniteDelta(f"{who}: delta holds NaN or infinite values")
    return norm


def drop_stale(contributions: Iterable[Contribution], max_staleness: int) -> tuple[list[Contribution], int]:
    """Keep contributions with staleness <= max_staleness (in versions); return (kept, number dropped)."""
    kept, dropped = [], 0
    for c in contributions:
        if c.staleness <= max_staleness:
            kept.append(c)
        else:
            dropped += 1
    return kept, dropped


def clip_limit(norms: Sequence[float], c: float, reference: Sequence[float] = ()) -> float:
    """λ = c·median(‖Δ‖ ∪ reference) (docs/architecture.md §6.2). `reference`: the owner's accepted norms of
    recent rounds, so that one delta cannot move the median it is clipped against (with two deltas alone, the
    larger is never above 3× theirs)."""
    return c * statistics.median([*norms, *reference])


def clip_factors(norms: Sequence[float], c: float, reference: Sequence[float] = (),
                 limit: float | None = None) -> list[float]:
    """s_m = min(1, λ/‖Δ_m‖): norms above λ (`limit`, else `clip_limit`) are clipped to it."""
    limit = clip_limit(norms, c, reference) if limit is None else limit
    return [1.0 if n <= limit else limit / n for n in norms]


def capped_shares(weights: Sequence[float], cap: float) -> list[float]:
    """The weights normalised to shares, none above `cap` (at least 1/M): what a capped share loses goes to
    the others in proportion to their weights, so no learner's claims buy more than `cap` of a merge."""
    total = math.fsum(weights)
    if not 0.0 < total < math.inf:
        return list(weights)  # (counters `validate` refuses)
    if len(weights) <= 1 or cap >= 1.0:
        return [w / total for w in weights]
    cap = max(cap, 1.0 / len(weights))
    fixed: set[int] = set()
    while True:
        free = [i for i in range(len(weights)) if i not in fixed]
        free_total, free_share = math.fsum(weights[i] for i in free), 1.0 - cap * len(fixed)
        if not free or free_total <= 0.0:
            return [cap if i in fixed else free_share / max(len(free), 1) for i in range(len(weights))]
        over = {i for i in free if weights[i] / free_total * free_share > cap}
        if not over:
            return [cap if i in fixed else weights[i] / free_total * free_share for i in range(len(weights))]
        fixed |= over


def weighted_mean(deltas: Sequence[Tensor], weights: Sequence[float]) -> Tensor:
    """Σ w_m Δ_m / Σ w_m  (DiLoCo 2311.08105 outer average, token-weighted as in Decoupled DiLoCo 2604.21428)."""
    total = math.fsum(weights)
    out = torch.zeros_like(deltas[0], dtype=torch.float32)
    for d, w in zip(deltas, weights, strict=True):
        out.add_(d, alpha=w / total)
    return out


def rda(deltas: Sequence[Tensor], weights: Sequence[float], norms: Sequence[float] | None = None) -> Tensor:
    """RDA_w(Δ) = (Σ w_m‖Δ_m‖ / Σ w_m) · φ(Σ w_m φ(Δ_m) / Σ w_m), φ(x) = x/‖x‖, φ(0) = 0  (Decoupled DiLoCo 2604.21428).

    The radius is the weighted mean norm and the direction the normalised weighted mean of unit directions, so
    the merged norm does not shrink as learners are added. `norms` may pass precomputed ‖Δ_m‖.
    """
    if norms is None:
        norms = [l2_norm(d) for d in deltas]
    total = math.fsum(weights)
    radius = math.fsum(w * n for w, n in zip(weights, norms, strict=True)) / total
    direction = torch.zeros_like(deltas[0], dtype=torch.float32)
    for d, w, n in zip(deltas, weights, norms, strict=True):
        if n >= _TINY:  # φ(Δ_m) = Δ_m/‖Δ_m‖, else 0
            direction.add_(d, alpha=w / (total * n))
    return _finish_rda(direction, radius, len(deltas))


def _finish_rda(direction: Tensor, radius: float, count: int) -> Tensor:
    """u = Σ w_m φ(Δ_m)/Σ w_m, in place: radius · φ(u)."""
    length = l2_norm(direction)
    # ‖u‖ <= 1 (a mean of unit vectors). When the directions cancel, what is left of u is fp32 rounding
    # (about M·ε); normalising it would blow noise up to the full radius, so treat it as 0: φ(0) = 0.
    if length <= 4 * count * _EPS or radius == 0.0:
        return direction.zero_()
    return direction.mul_(radius / length)


def merge(
    contributions: Iterable[Contribution],
    is_embedding: bool = False,
    clip_c: float = 3.0,
    *,
    embedding_numel: int | None = None,
    out: Tensor | None = None,
    scratch: Tensor | None = None,
    reference_norms: Sequence[float] = (),
    max_share: float = 1.0,
    limit: float | None = None,
    sparse: bool = False,
) -> MergeResult:
    """Merge the contributions of one fragment (docs/architecture.md §6.2).

    `is_embedding` merges the whole fragment with the weighted mean, otherwise RDA is used; a fragment that
    mixes both kinds passes `embedding_numel=Fragment.embedding_numel` instead: its first `embedding_numel`
    elements (the embedding tensors) get the weighted mean and the rest RDA. Clipping uses the whole delta.
    The same sums as `weighted_mean` and `rda` on the clipped deltas, taken one contribution at a time.
    `out` receives the merged delta and `scratch` the decoded deltas of callable contributions (flat fp32
    buffers of the fragment's size; fresh ones when not given). Norms are clipped against the median of
    theirs and `reference_norms` (`clip_factors`); no contribution's share is above `max_share`
    (`capped_shares`). `limit` fixes λ instead (a replica recomputing a published merge, coordinator/audit.py).
    `sparse` (the deltas of a sparse codec, `Codec.sparse`): every coordinate gets the weighted mean of the
    clipped deltas that hold it (a non-zero value there), 0 where none does; no RDA (`sparse_mean`).

    Raises `InvalidContribution` (or its subclass `NonFiniteDelta`) for the first bad contribution: validate
    each one with `validate` on receipt and drop the bad ones so that this never raises.
    """
    cs = list(contributions)
    if not cs:
        raise ValueError("merge needs at least one contribution")
    if not clip_c > 0:
        raise ValueError(f"clip_c must be positive, got {clip_c}")
    first = delta_of(cs[0], scratch)
    numel = first.numel()
    k = numel if is_embedding else (embedding_numel or 0)
    if not 0 <= k <= numel or (is_embedding and embedding_numel not in (None, numel)):
        raise ValueError(f"embedding_numel={embedding_numel} does not fit a fragment of {numel} elements")
    out = torch.zeros(numel, dtype=torch.float32) if out is None else out.zero_()
    weights = capped_shares([token_weight(c.tokens, c.steps, c.staleness) for c in cs], max_share)
    total = math.fsum(weights)
    if sparse:
        return sparse_mean(cs, weights, total, numel, out, scratch, clip_c, reference_norms, limit)
    mean, direction = out[:k], out[k:]
    # Pass 1: the norms, and RDA's sum of unit directions (φ(sΔ_m) = Δ_m/‖Δ_m‖: clipping keeps the direction).
    norms, tails = [], []  # ‖Δ_m‖, and ‖Δ_m[k:]‖ (the RDA part's own norm)
    for i, (c, w) in enumerate(zip(cs, weights, strict=True)):
        d = first if i == 0 else delta_of(c, scratch)
        norms.append(validate(c, numel, d))
        tails.append(norms[-1] if k == 0 else l2_norm(d[k:]))
        if k < numel and tails[-1] >= _TINY:
            direction.add_(d[k:], alpha=w / (total * tails[-1]))
        del d
    del first
    limit = clip_limit(norms, clip_c, reference_norms) if limit is None else limit
    factors = clip_factors(norms, clip_c, limit=limit)
    if k:  # pass 2: the weighted mean of the clipped deltas needs the clip factors, hence the median
        for c, w, s in zip(cs, weights, factors, strict=True):
            mean.add_(delta_of(c, scratch)[:k], alpha=w * s / total)
    if k < numel:
        if any(n * s < _TINY <= n for n, s in zip(tails, factors, strict=True)):
            # a delta clipped below the representable: φ(sΔ) = 0 for it; redo the sum without it (only
            # reachable when the median norm itself is below ~1e-38)
            direction.zero_()
            for c, w, s, n in zip(cs, weights, factors, tails, strict=True):
                if n * s >= _TINY:
                    direction.add_(delta_of(c, scratch)[k:], alpha=w / (total * n))
        radius = math.fsum(w * n * s for w, n, s in zip(weights, tails, factors, strict=True)) / total
        _finish_rda(direction, radius, len(cs))
    return _result(out, cs, weights, total, norms, factors, limit)


def sparse_mean(cs: list[Contribution], weights: list[float], total: float, numel: int, out: Tensor,
                scratch: Tensor | None, clip_c: float, reference_norms: Sequence[float],
                limit: float | None) -> MergeResult:
    """The merge of sparse deltas: out[i] = Σ_m w_m s_m Δ_m[i] / Σ_{m: Δ_m[i] ≠ 0} w_m (s_m the clip factors).
    Their supports barely overlap, and a delta's zeros are coordinates its sender kept back (they stay in its
    θ[p] for a later delta), not a zero move: a plain mean would shrink a coordinate one learner sent by its
    share, and RDA would scale it by about √M (docs/protocol.md §7.21)."""
    norms = [validate(c, numel, delta_of(c, scratch)) for c in cs]
    limit = clip_limit(norms, clip_c, reference_norms) if limit is None else limit
    factors = clip_factors(norms, clip_c, limit=limit)
    held = torch.zeros(numel, dtype=torch.float32)  # Σ w_m over the deltas holding each coordinate
    for c, w, s in zip(cs, weights, factors, strict=True):
        d = delta_of(c, scratch)
        out.add_(d, alpha=w * s / total)
        held.add_(d.ne(0).to(torch.float32), alpha=w / total)
    out.div_(held.masked_fill_(held == 0, 1.0))
    return _result(out, cs, weights, total, norms, factors, limit)


def _result(out: Tensor, cs: list[Contribution], weights: list[float], total: float, norms: list[float],
            factors: list[float], limit: float) -> MergeResult:
    return MergeResult(
        delta=out,
        weights=[w / total for w in weights],
        clipped=sum(1 for s in factors if s < 1.0),
        total_tokens=sum(c.tokens for c in cs),
        norms=[n * s for n, s in zip(norms, factors, strict=True)],
        limit=limit,
    )

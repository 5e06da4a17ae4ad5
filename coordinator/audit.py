"""Checking an owner's work: a published update is recomputed by the replicas that hold its deltas, and
checked for its size and for this learner's own delta by every learner (docs/protocol.md §7.19,
docs/security.md "What an owner can do").

An owner is whoever the member records rank first, and a member writes its own record: its updates must be
checkable. An update names what it merged (`UpdateFields.merged`: each delta's learner, payload digest,
counters and staleness, and the clipping norm λ); the merge and the outer step are deterministic given those
and the momentum of the base version, so a replica that holds the signed delta frames (they travel in
`replicate`) recomputes the update and refuses one that does not match. The owner's error-feedback residual
and the codec's rounding are not recomputed: the check is to a tolerance of the codec (`TOLERANCE`), not bit
for bit. A learner holds only its own deltas: it checks that an update naming it names a delta it sent with
the counters it sent, and that the update's norm is not far outside the fragment's recent history.
"""

from __future__ import annotations

import collections
import functools
import logging
import math
from collections.abc import Callable, Sequence

import torch

from diloco.protocol.codecs import Codec, l2_norm
from diloco.protocol.envelope import Envelope, parse_header
from diloco.protocol.errors import ProtocolError
from diloco.protocol.identity import peer_id_of

from .buffers import BufferPool
from .fragments import Encoded
from .merge import Contribution, merge
from .outer import OuterOptimizer
from .owner import NORM_HISTORY
from .version import Version
from .wire import DELTA, DeltaFields, UpdateFields

log = logging.getLogger(__name__)

# ‖Û − U_ref‖ allowed, as a fraction of the size of the step's terms lr·((1+μ)‖Δ̄‖ + μ²‖b‖): the codec's rounding
# of U and of the replicated momentum, and the owner's error-feedback residual (a previous rounding), fit well
# inside; a scaled, sign-flipped or noisy update does not.
TOLERANCE = {"fp32": 1e-3, "fp16": 0.02, "bf16": 0.05, "int8": 0.1, "int4": 0.5,
             "topk": 0.1}  # (its update: every coordinate of the merge, values rounded to 6 bits: ~0.005)
NORM_WINDOW = 32  # accepted update norms kept per fragment (and run-wide, as RMS)
NORM_WARMUP = 5  # accepted updates before a fragment's own history is used
NORM_K = 20.0  # an update norm above k × the median of its history is refused (momentum warm-up: ~5×)
ANCHOR_FRACTION = 10.0  # an update this many times larger than the anchor it moves is refused, history or not
SENT_KEPT = 32  # this learner's recent deltas kept per fragment (digest and counters): a new owner's first round
# may merge one sent several deltas ago (they pile up while it waits to learn the newest version)


class AuditFailed(ProtocolError):
    """An update that does not match the merge it names, or that this peer will not apply."""

    status = 403


class RefusedUpdate(AuditFailed):
    """An update refused by a learner's own checks (its norm, its own delta, a distrusted publisher)."""

    status = 422


def recompute(f: UpdateFields, frames: Sequence[bytes | memoryview], open_frame: Callable[[memoryview], Envelope],
              codec: Codec, numel: int, embedding_numel: int, outer: OuterOptimizer, max_share: float,
              clip_c: float, momentum: torch.Tensor | None, P: int,
              take: Callable[[], torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor | None, float, list[float]]:
    """(U_ref, b'_ref, scale, norms): the update and momentum that the deltas `frames` (signed delta envelopes, in `f.merged`'s
    order) give from the base version's momentum, by the rule of docs/protocol.md §7.12 with the update's λ.
    `scale` = lr·((1+μ)‖Δ̄‖ + μ²‖b‖), what `matches` measures a difference against; `norms` the clipped norms
    merged (an owner's clipping reference, `MergeResult.norms`). Raises `AuditFailed` when
    a frame is not the delta the update names. `momentum` is overwritten by b'_ref; `take` lends the flat
    fp32 work buffers of `numel` elements (fresh ones when None), as an owner's step borrows them: the deltas
    are decoded one at a time into one of them, as the merge reads them."""
    take = take or (lambda: torch.empty(numel, dtype=torch.float32))
    if len(frames) != len(f.merged) or not f.merged:
        raise AuditFailed(f"update {f.new} of fragment {f.p} names {len(f.merged)} deltas, {len(frames)} came")
    contributions = []
    for m, frame in zip(f.merged, frames, strict=True):
        env = open_frame(memoryview(frame))
        d = DeltaFields.parse(env.fields, P) if env.kind == DELTA else None
        if d is None or peer_id_of(env.sender) != m.learner or d.p != f.p or (d.steps, d.tokens) != (m.steps, m.tokens) \
                or max(0, f.base.version - d.base.version) != m.staleness \
                or parse_header(env.header)["payload_digest"] != m.digest:
            raise AuditFailed(f"a delta frame is not the delta of {m.learner[:8]} that update {f.new} names")
        contributions.append(Contribution(functools.partial(Encoded(codec, d.codec, env.payload).decode, numel),
                                          m.tokens, m.steps, m.staleness, m.learner))
    result = merge(contributions, clip_c=clip_c, embedding_numel=embedding_numel, limit=f.clip,
                   max_share=max_share, sparse=codec.sparse, out=take(), scratch=take())
    merged_norm = l2_norm(result.delta)
    momentum_norm = 0.0 if momentum is None else l2_norm(momentum)
    new_momentum = outer.update_into(result.delta, momentum,  # result.delta is U_ref from here on
                                     out=momentum if momentum is not None else take())
    scale = outer.lr * ((1 + outer.momentum) * merged_norm + outer.momentum**2 * momentum_norm)
    return result.delta, new_momentum, scale, result.norms


def checkable(f: UpdateFields, frames: Sequence[memoryview], kept: tuple[Version, Encoded | None] | None) -> bool:
    """Whether update `f` can be recomputed from `frames` and the momentum `kept` of its base: the delta frames
    came, and the base's momentum is of the owner's own term (the first version of a term is not checked)."""
    return bool(frames) and kept is not None and kept[0] == f.base and f.base.term == f.new.term


def matches(published: torch.Tensor, reference: torch.Tensor, scale: float, codec: str, *,
            in_place: bool = False) -> bool:
    """‖published − reference‖ within the codec's tolerance of `scale`; `in_place` leaves the difference in
    `published` (a work buffer) instead of allocating one."""
    diff = published.sub_(reference) if in_place else published - reference
    return l2_norm(diff) <= TOLERANCE.get(codec, 0.5) * scale + 1e-30


class UpdateGuard:
    """A learner's checks of the updates it applies (`FragmentSync.apply_update`): the update's norm against
    the fragment's history and the anchor, this learner's own delta as the update names it, and the
    publishers it no longer trusts. One per peer, on the loop."""

    def __init__(self, me: str, on_distrust: Callable[[str], None] = lambda peer: None,
                 stats: collections.Counter[str] | None = None) -> None:
        self.me, self.on_distrust = me, on_distrust
        self.norms: collections.defaultdict[int, collections.deque[float]] = collections.defaultdict(
            lambda: collections.deque(maxlen=NORM_WINDOW))
        self.rms: collections.deque[float] = collections.deque(maxlen=NORM_WINDOW)  # run-wide ‖U‖/√numel
        # p -> (digest, steps, tokens) of the deltas this learner signed lately
        self.sent: collections.defaultdict[int, collections.deque[tuple[bytes, int, int]]] = collections.defaultdict(
            lambda: collections.deque(maxlen=SENT_KEPT))
        self.distrusted: set[str] = set()
        self.refused: set[tuple[int, Version]] = set()
        self.stats = collections.Counter() if stats is None else stats  # (the sync's: in /v1/status)

    def sent_delta(self, p: int, digest: bytes, steps: int, tokens: int) -> None:
        """This learner signed a delta of p (recorded before it is sent: it may be merged at once)."""
        if (digest, steps, tokens) not in self.sent[p]:
            self.sent[p].append((digest, steps, tokens))

    def check_signer(self, p: int, new: Version, signer: str | None) -> None:
        """Refuse anything a distrusted peer signed, and a version this peer refused before (`signer` None:
        only the latter, for the version a new owner builds on, coordinator/distrust.py)."""
        if (signer is not None and signer in self.distrusted) or (p, new) in self.refused:
            self.stats["updates_refused_distrusted"] += 1
            raise RefusedUpdate(f"version {new} of fragment {p} comes from {signer[:8]}, whose updates this peer "
                                f"refused")

    def check(self, f: UpdateFields, signer: str, norm: float, anchor_norm: float, numel: int) -> None:
        """Raise `RefusedUpdate` (and distrust `signer`) for an update this learner must not apply."""
        self.check_signer(f.p, f.new, signer)
        reason = self._own_delta(f) or self._outlier(f.p, norm, anchor_norm, numel)
        if reason is not None:
            self.refuse(f.p, f.new, signer, reason)

    def check_install(self, p: int, new: Version, signer: str, jump: float, anchor_norm: float, versions: int,
                      numel: int, *, leaving: bool = False) -> None:
        """A whole fragment replacing a held one (a catch-up download) moves the anchor by `jump` over
        `versions` versions: the norm bounds of `check` apply to it, `versions` times over. `leaving`: the
        version a new owner builds on, replacing one of a distrusted publisher (coordinator/distrust.py): it
        may be signed by that publisher too (the owner refused only its last versions)."""
        self.check_signer(p, new, None if leaving else signer)
        reason = self._outlier(p, jump / max(versions, 1), anchor_norm, numel)
        if reason is not None:
            self.refuse(p, new, signer, f"a download that {reason.replace('its norm', 'moves the anchor by')}")

    def refuse(self, p: int, new: Version, signer: str, reason: str) -> None:
        self.stats["updates_refused"] += 1
        self.refused.add((p, new))
        log.warning("refused update %s of fragment %d from %s: %s", new, p, signer[:8], reason)
        if signer not in self.distrusted:
            self.distrusted.add(signer)
            self.on_distrust(signer)
        raise RefusedUpdate(f"update {new} of fragment {p}: {reason}")

    def accepted(self, p: int, norm: float, numel: int) -> None:
        self.norms[p].append(norm)
        self.rms.append(norm / math.sqrt(max(numel, 1)))

    def _own_delta(self, f: UpdateFields) -> str | None:
        mine = [m for m in f.merged if m.learner == self.me]
        if len(mine) > 1:
            return "it names this learner's delta twice"
        if not mine or not self.sent[f.p]:
            return None  # (not merged, or sent before a restart: nothing to compare)
        m = mine[0]
        if (m.digest, m.steps, m.tokens) not in self.sent[f.p]:
            self.stats["updates_refused_own_delta"] += 1
            return "it names a delta of this learner that it did not send (digest or counters differ)"
        return None

    def _outlier(self, p: int, norm: float, anchor_norm: float, numel: int) -> str | None:
        if not math.isfinite(norm) or norm > ANCHOR_FRACTION * anchor_norm > 0:
            self.stats["updates_refused_norm"] += 1
            return f"its norm {norm:.3g} is above {ANCHOR_FRACTION:g} × the anchor's {anchor_norm:.3g}"
        history = self.norms[p]
        if len(history) >= NORM_WARMUP:
            limit = NORM_K * _median(history)
        elif len(self.rms) >= NORM_WARMUP:  # a new fragment's history: the run's, per element
            limit = NORM_K * _median(self.rms) * math.sqrt(max(numel, 1))
        else:
            return None
        if norm > limit > 0:
            self.stats["updates_refused_norm"] += 1
            return f"its norm {norm:.3g} is above {NORM_K:g} × the median of the fragment's recent updates"
        return None


def _median(xs: collections.deque[float]) -> float:
    s = sorted(xs)
    return s[len(s) // 2] if len(s) % 2 else 0.5 * (s[len(s) // 2 - 1] + s[len(s) // 2])


class Auditor:
    """A replica's recomputation of the updates it is asked to hold (`Replication._on_replicate`): refuses one
    that does not match its deltas, counts it, logs one line and stops trusting its owner (which moves the
    fragment to its replica in this peer's view)."""

    def __init__(self, codec: Codec, numel: Callable[[int], int], embedding_numel: Callable[[int], int],
                 outer: OuterOptimizer, max_share: float, clip_c: float, P: int,
                 open_frame: Callable[[memoryview], Envelope], guard: UpdateGuard,
                 stats: collections.Counter[str] | None = None, pool: BufferPool | None = None) -> None:
        self.codec, self.numel, self.embedding_numel, self.outer = codec, numel, embedding_numel, outer
        self.pool = pool or BufferPool(0, keep=0)  # (no pool: a fresh buffer each time)
        self.max_share, self.clip_c, self.P, self.open_frame, self.guard = max_share, clip_c, P, open_frame, guard
        self.stats = collections.Counter() if stats is None else stats  # (the shard's: in /v1/status)
        # p -> the clipped norms of the merges recomputed here: the clipping reference this replica starts
        # from when it takes p over (an owner's own history is empty after a takeover, when one ×1000 delta
        # at quorum 2 would not be clipped)
        self.norms: collections.defaultdict[int, collections.deque[float]] = collections.defaultdict(
            lambda: collections.deque(maxlen=NORM_HISTORY))

    def check(self, f: UpdateFields, update: Encoded, frames: Sequence[memoryview],
              kept: tuple[Version, Encoded | None] | None, momentum: Encoded | None) -> None:
        """Recompute update `f` (payload `update`, replicated momentum `momentum`) from the delta `frames` and
        the momentum this replica kept of its base; raise `AuditFailed` if it does not match. Skipped (counted)
        when the replica cannot: no frames, or no momentum of the base from this owner's own term. Runs in a
        worker thread: changes nothing but its counters."""
        if not checkable(f, frames, kept):
            self.stats["audits_skipped"] += 1
            return
        try:
            norms = self.verify(f, update, frames, kept, momentum)
        except ProtocolError as e:
            self.stats["audits_failed"] += 1
            raise AuditFailed(f"recomputed by a replica: {e}") from None
        self.stats["audits_passed"] += 1
        self.norms[f.p].extend(norms)

    def verify(self, f: UpdateFields, update: Encoded, frames: Sequence[memoryview],
               kept: tuple[Version, Encoded | None], momentum: Encoded | None) -> list[float]:
        """The recomputation itself, for a `checkable` update: the clipped norms merged if it matches, else
        `AuditFailed` (or the `ProtocolError` of a frame or payload that does not open). Counts nothing; also
        what an accusation's evidence is judged by (coordinator/accuse.py)."""
        p, numel = f.p, self.numel(f.p)
        lent: list[torch.Tensor] = []  # (fragment-sized work buffers: a fresh one costs page faults, ~4 ms each)

        def take() -> torch.Tensor:
            lent.append(self.pool.take(numel))
            return lent[-1]

        try:
            previous = kept[1].decode(numel, out=take()) if kept[1] is not None else None
            ref, ref_momentum, scale, norms = recompute(f, frames, self.open_frame, self.codec, numel,
                                                        self.embedding_numel(p), self.outer, self.max_share,
                                                        self.clip_c, previous, self.P, take)
            published = take()
            ok = matches(update.decode(numel, out=published), ref, scale, self.codec.name, in_place=True)
            if ok and ref_momentum is not None and momentum is not None:
                ok = matches(momentum.decode(numel, out=published), ref_momentum, scale / self.outer.lr,
                             self.codec.name, in_place=True)
        finally:
            for buf in lent:
                self.pool.give(buf)
        if not ok:
            raise AuditFailed(f"update {f.new} of fragment {p} is not the merge of the deltas it names")
        return norms

    def report(self, f: UpdateFields, signer: str, error: AuditFailed) -> None:
        """On the loop, after `check` failed: one log line, and `signer`'s updates are refused from now on."""
        try:
            self.guard.refuse(f.p, f.new, signer, str(error))
        except RefusedUpdate:
            pass

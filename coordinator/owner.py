"""One fragment's owner: collect deltas, decide when to step, merge, take the outer step (docs/architecture.md §6).

Pure state and tensor math, no network: `coordinator.shard` feeds it deltas and carries its publications.
Deltas are kept as the codec bytes they arrived in and decoded only at the outer step, so a round of M
learners costs M compressed copies, not M fp32 ones, while it waits.
"""

from __future__ import annotations

import collections
import functools
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from torch import Tensor

from diloco.protocol.codecs import Codec, get_codec
from diloco.protocol.envelope import join_bytes
from diloco.protocol.errors import Malformed, ProtocolError, StaleVersion

from .buffers import BufferPool
from .fragments import Encoded
from .grace import QuorumTracker
from .merge import Contribution, InvalidContribution, merge
from .outer import OuterOptimizer
from .version import Version
from .wire import Merged

RESIDUAL_CODEC = get_codec("int8")


@dataclass(frozen=True)
class PendingDelta:
    learner: str
    base: Version
    steps: int
    tokens: int
    meta: dict
    payload: bytes | memoryview  # the codec bytes as they arrived (not copied)
    digest: bytes = b""  # the delta envelope's signed payload digest of `payload`: named by the update
    prefix: bytes = b""  # the delta envelope's header and signature: prefix + payload is the signed frame a
    # replica gets to recompute the merge (coordinator/audit.py)

    def frame(self) -> bytes | memoryview:
        return join_bytes(self.prefix, self.payload) if self.prefix else b""


@dataclass
class Publication:
    """The result of one outer step, not yet the owner's: the update to publish and to apply,
    Θ^(new) = Θ^(base) + update, and the momentum and error-feedback residual that `commit` makes the
    owner's once the version is published."""

    p: int
    base: Version
    new: Version
    meta: dict
    payload: bytes
    update: Tensor  # lent by the owner's pool: give it back once applied
    learners: list[str]
    tokens: int
    batch: list[PendingDelta]
    momentum: Tensor | None
    residual: Encoded | None
    norms: list[float]  # the round's merged delta norms, for the owner's clipping reference
    merged: list[Merged]  # what the update says it merged: digests, counters, staleness (docs/protocol.md §7.19)
    clip: float  # λ, the clipping norm of this merge


@dataclass(frozen=True)
class OwnerSettings:
    quorum: int = 2
    gamma: float = 1.0
    tau: float = 10.0
    cap_s: float = 30.0
    max_staleness: int = 4
    clip_c: float = 3.0
    error_feedback: bool = True
    strict_quorum: bool = False  # the synchronous baseline: never step with fewer than `quorum` learners
    max_tokens_per_step: int = 1 << 24  # a delta's claim: tokens <= steps × this
    max_share: float = 1.0  # of any one learner in a merge


NORM_HISTORY = 32  # accepted delta norms an owner clips against, over its recent rounds


class FragmentOwner:
    """Owner of fragment `p` under `term`. The anchor itself lives in the FragmentStore, not here."""

    def __init__(
        self,
        p: int,
        numel: int,
        embedding_numel: int,
        codec: Codec,
        outer: OuterOptimizer,
        settings: OwnerSettings,
        term: int,
        momentum: Tensor | None = None,
        learners: Iterable[str] = (),
        clock: Callable[[], float] = time.monotonic,
        pool: BufferPool | None = None,
    ) -> None:
        self.p, self.numel, self.embedding_numel = p, numel, embedding_numel
        self.pool = pool or BufferPool(numel, keep=0)  # keep=0: fresh buffers every time
        self.codec, self.outer, self.settings, self.term = codec, outer, settings, term
        self.momentum = momentum  # committed: the momentum of the version `label`
        self.residual: Encoded | None = None  # error feedback, kept int8: 1 B/param instead of 4
        self.label: Version | None = None  # the version whose owner state this is (None: not known yet)
        self.held_back = False  # no step while True (a new owner reaching the newest version first)
        self.published = 0  # versions committed by this ownership
        self.signed: Version | None = None  # the newest version this ownership sent to its replicas
        self.stepped: Version | None = None  # the version whose momentum this ownership computed (its last commit)
        self.checked: Version | None = None  # the last base whose versions were compared before replicating
        self.hold_until: float | None = None  # no step before this time (a new owner pulling its momentum)
        self.clock = clock
        self.pending: dict[str, PendingDelta] = {}
        self.tracker = QuorumTracker(learners, settings.quorum, settings.gamma, settings.tau, settings.cap_s, clock,
                                     strict=settings.strict_quorum)
        self.dropped: collections.Counter[str] = collections.Counter()
        # committed with the version, like the momentum: the norms merged by the last rounds (`merge`'s reference)
        self.norms: collections.deque[float] = collections.deque(maxlen=NORM_HISTORY)

    def offer(self, delta: PendingDelta, current: Version) -> None:
        """Queue a learner's delta for the next outer step; refuse one too stale to merge."""
        staleness = current.version - delta.base.version
        if staleness > self.settings.max_staleness or delta.base > current:
            self.dropped["stale"] += 1
            raise StaleVersion(
                f"delta for fragment {self.p} is based on {delta.base}, the owner is at {current} "
                f"(max staleness {self.settings.max_staleness}); resync the fragment"
            )
        if delta.tokens > delta.steps * self.settings.max_tokens_per_step:
            self.dropped["claims"] += 1
            raise Malformed(f"a delta of {delta.steps} steps claims {delta.tokens} tokens, above this run's "
                            f"{self.settings.max_tokens_per_step} per step")
        if delta.meta.get("codec") != self.codec.name:
            self.dropped["codec"] += 1
            raise Malformed(f"fragment {self.p} takes codec {self.codec.name!r}, got {delta.meta.get('codec')!r}")
        try:
            if getattr(self.codec, "finite_when_checked", False):  # cheap: no decode until the outer step
                numel = self.codec.check(delta.meta, delta.payload, max_elements=self.numel)
            else:
                numel = self._decode_one(delta).numel()
            if numel != self.numel:
                raise Malformed(f"delta has {numel} elements, fragment {self.p} has {self.numel}")
        except ProtocolError:
            self.dropped["invalid"] += 1
            raise
        if delta.learner in self.pending:
            self.dropped["duplicate"] += 1  # the newer delta of the same learner replaces the older one
        self.pending[delta.learner] = delta
        self.tracker.add(delta.learner)

    def ready(self, now: float | None = None) -> bool:
        now = self.clock() if now is None else now
        held = self.held_back or (self.hold_until is not None and now < self.hold_until)
        return bool(self.pending) and not held and self.tracker.ready(now)

    def deadline(self) -> float | None:
        if not self.pending or self.held_back:
            return None
        due = self.tracker.deadline()
        return due if self.hold_until is None or due is None else max(due, self.hold_until)

    def take_round(self) -> list[PendingDelta]:
        """End the round: its deltas, for `step`; deltas arriving from now on belong to the next round."""
        batch = list(self.pending.values())
        self.pending.clear()
        self.tracker.reset()
        return batch

    def step(self, batch: list[PendingDelta], current: Version) -> Publication:
        """Merge a round's deltas, take the outer step and encode the update, into buffers of the step's own:
        nothing the owner holds changes (it runs in a worker thread while the event loop may hand the
        committed state over). `commit` makes the result the owner's once the version is published;
        `abandon` puts the round back otherwise (docs/architecture.md §7).

        The update is computed as U = −lr·g directly (g the Nesterov gradient of `OuterOptimizer.step`), which
        is Θ^(v+1) − Θ^(v) without forming Θ^(v+1)."""
        contributions = [
            Contribution(functools.partial(self._decode_one, d), d.tokens, d.steps,
                         max(0, current.version - d.base.version), d.learner)
            for d in batch
        ]
        if not contributions:
            raise InvalidContribution(f"no delta for fragment {self.p} in this round")
        pool = self.pool
        committed, residual = self.momentum, self.residual
        scratch, update = pool.take(self.numel), pool.take(self.numel)
        fresh = pool.take(self.numel) if self.outer.momentum != 0 else None  # the new momentum's buffer
        try:
            result = merge(contributions, clip_c=self.settings.clip_c, embedding_numel=self.embedding_numel,
                           out=update, scratch=scratch, reference_norms=tuple(self.norms),
                           max_share=self.settings.max_share, sparse=self.codec.sparse)
            momentum = self.outer.update_into(result.delta, committed, out=fresh)  # result.delta is now U
            # a sparse codec's update holds every coordinate of the merge and rounds only the values: no
            # residual, so a replica recomputes it to that rounding (docs/protocol.md §7.21)
            feedback = self.settings.error_feedback and not self.codec.sparse
            if feedback and residual is not None:
                update.add_(residual.decode(self.numel, out=scratch))
            meta, payload = self.codec.encode_update(update, len(contributions))
            self.codec.decode(meta, payload, max_elements=self.numel, out=scratch)  # U as every holder decodes it
            decoded = scratch
            if feedback:
                # what the codec dropped, carried into the next update; its own int8 rounding (~1/256 of a
                # residual that is itself ~1/256 of the update) is not carried
                residual = Encoded(RESIDUAL_CODEC, *RESIDUAL_CODEC.encode(update.sub_(decoded)))
        except BaseException:
            pool.give(scratch)
            pool.give(fresh)
            raise
        finally:
            pool.give(update)
        return Publication(
            p=self.p,
            base=current,
            new=Version(self.term, current.version + 1),
            meta=meta,
            payload=payload,
            update=decoded,
            learners=[c.learner for c in contributions],
            tokens=result.total_tokens,
            batch=batch,
            momentum=momentum,
            residual=residual,
            norms=result.norms,
            merged=[Merged(d.learner, d.digest, d.steps, d.tokens, c.staleness)
                    for d, c in zip(batch, contributions, strict=True)],
            clip=result.limit,
        )

    def leaves_term(self, base: Version) -> bool:
        """Whether the version stepped from `base` must go under a new term of this owner's (docs/protocol.md
        §7.19): in its own term it would be audited by replicas against what they kept of `base`, which is not
        what this step starts from when `base` is not a version whose momentum this ownership computed (one it
        reached: its own version that it replicated and did not publish, its momentum rebuilt), or when a version
        of that label already went to the replicas (a round replicated, then not published: another version of
        one label would leave a replica with the first one's momentum). The first version of a term is not
        audited, and a label is never signed twice."""
        if base.term != self.term:
            return False
        return self.stepped != base or (self.signed is not None and self.signed >= base.next())

    def commit(self, pub: Publication) -> None:
        """The version `pub.new` is published: its momentum and residual become the owner's, in one step
        (the caller holds the event loop, so a hand-over sees either the old state or this one)."""
        old = self.momentum
        self.momentum, self.residual, self.label = pub.momentum, pub.residual, pub.new
        self.published += 1
        self.stepped = pub.new
        self.norms.extend(pub.norms)
        if old is not None and self.pool.lends(old):
            self.pool.give(old)  # (a step's buffer, read by nothing once replaced: hand-overs copy or pop first)

    def adopt_momentum(self, momentum: Tensor, label: Version) -> bool:
        """Take the momentum of version `label` that arrived after the takeover (pulled from a member, or a
        late hand-over), if the owner still has none; False, changing nothing, otherwise."""
        if self.momentum is not None:
            return False
        self.momentum, self.label = momentum, label
        return True

    def abandon(self, pub: Publication | None, batch: list[PendingDelta], requeue: bool) -> int:
        """The round's version was not published: nothing the owner holds has changed. With `requeue` its
        deltas go back into the next round (unless the same learner has sent a newer one since); otherwise
        they are dropped and counted. Either way no version names them, so their learners keep that progress
        in θ and send it again with their next delta. Returns how many were dropped."""
        if pub is not None:
            self.pool.give(pub.momentum)  # (the step's own buffer, or None: never committed)
        dropped = 0
        for d in batch:
            if not requeue or d.learner in self.pending:
                dropped += 1
                continue
            self.pending[d.learner] = d
            self.tracker.add(d.learner)
        self.dropped["abandoned"] += dropped
        return dropped

    def _decode_one(self, d: PendingDelta, out: Tensor | None = None) -> Tensor:
        """Decode (into `out`, if given) and check one delta's size. Raises `Malformed`. The codecs never
        decode to non-finite values (they refuse such payloads), and `merge` checks every norm again."""
        return Encoded(self.codec, d.meta, d.payload).decode(self.numel, out=out)

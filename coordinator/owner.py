"""One fragment's owner: collect deltas, decide when to step, merge, take the outer step (DESIGN §7).

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
from diloco.protocol.errors import Malformed, ProtocolError, StaleVersion

from .buffers import BufferPool
from .fragments import Encoded
from .grace import QuorumTracker
from .merge import Contribution, InvalidContribution, merge
from .outer import OuterOptimizer
from .version import Version

RESIDUAL_CODEC = get_codec("int8")


@dataclass(frozen=True)
class PendingDelta:
    learner: str
    base: Version
    steps: int
    tokens: int
    meta: dict
    payload: bytes


@dataclass
class Publication:
    """The result of one outer step: the update to publish and to apply, Θ^(new) = Θ^(base) + update."""

    p: int
    base: Version
    new: Version
    meta: dict
    payload: bytes
    update: Tensor
    learners: list[str]
    tokens: int


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
        self.momentum = momentum
        self.residual: Encoded | None = None  # error feedback, kept int8: 1 B/param instead of 4
        self.pending: dict[str, PendingDelta] = {}
        self.tracker = QuorumTracker(learners, settings.quorum, settings.gamma, settings.tau, settings.cap_s, clock,
                                     strict=settings.strict_quorum)
        self.dropped: collections.Counter[str] = collections.Counter()

    def offer(self, delta: PendingDelta, current: Version) -> None:
        """Queue a learner's delta for the next outer step; refuse one too stale to merge."""
        staleness = current.version - delta.base.version
        if staleness > self.settings.max_staleness or delta.base > current:
            self.dropped["stale"] += 1
            raise StaleVersion(
                f"delta for fragment {self.p} is based on {delta.base}, the owner is at {current} "
                f"(max staleness {self.settings.max_staleness}); resync the fragment"
            )
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
        return bool(self.pending) and self.tracker.ready(now)

    def deadline(self) -> float | None:
        return self.tracker.deadline() if self.pending else None

    def take_round(self) -> list[PendingDelta]:
        """End the round: its deltas, for `step`; deltas arriving from now on belong to the next round."""
        batch = list(self.pending.values())
        self.pending.clear()
        self.tracker.reset()
        return batch

    def step(self, batch: list[PendingDelta], current: Version) -> Publication:
        """Merge a round's deltas, take the outer step and encode the update. Touches neither the anchor nor
        the pending deltas (it may run in a worker thread); the caller applies `Publication.update` once
        the publication is replicated, then gives it back to the pool.

        The update is computed as U = −lr·g directly (g the Nesterov gradient of `OuterOptimizer.step`), which
        is Θ^(v+1) − Θ^(v) without forming Θ^(v+1); the momentum buffer is updated in place."""
        contributions = [
            Contribution(functools.partial(self._decode_one, d), d.tokens, d.steps,
                         max(0, current.version - d.base.version), d.learner)
            for d in batch
        ]
        if not contributions:
            raise InvalidContribution(f"no delta for fragment {self.p} in this round")
        pool = self.pool
        scratch, update = pool.take(self.numel), pool.take(self.numel)
        try:
            result = merge(contributions, clip_c=self.settings.clip_c, embedding_numel=self.embedding_numel,
                           out=update, scratch=scratch)
            self.momentum = self.outer.update_into(result.delta, self.momentum)  # result.delta is now U
            if self.settings.error_feedback and self.residual is not None:
                update.add_(self.residual.decode(self.numel, out=scratch))
            meta, payload = self.codec.encode(update)
            decoded = self.codec.decode(meta, payload, max_elements=self.numel, out=pool.take(self.numel))
            decoded = decoded.reshape(-1)
            if self.settings.error_feedback:
                # what the codec dropped, carried into the next update; its own int8 rounding (~1/256 of a
                # residual that is itself ~1/256 of the update) is not carried
                self.residual = Encoded(RESIDUAL_CODEC, *RESIDUAL_CODEC.encode(update.sub_(decoded)))
        finally:
            pool.give(scratch)
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
        )

    def _decode_one(self, d: PendingDelta, out: Tensor | None = None) -> Tensor:
        """Decode (into `out`, if given) and check one delta's size. Raises `Malformed`. The codecs never
        decode to non-finite values (they refuse such payloads), and `merge` checks every norm again."""
        return Encoded(self.codec, d.meta, d.payload).decode(self.numel, out=out)

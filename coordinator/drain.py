"""An owner that leaves on purpose: its last rounds published, each fragment handed over and acknowledged,
and the deltas that still reach it passed on (docs/architecture.md §6.6, docs/preemption.md).

A peer that is killed loses the deltas of its open rounds and leaves its successors to rebuild or pull the
momentum. One told to stop in time (a spot notice, SIGTERM) does better, in this order, on the shard's loop:

1. `close_rounds`: every owned fragment with pending deltas takes its outer step now, without waiting for
   the quorum or the grace window, and publishes as usual (replicated, committed, pushed): a delta this
   owner took is merged, not dropped at the hand-over. Not in a `synchronous` run, whose rounds never step
   short of the quorum. A step already running is waited for.
2. The caller ranks this peer out of `roles` (node/swarm.py), in the same event-loop step as the last check
   that nothing is pending, so `Shard.reassign` releases every fragment at once; `Shard._release` hands each
   one's committed state (certificate, fp32 anchor, fp32 momentum) to its next owner (`hand_over`), retried
   until it is acknowledged or the deadline comes, and keeps the momentum as a replica would, for the final
   checkpoint.
3. Until the process stops, a delta that still arrives for a fragment handed over (its sender has not seen
   the change yet) is forwarded, exactly as signed, to the new owner (`forward`), which verifies it as its
   sender's own; the sender is answered once the new owner took it. The deltas this owner had taken but
   not merged when it released the fragment (they came after its `FINAL_ROUNDS` early steps) are passed on
   the same way (`pass_on`): only one that no new owner took is counted as dropped.

Every wait ends at the drain's deadline; what was not done by then is reported, not waited for.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from diloco.protocol.envelope import Envelope
from diloco.protocol.transport import RemoteError, TransportError

from .send import STATEFUL_POST_FLOOR_S
from .version import GENESIS, Version
from .wire import ROUTE_DELTA, DeltaFields

if TYPE_CHECKING:
    from .owner import FragmentOwner, PendingDelta
    from .shard import Shard

log = logging.getLogger(__name__)
WAIT_S = 0.02  # between two looks at the rounds still stepping
FINAL_ROUNDS = 2  # early outer steps per fragment before it is released anyway
FORWARD_WAIT_S = 3.0  # how long a delta for a fragment handed over tries its new owner (its sender waits 5 s)
FORWARD_RETRY_S = 0.25  # between two tries (the new owner answers 503 until it has seen us leave)


@dataclass
class HandOver:
    """One fragment released by a drain: to whom, at which version, and whether that peer acknowledged it."""

    p: int
    to: str | None
    version: str
    acked: bool = False
    skipped: str = ""  # why nothing was sent (no next owner, no momentum, nothing published yet)


@dataclass
class OwnerDrain:
    """What the shard did in a drain (its part of node/swarm.py's `DrainReport`)."""

    final_rounds: int = 0  # outer steps taken early so that no pending delta was dropped
    dropped_deltas: int = 0  # deltas taken but neither merged nor taken by the fragment's next owner
    passed_on: int = 0  # deltas taken after the last early step, forwarded at the release and taken there
    handovers: list[HandOver] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # what the deadline cut short, one entry per thing


class ShardDrain:
    """The drain of one shard. `until` is set for as long as the drain, and then the process, lasts."""

    def __init__(self, shard: Shard) -> None:
        self.shard = shard
        self.until: float | None = None  # the deadline (time.monotonic()); None: not draining
        self.report = OwnerDrain()
        self._sending: list[asyncio.Task] = []
        self._passing: list[asyncio.Task] = []  # `pass_on`'s forwards; each returns whether it was taken

    @property
    def active(self) -> bool:
        return self.until is not None

    async def run(self, deadline: float, rank_out: Callable[[], None]) -> OwnerDrain:
        """Close the rounds, rank this peer out (`rank_out`: after it, `reassign` releases every fragment),
        then wait for the hand-overs' acknowledgements; all of it by `deadline`."""
        self.until = deadline
        closed = await self.close_rounds(deadline)
        rank_out()  # (no await since `close_rounds` last looked: what is pending now is passed on, `pass_on`)
        if self._sending or self._passing:
            await asyncio.wait(self._sending + self._passing, timeout=max(0.0, deadline - time.monotonic()))
        self.report.passed_on = sum(1 for t in self._passing
                                    if t.done() and not t.cancelled() and t.exception() is None and t.result())
        self.report.dropped_deltas += len(self._passing) - self.report.passed_on
        self.shard.stats["deltas_dropped_on_handoff"] += self.report.dropped_deltas
        if not closed:
            self.report.skipped.append(f"the last rounds ({self.report.dropped_deltas} pending deltas dropped)")
        self.report.skipped += [f"the hand-over of fragment {h.p} to {h.to[:8]}" for h in self.report.handovers
                                if not h.acked and not h.skipped]
        return self.report

    async def close_rounds(self, deadline: float) -> bool:
        """Step every owned fragment's pending round now, until none is pending and none is stepping; True if
        that was reached before `deadline`. A fragment gets at most `FINAL_ROUNDS` early steps (deltas keep
        arriving until the others see this peer leave); a `synchronous` run's rounds are left as they are."""
        shard = self.shard
        forced: dict[int, int] = {}
        while True:
            busy = False
            for p, owner in list(shard.owners.items()):
                if p in shard._stepping:
                    busy = True
                    continue
                if not owner.pending or shard.spec.synchronous or forced.get(p, 0) >= FINAL_ROUNDS:
                    continue
                if not self._may_step(owner):
                    busy = True
                    continue
                shard._stepping.add(p)
                shard._spawn(shard._step_guarded(p, owner))
                forced[p] = forced.get(p, 0) + 1
                self.report.final_rounds += 1
                busy = True
            if not busy:
                return True
            if time.monotonic() + WAIT_S >= deadline:
                return False
            await asyncio.sleep(WAIT_S)

    @staticmethod
    def _may_step(owner: FragmentOwner) -> bool:
        """Not held back: a new owner still reaching the newest version, or pulling its momentum."""
        return not owner.held_back and (owner.hold_until is None or owner.clock() >= owner.hold_until)

    def hand_over(self, p: int, to: str | None, owner: FragmentOwner, label: Version, anchor: torch.Tensor,
                  cert: bytes) -> None:
        """Called by `Shard._release` during a drain, with the committed snapshot it took: send it to `to`
        in the background, retried until acknowledged or the deadline (`Replication.send_full`)."""
        h = HandOver(p, to, str(label))
        self.report.handovers.append(h)
        if to is None:
            h.skipped = "no other member may own it"
        elif label == GENESIS:
            h.skipped = "no version published yet"
        elif owner.momentum is None or label != owner.label:
            h.skipped = "no momentum of the version held"
        if h.skipped:
            log.info("drain: fragment %d not handed over: %s", p, h.skipped)
            return

        async def send() -> None:
            h.acked = await self.shard.replication.send_full(p, to, owner.term, owner.momentum, cert, anchor,
                                                             retry_until=self.until)
            log.info("drain: fragment %d at %s handed over to %s: %s", p, label, to[:8],
                     "acknowledged" if h.acked else "not acknowledged")

        task = asyncio.get_running_loop().create_task(send())
        self._sending.append(task)
        self.shard._tasks.add(task)
        task.add_done_callback(self.shard._tasks.discard)

    def pass_on(self, p: int, pending: list[PendingDelta]) -> None:
        """Called by `Shard._release` during a drain with the deltas of p taken but not merged: each is sent,
        exactly as signed, to p's next owner in the background (`run` counts the ones no owner took)."""
        loop = asyncio.get_running_loop()
        for d in pending:
            if not d.prefix:  # (no signed frame to pass on: a delta made in this process, as by the tests)
                self.report.dropped_deltas += 1
                continue
            task = loop.create_task(self._deliver(p, [d.prefix, d.payload]))
            self._passing.append(task)
            self.shard._tasks.add(task)
            task.add_done_callback(self.shard._tasks.discard)

    async def forward(self, env: Envelope) -> bool:
        """A delta for a fragment this draining peer no longer owns: passed on unchanged to the owner it
        handed the fragment to; True once that owner took it. False (the caller answers as it would have)
        when this peer owns the fragment again, has no one to pass it to, or that owner refused it."""
        f = DeltaFields.parse(env.fields, len(self.shard.store))
        return await self._deliver(f.p, [env.prefix(), env.payload])

    async def _deliver(self, p: int, frame: list[bytes | memoryview]) -> bool:
        """POST one signed delta frame to p's owner in this peer's view, retried while it answers 503 (it has
        not seen this peer leave yet), for at most FORWARD_WAIT_S; True once that owner took it."""
        shard = self.shard
        until = time.monotonic() + FORWARD_WAIT_S
        while p not in shard.owners:
            roles = shard.members.roles(p)
            url = shard.members.url(roles[0]) if roles and roles[0] != shard.members.peer_id else None
            if url is None:
                return False
            try:
                await shard.client.request("POST", url, ROUTE_DELTA, body=frame, min_deadline_s=STATEFUL_POST_FLOOR_S)
                shard.stats["deltas_forwarded"] += 1
                return True
            except RemoteError as e:
                if e.status != 503:
                    log.info("drain: a delta for fragment %d refused by its new owner %s: %s", p, roles[0][:8], e)
                    return False
            except TransportError as e:
                log.info("drain: a delta for fragment %d not passed on to %s: %s", p, roles[0][:8], e)
                return False
            if time.monotonic() + FORWARD_RETRY_S >= until:
                log.info("drain: a delta for fragment %d not taken by %s within %.0f s", p, roles[0][:8],
                         FORWARD_WAIT_S)
                return False
            await asyncio.sleep(FORWARD_RETRY_S)
        return False

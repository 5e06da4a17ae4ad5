"""θ's half of the rebase rule, done at the training thread's step boundaries within a small time budget per
step (docs/architecture.md §5.3).

At 100M parameters, one new version of one fragment means decoding two int8 tensors of 12.5M elements and
adding them into the model (tens of milliseconds), and sending a fragment means copying it out of the model
(about 18 ms). Paid inside one step, that is a stall the user's loop sees. So:

- a summer thread decodes each fragment's moves and sums them into one fp32 buffer, off the training thread;
- the training thread adds those sums into θ a slice at a time, for at most a share of a step's time per step
  (at least one slice, so it always gets on);
- a fragment due to be sent is copied out of θ while its own moves wait: one of a single slice at once, at its
  step; a larger one by a copier thread while training goes on (or, without `copy_in_background`, a slice per
  step like the moves). Once copied, the snapshot goes out (`submit`), by the copier itself for its own, so
  that a loop which stops stepping for a while (an evaluation) does not hold its delta back.

Both are exact element by element. Every move reaches every element of θ once. A snapshot element copied k
steps after another is still θ_i at the moment it was copied, so Δ_i = Θ_base,i − θ_i holds, and the progress
made after that moment stays in θ for the next delta. That holds as well for a copy made while the training
loop writes θ: each fp32 element is read whole, before or after a write, never half of each, and nothing but
the user's optimizer writes θ[p] until the copy is done (θ[p]'s moves wait; a fragment downloaded whole
meanwhile cancels the copy, which starts over). Only writes must stay at step boundaries. A due fragment with
moves still waiting is copied once they are applied (they go first); after `MAX_DEFER` steps, whatever it waits
for is done at once: a bounded stall rather than a delta built on a stale base, which its owner would refuse.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from torch import Tensor

from diloco.coordinator.buffers import BufferPool
from diloco.coordinator.fragments import FragmentStore, Held, Move
from diloco.coordinator.plan import FragmentPlan
from diloco.coordinator.version import Version

from .niceness import lower_this_thread
from .swarm import SwarmFailed

log = logging.getLogger(__name__)
SLICE = 1 << 18  # elements per slice: about 0.3 ms to add or copy on one core (1 ms under load)
MAX_DEFER = 8  # steps a due fragment may wait for its own moves before they are applied at once
BUDGET_SHARE = 0.03  # of the step time, spent per step on θ's side of the rebase rule
MIN_BUDGET_S = 0.001
MAX_SKIPS = 4  # steps in a row that may leave the store's changes for later while its lock is busy

# Told of every write into θ, right after it: θ[p][start:stop] was set to values[start:stop] (add=False) or had
# values[start:stop] added (add=True); `values` is the whole flat fragment and is reused once the call returns.
OnWrite = Callable[[int, int, int, Tensor, bool], None]


@dataclass
class _Sum:
    """Moves of one fragment summed into `buf`; θ[p] is based on `label` once all of it is added."""

    buf: Tensor
    label: Version
    done: int = 0  # elements already added into θ[p]
    started: bool = False  # the training thread has begun adding it: nothing may be summed into it any more
    busy: bool = False  # the summer is adding a batch into it
    dropped: bool = False  # θ[p] was replaced meanwhile: the summer gives `buf` back when done


@dataclass
class _Batch:
    p: int
    epoch: int
    moves: list[Move]
    label: Version


@dataclass
class _Snapshot:
    p: int
    buf: Tensor
    base: Version
    done: int = 0  # elements copied
    copier: bool = False  # copied by the copier thread (the rest is guarded by `_cond` then)
    complete: bool = False  # the copier has copied all of it
    cancelled: bool = False  # θ[p] was replaced meanwhile: the copier gives `buf` back when done


class Theta:
    """Applies new versions to θ and copies due fragments out of it, a bounded slice of work per step.

    `submit(p, snapshot, base)` receives each finished snapshot (a `pool` buffer, the caller's from then on),
    on the training thread, or on the copier thread for the copier's (so it must be thread-safe);
    `replaced(p)` is told of each fragment installed whole (θ[p] overwritten: its local progress is gone).
    `background=False` does everything inline at once (the synchronous baseline, whose steps wait anyway);
    `copy_in_background=False` copies due fragments a slice per step instead of on the copier thread."""

    def __init__(self, store: FragmentStore, plan: FragmentPlan, params: Mapping[str, Tensor], pool: BufferPool,
                 submit: Callable[[int, Tensor, Version], None], replaced: Callable[[int], None], *,
                 background: bool = True, copy_in_background: bool = True, on_write: OnWrite | None = None) -> None:
        self.store, self.plan, self.params, self.pool = store, plan, params, pool
        self._submit, self._replaced = submit, replaced
        self._on_write = on_write or (lambda p, start, stop, values, add: None)
        P = len(plan.fragments)
        self.base: list[Version] = store.labels()  # per fragment, the version θ[p] is based on
        self.step_time_s = 0.0  # the caller's step time, for the budget
        self._numel = [f.numel for f in plan.fragments]
        self._due: dict[int, int] = {}  # p -> steps it has been due
        self._snaps: dict[int, _Snapshot] = {}  # written under `_cond` (the copier removes its own when sent)
        self._sums: list[deque[_Sum]] = [deque() for _ in range(P)]
        self._epoch = [0] * P  # bumped when θ[p] is replaced: batches of an older epoch are moot
        self._queue: deque[_Batch] = deque()
        self._summing: _Batch | None = None
        self._error: tuple[str, BaseException] | None = None  # (what failed, why), from a helper thread
        self._skipped = 0  # steps in a row whose take found the store's lock busy
        self.settled_at_once = 0  # due fragments whose moves were applied at once after MAX_DEFER steps
        self._closed = False
        self._copies: deque[_Snapshot] = deque()  # for the copier thread
        self._cond = threading.Condition()  # guards _sums, _epoch, _queue, _summing, _error, _closed, _copies
        self._thread: threading.Thread | None = None
        self._copier: threading.Thread | None = None
        if background:
            self._thread = threading.Thread(target=self._summer, name="diloco-theta", daemon=True)
            self._thread.start()
            if copy_in_background:
                self._copier = threading.Thread(target=self._copy_all, name="diloco-theta-copy", daemon=True)
                self._copier.start()

    # -- the training thread ----------------------------------------------------------------------------------

    def due(self, p: int) -> None:
        """Fragment p is to be sent: its snapshot starts at a coming step boundary."""
        self._due.setdefault(p, 0)

    def step(self) -> None:
        """At a step boundary: take what the store has for θ, then work until the step's budget is spent."""
        deadline = time.perf_counter() + max(MIN_BUDGET_S, BUDGET_SHARE * self.step_time_s)
        self._raise_error()
        self._take(wait=self._thread is None)
        if self._thread is None:
            self._settle_all()
        self._start_due(force=self._thread is None)
        first = True
        for p in list(self._snaps):
            first = self._copy(p, None if self._thread is None else deadline, first)
        for p in sorted(range(len(self._sums)), key=lambda q: q not in self._due):
            if p not in self._snaps:
                first = self._apply(p, None if self._thread is None else deadline, first)

    def flush(self, also: Callable[[list[Held]], object] | None = None) -> object:
        """Everything now: the store's changes taken (with `also` run inside the same critical section, see
        `FragmentStore.take_changes`), snapshots in progress finished and sent, every move applied. Returns
        what `also` returned. Due fragments not started yet stay due."""
        self._raise_error()
        extra = self._take(also)
        for p in list(self._snaps):
            self._copy(p, None, True)
        self._settle_all()
        return extra

    def send_due(self) -> None:
        """Every due fragment snapshotted and sent now, its waiting moves applied first, and every snapshot in
        progress finished: a learner that stops stepping (a drain, node/learner.py) sends what it has."""
        self._raise_error()
        self._take()
        self._start_due(force=True)
        for p in list(self._snaps):
            self._copy(p, None, True)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        for thread in (self._thread, self._copier):
            if thread is not None:
                thread.join(timeout=5)
                if thread.is_alive():
                    log.warning("θ's %s thread did not stop within 5 s; it is left running", thread.name)

    def _take(self, also: Callable[[list[Held]], object] | None = None, wait: bool = True) -> object:
        """The store's changes for θ. `wait=False`: none this step if the store's lock is busy (the loop
        writes an anchor under it, tens of milliseconds at 100M parameters), unless that was already so at
        the last `MAX_SKIPS` steps."""
        def copy(p: int, anchor: Tensor) -> None:
            self._cancel_snapshot(p)  # before θ[p] is overwritten: the copier must not send a torn copy
            self.plan.unflatten_into(p, anchor, self.params)
            self._on_write(p, 0, self._numel[p], anchor, False)

        changes = self.store.take_changes(copy, also, wait=wait or self._skipped >= MAX_SKIPS)
        if changes is None:
            self._skipped += 1
            return None
        self._skipped = 0
        for p in sorted(changes.replace):
            self._reset(p)
            self.base[p] = changes.labels[p]
            self._replaced(p)
        if changes.moves:
            with self._cond:
                for p, moves in sorted(changes.moves.items()):
                    self._queue.append(_Batch(p, self._epoch[p], moves, changes.labels[p]))
                self._cond.notify_all()
        return changes.also

    def _reset(self, p: int) -> None:
        """θ[p] was overwritten by a whole download: the moves that waited for it are moot (its snapshot was
        cancelled before the overwrite, in `_take`)."""
        with self._cond:
            self._epoch[p] += 1
            self._queue = deque(b for b in self._queue if b.p != p)
            for s in self._sums[p]:
                if s.busy:
                    s.dropped = True
                else:
                    self.pool.give(s.buf)
            self._sums[p].clear()

    def _cancel_snapshot(self, p: int) -> None:
        """θ[p] is being overwritten: a snapshot of it not yet sent is moot, and the fragment is due again."""
        with self._cond:
            snap = self._snaps.pop(p, None)
            if snap is None:
                return
            snap.cancelled = True
            if not snap.copier:  # (the copier gives its buffer back itself)
                self.pool.give(snap.buf)
        self._due.setdefault(p, 0)

    def _start_due(self, force: bool) -> None:
        for p in sorted(self._due, key=self._due.get, reverse=True):
            if p in self._snaps:
                continue
            with self._cond:
                waiting = self._waiting(p)
            if waiting:
                self._due[p] += 1
                if not force and self._due[p] <= MAX_DEFER:
                    continue
                if not force:
                    self.settled_at_once += 1
                self._settle(p)
            del self._due[p]
            snap = _Snapshot(p, self.pool.take(self._numel[p]), self.base[p])
            snap.copier = self._copier is not None and self._numel[p] > SLICE  # (one slice: copied now, sent at once)
            with self._cond:
                self._snaps[p] = snap
                if snap.copier:
                    self._copies.append(snap)
                    self._cond.notify_all()

    def _copy(self, p: int, deadline: float | None, first: bool) -> bool:
        """Copy slices of θ[p] into its snapshot until `deadline` (None: all) and send it once complete; one
        the copier copies is left to it (`deadline` None: waited for until the copier has sent it)."""
        snap, n = self._snaps.get(p), self._numel[p]
        if snap is None:  # (the copier has just sent it)
            return first
        if snap.copier:
            if deadline is None:
                with self._cond:
                    self._cond.wait_for(lambda: snap.complete or snap.cancelled or self._error is not None)
                self._raise_error()
            return first
        while snap.done < n and (first or deadline is None or time.perf_counter() < deadline):
            snap.done = self.plan.copy_range(p, self.params, snap.buf, snap.done, min(snap.done + SLICE, n))
            first = False
        if snap.done >= n:
            with self._cond:
                del self._snaps[p]
            self._submit(p, snap.buf, snap.base)
        return first

    def _apply(self, p: int, deadline: float | None, first: bool) -> bool:
        """Add slices of p's sums into θ[p], oldest first, until `deadline` (None: all of them)."""
        n = self._numel[p]
        while first or deadline is None or time.perf_counter() < deadline:
            with self._cond:
                s = self._sums[p][0] if self._sums[p] and not self._sums[p][0].busy else None
                if s is None:
                    return first
                s.started = True
            start = s.done
            s.done = self.plan.add_range(p, s.buf, self.params, start, min(start + SLICE, n))
            self._on_write(p, start, s.done, s.buf, True)
            first = False
            if s.done >= n:
                with self._cond:
                    self._sums[p].popleft()
                self.pool.give(s.buf)
                self.base[p] = s.label
        return first

    def _settle(self, p: int) -> None:
        """Every move of p into θ[p] now: the summer's batch of p finished, the rest decoded here."""
        with self._cond:
            mine = [b for b in self._queue if b.p == p]
            self._queue = deque(b for b in self._queue if b.p != p)
            self._cond.wait_for(lambda: self._summing is None or self._summing.p != p)
        self._raise_error()
        self._apply(p, None, True)
        for batch in mine:
            buf = self.pool.take(self._numel[p])
            try:
                self._sum_into(p, batch.moves, buf, fresh=True)
                self.plan.add_into(p, buf, self.params)
                self._on_write(p, 0, self._numel[p], buf, True)
            finally:
                self.pool.give(buf)
            self.base[p] = batch.label

    def _settle_all(self) -> None:
        for p in range(len(self._sums)):
            if p not in self._snaps:
                self._settle(p)

    def _waiting(self, p: int) -> bool:
        """Moves of p not yet in θ[p] (with `_cond` held)."""
        return bool(self._sums[p]) or any(b.p == p for b in self._queue) or (
            self._summing is not None and self._summing.p == p)

    def _raise_error(self) -> None:
        with self._cond:
            failed = self._error
        if failed is not None:
            what, error = failed
            raise SwarmFailed(f"{what} failed ({type(error).__name__}: {error}); θ no longer follows the swarm; "
                              "restart this learner") from error

    # -- the copier thread ------------------------------------------------------------------------------------

    def _copy_all(self) -> None:
        """Copy each queued snapshot out of θ, a slice at a time, while the training thread goes on."""
        lower_this_thread()
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._copies or self._closed)
                if self._closed:
                    return
                snap = self._copies.popleft()
            p, n, error = snap.p, self._numel[snap.p], None
            try:
                while snap.done < n and not snap.cancelled:
                    snap.done = self.plan.copy_range(p, self.params, snap.buf, snap.done, min(snap.done + SLICE, n))
            except Exception as e:  # noqa: BLE001 - reported to the training thread at its next step
                error = e
            with self._cond:  # (held while it is sent, so that `_cancel_snapshot` cannot interleave)
                if error is not None:
                    self._error = ("copying a due fragment out of the model", error)
                elif snap.cancelled:
                    self.pool.give(snap.buf)
                else:
                    del self._snaps[p]
                    snap.complete = True
                    try:
                        self._submit(p, snap.buf, snap.base)
                    except Exception as e:  # noqa: BLE001 - reported to the training thread at its next step
                        self._error = ("sending a due fragment's snapshot", e)
                self._cond.notify_all()

    # -- the summer thread ------------------------------------------------------------------------------------

    def _summer(self) -> None:
        lower_this_thread()
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._closed)
                if self._closed:
                    return
                batch = self._queue.popleft()
                p = batch.p
                last = self._sums[p][-1] if self._sums[p] else None
                target = last if last is not None and not last.started and not last.busy else None
                if target is not None:
                    target.busy = True
                self._summing = batch
            buf = target.buf if target is not None else self.pool.take(self._numel[p])
            error = None
            try:
                self._sum_into(p, batch.moves, buf, fresh=target is None)
            except Exception as e:  # noqa: BLE001 - reported to the training thread at its next step
                error = e
            with self._cond:
                self._summing = None
                if error is not None:
                    self._error = ("decoding a new version's moves", error)
                if target is not None:
                    target.busy = False
                    if target.dropped:
                        self.pool.give(buf)
                    else:
                        target.label = batch.label
                elif batch.epoch == self._epoch[p] and error is None:
                    self._sums[p].append(_Sum(buf, batch.label))
                else:
                    self.pool.give(buf)
                self._cond.notify_all()

    def _sum_into(self, p: int, moves: list[Move], buf: Tensor, fresh: bool) -> None:
        """buf := Σ moves (`fresh`), or buf += Σ moves."""
        n = self._numel[p]
        for i, move in enumerate(moves):
            if fresh and i == 0:
                if isinstance(move, Tensor):
                    buf.copy_(move.reshape(-1))
                else:
                    move.decode(n, out=buf)
            elif isinstance(move, Tensor):
                buf.add_(move.reshape(-1))
            else:
                with self.pool.borrow(n) as scratch:
                    buf.add_(move.decode(n, out=scratch))

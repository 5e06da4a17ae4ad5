"""What a learner's θ owes and is owed, fragment by fragment: the rebase rule's accounting
(docs/architecture.md §5.3).

θ[p] = Θ_p + (local progress not yet merged). When Θ_p moves by U, θ[p] moves by U too; when U merged this
learner's own outstanding delta Δ_sent (= Θ_base − θ at the send), that progress is now part of Θ_p and leaves
θ[p]: θ[p] += U + Δ_sent. The moves are summed per fragment until the next step boundary (`take`). A delta
that no version merged leaves its progress in θ[p]: its steps and tokens are carried into the next delta of
p, which contains that progress. Only a whole download (`installed`) overwrites θ[p] and drops what it owed.

Plain bookkeeping with no lock of its own: `FragmentStore` calls it under its lock, in the same critical
section as the anchor change it accounts for. `InFlight` and `VersionLog` are the two other pieces of learner
state kept there: the synchronous baseline's wait, and the record the chaos harness checks.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .version import Version

if TYPE_CHECKING:
    from .fragments import Move


@dataclass
class Changes:
    """θ[p] := Θ_p for p in `replace` (installed whole: copied by `FragmentStore.take_changes` itself);
    θ[p] += Σ moves[p] (the rebase rule); `labels`: the versions θ is based on afterwards."""

    replace: set[int]
    moves: dict[int, list[Move]]
    labels: list[Version]
    also: object = None  # what `take_changes(also=...)` returned


class RebaseLedger:
    """Per fragment: the moves θ has not applied yet, the delta sent and not merged, the steps carried."""

    def __init__(self) -> None:
        self.pending: dict[int, list[Move]] = {}  # p -> what θ[p] must move by at the next step boundary
        self.replaced: set[int] = set()  # fragments installed whole: θ[p] := Θ_p
        self.outstanding: dict[int, tuple[Move, int, int]] = {}  # p -> (Δ_sent as merged, its steps, tokens)
        self.carried: dict[int, tuple[int, int]] = {}  # p -> (steps, tokens) of deltas never merged
        self.merged_steps = 0  # Σ over fragments of the inner steps of our deltas that reached a version
        self.merged_tokens = 0  # the same for tokens

    def moved(self, p: int, move: Move, merged_ours: bool) -> bool:
        """Θ_p moved by `move`; `merged_ours`: the version names this learner among its contributors. Returns
        whether it merged our outstanding delta (which then leaves θ[p] too)."""
        moves = [move]
        settled = merged_ours and p in self.outstanding
        if settled:
            sent, steps, tokens = self.outstanding.pop(p)
            moves.append(sent)
            self.merged_steps += steps
            self.merged_tokens += tokens
        if p not in self.replaced:
            self.pending.setdefault(p, []).extend(moves)
        return settled

    def installed(self, p: int) -> None:
        """Θ_p was replaced whole: θ[p] := Θ_p at the next boundary, and the progress it held is gone."""
        self.pending.pop(p, None)
        self.outstanding.pop(p, None)
        self.carried.pop(p, None)
        self.replaced.add(p)

    def sent(self, p: int, sent: Move, steps: int, tokens: int) -> tuple[int, int]:
        """Remember the delta just sent for p until a version merges it; returns the (steps, tokens) it
        carries: its own plus those of earlier deltas of p that were never merged."""
        if p in self.outstanding:  # superseded before any version merged it
            _, s, t = self.outstanding.pop(p)
            self.carry(p, s, t)
        s, t = self.carried.pop(p, (0, 0))
        self.outstanding[p] = (sent, steps + s, tokens + t)
        return steps + s, tokens + t

    def unsent(self, p: int) -> None:
        """The delta was not accepted: its progress stays in θ[p] and goes out with the next one."""
        if p in self.outstanding:
            _, s, t = self.outstanding.pop(p)
            self.carry(p, s, t)

    def carry(self, p: int, steps: int, tokens: int) -> None:
        s, t = self.carried.get(p, (0, 0))
        self.carried[p] = (s + steps, t + tokens)

    def take(self) -> tuple[set[int], dict[int, list[Move]]]:
        """The fragments replaced whole and the moves queued since the last call."""
        out = self.replaced, self.pending
        self.pending, self.replaced = {}, set()
        return out


class InFlight:
    """Fragments whose delta is being sent or waits to be merged: what a synchronous learner waits on. Shares
    the store's lock; every method but `wait` expects it held."""

    def __init__(self, lock: threading.Lock) -> None:
        self.fragments: set[int] = set()
        self.lock = lock
        self.settled = threading.Condition(lock)  # notified when a fragment leaves `fragments`

    def add(self, p: int) -> None:
        self.fragments.add(p)

    def settle(self, p: int) -> None:
        if p in self.fragments:
            self.fragments.discard(p)
            self.settled.notify_all()

    def wait(self, fragments: Iterable[int], timeout: float) -> bool:
        """Block until none of `fragments` is in flight; False if `timeout` seconds passed first."""
        wanted = set(fragments)
        with self.lock:
            return self.settled.wait_for(lambda: not self.fragments & wanted, timeout)


class VersionLog:
    """Every (p, term, version) the store moved to, in order, while recording is on (the chaos harness's
    invariants are computed from it)."""

    def __init__(self) -> None:
        self.moves: list[tuple[int, int, int]] | None = None  # None: not recording

    def record(self, p: int, label: Version) -> None:
        if self.moves is not None:
            self.moves.append((p, label.term, label.version))

    def take(self) -> list[tuple[int, int, int]]:
        out, self.moves = (self.moves or []), ([] if self.moves is not None else None)
        return out

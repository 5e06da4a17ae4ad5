"""Goodput and the swarm's invariants, computed from what learners reported (docs/architecture.md §10).

Every figure here comes from the learners' own counters and version reports, as the chaos harness recorded them
per incarnation (one process lifetime of one learner slot), never from the fault schedule:

    goodput = Σ_m (inner steps of learner m that reached a published version)
              ÷ Σ_m (allocated wall time of m × m's nominal steps/s)

- A learner's `merged_steps` counter sums, over its P fragments, the inner steps behind its deltas that an
  owner merged into a version it then received; one inner step is P fragment-steps, so steps = counter / P. The
  counter is saved in checkpoints and restored with them.
- Decoupled: a restarted learner's earlier merges stay in the swarm, so every incarnation adds what it merged
  while it lived (last reported − value it started from).
- Synchronous (`rollback=True`): after a failure every learner returns to its last checkpoint, and so does its
  counter; work merged after that checkpoint was thrown away with the versions that held it. What survives is
  the final incarnation's last value minus the first one's starting value.
- Allocated time runs from a slot's first "joined" to the end of the run: a crashed learner's down time and its
  restart are still paid for.

Invariants:
- a version regression: a learner accepting a lower (term, version) of a fragment than one it already held (in
  any earlier incarnation of the same slot; the synchronous baseline's rollbacks start a new epoch);
- a lost accepted update: two different terms accepted for the same version number of a fragment within one
  epoch: the swarm forked, and whoever held the losing branch had accepted an update that no longer exists.
  Counted as a defect when some learner holding the losing version was up (joined, not yet dead) when the
  competing branch appeared (its first version at or below that number, under a higher term: from then on
  the version was lost, whatever came after), so the new owner should have reached it. (Two branches split
  among live learners show as such a defect at their first versions.) When every holder was down at that moment
  (the learners that had it all dead or still restarting, the others publishing meanwhile), no protocol that
  does not wait for dead peers could have kept it; those are counted apart (`lost_with_every_holder_down`).
"""

from __future__ import annotations

import bisect
import operator
from collections import defaultdict
from dataclasses import dataclass, field


@dataclass
class Incarnation:
    """One process lifetime of learner slot `slot`, as the harness saw it (times on the harness's clock)."""

    slot: int
    launched_at: float
    epoch: int = 0  # synchronous baseline: the number of fleet rollbacks before this incarnation
    joined_at: float | None = None
    first_step_at: float | None = None  # when its first inner step was reported (the end of its restart)
    startup: dict = field(default_factory=dict)  # its own start-up phases (s), as it reported them (node/train.py)
    ended_at: float | None = None
    start_merged: int = 0  # merged_steps (fragment-steps) when it joined, restored from a checkpoint
    last_merged: int = 0
    start_tokens: int = 0  # merged tokens, the same way
    last_tokens: int = 0
    steps: int = 0  # inner steps taken, as last reported
    accepted: list[tuple[int, int, int]] = field(default_factory=list)  # (p, term, version), in order
    accepted_at: list[float] = field(default_factory=list)  # when each of `accepted` was reported
    progress: list[tuple[float, int, int]] = field(default_factory=list)  # (time, inner step, merged_steps)
    final_eval_loss: float | None = None
    ended_by: str = ""  # "killed", "aborted" (rollback), "finished", "exited"


def merged_steps(incarnations: list[Incarnation], fragments: int, rollback: bool) -> dict[int, float]:
    """Per slot, the inner steps that reached a surviving published version."""
    return {slot: n / fragments for slot, n in _surviving(incarnations, rollback, "merged").items()}


def merged_tokens(incarnations: list[Incarnation], rollback: bool) -> int:
    """Σ over slots of the tokens that reached a surviving version (same rules as `merged_steps`)."""
    return sum(_surviving(incarnations, rollback, "tokens").values())


def _surviving(incarnations: list[Incarnation], rollback: bool, counter: str) -> dict[int, int]:
    """Per slot, what the counter (`start_<counter>`/`last_<counter>`) gained that survived (module docstring)."""
    by_slot: dict[int, list[Incarnation]] = defaultdict(list)
    for inc in incarnations:
        if inc.joined_at is not None:
            by_slot[inc.slot].append(inc)
    out = {}
    for slot, incs in by_slot.items():
        incs.sort(key=lambda i: i.launched_at)
        start, last = (operator.attrgetter(f"start_{counter}"), operator.attrgetter(f"last_{counter}"))
        out[slot] = last(incs[-1]) - start(incs[0]) if rollback else sum(last(i) - start(i) for i in incs)
    return out


def allocated_s(incarnations: list[Incarnation], end: float) -> dict[int, float]:
    """Per slot, the wall time from its first join to the end of the run."""
    first: dict[int, float] = {}
    for inc in incarnations:
        if inc.joined_at is not None:
            first[inc.slot] = min(first.get(inc.slot, inc.joined_at), inc.joined_at)
    return {slot: max(0.0, end - t) for slot, t in first.items()}


def goodput(incarnations: list[Incarnation], fragments: int, nominal_steps_per_s: dict[int, float], end: float,
            rollback: bool) -> float:
    """The goodput of one run (docs/architecture.md §10)."""
    steps = merged_steps(incarnations, fragments, rollback)
    alloc = allocated_s(incarnations, end)
    possible = sum(alloc[s] * nominal_steps_per_s[s] for s in alloc)
    return sum(steps.values()) / possible if possible > 0 else 0.0


def version_regressions(incarnations: list[Incarnation]) -> int:
    """Accepted versions lower than one the same slot already held (epochs reset what was held)."""
    held: dict[tuple[int, int, int], tuple[int, int]] = {}  # (epoch, slot, p) -> highest (term, version)
    count = 0
    for inc in sorted(incarnations, key=lambda i: i.launched_at):
        for p, term, version in inc.accepted:
            key, label = (inc.epoch, inc.slot, p), (term, version)
            if key in held and label < held[key]:
                count += 1
            else:
                held[key] = label
    return count


def lost_accepted_updates(incarnations: list[Incarnation]) -> int:
    """Σ over (epoch, fragment, version number) of the terms accepted below the highest one, for which some
    learner holding that version was up when a higher term of it appeared (module docstring)."""
    return _forks(incarnations)[0]


def lost_with_every_holder_down(incarnations: list[Incarnation]) -> int:
    """The other lost accepted updates: every learner holding the version was down when a higher term of it
    appeared."""
    return _forks(incarnations)[1]


def _forks(incarnations: list[Incarnation]) -> tuple[int, int]:
    # (epoch, p, version) -> term -> slot -> the first time that slot accepted it (None: not reported)
    seen: dict[tuple[int, int, int], dict[int, dict[int, float | None]]] = defaultdict(lambda: defaultdict(dict))
    for inc in incarnations:
        for i, (p, term, version) in enumerate(inc.accepted):
            at = inc.accepted_at[i] if i < len(inc.accepted_at) else None
            holders = seen[(inc.epoch, p, version)][term]
            first = holders.get(inc.slot, at)
            holders[inc.slot] = None if first is None or at is None else min(first, at)
    # (epoch, p) -> [(version, term, the first time any slot accepted it)]: where each branch began
    firsts: dict[tuple[int, int], list[tuple[int, int, float | None]]] = defaultdict(list)
    for (epoch, p, version), terms in seen.items():
        for term, holders in terms.items():
            times = list(holders.values())
            firsts[(epoch, p)].append((version, term, None if None in times else min(times)))
    defects = down = 0
    for (epoch, p, version), terms in seen.items():
        for term, holders in terms.items():
            if not any(higher > term for higher in terms):
                continue  # the surviving branch
            # the version was lost when a higher term first published a version at or below its number: that
            # branch does not hold it (version numbers only grow along a branch), whatever came after
            later = [t for v, higher, t in firsts[(epoch, p)] if higher > term and v <= version]
            appeared = min((t for t in later if t is not None), default=None) if None not in later else None
            if appeared is None or any(at is None or (at <= appeared and _up(incarnations, epoch, slot, appeared))
                                       for slot, at in holders.items()):
                defects += 1
            else:
                down += 1
    return defects, down


def _up(incarnations: list[Incarnation], epoch: int, slot: int, at: float) -> bool:
    """Was an incarnation of `slot` joined and alive at `at`? (A relaunch holds again what its slot accepted:
    its journal replays it.)"""
    return any(i.slot == slot and i.epoch == epoch and i.joined_at is not None and i.joined_at <= at
               and (i.ended_at is None or i.ended_at > at) for i in incarnations)


def loss_at_tokens(points: list[tuple[float, float]], tokens: float, window: int = 4) -> float | None:
    """Eval loss at `tokens` from (merged tokens, eval loss) samples of a run: a running mean over `window`
    neighbouring samples (learners evaluate their own replicas, which differ a little), linearly interpolated;
    clamped to the first and last samples. None without samples."""
    if not points:
        return None
    pts = sorted(points)
    xs = [x for x, _ in pts]
    ys = running_mean([y for _, y in pts], window)
    if tokens <= xs[0]:
        return ys[0]
    if tokens >= xs[-1]:
        return ys[-1]
    i = bisect.bisect_right(xs, tokens)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return y0 if x1 == x0 else y0 + (y1 - y0) * (tokens - x0) / (x1 - x0)


def running_mean(ys: list[float], window: int) -> list[float]:
    """Mean of each value and the `window` − 1 before it (fewer at the start)."""
    return [sum(ys[max(0, i - window + 1): i + 1]) / len(ys[max(0, i - window + 1): i + 1]) for i in range(len(ys))]

"""When to take fragment p's outer step: minimum quorum plus an adaptive grace window (docs/architecture.md §6.1).

A round of fragment p collects one delta per learner. It is ready when every live learner has reported, or when
at least K distinct learners have reported and the grace window, fixed at the moment the quorum was reached,
has passed since then. `QuorumTracker` is a pure state machine over an injected clock: it never sleeps or
polls; `deadline()` says when it will become ready, so the shard's single timer loop can wait for exactly that.

Timing, in seconds: ξ_quorum is measured from the round's first contribution to the K-th distinct learner;
ξ_step (the learners' inner step time) and ξ_sync (the owner's publish time) are EWMAs fed by the shard. Until
ξ_step has been observed the window is 0 (step at quorum).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass


@dataclass
class Ewma:
    """Exponentially weighted moving average; the first sample is taken as is."""

    alpha: float = 0.2
    value: float | None = None

    def update(self, sample: float) -> float:
        self.value = sample if self.value is None else (1 - self.alpha) * self.value + self.alpha * sample
        return self.value


def grace_window(
    step_s: float, quorum_s: float, sync_s: float, gamma: float, tau: float, cap_s: float
) -> float:
    """ξ_grace = clip(γ·(τ·ξ_step − (ξ_quorum + ξ_sync)), 0, cap)  (Decoupled DiLoCo 2604.21428 adaptive grace window)."""
    return min(max(gamma * (tau * step_s - (quorum_s + sync_s)), 0.0), cap_s)


class QuorumTracker:
    """Readiness of one fragment's round: who reported, when the quorum was reached, when to step."""

    def __init__(
        self,
        expected_learners: Iterable[str],
        K: int,
        gamma: float,
        tau: float,
        cap_s: float,
        clock: Callable[[], float] = time.monotonic,
        ewma_alpha: float = 0.2,
        strict: bool = False,
    ) -> None:
        if K < 1:
            raise ValueError(f"quorum K must be at least 1, got {K}")
        if gamma < 0 or tau < 0 or cap_s < 0:
            raise ValueError("gamma, tau and cap_s must be non-negative")
        self.K, self.gamma, self.tau, self.cap_s = K, gamma, tau, cap_s
        self.strict = strict  # K is a hard floor: "every live learner reported" does not count below it
        self.clock = clock
        self.step_time = Ewma(ewma_alpha)
        self.sync_time = Ewma(ewma_alpha)
        self.expected: frozenset[str] = frozenset(expected_learners)
        self.reset()

    def reset(self) -> None:
        """Start a new round (after the outer step); the EWMAs and the expected learners are kept."""
        self.reported: set[str] = set()
        self.first_at: float | None = None  # first contribution of the round
        self.quorum_at: float | None = None  # K-th distinct learner
        self.grace_s: float | None = None  # the window, fixed when the quorum was reached
        self.all_at: float | None = None  # every expected learner had reported

    def observe_step_time(self, seconds: float) -> None:
        self.step_time.update(seconds)

    def observe_sync_time(self, seconds: float) -> None:
        self.sync_time.update(seconds)

    @property
    def quorum_wait(self) -> float | None:
        """ξ_quorum of this round, once reached."""
        return None if self.quorum_at is None or self.first_at is None else self.quorum_at - self.first_at

    def window(self, quorum_s: float) -> float:
        """The grace window for a round that took `quorum_s` to reach quorum, from the current estimates."""
        if self.step_time.value is None:
            return 0.0
        sync_s = self.sync_time.value or 0.0
        return grace_window(self.step_time.value, quorum_s, sync_s, self.gamma, self.tau, self.cap_s)

    def _update_all(self, now: float) -> None:
        everyone = bool(self.expected) and self.expected <= self.reported
        if self.strict and len(self.reported) < self.K:
            everyone = False
        if not everyone:
            self.all_at = None
        elif self.all_at is None:
            self.all_at = now

    def set_expected(self, learners: Iterable[str]) -> None:
        """The live learners changed (a member record appeared or expired)."""
        self.expected = frozenset(learners)
        self._update_all(self.clock())

    def add(self, learner: str) -> bool:
        """Record a contribution from `learner`; False if it had already reported this round."""
        if learner in self.reported:
            return False
        now = self.clock()
        self.reported.add(learner)
        if self.first_at is None:
            self.first_at = now
        if self.quorum_at is None and len(self.reported) >= self.K:
            self.quorum_at = now
            self.grace_s = self.window(now - self.first_at)
        self._update_all(now)
        return True

    def deadline(self) -> float | None:
        """The clock time from which `ready()` holds without further events; None while waiting for learners."""
        after_grace = None if self.quorum_at is None else self.quorum_at + (self.grace_s or 0.0)
        return min((t for t in (self.all_at, after_grace) if t is not None), default=None)

    def ready(self, now: float | None = None) -> bool:
        """Every live learner reported, or at least K did and the grace window since the quorum has passed.
        With `strict` (the synchronous baseline) nothing is ready below K, however few learners are live."""
        deadline = self.deadline()
        return deadline is not None and (self.clock() if now is None else now) >= deadline

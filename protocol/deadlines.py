"""Adaptive deadlines: how long to wait for a peer, learned from how it behaved (docs/architecture.md §3).

Each link keeps an EWMA of round-trip latency and of transfer rate. A request of n bytes gets
`clip(slack · (rtt + n / rate), floor, ceiling)`: a slow intercontinental link earns patience, a dead peer on
the same rack is given up on quickly. Nothing here sleeps; callers pass the number to `asyncio.timeout`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class DeadlinePolicy:
    """The knobs, with defaults that suit both loopback tests and WAN links."""

    floor_s: float = 0.5
    ceiling_s: float = 300.0
    slack: float = 4.0
    initial_rtt_s: float = 0.25
    initial_rate_bps: float = 10e6  # conservative until measured
    alpha: float = 0.2


class LinkEstimator:
    """EWMA of one link's latency (small requests) and transfer rate (large ones)."""

    LARGE_BYTES = 256 * 1024

    def __init__(self, policy: DeadlinePolicy | None = None) -> None:
        self.policy = policy or DeadlinePolicy()
        self.rtt_s = self.policy.initial_rtt_s
        self.rate_bps = self.policy.initial_rate_bps
        self.rtt_samples = 0
        self.rate_samples = 0

    def deadline(self, nbytes: int = 0) -> float:
        p = self.policy
        expected = self.rtt_s + nbytes / self.rate_bps
        return min(max(p.slack * expected, p.floor_s), p.ceiling_s)

    def observe(self, elapsed_s: float, nbytes: int) -> None:
        """Record one completed exchange of `nbytes` (request + response) that took `elapsed_s`."""
        alpha = self.policy.alpha
        if nbytes >= self.LARGE_BYTES:
            a = alpha if self.rate_samples else 1.0
            self.rate_samples += 1
            rate = nbytes / max(elapsed_s, 1e-6)  # latency included: never more optimistic than observed
            self.rate_bps = (1 - a) * self.rate_bps + a * rate
        else:
            a = alpha if self.rtt_samples else 1.0
            self.rtt_samples += 1
            self.rtt_s = (1 - a) * self.rtt_s + a * max(elapsed_s, 1e-5)

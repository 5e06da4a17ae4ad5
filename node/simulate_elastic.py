"""The elastic-slice model (profile `paper`): Decoupled DiLoCo's simulation setup, each learner an elastic job.

Decoupled DiLoCo (arXiv:2604.21428, Google DeepMind, April 2026) simulates N chips each interrupted about once
a year (Fig. 5: MTBI_chip = 1 year, N_chip = 150k to 1.2M; Table 1: to 2.4M, a cluster failure every 13 s) under
slice-granularity elasticity (Fig. 1: after a localized failure the job goes on with fewer TPU slices); each of
its learners is such an elastic job itself. Its simulation is set by the per-chip MTBI, the chip count, chip
speed variance, the downscale and upscale times and the time for failed chips to return. This module models
all of them but chip speed variance (chips here are identical); docs/chaos.md has every value and its source.

Model. A unit (the whole job, or one learner) of n chips is k = max(1, n // slice_chips) slices. Its chips fail
as a Poisson process of rate Λ = n/mtbi_s per second of the unit's *training* time: a stalled unit's chips do
not age (the chaos harness's schedule counts up times the same way, docs/chaos.md). A failure loses the step in
flight (step_s/2 on average) and takes its slice out for return_s. No state is lost: every learner copies its
model to its hosts' RAM after each step (the paper's system design, with Fig. 4), so nothing rolls back.

* dp_elastic (one elastic job of N chips), k >= 2: it stalls downscale_s, goes on with k - 1 slices, and stalls
  upscale_s when the slice returns. Per failure: stall c = downscale_s + upscale_s, lost training
  l = step_s/2 + (return_s - downscale_s)+/k (the missing slice's share until it is back, counted in full even
  when other stalls overlap it: pessimistic). A unit left with no slice at all (all k out within return_s) is
  not modelled: at the paper's sizes that takes hundreds of failures at once. With k = 1 it behaves like dp.
* dp (non-elastic data parallel, the paper's "no elasticity"): the job waits for the failed chips to return,
  then upscales back to full size: c = return_s + upscale_s, l = step_s/2.
* decoupled: M learners of N/M chips, each a dp_elastic unit of its own. With the paper's minimum quorum K = 1 a
  learner never waits for another, and the syncer (CPUs only) does not fail, so a failure costs only its own
  learner. The fleet's goodput is the mean of its learners'; M = 1 is dp_elastic.

Costs add up and never compound (failures wait for training time), so the long-run goodput is exact:
g = max(0, 1 - Λl) / (1 + Λc), the share of allocated chip-time spent on steps that survive. ``replay`` applies
the same rules to an explicit schedule (failure instants in seconds of each unit's training) over horizon_s of
wall time; ``simulate`` replays Poisson schedules (the discrete-event check).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, fields

import numpy as np


@dataclass(frozen=True)
class ElasticParams:
    """The `paper` profile: every cost of the model, in seconds unless said otherwise, with its source."""

    # s: one inner step. The paper's bandwidth analysis assumes a 1 s step; here it only sets the step lost in
    # flight at a failure (half a step on average).
    step_s: float = 1.0
    # chips: one slice, what a chip failure takes out (paper Fig. 1). Not from the paper (its simulation's values
    # were not available to us): 256 because that is a TPU v6e pod (Cloud TPU docs), the hardware the paper
    # trains on with v5p. It only sets how much capacity a missing slice costs: 0.4% of a 150k-chip learner.
    slice_chips: int = 256
    # s: an elastic unit's stall when one of its slices fails: notice it, drop the slice, rebuild the mesh,
    # resume (the paper's "downscale time"). Not from the paper: 20 s because that is the downtime TrainMover
    # (arXiv:2412.12636v3) measures per unplanned interruption with elastic and standby machines at 1024 GPUs.
    downscale_s: float = 20.0
    # s: the stall to take a returned slice back in (the paper's "upscale time"), a planned change: the slice
    # warms up beside the running job. Not from the paper: 6 s because TrainMover (arXiv:2412.12636v2) keeps 99%
    # training efficiency with one planned migration every 10 minutes, i.e. at most 6 s each.
    upscale_s: float = 6.0
    # s: from a failure until the failed chips are back (the paper's "time for failed chips to return"). Not from
    # the paper: 60 s because a hot-spare slice is swapped in (the down time the localhost profile has always
    # assumed); a host reboot takes 5-10 minutes and would leave non-elastic data parallel near 0%.
    return_s: float = 60.0
    # s: wall time simulated by `replay` and `simulate`. 30 days, a frontier run; the expectation is the
    # long-run rate, which a 30-day run at the paper's failure rates matches to 1e-5.
    horizon_s: float = 30 * 86400.0

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if not isinstance(v, int | float) or math.isnan(v) or v < 0:
                raise ValueError(f"{f.name} must be a number >= 0, not {v!r}")
            if f.name != "horizon_s" and math.isinf(v):
                raise ValueError(f"{f.name} must be finite")
        if self.step_s <= 0 or self.horizon_s <= 0 or self.slice_chips < 1:
            raise ValueError("step_s and horizon_s must be > 0, slice_chips >= 1")


def _units(mode: str, chips: int, learners: int) -> tuple[int, float]:
    """(number of units, chips per unit): decoupled has M learners, dp and dp_elastic one job of N chips."""
    return (learners, chips / learners) if mode == "decoupled" else (1, float(chips))


def failure_costs(mode: str, unit_chips: float, p: ElasticParams) -> tuple[float, float]:
    """(stall c, lost training l) in seconds, per failure of a unit of `unit_chips` chips."""
    k = max(1, int(unit_chips // p.slice_chips))
    if mode == "dp" or k == 1:
        return p.return_s + p.upscale_s, p.step_s / 2
    return p.downscale_s + p.upscale_s, p.step_s / 2 + max(0.0, p.return_s - p.downscale_s) / k


def expected_goodput(mode: str, chips: int, learners: int, mtbi_s: float, params: ElasticParams) -> float:
    """Exact long-run goodput of the model: max(0, 1 - Λl) / (1 + Λc) per unit (module docstring)."""
    _, unit = _units(mode, chips, learners)
    rate = unit / mtbi_s
    stall, lost = failure_costs(mode, unit, params)
    return max(0.0, 1.0 - rate * lost) / (1.0 + rate * stall)


def _unit_useful(f: np.ndarray, stall: float, lost: float, horizon: float) -> float:
    """Useful seconds of one unit by wall time `horizon`, given its failures at training times f (sorted)."""
    wall = f + stall * np.arange(len(f))  # the wall time of each failure: the stalls before it come first
    n = int(np.searchsorted(wall, horizon, "left"))
    trained = horizon if n == 0 else max(float(f[n - 1]), horizon - n * stall)  # a stall may run past the end
    return max(0.0, trained - n * lost)


def replay(mode: str, learners: int, failures: Sequence[Sequence[float]], params: ElasticParams,
           chips: int) -> float:
    """Goodput the model gives for one explicit schedule: failures[m] = instants (seconds of training) at which
    a chip of learner m fails. For dp and dp_elastic the M schedules are one job's, merged."""
    big_t = params.horizon_s
    if math.isinf(big_t):
        raise ValueError("replay needs a finite horizon_s")
    if len(failures) != learners:
        raise ValueError(f"failures has {len(failures)} schedules for {learners} learners")
    fs = [np.sort(x[(x >= 0) & (x < big_t)]) for x in (np.asarray(v, dtype=float) for v in failures)]
    units, unit_chips = _units(mode, chips, learners)
    if units == 1:
        fs = [np.sort(np.concatenate(fs))]
    stall, lost = failure_costs(mode, unit_chips, params)
    return sum(_unit_useful(f, stall, lost, big_t) for f in fs) / (units * big_t)


def simulate(mode: str, chips: int, learners: int, mtbi_s: float, params: ElasticParams, *, seed: int = 0,
             runs: int = 1) -> float:
    """Discrete-event estimate: mean goodput of `runs` replays of seeded Poisson schedules."""
    big_t = params.horizon_s
    if math.isinf(big_t):
        raise ValueError("simulate needs a finite horizon_s")
    units, unit_chips = _units(mode, chips, learners)
    rate = unit_chips / mtbi_s
    rng, total = np.random.default_rng(seed), 0.0
    for _ in range(runs):
        sched = [rng.uniform(0, big_t, rng.poisson(rate * big_t)) for _ in range(units)]
        total += replay(mode, units, sched, params, chips=chips)
    return total / runs

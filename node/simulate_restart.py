"""The restart model (profile `localhost`): a learner is one process, so any failure stops all of it.

This is the fleet the localhost chaos harness runs (docs/chaos.md): a `kill -9` ends a learner process, which
comes back after a down time and a restart. `diloco.node.chaos_run` replays its kill schedules through this model
with the costs it measured (`replayed_goodput`) and predicts them from its calibration (`predicted_goodput`). A
fleet whose learners are large elastic jobs of many slices is `node/simulate_elastic.py` (profile `paper`).

Model. A cluster of N chips is split into M learners of c = N/M chips. Every chip is interrupted as a Poisson
process of mean ``mtbi_s`` (at all times, also while its slice is being replaced), so a learner fails at rate
λ = c/mtbi_s and the whole job at Λ = N/mtbi_s. A failure during a recovery restarts that recovery; hence a unit
(job or learner) with recovery time R is out at time t exactly when it failed in (t-R, t]. Everything starts up
at t = 0 (cold start) and stops at the horizon T. Goodput = useful step-time / (M·T): the share of allocated
chip-time spent on steps that survive (a down learner is still paid for).

* ``dp`` (non-elastic): any failure stops everyone for R = detect + downtime + restart and loses the work since
  the last checkpoint. A checkpoint follows every τ = ckpt_interval_s of progress and stalls ckpt_write_s = W,
  so the job completes blocks of B = τ + W and keeps τ per block; the stretch after the last failure is never
  rolled back, so all of it counts (at τ/B). M does not matter. τ = 0 (default) means the model's own optimum: x = Λτ solves 1 - e^{-(x+ΛW)} = x (the exact
  form of Young/Daly's √(2W/Λ)), at least one step; with no failures, one checkpoint at the end.
* ``dp_elastic``: a failed learner's slice is out for R; each survivor in the group stalls detect + reconfig
  (it must notice the failure, then re-form the group) and loses the current step (step_s); the failed learner
  loses its in-flight step too. Its rejoin stalls every learner in the group, itself included, for reconfig_s.
  Every event is charged in full (real stalls that overlap would merge, so once events come faster than one
  per reconfig_s this is pessimistic, and goodput is clipped at 0). Survivors hold the state: no checkpoints.
* ``decoupled``: only the failed learner stops, for R_d = downtime + restart (no group detection), and loses its
  unmerged work L = (H/2)·step_s + merge_latency_s, at most all it did since it came back. L is the mean: P
  staggered fragments each hold a uniform share of their H-step cycle, and their average stays within
  H/(2P) steps of H/2. At T every learner also loses its unmerged work (at most its age).
* M = 1: nobody else holds the state, so dp_elastic and decoupled are exactly dp.
* sync_efficiency multiplies dp and dp_elastic, decoupled_efficiency multiplies decoupled.

Exact expectations (cold start, any T; T = inf gives the long-run rate), with d, r, s = detect_s, reconfig_s,
step_s and e_s, e_d = sync_efficiency, decoupled_efficiency. With up(ρ, R, L, T) =
E ∫_0^{T-L} 1{no failure in (t-R, t+L]} dt = e^{-ρL} [(1 - e^{-ρ·min(R, T-L)})/ρ + e^{-ρR}(T-L-R)⁺]:

* decoupled: goodput = e_d · up(λ, R_d, L, T) / T                          → e_d · e^{-λ(R_d + L)}
* dp: E[blocks done by T] = Σ_{k≤T/B} e^{-ΛkB} + Λe^{-ΛR} Σ_k e^{-ΛkB}(T-R-kB)⁺ (the first term: the block
  run from t = 0; the second, by the Mecke formula: a block run from each failure u, done at u+R+kB if no
  failure in between); goodput = e_s · (τ · E[blocks] + E[tail]) / T         → e_s · τΛe^{-ΛR} / (e^{ΛB} - 1),
  E[tail] = τ·E[frac(x/B)] for the stretch x after the last failure (integrated numerically, `_dp_tail`)
* dp_elastic, per learner: I = up(λ, R, 0, T) in the group; λI departures; λe^{-λR}(T-R)⁺ rejoins; another
  learner's events that find this one in the group: λ(d+r+s)·up(2λ, R, 0, T) + rλe^{-2λR}(T-R)⁺. Goodput =
  e_s · max(0, I - s·λI - r·rejoins - (M-1)·cross) / T          → e_s · max(0, p - λp((M-1)p(d+2r+s) + s + r)),
  p = e^{-λR}.

``replay`` computes the same model for one explicit failure schedule: with gaps g between consecutive points of
[-R, failures…, T], decoupled keeps Σ(g - R_d - L)⁺, dp keeps τ·Σ⌊(g - R)⁺/B⌋, dp_elastic counts its events
directly. ``simulate`` (the discrete-event check) draws Poisson schedules and replays them. A harness replays
its real kill schedule with its measured step time and down times as the costs and horizon_s = its run length.

The `localhost` profile is `SimParams()`: the costs this simulator used before the paper profile existed (each
field says why). The per-chip MTBI default of 1 year is the scenario of Decoupled DiLoCo (arXiv:2604.21428, Fig. 5:
1.2M chips each interrupted about once a year, a cluster failure every ~26 s); Llama 3 measured 419 unexpected
interruptions in 54 days on 16,384 GPUs, ≈ 5.8 years per GPU.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace

import numpy as np

_MAX_BLOCKS = 1_000_000  # beyond this many checkpoint blocks in the horizon, dp's edge terms are < 1e-6


@dataclass(frozen=True)
class SimParams:
    """Every cost the model assumes, in seconds unless said otherwise."""

    # s: one inner step. ~1 s is a frontier step (a few M tokens per learner); only scales per-failure losses.
    step_s: float = 1.0
    # steps, H: a fragment's delta leaves every H steps (`init-run` default; Streaming DiLoCo uses 100).
    inner_steps: int = 100
    # count, P: fragments, staggered by H/P steps (`init-run` default); the unmerged share stays H/2 ± H/(2P).
    fragments: int = 4
    # s: until a synchronous group notices a failure. A tuned heartbeat; torch's default collective timeout is
    # 600 s, so 30 s favours dp.
    detect_s: float = 30.0
    # s: failure until the replacement process can start. A hot-spare slice is swapped in; a host reboot
    # takes 5-10 min, so 60 s favours every mode, dp most.
    downtime_s: float = 60.0
    # s: process start to first step: runtime and communicator init, state restore from host memory or peers
    # at 1e5 chips (from remote storage it is longer).
    restart_s: float = 120.0
    # s: elastic dp: re-form the group without restarting processes (communicator init at 1e5 ranks and
    # re-sharding the input pipeline take tens of seconds).
    reconfig_s: float = 30.0
    # s: dp checkpoint period of progress; 0 = the model's optimum for the job's failure rate, so the
    # non-elastic baseline is never handicapped by a badly chosen period.
    ckpt_interval_s: float = 0.0
    # s: dp stall per checkpoint: the device-to-host snapshot (persisting to storage runs in the background).
    ckpt_write_s: float = 5.0
    # s: decoupled: a delta's send until the version merging it is published (cross-datacentre transfer of a
    # compressed fragment at ~10 Gbit/s, the quorum wait and the outer step).
    merge_latency_s: float = 30.0
    # fraction: useful share of failure-free time of a synchronous job (blocking communication). 1 = ideal.
    sync_efficiency: float = 1.0
    # fraction: the same for decoupled (background fragment I/O). 1 = ideal.
    decoupled_efficiency: float = 1.0
    # s: simulated wall time. 30 days, a frontier run, makes end effects negligible; inf = long-run rate;
    # the localhost harness passes its run length.
    horizon_s: float = 30 * 86400.0

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if not isinstance(v, int | float) or math.isnan(v) or v < 0:
                raise ValueError(f"{f.name} must be a number >= 0, not {v!r}")
        if self.step_s <= 0 or self.horizon_s <= 0 or self.inner_steps < 1 or self.fragments < 1:
            raise ValueError("step_s and horizon_s must be > 0, inner_steps and fragments >= 1")
        if not (0 < self.sync_efficiency <= 1 and 0 < self.decoupled_efficiency <= 1):
            raise ValueError("sync_efficiency and decoupled_efficiency must be in (0, 1]")
        if math.isinf(self.step_s) or any(math.isinf(getattr(self, n)) for n in ("inner_steps", "fragments")):
            raise ValueError("step_s, inner_steps and fragments must be finite")

    @property
    def recovery_s(self) -> float:
        """R of dp and dp_elastic: detect, replace, restart."""
        return self.detect_s + self.downtime_s + self.restart_s

    @property
    def decoupled_out_s(self) -> float:
        """R_d of a decoupled learner: nobody waits to detect it."""
        return self.downtime_s + self.restart_s

    @property
    def unmerged_s(self) -> float:
        """L: a decoupled learner's unmerged work at a random instant (half a cycle plus the merge)."""
        return self.inner_steps * self.step_s / 2 + self.merge_latency_s


def checkpoint_interval(params: SimParams, job_rate: float) -> float:
    """τ: the explicit period, or the optimum of the long-run dp goodput τ/(e^{Λ(τ+W)} - 1) for rate Λ."""
    if params.ckpt_interval_s > 0:
        return params.ckpt_interval_s
    if params.ckpt_write_s == 0:
        return params.step_s  # checkpoints are free: take one every step
    if job_rate == 0:  # nothing fails: a single checkpoint at the end
        return max(params.step_s, params.horizon_s - params.ckpt_write_s)
    w, lo, hi = job_rate * params.ckpt_write_s, 0.0, 1.0  # root of 1 - e^{-(x+w)} - x on (0, 1)
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if -math.expm1(-(mid + w)) > mid else (lo, mid)
    return max(params.step_s, lo / job_rate)


def _exp(x: float) -> float:
    return math.exp(max(x, -745.0))


def _up(rate: float, out_s: float, tail_s: float, horizon: float) -> float:
    """E ∫_0^{T-tail} 1{no failure in (t-out, t+tail]} dt for Poisson failures of `rate` from t = 0."""
    head = min(out_s, horizon - tail_s)
    if head <= 0:
        return 0.0
    first = head if rate == 0 else -math.expm1(-rate * head) / rate
    return _exp(-rate * tail_s) * (first + _exp(-rate * out_s) * max(0.0, horizon - tail_s - out_s))


def _dp(job_rate: float, p: SimParams) -> float:
    tau, big_t, r = checkpoint_interval(p, job_rate), p.horizon_s, p.recovery_s
    b = tau + p.ckpt_write_s
    if math.isinf(big_t) or big_t / b > _MAX_BLOCKS:
        if job_rate == 0:
            return p.sync_efficiency * (1.0 if math.isinf(tau) else tau / b)
        x = job_rate * b
        return 0.0 if x > 700 else p.sync_efficiency * tau * job_rate * _exp(-job_rate * r) / math.expm1(x)
    k1, k2 = int(big_t // b), int(max(0.0, big_t - r) // b)
    first = np.exp(-job_rate * b * np.arange(1, k1 + 1)).sum()
    k = np.arange(1, k2 + 1)
    later = job_rate * _exp(-job_rate * r) * (np.exp(-job_rate * b * k) * (big_t - r - k * b)).sum()
    return p.sync_efficiency * (tau * float(first + later) + _dp_tail(job_rate, r, tau, b, big_t)) / big_t


def _dp_tail(job_rate: float, r: float, tau: float, b: float, big_t: float, grid: int = 200_001) -> float:
    """E[progress of the unfinished block at T]: no failure follows it, so nothing rolls it back; it counts.
    The last stretch runs from the last failure (density Λe^{-Λv} at v = T - u) or from 0 (probability e^{-ΛT})."""
    def frac(x: np.ndarray | float) -> np.ndarray | float:
        return tau * (np.asarray(x) / b - np.floor(np.asarray(x) / b))

    from_start = _exp(-job_rate * big_t) * float(frac(big_t))
    if job_rate == 0:
        return from_start
    v = np.linspace(0.0, big_t, grid)
    f = job_rate * np.exp(-job_rate * v) * frac(np.maximum(v - r, 0.0))
    return from_start + float(np.sum((f[1:] + f[:-1]) * np.diff(v)) / 2)


def expected_goodput(mode: str, chips: int, learners: int, mtbi_s: float, params: SimParams) -> float:
    """Exact expected goodput of the model (see the module docstring); horizon_s = inf: the long-run rate."""
    job_rate, rate = chips / mtbi_s, chips / learners / mtbi_s
    if mode == "dp" or learners == 1:
        return _dp(job_rate, params)
    big_t = params.horizon_s
    if mode == "decoupled":
        out, tail = params.decoupled_out_s, params.unmerged_s
        if math.isinf(big_t):
            return params.decoupled_efficiency * _exp(-rate * (out + tail))
        return params.decoupled_efficiency * _up(rate, out, tail, big_t) / big_t
    r, s, d, rc = params.recovery_s, params.step_s, params.detect_s, params.reconfig_s
    if math.isinf(big_t):
        p_in = _exp(-rate * r)
        useful = p_in - rate * p_in * ((learners - 1) * p_in * (d + 2 * rc + s) + s + rc)
        return params.sync_efficiency * max(0.0, useful)
    in_time = _up(rate, r, 0.0, big_t)
    after = max(0.0, big_t - r)
    rejoins = rate * _exp(-rate * r) * after
    cross = rate * (d + rc + s) * _up(2 * rate, r, 0.0, big_t) + rc * rate * _exp(-2 * rate * r) * after
    useful = in_time - s * rate * in_time - rc * rejoins - (learners - 1) * cross
    return params.sync_efficiency * max(0.0, useful) / big_t


def _gaps(f: np.ndarray, out_s: float, horizon: float) -> np.ndarray:
    return np.diff(np.concatenate(([-out_s], f, [horizon])))


def replay(mode: str, learners: int, failures: Sequence[Sequence[float]], params: SimParams) -> float:
    """Goodput the model gives for one explicit schedule: failures[m] = failure times (s) of learner m.

    Times outside [0, horizon_s) are ignored; horizon_s must be finite. With ckpt_interval_s = 0 the dp
    period is the optimum for the schedule's own failure rate (all failures / horizon).
    """
    big_t = params.horizon_s
    if math.isinf(big_t):
        raise ValueError("replay needs a finite horizon_s (the run length)")
    if len(failures) != learners:
        raise ValueError(f"failures has {len(failures)} schedules for {learners} learners")
    fs = [np.sort(x[(x >= 0) & (x < big_t)]) for x in (np.asarray(v, dtype=float) for v in failures)]
    if mode == "dp" or learners == 1:
        f = np.sort(np.concatenate(fs))
        tau = checkpoint_interval(params, len(f) / big_t)
        g = np.maximum(_gaps(f, params.recovery_s, big_t) - params.recovery_s, 0.0) / (tau + params.ckpt_write_s)
        blocks = np.floor(g[:-1]).sum() + g[-1]  # the last stretch is never rolled back: all of it counts
        return params.sync_efficiency * tau * float(blocks) / big_t
    if mode == "decoupled":
        cut = params.decoupled_out_s + params.unmerged_s
        kept = sum(float(np.maximum(_gaps(f, params.decoupled_out_s, big_t) - cut, 0.0).sum()) for f in fs)
        return params.decoupled_efficiency * kept / (learners * big_t)
    r, s, d, rc = params.recovery_s, params.step_s, params.detect_s, params.reconfig_s
    times, owners, costs, useful = [], [], [], 0.0
    for m, f in enumerate(fs):
        g = _gaps(f, r, big_t)
        useful += float(np.maximum(g - r, 0.0).sum())
        dep, rej = f[g[:-1] >= r], f[g[1:] > r] + r  # failures while in the group; comebacks before T
        useful -= s * len(dep) + rc * len(rej)
        times += [dep, rej]
        owners += [np.full(len(dep) + len(rej), m)]
        costs += [np.full(len(dep), d + rc + s), np.full(len(rej), rc)]
    t_all, o_all, c_all = np.concatenate(times), np.concatenate(owners), np.concatenate(costs)
    for m, f in enumerate(fs):  # learner m pays for others' events that find it in the group
        in_group = np.searchsorted(f, t_all, "right") == np.searchsorted(f, t_all - r, "right")
        useful -= float(c_all[in_group & (o_all != m)].sum())
    return params.sync_efficiency * max(0.0, useful) / (learners * big_t)


def simulate(mode: str, chips: int, learners: int, mtbi_s: float, params: SimParams, *, seed: int = 0,
             runs: int = 1) -> float:
    """Discrete-event estimate: mean goodput of `runs` replays of Poisson schedules (seeded)."""
    if math.isinf(params.horizon_s):
        raise ValueError("simulate needs a finite horizon_s")
    rate = chips / learners / mtbi_s
    fixed = replace(params, ckpt_interval_s=checkpoint_interval(params, chips / mtbi_s))
    rng, total = np.random.default_rng(seed), 0.0
    for _ in range(runs):
        sched = [rng.uniform(0, params.horizon_s, rng.poisson(rate * params.horizon_s)) for _ in range(learners)]
        total += replay(mode, learners, sched, fixed)
    return total / runs


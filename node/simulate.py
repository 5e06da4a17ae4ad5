"""Fleet goodput simulator: non-elastic data parallel, elastic data parallel and decoupled learners.

N chips, split into M learners for the decoupled mode, every chip interrupted at random with a mean time between
interruptions (MTBI); goodput is the share of allocated chip-time spent on steps that survive. A parameter set
(`node/fleet_profiles.py`) names the model it follows:

- `paper` (default): `node/simulate_elastic.py`, Decoupled DiLoCo's own setup (arXiv:2604.21428): a job or learner
  is an elastic job of TPU slices; a failure takes one slice out while the rest goes on.
- `localhost`: `node/simulate_restart.py`: a learner is one process, so any failure stops it (the chaos harness).

This module is what both share: argument checks, the discrete-event check, the table and its text. Modes are the
same in both: `dp` (non-elastic), `dp_elastic` (one elastic job; in `localhost`, M groups that shrink and grow)
and `decoupled` (M learners, only the failed one pays).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict

from . import simulate_elastic as elastic
from . import simulate_restart as restart
from .fleet_profiles import DEFAULT_PROFILE, PROFILES, Params, profile, with_overrides
from .simulate_elastic import ElasticParams
from .simulate_restart import SimParams, checkpoint_interval

__all__ = ["DEFAULT_CHIPS", "DEFAULT_LEARNERS", "DEFAULT_MTBI_YEARS", "DEFAULT_PROFILE", "MODES", "PROFILES", "YEAR_S",
           "ElasticParams", "SimParams", "checkpoint_interval", "expected_goodput", "format_table", "params_json",
           "parse_counts", "profile", "profile_name", "replay", "simulate", "table", "with_overrides"]

MODES = ("dp", "dp_elastic", "decoupled")
YEAR_S = 365.25 * 86400.0
DEFAULT_MTBI_YEARS = 1.0
DEFAULT_CHIPS = (150_000, 300_000, 600_000, 1_200_000, 2_400_000)
DEFAULT_LEARNERS = (2, 4, 8, 16)


def _check(mode: str, chips: int, learners: int, mtbi_s: float) -> None:
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, not {mode!r}")
    if learners < 1 or chips < learners or not mtbi_s > 0:
        raise ValueError("need chips >= learners >= 1 and mtbi_s > 0")


def profile_name(params: Params) -> str:
    """'paper' or 'localhost': the model a parameter set follows."""
    return "paper" if isinstance(params, ElasticParams) else "localhost"


def expected_goodput(mode: str, chips: int, learners: int, mtbi_s: float, params: Params) -> float:
    """Exact expected goodput of the parameter set's model (its module docstring)."""
    _check(mode, chips, learners, mtbi_s)
    model = elastic if isinstance(params, ElasticParams) else restart
    return model.expected_goodput(mode, chips, learners, mtbi_s, params)


def replay(mode: str, learners: int, failures: Sequence[Sequence[float]], params: Params, *,
           chips: int | None = None) -> float:
    """Goodput of one explicit schedule, failures[m] = failure times (s) of learner m. `localhost`: wall-clock
    times; `paper`: seconds of the learner's training, and `chips` (the fleet's size) is required."""
    _check(mode, chips or learners, learners, 1.0)
    if isinstance(params, ElasticParams):
        if chips is None:
            raise ValueError("the paper profile's replay needs chips (slices per learner depend on it)")
        return elastic.replay(mode, learners, failures, params, chips)
    return restart.replay(mode, learners, failures, params)


def simulate(mode: str, chips: int, learners: int, mtbi_s: float, params: Params, *, seed: int = 0,
             runs: int = 1) -> float:
    """Discrete-event estimate: mean goodput of `runs` replays of seeded Poisson schedules."""
    _check(mode, chips, learners, mtbi_s)
    model = elastic if isinstance(params, ElasticParams) else restart
    return model.simulate(mode, chips, learners, mtbi_s, params, seed=seed, runs=runs)


def table(chips: Sequence[int], learners: Sequence[int], mtbi_s: float, params: Params, *,
          des: bool = False, seed: int = 0) -> list[dict]:
    """Rows {mode, chips, learners, goodput} for every mode, chip count and learner count."""
    rows = []
    for n in chips:
        for m in learners:
            for mode in MODES:
                g = (simulate(mode, n, m, mtbi_s, params, seed=seed) if des
                     else expected_goodput(mode, n, m, mtbi_s, params))
                rows.append({"mode": mode, "chips": n, "learners": m, "goodput": g})
    return rows


def parse_counts(text: str) -> list[int]:
    """'150k,2.4M,16' -> [150000, 2400000, 16]; ValueError on anything else."""
    out = []
    for part in text.split(","):
        p = part.strip().replace("_", "")
        scale = {"k": 1_000, "m": 1_000_000}.get(p[-1:].lower(), 1)
        try:
            v = float(p[:-1] if scale > 1 else p) * scale
        except ValueError:
            raise ValueError(f"{part.strip()!r} is not a count (for example 150000, 150k or 2.4M)") from None
        if not v.is_integer() or v < 1:
            raise ValueError(f"{part.strip()!r} is not a whole number >= 1")
        out.append(int(v))
    return out


def params_json(params: Params, mtbi_s: float, des: bool) -> dict:
    """The --json `params` object; infinite values are written as null."""
    out = {"profile": profile_name(params), **asdict(params), "mtbi_s": mtbi_s, "mtbi_years": mtbi_s / YEAR_S,
           "method": "des" if des else "exact"}
    return {k: (None if isinstance(v, float) and math.isinf(v) else v) for k, v in out.items()}


def _dur(s: float) -> str:
    if math.isinf(s):
        return "inf"
    for unit, size, least in (("y", YEAR_S, 1), ("d", 86400, 2), ("h", 3600, 2), ("min", 60, 2)):
        if s >= least * size:
            return f"{s / size:.1f} {unit}"
    return f"{s:.0f} s"


def format_table(rows: list[dict], mtbi_s: float, params: Params, des: bool = False) -> list[str]:
    """A readable goodput table, one line per (chips, learners)."""
    paper = isinstance(params, ElasticParams)
    how = ("discrete-event simulation, horizon " + _dur(params.horizon_s) if des
           else "long-run expectation" if paper or math.isinf(params.horizon_s)
           else "exact expectation, horizon " + _dur(params.horizon_s))
    model = "paper: elastic slices, arXiv:2604.21428" if paper else "localhost: a failure stops its learner"
    lines = [f"goodput (% of allocated chip-time), profile {model}, per-chip MTBI {_dur(mtbi_s)}, {how}",
             "params: " + " ".join(f"{k}={v:g}" for k, v in asdict(params).items()),
             f"{'chips':>10} {'M':>3} {'job MTBI':>9} {'learner MTBI':>12} {'dp':>6} {'dp_elastic':>10} "
             f"{'decoupled':>9}"]
    by_key: dict[tuple[int, int], dict[str, float]] = {}
    for row in rows:
        by_key.setdefault((row["chips"], row["learners"]), {})[row["mode"]] = row["goodput"]
    for (n, m), g in by_key.items():
        lines.append(f"{n:>10,} {m:>3} {_dur(mtbi_s / n):>9} {_dur(mtbi_s * m / n):>12} {100 * g['dp']:>6.1f} "
                     f"{100 * g['dp_elastic']:>10.1f} {100 * g['decoupled']:>9.1f}")
    return lines

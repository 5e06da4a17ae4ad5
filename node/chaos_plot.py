"""The chaos run's two pictures: eval loss against wall time, and goodput as it accumulates, per mode.

Needs matplotlib (`pip install 'diloco-node[plots]'`); `chaos_run` skips the plots with a hint without it.
Faults are drawn as thin vertical lines in the colour of the mode they hit.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402 - after choosing the file-only backend

from .chaos import FleetRun  # noqa: E402
from .goodput import running_mean  # noqa: E402

COLOURS = {"decoupled": "tab:blue", "sync": "tab:red", "no_failure": "tab:gray"}


def _faults(run: FleetRun) -> list[float]:
    t0_wall = next((e["t"] for e in run.events if e["event"] == "fleet_up"), None)
    return [e["t"] - t0_wall for e in run.events if e["event"] == "fault" and t0_wall is not None]


def merged_curve(run: FleetRun, fragments: int) -> tuple[list[float], list[float]]:
    """Fleet inner steps merged so far, against seconds since the fleet came up. Synchronous: each learner's
    counter as restored after a rollback (so lost work shows as a drop); decoupled: every incarnation's gains."""
    rollback = run.mode == "sync"
    samples = []  # (t, slot, incarnation index, merged)
    for k, inc in enumerate(run.incarnations):
        samples += [(t, inc.slot, k, m - (0 if rollback else inc.start_merged)) for t, _, m in inc.progress]
    samples.sort()
    done: dict[int, float] = {}  # decoupled: gains of a slot's finished incarnations
    current: dict[int, tuple[int, float]] = {}
    xs, ys = [], []
    for t, slot, k, m in samples:
        prev = current.get(slot)
        if prev is not None and prev[0] != k and not rollback:
            done[slot] = done.get(slot, 0.0) + prev[1]
        current[slot] = (k, m)
        xs.append(t - run.started_at)
        ys.append((sum(done.values()) + sum(v for _, v in current.values())) / fragments)
    return xs, ys


def plot(out: Path, runs: dict[str, FleetRun], nominal: dict[int, float], fragments: int) -> list[Path]:
    paths = []
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for mode, run in runs.items():
        if mode not in COLOURS or not run.evals:
            continue
        pts = sorted((t - run.started_at, loss) for t, _, loss in run.evals)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], ".", ms=3, alpha=0.35, color=COLOURS[mode])
        smooth = running_mean([p[1] for p in pts], max(1, len(nominal)))
        ax.plot([p[0] for p in pts], smooth, "-", color=COLOURS[mode], label=mode.replace("_", " "))
        for x in _faults(run):
            ax.axvline(x, color=COLOURS[mode], lw=0.5, alpha=0.4)
    paths.append(_save(fig, ax, out / "loss_vs_time.png", "Eval loss under the same fault schedule",
                       "eval loss (each learner's model, held-out data)"))

    fig, ax = plt.subplots(figsize=(8, 4.5))
    rate = sum(nominal.values())
    for mode, run in runs.items():
        if mode not in COLOURS:
            continue
        xs, ys = merged_curve(run, fragments)
        pairs = [(x, y / (rate * x)) for x, y in zip(xs, ys, strict=True) if x > 10]
        ax.plot([p[0] for p in pairs], [p[1] for p in pairs], "-", color=COLOURS[mode], label=mode.replace("_", " "))
        for x in _faults(run):
            ax.axvline(x, color=COLOURS[mode], lw=0.5, alpha=0.4)
    ax.axhline(1.0, color="black", lw=0.8, ls="--")
    ax.set_ylim(0, 1.1)
    paths.append(_save(fig, ax, out / "goodput_vs_time.png", "Goodput under the same fault schedule",
                       "goodput so far (merged steps ÷ nominal steps)"))
    return paths


def _save(fig, ax, path: Path, title: str, ylabel: str) -> Path:
    ax.set_xlabel("wall time since the fleet came up (s)")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path

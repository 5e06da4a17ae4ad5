"""`diloco-node report DIR`: PNG plots of a run, drawn from the learners' own event lines.

Input: every `*.jsonl` file under DIR whose lines are `join` events (`emit` in node/train.py: "joined",
"progress", "merged", "eval", "done", ...). One file is one learner (a restarted learner's incarnations
follow each other in it, each opening with "joined"); the layouts the commands write:

    join --out DIR      DIR/events.jsonl                 one learner
    demo --out DIR      DIR/learner-I/events.jsonl       the demo's learners, one group
    chaos --out DIR     DIR/MODE/learner-I.jsonl         one group per mode (decoupled, sync, ...)

A file named `events.jsonl` is the learner of its directory; any other file is a learner named by its path.
Learners of one directory form a group (they ran together: one clock, one swarm); lines of another shape
(the chaos harness's own events.jsonl, summaries) are not read. Time is wall time since the group's first
event. Plots, each skipped with the reason when no event carries what it needs:

    loss_vs_time.png    training loss ("progress", mean of the last inner steps) and eval loss ("eval", "done")
    loss_vs_tokens.png  the same against the learner's own inner-step tokens
    goodput.png         per group, Σ merged_steps / (P · Σ steps) over the learners' latest "progress": the
                        share of inner steps whose progress reached a published version (the demo's goodput,
                        as it accumulates; `chaos` draws its wall-time goodput itself)
    bytes_per_step.png  bytes sent and received per inner step, between consecutive "progress" events
    staleness.png       a histogram: at every "progress" event of a learner, for every fragment p, the newest
                        version number of p held by any learner of the group so far minus the one this learner
                        holds. Held versions are the "joined" event's list, moved by the `accepted` moves each
                        later event reports (a move counts from the event that reports it); needs 2 learners.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .demo import _version_number

LEARNER_EVENTS = {"joined", "first_step", "progress", "merged", "eval", "checkpoint_failed", "done"}
PLOTS = ("loss_vs_time.png", "loss_vs_tokens.png", "goodput.png", "bytes_per_step.png", "staleness.png")


class ReportError(Exception):
    """The report cannot be made (no events, no matplotlib): one line for the user."""


@dataclass
class Stream:
    """One learner's events, in the order it wrote them."""

    name: str
    group: str
    events: list[dict[str, Any]]
    t0: float = 0.0  # the group's first event

    def of(self, *kinds: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e["event"] in kinds]


@dataclass
class Report:
    written: list[Path] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (file, why)


def _learner_events(path: Path) -> list[dict[str, Any]]:
    events = []
    with open(path, errors="replace") as f:
        for line in f:
            try:
                ev = json.loads(line)
            except ValueError:  # a line cut short by a kill, or not ours
                continue
            if (isinstance(ev, dict) and ev.get("event") in LEARNER_EVENTS and "mode" not in ev
                    and isinstance(ev.get("t"), (int, float))):
                events.append(ev)
    return events


def load(root: Path) -> list[Stream]:
    """Every learner stream under `root`, with its group's start time."""
    streams = []
    for path in sorted(root.rglob("*.jsonl")):
        events = _learner_events(path)
        if not events:
            continue
        rel = path.relative_to(root)
        where = rel.parent if path.name == "events.jsonl" else rel.with_suffix("")
        name = root.name if where == Path(".") else str(where)
        group = "" if where.parent == Path(".") else str(where.parent)
        streams.append(Stream(name, group, events))
    for s in streams:
        s.t0 = min(e["t"] for o in streams if o.group == s.group for e in o.events)
    return streams


def staleness(streams: list[Stream]) -> list[int]:
    """Versions behind, per (progress event, fragment), over every group of at least 2 learners with versions
    (the module docstring says how)."""
    values: list[int] = []
    for group in {s.group for s in streams}:
        members = [s for s in streams if s.group == group and s.of("joined") and "versions" in s.of("joined")[0]]
        if len(members) < 2:
            continue
        timeline = sorted(((e["t"], i, e) for i, s in enumerate(members) for e in s.events), key=_when)
        held: dict[int, list[int]] = {}
        newest: list[int] = []
        for _, i, ev in timeline:
            if ev["event"] == "joined" and isinstance(ev.get("versions"), list):
                held[i] = [_version_number(v) for v in ev["versions"]]
            mine = held.get(i)
            if mine is None:
                continue
            for move in ev.get("accepted") or []:
                if isinstance(move, list) and len(move) == 3 and 0 <= int(move[0]) < len(mine):
                    mine[int(move[0])] = int(move[2])
            newest = [max(a, b) for a, b in zip(newest or [0] * len(mine), mine, strict=False)]
            if ev["event"] == "progress":
                values += [max(0, n - v) for n, v in zip(newest, mine, strict=False)]
    return values


def _when(item: tuple[float, int, dict]) -> tuple[float, int]:
    """Time, then learner: a stable sort keeps each learner's own order for events of the same instant."""
    return item[0], item[1]


def goodput_curve(members: list[Stream]) -> tuple[list[float], list[float]]:
    """(seconds, goodput so far) of one group, at each "progress" event of any of its learners."""
    fragments = {i: len(s.of("joined")[0].get("versions") or []) for i, s in enumerate(members) if s.of("joined")}
    latest: dict[int, tuple[int, int]] = {}
    xs, ys = [], []
    for t, i, ev in sorted(((e["t"], i, e) for i, s in enumerate(members) for e in s.of("progress")), key=_when):
        if "merged_steps" not in ev or not fragments.get(i):
            continue
        latest[i] = (int(ev["step"]), int(ev["merged_steps"]))
        possible = sum(fragments[j] * steps for j, (steps, _) in latest.items())
        if possible:
            xs.append(t - members[0].t0)
            ys.append(min(1.0, sum(m for _, m in latest.values()) / possible))
    return xs, ys


def bytes_per_step(s: Stream) -> tuple[list[float], list[float]]:
    xs, ys, prev = [], [], None
    for ev in s.of("joined", "progress"):
        if ev["event"] == "joined" or "bytes" not in ev:  # a new incarnation: its counters start again
            prev = None
            continue
        if prev is not None and ev["step"] > prev["step"] and ev["bytes"] >= prev["bytes"]:
            xs.append(ev["t"] - s.t0)
            ys.append((ev["bytes"] - prev["bytes"]) / (ev["step"] - prev["step"]))
        prev = ev
    return xs, ys


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise ReportError("the report draws with matplotlib, which is not installed: "
                          "pip install 'diloco-node[plots]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _styles(streams: list[Stream]) -> dict[str, tuple[str, str | None]]:
    """stream name -> (colour, legend label or None): a colour per learner in one group, else per group."""
    groups = list(dict.fromkeys(s.group for s in streams))
    out, labelled = {}, set()
    for k, s in enumerate(streams):
        if len(groups) == 1:
            out[s.name] = (f"C{k % 10}", s.name)
        else:
            g = groups.index(s.group)
            out[s.name] = (f"C{g % 10}", None if s.group in labelled else (s.group or "(top)"))
            labelled.add(s.group)
    return out


def make_report(root: Path, out: Path | None = None) -> Report:
    """Write the plots of `root`'s events into `out` (default ROOT/report); say which were skipped and why."""
    if not root.is_dir():
        raise ReportError(f"{root} is not a directory (give the --out directory of join, demo or chaos)")
    streams = load(root)
    if not streams:
        raise ReportError(f"no learner events under {root}: expected the *.jsonl files that `join --out`, "
                          "`demo --out` or `chaos --out` write")
    plt = _pyplot()
    out = out or root / "report"
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ReportError(f"cannot create {out}: {e.strerror or e}") from None
    report, style = Report(), _styles(streams)

    def figure(name: str, why_not: str, draw: Callable[[Any], bool], xlabel: str, ylabel: str,
               title: str) -> None:
        fig, ax = plt.subplots(figsize=(8, 4.5))
        try:
            if not draw(ax):
                report.skipped.append((name, why_not))
                return
            ax.set(xlabel=xlabel, ylabel=ylabel, title=title)
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize="small")
            fig.tight_layout()
            fig.savefig(out / name, dpi=120)
            report.written.append(out / name)
        finally:
            plt.close(fig)

    def losses(x: str) -> Callable[[Any], bool]:
        def at(ev: dict, s: Stream) -> float:
            return ev["t"] - s.t0 if x == "t" else ev.get("tokens")

        def draw(ax: Any) -> bool:
            drawn = False
            for s in streams:
                colour, label = style[s.name]
                train = [(at(e, s), e["loss"]) for e in s.of("progress") if _num(e.get("loss")) and _num(at(e, s))]
                evals = [(at(e, s), e["eval_loss"]) for e in s.of("eval", "done")
                         if _num(e.get("eval_loss")) and _num(at(e, s))]
                if train:
                    ax.plot(*zip(*train, strict=True), "-", color=colour, lw=1, alpha=0.8, label=label)
                if evals:
                    ax.plot(*zip(*evals, strict=True), "o", color=colour, ms=4, mfc="none")
                drawn = drawn or bool(train or evals)
            return drawn
        return draw

    figure("loss_vs_time.png", "no progress or eval event with a loss", losses("t"),
           "wall time since the group's first event (s)", "loss (line: training; circles: held-out eval)",
           "Loss against wall time")
    figure("loss_vs_tokens.png", "no progress or eval event with a loss and tokens", losses("tokens"),
           "tokens this learner trained on", "loss (line: training; circles: held-out eval)",
           "Loss against tokens")

    def draw_goodput(ax: Any) -> bool:
        drawn = False
        for group in dict.fromkeys(s.group for s in streams):
            members = [s for s in streams if s.group == group]
            xs, ys = goodput_curve(members)
            if xs:
                ax.plot(xs, ys, "-", color=style[members[0].name][0], label=group or root.name)
                drawn = True
        ax.set_ylim(0, 1.05)
        return drawn

    figure("goodput.png", "no progress event with merged_steps (a standalone run?)", draw_goodput,
           "wall time since the group's first event (s)", "Σ merged steps ÷ (P · Σ inner steps)",
           "Goodput so far")

    def draw_bytes(ax: Any) -> bool:
        drawn = False
        for s in streams:
            xs, ys = bytes_per_step(s)
            if xs:
                ax.plot(xs, ys, "-", color=style[s.name][0], lw=1, label=style[s.name][1])
                drawn = True
        return drawn

    figure("bytes_per_step.png", "fewer than two progress events with bytes per learner", draw_bytes,
           "wall time since the group's first event (s)", "bytes sent + received per inner step",
           "Traffic per inner step")

    def draw_staleness(ax: Any) -> bool:
        values = staleness(streams)
        if values:
            top = max(3, *values)
            ax.hist(values, bins=[b - 0.5 for b in range(top + 2)], rwidth=0.8, color="C0",
                    label=f"{len(values)} samples, mean {sum(values) / len(values):.2f}")
            ax.set_xticks(range(top + 1))
        return bool(values)

    figure("staleness.png", "needs the version moves of at least 2 learners of one run (join --json or --out)",
           draw_staleness, "versions behind the newest held by any learner (per fragment)",
           "progress events × fragments", "Staleness of the learners' fragments")
    return report


def _num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def describe(report: Report) -> Iterable[str]:
    """The report's lines for the user: every file written, every plot skipped and why."""
    for path in report.written:
        yield f"wrote {path}"
    for name, why in report.skipped:
        yield f"skipped {name}: {why}"

"""The live terminal view of `diloco-node join` and `demo`: what a person watching a learner wants to see.

Only on a terminal. With stdout piped, `--json` or `--log-format json`, `join` prints its plain or JSON lines
(node/train.py `emit`) and the demo its plain lines, exactly as without this module: the chaos harness and
the demo parse them. The view is fed the same events `emit` gets, plus the learner's `/v1/status` object
(docs/status.md) at most once a second; a key the status lacks shows as "—".

Versions are shown as a person reads them: `v16 · term 115576` for the label "115576.16" (protocol §7.3).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, TextIO

from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

if TYPE_CHECKING:
    from .demo import Demo
    from .train import TrainOptions

log = logging.getLogger(__name__)

DASH = "—"
STATUS_EVERY_S = 1.0  # the swarm status is read at most this often
MAX_FRAGMENT_ROWS = 16
MAX_ALERTS = 3
QUIET_EVENTS = {"progress", "merged", "first_step"}  # shown in the table; every other event is printed above it


def wanted(stream: TextIO, *, json_lines: bool, log_format: str) -> bool:
    """A live view belongs on `stream`: a real terminal, and neither `--json` nor `--log-format json` asked
    for machine-readable output."""
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty()) and not json_lines and log_format != "json" and os.environ.get("TERM") != "dumb"


def split_version(label: Any) -> tuple[int, int] | None:
    term, dot, number = str(label).partition(".")
    return (int(term), int(number)) if dot and term.isdigit() and number.isdigit() else None


def version_text(label: Any) -> str:
    """"115576.16" → "v16 · term 115576"; "0.0" → "v0 · initial"; anything else → "—"."""
    tv = split_version(label)
    if tv is None:
        return DASH
    return "v0 · initial" if tv == (0, 0) else f"v{tv[1]} · term {tv[0]}"


def age_text(seconds: float | None) -> str:
    if seconds is None:
        return DASH
    s = max(0.0, seconds)
    if s < 120:
        return f"{s:.0f}s"
    if s < 7200:
        return f"{int(s // 60)}m{int(s % 60):02d}s"
    return f"{s / 3600:.1f}h"


def _num(x: Any, fmt: str = ".3f") -> str:
    return format(x, fmt) if isinstance(x, (int, float)) and not isinstance(x, bool) else DASH


def _pct(x: Any) -> str:
    return f"{100 * x:.1f}%" if isinstance(x, (int, float)) else DASH


class VersionAges:
    """When each fragment last moved to a new version, where the status has no `last_version_age_s`: the
    first time this view saw the label (unknown for the label it found at its start)."""

    def __init__(self) -> None:
        self._seen: dict[int, tuple[str, float | None]] = {}

    def age(self, p: int, label: str, now: float) -> float | None:
        held = self._seen.get(p)
        if held is None:
            self._seen[p] = (label, None)
        elif held[0] != label:
            self._seen[p] = (label, now)
        since = self._seen[p][1]
        return None if since is None else now - since


def fragment_table(status: dict[str, Any], ages: VersionAges | None = None, title: str | None = None) -> Table:
    """One row per fragment: its version, owner, the age of its last outer step and its staleness."""
    now = time.monotonic()
    me = status.get("peer_id")
    t = Table(title=title, title_justify="left", expand=False, pad_edge=False, box=None, header_style="bold dim")
    for name, justify in (("p", "right"), ("version", "left"), ("owner", "left"), ("last outer step", "right"),
                          ("behind", "right")):
        t.add_column(name, justify=justify)
    fragments = status.get("fragments") or []
    for f in fragments[:MAX_FRAGMENT_ROWS]:
        roles = f.get("roles") or []
        owner = f.get("owner", roles[0] if roles else None)
        age = f.get("last_version_age_s")
        if age is None and ages is not None and "last_version_age_s" not in f:
            age = ages.age(f.get("p", 0), str(f.get("version")), now)
        stale = f.get("staleness")
        style = "red" if isinstance(stale, int) and stale > status.get("max_staleness", stale) else \
            "yellow" if isinstance(stale, int) and stale > 0 else None
        t.add_row(str(f.get("p", DASH)), version_text(f.get("version")),
                  Text((owner or DASH)[:8] + (" (this peer)" if owner and owner == me else "")),
                  age_text(age) + (" ago" if age is not None else ""),
                  Text(str(stale) if stale is not None else DASH, style=style or ""))
    if len(fragments) > MAX_FRAGMENT_ROWS:
        t.add_row("", Text(f"… {len(fragments) - MAX_FRAGMENT_ROWS} more", style="dim"), "", "", "")
    return t


def alert_lines(status: dict[str, Any]) -> list[Text]:
    alerts = status.get("alerts") or []
    lines = [Text(f"{a.get('severity', 'warning')}: {a.get('kind', 'alert')}: {a.get('message', '')}",
                  style="red" if a.get("severity") == "error" else "yellow") for a in alerts[:MAX_ALERTS]]
    if len(alerts) > MAX_ALERTS:
        lines.append(Text(f"… {len(alerts) - MAX_ALERTS} more alerts (see /v1/status)", style="dim"))
    return lines


class LearnerView:
    """`join`'s live view: fed `emit`'s events (`feed`) and the swarm status (`poll`), drawn by `render`."""

    def __init__(self, steps: int = 0) -> None:
        self.steps = steps
        self.fields: dict[str, Any] = {}  # the newest value of every field of every event so far
        self.status: dict[str, Any] = {}
        self.ages = VersionAges()
        self.started = time.monotonic()
        self._status_at = 0.0
        self._lock = threading.Lock()  # (rich's refresh thread renders while the training thread feeds)
        self.printer: Callable[[str], None] | None = None  # where events other than progress go, as lines

    def feed(self, event: str, fields: dict[str, Any], line: str) -> None:
        with self._lock:
            self.fields.update(fields)
            if event == "eval" and "eval_loss" in fields:
                self.fields["last_eval_loss"] = fields["eval_loss"]
        if event not in QUIET_EVENTS and self.printer is not None:
            self.printer(line)

    def poll(self, read_status: Callable[[], dict[str, Any]]) -> None:
        """Take the swarm's status, at most once every STATUS_EVERY_S. A display never stops training: a read
        that fails leaves the last status in place."""
        now = time.monotonic()
        if now - self._status_at < STATUS_EVERY_S:
            return
        self._status_at = now
        try:
            status = read_status()
        except Exception as e:  # (see the docstring)
            log.debug("live view: status unavailable: %s", e)
            return
        with self._lock:
            self.status = status

    def render(self) -> RenderableType:
        with self._lock:
            f, st = dict(self.fields), self.status
        steps = [x for x in (st.get("step"), f.get("step")) if isinstance(x, int)]
        step = max(steps) if steps else None  # (the newer of the last status and the last progress event)
        stats = Table.grid(padding=(0, 3))
        figures = {
            "step": DASH if step is None else f"{step}/{self.steps}" if self.steps else str(step),
            "loss": _num(_first(f.get("loss"), st.get("loss"))),
            "eval loss": _num(_first(st.get("eval_loss"), f.get("last_eval_loss"))),
            "tokens/s": _num(tokens_per_s(f, st), ",.0f"),
            "peers": str(len(st["members"])) if "members" in st else str(f.get("peers", DASH)),
            "goodput": _pct(goodput(f, st)),
            "MB in+out": _num(_megabytes(f, st), ".2f"),
            "elapsed": age_text(time.monotonic() - self.started),
        }
        for _ in figures:
            stats.add_column(justify="right")
        stats.add_row(*(Text(k, style="dim") for k in figures))
        stats.add_row(*figures.values())
        parts: list[RenderableType] = [self._head(f, st), stats]
        if st.get("fragments"):
            parts.append(fragment_table(st, self.ages))
        return Group(*parts, *alert_lines(st))

    @staticmethod
    def _head(f: dict[str, Any], st: dict[str, Any]) -> Text:
        head = Text.assemble(("diloco-node join", "bold"), "  ")
        if not st:
            head.append(f"peer {f['peer_id'][:8]}" if "peer_id" in f else "joining the swarm…", style="yellow")
            return head
        head.append(f"run {st.get('run_name', DASH)} ({str(st.get('run_id', ''))[:12]})  "
                    f"peer {str(st.get('peer_id', ''))[:8]}  {st.get('url') or '(client mode)'}  ")
        head.append("synced" if st.get("synced") else "syncing", style="green" if st.get("synced") else "yellow")
        if st.get("healthy") is False:
            head.append(f"  FAILED: {st.get('error')}", style="bold red")
        return head


def _first(*values: Any) -> Any:
    return next((v for v in values if v is not None), None)


def tokens_per_s(f: dict[str, Any], st: dict[str, Any]) -> float | None:
    """The status's tokens/s, else steps/s × tokens per step from the progress events."""
    if st.get("tokens_per_s"):
        return st["tokens_per_s"]
    steps, tokens, rate = f.get("step"), f.get("tokens"), f.get("steps_per_s")
    return rate * tokens / steps if steps and tokens and rate else None


def goodput(f: dict[str, Any], st: dict[str, Any], fragments: int = 0) -> float | None:
    """The status's goodput, else the demo's Σ merged_steps / (P · steps) from the progress events (P: the
    status's fragments, or `fragments`)."""
    if st.get("goodput") is not None:
        return st["goodput"]
    fragments, step, merged = len(st.get("fragments") or []) or fragments, f.get("step"), f.get("merged_steps")
    return min(1.0, merged / (fragments * step)) if fragments and step and merged is not None else None


def _megabytes(f: dict[str, Any], st: dict[str, Any]) -> float | None:
    total = st.get("bytes_total")
    b = sum(total.values()) if total else f.get("bytes")
    return b / 1e6 if isinstance(b, (int, float)) else None


@contextlib.contextmanager
def live(get_renderable: Callable[[], RenderableType], console: Console | None = None,
         refresh_per_second: float = 4) -> Iterator[Live]:
    """A rich Live on stdout (or `console`) redrawing `get_renderable()`; the last frame stays on screen.

    While it runs, log records that go to a terminal's stderr are printed above it, not through it."""
    console = console or Console()
    to_terminal = console.is_terminal and bool(getattr(sys.stderr, "isatty", lambda: False)())
    with Live(get_renderable=get_renderable, console=console, refresh_per_second=refresh_per_second,
              transient=False, redirect_stderr=to_terminal) as view:
        moved = _route_logs_to(sys.stderr) if to_terminal else []
        try:
            yield view
        finally:
            for handler, stream in moved:
                handler.setStream(stream)


def _route_logs_to(proxy: Any) -> list[tuple[logging.StreamHandler, Any]]:
    """Point the root logger's handlers on the terminal's stderr at `proxy` (rich's stderr proxy, which prints
    above the live view); returns what to restore."""
    original = getattr(proxy, "rich_proxied_file", None)
    moved = []
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.StreamHandler) and original is not None and handler.stream is original:
            moved.append((handler, handler.stream))
            handler.setStream(proxy)
    return moved


@contextlib.contextmanager
def learner_session(view: LearnerView, console: Console | None = None) -> Iterator[LearnerView]:
    """`join` on a terminal: `view` drawn live for the whole run, events printed above it."""
    with live(view.render, console) as lv:
        view.printer = lambda line: lv.console.print(Text(line), soft_wrap=True)  # (the terminal wraps)
        try:
            yield view
        finally:
            view.printer = None


def demo_table(demo: Demo, poller: StatusPoller | None) -> RenderableType:
    """The demo's live view: one row per learner process, then the fragments as one learner sees them (from
    `poller`, the learners' statuses; without one, only what their progress lines said)."""
    o = demo.opts
    latest: Callable[[int], dict[str, Any]] = poller.latest if poller is not None else lambda _: {}
    t = Table(title=f"diloco-node demo: {o.peers} learners × {o.steps} steps, {demo.elapsed():.0f}s")
    for name, justify in (("learner", "left"), ("peer id", "left"), ("step", "right"), ("loss", "right"),
                          ("tokens/s", "right"), ("goodput", "right"), ("behind", "right"), ("peers", "right"),
                          ("MB sent+recv", "right"), ("state", "left")):
        t.add_column(name, justify=justify)
    seen: dict[str, Any] = {}
    for v in demo.views:
        st = latest(v.index)
        seen = seen or st
        f = {"step": v.step, "tokens": v.tokens, "steps_per_s": v.steps_per_s, "merged_steps": v.merged_steps}
        stale = [x["staleness"] for x in st.get("fragments", []) if isinstance(x.get("staleness"), int)]
        style = "green" if v.state.startswith("done") else "red" if v.state.startswith("failed") else ""
        t.add_row(str(v.index), v.peer_id[:10], f"{v.step}/{o.steps}", _num(v.loss), _num(tokens_per_s(f, st), ",.0f"),
                  _pct(goodput(f, st, o.fragments)), str(sum(stale)) if stale else DASH, str(v.peers_seen),
                  f"{v.bytes / 1e6:.2f}", Text(v.state, style=style))
    parts: list[RenderableType] = [t]
    if seen.get("fragments"):
        who = next(v.index for v in demo.views if latest(v.index) is seen)
        parts.append(fragment_table(seen, demo.version_ages, title=f"fragments, as learner {who} sees them"))
    parts.append(Text(f"logs in {demo.workdir}   (Ctrl-C stops the learners)", style="dim"))
    return Group(*parts)


class StatusPoller:
    """Reads `GET URL/v1/status` of some peers every `every_s` in one thread: the demo's view of its
    learners (their processes print only progress lines). A peer that does not answer keeps its last status."""

    def __init__(self, every_s: float = 2.0, timeout_s: float = 1.5) -> None:
        self.every_s, self.timeout_s = every_s, timeout_s
        self._urls: dict[int, str] = {}
        self._latest: dict[int, dict[str, Any]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="status-poller")

    def watch(self, key: int, url: str) -> None:
        if url:
            self._urls[key] = url.rstrip("/")

    def latest(self, key: int) -> dict[str, Any]:
        return self._latest.get(key, {})

    def start(self) -> StatusPoller:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=self.timeout_s + 1)

    def _run(self) -> None:
        while not self._stop.is_set():
            for key, url in list(self._urls.items()):
                try:
                    with urllib.request.urlopen(url + "/v1/status", timeout=self.timeout_s) as r:
                        self._latest[key] = json.loads(r.read())
                except (OSError, ValueError) as e:
                    log.debug("status of %s: %s", url, e)
            self._stop.wait(self.every_s)


@contextlib.contextmanager
def join_view(opts: TrainOptions, log_format: str, stream: TextIO | None = None) -> Iterator[None]:
    """`join`'s output for the duration of the block: on a terminal (and on torchrun's rank 0), a live view
    that `emit` feeds (`opts.view`); anywhere else nothing changes and `emit` prints its lines."""
    stream = stream or sys.stdout
    if not wanted(stream, json_lines=opts.json, log_format=log_format) or os.environ.get("RANK", "0") != "0":
        yield
        return
    opts.view = LearnerView(opts.steps)
    try:
        with learner_session(opts.view, Console(file=stream)):
            yield
    finally:
        opts.view = None

"""`diloco-node demo`: a real swarm of N learner processes on this machine, with a live view and a summary.

The demo writes a fresh creator key and a signed run spec into a working directory, starts the first learner
(`diloco-node join` without `--peers`, so it opens a new swarm), reads its URL from its "joined" event, then
starts the other N − 1 learners with `--peers URL`. Each learner is an ordinary `join` process that trains for
`--steps` inner steps and prints JSON lines (see `node/train.py`); the demo reads every child's stdout in a
reader thread and shows the latest figures (a `rich` live table on a terminal, plain lines otherwise).

It ends when every learner has printed its "done" event, on Ctrl-C / SIGTERM (each learner gets SIGINT, which
makes it stop, evaluate and print "done"; whatever is still running 5 s later is killed), on `--timeout`, or as
soon as a learner exits without "done" (an error: its last output lines are shown). Every child is killed and
reaped in a `finally` block, so none is left behind.

Summary figures (also the keys of the JSON object printed last with `--json`):

    peers        N
    final_loss   mean over learners of their final training loss (mean of their last 20 inner steps)
    eval_loss    mean over learners of their held-out evaluation loss at the end
    outer_steps  sum over learners of the outer steps their syncer shard applied (each owner counts its own)
    goodput      Σ merged_steps / (P · Σ steps), capped at 1: the fraction of inner steps whose progress
                 reached a published global version. `merged_steps` counts, per fragment, the inner steps behind
                 this learner's deltas that an owner merged into a version (summed over the P fragments);
                 `steps` is the learner's inner steps. Progress still local when the run ends does not count.
                 (Steps only: `diloco-node chaos` adds the wall-time accounting of docs/architecture.md §10.)
    bytes_sent   sum over learners of the bytes they sent (HTTP requests and responses, all routes)
    wall_s       wall time of the whole demo, from start-up to the last learner's exit
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from .live import StatusPoller, VersionAges, version_text

log = logging.getLogger(__name__)

SUMMARY_KEYS = ("peers", "final_loss", "eval_loss", "outer_steps", "goodput", "bytes_sent", "wall_s")
JOIN_WAIT_S = 120.0  # how long the first learner may take to print "joined"
EXIT_WAIT_S = 15.0  # how long a learner may take to exit after "done"
STOP_GRACE_S = 5.0  # after SIGINT, before SIGKILL
PLAIN_EVERY_S = 5.0  # plain progress lines: at most one block this often


class DemoError(Exception):
    """The demo could not finish: `str(e)` is one line; `details` are the lines that show why."""

    def __init__(self, message: str, details: list[str] | None = None) -> None:
        super().__init__(message)
        self.details = details or []


@dataclass
class DemoOptions:
    peers: int = 3
    steps: int = 600
    task: str = "markov"
    inner_steps: int = 50
    fragments: int = 4
    codec: str = "int8"
    workdir: Path | None = None  # None: a fresh temporary directory
    json: bool = False
    progress_every: int = 10
    timeout_s: float = 0.0  # 0: no limit
    live: bool | None = None  # None: a rich live table when stdout is a terminal and not --json


@dataclass
class PeerView:
    """What the demo knows about one learner process, from its JSON lines."""

    index: int
    key_file: Path
    log_file: Path
    peer_id: str = ""
    proc: subprocess.Popen | None = None
    url: str = ""
    state: str = "starting"
    step: int = 0
    loss: float | None = None
    steps_per_s: float = 0.0
    versions: int = 0
    peers_seen: int = 0
    tokens: int = 0
    merged_steps: int = 0
    bytes: int = 0
    done: dict[str, Any] | None = None
    returncode: int | None = None
    eof: bool = False
    tail: deque = field(default_factory=lambda: deque(maxlen=20))  # non-JSON stdout lines

    def last_output(self, n: int = 15) -> list[str]:
        """The last lines this learner wrote: its stderr log, then stdout lines that were not JSON."""
        lines: list[str] = []
        with contextlib.suppress(OSError):
            lines = self.log_file.read_text(errors="replace").splitlines()[-n:]
        return lines + list(self.tail)[-n:]


def _version_number(label: Any) -> int:
    """The version of a label "term.version" (as the learners print them), 0 if unreadable."""
    number = str(label).rpartition(".")[2]
    return int(number) if number.isdigit() else 0


def _versions_text(labels: list[str]) -> str:
    """The fragments' versions as read by a person: "p0 v16 · term 115576, p1 …" ("-" for none)."""
    return ", ".join(f"p{p} {version_text(label)}" for p, label in enumerate(labels)) or "-"


def _tail_of(view: PeerView) -> list[str]:
    lines = view.last_output()
    if not lines:
        return [f"  learner {view.index} wrote nothing to stderr ({view.log_file})"]
    return [f"  learner {view.index} | {line}" for line in lines]


class Demo:
    def __init__(self, opts: DemoOptions, out: TextIO | None = None) -> None:
        if opts.peers < 1:
            raise DemoError("--peers must be at least 1")
        if opts.steps < 1:
            raise DemoError("--steps must be at least 1 (the demo ends when every learner has trained them)")
        self.opts = opts
        self.out = out or sys.stdout
        self.workdir = Path(opts.workdir).resolve() if opts.workdir else Path(tempfile.mkdtemp(prefix="diloco-demo-"))
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.events: queue.Queue[tuple[int, str | None]] = queue.Queue()
        self.views: list[PeerView] = []
        self.threads: list[threading.Thread] = []
        self.t0 = time.monotonic()
        self.best_loss: float | None = None
        self.spec_path = self.workdir / "run.spec"
        self.run_label = ""
        self._last_plain = 0.0
        self.live_mode = opts.live if opts.live is not None else (self.out.isatty() and not opts.json)
        self.poller: StatusPoller | None = None  # live mode: each learner's /v1/status, for the table
        self.version_ages = VersionAges()

    # -- set-up ---------------------------------------------------------------------------------------------

    def prepare(self) -> None:
        """A creator key, a signed run spec and one key per learner, all in the working directory."""
        from diloco.protocol.identity import Identity

        from .train import new_run, task_of

        o = self.opts
        creator = Identity.generate()
        creator.save(self.workdir / "creator.key", overwrite=True)
        from diloco.protocol.errors import ProtocolError

        try:
            genesis = new_run(creator, f"demo-{time.strftime('%Y%m%d-%H%M%S')}", task=o.task,
                              fragments=o.fragments, inner_steps=o.inner_steps, codec=o.codec)
        except (ProtocolError, ValueError, OSError) as e:
            raise DemoError(f"cannot create the demo's run: {getattr(e, 'reason', e)}") from None
        genesis.save(self.spec_path)
        spec = genesis.spec
        with contextlib.suppress(Exception):
            self.best_loss = float(task_of(spec).data.entropy_rate_nats())
        self.run_label = (f"run {spec.name} ({spec.run_id.hex()[:12]}): task {spec.task}, P={spec.fragments} "
                          f"fragments, H={spec.inner_steps} inner steps, quorum K={spec.quorum}, codec {spec.codec}")
        for i in range(o.peers):
            ident = Identity.generate()
            key = ident.save(self.workdir / f"learner-{i}.key", overwrite=True)
            self.views.append(PeerView(i, key, self.workdir / f"learner-{i}.log", peer_id=ident.peer_id))

    def command(self, view: PeerView, bootstrap: str | None) -> list[str]:
        o = self.opts
        cmd = [sys.executable, "-m", "diloco.node.cli", "join", "--run", str(self.spec_path),
               "--listen", "127.0.0.1:0", "--steps", str(o.steps), "--json", "--fast-membership",
               "--progress-every", str(o.progress_every), "--key", str(view.key_file),
               "--out", str(self.workdir / f"learner-{view.index}")]  # its events.jsonl: `diloco-node report`
        if bootstrap:
            cmd[cmd.index("--steps"):cmd.index("--steps")] = ["--peers", bootstrap]
        return cmd

    def spawn(self, view: PeerView, bootstrap: str | None) -> None:
        from .config import child_env

        env = dict(child_env(os.environ), OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", NUMBA_NUM_THREADS="1",
                   PYTHONUNBUFFERED="1")
        with open(view.log_file, "ab") as err:
            # own session: a terminal's Ctrl-C reaches only the demo, which stops the learners itself
            view.proc = subprocess.Popen(self.command(view, bootstrap), stdin=subprocess.DEVNULL,
                                         stdout=subprocess.PIPE, stderr=err, text=True, bufsize=1, env=env,
                                         start_new_session=True, cwd=self.workdir)
        view.state = "joining"
        t = threading.Thread(target=self._read, args=(view.index, view.proc.stdout), daemon=True,
                             name=f"demo-reader-{view.index}")
        t.start()
        self.threads.append(t)

    def _read(self, index: int, stream: TextIO) -> None:
        try:
            for line in stream:
                self.events.put((index, line))
        except (OSError, ValueError):
            pass
        finally:
            self.events.put((index, None))

    # -- events ---------------------------------------------------------------------------------------------

    def pump(self, timeout: float) -> None:
        """Apply every queued line, waiting up to `timeout` for the first one."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                index, line = self.events.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                return
            self.apply(self.views[index], line)
            if self.events.empty():
                return

    def apply(self, view: PeerView, line: str | None) -> None:
        if line is None:
            view.eof = True
            if view.proc is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    view.returncode = view.proc.wait(timeout=EXIT_WAIT_S)
            if view.done is None:
                view.state = f"failed (exit {view.returncode})"
            else:
                view.state = "done" if view.returncode == 0 else f"done (exit {view.returncode})"
            return
        try:
            ev = json.loads(line)
            kind = ev["event"]
        except (ValueError, TypeError, KeyError):
            view.tail.append(line.rstrip("\n"))
            return
        if kind == "joined":
            view.url, view.peer_id, view.step = ev.get("url", ""), ev.get("peer_id", view.peer_id), ev.get("step", 0)
            view.state = "training"
            if self.poller is not None:
                self.poller.watch(view.index, view.url)
        elif kind == "progress":
            view.step, view.loss = ev.get("step", view.step), ev.get("loss", view.loss)
            view.steps_per_s, view.versions = ev.get("steps_per_s", 0.0), ev.get("versions", view.versions)
            view.peers_seen, view.bytes = ev.get("peers", view.peers_seen), ev.get("bytes", view.bytes)
            view.tokens, view.merged_steps = ev.get("tokens", view.tokens), ev.get("merged_steps", view.merged_steps)
        elif kind == "done":
            view.done = ev
            view.step, view.loss = ev.get("steps", view.step), ev.get("final_loss", view.loss)
            view.versions = sum(_version_number(v) for v in ev.get("versions", [])) or view.versions
            b = ev.get("bytes") or {}
            view.bytes = int(b.get("bytes_in", 0)) + int(b.get("bytes_out", 0))
            view.state = "finishing"

    def failed(self) -> PeerView | None:
        return next((v for v in self.views if v.eof and v.done is None), None)

    # -- display --------------------------------------------------------------------------------------------

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def table(self):
        from .live import demo_table

        return demo_table(self, self.poller)

    def plain(self, force: bool = False) -> None:
        now = self.elapsed()
        if not force and now - self._last_plain < PLAIN_EVERY_S:
            return
        self._last_plain = now
        for v in self.views:
            loss = "-" if v.loss is None else f"{v.loss:.3f}"
            self.out.write(f"[{now:6.1f}s] learner {v.index} {v.peer_id[:10]} step {v.step}/{self.opts.steps} "
                           f"loss {loss} {v.steps_per_s:.1f} steps/s versions {v.versions} peers {v.peers_seen} "
                           f"{v.bytes / 1e6:.2f} MB {v.state}\n")
        self.out.flush()

    # -- the run --------------------------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        """Start the learners, follow them to the end; returns the summary. Raises DemoError on failure,
        KeyboardInterrupt (after stopping the learners) on Ctrl-C or SIGTERM."""
        restore = _signals_raise_interrupt()
        try:
            self.out.write(f"workdir: {self.workdir}\n")
            self.out.flush()
            self.prepare()
            self.out.write(f"{self.run_label}\nstarting {self.opts.peers} learners × {self.opts.steps} steps\n")
            self.out.flush()
            if self.live_mode:
                from rich.console import Console

                from .live import live

                self.poller = StatusPoller().start()
                with live(self.table, Console(file=self.out)) as lv:
                    self._follow(lambda: lv.refresh())
            else:
                self._follow(lambda: self.plain())
                self.plain(force=True)
            return self.summary()
        except KeyboardInterrupt:
            self.stop(graceful=True)
            raise
        finally:
            if self.poller is not None:
                self.poller.stop()
            self.stop(graceful=False)
            restore()

    def _follow(self, refresh) -> None:
        first = self.views[0]
        self.spawn(first, None)
        deadline = time.monotonic() + JOIN_WAIT_S
        while not first.url:
            self.pump(0.25)
            refresh()
            if first.eof:
                raise DemoError(f"learner 0 exited (code {first.returncode}) before joining; see {first.log_file}",
                                _tail_of(first))
            if time.monotonic() > deadline:
                raise DemoError(f"learner 0 printed no 'joined' event within {JOIN_WAIT_S:.0f}s; see {first.log_file}",
                                _tail_of(first))
        for v in self.views[1:]:
            self.spawn(v, first.url)
        while not all(v.eof for v in self.views):
            self.pump(0.25)
            refresh()
            bad = self.failed()
            if bad is not None:
                raise DemoError(f"learner {bad.index} ({bad.peer_id[:10]}) exited with code {bad.returncode} "
                                f"before finishing; see {bad.log_file}", _tail_of(bad))
            if all(v.done is not None for v in self.views):
                self._await_exits(refresh)
                break
            if self.opts.timeout_s and self.elapsed() > self.opts.timeout_s:
                behind = [f"{v.index} (step {v.step}, {v.state})" for v in self.views if v.done is None]
                raise DemoError(f"the demo did not finish within --timeout {self.opts.timeout_s:.0f}s; "
                                f"learners still running: {', '.join(behind)}",
                                [line for v in self.views if v.done is None for line in _tail_of(v)])
        self.wall_s = self.elapsed()

    def _await_exits(self, refresh) -> None:
        """Every learner printed "done": give them EXIT_WAIT_S to close their swarm and exit."""
        deadline = time.monotonic() + EXIT_WAIT_S
        while not all(v.eof for v in self.views) and time.monotonic() < deadline:
            self.pump(0.25)
            refresh()
        for v in self.views:
            if not v.eof:
                v.state = "done (killed on exit)"
        refresh()

    def stop(self, graceful: bool) -> None:
        """Stop every learner still running: SIGINT first if `graceful` (each prints "done"), SIGKILL after
        STOP_GRACE_S; then reap them all. Safe to call twice."""
        running = [v for v in self.views if v.proc is not None and v.proc.poll() is None]
        if graceful and running:
            for v in running:
                with contextlib.suppress(ProcessLookupError):
                    v.proc.send_signal(signal.SIGINT)
                    v.state = "stopping"
            deadline = time.monotonic() + STOP_GRACE_S
            with contextlib.suppress(KeyboardInterrupt):  # a second Ctrl-C kills at once
                while time.monotonic() < deadline and any(v.proc.poll() is None for v in running):
                    self.pump(0.1)
        for v in self.views:
            if v.proc is None:
                continue
            if v.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    v.proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                v.returncode = v.proc.wait(timeout=10)
            with contextlib.suppress(OSError):
                v.proc.stdout.close()
        for t in self.threads:
            t.join(timeout=2)
        with contextlib.suppress(queue.Empty):  # lines that arrived while stopping (e.g. "done" after SIGINT)
            while True:
                index, line = self.events.get_nowait()
                if line is not None:
                    self.apply(self.views[index], line)

    # -- summary --------------------------------------------------------------------------------------------

    def summary(self) -> dict[str, Any]:
        """The JSON summary (keys SUMMARY_KEYS) over the learners' "done" events; figures of learners without
        one (interrupted) are left out, and a mean over none is null."""
        done = [v.done for v in self.views if v.done is not None]
        steps = sum(int(d.get("steps", 0)) for d in done)
        merged = sum(int(d.get("merged_steps", 0)) for d in done)

        def mean(key: str) -> float | None:
            vals = [float(d[key]) for d in done if isinstance(d.get(key), (int, float))]
            return sum(vals) / len(vals) if vals else None

        return {
            "peers": self.opts.peers,
            "final_loss": mean("final_loss"),
            "eval_loss": mean("eval_loss"),
            "outer_steps": sum(int(d.get("outer_steps", 0)) for d in done),
            "goodput": min(1.0, merged / (self.opts.fragments * steps)) if steps else None,
            "bytes_sent": sum(int((d.get("bytes") or {}).get("bytes_out", 0)) for d in done),
            "wall_s": getattr(self, "wall_s", None) or self.elapsed(),
        }

    def report(self, summary: dict[str, Any], interrupted: bool = False) -> list[str]:
        """The human-readable summary."""
        def f(x: float | None, fmt: str = ".3f") -> str:
            return "n/a" if x is None else format(x, fmt)

        lines = [f"demo {'interrupted' if interrupted else 'finished'}: {summary['peers']} learners in {summary['wall_s']:.1f}s (workdir {self.workdir})"]
        for v in self.views:
            d = v.done or {}
            b = d.get("bytes") or {}
            lines.append(f"  learner {v.index} {v.peer_id[:10]}: {d.get('steps', v.step)} steps, "
                         f"final loss {f(d.get('final_loss'))}, eval loss {f(d.get('eval_loss'))}, "
                         f"outer steps {d.get('outer_steps', '-')}, versions {_versions_text(d.get('versions', []))}, "
                         f"sent {b.get('bytes_out', 0) / 1e6:.2f} MB, received {b.get('bytes_in', 0) / 1e6:.2f} MB"
                         + ("" if v.done else f" [{v.state}]"))
        best = f" (best possible, the source's entropy rate: {self.best_loss:.3f}; uniform guess: " \
               f"{math.log(64):.3f})" if self.best_loss is not None and self.opts.task == "markov" else ""
        lines += [
            f"final training loss (mean over learners): {f(summary['final_loss'])}",
            f"held-out eval loss (mean over learners):  {f(summary['eval_loss'])}{best}",
            f"outer steps (summed over owners):         {summary['outer_steps']}",
            f"goodput:                                  {f(summary['goodput'])}  = Σ merged_steps / "
            f"(P · Σ inner steps): the share of inner steps whose progress reached a published version",
            f"bytes sent (all learners):                {summary['bytes_sent'] / 1e6:.2f} MB",
        ]
        return lines


def _signals_raise_interrupt():
    """SIGTERM and SIGHUP stop the demo like Ctrl-C (so the learners are stopped too); returns an undo."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None

    def handler(signum, frame):
        raise KeyboardInterrupt

    old = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGHUP)}
    return lambda: [signal.signal(s, h) for s, h in old.items()]


def run_demo(opts: DemoOptions, out: TextIO | None = None) -> tuple[Demo, dict[str, Any], bool]:
    """Run the demo; returns (demo, summary, interrupted). Raises DemoError when a learner fails."""
    demo = Demo(opts, out)
    try:
        summary = demo.run()
        return demo, summary, False
    except KeyboardInterrupt:
        summary = demo.summary()
        return demo, summary, True

"""Multi-region emulation: one learner per "region", each in its own network namespace, behind a slow, far link.

    sudo .venv/bin/python examples/multi_region/run.py [--seconds 90] [--rate-mbit 20] [--latency-ms 40,80,120]
                                                       [--regions 3] [--inner-steps 30] [--fragments 4] [--codec int8]
                                                       [--json]

Builds a hub namespace and one namespace per region (`dnmr-<pid>-hub`, `dnmr-<pid>-r0` ...), joins each region to
the hub with a veth pair (10.213.<i>.2 in the region, 10.213.<i>.1 in the hub), limits both directions of every
region link with `tc tbf`, and starts a userspace latency relay (relay.py) in the hub: this kernel has no netem.
The hub does not forward packets, so the only way from one region to another is through the relay, which adds
the configured one-way latency per direction. Then it writes a run spec (`diloco-node init-run`), starts one
`diloco-node join --json` learner per region inside its namespace, announced at its relay address, trains for
--seconds once all have joined, stops them (SIGINT: each prints its "done" summary) and reports:

  goodput         Σ merged_steps / (P · Σ steps), capped at 1: the share of inner steps whose progress reached a
                  published version (P: fragments of the run spec), as `diloco-node demo` defines it
  bytes_per_step  bytes sent + received per inner step per learner (mean over learners of their own counters,
                  less what the status polling below cost them), as benchmarks/swarm.py defines it
  staleness       every 2 s each learner's /v1/status is read (from the hub, not through the relay); for each
                  fragment, how many versions a learner's copy trails the newest version any learner holds then;
                  mean and max over all samples taken while every learner was training

With --json the last line is one JSON object: goodput, bytes_per_step, staleness_mean, staleness_max, regions,
rate_mbit, latency_ms, seconds, codec. Needs root and iproute2 (`ip`, `tc`); says so in one line when either is missing.
Everything it starts is killed and reaped, and every namespace and veth it created (only those) is deleted, in a
`finally` block, also on Ctrl-C and SIGTERM.

This module runs the learners and reports on them; netns.py builds and removes the network they run on.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import queue
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

from netns import Network, SetupError, hub_address, missing_requirements, region_address, sh

HERE = Path(__file__).resolve().parent
PORT = 7000  # every learner listens on its region address, every relay route on its hub address, this port
JOIN_WAIT_S = 150.0
RELAY_WAIT_S = 20.0
STOP_WAIT_S = 25.0  # after SIGINT: the learners evaluate, print "done" and leave the swarm
POLL_EVERY_S = 2.0
REPORT_EVERY_S = 10.0


# -- arguments ------------------------------------------------------------------------------------------------


def parse_latency(text: str, regions: int) -> list[list[float]]:
    """One-way latencies in ms → an N×N matrix (diagonal 0). Accepts one number (every pair), N(N−1)/2 numbers
    (the upper triangle, row by row: for 3 regions 0↔1, 0↔2, 1↔2; symmetric) or N rows separated by ';'
    (row i, column j: the delay of bytes going from region i to region j)."""
    try:
        if ";" in text:
            rows = [[float(x) for x in row.split(",")] for row in text.strip().strip(";").split(";")]
            if len(rows) != regions or any(len(r) != regions for r in rows):
                raise SetupError(f"--latency-ms matrix must be {regions} rows of {regions} numbers")
            m = [[0.0 if i == j else rows[i][j] for j in range(regions)] for i in range(regions)]
        else:
            vals = [float(x) for x in text.split(",")]
            pairs = [(i, j) for i in range(regions) for j in range(i + 1, regions)]
            if len(vals) == 1:
                vals = vals * len(pairs)
            if len(vals) != len(pairs):
                raise SetupError(f"--latency-ms takes 1 number, {len(pairs)} (one per pair of regions: "
                                 f"{', '.join(f'{i}-{j}' for i, j in pairs)}) or a {regions}x{regions} matrix "
                                 "with rows separated by ';'")
            m = [[0.0] * regions for _ in range(regions)]
            for (i, j), v in zip(pairs, vals, strict=True):
                m[i][j] = m[j][i] = v
    except ValueError:
        raise SetupError(f"--latency-ms {text!r}: not a list of numbers (ms)") from None
    if any(v < 0 or v > 10_000 for row in m for v in row):
        raise SetupError("--latency-ms values must be between 0 and 10000 ms")
    return m


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line, checked; a SetupError names the first bad flag. Adds `latency` (the N×N matrix)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=90.0, help="training time once every learner has joined")
    ap.add_argument("--rate-mbit", type=float, default=20.0, help="tbf rate of each region's link, each direction")
    ap.add_argument("--latency-ms", default="40,80,120",
                    help="one-way latency between regions: one number, one per pair (0-1,0-2,1-2 for 3 regions) "
                    "or a matrix 'a,b,c;d,e,f;g,h,i' (row: from, column: to)")
    ap.add_argument("--regions", type=int, default=3, help="regions (one learner each), 2 to 8")
    ap.add_argument("--inner-steps", type=int, default=30, help="H of the run spec")
    ap.add_argument("--fragments", type=int, default=4, help="P of the run spec")
    ap.add_argument("--codec", default="int8", help="codec of the run spec (topk: sparse, for thin links)")
    ap.add_argument("--prefix", default=None, help="namespace name prefix (default dnmr-<pid>)")
    ap.add_argument("--workdir", type=Path, default=None, help="run spec, keys and logs (default: a fresh temp dir)")
    ap.add_argument("--json", action="store_true", help="a JSON summary object as the last line")
    args = ap.parse_args(argv)
    if not 2 <= args.regions <= 8:
        raise SetupError("--regions must be between 2 and 8")
    if args.seconds <= 0 or args.rate_mbit <= 0:
        raise SetupError("--seconds and --rate-mbit must be positive")
    if args.inner_steps < 1 or args.fragments < 1:
        raise SetupError("--inner-steps and --fragments must be at least 1")
    args.prefix = args.prefix or f"dnmr-{os.getpid()}"
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,40}", args.prefix):
        raise SetupError("--prefix: letters, digits, '.', '_' and '-' only, at most 41 characters")
    args.latency = parse_latency(args.latency_ms, args.regions)
    return args


# -- processes ------------------------------------------------------------------------------------------------


@dataclass
class Child:
    name: str
    proc: subprocess.Popen
    log: Path | None = None
    lines: list[str] = field(default_factory=list)  # non-JSON stdout lines (kept for error messages)
    eof: bool = False


@dataclass
class LearnerView:
    index: int
    child: Child | None = None
    joined_at: float | None = None
    url: str = ""
    step: int = 0
    loss: float | None = None
    versions: int = 0
    peers: int = 0
    bytes: int = 0
    done: dict[str, Any] | None = None


class Emulation:
    """One run: the learners (and the relay and poller) on a Network, their events, and the summary."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.n = args.regions
        self.net = Network(args.prefix, args.regions, args.rate_mbit)
        self.children: list[Child] = []
        self.events: queue.Queue[tuple[Child, str | None]] = queue.Queue()
        self.learners = [LearnerView(i) for i in range(self.n)]
        self.rounds: list[tuple[float, list[dict]]] = []  # status polls: (t, per learner)
        self.relay_stats: dict | None = None
        self.train_start: float | None = None
        self.train_end: float | None = None
        if args.workdir:
            args.workdir.mkdir(parents=True, exist_ok=True)
        self.workdir = args.workdir or Path(tempfile.mkdtemp(prefix=f"{args.prefix}-"))
        self.out = sys.stdout

    def say(self, text: str) -> None:
        self.out.write(text + "\n")
        self.out.flush()

    # children ---------------------------------------------------------------------------------------------

    def spawn(self, name: str, ns: str, cmd: list[str], log: Path | None = None) -> Child:
        env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", NUMBA_NUM_THREADS="1",
                   PYTHONUNBUFFERED="1")
        err = open(log, "ab") if log else subprocess.DEVNULL
        try:
            # own session: Ctrl-C reaches only this script, which stops the children itself
            proc = subprocess.Popen(self.net.exec_in(ns, cmd), stdin=subprocess.DEVNULL,
                                    stdout=subprocess.PIPE, stderr=err, text=True, bufsize=1, env=env,
                                    start_new_session=True, cwd=self.workdir)
        finally:
            if log:
                err.close()
        child = Child(name, proc, log)
        self.children.append(child)
        threading.Thread(target=self._read, args=(child,), daemon=True, name=f"read-{name}").start()
        return child

    def _read(self, child: Child) -> None:
        try:
            for line in child.proc.stdout:
                self.events.put((child, line))
        except (OSError, ValueError):
            pass
        finally:
            self.events.put((child, None))

    def signal(self, child: Child, sig: int) -> None:
        if child.proc.poll() is None:  # not reaped: its process group is still ours
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(child.proc.pid, sig)

    def kill_all(self) -> None:
        for child in reversed(self.children):
            self.signal(child, signal.SIGKILL)
        for child in self.children:
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.proc.wait(timeout=10)
            with contextlib.suppress(OSError, ValueError):
                child.proc.stdout.close()

    def tail(self, child: Child, n: int = 8) -> str:
        lines: list[str] = []
        if child.log:
            with contextlib.suppress(OSError):
                lines = child.log.read_text(errors="replace").splitlines()
        lines += child.lines
        return " | ".join(line.strip() for line in lines[-n:] if line.strip()) or "(no output)"

    # events -----------------------------------------------------------------------------------------------

    def pump(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                child, line = self.events.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                return
            self.apply(child, line)
            if self.events.empty() and time.monotonic() >= deadline:
                return

    def apply(self, child: Child, line: str | None) -> None:
        if line is None:
            child.eof = True
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.proc.wait(timeout=5)
            return
        try:
            ev = json.loads(line)
            kind = ev["event"]
        except (ValueError, TypeError, KeyError):
            child.lines = (child.lines + [line.rstrip("\n")])[-20:]
            return
        if child.name == "relay":
            if kind == "stats":
                self.relay_stats = ev
            elif kind == "ready":
                child.lines.append("ready")
            return
        if child.name == "poll":
            if kind == "round":
                self.rounds.append((time.monotonic(), ev["learners"]))
            return
        view = self.learners[int(child.name.rpartition("-")[2])]
        if kind == "joined":
            view.joined_at, view.url = time.monotonic(), ev.get("url", "")
        elif kind == "progress":
            view.step, view.loss = ev.get("step", view.step), ev.get("loss", view.loss)
            view.versions, view.peers = ev.get("versions", view.versions), ev.get("peers", view.peers)
            view.bytes = ev.get("bytes", view.bytes)
        elif kind == "done":
            view.done = ev
            view.step = ev.get("steps", view.step)

    def wait_for(self, what: str, cond: Callable[[], bool], timeout: float, watch: list[Child]) -> None:
        deadline = time.monotonic() + timeout
        while not cond():
            self.pump(0.25)
            for child in watch:
                if child.eof or child.proc.poll() is not None:
                    raise SetupError(f"{child.name} exited (code {child.proc.poll()}) while waiting for {what}: "
                                     f"{self.tail(child)}" + (f" (log: {child.log})" if child.log else ""))
            if time.monotonic() > deadline:
                raise SetupError(f"no {what} within {timeout:.0f}s" + "".join(
                    f"; {c.name}: {self.tail(c, 3)}" for c in watch))

    # the run ----------------------------------------------------------------------------------------------

    def learner_cmd(self, i: int, spec: Path) -> list[str]:
        cmd = [sys.executable, "-m", "diloco.node.cli", "join", "--run", str(spec),
               "--listen", f"{region_address(i)}:{PORT}", "--announce", f"http://{hub_address(i)}:{PORT}",
               "--region", f"r{i}", "--key", str(self.workdir / f"learner-{i}.pem"), "--json",
               "--fast-membership", "--progress-every", "10"]
        if i > 0:
            cmd += ["--peers", f"http://{hub_address(0)}:{PORT}"]  # the first learner, through the relay
        return cmd

    def run(self) -> None:
        a = self.args
        net = self.net
        self.say(f"workdir {self.workdir}; namespaces {net.hub}, {', '.join(net.regions)}")
        net.build()
        self.say(f"network: {self.n} regions, each linked to the hub at {a.rate_mbit:g} Mbit/s per direction "
                 f"(tc tbf); one-way latency ms {a.latency}")
        spec = self.workdir / "run.spec"
        sh(sys.executable, "-m", "diloco.node.cli", "init-run", "--name", f"multi-region-{os.getpid()}",
           "--key", str(self.workdir / "creator.pem"), "--inner-steps", str(a.inner_steps),
           "--fragments", str(a.fragments), "--codec", a.codec, "--out", str(spec))
        config = {"routes": [{"listen": [hub_address(i), PORT], "target": [region_address(i), PORT],
                              "region": i} for i in range(self.n)],
                  "sources": {region_address(i): i for i in range(self.n)}, "latency_ms": a.latency}
        (self.workdir / "relay.json").write_text(json.dumps(config))
        relay = self.spawn("relay", net.hub, [sys.executable, str(HERE / "relay.py"), "--config",
                                               str(self.workdir / "relay.json")], self.workdir / "relay.log")
        self.wait_for("relay 'ready' line", lambda: "ready" in relay.lines, RELAY_WAIT_S, [relay])
        first = self.learners[0]
        first.child = self.spawn("learner-0", net.regions[0], self.learner_cmd(0, spec),
                                 self.workdir / "learner-0.log")
        self.wait_for("'joined' event from learner 0", lambda: first.joined_at is not None, JOIN_WAIT_S,
                      [relay, first.child])
        for v in self.learners[1:]:
            v.child = self.spawn(f"learner-{v.index}", net.regions[v.index], self.learner_cmd(v.index, spec),
                                 self.workdir / f"learner-{v.index}.log")
        self.wait_for("'joined' events from every learner", lambda: all(v.joined_at for v in self.learners),
                      JOIN_WAIT_S, [relay] + [v.child for v in self.learners])
        self.spawn("poll", net.hub, [sys.executable, str(HERE / "poll.py"), "--interval", str(POLL_EVERY_S),
                                     *(f"http://{region_address(i)}:{PORT}" for i in range(self.n))],
                   self.workdir / "poll.log")
        self.train_start = time.monotonic()
        self.say(f"all {self.n} learners joined; training for {a.seconds:g}s")
        last = self.train_start
        watch = [relay] + [v.child for v in self.learners]
        while time.monotonic() - self.train_start < a.seconds:
            self.pump(0.5)
            for child in watch:
                if child.eof or child.proc.poll() is not None:
                    raise SetupError(f"{child.name} exited (code {child.proc.poll()}) during the run: "
                                     f"{self.tail(child)}" + (f" (log: {child.log})" if child.log else ""))
            if time.monotonic() - last >= REPORT_EVERY_S:
                last = time.monotonic()
                self.progress_lines()
        self.stop_gracefully()

    def progress_lines(self) -> None:
        t = time.monotonic() - (self.train_start or time.monotonic())
        for v in self.learners:
            loss = "-" if v.loss is None else f"{v.loss:.3f}"
            self.say(f"[{t:5.0f}s] r{v.index}: step {v.step} loss {loss} Σversions {v.versions} peers {v.peers} "
                     f"{v.bytes / 1e6:.2f} MB")

    def stop_gracefully(self) -> None:
        """Stop the poller, SIGINT the learners and wait for their "done" events, then stop the relay."""
        self.train_end = time.monotonic()
        for child in self.children:
            if child.name == "poll":
                self.signal(child, signal.SIGTERM)
        running = [v for v in self.learners if v.child is not None and v.child.proc.poll() is None]
        for v in running:
            self.signal(v.child, signal.SIGINT)
        deadline = time.monotonic() + STOP_WAIT_S
        while time.monotonic() < deadline and not all(v.child.eof for v in running):
            self.pump(0.25)
        for child in self.children:
            if child.name == "relay":
                self.signal(child, signal.SIGTERM)
                end = time.monotonic() + 5
                while time.monotonic() < end and not child.eof:
                    self.pump(0.25)
        with contextlib.suppress(queue.Empty):  # lines that arrived meanwhile
            while True:
                child, line = self.events.get_nowait()
                self.apply(child, line)

    # results ----------------------------------------------------------------------------------------------

    def staleness(self) -> list[int]:
        """Per sample (poll round, learner, fragment): versions behind the newest copy any learner held."""
        samples: list[int] = []
        for t, learners in self.rounds:
            if self.train_start is None or t < self.train_start:
                continue
            held = [entry["fragments"] for entry in learners if entry.get("fragments")]
            if len(held) < 2:
                continue
            for p in range(min(len(h) for h in held)):
                newest = max(tuple(h[p]) for h in held)
                samples += [max(0, newest[1] - h[p][1]) for h in held]
        return samples

    def status_bytes(self, i: int) -> int:
        for _, learners in reversed(self.rounds):
            for entry in learners:
                if entry.get("i") == i and "status_bytes" in entry:
                    return int(entry["status_bytes"])
        return 0

    def summary(self) -> dict[str, Any]:
        a = self.args
        done = [v for v in self.learners if v.done is not None]
        steps = sum(int(v.done.get("steps", 0)) for v in done)
        merged = sum(int(v.done.get("merged_steps", 0)) for v in done)
        per_step = []
        for v in done:
            b = v.done.get("bytes") or {}
            total = int(b.get("bytes_in", 0)) + int(b.get("bytes_out", 0)) - self.status_bytes(v.index)
            if int(v.done.get("steps", 0)) > 0:
                per_step.append(max(0, total) / int(v.done["steps"]))
        st = self.staleness()
        return {
            "goodput": min(1.0, merged / (a.fragments * steps)) if steps else None,
            "bytes_per_step": sum(per_step) / len(per_step) if per_step else None,
            "staleness_mean": sum(st) / len(st) if st else None,
            "staleness_max": max(st) if st else None,
            "regions": self.n,
            "rate_mbit": a.rate_mbit,
            "latency_ms": a.latency,
            "seconds": a.seconds,
            "codec": a.codec,
        }

    def report(self, s: dict[str, Any]) -> list[str]:
        def f(x: float | int | None, fmt: str = ".3f") -> str:
            return "n/a" if x is None else format(x, fmt)

        trained = (self.train_end or time.monotonic()) - (self.train_start or time.monotonic())
        lines = [f"multi-region run: {s['regions']} regions, {s['rate_mbit']:g} Mbit/s links, latency ms "
                 f"{s['latency_ms']}, {trained:.0f}s of training (logs in {self.workdir})"]
        for v in self.learners:
            d = v.done or {}
            b = d.get("bytes") or {}
            lines.append(f"  r{v.index}: {d.get('steps', v.step)} steps, merged_steps {d.get('merged_steps', '-')}, "
                         f"sent_steps {d.get('sent_steps', '-')}, versions {' '.join(d.get('versions', [])) or '-'}, "
                         f"final loss {f(d.get('final_loss'))}, sent {b.get('bytes_out', 0) / 1e6:.2f} MB, "
                         f"received {b.get('bytes_in', 0) / 1e6:.2f} MB" + ("" if v.done else " [no 'done' event]"))
        if self.relay_stats:
            for r in self.relay_stats.get("routes", []):
                lines.append(f"  relay to r{r['region']}: {r['connections']} connections, "
                             f"{r['bytes_up'] / 1e6:.2f} MB in, {r['bytes_down'] / 1e6:.2f} MB back")
        bps = s["bytes_per_step"]
        lines += [
            f"goodput         {f(s['goodput'])}  (Σ merged_steps / (P · Σ steps), P = {self.args.fragments})",
            f"bytes per step  {'n/a' if bps is None else f'{bps / 1e3:.1f} KB'}  (sent + received per inner step "
            "per learner)",
            f"staleness       mean {f(s['staleness_mean'], '.2f')}, max {f(s['staleness_max'], 'd')} versions "
            f"behind the newest copy of a fragment ({len(self.staleness())} samples)",
        ]
        return lines


def _raise_interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(argv)
    except SetupError as e:
        print(f"multi_region: {e}", file=sys.stderr)
        return 2
    problem = missing_requirements()
    if problem:
        print(problem, file=sys.stderr)
        return 2
    # Ctrl-C, SIGTERM and SIGHUP stop the run (the learners get SIGINT and print "done"). SIGINT is installed
    # explicitly: started in the background by a shell it would be ignored here and in every child, which
    # inherits an ignored signal; a handled one is reset to the default in the child instead.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _raise_interrupt)
    emu = Emulation(args)
    code, summary = 0, None
    try:
        try:
            emu.run()
        except KeyboardInterrupt:
            code = 130
            if emu.train_start is not None and emu.train_end is None:
                with contextlib.suppress(KeyboardInterrupt):
                    emu.stop_gracefully()
        if emu.train_start is not None:
            summary = emu.summary()
    except SetupError as e:
        print(f"multi_region: {e}", file=sys.stderr)
        code = 1
    finally:
        # a second Ctrl-C or SIGTERM must not cut the clean-up short
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM, signal.SIGHUP})
        try:
            emu.kill_all()
            emu.net.teardown()
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # drop signals that came meanwhile
                signal.signal(sig, signal.SIG_IGN)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM, signal.SIGHUP})
    if code == 130 and summary is None:
        print("multi_region: interrupted before every learner had joined; all it started is stopped and removed",
              file=sys.stderr)
    if summary is not None:
        for line in emu.report(summary):
            print(line)
        if code == 130:
            print("interrupted: the figures cover the run until then", file=sys.stderr)
        if args.json:
            print(json.dumps(summary), flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())

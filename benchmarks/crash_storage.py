"""kill -9 during checkpoint writes and replications: does storage survive? (issue 15, "Storage integrity").

    python benchmarks/crash_storage.py [--quick] [--kills N] [--learners M] [--seed S]

A real swarm of M learner processes (`diloco-node join`, through benchmarks/_crash_storage_worker.py, which
leaves a marker file while a checkpoint is written or a replication is sent or received) checkpoints every few
inner steps. N times, one learner is killed with SIGKILL, half of the time at a random instant, half of the time
aimed: the harness polls the markers and kills within a few milliseconds of one appearing (checkpoint and
replication alternately). After each kill it checks, from the dead learner's folder alone:

- every `step-*` checkpoint verifies (digests, shapes), and one loads (`unloadable_checkpoints`);
- the newest checkpoint plus its version journal (`node/journal.py` replay, as a restart does) holds, for every
  fragment, at least the highest version the learner had reported accepting before the kill
  (`version_regressions`, counted per fragment and kill);

then restarts it (same key, port and folder) and checks that its first report after the join does not go below
that either. At the end, `accepted_updates_lost` is `node/goodput.py`'s count of versions accepted under two
terms while a holder was up (the chaos harness's invariant); `lost_with_every_holder_down` the others.
`kills_during_checkpoint` / `kills_during_replication` count kills that left the marker behind, i.e. that
landed while a write or a replication was in progress. Prints one JSON object last.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
WORKER = REPO / "benchmarks" / "_crash_storage_worker.py"
JOIN_TIMEOUT_S = 120.0


@dataclass
class Slot:
    index: int
    key: Path
    ckpt: Path
    busy: Path
    port: int
    proc: subprocess.Popen | None = None
    incs: list = field(default_factory=list)  # goodput.Incarnation, one per process lifetime
    joined: threading.Event = field(default_factory=threading.Event)
    joined_versions: list[str] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def _free_port() -> int:
    with contextlib.closing(socket.socket()) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Swarm:
    """The learner processes, their reports (goodput.Incarnation) and their restarts."""

    def __init__(self, work: Path, learners: int, checkpoint_every: int, pace_s: float) -> None:
        from diloco.node.goodput import Incarnation
        from diloco.node.train import new_run
        from diloco.protocol.identity import Identity

        self.Incarnation = Incarnation
        self.work, self.checkpoint_every, self.pace_s = work, checkpoint_every, pace_s
        self.spec_path = work / "run.spec"
        genesis = new_run(Identity.generate(), "crash-storage", task="markov", inner_steps=8, fragments=4,
                          quorum=2, codec="int8")
        genesis.save(self.spec_path)
        self.spec = genesis.spec
        self.slots = []
        for i in range(learners):
            key = work / f"key-{i}.pem"
            Identity.generate().save(key)
            self.slots.append(Slot(i, key, work / f"ckpt-{i}", work / f"busy-{i}", _free_port()))
        self.lock = threading.Lock()

    def launch(self, slot: Slot, peers: list[str]) -> None:
        slot.busy.mkdir(parents=True, exist_ok=True)
        for marker in slot.busy.iterdir():
            marker.unlink()
        cmd = [sys.executable, str(WORKER), str(slot.busy), "--log-level", "warning", "join", "--run",
               str(self.spec_path), "--listen", f"127.0.0.1:{slot.port}", "--key", str(slot.key), "--json",
               "--fast-membership", "--progress-every", "5", "--pace", str(self.pace_s),
               "--checkpoint-dir", str(slot.ckpt), "--checkpoint-every", str(self.checkpoint_every)]
        for url in peers:
            cmd += ["--peers", url]
        env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", NUMBA_NUM_THREADS="1",
                   PYTHONUNBUFFERED="1", PYTHONPATH=str(REPO))
        slot.joined.clear()
        with open(self.work / f"learner-{slot.index}.log", "ab") as err:
            slot.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=err,
                                         text=True, bufsize=1, env=env, start_new_session=True)
        inc = self.Incarnation(slot.index, time.monotonic())
        slot.incs.append(inc)
        threading.Thread(target=self._read, args=(slot, inc, slot.proc), daemon=True).start()

    def _read(self, slot: Slot, inc, proc: subprocess.Popen) -> None:
        with open(self.work / f"learner-{slot.index}.jsonl", "a", buffering=1) as out:
            for line in proc.stdout:
                out.write(line)
                try:
                    ev = json.loads(line)
                except ValueError:
                    continue
                now, kind = time.monotonic(), ev.get("event")
                with self.lock:
                    if kind == "joined":
                        inc.joined_at = now
                        slot.joined_versions = list(ev.get("versions", []))
                        slot.joined.set()
                    accepted = [tuple(a) for a in ev.get("accepted", [])]
                    inc.accepted.extend(accepted)
                    inc.accepted_at.extend([now] * len(accepted))
                    if kind == "checkpoint_failed":
                        print(f"learner {slot.index}: {ev.get('error')}", file=sys.stderr)

    def wait_joined(self, slot: Slot) -> None:
        deadline = time.monotonic() + JOIN_TIMEOUT_S
        while not slot.joined.wait(0.1):
            if slot.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"learner {slot.index} did not join (exit {slot.proc.poll()}): see "
                                   f"{self.work / f'learner-{slot.index}.log'}")

    def kill(self, slot: Slot) -> None:
        if slot.proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(slot.proc.pid, signal.SIGKILL)
        slot.proc.wait()
        slot.incs[-1].ended_at, slot.incs[-1].ended_by = time.monotonic(), "killed"
        slot.proc = None

    def highest_reported(self, slot: Slot) -> dict[int, tuple[int, int]]:
        """Per fragment, the highest (term, version) this slot reported holding, in any incarnation."""
        from diloco.coordinator.version import Version

        out: dict[int, tuple[int, int]] = {}
        with self.lock:
            held = [(p, t, v) for inc in slot.incs for p, t, v in inc.accepted]
            held += [(p, (lab := Version.parse(s)).term, lab.version) for p, s in enumerate(slot.joined_versions)]
        for p, t, v in held:
            out[p] = max(out.get(p, (0, 0)), (t, v))
        return out

    def stop(self) -> None:
        for slot in self.slots:
            self.kill(slot)


def durable(ckpt_dir: Path, spec) -> tuple[list[tuple[int, int]] | None, int]:
    """(what a restart would hold: newest loadable checkpoint + journal replay, or None; folders that fail to
    verify), read from the folder alone."""
    from diloco.coordinator.version import Version
    from diloco.node.checkpoint import CheckpointCorrupt, load_checkpoint, load_latest
    from diloco.node.journal import replay

    corrupt = 0
    for path in sorted(ckpt_dir.glob("step-*")) if ckpt_dir.exists() else []:
        try:
            load_checkpoint(path)
        except CheckpointCorrupt as e:
            corrupt += 1
            print(f"unloadable checkpoint {path}: {e.reason}", file=sys.stderr)
    ckpt = load_latest(ckpt_dir) if ckpt_dir.exists() else None
    if ckpt is None:
        return None, corrupt
    anchors = [ckpt.anchors[p].reshape(-1).clone() for p in range(spec.fragments)]
    labels = [Version(*ckpt.labels[p]) for p in range(spec.fragments)]
    certs = [ckpt.certs.get(p, b"") for p in range(spec.fragments)]
    replay(ckpt_dir, spec, anchors, labels, certs, set())
    return [(v.term, v.version) for v in labels], corrupt


def aimed_wait(slot: Slot, kind: str, rng: random.Random, window_s: float) -> bool:
    """Poll `slot`'s markers until one of `kind` appears (then wait 0-3 ms); False if none within window_s."""
    deadline = time.monotonic() + window_s
    while time.monotonic() < deadline:
        with contextlib.suppress(FileNotFoundError):
            if any(m.name.startswith(kind) for m in os.scandir(slot.busy)):
                time.sleep(rng.uniform(0, 0.003))
                return True
        time.sleep(0.002)
    return False


def run(kills: int, learners: int, seed: int, checkpoint_every: int, pace_s: float, work: Path) -> dict:
    from diloco.coordinator.version import Version
    from diloco.node.goodput import lost_accepted_updates, lost_with_every_holder_down

    rng = random.Random(seed)
    swarm = Swarm(work, learners, checkpoint_every, pace_s)
    out = {"kills": 0, "kills_during_checkpoint": 0, "kills_during_replication": 0, "kills_aimed": 0,
           "kills_with_tmp_checkpoint_folder": 0, "unloadable_checkpoints": 0, "version_regressions": 0,
           "regressions_after_rejoin": 0, "accepted_updates_lost": 0}
    t0 = time.monotonic()
    restarts: list[float] = []
    try:
        first = swarm.slots[0]
        swarm.launch(first, [])
        swarm.wait_joined(first)
        for s in swarm.slots[1:]:
            swarm.launch(s, [first.url])
        for s in swarm.slots[1:]:
            swarm.wait_joined(s)
        deadline = time.monotonic() + 60
        while not any(inc.accepted for s in swarm.slots for inc in s.incs) or not all(
                (s.ckpt / "journal").exists() and any(s.ckpt.glob("step-*")) for s in swarm.slots):
            if time.monotonic() > deadline:
                raise RuntimeError("no versions or no checkpoints after 60 s")
            time.sleep(0.2)
        for k in range(kills):
            victim = rng.choice(swarm.slots)
            aim = ("ckpt", "repl")[(k // 2) % 2] if k % 2 else None
            if aim is None:
                time.sleep(rng.uniform(0.2, 2.0))
            elif aimed_wait(victim, aim, rng, 6.0):
                out["kills_aimed"] += 1
            swarm.kill(victim)
            out["kills"] += 1
            markers = [m.name for m in victim.busy.iterdir()]
            out["kills_during_checkpoint"] += any(m.startswith("ckpt") for m in markers)
            out["kills_during_replication"] += any(m.startswith("repl") for m in markers)
            out["kills_with_tmp_checkpoint_folder"] += any(victim.ckpt.glob(".tmp-*"))
            time.sleep(0.2)  # the reader thread drains what the learner printed before it died
            reported = swarm.highest_reported(victim)
            labels, corrupt = durable(victim.ckpt, swarm.spec)
            out["unloadable_checkpoints"] += corrupt + (labels is None)
            on_disk = labels or [(0, 0)] * swarm.spec.fragments
            behind = [p for p, v in reported.items() if on_disk[p] < v]
            if behind:
                print(f"kill {k}: learner {victim.index} on disk {on_disk}, reported {reported}", file=sys.stderr)
            out["version_regressions"] += len(behind)
            peers = [s.url for s in swarm.slots if s is not victim and s.proc is not None]
            t = time.monotonic()
            swarm.launch(victim, peers)
            swarm.wait_joined(victim)
            restarts.append(time.monotonic() - t)
            back = [(v.term, v.version) for v in map(Version.parse, victim.joined_versions)]
            out["regressions_after_rejoin"] += sum(back[p] < on_disk[p] for p in range(len(back)))
            print(f"kill {k + 1}/{kills}: learner {victim.index}, markers {sorted({m[:4] for m in markers})}, "
                  f"on disk {on_disk}, back at {victim.joined_versions}", file=sys.stderr)
        time.sleep(3.0)  # the last versions reach everyone's reports
        incs = [inc for s in swarm.slots for inc in s.incs]
        with swarm.lock:
            out["accepted_updates_lost"] = lost_accepted_updates(incs)
            out["lost_with_every_holder_down"] = lost_with_every_holder_down(incs)
            out["versions_accepted"] = sum(len(inc.accepted) for inc in incs)
    finally:
        swarm.stop()
    out.update(learners=learners, checkpoint_every=checkpoint_every, pace_s=pace_s, seed=seed,
               restart_s_median=round(sorted(restarts)[len(restarts) // 2], 2) if restarts else None,
               wall_s=round(time.monotonic() - t0, 1))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="4 kills (under a minute)")
    ap.add_argument("--kills", type=int, default=None)
    ap.add_argument("--learners", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--checkpoint-every", type=int, default=2)
    ap.add_argument("--pace", type=float, default=0.1)
    ap.add_argument("--workdir", type=Path, default=None, help="keep the learners' folders and logs here")
    args = ap.parse_args()
    kills = args.kills if args.kills is not None else (4 if args.quick else 50)
    if args.workdir is not None:
        args.workdir.mkdir(parents=True, exist_ok=True)
        result = run(kills, args.learners, args.seed, args.checkpoint_every, args.pace, args.workdir)
    else:
        with tempfile.TemporaryDirectory(prefix="crash-storage-") as tmp:
            result = run(kills, args.learners, args.seed, args.checkpoint_every, args.pace, Path(tmp))
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()

"""Byzantine benchmark: a swarm of 4 learners, one of them hostile, on the built-in synthetic task.

    python benchmarks/byzantine.py [--quick] [--steps S] [--attacks a,b,...]

Each run is a fresh swarm with the same task seed: 3 honest `diloco-node join` processes (one torch thread
each) training S inner steps, and a 4th learner in this process (tests/hostile.py) that trains alongside them
and is honest in the clean run and hostile in the others, one attack per run (the attacks of
docs/security.md: hostile deltas, forged updates, the top of the (term, version) range, a dishonest owner
that made itself the owner of a fragment with a key the rendezvous ranks first). A run's eval loss is the
mean "done" eval_loss of the 3 honest learners. The last line of stdout is one JSON object:
{"clean_eval_loss": x, "attacks": {"<name>": {"eval_loss": y, "ratio": y/x, ...}}, "target": 1.05, "met": bool};
human-readable lines go to stderr. --quick runs fewer steps and four of the attacks (one per kind).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tests/hostile.py, the scripted hostile member

import torch  # noqa: E402

from diloco.node.train import new_run  # noqa: E402
from diloco.protocol.identity import Identity  # noqa: E402
from tests.helpers import Proc, cli  # noqa: E402
from tests.hostile import ATTACKS, OWNER_ATTACKS, Hostile, owner_key  # noqa: E402

TARGET = 1.05
HONEST, FRAGMENTS, INNER_STEPS = 3, 4, 20
FULL_STEPS, QUICK_STEPS = 300, 150
QUICK_ATTACKS = ("scale1000", "top_of_range", "owner_scaled", "owner_flip")
# what the honest learners' summaries count of the attack (summed over the three)
COUNTERS = [("shard", "deltas_dropped_Malformed"), ("shard", "deltas_dropped_StaleVersion"), ("shard", "audits_failed"),
            ("shard", "audits_passed"), ("sync", "updates_unauthorized"), ("sync", "updates_refused_norm"),
            ("sync", "updates_refused_distrusted"), ("shard", "accusations_upheld"), ("shard", "accusations_dismissed"),
            ("sync", "distrusted_versions_left")]


def log(*a: object) -> None:
    print(*a, file=sys.stderr, flush=True)


def run_swarm(attack: str, steps: int, seed: int, workdir: Path) -> dict:
    """One fresh swarm; returns the honest learners' eval losses and what the hostile member saw."""
    workdir.mkdir(parents=True)
    genesis = new_run(Identity.generate(), f"byzantine-{attack}", task="markov", inner_steps=INNER_STEPS,
                      fragments=FRAGMENTS, quorum=2, codec="int8", seed=seed)
    genesis.save(workdir / "run.spec")
    keys = [Identity.generate() for _ in range(HONEST)]
    for i, k in enumerate(keys):
        k.save(workdir / f"key{i}.pem")
    procs: list[Proc] = []
    hostile = None
    t0 = time.monotonic()
    try:
        url = None
        for i in range(HONEST):
            args = ["--log-level", "warning", "join", "--run", str(workdir / "run.spec"), "--listen", "127.0.0.1:0",
                    "--steps", str(steps), "--json", "--progress-every", "50", "--fast-membership",
                    "--key", str(workdir / f"key{i}.pem"), *(["--peers", url] if url else [])]
            procs.append(Proc(cli(*args), env={"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
                                               "NUMBA_NUM_THREADS": "1"}))
            if url is None:
                procs[0].wait_for(r'"event": "joined"', timeout=120)
                url = procs[0].events("joined")[0]["url"]
        # the hostile member joins a running swarm (a joiner that syncs from a dishonest owner takes its
        # fragment unchecked: docs/security.md)
        while not all(p.events("joined") for p in procs):
            if time.monotonic() - t0 > 120 or any(p.popen.poll() is not None for p in procs):
                raise RuntimeError(f"run {attack}: a learner did not join")
            time.sleep(0.1)
        identity = owner_key(genesis.spec.run_id, FRAGMENTS, [k.peer_id for k in keys]) \
            if attack in OWNER_ATTACKS else None
        hostile = Hostile(genesis, [url], attack, identity=identity).start()
        while any(p.popen.poll() is None and not p.events("done") for p in procs):
            if time.monotonic() - t0 > 600:
                raise RuntimeError(f"run {attack} did not finish in 600 s")
            hostile.train(5)
        done = [p.events("done") for p in procs]
        if not all(done):
            raise RuntimeError(f"run {attack}: a learner ended without its summary:\n" +
                               "\n".join(procs[i].lines[-20:][-1] for i in range(HONEST) if not done[i]))
        losses = [d[0]["eval_loss"] for d in done]
        answers = dict(hostile.answers)
        refused = {k: sum(d[0].get(part, {}).get(k, 0) for d in done) for part, k in COUNTERS}
        return {"eval_losses": losses, "corrupted": hostile.corrupted, "answers": answers,
                "refused": {k: v for k, v in refused.items() if v}, "wall_s": round(time.monotonic() - t0, 1)}
    finally:
        if hostile is not None:
            hostile.close()
        for i, p in enumerate(procs):
            p.kill()
            p.read_available()
            (workdir / f"learner{i}.log").write_text("\n".join(p.lines))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help=f"{QUICK_STEPS} steps, attacks {', '.join(QUICK_ATTACKS)}")
    ap.add_argument("--steps", type=int, default=None, help=f"inner steps per learner (default {FULL_STEPS})")
    ap.add_argument("--attacks", default=None, help="comma-separated attacks (default: all)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--keep", default=None, help="keep each run's spec, keys and learner logs in this directory")
    args = ap.parse_args()
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    steps = args.steps or (QUICK_STEPS if args.quick else FULL_STEPS)
    attacks = args.attacks.split(",") if args.attacks else list(QUICK_ATTACKS if args.quick else ATTACKS)
    unknown = [a for a in attacks if a not in ATTACKS]
    if unknown:
        ap.error(f"unknown attacks {unknown}; known: {', '.join(ATTACKS)}")
    with tempfile.TemporaryDirectory(prefix="byzantine-") as tmp:
        tmp = args.keep or tmp
        clean = run_swarm("none", steps, args.seed, Path(tmp) / "clean")
        x = statistics.fmean(clean["eval_losses"])
        log(f"clean: eval loss {x:.4f} {clean['eval_losses']} ({clean['wall_s']} s)")
        out = {}
        for attack in attacks:
            r = run_swarm(attack, steps, args.seed, Path(tmp) / attack)
            y = statistics.fmean(r["eval_losses"])
            out[attack] = {"eval_loss": round(y, 4), "ratio": round(y / x, 4), "eval_losses": r["eval_losses"],
                           "corrupted_updates": r["corrupted"], "answers": r["answers"], "honest_counters": r["refused"]}
            log(f"{attack}: eval loss {y:.4f} ratio {y / x:.4f} {r['eval_losses']} ({r['wall_s']} s) {r['answers']}")
    met = all(a["ratio"] <= TARGET for a in out.values())
    print(json.dumps({"clean_eval_loss": round(x, 4), "attacks": out, "steps": steps, "target": TARGET, "met": met}))


if __name__ == "__main__":
    main()

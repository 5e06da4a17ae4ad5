"""Convergence benchmark: the global model of Decoupled DiLoCo (M real learner processes) vs data parallel at
its best learning rate, same tokens.

    python benchmarks/convergence.py [--quick] [--json] [--steps S] [--learners M] [--tasks markov,kjv]
                                     [--codec NAME] [--dp-lrs A,B,C] [--set FIELD=VALUE ...] [--dp-from FILE]

Per task ("markov": a Markov source whose entropy rate is known, the floor no model beats; "kjv": the King James
text, no floor known), tiny GPT, batch B = 16 sequences of T = 64 tokens, AdamW at a constant lr:

* DiLoCo: M (default 4) `diloco-node join` processes on loopback, one torch thread each, each with its own
  fresh key, at the DEFAULT RunSpec (only the run's name, the task, `--codec` and `--set` fields are set). The
  first opens the swarm, the others join through its URL; each trains S inner steps at batch B on its own data
  stream. Its "done" event carries two evaluations: `eval_loss`, of its live model (the anchors plus its local
  steps not merged yet), and `global_eval_loss`, of the global model: a copy with every fragment set to the
  latest published version the learner holds (`Learner.global_model()`: the model a user would ship).
  `global_eval_loss` and `live_eval_loss` are the means over the M learners of those two.
* Data parallel: one model per learning rate, the same init (same task seed) and inner optimizer, batch M·B
  (one batch from each of M data streams `task.batches(learner=i)`, i < M, concatenated), S steps: the same
  total tokens M·S·B·T. The lrs (default the task's lr × 0.5, 1, 2, 4: factor 2 apart) run in worker
  processes after the learners finished; while the best is at an end of the grid, the grid is extended past it
  (twice at most). The best is the comparison; every lr's loss is reported (`dp_lrs`).

Everything is evaluated with `evaluate(model, task)` on the task's fixed held-out batches. The last line of
stdout is one JSON object with `excess_ratio` = (global − floor) ÷ (best data parallel − floor) on "markov"
(target <= 1.25 at M = 4, the default RunSpec and steps; not expected at --quick) and `kjv_ratio` = global ÷
best data parallel on "kjv". Human-readable lines go to stderr.

Data parallel at a constant lr is deterministic, and its S-step run is the prefix of any longer one: its eval
curve is in the JSON (`dp_curves`), and `--dp-from FILE` (a file holding an earlier run's JSON line, at S' ≥ S
steps and the same M) takes data parallel from that curve instead of training it again: for sweeps of RunSpec
fields (`--set`), where only the DiLoCo side changes.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing
import os
import signal
import statistics
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _convergence_learners import run_diloco  # noqa: E402

TASKS = ("markov", "kjv")
EXCESS_TARGET = 1.25  # at M = 4, the default RunSpec and FULL_STEPS
FULL_STEPS = 1000
QUICK_STEPS = 100
LR_FACTORS = (0.5, 1.0, 2.0, 4.0)
MAX_EXTENSIONS = 2
CURVE_POINTS = 10


def log(*a: object) -> None:
    print(*a, file=sys.stderr, flush=True)


def run_dp(task_name: str, steps: int, learners: int, lr: float) -> dict[str, Any]:
    """Synchronous data parallel (in a worker process, one thread): batch learners·B from learners streams,
    the same init and AdamW at `lr`; the eval curve at every steps/CURVE_POINTS steps."""
    import torch

    from diloco.node.tasks import evaluate, make_task

    torch.set_num_threads(1)
    task = make_task(task_name, seed=0)
    model = task.build_model()
    opt = task.optimizer(model)
    for group in opt.param_groups:
        group["lr"] = lr
    streams = [task.batches(learner=i) for i in range(learners)]
    t0, tokens, curve = time.monotonic(), 0, {}
    every = max(steps // CURVE_POINTS, 1)
    for step in range(1, steps + 1):
        xs, ys = zip(*(next(s) for s in streams), strict=True)
        x, y = torch.cat(xs), torch.cat(ys)
        loss = task.loss(model, x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        tokens += x.numel()
        if step % every == 0 or step == steps:
            curve[step] = evaluate(model, task)
    return {"lr": lr, "eval_loss": curve[steps], "tokens": tokens, "wall_s": time.monotonic() - t0, "curve": curve}


def sweep_dp(task_name: str, steps: int, learners: int, lrs: list[float]) -> dict[float, dict]:
    """Data parallel at every lr of `lrs`, one worker process per core (4 at most; the learners are
    done), extended past an end of the grid while the best is there."""
    results: dict[float, dict] = {}
    workers = max(1, min(os.cpu_count() or 1, 4))
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        todo, extensions = sorted(lrs), 0
        while todo:
            for r in pool.map(run_dp, *zip(*((task_name, steps, learners, lr) for lr in todo), strict=True)):
                results[r["lr"]] = r
                log(f"  data parallel {task_name}, lr {r['lr']:g}: eval loss {r['eval_loss']:.4f} ({r['wall_s']:.0f}s)")
            grid = sorted(results)
            best = min(grid, key=lambda lr: results[lr]["eval_loss"])
            todo = []
            if extensions < MAX_EXTENSIONS and best in (grid[0], grid[-1]) and len(grid) > 1:
                todo, extensions = [best * 2 if best == grid[-1] else best / 2], extensions + 1
                log(f"  the best lr {best:g} is at the end of the grid: adding {todo[0]:g}")
    return results


def dp_from_file(path: Path, task_name: str, steps: int, learners: int) -> dict[float, dict]:
    """Data parallel read from an earlier run's JSON line: each lr's loss at `steps` on its curve."""
    lines = [x for x in path.read_text().splitlines() if x.startswith("{")]
    if not lines:
        raise SystemExit(f"--dp-from {path}: no JSON line in it")
    earlier = json.loads(lines[-1])
    if earlier.get("learners") != learners:
        raise SystemExit(f"--dp-from {path}: its data parallel is at M = {earlier.get('learners')}, not {learners}")
    curves = earlier.get("dp_curves", {}).get(task_name)
    if not curves:
        raise SystemExit(f"--dp-from {path}: no data-parallel curve of task {task_name}")
    out = {}
    for lr, curve in curves.items():
        if str(steps) not in curve:
            raise SystemExit(f"--dp-from {path}: its {task_name} curve has no point at step {steps} "
                             f"(it has {', '.join(curve)})")
        out[float(lr)] = {"lr": float(lr), "eval_loss": curve[str(steps)], "tokens": None, "curve": curve}
    return out


def compare(task_name: str, args: argparse.Namespace, steps: int, workdir: Path,
            run_fields: dict[str, Any]) -> dict[str, Any]:
    """One task: the M learners, then data parallel at each lr; the figures of both."""
    dl = run_diloco(steps, args.learners, workdir / task_name, progress_every=max(steps // 20, 1),
                    timeout_s=args.timeout, run_fields={"task": task_name, **run_fields}, log=log)
    done = dl["done"]
    live = [d["eval_loss"] for d in done]
    glob = [d["global_eval_loss"] for d in done]
    diloco_tokens = sum(int(d["tokens"]) for d in done)
    log(f"DiLoCo {task_name}: {args.learners} learners done in {dl['wall_s']:.1f}s (join {max(dl['join_s']):.1f}s); "
        f"global model eval losses {', '.join(f'{e:.4f}' for e in glob)}; live models {', '.join(f'{e:.4f}' for e in live)}")
    for i, d in enumerate(done):
        log(f"  learner {i}: {d['steps']} steps in {d['train_s']:.1f}s, outer steps {d['outer_steps']}, versions "
            f"{' '.join(d['versions'])}, sent steps {d['sent_steps']}, merged steps {d['merged_steps']}, "
            f"overwritten steps {d['overwritten_steps']}")
    if args.dp_from is not None:
        dp = dp_from_file(args.dp_from, task_name, steps, args.learners)
        log(f"data parallel {task_name}: from {args.dp_from} at step {steps}")
    else:
        from diloco.node.tasks import make_task

        base_lr = make_task(task_name, seed=0).lr
        lrs = args.dp_lrs or [base_lr * f for f in LR_FACTORS]
        log(f"data parallel {task_name}: {steps} steps at batch {args.learners}×B, lrs {', '.join(f'{x:g}' for x in lrs)}")
        dp = sweep_dp(task_name, steps, args.learners, lrs)
    best = min(dp.values(), key=lambda r: r["eval_loss"])
    if best["tokens"] is not None and best["tokens"] != diloco_tokens:
        log(f"warning: DiLoCo trained {diloco_tokens} tokens, data parallel {best['tokens']}")
    return {"dp_eval_loss": best["eval_loss"], "dp_lr": best["lr"],
            "dp_lrs": {f"{lr:g}": r["eval_loss"] for lr, r in sorted(dp.items())},
            "dp_curve": {f"{lr:g}": r["curve"] for lr, r in sorted(dp.items())},
            "global_eval_loss": statistics.fmean(glob), "live_eval_loss": statistics.fmean(live),
            "global_eval_losses": glob, "live_eval_losses": live, "tokens": diloco_tokens,
            "wall_s": dl["wall_s"], "spec": dl["spec"]}


def parse_set(items: list[str]) -> dict[str, Any]:
    """`--set inner_steps=50 --set outer_lr=0.5`: RunSpec fields, typed by their declared type."""
    from diloco.coordinator.runspec import RunSpec

    types = {f.name: str(f.type) for f in dataclasses.fields(RunSpec)}
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        kind = types.get(key)
        if not sep or kind not in ("int", "float", "bool", "str"):
            raise SystemExit(f"--set {item}: expected FIELD=VALUE with FIELD an int, float, bool or str field of "
                             f"RunSpec ({', '.join(k for k, t in types.items() if t in ('int', 'float', 'bool'))})")
        try:
            out[key] = {"int": int, "float": float, "str": str,
                        "bool": lambda v: {"true": True, "false": False}[v.lower()]}[kind](value)
        except (ValueError, KeyError):
            raise SystemExit(f"--set {item}: {value!r} is not a {kind}") from None
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help=f"{QUICK_STEPS} steps (the target is not expected)")
    ap.add_argument("--json", action="store_true", help="only the JSON line on stdout (it is always the last line)")
    ap.add_argument("--steps", type=int, default=None, help=f"S: inner steps per learner (default {FULL_STEPS})")
    ap.add_argument("--learners", type=int, default=4, help="M: learner processes (default 4)")
    ap.add_argument("--tasks", default=",".join(TASKS), help="comma-separated, of markov and kjv (default both)")
    ap.add_argument("--codec", default=None, help="the run's codec (default the RunSpec's)")
    ap.add_argument("--dp-lrs", default=None, help="data-parallel lrs, comma-separated (default: the task lr × 0.5, 1, 2, 4)")
    ap.add_argument("--dp-from", type=Path, default=None, help="data parallel from an earlier run's JSON line")
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", help="a RunSpec field (sweeps)")
    ap.add_argument("--timeout", type=float, default=1800.0, help="give up on the learners after this many seconds")
    ap.add_argument("--workdir", type=Path, default=None, help="keep the run specs, keys and learner logs here")
    args = ap.parse_args()
    steps = args.steps or (QUICK_STEPS if args.quick else FULL_STEPS)
    tasks = [t for t in args.tasks.split(",") if t]
    if steps < 1 or args.learners < 1:
        ap.error("--steps and --learners must be at least 1")
    if not tasks or set(tasks) - set(TASKS):
        ap.error(f"--tasks takes {' and '.join(TASKS)}, got {args.tasks!r}")
    try:
        args.dp_lrs = [float(x) for x in args.dp_lrs.split(",")] if args.dp_lrs else None
    except ValueError:
        ap.error(f"--dp-lrs takes comma-separated numbers, got {args.dp_lrs!r}")
    run_fields = parse_set(args.set)
    if args.codec is not None:
        from diloco.protocol.codecs import get_codec
        from diloco.protocol.errors import Malformed

        try:
            get_codec(args.codec)
        except Malformed as e:
            ap.error(str(e))
        run_fields["codec"] = args.codec

    from diloco.node.tasks import make_task

    floor = make_task("markov", seed=0).data.entropy_rate_nats()
    log(f"convergence: {args.learners} DiLoCo learner processes × {steps} steps vs data parallel {steps} steps at "
        f"{args.learners}× the batch, tasks {', '.join(tasks)}; markov entropy floor {floor:.4f} nats")
    t_start = time.monotonic()
    tmp = None if args.workdir else tempfile.TemporaryDirectory(prefix="diloco-convergence-")
    workdir = args.workdir or Path(tmp.name)
    try:
        res = {t: compare(t, args, steps, workdir, run_fields) for t in tasks}
    finally:
        if tmp is not None:
            tmp.cleanup()

    mk, kj = res.get("markov"), res.get("kjv")
    excess = live_excess = kjv_ratio = None
    if mk:
        excess = (mk["global_eval_loss"] - floor) / max(mk["dp_eval_loss"] - floor, 1e-9)
        live_excess = (mk["live_eval_loss"] - floor) / max(mk["dp_eval_loss"] - floor, 1e-9)
        log(f"result markov: global model {mk['global_eval_loss']:.4f}, live models {mk['live_eval_loss']:.4f}, "
            f"data parallel {mk['dp_eval_loss']:.4f} (lr {mk['dp_lr']:g}), floor {floor:.4f}: excess ratio "
            f"{excess:.3f} (live {live_excess:.3f}; target <= {EXCESS_TARGET} at M = 4)")
    if kj:
        kjv_ratio = kj["global_eval_loss"] / kj["dp_eval_loss"]
        log(f"result kjv: global model {kj['global_eval_loss']:.4f}, live models {kj['live_eval_loss']:.4f}, data "
            f"parallel {kj['dp_eval_loss']:.4f} (lr {kj['dp_lr']:g}): ratio {kjv_ratio:.4f}")
    first = mk or kj
    result = {
        "dp_eval_loss": mk["dp_eval_loss"] if mk else None, "dp_lrs": mk["dp_lrs"] if mk else None,
        "global_eval_loss": mk["global_eval_loss"] if mk else None,
        "live_eval_loss": mk["live_eval_loss"] if mk else None, "entropy_floor": floor, "excess_ratio": excess,
        "kjv_ratio": kjv_ratio, "tokens": first["tokens"], "learners": args.learners,
        "live_excess_ratio": live_excess, "dp_lr": mk["dp_lr"] if mk else None,
        "excess_target": EXCESS_TARGET, "excess_met": excess is not None and excess <= EXCESS_TARGET,
        "kjv": {k: kj[k] for k in ("dp_eval_loss", "dp_lr", "dp_lrs", "global_eval_loss", "live_eval_loss")}
        if kj else None,
        "steps": steps, "spec": first["spec"], "dp_from": str(args.dp_from) if args.dp_from else None,
        "per_learner": {t: {"global": r["global_eval_losses"], "live": r["live_eval_losses"]} for t, r in res.items()},
        "diloco_wall_s": {t: r["wall_s"] for t, r in res.items()},
        "dp_curves": {t: r["dp_curve"] for t, r in res.items()},
        "total_s": time.monotonic() - t_start,
    }
    if not args.json:
        print(f"excess ratio {excess}, kjv ratio {kjv_ratio}")
    print(json.dumps(result), flush=True)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # SIGTERM unwinds like Ctrl-C, so the finally blocks reap the learners


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        main()
    except KeyboardInterrupt:
        log("interrupted: every learner process was stopped")
        sys.exit(130)

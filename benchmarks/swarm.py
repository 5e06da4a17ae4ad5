"""Swarm benchmark: our learners and syncer shards vs hivemind 1.1.12 and the raw socket, one run.

    python benchmarks/swarm.py [--quick] [--json]

What each key measures (all on loopback, one torch thread per process):
  round_s                 4 learner processes hold a 25M-float32 stand-in in 8 fragments (int8 codec, quorum 4);
                          each perturbs its parameters as training would, then all are released together and hand
                          every fragment's delta to their swarms at once; from the last learner's hand-over to the
                          last learner holding every new version (median over rounds, after one warm-up round)
  hivemind_allreduce_s    hivemind's DecentralizedAverager, same tensors, 4 processes, 8-bit codec; its rounds
                          and ours alternate (ours, theirs, theirs, ours, ...: both swarms stay up meanwhile)
  join_s                  a fifth learner: Learner.start() + its first step(), i.e. first contact with a peer to
                          its first inner step with the whole state synced (imports, model and Learner
                          construction excluded); median of 3 joiners, each a fresh process, one after the other
  hivemind_load_state_s   a fifth hivemind peer's load_state_from_peers() of the same tensors; median of 3 loads
                          by that peer (only the first of them fresh)
  raw_transfer_s          the same 100 MB over one plain loopback TCP socket between two processes; transfers
                          alternate with the joins (raw, join, join, raw, ...)
  overhead_ratio          tiny-GPT inner steps/s of 2 learners in a 2-learner swarm (default RunSpec) ÷ the
                          same loop without the swarm, 2 processes side by side; in the order standalone, swarm,
                          swarm, standalone, means of each side
  bytes_per_step          bytes sent + received per inner step per learner, from the learners' own counters, in
                          a 4-learner tiny-GPT swarm at the default RunSpec and default membership timings
  ddp_bytes_per_step      what a fp32 ring all-reduce moves per step per worker: 2·2(M−1)/M·4·params
  bandwidth_reduction     ddp_bytes_per_step ÷ bytes_per_step
  sparse_bytes_per_step   bytes_per_step of the same swarm at the same RunSpec but for the sparse codec's fields
                          (`SPARSE`: codec topk, docs/protocol.md §6 and §7.21), measured right after it
  sparse_bandwidth_reduction  ddp_bytes_per_step ÷ sparse_bytes_per_step
  extra_rss_bytes_per_param  (peak RSS of a stand-in learner after rounds in which fragments go out one after
                          the other, as the schedule sends them − peak RSS of the same process holding the same
                          model and AdamW state without the swarm) ÷ 25M
  rss_growth_bytes_per_param  change of the current RSS between the first and the last of those rounds ÷ 25M
The last line of stdout is one JSON object with these keys. `--bandwidth` measures only the last five (the two
4-learner swarms, side by side).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
JOINERS = 3  # join_s and hivemind_load_state_s are medians over this many joins
SPARSE = {"codec": "topk"}  # the RunSpec fields of a sparse run (docs/protocol.md §7.21)


def log(*a: object) -> None:
    print(*a, file=sys.stderr, flush=True)


def _die_with_parent() -> None:
    """Linux: the worker gets SIGKILL when this benchmark process dies, however it dies."""
    import ctypes
    import signal

    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class Worker:
    def __init__(self, args: list[str]) -> None:
        self.proc = subprocess.Popen([sys.executable, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=sys.stderr, text=True, env=ENV, cwd=HERE.parent,
                                     preexec_fn=_die_with_parent)

    def event(self, timeout: float = 300) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"worker {self.proc.args[1:3]} exited with {self.proc.wait()}")
            if line.startswith("{"):
                return json.loads(line)
        raise TimeoutError(f"worker {self.proc.args[1:3]} said nothing for {timeout}s")

    def send(self, line: str) -> None:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


def stand_in_spec(path: Path) -> None:
    sys.path.insert(0, str(HERE))
    from _swarm_worker import FRAGMENTS, StandIn

    from diloco.coordinator.plan import FragmentPlan
    from diloco.coordinator.runspec import Genesis, RunSpec
    from diloco.node.learner import genesis_digest
    from diloco.protocol.identity import Identity

    model = StandIn()
    plan = FragmentPlan.from_module(model, FRAGMENTS)
    # quorum 4: each round merges all four learners' deltas into one version per fragment, as hivemind's
    # all-reduce averages its group of four
    spec = RunSpec("swarm-bench", task="stand-in", fragments=FRAGMENTS, codec="int8", quorum=4,
                   plan_digest=plan.digest(), genesis_digest=genesis_digest(plan, model))
    Genesis.create(Identity.generate(), spec).save(path)


def _round_events(workers: list[Worker], command: str) -> list[dict]:
    """One round: every learner perturbs its parameters (as training would), then all are released together."""
    for w in workers:
        w.send("prepare")
    for w in workers:
        w.event()
    for w in workers:
        w.send(command)
    evs = [w.event() for w in workers]
    stalled = [e for e in evs if e["event"] != "round"]
    if stalled:
        raise RuntimeError(f"a round did not complete within its deadline: {stalled}; the others: {[e for e in evs if e not in stalled]}")
    return evs


def stand_in_part(tmp: Path, rounds: int, hm) -> dict:
    """The 25M stand-in's rounds and joins, each interleaved with its reference (`hm`, benchmarks/_hivemind_swarm.py):
    our rounds with hivemind's all-reduce rounds, our joins with raw socket transfers, in the order A B, B A, ...,
    so that a shared machine's drift over the run falls on both sides alike."""
    from _swarm_worker import NUMEL

    spec = tmp / "standin.spec"
    stand_in_spec(spec)
    worker = str(HERE / "_swarm_worker.py")
    workers: list[Worker] = []
    try:
        base = Worker([worker, "standalone", str(spec)])
        standalone_rss = base.event()["maxrss"]
        base.stop()
        workers.append(Worker([worker, "learner", str(spec)]))
        url = workers[0].event()["url"]
        workers += [Worker([worker, "learner", str(spec), url]) for _ in range(3)]
        for w in workers[1:]:
            w.event()
        time.sleep(3)  # every member record seen by every peer
        # Memory first, under the schedule's load (one fragment after the other), before the all-at-once rounds
        # below raise the peak: ru_maxrss only ever grows.
        staggered = []
        for _ in range(rounds + 1):
            staggered.append(_round_events(workers, "stagger"))
        rss = [e["maxrss"] for e in staggered[-1]]
        growth = statistics.median(b["rss"] - a["rss"] for a, b in zip(staggered[1], staggered[-1], strict=True))
        log(f"staggered rounds: peak RSS {[r / 2**20 for r in rss]} MiB, growth {growth / 2**20:.1f} MiB")
        times: list[float] = []

        def our_round() -> None:
            evs = _round_events(workers, "go")
            times.append(max(e["have"] for e in evs) - max(e["sent"] for e in evs))
            log(f"round {len(times) - 1}{' (warm-up)' if len(times) == 1 else ''}: {times[-1]:.3f}s, CPU seconds "
                f"per learner {[round(e['cpu_s'], 2) for e in evs]}")

        our_round()  # warm-up (the first all-at-once round), not counted, as hivemind's first is not
        hivemind = hm.hivemind_allreduce_s(NUMEL, 4, repeats=rounds, alongside=our_round)
        joins: list[float] = []
        raws: list[float] = []

        def join_once() -> None:  # one after the other, each a fresh process
            joiner = Worker([worker, "joiner", str(spec), url])
            join = joiner.event()
            joiner.proc.wait(60)
            joins.append(join["join_s"])
            log(f"join: {join['join_s']:.3f}s, versions {join['versions']}")

        hm.interleave(lambda: raws.append(hm.raw_transfer_s(100_000_000, repeats=3)), join_once, JOINERS)
        return {"round_s": statistics.median(times[1:]), "hivemind_allreduce_s": hivemind,
                "join_s": statistics.median(joins), "raw_transfer_s": statistics.median(raws),
                "extra_rss_bytes_per_param": (statistics.median(rss) - standalone_rss) / NUMEL,
                "rss_growth_bytes_per_param": growth / NUMEL}
    finally:
        for w in workers:
            w.stop()


def tiny_part(tmp: Path, steps: int, bytes_steps: int, bandwidth_only: bool = False,
              sparse_fields: dict | None = None) -> dict:
    from _hivemind_swarm import interleave

    from diloco.node.tasks import make_task
    from diloco.node.train import new_run
    from diloco.protocol.identity import Identity

    spec, sparse_spec = tmp / "tiny.spec", tmp / "tiny-sparse.spec"
    new_run(Identity.generate(), "tiny-bench").save(spec)  # the default RunSpec
    sparse_fields = SPARSE if sparse_fields is None else sparse_fields
    new_run(Identity.generate(), "tiny-bench-sparse", **sparse_fields).save(sparse_spec)

    def swarm(m: int, n_steps: int, fast: bool, spec: Path = spec) -> list[list[dict]]:
        args = ["-m", "diloco.node.cli", "join", "--run", str(spec), "--listen", "127.0.0.1:0", "--json",
                "--steps", str(n_steps), "--progress-every", "10", *(["--fast-membership"] if fast else [])]
        ws = [Worker(args)]
        events: list[list[dict]] = [[ws[0].event()]]
        ws += [Worker([*args, "--peers", events[0][0]["url"]]) for _ in range(m - 1)]
        events += [[w.event()] for w in ws[1:]]
        try:
            for w, evs in zip(ws, events, strict=True):
                while evs[-1]["event"] != "done":
                    evs.append(w.event())
        finally:
            for w in ws:
                w.stop()
        return events

    def speed(evs: list[dict]) -> float:
        prog = [e for e in evs if e["event"] == "progress"]
        a, b = prog[len(prog) // 10], prog[-1]
        return (b["step"] - a["step"]) / (b["t"] - a["t"])

    def bytes_per_step(spec: Path, what: str) -> float:
        # the traffic at the membership timings a user runs: the member polls and DHT reads cost bytes per
        # second, not per step, so at the test-only --fast-membership timings (2.5x as frequent) the per-step
        # figure would measure the machine's speed as much as the protocol
        four = swarm(4, bytes_steps, fast=False, spec=spec)
        routes: dict[str, float] = {}
        for e in four:
            for route, n in e[-1].get("bytes_by_route", {}).items():
                routes[route] = routes.get(route, 0.0) + n / e[-1]["steps"] / len(four)
        log(f"{what}: bytes per inner step per learner by route: "
            + ", ".join(f"{r} {n:.0f}" for r, n in sorted(routes.items(), key=lambda kv: -kv[1]) if n >= 1))
        return statistics.mean((e[-1]["bytes"]["bytes_in"] + e[-1]["bytes"]["bytes_out"]) / e[-1]["steps"]
                               for e in four)

    out: dict = {}
    if not bandwidth_only:
        def standalone() -> float:
            alone = [Worker([str(HERE / "_swarm_worker.py"), "tiny", str(steps)]) for _ in range(2)]
            try:
                return statistics.mean(w.event()["steps_per_s"] for w in alone)
            finally:
                for w in alone:
                    w.stop()

        speeds: dict[str, list[float]] = {"standalone": [], "swarm": []}
        interleave(  # standalone, swarm, swarm, standalone
            lambda: speeds["standalone"].append(standalone()),
            lambda: speeds["swarm"].append(statistics.mean(speed(evs) for evs in swarm(2, steps, fast=True))), 2)
        log(f"tiny GPT steps/s: standalone {speeds['standalone']}, in a 2-learner swarm {speeds['swarm']}")
        out["overhead_ratio"] = statistics.mean(speeds["swarm"]) / statistics.mean(speeds["standalone"])
    params = make_task("markov").build_model().num_params()
    ddp = 2 * 2 * (4 - 1) / 4 * 4 * params
    per_step, sparse = bytes_per_step(spec, "int8"), bytes_per_step(sparse_spec, "sparse")
    log(f"bytes per inner step per learner: {per_step:.0f} (the default RunSpec, int8), {sparse:.0f} "
        f"({sparse_fields}); a fp32 ring all-reduce moves {ddp:.0f}")
    return {**out, "bytes_per_step": per_step, "ddp_bytes_per_step": ddp, "bandwidth_reduction": ddp / per_step,
            "sparse_bytes_per_step": sparse, "sparse_bandwidth_reduction": ddp / sparse}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer rounds and steps (about a minute or two)")
    ap.add_argument("--json", action="store_true", help="only the JSON line matters (it is always the last)")
    ap.add_argument("--bandwidth", action="store_true", help="only the bytes per step, int8 and sparse side by side")
    ap.add_argument("--sparse-codec", default=SPARSE["codec"], help="the sparse side's codec (a sweep: topk:C:K:B)")
    ap.add_argument("--sparse-set", action="append", default=[], metavar="FIELD=NUMBER",
                    help="a numeric RunSpec field of the sparse side only (a sweep: inner_steps=50)")
    args = ap.parse_args()
    sys.path.insert(0, str(HERE))
    sparse_fields = {**SPARSE, "codec": args.sparse_codec}
    for item in args.sparse_set:
        key, _, value = item.partition("=")
        sparse_fields[key] = float(value) if "." in value else int(value)
    if args.bandwidth:
        with tempfile.TemporaryDirectory() as tmp:
            result = tiny_part(Path(tmp), 0, bytes_steps=300 if args.quick else 800, bandwidth_only=True,
                               sparse_fields=sparse_fields)
        log(f"bandwidth_reduction {result['bandwidth_reduction']:.0f} (target >= 150), sparse_bandwidth_reduction "
            f"{result['sparse_bandwidth_reduction']:.0f} (target >= 1000)")
        print(json.dumps(result))
        return
    import _hivemind_swarm as hm

    result: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        result.update(stand_in_part(Path(tmp), rounds=3 if args.quick else 5, hm=hm))
        result.update(tiny_part(Path(tmp), steps=300 if args.quick else 600, bytes_steps=300 if args.quick else 800,
                                    sparse_fields=sparse_fields))
    result["hivemind_load_state_s"] = hm.hivemind_load_state_s(25_000_000, 4, repeats=JOINERS)
    r = result
    log(f"round_s {r['round_s']:.3f} vs hivemind all-reduce {r['hivemind_allreduce_s']:.3f} "
        f"(ratio {r['round_s'] / r['hivemind_allreduce_s']:.2f}, target <= 1)")
    log(f"join_s {r['join_s']:.3f} vs hivemind load_state {r['hivemind_load_state_s']:.3f} "
        f"(ratio {r['join_s'] / r['hivemind_load_state_s']:.2f}, target <= 0.5) and raw transfer "
        f"{r['raw_transfer_s']:.3f} (ratio {r['join_s'] / r['raw_transfer_s']:.1f}, target <= 4)")
    log(f"overhead_ratio {r['overhead_ratio']:.3f} (target >= 0.90); bandwidth_reduction "
        f"{r['bandwidth_reduction']:.0f} (target >= 150), sparse {r['sparse_bandwidth_reduction']:.0f} (target >= "
        f"1000); extra RSS {r['extra_rss_bytes_per_param']:.2f} B/param "
        "(target <= 12)")
    print(json.dumps(result))


if __name__ == "__main__":
    main()

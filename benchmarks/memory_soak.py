"""Memory over a long run: does a learner's RSS grow? (the "no growth over a 10-minute run" target)

    python benchmarks/memory_soak.py [--minutes 10] [--quick] [--json]

Four learner processes hold the 25M-parameter stand-in of `benchmarks/swarm.py` (8 fragments, int8, quorum 4)
and run rounds back to back for `--minutes`: each round every learner perturbs its parameters as training
would, then sends its fragments one after the other as the schedule does. Each learner reports its current
RSS (/proc/self/statm) after every round; a round's transient buffers move a single reading by ±20 MiB, so
each figure is the median of the readings in a tenth of the run (a minute of the default 10). The first two
tenths are warm-up (the work-buffer pool fills, the allocator settles): `warmup_bytes_per_param` is the first
tenth → the third, and `growth_bytes_per_param` the third → the last, per learner (median learner;
`max_growth_...` the worst). The RSS of the same process holding the model and AdamW without the swarm is the baseline of the
extra bytes. The last line of stdout is one JSON object: {"minutes", "rounds", "baseline_rss_mib",
"rss_mib_third_tenth", "rss_mib_last_tenth", "peak_extra_bytes_per_param", "warmup_bytes_per_param",
"growth_bytes_per_param", "max_growth_bytes_per_param"}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from swarm import Worker, _round_events, log, stand_in_spec  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--quick", action="store_true", help="45 seconds instead (the windows scale with the run)")
    ap.add_argument("--json", action="store_true", help="only the JSON line matters (it is always the last)")
    args = ap.parse_args()
    if args.quick:
        args.minutes = 0.75
    from _swarm_worker import NUMEL

    worker = str(HERE / "_swarm_worker.py")
    with tempfile.TemporaryDirectory() as tmp:
        spec = Path(tmp) / "standin.spec"
        stand_in_spec(spec)
        base = Worker([worker, "standalone", str(spec)])
        baseline = base.event()["maxrss"]
        base.stop()
        workers = [Worker([worker, "learner", str(spec)])]
        try:
            url = workers[0].event()["url"]
            workers += [Worker([worker, "learner", str(spec), url]) for _ in range(3)]
            for w in workers[1:]:
                w.event()
            time.sleep(3)
            start = time.monotonic()
            samples: list[tuple[float, list[int]]] = []  # (minutes since start, RSS of each learner)
            while time.monotonic() - start < args.minutes * 60:
                evs = _round_events(workers, "stagger")
                samples.append(((time.monotonic() - start) / 60, [e["rss"] for e in evs]))
                if len(samples) % 40 == 0:
                    log(f"{samples[-1][0]:.1f} min, {len(samples)} rounds: RSS "
                        f"{[round(r / 2**20) for r in samples[-1][1]]} MiB")
            peak = [e["maxrss"] for e in evs]
        finally:
            for w in workers:
                w.stop()

    def window(lo: float, hi: float) -> list[float]:
        """Per learner, the median RSS read in the tenths [lo, hi) of the run."""
        rows = [rss for t, rss in samples if lo <= t / args.minutes * 10 < hi] or [samples[-1][1]]
        return [statistics.median(col) for col in zip(*rows, strict=True)]

    first, warm, last = window(0, 1), window(2, 3), window(9, 11)
    for tenth in range(10):  # the whole profile, to tell a step during warm-up from a steady climb
        log(f"tenth {tenth + 1}: median RSS {[round(r / 2**20, 1) for r in window(tenth, tenth + 1)]} MiB")
    growth = [(b - a) / NUMEL for a, b in zip(warm, last, strict=True)]
    print(json.dumps({
        "minutes": args.minutes, "rounds": len(samples), "baseline_rss_mib": round(baseline / 2**20, 1),
        "rss_mib_third_tenth": [round(r / 2**20, 1) for r in warm],
        "rss_mib_last_tenth": [round(r / 2**20, 1) for r in last],
        "peak_extra_bytes_per_param": round((statistics.median(peak) - baseline) / NUMEL, 2),
        "warmup_bytes_per_param": round(statistics.median((b - a) / NUMEL for a, b in zip(first, warm, strict=True)), 3),
        "growth_bytes_per_param": round(statistics.median(growth), 3), "max_growth_bytes_per_param": round(max(growth), 3),
    }))


if __name__ == "__main__":
    main()

"""Memory over a long run: does a learner's RSS grow? (the "no growth over a 10-minute run" target)

    python benchmarks/memory_soak.py [--minutes 10] [--json]

Four learner processes hold the 25M-parameter stand-in of `benchmarks/swarm.py` (8 fragments, int8, quorum 4)
and run rounds back to back for `--minutes`: each round every learner perturbs its parameters as training
would, then sends its fragments one after the other as the schedule does. Each learner reports its current
RSS (/proc/self/statm) after every round. Growth is measured from the end of the first minute (allocator
and caches warm) to the end, per learner; the RSS of the same process holding the model and AdamW without
the swarm is the baseline of the extra bytes. The last line of stdout is one JSON object:
{"minutes", "rounds", "baseline_rss_mib", "rss_mib_after_1min", "rss_mib_at_end", "peak_extra_bytes_per_param",
 "growth_bytes_per_param" (the median learner), "max_growth_bytes_per_param"}.
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
    ap.add_argument("--json", action="store_true", help="only the JSON line matters (it is always the last)")
    args = ap.parse_args()
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
            warm: list[int] | None = None
            rounds = 0
            while time.monotonic() - start < args.minutes * 60:
                evs = _round_events(workers, "stagger")
                rounds += 1
                if warm is None and time.monotonic() - start >= 60:
                    warm = [e["rss"] for e in evs]
                    log(f"after 1 min ({rounds} rounds): RSS {[round(r / 2**20) for r in warm]} MiB")
                if rounds % 20 == 0:
                    log(f"{(time.monotonic() - start) / 60:.1f} min, {rounds} rounds: RSS "
                        f"{[round(e['rss'] / 2**20) for e in evs]} MiB")
            end = [e["rss"] for e in evs]
            peak = [e["maxrss"] for e in evs]
        finally:
            for w in workers:
                w.stop()
    warm = warm or end
    growth = [(b - a) / NUMEL for a, b in zip(warm, end, strict=True)]
    print(json.dumps({
        "minutes": args.minutes, "rounds": rounds, "baseline_rss_mib": round(baseline / 2**20, 1),
        "rss_mib_after_1min": [round(r / 2**20, 1) for r in warm], "rss_mib_at_end": [round(r / 2**20, 1) for r in end],
        "peak_extra_bytes_per_param": round((statistics.median(peak) - baseline) / NUMEL, 2),
        "growth_bytes_per_param": round(statistics.median(growth), 3), "max_growth_bytes_per_param": round(max(growth), 3),
    }))


if __name__ == "__main__":
    main()

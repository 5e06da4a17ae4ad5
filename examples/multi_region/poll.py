"""Poll each learner's `GET /v1/status` every few seconds and print what run.py needs, one JSON line per round.

run.py starts this inside the hub namespace (`ip netns exec`), the only place from which every learner's own
listening address is reachable without going through the latency relay. Standard library only, so it starts
in well under a second and costs next to nothing.

    poll.py [--interval 2] URL...
    → {"event": "round", "t": ..., "learners": [{"i": 0, "step": 120, "fragments": [[term, version], ...],
                                                 "status_bytes": 12345}, {"i": 1, "error": "..."}, ...]}

`status_bytes` is what this poller has cost that learner so far (the bytes of the `/v1/status` answers it
served, from its own counters, plus the answer just read), so run.py can leave the polling out of the
learner's byte counters.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
import time
import urllib.request

STATUS_ROUTE = "/v1/status"
OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never an http_proxy from the environment


def version_pair(label: str) -> list[int]:
    """"term.version" (as /v1/status writes fragment versions) → [term, version]; [0, 0] if unreadable."""
    term, _, version = str(label).partition(".")
    return [int(term), int(version)] if term.isdigit() and version.isdigit() else [0, 0]


def poll_one(i: int, url: str, timeout: float) -> dict:
    try:
        with OPENER.open(url.rstrip("/") + STATUS_ROUTE, timeout=timeout) as resp:
            body = resp.read()
        st = json.loads(body)
        served = ((st.get("bytes") or {}).get("served") or {}).get(STATUS_ROUTE) or {}
        return {"i": i, "step": st.get("step", 0),
                "fragments": [version_pair(f.get("version", "")) for f in st.get("fragments", [])],
                "status_bytes": int(served.get("bytes_out", 0)) + int(served.get("bytes_in", 0)) + len(body)}
    except (OSError, ValueError) as e:
        return {"i": i, "error": f"{type(e).__name__}: {e}"}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Poll learners' /v1/status; one JSON line per round.")
    ap.add_argument("--interval", type=float, default=2.0)
    ap.add_argument("--timeout", type=float, default=3.0)
    ap.add_argument("urls", nargs="+")
    args = ap.parse_args(argv)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.is_set():
        start = time.monotonic()
        learners = [poll_one(i, url, args.timeout) for i, url in enumerate(args.urls)]
        print(json.dumps({"event": "round", "t": time.time(), "learners": learners}), flush=True)
        stop.wait(max(0.0, args.interval - (time.monotonic() - start)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

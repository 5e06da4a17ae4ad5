"""Fuzzing: every decoder of network bytes fed generated and mutated inputs; only typed errors may come out.

    python benchmarks/fuzz.py [--quick] [--inputs N] [--seed S]

Decoders (benchmarks/_fuzz_targets.py): canonical msgpack, the envelope (header, whole frame, certificate,
streaming reader), every tensor codec, DHT records, requests and replies, the swarm's message fields and
bodies, the URL path and query parsers, the fragment download reader, the run spec and genesis file, and
bulk HTTP heads; then every HTTP route of a live one-learner peer on a loopback port
(benchmarks/_fuzz_routes.py). Inputs are mutations of valid ones (real sealed envelopes, encoded tensors,
DHT messages), re-signed where a signature would stop them early. Each input must be accepted or raise the
decoder's typed errors (`ProtocolError` and its subclasses) within a time bound, and a refused one must
leave the decoder's state (replay cache, DHT storage and routing table, the peer's fragments) unchanged;
a route must never answer 500, and the peer must log no exception. Reproducible: hypothesis draws the
inputs from a fixed seed. Progress goes to stderr; the last line of stdout is one JSON object.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("NUMBA_NUM_THREADS", "1")

import argparse  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _fuzz_core import Tally, drive  # noqa: E402
from _fuzz_targets import all_targets  # noqa: E402

DEFAULT_INPUTS = 102_000
QUICK_INPUTS = 5_000
ROUTE_SHARE = 0.15  # of the inputs: a request costs ~3 times an in-process decode


def run(total: int, seed: int, *, routes: bool = True, log=print) -> tuple[Tally, int]:
    """Fuzz `total` inputs across every target; returns the tally and the peer's logged exceptions."""
    targets = all_targets()
    n_routes = int(total * ROUTE_SHARE) if routes else 0
    each = -(-(total - n_routes) // len(targets))
    tally = Tally()
    for i, (name, one) in enumerate(targets.items()):
        t0 = time.monotonic()
        drive(each, seed + i, lambda rng, one=one: one(rng, tally))
        log(f"{name}: {each} inputs in {time.monotonic() - t0:.1f} s; untyped {tally.untyped_errors}, "
            f"hangs {tally.hangs}, state changes {tally.state_changes}")
    background = 0
    if n_routes:
        background = fuzz_routes(n_routes, seed + len(targets), tally, log)
    return tally, background


def fuzz_routes(n: int, seed: int, tally: Tally, log) -> int:
    """Half the route inputs broken after signing (state always checked), half signed; returns the number of
    exceptions the peer logged meanwhile."""
    from _fuzz_routes import BackgroundErrors, LivePeer, route_target

    errors = BackgroundErrors()
    logging.getLogger().addHandler(errors)
    peer = LivePeer()
    try:
        for k, signed in enumerate((False, True)):
            t0 = time.monotonic()
            target = route_target(peer, signed=signed)
            drive(n // 2, seed + k, lambda rng, one=target: one(rng, tally))
            log(f"routes ({'signed' if signed else 'broken frames'}): {n // 2} requests in "
                f"{time.monotonic() - t0:.1f} s; untyped {tally.untyped_errors}, hangs {tally.hangs}, "
                f"state changes {tally.state_changes}")
    finally:
        peer.close()
        logging.getLogger().removeHandler(errors)
    for record in errors.records[:5]:
        tally.fail("routes", "the peer logged an exception", record[-1500:])
    return len(errors.records)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help=f"{QUICK_INPUTS} inputs instead of {DEFAULT_INPUTS}")
    parser.add_argument("--inputs", type=int, default=None, help="total inputs across every decoder")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    total = args.inputs or (QUICK_INPUTS if args.quick else DEFAULT_INPUTS)
    t0 = time.monotonic()
    tally, background = run(total, args.seed, log=lambda m: print(m, file=sys.stderr, flush=True))
    for f in tally.failures:
        print(f, file=sys.stderr)
    print(json.dumps({
        "inputs": tally.inputs, "per_decoder": tally.per_decoder, "accepted": tally.accepted,
        "untyped_errors": tally.untyped_errors + background, "peer_logged_exceptions": background,
        "hangs": tally.hangs, "state_changes": tally.state_changes, "route_statuses": tally.statuses,
        "seed": args.seed, "seconds": round(time.monotonic() - t0, 1),
    }))


if __name__ == "__main__":
    main()

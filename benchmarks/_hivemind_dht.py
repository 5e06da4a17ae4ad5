"""Hivemind half of the DHT benchmark: the same procedure we run against our own DHT.

What it measures, for N ``hivemind.DHT`` nodes on loopback (each one a forked process with its own p2pd):

* ``bootstrap_s``: wall time from starting the first node until all N report ready. Node 0 starts alone; the
  rest start in small concurrent batches, each bootstrapping from node 0 plus up to two random earlier nodes.
  A hivemind node is "ready" once it has pinged its initial peers and looked up its own neighbourhood.
* ``store_*_ms`` / ``get_*_ms``: per-operation latency (p50/p99, numpy.percentile) of the blocking
  ``dht.store(key, value, get_dht_time() + 600)`` and ``dht.get(key, latest=True)`` calls, each issued
  from a random node, one at a time; keys are random strings, values 64 random bytes.
* ``get_success``: fraction of gets whose value equals what was stored.
* ``get_success_after_churn``: the same gets from random survivors after ``churn`` of the nodes were killed
  with SIGKILL (the DHT process and its p2pd child, no graceful shutdown).
* ``rss_mb_per_node``: mean over nodes of RSS(DHT process) + RSS(its p2pd child), in MiB (2**20 bytes),
  taken after the gets and before the churn. The DHT processes are forked from this one, so their RSS
  also counts copy-on-write pages shared with the parent (python, torch, hivemind); the PSS is logged too.

Every process started here (DHT processes and p2pd daemons) is killed and reaped before returning, even
on errors, and the p2pd unix sockets are removed. Networking stays on 127.0.0.1: no IPFS bootstrap,
relays, AutoNAT or UPnP. hivemind's MPFuture makes the main thread's event loop exist as a side effect;
if there was none before the call, it is closed and unset again at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import sys
import time

import numpy as np
import psutil

MIB = 2**20
BATCH = 4  # nodes started concurrently after the first one (2 CPU cores: p2pd start-up is CPU-heavy)
P2P_OPTS = dict(
    host_maddrs=["/ip4/127.0.0.1/tcp/0"],
    use_ipfs=False,
    use_relay=False,
    use_auto_relay=False,
    auto_nat=False,
    nat_port_map=False,
)


def print_to_stderr(*args) -> None:
    print(*args, file=sys.stderr, flush=True)


async def _routing_table_size(_dht, node) -> int:  # runs inside a DHT process via run_coroutine
    return len(node.protocol.routing_table.uid_to_peer_id)


def _procs(dht) -> list[psutil.Process]:
    """The DHT process and its descendants (the p2pd daemon), those still alive."""
    try:
        root = psutil.Process(dht.pid)
        return [root, *root.children(recursive=True)]
    except (psutil.Error, TypeError, ValueError):
        return []


def _sockets(procs: list[psutil.Process]) -> list[str]:
    """p2pd's control socket and the matching client socket, read from p2pd's command line."""
    paths = []
    for p in procs:
        with contextlib.suppress(psutil.Error):
            for arg in p.cmdline():
                if arg.startswith("-listen=/unix"):
                    path = arg.split("=", 1)[1][len("/unix") :]
                    paths += [path, path.replace("/hivemind-p2pd-", "/hivemind-p2pclient-")]
    return paths


def _hard_kill(dht, known: list[psutil.Process]) -> None:
    """SIGKILL p2pd, then the DHT process; remove the sockets. p2pd goes first so that its parent (the DHT
    process, whose asyncio child watcher waits on it) reaps it; an orphan would be left to init."""
    procs = {p.pid: p for p in known + _procs(dht)}
    sockets = _sockets(list(procs.values()))
    root = procs.pop(dht.pid, None) if dht.pid is not None else None
    for p in procs.values():
        with contextlib.suppress(psutil.Error):
            p.kill()  # psutil checks the create time, so a recycled pid is never hit
    psutil.wait_procs(list(procs.values()), timeout=3)
    if root is not None:
        with contextlib.suppress(psutil.Error):
            root.kill()
        dht.join(timeout=10)
    for path in sockets:
        with contextlib.suppress(OSError):
            os.remove(path)


def _main_thread_loop():
    local = getattr(asyncio.get_event_loop_policy(), "_local", None)
    return getattr(local, "_loop", None)


def _ms_percentiles(xs: list[float]) -> tuple[float, float]:
    return float(np.percentile(xs, 50) * 1e3), float(np.percentile(xs, 99) * 1e3)


def run_hivemind_dht(n: int, ops: int = 200, churn: float = 0.10, seed: int = 0, log=print_to_stderr) -> dict:
    """Returns {"bootstrap_s", "store_p50_ms", "store_p99_ms", "get_p50_ms", "get_p99_ms", "get_success",
    "get_success_after_churn", "rss_mb_per_node"}; rss_mb_per_node is in MiB (2**20 bytes) and counts
    the DHT process plus its p2pd daemon."""
    import hivemind
    from hivemind.utils import get_dht_time

    assert n >= 2, "need at least two nodes"
    rng = random.Random(seed)
    loop_before = _main_thread_loop()
    dhts: list = []
    tracked: dict[int, list[psutil.Process]] = {}  # index -> [DHT process, p2pd]
    try:
        t0 = time.perf_counter()
        dhts.append(hivemind.DHT(start=True, **P2P_OPTS))
        maddrs = [[str(a) for a in dhts[0].get_visible_maddrs()]]
        tracked[0] = _procs(dhts[0])
        for lo in range(1, n, BATCH):
            batch = range(lo, min(n, lo + BATCH))
            for _ in batch:
                peers = maddrs[0] + sum(rng.sample(maddrs[1:], min(2, len(maddrs) - 1)), [])
                dhts.append(hivemind.DHT(initial_peers=peers, start=True, await_ready=False, **P2P_OPTS))
            for i in batch:
                dhts[i].wait_until_ready(timeout=120)
                tracked[i] = _procs(dhts[i])
                maddrs.append([str(a) for a in dhts[i].get_visible_maddrs()])
        bootstrap_s = time.perf_counter() - t0
        sizes = [d.run_coroutine(_routing_table_size) for d in dhts]
        log(
            f"hivemind: {n} nodes ready in {bootstrap_s:.2f}s; routing table sizes "
            f"min/mean/max {min(sizes)}/{np.mean(sizes):.1f}/{max(sizes)}"
        )

        records = {f"bench-{seed}-{i}-{rng.getrandbits(64):016x}": rng.randbytes(64) for i in range(ops)}
        store_s, stored = [], 0
        t1 = time.perf_counter()
        for key, value in records.items():
            dht = rng.choice(dhts)
            t = time.perf_counter()
            stored += bool(dht.store(key, value, get_dht_time() + 600))
            store_s.append(time.perf_counter() - t)
        log(f"hivemind: {ops} stores in {time.perf_counter() - t1:.2f}s ({stored} acknowledged)")

        def get_round(nodes: list) -> tuple[float, list[float]]:
            ok, lat = 0, []
            for key, value in records.items():
                dht = rng.choice(nodes)
                t = time.perf_counter()
                res = dht.get(key, latest=True)
                lat.append(time.perf_counter() - t)
                ok += res is not None and res.value == value
            return ok / max(1, len(records)), lat

        t1 = time.perf_counter()
        get_success, get_s = get_round(dhts)
        log(f"hivemind: {ops} gets in {time.perf_counter() - t1:.2f}s, success {get_success:.3f}")

        rss, pss = [], []
        for i in range(n):
            procs = _procs(dhts[i])
            rss.append(sum(p.memory_info().rss for p in procs) / MIB)
            with contextlib.suppress(psutil.Error):
                pss.append(sum(p.memory_full_info().pss for p in procs) / MIB)
        log(
            f"hivemind: per node RSS {np.mean(rss):.1f} MiB, PSS {np.mean(pss) if pss else float('nan'):.1f} MiB"
        )

        n_kill = min(n - 1, max(1, round(churn * n))) if churn > 0 else 0
        victims = set(rng.sample(range(n), n_kill))
        for i in victims:
            _hard_kill(dhts[i], tracked.get(i, []))
        survivors = [d for i, d in enumerate(dhts) if i not in victims]
        t1 = time.perf_counter()
        churn_success, churn_s = get_round(survivors)
        p50, p99 = _ms_percentiles(churn_s)
        log(
            f"hivemind: killed {len(victims)} nodes; {ops} gets in {time.perf_counter() - t1:.2f}s, "
            f"success {churn_success:.3f}, p50 {p50:.1f} ms, p99 {p99:.1f} ms"
        )

        store_p50, store_p99 = _ms_percentiles(store_s)
        get_p50, get_p99 = _ms_percentiles(get_s)
        return {
            "bootstrap_s": bootstrap_s,
            "store_p50_ms": store_p50,
            "store_p99_ms": store_p99,
            "get_p50_ms": get_p50,
            "get_p99_ms": get_p99,
            "get_success": get_success,
            "get_success_after_churn": churn_success,
            "rss_mb_per_node": float(np.mean(rss)),
        }
    finally:
        for i, dht in enumerate(dhts):
            _hard_kill(dht, tracked.get(i, []))
        loop = _main_thread_loop()
        if loop_before is None and loop is not None:
            with contextlib.suppress(RuntimeError):
                loop.close()
            asyncio.set_event_loop(None)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=16)
    parser.add_argument("--ops", type=int, default=50)
    parser.add_argument("--churn", type=float, default=0.10)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(json.dumps(run_hivemind_dht(args.n, args.ops, args.churn, args.seed)))

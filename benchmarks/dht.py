"""DHT benchmark: our Kademlia over aiohttp vs hivemind 1.1.12's DHT (libp2p daemon), same procedure, one run.

    python benchmarks/dht.py [--quick] [--json]

For each swarm: time to bootstrap N nodes; 200 stores then 200 gets of random keys from random nodes (latency
p50/p99, success rate); then 10% of the nodes are killed and the gets repeated (success rate); memory per node.
Gets are `latest=True` on both sides. Ours: N nodes in one process on loopback ports (no torch imported),
memory = process RSS ÷ N. hivemind: N processes each with its own p2pd, memory = RSS of the process plus its
p2pd (see benchmarks/_hivemind_dht.py). The last line of stdout is one JSON object:
{"ours": {"<N>": {...}}, "hivemind": {"<N>": {...}}}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import time

KEYS = ("bootstrap_s", "store_p50_ms", "store_p99_ms", "get_p50_ms", "get_p99_ms", "get_success",
        "get_success_after_churn", "rss_mb_per_node")


def log(*a: object) -> None:
    print(*a, file=sys.stderr, flush=True)


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q / 100 * (len(xs) - 1)))] * 1000


async def ours(n: int, ops: int, churn: float, seed: int) -> dict:
    import psutil

    from diloco.protocol.dht.node import DHTNode
    from diloco.protocol.transport import PeerClient

    rng = random.Random(seed)
    client = PeerClient(retries=0, limit=512, limit_per_host=4)
    t0 = time.perf_counter()
    nodes = [await DHTNode.start(client=client)]
    while len(nodes) < n:
        batch = min(8, n - len(nodes))
        seeds = [[nodes[0].url, *(x.url for x in rng.sample(nodes, min(2, len(nodes))))] for _ in range(batch)]
        nodes += await asyncio.gather(*(DHTNode.start(client=client, bootstrap=s) for s in seeds))
    bootstrap_s = time.perf_counter() - t0
    log(f"ours N={n}: bootstrap {bootstrap_s:.1f}s, routing table sizes "
        f"{min(len(x.routing) for x in nodes)}..{max(len(x.routing) for x in nodes)}")
    keys = {f"bench-{seed}-{i}-{rng.getrandbits(64):x}": rng.randbytes(64) for i in range(ops)}
    store_lat = []
    for key, value in keys.items():
        node = rng.choice(nodes)
        t = time.perf_counter()
        await node.store(key, value, time.time() + 600)
        store_lat.append(time.perf_counter() - t)

    async def gets(pool: list) -> tuple[list[float], float]:
        lat, ok = [], 0
        for key, value in keys.items():
            node = rng.choice(pool)
            t = time.perf_counter()
            got = await node.get(key, latest=True)
            lat.append(time.perf_counter() - t)
            ok += got == value
        return lat, ok / len(keys)

    get_lat, success = await gets(nodes)
    rss_mb = psutil.Process().memory_info().rss / 2**20 / n
    victims = rng.sample(nodes[1:], int(n * churn))
    await asyncio.gather(*(v.stop() for v in victims))  # servers closed: connections refused, like kill -9
    survivors = [x for x in nodes if x not in victims]
    _, success_churn = await gets(survivors)
    await asyncio.gather(*(x.stop() for x in survivors))
    await client.close()
    return dict(zip(KEYS, (bootstrap_s, _pct(store_lat, 50), _pct(store_lat, 99), _pct(get_lat, 50),
                           _pct(get_lat, 99), success, success_churn, rss_mb), strict=True))


def run_ours_subprocess(n: int, ops: int, seed: int) -> dict:
    """Our swarm in a fresh process, so its RSS holds only what our nodes need (no torch, no hivemind)."""
    out = subprocess.run([sys.executable, __file__, "--ours", str(n), "--ops", str(ops), "--seed", str(seed)],
                         capture_output=True, text=True, timeout=900)
    sys.stderr.write(out.stderr)
    if out.returncode != 0:
        raise RuntimeError(f"our DHT run for N={n} failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="hivemind at N=16, ours at 16 and 64 (under a minute or two)")
    ap.add_argument("--json", action="store_true", help="only the JSON line on stdout (it is always the last line)")
    ap.add_argument("--ours", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--ops", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.ours:
        print(json.dumps(asyncio.run(ours(args.ours, args.ops, 0.10, args.seed))))
        return
    hm_n = 16 if args.quick else 32
    sizes = [hm_n, 64] if args.quick else [hm_n, 64, 256]
    result: dict = {"ours": {}, "hivemind": {}}
    for n in sizes:
        result["ours"][str(n)] = run_ours_subprocess(n, args.ops, args.seed)
        log(f"ours N={n}: {result['ours'][str(n)]}")
    try:
        sys.path.insert(0, os.path.dirname(__file__))
        from _hivemind_dht import run_hivemind_dht

        result["hivemind"][str(hm_n)] = run_hivemind_dht(hm_n, ops=args.ops, churn=0.10, seed=args.seed, log=log)
        log(f"hivemind N={hm_n}: {result['hivemind'][str(hm_n)]}")
    except ImportError as e:
        log(f"hivemind not installed ({e}); comparing nothing")
    o, h = result["ours"][str(hm_n)], result["hivemind"].get(str(hm_n))
    if h:
        log(f"get_p50 ours/hivemind at N={hm_n}: {o['get_p50_ms'] / h['get_p50_ms']:.3f} (target <= 1)")
        log(f"rss per node ours/hivemind: {o['rss_mb_per_node'] / h['rss_mb_per_node']:.4f} (target <= 0.2)")
    big = result["ours"][str(sizes[-1])]
    log(f"ours N={sizes[-1]}: get_success {big['get_success']}, after churn {big['get_success_after_churn']}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()

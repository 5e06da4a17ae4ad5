"""How long a downloaded fragment waits for its check after its last byte: hashed while it arrives, or after.

    python benchmarks/download_check.py [--quick] [--mb-per-s R]

A joiner checks every fragment it downloads against the anchor digest its certificate names before installing
it. Hashed after the download (the code before `RunningDigest`), the check adds a whole hash after the last
byte: ~0.2 s per GB with BLAKE3 (~0.55 s with SHA-256, the digest before); hashed while the bytes arrive, only
the last piece is left. One fragment of 100M
fp32 parameters (400 MB; --quick: 25M), served by a real aiohttp route on loopback paced at R MB/s (default 400,
~3.2 Gbit/s: a link slower than the hash, as between machines; unpaced loopback on 2 cores is CPU-bound
instead, and there the join's benchmark, `benchmarks/swarm.py`, is the measure) and read with
`FragmentReader` through `bulk.get_into`, the two ways alternated, 3 times each. The last line of stdout:
{"numel", "mb_per_s", "download_s_while", "download_s_after", "check_after_last_byte_ms_while",
 "check_after_last_byte_ms_after", "ratio"}  (medians; ratio = after ÷ while, of the time after the last byte)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time

import torch
from aiohttp import web

from diloco.coordinator.wire import FragmentReader, anchor_digest, pack_fragment
from diloco.protocol.bulk import get_into
from diloco.protocol.transport import PeerServer

PIECE = 1 << 20


def log(*a: object) -> None:
    print(*a, file=sys.stderr, flush=True)


async def main(numel: int, mb_per_s: float, repeats: int) -> dict:
    anchor = torch.randn(numel, generator=torch.Generator().manual_seed(0))
    expected = anchor_digest(anchor)
    head, data = pack_fragment(b"certificate", anchor.numpy().data.cast("B"))
    length = len(head) + len(data)

    async def fragment(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse()
        resp.content_length = length
        await resp.prepare(request)
        await resp.write(head)
        t0 = time.perf_counter()
        for i in range(0, len(data), PIECE):
            await resp.write(data[i : i + PIECE])
            await asyncio.sleep(max(0.0, t0 + (i + PIECE) / (mb_per_s * 1e6) - time.perf_counter()))
        await resp.write_eof()
        return resp

    server = PeerServer()
    server.add_route("GET", "/v1/fragment", fragment)
    await server.start()
    runs: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
    try:
        for _ in range(repeats):
            for hashing in (True, False):
                reader = FragmentReader(numel, into=torch.empty(numel), hash_while_reading=hashing)
                t0 = time.perf_counter()
                await get_into(server.url, "/v1/fragment", reader, length)
                last_byte = time.perf_counter()
                if await reader.digest() != expected:
                    raise AssertionError("the digest does not match")
                checked = time.perf_counter()
                runs[hashing].append((last_byte - t0, checked - last_byte))
                log(f"{'while' if hashing else 'after'}: download {last_byte - t0:.3f} s, "
                    f"check {1000 * (checked - last_byte):.1f} ms after the last byte")
    finally:
        await server.stop()
    out: dict = {"numel": numel, "mb_per_s": mb_per_s}
    for hashing, name in ((True, "while"), (False, "after")):
        out[f"download_s_{name}"] = round(statistics.median(d for d, _ in runs[hashing]), 4)
        out[f"check_after_last_byte_ms_{name}"] = round(1000 * statistics.median(c for _, c in runs[hashing]), 2)
    out["ratio"] = round(out["check_after_last_byte_ms_after"] / out["check_after_last_byte_ms_while"], 1)
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="25M parameters instead of 100M")
    parser.add_argument("--mb-per-s", type=float, default=400.0, help="the serving pace (MB/s)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(json.dumps(asyncio.run(main(25_000_000 if args.quick else 100_000_000, args.mb_per_s, 3))))

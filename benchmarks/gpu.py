"""Benchmark: a learner on an accelerator, in one run on one device (under 5 minutes).

    python benchmarks/gpu.py [--quick] [--json] [--device cuda|cpu]

1. Codec: int8 encode and decode of a 25M-element float32 N(0, 1) tensor that lives on the device (encode:
   on the device, then the payload to the host; decode: the payload to the device, decoded into a device
   buffer), against `dst.copy_(src)` of the same tensor on the same device: GB/s of float32 input, medians,
   repetitions interleaved, every call synchronized.
2. Learners: two `join` processes of the small GPT on the same device, standalone side by side, then the same
   two as a swarm (quorum 2, H = 50, P = 4); tokens/s from their own `done` reports; ratio = in swarm ÷
   standalone (the same contention on the device both times).
3. One outer round: `owner_round_s`, the median over the swarm's owners of their published rounds (deltas
   taken, the outer step, replication, the version pushed to every learner), as each reported it; and
   `network_bytes_per_step`, what a swarm learner sent and received per inner step.

Not measured yet (the issue asks for it): the bytes over PCIe per outer step.
`--device cpu` runs the same on the CPU (a dry run of the script: its figures say nothing about a GPU). The
table goes to stderr; the last line of stdout is one JSON object.
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

import torch

from diloco.protocol.codecs import get_codec

NUMEL = 25_000_000


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device: torch.device) -> float:
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t0


def codec_figures(device: torch.device, reps: int) -> dict[str, float]:
    """GB/s (float32 input bytes) of int8 encode and decode on `device`, and of copy_ there."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(NUMEL, generator=g).to(device)
    dst = torch.empty_like(x)
    out = torch.empty_like(x)
    codec = get_codec("int8")
    meta, data = codec.encode(x)  # warm: allocations, kernels
    codec.decode(meta, data, out=out)
    times: dict[str, list[float]] = {"encode": [], "decode": [], "copy": []}
    for _ in range(reps):
        times["encode"].append(_timed(lambda: codec.encode(x), device))
        times["decode"].append(_timed(lambda: codec.decode(meta, data, out=out), device))
        times["copy"].append(_timed(lambda: dst.copy_(x), device))
    gbs = {k: 4 * NUMEL / statistics.median(v) / 1e9 for k, v in times.items()}
    return {"encode_gbs": round(gbs["encode"], 2), "decode_gbs": round(gbs["decode"], 2),
            "copy_gbs": round(gbs["copy"], 2), "encode_vs_copy": round(gbs["encode"] / gbs["copy"], 3),
            "decode_vs_copy": round(gbs["decode"] / gbs["copy"], 3)}


def _cli(*args: str, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "diloco.node", *args], text=True, **kw)


def _done(proc: subprocess.Popen, timeout: float) -> dict:
    out, err = proc.communicate(timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"a learner failed ({proc.returncode}): {err[-2000:]}")
    events = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    done = [e for e in events if e.get("event") == "done"]
    if not done:
        raise RuntimeError(f"a learner reported no 'done': {out[-2000:]}")
    return done[-1]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def learner_figures(device: str, steps: int, work: Path) -> dict[str, float]:
    spec = work / "run.spec"
    subprocess.run([sys.executable, "-m", "diloco.node", "init-run", "--name", "gpu-bench", "--model", "small",
                    "--fragments", "4", "--inner-steps", "50", "--quorum", "2", "--key", str(work / "creator.pem"),
                    "--out", str(spec)], check=True, capture_output=True)
    common = ["join", "--spec", str(spec), "--device", device, "--steps", str(steps), "--json",
              "--progress-every", "1000000", "--fast-membership"]
    pipes = dict(stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    alone = [_cli(*common, "--standalone", "--listen", f"127.0.0.1:{_free_port()}", **pipes) for _ in range(2)]
    solo = [_done(p, 600) for p in alone]
    port = _free_port()
    first = _cli(*common, "--listen", f"127.0.0.1:{port}", "--key", str(work / "a.pem"), **pipes)
    second = _cli(*common, "--listen", "127.0.0.1:0", "--key", str(work / "b.pem"), "--peers",
                  f"127.0.0.1:{port}", "--wait-for-peers", "60", **pipes)
    swarm = [_done(p, 600) for p in (first, second)]

    def rate(d: dict) -> float:
        return d["tokens"] / d["train_s"] if d.get("train_s") else 0.0

    standalone, in_swarm = statistics.fmean(rate(d) for d in solo), statistics.fmean(rate(d) for d in swarm)
    rounds = [d["owner_round_s"] for d in swarm if d.get("owner_round_s") is not None]
    moved = [sum(v for v in d.get("bytes", {}).values() if isinstance(v, int | float)) / d["steps"] for d in swarm]
    return {"standalone_tokens_per_s": round(standalone, 1), "swarm_tokens_per_s": round(in_swarm, 1),
            "swarm_vs_standalone": round(in_swarm / standalone, 3) if standalone else 0.0,
            "owner_round_s": round(statistics.median(rounds), 3) if rounds else None,
            "network_bytes_per_step": round(statistics.fmean(moved)),
            "swarm_versions": [d.get("versions") for d in swarm]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA device: run on a machine with a GPU, or --device cpu for a dry run")
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(1)
    result: dict = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"}
    result |= codec_figures(device, 5 if args.quick else 15)
    with tempfile.TemporaryDirectory() as work:
        result |= learner_figures(args.device, 100 if args.quick else 400, Path(work))
    if not args.json:
        for k, v in result.items():
            print(f"{k:>26}: {v}", file=sys.stderr)
        print("targets: swarm_vs_standalone >= 0.97, encode_vs_copy >= 0.25 (on a GPU)", file=sys.stderr)
    print(json.dumps(result))


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()

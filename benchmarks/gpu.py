"""Benchmark: a learner on an accelerator, in one run on one device (under 5 minutes).

    python benchmarks/gpu.py [--quick] [--json] [--device cuda|cpu]

1. Codec: int8 encode and decode of a 25M-element float32 N(0, 1) tensor that lives on the device, on the
   device (the payload stays there: `encode_gbs`, `decode_gbs`), against `dst.copy_(src)` of the same
   tensor on the same device: GB/s of float32 input, medians, repetitions interleaved, every call
   synchronized. Then the learner's whole path: encode with the payload brought to host memory
   (`encode_to_host_gbs`), decode of a host payload into a device buffer (`decode_from_host_gbs`), beside
   the link itself (`payload_to_host_gbs`: the payload's bytes copied to pinned host memory).
2. Learners: two `join` processes of the small GPT on the same device, standalone side by side, then the same
   two as a swarm (quorum 2, H = 50, P = 4), then a second swarm, then standalone again (standalone, swarm,
   swarm, standalone: a linear drift favours neither side), after a warm-up swarm that is not counted; tokens/s from their own `done` reports; ratio = the
   swarm phases' mean ÷ the standalone phases' mean (the same contention on the device every time).
3. One outer round: `owner_round_s`, the median over the swarm's owners of their published rounds (deltas
   taken, the outer step, replication, the version pushed to every learner), as each reported it; and
   `network_bytes_per_step`, what a swarm learner sent and received per inner step.
4. Bytes over PCIe: the device's own counters (NVML's PCIe TX and RX throughput, sampled every 20 ms and
   integrated) during each phase. The standalone pair already moves its
   token batches and launches its kernels; what the swarm adds on top, divided by the swarm's outer steps
   (each learner's steps ÷ H), is `pcie_bytes_per_outer_step`, quoted beside the model's fp32 size. Where the
   driver does not give these counters (some virtual machines), the figures are null and the reason is said.
`--device cpu` runs the same on the CPU (a dry run of the script: its figures say nothing about a GPU). The
table goes to stderr; the last line of stdout is one JSON object.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from diloco.protocol import device_int8
from diloco.protocol.codecs import get_codec

NUMEL = 25_000_000
INNER_STEPS = 50  # H of the benchmark's run


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
    """GB/s (float32 input bytes) of int8 encode and decode on `device`, against copy_ there; and the same
    with the payload's trip over PCIe (the learner's path), against a pinned copy of the payload's bytes."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(NUMEL, generator=g).to(device)
    dst = torch.empty_like(x)
    out = torch.empty_like(x)
    codec = get_codec("int8")
    block = codec.block
    payload = device_int8.encode(x, block)
    meta, data = codec.encode(x)  # warm: allocations, kernels, the pinned host cache
    codec.decode(meta, data, out=out)
    host = torch.empty(payload.numel(), dtype=torch.uint8, pin_memory=device.type == "cuda")
    runs = {"encode": lambda: device_int8.encode(x, block),
            "decode": lambda: device_int8.decode(payload, NUMEL, block, out),
            "copy": lambda: dst.copy_(x),
            "encode_to_host": lambda: codec.encode(x),
            "decode_from_host": lambda: codec.decode(meta, data, out=out),
            "payload_to_host": lambda: host.copy_(payload)}
    times: dict[str, list[float]] = {k: [] for k in runs}
    for _ in range(reps):  # interleaved: the same state of the device for each
        for k, fn in runs.items():
            times[k].append(_timed(fn, device))
    med = {k: statistics.median(v) for k, v in times.items()}
    gbs = {k: 4 * NUMEL / t / 1e9 for k, t in med.items() if k != "payload_to_host"}
    encoder = "triton" if device_int8._triton is not None else "torch operations"
    return {"encoder": encoder, "encode_gbs": round(gbs["encode"], 2), "decode_gbs": round(gbs["decode"], 2),
            "copy_gbs": round(gbs["copy"], 2), "encode_vs_copy": round(gbs["encode"] / gbs["copy"], 3),
            "decode_vs_copy": round(gbs["decode"] / gbs["copy"], 3),
            "encode_to_host_gbs": round(gbs["encode_to_host"], 2),
            "decode_from_host_gbs": round(gbs["decode_from_host"], 2),
            # the link itself: the payload's own bytes per second, device to pinned host memory
            "payload_to_host_gbs": round(payload.numel() / med["payload_to_host"] / 1e9, 2)}


class PcieMeter:
    """Integrates NVML's PCIe TX + RX throughput (KB/s over 20 ms windows) of GPU 0 on a sampling thread."""

    def __init__(self) -> None:
        import pynvml  # nvidia-ml-py: on every CUDA machine with a driver

        pynvml.nvmlInit()
        self._nvml = pynvml
        self._handle = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
        self._sample()  # raises NVMLError_NotSupported where the counters are not exposed
        self.bytes = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _sample(self) -> float:
        nv = self._nvml
        kbs = (nv.nvmlDeviceGetPcieThroughput(self._handle, nv.NVML_PCIE_UTIL_TX_BYTES)
               + nv.nvmlDeviceGetPcieThroughput(self._handle, nv.NVML_PCIE_UTIL_RX_BYTES))
        return kbs * 1024.0

    def _run(self) -> None:
        last = time.perf_counter()
        while not self._stop.is_set():
            rate = self._sample()  # each counter read covers the last 20 ms
            now = time.perf_counter()
            self.bytes += rate * (now - last)
            last = now

    def __enter__(self) -> PcieMeter:
        self.bytes = 0.0
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        assert self._thread is not None
        self._thread.join()


def _pcie_meter(device: str) -> tuple[PcieMeter | None, str | None]:
    if device != "cuda":
        return None, "not a CUDA device"
    try:
        return PcieMeter(), None
    except Exception as e:  # no pynvml, or the driver does not expose the counters
        return None, f"{type(e).__name__}: {e}"


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


def _spec(work: Path, name: str) -> Path:
    spec = work / f"{name}.spec"
    subprocess.run([sys.executable, "-m", "diloco.node", "init-run", "--name", name, "--model", "small",
                    "--fragments", "4", "--inner-steps", str(INNER_STEPS), "--quorum", "2",
                    "--key", str(work / "creator.pem"), "--out", str(spec)], check=True, capture_output=True)
    return spec


def _pair(device: str, steps: int, work: Path, phase: int, swarm: bool) -> list[dict]:
    """Two learners side by side on the device: standalone, or a fresh two-learner swarm (its own run)."""
    spec = _spec(work, f"gpu-bench-{phase}")
    common = ["join", "--spec", str(spec), "--device", device, "--steps", str(steps), "--json",
              "--progress-every", "1000000", "--fast-membership"]
    pipes = dict(stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    if not swarm:
        procs = [_cli(*common, "--standalone", "--listen", f"127.0.0.1:{_free_port()}", **pipes) for _ in range(2)]
    else:
        port = _free_port()
        procs = [_cli(*common, "--listen", f"127.0.0.1:{port}", "--key", str(work / f"a{phase}.pem"), **pipes),
                 _cli(*common, "--listen", "127.0.0.1:0", "--key", str(work / f"b{phase}.pem"), "--peers",
                      f"127.0.0.1:{port}", "--wait-for-peers", "60", **pipes)]
    return [_done(p, 600) for p in procs]


def learner_figures(device: str, steps: int, work: Path) -> dict[str, float]:
    """Standalone, swarm, swarm, standalone (so that a drift of the device's clocks or of the machine favours
    neither side); tokens/s of each pair, PCIe bytes of each phase."""
    meter, no_meter = _pcie_meter(device)
    phases = [False, True, True, False]
    _pair(device, steps // 2, work, 99, True)  # warm-up, not counted: the device's clocks, caches, JIT
    runs, pcie_bytes = [], []
    for i, swarm in enumerate(phases):
        with meter or contextlib.nullcontext():
            runs.append(_pair(device, steps, work, i, swarm))
        pcie_bytes.append(meter.bytes if meter else None)

    def rate(d: dict) -> float:
        return d["tokens"] / d["train_s"] if d.get("train_s") else 0.0

    rates = [statistics.fmean(rate(d) for d in pair) for pair in runs]
    standalone = statistics.fmean(r for r, sw in zip(rates, phases, strict=True) if not sw)
    in_swarm = statistics.fmean(r for r, sw in zip(rates, phases, strict=True) if sw)
    swarms = [d for pair, sw in zip(runs, phases, strict=True) if sw for d in pair]
    rounds = [d["owner_round_s"] for d in swarms if d.get("owner_round_s") is not None]
    moved = [sum(v for v in d.get("bytes", {}).values() if isinstance(v, int | float)) / d["steps"] for d in swarms]
    params = swarms[0].get("params")
    pcie = {"pcie_counters": no_meter or "nvml", "pcie_bytes_per_outer_step": None,
            "model_fp32_bytes": 4 * params if params else None}
    if meter is not None:
        alone_b = statistics.fmean(b for b, sw in zip(pcie_bytes, phases, strict=True) if not sw)
        swarm_b = statistics.fmean(b for b, sw in zip(pcie_bytes, phases, strict=True) if sw)
        outer_steps = statistics.fmean(sum(d["steps"] for d in pair) for pair, sw in zip(runs, phases, strict=True)
                                       if sw) / INNER_STEPS  # per swarm phase, both learners
        pcie |= {"pcie_bytes_standalone": round(alone_b), "pcie_bytes_swarm": round(swarm_b),
                 "pcie_bytes_per_outer_step": round((swarm_b - alone_b) / outer_steps)}
    return pcie | {"standalone_tokens_per_s": round(standalone, 1), "swarm_tokens_per_s": round(in_swarm, 1),
                   "swarm_vs_standalone": round(in_swarm / standalone, 3) if standalone else 0.0,
                   "phase_tokens_per_s": [round(r) for r in rates],
                   "owner_round_s": round(statistics.median(rounds), 3) if rounds else None,
                   "network_bytes_per_step": round(statistics.fmean(moved)),
                   "swarm_versions": [d.get("versions") for d in swarms]}


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
    print(json.dumps(result), file=sys.stderr, flush=True)  # (the codec's figures, should the learners fail)
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

"""Benchmark: our tensor codecs against hivemind 1.1.12's and against a plain memory copy, in one run.

    python benchmarks/codecs.py [--quick] [--json]

On one seeded 10M-element float32 N(0, 1) tensor, single-threaded (torch, numba and OpenMP alike):
each of our codecs (`topk` in its sparse form, `encode_delta`: what deltas and updates travel in),
hivemind's FLOAT16 / UNIFORM_8BIT / BLOCKWISE_8BIT (serialize_torch_tensor + SerializeToString, and back),
and `dst.copy_(src)` as the memory-bandwidth limit. Repetitions are interleaved across codecs and reported
as medians. GB/s counts float32 input bytes (4 * numel / s);
ratio = float32 bytes / bytes on the wire (payload + msgpack(meta) for ours, the protobuf for hivemind);
rel_l2 = ||decode(encode(x)) - x|| / ||x||. The table and the targets go to stderr; the last line of
stdout is one JSON object. `--json` prints only that line. It must never time a cold (uncompiled) call.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # bitsandbytes' CPU kernels use OpenMP; one thread for all

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
from collections.abc import Callable  # noqa: E402

import msgpack  # noqa: E402
import torch  # noqa: E402

from diloco.protocol.codecs import get_codec  # noqa: E402

OURS = ["fp32", "fp16", "bf16", "int8", "int4", "topk"]
DENSE = OURS[:5]  # the decode target below applies to these (a sparse decode writes mostly zeros)
TOPK_ENCODE_GBPS = 1.0  # issue 17: the sparse encoder on one core
NUMEL = 10_000_000


def hivemind_pairs() -> dict[str, tuple[Callable, Callable]]:
    """name -> (encode, decode) through hivemind's own serialization; empty if hivemind is missing."""
    try:
        from hivemind.compression import deserialize_torch_tensor, serialize_torch_tensor
        from hivemind.proto import runtime_pb2
    except ImportError as err:
        print(f"hivemind not importable ({err}); skipping its codecs", file=sys.stderr)
        return {}
    kinds = {
        "hivemind_fp16": runtime_pb2.FLOAT16,
        "hivemind_uniform8": runtime_pb2.UNIFORM_8BIT,
        "hivemind_blockwise8": runtime_pb2.BLOCKWISE_8BIT,
    }

    def pair(kind: int) -> tuple[Callable, Callable]:
        def encode(x: torch.Tensor) -> bytes:
            return serialize_torch_tensor(x, kind).SerializeToString()

        def decode(data: bytes) -> torch.Tensor:
            return deserialize_torch_tensor(runtime_pb2.Tensor.FromString(data))

        return encode, decode

    return {name: pair(kind) for name, kind in kinds.items()}


def ours_pair(name: str, out: torch.Tensor) -> tuple[Callable, Callable, Callable]:
    codec = get_codec(name)

    def encode(x: torch.Tensor) -> tuple[dict, bytes]:
        return codec.encode_delta(x)  # (`encode` for every codec but topk)

    def decode(encoded: tuple[dict, bytes]) -> torch.Tensor:
        return codec.decode(*encoded, max_elements=NUMEL, out=out)

    def wire_bytes(encoded: tuple[dict, bytes]) -> int:
        return len(encoded[1]) + len(msgpack.packb(encoded[0]))

    return encode, decode, wire_bytes


def timed(fn: Callable, arg: object) -> tuple[float, object]:
    start = time.perf_counter()
    result = fn(arg)
    return time.perf_counter() - start, result


def run(reps: int) -> dict:
    torch.set_num_threads(1)
    x = torch.randn(NUMEL, generator=torch.Generator().manual_seed(0))
    out = torch.empty(NUMEL)
    codecs: dict[str, tuple[Callable, Callable, Callable]] = {name: ours_pair(name, out) for name in OURS}
    for name, (enc, dec) in hivemind_pairs().items():
        codecs[name] = (enc, dec, len)
    enc_times: dict[str, list[float]] = {name: [] for name in codecs}
    dec_times: dict[str, list[float]] = {name: [] for name in codecs}
    results: dict[str, dict[str, float]] = {}
    for name, (enc, dec, wire_bytes) in codecs.items():  # warm-up: numba compile, lazy imports
        encoded = enc(x)
        decoded = dec(encoded)
        rel = ((decoded.double() - x.double()).norm() / x.double().norm()).item()
        results[name] = {"ratio": 4 * NUMEL / wire_bytes(encoded), "rel_l2": rel}
    dst = torch.empty_like(x)
    copy_times = []
    for _ in range(reps):  # interleaved, so that a noisy neighbour slows every codec alike
        copy_times.append(timed(dst.copy_, x)[0])
        for name, (enc, dec, _) in codecs.items():
            t_enc, encoded = timed(enc, x)
            t_dec, _ = timed(dec, encoded)
            enc_times[name].append(t_enc)
            dec_times[name].append(t_dec)
            del encoded
    gbps = lambda times: 4 * NUMEL / statistics.median(times) / 1e9  # noqa: E731
    for name in codecs:
        results[name] = {
            "encode_gbps": gbps(enc_times[name]),
            "decode_gbps": gbps(dec_times[name]),
            **results[name],
        }
    return {"copy_gbps": gbps(copy_times), "codecs": results}


def targets(report: dict) -> list[tuple[str, bool]]:
    """The targets of the codec issue, each as (statement, met)."""
    c, copy = report["codecs"], report["copy_gbps"]
    checks = [
        (f"{n} decode >= 0.1 x copy ({0.1 * copy:.2f} GB/s)", c[n]["decode_gbps"] >= 0.1 * copy) for n in DENSE
    ]
    checks += [(f"topk encode >= {TOPK_ENCODE_GBPS:g} GB/s", c["topk"]["encode_gbps"] >= TOPK_ENCODE_GBPS),
               ("topk ratio >= 100", c["topk"]["ratio"] >= 100)]
    checks += [
        ("int8 ratio >= 3.9", c["int8"]["ratio"] >= 3.9),
        ("int4 ratio >= 7.5", c["int4"]["ratio"] >= 7.5),
    ]
    checks += [("int4 rel_l2 <= 0.10", c["int4"]["rel_l2"] <= 0.10)]
    hm = c.get("hivemind_blockwise8")
    if hm:
        checks += [
            ("int8 encode >= 3 x hivemind_blockwise8", c["int8"]["encode_gbps"] >= 3 * hm["encode_gbps"]),
            ("int8 decode >= hivemind_blockwise8", c["int8"]["decode_gbps"] >= hm["decode_gbps"]),
            ("int8 rel_l2 <= hivemind_blockwise8", c["int8"]["rel_l2"] <= hm["rel_l2"]),
            ("int4 encode >= 2 x hivemind_blockwise8", c["int4"]["encode_gbps"] >= 2 * hm["encode_gbps"]),
        ]
    return checks


def print_table(report: dict, reps: int) -> None:
    err = sys.stderr
    print(f"codecs on {NUMEL:,} float32 N(0,1) values (seed 0), 1 thread, median of {reps}; GB/s of float32 input",
          file=err)  # fmt: skip
    print(
        f"{'codec':<20} {'encode GB/s':>11} {'decode GB/s':>11} {'ratio':>7} {'rel_l2':>9} {'dec/copy':>9}",
        file=err,
    )
    for name, r in report["codecs"].items():
        print(f"{name:<20} {r['encode_gbps']:>11.3f} {r['decode_gbps']:>11.3f} {r['ratio']:>7.3f} "
              f"{r['rel_l2']:>9.5f} {r['decode_gbps'] / report['copy_gbps']:>9.3f}", file=err)  # fmt: skip
    print(f"{'copy_ (memory limit)':<20} {report['copy_gbps']:>11.3f}", file=err)
    hm = report["codecs"].get("hivemind_blockwise8")
    if hm:
        for name in ("int8", "int4"):
            r = report["codecs"][name]
            print(f"{name} vs hivemind_blockwise8: encode x{r['encode_gbps'] / hm['encode_gbps']:.1f}, "
                  f"decode x{r['decode_gbps'] / hm['decode_gbps']:.1f}, ratio x{r['ratio'] / hm['ratio']:.2f}, "
                  f"rel_l2 x{r['rel_l2'] / hm['rel_l2']:.2f}", file=err)  # fmt: skip
    for statement, met in targets(report):
        print(f"target {'met    ' if met else 'MISSED '} {statement}", file=err)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions (under a minute)")
    parser.add_argument("--json", action="store_true", help="print only the JSON line")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")  # hivemind and bitsandbytes warn about deprecations on every call
    reps = 3 if args.quick else 9
    report = run(reps)
    if not args.json:
        print_table(report, reps)
    print(json.dumps(report))


if __name__ == "__main__":
    main()

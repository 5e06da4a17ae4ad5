"""The `topk` codec (protocol/sparse.py, docs/protocol.md §6 `topk`) and the sparse path through the owner and
the replica's audit: what the sparse form keeps, that error feedback delivers what it drops, that every
receiver decodes the same bits, that malformed payloads raise only the codec's typed errors, checked before
anything is allocated."""

from __future__ import annotations

import hashlib
import subprocess
import sys

import msgpack
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from diloco.protocol.codecs import ErrorFeedback, get_codec
from diloco.protocol.errors import Malformed, ProtocolError, TooLarge
from diloco.protocol.sparse import TopkCodec, sparse_size

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
TOPK = get_codec("topk")


def gaussian(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


def reference_decode(meta: dict, payload: bytes) -> torch.Tensor:
    """docs/protocol.md §6 `topk`, read literally: codebooks, then LSB-first entries, each the Rice-coded gap
    since the index before it (r = floor(log2(n / e)): ones, a zero, r bits) and a code of `bits` bits."""
    numel = int(np.prod(meta["shape"], dtype=np.int64)) if meta["shape"] else 1
    chunk, k, bits = meta["chunk"], meta["k"], meta["bits"]
    levels = 1 << (bits - 1)
    nchunks = -(-numel // chunk)
    books = np.frombuffer(payload, np.uint16, count=levels * nchunks)
    tail = payload[2 * levels * nchunks :]
    stream = int.from_bytes(tail, "little")
    out = np.zeros(numel, np.float32)
    at = 0

    def take(width: int) -> int:
        nonlocal at
        value = (stream >> at) & ((1 << width) - 1)
        at += width
        return value

    for j in range(nchunks):
        n = min(chunk, numel - j * chunk)
        e = min(k, n)
        r = int(np.floor(np.log2(n / e)))
        index = -1
        for _ in range(e):
            q = 0
            while take(1):
                q += 1
            index += 1 + (q << r) + take(r)
            code = take(bits)
            assert index < n
            value = np.array([int(books[j * levels + (code & (levels - 1))]) << 16], np.uint32).view(np.float32)[0]
            out[j * chunk + index] = -value if code >> (bits - 1) else value
    assert len(tail) == -(-at // 8) and stream >> at == 0  # the stream ends with the last entry's byte
    return torch.from_numpy(out).view(meta["shape"])


# --- what the sparse form keeps -----------------------------------------------------------------------------


@pytest.mark.parametrize(("chunk", "k", "bits"), [(4096, 64, 2), (1024, 16, 1), (256, 8, 4), (64, 64, 3), (2, 1, 2)])
@pytest.mark.parametrize("numel", [1, 7, 1000, 4096, 10_001])
def test_sparse_form_keeps_the_k_largest_magnitudes_of_each_chunk_with_their_signs(chunk, k, bits, numel) -> None:
    codec = TopkCodec(chunk, k, bits)
    x = gaussian(numel, seed=numel)
    meta, payload = codec.encode_delta(x)
    meta = msgpack.unpackb(msgpack.packb(meta))  # meta survives the wire
    assert len(payload) <= codec.delta_size(numel) == sparse_size(numel, chunk, k, bits)
    y = codec.decode(meta, payload)
    assert torch.equal(y, reference_decode(meta, bytes(payload)))
    for lo in range(0, numel, chunk):
        xs, ys = x[lo : lo + chunk], y[lo : lo + chunk]
        kept = torch.topk(xs.abs(), min(k, xs.numel())).indices
        assert set(torch.nonzero(ys).flatten().tolist()) == set(kept.tolist())  # (no ties in Gaussian data)
        assert torch.equal(torch.sign(ys[kept]), torch.sign(xs[kept]))
        # each kept value decodes to a codebook magnitude between the smallest and largest kept (bf16-rounded)
        lo_mag, hi_mag = xs.abs()[kept].min().item(), xs.abs()[kept].max().item()
        assert ys[kept].abs().min().item() >= lo_mag * (1 - 2**-8) and ys[kept].abs().max().item() <= hi_mag * (1 + 2**-8)


def test_the_selection_is_exact_when_the_scale_changes_from_chunk_to_chunk() -> None:
    """The first pass gathers candidates from the bin the chunk before used: up, down or the same."""
    scales = torch.tensor([1.0, 1e3, 1e-3, 1e-3, 4.0, 0.5, 1e6, 1e6, 2.0, 0.0, 1.0, 1e-30])
    x = (gaussian(64 * 12, seed=5).view(12, 64) * scales[:, None]).reshape(-1)
    x[64 * 10 : 64 * 10 + 32] = 3.0  # ties across a chunk's threshold
    codec = TopkCodec(64, 12, 3)
    y = codec.decode(*codec.encode_delta(x))
    for j in range(12):
        xs, ys = x[64 * j : 64 * (j + 1)], y[64 * j : 64 * (j + 1)]
        order = sorted(range(64), key=lambda i: (-abs(xs[i].item()), i))[:12]
        assert set(torch.nonzero(ys).flatten().tolist()) == {i for i in order if xs[i] != 0}, j


def test_more_value_bits_decode_the_kept_values_closer() -> None:
    x = gaussian(1 << 16)
    errors = []
    for bits in (1, 2, 3, 4):
        codec = TopkCodec(4096, 64, bits)
        y = codec.decode(*codec.encode_delta(x))
        kept = y != 0
        errors.append(((y - x)[kept].norm() / x[kept].norm()).item())
    assert errors == sorted(errors, reverse=True) and errors[-1] < 0.05


def test_ties_go_to_the_lowest_index_and_zeros_decode_to_zero() -> None:
    x = torch.ones(100)
    codec = TopkCodec(64, 5, 2)
    y = codec.decode(*codec.encode_delta(x))
    assert torch.nonzero(y).flatten().tolist() == [0, 1, 2, 3, 4, 64, 65, 66, 67, 68]
    assert torch.equal(codec.decode(*codec.encode_delta(torch.zeros(5000))), torch.zeros(5000))


def test_sparse_form_of_the_default_codec_is_18x_below_int8_at_most_and_about_29x_below_it_on_gaussian_data() -> None:
    # 4 codebook bytes + 128 entries of at most 1 + 5 + 2 bits + 3968 >> 5 quotient bits per 4096 elements
    assert TOPK.delta_size(1 << 20) == 256 * 4 + 256 * (128 * 8 + 124) // 8
    assert get_codec("int8").encoded_size(1 << 20) / TOPK.delta_size(1 << 20) > 18
    _, payload = TOPK.encode_delta(gaussian(1 << 20))
    assert 28 < get_codec("int8").encoded_size(1 << 20) / len(payload) < 30  # gaps of ~32: ~7 bits per index


@FUZZ
@given(log2_chunk=st.integers(1, 12), k_frac=st.floats(0.0, 1.0), bits=st.integers(1, 8),
       numel=st.integers(1, 9000), where=st.sampled_from(["start", "end", "spread", "random"]))
def test_no_encoding_is_longer_than_the_size_the_meta_allows(log2_chunk, k_frac, bits, numel, where) -> None:
    """The largest size bounds every encoding (the encoder writes into a buffer of that size), whichever
    coordinates are kept: bunched at the start or the end of each chunk (one long gap), or spread out."""
    chunk = 1 << log2_chunk
    k = max(1, min(chunk, round(k_frac * chunk)))
    pos = torch.arange(numel) % chunk
    x = {"start": -pos.float(), "end": pos.float(), "spread": (pos % max(chunk // k, 1) == 0).float(),
         "random": gaussian(numel, seed=numel)}[where] + 1.0
    codec = TopkCodec(chunk, k, bits)
    meta, payload = codec.encode_delta(x)
    assert len(payload) <= codec.delta_size(numel)
    assert torch.equal(codec.decode(meta, payload), reference_decode(meta, bytes(payload)))


def test_the_size_bound_and_the_kernels_take_the_same_rice_parameter() -> None:
    from diloco.protocol import _topk_kernels as TK
    from diloco.protocol.sparse import rice_param

    for n in range(1, 300):
        for entries in range(1, n + 1):
            assert rice_param(n, entries) == TK.rice_param(n, entries), (n, entries)


def test_encode_gives_the_dense_form_int8_layout_under_the_topk_name() -> None:
    x = gaussian(3000)
    meta, payload = TOPK.encode(x)
    int8_meta, int8_payload = get_codec("int8").encode(x)
    assert meta == {**int8_meta, "codec": "topk"} and bytes(payload) == bytes(int8_payload)
    assert torch.equal(TOPK.decode(meta, payload), get_codec("int8").decode(int8_meta, int8_payload))
    assert TOPK.check(meta, payload) == 3000
    assert TOPK.encoded_size(3000) == len(payload)  # the larger form bounds every payload


@pytest.mark.parametrize("shape", [(), (1,), (0,), (3, 0), (5, 7)])
def test_sparse_form_keeps_odd_shapes(shape: tuple) -> None:
    x = torch.full(shape, -2.75)
    meta, payload = TOPK.encode_delta(x)
    y = TOPK.decode(meta, payload)
    assert y.shape == x.shape and torch.allclose(y, x, rtol=2**-8)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_sparse_encode_refuses_non_finite_values(bad: float) -> None:
    x = gaussian(9000)
    x[8999] = bad
    with pytest.raises(Malformed, match="non-finite"):
        TOPK.encode_delta(x)


def test_huge_and_tiny_magnitudes_keep_their_relative_size() -> None:
    for scale in (1e30, 1e-30, 3.3e38):
        x = gaussian(5000).clamp(-4, 4) * (scale / 5)
        y = TOPK.decode(*TOPK.encode_delta(x))
        kept = y != 0
        err = (y.double() - x.double())[kept].norm() / x.double()[kept].norm()
        assert bool(torch.isfinite(y).all()) and err.item() < 0.3


# --- error feedback ------------------------------------------------------------------------------------------


def test_error_feedback_delivers_what_the_sparse_form_drops() -> None:
    """Σ decoded tracks Σ sent: their difference is exactly the residual, which stays bounded (it does not grow
    with the steps), so the relative error of the sum goes to zero; without feedback it does not."""
    feedback = ErrorFeedback("topk")
    n, sum_in, sum_ef, sum_plain = 8192, torch.zeros(8192), torch.zeros(8192), torch.zeros(8192)
    gaps = []
    for step in range(400):
        x = gaussian(n, seed=step) * 0.01 + 0.002 * torch.linspace(-1, 1, n)  # noise around a steady direction
        sum_in += x
        meta, payload = feedback.encode("w", x)
        assert "chunk" in meta and len(payload) <= TOPK.delta_size(n)  # error feedback sends the sparse form
        sum_ef += TOPK.decode(meta, payload)
        sum_plain += TOPK.decode(*TOPK.encode_delta(x))
        assert torch.allclose(sum_in - sum_ef, feedback.residual("w"), atol=1e-4)
        gaps.append((sum_in - sum_ef).norm().item())
    assert max(gaps[300:]) < 1.5 * max(gaps[100:200])  # bounded: the residual stops growing
    assert gaps[-1] / sum_in.norm().item() < 0.15
    assert (sum_in - sum_plain).norm() > 5 * (sum_in - sum_ef).norm()


# --- the same bits on every receiver ----------------------------------------------------------------------------


def test_encode_and_decode_are_deterministic_across_processes() -> None:
    """Every learner decodes an update to the same bits, so Θ + decode(U) hashes alike everywhere; the encoder
    too gives the same bytes for the same tensor (in a fresh process: nothing cached or shared)."""
    x = gaussian(50_000, seed=3) * 1e-3
    meta, payload = TOPK.encode_delta(x)
    digest = hashlib.sha256(TOPK.decode(meta, payload).numpy().tobytes()).hexdigest()
    code = (
        "import hashlib, torch; from diloco.protocol.codecs import get_codec; c = get_codec('topk');"
        "x = torch.randn(50_000, generator=torch.Generator().manual_seed(3)) * 1e-3; m, p = c.encode_delta(x);"
        "print(hashlib.sha256(bytes(p)).hexdigest(), hashlib.sha256(c.decode(m, p).numpy().tobytes()).hexdigest())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == [hashlib.sha256(bytes(payload)).hexdigest(), digest]
    again = TOPK.decode(meta, payload, out=torch.full((50_000,), 7.0))
    assert hashlib.sha256(again.numpy().tobytes()).hexdigest() == digest  # `out`'s old values play no part


# --- malformed payloads: typed errors, checked before decoding -------------------------------------------------


def small() -> tuple[dict, bytes]:
    codec = TopkCodec(64, 4, 2)
    meta, payload = codec.encode_delta(gaussian(100))  # 2 chunks: 64 + 36 elements, 4 entries each
    return meta, bytes(payload)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"codec": "int8"}, "names codec"),
        ({"chunk": 48}, "power of two"),
        ({"chunk": 1 << 17}, "power of two"),
        ({"chunk": True}, "power of two"),
        ({"k": 0}, "'k'"),
        ({"k": 65}, "'k'"),
        ({"k": 4.0}, "'k'"),
        ({"bits": 0}, "'bits'"),
        ({"bits": 9}, "'bits'"),
        ({"block": 512}, "one form only"),
        ({"shape": [130]}, "past the end of its chunk"),  # (other chunk sizes: the gaps read otherwise)
        ({"shape": [100_000]}, "payload is"),
        ({"shape": "100"}, "shape"),
    ],
)
def test_malformed_meta_is_refused_with_one_line(change: dict, message: str) -> None:
    meta, payload = small()
    with pytest.raises(Malformed, match=message):
        TOPK.decode({**meta, **change}, payload)
    with pytest.raises(Malformed, match=message):
        TOPK.check({**meta, **change}, payload)


def test_meta_without_either_form_is_refused() -> None:
    meta, payload = small()
    with pytest.raises(Malformed, match="the dense form"):
        TOPK.decode({"codec": "topk", "shape": meta["shape"], "chunk": 64}, payload)
    with pytest.raises(Malformed, match="must be a map"):
        TOPK.decode([1, 2], payload)  # type: ignore[arg-type]


def test_the_payload_length_is_bounded_by_the_meta_and_exactly_what_the_entries_take() -> None:
    meta, payload = small()
    for bad, message in ((payload[:-1], "ends inside an entry"), (payload + b"\0", "nothing follow"),
                         (b"", "payload is"), (payload + bytes(64), "payload is")):
        with pytest.raises(Malformed, match=message):
            TOPK.decode(meta, bad)


@pytest.mark.parametrize("book", [0x7F80, 0x7FC0, 0x8000, 0xBF80])  # inf, NaN, -0, -1
def test_codebook_magnitudes_must_be_finite_and_non_negative(book: int) -> None:
    meta, payload = small()
    bad = np.array([book], np.uint16).tobytes() + payload[2:]
    with pytest.raises(Malformed, match="codebook"):
        TOPK.check(meta, bad)


def _with_entries(payload: bytes, chunks: list[list[tuple[int, int]]], pad: int = 0) -> bytes:
    """`small()`'s payload with its entries replaced by (gap, code) pairs per chunk, packed as docs/protocol.md §6
    says (r = 4 in the 64-element chunk, 3 in the 36-element one), then `pad` as the padding bits."""
    books = 2 * 2 * 2  # 2 chunks x 2 levels x 2 bytes
    stream, at = 0, 0
    for r, entries in zip((4, 3), chunks, strict=True):
        for gap, code in entries:
            q = gap >> r
            stream |= ((1 << q) - 1 | (gap & ((1 << r) - 1)) << (q + 1) | code << (q + 1 + r)) << at
            at += q + 1 + r + 2
    stream |= pad << at
    return payload[:books] + stream.to_bytes(-(-at // 8), "little")


GOOD = [[(0, 1), (0, 2), (0, 3), (60, 0)], [(0, 0), (0, 0), (0, 0), (32, 3)]]  # indices 0 1 2 63 and 0 1 2 35


def test_entries_decode_at_their_gaps_and_one_past_its_chunk_is_refused() -> None:
    meta, payload = small()
    good = _with_entries(payload, GOOD)
    assert TOPK.check(meta, good) == 100
    y = TOPK.decode(meta, good)
    assert torch.equal(y, reference_decode(meta, good))
    assert torch.nonzero(y).flatten().tolist() == [0, 1, 2, 63, 64, 65, 66, 99]
    for bad in ([[(0, 1), (0, 2), (0, 3), (61, 0)], GOOD[1]],  # index 64 of a 64-element chunk
                [GOOD[0], [(0, 0), (0, 0), (0, 0), (33, 3)]],  # index 36 of the last chunk's 36
                [[(61, 0), (0, 0), (0, 0), (0, 0)], GOOD[1]]):  # 61, 62, 63, then 64
        for read in (TOPK.check, TOPK.decode):
            with pytest.raises(Malformed, match="past the end of its chunk"):
                read(meta, _with_entries(payload, bad))


def test_padding_bits_after_the_last_entry_must_be_zero() -> None:
    meta, payload = small()
    bits = sum(gap // 16 + 7 for gap, _ in GOOD[0]) + sum(gap // 8 + 6 for gap, _ in GOOD[1])
    assert bits % 8, "the example needs padding bits"
    assert TOPK.check(meta, _with_entries(payload, GOOD)) == 100
    with pytest.raises(Malformed, match="padding"):
        TOPK.check(meta, _with_entries(payload, GOOD, pad=1))


def test_size_limits_are_checked_before_anything_is_allocated() -> None:
    meta, payload = small()
    with pytest.raises(TooLarge):
        TOPK.decode({**meta, "shape": [1 << 40]}, payload)
    with pytest.raises(TooLarge):
        TOPK.check(meta, payload, max_elements=99)
    with pytest.raises(ValueError, match="out must be"):
        TOPK.decode(meta, payload, out=torch.empty(99))


@FUZZ
@given(data=st.data())
def test_decoding_mutated_meta_or_bytes_only_raises_protocol_errors_and_never_a_non_finite_value(data) -> None:
    chunk = data.draw(st.sampled_from([2, 16, 64, 4096]))
    codec = TopkCodec(chunk, data.draw(st.integers(1, chunk)), data.draw(st.integers(1, 4)))
    meta, payload = codec.encode_delta(gaussian(data.draw(st.integers(0, 300)), seed=1))
    payload = bytearray(payload)
    for _ in range(data.draw(st.integers(0, 4))):
        if payload:
            payload[data.draw(st.integers(0, len(payload) - 1))] = data.draw(st.integers(0, 255))
    if data.draw(st.booleans()):
        key = data.draw(st.sampled_from(["chunk", "k", "bits", "shape", "block", "codec"]))
        meta = {**meta, key: data.draw(st.one_of(st.integers(-2, 1 << 17), st.text(max_size=3), st.none(),
                                                  st.lists(st.integers(0, 400), max_size=3)))}
    try:
        n = TOPK.check(meta, bytes(payload), max_elements=1 << 16)
    except ProtocolError as e:
        assert isinstance(e, Malformed | TooLarge)
        return
    y = TOPK.decode(meta, bytes(payload), max_elements=1 << 16)  # what check passed, decode decodes
    assert y.numel() == n and bool(torch.isfinite(y).all())


@FUZZ
@given(st.binary(max_size=300), st.integers(0, 600))
def test_arbitrary_bytes_never_crash_the_decoder(data: bytes, numel: int) -> None:
    meta = {"codec": "topk", "shape": [numel], "chunk": 64, "k": 8, "bits": 2}
    try:
        y = TOPK.decode(meta, data)
    except ProtocolError as e:
        assert isinstance(e, Malformed | TooLarge)
    else:
        assert bool(torch.isfinite(y).all())

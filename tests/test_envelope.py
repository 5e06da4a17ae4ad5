import asyncio
import hashlib
import struct

import blake3
import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from diloco.protocol import canonical
from diloco.protocol.envelope import (
    DOMAIN,
    MAX_HEADER_BYTES,
    PROTOCOL_VERSION,
    EnvelopeVerifier,
    max_frame_size,
    payload_digest_of,
    register_kind,
    seal,
)
from diloco.protocol.errors import (
    BadSignature,
    Expired,
    Malformed,
    NotMember,
    ProtocolError,
    Replayed,
    TooLarge,
    WrongRun,
)
from diloco.protocol.identity import Identity

RUN = hashlib.sha256(b"run").digest()
OTHER_RUN = hashlib.sha256(b"other").digest()
register_kind("test.small", 1024)

SENDER = Identity.generate()


def frame(payload=b"hello", kind="test.small", run=RUN, fields=None, **kw):
    return seal(SENDER, kind, run, fields or {"p": 3, "v": [1, 2]}, payload, **kw).to_bytes()


async def chunked(data: bytes, size: int):
    for i in range(0, len(data), size):
        yield data[i : i + size]


def read(verifier, data, size=7, content_length=None):
    return asyncio.run(verifier.read(chunked(data, size), content_length=content_length))


def test_sealed_envelope_opens_with_every_field_intact():
    env = EnvelopeVerifier(RUN).open(frame(b"xyz", fields={"p": 1}))
    assert env.kind == "test.small" and env.run_id == RUN and env.sender == SENDER.public_key
    assert env.fields == {"p": 1} and bytes(env.payload) == b"xyz"
    assert env.sender_id == SENDER.peer_id


@pytest.mark.parametrize("chunk", [1, 3, 64, 10_000])
def test_streamed_envelope_verifies_at_any_chunk_size(chunk):
    data = frame(b"p" * 900)
    env = read(EnvelopeVerifier(RUN), data, chunk, content_length=len(data))
    assert bytes(env.payload) == b"p" * 900


def test_a_received_frame_is_handed_on_as_received_and_a_writable_one_is_copied():
    # (a kept update's frame is its received buffer: no second fragment-sized buffer per update)
    data = frame(b"q" * 900)
    streamed = read(EnvelopeVerifier(RUN), data, 64, content_length=len(data))
    assert bytes(streamed.frame()) == data and streamed.frame() is streamed.frame()
    assert np.shares_memory(np.frombuffer(streamed.frame(), np.uint8), np.frombuffer(streamed.payload, np.uint8))
    opened = EnvelopeVerifier(RUN).open(data)
    assert np.shares_memory(np.frombuffer(opened.frame(), np.uint8), np.frombuffer(data, np.uint8))
    writable = bytearray(data)
    kept = EnvelopeVerifier(RUN).open(writable).frame()
    writable[-1] ^= 1
    assert bytes(kept) == data
    assert bytes(seal(SENDER, "test.small", RUN, {}, b"r" * 10).frame())[-10:] == b"r" * 10


def test_relayed_envelope_is_byte_identical():
    env = EnvelopeVerifier(RUN).open(frame())
    assert env.prefix() + bytes(env.payload) == env.to_bytes()
    assert EnvelopeVerifier(RUN).open(env.to_bytes()).fields == env.fields


def test_tampered_header_fails_signature():
    data = bytearray(frame())
    i = data.index(msgpack.packb("fields")) + 8
    data[i] ^= 1
    with pytest.raises((BadSignature, Malformed)):
        EnvelopeVerifier(RUN).open(bytes(data))


def test_tampered_payload_fails_digest_and_releases_nonce():
    good = frame(b"payload")
    bad = good[:-1] + b"X"
    v = EnvelopeVerifier(RUN)
    with pytest.raises(BadSignature, match="digest"):
        v.open(bad)
    with pytest.raises(BadSignature, match="digest"):
        read(v, bad)
    assert bytes(v.open(good).payload) == b"payload"  # the failed copies did not burn the nonce


def test_signature_by_another_key_is_bad_signature():
    env = seal(SENDER, "test.small", RUN, {}, b"")
    forged = struct.pack(">I", len(env.header)) + env.header + Identity.generate().sign(DOMAIN + env.header)
    with pytest.raises(BadSignature):
        EnvelopeVerifier(RUN).open(forged)


def test_same_message_twice_is_replayed():
    data = frame()
    v = EnvelopeVerifier(RUN)
    v.open(data)
    with pytest.raises(Replayed):
        v.open(data)
    with pytest.raises(Replayed):
        read(v, data)


def test_timestamp_outside_skew_is_expired():
    now = 1_000_000.0
    v = EnvelopeVerifier(RUN, max_skew_s=30, clock=lambda: now)
    v.open(frame(now_ms=int((now - 29) * 1000)))
    with pytest.raises(Expired, match="NTP"):
        v.open(frame(now_ms=int((now - 31) * 1000)))
    with pytest.raises(Expired):
        v.open(frame(now_ms=int((now + 31) * 1000)))


def test_wrong_run_is_refused():
    with pytest.raises(WrongRun, match="run"):
        EnvelopeVerifier(RUN).open(frame(run=OTHER_RUN))


def test_non_member_is_refused_before_its_signature_costs_a_verification():
    v = EnvelopeVerifier(RUN, is_member=lambda pk: pk != SENDER.public_key)
    with pytest.raises(NotMember, match=SENDER.peer_id):
        v.open(frame())
    env = seal(SENDER, "test.small", RUN, {}, b"")
    bad_signature = struct.pack(">I", len(env.header)) + env.header + bytes(64)
    with pytest.raises(NotMember):  # not BadSignature: the signature was never looked at
        v.open(bad_signature)
    with pytest.raises(BadSignature):
        EnvelopeVerifier(RUN).open(bad_signature)


def test_payload_over_kind_limit_is_too_large_before_reading():
    register_kind("test.tiny", 4)
    with pytest.raises(TooLarge):
        seal(SENDER, "test.tiny", RUN, {}, b"12345")
    env = seal(SENDER, "test.small", RUN, {}, b"12345")
    register_kind("test.small", 4)
    try:
        with pytest.raises(TooLarge):
            EnvelopeVerifier(RUN).open(env.to_bytes())
    finally:
        register_kind("test.small", 1024)


def test_content_length_over_any_limit_is_refused_before_reading():
    async def never():
        raise AssertionError("must not read")
        yield b""

    with pytest.raises(TooLarge):
        asyncio.run(EnvelopeVerifier(RUN).read(never(), content_length=max_frame_size() + 1))


def test_header_length_prefix_over_limit_is_too_large():
    data = struct.pack(">I", MAX_HEADER_BYTES + 1) + b"\0" * 100
    with pytest.raises(TooLarge):
        EnvelopeVerifier(RUN).open(data)
    with pytest.raises(TooLarge):
        read(EnvelopeVerifier(RUN), data)


def test_truncated_and_extended_payloads_are_malformed():
    data = frame(b"abcdef")
    with pytest.raises(Malformed, match="ended"):
        read(EnvelopeVerifier(RUN), data[:-2])
    with pytest.raises(Malformed, match="longer"):
        read(EnvelopeVerifier(RUN), data + b"zz")
    with pytest.raises(Malformed):
        EnvelopeVerifier(RUN).open(data[:-2])


def test_content_length_mismatch_is_malformed():
    data = frame()
    with pytest.raises(Malformed, match="Content-Length"):
        read(EnvelopeVerifier(RUN), data, content_length=len(data) + 1)


@pytest.mark.parametrize("chunk", [1, 5, 64, 10_000])
def test_a_trailer_the_header_announces_is_read_after_the_frame_unhashed_and_checked_for_its_length(chunk):
    def trailer(fields):
        if not isinstance(fields.get("t"), int) or fields["t"] < 0:
            raise Malformed("bad trailer length")
        return fields["t"]

    def body_read(data, content_length=None, max_trailer=100, verifier=None):
        return asyncio.run((verifier or EnvelopeVerifier(RUN)).read(
            chunked(data, chunk), content_length=content_length, trailer=trailer, max_trailer=max_trailer))

    env = seal(SENDER, "test.small", RUN, {"t": 7}, b"payload!")
    data = env.to_bytes() + b"TRAILER"
    got = body_read(data, len(data))
    assert bytes(got.payload) == b"payload!" and bytes(got.trailer) == b"TRAILER"
    assert bytes(got.frame()) == env.to_bytes() and got.payload_digest == blake3.blake3(b"payload!").digest()
    opened = EnvelopeVerifier(RUN).open(data, trailing=True)
    assert bytes(opened.payload) == b"payload!" and bytes(opened.trailer) == b"TRAILER"
    with pytest.raises(Malformed):  # (bytes after the payload, where none are expected)
        EnvelopeVerifier(RUN).open(data)
    with pytest.raises(Malformed, match="trailer"):
        body_read(data[:-1])
    with pytest.raises(Malformed, match="longer"):
        body_read(data + b"!")
    with pytest.raises(Malformed, match="Content-Length"):
        body_read(data, len(data) - 1)
    with pytest.raises(TooLarge):
        body_read(data, max_trailer=6)
    with pytest.raises(TooLarge):  # (over the route's whole limit: refused on Content-Length, before reading)
        asyncio.run(EnvelopeVerifier(RUN).read(chunked(b"", 1), content_length=max_frame_size() + 101,
                                               trailer=trailer, max_trailer=100))
    with pytest.raises(Malformed, match="bad trailer"):
        body_read(seal(SENDER, "test.small", RUN, {"t": -1}, b"x").to_bytes())
    tampered = bytearray(data)
    tampered[-8] ^= 1  # the payload's last byte: signed, unlike the trailer's
    with pytest.raises(BadSignature):
        body_read(bytes(tampered))


def test_non_canonical_header_is_malformed():
    env = seal(SENDER, "test.small", RUN, {"b": 1, "a": 2}, b"")
    h = msgpack.unpackb(env.header)
    reordered = msgpack.packb(dict(reversed(list(h.items()))), use_bin_type=True)
    assert reordered != env.header
    data = struct.pack(">I", len(reordered)) + reordered + SENDER.sign(DOMAIN + reordered)
    with pytest.raises(Malformed, match="canonical"):
        EnvelopeVerifier(RUN).open(data)


def test_header_with_missing_or_extra_fields_is_malformed():
    env = seal(SENDER, "test.small", RUN, {}, b"")
    h = canonical.unpackb(env.header)
    for mutate in (lambda d: d.pop("nonce"), lambda d: d.__setitem__("extra", 1),
                   lambda d: d.__setitem__("nonce", b"short"), lambda d: d.__setitem__("v", 99)):
        d = dict(h)
        mutate(d)
        hb = canonical.packb(d)
        data = struct.pack(">I", len(hb)) + hb + SENDER.sign(DOMAIN + hb)
        with pytest.raises(Malformed):
            EnvelopeVerifier(RUN).open(data)


def _resealed(env, version: int, digest: bytes, signer: Identity = SENDER) -> bytes:
    """`env`'s frame with its header's version and payload digest replaced, signed again by `signer`."""
    h = canonical.unpackb(env.header)
    h["v"], h["payload_digest"] = version, digest
    hb = canonical.packb(h)
    return struct.pack(">I", len(hb)) + hb + signer.sign(DOMAIN + hb) + bytes(env.payload)


@pytest.mark.parametrize("chunk", [3, 10_000])
def test_version_2_digests_payloads_with_blake3_and_version_1_frames_with_sha256_are_still_read(chunk):
    payload = b"a payload of some length" * 10
    env = seal(SENDER, "test.small", RUN, {"p": 1}, payload)
    assert env.version == PROTOCOL_VERSION == 2
    assert env.payload_digest == blake3.blake3(payload).digest() == payload_digest_of(payload)
    old = _resealed(env, 1, hashlib.sha256(payload).digest())  # what a peer of protocol 1 sent and kept
    for frame_ in (env.to_bytes(), old):
        assert bytes(EnvelopeVerifier(RUN).open(frame_).payload) == payload
        assert bytes(read(EnvelopeVerifier(RUN), frame_, size=chunk).payload) == payload
    assert EnvelopeVerifier(RUN).open(old).version == 1
    assert payload_digest_of(payload, 1) == hashlib.sha256(payload).digest()
    fp32 = np.arange(12, dtype=np.float32).reshape(3, 4)  # a tensor's memory (a momentum, full form) hashes as its bytes
    assert payload_digest_of(fp32) == blake3.blake3(fp32.tobytes()).digest()
    assert payload_digest_of(fp32, 1) == hashlib.sha256(fp32.tobytes()).digest()
    # each version's digest is checked with its own hash: the other one's digest does not pass
    for wrong in (_resealed(env, 1, blake3.blake3(payload).digest()),
                  _resealed(env, 2, hashlib.sha256(payload).digest())):
        with pytest.raises(BadSignature):
            EnvelopeVerifier(RUN).open(wrong)
        with pytest.raises(BadSignature):
            read(EnvelopeVerifier(RUN), wrong, size=chunk)
    for unknown in (0, 3):
        with pytest.raises(Malformed, match=f"protocol version {unknown} not supported .*reads 1, 2 and sends 2"):
            EnvelopeVerifier(RUN).open(_resealed(env, unknown, blake3.blake3(payload).digest()))


def test_canonical_refuses_ext_types_and_trailing_bytes():
    with pytest.raises(Malformed):
        canonical.unpackb(msgpack.packb(msgpack.ExtType(5, b"x")))
    with pytest.raises(Malformed):
        canonical.unpackb(canonical.packb({"a": 1}) + b"\0")
    with pytest.raises(Malformed):
        canonical.packb({1: 2})


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(st.binary(max_size=400))
def test_random_bytes_only_raise_protocol_errors(data):
    with pytest.raises(ProtocolError):
        EnvelopeVerifier(RUN).open(data)
    with pytest.raises(ProtocolError):
        read(EnvelopeVerifier(RUN), data, 5)


VALID = frame(b"0123456789", fields={"p": 2, "tokens": 1000, "name": "x"})


@settings(max_examples=400, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, len(VALID) - 1), st.integers(0, 255)), min_size=1, max_size=4),
    st.integers(-5, 5),
)
def test_mutated_envelopes_only_raise_protocol_errors(edits, resize):
    data = bytearray(VALID)
    for i, b in edits:
        data[i] = b
    if resize < 0:
        data = data[:resize]
    else:
        data += b"\x07" * resize
    data = bytes(data)
    for attempt in (lambda: EnvelopeVerifier(RUN).open(data), lambda: read(EnvelopeVerifier(RUN), data, 9)):
        try:
            env = attempt()
        except ProtocolError:
            continue
        assert env.to_bytes() == VALID  # only a no-op mutation may pass


def test_the_replay_cache_forgets_expired_pairs_as_time_passes_not_only_when_full():
    from diloco.protocol.envelope import ReplayCache

    cache = ReplayCache(max_entries=1_000_000)
    for i in range(1000):  # a minute of traffic, each pair valid for 60 s after its timestamp
        cache.reserve(i.to_bytes(4, "big"), expires_at=100.0 + i * 0.06 + 60, now=100.0 + i * 0.06)
    assert len(cache) == 1000
    cache.reserve(b"later", expires_at=400.0 + 60, now=400.0)  # minutes later: the old pairs are gone
    assert len(cache) == 1
    with pytest.raises(Replayed):
        cache.reserve(b"later", expires_at=401.0 + 60, now=401.0)  # a pair still valid is still refused


def test_envelopes_never_fill_the_signature_cache_and_repeated_records_hit_it():
    """Every envelope has its own nonce, so remembering its verification only grows the memory (it once
    grew a learner by ~20 MiB over its first minutes); DHT records come back unchanged and are remembered."""
    import time

    from diloco.protocol.dht.records import ValueRecord
    from diloco.protocol.identity import VERIFIED

    VERIFIED.clear()
    verifier = EnvelopeVerifier(RUN)
    for i in range(50):
        verifier.open(frame(b"x" * i))
    assert len(VERIFIED) == 0
    record = ValueRecord.create(SENDER, "run:x:members", b"value", time.time() + 60, SENDER.peer_id)
    for _ in range(5):
        ValueRecord.from_wire(record.to_wire())
    assert len(VERIFIED) == 1 and VERIFIED.hits == 4
    forged = record.to_wire() | {"value": b"other"}  # same signer and signature, another message: checked
    with pytest.raises(BadSignature):
        ValueRecord.from_wire(forged)


def test_the_signature_cache_holds_its_digests_in_fixed_memory():
    import hashlib
    import tracemalloc

    from diloco.protocol.identity import DigestCache

    digests = [hashlib.sha256(str(i).encode()).digest() for i in range(2000)]
    cache = DigestCache(64)
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for d in digests:
        cache.add(d)
        assert d in cache  # the newest digest is always held
    grown = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    assert grown < 1024  # 2000 additions allocate nothing that stays
    held = [d for d in digests if d in cache]
    assert 0 < len(held) <= 64 and len(cache) == len(held)
    assert digests[-1] in held
    same_slot = next(d for d in digests if d != digests[-1] and cache._at(d) == cache._at(digests[-1]))
    assert same_slot not in cache  # a collision pushes the older digest out
    with pytest.raises(ValueError):
        cache.add(b"short")
    cache.clear()
    assert len(cache) == 0 and digests[-1] not in cache


def test_a_repeated_verification_with_a_key_or_signature_of_the_wrong_size_is_malformed():
    from diloco.protocol.identity import verify_repeated

    for key, sig in ((bytes(300), bytes(64)), (bytes(32), bytes(65)), (b"", b"")):
        with pytest.raises(Malformed):
            verify_repeated(key, sig, b"message")


def test_the_worked_ping_of_the_protocol_document_is_what_this_implementation_sends_and_reads():
    """docs/protocol.md §5.13, byte for byte: a hostile peer (tests/hostile.py) or another implementation is
    written from that document."""
    from unittest import mock

    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from diloco.protocol.dht.node import DEFAULT_NETWORK_ID
    from diloco.protocol.dht.records import NodeInfo

    ident = Identity(Ed25519PrivateKey.from_private_bytes(bytes(range(32))))
    ts = 1767225600000
    payload = canonical.packb({"node": NodeInfo.create(ident, "http://127.0.0.1:7000", "local", now_ms=ts).to_wire()})
    with mock.patch("os.urandom", lambda n: bytes(range(0xA0, 0xA0 + n))):
        env = seal(ident, "dht", DEFAULT_NETWORK_ID, {"op": "ping"}, payload, now_ms=ts)
    frame_ = env.to_bytes()
    assert len(frame_) == 490 and len(env.header) == 220 and len(payload) == 202
    assert env.payload_digest.hex() == "eee52bf6f6c67916e020f9f52ec9446d40cb5c82a234c8c5d2cc8ee59bab2a4d"
    assert hashlib.sha256(frame_).hexdigest() == "4525eddf304c74776ff4883a5a067627d3cd06b21842374269d47c04a5817d76"
    v1 = _resealed(env, 1, hashlib.sha256(payload).digest(), signer=ident)
    assert hashlib.sha256(v1).hexdigest() == "8ab7697896e975025f1e6fb5be65f7478691fc9236a499b6a2e2b9183bd9cd1d"
    verifier = EnvelopeVerifier(DEFAULT_NETWORK_ID)
    with mock.patch("time.time", lambda: ts / 1000):
        for f in (frame_, v1):
            assert bytes(verifier.open(f, fresh=False).payload) == payload

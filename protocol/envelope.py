"""Signed envelopes: the one wire format of every state-changing message (docs/architecture.md §3).

    frame = u32 big-endian header_len | header (canonical msgpack map) | signature (64 bytes) | payload

The signature is Ed25519 over `DOMAIN + header`; the header names the payload's length and digest (BLAKE3 in
version 2, SHA-256 in version 1, which is still read), so the payload is checked while it streams in and is never
trusted before its last byte matched. Anything signed may
be relayed by any peer: the signature, not the sender's address, says where a message came from.

This module never acts on a message before `EnvelopeVerifier` has passed it, and never uses pickle.
"""

from __future__ import annotations

import hashlib
import os
import struct
import time
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import blake3
import numpy as np

from . import canonical
from .errors import BadSignature, Expired, Malformed, NotMember, ProtocolError, Replayed, TooLarge, WrongRun
from .identity import PUBLIC_KEY_BYTES, SIGNATURE_BYTES, Identity, peer_id_of, verify

PROTOCOL_VERSION = 2  # what this peer seals: the payload digest is BLAKE3
READ_VERSIONS = (1, 2)  # what it verifies: version 1 (SHA-256 payload digests) is still read (docs/protocol.md §3)
DOMAIN = b"diloco-node/v1/envelope\0"
NONCE_BYTES = 16
RUN_ID_BYTES = 32
DIGEST_BYTES = 32
MAX_HEADER_BYTES = 64 * 1024
DEFAULT_MAX_PAYLOAD = 1 << 20
_PREFIX = struct.Struct(">I")

# Per-kind payload limits. Layers register their kinds at import time; unknown kinds get DEFAULT_MAX_PAYLOAD.
_PAYLOAD_LIMITS: dict[str, int] = {}


def register_kind(kind: str, max_payload: int) -> None:
    """Declare a message kind and the largest payload it may carry."""
    _PAYLOAD_LIMITS[kind] = max_payload


def payload_limit(kind: str) -> int:
    return _PAYLOAD_LIMITS.get(kind, DEFAULT_MAX_PAYLOAD)


def frame_limit(payload: int) -> int:
    """The largest frame that carries at most `payload` bytes of payload (prefix, largest header, signature)."""
    return _PREFIX.size + MAX_HEADER_BYTES + SIGNATURE_BYTES + payload


def max_frame_size() -> int:
    """The largest frame any registered kind allows: checked against Content-Length before reading."""
    return frame_limit(max([DEFAULT_MAX_PAYLOAD, *_PAYLOAD_LIMITS.values()]))


_NO_TRAILER = memoryview(b"")


def payload_hash(version: int = PROTOCOL_VERSION) -> Any:
    """A fresh hasher of the payload digest of `version`'s envelopes: BLAKE3 (32 bytes) from version 2, SHA-256
    before. BLAKE3 takes about 0.4 of SHA-256's CPU here, and every payload byte is hashed by its sender and by
    each receiver; both release the GIL for large buffers."""
    return blake3.blake3() if version >= 2 else hashlib.sha256()


def payload_digest_of(data: Any, version: int = PROTOCOL_VERSION) -> bytes:
    """The payload digest of `data` (any C-contiguous buffer: bytes, or a tensor's or an array's memory) as a
    `version` envelope's header names it."""
    view = memoryview(data)
    h = payload_hash(version)
    h.update(view if view.format == "B" and view.ndim == 1 else view.cast("B"))  # (blake3 takes bytes only)
    return h.digest()


@dataclass(frozen=True)
class Envelope:
    """A verified (or freshly sealed) message. `header` and `signature` are the exact signed bytes."""

    kind: str
    run_id: bytes
    sender: bytes
    nonce: bytes
    timestamp_ms: int
    fields: dict[str, Any]
    payload: bytes | bytearray | memoryview
    header: bytes = field(repr=False)
    signature: bytes = field(repr=False)
    # the whole frame as received, when it arrived in one read-only buffer: `frame()` hands it out uncopied
    received: memoryview | None = field(default=None, repr=False, compare=False)
    # bytes that came after the frame in the same body, where the route's kind takes some (`read`'s `trailer`):
    # not covered by the signature; what they are and how each is checked is that kind's own rule
    trailer: memoryview = field(default=_NO_TRAILER, repr=False, compare=False)

    @property
    def sender_id(self) -> str:
        return peer_id_of(self.sender)

    @property
    def payload_digest(self) -> bytes:
        """The payload's digest, as the signed header names it (checked against the payload when received)."""
        return parse_header(self.header)["payload_digest"]

    @property
    def version(self) -> int:
        """The envelope's protocol version (`v`): which hash its payload digest is (`payload_hash`)."""
        return parse_header(self.header)["v"]

    def prefix(self) -> bytes:
        """Everything before the payload; send `prefix()` then `payload` to relay the message unchanged."""
        return _prefix(self.header, self.signature)

    def to_bytes(self) -> bytes:
        return self.prefix() + bytes(self.payload)

    def frame(self) -> memoryview:
        """The whole frame, as `to_bytes`: the received buffer itself, else joined without holding the GIL
        (`join_bytes`): for frames of fragment size, which are kept and served."""
        if self.received is not None:
            return self.received
        return join_bytes(self.prefix(), self.payload)

    def frame_size(self) -> int:
        return _PREFIX.size + len(self.header) + SIGNATURE_BYTES + len(self.payload)


def seal(
    identity: Identity,
    kind: str,
    run_id: bytes,
    fields: dict[str, Any] | None = None,
    payload: bytes | bytearray | memoryview = b"",
    *,
    now_ms: int | None = None,
    digest: bytes | None = None,
) -> Envelope:
    """Sign a new message. The payload is hashed, not copied; `digest`: its `payload_digest_of`, when the caller
    has just computed it over these very bytes (it is not computed again)."""
    if len(run_id) != RUN_ID_BYTES:
        raise ValueError(f"run_id must be {RUN_ID_BYTES} bytes")
    if len(payload) > payload_limit(kind):
        raise TooLarge(f"{kind} payload of {len(payload)} bytes exceeds the limit of {payload_limit(kind)}")
    header_fields = {
        "v": PROTOCOL_VERSION,
        "kind": kind,
        "run_id": run_id,
        "sender": identity.public_key,
        "nonce": os.urandom(NONCE_BYTES),
        "timestamp_ms": int(time.time() * 1000) if now_ms is None else now_ms,
        "fields": fields or {},
        "payload_len": len(payload),
        "payload_digest": payload_digest_of(payload) if digest is None else digest,
    }
    header = canonical.packb(header_fields)
    if len(header) > MAX_HEADER_BYTES:
        raise TooLarge(f"header of {len(header)} bytes exceeds {MAX_HEADER_BYTES}")
    return Envelope(
        kind=kind,
        run_id=run_id,
        sender=identity.public_key,
        nonce=header_fields["nonce"],
        timestamp_ms=header_fields["timestamp_ms"],
        fields=header_fields["fields"],
        payload=payload,
        header=header,
        signature=identity.sign(DOMAIN + header),
    )


_HEADER_TYPES: dict[str, type | tuple[type, ...]] = {
    "v": int,
    "kind": str,
    "run_id": bytes,
    "sender": bytes,
    "nonce": bytes,
    "timestamp_ms": int,
    "fields": dict,
    "payload_len": int,
    "payload_digest": bytes,
}
_FIXED_LEN = {"run_id": RUN_ID_BYTES, "sender": PUBLIC_KEY_BYTES, "nonce": NONCE_BYTES, "payload_digest": DIGEST_BYTES}


def parse_header(header: bytes) -> dict[str, Any]:
    """Decode and type-check a header; every field present with the right type and length, no others."""
    h = canonical.unpackb(header, max_len=MAX_HEADER_BYTES)
    if not isinstance(h, dict):
        raise Malformed("envelope header is not a map")
    if set(h) != set(_HEADER_TYPES):
        missing, extra = set(_HEADER_TYPES) - set(h), set(h) - set(_HEADER_TYPES)
        raise Malformed(f"envelope header fields wrong (missing {sorted(missing)}, unexpected {sorted(extra)})")
    for name, typ in _HEADER_TYPES.items():
        if not isinstance(h[name], typ) or isinstance(h[name], bool):
            raise Malformed(f"envelope field {name!r} must be {getattr(typ, '__name__', typ)}")
    for name, n in _FIXED_LEN.items():
        if len(h[name]) != n:
            raise Malformed(f"envelope field {name!r} must be {n} bytes, got {len(h[name])}")
    if h["v"] not in READ_VERSIONS:
        raise Malformed(f"protocol version {h['v']} not supported (this peer reads "
                        f"{', '.join(map(str, READ_VERSIONS))} and sends {PROTOCOL_VERSION}): upgrade diloco-node")
    if h["payload_len"] < 0:
        raise Malformed("negative payload_len")
    return h


class ReplayCache:
    """Remembers (sender, nonce) pairs until their timestamp leaves the skew window.

    A pair is *reserved* when its header verifies and *committed* when its payload does; a failed transfer
    releases it, so the sender can retry the very same signed bytes.
    """

    PURGE_EVERY_S = 30.0  # expired pairs are dropped this often (else the cache only grows, up to the cap)

    def __init__(self, max_entries: int = 1_000_000) -> None:
        self._seen: dict[bytes, float] = {}
        self._max = max_entries
        self._next_purge = 0.0

    def reserve(self, key: bytes, expires_at: float, now: float) -> None:
        if now >= self._next_purge:
            self._purge(now)
            self._next_purge = now + self.PURGE_EVERY_S
        if key in self._seen and self._seen[key] >= now:
            raise Replayed("message already received (same sender and nonce)")
        if len(self._seen) >= self._max:
            self._purge(now)
            if len(self._seen) >= self._max:
                raise Replayed("replay cache full; refusing new messages until old ones expire")
        self._seen[key] = expires_at

    def release(self, key: bytes) -> None:
        self._seen.pop(key, None)

    def _purge(self, now: float) -> None:
        self._seen = {k: t for k, t in self._seen.items() if t >= now}

    def __len__(self) -> int:
        return len(self._seen)


class EnvelopeVerifier:
    """Checks, in order: shape, kind, size, run, time, membership, signature, replay; then the payload digest.

    `is_member(pubkey)` decides membership (None admits every key: an `open` run).
    """

    def __init__(
        self,
        run_id: bytes,
        *,
        is_member: Callable[[bytes], bool] | None = None,
        max_skew_s: float = 60.0,
        clock: Callable[[], float] = time.time,
        replay: ReplayCache | None = None,
        kinds: Iterable[str] | None = None,
    ) -> None:
        self.run_id = run_id
        self.is_member = is_member
        self.max_skew_s = max_skew_s
        self.clock = clock
        self.replay = replay or ReplayCache()
        self.kinds = frozenset(kinds) if kinds is not None else None

    def check_header(self, header: bytes, signature: bytes, *, fresh: bool = True,
                     kinds: frozenset[str] | None = None, max_payload: int | None = None) -> dict[str, Any]:
        """Verify everything but the payload; reserves the nonce (release it if the payload fails).

        `fresh=False` verifies a relayed record (an update served long after it was signed, a version
        certificate): shape, kind, size, run, signature and membership, but not its age nor replays. Use it
        only for messages whose effect is idempotent. `kinds` and `max_payload`: a route's own kinds and
        payload limit (from the run's plan), on top of the verifier's.
        """
        h = parse_header(header)
        kind = h["kind"]
        for allowed in (self.kinds, kinds):
            if allowed is not None and kind not in allowed:
                raise Malformed(f"message kind {kind!r} is not accepted here")
        limit = payload_limit(kind) if max_payload is None else min(max_payload, payload_limit(kind))
        if h["payload_len"] > limit:
            raise TooLarge(f"{kind} payload of {h['payload_len']} bytes exceeds the limit of {limit}")
        if h["run_id"] != self.run_id:
            raise WrongRun(
                f"message is for run {h['run_id'].hex()[:16]}…, this peer is in run {self.run_id.hex()[:16]}…"
            )
        now = self.clock()
        skew = h["timestamp_ms"] / 1000 - now
        if fresh and abs(skew) > self.max_skew_s:
            raise Expired(
                f"message timestamp is {skew:+.0f}s from this peer's clock (limit ±{self.max_skew_s:.0f}s); "
                "check the clocks (NTP)"
            )
        # (membership before the signature: a stranger's key costs a set lookup, not an Ed25519 verification)
        if self.is_member is not None and not self.is_member(h["sender"]):
            raise NotMember(f"peer {peer_id_of(h['sender'])} is not a member of this run")
        verify(h["sender"], signature, DOMAIN + header)
        h["fresh"] = fresh
        if fresh:
            self.replay.reserve(h["sender"] + h["nonce"], h["timestamp_ms"] / 1000 + self.max_skew_s, now)
        return h

    def release(self, h: dict[str, Any]) -> None:
        if h["fresh"]:
            self.replay.release(h["sender"] + h["nonce"])

    def forget(self, env: Envelope) -> None:
        """Let a fresh message that was refused before any work ("not here, not now") arrive once more: its
        sender, or a peer relaying it unchanged, may try again with the same signed bytes."""
        self.replay.release(env.sender + env.nonce)

    def certificate(self, prefix: bytes | bytearray | memoryview) -> Envelope:
        """Verify an envelope prefix alone (header + signature, no payload): a version certificate."""
        header, signature, rest = _split_prefix(memoryview(prefix))
        if len(rest):
            raise Malformed("certificate has bytes after its signature")
        h = self.check_header(bytes(header), bytes(signature), fresh=False)
        return _envelope(h, bytes(header), bytes(signature), b"")

    def open(self, frame: bytes | bytearray | memoryview, *, fresh: bool = True, trailing: bool = False) -> Envelope:
        """Verify a whole frame held in memory (`fresh` as in `check_header`). With `trailing`, bytes after the
        payload are the envelope's `trailer` (unchecked) instead of an error."""
        mv = memoryview(frame)
        header, signature, rest = _split_prefix(mv)
        h = self.check_header(bytes(header), bytes(signature), fresh=fresh)
        try:
            n = h["payload_len"]
            if len(rest) < n or (len(rest) > n and not trailing):
                raise Malformed(f"payload is {len(rest)} bytes, header says {n}")
            rest, trailer = rest[:n], rest[n:]
            if payload_digest_of(rest, h["v"]) != h["payload_digest"]:
                raise BadSignature("payload does not match its signed digest")
        except ProtocolError:
            self.release(h)
            raise
        # (a buffer the caller may still write to is copied by `frame()`, as before)
        received = mv[: len(mv) - len(trailer)] if mv.readonly else None
        return _envelope(h, bytes(header), bytes(signature), rest, received=received, trailer=trailer)

    async def read(
        self, chunks: AsyncIterator[bytes], *, content_length: int | None = None, fresh: bool = True,
        kinds: frozenset[str] | None = None, max_payload: int | None = None,
        trailer: Callable[[dict[str, Any]], int] | None = None, max_trailer: int = 0,
    ) -> Envelope:
        """Verify a frame arriving as an async stream of chunks (e.g. aiohttp's `content.iter_any()`).

        The size is checked before anything is read when `content_length` is known; the header (kind and
        size included: `kinds`, `max_payload` as in `check_header`) is verified before any payload byte is
        buffered; the digest is updated chunk by chunk. `trailer`: for a kind whose body goes on after the
        frame (docs/protocol.md §3.2), how many bytes follow, from the verified header's fields (at most
        `max_trailer`; it may raise `Malformed`); they are read into the envelope's `trailer`, not hashed.
        """
        largest = max_frame_size() if max_payload is None else min(max_frame_size(), frame_limit(max_payload))
        largest += max_trailer if trailer is not None else 0
        if content_length is not None and content_length > largest:
            raise TooLarge(f"message of {content_length} bytes exceeds the largest allowed here ({largest})")
        reader = _ChunkReader(chunks)
        (hlen,) = _PREFIX.unpack(await reader.read_exactly(_PREFIX.size, "length prefix"))
        if hlen > MAX_HEADER_BYTES:
            raise TooLarge(f"header of {hlen} bytes exceeds {MAX_HEADER_BYTES}")
        header = await reader.read_exactly(hlen, "header")
        signature = await reader.read_exactly(SIGNATURE_BYTES, "signature")
        h = self.check_header(header, signature, fresh=fresh, kinds=kinds, max_payload=max_payload)
        try:
            n = h["payload_len"]
            t = trailer(h["fields"]) if trailer is not None else 0
            if t > max_trailer:
                raise TooLarge(f"{h['kind']} trailer of {t} bytes exceeds the limit of {max_trailer}")
            if content_length is not None and content_length != _PREFIX.size + hlen + SIGNATURE_BYTES + n + t:
                raise Malformed("Content-Length does not match the envelope's payload_len"
                                + (" and trailer" if trailer is not None else ""))
            # np.empty, not bytearray(n): that zero-fills megabytes (and faults their pages in) holding the GIL,
            # the largest GIL hold of a learner's loop in the step-latency benchmark; numpy copies into it
            # without the GIL. The prefix goes first, so that the frame is one buffer (`Envelope.frame`).
            prefix = _prefix(header, signature)
            whole = np.empty(len(prefix) + n + t, np.uint8)
            whole[: len(prefix)] = np.frombuffer(prefix, np.uint8)
            view = whole[len(prefix) :]
            digest = payload_hash(h["v"])
            pos = 0
            async for part in reader.rest():
                if pos + len(part) > n + t:
                    raise Malformed(f"payload longer than the {n} bytes its header declares"
                                    + (f" (and a trailer of {t})" if trailer is not None else ""))
                view[pos : pos + len(part)] = np.frombuffer(part, np.uint8)
                digest.update(memoryview(part)[: max(0, n - pos)])
                pos += len(part)
            if pos != n + t:
                raise Malformed(f"payload ended after {min(pos, n)} of {n} bytes"
                                + (f" and {max(0, pos - n)} of its {t}-byte trailer" if t else ""))
            if digest.digest() != h["payload_digest"]:
                raise BadSignature("payload does not match its signed digest")
        except BaseException:
            self.release(h)
            raise
        # (the trailer stays writable: a part of it that is kept, e.g. a frame, is copied out by `frame()`
        # instead of holding on to this whole buffer)
        return _envelope(h, header, signature, memoryview(view[:n]),
                         received=memoryview(whole[: len(prefix) + n]).toreadonly(), trailer=memoryview(view[n:]))


def join_bytes(*parts: bytes | bytearray | memoryview) -> memoryview:
    """The parts concatenated into one new read-only buffer. numpy copies without holding the GIL; `a + b`
    and `bytes(view)` hold it for the whole copy (about 10 ms per 12.5 MB, during which no other thread of
    the process runs Python: the training thread waits)."""
    views = [memoryview(p).cast("B") for p in parts]
    out = np.empty(sum(v.nbytes for v in views), np.uint8)
    pos = 0
    for v in views:
        out[pos : pos + v.nbytes] = np.frombuffer(v, np.uint8)
        pos += v.nbytes
    return memoryview(out).toreadonly()


def _prefix(header: bytes, signature: bytes) -> bytes:
    """`u32 header_len | header | signature`: a frame without its payload."""
    return _PREFIX.pack(len(header)) + header + signature


def _envelope(h: dict[str, Any], header: bytes, signature: bytes, payload: Any,
              received: memoryview | None = None, trailer: memoryview = _NO_TRAILER) -> Envelope:
    return Envelope(
        kind=h["kind"],
        run_id=h["run_id"],
        sender=h["sender"],
        nonce=h["nonce"],
        timestamp_ms=h["timestamp_ms"],
        fields=h["fields"],
        payload=payload,
        header=header,
        signature=signature,
        received=received,
        trailer=trailer,
    )


def _split_prefix(mv: memoryview) -> tuple[memoryview, memoryview, memoryview]:
    if len(mv) < _PREFIX.size:
        raise Malformed("message shorter than its length prefix")
    (hlen,) = _PREFIX.unpack(mv[: _PREFIX.size])
    if hlen > MAX_HEADER_BYTES:
        raise TooLarge(f"header of {hlen} bytes exceeds {MAX_HEADER_BYTES}")
    end = _PREFIX.size + hlen
    if len(mv) < end + SIGNATURE_BYTES:
        raise Malformed("message ends inside its header or signature")
    return mv[_PREFIX.size : end], mv[end : end + SIGNATURE_BYTES], mv[end + SIGNATURE_BYTES :]


class _ChunkReader:
    """Exact reads over an async iterator of byte chunks."""

    def __init__(self, chunks: AsyncIterator[bytes]) -> None:
        self._it = chunks.__aiter__()
        self._buf = bytearray()

    async def read_exactly(self, n: int, what: str) -> bytes:
        while len(self._buf) < n:
            try:
                self._buf += await self._it.__anext__()
            except StopAsyncIteration:
                raise Malformed(f"message ended inside its {what}") from None
        out = bytes(self._buf[:n])
        del self._buf[:n]
        return out

    async def rest(self) -> AsyncIterator[bytes]:
        if self._buf:
            yield bytes(self._buf)
            self._buf.clear()
        async for part in self._it:
            yield part

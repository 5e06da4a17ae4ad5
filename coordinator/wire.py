"""The swarm's messages: deltas, updates, replication, fragment downloads and member records (docs/architecture.md §3).

Each message is a signed envelope (`diloco.protocol.envelope`) whose `fields` are described here; this module
turns those fields into typed values and refuses anything else with `Malformed`. Tensor payloads are codec
bytes (`diloco.protocol.codecs`), decoded only by the codec, which checks its own metadata. docs/protocol.md
§7 is the prose version of this file.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import Any

import blake3
import torch

from diloco.protocol import canonical
from diloco.protocol.bulk import RunningDigest
from diloco.protocol.codecs import Codec
from diloco.protocol.envelope import (
    PROTOCOL_VERSION,
    frame_limit,
    join_bytes,
    payload_digest_of,
    register_kind,
)
from diloco.protocol.errors import Malformed

from .version import Version

DELTA, UPDATE, REPLICATE, ACCUSE = "delta", "update", "replicate", "accuse"
MAX_LEARNERS = 4096
MAX_TENSOR_PAYLOAD = 1 << 31  # 2 GiB: an fp32 fragment of 512M parameters
for _kind in (DELTA, UPDATE, REPLICATE, ACCUSE):
    register_kind(_kind, MAX_TENSOR_PAYLOAD)

ROUTE_DELTA = "/v1/delta"
ROUTE_UPDATE = "/v1/update"
ROUTE_REPLICATE = "/v1/replicate"
ROUTE_ACCUSE = "/v1/accuse"
ROUTE_FRAGMENT = "/v1/fragment/{p}"  # GET: u32 cert_len | cert | fp32 anchor
ROUTE_UPDATES = "/v1/updates/{p}"  # GET ?after=T.V[&wait=S]: canonical list of update frames
ROUTE_STATUS = "/v1/status"
ROUTE_METRICS = "/metrics"  # GET: Prometheus text exposition (docs/status.md)
ROUTE_MOMENTUM = "/v1/momentum/{p}"  # GET ?label=T.V: u32 meta_len | meta | codec payload
ROUTE_VERSIONS = "/v1/versions"  # GET: canonical list of [term, version], one per fragment


def path_fragment(raw: str, P: int) -> int:
    """The fragment index `{p}` of a route's path: ASCII digits, below the plan's P; raises `Malformed`."""
    p = canonical.parse_decimal(raw, "a fragment index")
    if p >= P:
        raise Malformed(f"no fragment {p} in a plan of {P}")
    return p


def _int(fields: dict[str, Any], name: str, lo: int = 0, hi: int = 2**63 - 1) -> int:
    v = fields.get(name)
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise Malformed(f"field {name!r} must be an integer in [{lo}, {hi}]")
    return v


def _meta(fields: dict[str, Any], name: str) -> dict[str, Any]:
    v = fields.get(name)
    if not isinstance(v, dict):
        raise Malformed(f"field {name!r} must be codec metadata (a map)")
    return v


def _exact(fields: dict[str, Any], names: set[str], kind: str) -> None:
    if set(fields) != names:
        raise Malformed(f"{kind} fields must be exactly {sorted(names)}, got {sorted(fields)}")


@dataclass(frozen=True)
class DeltaFields:
    """Learner → owner: Δ_p = Θ_p^(base) − θ[p], computed over `steps` inner steps and `tokens` tokens."""

    p: int
    base: Version
    steps: int
    tokens: int
    codec: dict[str, Any]

    def to_fields(self) -> dict[str, Any]:
        return {"p": self.p, "base": self.base.to_wire(), "steps": self.steps, "tokens": self.tokens,
                "codec": self.codec}

    @classmethod
    def parse(cls, f: dict[str, Any], P: int) -> DeltaFields:
        _exact(f, {"p", "base", "steps", "tokens", "codec"}, DELTA)
        return cls(_int(f, "p", 0, P - 1), Version.from_wire(f["base"]), _int(f, "steps", 1),
                   _int(f, "tokens", 1), _meta(f, "codec"))


@dataclass(frozen=True)
class Merged:
    """One delta an update merged, as the update names it: enough for anyone holding that delta to recompute
    the merge (coordinator/audit.py): who sent it, the payload digest of its codec payload, its counters and its
    staleness (which, with the RunSpec's `max_share`, fix its merge weight)."""

    learner: str
    digest: bytes
    steps: int
    tokens: int
    staleness: int

    def to_wire(self) -> list[Any]:
        return [self.learner, self.digest, self.steps, self.tokens, self.staleness]

    @classmethod
    def from_wire(cls, v: Any) -> Merged:
        if not isinstance(v, list) or len(v) != 5:
            raise Malformed("a merged entry must be [learner, digest, steps, tokens, staleness]")
        learner, digest = v[0], v[1]
        if not isinstance(learner, str) or len(learner) > 64:
            raise Malformed("a merged entry's learner must be a PeerId")
        if not isinstance(digest, bytes) or len(digest) != 32:
            raise Malformed("a merged entry's digest must be 32 bytes")
        f = {"steps": v[2], "tokens": v[3], "staleness": v[4]}
        return cls(learner, digest, _int(f, "steps", 1), _int(f, "tokens", 1), _int(f, "staleness"))


@dataclass(frozen=True)
class UpdateFields:
    """Owner → learners: U = Θ_p^(new) − Θ_p^(base); `digest` is the anchor digest of Θ_p^(new).

    The header of an update (its envelope prefix) is also the certificate of version `new`: any holder may
    serve Θ_p^(new) with it, and the downloader checks the bytes against `digest`. `merged` and `clip` say
    what the merge was made of (one entry per learner, in `learners`' order, and the clipping norm λ), so that
    the outer step can be recomputed and checked (docs/protocol.md §7.19).
    """

    p: int
    base: Version
    new: Version
    digest: bytes
    codec: dict[str, Any]
    learners: tuple[str, ...] = ()  # PeerIds whose deltas this outer step merged
    merged: tuple[Merged, ...] = ()  # the same deltas: digests, counters, staleness (empty: not said)
    clip: float = 0.0  # λ: every merged delta's norm was clipped to at most this

    def to_fields(self) -> dict[str, Any]:
        return {"p": self.p, "base": self.base.to_wire(), "new": self.new.to_wire(), "digest": self.digest,
                "codec": self.codec, "learners": list(self.learners), "merged": [m.to_wire() for m in self.merged],
                "clip": float(self.clip)}

    @classmethod
    def parse(cls, f: dict[str, Any], P: int) -> UpdateFields:
        _exact(f, {"p", "base", "new", "digest", "codec", "learners", "merged", "clip"}, UPDATE)
        digest = f["digest"]
        if not isinstance(digest, bytes) or len(digest) != 32:
            raise Malformed("update digest must be 32 bytes")
        learners = f["learners"]
        if not isinstance(learners, list) or len(learners) > MAX_LEARNERS or not all(
            isinstance(x, str) and len(x) <= 64 for x in learners
        ):
            raise Malformed(f"update learners must be a list of at most {MAX_LEARNERS} PeerIds")
        raw = f["merged"]
        if not isinstance(raw, list) or len(raw) > MAX_LEARNERS:
            raise Malformed(f"update merged must be a list of at most {MAX_LEARNERS} entries")
        merged = tuple(Merged.from_wire(m) for m in raw)
        if merged and [m.learner for m in merged] != learners:
            raise Malformed("update merged must name the update's learners, in order")
        clip = f["clip"]
        if not isinstance(clip, float) or not 0.0 <= clip < math.inf:
            raise Malformed("update clip must be a finite float64 >= 0")
        out = cls(_int(f, "p", 0, P - 1), Version.from_wire(f["base"]), Version.from_wire(f["new"]), digest,
                  _meta(f, "codec"), tuple(learners), merged, clip)
        if not out.new > out.base:
            raise Malformed(f"update to {out.new} does not move forward from {out.base}")
        return out


@dataclass(frozen=True)
class ReplicateFields:
    """Owner → replica, before publishing: the update frame (as learners will get it) and the momentum.

    Payload: the momentum codec payload (empty without one). The body goes on after the frame (its trailer,
    `replicate_trailer_len`): the update frame's bytes (`update_len` of them), then the frames of the deltas
    the update merged (`deltas`: their byte lengths, in the update's `merged` order), so that the replica can
    recompute the step (coordinator/audit.py). Each of those frames is signed by its own sender and hashed
    once, when it is verified; the replicate's own signature covers the momentum. With `full`, the payload is
    instead the certificate (`update_len` bytes), the fp32 anchor and the fp32 momentum (a new replica's first
    copy), and there is no trailer.
    """

    p: int
    term: int
    label: Version  # the version the replica holds once this is applied
    full: bool
    update_len: int
    momentum: dict[str, Any] | None
    deltas: tuple[int, ...] = ()  # byte lengths of the merged delta frames in the trailer, after the update
    # digest of the momentum's bytes (`momentum_digest`: codec payload, or fp32 in the full form); None: no
    # momentum. Signed in the header, so the header alone and those bytes prove what the owner replicated (an
    # accusation, §7.20). In the normal form the payload is the momentum: `mdigest` is the header's payload digest.
    mdigest: bytes | None = None

    def names_its_momentum(self, payload_digest: bytes, payload_len: int) -> bool:
        """In the normal form: `mdigest` is the signed payload's digest when there is a momentum, and without
        one there is neither a digest nor a payload."""
        return self.mdigest == (payload_digest if self.momentum else None) and (bool(self.momentum) or not payload_len)

    def to_fields(self) -> dict[str, Any]:
        return {"p": self.p, "term": self.term, "label": self.label.to_wire(), "full": self.full,
                "update_len": self.update_len, "momentum": self.momentum, "deltas": list(self.deltas),
                "mdigest": self.mdigest}

    @classmethod
    def parse(cls, f: dict[str, Any], P: int) -> ReplicateFields:
        _exact(f, {"p", "term", "label", "full", "update_len", "momentum", "deltas", "mdigest"}, REPLICATE)
        if not isinstance(f["full"], bool):
            raise Malformed("replicate 'full' must be a bool")
        momentum = None if f["momentum"] is None else _meta(f, "momentum")
        deltas = f["deltas"]
        if not isinstance(deltas, list) or len(deltas) > MAX_LEARNERS or (f["full"] and deltas):
            raise Malformed(f"replicate deltas must be a list of at most {MAX_LEARNERS} lengths (none when full)")
        lengths = tuple(_int({"d": d}, "d") for d in deltas)
        mdigest = f["mdigest"]
        if mdigest is not None and (not isinstance(mdigest, bytes) or len(mdigest) != 32):
            raise Malformed("replicate mdigest must be 32 bytes or nil")
        return cls(_int(f, "p", 0, P - 1), _int(f, "term"), Version.from_wire(f["label"]), f["full"],
                   _int(f, "update_len"), momentum, lengths, mdigest)


MAX_CERT = 70_000  # bytes of an update certificate in a fragment body, at most


def momentum_body_max(numel: int) -> int:
    """The longest body GET /v1/momentum/{p} may answer: fp32 (after a full replication) is the largest form."""
    return 4 + 4096 + 4 * numel


def pack_momentum(meta: dict, payload: bytes | memoryview) -> memoryview:
    """Body of GET /v1/momentum/{p}: u32 big-endian length of the codec meta (canonical msgpack), meta, payload."""
    head = canonical.packb(meta)
    return join_bytes(struct.pack(">I", len(head)) + head, payload)


def parse_momentum(body: bytes) -> tuple[dict, bytes]:
    """Inverse of `pack_momentum`, checked; the codec checks the meta itself. Raises `Malformed`."""
    if len(body) < 4:
        raise Malformed("momentum answer shorter than its length prefix")
    (n,) = struct.unpack(">I", body[:4])
    meta = canonical.unpackb(body[4 : 4 + n], max_len=4096)
    if not isinstance(meta, dict):
        raise Malformed("momentum meta must be a map")
    return meta, bytes(body[4 + n :])


def pack_versions(labels: list[Version]) -> bytes:
    """Body of GET /v1/versions: the holder's version of every fragment, in order."""
    return canonical.packb([[v.term, v.version] for v in labels])


def parse_versions(body: bytes, P: int) -> list[Version]:
    """Inverse of `pack_versions`, checked: exactly P versions. Raises `Malformed`."""
    value = canonical.unpackb(body, max_len=versions_body_max(P))
    if not isinstance(value, list) or len(value) != P:
        raise Malformed(f"versions answer must list {P} versions")
    return [Version.from_wire(v) for v in value]


def versions_body_max(P: int) -> int:
    """The longest body GET /v1/versions may answer: P pairs of 64-bit integers."""
    return 8 + 20 * P


def updates_body_max(codec_bytes: int, frames: int, budget: int = 0) -> int:
    """The longest body GET /v1/updates/{p} may answer: a canonical list of at most `frames` update envelopes,
    each carrying at most `codec_bytes` of payload (the run's codec for the fragment's size:
    `Codec.encoded_size`), together at most max(`budget`, one such envelope) bytes (what a holder keeps)."""
    return 8 + 8 * frames + max(budget, frame_limit(codec_bytes))


def tensor_payload_max(codec: Codec, numel: int) -> int:
    """The largest payload of a `delta` or an `update` of a fragment of `numel` elements: its codec bytes."""
    return codec.encoded_size(numel)


MAX_AUDITED_DELTAS = 16  # delta frames a `replicate` carries at most; a larger round ships none (not recomputed)


def replicate_payload_max(codec: Codec, numel: int) -> int:
    """The largest `replicate` payload for such a fragment: the momentum in the run's codec, or (the full form)
    a certificate and the fp32 anchor and momentum."""
    return max(codec.encoded_size(numel), MAX_CERT + 8 * numel)


def replicate_trailer_max(codec: Codec, numel: int) -> int:
    """The largest `replicate` trailer for such a fragment: an update frame and up to MAX_AUDITED_DELTAS delta
    frames."""
    return (1 + MAX_AUDITED_DELTAS) * frame_limit(codec.encoded_size(numel))


def replicate_trailer_len(fields: dict[str, Any], P: int) -> int:
    """How many bytes follow a `replicate` frame with these fields: its update and delta frames (none in the
    full form). Raises `Malformed` for fields that do not parse."""
    f = ReplicateFields.parse(fields, P)
    return 0 if f.full else f.update_len + sum(f.deltas)


def momentum_digest(data: bytes | memoryview | Any, version: int = PROTOCOL_VERSION) -> bytes:
    """`ReplicateFields.mdigest`: the payload digest (of a `version` envelope: BLAKE3 from 2, SHA-256 in 1) of a
    momentum's bytes (any buffer), so that in the normal form it equals the replicate's `payload_digest`; called in
    a worker thread."""
    return payload_digest_of(data, version)


def split_replicate(f: ReplicateFields, trailer: memoryview) -> tuple[memoryview, list[memoryview]]:
    """The frames in a normal `replicate`'s trailer (views, not copies): the update frame and the delta frames.
    Raises `Malformed` when the lengths do not add up to the trailer's."""
    if f.full or f.update_len + sum(f.deltas) != len(trailer):
        raise Malformed("replicate update and delta frames do not fill its trailer")
    frames, pos = [], f.update_len
    for n in f.deltas:
        frames.append(trailer[pos : pos + n])
        pos += n
    return trailer[: f.update_len], frames


@dataclass(frozen=True)
class AccuseFields:
    """Any peer → members: evidence that an owner published update `new` of fragment p that is not the merge
    it names (docs/protocol.md §7.20). Payload: the prefix of the owner's `replicate` of `new`'s base
    (`base_len` bytes: header and signature only), the momentum bytes that prefix's `mdigest` names
    (`momentum_len`), then the owner's whole `replicate` frame of `new` followed by its trailer."""

    p: int
    new: Version
    base_len: int
    momentum_len: int

    def to_fields(self) -> dict[str, Any]:
        return {"p": self.p, "new": self.new.to_wire(), "base_len": self.base_len, "momentum_len": self.momentum_len}

    @classmethod
    def parse(cls, f: dict[str, Any], P: int) -> AccuseFields:
        _exact(f, {"p", "new", "base_len", "momentum_len"}, ACCUSE)
        return cls(_int(f, "p", 0, P - 1), Version.from_wire(f["new"]), _int(f, "base_len", 1, MAX_CERT),
                   _int(f, "momentum_len"))


def accuse_payload_max(codec: Codec, numel: int) -> int:
    """The largest `accuse` payload: a replicate prefix, an fp32 momentum (the largest form) and a replicate frame
    with its trailer."""
    return MAX_CERT + 4 * numel + frame_limit(replicate_payload_max(codec, numel)) + replicate_trailer_max(codec, numel)


def anchor_hash() -> blake3.blake3:
    """A fresh hasher of the anchor digest (docs/protocol.md §7.3): BLAKE3 with its default 32-byte output.
    Whole fragments are hashed at every download, catch-up check and replication, so this is the swarm's
    largest hash: BLAKE3 takes ~0.4 of SHA-256's CPU here (SHA-256 with the CPU's SHA extensions)."""
    return blake3.blake3()


def anchor_bytes(anchor: torch.Tensor) -> memoryview:
    """A fragment's fp32 little-endian bytes (a view where the tensor is contiguous): what is hashed, sent and
    journaled."""
    return anchor.detach().contiguous().view(torch.uint8).numpy().data


def anchor_digest(anchor: torch.Tensor) -> bytes:
    """The anchor digest of a fragment's fp32 bytes: what an update certifies and a download is checked against."""
    return anchor_hash().update(anchor_bytes(anchor)).digest()


def fragment_body_max(numel: int) -> int:
    """The longest body GET /v1/fragment/{p} may answer for a fragment of `numel` elements."""
    return 4 + MAX_CERT + 4 * numel


def pack_fragment(cert: bytes, anchor_bytes: bytes | memoryview) -> list[bytes | memoryview]:
    """Body of GET /v1/fragment/{p}: u32 big-endian cert length, the cert, the fp32 anchor bytes."""
    return [struct.pack(">I", len(cert)) + cert, anchor_bytes]


class FragmentReader:
    """Reads the body of GET /v1/fragment/{p} (see `pack_fragment`) as a `bulk.BodySink`: the socket writes
    the anchor bytes straight into an fp32 tensor (`anchor`: a fresh one, or the one given), so a download is
    never held twice nor copied; the certificate ends up in `cert`. Checking the anchor against it is the
    caller's."""

    def __init__(self, numel: int, into: torch.Tensor | None = None, hash_while_reading: bool = False) -> None:
        """`into`: a flat fp32 tensor of `numel` elements to write the anchor into (default: a new one).
        `hash_while_reading`: the anchor digest is computed as its bytes arrive (`digest`; inside an event
        loop only)."""
        self.numel, self.into, self.hash_while_reading = numel, into, hash_while_reading

    def begin(self, content_length: int) -> None:
        if not 4 + self.numel * 4 <= content_length <= fragment_body_max(self.numel):
            raise Malformed(f"a fragment of {self.numel} elements cannot be {content_length} bytes long")
        self.length = content_length
        self.cert: bytes | None = None
        self._head, self._head_pos = bytearray(4), 0  # the certificate's length, then the certificate
        self._cert_len: int | None = None
        self.anchor = torch.empty(self.numel, dtype=torch.float32) if self.into is None else self.into
        self._bytes = memoryview(self.anchor.numpy()).cast("B")
        self._pos = 0
        self._running = RunningDigest(self._bytes, anchor_hash()) if self.hash_while_reading else None

    def buffer(self) -> memoryview:
        if self.cert is None:
            return memoryview(self._head)[self._head_pos :]
        return self._bytes[self._pos :]

    def advance(self, n: int) -> None:
        if self.cert is not None:
            self._pos += n
            if self._running is not None:
                self._running.filled(self._pos)
            return
        self._head_pos += n
        if self._head_pos < len(self._head):
            return
        if self._cert_len is None:  # the length is read: now the certificate, into a new buffer (the
            # socket may still hold a view of this one)
            (k,) = struct.unpack(">I", self._head)
            if 4 + k + 4 * self.numel != self.length:
                raise Malformed(f"a certificate of {k} bytes does not fit a fragment body of {self.length} bytes")
            self._cert_len, self._head, self._head_pos = k, bytearray(k), 0
            if k:
                return
        self.cert = bytes(self._head)

    def end(self) -> None:
        if self.cert is None or self._pos != len(self._bytes):
            raise Malformed(f"fragment download ended before its {self.numel} elements")

    async def digest(self) -> bytes:
        """The anchor digest of its bytes (what its certificate names), on the event loop's worker threads."""
        if self._running is None:
            self._running = RunningDigest(self._bytes, anchor_hash())
            self._running.filled(self._pos)
        return await self._running.digest()


@dataclass(frozen=True)
class MemberRecord:
    """Value under `run:<id>:members`, subkey = the peer's PeerId (signed by it through the DHT record)."""

    url: str
    region: str
    client_mode: bool
    step: int
    step_time_s: float
    tokens_per_s: float
    synced: bool
    left: bool = False  # the peer stopped: its last record, so readers drop it before it expires

    def encode(self) -> bytes:
        return canonical.packb(self.__dict__)

    @classmethod
    def decode(cls, data: bytes) -> MemberRecord:
        obj = canonical.unpackb(data, max_len=4096)
        names = set(cls.__dataclass_fields__)
        if not isinstance(obj, dict) or set(obj) != names:
            raise Malformed("member record fields are wrong")
        if not isinstance(obj["url"], str) or not isinstance(obj["region"], str):
            raise Malformed("member record url/region must be strings")
        if not all(isinstance(obj[flag], bool) for flag in ("client_mode", "synced", "left")):
            raise Malformed("member record flags must be bools")
        for name in ("step_time_s", "tokens_per_s"):
            if not isinstance(obj[name], int | float) or isinstance(obj[name], bool):
                raise Malformed(f"member record {name} must be a number")
        _int(obj, "step")
        return cls(**obj)


@dataclass(frozen=True)
class FragRecord:
    """Value under `run:<id>:frag:<p>`, subkey = the owner's PeerId: the newest version it published."""

    version: Version

    def encode(self) -> bytes:
        return canonical.packb({"version": self.version.to_wire()})

    @classmethod
    def decode(cls, data: bytes) -> FragRecord:
        obj = canonical.unpackb(data, max_len=1024)
        if not isinstance(obj, dict) or set(obj) != {"version"}:
            raise Malformed("frag record must be {version}")
        return cls(Version.from_wire(obj["version"]))


def members_key(run_id: bytes) -> str:
    return f"run:{run_id.hex()}:members"


def frag_key(run_id: bytes, p: int) -> str:
    return f"run:{run_id.hex()}:frag:{p}"


# -- the reachability probe (node/reach.py) -----------------------------------------------------------------

REACH = "reach"
ROUTE_REACH = "/v1/reach"
register_kind(REACH, 0)  # fields only
MAX_URL = 256


def reach_url(fields: dict[str, Any]) -> str:
    """The `url` of a `reach` request: `http(s)://host:port`, at most MAX_URL characters; raises `Malformed`."""
    _exact(fields, {"url"}, REACH)
    url = fields["url"]
    if not isinstance(url, str) or not url.startswith(("http://", "https://")) or len(url) > MAX_URL \
            or "?" in url or "#" in url:
        raise Malformed("url must be http(s)://host:port")
    return url.rstrip("/")

"""The version journal: every version this learner accepted since its last checkpoint, on disk
(docs/architecture.md §5.6).

A checkpoint holds the versions of its step; a learner killed later loses the versions it accepted since, and
if every other holder of such a version dies too, the next owner of the fragment builds on an older one: the
fragment forks and an accepted update is lost. So each version that reaches the store is also appended here, as
the update frame that produced it (or, for a whole-fragment download, its certificate and fp32 anchor), and a
restarted learner replays the journal onto its checkpoint before it joins: it then holds, and offers to the new
owner (`GET /v1/versions`, `Takeover.reach_newest`), the newest version it accepted.

Appends are plain `write()`s: kill -9 does not lose what the page cache holds (a power failure may; the
checkpoint is the durable state). The journal lives in `DIR/journal/` next to the checkpoints, as segments
`seg-<n>`, each a sequence of records

    MAGIC (4 bytes) | kind (1 byte) | body length (u32, big-endian) | body | SHA-256 of kind + body (32 bytes)

kind `u`: an update frame (docs/protocol.md §3); kind `f`: u32 certificate length | certificate | fp32 anchor;
kind `m`: the outer momentum a replica was sent with a version (`Replication.kept`, otherwise only in memory and
in the next checkpoint), u32 p | i64 term | i64 version | u32 meta length | codec meta (JSON) | payload; a restart
keeps the newest one per fragment as the checkpoint's would be kept (`node/saved_momenta.py`), so the momentum of
a version accepted after the checkpoint survives kill -9 of the replica too. A momentum record is this peer's own
note, like the checkpoint, not signed: it is checked by decoding it.
A record is trusted only after the checks any update gets: signature, run and membership (`EnvelopeVerifier`),
and the owner's digest of the anchor it produces. A torn record (killed mid-write) or a corrupt one ends its
segment. `rotate` starts a new segment just before a checkpoint is captured; once that checkpoint is written,
the segments before the previous checkpoint's are covered by both kept checkpoints and are deleted (`drop_before`,
called by `Learner.save_checkpoint`): a resume that falls back to the older one still replays everything since.
An append that fails (a full disk) is cut off again, so the records after it stay readable.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import struct
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from diloco.coordinator.fragments import Encoded
from diloco.coordinator.runspec import RunSpec
from diloco.coordinator.version import Version
from diloco.coordinator.wire import UPDATE, UpdateFields, anchor_bytes, anchor_digest
from diloco.protocol.codecs import get_codec
from diloco.protocol.envelope import EnvelopeVerifier
from diloco.protocol.errors import ProtocolError

from . import saved_momenta

log = logging.getLogger(__name__)

MAGIC = b"DLJ1"
UPDATE_RECORD, FRAGMENT_RECORD, MOMENTUM_RECORD = b"u", b"f", b"m"
_HEAD = struct.Struct(">4scI")
_MOMENTUM = struct.Struct(">IqqI")
_SEGMENT = re.compile(r"seg-(0|[1-9][0-9]*)")


class Journal:
    """The append side (the swarm loop calls `update` and `fragment`) and the segments' life (the training
    thread calls `rotate` and `drop_before`); one lock orders them."""

    def __init__(self, directory: str | os.PathLike) -> None:
        self.dir = Path(directory) / "journal"
        self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._fd: int | None = None
        self.failed_writes = 0  # appends lost to a write error (a full disk), reported in the learner's status
        self.segment = max(segments(self.dir), default=-1) + 1
        self._open()

    def _open(self) -> None:
        self._fd = os.open(self.dir / f"seg-{self.segment}", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)

    def update(self, frame: bytes) -> None:
        """An update frame whose version this peer's store just moved to."""
        self._append(UPDATE_RECORD, [frame])

    def fragment(self, cert: bytes, anchor: torch.Tensor) -> None:
        """A fragment installed whole (a download, a full replication): its certificate and fp32 anchor."""
        self._append(FRAGMENT_RECORD, [struct.pack(">I", len(cert)), cert, anchor_bytes(anchor)])

    def momentum(self, p: int, label: Version, momentum: Encoded) -> None:
        """The momentum of version `label` of p that this replica keeps (`Replication._on_replicate`)."""
        meta = json.dumps(momentum.meta, sort_keys=True, separators=(",", ":")).encode()
        self._append(MOMENTUM_RECORD, [_MOMENTUM.pack(p, label.term, label.version, len(meta)), meta,
                                       momentum.payload])

    def _append(self, kind: bytes, parts: list) -> None:
        size = sum(len(x) for x in parts)
        digest = hashlib.sha256(kind)
        for part in parts:
            digest.update(part)
        buffers = [memoryview(_HEAD.pack(MAGIC, kind, size)), *(memoryview(x).cast("B") for x in parts),
                   memoryview(digest.digest())]
        with self._lock:
            if self._fd is None:
                return
            end = os.fstat(self._fd).st_size
            try:
                _write_all(self._fd, buffers)
            except OSError as e:  # a full disk must not stop training: the checkpoint still stands
                self.failed_writes += 1
                log.warning("version journal write failed (%s): this version is not in the journal", e)
                try:  # cut the torn record off, or every record appended after it would be unreadable
                    os.ftruncate(self._fd, end)
                except OSError as e2:
                    log.warning("version journal: could not cut a torn record (%s); starting a new segment", e2)
                    self._next_segment()

    def rotate(self) -> int:
        """Start a new segment; returns its number. Call it before capturing a checkpoint: everything in the
        older segments was then applied before the capture, so the checkpoint covers it. Where no new segment
        can be created (a full disk), appends go on in the current one, whose number is returned."""
        with self._lock:
            self._next_segment()
            return self.segment

    def _next_segment(self) -> None:
        """With the lock held: open segment + 1 and make it current; keep the current one if that fails."""
        try:
            fd = os.open(self.dir / f"seg-{self.segment + 1}", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        except OSError as e:
            log.warning("version journal: no new segment (%s); appending to segment %d", e, self.segment)
            return
        if self._fd is not None:
            os.close(self._fd)
        self._fd, self.segment = fd, self.segment + 1

    def drop_before(self, segment: int) -> None:
        """Delete the segments older than `segment` (a checkpoint captured after `rotate` returned it is on disk)."""
        for n in segments(self.dir):
            if n < segment:
                (self.dir / f"seg-{n}").unlink(missing_ok=True)

    def close(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None


def _write_all(fd: int, buffers: list[memoryview]) -> None:
    """writev until every byte is written (a write may be short)."""
    while buffers:
        n = os.writev(fd, buffers)
        while buffers and n >= len(buffers[0]):
            n -= len(buffers[0])
            buffers.pop(0)
        if buffers and n:
            buffers[0] = buffers[0][n:]


def segments(directory: Path) -> list[int]:
    """The segment numbers under `directory`, oldest first."""
    if not directory.is_dir():
        return []
    return sorted(int(m[1]) for p in directory.iterdir() if (m := _SEGMENT.fullmatch(p.name)))


def records(directory: str | os.PathLike) -> Iterator[tuple[bytes, bytes]]:
    """(kind, body) of every intact record, oldest segment first; a segment ends at its first torn or corrupt
    record (only the last one can be torn: records are appended one at a time)."""
    root = Path(directory) / "journal"
    for n in segments(root):
        try:
            data = (root / f"seg-{n}").read_bytes()
        except OSError as e:
            log.warning("version journal segment %d unreadable: %s", n, e)
            continue
        at = 0
        while at + _HEAD.size <= len(data):
            magic, kind, size = _HEAD.unpack_from(data, at)
            end = at + _HEAD.size + size
            if magic != MAGIC or end + 32 > len(data):
                break
            body = data[at + _HEAD.size : end]
            if hashlib.sha256(kind + body).digest() != data[end : end + 32]:
                break
            yield kind, body
            at = end + 32
        if at != len(data):
            log.info("version journal segment %d: %d bytes after the last intact record ignored", n, len(data) - at)


@dataclass
class Replayed:
    """What a replay moved: the fragments and how many records were applied or refused; the newest momentum
    journaled per fragment."""

    moved: set[int]
    applied: int = 0
    refused: int = 0
    momenta: dict[int, tuple[Version, Encoded]] = field(default_factory=dict)


def replay(directory: str | os.PathLike, spec: RunSpec, anchors: list[torch.Tensor], labels: list[Version],
           certs: list[bytes], unset: set[int]) -> Replayed:
    """Apply the journal to the state a checkpoint gave (`anchors`, `labels`, `certs`, changed in place; `unset`:
    fragments without values, which only a whole-fragment record fills). Each record is checked like any update
    (signature, run, membership, then the owner's digest of its result); one that fails, or that does not lead
    on from the version held, is skipped."""
    verifier = EnvelopeVerifier(spec.run_id, is_member=spec.is_member, kinds={UPDATE})
    codec = get_codec(spec.codec)
    out = Replayed(set())
    momenta: dict[int, tuple[Version, bytes]] = {}
    for kind, body in records(directory):
        try:
            if kind == UPDATE_RECORD:
                env = verifier.open(body, fresh=False)
                f = UpdateFields.parse(env.fields, len(anchors))
                if f.p in unset or f.base != labels[f.p] or not f.new > f.base:
                    continue
                result = anchors[f.p] + Encoded(codec, f.codec, env.payload).decode(anchors[f.p].numel())
                cert, label, p = env.prefix(), f.new, f.p
            elif kind == MOMENTUM_RECORD:  # (only the newest per fragment is decoded and checked, below)
                p, term, version, _ = _MOMENTUM.unpack_from(body)
                if p not in momenta or momenta[p][0] <= Version(term, version):
                    momenta[p] = (Version(term, version), body)
                continue
            elif kind == FRAGMENT_RECORD:
                (n,) = struct.unpack_from(">I", body)
                cert = body[4 : 4 + n]
                f = UpdateFields.parse(verifier.certificate(cert).fields, len(anchors))
                raw = body[4 + n :]
                if len(raw) != 4 * anchors[f.p].numel():
                    raise ValueError("anchor of the wrong size")
                if not (f.p in unset or f.new > labels[f.p]):
                    continue
                result, label, p = torch.frombuffer(bytearray(raw), dtype=torch.float32), f.new, f.p
            else:
                continue
            if anchor_digest(result) != f.digest:
                raise ValueError(f"fragment {f.p} at {f.new} differs from its owner's digest")
        except (ProtocolError, ValueError, KeyError, TypeError, struct.error) as e:  # (never stop the start)
            # (json's JSONDecodeError is a ValueError)
            out.refused += 1
            log.warning("version journal record refused: %s", e)
            continue
        anchors[p].copy_(result.reshape(-1))
        labels[p], certs[p] = label, cert
        unset.discard(p)
        out.moved.add(p)
        out.applied += 1
    for p, (label, body) in momenta.items():
        try:
            n = _MOMENTUM.unpack_from(body)[3]
            meta = json.loads(body[_MOMENTUM.size : _MOMENTUM.size + n])
            payload = torch.frombuffer(bytearray(body[_MOMENTUM.size + n :]), dtype=torch.uint8)
            out.momenta[p] = saved_momenta.checked(p, (label.term, label.version), meta, payload, spec.codec,
                                                   [a.numel() for a in anchors])
        except (ProtocolError, ValueError, KeyError, TypeError, struct.error) as e:
            out.refused += 1
            log.warning("version journal momentum of fragment %d refused: %s", p, e)
    return out


def open_journal(checkpoint_dir: str | os.PathLike | None, spec: RunSpec, anchors: list[torch.Tensor],
                 labels: list[Version], certs: list[bytes], *, resumed: bool,
                 into_theta: Callable[[int, torch.Tensor], None],
                 momenta: dict[int, tuple[Version, Encoded]] | None = None) -> Journal | None:
    """The learner's start (`Learner.start`): replay the journal onto the checkpoint just loaded (`resumed`)
    and copy each fragment it moved into θ (`into_theta(p, anchor)`: θ[p] := Θ_p, as a download would), then
    open a new segment for this run of the learner. `momenta` (the checkpoint's, `saved_momenta.read_from`)
    takes each journaled momentum of a newer version. None without a checkpoint folder, or in a synchronous run
    (it restarts from its checkpoints, docs/architecture.md §10). Without a checkpoint to replay onto, an
    earlier start's segments are dropped."""
    if checkpoint_dir is None or spec.synchronous:
        return None
    if resumed:
        replayed = replay(checkpoint_dir, spec, anchors, labels, certs, set())
        for p in sorted(replayed.moved):
            into_theta(p, anchors[p])
        for p, (label, momentum) in replayed.momenta.items():
            if momenta is not None and (p not in momenta or momenta[p][0] < label):
                momenta[p] = (label, momentum)
        if replayed.applied or replayed.refused:
            log.info("version journal: %d records replayed, %d refused; now at %s", replayed.applied,
                     replayed.refused, [str(v) for v in labels])
    journal = Journal(checkpoint_dir)
    if not resumed:
        journal.drop_before(journal.segment)
    return journal

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

kind `u`: an update frame (docs/protocol.md §3); kind `f`: u32 certificate length | certificate | fp32 anchor.
A record is trusted only after the checks any update gets: signature, run and membership (`EnvelopeVerifier`),
and the owner's digest of the anchor it produces. A torn record (killed mid-write) or a corrupt one ends its
segment. `rotate` starts a new segment just before a checkpoint is captured; once that checkpoint is written,
the segments before it are covered by it and are deleted (`drop_before`).
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import struct
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from diloco.coordinator.fragments import Encoded, anchor_digest
from diloco.coordinator.runspec import RunSpec
from diloco.coordinator.version import Version
from diloco.coordinator.wire import UPDATE, UpdateFields
from diloco.protocol.codecs import get_codec
from diloco.protocol.envelope import EnvelopeVerifier
from diloco.protocol.errors import ProtocolError

log = logging.getLogger(__name__)

MAGIC = b"DLJ1"
UPDATE_RECORD, FRAGMENT_RECORD = b"u", b"f"
_HEAD = struct.Struct(">4scI")
_SEGMENT = re.compile(r"seg-(0|[1-9][0-9]*)")


class Journal:
    """The append side (the swarm loop calls `update` and `fragment`) and the segments' life (the training
    thread calls `rotate` and `drop_before`); one lock orders them."""

    def __init__(self, directory: str | os.PathLike) -> None:
        self.dir = Path(directory) / "journal"
        self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._fd: int | None = None
        self.segment = max(segments(self.dir), default=-1) + 1
        self._open()

    def _open(self) -> None:
        self._fd = os.open(self.dir / f"seg-{self.segment}", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)

    def update(self, frame: bytes) -> None:
        """An update frame whose version this peer's store just moved to."""
        self._append(UPDATE_RECORD, [frame])

    def fragment(self, cert: bytes, anchor: torch.Tensor) -> None:
        """A fragment installed whole (a download, a full replication): its certificate and fp32 anchor."""
        data = anchor.detach().contiguous().view(torch.uint8).numpy().data
        self._append(FRAGMENT_RECORD, [struct.pack(">I", len(cert)), cert, data])

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
            try:
                _write_all(self._fd, buffers)
            except OSError as e:  # a full disk must not stop training: the checkpoint still stands
                log.warning("version journal write failed: %s", e)

    def rotate(self) -> int:
        """Start a new segment; returns its number. Call it before capturing a checkpoint: everything in the
        older segments was then applied before the capture, so the checkpoint covers it."""
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
            self.segment += 1
            self._open()
            return self.segment

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
    """What a replay moved: the fragments and how many records were applied or refused."""

    moved: set[int]
    applied: int = 0
    refused: int = 0


def replay(directory: str | os.PathLike, spec: RunSpec, anchors: list[torch.Tensor], labels: list[Version],
           certs: list[bytes], unset: set[int]) -> Replayed:
    """Apply the journal to the state a checkpoint gave (`anchors`, `labels`, `certs`, changed in place; `unset`:
    fragments without values, which only a whole-fragment record fills). Each record is checked like any update
    (signature, run, membership, then the owner's digest of its result); one that fails, or that does not lead
    on from the version held, is skipped."""
    verifier = EnvelopeVerifier(spec.run_id, is_member=spec.is_member, kinds={UPDATE})
    codec = get_codec(spec.codec)
    out = Replayed(set())
    for kind, body in records(directory):
        try:
            if kind == UPDATE_RECORD:
                env = verifier.open(body, fresh=False)
                f = UpdateFields.parse(env.fields, len(anchors))
                if f.p in unset or f.base != labels[f.p] or not f.new > f.base:
                    continue
                result = anchors[f.p] + Encoded(codec, f.codec, env.payload).decode(anchors[f.p].numel())
                cert, label, p = env.prefix(), f.new, f.p
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
            out.refused += 1
            log.warning("version journal record refused: %s", e)
            continue
        anchors[p].copy_(result.reshape(-1))
        labels[p], certs[p] = label, cert
        unset.discard(p)
        out.moved.add(p)
        out.applied += 1
    return out


def open_journal(checkpoint_dir: str | os.PathLike | None, spec: RunSpec, anchors: list[torch.Tensor],
                 labels: list[Version], certs: list[bytes], *, resumed: bool,
                 into_theta: Callable[[int, torch.Tensor], None]) -> Journal | None:
    """The learner's start (`Learner.start`): replay the journal onto the checkpoint just loaded (`resumed`)
    and copy each fragment it moved into θ (`into_theta(p, anchor)`: θ[p] := Θ_p, as a download would), then
    open a new segment for this run of the learner. None without a checkpoint folder, or in a synchronous run
    (it restarts from its checkpoints, docs/architecture.md §10). Without a checkpoint to replay onto, an
    earlier start's segments are dropped."""
    if checkpoint_dir is None or spec.synchronous:
        return None
    if resumed:
        replayed = replay(checkpoint_dir, spec, anchors, labels, certs, set())
        for p in sorted(replayed.moved):
            into_theta(p, anchors[p])
        if replayed.applied or replayed.refused:
            log.info("version journal: %d records replayed, %d refused; now at %s", replayed.applied,
                     replayed.refused, [str(v) for v in labels])
    journal = Journal(checkpoint_dir)
    if not resumed:
        journal.drop_before(journal.segment)
    return journal

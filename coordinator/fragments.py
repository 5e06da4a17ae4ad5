"""The anchors: the last global version Θ_p of every fragment this peer holds, with its label (docs/architecture.md §5.3, §8).

One store per peer, shared by the learner and the syncer shard (which, as owner or replica, advances the anchor
by the very update bytes it publishes). Every anchor change goes through `advance` or `install` under one lock,
so the training thread never reads a half-written fragment, and a label never moves backwards; nothing is hashed
under that lock (the training thread takes it at every step boundary). The update
frames of the last few versions are kept, so a learner that missed one can catch up without a full download.

What the learner does with a new version (the rebase rule) is accounted in `coordinator.rebase`, in the same
critical section as the anchor change; the learner applies it at its next step boundary (`take_changes`).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from diloco.protocol.codecs import Codec, plain_fp32
from diloco.protocol.errors import BadSignature, Malformed, StaleVersion

from .rebase import Changes, InFlight, RebaseLedger, VersionLog
from .version import GENESIS, Version

# Update frames kept per fragment for catch-up: the newest ones, as many as fit in 1 byte per parameter (one
# int8 update; ~5 sparse ones of 4 merged deltas), at least one and at most KEEP_UPDATES
KEEP_UPDATES = 16


@dataclass(frozen=True)
class Encoded:
    """A tensor kept as the codec bytes it travelled in (1 B/param at int8 instead of 4), decoded on use."""

    codec: Codec
    meta: dict
    payload: bytes | memoryview

    def decode(self, numel: int, out: Tensor | None = None) -> Tensor:
        """The flat fp32 tensor; into `out` (a contiguous fp32 buffer of `numel` elements) if given. Raises
        `Malformed` if the payload does not hold exactly `numel` elements."""
        try:
            flat = self.codec.decode(self.meta, self.payload, max_elements=numel, out=out).reshape(-1)
        except ValueError:  # `out` has `numel` elements, the payload another number
            flat = None
        if flat is None or flat.numel() != numel:
            raise Malformed(f"a tensor of {numel} elements was expected; the payload holds another number")
        return flat


Move = Tensor | Encoded


class DigestMismatch(BadSignature):
    """An update applied to our anchor does not give the bytes its owner certified."""


@dataclass
class Held:
    """One fragment's anchor and what proves it: the owner-signed header of the update that produced it."""

    anchor: Tensor  # flat fp32
    label: Version = GENESIS
    cert: bytes = b""  # envelope prefix (header + signature) of the update whose result is `anchor`
    generation: int = 0  # bumped by every write of `anchor` (see `FragmentStore.read`)
    updates: deque[tuple[Version, Version, bytes]] = field(default_factory=lambda: deque(maxlen=KEEP_UPDATES))
    kept_bytes: int = 0  # Σ of len(frame) over `updates`


class FragmentStore:
    """Anchors by fragment index, with the moves the learner has not applied to θ yet (`take_changes`)."""

    def __init__(self, anchors: list[Tensor], self_id: str = "", *, adopt: bool = False,
                 unset: Iterable[int] = ()) -> None:
        """`adopt`: the caller hands over its fp32 tensors (no copy); otherwise each anchor is cloned.
        `unset`: fragments whose anchor holds no values yet (a joiner that will download them: their memory is
        not touched until then); no update applies to them until `install` or `fill` gives them values."""
        self.held = [Held(a if adopt and plain_fp32(a) else a.detach().to(torch.float32).contiguous().clone())
                     for a in anchors]
        self.unset = set(unset)
        self.downloading: set[int] = set()  # unset fragments being downloaded straight into their anchor
        self.self_id = self_id
        self.lock = threading.Lock()  # guards all of the below and the anchors' writes
        self.rebase = RebaseLedger()  # what θ owes and is owed (the rebase rule)
        self.in_flight = InFlight(self.lock)  # the synchronous baseline's wait for merges
        self.versions = VersionLog()  # every version moved to, for the chaos harness (when recording)
        self.keep_frames: set[int] | None = None  # fragments whose update frames to keep (None: all); the shard
        # sets it to the fragments this peer owns or replicates, the holders that learners catch up from

    def __len__(self) -> int:
        return len(self.held)

    @property
    def merged_steps(self) -> int:
        """Σ over fragments of the inner steps of our deltas that reached a version (checkpointed)."""
        return self.rebase.merged_steps

    @merged_steps.setter
    def merged_steps(self, value: int) -> None:
        self.rebase.merged_steps = value

    @property
    def merged_tokens(self) -> int:
        return self.rebase.merged_tokens

    @merged_tokens.setter
    def merged_tokens(self, value: int) -> None:
        self.rebase.merged_tokens = value

    def record_versions(self) -> None:
        """From now on, remember every version this store moves to (`take_accepted`)."""
        with self.lock:
            self.versions.moves = []

    def label(self, p: int) -> Version:
        return self.held[p].label

    def labels(self) -> list[Version]:
        return [h.label for h in self.held]

    def numel(self, p: int) -> int:
        return self.held[p].anchor.numel()

    def max_numel(self) -> int:
        """The largest fragment's element count (0 for an empty store): what a message's size is bounded by."""
        return max((h.anchor.numel() for h in self.held), default=0)

    def advance(
        self, p: int, base: Version, new: Version, update: Tensor, frame: bytes, cert: bytes,
        contributors: tuple[str, ...] | list[str] = (), move: Move | None = None,
        result: Tensor | None = None, generation: int | None = None,
    ) -> None:
        """Θ_p := Θ_p + update, moving the label from `base` to `new`; refuses anything but the next step.

        `result`: Θ_p^(new) already computed (and checked against the owner's digest) by the caller, outside
        the lock, from the anchor of `generation` (see `read`); it is copied in unless the anchor has been
        written since, which raises `StaleVersion`. Hashing never happens under this lock: the training
        thread waits on it at every step boundary. `move` is `update` as the learner will apply it (its
        encoded form, to keep pending moves small); default `update` itself.
        """
        with self.lock:
            held = self.held[p]
            if p in self.unset:
                raise StaleVersion(f"fragment {p} has no values here yet; the update applies to {base}")
            if held.label != base:
                raise StaleVersion(f"fragment {p} is at {held.label}, the update applies to {base}")
            if not new > base:
                raise StaleVersion(f"update to {new} does not move fragment {p} forward from {base}")
            if result is not None:
                if generation != held.generation:
                    raise StaleVersion(f"fragment {p} was written while its update to {new} was checked")
                held.anchor.copy_(result.reshape(-1))
            else:
                held.anchor.add_(update.reshape(-1))
            held.generation += 1
            held.label, held.cert = new, cert
            self.versions.record(p, new)
            if self.keep_frames is None or p in self.keep_frames:
                self._keep(held, base, new, frame)
            if self.rebase.moved(p, move if move is not None else update.reshape(-1).clone(),
                                 merged_ours=self.self_id in contributors):
                self.in_flight.settle(p)

    @staticmethod
    def _keep(held: Held, base: Version, new: Version, frame: bytes) -> None:
        """Keep the frame of update base → new; drop the oldest ones past the budget (`KEEP_UPDATES`)."""
        if len(held.updates) == held.updates.maxlen:
            held.kept_bytes -= len(held.updates[0][2])
        held.updates.append((base, new, frame))
        held.kept_bytes += len(frame)
        while len(held.updates) > 1 and held.kept_bytes > held.anchor.numel():
            held.kept_bytes -= len(held.updates.popleft()[2])

    def read(self, p: int) -> tuple[Tensor, Version, int]:
        """(anchor, label, generation) of fragment p, for reading the anchor outside the lock: only the swarm's
        event loop writes anchors, each write bumps the generation, so a result computed from this anchor is
        committed only if the generation is still the same (`advance`, `install`)."""
        with self.lock:
            held = self.held[p]
            return held.anchor, held.label, held.generation

    def install(self, p: int, anchor: Tensor, label: Version, cert: bytes, *, repair_of: int | None = None,
                adopt: bool = False, replacing: Version | None = None) -> None:
        """Replace the whole anchor (a joiner's download, or a learner that fell too far behind).
        `repair_of`: the generation of an anchor of the same label that the caller found to differ from the
        certified bytes (`read`, then its digest): that one is replaced too, if not written since. `adopt`:
        keep `anchor` itself (a fresh tensor the caller hands over) instead of copying it. `replacing`: the
        held version, signed by a publisher this peer no longer trusts, that a lower `label` may replace
        (coordinator/distrust.py); the only way a label goes back."""
        with self.lock:
            held = self.held[p]
            same = repair_of is not None and label == held.label and repair_of == held.generation
            leaving = replacing is not None and held.label == replacing and label != replacing
            if not (label > held.label or same or leaving):
                raise StaleVersion(f"fragment {p} is already at {held.label}, not installing {label}")
            if anchor.numel() != held.anchor.numel():
                raise ValueError(f"fragment {p} has {held.anchor.numel()} elements, got {anchor.numel()}")
            if adopt and plain_fp32(anchor) and anchor.dim() == 1:
                held.anchor = anchor
            else:
                held.anchor.copy_(anchor.reshape(-1))
            held.generation += 1
            held.label, held.cert = label, cert
            self.unset.discard(p)
            self.versions.record(p, label)
            held.updates.clear()
            held.kept_bytes = 0
            self.rebase.installed(p)  # θ[p] is overwritten: the progress it held is gone
            self.in_flight.settle(p)

    def begin_download(self, p: int) -> Tensor | None:
        """The memory to download fragment p into: its own anchor while p is unset (nothing reads it then;
        `install` of that very tensor then copies nothing), once at a time; otherwise None (use a new tensor).
        Pair with `end_download`."""
        with self.lock:
            if p not in self.unset or p in self.downloading:
                return None
            self.downloading.add(p)
            return self.held[p].anchor

    def end_download(self, p: int) -> None:
        with self.lock:
            self.downloading.discard(p)

    def fill(self, p: int, values: Tensor) -> bool:
        """Give an unset fragment its values (a joiner's own Θ^(0), for a fragment nobody has a version of);
        False, changing nothing, if it has values already or is being downloaded."""
        with self.lock:
            if p not in self.unset or p in self.downloading:
                return False
            self.held[p].anchor.copy_(values.reshape(-1))
            self.held[p].generation += 1
            self.unset.discard(p)
            return True

    def cert(self, p: int) -> bytes:
        """The certificate of the version of p held now (b"" at genesis)."""
        with self.lock:
            return self.held[p].cert

    def updates_after(self, p: int, label: Version) -> list[bytes] | None:
        """The kept update frames that lead from `label` to the current version, or None if not all are kept."""
        with self.lock:
            held = self.held[p]
            chain = list(held.updates)
        frames: list[bytes] = []
        at = label
        for base, new, frame in chain:
            if base == at:
                frames.append(frame)
                at = new
        return frames if at == held.label else None

    def add_to(self, p: int, label: Version, update: Tensor, out: Tensor) -> bool:
        """out := Θ_p + update if Θ_p is still at `label` (what an owner certifies); False if it has moved."""
        with self.lock:
            held = self.held[p]
            if held.label != label:
                return False
            torch.add(held.anchor, update.reshape(-1), out=out)
            return True

    def snapshot_into(self, p: int, out: Tensor) -> tuple[Version, bytes]:
        """Copy the anchor into `out` (a flat fp32 buffer of its size); returns its (label, cert)."""
        with self.lock:
            h = self.held[p]
            out.copy_(h.anchor)
            return h.label, h.cert

    def snapshot(self, p: int) -> tuple[Tensor, Version, bytes]:
        """A consistent copy of (anchor, label, cert)."""
        with self.lock:
            h = self.held[p]
            return h.anchor.clone(), h.label, h.cert

    def set_outstanding(self, p: int, base: Version, sent: Move, steps: int, tokens: int = 0,
                        generation: int | None = None) -> tuple[int, int] | None:
        """Remember the delta just sent for p (as the owner will merge it) until a version merges it.
        Returns the (steps, tokens) it carries (`RebaseLedger.sent`). None if the anchor has moved off `base`
        (or, given the `generation` Δ was computed from, was written at all) meanwhile: then the delta must
        not be sent."""
        with self.lock:
            held = self.held[p]
            if held.label != base or (generation is not None and held.generation != generation):
                return None
            return self.rebase.sent(p, sent, steps, tokens)

    def drop_outstanding(self, p: int) -> None:
        """The delta was not accepted: its progress stays in θ[p] and goes out with the next one."""
        with self.lock:
            self.rebase.unsent(p)
            self.in_flight.settle(p)

    def carry(self, p: int, steps: int, tokens: int) -> None:
        """A delta that was never sent: its progress stays in θ[p], and the next delta counts its steps."""
        with self.lock:
            self.rebase.carry(p, steps, tokens)

    # -- waiting for a delta to be merged (the synchronous baseline) ----------------------------------------

    def begin_send(self, p: int) -> None:
        """The learner hands fragment p's delta to the loop: p is in flight until merged, refused or moot."""
        with self.lock:
            self.in_flight.add(p)

    def end_send(self, p: int, accepted: bool) -> None:
        """The loop is done sending; an accepted delta stays in flight until a version merges it."""
        with self.lock:
            if not accepted or p not in self.rebase.outstanding:
                self.in_flight.settle(p)

    def wait_settled(self, fragments: list[int] | range, timeout: float) -> bool:
        """Block until none of `fragments` is in flight; False if `timeout` seconds passed first."""
        return self.in_flight.wait(fragments, timeout)

    def take_accepted(self) -> list[tuple[int, int, int]]:
        """The (p, term, version) moves recorded since the last call (after `record_versions`)."""
        with self.lock:
            return self.versions.take()

    def take_changes(self, copy_replaced: Callable[[int, Tensor], None],
                     also: Callable[[list[Held]], object] | None = None, *, wait: bool = True) -> Changes | None:
        """For the training thread, at a step boundary: what to do to θ, and the labels θ is then based on.

        `copy_replaced(p, anchor)` writes each fragment installed whole into θ, inside the same critical
        section: an update landing after it goes into the next changes, never into both the copy and the
        moves (θ would get it twice). `also(held)` runs in that critical section too (a checkpoint reads the
        anchors there: they are then exactly what θ is based on once these changes are applied); its result
        is `Changes.also`. `wait=False`: None, at once, while another thread holds the lock (the event loop
        writes anchors under it: the training thread takes the changes at its next step instead of waiting)."""
        if not self.lock.acquire(blocking=wait):
            return None
        try:
            replaced, moves = self.rebase.take()
            for p in sorted(replaced):
                copy_replaced(p, self.held[p].anchor)
            extra = also(self.held) if also is not None else None
            return Changes(replaced, moves, [h.label for h in self.held], extra)
        finally:
            self.lock.release()

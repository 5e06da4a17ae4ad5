"""Who may publish a fragment's version: the authorization rule for updates, certificates and replications
(docs/architecture.md §6.7).

Signatures say who sent a message; this module says whether that sender may change fragment p. A term is
owned by one peer: its slot (`term % TERM_SLOTS`) is derived from the publisher's PeerId (`term_slot`), so a
member cannot publish in another member's term. A version that starts a term (a takeover) must come from a
peer that may own p in this peer's view of the live members: its owner or one of its replicas (a replica
takes over as soon as it sees the owner gone, and this peer's view may still hold the old owner). A version
fetched from a holder (catch-up, a whole-fragment download) may also start a term of a publisher that is no
longer live (it was published while its owner was), or of one that owned p in this view without this peer
(published while this peer was away: a peer that comes back must reach it before publishing over it). Every
version moves one outer step (`version + 1`), and a term may be at most `TERM_BLOCKS_AHEAD` takeovers above its
base and below `TERM_MAX`, so no message can push a fragment's label to where the next real owner could not
publish above it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

from diloco.protocol.errors import ProtocolError

from .version import Version

TERM_SLOTS = 1 << 16
TERM_BLOCKS_AHEAD = 64  # takeovers one version may jump (a real one jumps 1, or a few after a partition)
TERM_MAX = 1 << 47  # 2^31 takeovers: never reached by a real run, and far from the int64 limit


class Unauthorized(ProtocolError):
    """A correctly signed message from a peer that may not change what it names."""

    status = 403


def term_slot(peer_id: str) -> int:
    """The slot of `peer_id`'s terms: the first 16 bits of SHA-256 of its PeerId."""
    return int.from_bytes(hashlib.sha256(peer_id.encode()).digest()[:2], "big") % TERM_SLOTS


def next_term(seen: int, peer_id: str) -> int:
    """A term above every term seen, in a slot of its own for this peer: two peers that take a fragment at the
    same moment (their views of the member set differ for a poll interval) publish under different terms, so
    the higher one wins everywhere instead of two different fragments carrying one label."""
    term = (seen // TERM_SLOTS + 1) * TERM_SLOTS + term_slot(peer_id)
    if term >= TERM_MAX:
        raise ValueError(f"term {term} would pass the largest term {TERM_MAX}")
    return term


def check_term(term: int, signer: str) -> None:
    """`signer` may publish in `term`: one of its own slot, below TERM_MAX. Raises `Unauthorized`."""
    if term == 0:
        raise Unauthorized("term 0 is the genesis; no owner publishes in it")
    if term >= TERM_MAX:
        raise Unauthorized(f"term {term} is above the largest term {TERM_MAX}")
    if term_slot(signer) != term % TERM_SLOTS:
        raise Unauthorized(f"term {term} is in slot {term % TERM_SLOTS}, not in the signer's "
                           f"({term_slot(signer)}): only the peer that took the fragment over publishes in it")


def check_update(p: int, base: Version, new: Version, signer: str, may_own: Callable[[int, str], bool],
                 is_live: Callable[[str], bool], pushed: bool) -> None:
    """An update of fragment p from `base` to `new` signed by `signer` may be applied; raises `Unauthorized`.

    `may_own(p, peer)`: `peer` is p's owner or a replica in this peer's view (for a fetched update, also in this
    view without this peer: `Membership.may_have_owned`); `is_live(peer)`: it is a live member in this view.
    `pushed`: the update was sent to us by its publisher (not fetched from a holder)."""
    check_term(new.term, signer)
    if new.version != base.version + 1:
        raise Unauthorized(f"an update moves one outer step; {base} → {new} is not one")
    if new.term // TERM_SLOTS > base.term // TERM_SLOTS + TERM_BLOCKS_AHEAD:
        raise Unauthorized(f"term {new.term} is more than {TERM_BLOCKS_AHEAD} takeovers above {base}")
    if new.term != base.term and not may_own(p, signer) and (pushed or is_live(signer)):
        raise Unauthorized(f"{signer[:8]} takes fragment {p} over at {new} but is neither its owner nor a "
                           f"replica here")


def check_replication(p: int, term: int, label: Version, full: bool, signer: str,
                      may_own: Callable[[int, str], bool]) -> None:
    """A replication of fragment p (the owner's `term`, version `label`) signed by `signer` may be kept; raises
    `Unauthorized`. An owner replicates in its own term, to its replicas, so `signer` may own p here; a full
    state (a hand-over, or a replica that fell behind) may also come from the peer that published `label`
    and has since lost p to a newcomer (and `may_own` of a full state is `Membership.may_have_owned`: the
    peer that held p while this one was away hands it back)."""
    check_term(term, signer)
    if label.term > term or term // TERM_SLOTS > label.term // TERM_SLOTS + TERM_BLOCKS_AHEAD:
        raise Unauthorized(f"an owner in term {term} cannot replicate version {label}")
    if not may_own(p, signer) and not (full and label.term == term):
        raise Unauthorized(f"{signer[:8]} replicates fragment {p} but is neither its owner nor a replica here")

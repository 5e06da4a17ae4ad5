"""Who owns fragment p: rendezvous (highest random weight) hashing over the live members (docs/architecture.md §2).

owner(p) is the member with the highest score H(run_id, p, peer_id); the next `replicas` members by score are its
replicas. Every peer computes the same answer from the same member list, with no coordination, and when a
member joins or leaves only the fragments whose top candidates change move. Client-mode peers (no inbound
port) are never candidates. Pure functions: no network, no clocks.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import Protocol

from diloco.protocol import canonical


class MemberLike(Protocol):
    """Anything with a peer id and a client-mode flag (the member records of the DHT)."""

    @property
    def peer_id(self) -> str: ...

    @property
    def client_mode(self) -> bool: ...


def score(run_id: bytes, p: int, peer_id: str) -> int:
    """H(run_id, p, peer_id): SHA-256 of the canonical msgpack `[run_id, p, peer_id]`, as a big-endian integer."""
    return int.from_bytes(hashlib.sha256(canonical.packb([bytes(run_id), int(p), peer_id])).digest(), "big")


def _candidates(members: Iterable[MemberLike]) -> list[str]:
    """Distinct peer ids of the members that may own fragments, in a fixed order."""
    return sorted({m.peer_id for m in members if not m.client_mode})


def _ranked(run_id: bytes, p: int, candidates: list[str], n: int) -> list[str]:
    # Highest score first; equal scores (a SHA-256 collision) fall back to the peer id, to stay total.
    return sorted(candidates, key=lambda peer: (-score(run_id, p, peer), peer))[:n]


def owners(run_id: bytes, p: int, members: Iterable[MemberLike], replicas: int = 1) -> list[str]:
    """[owner, replica 1, ..., replica r] of fragment p; shorter when fewer candidates are live, [] when none."""
    if replicas < 0:
        raise ValueError(f"replicas must be >= 0, got {replicas}")
    return _ranked(run_id, p, _candidates(members), 1 + replicas)


def assignment(run_id: bytes, P: int, members: Iterable[MemberLike], replicas: int = 1) -> list[list[str]]:
    """`owners(run_id, p, members, replicas)` for every fragment p in range(P)."""
    if replicas < 0:
        raise ValueError(f"replicas must be >= 0, got {replicas}")
    candidates = _candidates(members)
    return [_ranked(run_id, p, candidates, 1 + replicas) for p in range(P)]


def roles_of(peer_id: str, table: list[list[str]]) -> dict[int, int]:
    """For an `assignment` table: {fragment: rank} of `peer_id`, rank 0 = owner, 1.. = replica."""
    return {p: holders.index(peer_id) for p, holders in enumerate(table) if peer_id in holders}

"""Kademlia routing table: who we know, bucketed by XOR distance from our own node id (docs/architecture.md §4).

Layout: 160 fixed buckets, allocated lazily; bucket `i` holds the contacts whose distance `d = id ^ self_id`
has `d.bit_length() - 1 == i`, i.e. `2**i <= d < 2**(i+1)`. Each bucket keeps at most `k` contacts ordered
least-recently-seen first, plus a small replacement cache of the most recently seen contacts that did not fit.
Which contacts are kept is the same as in a split-on-own-bucket table; only the near buckets may hold a few
more, which only helps lookups. Refresh covers the buckets from the nearest non-empty one outwards, which is
exactly the range a split-style table would own, so a 10-node swarm refreshes a handful of buckets, not 160.

The eviction dance is the caller's (it owns the network): `update(c)` on a full bucket returns the
least-recently-seen contact to PING; if it answers call `update` on it, else `remove` it, which promotes the
freshest replacement.

This module never does I/O, never admits our own id or a client-mode node (a node that takes no inbound
connections must never be handed out as a contact), and is not thread-safe: one asyncio loop owns it.
"""

from __future__ import annotations

import hashlib
import random
import time
from collections.abc import Callable, Iterator
from typing import Generic, Protocol, TypeVar

ID_BITS = 160
ID_SPACE = 1 << ID_BITS


def key_id(key: str) -> int:
    """The 160-bit id a DHT key is stored under: the first 160 bits of SHA-256 of its UTF-8 bytes."""
    return int.from_bytes(hashlib.sha256(key.encode("utf-8")).digest()[: ID_BITS // 8], "big")


def bucket_index(self_id: int, node_id: int) -> int:
    """Index of the bucket holding `node_id` in `self_id`'s table: floor(log2(self_id ^ node_id)).
    Raises `ValueError` for `node_id == self_id`, which has no bucket."""
    d = self_id ^ node_id
    if d == 0:
        raise ValueError("a node has no bucket in its own routing table")
    return d.bit_length() - 1


class Contact(Protocol):
    """What the table needs from a contact. `records.NodeInfo` is the real one; tests may use a stand-in."""

    @property
    def node_id(self) -> int: ...

    @property
    def client_mode(self) -> bool: ...

    @property
    def timestamp_ms(self) -> int: ...


C = TypeVar("C", bound=Contact)


class RoutingTable(Generic[C]):
    """k-buckets over the 160-bit id space of the node `self_id`.

    `clock` (monotonic seconds) dates bucket activity for `stale_buckets`; `replacements` bounds each bucket's
    replacement cache.
    """

    def __init__(
        self,
        self_id: int,
        k: int = 20,
        clock: Callable[[], float] = time.monotonic,
        *,
        replacements: int = 8,
        rng: random.Random | None = None,
    ) -> None:
        if not 0 <= self_id < ID_SPACE:
            raise ValueError("self_id must be a 160-bit non-negative integer")
        if k < 1 or replacements < 0:
            raise ValueError("k must be >= 1 and replacements >= 0")
        self.self_id = self_id
        self.k = k
        self.replacements = replacements
        self._clock = clock
        self._rng = rng or random.Random()
        self._buckets: dict[int, dict[int, C]] = {}  # index -> {node_id: contact}, least-recently-seen first
        self._cache: dict[int, dict[int, C]] = {}  # index -> replacement cache, least-recently-seen first
        self._created = clock()
        self._touched: dict[int, float] = {}  # index -> last lookup or contact in that bucket's range

    def bucket_index(self, node_id: int) -> int:
        return bucket_index(self.self_id, node_id)

    def update(self, contact: C) -> C | None:
        """We heard from `contact`: insert it or mark it most recently seen.

        Keeps whichever version of the contact has the larger `timestamp_ms` (a replayed old NodeInfo never
        rolls an address back). Returns None, or, when the bucket is full, its least-recently-seen contact for
        the caller to PING (the newcomer waits in the replacement cache). Our own id and client-mode contacts
        are refused (None, nothing inserted); a newer client-mode version of a known contact removes it.
        """
        nid = contact.node_id
        if not 0 <= nid < ID_SPACE:
            raise ValueError(f"node id {nid} is not a 160-bit non-negative integer")
        if nid == self.self_id:
            return None
        i = self.bucket_index(nid)
        bucket = self._buckets.get(i)
        known = bucket.get(nid) if bucket else None
        if contact.client_mode:  # refused; and it says a node we hold stopped taking connections
            held = known if known is not None else self._cache.get(i, {}).get(nid)
            if held is not None and contact.timestamp_ms > held.timestamp_ms:
                self.remove(nid)
            return None
        self._touched[i] = self._clock()
        if bucket is None:
            bucket = self._buckets[i] = {}
        if known is not None:
            del bucket[nid]
            bucket[nid] = _newer(known, contact)
            return None
        cache = self._cache.get(i, {})
        if len(bucket) < self.k:
            bucket[nid] = _newer(cache.pop(nid), contact) if nid in cache else contact
            return None
        if self.replacements:
            cache = self._cache.setdefault(i, {})
            old = cache.pop(nid, None)
            cache[nid] = _newer(old, contact) if old is not None else contact
            while len(cache) > self.replacements:
                del cache[next(iter(cache))]
        return next(iter(bucket.values()))

    def remove(self, node_id: int) -> C | None:
        """Forget `node_id` (it did not answer) and promote the most recently seen replacement, if any.
        Returns the removed contact, or None if it was not in the table (it is dropped from the cache too)."""
        if node_id == self.self_id or not 0 <= node_id < ID_SPACE:
            return None
        i = self.bucket_index(node_id)
        cache = self._cache.get(i)
        if cache is not None:
            cache.pop(node_id, None)
        bucket = self._buckets.get(i)
        if bucket is None or node_id not in bucket:
            return None
        gone = bucket.pop(node_id)
        if cache:
            nid = next(reversed(cache))
            bucket[nid] = cache.pop(nid)
        if not bucket:
            del self._buckets[i]
        if cache is not None and not cache:
            del self._cache[i]
        return gone

    def get(self, node_id: int) -> C | None:
        if node_id == self.self_id or not 0 <= node_id < ID_SPACE:
            return None
        bucket = self._buckets.get(self.bucket_index(node_id))
        return bucket.get(node_id) if bucket else None

    def closest(self, target: int, n: int, exclude: set[int] | None = None) -> list[C]:
        """Up to `n` contacts nearest to `target` by XOR distance, nearest first; `exclude` holds node ids."""
        if n <= 0:
            return []
        out: list[C] = []
        # Buckets cover disjoint ranges of distance to `target`; visit them nearest range first and stop once
        # n contacts are in hand: every later bucket's contacts are farther than all of these.
        for i in self._bucket_order(target):
            bucket = self._buckets.get(i)
            if not bucket:
                continue
            ranked = sorted(
                (c for c in bucket.values() if not exclude or c.node_id not in exclude),
                key=lambda c: c.node_id ^ target,
            )
            out.extend(ranked)
            if len(out) >= n:
                break
        out.sort(key=lambda c: c.node_id ^ target)
        return out[:n]

    def _bucket_order(self, target: int) -> list[int]:
        d = target ^ self.self_id
        # A contact in bucket i is at distance (d with bit i flipped) in its bits >= i, anything below: each
        # bucket covers one aligned, disjoint range of distances, and sorting by the range start orders them.
        return sorted(self._buckets, key=lambda i: ((d ^ (1 << i)) >> i) << i)

    def stale_buckets(self, older_than_s: float) -> list[int]:
        """For each bucket with no contact or lookup for `older_than_s`, a random id in its range to look up.

        Covers the buckets from the nearest non-empty one out to the farthest; an empty table gives [] (the
        caller bootstraps instead). Returned ids are not marked fresh: call `touch_bucket_for` after the lookup.
        """
        if not self._buckets:
            return []
        now = self._clock()
        out = []
        for i in range(min(self._buckets), ID_BITS):
            if now - self._touched.get(i, self._created) >= older_than_s:
                out.append(self.self_id ^ ((1 << i) | self._rng.getrandbits(i)))
        return out

    def touch_bucket_for(self, target: int) -> None:
        """A lookup for `target` just ran: its bucket is fresh."""
        if target != self.self_id:
            self._touched[self.bucket_index(target)] = self._clock()

    def bucket(self, index: int) -> list[C]:
        """Contacts of bucket `index`, least-recently-seen first (a copy)."""
        return list(self._buckets.get(index, {}).values())

    def replacement_cache(self, index: int) -> list[C]:
        """Replacement candidates of bucket `index`, least-recently-seen first (a copy)."""
        return list(self._cache.get(index, {}).values())

    def __len__(self) -> int:
        return sum(len(b) for b in self._buckets.values())

    def __iter__(self) -> Iterator[C]:
        """A snapshot of every contact, nearest bucket first."""
        return iter([c for i in sorted(self._buckets) for c in self._buckets[i].values()])

    def __contains__(self, node_id: object) -> bool:
        return isinstance(node_id, int) and self.get(node_id) is not None


def _newer(old: C, new: C) -> C:
    return new if new.timestamp_ms >= old.timestamp_ms else old

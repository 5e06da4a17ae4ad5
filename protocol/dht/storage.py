"""Local storage of DHT values: what this node answers to FIND_VALUE and republishes (docs/architecture.md §4).

A key holds two independent namespaces: at most one *plain* record (subkey None, writable by anyone) and a
dictionary of *subkey* records (each writable only by the peer whose PeerId is the subkey). They never
overwrite each other; `get` returns both in a `StoredValue`. Readers of a dictionary key such as
`run:<id>:members` should look at `.subkeys` only: a plain record there is anyone's to write.

Per (key, subkey) the record with the larger expiration wins (ties: the larger signature, so every replica
keeps the same one); storing an identical record again is a no-op, and an older one raises `StaleVersion`
(409), so the STORE handler can tell the writer its value was superseded.

`store` refuses with a typed error and a one-line reason, and then has stored NOTHING:
  TooLarge       the value is over `max_value_bytes`;
  Expired        already expired, or expiring more than `max_expiration_s` (+ clock skew) from now;
  BadSignature   the signature does not verify (`ForgedSubkey`: signed by someone who does not own the subkey);
  Malformed      a key or subkey that is not one;
  StaleVersion   an equal-or-newer record is already held for this (key, subkey);
  BackPressure   `max_keys` records or `max_total_bytes` of values already held (after purging expired ones).

Expired records are never returned: `get` purges the key it reads, `purge()` sweeps everything. This module
never does I/O and never decides which keys this node should hold (that is the lookup's job); it keeps records
in plain dicts, one small slotted `ValueRecord` each.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from ..errors import BackPressure, Expired, StaleVersion, TooLarge
from .records import ValueRecord


@dataclass(frozen=True, slots=True)
class StoredValue:
    """What a key holds now: its plain record (or None) and its live subkey records by subkey."""

    plain: ValueRecord | None
    subkeys: dict[str, ValueRecord]


class DHTStorage:
    """Signed, expiring records by (key, subkey). `clock` is unix seconds (records carry unix expirations)."""

    def __init__(
        self,
        max_value_bytes: int = 64 * 1024,
        max_expiration_s: float = 24 * 3600,
        max_keys: int = 100_000,
        clock: Callable[[], float] = time.time,
        *,
        max_total_bytes: int = 256 * 1024 * 1024,
        max_clock_skew_s: float = 60.0,
    ) -> None:
        self.max_value_bytes = max_value_bytes
        self.max_expiration_s = max_expiration_s
        self.max_keys = max_keys  # bounds records: each (key, subkey) pair counts as one
        self.max_total_bytes = max_total_bytes  # bounds the sum of stored value sizes
        self.max_clock_skew_s = max_clock_skew_s
        self._clock = clock
        self._plain: dict[str, ValueRecord] = {}
        self._subkeys: dict[str, dict[str, ValueRecord]] = {}
        self._count = 0
        self._bytes = 0

    def store(self, record: ValueRecord) -> None:
        """Keep `record` if it is valid and newer than what this (key, subkey) holds; else raise (see module)."""
        size = len(record.value)
        if size > self.max_value_bytes:
            raise TooLarge(
                f"value of {size} bytes for {record.key!r} exceeds the limit of {self.max_value_bytes}"
            )
        now = self._clock()
        if record.expiration <= now:
            raise Expired(f"record for {record.key!r} expired {now - record.expiration:.0f}s ago")
        if record.expiration > now + self.max_expiration_s + self.max_clock_skew_s:
            raise Expired(
                f"record for {record.key!r} expires in {record.expiration - now:.0f}s, "
                f"more than the {self.max_expiration_s:.0f}s this node keeps values"
            )
        record.verify()
        held = self._live(record.key, record.subkey, now)
        if held is not None:
            if held == record:
                return
            if not record.supersedes(held):
                raise StaleVersion(
                    f"{_name(record)} already holds a record expiring at {held.expiration:.3f} "
                    f"(this one: {record.expiration:.3f})"
                )
        self._make_room(size - (len(held.value) if held else 0), new_entry=held is None)
        self._put(record)

    def get(self, key: str) -> StoredValue | None:
        """The live records of `key`, or None when it holds none."""
        now = self._clock()
        plain = self._live(key, None, now)
        subkeys = self._subkeys.get(key)
        if subkeys is not None:
            for rec in [r for r in subkeys.values() if r.expiration <= now]:
                self._drop(rec)
            subkeys = self._subkeys.get(key)
        if plain is None and not subkeys:
            return None
        return StoredValue(plain, dict(subkeys) if subkeys else {})

    def get_record(self, key: str, subkey: str | None = None) -> ValueRecord | None:
        """The live record of exactly (key, subkey), or None."""
        return self._live(key, subkey, self._clock())

    def purge(self) -> int:
        """Drop every expired record; returns how many were dropped."""
        now = self._clock()
        dead = [r for r in self._records() if r.expiration <= now]
        for rec in dead:
            self._drop(rec)
        return len(dead)

    def items_for_republish(self) -> list[ValueRecord]:
        """Every live record, for the periodic republish to the key's current k closest nodes."""
        now = self._clock()
        return [r for r in self._records() if r.expiration > now]

    @property
    def total_bytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        """Records held, counting expired ones not yet purged."""
        return self._count

    # -- internals ------------------------------------------------------------------------------------------

    def _records(self) -> list[ValueRecord]:
        return [*self._plain.values(), *(r for d in self._subkeys.values() for r in d.values())]

    def _live(self, key: str, subkey: str | None, now: float) -> ValueRecord | None:
        rec = self._plain.get(key) if subkey is None else self._subkeys.get(key, {}).get(subkey)
        if rec is not None and rec.expiration <= now:
            self._drop(rec)
            return None
        return rec

    def _make_room(self, extra_bytes: int, *, new_entry: bool) -> None:
        def full() -> bool:
            return (
                new_entry and self._count >= self.max_keys
            ) or self._bytes + extra_bytes > self.max_total_bytes

        if full():
            self.purge()
            if full():
                raise BackPressure(
                    f"DHT storage full ({self._count} records, {self._bytes} bytes); try another node or later"
                )

    def _put(self, rec: ValueRecord) -> None:
        if rec.subkey is None:
            old = self._plain.get(rec.key)
            self._plain[rec.key] = rec
        else:
            d = self._subkeys.setdefault(rec.key, {})
            old = d.get(rec.subkey)
            d[rec.subkey] = rec
        if old is None:
            self._count += 1
        else:
            self._bytes -= len(old.value)
        self._bytes += len(rec.value)

    def _drop(self, rec: ValueRecord) -> None:
        if rec.subkey is None:
            if self._plain.get(rec.key) is not rec:
                return
            del self._plain[rec.key]
        else:
            d = self._subkeys.get(rec.key)
            if d is None or d.get(rec.subkey) is not rec:
                return
            del d[rec.subkey]
            if not d:
                del self._subkeys[rec.key]
        self._count -= 1
        self._bytes -= len(rec.value)


def _name(rec: ValueRecord) -> str:
    return repr(rec.key) if rec.subkey is None else f"{rec.key!r}[{rec.subkey}]"

"""Fragment versions: (term, version), ordered lexicographically, that never regress (docs/architecture.md §2, §6.5).

`version` counts outer steps of a fragment; `term` grows with every ownership takeover. A peer that takes a
fragment over publishes under a term above every term it has seen (`authority.next_term`: the next block of 2^16,
at an offset of its own, so two peers never pick the same term), and after a partition heals the higher term
wins whatever the version counts. Pure values: no network, no clocks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from diloco.protocol.canonical import parse_decimal
from diloco.protocol.errors import Malformed

_MAX = 2**63 - 1


@dataclass(frozen=True, order=True)
class Version:
    term: int
    version: int

    def __post_init__(self) -> None:
        for field, value in (("term", self.term), ("version", self.version)):
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= _MAX:
                raise ValueError(f"{field} must be an integer in [0, 2**63), got {value!r}")

    def next(self) -> Version:
        """The version published by this term's next outer step."""
        return Version(self.term, self.version + 1)

    def takeover(self) -> Version:
        """The version a replica holds after taking ownership over from this one (same state, term + 1)."""
        return Version(self.term + 1, self.version)

    def to_wire(self) -> list[int]:
        return [self.term, self.version]

    @classmethod
    def from_wire(cls, value: Any) -> Version:
        """Parse `[term, version]` from a decoded message; raises `Malformed`."""
        if not isinstance(value, list | tuple) or len(value) != 2:
            raise Malformed("a version must be a [term, version] pair")
        try:
            return cls(value[0], value[1])
        except ValueError as e:
            raise Malformed(f"bad version: {e}") from None

    @classmethod
    def parse(cls, text: str) -> Version:
        """Parse `TERM.VERSION` as written in a URL query (`str(version)`); raises `Malformed`."""
        term, dot, version = text.partition(".")
        if not dot:
            raise Malformed(f"a version must be written TERM.VERSION, got {text[:48]!r}")
        try:
            return cls(parse_decimal(term, "a version's term"), parse_decimal(version, "a version number"))
        except ValueError as e:
            raise Malformed(f"bad version: {e}") from None

    def __str__(self) -> str:
        return f"{self.term}.{self.version}"


GENESIS = Version(0, 0)


def is_newer(a: Version, b: Version) -> bool:
    """True when `a` is strictly greater than `b`, i.e. may replace it (learners accept only these)."""
    return a > b

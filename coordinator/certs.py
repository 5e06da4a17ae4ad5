"""Membership certificates and spec amendments: how an `allowlist` run admits keys after its genesis, and drops
them again, without a new run id (docs/protocol.md §7.18).

Both are signed by the run's creator, each under its own domain, so neither verifies as the other nor as a
genesis. A certificate admits one key for a time window. An amendment lists, in full each time, the keys
revoked and the keys added since the genesis; the highest `seq` wins, so the newest amendment alone is the
run's roster. Peers learn both from the DHT key `run:<id>:auth` (an `AuthRecord` per peer: its own certificate,
and the newest amendment it knows, relayed), and `Roster` decides, from all of it, who is admitted now.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from diloco.protocol import canonical
from diloco.protocol.errors import Expired, Malformed, NotMember, ProtocolError, WrongRun
from diloco.protocol.identity import PUBLIC_KEY_BYTES, SIGNATURE_BYTES, Identity, peer_id_of, verify_repeated

from .runspec import RunSpec

CERT_DOMAIN = b"diloco-node/v1/member-cert\0"
AMENDMENT_DOMAIN = b"diloco-node/v1/amendment\0"
CLOCK_SKEW_S = 60  # a certificate's window is widened by this on both sides (the envelope's clock skew)
MAX_AMENDED_KEYS = 1024  # revoked + allowed keys in one amendment: it must fit a 64 KiB DHT value
MAX_CERT_BYTES = 1024
MAX_AMENDMENT_BYTES = 48 * 1024
_INT64 = 2**63


def auth_key(run_id: bytes) -> str:
    """The DHT key of the run's certificates and amendments (one subkey per publishing peer)."""
    return f"run:{run_id.hex()}:auth"


def _int(v: Any, name: str) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v < _INT64:
        raise Malformed(f"{name} must be an integer in [0, 2^63)")
    return v


def _key(v: Any, name: str) -> bytes:
    if not isinstance(v, bytes) or len(v) != PUBLIC_KEY_BYTES:
        raise Malformed(f"{name} must be a {PUBLIC_KEY_BYTES}-byte public key")
    return v


def _map(obj: Any, what: str, names: set[str]) -> dict[str, Any]:
    if not isinstance(obj, dict) or set(obj) != names:
        raise Malformed(f"{what} must be a map with exactly the keys {sorted(names)}")
    return obj


def _require_allowlist(creator: Identity, spec: RunSpec) -> None:
    if spec.membership != "allowlist":
        raise ValueError("this run is open (it admits every key): certificates and amendments are for "
                         "allowlist runs")
    if creator.public_key != spec.creator:
        raise ValueError(f"this key ({creator.peer_id}) is not the run's creator ({peer_id_of(spec.creator)})")


def _write(path: str | os.PathLike[str], data: bytes) -> Path:
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)
    return path


def _read(path: str | os.PathLike[str], what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise Malformed(f"cannot read {what} {path}: {e.strerror}") from None


@dataclass(frozen=True)
class Certificate:
    """The creator's word that `peer` is a member of run `run_id` from `not_before` to `not_after` (unix s)."""

    run_id: bytes
    peer: bytes
    not_before: int
    not_after: int
    signature: bytes

    @classmethod
    def issue(cls, creator: Identity, spec: RunSpec, peer: bytes, days: float, *, now: float | None = None) -> Certificate:
        """Certify `peer` for `days` from now. Raises `ValueError` for an open run, a key that is not the
        creator's, or a window that is not positive."""
        _require_allowlist(creator, spec)
        _key(peer, "peer")
        if not days > 0:
            raise ValueError("a certificate must be valid for more than 0 days")
        start = int(time.time() if now is None else now)
        if not math.isfinite(days) or start + days * 86400 >= _INT64:
            raise ValueError("a certificate's end must be before 2^63 seconds")
        end = start + int(days * 86400)
        unsigned = cls(spec.run_id, peer, start, end, b"")
        return cls(spec.run_id, peer, start, end, creator.sign(unsigned.signed_message()))

    def signed_message(self) -> bytes:
        return CERT_DOMAIN + canonical.packb([self.run_id, self.peer, self.not_before, self.not_after])

    def verify(self, spec: RunSpec, *, now: float | None = None) -> None:
        """Raises `WrongRun` (another run), `BadSignature` (not the creator's), `Expired` (outside the window,
        ± `CLOCK_SKEW_S`)."""
        if self.run_id != spec.run_id:
            raise WrongRun(f"certificate is for run {self.run_id.hex()[:16]}…, not {spec.run_id.hex()[:16]}…")
        verify_repeated(spec.creator, self.signature, self.signed_message())
        self.check_time(now)

    def check_time(self, now: float | None = None) -> None:
        t = time.time() if now is None else now
        if not self.not_before - CLOCK_SKEW_S <= t <= self.not_after + CLOCK_SKEW_S:
            raise Expired(f"certificate of {peer_id_of(self.peer)} is valid from {self.not_before} to "
                          f"{self.not_after} (unix s), not now ({t:.0f})")

    def to_wire(self) -> dict[str, Any]:
        return {"run_id": self.run_id, "peer": self.peer, "not_before": self.not_before,
                "not_after": self.not_after, "signature": self.signature}

    @classmethod
    def from_wire(cls, obj: Any) -> Certificate:
        """Shape and types only: `verify` checks the signature against a spec."""
        o = _map(obj, "certificate", {"run_id", "peer", "not_before", "not_after", "signature"})
        if not isinstance(o["run_id"], bytes) or len(o["run_id"]) != 32:
            raise Malformed("certificate run_id must be 32 bytes")
        if not isinstance(o["signature"], bytes) or len(o["signature"]) != SIGNATURE_BYTES:
            raise Malformed(f"certificate signature must be {SIGNATURE_BYTES} bytes")
        nb, na = _int(o["not_before"], "not_before"), _int(o["not_after"], "not_after")
        if na < nb:
            raise Malformed("certificate not_after is before its not_before")
        return cls(o["run_id"], _key(o["peer"], "peer"), nb, na, o["signature"])

    def to_bytes(self) -> bytes:
        return canonical.packb(self.to_wire())

    @classmethod
    def from_bytes(cls, data: bytes) -> Certificate:
        return cls.from_wire(canonical.unpackb(data, max_len=MAX_CERT_BYTES))

    def save(self, path: str | os.PathLike[str]) -> Path:
        return _write(path, self.to_bytes())

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Certificate:
        return cls.from_bytes(_read(path, "certificate"))


@dataclass(frozen=True)
class Amendment:
    """The creator's current changes to the genesis allowlist: `revoke` (refused, whatever admitted them) and
    `allow` (admitted as if listed). Both sorted, disjoint, without the creator; the highest `seq` wins."""

    run_id: bytes
    seq: int
    revoke: tuple[bytes, ...]
    allow: tuple[bytes, ...]
    signature: bytes

    @classmethod
    def issue(cls, creator: Identity, spec: RunSpec, *, revoke: Iterable[bytes] = (), allow: Iterable[bytes] = (),
              previous: Amendment | None = None) -> Amendment:
        """The next amendment: `previous`'s lists with `revoke` and `allow` applied (a key revoked now is no
        longer allowed, and the other way round). Raises `ValueError` for a key in both, the creator revoked,
        an open run, or a key that is not the creator's."""
        _require_allowlist(creator, spec)
        revoke, allow = {_key(k, "revoked key") for k in revoke}, {_key(k, "allowed key") for k in allow}
        if revoke & allow:
            raise ValueError("a key cannot be revoked and allowed in the same amendment")
        if spec.creator in revoke:
            raise ValueError("the run's creator cannot be revoked")
        if previous is not None:
            previous.verify(spec)
        revoked = (set(previous.revoke if previous else ()) - allow) | revoke
        allowed = (set(previous.allow if previous else ()) - revoke) | allow
        seq = previous.seq + 1 if previous else 1
        unsigned = cls(spec.run_id, seq, tuple(sorted(revoked)), tuple(sorted(allowed)), b"")
        unsigned.check_shape()
        return cls(unsigned.run_id, seq, unsigned.revoke, unsigned.allow, creator.sign(unsigned.signed_message()))

    def check_shape(self) -> None:
        if self.seq < 1:
            raise Malformed("amendment seq must be >= 1")
        if len(self.revoke) + len(self.allow) > MAX_AMENDED_KEYS:
            raise Malformed(f"an amendment lists at most {MAX_AMENDED_KEYS} keys")
        for name, keys in (("revoke", self.revoke), ("allow", self.allow)):
            if list(keys) != sorted(set(keys)):
                raise Malformed(f"amendment {name} must be sorted and without duplicates")
        if set(self.revoke) & set(self.allow):
            raise Malformed("amendment revokes and allows the same key")

    def signed_message(self) -> bytes:
        return AMENDMENT_DOMAIN + canonical.packb([self.run_id, self.seq, list(self.revoke), list(self.allow)])

    def verify(self, spec: RunSpec) -> None:
        """Raises `WrongRun` (another run), `BadSignature` (not the creator's)."""
        if self.run_id != spec.run_id:
            raise WrongRun(f"amendment is for run {self.run_id.hex()[:16]}…, not {spec.run_id.hex()[:16]}…")
        verify_repeated(spec.creator, self.signature, self.signed_message())

    def to_wire(self) -> dict[str, Any]:
        return {"run_id": self.run_id, "seq": self.seq, "revoke": list(self.revoke), "allow": list(self.allow),
                "signature": self.signature}

    @classmethod
    def from_wire(cls, obj: Any) -> Amendment:
        o = _map(obj, "amendment", {"run_id", "seq", "revoke", "allow", "signature"})
        if not isinstance(o["run_id"], bytes) or len(o["run_id"]) != 32:
            raise Malformed("amendment run_id must be 32 bytes")
        if not isinstance(o["signature"], bytes) or len(o["signature"]) != SIGNATURE_BYTES:
            raise Malformed(f"amendment signature must be {SIGNATURE_BYTES} bytes")
        lists = []
        for name in ("revoke", "allow"):
            if not isinstance(o[name], list) or len(o[name]) > MAX_AMENDED_KEYS:
                raise Malformed(f"amendment {name} must be a list of at most {MAX_AMENDED_KEYS} keys")
            lists.append(tuple(_key(k, f"amendment {name} entry") for k in o[name]))
        a = cls(o["run_id"], _int(o["seq"], "seq"), lists[0], lists[1], o["signature"])
        a.check_shape()
        return a

    def to_bytes(self) -> bytes:
        return canonical.packb(self.to_wire())

    @classmethod
    def from_bytes(cls, data: bytes) -> Amendment:
        return cls.from_wire(canonical.unpackb(data, max_len=MAX_AMENDMENT_BYTES))

    def save(self, path: str | os.PathLike[str]) -> Path:
        return _write(path, self.to_bytes())

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Amendment:
        return cls.from_bytes(_read(path, "amendment"))


@dataclass(frozen=True)
class AuthRecord:
    """A peer's value under `auth_key`: its own certificate, and the newest amendment it knows (relayed, so the
    roster outlives the creator's own record). Either may be absent (nil)."""

    certificate: Certificate | None = None
    amendment: Amendment | None = None

    def encode(self) -> bytes:
        return canonical.packb({"certificate": self.certificate.to_wire() if self.certificate else None,
                                "amendment": self.amendment.to_wire() if self.amendment else None})

    @classmethod
    def decode(cls, data: bytes) -> AuthRecord:
        o = _map(canonical.unpackb(data, max_len=MAX_CERT_BYTES + MAX_AMENDMENT_BYTES), "auth record",
                 {"certificate", "amendment"})
        return cls(None if o["certificate"] is None else Certificate.from_wire(o["certificate"]),
                   None if o["amendment"] is None else Amendment.from_wire(o["amendment"]))


class Roster:
    """Who an `allowlist` run admits now, as this peer knows it: the genesis allowlist and creator, the newest
    amendment, and the certificates members presented. Any thread may call `admits` (it reads only)."""

    def __init__(self, spec: RunSpec, *, clock: Callable[[], float] = time.time) -> None:
        self.spec, self.clock = spec, clock
        self.open = spec.membership == "open"
        self._genesis = frozenset((*spec.allowlist, spec.creator))
        self.amendment: Amendment | None = None
        self.certs: dict[bytes, Certificate] = {}  # key -> its certificate with the latest end
        self._revoked: frozenset[bytes] = frozenset()
        self._listed = self._genesis
        self._keys = {peer_id_of(k): k for k in self._genesis}  # PeerId -> key, for member records

    def admits(self, key: bytes) -> bool:
        """The envelope check (`EnvelopeVerifier.is_member`): open run, creator, listed and not revoked, or
        holding a certificate valid now."""
        if self.open or key == self.spec.creator:
            return True
        if key in self._revoked:
            return False
        if key in self._listed:
            return True
        cert = self.certs.get(key)
        if cert is None:
            return False
        try:
            cert.check_time(self.clock())
        except Expired:
            return False
        return True

    def admits_peer(self, peer_id: str) -> bool:
        """`admits` for the key of a member record's subkey (a PeerId)."""
        if self.open:
            return True
        key = self._keys.get(peer_id)
        return key is not None and self.admits(key)

    def present(self, cert: Certificate) -> None:
        """Learn a certificate. Raises a `ProtocolError` (and learns nothing) unless it verifies now."""
        if self.open:
            return
        cert.verify(self.spec, now=self.clock())
        held = self.certs.get(cert.peer)
        if held is None or cert.not_after > held.not_after:
            self.certs[cert.peer] = cert
            self._keys[peer_id_of(cert.peer)] = cert.peer

    def adopt(self, amendment: Amendment) -> bool:
        """Take `amendment` if it is newer than ours: True if it was. Raises a `ProtocolError` for one that
        does not verify."""
        if self.open:
            raise NotMember("an open run has no amendments")
        if self.amendment is not None and amendment.seq <= self.amendment.seq:
            return False
        amendment.verify(self.spec)
        self.amendment = amendment
        self._revoked = frozenset(amendment.revoke)
        self._listed = (self._genesis | frozenset(amendment.allow)) - self._revoked
        for k in amendment.allow:
            self._keys[peer_id_of(k)] = k
        return True

    def learn(self, peer_id: str, record: AuthRecord) -> None:
        """Take what one peer's auth record holds; a part that does not verify is skipped (and costs one
        signature check per distinct bytes: `verify_repeated` remembers only successes, so junk is re-checked,
        as junk member records are)."""
        if record.amendment is not None:
            try:
                self.adopt(record.amendment)
            except ProtocolError:
                pass
        cert = record.certificate
        if cert is not None and peer_id_of(cert.peer) == peer_id:
            try:
                self.present(cert)
            except ProtocolError:
                pass

    def forget_expired(self) -> None:
        now = self.clock()
        for key, cert in list(self.certs.items()):
            if cert.not_after + CLOCK_SKEW_S < now:
                del self.certs[key]

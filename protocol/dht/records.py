"""Signed DHT records: what a node says about itself (`NodeInfo`) and what it stores (`ValueRecord`).

Both are plain frozen dataclasses with `to_wire()` (a dict of msgpack-able values) and `from_wire(obj)`, which
checks every field's type and length and then the signature, raising only `Malformed` or `BadSignature`.
Each signature covers `DOMAIN + canonical.packb(signed fields)` with its own domain, so a signature of one kind
never verifies as another.

THE value rule (docs/architecture.md §4), stated once in `ValueRecord.verify`: the signer's signature covers
(key, subkey, value, expiration), and a record under a subkey must be signed by the peer whose PeerId *is*
that subkey. Plain keys (subkey None) may be written by anyone; the larger expiration wins.

This module never trusts a field before `from_wire` or `verify` has passed it, and never decides freshness or
size limits of stored values: that is `storage.DHTStorage`'s job.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from .. import canonical
from ..errors import BadSignature, Malformed
from ..identity import PUBLIC_KEY_BYTES, SIGNATURE_BYTES, Identity, node_id_of, peer_id_of, verify_repeated

NODE_INFO_DOMAIN = b"diloco-node/v1/node-info\0"
VALUE_DOMAIN = b"diloco-node/v1/dht-value\0"
MAX_URL_CHARS = 256
MAX_REGION_CHARS = 64
MAX_KEY_CHARS = 256
MAX_SUBKEY_CHARS = 64  # a PeerId is 43-44 base58 characters


class ForgedSubkey(BadSignature):
    """A record under a subkey that its signer does not own (the subkey is another peer's PeerId)."""


def _str(obj: Any, name: str, max_chars: int) -> str:
    if not isinstance(obj, str):
        raise Malformed(f"{name} must be a string, got {type(obj).__name__}")
    if len(obj) > max_chars:
        raise Malformed(f"{name} is {len(obj)} characters, the limit is {max_chars}")
    if not obj.isprintable():
        raise Malformed(f"{name} holds non-printable characters")
    return obj


def _bytes(obj: Any, name: str, length: int | None = None) -> bytes:
    if not isinstance(obj, bytes):
        raise Malformed(f"{name} must be bytes, got {type(obj).__name__}")
    if length is not None and len(obj) != length:
        raise Malformed(f"{name} must be {length} bytes, got {len(obj)}")
    return obj


def _fields(obj: Any, what: str, names: frozenset[str]) -> dict[str, Any]:
    if not isinstance(obj, dict):
        raise Malformed(f"{what} must be a map, got {type(obj).__name__}")
    if set(obj) != names:
        missing, extra = names - set(obj), set(obj) - names
        raise Malformed(
            f"{what} fields wrong (missing {sorted(missing)}, unexpected {sorted(map(str, extra))})"
        )
    return obj


def check_url(url: str, *, client_mode: bool) -> str:
    """An inbound address `http(s)://host[:port][/path]`; a client-mode node (no inbound port) may give ""."""
    _str(url, "url", MAX_URL_CHARS)
    if url == "" and client_mode:
        return url
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as e:
        raise Malformed(f"url {url!r} does not parse: {e}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise Malformed(f"url {url!r} must look like http://host:port")
    if parts.query or parts.fragment or parts.username is not None or " " in url or port == 0:
        raise Malformed(f"url {url!r} must be http(s)://host:port with no user, query or fragment")
    return url


@dataclass(frozen=True, slots=True)
class NodeInfo:
    """A node's signed self-description: its key, where to reach it, and whether it accepts connections.

    Only the node itself can produce a valid one; a newer `timestamp_ms` supersedes an older one. `node_id`
    (160-bit Kademlia id) and `peer_id` are derived from `public_key`, never sent.
    """

    public_key: bytes
    url: str
    region: str
    client_mode: bool
    timestamp_ms: int
    signature: bytes = field(repr=False)
    node_id: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "node_id", node_id_of(self.public_key))

    @classmethod
    def create(
        cls,
        identity: Identity,
        url: str,
        region: str = "",
        client_mode: bool = False,
        *,
        now_ms: int | None = None,
    ) -> NodeInfo:
        """Sign a fresh description of `identity`. Raises `Malformed` for a bad url or region."""
        check_url(url, client_mode=client_mode)
        _str(region, "region", MAX_REGION_CHARS)
        ts = int(time.time() * 1000) if now_ms is None else now_ms
        msg = _node_info_message(identity.public_key, url, region, client_mode, ts)
        return cls(identity.public_key, url, region, client_mode, ts, identity.sign(msg))

    @property
    def peer_id(self) -> str:
        return peer_id_of(self.public_key)

    def to_wire(self) -> dict[str, Any]:
        return {
            "public_key": self.public_key,
            "url": self.url,
            "region": self.region,
            "client_mode": self.client_mode,
            "timestamp_ms": self.timestamp_ms,
            "signature": self.signature,
        }

    @classmethod
    def from_wire(cls, obj: Any) -> NodeInfo:
        """Check shape, types, lengths and the signature. Raises `Malformed` or `BadSignature`.

        Node infos circulate in every lookup reply; one already verified is returned from a small cache when
        the wire fields are exactly equal (equality of all fields, the signature included, proves nothing new).
        """
        sig = obj.get("signature") if isinstance(obj, dict) else None
        cached = _VERIFIED_INFOS.get(sig) if isinstance(sig, bytes) else None
        if cached is not None and type(obj.get("client_mode")) is bool and cached.to_wire() == obj:
            return cached
        o = _fields(obj, "node info", _NODE_INFO_FIELDS)
        public_key = _bytes(o["public_key"], "public_key", PUBLIC_KEY_BYTES)
        signature = _bytes(o["signature"], "signature", SIGNATURE_BYTES)
        if not isinstance(o["client_mode"], bool):
            raise Malformed("client_mode must be a bool")
        url = check_url(o["url"], client_mode=o["client_mode"])
        region = _str(o["region"], "region", MAX_REGION_CHARS)
        ts = o["timestamp_ms"]
        if not isinstance(ts, int) or isinstance(ts, bool) or not 0 <= ts < 2**63:
            raise Malformed("timestamp_ms must be a non-negative 64-bit integer")
        verify_repeated(public_key, signature, _node_info_message(public_key, url, region, o["client_mode"], ts))
        info = cls(public_key, url, region, o["client_mode"], ts, signature)
        if len(_VERIFIED_INFOS) >= _VERIFIED_INFOS_MAX:
            _VERIFIED_INFOS.pop(next(iter(_VERIFIED_INFOS)))
        _VERIFIED_INFOS[signature] = info
        return info


_VERIFIED_INFOS: dict[bytes, NodeInfo] = {}
_VERIFIED_INFOS_MAX = 8192


_NODE_INFO_FIELDS = frozenset(["public_key", "url", "region", "client_mode", "timestamp_ms", "signature"])


def _node_info_message(
    public_key: bytes, url: str, region: str, client_mode: bool, timestamp_ms: int
) -> bytes:
    signed = {
        "public_key": public_key,
        "url": url,
        "region": region,
        "client_mode": client_mode,
        "timestamp_ms": timestamp_ms,
    }
    return NODE_INFO_DOMAIN + canonical.packb(signed)


@dataclass(frozen=True, slots=True)
class ValueRecord:
    """One stored DHT value with its writer's signature; relayable by anyone, forgeable by no one.

    `value` is opaque bytes (callers put canonical msgpack in it). `expiration` is unix seconds (float64).
    """

    key: str
    subkey: str | None
    value: bytes
    expiration: float
    signer: bytes
    signature: bytes = field(repr=False)

    @classmethod
    def create(
        cls, identity: Identity, key: str, value: bytes, expiration: float, subkey: str | None = None
    ) -> ValueRecord:
        """Sign `value` under `key` (and `subkey`, which must be `identity.peer_id`)."""
        rec = cls(key, subkey, bytes(value), float(expiration), identity.public_key, b"")
        _check_shape(rec)
        if subkey is not None and subkey != identity.peer_id:
            raise ForgedSubkey(f"subkey {subkey!r} is not the signer's PeerId {identity.peer_id}")
        return cls(
            rec.key, subkey, rec.value, rec.expiration, rec.signer, identity.sign(rec.signed_message())
        )

    @property
    def signer_id(self) -> str:
        return peer_id_of(self.signer)

    def signed_message(self) -> bytes:
        """The exact bytes the signature covers: domain + canonical (key, subkey, value, expiration)."""
        signed = {"key": self.key, "subkey": self.subkey, "value": self.value, "expiration": self.expiration}
        return VALUE_DOMAIN + canonical.packb(signed)

    def verify(self) -> None:
        """THE record rule. Raises `ForgedSubkey` if the subkey is not the signer's PeerId, `BadSignature` if
        the signature does not cover these exact fields, `Malformed` for a key that is not a key at all."""
        if self.subkey is not None and self.subkey != peer_id_of(self.signer):
            raise ForgedSubkey(
                f"record for subkey {self.subkey!r} of {self.key!r} is signed by {peer_id_of(self.signer)}, "
                "not by the subkey's owner"
            )
        verify_repeated(self.signer, self.signature, self.signed_message())

    def supersedes(self, other: ValueRecord) -> bool:
        """Last writer wins: the larger expiration, ties broken by the larger signature so every replica
        keeps the same record."""
        return (self.expiration, self.signature) > (other.expiration, other.signature)

    def to_wire(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "subkey": self.subkey,
            "value": self.value,
            "expiration": self.expiration,
            "signer": self.signer,
            "signature": self.signature,
        }

    @classmethod
    def from_wire(cls, obj: Any) -> ValueRecord:
        """Check shape, types, lengths, the subkey owner and the signature.

        Raises `Malformed`, `ForgedSubkey` or `BadSignature`. An integer expiration is read as float64.
        """
        o = _fields(obj, "value record", _VALUE_FIELDS)
        exp = o["expiration"]
        if not isinstance(exp, int | float) or isinstance(exp, bool):
            raise Malformed(f"expiration must be a number, got {type(exp).__name__}")
        if isinstance(exp, int) and not -(2**53) <= exp <= 2**53:
            raise Malformed("expiration out of range")
        rec = cls(
            o["key"],
            o["subkey"],
            _bytes(o["value"], "value"),
            float(exp),
            _bytes(o["signer"], "signer", PUBLIC_KEY_BYTES),
            _bytes(o["signature"], "signature", SIGNATURE_BYTES),
        )
        _check_shape(rec)
        rec.verify()
        return rec


_VALUE_FIELDS = frozenset(["key", "subkey", "value", "expiration", "signer", "signature"])


def _check_shape(rec: ValueRecord) -> None:
    _str(rec.key, "key", MAX_KEY_CHARS)
    if rec.key == "":
        raise Malformed("key must not be empty")
    if rec.subkey is not None:
        _str(rec.subkey, "subkey", MAX_SUBKEY_CHARS)
    if not isinstance(rec.value, bytes):
        raise Malformed("value must be bytes")
    if not math.isfinite(rec.expiration):
        raise Malformed("expiration must be a finite number")

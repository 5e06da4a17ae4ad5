"""Peer identity: Ed25519 keys, PeerIds and key files (docs/architecture.md §2).

A PeerId is the base58 of the SHA-256 of the raw 32-byte public key; a DHT node id is the first 160 bits
of that same digest. Key files are unencrypted PKCS#8 PEM with mode 0600. This module never loads a key
file that group or others can read: a leaked training key lets anyone sign deltas in the owner's name.
"""

from __future__ import annotations

import functools
import hashlib
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from .errors import BadSignature, Malformed

PUBLIC_KEY_BYTES = 32
SIGNATURE_BYTES = 64
NODE_ID_BITS = 160

_B58 = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"


class KeyFileError(Exception):
    """A key file that is missing, unreadable, malformed or too open. The message says what to do."""


def b58encode(data: bytes) -> str:
    """Bitcoin-alphabet base58, leading zero bytes kept as '1'."""
    n = int.from_bytes(data, "big")
    out = []
    while n:
        n, r = divmod(n, 58)
        out.append(_B58[r])
    pad = len(data) - len(data.lstrip(b"\0"))
    return "1" * pad + "".join(reversed(out))


def peer_id_of(public_key: bytes) -> str:
    """PeerId = base58(SHA-256(raw public key))."""
    return b58encode(hashlib.sha256(public_key).digest())


def node_id_of(public_key: bytes) -> int:
    """DHT node id: the first 160 bits of SHA-256(raw public key), as an integer."""
    return int.from_bytes(hashlib.sha256(public_key).digest()[: NODE_ID_BITS // 8], "big")


def verify(public_key: bytes, signature: bytes, message: bytes) -> None:
    """Raise `BadSignature` unless `signature` is `public_key`'s Ed25519 signature of `message`."""
    _verify(public_key, signature, message)


def verify_repeated(public_key: bytes, signature: bytes, message: bytes) -> None:
    """`verify`, for signed items that arrive again and again unchanged (DHT node infos and records: every
    reply carries them): a SHA-256 of the three that verified is remembered in `VERIFIED`, since re-verifying
    identical bytes proves nothing new. Failures are never remembered. Messages that never repeat (envelopes:
    each has its own nonce) must use `verify`: they would only push the useful digests out."""
    _check_sizes(public_key, signature)  # (fixed sizes: the three concatenated are unambiguous)
    key = hashlib.sha256(public_key + signature + message).digest()
    if key not in VERIFIED:
        _verify(public_key, signature, message)
        VERIFIED.add(key)


class DigestCache:
    """A set of 32-byte digests in memory allocated once: a direct-mapped table (a digest's slot is its
    first 8 bytes modulo the slot count; a new digest overwrites what its slot held).

    Fixed memory is the point: an LRU of Python objects filled over the first quarter-hour of a run and
    made the process's memory creep for that long; this table is 32 bytes a slot from the start. A digest
    pushed out by a collision only costs one more signature check. Slice reads and writes of a bytearray
    are single operations under the GIL, so threads need no lock (`hits` is a statistic only).
    """

    DIGEST = 32

    def __init__(self, slots: int) -> None:
        self.slots, self.hits = slots, 0
        self._table = bytearray(self.DIGEST * slots)

    def _at(self, digest: bytes) -> int:
        if len(digest) != self.DIGEST:
            raise ValueError(f"a digest is {self.DIGEST} bytes, not {len(digest)}")
        return int.from_bytes(digest[:8], "little") % self.slots * self.DIGEST

    def __contains__(self, digest: bytes) -> bool:
        at = self._at(digest)
        hit = self._table[at : at + self.DIGEST] == digest
        self.hits += hit
        return hit

    def add(self, digest: bytes) -> None:
        at = self._at(digest)
        self._table[at : at + self.DIGEST] = digest

    def __len__(self) -> int:
        empty = bytes(self.DIGEST)
        return sum(self._table[i : i + self.DIGEST] != empty for i in range(0, len(self._table), self.DIGEST))

    def clear(self) -> None:
        self._table[:] = bytes(len(self._table))
        self.hits = 0


VERIFIED = DigestCache(8192)  # 256 KiB


def _check_sizes(public_key: bytes, signature: bytes) -> None:
    if len(public_key) != PUBLIC_KEY_BYTES:
        raise Malformed(f"public key must be {PUBLIC_KEY_BYTES} bytes, got {len(public_key)}")
    if len(signature) != SIGNATURE_BYTES:
        raise Malformed(f"signature must be {SIGNATURE_BYTES} bytes, got {len(signature)}")


def _verify(public_key: bytes, signature: bytes, message: bytes) -> None:
    _check_sizes(public_key, signature)
    try:
        Ed25519PublicKey.from_public_bytes(public_key).verify(signature, message)
    except InvalidSignature:
        raise BadSignature(f"signature does not verify for peer {peer_id_of(public_key)}") from None
    except ValueError as e:  # not a point on the curve
        raise Malformed(f"invalid public key: {e}") from None


@dataclass(frozen=True)
class Identity:
    """A peer's signing key with its derived public names."""

    private_key: Ed25519PrivateKey

    @classmethod
    def generate(cls) -> Identity:
        return cls(Ed25519PrivateKey.generate())

    @functools.cached_property
    def public_key(self) -> bytes:
        return self.private_key.public_key().public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw
        )

    @functools.cached_property
    def peer_id(self) -> str:
        return peer_id_of(self.public_key)

    @functools.cached_property
    def node_id(self) -> int:
        return node_id_of(self.public_key)

    def sign(self, message: bytes) -> bytes:
        return self.private_key.sign(message)

    def to_pem(self) -> bytes:
        return self.private_key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )

    def save(self, path: str | os.PathLike[str], *, overwrite: bool = False) -> Path:
        """Write the key as PEM with mode 0600, created with that mode (never briefly readable by others)."""
        path = Path(path).expanduser()
        path.parent.mkdir(parents=True, exist_ok=True)
        flags = os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if overwrite else os.O_EXCL)
        try:
            fd = os.open(path, flags, 0o600)
        except FileExistsError:
            raise KeyFileError(f"{path} already exists; pass --force to overwrite it") from None
        except OSError as e:
            raise KeyFileError(f"cannot write key file {path}: {e.strerror}") from None
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), 0o600)
            f.write(self.to_pem())
            f.flush()
            os.fsync(f.fileno())
        return path

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Identity:
        """Load a PEM key file; refuse one that group or others can read."""
        path = Path(path).expanduser()
        try:
            st = path.stat()
        except FileNotFoundError:
            raise KeyFileError(f"key file {path} not found; create one with `diloco-node keygen --out {path}`") from None
        except OSError as e:
            raise KeyFileError(f"cannot read key file {path}: {e.strerror}") from None
        if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise KeyFileError(
                f"key file {path} is accessible by group or others (mode {stat.S_IMODE(st.st_mode):04o}); "
                f"run `chmod 600 {path}`"
            )
        try:
            key = serialization.load_pem_private_key(path.read_bytes(), password=None)
        except (ValueError, TypeError) as e:
            raise KeyFileError(f"{path} is not an unencrypted PEM private key ({e})") from None
        if not isinstance(key, Ed25519PrivateKey):
            raise KeyFileError(f"{path} holds a {type(key).__name__}, not an Ed25519 key")
        return cls(key)

    @classmethod
    def load_or_generate(cls, path: str | os.PathLike[str] | None) -> Identity:
        """Load `path` if given and present, else create it; `None` gives an ephemeral key."""
        if path is None:
            return cls.generate()
        if Path(path).expanduser().exists():
            return cls.load(path)
        ident = cls.generate()
        ident.save(path)
        return ident

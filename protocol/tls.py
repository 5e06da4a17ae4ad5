"""TLS whose certificates are the peers' own Ed25519 keys (docs/protocol.md §4.8, docs/security.md).

A private run encrypts every connection, and a peer is known by its PeerId, not by a name a certificate
authority vouches for. So each peer's certificate is self-signed with its identity key: the TLS 1.3 handshake
proves the server holds the private key of the public key in its certificate, and the client compares that
key's PeerId with the one it expects (the member record that gave it the URL names it). There is no CA, no
hostname check and nothing to renew: the certificate is made in memory at start and lives as long as the
process.

The client's side of a connection is checked by the signature on every message it sends (and, in a private
run, on its reads), not by TLS: a server needs no client certificate.
"""

from __future__ import annotations

import datetime
import os
import ssl
import tempfile

import aiohttp
from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from cryptography.x509.oid import NameOID

from .errors import PeerUnreachable
from .identity import Identity, peer_id_of

_NOT_BEFORE = datetime.datetime(2000, 1, 1, tzinfo=datetime.UTC)
_NOT_AFTER = datetime.datetime(9999, 12, 31, tzinfo=datetime.UTC)  # (RFC 5280's "no well-defined expiry")


class WrongPeer(PeerUnreachable):
    """The peer at a URL proved another identity than the one expected there."""


def certificate(identity: Identity) -> bytes:
    """The PEM certificate of `identity`: its own public key, signed by itself, named by its PeerId."""
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, identity.peer_id)])
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(identity.private_key.public_key())
        .serial_number(int.from_bytes(identity.public_key[:16], "big") >> 1 or 1)
        .not_valid_before(_NOT_BEFORE)
        .not_valid_after(_NOT_AFTER)
        .sign(identity.private_key, None)
    )
    return cert.public_bytes(serialization.Encoding.PEM)


def server_context(identity: Identity) -> ssl.SSLContext:
    """A TLS 1.3 server context presenting `identity`'s certificate."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    # `ssl` loads keys from files only: write both to a private temporary file, load it, delete it
    fd, path = tempfile.mkstemp(prefix="diloco-tls-", suffix=".pem")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(identity.to_pem() + certificate(identity))
        ctx.load_cert_chain(path)
    finally:
        os.unlink(path)
    return ctx


def client_context() -> ssl.SSLContext:
    """A TLS 1.3 client context that leaves the certificate's check to `PeerCheck` (no CA, no hostname)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    return ctx


def peer_key(der: bytes | None) -> bytes:
    """The Ed25519 public key a server's certificate (DER) holds, once its self-signature is checked."""
    if not der:
        raise WrongPeer("the peer presented no TLS certificate")
    try:
        cert = x509.load_der_x509_certificate(der)
        key = cert.public_key()
        if not isinstance(key, Ed25519PublicKey):
            raise WrongPeer("the peer's TLS certificate does not hold an Ed25519 key")
        key.verify(cert.signature, cert.tbs_certificate_bytes)
    except (ValueError, InvalidSignature) as e:
        raise WrongPeer(f"the peer's TLS certificate is not a self-signed Ed25519 certificate: {e}") from None
    return key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def check_peer(ssl_object: ssl.SSLObject | ssl.SSLSocket | None, expected: str | None, where: str) -> str:
    """The PeerId the server of this connection proved; `WrongPeer` unless it is `expected` (None: any)."""
    if ssl_object is None:
        raise WrongPeer(f"{where} did not speak TLS")
    got = peer_id_of(peer_key(ssl_object.getpeercert(binary_form=True)))
    if expected is not None and got != expected:
        raise WrongPeer(f"{where} is peer {got[:12]}…, not the expected {expected[:12]}…")
    return got


class PeerCheck(aiohttp.Fingerprint):
    """aiohttp's hook between the TLS handshake and the first byte of a request, checking a PeerId instead
    of a certificate digest: a connection to the wrong peer is closed before anything is sent on it."""

    def __init__(self, expected: str | None) -> None:
        super().__init__(bytes(32))  # (the digest aiohttp would compare is never used: `check` is ours)
        self.expected = expected

    def check(self, transport) -> None:  # noqa: ANN001 - aiohttp's asyncio.Transport
        host, port, *_ = transport.get_extra_info("peername") or ("?", 0)
        try:
            check_peer(transport.get_extra_info("ssl_object"), self.expected, f"{host}:{port}")
        except WrongPeer as e:  # (aiohttp closes the connection; PeerClient raises the WrongPeer)
            raise aiohttp.ServerFingerprintMismatch(b"", b"", host, port) from e

"""Typed protocol errors.

Every error a remote peer can cause derives from `ProtocolError` and carries the HTTP status that the
transport answers with (docs/architecture.md §3) and a one-line reason a person can act on. Code that decodes bytes
from the network must raise only these, never a bare `ValueError`, `KeyError` or a crash.
"""

from __future__ import annotations


class ProtocolError(Exception):
    """Base of every error caused by what a peer sent. `status` is the HTTP answer."""

    status: int = 400

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class Malformed(ProtocolError):
    """Bytes that do not parse, or fields of the wrong type, shape or length."""

    status = 400


class BadSignature(ProtocolError):
    """The Ed25519 signature does not verify, or the payload does not match its digest."""

    status = 401


class NotMember(ProtocolError):
    """The sender's key is not allowed in this run."""

    status = 403


class WrongRun(ProtocolError):
    """The message belongs to another run id."""

    status = 409


class StaleVersion(ProtocolError):
    """The message names a (term, version) older than one already held."""

    status = 409


class BaseOutdated(ProtocolError):
    """A replica holds a version of the fragment newer than the base the owner stepped from: publishing would
    fork the fragment, so the owner must reach that version first."""

    status = 412


class Replayed(ProtocolError):
    """A (sender, nonce) pair already seen inside the replay window."""

    status = 409


class Expired(ProtocolError):
    """A timestamp outside the allowed clock skew."""

    status = 409


class TooLarge(ProtocolError):
    """A header or payload over the size limit of its kind."""

    status = 413


class BackPressure(ProtocolError):
    """The receiver is busy; try again later."""

    status = 429


class Unavailable(ProtocolError):
    """Not the owner of what was asked, or shutting down."""

    status = 503


# -- a request that got no usable answer (raised by the transport, not decoded from bytes) ----------------


class TransportError(Exception):
    """A request that did not get a usable answer. `retryable` says whether trying later may help."""

    retryable = True


class PeerUnreachable(TransportError):
    """The connection could not be made or broke before the answer."""


class DeadlineExceeded(TransportError):
    """No complete answer within the request's deadline."""


class ResponseTooLarge(TransportError):
    retryable = False


class RemoteError(TransportError):
    """The peer answered with an error status; `reason` is its one-line explanation."""

    def __init__(self, status: int, reason: str, url: str) -> None:
        super().__init__(f"{url} answered {status}: {reason}")
        self.status = status
        self.reason = reason
        self.retryable = status in (429, 502, 504)

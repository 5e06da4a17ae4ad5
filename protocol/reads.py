"""Signed reads: in a private run, a GET is answered only to a member who signed it (docs/protocol.md §4.8).

Fragments, updates, momenta, status and member lists are the run's weights and its roster; in an `allowlist`
run a stranger who can reach a peer's port must learn nothing from them. A read carries, in one HTTP header,
the prefix of an envelope of kind `read` (no payload) whose fields name the method and the exact path with its
query: the usual checks (run, clock, membership before the signature, replay) then decide, before the route
runs. A signed read cannot be replayed (its nonce is reserved) nor moved to another path.
"""

from __future__ import annotations

import base64
import binascii

from .envelope import EnvelopeVerifier, join_bytes, register_kind, seal
from .errors import Malformed, NotMember
from .identity import Identity

READ = "read"
HEADER = "X-Diloco-Read"
MAX_HEADER_CHARS = 2048  # a read's prefix is ~250 bytes; base64 of it well under this

register_kind(READ, 0)


class ReadSigner:
    """Signs this peer's reads in one run: the value of the `X-Diloco-Read` header of one request."""

    def __init__(self, identity: Identity, run_id: bytes) -> None:
        self.identity = identity
        self.run_id = run_id

    def __call__(self, method: str, path: str) -> str:
        env = seal(self.identity, READ, self.run_id, {"method": method, "path": path})
        return base64.urlsafe_b64encode(env.prefix()).decode("ascii")


def check_read(verifier: EnvelopeVerifier, method: str, raw_path: str, value: str | None) -> bytes:
    """The reader's public key, if `value` (the header) is a member's fresh signature of this very request.

    Raises `NotMember` (403) without a header or for a stranger's key, `Malformed` (400) for a header that is
    not a read of this method and path, and the verifier's errors (409 wrong run, 401 bad signature, ...)."""
    if not value:
        raise NotMember(f"reads in this run need a member's signed request (the {HEADER} header)")
    if len(value) > MAX_HEADER_CHARS:
        raise Malformed(f"{HEADER} header of {len(value)} characters (limit {MAX_HEADER_CHARS})")
    try:
        prefix = base64.urlsafe_b64decode(value.encode("ascii"))
    except (binascii.Error, UnicodeEncodeError, ValueError):
        raise Malformed(f"{HEADER} header is not base64url") from None
    env = verifier.open(join_bytes(prefix), fresh=True)
    if env.kind != READ:
        raise Malformed(f"{HEADER} holds a {env.kind!r} message, not a read")
    if env.fields.get("method") != method or env.fields.get("path") != raw_path:
        raise Malformed(f"{HEADER} signs another request than {method} {raw_path[:200]}")
    return env.sender

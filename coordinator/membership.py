"""Who is in the run right now: member records in the DHT, local suspicion, fragment roles (docs/architecture.md §2).

Each peer keeps its record under `run:<id>:members` (subkey = its PeerId, so only it can write it), refreshed
well inside its TTL, and marked `left` when it stops. A peer is live while its record is, unless a request to
it failed since its last refresh (suspected): a killed owner is routed around at once instead of after its
TTL. In an `allowlist` run a record of a peer the `Roster` does not admit is ignored: the roster follows the
certificates and the newest amendment found under `run:<id>:auth` (coordinator/certs.py), polled with the
member records, so a revocation takes effect at every peer's next poll, without a restart. Roles (owner and
replicas of each fragment) follow from the live set by rendezvous hashing (`ownership.py`); `on_change`
callbacks fire when the live set changes.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from aiohttp import web

from diloco.protocol import canonical
from diloco.protocol.dht.node import DHTNode
from diloco.protocol.dht.records import ValueRecord
from diloco.protocol.errors import BackPressure, Malformed, NotMember, ProtocolError, TooLarge, WrongRun
from diloco.protocol.identity import Identity, peer_id_of
from diloco.protocol.transport import PeerClient, PeerServer, PeerUnreachable, RemoteError, TransportError

from .certs import Amendment, AuthRecord, Certificate, Roster, auth_key
from .ownership import owners
from .runspec import RunSpec
from .wire import MemberRecord, members_key

log = logging.getLogger(__name__)
ROUTE_AUTH = "/v1/auth"  # POST a signed auth record: a certified joiner's first contact, or a new amendment
MAX_AUTH_BODY = 64 * 1024
AUTH_AT_ONCE = 4  # auth posts verified at the same time (each costs two or three signature checks)
RELAY_S = 5.0  # how long an auth post waits for the record's relay into the DHT
HEARD_KEPT_S = 3600.0  # a member not heard from for this long is forgotten (`Membership.heard`)
AMENDMENT_RECORD_S = 23 * 3600  # the creator's own record of an amendment (the DHT keeps values 24 h at most;
# every peer that adopted it relays it under its own subkey, refreshed with its member record)


class CertificateRefused(Exception):
    """This peer's own certificate is not valid for the run, or every bootstrap peer refused it."""


@dataclass(frozen=True)
class Member:
    peer_id: str
    record: MemberRecord
    expiration: float

    @property
    def client_mode(self) -> bool:
        return self.record.client_mode

    @property
    def url(self) -> str:
        return self.record.url


async def post_auth(client: PeerClient, record: ValueRecord, urls: list[str], what: str) -> int | None:
    """POST a signed auth record to the first of `urls` that takes it; returns the amendment seq that peer holds
    now (None: nobody answered, or an answer without one). Raises `CertificateRefused` when every peer that
    answered refused it (401, 403, 409)."""
    body = canonical.packb(record.to_wire())
    refusals = []
    for url in urls:
        try:
            answer = await client.request("POST", url, ROUTE_AUTH, body=body, deadline_s=10.0, max_response=1024)
        except RemoteError as e:
            if e.status in (401, 403, 409):
                refusals.append(f"{url} answered {e.status}: {e.reason}")
                continue
            return None  # (busy, or a peer without the route: what follows decides)
        except TransportError:
            continue
        seq = bytes(answer).decode("ascii", "replace").rpartition("amendment ")[2]
        return int(seq) if seq.isdigit() else None
    if refusals:
        raise CertificateRefused(f"the peers refused {what}: " + "; ".join(refusals))
    return None


async def post_amendment(creator: Identity, spec: RunSpec, amendment: Amendment, urls: list[str]) -> int | None:
    """The creator's side of an amendment: post it (in its own signed auth record) to the first running peer of
    `urls` that takes it; that peer adopts it and relays it into the DHT. Returns the amendment seq that peer
    holds now (above `amendment.seq`: a newer one exists), None if nobody answered."""
    record = ValueRecord.create(creator, auth_key(spec.run_id), AuthRecord(None, amendment).encode(),
                                time.time() + AMENDMENT_RECORD_S, subkey=creator.peer_id)
    async with PeerClient(retries=1, tls=spec.membership == "allowlist") as client:
        return await post_auth(client, record, urls, "the amendment")


class Membership:
    """The live members of one run, as this peer sees them."""

    def __init__(
        self,
        dht: DHTNode,
        spec: RunSpec,
        own_record: Callable[[], MemberRecord],
        *,
        ttl_s: float = 30.0,
        refresh_s: float = 10.0,
        poll_s: float = 2.0,
        certificate: Certificate | None = None,
        roster: Roster | None = None,
    ) -> None:
        """`certificate`: this peer's membership certificate (allowlist runs), published under `auth_key`;
        `roster`: the admission state to keep current (one the DHT node's server already asks), else a new one.
        Raises `CertificateRefused` for a certificate that is not this peer's, or not valid for the run now."""
        self.dht, self.spec, self.own_record = dht, spec, own_record
        self.ttl_s, self.refresh_s, self.poll_s = ttl_s, refresh_s, poll_s
        self.peer_id = dht.identity.peer_id
        self.key = members_key(spec.run_id)
        self.members: dict[str, Member] = {}
        self.suspects: dict[str, float] = {}  # peer_id -> the record expiration it had when suspected
        self._suspected_at: dict[str, float] = {}  # peer_id -> when (time.time()) we suspected it, until a record
        # refreshed before that moment has been read once (`_refreshed_since_suspected`)
        self.on_change: list[Callable[[], None]] = []
        self.roster = roster or Roster(spec)
        self.certificate = certificate
        if certificate is not None:
            if certificate.peer != dht.identity.public_key:
                raise CertificateRefused(f"the certificate is for {peer_id_of(certificate.peer)}, not for this "
                                         f"peer's key ({self.peer_id}): pass the key it was issued to")
            try:
                self.roster.present(certificate)
            except ProtocolError as e:
                raise CertificateRefused(f"membership certificate refused: {e.reason}") from None
        self._auth_running = 0
        self._auth_until = 0.0  # our auth record's expiration, once stored
        self._revoked_warned = False
        self._live_ids: frozenset[tuple[str, bool]] = frozenset()
        self._published_until: float | None = None  # our record's expiration, once stored
        self.polls = 0
        # peer_id -> when its record was last refreshed, as far as this peer can tell (its expiration minus our
        # TTL, or when we first read it if that is earlier); a peer that marked its record `left` is dropped,
        # one whose record expired stays (`HEARD_KEPT_S`): the silent members an operator is told about
        self.heard: dict[str, float] = {}

    # -- views ----------------------------------------------------------------------------------------------

    def live(self) -> list[Member]:
        """Live members, this peer included."""
        return self._unexpired(suspects=False)

    def _unexpired(self, suspects: bool) -> list[Member]:
        """Members whose record has not expired (suspects only if `suspects`), this peer included."""
        now = time.time()
        out = [m for m in self.members.values()
               if m.expiration > now and (suspects or m.peer_id not in self.suspects) and m.peer_id != self.peer_id]
        out.append(Member(self.peer_id, self.own_record(), now + self.ttl_s))
        return out

    def recorded(self) -> list[Member]:
        """Members whose record has not expired, suspects included, this peer included (last): what an
        operator is shown, each with its state (docs/status.md)."""
        return self._unexpired(suspects=True)

    def servers(self, suspects: bool = False) -> list[Member]:
        """Live members other than this peer that accept connections (not client-mode, with a URL); with
        `suspects`, also those whose record has not expired but that failed to answer us lately."""
        return [m for m in self._unexpired(suspects) if m.peer_id != self.peer_id and not m.client_mode and m.url]

    def live_learners(self) -> set[str]:
        return {m.peer_id for m in self.live()}

    def url(self, peer_id: str) -> str | None:
        if peer_id == self.peer_id:
            return self.own_record().url
        m = self.members.get(peer_id)
        return m.url if m is not None and m.url else None

    def roles(self, p: int) -> list[str]:
        """[owner, replica, ...] of fragment p among the live members that hold every fragment already (a
        joiner still downloading must not own a fragment it does not have yet)."""
        return owners(self.spec.run_id, p, [m for m in self.live() if m.record.synced], self.spec.replicas)

    def may_own(self, p: int, peer_id: str) -> bool:
        """`peer_id` is p's owner or a replica among every member whose record has not expired, suspects and
        joiners still downloading included: the roles as another peer may see them a poll interval earlier or
        later (who may publish in p: coordinator/authority.py)."""
        return peer_id in owners(self.spec.run_id, p, self._unexpired(suspects=True), self.spec.replicas)

    def may_have_owned(self, p: int, peer_id: str) -> bool:
        """`may_own`, or `peer_id` is p's owner or a replica in this view without this peer: the roles while this
        peer was away (restarting, or cut off), when another member took p over and published. What a version
        fetched from a holder is checked against (coordinator/authority.py): a peer that comes back must be
        able to reach what was published without it before it publishes over it."""
        if self.may_own(p, peer_id):
            return True
        others = [m for m in self._unexpired(suspects=True) if m.peer_id != self.peer_id]
        return peer_id in owners(self.spec.run_id, p, others, self.spec.replicas)

    def is_live(self, peer_id: str) -> bool:
        """`peer_id` has a record that has not expired (suspected or not)."""
        m = self.members.get(peer_id)
        return peer_id == self.peer_id or (m is not None and m.expiration > time.time())

    def failed(self, peer_id: str, error: Exception) -> None:
        """A request to `peer_id` failed. A refused or reset connection (a dead process) makes it a suspect at
        once; a slow answer does not (on a loaded machine a live peer can miss a deadline, and suspecting it
        would move its fragments back and forth)."""
        if isinstance(error, PeerUnreachable):
            self.suspect(peer_id)

    def suspect(self, peer_id: str) -> None:
        """Route around `peer_id` until it refreshes its record."""
        m = self.members.get(peer_id)
        if m is None or peer_id == self.peer_id or peer_id in self.suspects:
            return
        log.info("suspecting %s (unreachable)", peer_id[:8])
        self.suspects[peer_id] = m.expiration
        self._suspected_at[peer_id] = time.time()
        self.changed()

    def distrust(self, peer_id: str) -> None:
        """Route around `peer_id` for as long as its record lasts, refreshed or not (it published an update this
        peer refused, coordinator/audit.py): it owns nothing in this peer's view, its fragments move to their
        replicas here. A suspect at time ∞ is dropped only when its record expires."""
        if peer_id != self.peer_id and peer_id in self.members:
            log.warning("distrusting %s: it published an update this peer refused", peer_id[:8])
            self.suspects[peer_id] = math.inf
            self.changed()

    # -- DHT I/O --------------------------------------------------------------------------------------------

    async def publish(self) -> None:
        await self._store(self.own_record())
        await self.present()

    async def present(self) -> None:
        """Store our auth record (our certificate, the newest amendment we know) if we have either: others
        admit a certified key only once they have read it, and relaying the amendment keeps it in the DHT."""
        if self.roster.open or (self.certificate is None and self.roster.amendment is None):
            return
        record = AuthRecord(self.certificate, self.roster.amendment)
        self._auth_until = max(time.time() + self.ttl_s, self._auth_until + 1e-3)
        await self.dht.store(auth_key(self.spec.run_id), record.encode(), self._auth_until, subkey=self.peer_id)

    async def withdraw(self) -> None:
        """Leaving: store our record once more with `left` set, so readers drop us at their next poll instead
        of routing to a dead URL until the record expires. Nothing to do if we never stored one."""
        if self._published_until is not None:
            await self._store(dataclasses.replace(self.own_record(), left=True))

    async def _store(self, record: MemberRecord) -> None:
        # (the later expiration wins in the DHT: strictly after the last one, even within a clock tick)
        expiration = max(time.time() + self.ttl_s, (self._published_until or 0.0) + 1e-3)
        self._published_until = expiration
        await self.dht.store(self.key, record.encode(), expiration, subkey=self.peer_id)
        self.heard[self.peer_id] = time.time()

    async def poll(self) -> None:
        if self.roster.open:
            raw = await self.dht.get(self.key, latest=True)
        else:  # (the auth records first: a certificate or an amendment decides which member records count)
            raw, auth = await asyncio.gather(self.dht.get(self.key, latest=True),
                                             self.dht.get(auth_key(self.spec.run_id), latest=True))
            self._learn(auth)
        found: dict[str, Member] = {}
        if isinstance(raw, dict):
            for peer_id, (value, expiration) in raw.items():
                if not self.roster.admits_peer(peer_id):
                    continue
                try:
                    record = MemberRecord.decode(value)
                except ProtocolError as e:
                    log.debug("ignoring member record of %s: %s", peer_id[:8], e)
                    continue
                if record.left:
                    self.heard.pop(peer_id, None)
                else:
                    found[peer_id] = Member(peer_id, record, expiration)
        self._heard(found)
        self.members = found
        for peer_id, at in list(self.suspects.items()):
            m = found.get(peer_id)
            if m is None or (m.expiration > at and self._refreshed_since_suspected(peer_id, m)):
                del self.suspects[peer_id]  # gone for good, or alive again (it refreshed)
                self._suspected_at.pop(peer_id, None)
        self.polls += 1
        self.changed()

    def _refreshed_since_suspected(self, peer_id: str, m: Member) -> bool:
        """A suspect's record newer than the one it had when suspected: alive again, unless it was refreshed
        before the suspicion (by its expiration: its clock's store time + TTL). The DHT may hand us such a record
        late, when the peer stored it between our last poll and its death; routing to it again would move its
        fragments back to a dead owner for a moment, and the owner state handed to it would be lost. Such a
        record is passed over once (it becomes the one to beat); any newer one clears the suspicion, so a live
        peer whose clock runs behind ours is cleared at its next refresh at the latest."""
        at = self._suspected_at.pop(peer_id, None)
        if at is None or m.expiration - self.ttl_s >= at:
            return True
        self.suspects[peer_id] = m.expiration
        log.info("a record of suspect %s stored before it failed to answer: still a suspect", peer_id[:8])
        return False

    def _heard(self, found: dict[str, Member]) -> None:
        """Note the records refreshed since the last poll (`heard`); forget peers silent for `HEARD_KEPT_S`."""
        now = time.time()
        for peer_id, m in found.items():
            before = self.members.get(peer_id)
            if peer_id != self.peer_id and (before is None or m.expiration > before.expiration):
                self.heard[peer_id] = min(now, m.expiration - self.ttl_s)
        for peer_id, at in list(self.heard.items()):
            if peer_id not in found and now - at > HEARD_KEPT_S:
                del self.heard[peer_id]

    def _learn(self, auth: object) -> None:
        """Take the certificates and the newest amendment out of the auth records of a poll."""
        seq = self.roster.amendment.seq if self.roster.amendment else 0
        if isinstance(auth, dict):
            for peer_id, (value, _) in auth.items():
                try:
                    self.roster.learn(peer_id, AuthRecord.decode(value))
                except ProtocolError as e:
                    log.debug("ignoring auth record of %s: %s", peer_id[:8], e)
        self.roster.forget_expired()
        a = self.roster.amendment
        if a is not None and a.seq > seq:
            log.info("run amendment %d adopted: %d keys revoked, %d added", a.seq, len(a.revoke), len(a.allow))
            if not self._revoked_warned and not self.roster.admits(self.dht.identity.public_key):
                self._revoked_warned = True
                log.warning("the run's creator revoked this peer's key (amendment %d): every other member now "
                            "refuses its messages", a.seq)

    # -- first contact: POST /v1/auth ---------------------------------------------------------------------

    def auth_record(self) -> ValueRecord:
        """Our auth record, signed as the DHT stores it (what `introduce` posts)."""
        record = AuthRecord(self.certificate, self.roster.amendment)
        return ValueRecord.create(self.dht.identity, auth_key(self.spec.run_id), record.encode(),
                                  time.time() + self.ttl_s, subkey=self.peer_id)

    async def introduce(self, client: PeerClient, urls: list[str]) -> None:
        """Before the join: show our certificate to the bootstrap peers, which admit us and relay it into the
        DHT (in a private run the DHT answers members only, so a certified key could not even bootstrap).
        Raises `CertificateRefused` when every peer that answered refused it (401/403/409)."""
        if self.certificate is not None and not self.roster.open and urls:
            await post_auth(client, self.auth_record(), urls, "this peer's certificate")

    def serve(self, server: PeerServer) -> None:
        server.add_route("POST", ROUTE_AUTH, self._serve_auth)

    async def _serve_auth(self, request: web.Request) -> web.Response:
        """A signed auth record (its signer's certificate and/or an amendment): verified, taken into the roster,
        relayed into the DHT. 403 unless the signer is admitted afterwards (a stranger, a revoked key)."""
        if self.roster.open:
            raise NotMember("this run is open: it has no certificates")
        if request.content_length is None or request.content_length > MAX_AUTH_BODY:
            raise TooLarge(f"an auth record is at most {MAX_AUTH_BODY} bytes, with a Content-Length")
        if self._auth_running >= AUTH_AT_ONCE:
            raise BackPressure(f"at most {AUTH_AT_ONCE} auth records are checked at a time")
        self._auth_running += 1
        try:
            record = ValueRecord.from_wire(canonical.unpackb(await request.read(), max_len=MAX_AUTH_BODY))
            if record.key != auth_key(self.spec.run_id) or record.subkey != record.signer_id:
                raise WrongRun("not an auth record of this run under its signer's own subkey")
            auth = AuthRecord.decode(record.value)
            if auth.certificate is not None:
                if auth.certificate.peer != record.signer:
                    raise Malformed("the certificate is not the signer's")
                self.roster.present(auth.certificate)
            if auth.amendment is not None:
                self.roster.adopt(auth.amendment)
            if not self.roster.admits(record.signer):
                raise NotMember(f"peer {record.signer_id} is not a member of this run (no valid certificate, "
                                "or revoked)")
            with contextlib.suppress(TransportError, ProtocolError, asyncio.TimeoutError):
                await asyncio.wait_for(self.dht.store_record(record), RELAY_S)
        finally:
            self._auth_running -= 1
        seq = self.roster.amendment.seq if self.roster.amendment else 0
        return web.Response(body=f"admitted; amendment {seq}".encode(), content_type="text/plain")

    async def run(self) -> None:
        """Refresh our record and poll the others, forever (cancelled at shutdown)."""
        next_publish = 0.0
        while True:
            now = time.monotonic()
            with contextlib.suppress(TransportError, ProtocolError):
                if now >= next_publish:
                    await self.publish()
                    next_publish = now + self.refresh_s
                await self.poll()
            await asyncio.sleep(self.poll_s)

    def changed(self) -> None:
        """Re-evaluate the live set (also after our own record changed) and notify on a change."""
        ids = frozenset((m.peer_id, m.record.synced) for m in self.live())
        if ids != self._live_ids:
            self._live_ids = ids
            for fn in self.on_change:
                fn()

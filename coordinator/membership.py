"""Who is in the run right now: member records in the DHT, local suspicion, fragment roles (docs/architecture.md §2).

Each peer keeps its record under `run:<id>:members` (subkey = its PeerId, so only it can write it), refreshed
well inside its TTL, and marked `left` when it stops. A peer is live while its record is, unless a request to
it failed since its last refresh (suspected): a killed owner is routed around at once instead of after its
TTL. A record of a peer outside an allowlist run is ignored. Roles (owner and replicas of each fragment)
follow from the live set by rendezvous hashing (`ownership.py`); `on_change` callbacks fire when the live
set changes.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from diloco.protocol.dht.node import DHTNode
from diloco.protocol.errors import ProtocolError
from diloco.protocol.identity import peer_id_of
from diloco.protocol.transport import PeerUnreachable, TransportError

from .ownership import owners
from .runspec import RunSpec
from .wire import MemberRecord, members_key

log = logging.getLogger(__name__)


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
    ) -> None:
        self.dht, self.spec, self.own_record = dht, spec, own_record
        self.ttl_s, self.refresh_s, self.poll_s = ttl_s, refresh_s, poll_s
        self.peer_id = dht.identity.peer_id
        self.key = members_key(spec.run_id)
        self.members: dict[str, Member] = {}
        self.suspects: dict[str, float] = {}  # peer_id -> the record expiration it had when suspected
        self.on_change: list[Callable[[], None]] = []
        self._allowed = None if spec.membership == "open" else {peer_id_of(k) for k in (*spec.allowlist, spec.creator)}
        self._live_ids: frozenset[tuple[str, bool]] = frozenset()
        self._published_until: float | None = None  # our record's expiration, once stored
        self.polls = 0

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

    def servers(self) -> list[Member]:
        """Live members other than this peer that accept connections (not client-mode, with a URL)."""
        return [m for m in self.live() if m.peer_id != self.peer_id and not m.client_mode and m.url]

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
        self.changed()

    # -- DHT I/O --------------------------------------------------------------------------------------------

    async def publish(self) -> None:
        await self._store(self.own_record())

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

    async def poll(self) -> None:
        raw = await self.dht.get(self.key, latest=True)
        found: dict[str, Member] = {}
        if isinstance(raw, dict):
            for peer_id, (value, expiration) in raw.items():
                if self._allowed is not None and peer_id not in self._allowed:
                    continue
                try:
                    record = MemberRecord.decode(value)
                except ProtocolError as e:
                    log.debug("ignoring member record of %s: %s", peer_id[:8], e)
                    continue
                if not record.left:
                    found[peer_id] = Member(peer_id, record, expiration)
        self.members = found
        for peer_id, at in list(self.suspects.items()):
            m = found.get(peer_id)
            if m is None or m.expiration > at:  # gone for good, or alive again (it refreshed)
                del self.suspects[peer_id]
        self.polls += 1
        self.changed()

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

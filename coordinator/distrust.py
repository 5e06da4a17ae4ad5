"""What a learner does when it stops trusting a publisher (docs/protocol.md §7.20, docs/security.md).

Distrust comes from a refused update, or from an upheld accusation (coordinator/accuse.py). The peer routes
around the publisher (`Membership.distrust`: it owns nothing in this view any more, its fragments move to their
replicas), and it leaves the versions that publisher signed: a learner may already hold the update a replica
refused (the owner pushed it before the accusation arrived), and the new owner, who refused it, builds on the
version before it. A learner that stayed on the refused version would send deltas the new owner cannot merge
(their base is not one it holds) and never see a version it can apply. So each fragment whose held version the
publisher signed goes back to the version its new owner holds: the only way a label ever goes back
(`FragmentStore.install(replacing=...)`), and θ[p] with it (the learner's progress on p since is lost, the
refused update with it).
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from diloco.protocol.errors import ProtocolError
from diloco.protocol.identity import peer_id_of
from diloco.protocol.transport import TransportError

from .version import Version
from .wire import ROUTE_VERSIONS, parse_versions, versions_body_max

if TYPE_CHECKING:
    from .sync import FragmentSync

log = logging.getLogger(__name__)
LEAVE_TRIES = 20  # rounds of asking p's new owner (it may not rank first in our view yet, or be busy)
LEAVE_RETRY_S = 1.0


class Distrust:
    """One per FragmentSync: `distrusted(peer)` is the UpdateGuard's callback."""

    def __init__(self, sync: FragmentSync) -> None:
        self.sync = sync
        self._tasks: set[asyncio.Task] = set()

    def distrusted(self, peer: str) -> None:
        """On the loop: route around `peer`, and leave every held version it signed."""
        sync = self.sync
        sync.members.distrust(peer)
        for p in range(sync.P):
            cert = sync.store.cert(p)
            if not cert:
                continue
            try:
                signer = peer_id_of(sync.verifier.certificate(cert).sender)
            except ProtocolError:
                continue
            if signer == peer:
                task = asyncio.get_running_loop().create_task(self._leave(p, sync.store.label(p)))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)

    async def _leave(self, p: int, tainted: Version) -> None:
        """Move fragment p from `tainted` to the version its new owner holds (unless it holds `tainted` too:
        then it builds on it, and so do we)."""
        sync = self.sync
        me = sync.members.peer_id
        for _ in range(LEAVE_TRIES):
            if sync.store.label(p) != tainted:
                return  # moved on meanwhile (a newer version of the new owner)
            roles = sync.members.roles(p)
            owner = roles[0] if roles else None
            url = sync.members.url(owner) if owner is not None and owner != me else None
            if owner == me:
                sync.stats["distrusted_version_kept_as_owner"] += 1
                return
            if url is not None:
                try:
                    body = await sync.client.request("GET", url, ROUTE_VERSIONS, deadline_s=2.0,
                                                     max_response=versions_body_max(sync.P))
                    held = parse_versions(body, sync.P)[p]
                    if held == tainted:
                        return
                    await sync.fetch_fragment(p, url, replacing=tainted)
                    if sync.store.label(p) != tainted:
                        sync.stats["distrusted_versions_left"] += 1
                        log.warning("fragment %d: left version %s of a distrusted publisher for %s, its new "
                                    "owner's (this learner's progress on it since is dropped)", p, tainted,
                                    sync.store.label(p))
                        return
                except (TransportError, ProtocolError) as e:
                    log.info("fragment %d: leaving distrusted version %s via %s failed: %s", p, tainted,
                             owner[:8], e)
            await asyncio.sleep(LEAVE_RETRY_S)
        sync.stats["distrusted_version_not_left"] += 1

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

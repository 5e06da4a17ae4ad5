"""Deltas out: a learner's Δ_p computed, encoded, signed and handed to owner(p) (docs/architecture.md §5.2).

Everything here runs on the swarm's loop, the heavy parts (the subtraction, the encoding, the signature) in
worker threads. A delta is never lost silently: one the owner does not take is dropped and its inner steps
carried to the next delta of p, whose Δ still holds the progress (the rebase rule, `FragmentStore`).
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Callable

import torch

from diloco.protocol.codecs import Codec, ErrorFeedback
from diloco.protocol.envelope import Envelope, parse_header, seal
from diloco.protocol.errors import ProtocolError
from diloco.protocol.identity import Identity
from diloco.protocol.transport import PeerClient, RemoteError, TransportError

from .audit import UpdateGuard
from .buffers import BufferPool
from .fragments import Encoded, FragmentStore, Move
from .membership import Membership
from .runspec import RunSpec
from .version import Version
from .wire import DELTA, ROUTE_DELTA, DeltaFields

log = logging.getLogger(__name__)
# Swarm messages that change state (deltas, updates, replication) wait at least this long for an answer. A
# peer busy with an outer step on a loaded machine answers late, and an envelope timed out may still have
# been taken: a delta sent again after it would be counted twice. A dead peer refuses the connection at once.
STATEFUL_POST_FLOOR_S = 5.0


class DeltaSender:
    """This learner's deltas, to the owners of their fragments. One per peer, on the loop; counts into the
    sync's `stats` (one /v1/status table)."""

    def __init__(self, identity: Identity, spec: RunSpec, store: FragmentStore, membership: Membership,
                 client: PeerClient, codec: Codec, pool: BufferPool, guard: UpdateGuard,
                 stats: collections.Counter[str], catch_up: Callable[[int, list[str]], object]) -> None:
        self.identity, self.spec, self.store, self.members, self.client = identity, spec, store, membership, client
        self.codec, self.pool, self.guard, self.stats, self.catch_up = codec, pool, guard, stats, catch_up
        self.feedback = ErrorFeedback(codec) if spec.error_feedback else None
        self._encoding: collections.defaultdict[int, asyncio.Lock] = collections.defaultdict(asyncio.Lock)
        # Set by the shard: a delta for a fragment this peer owns is handed over without the network.
        self.on_local_delta: Callable[[Envelope], None] | None = None

    async def send(self, p: int, live_fragment: torch.Tensor, base: Version, steps: int, tokens: int) -> bool:
        """Δ_p = Θ_p^(base) − θ[p] (plus the error-feedback residual), compressed, signed, sent to owner(p).

        `live_fragment` is the learner's snapshot of θ[p]. A failed owner is suspected and the delta goes to
        the next one. Until a version merges it, the delta is kept as outstanding (see `fragments`: the rebase
        rule). Returns whether an owner accepted it.
        """
        accepted = False
        try:
            accepted = await self._send(p, live_fragment, base, steps, tokens)
            return accepted
        finally:
            self.store.end_send(p, accepted)

    async def _send(self, p: int, live_fragment: torch.Tensor, base: Version, steps: int, tokens: int) -> bool:
        # Δ, its encoding and its signature are computed in worker threads: on the loop, 100 ms of CPU per large
        # fragment would delay every message this peer answers (members' refreshes included)
        anchor, label, generation = self.store.read(p)
        if label != base or p in self.store.unset:
            return self._moved(p, steps, tokens, live_fragment)
        # Δ_p = Θ_p − θ[p] into the snapshot's own buffer (which goes back to `self.pool` once encoded, unless
        # error feedback keeps Δ itself), outside the store's lock; a write of the anchor meanwhile is caught
        # by its generation
        delta = await asyncio.to_thread(torch.sub, anchor, live_fragment, out=live_fragment)
        residual = produced = None
        async with self._encoding[p]:  # one encode of p at a time: they share its error-feedback residual
            if self.feedback is not None:  # the residual carries what the codec dropped; θ[p] gives up all of Δ
                residual = self.feedback.residual(str(p))
                meta, payload = await asyncio.to_thread(self.feedback.encode, str(p), delta)
                produced = self.feedback.residual(str(p))
                merged: Move = delta
            else:  # what the codec dropped stays in θ[p] and goes out with the next delta
                meta, payload = await asyncio.to_thread(self.codec.encode_delta, delta)
                merged = Encoded(self.codec, meta, payload)
                del delta
                self.pool.give(live_fragment)
        carried = self.store.set_outstanding(p, base, merged, steps, tokens, generation=generation)
        if carried is not None and await self._deliver(p, base, *carried, meta, payload):
            return True
        if carried is None:
            self._moved(p, steps, tokens)
        else:
            self.store.drop_outstanding(p)
        if self.feedback is not None and self.feedback.residual(str(p)) is produced:
            self.feedback.restore(str(p), residual)  # not delivered: the residual before this encode stands
        return False

    def _moved(self, p: int, steps: int, tokens: int, snapshot: torch.Tensor | None = None) -> bool:
        """The anchor moved since the snapshot: Δ would be wrong. Not sent; θ[p] keeps that progress."""
        self.stats["deltas_dropped_moved"] += 1
        self.store.carry(p, steps, tokens)
        if snapshot is not None:
            self.pool.give(snapshot)
        return False

    async def _deliver(self, p: int, base: Version, steps: int, tokens: int, meta: dict, payload: bytes) -> bool:
        """Send a delta to owner(p), then to the next owner if that one is gone. True once one accepted it."""
        fields = DeltaFields(p, base, steps, tokens, meta).to_fields()
        for attempt in range(2 + self.spec.replicas):
            if attempt:
                await asyncio.sleep(0.25 * attempt)  # let the member view (and the owner's) catch up
            roles = self.members.roles(p)
            if not roles:
                break
            owner = roles[0]
            env = await asyncio.to_thread(seal, self.identity, DELTA, self.spec.run_id, fields, payload)
            self.guard.sent_delta(p, parse_header(env.header)["payload_digest"], steps, tokens)  # (before it can
            # be merged: an update naming it may come back before this send returns)
            try:
                if owner == self.members.peer_id and self.on_local_delta is not None:
                    self.on_local_delta(env)
                else:
                    url = self.members.url(owner)
                    if url is None:
                        raise TransportError(f"no address for owner {owner[:8]}")
                    await self.client.send_envelope(url, ROUTE_DELTA, env, min_deadline_s=STATEFUL_POST_FLOOR_S)
                self.stats["deltas_sent"] += 1
                return True
            except RemoteError as e:
                self.stats[f"deltas_refused_{e.status}"] += 1
                if e.status == 409:
                    self.catch_up(p, [owner])
                if e.status != 503:
                    return False
                # 503: alive, but not the owner in its own view (yet): it checks the owner it knows; retry.
            except ProtocolError as e:
                self.stats[f"deltas_refused_{e.status}"] += 1
                return False
            except TransportError as e:
                log.info("owner %s of fragment %d unreachable: %s", owner[:8], p, e)
                self.members.failed(owner, e)
        self.stats["deltas_lost_no_owner"] += 1
        return False

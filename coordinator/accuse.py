"""Accusations: a replica's refusal of an owner's update, made checkable by every member (docs/protocol.md
§7.20, docs/security.md "What an owner can do").

A replica that recomputes an update and finds it is not the merge it names (coordinator/audit.py) holds the
evidence: the owner's signed `replicate` of the update's base (its header names the digest of the momentum it
carried, `mdigest`), those momentum bytes, and the owner's signed `replicate` of the update itself, with the
signed delta frames it merged. It sends them to every live member as one `accuse` envelope. A member verifies
every signature and digest, recomputes the update exactly as the replica did, and, if it does not match either,
refuses the update and stops trusting its owner, as if it had refused the update itself. Nothing rests on the
accuser's word: an accusation whose evidence recomputes cleanly is dismissed (counted, logged) and changes
nothing, and each (owner, fragment, version) is judged once.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Callable

from aiohttp import web

from diloco.protocol.codecs import Codec, get_codec
from diloco.protocol.envelope import Envelope, EnvelopeVerifier, join_bytes, seal
from diloco.protocol.errors import Malformed
from diloco.protocol.identity import Identity, peer_id_of
from diloco.protocol.transport import PeerClient, PeerServer, RemoteError, TransportError

from .audit import AuditFailed, Auditor, RefusedUpdate, UpdateGuard, checkable
from .fragments import Encoded, FragmentStore
from .membership import Membership
from .runspec import RunSpec
from .send import STATEFUL_POST_FLOOR_S
from .version import Version
from .wire import (
    ACCUSE,
    REPLICATE,
    ROUTE_ACCUSE,
    UPDATE,
    AccuseFields,
    ReplicateFields,
    UpdateFields,
    accuse_payload_max,
    momentum_digest,
    split_replicate,
)

log = logging.getLogger(__name__)
JUDGED_KEPT = 1024  # (owner, p, version) verdicts remembered: each is recomputed once
DELIVER_FOR_S = 30.0  # how long an accusation keeps trying the members it has not reached yet
DELIVER_EVERY_S = 2.0  # between two tries


class Accusations:
    """Both sides for one peer: `accuse` (a replica's audit failed) and `POST /v1/accuse` (judge one)."""

    def __init__(self, identity: Identity, spec: RunSpec, store: FragmentStore, membership: Membership,
                 client: PeerClient, server: PeerServer, codec: Codec, auditor: Auditor, guard: UpdateGuard,
                 is_member: Callable[[bytes], bool], spawn: Callable,
                 stats: collections.Counter[str]) -> None:
        self.identity, self.spec, self.store, self.members, self.client = identity, spec, store, membership, client
        self.codec, self.auditor, self.guard, self.spawn, self.stats = codec, auditor, guard, spawn, stats
        self.evidence = EnvelopeVerifier(spec.run_id, is_member=is_member, kinds={REPLICATE})
        self.updates = EnvelopeVerifier(spec.run_id, is_member=is_member, kinds={UPDATE})
        self.judged: collections.OrderedDict[tuple[str, int, Version], bool] = collections.OrderedDict()
        server.add_envelope_route(ROUTE_ACCUSE, EnvelopeVerifier(spec.run_id, is_member=is_member, kinds={ACCUSE}),
                                  self._on_accuse, kinds={ACCUSE},
                                  max_payload=accuse_payload_max(codec, store.max_numel()))

    # -- the accuser ----------------------------------------------------------------------------------------

    def accuse(self, f: UpdateFields, owner: str, prefix: bytes | None, momentum: Encoded | None,
               refused: Envelope) -> None:
        """On the loop, after this replica's audit of `refused` (the owner's replicate of `f`) failed: send the
        evidence to every live member. `prefix` and `momentum`: the replicate this replica kept of f's base
        (None when it came from elsewhere, a checkpoint or this peer's own ownership: no evidence then)."""
        self._remember((owner, f.p, f.new), True)
        if prefix is None or momentum is None:
            self.stats["accusations_without_evidence"] += 1
            return
        self.spawn(self._send(f, owner, prefix, momentum, refused))

    async def _send(self, f: UpdateFields, owner: str, prefix: bytes, momentum: Encoded, refused: Envelope) -> None:
        payload = await asyncio.to_thread(join_bytes, prefix, momentum.payload, refused.prefix(), refused.payload,
                                          refused.trailer)
        fields = AccuseFields(f.p, f.new, len(prefix), len(momentum.payload)).to_fields()
        env = await asyncio.to_thread(seal, self.identity, ACCUSE, self.spec.run_id, fields, payload)

        async def one(url: str) -> str:
            """"sent" (judged there, or known), "refused" (an answer that another try would not change: a 409
            after a try whose answer was lost means it got there) or "retry" (no answer, 429 or 503)."""
            try:
                await self.client.send_envelope(url, ROUTE_ACCUSE, env, min_deadline_s=STATEFUL_POST_FLOOR_S)
                return "sent"
            except (TransportError, RemoteError) as e:
                log.info("accusation of fragment %d's %s to %s failed: %s", f.p, f.new, url, e)
                return "refused" if isinstance(e, RemoteError) and e.status not in (429, 503) else "retry"

        # Until DELIVER_FOR_S has passed, every member that has not taken it yet is tried again, every
        # DELIVER_EVERY_S: one that did not answer (a suspect, a busy peer, a connection refused at its
        # accept), and one that appeared meanwhile. A member it never reaches keeps the owner's versions.
        done: set[str] = {owner}  # (not the owner it accuses)
        until = time.monotonic() + DELIVER_FOR_S
        while True:
            todo = [m for m in self.members.servers(suspects=True) if m.peer_id not in done]
            outcomes = await asyncio.gather(*(one(m.url) for m in todo))
            done |= {m.peer_id for m, outcome in zip(todo, outcomes, strict=True) if outcome != "retry"}
            self.stats["accusations_sent"] += outcomes.count("sent")
            if time.monotonic() + DELIVER_EVERY_S >= until:
                return
            await asyncio.sleep(DELIVER_EVERY_S)

    # -- a judge --------------------------------------------------------------------------------------------

    async def _on_accuse(self, env: Envelope, request: web.Request) -> bytes:
        a = AccuseFields.parse(env.fields, len(self.store))
        payload = memoryview(env.payload)
        if a.base_len + a.momentum_len > len(payload):
            raise Malformed("accuse base and momentum are longer than its payload")
        base = self.evidence.certificate(payload[: a.base_len])
        kept_bytes = payload[a.base_len : a.base_len + a.momentum_len]
        refused = await asyncio.to_thread(self.evidence.open, payload[a.base_len + a.momentum_len :], fresh=False,
                                          trailing=True)  # (its trailer: the update and delta frames)
        if base.sender != refused.sender:
            raise Malformed("accuse evidence is signed by two different peers")
        owner = peer_id_of(refused.sender)
        key = (owner, a.p, a.new)
        if key in self.judged or owner == self.members.peer_id:  # (judged once; an honest peer: never itself)
            return b"known"
        f, update, frames, kept, momentum = await self._evidence(a, base, kept_bytes, refused)
        try:
            await asyncio.to_thread(self.auditor.verify, f, update, frames, kept, momentum)
        except AuditFailed as e:
            self._remember(key, True)
            self.stats["accusations_upheld"] += 1
            log.warning("accusation by %s upheld: %s", peer_id_of(env.sender)[:8], e)
            try:
                self.guard.refuse(f.p, f.new, owner, f"recomputed from an accusation: {e}")
            except RefusedUpdate:
                pass
            return b"upheld"
        self._remember(key, False)
        self.stats["accusations_dismissed"] += 1
        log.warning("accusation by %s dismissed: update %s of fragment %d by %s recomputes", peer_id_of(env.sender)[:8],
                    f.new, f.p, owner[:8])
        return b"dismissed"

    async def _evidence(self, a: AccuseFields, base: Envelope, kept_bytes: memoryview, refused: Envelope
                        ) -> tuple[UpdateFields, Encoded, list[memoryview], tuple[Version, Encoded], Encoded | None]:
        """The recomputation's inputs, each checked against what the owner signed; `Malformed` (or the
        envelope's own error) for anything that is not evidence of one update."""
        P = len(self.store)
        rb, rr = ReplicateFields.parse(base.fields, P), ReplicateFields.parse(refused.fields, P)
        if rr.full or rb.p != a.p or rr.p != a.p or rr.label != a.new or rb.term != rr.term:
            raise Malformed("accuse evidence is not two replications of one fragment in one term")
        if rb.mdigest is None or await asyncio.to_thread(momentum_digest, kept_bytes, base.version) != rb.mdigest:
            raise Malformed("accuse momentum is not the one its base replication names")
        head, frames = split_replicate(rr, refused.trailer)
        moved = memoryview(refused.payload)
        if not rr.names_its_momentum(refused.payload_digest, len(moved)):
            raise Malformed("accuse replication's momentum is not the one it names")
        update = await asyncio.to_thread(self.updates.open, head, fresh=False)
        if update.sender != refused.sender:
            raise Malformed("accuse replication carries another peer's update")
        f = UpdateFields.parse(update.fields, P)
        numel = self.store.numel(a.p)
        fp32 = get_codec("fp32")
        kept = (rb.label, Encoded(fp32, {"codec": "fp32", "shape": [numel]}, bytes(kept_bytes)) if rb.full
                else Encoded(self.codec, rb.momentum or {}, bytes(kept_bytes)))
        if f.p != a.p or f.new != a.new or not checkable(f, frames, kept):
            raise Malformed("accuse evidence cannot be recomputed (no delta frames, or not the update's base)")
        momentum = Encoded(self.codec, rr.momentum, moved) if rr.momentum else None
        return f, Encoded(self.codec, f.codec, update.payload), frames, kept, momentum

    def _remember(self, key: tuple[str, int, Version], guilty: bool) -> None:
        self.judged[key] = guilty
        while len(self.judged) > JUDGED_KEPT:
            self.judged.popitem(last=False)


"""Replication: the owner's state copied to each fragment's replicas, so a takeover loses nothing
(docs/architecture.md §6.5, §6.6).

Owner side: `replicate` hands a new version (its update frame and the step's momentum, not yet committed) to
p's replicas before the version is published; `send_full` sends the certificate, the fp32 anchor and the fp32
momentum to a replica that is behind, or to the next owner at a hand-over. Replica side: `POST /v1/replicate`
applies what arrives and keeps (version, momentum) per fragment for a takeover, and `GET /v1/momentum/{p}`
serves that momentum to a new owner that missed it. This module holds `kept` and `terms_seen`, nothing else;
it never changes an owner (a late hand-over is passed to `on_handover`).
"""

from __future__ import annotations

import asyncio
import collections
import functools
import logging
import time
from collections.abc import Callable, Sequence

import torch
from aiohttp import web

from diloco.protocol.codecs import Codec, get_codec
from diloco.protocol.envelope import Envelope, EnvelopeVerifier, join_bytes, seal
from diloco.protocol.errors import BaseOutdated, Malformed, ProtocolError, StaleVersion
from diloco.protocol.identity import Identity, peer_id_of
from diloco.protocol.transport import PeerClient, PeerServer, PeerUnreachable, RemoteError, TransportError

from .audit import AuditFailed, Auditor
from .authority import Unauthorized, check_replication
from .buffers import BufferPool
from .fragments import DigestMismatch, Encoded, FragmentStore
from .membership import Membership
from .runspec import RunSpec
from .send import STATEFUL_POST_FLOOR_S
from .sync import FragmentSync
from .version import Version
from .wire import (
    MAX_AUDITED_DELTAS,
    REPLICATE,
    ROUTE_MOMENTUM,
    ROUTE_REPLICATE,
    ReplicateFields,
    UpdateFields,
    anchor_digest,
    momentum_digest,
    pack_momentum,
    path_fragment,
    replicate_payload_max,
    replicate_trailer_len,
    replicate_trailer_max,
    split_replicate,
)

log = logging.getLogger(__name__)
FULL_RETRY_S = 0.25  # the first wait before a full replication that may pass is tried again (doubling, to 1 s)


class ReplicaAhead(Exception):
    """A replica answered 412: it holds a version of the fragment newer than the one the owner stepped from
    (a version of another owner the takeover did not see). Publishing would fork the fragment; the owner
    reaches that version and steps again."""

    def __init__(self, p: int, peers: set[str]) -> None:
        super().__init__(f"fragment {p}: {', '.join(sorted(x[:8] for x in peers))} hold a newer version")
        self.p, self.peers = p, peers


def fp32_copy(momentum: torch.Tensor) -> Encoded:
    """A momentum as it travels after a full replication: an fp32 copy, taken now (an owner's next step writes
    into the buffer its previous momentum came from)."""
    fp32 = get_codec("fp32")
    meta, payload = fp32.encode(momentum)
    return Encoded(fp32, meta, payload)


class Replication:
    """Both sides of replication for one peer."""

    def __init__(
        self,
        identity: Identity,
        spec: RunSpec,
        store: FragmentStore,
        membership: Membership,
        client: PeerClient,
        server: PeerServer,
        sync: FragmentSync,
        codec: Codec,
        pool: BufferPool,
        verifier: EnvelopeVerifier,
        stats: collections.Counter[str],
    ) -> None:
        self.identity, self.spec, self.store, self.members, self.client = identity, spec, store, membership, client
        self.sync, self.codec, self.pool, self.stats = sync, codec, pool, stats
        self.kept: dict[int, tuple[Version, Encoded | None]] = {}  # p -> replicated (version, momentum)
        # p -> the prefix of the owner's replicate that `kept[p]`'s momentum came in (its `mdigest` names those
        # bytes): with them it is evidence of what the owner replicated, for an accusation (coordinator/accuse.py)
        self.evidence: dict[int, bytes] = {}
        self.restored: dict[int, Version] = {}  # p -> the version whose kept momentum came from a checkpoint
        # p -> the version whose kept momentum came in a full replication: the owner's own fp32 momentum (its
        # hand-over, or what it sent this replica when it was behind), not a copy decoded from the run's codec
        self.handed: dict[int, Version] = {}
        self.terms_seen = [0] * len(store)  # p -> the highest term an owner replicated to us
        # p -> (the base, the replicas that answered 412 to a version built on it): once the owner has reached
        # the newest version it can find and still steps from that base, the same claim is not believed again
        self._ahead: dict[int, tuple[Version, set[str]]] = {}
        self._alone_since: float | None = None  # when the owner last found no other live member (`_alone`)
        # (p, version, momentum) of a full replication: a hand-over that may arrive after we took p over
        self.on_handover: Callable[[int, Version, Encoded], None] = lambda p, label, momentum: None
        # the momentum this peer's owner of p holds at a version (`Takeover.served`), when nothing is kept
        self.served_by_owner: Callable[[int, Version], Encoded | None] = lambda p, label: None
        self.auditor: Auditor | None = None  # recomputes the updates we are asked to hold (set by the shard)
        # (update fields, signer, the base's replicate prefix and momentum, the refused replicate): an audit failed
        self.on_audit_failed: Callable[[UpdateFields, str, bytes | None, Encoded | None, Envelope], None] = \
            lambda f, signer, prefix, momentum, env: None
        server.add_envelope_route(ROUTE_REPLICATE, verifier, self._on_replicate, kinds={REPLICATE},
                                  max_payload=replicate_payload_max(codec, store.max_numel()),
                                  trailer=functools.partial(replicate_trailer_len, P=len(store)),
                                  max_trailer=replicate_trailer_max(codec, store.max_numel()))
        server.add_route("GET", ROUTE_MOMENTUM, self._serve_momentum)

    def take(self, p: int) -> tuple[Version, Encoded | None] | None:
        """What we keep of fragment p (its version and momentum), handed to a takeover and forgotten here."""
        self.evidence.pop(p, None)
        return self.kept.pop(p, None)

    def keep(self, p: int, label: Version, momentum: torch.Tensor) -> None:
        """Keep the momentum of version `label` as a replica would (an owner that became a replica of p):
        an fp32 copy, unless what is kept already is of a newer version."""
        if p not in self.kept or self.kept[p][0] <= label:
            self.kept[p] = (label, fp32_copy(momentum))
            self.restored.pop(p, None)
            self.handed.pop(p, None)
            self.evidence.pop(p, None)

    def restore(self, p: int, label: Version, momentum: Encoded) -> None:
        """Keep the momentum of version `label` that this peer's checkpoint saved (a restart of every member
        leaves no other copy), as a replica would, unless what is kept already is of a newer version."""
        if p not in self.kept or self.kept[p][0] < label:
            self.kept[p] = (label, momentum)
            self.restored[p] = label
            self.handed.pop(p, None)
            self.evidence.pop(p, None)

    # -- owner side -----------------------------------------------------------------------------------------

    async def replicate(self, p: int, term: int, label: Version, update: Envelope, anchor: torch.Tensor,
                        momentum: torch.Tensor | None,
                        deltas: Sequence[tuple[bytes, bytes | memoryview]] = ()) -> set[str] | None:
        """Hand version `label` (the update `update`, giving `anchor`, and `momentum`, with the signed frames of
        the `deltas` it merged, each as its (prefix, payload), for the replicas to recompute it:
        coordinator/audit.py) to p's replicas before it is published; returns those that acknowledged (empty: nobody else is alive, `_alone`). None when none
        acknowledged: then the version must not be published yet (if this owner died right after, no live
        peer would hold it, and its successor would publish another version of that number); a silent
        replica is a suspect, or is retried once it answers."""
        replicas = [r for r in self.members.roles(p)[1:] if r != self.members.peer_id]
        if not replicas:
            return self._alone()
        base = UpdateFields.parse(update.fields, len(self.store)).base  # (the version the owner stepped from)
        claimed = self._ahead.get(p, (None, set()))
        disbelieved = claimed[1] if claimed[0] == base else set()
        self._alone_since = None
        # (encoded, hashed and sealed in worker threads: the loop keeps answering meanwhile)
        mmeta, mbytes = await asyncio.to_thread(self.codec.encode, momentum) if momentum is not None else (None, b"")
        mdigest = await asyncio.to_thread(momentum_digest, mbytes) if momentum is not None else None
        if len(deltas) > MAX_AUDITED_DELTAS or not all(prefix for prefix, _ in deltas):
            deltas = ()  # (too many to carry, or one without its frame: not recomputed)
        # the signed frames go after the envelope as they are: neither copied into one buffer nor hashed again
        trailer = [update.prefix(), update.payload, *(part for delta in deltas for part in delta)]
        fields = ReplicateFields(p, term, label, False, update.frame_size(), mmeta,
                                 tuple(len(prefix) + memoryview(body).nbytes for prefix, body in deltas),
                                 mdigest).to_fields()

        silent: set[str] = set()
        ahead: set[str] = set()

        async def one(peer: str) -> str | None:
            url = self.members.url(peer)
            if url is None:
                silent.add(peer)
                return None
            try:
                env = seal(self.identity, REPLICATE, self.spec.run_id, fields, mbytes, digest=mdigest)
                await self.client.send_envelope(url, ROUTE_REPLICATE, env, trailer,
                                                min_deadline_s=STATEFUL_POST_FLOOR_S)
                return peer
            except RemoteError as e:
                if e.status == 409 and momentum is not None:  # the replica is behind: send it everything
                    try:
                        full = await self.send_full(p, peer, term, momentum, update.prefix(), anchor, raises=True)
                    except RemoteError as full_e:
                        e, full = full_e, False
                    if full:
                        return peer
                if e.status == 412 and peer not in disbelieved:
                    ahead.add(peer)
                self.stats[f"replicate_refused_{e.status}"] += 1
            except TransportError as e:
                self.members.failed(peer, e)
                silent.add(peer)
            return None

        acked = {r for r in await asyncio.gather(*(one(r) for r in replicas)) if r is not None}
        if ahead:  # (even if another replica acknowledged: the version would fork p)
            self._ahead[p] = (base, ahead | disbelieved)
            raise ReplicaAhead(p, ahead)
        self._ahead.pop(p, None)
        if not acked and silent:
            self.stats["publications_held_for_a_replica"] += 1
            return None
        return acked or self._alone()

    def _alone(self) -> set[str] | None:
        """No replica holds the version: publish it (an empty set) only if no other peer that could hold it is
        alive, else wait (None) until one is a replica. A version held by its owner alone is forked by the next
        owner if this one dies before anybody else got it. Alone, wait one member TTL first: a peer that was
        alive until just now may be restarting with newer versions in its journal, and one that joined a moment
        ago may not be in our view yet (docs/architecture.md §6.5)."""
        now = time.monotonic()
        if self.members.servers():
            self._alone_since = None
            self.stats["publications_held_for_a_holder"] += 1
            return None
        if self._alone_since is None:
            self._alone_since = now
        if now - self._alone_since < self.members.ttl_s:
            self.stats["publications_held_while_alone"] += 1
            return None
        self.stats["published_without_live_replica"] += 1
        return set()

    async def send_full(self, p: int, peer: str, term: int, momentum: torch.Tensor, cert: bytes,
                        anchor: torch.Tensor, retry_until: float | None = None, raises: bool = False) -> bool:
        """Full state to `peer`: `cert` (the certificate of the version), its fp32 anchor and fp32 momentum,
        a consistent snapshot the caller took. True once `peer` answered 200 (the acknowledgement): it checked
        the certificate and the anchor's digest, installed the version if it held an older one, and keeps the
        momentum, or took it as the fragment's owner (a hand-over). With `retry_until` (a `time.monotonic()`
        time), a failure that may pass (no answer, 429, 5xx) is tried again until then; else one attempt. With
        `raises`, the peer's refusal (`RemoteError`) is raised instead of returning False."""
        url = self.members.url(peer)
        if url is None or not cert:
            return False
        label = UpdateFields.parse(self.sync.verifier.certificate(cert).fields, len(self.store)).new
        momentum = momentum.contiguous()
        mdigest = await asyncio.to_thread(momentum_digest, momentum.numpy())
        fields = ReplicateFields(p, term, label, True, len(cert), None, (), mdigest).to_fields()
        payload = await asyncio.to_thread(join_bytes, cert, anchor.numpy(), momentum.numpy())
        delay = FULL_RETRY_S
        while True:
            try:  # (sealed at each attempt: a fresh nonce)
                env = await asyncio.to_thread(seal, self.identity, REPLICATE, self.spec.run_id, fields, payload)
                await self.client.send_envelope(url, ROUTE_REPLICATE, env, min_deadline_s=STATEFUL_POST_FLOOR_S)
                self.stats["full_replications"] += 1
                return True
            except (TransportError, ProtocolError) as e:
                # (a slow or busy peer may answer next time; a refused connection is a peer that is gone)
                passing = isinstance(e, TransportError) and not isinstance(e, PeerUnreachable) and (
                    not isinstance(e, RemoteError) or e.status == 429 or e.status >= 500)
                if retry_until is None or not passing or time.monotonic() + delay >= retry_until:
                    log.info("full replication of fragment %d to %s failed: %s", p, peer[:8], e)
                    if raises and isinstance(e, RemoteError):
                        raise
                    return False
                self.stats["full_replication_retries"] += 1
            await asyncio.sleep(delay)
            delay = min(2 * delay, 1.0)
            url = self.members.url(peer)
            if url is None:
                return False

    # -- replica side ---------------------------------------------------------------------------------------

    def authorize(self, f: ReplicateFields, signer_key: bytes) -> None:
        """May the sender keep this replication here? Raises `Unauthorized` (403), and counts it
        (coordinator/authority.py). A full state (a hand-over) may come from a peer that owned p while this
        one was away (`Membership.may_have_owned`): the state of a newcomer's fragment, handed back to it."""
        may_own = self.members.may_have_owned if f.full else self.members.may_own
        try:
            check_replication(f.p, f.term, f.label, f.full, peer_id_of(signer_key), may_own)
        except Unauthorized:
            self.stats["replications_unauthorized"] += 1
            raise

    async def _on_replicate(self, env: Envelope, request: web.Request) -> bytes:
        f = ReplicateFields.parse(env.fields, len(self.store))
        self.authorize(f, env.sender)
        payload = memoryview(env.payload)
        numel = self.store.numel(f.p)
        self.terms_seen[f.p] = max(self.terms_seen[f.p], f.term)
        if not f.full:
            # the trailer's frames are bound to this signed header by their signer, fragment and version (a
            # label is signed once, docs/protocol.md §7.19) and, for the deltas, by the update's `merged`
            head, frames = split_replicate(f, env.trailer)
            rest = payload  # the momentum
            update = self.sync.verifier.open(head, fresh=False)  # (views, not copies: see `join_bytes`)
            if update.sender != env.sender:
                raise Unauthorized("a replication carries its sender's own update")
            uf = UpdateFields.parse(update.fields, len(self.store))
            if uf.p != f.p or uf.new != f.label:
                raise Malformed("a replication carries an update of another fragment or version")
            self._check_base(uf)
            if not f.names_its_momentum(env.payload_digest, len(rest)):
                raise Malformed("replicate mdigest is not the digest of its momentum bytes, its payload")
            if self.auditor is not None:
                kept = self.kept.get(f.p)
                try:
                    await asyncio.to_thread(
                        self.auditor.check, uf, Encoded(self.codec, uf.codec, update.payload), frames,
                        kept, Encoded(self.codec, f.momentum, rest) if f.momentum else None)
                except AuditFailed as e:
                    prefix = self.evidence.get(f.p)  # (taken before the report: it moves p, and `kept` with it)
                    self.auditor.report(uf, peer_id_of(env.sender), e)
                    self.on_audit_failed(uf, peer_id_of(env.sender), prefix, kept[1] if kept else None, env)
                    raise
            try:
                await self.sync.apply_update(update, verify=True, pushed=True)
            except (StaleVersion, DigestMismatch) as e:
                raise StaleVersion(f"replica cannot apply this update ({e}); send the full state") from None
            momentum = Encoded(self.codec, f.momentum, await asyncio.to_thread(join_bytes, rest)) if f.momentum else None
            if momentum is not None:  # refuse a malformed payload now, not at the takeover
                with self.pool.borrow(numel) as scratch:
                    momentum.decode(numel, out=scratch)
        else:
            head, rest = payload[: f.update_len], payload[f.update_len :]
            if len(rest) != 8 * numel:
                raise Malformed(f"full replication of fragment {f.p} must carry {8 * numel} bytes of state")
            cert = self.sync.verifier.certificate(bytes(head))
            uf = UpdateFields.parse(cert.fields, len(self.store))
            self.sync.authorize(uf, cert.sender, pushed=False)
            if uf.p != f.p or uf.new != f.label:
                raise Malformed("full replication does not match its certificate")
            self._check_base(uf)
            anchor = torch.frombuffer(rest[: 4 * numel], dtype=torch.float32)
            if await asyncio.to_thread(anchor_digest, anchor) != uf.digest:
                raise Malformed("full replication does not match its certificate")
            if f.label > self.store.label(f.p):
                self.store.install(f.p, anchor, f.label, bytes(head))
                if self.sync.journal is not None:
                    self.sync.journal.fragment(bytes(head), anchor)
            fp32 = get_codec("fp32")
            momentum = Encoded(fp32, {"codec": "fp32", "shape": [numel]},
                               await asyncio.to_thread(join_bytes, rest[4 * numel :]))
            if await asyncio.to_thread(momentum_digest, momentum.payload, env.version) != f.mdigest:
                raise Malformed("replicate mdigest is not the digest of its momentum bytes")
            momentum.decode(numel)  # the fp32 codec refuses non-finite values
        self.kept[f.p] = (f.label, momentum)
        self.restored.pop(f.p, None)
        if f.full:
            self.handed[f.p] = f.label
        else:
            self.handed.pop(f.p, None)
        if momentum is not None:
            self.evidence[f.p] = env.prefix()
        else:
            self.evidence.pop(f.p, None)
        if self.sync.journal is not None and momentum is not None:  # kept across a kill -9, as the version is
            self.sync.journal.momentum(f.p, f.label, momentum)
        self.stats["replications_received"] += 1
        if f.full and momentum is not None:
            self.on_handover(f.p, f.label, momentum)
        return b"ok"

    def _check_base(self, f: UpdateFields) -> None:
        """Refuse (412) to hold a version whose base is older than a version of p this replica holds, unless it
        holds that very version: the owner missed a version (another owner's, during a takeover or while member
        views differed), and the version it replicates would fork p and lose what that one merged. A version
        of the owner's own term is its own (one it replicated, then did not publish): it knows better."""
        held = self.store.label(f.p)
        if held > f.base and held != f.new and held.term != f.new.term:
            self.stats["replications_base_outdated"] += 1
            raise BaseOutdated(f"this replica holds fragment {f.p} at {held}, newer than the base {f.base} of "
                               f"{f.new}: reach it first")

    async def _serve_momentum(self, request: web.Request) -> web.Response:
        """GET /v1/momentum/{p}?label=T.V: the replicated momentum of that version, if this peer holds it, in
        the codec it arrived in; else the one of its owner of p at that version, in fp32."""
        p = path_fragment(request.match_info["p"], len(self.store))
        label = Version.parse(request.query.get("label", ""))
        kept = self.kept.get(p)
        held = kept[1] if kept is not None and kept[0] == label else None
        held = held or self.served_by_owner(p, label)
        if held is None:
            return web.Response(status=404, text="no momentum of that version here\n")
        return web.Response(body=pack_momentum(held.meta, held.payload))

"""The syncer shard: this peer's share of the outer optimization (docs/architecture.md §6).

For every fragment this peer owns it takes deltas (`POST /v1/delta`), steps when the quorum and grace window
say so, replicates the new state to the fragment's replicas (`POST /v1/replicate`), applies the published
update to its own anchor, pushes the update to the live learners and records the version in the DHT. For
fragments it replicates it keeps the owner's momentum, so a takeover (term + 1) loses nothing. Ownership
follows the live member set; a peer that loses a fragment while alive hands its momentum to the new owner.

One timer loop waits for the earliest round deadline; nothing here polls.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hashlib
import logging
import struct
import time

import torch
from aiohttp import web

from diloco.protocol import canonical
from diloco.protocol.codecs import Codec, get_codec
from diloco.protocol.envelope import Envelope, EnvelopeVerifier, seal
from diloco.protocol.errors import Malformed, ProtocolError, StaleVersion, Unavailable
from diloco.protocol.identity import Identity, peer_id_of
from diloco.protocol.transport import PeerClient, PeerServer, RemoteError, TransportError

from .buffers import BufferPool
from .fragments import DigestMismatch, Encoded, FragmentStore, anchor_digest
from .membership import Membership
from .outer import OuterOptimizer
from .owner import FragmentOwner, OwnerSettings, PendingDelta, Publication
from .plan import FragmentPlan
from .runspec import RunSpec
from .sync import STATEFUL_POST_FLOOR_S, FragmentSync
from .version import GENESIS, Version
from .wire import (
    DELTA,
    REPLICATE,
    ROUTE_DELTA,
    ROUTE_REPLICATE,
    ROUTE_UPDATE,
    UPDATE,
    DeltaFields,
    FragRecord,
    ReplicateFields,
    UpdateFields,
    frag_key,
    path_fragment,
)

log = logging.getLogger(__name__)
PUSH_CONCURRENCY = 8
FRAG_RECORD_TTL_S = 3600.0


TERM_SLOTS = 1 << 16


ROUTE_MOMENTUM = "/v1/momentum/{p}"


def momentum_body_max(numel: int) -> int:
    """The longest body GET /v1/momentum/{p} may answer: fp32 (a full replication) is the largest form."""
    return 4 + 4096 + 4 * numel


def _split_momentum(body: bytes) -> tuple[dict, bytes]:
    """Body of GET /v1/momentum: u32 big-endian length of the codec meta (canonical msgpack), meta, payload."""
    if len(body) < 4:
        raise Malformed("momentum answer shorter than its length prefix")
    (n,) = struct.unpack(">I", body[:4])
    meta = canonical.unpackb(body[4 : 4 + n], max_len=4096)
    if not isinstance(meta, dict):
        raise Malformed("momentum meta must be a map")
    return meta, bytes(body[4 + n :])


def next_term(seen: int, peer_id: str) -> int:
    """A term above every term seen, in a slot of its own for this peer: two peers that take a fragment at the
    same moment (their views of the member set differ for a poll interval) publish under different terms, so
    the higher one wins everywhere instead of two different fragments carrying one label."""
    slot = int.from_bytes(hashlib.sha256(peer_id.encode()).digest()[:2], "big") % TERM_SLOTS
    return (seen // TERM_SLOTS + 1) * TERM_SLOTS + slot


class Shard:
    """Owner and replica duties of one peer. Start `run()` as a task; it returns only when cancelled."""

    def __init__(
        self,
        identity: Identity,
        spec: RunSpec,
        plan: FragmentPlan,
        store: FragmentStore,
        membership: Membership,
        client: PeerClient,
        server: PeerServer,
        sync: FragmentSync,
        codec: Codec | None = None,
        pool: BufferPool | None = None,
    ) -> None:
        self.identity, self.spec, self.plan, self.store = identity, spec, plan, store
        self.pool = pool or BufferPool(max((f.numel for f in plan.fragments), default=0))
        self.members, self.client, self.sync = membership, client, sync
        self.codec = codec or get_codec(spec.codec)
        self.outer = OuterOptimizer(spec.outer_lr, spec.outer_momentum, nesterov=spec.outer_momentum > 0)
        self.settings = OwnerSettings(spec.quorum, spec.grace_gamma, spec.overlap, spec.grace_cap_s,
                                      spec.max_staleness, strict_quorum=spec.synchronous)
        self.owners: dict[int, FragmentOwner] = {}
        self.replica_momentum: dict[int, tuple[Version, Encoded | None]] = {}  # compressed until a takeover
        self.terms_seen = [0] * len(store)
        self.momentum_source: dict[int, str] = {}  # p -> where the momentum of an owned fragment came from
        self.outer_steps = [0] * len(store)
        self.stats: collections.Counter[str] = collections.Counter()
        self.verifier = EnvelopeVerifier(spec.run_id, is_member=spec.is_member, kinds={DELTA, REPLICATE})
        self._wake: asyncio.Event | None = None
        self._tasks: set[asyncio.Task] = set()
        self._stepping: set[int] = set()
        self._probing: set[str] = set()
        self.enabled = False  # becomes True once the membership view has been read at least once
        server.add_envelope_route(ROUTE_DELTA, self.verifier, self._on_delta, kinds={DELTA})
        server.add_envelope_route(ROUTE_REPLICATE, self.verifier, self._on_replicate, kinds={REPLICATE})
        server.add_route("GET", ROUTE_MOMENTUM, self._serve_momentum)
        sync.on_local_delta = self.accept_delta
        membership.on_change.append(self.reassign)

    # -- deltas ---------------------------------------------------------------------------------------------

    def accept_delta(self, env: Envelope) -> None:
        f = DeltaFields.parse(env.fields, len(self.store))
        owner = self.owners.get(f.p)
        if owner is None:
            self.stats["deltas_refused_not_owner"] += 1
            roles = self.members.roles(f.p)
            if len(roles) > 1 and self.members.peer_id in roles[1:] and roles[0] not in self._probing:
                # Learners think we own p: the owner we know may be gone. Check it now, not at its TTL.
                self._probing.add(roles[0])
                self._spawn(self._probe(roles[0]))
            raise Unavailable(f"not the owner of fragment {f.p}; the owner is {roles[0][:8] if roles else 'unknown'}")
        pending = PendingDelta(peer_id_of(env.sender), f.base, f.steps, f.tokens, f.codec, bytes(env.payload))
        try:
            owner.offer(pending, self.store.label(f.p))
        except ProtocolError as e:
            self.stats[f"deltas_dropped_{type(e).__name__}"] += 1
            raise
        self.stats["deltas_accepted"] += 1
        self._poke()

    async def _on_delta(self, env: Envelope, request: web.Request) -> bytes:
        self.accept_delta(env)
        return b"ok"

    # -- ownership ------------------------------------------------------------------------------------------

    def reassign(self) -> None:
        """Take or give up fragments after the live member set changed."""
        if not self.enabled:
            return
        live = self.members.live_learners()
        me = self.members.peer_id
        holding: set[int] = set()
        taken: list[int] = []
        for p in range(len(self.store)):
            roles = self.members.roles(p)
            if me in roles:
                holding.add(p)
            if roles and roles[0] == me and p not in self.owners:
                self._acquire(p, live)
                taken.append(p)
            elif (not roles or roles[0] != me) and p in self.owners:
                self._release(p, roles[0] if roles else None)
            if p in self.owners:
                self.owners[p].tracker.set_expected(live)
        self.store.keep_frames = holding
        if taken:
            self._spawn(self._reach_newest(taken))
        self._poke()

    async def _reach_newest(self, taken: list[int]) -> None:
        """A new owner steps only from the highest version any live member holds. A killed owner may have
        pushed its last version to some learners and to no replica: stepping from an older one would fork the
        fragment, and the deltas merged into that version would be lost (docs/architecture.md §6.6)."""
        try:
            above = await self.sync.held_above(taken)
            for p, (target, holders) in sorted(above.items()):
                owner = self.owners.get(p)
                if owner is None:
                    continue
                since = self.store.label(p)
                reached = await self.sync.reach(p, holders, target)
                self.stats["takeover_reached_newest" if reached else "takeover_newest_unreachable"] += 1
                if self.owners.get(p) is not owner or self.store.label(p) == since:
                    continue
                # the momentum of the version reached: rebuilt from ours and the kept updates since, if we can
                momentum = None
                if owner.momentum is not None and owner.label == since and self.outer.momentum != 0:
                    momentum = self._rebuild_momentum(p, since, owner.momentum)
                owner.momentum, owner.label = momentum, self.store.label(p)
                self.momentum_source[p] = "rebuilt" if momentum is not None else "fresh"
                log.info("fragment %d: taken over at %s, reached %s held by %s", p, since, self.store.label(p),
                         holders[0][:8])
                if momentum is None:
                    self._spawn(self._pull_momentum(p, self.store.label(p)))
        finally:
            for p in taken:
                if (owner := self.owners.get(p)) is not None:
                    owner.held_back = False
            self._poke()

    def _acquire(self, p: int, live: set[str]) -> None:
        label = self.store.label(p)
        kept = self.replica_momentum.pop(p, None)
        frag = self.plan.fragments[p]
        momentum, source = None, "fresh"
        if kept is not None and kept[0] == label:
            momentum, source = (kept[1].decode(frag.numel), "replica") if kept[1] else (None, "fresh")
        elif kept is not None and self.outer.momentum != 0:  # the replication of the newest version failed
            momentum = self._rebuild_momentum(p, kept[0], kept[1].decode(frag.numel) if kept[1] else None)
            source = "rebuilt" if momentum is not None else "fresh"
            self.stats["momentum_rebuilt_at_takeover" if momentum is not None else "momentum_not_rebuilt"] += 1
        term = next_term(max(label.term, self.terms_seen[p]), self.members.peer_id)
        self.owners[p] = FragmentOwner(p, frag.numel, frag.embedding_numel, self.codec, self.outer, self.settings,
                                       term, momentum, live, pool=self.pool)
        self.owners[p].label = label
        self.owners[p].held_back = True  # until `_reach_newest` has compared our version with the others
        self.momentum_source[p] = source
        if label != GENESIS:
            self.stats["takeovers"] += 1
            if momentum is None:
                self.stats["takeovers_without_momentum"] += 1
        log.info("now owner of fragment %d at %s (term %d, momentum %s)", p, label, term,
                 "kept" if momentum is not None else "fresh")
        if momentum is None and label != GENESIS:
            self._spawn(self._pull_momentum(p, label))

    def _rebuild_momentum(self, p: int, since: Version, momentum: torch.Tensor | None) -> torch.Tensor | None:
        """The momentum of fragment p's current version, from the one replicated at `since` and the kept
        updates since then (`OuterOptimizer.momentum_after`); None when those updates are not all kept."""
        frames = self.store.updates_after(p, since)
        if not frames:
            return None
        numel = self.store.numel(p)
        try:
            for frame in frames:
                env = self.sync.verifier.open(frame, fresh=False)
                f = UpdateFields.parse(env.fields, len(self.store))
                momentum = self.outer.momentum_after(momentum, Encoded(self.codec, f.codec, env.payload).decode(numel))
        except (ProtocolError, ValueError) as e:  # (frames we applied ourselves: not expected)
            log.info("cannot rebuild the momentum of fragment %d: %s", p, e)
            return None
        return momentum

    async def _pull_momentum(self, p: int, label: Version) -> None:
        """Taken over without the momentum of this version (member views differed, so the owner replicated
        to another peer): ask the other live members for it (GET /v1/momentum/{p}?label=T.V), one after the
        other until one has it; a member that fails or answers something malformed is passed over."""
        numel = self.store.numel(p)
        for m in self.members.live():
            owner = self.owners.get(p)
            if owner is None or owner.momentum is not None or self.store.label(p) != label:
                return
            if m.peer_id == self.members.peer_id or m.client_mode or not m.url:
                continue
            try:
                body = await self.client.request("GET", m.url, f"/v1/momentum/{p}?label={label}", deadline_s=10.0,
                                                 max_response=momentum_body_max(numel))
                meta, payload = _split_momentum(body)
                momentum = Encoded(self._momentum_codec(meta), meta, payload).decode(numel)
            except RemoteError as e:
                if e.status != 404:
                    log.info("momentum pull of fragment %d from %s refused: %s", p, m.peer_id[:8], e)
                continue
            except (TransportError, ProtocolError) as e:
                log.info("momentum pull of fragment %d from %s failed: %s", p, m.peer_id[:8], e)
                self.stats["momentum_pull_failures"] += 1
                continue
            if self.owners.get(p) is owner and owner.momentum is None and self.store.label(p) == label:
                owner.momentum, owner.label = momentum, label
                self.momentum_source[p] = "pulled"
                self.stats["momentum_pulled_after_takeover"] += 1
            return

    def _momentum_codec(self, meta: dict) -> Codec:
        """A replicated momentum travels in the run's codec (an ordinary replication) or in fp32 (a full
        replication or hand-over): docs/protocol.md §7.15. Anything else is `Malformed`."""
        name = meta.get("codec")
        if name == self.codec.name:
            return self.codec
        if name == "fp32":
            return get_codec("fp32")
        raise Malformed(f"momentum meta names codec {name!r}; this run's momentum is {self.codec.name!r} or fp32")

    async def _serve_momentum(self, request: web.Request) -> web.Response:
        """GET /v1/momentum/{p}?label=T.V: the replicated momentum of that version, if this peer holds it, in
        the codec it arrived in."""
        p = path_fragment(request.match_info["p"], len(self.store))
        label = Version.parse(request.query.get("label", ""))
        kept = self.replica_momentum.get(p)
        if kept is None or kept[1] is None or kept[0] != label:
            return web.Response(status=404, text="no replicated momentum of that version here\n")
        head = canonical.packb(kept[1].meta)
        return web.Response(body=struct.pack(">I", len(head)) + head + bytes(kept[1].payload))

    def _release(self, p: int, new_owner: str | None) -> None:
        owner = self.owners.pop(p)
        self.stats["deltas_dropped_on_handoff"] += len(owner.pending)
        log.info("no longer owner of fragment %d (new owner %s)", p, (new_owner or "none")[:8])
        if new_owner is None or owner.momentum is None:
            return
        # A committed snapshot, taken now: the anchor and the momentum of one version. A step still running
        # writes only its own buffers, and a popped owner never commits again.
        anchor, label, cert = self.store.snapshot(p)
        if label != GENESIS and label == owner.label:
            self._spawn(self._send_full(p, new_owner, owner.term, owner.momentum, cert, anchor))

    # -- the outer step -------------------------------------------------------------------------------------

    async def run(self) -> None:
        self._wake = asyncio.Event()
        while True:
            deadlines = [d for p, o in self.owners.items() if p not in self._stepping and (d := o.deadline()) is not None]
            timeout = max(0.0, min(deadlines) - time.monotonic()) if deadlines else None
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout)
            self._wake.clear()
            self._observe_step_time()
            for p, owner in list(self.owners.items()):
                if owner.ready() and p not in self._stepping:
                    self._stepping.add(p)
                    self._spawn(self._step_guarded(p, owner))

    async def _step_guarded(self, p: int, owner: FragmentOwner) -> None:
        """One fragment's outer step; fragments step concurrently, each one at a time."""
        try:
            await self._step(p, owner)
        except Exception:  # one fragment's failure must not stop the others
            log.exception("outer step of fragment %d failed", p)
            self.stats["outer_step_failures"] += 1
        finally:
            self._stepping.discard(p)
            self._poke()  # deltas may have queued up meanwhile

    def _poke(self) -> None:
        if self._wake is not None:
            self._wake.set()

    def _observe_step_time(self) -> None:
        times = sorted(m.record.step_time_s for m in self.members.live() if m.record.step_time_s > 0)
        if times:
            for owner in self.owners.values():
                owner.tracker.observe_step_time(times[len(times) // 2])

    async def _step(self, p: int, owner: FragmentOwner) -> None:
        """One owner round as a transaction (docs/architecture.md §7): the step computes the new anchor, momentum
        and residual into buffers of its own; they become the owner's and the store's together, with the new
        (term, version), once the replicas hold them and nothing newer arrived meanwhile. On any other outcome
        nothing changes and the round's deltas go back into the next round (or are dropped and counted once
        this peer no longer owns p)."""
        t0 = time.monotonic()
        label = self.store.label(p)
        if label.term > owner.term:  # another peer owned p meanwhile (views differed): publish above its term
            owner.term = next_term(label.term, self.members.peer_id)
        batch = owner.take_round()
        pub, env, replicated = None, None, set()
        try:
            pub = await asyncio.to_thread(owner.step, batch, label)
            published = await self._publish(p, owner, pub)
            if published is not None:
                env, replicated = published
        finally:
            if env is None:
                self.stats["publications_abandoned"] += 1
                dropped = owner.abandon(pub, batch, requeue=self.owners.get(p) is owner)
                self.stats["deltas_dropped_abandoned"] += dropped
            if pub is not None:
                self.pool.give(pub.update)
        if env is None:
            return
        self.outer_steps[p] += 1
        self.stats["outer_steps"] += 1
        await self._push(env, exclude=replicated | {self.members.peer_id})
        owner.tracker.observe_sync_time(time.monotonic() - t0)
        self._spawn(self.members.dht.store(frag_key(self.spec.run_id, p), FragRecord(pub.new).encode(),
                                           time.time() + FRAG_RECORD_TTL_S, subkey=self.members.peer_id))

    async def _publish(self, p: int, owner: FragmentOwner, pub: Publication) -> tuple[Envelope, set[str]] | None:
        """Certify Θ^(new), hand it to the replicas, then commit the store's anchor and the owner's state in
        one step of the event loop. None, changing nothing, if another version of p arrived first or this
        peer lost p meanwhile (views of the member set differed for a moment: the higher (term, version)
        stands)."""
        anchor = self.pool.take(self.store.numel(p))
        try:
            if not self.store.add_to(p, pub.base, pub.update, out=anchor):  # Θ^(new), as every holder will
                return None
            digest = await asyncio.to_thread(anchor_digest, anchor)
            fields = UpdateFields(p, pub.base, pub.new, digest, pub.meta, tuple(pub.learners)).to_fields()
            env = seal(self.identity, UPDATE, self.spec.run_id, fields, pub.payload)
            replicated = await self._replicate(p, owner, env, anchor, pub)
            if self.owners.get(p) is not owner or self.store.label(p) != pub.base:
                return None
            # the commit: no await from here on
            self.store.advance(p, pub.base, pub.new, pub.update, env.to_bytes(), env.prefix(),
                               contributors=pub.learners, move=Encoded(self.codec, pub.meta, pub.payload))
            owner.commit(pub)
            return env, replicated
        finally:
            self.pool.give(anchor)

    async def _push(self, env: Envelope, exclude: set[str]) -> None:
        """Send the update to every live learner that accepts connections, a few at a time."""
        gate = asyncio.Semaphore(PUSH_CONCURRENCY)

        async def one(member) -> None:
            async with gate:
                try:
                    await self.client.send_envelope(member.url, ROUTE_UPDATE, env, min_deadline_s=STATEFUL_POST_FLOOR_S)
                except RemoteError as e:
                    self.stats[f"push_refused_{e.status}"] += 1
                except TransportError as e:
                    self.members.failed(member.peer_id, e)
                    self.stats["push_failed"] += 1

        await asyncio.gather(*(one(m) for m in self.members.live()
                               if m.peer_id not in exclude and not m.client_mode and m.url))

    # -- replication ----------------------------------------------------------------------------------------

    async def _replicate(self, p: int, owner: FragmentOwner, update: Envelope, anchor: torch.Tensor,
                         pub: Publication) -> set[str]:
        """Hand the new state (Θ^(new) and the step's momentum, not yet committed) to the replicas before
        publishing; returns those that acknowledged."""
        replicas = [r for r in self.members.roles(p)[1:] if r != self.members.peer_id]
        if not replicas:
            self.stats["published_without_live_replica"] += 1
            return set()
        frame = update.to_bytes()
        momentum = pub.momentum
        mmeta, mbytes = self.codec.encode(momentum) if momentum is not None else (None, b"")
        fields = ReplicateFields(p, owner.term, pub.new, False, len(frame), mmeta).to_fields()

        async def one(peer: str) -> str | None:
            url = self.members.url(peer)
            if url is None:
                return None
            try:
                env = seal(self.identity, REPLICATE, self.spec.run_id, fields, frame + mbytes)
                await self.client.send_envelope(url, ROUTE_REPLICATE, env, min_deadline_s=STATEFUL_POST_FLOOR_S)
                return peer
            except RemoteError as e:
                if e.status == 409 and momentum is not None:  # the replica is behind: send it everything
                    full = await self._send_full(p, peer, owner.term, momentum, update.prefix(), anchor)
                    return peer if full else None
                self.stats[f"replicate_refused_{e.status}"] += 1
            except TransportError as e:
                self.members.failed(peer, e)
            return None

        acked = {r for r in await asyncio.gather(*(one(r) for r in replicas)) if r is not None}
        if not acked:
            self.stats["published_without_live_replica"] += 1
        return acked

    async def _send_full(self, p: int, peer: str, term: int, momentum: torch.Tensor, cert: bytes | None = None,
                         anchor: torch.Tensor | None = None) -> bool:
        """Full state to `peer`: the certificate of the version, the fp32 anchor and the fp32 momentum."""
        if anchor is None or cert is None:
            anchor, _, cert = self.store.snapshot(p)
        url = self.members.url(peer)
        if url is None or not cert:
            return False
        label = UpdateFields.parse(self.sync.verifier.certificate(cert).fields, len(self.store)).new
        fields = ReplicateFields(p, term, label, True, len(cert), None).to_fields()
        payload = cert + anchor.numpy().tobytes() + momentum.contiguous().numpy().tobytes()
        try:
            await self.client.send_envelope(url, ROUTE_REPLICATE,
                                            seal(self.identity, REPLICATE, self.spec.run_id, fields, payload),
                                            min_deadline_s=STATEFUL_POST_FLOOR_S)
            self.stats["full_replications"] += 1
            return True
        except (TransportError, ProtocolError) as e:
            log.info("full replication of fragment %d to %s failed: %s", p, peer[:8], e)
            return False

    async def _on_replicate(self, env: Envelope, request: web.Request) -> bytes:
        f = ReplicateFields.parse(env.fields, len(self.store))
        payload = memoryview(env.payload)
        numel = self.store.numel(f.p)
        self.terms_seen[f.p] = max(self.terms_seen[f.p], f.term)
        head, rest = payload[: f.update_len], payload[f.update_len :]
        if not f.full:
            update = self.sync.verifier.open(bytes(head), fresh=False)
            try:
                await self.sync.apply_update(update, verify=True)
            except (StaleVersion, DigestMismatch) as e:
                raise StaleVersion(f"replica cannot apply this update ({e}); send the full state") from None
            momentum = Encoded(self.codec, f.momentum, bytes(rest)) if f.momentum else None
            if momentum is not None:  # refuse a malformed payload now, not at the takeover
                with self.pool.borrow(numel) as scratch:
                    momentum.decode(numel, out=scratch)
        else:
            if len(rest) != 8 * numel:
                raise Malformed(f"full replication of fragment {f.p} must carry {8 * numel} bytes of state")
            cert = self.sync.verifier.certificate(bytes(head))
            uf = UpdateFields.parse(cert.fields, len(self.store))
            anchor = torch.frombuffer(rest[: 4 * numel], dtype=torch.float32)
            if uf.p != f.p or uf.new != f.label or await asyncio.to_thread(anchor_digest, anchor) != uf.digest:
                raise Malformed("full replication does not match its certificate")
            if f.label > self.store.label(f.p):
                self.store.install(f.p, anchor, f.label, bytes(head))
            fp32 = get_codec("fp32")
            momentum = Encoded(fp32, {"codec": "fp32", "shape": [numel]}, bytes(rest[4 * numel :]))
            momentum.decode(numel)  # the fp32 codec refuses non-finite values
        self.replica_momentum[f.p] = (f.label, momentum)
        self.stats["replications_received"] += 1
        owner = self.owners.get(f.p)
        if f.full and owner is not None and owner.momentum is None and momentum is not None \
                and f.label == self.store.label(f.p):
            # A handoff that arrived after we took the fragment over (the old owner saw the new member set
            # later than we did): the momentum is still the one that belongs to this version.
            owner.momentum = momentum.decode(self.store.numel(f.p))
            self.momentum_source[f.p] = "handed over"
            self.stats["momentum_adopted_after_takeover"] += 1
        return b"ok"

    async def _probe(self, peer: str) -> None:
        """Suspect `peer` (which moves its fragments to their replicas) if it does not answer within 2 s."""
        try:
            url = self.members.url(peer)
            if url is not None:
                await self.client.request("GET", url, "/v1/status", deadline_s=2.0, max_response=1 << 22)
        except RemoteError:
            pass  # it answered: alive
        except TransportError:
            self.members.suspect(peer)
        finally:
            self._probing.discard(peer)

    async def close(self) -> None:
        """Cancel the background work (steps, probes, pulls, hand-overs) before the client goes away."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


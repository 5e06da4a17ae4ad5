"""The syncer shard: this peer's share of the outer optimization (docs/architecture.md §6).

For every fragment this peer owns it takes deltas (`POST /v1/delta`), steps when the quorum and grace window
say so, and publishes each round as one transaction (`_step`): replicate the new state (`replication`),
commit it to the store and the owner, push the update to the live learners, record the version in the DHT.
Ownership follows the live member set: `takeover` starts each new ownership (term, momentum, the newest
version), and a peer that loses a fragment while alive hands a committed snapshot to the new owner. This
module owns `owners`; one timer loop waits for the earliest round deadline, nothing here polls.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import Callable

from aiohttp import web

from diloco.protocol.codecs import Codec, get_codec
from diloco.protocol.envelope import Envelope, EnvelopeVerifier, parse_header, seal
from diloco.protocol.errors import ProtocolError, Unavailable
from diloco.protocol.identity import Identity, peer_id_of
from diloco.protocol.transport import PeerClient, PeerServer, RemoteError, TransportError

from .accuse import Accusations
from .audit import Auditor
from .authority import next_term
from .buffers import BufferPool
from .drain import OwnerDrain, ShardDrain
from .fragments import Encoded, FragmentStore
from .membership import Membership
from .outer import OuterOptimizer
from .owner import FragmentOwner, OwnerSettings, PendingDelta, Publication
from .plan import FragmentPlan
from .replication import ReplicaAhead, Replication, fp32_copy
from .runspec import RunSpec
from .send import STATEFUL_POST_FLOOR_S
from .sync import FragmentSync
from .takeover import Takeover
from .version import GENESIS, Version
from .wire import (
    DELTA,
    REPLICATE,
    ROUTE_DELTA,
    ROUTE_UPDATE,
    UPDATE,
    DeltaFields,
    FragRecord,
    UpdateFields,
    anchor_digest,
    frag_key,
    tensor_payload_max,
)

log = logging.getLogger(__name__)
PUSH_CONCURRENCY = 8
FRAG_RECORD_TTL_S = 3600.0
# An owner announces a fragment's newest version in the DHT at most this often (the newest one once the time is
# up): the records serve the watch loop's every 6th look and joiners, while every announcement costs k stores
FRAG_RECORD_EVERY_S = 10.0
CHECKED_VERSIONS = 2  # a new owner asks every live member's versions again before replicating its first ones
REACH_ON_DELTA_EVERY_S = 5.0  # at most this often, a delta based on a version newer than ours starts a reach


class Shard:
    """Owner duties of one peer (its replica duties: `replication`). Start `run()` as a task; it returns only
    when cancelled."""

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
                                      spec.max_staleness, strict_quorum=spec.synchronous,
                                      max_tokens_per_step=spec.max_tokens_per_step, max_share=spec.max_share)
        self.owners: dict[int, FragmentOwner] = {}  # the fragments this peer owns; changed on the loop only
        self.outer_steps = [0] * len(store)
        # seconds of each recent published round, from taking its deltas to its version pushed to every learner
        self.round_s: collections.deque[float] = collections.deque(maxlen=256)
        self.stats: collections.Counter[str] = collections.Counter()
        self.verifier = EnvelopeVerifier(spec.run_id, is_member=spec.is_member, kinds={DELTA, REPLICATE})
        self._wake: asyncio.Event | None = None
        self._tasks: set[asyncio.Task] = set()
        self._to_announce: dict[int, Version] = {}  # p -> the newest version of p not announced yet
        self._announced_at: dict[int, float] = {}  # p -> monotonic time of its last announcement
        self._stepping: set[int] = set()
        self._behind_at: dict[int, float] = {}  # p -> monotonic time of the last reach a delta asked for (`_behind`)
        self._probing: set[str] = set()
        self.enabled = False  # becomes True once the membership view has been read at least once
        self._live_seen: set[str] = set()  # the live learners at the last `reassign`
        server.add_envelope_route(ROUTE_DELTA, self.verifier, self._on_delta, kinds={DELTA},
                                  max_payload=tensor_payload_max(self.codec, store.max_numel()))
        self.replication = Replication(identity, spec, store, membership, client, server, sync, self.codec,
                                       self.pool, self.verifier, self.stats)
        self.replication.auditor = Auditor(self.codec, store.numel, lambda p: plan.fragments[p].embedding_numel,
                                           self.outer, spec.max_share, self.settings.clip_c, len(store),
                                           lambda frame: self.verifier.open(frame, fresh=False), sync.guard,
                                           self.stats, self.pool)
        self.accusations = Accusations(identity, spec, store, membership, client, server, self.codec,
                                       self.replication.auditor, sync.guard,
                                       lambda key: self.verifier.is_member(key), self._spawn, self.stats)
        self.replication.on_audit_failed = self.accusations.accuse
        self.takeover = Takeover(store, membership, client, sync, self.replication, self.codec, self.outer,
                                 self.owners, self.stats, self._spawn)
        self.takeover.stepping = self._stepping.__contains__
        self.draining = ShardDrain(self)  # this peer's leaving on purpose (`drain`)
        sync.deltas.on_local_delta = self.accept_delta
        sync.on_held_above = self._told_held_above
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
        if f.base > self.store.label(f.p):  # (the delta is refused below, as stale: its learner resyncs meanwhile)
            self._behind(f.p, owner, peer_id_of(env.sender))
        pending = PendingDelta(peer_id_of(env.sender), f.base, f.steps, f.tokens, f.codec,
                               memoryview(env.payload).toreadonly(), parse_header(env.header)["payload_digest"],
                               env.prefix())
        try:
            owner.offer(pending, self.store.label(f.p))
        except ProtocolError as e:
            self.stats[f"deltas_dropped_{type(e).__name__}"] += 1
            raise
        self.stats["deltas_accepted"] += 1
        self._poke()

    def _behind(self, p: int, owner: FragmentOwner, sender: str) -> None:
        """`sender` sent a delta based on a version of p newer than ours: a version the takeover did not see
        (its holder did not answer then). Stepping now would fork p; reach it from that learner first. One
        request, at most once per REACH_ON_DELTA_EVERY_S: a member naming bases that do not exist holds no
        step back for long."""
        if not self._claim_heard(p, owner):
            return
        self.stats["reached_after_a_newer_delta"] += 1
        self._reach_before_stepping(p, owner, ask=sender)

    def _told_held_above(self, p: int, held: Version) -> None:
        """A joiner downloading p from us (or a learner asking for the updates after its version) holds a newer
        version, restored from its journal (docs/architecture.md §5.6): one we never saw, published by p's
        owner before it died. Its member record may be younger than our last poll, so the comparison at its
        arrival has not run yet, and our next version would fork p: read the member records now and compare
        with every live member before stepping. The claim is not signed (a read): bounded like `_behind`'s."""
        owner = self.owners.get(p)
        if owner is None or not self._claim_heard(p, owner):
            return
        self.stats["reached_after_a_joiner_held_above"] += 1
        log.info("fragment %d: a joiner holds %s, above our %s; comparing versions before the next step", p, held,
                 self.store.label(p))
        owner.held_back = True
        self._spawn(self._poll_then_reach(p))

    async def _poll_then_reach(self, p: int) -> None:
        seen = set(self._live_seen)
        try:
            with contextlib.suppress(TransportError, ProtocolError, asyncio.TimeoutError):
                await self.members.poll()
        finally:  # (a member that arrived: `reassign` compares with it, holding p back until then)
            if not self._live_seen - seen - {self.members.peer_id}:
                await self._reach_newest([p], once=True)

    def _claim_heard(self, p: int, owner: FragmentOwner) -> bool:
        """May a claim of a version of p newer than ours start a reach now? Not while one runs, and at most
        once per REACH_ON_DELTA_EVERY_S per fragment, whoever claims it (deltas and reads alike)."""
        now = time.monotonic()
        if owner.held_back or now - self._behind_at.get(p, float("-inf")) < REACH_ON_DELTA_EVERY_S:
            return False
        self._behind_at[p] = now
        return True

    def _reach_before_stepping(self, p: int, owner: FragmentOwner, ask: str | None = None) -> None:
        if self.owners.get(p) is owner:
            owner.held_back = True
            self._spawn(self._reach_newest([p], ask))

    async def _on_delta(self, env: Envelope, request: web.Request) -> bytes:
        if self.draining.active and await self.draining.forward(env):  # (handed over: to its new owner)
            return b"ok"
        self.accept_delta(env)
        return b"ok"

    # -- ownership ------------------------------------------------------------------------------------------

    def reassign(self) -> None:
        """Take or give up fragments after the live member set changed."""
        if not self.enabled:
            return
        live = self.members.live_learners()
        arrived, self._live_seen = live - self._live_seen, live
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
                self._release(p, roles)
            if p in self.owners:
                self.owners[p].tracker.set_expected(live)
        self.store.keep_frames = holding
        # A member that just arrived may hold a newer version of a fragment we already own (it restarted and
        # replayed its journal, docs/architecture.md §5.6): compare again before our next step, as at a takeover.
        kept = sorted(p for p in self.owners if p not in taken) if arrived - {me} else []
        for p in kept:
            self.owners[p].held_back = True
        if taken or kept:
            self._spawn(self._reach_newest(taken + kept))
        self._poke()

    @property
    def momentum_source(self) -> dict[int, str]:
        """p -> where the momentum of an owned fragment came from (`Takeover`)."""
        return self.takeover.momentum_source

    def momenta(self) -> dict[int, tuple[Version, Encoded]]:
        """p -> the momentum this peer holds of a version of fragment p (as owner, copied now, or as replica),
        for a checkpoint: a restart of every member at once leaves no other copy. On the loop thread."""
        held = {p: kept for p, kept in self.replication.kept.items() if kept[1] is not None}
        for p, owner in self.owners.items():
            if owner.momentum is not None and owner.label != GENESIS:
                held[p] = (owner.label, fp32_copy(owner.momentum))
        return held

    async def _reach_newest(self, taken: list[int], ask: str | None = None, once: bool = False) -> None:
        try:
            await self.takeover.reach_newest(taken, ask, once=once)
        finally:
            self._poke()

    def _acquire(self, p: int, live: set[str]) -> None:
        label, frag = self.store.label(p), self.plan.fragments[p]
        momentum, term = self.takeover.momentum(p), self.takeover.term(p)
        owner = FragmentOwner(p, frag.numel, frag.embedding_numel, self.codec, self.outer, self.settings, term,
                              momentum, live, pool=self.pool)
        owner.label = label
        owner.norms.extend(self.replication.auditor.norms.pop(p, ()))  # (the merges we recomputed as its replica)
        owner.held_back = True  # until `Takeover.reach_newest` has compared our version with the others
        self.owners[p] = owner
        if label != GENESIS:
            self.stats["takeovers"] += 1
            if momentum is None:
                self.stats["takeovers_without_momentum"] += 1
        log.info("now owner of fragment %d at %s (term %d, momentum %s)", p, label, term, self.momentum_source[p])
        if momentum is None and label != GENESIS:
            self._spawn(self._pull(p, label))

    async def _pull(self, p: int, label: Version) -> None:
        try:
            await self.takeover.pull(p, label)
        finally:
            self._poke()  # the owner held its first step back meanwhile

    def _release(self, p: int, roles: list[str]) -> None:
        owner = self.owners.pop(p)
        new_owner = roles[0] if roles else None
        log.info("no longer owner of fragment %d (new owner %s)", p, (new_owner or "none")[:8])
        if self.draining.active:  # leaving: the hand-over is awaited, and the momentum kept for the checkpoint
            anchor, label, cert = self.store.snapshot(p)
            if label != GENESIS and label == owner.label and owner.momentum is not None:
                self.replication.keep(p, label, owner.momentum)
            self.draining.hand_over(p, new_owner, owner, label, anchor, cert)
            self.draining.pass_on(p, list(owner.pending.values()))  # (taken after the last early step: to the next owner)
            return
        self.stats["deltas_dropped_on_handoff"] += len(owner.pending)
        if new_owner is None or owner.momentum is None:
            return
        # A committed snapshot, taken now: the anchor and the momentum of one version. A step still running
        # writes only its own buffers, and a popped owner never commits again.
        anchor, label, cert = self.store.snapshot(p)
        if label != GENESIS and label == owner.label:
            # kept as a replica keeps it, replica of p or not: the new owner may be gone before the hand-over
            # reaches it (a dead peer's late member record), and the next one pulls it from here
            self.replication.keep(p, label, owner.momentum)
            self._spawn(self.replication.send_full(p, new_owner, owner.term, owner.momentum, cert, anchor))

    async def drain(self, deadline: float, rank_out: Callable[[], None]) -> OwnerDrain:
        """Leave on purpose by `deadline` (time.monotonic()): the owned fragments' pending rounds published,
        then `rank_out()` (this peer out of `roles`: every fragment is released at once) and each one handed
        to its next owner and acknowledged (coordinator/drain.py). Deltas that reach us afterwards are
        forwarded to the new owners for as long as this shard lives."""
        return await self.draining.run(deadline, rank_out)

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
        if owner.label != label:
            self.takeover.move_momentum(p, owner, label)
        if owner.leaves_term(label):
            owner.term = next_term(owner.term, self.members.peer_id)
            self.stats["terms_left_unaudited"] += 1
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
                now = self.store.label(p)
                # (a version this round replicated may have come back to us from a replica, and merged them)
                merged = pub is not None and now.term == pub.new.term and now >= pub.new
                dropped = owner.abandon(pub, batch, requeue=self.owners.get(p) is owner and not merged)
                self.stats["deltas_dropped_abandoned"] += dropped
            if pub is not None:
                self.pool.give(pub.update)
        if env is None:
            return
        self.outer_steps[p] += 1
        self.stats["outer_steps"] += 1
        await self._push(env, exclude=replicated | {self.members.peer_id})
        self.round_s.append(time.monotonic() - t0)
        owner.tracker.observe_sync_time(self.round_s[-1])
        self._announce(p, pub.new)

    def _announce(self, p: int, version: Version) -> None:
        """Store FragRecord(version) of p in the DHT: now, or once FRAG_RECORD_EVERY_S has passed since the
        last announcement of p, then the newest version published meanwhile."""
        pending = p in self._to_announce
        self._to_announce[p] = max(version, self._to_announce.get(p, version))
        if not pending:
            self._spawn(self._announce_when_due(p))

    async def _announce_when_due(self, p: int) -> None:
        wait = self._announced_at.get(p, float("-inf")) + FRAG_RECORD_EVERY_S - time.monotonic()
        if wait > 0:
            await asyncio.sleep(wait)
        version = self._to_announce.pop(p)
        self._announced_at[p] = time.monotonic()
        await self.members.dht.store(frag_key(self.spec.run_id, p), FragRecord(version).encode(),
                                     time.time() + FRAG_RECORD_TTL_S, subkey=self.members.peer_id)

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
            fields = UpdateFields(p, pub.base, pub.new, digest, pub.meta, tuple(pub.learners), tuple(pub.merged),
                                  pub.clip).to_fields()
            env = await asyncio.to_thread(seal, self.identity, UPDATE, self.spec.run_id, fields, pub.payload)
            if owner.held_back:  # a member arrived meanwhile that may hold a newer version: compare first
                self.stats["publications_held_for_a_comparison"] += 1
                return None
            if owner.published < CHECKED_VERSIONS and owner.checked != pub.base:
                # a new ownership: the old owner may have published after the takeover compared versions
                # (member views differed for a moment), to members that are not our replicas. Once per base: a
                # member that claims a version it cannot serve delays one round, not every one
                owner.checked = pub.base
                if p in await self.sync.held_above([p], suspect=False):
                    self.stats["publications_held_for_a_newer_version"] += 1
                    self._reach_before_stepping(p, owner)
                    return None
            owner.signed = pub.new if owner.signed is None else max(owner.signed, pub.new)
            try:
                replicated = await self.replication.replicate(p, owner.term, pub.new, env, anchor, pub.momentum,
                                                              [(d.prefix, d.payload) for d in pub.batch])
            except ReplicaAhead as e:  # the version would fork p: reach the newer one, then step from it
                log.info("%s; reaching it before the next step", e)
                self.stats["publications_refused_base_outdated"] += 1
                self._reach_before_stepping(p, owner)
                return None
            if replicated is None:  # replicas in view, none holds it: try again once the view has moved on
                await asyncio.sleep(self.members.poll_s)  # (the failed replicas are suspects by now)
                return None
            if self.owners.get(p) is not owner or self.store.label(p) != pub.base:
                return None
            # the commit: no await from here on
            frame = env.frame()
            self.store.advance(p, pub.base, pub.new, pub.update, frame, env.prefix(),
                               contributors=pub.learners, move=Encoded(self.codec, pub.meta, pub.payload))
            owner.commit(pub)
            if self.sync.journal is not None:  # our own version, like every version we accept
                self.sync.journal.update(frame)
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

        await asyncio.gather(*(one(m) for m in self.members.servers() if m.peer_id not in exclude))

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


"""The learner's background half: one thread, one asyncio loop, all the I/O (docs/architecture.md §9).

It starts the peer's HTTP server, its DHT node, the membership view, the fragment sync and (unless in client
mode) the syncer shard; joins the run; downloads every fragment that is newer than what the learner holds;
then sends the deltas the training thread hands it and keeps the anchors current. The training thread talks
to it only through `submit_delta` and the `FragmentStore`, and never waits on the network.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import errno
import functools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from aiohttp import web

from diloco.coordinator.buffers import BufferPool
from diloco.coordinator.certs import Certificate, Roster
from diloco.coordinator.fragments import Encoded, FragmentStore
from diloco.coordinator.membership import Membership
from diloco.coordinator.plan import FragmentPlan
from diloco.coordinator.runspec import RunSpec
from diloco.coordinator.shard import Shard
from diloco.coordinator.sync import FragmentSync
from diloco.coordinator.version import Version
from diloco.coordinator.wire import MemberRecord
from diloco.protocol.codecs import get_codec
from diloco.protocol.dht.node import BootstrapFailed, DHTNode
from diloco.protocol.envelope import EnvelopeVerifier
from diloco.protocol.errors import ProtocolError
from diloco.protocol.identity import Identity
from diloco.protocol.reads import READ, ReadSigner
from diloco.protocol.tls import server_context
from diloco.protocol.transport import PeerClient, PeerServer, RemoteError, TransportError

from . import observe, operator, reach
from .heap import return_large_buffers_to_os, trim_heap
from .journal import Journal
from .niceness import started_workers
from .preempt import DrainReport

log = logging.getLogger(__name__)
DHT_WATCH_EVERY = 6  # every how many watches read the DHT's frag records (the others ask the members)
KNOWN_URLS_KEPT = 32  # member URLs remembered (most recently seen first): saved with checkpoints, pinged to heal


TRIM_EVERY_S = 20.0
POOL_KEEP = 4  # idle fragment-sized work buffers kept for reuse (see coordinator.buffers)
WITHDRAW_S = 2.0  # a stopping peer marks its member record `left` within this long, or leaves it to expire
MERGE_WAIT_SHARE = 0.5  # of a drain's time, at most spent waiting for owners to merge this learner's deltas


class JoinError(Exception):
    """The swarm could not be joined; the message says why and what to try."""


class SwarmFailed(RuntimeError):
    """The learner's background loop stopped after the join (its cause is `__cause__`): no delta leaves and no
    version arrives any more, so the model would train alone. Raised by `Learner.step`; restart the learner
    (it resumes from its checkpoint)."""


@dataclass
class SwarmConfig:
    """Where this peer listens and whom it contacts. Timings suit WAN runs; tests shorten them."""

    host: str = "127.0.0.1"
    port: int = 0
    announce: str | None = None
    peers: list[str] = field(default_factory=list)
    client_mode: bool | None = None  # None: detect (a peer tries to reach us)
    region: str = ""
    member_ttl_s: float = 30.0
    member_refresh_s: float = 10.0
    member_poll_s: float = 2.0
    watch_s: float = 5.0  # how often to compare our versions with the DHT's
    join_timeout_s: float = 300.0
    bootstrap_wait_s: float = 0.0  # keep trying `peers` this long (a fleet whose peers start together)
    known_peers: list[str] = field(default_factory=list)  # URLs of members seen before a restart (checkpoint):
    # tried with `peers` at the join but not required to answer, and pinged while not seen (`_reconnect`)
    private: bool | None = None  # TLS on every connection and signed reads; None: iff the run is an allowlist
    certificate: Certificate | None = None  # this key's membership certificate (`diloco-node certify`): an
    # allowlist run whose spec does not list the key admits it with one (coordinator/certs.py)
    operator_listen: tuple[str, int] | None = None  # (host, port): the dashboard, /v1/status and /metrics
    # again over plain HTTP with no key needed, for a private run or a client-mode peer (node/operator.py)


def is_private(spec: RunSpec, config: SwarmConfig) -> bool:
    """Whether this peer's traffic is TLS and its reads signed: an `allowlist` run's, unless told otherwise."""
    return spec.membership == "allowlist" if config.private is None else config.private


@dataclass
class Progress:
    """What the training thread reports, read by the loop for member records and status."""

    step: int = 0
    tokens: int = 0
    loss: float | None = None
    step_time_s: float = 0.0
    tokens_per_s: float = 0.0
    synced: bool = False
    eval_loss: float | None = None  # the last held-out evaluation loss, set by whoever evaluates (node/train.py)


class Swarm:
    def __init__(self, identity: Identity, spec: RunSpec, plan: FragmentPlan, anchors: list[torch.Tensor],
                 config: SwarmConfig, labels: list[Version] | None = None, certs: list[bytes] | None = None,
                 *, adopt_anchors: bool = False, unset: list[int] | None = None,
                 journal: Journal | None = None, momenta: dict[int, tuple[Version, Encoded]] | None = None) -> None:
        """`adopt_anchors`: the anchors are fresh tensors the swarm may keep (no copy of the model is made).
        `unset`: anchors with no values yet (see `FragmentStore`); `after_sync` must fill those still unset.
        `journal`: where every version the store moves to is recorded (`node/journal.py`); closed at `stop`.
        `momenta`: p -> (version, momentum) a checkpoint saved (`held_momenta`), kept as a replica would."""
        self.identity, self.spec, self.plan, self.config = identity, spec, plan, config
        self.journal = journal
        self._restored_momenta = dict(momenta or {})
        self.store = FragmentStore(anchors, identity.peer_id, adopt=adopt_anchors, unset=unset or ())
        self.pool = BufferPool(max((f.numel for f in plan.fragments), default=0), keep=POOL_KEEP)
        for p, (label, cert) in enumerate(zip(labels or [], certs or [], strict=False)):
            self.store.held[p].label, self.store.held[p].cert = label, cert
        self.progress = Progress()
        self.observer = observe.Observer(len(plan.fragments), spec.inner_steps, spec.max_staleness,
                                         config.member_ttl_s)  # history and alerts (node/observe.py)
        self.after_sync: Callable[[], None] | None = None  # run once synced, before other peers count on us;
        # raising a JoinError there ends the join with that error
        self.genesis: Callable[[int, torch.Tensor], object] | None = None  # a joiner's Θ^(0) (`FragmentSync.genesis`)
        self.codec = get_codec(spec.codec)
        self.client_mode = bool(config.client_mode)
        self.url = ""
        self.extra_status: list[Callable[[], dict[str, Any]]] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self.error: SwarmFailed | None = None  # set once the loop has died after the join (`healthy`)
        self.task_failures = 0  # one-off background tasks (a delta's send, a push) that raised
        self._stopping: asyncio.Event | None = None
        self._tasks: set[asyncio.Task] = set()
        self.server: PeerServer | None = None
        self.operator: PeerServer | None = None  # `SwarmConfig.operator_listen`'s server (node/operator.py)
        self.client: PeerClient | None = None
        self.dht: DHTNode | None = None
        self.roster = Roster(spec)  # who is admitted now: every verifier of this peer asks it (certificates,
        # amendments: coordinator/certs.py); `members` keeps it current
        self.members: Membership | None = None
        self.sync: FragmentSync | None = None
        self.shard: Shard | None = None
        self._seen_urls: dict[str, float] = {}  # URL of a member that accepts connections -> when last seen
        self._sends: set[asyncio.Task] = set()  # delta sends in flight (a drain waits for them)
        self._draining = False  # ranked out of every fragment's roles: our record says not `synced` (`drain`)
        self._left = False  # our record says `left` from now on

    # -- training-thread API --------------------------------------------------------------------------------

    def start(self) -> None:
        """Join the run and sync every fragment; returns once training may begin. Raises `JoinError`."""
        return_large_buffers_to_os()
        self._thread = threading.Thread(target=self._thread_main, name="diloco-swarm", daemon=True)
        self._thread.start()
        if not self._ready.wait(self.config.join_timeout_s + 30):
            raise JoinError(f"joining took longer than {self.config.join_timeout_s:.0f}s")
        if self._error is not None:
            raise self._error

    def submit_delta(self, p: int, live_fragment: torch.Tensor, base: Version, steps: int, tokens: int) -> None:
        """Hand a snapshot of θ[p] to the loop, which computes, compresses, signs and sends Δ_p. Never blocks.
        The snapshot is the loop's from now on (one taken from `self.pool` goes back there)."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        loop.call_soon_threadsafe(self._spawn_send, self.sync.deltas.send(p, live_fragment, base, steps, tokens))

    def _spawn_send(self, coro) -> None:
        task = self._spawn(coro)
        self._sends.add(task)
        task.add_done_callback(self._sends.discard)

    def offer_ownership(self) -> None:
        """The training thread has copied the synced fragments into its model: from now on this peer may own
        fragments (its record says `synced`, and the owners hand theirs over). Not before: taking fragments
        over (momentum pulls, replication) would compete for the CPU with that copy, and delay the first step."""
        loop = self._loop
        if loop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(self._become_candidate)

    def _become_candidate(self) -> None:
        if self.progress.synced or self._draining or self._stopping is None or self._stopping.is_set():
            return
        self.progress.synced = True
        self._spawn(self.members.publish())  # say so at once, without waiting for the refresh
        self.members.changed()

    def stop(self, timeout: float = 10.0) -> None:
        if self._loop is not None and self._stopping is not None and not self._loop.is_closed():
            with contextlib.suppress(RuntimeError):
                self._loop.call_soon_threadsafe(self._stopping.set)
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():  # (a daemon thread still inside torch at interpreter exit can abort it)
                log.warning("the swarm thread did not stop within %.0f s; it is left running", timeout)

    def drain(self, deadline: float) -> DrainReport:
        """Leave the swarm on purpose by `deadline` (time.monotonic()), the training thread having stopped
        stepping and handed its last deltas over (`Learner.drain`); the loop runs on afterwards, serving,
        until `stop` (docs/preemption.md). Call from any thread but the loop's."""
        loop = self._loop
        if loop is None or loop.is_closed() or not self.healthy:
            return DrainReport(skipped=["everything: the swarm loop is not running"])
        future = asyncio.run_coroutine_threadsafe(self._drain(deadline), loop)
        try:
            return future.result(max(0.0, deadline - time.monotonic()) + 2.0)
        except (TimeoutError, concurrent.futures.CancelledError):
            future.cancel()
            return DrainReport(skipped=["the rest: the swarm loop did not finish the drain in time"])
        except Exception as e:  # (the learner still writes its checkpoint and exits)
            log.error("the drain failed: %s: %s", type(e).__name__, e, exc_info=e)
            return DrainReport(skipped=[f"the rest: the drain failed ({type(e).__name__}: {e})"])

    async def _drain(self, deadline: float) -> DrainReport:
        """(1) the delta sends in flight finished; (2) for a while, the owners' merges of this learner's
        deltas received; (3) the shard's rounds closed, this peer ranked out of `roles` and every fragment it
        owned handed over and acknowledged (`Shard.drain`); (4) our record marked `left`."""
        report, t0 = DrainReport(), time.monotonic()
        sends = [t for t in self._sends if not t.done()]
        report.sends_waited = len(sends)
        if sends:
            _, late = await asyncio.wait(sends, timeout=max(0.0, deadline - t0))
            if late:
                report.skipped.append(f"{len(late)} delta sends")
        merge_until = min(deadline, t0 + MERGE_WAIT_SHARE * (deadline - t0))
        while self._unmerged(elsewhere=True) and time.monotonic() < merge_until:
            await asyncio.sleep(0.05)
        if self._unmerged(elsewhere=True):
            log.info("drain: after %.1f s, %d deltas sent to other owners are not merged yet", time.monotonic() - t0,
                     self._unmerged(elsewhere=True))
        if self.shard is not None:
            owned = await self.shard.drain(deadline, self._rank_out)
            report.final_rounds, report.dropped_deltas = owned.final_rounds, owned.dropped_deltas
            report.passed_on = owned.passed_on
            report.handovers = [dataclasses.asdict(h) for h in owned.handovers]
            report.skipped += owned.skipped
        else:
            self._rank_out()
        report.deltas_unmerged = self._unmerged(elsewhere=False)
        report.merged_steps = self.store.merged_steps
        self._left = True
        try:
            await asyncio.wait_for(self.members.publish(), max(0.05, min(WITHDRAW_S, deadline - time.monotonic())))
            report.left = True
        except (TimeoutError, TransportError, ProtocolError) as e:
            report.skipped.append(f"the `left` record ({type(e).__name__}: it expires in "
                                  f"{self.config.member_ttl_s:g} s)")
        return report

    def _rank_out(self) -> None:
        """Out of every fragment's roles in our own view first (our record says not `synced`): `Shard.reassign`
        releases, and hands over, every fragment we own; the others rank us out once they read the record."""
        self._draining = True
        self.members.changed()

    def _unmerged(self, elsewhere: bool) -> int:
        """Our deltas that an owner took and no version we received merged yet (`elsewhere`: of fragments
        another peer owns)."""
        with self.store.lock:
            outstanding = set(self.store.rebase.outstanding)
        return len(outstanding - set(self.shard.owners if self.shard and elsewhere else ()))

    # -- the loop -------------------------------------------------------------------------------------------

    @property
    def healthy(self) -> bool:
        """True while the background loop runs (before `start` and after `stop`: False)."""
        return self.error is None and self._thread is not None and self._thread.is_alive() and self._ready.is_set()

    def _thread_main(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as e:  # surfaced to the training thread by start(), or by Learner.step
            if not self._ready.is_set():
                self._error = e if isinstance(e, JoinError) else JoinError(f"{type(e).__name__}: {e}")
                self._ready.set()
            else:
                self._failed(e, "the swarm loop")
        else:
            if self._stopping is not None and not self._stopping.is_set() and self.error is None:
                self._failed(RuntimeError("the event loop returned"), "the swarm loop")

    def _failed(self, e: BaseException, what: str) -> None:
        """The swarm can no longer train with the others: remember why, for `Learner.step` to raise."""
        if self.error is None:
            log.error("%s died: %s: %s; this learner no longer syncs with the swarm", what, type(e).__name__, e,
                      exc_info=e)
            self.error = SwarmFailed(f"{what} died ({type(e).__name__}: {e}); no delta leaves and no version "
                                     "arrives any more; restart this learner (it resumes from its checkpoint)")
            self.error.__cause__ = e

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        # (the workers at a lower priority, not the loop: a loop thread preempted while it holds the GIL would
        # make the training thread wait for it; node/niceness.py)
        self._loop.set_default_executor(started_workers("swarm-worker"))
        self._stopping = asyncio.Event()
        private = is_private(self.spec, self.config)
        self.client = PeerClient(tls=private, read_signer=ReadSigner(self.identity, self.spec.run_id) if private
                                 else None)
        try:
            await self._open_server()
            await self._join()
            if self.after_sync is not None:
                self.after_sync()
            if self.store.unset - self.store.downloading:
                raise JoinError(f"fragments {sorted(self.store.unset)} were neither downloaded nor filled in")
            self.observer.observe(observe.read(self))  # (before any step: goodput counts from here)
            self._ready.set()  # (`offer_ownership` follows once the model holds what was synced)
            self._spawn(self.observer.run(functools.partial(observe.read, self)))
            self._spawn(self.dht.find_node(self.identity.node_id))
            for coro in (self.members.run(), self._watch(), self._trim(),
                         *([self.shard.run()] if self.shard else [])):
                self._spawn(coro, essential=True)
            await self._stopping.wait()
        finally:
            for task in list(self._tasks):
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            for part in (self.shard, self.sync):
                if part is not None:
                    await part.close()
            if self.members is not None:  # (after the tasks: none may store a live record after this one)
                with contextlib.suppress(TransportError, ProtocolError, asyncio.TimeoutError):
                    await asyncio.wait_for(self.members.withdraw(), WITHDRAW_S)
            if self.dht is not None:
                await self.dht.stop()
            for server in (self.server, self.operator):
                if server is not None:
                    await server.stop()
            await self.client.close()
            if self.journal is not None:
                self.journal.close()

    async def _open_server(self) -> None:
        cfg = self.config
        if cfg.client_mode:
            self.client_mode = True
        else:
            private = is_private(self.spec, cfg)
            self.server = PeerServer(cfg.host, cfg.port, ssl_context=server_context(self.identity) if private else None)
            if private:  # (a non-member is refused on every route: reads here, envelopes by their verifiers)
                self.server.guard_reads(EnvelopeVerifier(self.spec.run_id, is_member=self.roster.admits,
                                                         kinds={READ}))
        members_only = self.roster.admits if self.spec.membership == "allowlist" else None
        self.dht = DHTNode(self.identity, self.client, server=self.server, region=cfg.region, is_member=members_only)
        self.members = Membership(self.dht, self.spec, self._member_record, ttl_s=cfg.member_ttl_s,
                                  refresh_s=cfg.member_refresh_s, poll_s=cfg.member_poll_s,
                                  certificate=cfg.certificate, roster=self.roster)
        self.members.on_change.append(self._remember_members)
        self.sync = FragmentSync(self.identity, self.spec, self.store, self.members, self.client, self.server,
                                 self.codec, self.pool)
        self.sync.journal = self.journal
        self.sync.genesis = self.genesis
        self.sync.verifier.is_member = self.roster.admits  # (certificates and amendments: the roster's view)
        if self.server is not None:
            self.shard = Shard(self.identity, self.spec, self.plan, self.store, self.members, self.client,
                               self.server, self.sync, self.codec, self.pool)
            for p, (label, momentum) in self._restored_momenta.items():
                self.shard.replication.restore(p, label, momentum)
            operator.register_views(self.server, self)  # GET /v1/status, /metrics, / (the dashboard)
            probe = reach.ReachProbe(self.spec, self.client, self.server)
            self.members.serve(self.server)
            self.shard.verifier.is_member = probe.verifier.is_member = self.roster.admits
            try:
                await self.server.start()
            except OSError as e:
                if e.errno == errno.EADDRINUSE:
                    raise JoinError(f"port {cfg.host}:{cfg.port} is in use (another peer? pick --listen "
                                    "HOST:OTHERPORT)") from None
                raise JoinError(f"cannot listen on {cfg.host}:{cfg.port}: {e.strerror or e}") from None
            self.url = cfg.announce or self.server.url
            self.dht.announce(self.url)
        if cfg.operator_listen is not None:  # the views again, plain HTTP, for a browser and Prometheus
            host, port = cfg.operator_listen
            try:
                self.operator = await operator.start_operator_port(self, host, port)
            except OSError as e:
                raise JoinError(f"cannot serve the operator's port on {host}:{port}: {e.strerror or e}") from None
            log.info("operator's port (dashboard, /v1/status, /metrics): %s", self.operator.url)

    async def _join(self) -> None:
        cfg = self.config
        t0 = time.perf_counter()
        urls = list(dict.fromkeys([*cfg.peers, *(u for u in cfg.known_peers if u != self.url)]))
        while urls:
            try:
                await self.members.introduce(self.client, cfg.peers)  # (a certified key: before the DHT)
                await self.dht.bootstrap(urls, lookup=False)
                break
            except BootstrapFailed as e:
                if time.perf_counter() - t0 > cfg.bootstrap_wait_s:
                    if cfg.peers:
                        waited = (f"tried for {cfg.bootstrap_wait_s:g} s" if cfg.bootstrap_wait_s else
                                  "or let them start: --wait-for-peers SECONDS")
                        raise JoinError(f"{e}; check --peers ({waited})") from None
                    log.info("join: none of the %d members seen before the restart answered", len(urls))
                    break
                await asyncio.sleep(0.25)
        log.info("join: DHT bootstrapped in %.3fs", time.perf_counter() - t0)
        reachable, _ = await asyncio.gather(self._reachable(), self.members.poll())
        if not reachable:
            raise JoinError(f"other peers cannot reach {self.url}; pass --announce with a reachable address, "
                            "or --client-mode to train without accepting connections")
        log.info("join: %d members seen at %.3fs", len(self.members.live()), time.perf_counter() - t0)
        if self.shard is not None:
            self.shard.enabled = True
            self.shard.reassign()
        # while the fragments download, our record goes out (owners push updates to us once they see us,
        # `synced` false); the DHT's self-lookup, which fills our routing table and which nothing in the join
        # needs, runs after it (`_main`), not beside the downloads that take the CPU
        background = [asyncio.ensure_future(self.members.publish())]
        try:
            await self._sync_fragments(t0)
        except BaseException:
            for task in background:
                task.cancel()
            await asyncio.gather(*background, return_exceptions=True)
            raise
        await asyncio.gather(*background)

    async def _sync_fragments(self, t0: float) -> None:
        deadline = time.monotonic() + self.config.join_timeout_s
        while True:
            behind = await self.sync.sync_all()
            log.info("join: fragments synced at %.3fs, still behind: %s", time.perf_counter() - t0, behind)
            if not behind:
                return
            if time.monotonic() > deadline:
                raise JoinError(f"could not download fragments {behind} within {self.config.join_timeout_s:.0f}s")
            await asyncio.sleep(1.0)
            await self.members.poll()

    async def _reachable(self) -> bool:
        """Ask a bootstrap peer to open a connection to our announced URL (node/reach.py); True without asking
        when there is nothing to check (no peers, no server, or client mode chosen by flag)."""
        if self.config.client_mode is not None or self.server is None:
            return True
        for peer in self.config.peers:
            try:
                return await reach.ask(self.client, self.identity, self.spec, peer, self.url)
            except RemoteError as e:
                if e.status == 409:  # a peer of another run (or a clock far off): its reason says which
                    raise JoinError(f"{peer} refused this run's messages ({e.reason}); --peers must be peers "
                                    "of the run --run names") from None
            except TransportError:
                pass
        return True  # no peer answered the question: assume the announced address works

    async def _watch(self) -> None:
        """Catch up on versions we missed. Every `watch_s`: GET /v1/versions of the live members (one small
        answer each); every `DHT_WATCH_EVERY`-th time, and always in client mode, the DHT's frag records
        instead, which also name versions of owners this peer does not see (8 lookups of 3 RPCs each: most of
        a learner's DHT traffic when they were read at every watch)."""
        watches = 0
        while True:
            await asyncio.sleep(1.0 if self.client_mode else self.config.watch_s)
            watches += 1
            if not self.client_mode and watches % DHT_WATCH_EVERY:
                for p, (_, holders) in (await self.sync.held_above(list(range(len(self.store))), suspect=False)).items():
                    self.sync.catch_up(p, [*holders, *self.members.roles(p)])
                continue
            self._spawn(self._reconnect())
            try:
                newest = await self.sync.newest_versions()
            except (TransportError, ProtocolError) as e:  # the DHT is unreachable for now: try again later
                log.info("watch: cannot read the fragments' versions: %s", e)
                continue
            for p, found in enumerate(newest):
                if found is not None and found[0] > self.store.label(p):
                    self.sync.catch_up(p, [found[1], *self.members.roles(p)])

    def _remember_members(self) -> None:
        now = time.time()
        for m in self.members.servers():
            self._seen_urls[m.url] = now
            self.client.expect(m.url, m.peer_id)  # (a private run's TLS: only that peer may answer there)
        if len(self._seen_urls) > KNOWN_URLS_KEPT:
            for url in sorted(self._seen_urls, key=self._seen_urls.get)[:-KNOWN_URLS_KEPT]:
                del self._seen_urls[url]

    def known_urls(self) -> list[str]:
        """URLs of the members this peer has seen (the most recent first; those seen now too), for a restart
        to bootstrap from (`SwarmConfig.known_peers`): a learner relaunched with only `--peers` that are down,
        or that restarted into a swarm of their own, still finds the others. Any thread may call this."""
        seen = dict(self._seen_urls)  # (a copy: the loop updates it)
        return sorted(seen, key=seen.get, reverse=True)

    def held_momenta(self, timeout_s: float = 5.0) -> dict[int, tuple[Version, Encoded]]:
        """p -> (version, momentum) of what this peer holds as owner or replica (`Shard.momenta`), read on the
        loop; {} when there is no shard, or the loop does not answer within `timeout_s` (it died, or is
        stopping). For checkpoints: call from any thread but the loop's."""
        loop, shard = self._loop, self.shard
        if loop is None or shard is None or loop.is_closed() or not self.healthy:
            return {}

        async def read() -> dict[int, tuple[Version, Encoded]]:
            return shard.momenta()

        try:
            return asyncio.run_coroutine_threadsafe(read(), loop).result(timeout_s)
        except (RuntimeError, TimeoutError, concurrent.futures.CancelledError) as e:
            log.info("checkpoint without momenta: the loop did not answer (%s)", type(e).__name__)
            return {}

    async def _reconnect(self) -> None:
        """Ping the URLs of members seen before (and of `peers` and `known_peers`) that are not in our view
        now. A swarm split in two (peers restarted at the same time, each bootstrapping from the other half's
        dead URLs) then becomes one DHT again: a ping that is answered puts each side in the other's routing
        table, and the next member poll sees every member."""
        self._remember_members()
        live = {m.url for m in self.members.servers()} | {self.url}
        urls = [u for u in dict.fromkeys([*self.known_urls(), *self.config.peers, *self.config.known_peers])
                if u not in live][:KNOWN_URLS_KEPT]
        results = await asyncio.gather(*(self.dht.ping(u) for u in urls), return_exceptions=True)
        answered = sum(not isinstance(r, BaseException) for r in results)
        if answered:
            log.info("reconnect: %d of %d members not in our view answered", answered, len(urls))
            await self.members.poll()

    async def _trim(self) -> None:
        """Return freed heap pages to the OS now and then (see `trim_heap`)."""
        while True:
            await asyncio.sleep(TRIM_EVERY_S)
            await asyncio.to_thread(trim_heap)

    def _spawn(self, coro, essential: bool = False) -> asyncio.Task:
        """Run `coro` on the loop. An `essential` one (the member view, the watch, the shard) runs for the whole
        life of the swarm: if it ends, the swarm has failed (`error`) and the loop stops. A one-off task that
        raises is logged and counted."""
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(functools.partial(self._task_done, essential=essential))
        return task

    def _task_done(self, task: asyncio.Task, essential: bool) -> None:
        self._tasks.discard(task)
        if task.cancelled():
            return
        e = task.exception()
        if essential and not self._stopping.is_set():
            self._failed(e or RuntimeError("it returned"), f"background task {task.get_coro().__qualname__}")
            self._stopping.set()
        elif e is not None:
            self.task_failures += 1
            log.error("background task %s failed: %s: %s", task.get_coro().__qualname__, type(e).__name__, e,
                      exc_info=e)

    # -- records and status ---------------------------------------------------------------------------------

    def _member_record(self) -> MemberRecord:
        pr = self.progress
        return MemberRecord(self.url, self.config.region, self.client_mode, pr.step, pr.step_time_s,
                            pr.tokens_per_s, pr.synced and not self._draining, left=self._left)

    def status(self, history_after: float | None = None) -> dict[str, Any]:
        """The documented `/v1/status` object (docs/status.md); `history_after`: only the history samples
        taken after that unix time (`GET /v1/status?history_after=T`, for a poller that has the older ones)."""
        pr = self.progress
        members = self.members.recorded() if self.members else []  # (suspects too: `state` says which)
        counters = {}
        if self.server:
            counters["served"] = {r: c.__dict__ for r, c in self.server.counters.served.items()}
        if self.client:
            counters["sent"] = {r: c.__dict__ for r, c in self.client.counters.sent.items()}
        out = {
            "peer_id": self.identity.peer_id,
            "run_id": self.spec.run_id.hex(),
            "run_name": self.spec.name,
            "url": self.url,
            "client_mode": self.client_mode,
            "step": pr.step,
            "tokens": pr.tokens,
            "loss": observe.finite(pr.loss),
            "step_time_s": pr.step_time_s,
            "tokens_per_s": pr.tokens_per_s,
            "synced": pr.synced,
            "healthy": self.error is None,
            "error": str(self.error) if self.error is not None else None,
            "task_failures": self.task_failures,
            "fragments": [
                {"p": p, "version": str(self.store.label(p)), "roles": self.members.roles(p) if self.members else [],
                 "outer_steps": self.shard.outer_steps[p] if self.shard else 0,
                 "momentum": self.shard.momentum_source.get(p) if self.shard and p in self.shard.owners else None}
                for p in range(len(self.store))
            ],
            "members": [{"peer_id": m.peer_id, "url": m.url, "step": m.record.step, "region": m.record.region,
                         "synced": m.record.synced, "expires_in_s": round(m.expiration - time.time(), 1),
                         "client_mode": m.client_mode} for m in members],
            "shard": dict(self.shard.stats) if self.shard else {},
            "sync": dict(self.sync.stats) if self.sync else {},
            "bytes": counters,
            "bytes_total": self.bytes_total(),
            "connections_opened": self.client.counters.connections_opened if self.client else 0,
        }
        observe.extend_status(out, self, self.observer, history_after)
        for fn in self.extra_status:
            out.update(fn())
        return out

    def bytes_by_route(self) -> dict[str, int]:
        """Bytes in + out per route, served and sent together (where a swarm's traffic goes)."""
        out: dict[str, int] = {}
        for counters in ([self.server.counters] if self.server else []) + ([self.client.counters] if self.client else []):
            for table in (counters.served, counters.sent):
                for route, c in table.items():
                    out[route] = out.get(route, 0) + c.bytes_in + c.bytes_out
        return dict(sorted(out.items(), key=lambda kv: -kv[1]))

    def bytes_total(self) -> dict[str, int]:
        total = {"bytes_in": 0, "bytes_out": 0}
        for counters in ([self.server.counters] if self.server else []) + ([self.client.counters] if self.client else []):
            t = counters.totals()
            total["bytes_in"] += t["bytes_in"]
            total["bytes_out"] += t["bytes_out"]
        return total

    async def serve_status(self, request: web.Request) -> web.Response:
        """GET /v1/status (node/operator.py registers it)."""
        return web.json_response(self.status(observe.history_after(request.query.get("history_after"))))

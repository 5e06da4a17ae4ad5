"""Keeping anchors current, the holder's side: receive updates, serve versions, fetch what is missing
(docs/architecture.md §5.2, §5.4, §5.5, §6.5). This learner's deltas go out through `send.DeltaSender`.

Every version that reaches the store is checked against the owner's certificate: an update must land on the
bytes the owner certified (`digest`), a downloaded fragment must hash to it. Updates and certificates are
relayed records (`fresh=False`): applying one twice is a no-op, so they may come from any holder at any age.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import random
from collections.abc import Callable
from typing import Protocol

import torch
from aiohttp import web

from diloco.protocol import canonical
from diloco.protocol.codecs import Codec, l2_norm
from diloco.protocol.envelope import Envelope, EnvelopeVerifier
from diloco.protocol.errors import Malformed, PeerUnreachable, ProtocolError, StaleVersion
from diloco.protocol.identity import Identity, peer_id_of
from diloco.protocol.transport import PeerClient, PeerServer, RemoteError, TransportError

from .audit import UpdateGuard
from .authority import Unauthorized, check_update
from .buffers import BufferPool
from .distrust import Distrust
from .fragments import KEEP_UPDATES, DigestMismatch, Encoded, FragmentStore
from .membership import Membership
from .runspec import RunSpec
from .send import DeltaSender
from .version import GENESIS, Version
from .wire import (
    ROUTE_FRAGMENT,
    ROUTE_UPDATE,
    ROUTE_UPDATES,
    ROUTE_VERSIONS,
    UPDATE,
    FragmentReader,
    FragRecord,
    UpdateFields,
    anchor_digest,
    frag_key,
    fragment_body_max,
    pack_fragment,
    pack_versions,
    parse_versions,
    path_fragment,
    tensor_payload_max,
    updates_body_max,
    versions_body_max,
)

log = logging.getLogger(__name__)
DIGEST_EVERY = 4


class VersionJournal(Protocol):
    """Where a peer records each version its store moves to, so that a restart can replay it on top of its
    checkpoint (the learner's `node/journal.py`; docs/architecture.md §5.6). Called on the loop right after the
    store changed, before anything else can write that anchor."""

    def update(self, frame: bytes) -> None: ...

    def fragment(self, cert: bytes, anchor: torch.Tensor) -> None: ...

    def momentum(self, p: int, label: Version, momentum: Encoded) -> None: ...  # (a replica's, as it arrives)


class FragmentSync:
    """Anchors in (and, through `deltas`, this learner's deltas out). One per peer; `server` is None for a
    client-mode learner."""

    def __init__(
        self,
        identity: Identity,
        spec: RunSpec,
        store: FragmentStore,
        membership: Membership,
        client: PeerClient,
        server: PeerServer | None,
        codec: Codec,
        pool: BufferPool | None = None,
    ) -> None:
        self.identity, self.spec, self.store, self.members, self.client = identity, spec, store, membership, client
        self.pool = pool or BufferPool(store.max_numel())
        self.codec = codec
        self.P = len(store)
        self.verifier = EnvelopeVerifier(spec.run_id, is_member=spec.is_member, kinds={UPDATE})
        self.stats: collections.Counter[str] = collections.Counter()
        self.versions_accepted = 0
        self.regressions = 0
        # what others said they hold (what an operator's staleness view shows, node/observe.py): a live
        # member's answer to GET /v1/versions, and the newest version the DHT's frag records named for each p
        self.reported: dict[str, list[Version]] = {}
        self.announced: list[tuple[Version, str] | None] = [None] * self.P
        self._catching_up: dict[int, asyncio.Task] = {}
        # Set by the shard: a peer fetching fragment p holds a version above ours (`_told_held`)
        self.on_held_above: Callable[[int, Version], None] | None = None
        self.journal: VersionJournal | None = None  # set by the learner when it keeps checkpoints
        # writes a joiner's Θ^(0) of fragment p, from its model, into a flat fp32 buffer (set by the learner
        # while it joins): `_from_genesis`
        self.genesis: Callable[[int, torch.Tensor], object] | None = None
        # the checks of an owner's work this learner can make (coordinator/audit.py)
        self.guard = UpdateGuard(membership.peer_id, lambda peer: self.distrust.distrusted(peer), self.stats)
        self.distrust = Distrust(self)
        self.deltas = DeltaSender(identity, spec, store, membership, client, codec, self.pool, self.guard,
                                  self.stats, self.catch_up)  # (this learner's, out: coordinator/send.py)
        if server is not None:
            server.add_envelope_route(ROUTE_UPDATE, self.verifier, self._on_update, kinds={UPDATE}, fresh=False,
                                      max_payload=tensor_payload_max(codec, store.max_numel()))
            server.add_route("GET", ROUTE_FRAGMENT, self._serve_fragment)
            server.add_route("GET", ROUTE_UPDATES, self._serve_updates)
            server.add_route("GET", ROUTE_VERSIONS, self._serve_versions)

    # -- receiving ------------------------------------------------------------------------------------------

    def authorize(self, f: UpdateFields, signer_key: bytes, pushed: bool) -> None:
        """May the peer that signed this update (or certificate) publish it? Raises `Unauthorized` (403), and
        counts it (coordinator/authority.py). A version fetched from a holder may start the term of a peer that
        owned p while this one was away (`Membership.may_have_owned`)."""
        may_own = self.members.may_own if pushed else self.members.may_have_owned
        try:
            check_update(f.p, f.base, f.new, peer_id_of(signer_key), may_own, self.members.is_live, pushed)
        except Unauthorized:
            self.stats["updates_unauthorized"] += 1
            raise

    async def apply_update(self, env: Envelope, verify: bool | None = None, pushed: bool = False) -> bool:
        """Apply a verified update envelope; True if it moved the anchor. Raises `Unauthorized` when its
        signer may not publish it (`pushed`: sent by its publisher, not fetched from a holder), `StaleVersion`
        when the update is for a base we do not hold (the caller fetches the gap) and `DigestMismatch` on
        divergence.

        A checked update (every DIGEST_EVERY-th version, or `verify`) is added to a copy of the anchor and
        hashed in a worker thread, outside the store's lock and off the event loop; the result is committed
        only if the anchor was not written meanwhile."""
        f = UpdateFields.parse(env.fields, self.P)
        self.authorize(f, env.sender, pushed)
        self.guard.check_signer(f.p, f.new, peer_id_of(env.sender))
        held = self.store.label(f.p)
        if not f.new > held:
            self.stats["updates_already_held"] += 1
            return False
        if f.base != held:
            raise StaleVersion(f"fragment {f.p} is at {held}; this update applies to {f.base}")
        numel = self.store.numel(f.p)
        frame = env.frame()
        move = Encoded(self.codec, f.codec, memoryview(frame)[env.frame_size() - len(env.payload):])
        check = verify if verify is not None else f.new.version % DIGEST_EVERY == 0
        with self.pool.borrow(numel) as update:  # (the codecs never decode to non-finite values)
            move.decode(numel, out=update)
            norm = l2_norm(update)
            self.guard.check(f, peer_id_of(env.sender), norm, l2_norm(self.store.read(f.p)[0]), numel)
            result = generation = None
            if check:
                anchor, label, generation = self.store.read(f.p)
                if label != f.base:
                    raise StaleVersion(f"fragment {f.p} is at {label}; this update applies to {f.base}")
                # into `update`'s own buffer, the learner gets `move` instead (a + b == b + a, bit for bit)
                result = update.add_(anchor)
                if await asyncio.to_thread(anchor_digest, result) != f.digest:
                    raise DigestMismatch(f"fragment {f.p} at {f.new} differs from the owner's; downloading it whole")
                if self.store.label(f.p) == f.new:
                    self.stats["updates_already_held"] += 1  # the same update came in meanwhile
                    return False
            self.store.advance(f.p, f.base, f.new, update, frame, env.prefix(), contributors=f.learners,
                               move=move, result=result, generation=generation)
        if self.journal is not None:
            self.journal.update(frame)
        self.guard.accepted(f.p, norm, numel)
        self.versions_accepted += 1
        return True

    async def _on_update(self, env: Envelope, request: web.Request) -> bytes:
        try:
            await self.apply_update(env, pushed=True)
        except (StaleVersion, DigestMismatch) as e:
            f = UpdateFields.parse(env.fields, self.P)
            self.stats["updates_out_of_order"] += 1
            self.catch_up(f.p, [peer_id_of(env.sender)])
            raise StaleVersion(f"{e}; fetching the missing versions") from None
        return b"ok"

    # -- serving --------------------------------------------------------------------------------------------

    def _fragment_index(self, request: web.Request) -> int:
        return path_fragment(request.match_info["p"], self.P)

    async def _serve_fragment(self, request: web.Request) -> web.StreamResponse:
        """GET /v1/fragment/{p}[?held=T.V]: the certified anchor. 404 while we hold only the genesis version.
        `held`: the version the asking joiner holds (restored from its journal), which its owner compares."""
        p = self._fragment_index(request)
        if "held" in request.query:
            self._told_held(p, Version.parse(request.query["held"]))
        with self.pool.borrow(self.store.numel(p)) as anchor:
            label, cert = self.store.snapshot_into(p, anchor)
            if not cert:
                return web.Response(status=404, text=f"fragment {p} is at genesis {label}; build it from the seed\n")
            head, data = pack_fragment(cert, anchor.numpy().data.cast("B"))
            resp = web.StreamResponse(headers={"Content-Type": "application/octet-stream"})
            resp.content_length = len(head) + len(data)
            await resp.prepare(request)
            await resp.write(head)
            for i in range(0, len(data), 1 << 20):
                await resp.write(data[i : i + (1 << 20)])
            await resp.write_eof()
        return resp

    async def _serve_updates(self, request: web.Request) -> web.Response:
        """GET /v1/updates/{p}?after=T.V: the kept update frames from that version on (404 if not all kept)."""
        p = self._fragment_index(request)
        after = Version.parse(request.query.get("after", ""))
        self._told_held(p, after)  # (the asker holds `after`)
        frames = self.store.updates_after(p, after)
        if frames is None:
            return web.Response(status=404, text=f"updates after {after} of fragment {p} are no longer kept\n")
        return web.Response(body=canonical.packb(frames), content_type="application/octet-stream")

    def _told_held(self, p: int, held: Version) -> None:
        if held > self.store.label(p) and self.on_held_above is not None:
            self.on_held_above(p, held)

    async def _serve_versions(self, request: web.Request) -> web.Response:
        """GET /v1/versions: this holder's version of every fragment."""
        return web.Response(body=pack_versions(self.store.labels()), content_type="application/octet-stream")

    # -- fetching -------------------------------------------------------------------------------------------

    async def close(self) -> None:
        """Cancel the catch-ups still running."""
        tasks = [t for t in self._catching_up.values() if not t.done()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.distrust.close()

    def catch_up(self, p: int, sources: list[str]) -> asyncio.Task:
        """Fetch the versions of fragment p we miss, in the background (one task per fragment at a time)."""
        task = self._catching_up.get(p)
        if task is None or task.done():
            task = asyncio.get_running_loop().create_task(self._catch_up(p, sources))
            self._catching_up[p] = task
        return task

    async def _catch_up(self, p: int, sources: list[str], target: Version | None = None) -> bool:
        """Fetch the versions of p we miss: first the kept updates, from every holder in turn while the gap is
        small (`target` within KEEP_UPDATES versions, or unknown), since only p's owner and replicas keep them
        and a source may be neither; then the whole fragment, from the holders that did not give them. With a
        `target`, a holder that is itself behind it is passed over for the next."""
        holders = [s for s in dict.fromkeys([*sources, *self.members.roles(p)]) if s != self.members.peer_id]

        def reached() -> bool:
            return target is None or not target > self.store.label(p)

        def small_gap() -> bool:  # (updates need values to apply to)
            return p not in self.store.unset and (
                target is None or target.version - self.store.label(p).version <= KEEP_UPDATES)

        whole: list[str] = []  # the holders to download p from, in order
        for i, peer in enumerate(holders):
            url = self.members.url(peer)
            if url is None:
                continue
            if not small_gap():
                whole += holders[i:]
                break
            try:
                before = self.store.label(p)
                if await self._fetch_updates(p, url):
                    # (unknown target: done once a holder moved us, or the first one answered that we hold its
                    # version; a holder before it that kept no updates may still be ahead)
                    if reached() and (target is not None or self.store.label(p) > before or not whole):
                        return True
                else:
                    whole.append(peer)  # (it keeps no chain from our version: not an owner or replica of p)
            except (DigestMismatch, Unauthorized) as e:
                if isinstance(e, DigestMismatch):
                    self.stats["diverged_repairs"] += 1  # our copy is not the owner's: take it whole
                # (Unauthorized: a takeover in the gap by a member that may not own p now: the newest whole)
                whole = [peer, *whole, *holders[i + 1:]]
                break
            except (TransportError, ProtocolError) as e:
                self._holder_failed(peer, f"catching up fragment {p}", e)
        for peer in whole:
            url = self.members.url(peer)
            if url is None:
                continue
            try:
                if await self.fetch_fragment(p, url, repair=True) and reached():
                    return True
            except (TransportError, ProtocolError) as e:
                self._holder_failed(peer, f"catching up fragment {p}", e)
        return False

    def _holder_failed(self, peer: str, doing: str, e: TransportError | ProtocolError) -> None:
        """Log a holder's failure; one that gave no HTTP answer becomes a suspect (`Membership.failed`)."""
        log.info("%s from %s failed: %s", doing, peer[:8], e)
        if isinstance(e, TransportError):
            self.members.failed(peer, e)

    async def _fetch_updates(self, p: int, url: str) -> bool:
        frames = await self._kept_updates(p, url, self.store.label(p))
        if frames is None:
            return False
        await self._apply_frames(frames)
        self.stats["caught_up_by_updates"] += 1
        return True

    async def _kept_updates(self, p: int, url: str, after: Version) -> list[bytes] | None:
        """GET /v1/updates/{p}?after=...: the holder's kept update frames from `after` on; None on 404."""
        try:
            numel = self.store.numel(p)
            cap = updates_body_max(self.codec.encoded_size(numel), KEEP_UPDATES, budget=numel)
            body = await self.client.request("GET", url, f"/v1/updates/{p}?after={after}", idempotent=True,
                                             retries=0, max_response=cap)  # (the next holder is the retry)
        except RemoteError as e:
            if e.status == 404:
                return None
            raise
        frames = canonical.unpackb(body, max_len=1 << 31, strict=False)
        if not isinstance(frames, list) or not all(isinstance(f, bytes) for f in frames):
            raise Malformed("updates answer must be a list of frames")
        if len(frames) > KEEP_UPDATES:
            raise Malformed(f"updates answer of {len(frames)} frames (a holder keeps at most {KEEP_UPDATES})")
        return frames

    async def _apply_frames(self, frames: list[bytes]) -> None:
        """Apply a chain of update frames in order; the last one's digest is checked, vouching for the chain."""
        for i, frame in enumerate(frames):
            await self.apply_update(self.verifier.open(frame, fresh=False), verify=True if i == len(frames) - 1 else None)

    async def _from_genesis(self, p: int, url: str) -> bool:
        """A joiner's fragment p as its own Θ^(0) (`genesis`: its model, built from the run's seed) plus the
        owner's kept updates since 0.0, when the owner keeps them all: a few compressed updates instead of the
        fp32 fragment (a sparse run keeps ~5 updates of 4 merged deltas). True when done, or when the owner is
        still at 0.0 (p stays unset, as after a 404 for the fragment); False, for a download, when the owner does not keep them or the
        result does not land on the last update's digest (a model not built from the seed)."""
        frames = await self._kept_updates(p, url, GENESIS)
        if frames is None:
            return False
        if not frames:
            return True
        into = self.store.begin_download(p)  # (p's own anchor, which nothing reads while p is unset)
        if into is None:
            return False
        try:  # (in a worker thread: the fragments of a join are built on every core, the loop keeps receiving)
            await asyncio.to_thread(self.genesis, p, into)
        finally:
            self.store.end_download(p)
        if not self.store.fill(p, into):
            return False
        try:
            await self._apply_frames(frames)
        except DigestMismatch:
            self.stats["join_genesis_mismatch"] += 1
            return False
        self.stats["join_from_genesis_by_updates"] += 1
        return True

    async def fetch_fragment(self, p: int, url: str, repair: bool = False, replacing: Version | None = None,
                             held: Version | None = None) -> bool:
        """Download Θ_p whole from `url`, check it against its certificate, install it if newer (or, with
        `repair`, if it is the same version with other bytes than ours; with `replacing`, if we still hold that
        version of a distrusted publisher: coordinator/distrust.py). `held`: tell `url` the version we hold."""
        # the download lands in the fragment's own anchor while that holds no values yet, else in a new tensor
        reader = FragmentReader(self.store.numel(p), into=self.store.begin_download(p), hash_while_reading=True)
        try:
            path = f"/v1/fragment/{p}" if held is None else f"/v1/fragment/{p}?held={held}"
            await self.client.request("GET", url, path, idempotent=True, retries=0,
                                      max_response=fragment_body_max(self.store.numel(p)), sink=reader)
            return await self._check_and_install(p, reader, repair, replacing)
        except RemoteError as e:
            if e.status == 404:
                return False
            raise
        finally:
            if reader.into is not None:
                self.store.end_download(p)

    async def _check_and_install(self, p: int, reader: FragmentReader, repair: bool,
                                 replacing: Version | None = None) -> bool:
        cert = self.verifier.certificate(reader.cert)
        f = UpdateFields.parse(cert.fields, self.P)
        if f.p != p:
            raise Malformed(f"fragment download does not match fragment {p}")
        self.authorize(f, cert.sender, pushed=False)
        leaving = replacing is not None and self.store.label(p) == replacing and f.new != replacing
        self.guard.check_signer(p, f.new, None if leaving else peer_id_of(cert.sender))
        if await reader.digest() != f.digest:  # (hashed on worker threads while it arrived)
            raise DigestMismatch(f"downloaded fragment {p} does not match its certificate")
        if p not in self.store.unset and f.new != self.store.label(p):  # the jump: bounded like an update's
            held, label, _ = self.store.read(p)
            jump, held_norm = await asyncio.to_thread(lambda: (l2_norm(reader.anchor - held), l2_norm(held)))
            self.guard.check_install(p, f.new, peer_id_of(cert.sender), jump, held_norm,
                                     abs(f.new.version - label.version), self.store.numel(p), leaving=leaving)
        repair_of = None
        if repair and f.new == self.store.label(p) and p not in self.store.unset:
            anchor, label, generation = self.store.read(p)  # ours, hashed outside the lock too
            if label != f.new or await asyncio.to_thread(anchor_digest, anchor) == f.digest:
                return True  # same version, same bytes (or moved on meanwhile): nothing to repair
            repair_of = generation
        if f.new > self.store.label(p) or repair_of is not None or leaving:
            with contextlib.suppress(StaleVersion):  # (another version or write landed meanwhile)
                self.store.install(p, reader.anchor, f.new, reader.cert, repair_of=repair_of, adopt=True,
                                   replacing=replacing if leaving else None)
                self.stats["full_downloads"] += 1
                if self.journal is not None:
                    self.journal.fragment(reader.cert, reader.anchor)
        return True

    async def held_above(self, ps: list[int], *, suspect: bool = True, unanswered: set[str] | None = None,
                         only: set[str] | None = None) -> dict[int, tuple[Version, list[str]]]:
        """For each fragment of `ps` that a live member holds at a version above ours: the highest such version
        and the members that hold it (GET /v1/versions of every live member, or of those in `only`, at once,
        2 s each; a member that does not answer is passed over, and suspected unless `suspect` is False: the
        periodic watch, which must not make a busy member look dead)."""
        live = self.members.servers()
        members = [m for m in live if only is None or m.peer_id in only]

        async def ask(m) -> tuple[str, list[Version] | None]:
            try:
                body = await self.client.request("GET", m.url, ROUTE_VERSIONS, deadline_s=2.0,
                                                 max_response=versions_body_max(self.P))
                return m.peer_id, parse_versions(body, self.P)
            except (TransportError, ProtocolError) as e:
                if suspect or (unanswered is not None and isinstance(e, PeerUnreachable)):  # (dead: suspect now)
                    self._holder_failed(m.peer_id, "asking for versions", e)
                elif unanswered is not None:  # (a slow or busy one: the caller may ask again)
                    unanswered.add(m.peer_id)
                return m.peer_id, None

        best: dict[int, tuple[Version, list[str]]] = {}
        answers = await asyncio.gather(*(ask(m) for m in members))
        self.reported = {**{m.peer_id: self.reported[m.peer_id] for m in live if m.peer_id in self.reported},
                         **{peer: versions for peer, versions in answers if versions is not None}}
        for peer, versions in answers:
            for p in ps if versions is not None else ():
                v = versions[p]
                if not v > self.store.label(p):
                    continue
                if p not in best or v > best[p][0]:
                    best[p] = (v, [peer])
                elif v == best[p][0]:
                    best[p][1].append(peer)
        return best

    async def reach(self, p: int, sources: list[str], target: Version) -> bool:
        """Fetch fragment p up to at least `target` from `sources` first (then the other holders)."""
        return await self._catch_up(p, sources, target)

    async def newest_version(self, p: int) -> tuple[Version, str] | None:
        """The newest version of fragment p announced in the DHT and the peer that announced it (its owner
        then), or None. That peer holds the version."""
        raw = await self.members.dht.get(frag_key(self.spec.run_id, p), latest=True)
        found = []
        for peer, (value, _) in (raw.items() if isinstance(raw, dict) else []):
            try:
                found.append((FragRecord.decode(value).version, peer))
            except ProtocolError:
                continue
        self.announced[p] = max(found, default=None)
        return self.announced[p]

    async def newest_versions(self) -> list[tuple[Version, str] | None]:
        """`newest_version` of every fragment."""
        return list(await asyncio.gather(*(self.newest_version(p) for p in range(self.P))))

    async def sync_all(self) -> list[int]:
        """Bring every fragment to its newest version; returns the fragments still behind (empty when synced).

        All fragments are fetched at once, each from its owner in our view of the swarm: the owner holds the
        newest version by definition (a 404 from it: the fragment is still at genesis), so nothing needs to
        be checked. A fragment whose owner is unknown or fails comes from another holder (the load spread
        evenly); only those are then compared with the versions announced in the DHT, and caught up from the
        announcing owner first. (Reading the DHT for every fragment cost a joiner about a fifth of its join
        in lookups: 8 keys, 3 nodes each.)"""
        live = [m.peer_id for m in self.members.live() if m.peer_id != self.members.peer_id and not m.client_mode]
        random.shuffle(live)
        unchecked: list[int] = []

        async def fetch(p: int) -> None:
            if not await self._from_owner(p):
                k = p % max(len(live), 1)
                await self._catch_up(p, [*live[k:], *live[:k]])
                unchecked.append(p)

        await asyncio.gather(*(fetch(p) for p in range(self.P)))
        self.stats["join_synced_from_owner"] += self.P - len(unchecked)
        self.stats["join_checked_in_dht"] += len(unchecked)
        newest = dict(zip(unchecked, await asyncio.gather(*(self.newest_version(p) for p in unchecked)), strict=True))

        def behind() -> list[int]:
            return sorted(p for p, v in newest.items() if v is not None and v[0] > self.store.label(p))

        await asyncio.gather(*(self._catch_up(p, [newest[p][1], *live], newest[p][0]) for p in behind()))
        return behind()

    async def _from_owner(self, p: int) -> bool:
        """Download fragment p from its owner in our view; True when the owner answered (with the fragment, or
        with 404 while the fragment is at genesis)."""
        roles = self.members.roles(p)
        owner = roles[0] if roles and roles[0] != self.members.peer_id else None
        url = self.members.url(owner) if owner is not None else None
        if url is None:
            return False
        try:
            if p in self.store.unset and self.genesis is not None and await self._from_genesis(p, url):
                return True
            # (a version restored from our journal may be one the owner never saw: it compares when told so)
            held = None if p in self.store.unset else self.store.label(p)
            await self.fetch_fragment(p, url, repair=True, held=held)
            return True
        except (TransportError, ProtocolError) as e:
            self._holder_failed(owner, f"downloading fragment {p} from its owner", e)
            return False

"""A scripted hostile member, for tests/test_byzantine.py and benchmarks/byzantine.py.

It is a real learner of the run (it joins, trains on its own data, owns what the rendezvous gives it), with
one attack switched on. Its forged messages are built only from the protocol's public pieces, as
docs/protocol.md §3, §6 and §7 specify them: `seal` (protocol/envelope.py), the fields of coordinator/wire.py
and the codecs of protocol/codecs.py. Every answer a forged message gets is counted in `answers`
("<what>:<HTTP status>"), so a test can say the swarm refused it. The attacks of docs/security.md:

- on its deltas: `nan`, `inf` (a non-finite int8 scale), `scale1000`, `sign_flip`, `noise` (a random direction
  at 10× the norm), `inflated_tokens` (the largest claim allowed, and claims above it), `no_such_fragment`
  (deltas for a fragment and a version that do not exist), `duplicate` (the same frame again, and a second
  copy of the same delta);
- forged updates of fragments it may not own: `forged_update` (a takeover of its own, ×1000, and one in the
  owner's term), `top_of_range` (versions and a replication at the top of the (term, version) range);
- as an owner (it grinds a key that the rendezvous ranks first for a fragment, and publishes its own member
  record like any member): `owner_scaled` (updates ×1000), `owner_noise` (noise at 1000× the update's norm),
  both pushed without replicating, and `owner_flip` (the update sign-flipped, at its own norm, replicated too).
"""

from __future__ import annotations

import asyncio
import collections
import struct
import threading
import urllib.error
import urllib.request
from collections.abc import Callable
from types import SimpleNamespace

import torch

from diloco.coordinator.authority import TERM_MAX, TERM_SLOTS, next_term, term_slot
from diloco.coordinator.ownership import owners
from diloco.coordinator.runspec import Genesis
from diloco.coordinator.version import Version
from diloco.coordinator.wire import (
    DELTA,
    REPLICATE,
    ROUTE_DELTA,
    ROUTE_REPLICATE,
    ROUTE_UPDATE,
    UPDATE,
    DeltaFields,
    ReplicateFields,
    UpdateFields,
    anchor_digest,
)
from diloco.protocol.codecs import get_codec
from diloco.protocol.envelope import join_bytes, seal
from diloco.protocol.identity import Identity
from diloco.protocol.transport import RemoteError, TransportError

from .swarm_utils import LocalLearner, urlopen_within_conn_rate

DELTA_ATTACKS = ("nan", "inf", "scale1000", "sign_flip", "noise", "inflated_tokens", "no_such_fragment", "duplicate")
FORGERIES = ("forged_update", "top_of_range")
OWNER_ATTACKS = ("owner_scaled", "owner_noise", "owner_flip")
ATTACKS = DELTA_ATTACKS + FORGERIES + OWNER_ATTACKS


def _key_placed(run_id: bytes, P: int, others: list[str], placed: Callable[[int], bool], tries: int,
                every: bool = False) -> Identity | None:
    """A fresh key whose place among `others` in the rendezvous ranking (docs/protocol.md §7.5; 0: the owner) of
    at least one fragment (`every`: of every fragment) satisfies `placed`; None after `tries` keys."""
    for _ in range(tries):
        key = Identity.generate()
        members = [SimpleNamespace(peer_id=peer, client_mode=False) for peer in [*others, key.peer_id]]
        places = (placed(owners(run_id, p, members, replicas=len(others)).index(key.peer_id)) for p in range(P))
        if (all if every else any)(places):
            return key
    return None


def owner_key(run_id: bytes, P: int, others: list[str], tries: int = 2000) -> Identity:
    """A fresh key that the rendezvous ranks above every one of `others` for at least one fragment: what any
    member can do by generating keys, since it publishes its own member record (a random key if none does)."""
    return _key_placed(run_id, P, others, lambda place: place == 0, tries) or Identity.generate()


def outsider_key(run_id: bytes, P: int, others: list[str], roles: int, tries: int = 2000) -> Identity:
    """A fresh key that `roles` of `others` outrank in every fragment: while they are live it may neither own nor
    replicate any, so its forgeries are forgeries and its hostile deltas reach honest owners only (a random
    member's key owns or replicates some fragment of a small swarm most of the time, and every one in 1 run of
    16: then it had nothing to forge in, and as an owner it would merge its own hostile deltas)."""
    key = _key_placed(run_id, P, others, lambda place: place >= roles, tries, every=True)
    if key is None:
        raise RuntimeError(f"no key outranked by {roles} of {len(others)} members in every fragment in {tries} tries")
    return key


def post(url: str, route: str, frame: bytes) -> int:
    req = urllib.request.Request(url + route, data=frame, method="POST")
    try:
        with urlopen_within_conn_rate(req, timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return 0


class Hostile:
    """One hostile member in this process. `attack` may be changed while it trains (`attack = name`)."""

    def __init__(self, genesis: Genesis, peers: list[str], attack: str, *, index: int = 3,
                 identity: Identity | None = None, **cfg) -> None:
        if attack not in ATTACKS and attack != "none":
            raise ValueError(f"unknown attack {attack!r}")
        self.genesis, self.spec, self.attack = genesis, genesis.spec, attack
        self.node = LocalLearner(genesis, index, peers, learner_kw={"identity": identity} if identity else None,
                                 **cfg)
        self.answers: collections.Counter[str] = collections.Counter()
        self.corrupted = 0  # updates this peer published wrong, as an owner
        self.forged: set[int] = set()  # the fragments it forged updates of
        self.codec = get_codec(self.spec.codec)
        self._lock = threading.Lock()

    # -- running --------------------------------------------------------------------------------------------

    def start(self) -> Hostile:
        self.node.start()
        swarm = self.node.learner.swarm
        self.swarm, self.key, self.members, self.sync = swarm, swarm.identity, swarm.members, swarm.sync
        self._wrap_deltas()
        if swarm.shard is not None:
            self._wrap_owner(swarm.shard)
        return self

    def train(self, steps: int) -> float:
        """Train honestly for `steps` inner steps (its deltas go out through the attack), then forge."""
        loss = self.node.train(steps)
        if self.attack in FORGERIES:
            self.forge()
        return loss

    def close(self) -> None:
        self.node.learner.close()

    def count(self, what: str, status: int) -> None:
        with self._lock:
            self.answers[f"{what}:{status}"] += 1

    # -- deltas ---------------------------------------------------------------------------------------------

    def _wrap_deltas(self) -> None:
        sender, honest = self.sync.deltas, self.sync.deltas._deliver

        async def deliver(p: int, base: Version, steps: int, tokens: int, meta: dict, payload: bytes) -> bool:
            attack = self.attack
            if attack in ("nan", "inf", "scale1000", "sign_flip", "noise"):
                meta, payload = self._mutate(attack, meta, payload, self.spec)
            elif attack == "inflated_tokens":
                most = steps * self.spec.max_tokens_per_step
                for claim in (most + 1, 2**62):
                    await self._send_delta(p, DeltaFields(p, base, steps, claim, meta), payload, "claim")
                tokens = most  # the largest claim allowed: its share is capped
            elif attack == "no_such_fragment":
                await self._send_delta(p, DeltaFields(p, base, steps, tokens, meta), payload, "fragment",
                                       raw_p=len(self.swarm.store))
                ahead = Version(base.term, base.version + 100)
                await self._send_delta(p, DeltaFields(p, ahead, steps, tokens, meta), payload, "version")
            accepted = await honest(p, base, steps, tokens, meta, payload)
            if attack == "duplicate":
                env = await self._send_delta(p, DeltaFields(p, base, steps, tokens, meta), payload, "copy")
                if env is not None:
                    await self._post_frame(p, env.to_bytes(), "replay")
            return accepted

        sender._deliver = deliver

    def _mutate(self, attack: str, meta: dict, payload: bytes, spec) -> tuple[dict, bytes]:
        if attack in ("nan", "inf"):  # an int8 payload starts with its float32 block scales
            raw = bytearray(payload)
            raw[:4] = struct.pack("<f", float("nan") if attack == "nan" else float("inf"))
            return meta, bytes(raw)
        x = self.codec.decode(meta, payload, max_elements=1 << 30).clone()
        if attack == "scale1000":
            x *= 1000
        elif attack == "sign_flip":
            x = -x
        else:
            noise = torch.randn_like(x)
            x = noise * (10 * float(x.norm()) / max(float(noise.norm()), 1e-30))
        return self.codec.encode(x)

    async def _send_delta(self, p: int, fields: DeltaFields, payload: bytes, what: str, raw_p: int | None = None):
        wire = fields.to_fields()
        if raw_p is not None:
            wire["p"] = raw_p
        env = seal(self.key, DELTA, self.spec.run_id, wire, payload)
        await self._post_frame(p, env.to_bytes(), what)
        return env

    async def _post_frame(self, p: int, frame: bytes, what: str) -> None:
        roles = self.members.roles(p)
        url = self.members.url(roles[0]) if roles and roles[0] != self.members.peer_id else None
        if url is None:
            return
        status = await asyncio.to_thread(post, url, ROUTE_DELTA, frame)
        self.count(f"delta_{what}", status)

    # -- forged updates -------------------------------------------------------------------------------------

    def forge(self) -> None:
        """Forge updates (and a replication) of every fragment this member may not own, to every member."""
        me = self.key.peer_id
        urls = [m.url for m in self.members.servers()]
        for p in range(len(self.swarm.store)):
            if self.members.may_own(p, me):
                continue
            self.forged.add(p)
            anchor, base, _ = self.swarm.store.read(p)
            anchor = anchor.clone()
            meta, payload = self.codec.encode(torch.full_like(anchor, 1000.0))
            digest = anchor_digest(anchor + self.codec.decode(meta, payload, max_elements=anchor.numel()))
            if self.attack == "forged_update":
                news = [Version(next_term(base.term, me), base.version + 1), base.next()]
            else:
                top = TERM_MAX - TERM_SLOTS + term_slot(me)
                news = [Version(2**63 - 1, 2**63 - 1), Version(top, base.version + 1), Version(top, 2**63 - 1)]
            for new in news:
                if not new > base:
                    continue
                fields = UpdateFields(p, base, new, digest, meta, (me,)).to_fields()
                frame = seal(self.key, UPDATE, self.spec.run_id, fields, payload).to_bytes()
                for url in urls:
                    self.count("update", post(url, ROUTE_UPDATE, frame))
            if self.attack == "top_of_range":
                fields = ReplicateFields(p, 2**63 - 1, Version(2**63 - 1, base.version + 1), False, 0, None).to_fields()
                frame = seal(self.key, REPLICATE, self.spec.run_id, fields, join_bytes()).to_bytes()
                for url in urls:
                    self.count("replicate", post(url, ROUTE_REPLICATE, frame))

    # -- a dishonest owner ----------------------------------------------------------------------------------

    def _wrap_owner(self, shard) -> None:
        acquire, replicate = shard._acquire, shard.replication.replicate

        def dishonest(owner) -> None:
            step = owner.step

            def dishonest_step(batch, current):
                pub = step(batch, current)
                if self.attack in OWNER_ATTACKS:
                    self._corrupt(pub)
                return pub

            owner.step = dishonest_step

        def acquire_and_corrupt(p: int, live: set[str]) -> None:
            acquire(p, live)
            dishonest(shard.owners[p])

        async def replicate_or_not(p, term, label, update, anchor, momentum, deltas=()):
            if self.attack not in OWNER_ATTACKS:
                return await replicate(p, term, label, update, anchor, momentum, deltas)
            if self.attack == "owner_flip":  # replicas get it, and whatever they answer it is published
                try:
                    await replicate(p, term, label, update, anchor, momentum, deltas)
                except (TransportError, RemoteError):
                    pass
            return set()  # published as if no replica were alive

        for owner in list(shard.owners.values()):  # (taken while joining)
            dishonest(owner)
        shard._acquire = acquire_and_corrupt
        shard.replication.replicate = replicate_or_not

    def _corrupt(self, pub) -> None:
        u = pub.update
        if self.attack == "owner_scaled":
            u.mul_(1000.0)
        elif self.attack == "owner_noise":  # (1000×, as owner_scaled: the first update of a term, on fresh
            # momentum, can be ~5× smaller than the fragment's steady ones, and 100× of it then sits inside the
            # learners' 20 × median bound, which lets an update of that norm through by design)
            noise = torch.randn_like(u)
            u.copy_(noise * (1000 * float(u.norm()) / max(float(noise.norm()), 1e-30)))
        else:
            u.neg_()
        pub.meta, pub.payload = self.codec.encode(u)
        self.codec.decode(pub.meta, pub.payload, max_elements=u.numel(), out=u)
        self.corrupted += 1

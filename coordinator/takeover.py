"""How a peer starts owning a fragment: its term, its momentum, and the version it builds on
(docs/architecture.md §6.6).

A new owner publishes under a term above every term it has seen (`next_term`). Its momentum comes, in this
order of preference, from what the replica kept of the current version ("replica", or "checkpoint" when that
copy is the one this peer's checkpoint saved before a restart), from the one kept of an
older version and the kept updates since ("rebuilt"), from a late hand-over of the old owner ("handed
over"), or from another member that holds it ("pulled"); "fresh" only when none of them exists. Before its
first step it compares its version with every live member's and reaches the highest one: a killed owner may
have pushed its last version to some learners and to no replica, and stepping from an older version would
fork the fragment and lose the deltas merged into that one. This module owns `momentum_source`; the owners
themselves belong to the shard, and are changed here only through `FragmentOwner.adopt_momentum`.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Callable, Mapping

import torch

from diloco.protocol.codecs import Codec, get_codec
from diloco.protocol.errors import Malformed, ProtocolError
from diloco.protocol.transport import PeerClient, RemoteError, TransportError

from .authority import TERM_BLOCKS_AHEAD, TERM_SLOTS, next_term
from .fragments import Encoded, FragmentStore
from .membership import Membership
from .outer import OuterOptimizer
from .owner import FragmentOwner
from .replication import Replication, fp32_copy
from .sync import FragmentSync
from .version import Version
from .wire import UpdateFields, momentum_body_max, parse_momentum

log = logging.getLogger(__name__)
PULL_HOLD_S = 10.0  # how long a new owner without its momentum holds its first step back to pull it
PULL_RETRY_S = 1.0  # between two rounds of asking every live member
# how long a new owner asks again a live member that did not say which versions it holds (a busy or restarting
# peer that may hold a newer version: stepping without it would fork the fragment), before suspecting it
NEWEST_HOLD_S = 10.0


class Takeover:
    """The start of each ownership of this peer. `owners` is the shard's map of the fragments it owns."""

    def __init__(
        self,
        store: FragmentStore,
        membership: Membership,
        client: PeerClient,
        sync: FragmentSync,
        replication: Replication,
        codec: Codec,
        outer: OuterOptimizer,
        owners: Mapping[int, FragmentOwner],
        stats: collections.Counter[str],
        spawn: Callable,
    ) -> None:
        self.store, self.members, self.client, self.sync = store, membership, client, sync
        self.replication, self.codec, self.outer, self.owners, self.stats = replication, codec, outer, owners, stats
        self.spawn = spawn
        self.momentum_source: dict[int, str] = {}  # p -> where the momentum of an owned fragment came from
        self.stepping: Callable[[int], bool] = lambda p: False  # an outer step of p is running (the shard's)
        replication.on_handover = self._handed_over
        replication.served_by_owner = self.served

    def term(self, p: int) -> int:
        """The term a new owner of p publishes under: above its label's and every term replicated to it."""
        label = self.store.label(p).term  # (a term seen in replication was checked against the label's: §6.7)
        seen = min(self.replication.terms_seen[p], (label // TERM_SLOTS + TERM_BLOCKS_AHEAD - 1) * TERM_SLOTS)
        return next_term(max(label, seen), self.members.peer_id)

    def momentum(self, p: int) -> torch.Tensor | None:
        """The momentum of p's current version for a new owner, from what replication kept (None: fresh)."""
        label, numel = self.store.label(p), self.store.numel(p)
        kept = self.replication.take(p)
        momentum, source = None, "fresh"
        restored = self.replication.restored.pop(p, None)
        handed = self.replication.handed.pop(p, None)
        if kept is not None and kept[0] == label:
            source = "checkpoint" if restored == label else "handed over" if handed == label else "replica"
            momentum, source = (kept[1].decode(numel), source) if kept[1] else (None, "fresh")
        elif kept is not None and self.outer.momentum != 0:  # the replication of the newest version failed
            momentum = self.rebuild(p, kept[0], kept[1].decode(numel) if kept[1] else None)
            source = "rebuilt" if momentum is not None else "fresh"
            self.stats["momentum_rebuilt_at_takeover" if momentum is not None else "momentum_not_rebuilt"] += 1
        self.momentum_source[p] = source
        return momentum

    def rebuild(self, p: int, since: Version, momentum: torch.Tensor | None) -> torch.Tensor | None:
        """The momentum of fragment p's current version, from the one of version `since` and the kept
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

    async def reach_newest(self, taken: list[int], ask: str | None = None, *, once: bool = False) -> None:
        """Bring the fragments just `taken` over to the highest version any live member holds (with `ask`:
        that member, asked once; with `once`: each, asked once), then let their owners step (they are held
        back until then)."""
        try:
            if ask is None and not once:
                above = await self._held_above(taken)
            else:  # (one request each: a claim that nobody answers for holds no step back long)
                above = await self.sync.held_above(taken, suspect=False, only=None if ask is None else {ask})
            for p, (target, holders) in sorted(above.items()):
                owner = self.owners.get(p)
                if owner is None:
                    continue
                since = self.store.label(p)
                reached = await self.sync.reach(p, holders, target)
                self.stats["takeover_reached_newest" if reached else "takeover_newest_unreachable"] += 1
                if self.owners.get(p) is not owner or self.store.label(p) in (since, owner.label):
                    continue  # (nothing reached, or a hand-over brought the owner state of what was: `_handed_over`)
                # the momentum of the version reached: rebuilt from ours and the kept updates since, if we can
                momentum = self._rebuilt(p, owner)
                owner.momentum, owner.label = momentum, self.store.label(p)
                self.momentum_source[p] = "rebuilt" if momentum is not None else "fresh"
                log.info("fragment %d: taken over at %s, reached %s held by %s", p, since, self.store.label(p),
                         holders[0][:8])
                if momentum is None:
                    self.spawn(self.pull(p, self.store.label(p)))
        finally:
            for p in taken:
                if (owner := self.owners.get(p)) is not None:
                    owner.held_back = False

    def move_momentum(self, p: int, owner: FragmentOwner, label: Version) -> None:
        """The store moved past the version the owner's momentum is of outside `reach_newest` (the old owner's
        last push after a takeover, or this owner's own unpublished version fetched back from a replica by
        the learner's catch-up): before the next step, rebuild the momentum of `label` from the kept updates
        since, or keep the older one if they are not all kept."""
        momentum = self._rebuilt(p, owner)
        if momentum is not None:
            owner.momentum = momentum
            self.momentum_source[p] = "rebuilt"
        self.stats["momentum_rebuilt_at_a_step" if momentum is not None else "momentum_of_an_older_version_kept"] += 1
        owner.label = label

    def _rebuilt(self, p: int, owner: FragmentOwner) -> torch.Tensor | None:
        """The momentum of p's current version from the owner's (of `owner.label`) and the kept updates since;
        None when it has none to start from, the run has no momentum, or those updates are not all kept."""
        if owner.momentum is None or owner.label is None or self.outer.momentum == 0:
            return None
        return self.rebuild(p, owner.label, owner.momentum)

    async def _held_above(self, taken: list[int]) -> dict[int, tuple[Version, list[str]]]:
        """`FragmentSync.held_above`, asked again (every `PULL_RETRY_S`, for at most `NEWEST_HOLD_S`) while a
        live member does not answer; one still silent then is a suspect, as a failed request makes it."""
        above: dict[int, tuple[Version, list[str]]] = {}
        until = asyncio.get_running_loop().time() + NEWEST_HOLD_S
        while True:
            missed: set[str] = set()
            for p, (v, holders) in (await self.sync.held_above(taken, suspect=False, unanswered=missed)).items():
                if p not in above or v > above[p][0]:
                    above[p] = (v, holders)
            missed &= {m.peer_id for m in self.members.servers()}
            if not missed or asyncio.get_running_loop().time() >= until:
                break
            self.stats["takeover_versions_asked_again"] += 1
            await asyncio.sleep(PULL_RETRY_S)
        for peer in missed:
            self.members.suspect(peer)
        return above

    async def pull(self, p: int, label: Version) -> None:
        """Taken over without the momentum of this version (member views differed, so the owner replicated
        to another peer, or the holder owned p for a moment): ask the other live members for it (GET
        /v1/momentum/{p}?label=T.V) until one has it, in rounds `PULL_RETRY_S` apart for at most
        `PULL_HOLD_S`, while the owner holds its first step back (stepping would start the momentum from
        zero, and the one pulled afterwards would belong to an older version). A member that fails or answers
        something malformed is passed over; once the hold is over the owner steps with a fresh momentum.
        A run without outer momentum (a `topk` run, docs/protocol.md §7.21) has none to pull: no request, no hold."""
        owner = self.owners.get(p)
        if owner is None or self.outer.momentum == 0:
            return
        until = owner.hold_until = owner.clock() + PULL_HOLD_S
        try:
            while True:
                for m in self.members.servers():
                    if self.owners.get(p) is not owner or owner.momentum is not None or self.store.label(p) != label:
                        return
                    momentum = await self._ask(p, label, m)
                    if momentum is None:
                        continue
                    if self.owners.get(p) is owner and self.store.label(p) == label \
                            and owner.adopt_momentum(momentum, label):
                        self.momentum_source[p] = "pulled"
                        self.stats["momentum_pulled_after_takeover"] += 1
                    return
                if owner.clock() + PULL_RETRY_S >= until:
                    break
                await asyncio.sleep(PULL_RETRY_S)
            if self.owners.get(p) is owner and owner.momentum is None:
                self.stats["momentum_pull_gave_up"] += 1
                log.warning("fragment %d: no live member holds the momentum of %s; its owner restarts it from "
                            "zero", p, label)
        finally:
            owner.hold_until = None

    async def _ask(self, p: int, label: Version, m) -> torch.Tensor | None:
        """Member m's momentum of p at `label`, or None (it has none, failed, or answered something malformed)."""
        numel = self.store.numel(p)
        try:
            body = await self.client.request("GET", m.url, f"/v1/momentum/{p}?label={label}", deadline_s=10.0,
                                             max_response=momentum_body_max(numel))
            meta, payload = parse_momentum(body)
            return Encoded(self._codec_of(meta), meta, payload).decode(numel)
        except RemoteError as e:
            if e.status != 404:
                log.info("momentum pull of fragment %d from %s refused: %s", p, m.peer_id[:8], e)
        except (TransportError, ProtocolError) as e:
            log.info("momentum pull of fragment %d from %s failed: %s", p, m.peer_id[:8], e)
            self.stats["momentum_pull_failures"] += 1
        return None

    def served(self, p: int, label: Version) -> Encoded | None:
        """The momentum of p at `label` that this peer's owner of p holds, for GET /v1/momentum/{p} (a peer
        that took p over for a moment took the replica's copy with it), copied now, on the event loop."""
        owner = self.owners.get(p)
        if owner is None or owner.momentum is None or owner.label != label:
            return None
        return fp32_copy(owner.momentum)

    def _codec_of(self, meta: dict) -> Codec:
        """A replicated momentum travels in the run's codec (an ordinary replication) or in fp32 (a full
        replication or hand-over): docs/protocol.md §7.15. Anything else is `Malformed`."""
        name = meta.get("codec")
        if name == self.codec.name:
            return self.codec
        if name == "fp32":
            return get_codec("fp32")
        raise Malformed(f"momentum meta names codec {name!r}; this run's momentum is {self.codec.name!r} or fp32")

    def _handed_over(self, p: int, label: Version, momentum: Encoded) -> None:
        """A hand-over (the old owner's full state, already installed in the store if it was newer) that
        arrived after we took the fragment over: the old owner saw the new member set later than we did, or
        published it only once it had drained (node/swarm.py). If it is of the version we hold and our owner
        has not stepped past it, its fp32 momentum replaces whatever we started with (the replica's copy,
        decoded from the run's codec; a rebuilt or a fresh one; none while a pull runs), and our owner moves to
        that version if it was behind, so both orders of takeover and hand-over end at the same state. Not
        while an outer step of p runs: that step builds on the momentum it read, and commits or abandons."""
        owner = self.owners.get(p)
        if owner is None or label != self.store.label(p) or self.stepping(p):
            return
        if owner.label is not None and owner.label > label:
            return
        if owner.momentum is None:
            if not owner.adopt_momentum(momentum.decode(self.store.numel(p)), label):
                return
        else:
            owner.momentum, owner.label = momentum.decode(self.store.numel(p)), label
        self.momentum_source[p] = "handed over"
        self.stats["momentum_adopted_after_takeover"] += 1


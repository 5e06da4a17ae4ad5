"""Versions survive kill -9 of every holder: the version journal (node/journal.py) and the owner's rules for
publishing without a replica (docs/architecture.md §5.6, §6.5). Learners in one process; a "kill" stops a
learner's swarm without a goodbye and without the checkpoint that `close` writes."""

from __future__ import annotations

import hashlib
import struct
import time
from pathlib import Path

import pytest
import torch

from diloco.coordinator.version import Version
from diloco.coordinator.wire import anchor_digest
from diloco.node.checkpoint import load_latest
from diloco.node.journal import (
    FRAGMENT_RECORD,
    MAGIC,
    MOMENTUM_RECORD,
    UPDATE_RECORD,
    records,
    replay,
    segments,
)
from diloco.protocol.identity import Identity

from .swarm_utils import LocalLearner, tiny_run, wait_until


class Node(LocalLearner):
    """A learner in this process with a checkpoint folder and a key that outlive it (one restart = a new Node)."""

    def __init__(self, genesis, index: int, ckpt: Path, identity: Identity, peers: list[str] | None = None,
                 ttl_s: float = 4.0) -> None:
        super().__init__(genesis, index, peers, member_ttl_s=ttl_s,
                         learner_kw={"identity": identity, "checkpoint_dir": ckpt})
        self.accepted: list[tuple[int, int, int]] = []

    def start(self) -> Node:
        super().start()
        self.learner.swarm.store.record_versions()
        return self

    @property
    def labels(self) -> list[Version]:
        return self.learner.labels

    def checkpoint(self) -> list[Version]:
        self.learner.save_checkpoint(wait=True)
        return load_latest(self.learner.checkpoint_dir).labels

    def kill(self) -> None:
        """Like kill -9: no goodbye (the member record outlives it), no checkpoint."""
        if self.learner._saving is not None:
            self.learner._saving.join()

        async def silent() -> None:
            pass

        self.learner.swarm.members.withdraw = silent
        self.learner.swarm.stop()
        self.accepted += self.learner.swarm.store.take_accepted()


def forks(*nodes: Node) -> dict:
    """(p, version) accepted under two terms anywhere: the harness's lost accepted updates."""
    terms: dict[tuple[int, int], set[int]] = {}
    for n in nodes:
        for p, term, version in n.accepted + n.learner.swarm.store.take_accepted():
            terms.setdefault((p, version), set()).add(term)
    return {k: t for k, t in terms.items() if len(t) > 1}




def two_joined(tmp_path, nodes) -> tuple:
    """A (folder a) and B (folder b, bootstrapped from A) of a new tiny run, each seeing both: (genesis, keys, a, b)."""
    genesis = tiny_run(quorum=2)
    keys = [Identity.generate() for _ in range(2)]
    a = Node(genesis, 0, tmp_path / "a", keys[0]).start()
    b = Node(genesis, 1, tmp_path / "b", keys[1], peers=[a.url]).start()
    nodes += [a, b]
    wait_until(lambda: all(len(n.learner.swarm.members.live()) == 2 for n in (a, b)), 20, "2 live members")
    return genesis, keys, a, b


def two_learners_one_killed_after_its_checkpoint(tmp_path, nodes):
    """A and B train; B checkpoints; both go on until B holds newer versions of every fragment; both are killed.
    Returns (genesis, B's key, B's folder, B's checkpoint labels, the labels B held, A's anchor digests)."""
    genesis, keys, a, b = two_joined(tmp_path, nodes)
    for _ in range(2):
        for n in (a, b):
            n.train(10)
    wait_until(lambda: all(v.version >= 1 for v in b.labels), 30, "a version of every fragment at B")
    saved = b.checkpoint()
    for _ in range(2):
        for n in (a, b):
            n.train(10)
    wait_until(lambda: all(b.labels[p] > Version(*saved[p]) for p in range(4)) and a.labels == b.labels, 30,
               "newer versions of every fragment at both")
    held = list(b.labels)
    digests = [anchor_digest(a.learner.swarm.store.held[p].anchor) for p in range(4)]
    b.kill()
    a.kill()
    return genesis, keys[1], tmp_path / "b", saved, held, digests


@pytest.mark.timeout(120)
def test_a_learner_killed_after_its_checkpoint_comes_back_with_the_newest_version_it_accepted(tmp_path, nodes):
    genesis, key, folder, saved, held, digests = two_learners_one_killed_after_its_checkpoint(tmp_path, nodes)
    assert [Version(*saved[p]) for p in range(4)] != held
    back = Node(genesis, 1, folder, key)  # alone: what it holds is what it had on disk
    nodes.append(back)
    back.start()
    assert back.labels == held, "the versions accepted after the checkpoint were lost"
    store = back.learner.swarm.store
    assert [anchor_digest(store.held[p].anchor) for p in range(4)] == digests
    for p in range(4):  # θ[p] was moved to the version replayed (as from a download)
        assert anchor_digest(back.learner.plan.flatten(p, back.learner.params)) == digests[p]


def _rewrite(path: Path, edit) -> None:
    """Apply `edit(kind, body) -> (kind, body) | None` to every record of a segment, re-sealing each record."""
    out = bytearray()
    data = path.read_bytes()
    at = 0
    while at < len(data):
        _, kind, size = struct.unpack_from(">4scI", data, at)
        body = data[at + 9 : at + 9 + size]
        at += 9 + size + 32
        changed = edit(kind, body)
        if changed is not None:
            kind, body = changed
            out += struct.pack(">4scI", MAGIC, kind, len(body)) + body + hashlib.sha256(kind + body).digest()
    path.write_bytes(bytes(out))


@pytest.mark.timeout(120)
def test_a_forged_or_torn_journal_record_is_refused_and_the_restart_goes_on(tmp_path, nodes):
    genesis, key, folder, saved, held, _ = two_learners_one_killed_after_its_checkpoint(tmp_path, nodes)
    journal = folder / "journal"
    kinds = [kind for kind, _ in records(folder)]
    assert kinds and set(kinds) <= {UPDATE_RECORD, FRAGMENT_RECORD, MOMENTUM_RECORD}

    def replayed() -> tuple[list[Version], int]:
        ckpt = load_latest(folder)
        anchors = [ckpt.anchors[p].reshape(-1).clone() for p in range(4)]
        labels = [Version(*ckpt.labels[p]) for p in range(4)]
        out = replay(folder, genesis.spec, anchors, labels, [ckpt.certs[p] for p in range(4)], set())
        return labels, out.refused

    assert replayed() == (held, 0)
    # a flipped payload byte in the first update frame, the record's own digest re-sealed: the frame's
    # signed payload digest refuses it, and what builds on it no longer chains
    first = {"done": False}

    def forge(kind: bytes, body: bytes):
        if kind == UPDATE_RECORD and not first["done"]:
            first["done"] = True
            body = bytearray(body)
            body[-1] ^= 1
            return kind, bytes(body)
        return kind, body

    seg = journal / f"seg-{segments(journal)[0]}"
    original = seg.read_bytes()
    _rewrite(seg, forge)
    labels, refused = replayed()
    assert refused >= 1 and labels != held
    # torn: the last record cut short (killed mid-write), then junk: everything before it still replays
    seg.write_bytes(original)
    last = journal / f"seg-{segments(journal)[-1]}"
    data = last.read_bytes()
    at, cut = 0, None
    while at < len(data):  # (the last version record: a replica's momentum record may follow it)
        _, kind, size = struct.unpack_from(">4scI", data, at)
        at += 9 + size + 32
        if kind != MOMENTUM_RECORD:
            cut = at - 7
    last.write_bytes(data[:cut])
    labels, refused = replayed()
    assert refused == 0 and labels != held and sum(a != b for a, b in zip(labels, held, strict=True)) == 1
    last.write_bytes(data + b"\x00garbage")
    assert replayed() == (held, 0)
    back = Node(genesis, 1, folder, key).start()  # and a real restart on the torn journal
    nodes.append(back)
    assert back.labels == held


@pytest.mark.timeout(120)
def test_segments_a_checkpoint_covers_are_deleted_once_it_is_written(tmp_path, nodes):
    genesis = tiny_run(quorum=1)
    n = Node(genesis, 0, tmp_path / "a", Identity.generate()).start()
    nodes.append(n)
    n.train(20)
    wait_until(lambda: all(v.version >= 1 for v in n.labels), 30, "versions")
    before = segments(tmp_path / "a" / "journal")
    assert [kind for kind, _ in records(tmp_path / "a")], "the owner's own versions are journaled"
    n.checkpoint()
    after = segments(tmp_path / "a" / "journal")
    assert after and min(after) > max(before), "the segments the checkpoint covers are still there"
    n.kill()
    ckpt = load_latest(tmp_path / "a")
    anchors = [ckpt.anchors[p].reshape(-1).clone() for p in range(4)]
    labels = [Version(*ckpt.labels[p]) for p in range(4)]
    replay(tmp_path / "a", genesis.spec, anchors, labels, [ckpt.certs[p] for p in range(4)], set())
    assert labels == n.labels, "checkpoint and journal together hold every version the learner had"


@pytest.mark.timeout(120)
def test_an_owner_does_not_publish_alone_while_another_peer_that_could_hold_it_is_alive(tmp_path, nodes):
    genesis = tiny_run(quorum=2)
    a = Node(genesis, 0, tmp_path / "a", Identity.generate()).start()
    b = Node(genesis, 1, tmp_path / "b", Identity.generate(), peers=[a.url]).start()
    nodes += [a, b]
    wait_until(lambda: all(len(n.learner.swarm.members.live()) == 2 for n in (a, b)), 20, "2 live members")
    b.learner.swarm.progress.synced = False  # B is alive, but no candidate for any role (as while it joins)
    b.learner.swarm._loop.call_soon_threadsafe(lambda: b.learner.swarm._spawn(b.learner.swarm.members.publish()))
    me = a.learner.swarm.identity.peer_id
    wait_until(lambda: all(a.learner.swarm.members.roles(p) == [me] for p in range(4)), 10, "A alone in the roles")
    before = list(a.labels)
    deadline = time.monotonic() + 4.0
    while time.monotonic() < deadline:
        for n in (a, b):
            n.train(5)
    shard = a.learner.swarm.shard
    assert a.labels == before, f"published with no other holder while B was alive: {dict(shard.stats)}"
    assert shard.stats["publications_held_for_a_holder"] >= 1
    b.learner.swarm._loop.call_soon_threadsafe(b.learner.swarm._become_candidate)
    for _ in range(3):
        for n in (a, b):
            n.train(10)
    wait_until(lambda: any(v.version >= 1 for v in b.labels), 30, "versions once B can be a replica")


@pytest.mark.timeout(180)
def test_a_swarm_whose_every_learner_was_killed_comes_back_without_a_fork(tmp_path, nodes):
    """A is killed; B and C go on (newer versions, journaled); B and C are killed. A comes back first, alone and
    stale, and trains; B comes back within a member TTL. No version number of any fragment gets two terms."""
    genesis = tiny_run(quorum=2)
    keys = [Identity.generate() for _ in range(3)]
    a = Node(genesis, 0, tmp_path / "a", keys[0]).start()
    b = Node(genesis, 1, tmp_path / "b", keys[1], peers=[a.url]).start()
    c = Node(genesis, 2, tmp_path / "c", keys[2], peers=[a.url]).start()
    nodes += [a, b, c]
    wait_until(lambda: all(len(n.learner.swarm.members.live()) == 3 for n in (a, b, c)), 20, "3 live members")
    for _ in range(2):
        for n in (a, b, c):
            n.train(10)
    wait_until(lambda: all(v.version >= 1 for v in a.labels), 30, "a version of every fragment")
    for n in (a, b, c):
        n.checkpoint()
    stale = list(a.labels)
    a.kill()
    for _ in range(3):
        for n in (b, c):
            n.train(10)
    wait_until(lambda: all(b.labels[p] > stale[p] for p in range(4)) and b.labels == c.labels, 30,
               "B and C past A's versions")
    newest = list(b.labels)
    b.kill()
    c.kill()
    a2 = Node(genesis, 0, tmp_path / "a", keys[0], ttl_s=8.0).start()
    nodes.append(a2)
    assert all(a2.labels[p] < newest[p] for p in range(4))
    a2.train(12)  # alone, stale: must not publish yet
    b2 = Node(genesis, 1, tmp_path / "b", keys[1], peers=[a2.url], ttl_s=8.0).start()
    nodes.append(b2)
    assert b2.labels == newest, "B does not hold its newest versions (its journal was not replayed, or a fork won)"
    for _ in range(4):
        for n in (a2, b2):
            n.train(10)
    wait_until(lambda: all(a2.labels[p] > newest[p] for p in range(4)) and a2.labels == b2.labels, 40,
               "versions built on B's newest")
    assert not forks(a, b, c, a2, b2), "a version number of a fragment was published twice"


@pytest.mark.timeout(120)
def test_a_joiner_that_finds_nobody_to_download_from_waits_before_publishing_alone(tmp_path, nodes):
    """It joined an existing swarm (through a bootstrap peer), yet finds no member: every other learner may be
    restarting, with versions it cannot see yet. It fills its fragments with Θ^(0) and must not publish from
    them at once (the chaos sweep's seed 4 saw such a joiner fork version 1 of a fragment at 2 min)."""
    from .helpers import Proc, cli

    dht = Proc(cli("dht", "--listen", "127.0.0.1:0"))
    try:
        url = dht.wait_for(r"announced as (\S+)", timeout=60).group(1)
        genesis = tiny_run(quorum=1)
        joiner = Node(genesis, 0, tmp_path / "a", Identity.generate(), peers=[url], ttl_s=8.0).start()
        nodes.append(joiner)
        assert all(v.version == 0 for v in joiner.labels)
        joiner.train(15)  # every fragment due at least once: rounds of a quorum of 1
        shard = joiner.learner.swarm.shard
        wait_until(lambda: shard.stats["publications_held_while_alone"] >= 1 or any(v.version for v in joiner.labels),
                   10, "a publication attempt")
        assert shard.stats["publications_held_while_alone"] >= 1, f"published alone at once: {dict(shard.stats)}"
        deadline = time.monotonic() + 30
        while not any(v.version for v in joiner.labels) and time.monotonic() < deadline:
            joiner.train(5)
        assert any(v.version for v in joiner.labels), "alone for a member TTL, it publishes"
    finally:
        dht.kill()


@pytest.mark.timeout(120)
def test_after_every_learner_stopped_the_owners_take_their_momentum_from_the_checkpoints(tmp_path, nodes):
    """A and B train, checkpoint and are both killed: no live copy of any fragment's outer momentum is left but
    the checkpoints'. Restarted, every owner has the momentum of its version at once (no pull that nobody can
    answer, no momentum started from zero): the very one held before where the owner saved it itself."""
    genesis, keys, a, b = two_joined(tmp_path, nodes)
    for _ in range(3):
        for n in (a, b):
            n.train(10)
    seen: dict = {"state": None, "since": 0.0}

    def settled() -> bool:
        """The same versions at both, every owner committed to its fragment's, all unchanged for a second."""
        now = (a.labels, b.labels, {p: o.label for n in (a, b) for p, o in n.learner.swarm.shard.owners.items()
                                    if o.momentum is not None})
        if now != seen["state"]:
            seen["state"], seen["since"] = now, time.monotonic()
        return now[0] == now[1] == [now[2].get(p) for p in range(4)] and all(v.version >= 2 for v in now[0]) \
            and time.monotonic() - seen["since"] >= 1.0

    wait_until(settled, 30, "the same committed versions at both, for a second")
    owned = {p: n for n in (a, b) for p in n.learner.swarm.shard.owners}
    held = {p: (o.label, o.momentum.clone()) for n in (a, b) for p, o in n.learner.swarm.shard.owners.items()}
    assert len(held) == 4 and all(m.abs().sum() > 0 for _, m in held.values())
    labels = [n.checkpoint() for n in (a, b)]
    assert labels[0] == labels[1]
    a.kill()
    b.kill()
    a2 = Node(genesis, 0, tmp_path / "a", keys[0]).start()
    b2 = Node(genesis, 1, tmp_path / "b", keys[1], peers=[a2.url]).start()
    nodes += [a2, b2]
    restarted = {a: a2, b: b2}

    def owners() -> dict:
        return {p: (n, o) for n in (a2, b2) for p, o in n.learner.swarm.shard.owners.items()}

    wait_until(lambda: len(owners()) == 4 and all(o.momentum is not None for _, o in owners().values())
               and all(len(n.learner.swarm.members.live()) == 2 for n in (a2, b2)), 20,
               "an owner with its momentum for every fragment")
    for p, (n, o) in owners().items():
        source = n.learner.swarm.shard.momentum_source[p]
        label, before = held[p]
        assert o.label == label and source != "fresh", (p, source)
        if n is restarted[owned[p]] and source == "checkpoint":
            assert torch.equal(o.momentum, before), "the owner's own saved momentum came back changed"
        else:  # one a replica kept (int8) and saved, handed over or pulled
            assert torch.allclose(o.momentum, before, atol=float(before.abs().max()) / 50), (p, source)
    assert any(src == "checkpoint" for n in (a2, b2) for src in n.learner.swarm.shard.momentum_source.values())
    assert all(n.learner.swarm.shard.stats["momentum_pull_gave_up"] == 0 for n in (a2, b2))

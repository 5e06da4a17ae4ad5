"""Spot preemption with a clean hand-over (docs/preemption.md): SIGTERM, SIGINT or a cloud's metadata notice
drains a learner (its deltas sent, its rounds published, each fragment handed to the next owner with its
momentum and acknowledged, `left` published, a final checkpoint) and it exits 0; restarted, it rejoins.
Real `join` processes on loopback; the cloud's metadata endpoint is a fake aiohttp server on loopback."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import statistics
import threading
import time
import types

import pytest
import torch
from aiohttp import web

from diloco.coordinator.ownership import owners
from diloco.coordinator.runspec import Genesis
from diloco.node.preempt import MetadataPoller, Notice, install_signals
from diloco.protocol.identity import Identity

from .helpers import Proc
from .swarm_utils import LocalLearner, get_status, tiny_run, wait_until
from .test_swarm_processes import Fleet

FRAGMENTS = 4


class FakeMetadata:
    """A cloud's instance metadata endpoint on a loopback port (AWS IMDSv2 and GCP routes), in its own thread.
    `notice = True` makes it announce an interruption; it refuses requests without the headers the real ones
    require."""

    TOKEN = "fake-imds-token"

    def __init__(self) -> None:
        self.notice = False
        self.up = True  # False: every request fails with 500
        self.requests: list[tuple[str, str]] = []
        self._loop = asyncio.new_event_loop()
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        assert self._started.wait(10)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        app = web.Application()
        app.router.add_put("/latest/api/token", self._token)
        app.router.add_get("/latest/meta-data/spot/instance-action", self._action)
        app.router.add_get("/computeMetadata/v1/instance/preempted", self._preempted)
        self._runner = web.AppRunner(app)
        self._loop.run_until_complete(self._runner.setup())
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        self._loop.run_until_complete(site.start())
        self.port = site._server.sockets[0].getsockname()[1]
        self._started.set()
        self._loop.run_forever()

    def close(self) -> None:
        async def stop() -> None:
            await self._runner.cleanup()

        asyncio.run_coroutine_threadsafe(stop(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    async def _token(self, request: web.Request) -> web.Response:
        self.requests.append(("PUT", request.path))
        if not self.up:
            return web.Response(status=500)
        if not request.headers.get("X-aws-ec2-metadata-token-ttl-seconds"):
            return web.Response(status=400)
        return web.Response(text=self.TOKEN)

    async def _action(self, request: web.Request) -> web.Response:
        self.requests.append(("GET", request.path))
        if request.headers.get("X-aws-ec2-metadata-token") != self.TOKEN:
            return web.Response(status=401)
        if not self.notice:
            return web.Response(status=404)
        return web.json_response({"action": "terminate", "time": "2026-01-01T00:02:00Z"})

    async def _preempted(self, request: web.Request) -> web.Response:
        self.requests.append(("GET", request.path))
        if not self.up:
            return web.Response(status=500)
        if request.headers.get("Metadata-Flavor") != "Google":
            return web.Response(status=403)
        return web.Response(text="TRUE" if self.notice else "FALSE")


@pytest.fixture
def metadata():
    servers: list[FakeMetadata] = []

    def make() -> FakeMetadata:
        servers.append(FakeMetadata())
        return servers[-1]

    yield make
    for server in servers:
        server.close()


@pytest.fixture
def fleet(tmp_path):
    fleets: list[Fleet] = []

    def make(**fields) -> Fleet:
        f = Fleet(tmp_path, "info", **{"inner_steps": 10, "fragments": FRAGMENTS, **fields})
        fleets.append(f)
        return f

    yield make
    for f in fleets:
        f.close()


def _version(text: str) -> tuple[int, int]:
    term, version = text.split(".")
    return int(term), int(version)


def keys_where_one_of_owns(f: Fleet, n: int, candidates: list[int]) -> None:
    """Write the keys of learners 0..n-1 of `f` so that, once all n are live, one among `candidates` owns a
    fragment (the rendezvous ranking of their ids, coordinator/ownership.py): random keys give every fragment
    to one learner now and then (1 start in 81 for 3 learners and 4 fragments)."""
    spec = Genesis.load(f.dir / "run.spec").spec
    while True:
        keys = [Identity.generate() for _ in range(n)]
        members = [types.SimpleNamespace(peer_id=k.peer_id, client_mode=False) for k in keys]
        firsts = {owners(spec.run_id, p, members, replicas=0)[0] for p in range(spec.fragments)}
        if any(keys[i].peer_id in firsts for i in candidates):
            break
    for i, k in enumerate(keys):
        k.save(f.dir / f"key{i}.pem")


def settled_owner(urls: list[str], candidates: list[int]) -> tuple[int, dict, list[dict]]:
    """Once every learner sees every other, their views agree on the roles and every fragment has versions: the
    learner among `candidates` that owns the most fragments, its PeerId -> index map, and the statuses.
    (A learner may hold no role at all: the keys are random, and 3 learners rank for 4 fragments.)"""
    found: dict = {}

    def agreed() -> bool:
        st = [get_status(u) for u in urls]
        ids = {s["peer_id"] for s in st}
        if any({m["peer_id"] for m in s["members"]} | {s["peer_id"]} != ids for s in st):
            return False
        roles = [[fr["roles"] for fr in s["fragments"]] for s in st]
        if any(r != roles[0] for r in roles):
            return False
        if not all(_version(fr["version"])[1] >= 2 for fr in st[0]["fragments"]):
            return False
        found["st"] = st
        return True

    wait_until(agreed, 60, "every learner a candidate, the roles agreed, versions of every fragment", poll=0.5)
    st = found["st"]
    index = {s["peer_id"]: i for i, s in enumerate(st)}
    owned = {i: [fr["p"] for fr in st[0]["fragments"] if index[fr["roles"][0]] == i] for i in candidates}
    victim = max(candidates, key=lambda i: len(owned[i]))
    assert owned[victim], f"no candidate owns a fragment: {owned}"
    return victim, index, st


def forks(procs: list[Proc]) -> dict:
    """(p, version) accepted under two terms by any of `procs` (their JSON lines' `accepted` moves)."""
    terms: dict[tuple[int, int], set[int]] = {}
    for proc in procs:
        for ev in proc.events():
            for p, term, version in ev.get("accepted", ()):
                terms.setdefault((p, version), set()).add(term)
    return {k: t for k, t in terms.items() if len(t) > 1}


def longest_gap(proc: Proc, start: float, end: float) -> float:
    ev = [e for e in proc.events("progress") if start <= e["t"] <= end]
    return max((b["t"] - a["t"] for a, b in zip(ev, ev[1:], strict=False)), default=0.0)


def median_gap(proc: Proc, start: float, end: float) -> float:
    ev = [e for e in proc.events("progress") if start <= e["t"] <= end]
    return statistics.median(b["t"] - a["t"] for a, b in zip(ev, ev[1:], strict=False))


@pytest.mark.timeout(120)
def test_sigterm_of_an_owner_hands_its_fragments_over_and_it_rejoins_from_its_checkpoint(fleet):
    f = fleet()
    procs = [f.start(i, 100000) for i in range(3)]
    urls = [p.events("joined")[0]["url"] for p in procs]
    victim, index, st = settled_owner(urls, [0, 1, 2])
    survivors = [i for i in range(3) if i != victim]
    time.sleep(2.0)  # (a stretch of normal steps to compare the drain's with)
    before = procs[victim].events("progress")[-1]
    signalled = time.time()
    procs[victim].popen.send_signal(signal.SIGTERM)
    seen: dict[int, list[list[tuple[int, int]]]] = {i: [] for i in survivors}
    while procs[victim].popen.poll() is None and time.time() < signalled + 30:
        for i in survivors:
            seen[i].append([_version(fr["version"]) for fr in get_status(urls[i])["fragments"]])
        time.sleep(0.2)
    took = time.time() - signalled
    rc = procs[victim].popen.wait(5)
    assert rc == 0, "\n".join(procs[victim].lines[-30:])
    assert took < 25, f"the drained learner took {took:.1f}s to exit (--drain-s 25)"
    drained = procs[victim].events("drained")[0]
    assert drained["reason"] == "SIGTERM" and drained["complete"], drained
    assert drained["handed_over"] >= 1 and drained["acked"] == drained["handed_over"], drained
    assert drained["checkpoint"] and drained["left"] and drained["dropped_deltas"] == 0, drained
    # every delta an owner took from it is merged (none outstanding), and so are the steps it made after its
    # last progress line before the signal, in every fragment: the drain sent them and waited for the merges
    done = procs[victim].events("done")[0]
    assert drained["deltas_unmerged"] == 0, drained
    assert drained["merged_steps"] > before["merged_steps"], (drained, before)
    assert drained["merged_steps"] - before["merged_steps"] >= FRAGMENTS * (done["steps"] - before["step"]), (
        drained, before, done)

    # the next owner took each fragment over with the momentum handed to it, and no version forked
    handed = [h for h in drained["handovers"] if h["acked"]]
    for h in handed:
        owner_url = urls[index[h["to"]]]
        wait_until(lambda h=h, u=owner_url: get_status(u)["fragments"][h["p"]]["roles"][:1] == [h["to"]], 15,
                   f"{h['to'][:8]} to own fragment {h['p']}")
        frag = get_status(owner_url)["fragments"][h["p"]]
        assert frag["momentum"] == "handed over", (h, frag)
        assert _version(frag["version"]) >= _version(h["version"]), (h, frag)
    for i, views in seen.items():
        for p in range(FRAGMENTS):
            versions = [v[p] for v in views]
            assert versions == sorted(versions), f"learner {i} saw fragment {p} regress: {versions}"
    wait_until(lambda: len({tuple(fr["version"] for fr in get_status(urls[i])["fragments"]) for i in survivors})
               == 1, 20, "the survivors to agree on every version", poll=0.5)
    assert not forks([procs[i] for i in survivors] + [procs[victim]])

    # the survivors trained on through the drain, at their usual pace (a wait on the drained peer would be a
    # post's deadline, seconds; on a shared 2-core machine the scheduler alone stretches some steps)
    for i in survivors:
        normal = median_gap(procs[i], signalled - 2.0, signalled)
        longest = longest_gap(procs[i], signalled - 2.0, signalled)
        gap = longest_gap(procs[i], signalled, signalled + took)
        assert gap <= max(3 * normal, 2 * longest, 0.5), (
            f"survivor {i} paused {gap:.3f}s during the drain (steps {normal:.3f}s, longest before {longest:.3f}s)")
        assert procs[i].popen.poll() is None
    assert not [s for i in survivors for s in [get_status(urls[i])["sync"]] if s.get("deltas_lost_no_owner")]

    # restarted from its checkpoint folder, it rejoins the survivors and trains on from its checkpoint's step
    f.first_url = urls[survivors[0]]
    back = f.start(victim, 100000)
    joined = back.events("joined")[0]
    assert joined["step"] == drained["checkpoint_step"], (joined, drained)
    url = joined["url"]
    wait_until(lambda: get_status(url)["synced"] and get_status(url)["step"] > joined["step"] + 10, 40,
               "the restarted learner to train on")
    wait_until(lambda: get_status(url)["sync"].get("deltas_sent", 0) >= 2, 30, "its deltas accepted again")


@pytest.mark.timeout(120)
def test_an_aws_spot_notice_drains_the_learner_like_sigterm(fleet, metadata):
    f = fleet()
    servers = [metadata(), metadata()]  # (one endpoint per learner: the one that owns more gets the notice)
    procs = [f.start(i, 100000, "--preemption-notice", "aws", "--metadata-url", servers[i].url) for i in range(2)]
    urls = [p.events("joined")[0]["url"] for p in procs]
    victim, _, _ = settled_owner(urls, [0, 1])
    survivor, proc = 1 - victim, procs[victim]
    assert ("PUT", "/latest/api/token") in servers[victim].requests, "the poller asked for an IMDSv2 token"
    servers[victim].notice = True
    noticed = time.time()
    rc = proc.popen.wait(40)
    assert rc == 0, "\n".join(proc.lines[-30:])
    assert time.time() - noticed < 5 + 25  # (a poll every 5 s, then the drain)
    drained = proc.events("drained")[0]
    assert drained["reason"] == "aws spot interruption notice: terminate at 2026-01-01T00:02:00Z", drained
    assert drained["complete"] and drained["handed_over"] >= 1 and drained["acked"] == drained["handed_over"]
    for h in drained["handovers"]:
        assert h["to"] == procs[survivor].events("joined")[0]["peer_id"]
        wait_until(lambda h=h: get_status(urls[survivor])["fragments"][h["p"]]["roles"][:1] == [h["to"]], 15,
                   "the survivor to own the fragments handed over")
        assert get_status(urls[survivor])["fragments"][h["p"]]["momentum"] == "handed over"
    assert procs[survivor].popen.poll() is None


@pytest.mark.timeout(120)
def test_a_drain_cut_short_by_its_deadline_still_exits_and_a_second_sigterm_exits_at_once(fleet):
    """A member that stops answering (SIGSTOP) holds up the drains of the others: one with `--drain-s 4` skips
    what it could not finish, writes its checkpoint and exits 0 in time; one that gets a second SIGTERM exits
    at once with 143, without draining."""
    f = fleet()
    # the member stopped is one that owns a fragment (a member may own none, and then nothing the short drain
    # does need wait on it): the short drain's delta to it is still in flight at 4 s
    keys_where_one_of_owns(f, 3, [0, 2])
    procs = [f.start(0, 100000), f.start(1, 100000, "--drain-s", "4"), f.start(2, 100000)]
    victim, _, _ = settled_owner([p.events("joined")[0]["url"] for p in procs], [0, 2])
    stopped, short, twice = procs[victim], procs[1], procs[2 - victim]
    stopped.popen.send_signal(signal.SIGSTOP)  # (its answers never come: the others' drains wait on them)
    try:
        signalled = time.time()
        short.popen.send_signal(signal.SIGTERM)
        twice.popen.send_signal(signal.SIGTERM)
        twice.wait_for("draining within 25 s", timeout=20)
        time.sleep(0.5)
        assert twice.popen.poll() is None, "the drain was still waiting for the stopped peer"
        second = time.time()
        twice.popen.send_signal(signal.SIGTERM)
        assert twice.popen.wait(10) == 128 + signal.SIGTERM
        assert time.time() - second < 3, "the second SIGTERM did not exit at once"
        assert not twice.events("drained")

        assert short.popen.wait(20) == 0, "\n".join(short.lines[-30:])
        took = time.time() - signalled
        drained = short.events("drained")[0]
        assert drained["skipped"] and not drained["complete"], drained
        assert drained["checkpoint"] and drained["seconds"] <= 4.5, drained
        assert took < 4 + 6, f"the drain cut short took {took:.1f}s to exit"
    finally:
        stopped.popen.send_signal(signal.SIGCONT)


def test_a_signal_asks_for_a_drain_and_only_joins_one_a_metadata_notice_started():
    notice = Notice()
    undo = install_signals(notice)
    try:
        os.kill(os.getpid(), signal.SIGINT)
        assert notice.wait(5) and notice.reason == "SIGINT"
    finally:
        undo()
    notice = Notice()
    undo = install_signals(notice)
    try:
        notice.request("gcp preemption notice")
        os.kill(os.getpid(), signal.SIGTERM)  # (the shutdown that follows the notice: not a second signal)
        time.sleep(0.1)
        assert notice.reason == "gcp preemption notice"
    finally:
        undo()


def test_the_gcp_poller_reads_the_preempted_flag_and_survives_an_unreachable_endpoint(metadata, caplog):
    metadata = metadata()
    notice = Notice()
    poller = MetadataPoller("gcp", notice, metadata.url, poll_s=0.05)
    assert poller.poll_once() is None  # FALSE
    metadata.up = False
    with caplog.at_level(logging.WARNING, logger="diloco.node.preempt"):
        assert poller.poll_once() is None and poller.poll_once() is None
    assert poller.errors == 2
    assert len([r for r in caplog.records if "cannot be read" in r.getMessage()]) == 1, "an error is logged once"
    metadata.up = True
    poller.start()
    time.sleep(0.3)
    assert not notice.requested
    metadata.notice = True
    assert notice.wait(5), "the poller saw TRUE"
    poller.stop()
    assert notice.reason == "gcp preemption notice"
    assert ("GET", "/computeMetadata/v1/instance/preempted") in metadata.requests


def test_the_aws_poller_takes_a_token_and_renews_it_when_refused(metadata):
    metadata = metadata()
    notice = Notice()
    poller = MetadataPoller("aws", notice, metadata.url)
    assert poller.poll_once() is None  # 404: no interruption
    poller._token = "expired"  # (as after its TTL: the endpoint answers 401, the poller asks for a new one)
    metadata.notice = True
    assert poller.poll_once() == "aws spot interruption notice: terminate at 2026-01-01T00:02:00Z"
    assert metadata.requests.count(("PUT", "/latest/api/token")) == 2
    unreachable = MetadataPoller("aws", Notice(), "http://127.0.0.1:9", timeout_s=0.5)
    assert unreachable.poll_once() is None and unreachable.errors == 1


@pytest.fixture
def learners():
    made: list[LocalLearner] = []
    yield made
    for n in made:
        if n.learner.swarm is not None:
            n.learner.swarm.stop()


def _on_loop(n: LocalLearner, fn):
    """Run `fn()` (a coroutine function) on learner n's swarm loop and return its result."""
    return asyncio.run_coroutine_threadsafe(fn(), n.learner.swarm._loop).result(30)


@pytest.mark.timeout(120)
def test_a_hand_over_after_the_new_owners_takeover_still_ends_handed_over_at_the_newest_version(learners):
    """The other order: the next owner takes the fragment over before the old owner's hand-over arrives (its
    view lost the old owner first), and the old owner published one more version meanwhile, which reached it
    as a replica's copy. The late hand-over replaces the replica's momentum and brings the owner to that
    version: the same state as when the hand-over comes first, one version, no fork."""
    genesis = tiny_run(quorum=2, fragments=FRAGMENTS)
    slow = {"member_refresh_s": 60.0, "member_ttl_s": 120.0}  # (a suspect stays one until we are done)
    first = LocalLearner(genesis, 0, **slow).start()
    learners += [first, *(LocalLearner(genesis, i, [first.url], **slow).start() for i in (1, 2))]
    by_id = {n.learner.swarm.identity.peer_id: n for n in learners}

    def frag() -> tuple[int, list[str]] | None:  # a fragment with a published version, its roles agreed, and
        # the replica holding the momentum of that version (roles that changed since the owner's last round
        # leave the new replica without one: its takeover would pull the momentum instead)
        for p in range(FRAGMENTS):
            roles = [n.learner.swarm.members.roles(p) for n in learners]
            if len(roles[0]) == 2 and all(r == roles[0] for r in roles) \
                    and p in by_id[roles[0][0]].learner.swarm.shard.owners \
                    and by_id[roles[0][0]].learner.swarm.store.label(p).version >= 1 \
                    and (by_id[roles[0][1]].learner.swarm.shard.replication.kept.get(p, (None,))[0]
                         == by_id[roles[0][0]].learner.swarm.store.label(p)):
                return p, roles[0]
        return None

    for _ in range(20):
        for n in learners:
            n.train(10)
        if frag() is not None:
            break
    assert frag() is not None, "no fragment with a published version and agreed roles"
    p, (old_id, new_id) = frag()
    old, new = by_id[old_id], by_id[new_id]
    other = next(n for n in learners if n not in (old, new))
    shard_new, shard_old = new.learner.swarm.shard, old.learner.swarm.shard

    async def suspect() -> None:
        new.learner.swarm.members.suspect(old_id)

    _on_loop(new, suspect)
    wait_until(lambda: p in shard_new.owners and not shard_new.owners[p].held_back, 10, "the takeover")
    assert shard_new.momentum_source[p] == "replica"
    taken_at = shard_new.owners[p].label
    before = old.learner.swarm.store.label(p)
    for _ in range(10):  # the others' deltas still go to the old owner, which publishes a version that the new
        for n in (old, other):  # one gets as its replica
            n.train(10)
        newest = old.learner.swarm.store.label(p)
        if newest > before and new.learner.swarm.store.label(p) == newest:
            break
    assert newest > before and new.learner.swarm.store.label(p) == newest, (before, newest)
    assert shard_new.owners[p].label == taken_at < newest  # its owner state is still the takeover's

    async def hand_over() -> tuple[bool, torch.Tensor]:
        owner = shard_old.owners[p]
        anchor, label, cert = old.learner.swarm.store.snapshot(p)
        assert label == owner.label == newest
        acked = await shard_old.replication.send_full(p, new_id, owner.term, owner.momentum, cert, anchor)
        return acked, owner.momentum.clone()

    acked, momentum = _on_loop(old, hand_over)
    assert acked
    owner = shard_new.owners[p]
    assert shard_new.momentum_source[p] == "handed over"
    assert owner.label == newest == new.learner.swarm.store.label(p)
    assert torch.equal(owner.momentum, momentum), "the old owner's fp32 momentum, exactly"

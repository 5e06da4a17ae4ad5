"""Real learner processes on loopback: training, kill -9 of a learner and of an owner, client mode."""

from __future__ import annotations

import signal
import statistics
import time

import pytest

from diloco.node.train import new_run
from diloco.protocol.identity import Identity

from .helpers import Proc, cli
from .swarm_utils import get_status, wait_until


class Fleet:
    def __init__(self, tmp_path, log_level: str = "warning", **run_fields) -> None:
        self.dir, self.log_level = tmp_path, log_level
        fields = dict(task="markov", inner_steps=20, fragments=4, quorum=2)
        new_run(Identity.generate(), "proc-test", **{**fields, **run_fields}).save(tmp_path / "run.spec")
        self.procs: list[Proc] = []
        self.first_url: str | None = None

    def start(self, i: int, steps: int, *extra: str) -> Proc:
        args = ["--log-level", self.log_level, "join", "--run", str(self.dir / "run.spec"), "--listen", "127.0.0.1:0", "--steps", str(steps),
                "--json", "--progress-every", "1", "--fast-membership", "--key", str(self.dir / f"key{i}.pem"),
                "--checkpoint-dir", str(self.dir / f"ckpt{i}"), "--checkpoint-every", "20", *extra]
        if self.first_url:
            args += ["--peers", self.first_url]
        proc = Proc(cli(*args), env={"OMP_NUM_THREADS": "1"})
        self.procs.append(proc)
        joined = proc.wait_for(r'"event": "joined"', timeout=90)
        if self.first_url is None:
            self.first_url = proc.events("joined")[0]["url"]
        assert joined
        return proc

    def close(self) -> None:
        for p in self.procs:
            p.kill()


@pytest.fixture
def fleet(tmp_path):
    fleets: list[Fleet] = []

    def make(log_level: str = "warning", **fields) -> Fleet:
        f = Fleet(tmp_path, log_level, **fields)
        fleets.append(f)
        return f

    yield make
    for f in fleets:
        f.close()


def step_of(proc: Proc) -> int:
    ev = proc.events("progress")
    return ev[-1]["step"] if ev else 0


@pytest.mark.timeout(240)
def test_three_learner_processes_bring_the_eval_loss_well_down(fleet):
    f = fleet()
    procs = [f.start(i, 240) for i in range(3)]
    done = [p.wait_for(r'"event": "done"', timeout=200) for p in procs]
    assert all(done)
    evals = [p.events("done")[0]["eval_loss"] for p in procs]
    assert max(evals) < 3.0, f"eval losses {evals} (start ≈ ln 64 = 4.16, best possible ≈ 2.35)"
    assert sum(p.events("done")[0]["outer_steps"] for p in procs) > 0
    rounds = [p.events("done")[0]["owner_round_s"] for p in procs if p.events("done")[0]["outer_steps"]]
    assert rounds and all(0 < r < 30 for r in rounds), rounds  # an owner's published rounds, timed


@pytest.mark.timeout(300)
def test_kill_9_of_a_learner_never_pauses_the_others_and_it_rejoins(fleet):
    f = fleet()
    procs = [f.start(i, 100000) for i in range(3)]
    wait_until(lambda: all([step_of(p) >= 60 for p in procs]), 120, "every learner at step 60")
    victim, survivors = procs[2], procs[:2]
    killed_at = time.time()
    victim.kill(signal.SIGKILL)
    # (every survivor's output read at each poll, not only up to the first one still short: a child whose pipe
    # fills blocks in its `print`, a pause of the test's own making)
    wait_until(lambda: all([sum(e["t"] > killed_at + 8 for e in p.events("progress")) > 0 for p in survivors]),
               60, "survivors to train on after the kill")
    # A pause caused by the failure (waiting on the dead peer: a connect or a post deadline, seconds) would
    # stand out against the same survivor's own gaps just before it: on a shared 2-core machine the scheduler
    # alone makes some steps several times longer than the median, and the survivors' takeover of the dead
    # peer's fragments runs on their loop threads meanwhile.
    for p in survivors:
        ev = p.events("progress")
        gaps = [(a["t"], b["t"] - a["t"]) for a, b in zip(ev, ev[1:], strict=False)]
        before = [g for t, g in gaps if killed_at - 8 <= t < killed_at]
        after = [g for t, g in gaps if killed_at <= t < killed_at + 8]
        step_time = statistics.median(before)
        # (a wait on the dead peer is a connect or post deadline: 1 s and more; in a full-suite run on this
        # 2-core machine one survivor's gap reached 0.41 s against 0.124 s steps, cause not yet found)
        allowed = max(3 * step_time, 2 * max(before), 0.5)
        assert max(after) <= allowed, (
            f"a survivor paused {max(after):.3f}s after the kill (step time {step_time:.3f}s, "
            f"longest gap before {max(before):.3f}s)"
        )
    # the same key and checkpoint directory: it resumes, resyncs and contributes again
    f.first_url = survivors[0].events("joined")[0]["url"]
    back = f.start(2, 100000)
    assert back.events("joined")[0]["step"] >= 20, "the restarted learner resumed from its checkpoint"
    url = back.events("joined")[0]["url"]
    wait_until(lambda: get_status(url)["sync"].get("deltas_sent", 0) >= 2, 90,
               "the restarted learner to have deltas accepted again")


@pytest.mark.timeout(300)
def test_kill_9_of_an_owner_hands_the_fragment_to_a_replica_under_a_higher_term(fleet):
    f = fleet(log_level="info")  # (the survivors' log of the fragment goes into a failure's message)
    procs = [f.start(i, 100000) for i in range(3)]
    urls = [p.events("joined")[0]["url"] for p in procs]
    wait_until(lambda: all(int(fr["version"].split(".")[1]) >= 3 for fr in get_status(urls[0])["fragments"]),
               120, "three versions of every fragment")
    status = get_status(urls[0])
    by_peer = {get_status(u)["peer_id"]: i for i, u in enumerate(urls)}
    # a fragment owned by a learner other than the bootstrap one if there is one (any owner will do: the
    # survivors know each other through the DHT already), and its replica
    frag = next((fr for fr in status["fragments"] if by_peer[fr["roles"][0]] != 0), status["fragments"][0])
    owner_i, replica = by_peer[frag["roles"][0]], frag["roles"][1]
    p = frag["p"]
    seen: dict[int, list[tuple[int, int]]] = {i: [] for i in range(3) if i != owner_i}

    def record() -> None:
        for i in seen:
            v = get_status(urls[i])["fragments"][p]["version"]
            seen[i].append(tuple(int(x) for x in v.split(".")))

    record()
    term_before = max(v[-1][0] for v in seen.values())
    procs[owner_i].kill(signal.SIGKILL)

    def taken_over() -> bool:
        record()
        return all(v[-1][0] > term_before for v in seen.values())

    try:
        wait_until(taken_over, 90, f"fragment {p} to be published under a new term", poll=0.5)
    except AssertionError as e:
        views = {i: (get_status(urls[i])["fragments"][p], get_status(urls[i])["shard"]) for i in seen}
        raise AssertionError(f"{e}; versions seen {seen}; survivors' views {views}") from None
    # Member views may differ for a moment, so the replica that takes over is the survivors' choice; what must
    # hold is that it carries the momentum on (kept from replication, handed over, or pulled from a holder).
    survivors = [u for i, u in enumerate(urls) if i != owner_i]
    wait_until(lambda: len({get_status(u)["fragments"][p]["roles"][0] for u in survivors}) == 1, 30,
               "the survivors to agree on the new owner")
    new_owner = get_status(survivors[0])["fragments"][p]["roles"][0]
    assert new_owner != frag["roles"][0]
    owner_url = urls[by_peer[new_owner]]
    # The momentum comes along: kept from replication, handed over, pulled from a holder, or rebuilt from the
    # one replicated before and the kept update; never restarted from zero ("fresh"). A pull may take a moment.
    carried = ("replica", "handed over", "pulled", "rebuilt")
    try:
        wait_until(lambda: get_status(owner_url)["fragments"][p]["momentum"] in carried, 15,
                   f"the new owner to carry the momentum of fragment {p} on (not 'fresh')")
    except AssertionError as e:
        for i in seen:
            procs[i].read_available()
        logs = {i: [ln for ln in procs[i].lines if f"fragment {p}" in ln] for i in seen}
        raise AssertionError(f"{e}; the survivors' log of fragment {p}: {logs}") from None
    del replica
    for i, versions in seen.items():
        assert versions == sorted(versions), f"learner {i} saw fragment {p} regress: {versions}"


@pytest.mark.timeout(240)
def test_client_mode_learner_trains_and_never_owns_a_fragment(fleet):
    f = fleet()
    procs = [f.start(0, 200), f.start(1, 200)]
    light = f.start(2, 200, "--client-mode")
    assert light.events("joined")[0]["url"] == ""
    light_id = light.events("joined")[0]["peer_id"]
    urls = [p.events("joined")[0]["url"] for p in procs]
    roles_seen, members_seen = set(), set()
    while not light.events("done"):
        for url in urls:
            try:
                st = get_status(url)
            except OSError:
                continue  # finished already
            roles_seen |= {r for fr in st["fragments"] for r in fr["roles"]}
            members_seen |= {m["peer_id"] for m in st["members"]}
        assert light.popen.poll() is None or light.events("done"), "the client-mode learner died"
        time.sleep(0.5)
    assert light_id in members_seen, "the client-mode learner is a member the others see"
    assert light_id not in roles_seen, "a client-mode learner was given a fragment"
    summary = light.events("done")[0]
    assert summary["outer_steps"] == 0 and summary["shard"] == {}
    assert summary["eval_loss"] < 3.2 and summary["sync"].get("deltas_sent", 0) > 0
    assert any(int(v.split(".")[1]) > 0 for v in summary["versions"])
    for p in procs:
        p.wait_for(r'"event": "done"', timeout=120)

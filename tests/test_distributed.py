"""A learner of two DDP ranks (torchrun, gloo on the CPU) in a swarm with a single-process learner
(node/distributed.py): both ranks hold bit-identical parameters after every change the swarm makes, and both
learners' eval loss falls."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from diloco.node.checkpoint import load_latest
from diloco.node.tasks import evaluate

from .swarm_utils import LocalLearner, tiny_run, wait_until

WORKER = Path(__file__).resolve().parent / "_ddp_worker.py"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(*args: str, stderr=subprocess.STDOUT) -> subprocess.Popen:
    """Two ranks on this machine; `args`: a script and its arguments, or `-m MODULE ...`. A rank that crashes
    in native code prints its threads' Python stacks (faulthandler): `_crashes` finds them in its output."""
    return subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
         "--master-port", str(_free_port()), *args], stdout=subprocess.PIPE, stderr=stderr, text=True,
        env={**os.environ, "PYTHONFAULTHANDLER": "1"})


def _crashes(output: str) -> str:
    """The faulthandler reports in a torchrun's output (a rank's "Fatal Python error" and the stacks after it),
    which the end of a long output would not show: a crash's own words, before the other rank's traceback."""
    start = output.find("Fatal Python error")
    return output[start:start + 6000] + "\n...\n" if start >= 0 else ""


def _worker(spec: Path, peer: str, out: Path, steps: int, *mode: str) -> subprocess.Popen:
    return _torchrun(str(WORKER), str(spec), peer, str(out), str(steps), *mode)


def _swarm_of_one(tmp_path: Path, quorum: int) -> tuple[Path, LocalLearner]:
    """A run (saved as tmp_path/run.spec) opened by one single-process learner of this process."""
    genesis = tiny_run(quorum=quorum, inner_steps=10)
    spec = tmp_path / "run.spec"
    genesis.save(spec)
    return spec, LocalLearner(genesis, 0).start()


def _beside_a_single_process_learner(tmp_path: Path, steps: int, *mode: str) -> tuple[list[dict], float, float]:
    """The 2-rank worker trains `steps` steps in a swarm with a single-process learner of this process; returns
    the ranks' reports and the single learner's eval loss before and after."""
    spec, solo = _swarm_of_one(tmp_path, quorum=2)
    try:
        before = evaluate(solo.model, solo.task)
        proc = _worker(spec, solo.url, tmp_path, steps, *mode)
        while proc.poll() is None:
            solo.train(5)
        output = proc.stdout.read()
        assert proc.returncode == 0, _crashes(output) + output[-4000:]
        after = evaluate(solo.model, solo.task)
    finally:
        solo.learner.close()
    return [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in range(2)], before, after


@pytest.mark.timeout(300)
def test_a_two_rank_ddp_learner_and_a_single_process_learner_train_one_swarm(tmp_path):
    steps = 150
    ranks, before, after = _beside_a_single_process_learner(tmp_path, steps)
    assert ranks[0]["digests"] == ranks[1]["digests"], "the ranks' parameters differ after a change by the swarm"
    assert len(ranks[0]["digests"]) > 3, "the swarm never changed the DDP learner's parameters"
    assert ranks[0]["t"] == ranks[1]["t"] == steps
    assert ranks[0]["tokens"] == ranks[1]["tokens"] == steps * 2 * ranks[0]["tokens_per_batch"]
    assert min(ranks[0]["versions"]) >= 1
    for r in ranks:  # (it joined once the other had trained a while: it starts from the swarm's versions)
        assert r["eval_after"] < r["eval_before"]
    assert after < before - 0.5


@pytest.mark.timeout(300)
def test_a_two_rank_fsdp2_learner_trains_with_the_swarm_and_its_shards_hold_what_it_checkpointed(tmp_path):
    """FSDP2 (node/fsdp.py): rank 0 works on a full copy of θ and the ranks replay its writes on their shards;
    after `close` the θ the two shards make up is, bit for bit, the θ rank 0 checkpointed (every version
    the swarm sent, every step the ranks made)."""
    steps = 150
    ranks, before, after = _beside_a_single_process_learner(tmp_path, steps, "fsdp")
    for r in ranks:
        assert len({d for _, d in r["digests"]}) > 3, "the swarm never changed this rank's shard"
        assert r["t"] == steps and r["tokens"] == steps * 2 * r["tokens_per_batch"]
        assert r["eval_after"] < r["eval_before"]
    assert ranks[0]["digests"][0][1] != ranks[1]["digests"][0][1], "the ranks hold the same tensors: not sharded"
    assert min(ranks[0]["versions"]) >= 1
    ckpt = load_latest(tmp_path / "ckpt")
    assert ckpt is not None and ckpt.step == steps
    saved = hashlib.sha256()
    for name in sorted(ckpt.params):
        saved.update(ckpt.params[name].contiguous().view(torch.uint8).numpy())
    assert ranks[0]["closed_digest"] == ranks[1]["closed_digest"] == saved.hexdigest()
    assert after < before - 0.5


def _saved_optimizer_digest(ckpt) -> str:
    h = hashlib.sha256()
    for i in sorted(ckpt.optimizer["state"]):
        for key in sorted(ckpt.optimizer["state"][i]):
            h.update(ckpt.optimizer["state"][i][key].reshape(-1).contiguous().view(torch.uint8).numpy())
    return h.hexdigest()


@pytest.mark.timeout(300)
def test_a_relaunched_fsdp2_learner_resumes_its_inner_optimizer_state_from_rank_0s_checkpoint(tmp_path):
    """The sharded AdamW state is gathered into rank 0's checkpoint (whole, by parameter) and, when the learner
    comes back, every rank gets its shards of it: the optimizer state right after the second start is, bit for
    bit, the one the first run closed with."""
    spec, solo = _swarm_of_one(tmp_path, quorum=1)
    try:
        reports = []
        for steps in (60, 1):
            proc = _worker(spec, solo.url, tmp_path, steps, "fsdp")
            while proc.poll() is None:
                solo.train(5)
            output = proc.stdout.read()
            assert proc.returncode == 0, _crashes(output) + output[-4000:]
            reports.append(json.loads((tmp_path / "rank-0.json").read_text()))
            if steps == 60:
                ckpt = load_latest(tmp_path / "ckpt")
                assert ckpt is not None and ckpt.step == 60
                params = dict(solo.model.named_parameters())  # (the same model, whole)
                state = ckpt.optimizer["state"]
                assert len(state) == len(params) and all(
                    state[i]["exp_avg"].shape == p.shape for i, p in enumerate(params.values()))
                saved = _saved_optimizer_digest(ckpt)
    finally:
        solo.learner.close()
    first, second = reports
    assert first["closed_optimizer"] == saved, "rank 0's checkpoint does not hold the optimizer state the ranks had"
    assert second["started_optimizer"] == saved, "the relaunched ranks did not get the saved optimizer state back"
    assert second["t"] == 61


@pytest.mark.timeout(300)
def test_a_rank_killed_takes_its_learner_down_and_the_swarm_goes_on(tmp_path):
    spec, solo = _swarm_of_one(tmp_path, quorum=1)
    try:
        proc = _worker(spec, solo.url, tmp_path, 100_000)
        deadline = time.monotonic() + 120
        while not (tmp_path / "pid-1").exists() and proc.poll() is None and time.monotonic() < deadline:
            solo.train(5)
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        wait_until(lambda: len(solo.learner.swarm.members.live()) == 2, 20, "the DDP learner in the swarm")
        os.kill(int((tmp_path / "pid-1").read_text()), signal.SIGKILL)
        stopped = time.monotonic()
        while proc.poll() is None and time.monotonic() < stopped + 90:
            solo.train(5)
        assert proc.poll() is not None, "the job went on with a dead rank"
        assert proc.returncode != 0
        assert not any(p.is_file() for p in tmp_path.glob("rank-*.json")), "a rank finished as if nothing happened"
        wait_until(lambda: len(solo.learner.swarm.members.live()) == 1, 30, "the dead learner gone from the view")
        versions = list(solo.learner.labels)
        deadline = time.monotonic() + 30  # (alone after seeing others, an owner waits a member TTL: §6.5)
        while not all(b > a for a, b in zip(versions, solo.learner.labels, strict=True)):
            assert time.monotonic() < deadline, "the swarm stopped merging once the DDP learner died"
            solo.train(5)
    finally:
        solo.learner.close()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", [[], ["--fsdp"]], ids=["ddp", "fsdp"])
def test_join_under_torchrun_is_one_learner_of_two_ranks(tmp_path, layout):
    """`torchrun --nproc-per-node 2 -m diloco.node join [--fsdp] ...`: rank 0 alone speaks to the swarm and
    prints."""
    spec, solo = _swarm_of_one(tmp_path, quorum=2)
    try:
        proc = _torchrun("-m", "diloco.node", "join", *layout, "--spec", str(spec), "--peers", solo.url, "--listen",
                         "127.0.0.1:0", "--key", str(tmp_path / "key.pem"), "--steps", "80", "--json",
                         "--fast-membership", "--progress-every", "20", "--checkpoint-dir", str(tmp_path / "ckpt"),
                         "--checkpoint-every", "40", stderr=subprocess.PIPE)
        while proc.poll() is None:
            solo.train(5)
        out, err = proc.communicate()
        assert proc.returncode == 0, _crashes(err) + err[-4000:]
        wait_until(lambda: len(solo.learner.swarm.members.live()) == 1, 10, "the torchrun learner leaving")
    finally:
        solo.learner.close()
    events = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    kinds = [e["event"] for e in events]
    assert kinds.count("joined") == 1 and kinds.count("done") == 1, kinds  # one learner, not one per rank
    done = events[kinds.index("done")]
    assert done["ranks"] == 2 and done["steps"] == 80
    assert done["tokens"] == 80 * 2 * solo.task.tokens_per_batch
    assert any(int(v.split(".")[1]) >= 1 for v in done["versions"])
    assert any((tmp_path / "ckpt").glob("step-*")), "rank 0 wrote no checkpoint"


def _rank_pids(launcher: int) -> dict[int, int]:
    """RANK -> pid of the worker processes torchrun (pid `launcher`) started."""
    out = {}
    for child in Path(f"/proc/{launcher}/task/{launcher}/children").read_text().split():
        env = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
        ranks = [int(e[5:]) for e in env if e.startswith(b"RANK=")]
        if ranks:
            out[ranks[0]] = int(child)
    return out


@pytest.mark.timeout(300)
def test_a_torchrun_learner_whose_rank_was_killed_rejoins_as_the_same_one_learner(tmp_path):
    """kill -9 of rank 1 ends the job; relaunched with the same key and checkpoints, it resumes from rank 0's
    checkpoint as the same single member of the swarm."""
    spec, solo = _swarm_of_one(tmp_path, quorum=1)
    key, ckpt = tmp_path / "key.pem", tmp_path / "ckpt"

    def launch(steps: int, out: Path) -> subprocess.Popen:
        with out.open("w") as f:
            return subprocess.Popen(
                [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr",
                 "127.0.0.1", "--master-port", str(_free_port()), "-m", "diloco.node", "join", "--spec", str(spec),
                 "--peers", solo.url, "--listen", "127.0.0.1:0", "--key", str(key), "--steps", str(steps),
                 "--json", "--fast-membership", "--progress-every", "10", "--checkpoint-dir", str(ckpt),
                 "--checkpoint-every", "20"], stdout=f, stderr=subprocess.STDOUT, text=True)

    try:
        first = launch(0, tmp_path / "first.log")
        deadline = time.monotonic() + 120
        while not any(ckpt.glob("step-*")) and first.poll() is None:
            assert time.monotonic() < deadline, "no checkpoint from the torchrun learner"
            solo.train(5)
        assert first.poll() is None, (tmp_path / "first.log").read_text()[-3000:]
        from diloco.node.cli import load_identity
        me = load_identity(key).peer_id
        wait_until(lambda: me in {m.peer_id for m in solo.learner.swarm.members.live()}, 20, "the learner in view")
        os.kill(_rank_pids(first.pid)[1], signal.SIGKILL)
        stopped = time.monotonic()
        while first.poll() is None and time.monotonic() < stopped + 90:
            solo.train(5)
        assert first.poll() not in (None, 0), "the job went on with a dead rank"
        second = launch(60, tmp_path / "second.log")
        seen: set[int] = set()
        while second.poll() is None:
            solo.train(5)
            seen.add(len(solo.learner.swarm.members.live()))
        log = (tmp_path / "second.log").read_text()
        assert second.returncode == 0, _crashes(log) + log[-4000:]
    finally:
        solo.learner.close()
    events = [json.loads(line) for line in log.splitlines() if line.startswith("{")]
    joined = [e for e in events if e["event"] == "joined"]
    assert len(joined) == 1 and joined[0]["peer_id"] == me, joined
    assert joined[0]["step"] >= 20, "it did not resume from rank 0's checkpoint"
    assert max(seen) <= 2, "the relaunched ranks showed up as more than one learner"
    done = [e for e in events if e["event"] == "done"]
    assert done and done[0]["steps"] == 60 and done[0]["ranks"] == 2


@pytest.mark.timeout(300)
def test_sigterm_to_torchrun_drains_the_learner_of_two_ranks_and_it_exits_cleanly(tmp_path):
    """torchrun forwards SIGTERM to both ranks: they stop at the same step, rank 0 sends what is due, hands its
    fragments over, marks itself `left` and writes its final checkpoint at that step, both ranks exit 0."""
    spec, solo = _swarm_of_one(tmp_path, quorum=1)
    key, ckpt, out = tmp_path / "key.pem", tmp_path / "ckpt", tmp_path / "run.log"
    try:
        with out.open("w") as f:
            job = subprocess.Popen(
                [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr",
                 "127.0.0.1", "--master-port", str(_free_port()), "-m", "diloco.node", "join", "--spec", str(spec),
                 "--peers", solo.url, "--listen", "127.0.0.1:0", "--key", str(key), "--json",
                 "--fast-membership", "--progress-every", "5", "--checkpoint-dir", str(ckpt),
                 "--checkpoint-every", "1000", "--drain-s", "20"], stdout=f, stderr=subprocess.STDOUT, text=True)
        from diloco.node.cli import load_identity

        deadline = time.monotonic() + 120
        while not (key.exists() and load_identity(key).peer_id in
                   {m.peer_id for m in solo.learner.swarm.members.live()}) or '"progress"' not in out.read_text():
            assert job.poll() is None and time.monotonic() < deadline, out.read_text()[-3000:]
            solo.train(5)
        me = load_identity(key).peer_id
        job.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        while job.poll() is None and time.monotonic() < signalled + 60:
            solo.train(2)
        log = out.read_text()
        assert job.poll() is not None, "torchrun did not end after SIGTERM: " + log[-3000:]
        assert time.monotonic() - signalled < 30, "the drain outlasted --drain-s and torchrun's own wait"
        wait_until(lambda: me not in {m.peer_id for m in solo.learner.swarm.members.live()}, 20,
                   "the drained learner out of the solo's view")
    finally:
        solo.learner.close()
    events = [json.loads(line) for line in log.splitlines() if line.startswith("{")]
    drained = [e for e in events if e["event"] == "drained"]
    assert len(drained) == 1, log[-3000:]
    assert drained[0]["left"] and drained[0]["checkpoint"], drained
    done = [e for e in events if e["event"] == "done"]
    assert done and done[0]["ranks"] == 2
    assert load_latest(ckpt).step == done[0]["steps"], "the final checkpoint is not at the drained step"
    assert "second SIGTERM" not in log, "a rank took torchrun's forwarded signal for a second one"

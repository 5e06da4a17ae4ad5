"""A learner of two DDP ranks (torchrun, gloo on the CPU) in a swarm with a single-process learner
(node/distributed.py): both ranks hold bit-identical parameters after every change the swarm makes, and both
learners' eval loss falls."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from diloco.node.tasks import evaluate

from .swarm_utils import LocalLearner, tiny_run, wait_until

WORKER = Path(__file__).resolve().parent / "_ddp_worker.py"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(*args: str, stderr=subprocess.STDOUT) -> subprocess.Popen:
    """Two ranks on this machine; `args`: a script and its arguments, or `-m MODULE ...`."""
    return subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
         "--master-port", str(_free_port()), *args], stdout=subprocess.PIPE, stderr=stderr, text=True)


def _worker(spec: Path, peer: str, out: Path, steps: int) -> subprocess.Popen:
    return _torchrun(str(WORKER), str(spec), peer, str(out), str(steps))


def _swarm_of_one(tmp_path: Path, quorum: int) -> tuple[Path, LocalLearner]:
    """A run (saved as tmp_path/run.spec) opened by one single-process learner of this process."""
    genesis = tiny_run(quorum=quorum, inner_steps=10)
    spec = tmp_path / "run.spec"
    genesis.save(spec)
    return spec, LocalLearner(genesis, 0).start()


@pytest.mark.timeout(300)
def test_a_two_rank_ddp_learner_and_a_single_process_learner_train_one_swarm(tmp_path):
    spec, solo = _swarm_of_one(tmp_path, quorum=2)
    try:
        before = evaluate(solo.model, solo.task)
        steps = 150
        proc = _worker(spec, solo.url, tmp_path, steps)
        while proc.poll() is None:
            solo.train(5)
        output = proc.stdout.read()
        assert proc.returncode == 0, output[-4000:]
        after = evaluate(solo.model, solo.task)
    finally:
        solo.learner.close()
    ranks = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in range(2)]
    assert ranks[0]["digests"] == ranks[1]["digests"], "the ranks' parameters differ after a change by the swarm"
    assert len(ranks[0]["digests"]) > 3, "the swarm never changed the DDP learner's parameters"
    assert ranks[0]["t"] == ranks[1]["t"] == steps
    assert ranks[0]["tokens"] == ranks[1]["tokens"] == steps * 2 * ranks[0]["tokens_per_batch"]
    assert min(ranks[0]["versions"]) >= 1
    for r in ranks:  # (it joined once the other had trained a while: it starts from the swarm's versions)
        assert r["eval_after"] < r["eval_before"]
    assert after < before - 0.5


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
def test_join_under_torchrun_is_one_learner_of_two_ranks(tmp_path):
    """`torchrun --nproc-per-node 2 -m diloco.node join ...`: rank 0 alone speaks to the swarm and prints."""
    spec, solo = _swarm_of_one(tmp_path, quorum=2)
    try:
        proc = _torchrun("-m", "diloco.node", "join", "--spec", str(spec), "--peers", solo.url, "--listen",
                         "127.0.0.1:0", "--key", str(tmp_path / "key.pem"), "--steps", "80", "--json",
                         "--fast-membership", "--progress-every", "20", "--checkpoint-dir", str(tmp_path / "ckpt"),
                         "--checkpoint-every", "40", stderr=subprocess.PIPE)
        while proc.poll() is None:
            solo.train(5)
        out, err = proc.communicate()
        assert proc.returncode == 0, err[-4000:]
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

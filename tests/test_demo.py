"""`diloco-node demo`: a real two-learner swarm on localhost, end to end, and nothing left running after it."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

KEYS = {"peers", "final_loss", "eval_loss", "outer_steps", "goodput", "bytes_sent", "wall_s"}


def learners_of(workdir: Path) -> list[int]:
    """Pids of live `diloco.node.cli join` processes whose command line names `workdir` (our demo's only)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            state = (entry / "stat").read_text().rpartition(")")[2].split()[0]
        except OSError:
            continue
        cmd = b" ".join(argv).decode(errors="replace")
        if "diloco.node.cli" in cmd and " join " in cmd and str(workdir) in cmd and state != "Z":
            pids.append(int(entry.name))
    return pids


@pytest.fixture
def demo_workdir(tmp_path):
    workdir = tmp_path / "demo"
    yield workdir
    for pid in learners_of(workdir):  # never leave one behind, even when the test failed
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.mark.timeout(200)
def test_demo_two_learners_json_summary_and_no_survivors(demo_workdir):
    cmd = [sys.executable, "-m", "diloco.node.cli", "demo", "--peers", "2", "--steps", "120", "--inner-steps", "20",
           "--json", "--workdir", str(demo_workdir), "--timeout", "140"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=160)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)  # the demo stops its learners on SIGTERM
        try:
            out, err = proc.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        pytest.fail(f"demo did not finish within 160 s (waiting for both learners' 'done')\n{out[-3000:]}\n{err[-3000:]}")
    assert proc.returncode == 0, f"demo exited with {proc.returncode}\nstdout:\n{out[-3000:]}\nstderr:\n{err[-3000:]}"

    lines = out.strip().splitlines()
    summary = json.loads(lines[-1])
    assert set(summary) == KEYS, summary
    assert summary["peers"] == 2
    assert summary["eval_loss"] < math.log(64), summary  # better than a uniform guess over the 64 symbols
    assert summary["final_loss"] < math.log(64), summary
    assert summary["outer_steps"] > 0, summary
    assert 0 < summary["goodput"] <= 1, summary
    assert summary["bytes_sent"] > 0, summary
    assert summary["wall_s"] > 0, summary
    assert any(line.startswith("goodput:") for line in lines), "the human summary explains goodput"

    deadline = time.monotonic() + 5  # reaped by the demo before it exits; allow /proc a moment
    while learners_of(demo_workdir) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert learners_of(demo_workdir) == [], "a learner process survived the demo"

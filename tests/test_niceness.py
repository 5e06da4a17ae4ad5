"""The swarm's worker pool: every thread running, at the background priority, before its first job."""

from __future__ import annotations

import os
import threading
import time

import pytest

from diloco.node.niceness import BACKGROUND_NICE, started_workers


def _alive(prefix: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(prefix + "_") and t.is_alive()]


def test_every_worker_runs_at_the_background_priority_before_the_first_job():
    mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    pool = started_workers("nice-pool")
    try:
        threads = _alive("nice-pool")
        assert len(threads) == min(32, (os.cpu_count() or 1) + 4)
        for t in threads:
            assert os.getpriority(os.PRIO_PROCESS, t.native_id) == min(19, mine + BACKGROUND_NICE), t.name
        gate = threading.Barrier(len(threads) + 1, timeout=10)
        jobs = [pool.submit(gate.wait) for _ in threads]  # as many jobs at once as threads: none is started
        gate.wait()
        assert set(_alive("nice-pool")) == set(threads)
        for job in jobs:
            job.result(10)
    finally:
        pool.shutdown(wait=True)
    assert not _alive("nice-pool")


def test_a_thread_that_cannot_start_fails_the_pool_and_leaves_no_thread_waiting(monkeypatch):
    real, calls = threading.Thread.start, []

    def start(self: threading.Thread) -> None:
        calls.append(self.name)
        if len(calls) == 3:
            raise RuntimeError("can't start new thread")
        real(self)

    monkeypatch.setattr(threading.Thread, "start", start)
    with pytest.raises(RuntimeError, match="can't start new thread"):
        started_workers("broken-pool")
    monkeypatch.undo()
    deadline = time.monotonic() + 10
    while _alive("broken-pool") and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not _alive("broken-pool"), "the threads that did start must not wait on the barrier forever"

"""The swarm's threads yield the CPU to the training thread (Linux `nice`, which is per thread).

On a machine whose cores are all busy, a training step that wakes while the swarm's threads hold every core
waits for one of them to be preempted: that wait is the tail of the step-time distribution. The swarm's work
has deadlines of seconds, the step's of milliseconds, so the threads that do its heavy numeric work with the
GIL released (the event loop's worker threads, θ's summer and copier) run a few nice levels below the thread
that trains. The event loop itself does not: it runs Python, holding the GIL, and a loop preempted while it
holds it makes the training thread of its own process wait (README, Step latency and Hostile members: a
flooded learner kept more of its steps with its loop at the training thread's priority, and the step-latency
ratio did not suffer). Not an idle class, for the same reason.
"""

from __future__ import annotations

import concurrent.futures
import os
import threading

BACKGROUND_NICE = 5  # levels below the caller's: a weight of about a third of the training thread's when both run


def lower_this_thread(levels: int = BACKGROUND_NICE) -> None:
    """Lower the calling thread's scheduling priority by `levels` nice levels (at most to 19); a no-op where
    the platform has no per-thread nice or refuses it."""
    if levels <= 0 or not hasattr(os, "setpriority"):
        return
    tid = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + levels))
    except OSError:
        pass


def started_workers(prefix: str, timeout_s: float = 30.0) -> concurrent.futures.ThreadPoolExecutor:
    """A pool of worker threads at the background priority, every one of them running before the first job.
    A `ThreadPoolExecutor` starts a thread when a job finds none idle, and `Thread.start` waits until the new
    thread runs: during a join, whose downloads keep every core busy, that was ~4 ms (a scheduler tick) per
    thread, with the event loop blocked in the middle of the downloads (~12 ms of a ~120 ms join)."""
    threads = min(32, (os.cpu_count() or 1) + 4)  # (ThreadPoolExecutor's default size)
    pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix=prefix, initializer=lower_this_thread)
    gate = threading.Barrier(threads + 1, timeout=timeout_s)
    try:
        for _ in range(threads):  # each job holds its thread until all are running, so each submit starts one
            pool.submit(gate.wait)
        gate.wait()
    except BaseException:
        gate.abort()
        pool.shutdown(wait=False)
        raise
    return pool

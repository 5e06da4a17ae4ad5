"""Helpers for swarm tests: tiny runs, in-process learners, waiting with deadlines."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable

from diloco.coordinator.runspec import Genesis
from diloco.node.learner import Learner
from diloco.node.swarm import SwarmConfig
from diloco.node.train import new_run, task_of
from diloco.protocol.identity import Identity


def tiny_run(**fields) -> Genesis:
    defaults = dict(task="markov", inner_steps=10, fragments=4, quorum=2, codec="int8")
    return new_run(Identity.generate(), "test-run", **{**defaults, **fields})


def fast_config(peers: list[str] | None = None, **kw) -> SwarmConfig:
    # (`bootstrap_wait_s`: the test's learners, clients and hostile members all come from 127.0.0.1, and past
    # its connection-rate burst a peer closes that address's new connections: a join tries again meanwhile)
    fields = {"member_ttl_s": 4.0, "member_refresh_s": 1.0, "member_poll_s": 0.5, "watch_s": 1.0,
              "join_timeout_s": 60, "bootstrap_wait_s": 10.0, **kw}
    return SwarmConfig(peers=peers or [], **fields)


class LocalLearner:
    """A learner with its model, optimizer and data in this process (one swarm thread each)."""

    def __init__(self, genesis: Genesis, index: int, peers: list[str] | None = None, *,
                 learner_kw: dict | None = None, **cfg) -> None:
        """`cfg`: SwarmConfig fields over `fast_config`'s; `learner_kw`: more `Learner` arguments."""
        self.task = task_of(genesis.spec)
        self.model = self.task.build_model()
        self.opt = self.task.optimizer(self.model)
        self.learner = Learner(self.model, self.opt, genesis, config=fast_config(peers, **cfg), **(learner_kw or {}))
        self.batches = self.task.batches(learner=index)

    def start(self) -> LocalLearner:
        self.learner.start()
        return self

    @property
    def url(self) -> str:
        return self.learner.swarm.url

    def train(self, steps: int) -> float:
        loss = None
        for _ in range(steps):
            x, y = next(self.batches)
            _, loss = self.model(x, y)
            self.opt.zero_grad()
            loss.backward()
            self.opt.step()
            self.learner.step(tokens=x.numel(), loss=loss.item())
        return float(loss.detach())


def wait_until(cond: Callable[[], bool], timeout: float, what: str, poll: float = 0.1) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(poll)
    raise AssertionError(f"waited {timeout:.0f}s for {what}")


def urlopen_within_conn_rate(req: urllib.request.Request | str, timeout: float = 10, tries: int = 25):
    """`urllib.request.urlopen`, a new connection per request. Every test client shares 127.0.0.1 with the
    peers and hostile members of a test, and a peer closes a new connection unanswered past its address's
    connection-rate burst (protocol/limits.py: a client is expected to pool them): such a refusal is retried
    after a pause, as a bucket refills, up to `tries` times. A peer that is gone refuses the connection instead."""
    for _ in range(tries - 1):
        try:
            return urllib.request.urlopen(req, timeout=timeout)
        except urllib.error.HTTPError:
            raise
        except (ConnectionResetError, urllib.error.URLError) as e:
            if not isinstance(e, ConnectionResetError) and not isinstance(e.reason, ConnectionResetError):
                raise
            time.sleep(0.2)
    return urllib.request.urlopen(req, timeout=timeout)


def get_status(url: str) -> dict:
    with urlopen_within_conn_rate(url + "/v1/status", timeout=5) as r:
        return json.loads(r.read())

"""Helpers for swarm tests: tiny runs, in-process learners, waiting with deadlines."""

from __future__ import annotations

import json
import time
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
    fields = {"member_ttl_s": 4.0, "member_refresh_s": 1.0, "member_poll_s": 0.5, "watch_s": 1.0,
              "join_timeout_s": 60, **kw}
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


def get_status(url: str) -> dict:
    with urllib.request.urlopen(url + "/v1/status", timeout=5) as r:
        return json.loads(r.read())

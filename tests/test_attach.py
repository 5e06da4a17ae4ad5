"""`Learner.attach(optimizer)`: the user's loop stays as it was; an optimizer step post-hook calls `step`."""

from __future__ import annotations

import pytest

from .swarm_utils import LocalLearner, tiny_run, wait_until


class Attached(LocalLearner):
    """Trains with a plain PyTorch loop: no `learner.step()` in it."""

    def attach(self) -> None:
        self.last_loss: float | None = None
        self.handle = self.learner.attach(self.opt, tokens=lambda: self.tokens, loss=lambda: self.last_loss)

    def train(self, steps: int) -> float:
        for _ in range(steps):
            x, y = next(self.batches)
            _, loss = self.model(x, y)
            self.opt.zero_grad()
            loss.backward()
            self.tokens, self.last_loss = x.numel(), loss.item()
            self.opt.step()
        return self.last_loss


@pytest.fixture
def learners():
    made: list[LocalLearner] = []
    yield made
    for n in made:
        n.learner.close()


@pytest.mark.timeout(120)
def test_an_attached_learner_trains_in_a_swarm_with_its_loop_unchanged(learners):
    genesis = tiny_run(quorum=2)
    a = LocalLearner(genesis, 0).start()
    b = Attached(genesis, 1, [a.url]).start()
    learners += [a, b]
    b.attach()
    wait_until(lambda: all(len(n.learner.swarm.members.live()) == 2 for n in (a, b)), 20, "2 live members")
    first = b.train(1)
    assert b.learner.t == 1 and b.learner.tokens == b.tokens > 0
    assert b.learner.swarm.progress.loss == pytest.approx(first)
    for _ in range(3):
        a.train(10)
        b.train(10)
    assert b.learner.t == 31
    wait_until(lambda: all(v.version >= 1 for v in b.learner.labels), 30, "every fragment merged at the attached one")
    assert b.learner.sent_steps > 0, "the hook's steps never left as deltas"


def test_a_learner_attaches_once_and_a_removed_hook_no_longer_steps():
    genesis = tiny_run(quorum=1)
    n = Attached(genesis, 0)
    n.learner.start()
    try:
        n.attach()
        with pytest.raises(RuntimeError, match="already attached"):
            n.learner.attach(tokens=1)
        n.train(2)
        assert n.learner.t == 2
        n.handle.remove()
        n.train(2)
        assert n.learner.t == 2, "a removed hook still calls step()"
        with n.learner.attach(tokens=5):  # attachable again; the with block removes it
            n.opt.step()
        n.opt.step()
        assert n.learner.t == 3 and n.learner.tokens == 2 * n.tokens + 5
        with pytest.raises(ValueError):
            n.learner.attach(tokens=-1)
    finally:
        n.learner.close()

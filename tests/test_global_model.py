"""`Learner.global_model()`: the model assembled from a learner's anchors (what the convergence benchmark
evaluates as the global model), not its live copy."""

import pytest
import torch

from diloco.node.tasks import evaluate

from .swarm_utils import LocalLearner, tiny_run, wait_until


@pytest.fixture
def pair():
    genesis = tiny_run(fragments=4, quorum=2, inner_steps=10)
    first = LocalLearner(genesis, 0).start()
    learners = [first]
    try:
        learners.append(LocalLearner(genesis, 1, peers=[first.url]).start())
        yield learners
    finally:
        for ll in learners:
            ll.learner.close()


def _consistent_copy(ll: LocalLearner) -> tuple[torch.nn.Module, list[torch.Tensor]]:
    """The global model and the store's anchors, taken while no version arrived in between."""
    store = ll.learner.swarm.store
    for _ in range(200):
        before = ll.learner.labels
        model = ll.learner.global_model()
        anchors = [store.snapshot(p)[0] for p in range(len(store))]
        if ll.learner.labels == before:
            return model, anchors
    raise AssertionError("the anchors kept moving while the global model was assembled")


@pytest.mark.timeout(120)
def test_the_global_model_holds_exactly_the_anchors_and_leaves_the_live_model_alone(pair):
    wait_until(lambda: all(len(ll.learner.swarm.members.live()) == 2 for ll in pair), 20, "2 live members")
    for _ in range(4):
        for ll in pair:
            ll.train(10)
    wait_until(lambda: all(v.version > 0 for v in pair[0].learner.labels), 30, "a new version of every fragment")
    for ll in pair:
        ll.train(3)  # local steps not merged: the live model is off its anchors now
    ll = pair[0]
    live = {n: t.detach().clone() for n, t in ll.model.named_parameters()}
    model, anchors = _consistent_copy(ll)
    plan, params = ll.learner.plan, dict(model.named_parameters())
    for p, anchor in enumerate(anchors):
        assert torch.equal(plan.flatten(p, params), anchor), f"fragment {p} of the global model is not its anchor"
    live_params = dict(ll.model.named_parameters())
    assert all(torch.equal(live[n], t) for n, t in live_params.items()), "the live model was changed"
    assert any(not torch.equal(plan.flatten(p, live_params), a) for p, a in enumerate(anchors)), \
        "the live model equals the anchors: this test would not tell them apart"
    assert model is not ll.model and all(params[n] is not live_params[n] for n in params)
    assert evaluate(model, ll.task) > 0  # an ordinary model: it runs


def test_the_global_model_needs_a_started_learner():
    ll = LocalLearner(tiny_run(), 0)
    with pytest.raises(RuntimeError, match="start"):
        ll.learner.global_model()

import threading

import pytest
import torch

from diloco.coordinator.outer import OuterOptimizer
from diloco.coordinator.owner import FragmentOwner, OwnerSettings, PendingDelta
from diloco.coordinator.version import GENESIS, Version
from diloco.protocol.codecs import get_codec
from diloco.protocol.errors import Malformed, StaleVersion

N = 64
CODEC = get_codec("fp32")


def owner(**kw) -> FragmentOwner:
    settings = OwnerSettings(**{"quorum": 2, "max_staleness": 2, **kw})
    return FragmentOwner(0, N, 0, CODEC, OuterOptimizer(0.7, 0.9), settings, term=3, learners={"a", "b"})


def delta(learner: str, value: float, base=GENESIS, tokens=100, steps=10, codec=CODEC) -> PendingDelta:
    meta, payload = codec.encode(torch.full((N,), value) + torch.linspace(0, value, N))
    return PendingDelta(learner, base, steps, tokens, meta, payload)


def test_round_is_ready_when_every_live_learner_reported():
    o = owner()
    o.offer(delta("a", 1.0), GENESIS)
    assert not o.ready()
    o.offer(delta("b", 1.0), GENESIS)
    assert o.ready()


def test_outer_step_publishes_the_next_version_of_this_term_and_equals_sgd_nesterov():
    o = owner()
    o.offer(delta("a", 1.0), GENESIS)
    o.offer(delta("b", 1.0), GENESIS)
    pub = o.step(o.take_round(), GENESIS)
    assert pub.base == GENESIS and pub.new == Version(3, 1) and sorted(pub.learners) == ["a", "b"]
    # equal deltas merge (RDA) to that delta; the first Nesterov step is Θ − lr·(Δ + μΔ)
    assert torch.allclose(pub.update, -0.7 * 1.9 * (torch.ones(N) + torch.linspace(0, 1, N)))


def test_deltas_too_stale_are_refused_and_counted():
    o = owner()
    with pytest.raises(StaleVersion):
        o.offer(delta("a", 1.0, base=Version(0, 1)), Version(0, 4))
    assert o.dropped["stale"] == 1 and not o.pending


def test_a_second_delta_of_a_learner_replaces_its_first_in_the_round():
    o = owner()
    o.offer(delta("a", 1.0), GENESIS)
    o.offer(delta("a", 2.0), GENESIS)
    assert len(o.pending) == 1 and o.dropped["duplicate"] == 1


def test_non_finite_or_misshapen_deltas_are_refused_on_arrival():
    o = owner()
    meta, payload = CODEC.encode(torch.ones(N - 1))
    with pytest.raises(Malformed):
        o.offer(PendingDelta("a", GENESIS, 1, 1, meta, payload), GENESIS)
    bad = bytearray(CODEC.encode(torch.ones(N))[1])
    bad[0:4] = torch.tensor([float("nan")]).numpy().tobytes()
    with pytest.raises(Malformed):
        o.offer(PendingDelta("a", GENESIS, 1, 1, {"codec": "fp32", "shape": [N]}, bytes(bad)), GENESIS)
    assert not o.pending


def test_deltas_arriving_during_a_step_belong_to_the_next_round():
    o = owner()
    o.offer(delta("a", 1.0), GENESIS)
    batch = o.take_round()
    o.offer(delta("b", 1.0), GENESIS)
    o.step(batch, GENESIS)
    assert list(o.pending) == ["b"]


def test_error_feedback_keeps_what_the_codec_dropped_from_the_update():
    int4 = get_codec("int4")
    o = FragmentOwner(0, N, 0, int4, OuterOptimizer(0.7, 0.9), OwnerSettings(quorum=1), term=0, learners={"a"})
    anchor = torch.zeros(N)
    for _ in range(3):
        o.offer(delta("a", 0.01 * (1 + torch.rand(1).item()), codec=int4), GENESIS)
        pub = o.step(o.take_round(), GENESIS)
        o.commit(pub)
        assert o.residual is not None and o.residual.decode(N).abs().max() > 0
        assert len(o.residual.payload) < 4 * N  # kept compressed
        anchor += pub.update


def committed_owner(codec=None) -> FragmentOwner:
    """An owner with int4 (lossy: a residual) that has committed one round, so it holds momentum and residual."""
    codec = codec or get_codec("int4")
    o = FragmentOwner(0, N, 0, codec, OuterOptimizer(0.7, 0.9), OwnerSettings(quorum=2), term=3,
                      learners={"a", "b"})
    o.offer(delta("a", 1.0, codec=codec), GENESIS)
    o.offer(delta("b", 0.5, codec=codec), GENESIS)
    o.commit(o.step(o.take_round(), GENESIS))
    assert o.momentum is not None and o.residual is not None and o.label == Version(3, 1)
    return o


def test_an_outer_step_changes_no_owner_state_until_its_version_is_committed():
    int4 = get_codec("int4")
    o = committed_owner(int4)
    momentum, residual = o.momentum.clone(), bytes(o.residual.payload)
    o.offer(delta("a", 2.0, base=Version(3, 1), codec=int4), Version(3, 1))
    o.offer(delta("b", 1.0, base=Version(3, 1), codec=int4), Version(3, 1))
    pub = o.step(o.take_round(), Version(3, 1))
    assert torch.equal(o.momentum, momentum), "the step wrote the owner's momentum before the version existed"
    assert bytes(o.residual.payload) == residual and o.label == Version(3, 1)
    assert not torch.equal(pub.momentum, momentum)
    o.commit(pub)
    assert o.momentum is pub.momentum and o.residual is pub.residual and o.label == Version(3, 2)


def test_an_abandoned_round_leaves_the_owner_as_it_was_and_its_deltas_go_to_the_next_round():
    int4 = get_codec("int4")
    o = committed_owner(int4)
    momentum, residual = o.momentum.clone(), bytes(o.residual.payload)
    a, b = delta("a", 2.0, base=Version(3, 1), codec=int4), delta("b", 1.0, base=Version(3, 1), codec=int4)
    o.offer(a, Version(3, 1))
    o.offer(b, Version(3, 1))
    batch = o.take_round()
    pub = o.step(batch, Version(3, 1))
    newer_b = delta("b", 3.0, base=Version(3, 1), codec=int4)
    o.offer(newer_b, Version(3, 1))  # b sent again while the round was out: its newer delta stands
    assert o.abandon(pub, batch, requeue=True) == 1
    assert torch.equal(o.momentum, momentum) and bytes(o.residual.payload) == residual
    assert o.pending == {"a": a, "b": newer_b} and o.ready()
    again = o.step(o.take_round(), Version(3, 1))  # the same round, redone from the committed state
    assert again.new == Version(3, 2) and sorted(again.learners) == ["a", "b"]
    o.offer(a, Version(3, 1))
    assert o.abandon(again, o.take_round(), requeue=False) == 1 and o.dropped["abandoned"] == 2
    assert not o.pending


class PausingCodec:
    """The run's codec, stopping inside the step's encode (after the momentum is computed) until released."""

    def __init__(self, codec) -> None:
        self.codec, self.name = codec, codec.name
        self.inside, self.release = threading.Event(), threading.Event()

    def encode_update(self, tensor, merged):
        self.inside.set()
        assert self.release.wait(10), "the test never released the step"
        return self.codec.encode_update(tensor, merged)

    def __getattr__(self, name):
        return getattr(self.codec, name)


def test_what_a_hand_over_reads_during_a_step_is_the_committed_momentum():
    int4 = get_codec("int4")
    o = committed_owner(int4)
    committed = o.momentum.clone()
    o.offer(delta("a", 2.0, base=Version(3, 1), codec=int4), Version(3, 1))
    o.offer(delta("b", 1.0, base=Version(3, 1), codec=int4), Version(3, 1))
    o.codec = pausing = PausingCodec(int4)
    worker = threading.Thread(target=o.step, args=(o.take_round(), Version(3, 1)))
    worker.start()
    try:
        assert pausing.inside.wait(10), "the step never reached its encode"
        handed = o.momentum.clone()  # what Shard._release sends while the step runs in its worker thread
    finally:
        pausing.release.set()
        worker.join(10)
    assert torch.equal(handed, committed), "a hand-over during a step carried a momentum no version has"


def test_a_delta_claiming_more_tokens_than_its_steps_allow_is_refused_and_counted():
    o = owner(max_tokens_per_step=100)
    o.offer(delta("a", 1.0, tokens=1000, steps=10), GENESIS)  # 100 per step: at the bound
    with pytest.raises(Malformed, match="claims"):
        o.offer(delta("b", 1.0, tokens=1001, steps=10), GENESIS)
    assert o.dropped["claims"] == 1 and set(o.pending) == {"a"}


def test_the_clipping_reference_is_committed_with_the_version_and_clips_a_huge_delta_at_quorum_two():
    o = owner()
    current = GENESIS
    for _ in range(2):  # two honest rounds, published
        o.offer(delta("a", 1.0, base=current), current)
        o.offer(delta("b", 1.1, base=current), current)
        pub = o.step(o.take_round(), current)
        o.commit(pub)
        current = pub.new
    assert len(o.norms) == 4
    o.offer(delta("a", 1.0, base=current), current)
    o.offer(delta("b", 1000.0, base=current), current)
    batch = o.take_round()
    pub = o.step(batch, current)
    honest = float((torch.full((N,), 1.0) + torch.linspace(0, 1.0, N)).norm())
    assert max(pub.norms) <= 3.0 * 1.1 * honest  # clipped to 3× the median of the recent norms
    before = list(o.norms)
    o.abandon(pub, batch, requeue=False)
    assert list(o.norms) == before  # a round that is not published leaves the reference as it was


def test_an_owner_holds_one_momentum_between_rounds_and_gives_every_step_buffer_back():
    """An owner's fp32 buffers come from the swarm's pool: between rounds it holds its committed momentum only
    (no spare kept for the next step, 4 B/param per owned fragment), and a committed or abandoned round gives
    the replaced momentum and the step's work buffers back."""
    from diloco.coordinator.buffers import BufferPool

    int4 = get_codec("int4")
    pool = BufferPool(N, keep=8)
    o = FragmentOwner(0, N, 0, int4, OuterOptimizer(0.7, 0.9), OwnerSettings(quorum=2), term=3,
                      learners={"a", "b"}, pool=pool)
    label = GENESIS
    for value in (1.0, 2.0, 3.0):
        o.offer(delta("a", value, base=label, codec=int4), label)
        o.offer(delta("b", value / 2, base=label, codec=int4), label)
        pub = o.step(o.take_round(), label)
        assert pool.lent() == 3 - (label == GENESIS)  # the step's momentum and update, and the committed momentum
        o.commit(pub)
        pool.give(pub.update)  # (the shard's, once the version is in the store)
        label = pub.new
        assert pool.lent() == 1 and pool.lends(o.momentum), "an owner between rounds holds its momentum only"
        assert [k for k, v in vars(o).items() if isinstance(v, torch.Tensor)] == ["momentum"]
    committed = o.momentum.clone()
    o.offer(delta("a", 4.0, base=label, codec=int4), label)
    o.offer(delta("b", 2.0, base=label, codec=int4), label)
    batch = o.take_round()
    pub = o.step(batch, label)
    o.abandon(pub, batch, requeue=True)
    pool.give(pub.update)
    assert pool.lent() == 1 and torch.equal(o.momentum, committed)

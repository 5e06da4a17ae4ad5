"""The outer optimizer is torch.optim.SGD(nesterov=True) with the merged delta as the gradient."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from diloco.coordinator.outer import OuterOptimizer, export_state, import_state
from diloco.protocol.errors import Malformed

torch.set_num_threads(1)


def torch_sgd_trajectory(theta0, deltas, lr, momentum, nesterov):
    param = torch.nn.Parameter(theta0.clone())
    opt = torch.optim.SGD([param], lr=lr, momentum=momentum, nesterov=nesterov)
    out = []
    for d in deltas:
        param.grad = d.clone()
        opt.step()
        out.append(param.detach().clone())
    return out, opt.state[param].get("momentum_buffer")


def sgd_case(seed, lr, momentum, nesterov):
    """Θ⁽⁰⁾ and 6 deltas from `seed`, with torch's SGD trajectory and final momentum for them."""
    g = torch.Generator().manual_seed(seed)
    theta0 = torch.randn(257, generator=g)
    deltas = [torch.randn(257, generator=g) * 0.01 for _ in range(6)]
    return theta0, deltas, *torch_sgd_trajectory(theta0, deltas, lr, momentum, nesterov)


@pytest.mark.parametrize(
    ("lr", "momentum", "nesterov"), [(0.7, 0.9, True), (0.3, 0.5, True), (1.0, 0.9, False)]
)
def test_outer_step_equals_torch_sgd_over_several_steps(lr, momentum, nesterov):
    theta0, deltas, expected, expected_buf = sgd_case(0, lr, momentum, nesterov)
    outer = OuterOptimizer(lr=lr, momentum=momentum, nesterov=nesterov)
    theta, buf = theta0, None
    for d, want in zip(deltas, expected, strict=True):
        theta, buf = outer.step(theta, d, buf)
        assert torch.equal(theta, want)  # same ops in the same order: the same bits
    assert torch.equal(buf, expected_buf)


@pytest.mark.parametrize(
    ("lr", "momentum", "nesterov"), [(0.7, 0.9, True), (0.3, 0.5, True), (1.0, 0.9, False), (0.5, 0.0, False)]
)
def test_the_owners_in_place_update_follows_torch_sgd(lr, momentum, nesterov):
    theta0, deltas, expected, expected_buf = sgd_case(1, lr, momentum, nesterov)
    outer = OuterOptimizer(lr=lr, momentum=momentum, nesterov=nesterov)
    theta, buf = theta0.clone(), None
    for d, want in zip(deltas, expected, strict=True):
        work = d.clone()
        kept = None if buf is None else buf.clone()
        spare = torch.empty_like(d)
        new = outer.update_into(work, buf, out=spare)  # work is now U = Θ' − Θ
        assert new is None or new is spare, "the new momentum goes into the buffer given"
        assert kept is None or torch.equal(buf, kept), "the momentum read is left as it was"
        buf = new
        theta += work
        assert torch.allclose(theta, want, rtol=0, atol=1e-6)  # U directly: rounding differs, not the step
    if momentum:
        assert torch.allclose(buf, expected_buf, rtol=0, atol=1e-7)
    else:
        assert buf is None and expected_buf is None


@pytest.mark.parametrize(("lr", "momentum", "nesterov"), [(0.7, 0.9, True), (0.3, 0.5, True), (1.0, 0.9, False)])
def test_a_missed_momentum_is_rebuilt_from_the_one_before_and_the_published_update(lr, momentum, nesterov):
    _, deltas, _, _ = sgd_case(2, lr, momentum, nesterov)
    outer = OuterOptimizer(lr=lr, momentum=momentum, nesterov=nesterov)
    buf = None
    for d in deltas:
        before = None if buf is None else buf.clone()  # what the replica holds from the last replication
        update = d.clone()
        buf = outer.update_into(update, buf)  # the owner's step; `update` is what every holder receives
        rebuilt = outer.momentum_after(before, update)
        assert torch.allclose(rebuilt, buf, rtol=0, atol=1e-6)


def test_plain_sgd_without_momentum_is_theta_minus_lr_delta():
    outer = OuterOptimizer(lr=0.5, momentum=0.0, nesterov=False)
    theta, buf = outer.step(torch.ones(3), torch.tensor([1.0, 2.0, 4.0]))
    torch.testing.assert_close(theta, torch.tensor([0.5, 0.0, -1.0]))
    assert buf is None


def test_first_nesterov_step_moves_by_lr_times_one_plus_momentum():
    theta, buf = OuterOptimizer(lr=0.7, momentum=0.9).step(torch.zeros(2), torch.ones(2))
    torch.testing.assert_close(theta, torch.full((2,), -0.7 * 1.9))
    torch.testing.assert_close(buf, torch.ones(2))


def test_step_never_mutates_its_inputs():
    theta, delta, buf = torch.ones(4), torch.full((4,), 0.5), torch.full((4,), 0.25)
    OuterOptimizer().step(theta, delta, buf)
    assert torch.equal(theta, torch.ones(4))
    assert torch.equal(delta, torch.full((4,), 0.5))
    assert torch.equal(buf, torch.full((4,), 0.25))


def test_state_round_trip_continues_the_same_trajectory():
    g = torch.Generator().manual_seed(1)
    theta0 = torch.randn(64, generator=g)
    deltas = [torch.randn(64, generator=g) for _ in range(4)]
    outer = OuterOptimizer()
    theta, buf = theta0, None
    for d in deltas:
        theta, buf = outer.step(theta, d, buf)
    # Replica: takes the exported state after two steps and continues.
    theta_r, buf_r = theta0, None
    for d in deltas[:2]:
        theta_r, buf_r = outer.step(theta_r, d, buf_r)
    buf_r = import_state(export_state(buf_r), numel=64)
    for d in deltas[2:]:
        theta_r, buf_r = outer.step(theta_r, d, buf_r)
    assert torch.equal(theta_r, theta)
    assert torch.equal(buf_r, buf)


def test_empty_state_round_trips_to_a_fresh_buffer():
    assert export_state(None) == {}
    assert import_state({}, numel=8) is None


@pytest.mark.parametrize(
    "state",
    [
        {"momentum": torch.ones(7)},
        {"momentum": torch.ones(8, dtype=torch.float64)},
        {"momentum": torch.full((8,), float("nan"))},
        {"momentum": torch.ones(8), "extra": torch.ones(1)},
    ],
)
def test_imported_state_is_checked(state):
    with pytest.raises(Malformed):
        import_state(state, numel=8)


def test_bad_hyperparameters_are_refused():
    for kwargs in ({"lr": 0.0}, {"momentum": 1.0}, {"momentum": 0.0, "nesterov": True}):
        with pytest.raises(ValueError):
            OuterOptimizer(**kwargs)


@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("in_place", [False, True])
def test_the_owners_step_rounds_each_operation_on_its_own(nesterov, in_place):
    # the one-pass kernel must give, bit for bit, b = μ·m + Δ and U = −lr·(Δ + μ·b) (or −lr·b) computed one
    # float32 operation at a time, whatever the CPU: what another replica recomputes
    g = torch.Generator().manual_seed(3)
    m, d = torch.randn(10_001, generator=g), torch.randn(10_001, generator=g) * 1e-3
    mu, neg_lr = np.float32(0.9), np.float32(-0.7)
    want_b = mu * m.numpy() + d.numpy()
    want_u = neg_lr * (d.numpy() + mu * want_b) if nesterov else neg_lr * want_b
    outer = OuterOptimizer(lr=0.7, momentum=0.9, nesterov=nesterov)
    kept = m.clone()
    out = m if in_place else torch.empty_like(m)
    new = outer.update_into(d, m, out=out)
    assert new is out
    assert np.array_equal(new.numpy(), want_b)
    assert np.array_equal(d.numpy(), want_u)
    assert in_place or torch.equal(m, kept), "the momentum read is left as it was"


def test_buffers_the_kernel_cannot_take_get_the_same_step():
    # float64 and a strided view: torch's ops, the same step to rounding
    g = torch.Generator().manual_seed(4)
    m, d = torch.randn(64, generator=g), torch.randn(64, generator=g)
    outer = OuterOptimizer(lr=0.7, momentum=0.9, nesterov=True)
    want_u = d.clone()
    want_b = outer.update_into(want_u, m.clone())
    for case in ("float64", "strided"):
        mm, dd = (m.double(), d.double()) if case == "float64" else (m.repeat_interleave(2)[::2], d.clone())
        b = outer.update_into(dd, mm)
        assert torch.allclose(b.float(), want_b, rtol=0, atol=1e-6), case
        assert torch.allclose(dd.float(), want_u, rtol=0, atol=1e-6), case

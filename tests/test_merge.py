"""The merge rule (docs/architecture.md §6.2) against its formulas, written out directly in fp64."""

from __future__ import annotations

import math

import pytest
import torch

from diloco.coordinator.merge import (
    Contribution,
    InvalidContribution,
    NonFiniteDelta,
    capped_shares,
    drop_stale,
    merge,
    token_weight,
    validate,
)
from diloco.protocol.errors import Malformed

torch.set_num_threads(1)


def phi(x: torch.Tensor) -> torch.Tensor:
    n = x.norm()
    return x / n if n > 0 else torch.zeros_like(x)


def direct_rda(deltas, w):
    """(Σ w_m‖Δ_m‖ / Σ w_m) · φ(Σ w_m φ(Δ_m) / Σ w_m), in fp64."""
    deltas = [d.double() for d in deltas]
    w = torch.tensor(w, dtype=torch.float64)
    radius = sum(wm * d.norm() for wm, d in zip(w, deltas, strict=True)) / w.sum()
    return radius * phi(sum(wm * phi(d) for wm, d in zip(w, deltas, strict=True)) / w.sum())


def contributions(deltas, tokens=None, steps=None, staleness=None):
    n = len(deltas)
    tokens = tokens or [1000] * n
    steps = steps or [10] * n
    staleness = staleness or [0] * n
    return [
        Contribution(d, t, s, st, f"l{i}")
        for i, (d, t, s, st) in enumerate(zip(deltas, tokens, steps, staleness, strict=True))
    ]


@pytest.mark.parametrize("M", [2, 4, 8])
def test_rda_norm_independent_of_learner_count(M):
    # M orthogonal deltas of norm 2: the plain mean has norm 2/√M, RDA keeps 2.
    deltas = [2.0 * torch.eye(8)[m] for m in range(M)]
    out = merge(contributions(deltas), is_embedding=False).delta
    assert out.norm().item() == pytest.approx(2.0, rel=1e-6)
    mean = merge(contributions(deltas), is_embedding=True).delta
    assert mean.norm().item() == pytest.approx(2 / math.sqrt(M))


def test_rda_equals_its_formula_on_random_data():
    g = torch.Generator().manual_seed(0)
    deltas = [torch.randn(1000, generator=g) * (1 + m) for m in range(5)]
    tokens, steps, staleness = [800, 1200, 500, 3000, 1000], [10, 12, 5, 30, 8], [0, 1, 0, 2, 0]
    w = [token_weight(t, s, st) for t, s, st in zip(tokens, steps, staleness, strict=True)]
    result = merge(contributions(deltas, tokens, steps, staleness), is_embedding=False, clip_c=100.0)
    assert result.delta.dtype == torch.float32
    torch.testing.assert_close(result.delta.double(), direct_rda(deltas, w), rtol=1e-5, atol=1e-6)
    assert result.clipped == 0


def test_embedding_fragment_is_weighted_mean():
    g = torch.Generator().manual_seed(1)
    deltas = [torch.randn(500, generator=g) for _ in range(4)]
    tokens, steps = [100, 400, 200, 300], [1, 4, 2, 5]
    w = torch.tensor([t * (t / s) for t, s in zip(tokens, steps, strict=True)], dtype=torch.float64)
    expected = sum(wm * d.double() for wm, d in zip(w, deltas, strict=True)) / w.sum()
    out = merge(contributions(deltas, tokens, steps), is_embedding=True).delta
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-6)


def test_mixed_fragment_uses_weighted_mean_on_the_embedding_prefix_and_rda_on_the_rest():
    g = torch.Generator().manual_seed(4)
    deltas = [torch.randn(300, generator=g) for _ in range(3)]
    tokens, steps = [100, 300, 200], [2, 3, 4]
    w = [token_weight(t, s) for t, s in zip(tokens, steps, strict=True)]
    out = merge(contributions(deltas, tokens, steps), embedding_numel=100, clip_c=100.0).delta
    mean = sum(wm * d[:100].double() for wm, d in zip(w, deltas, strict=True)) / sum(w)
    torch.testing.assert_close(out[:100].double(), mean, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(
        out[100:].double(), direct_rda([d[100:] for d in deltas], w), rtol=1e-5, atol=1e-6
    )
    with pytest.raises(ValueError):
        merge(contributions(deltas), embedding_numel=301)


def test_weight_is_tokens_times_tokens_per_step_discounted_by_staleness():
    assert token_weight(tokens=1000, steps=10, staleness=0) == 1000 * 100
    assert token_weight(tokens=1000, steps=10, staleness=3) == 1000 * 100 / 4
    # Same tokens in half the steps (twice the batch) counts twice as much.
    assert token_weight(1000, 5) == 2 * token_weight(1000, 10)
    cs = contributions([torch.ones(3)] * 3, tokens=[100, 100, 200], steps=[1, 1, 1], staleness=[0, 1, 0])
    result = merge(cs, is_embedding=True)
    assert result.weights == pytest.approx([1e4 / 5.5e4, 5e3 / 5.5e4, 4e4 / 5.5e4])
    assert result.total_tokens == 400


def test_weighted_mean_follows_the_weights():
    deltas = [torch.zeros(4), torch.ones(4)]
    # weights 1·1 and 3·3 → mean 9/10
    out = merge(contributions(deltas, tokens=[1, 3], steps=[1, 1]), is_embedding=True).delta
    torch.testing.assert_close(out, torch.full((4,), 0.9))


def test_norms_above_c_times_median_are_clipped_to_it():
    base = [torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0]), torch.tensor([1.0, 1.0]) / math.sqrt(2)]
    outlier = torch.tensor([30.0, 40.0])  # norm 50, median of norms is 1
    result = merge(contributions([*base, outlier]), is_embedding=True, clip_c=3.0)
    assert result.clipped == 1
    clipped = outlier * (3.0 / 50.0)
    torch.testing.assert_close(result.delta, (sum(base) + clipped) / 4)
    # RDA: the clipped delta keeps its direction and enters the radius with norm 3.
    rda = merge(contributions([*base, outlier]), is_embedding=False, clip_c=3.0).delta
    torch.testing.assert_close(rda.double(), direct_rda([*base, clipped], [1.0] * 4).to(torch.float64))
    assert rda.norm().item() == pytest.approx((1 + 1 + 1 + 3) / 4)


def test_norms_at_or_below_c_times_median_are_untouched():
    deltas = [torch.tensor([1.0]), torch.tensor([2.0]), torch.tensor([6.0])]  # median 2, 6 = 3·2
    result = merge(contributions(deltas), is_embedding=True)
    assert result.clipped == 0
    torch.testing.assert_close(result.delta, torch.tensor([3.0]))


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_delta_is_refused(bad):
    d = torch.ones(10)
    d[3] = bad
    c = Contribution(d, 10, 1, 0, "mallory")
    with pytest.raises(NonFiniteDelta, match="mallory"):
        validate(c)
    with pytest.raises(NonFiniteDelta):
        merge([Contribution(torch.ones(10), 10, 1), c], is_embedding=False)


def test_refusals_are_typed_value_errors_with_status_400():
    d = torch.ones(4)
    d[0] = math.nan
    with pytest.raises(ValueError) as info:
        validate(Contribution(d, 1, 1))
    assert isinstance(info.value, Malformed) and info.value.status == 400


@pytest.mark.parametrize(
    "c",
    [
        Contribution(torch.ones(4), 0, 1),
        Contribution(torch.ones(4), 1, 0),
        Contribution(torch.ones(4), 1, 1, -1),
        Contribution(torch.ones(2, 2), 1, 1),
        Contribution(torch.ones(4, dtype=torch.int64), 1, 1),
    ],
)
def test_bad_counters_or_shapes_are_refused(c):
    with pytest.raises(InvalidContribution):
        validate(c)


def test_deltas_of_different_sizes_are_refused():
    with pytest.raises(InvalidContribution, match="elements"):
        merge(contributions([torch.ones(4), torch.ones(5)]), is_embedding=False)


def test_phi_of_zero_is_zero_so_all_zero_deltas_merge_to_zero():
    for is_embedding in (False, True):
        out = merge(contributions([torch.zeros(16)] * 3), is_embedding=is_embedding).delta
        assert torch.equal(out, torch.zeros(16))


def test_zero_delta_adds_no_direction_but_counts_in_the_radius():
    deltas = [torch.zeros(3), torch.tensor([0.0, 2.0, 0.0])]
    out = merge(contributions(deltas), is_embedding=False, clip_c=10.0).delta
    torch.testing.assert_close(out, torch.tensor([0.0, 1.0, 0.0]))


def test_opposite_deltas_cancel_to_zero_without_nan():
    d = torch.randn(32, generator=torch.Generator().manual_seed(2))
    out = merge(contributions([d, -d]), is_embedding=False).delta
    assert torch.equal(out, torch.zeros(32))


def test_single_contribution_passes_through():
    d = torch.randn(64, generator=torch.Generator().manual_seed(3))
    for is_embedding in (False, True):
        torch.testing.assert_close(merge(contributions([d]), is_embedding=is_embedding).delta, d)


def test_merge_needs_contributions():
    with pytest.raises(ValueError):
        merge([], is_embedding=False)


def test_drop_stale_keeps_up_to_max_staleness_and_counts_the_rest():
    cs = contributions([torch.ones(2)] * 4, staleness=[0, 2, 3, 5])
    kept, dropped = drop_stale(cs, max_staleness=2)
    assert [c.staleness for c in kept] == [0, 2]
    assert dropped == 2


def test_deltas_given_as_callables_merge_the_same_one_at_a_time():
    g = torch.Generator().manual_seed(5)
    deltas = [torch.randn(300, generator=g) * (1 + 9 * (i == 3)) for i in range(5)]  # one gets clipped
    calls = [0] * 5

    def source(i):
        def make(out=None):
            calls[i] += 1
            return deltas[i].clone() if out is None else out.copy_(deltas[i])
        return make

    scratch, out = torch.empty(300), torch.empty(300)
    for emb in (None, 100, 300):
        direct = merge([Contribution(d, 10 + i, 5) for i, d in enumerate(deltas)], embedding_numel=emb,
                       is_embedding=emb == 300)
        lazy = merge([Contribution(source(i), 10 + i, 5) for i in range(5)], embedding_numel=emb,
                     is_embedding=emb == 300, scratch=scratch, out=out.fill_(float("nan")))
        assert lazy.delta.data_ptr() == out.data_ptr()
        assert torch.allclose(direct.delta, lazy.delta, atol=1e-6) and direct.weights == lazy.weights
        assert lazy.clipped == direct.clipped == 1
    # pure RDA in one pass; a weighted-mean part needs a second (its clip factors wait for the median)
    assert calls == [1 + 2 + 2] * 5


def test_at_quorum_two_a_huge_delta_is_clipped_only_against_the_owners_recent_norms():
    honest, huge = torch.tensor([0.6, 0.8]), torch.tensor([600.0, 800.0])  # norms 1 and 1000
    alone = merge(contributions([honest, huge]), clip_c=3.0)
    assert alone.clipped == 0  # the round's own median (500.5) moves with the huge delta
    result = merge(contributions([honest, huge]), clip_c=3.0, reference_norms=[1.0, 1.1, 0.9, 1.0])
    assert result.clipped == 1 and result.norms == pytest.approx([1.0, 3.0])
    assert result.delta.norm().item() == pytest.approx(2.0)  # RDA radius (1 + 3) / 2, same direction


@pytest.mark.parametrize("weights, cap, shares", [
    ([1.0, 1.0], 0.5, [0.5, 0.5]),
    ([1e12, 1.0], 0.5, [0.5, 0.5]),  # a claim of any size buys half of a two-learner merge, not all of it
    ([8.0, 1.0, 1.0], 0.5, [0.5, 0.25, 0.25]),
    ([8.0, 4.0, 2.0, 2.0], 0.4, [0.4, 0.3, 0.15, 0.15]),
    ([9.0, 9.0, 1.0, 1.0], 0.3, [0.3, 0.3, 0.2, 0.2]),
    ([3.0, 1.0], 1.0, [0.75, 0.25]),
    ([5.0, 1.0, 1.0], 0.1, [1 / 3, 1 / 3, 1 / 3]),  # a cap below 1/M is 1/M
])
def test_no_share_is_above_the_cap_and_the_rest_keep_their_proportions(weights, cap, shares):
    assert capped_shares(weights, cap) == pytest.approx(shares)


def test_a_merge_caps_the_share_of_a_delta_whatever_its_counters_claim():
    deltas = [torch.zeros(4), torch.ones(4)]
    out = merge(contributions(deltas, tokens=[1, 10**9], steps=[1, 1]), is_embedding=True, max_share=0.5)
    assert out.weights == pytest.approx([0.5, 0.5])
    torch.testing.assert_close(out.delta, torch.full((4,), 0.5))


def test_sparse_deltas_get_the_weighted_mean_of_the_deltas_holding_each_coordinate() -> None:
    a = torch.tensor([1.0, 0.0, 2.0, 0.0, 0.0])
    b = torch.tensor([0.0, -3.0, 4.0, 0.0, 0.0])
    c = torch.tensor([0.0, 0.0, 0.0, 0.5, 0.0])
    cs = [Contribution(a, 100, 10), Contribution(b, 300, 10), Contribution(c, 100, 10)]
    w = [token_weight(x.tokens, x.steps) for x in cs]  # 1000, 9000, 1000
    result = merge(cs, clip_c=1e9, sparse=True)
    expected = torch.tensor([1.0, -3.0, (w[0] * 2.0 + w[1] * 4.0) / (w[0] + w[1]), 0.5, 0.0])
    assert torch.allclose(result.delta, expected, rtol=1e-6, atol=0)
    # the same contributions merged densely: a coordinate one learner sent shrinks by its share
    dense = merge(cs, clip_c=1e9, is_embedding=True).delta
    assert dense[0].item() == pytest.approx(w[0] / sum(w))


def test_sparse_merge_clips_and_caps_shares_like_the_dense_one() -> None:
    big = torch.zeros(8)
    big[0] = 1000.0
    small = [torch.zeros(8) for _ in range(3)]
    for i, d in enumerate(small):
        d[1 + i] = 1.0
    cs = [Contribution(big, 100, 10), *(Contribution(d, 100, 10) for d in small)]
    result = merge(cs, clip_c=3.0, sparse=True, max_share=0.5)
    assert result.clipped == 1 and result.limit == pytest.approx(3.0)
    assert result.delta[0].item() == pytest.approx(3.0)  # clipped to λ, alone on its coordinate
    assert torch.equal(result.delta[1:4], torch.ones(3)) and result.delta[4:].abs().sum() == 0

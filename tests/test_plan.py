"""The fragment plan: deterministic, balanced greedy packing of whole tensors (docs/architecture.md §5.1)."""

from __future__ import annotations

import itertools
import math
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from diloco.coordinator.plan import FragmentPlan, default_embedding_rule

torch.set_num_threads(1)


def gpt_shapes(layers=4, d=64, vocab=512, ctx=128):
    """The parameter shapes of a nanoGPT-style transformer."""
    shapes = [("transformer.wte.weight", (vocab, d), True), ("transformer.wpe.weight", (ctx, d), True)]
    for i in range(layers):
        h = f"transformer.h.{i}"
        shapes += [
            (f"{h}.ln_1.weight", (d,), False),
            (f"{h}.attn.c_attn.weight", (3 * d, d), False),
            (f"{h}.attn.c_proj.weight", (d, d), False),
            (f"{h}.ln_2.weight", (d,), False),
            (f"{h}.mlp.c_fc.weight", (4 * d, d), False),
            (f"{h}.mlp.c_proj.weight", (d, 4 * d), False),
        ]
    return shapes + [("transformer.ln_f.weight", (d,), False)]


class TinyGPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(50, 8)  # an embedding by module type, not by name
        self.pos_embed = nn.Parameter(torch.zeros(16, 8))  # an embedding by name
        self.blocks = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 8), nn.LayerNorm(8))
        self.head = nn.Linear(8, 50, bias=False)
        self.head.weight = self.tok.weight  # tied: one tensor, listed once


def test_plan_is_deterministic_and_independent_of_input_order():
    shapes = gpt_shapes()
    shuffled = shapes[:]
    random.Random(0).shuffle(shuffled)
    a, b = FragmentPlan.from_shapes(shapes, 4), FragmentPlan.from_shapes(shuffled, 4)
    assert a.fragments == b.fragments
    assert a.digest() == b.digest()


def test_every_tensor_is_in_exactly_one_fragment():
    shapes = gpt_shapes()
    plan = FragmentPlan.from_shapes(shapes, 5)
    assert sorted(plan.names) == sorted(n for n, _, _ in shapes)
    for f in plan.fragments:
        assert f.names and all(plan.fragment_of(n) == f.index for n in f.names)
        assert f.numel == sum(math.prod(s) for s in f.shapes)


def test_largest_first_into_the_lightest_fragment_ties_by_name():
    sizes = {"b": 4, "a": 4, "c": 3, "d": 2}
    plan = FragmentPlan.from_shapes([(n, (k,), False) for n, k in sizes.items()], 2)
    assert [f.names for f in plan.fragments] == [("a", "c"), ("b", "d")]


def test_typical_transformer_is_within_four_thirds_of_perfect_balance():
    for P in (2, 3, 4, 6):
        assert FragmentPlan.from_shapes(gpt_shapes(layers=8, d=128, vocab=256), P).balance() <= 4 / 3


shape_lists = st.lists(st.integers(1, 10_000), min_size=1, max_size=60)


@settings(max_examples=150, deadline=None)
@given(sizes=shape_lists, P=st.integers(1, 12))
def test_largest_fragment_is_at_most_mean_plus_largest_tensor(sizes, P):
    """Greedy list scheduling: max ≤ mean + (1 − 1/P)·largest tensor, hence ≤ 4/3·mean when largest ≤ mean/3."""
    if P > len(sizes):
        return
    plan = FragmentPlan.from_shapes([(f"t{i}", (n,), False) for i, n in enumerate(sizes)], P)
    mean = sum(sizes) / P
    assert max(f.numel for f in plan.fragments) <= mean + (1 - 1 / P) * max(sizes) + 1e-9
    if max(sizes) <= mean / 3:
        assert plan.balance() <= 4 / 3 + 1e-12


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.integers(1, 100), min_size=2, max_size=7), P=st.integers(2, 3))
def test_within_lpt_bound_of_the_optimal_packing(sizes, P):
    """LPT's guarantee (Graham 1969): max ≤ (4/3 − 1/(3P)) · the best possible max, checked by brute force."""
    if P > len(sizes):
        return
    plan = FragmentPlan.from_shapes([(f"t{i}", (n,), False) for i, n in enumerate(sizes)], P)
    best = min(
        max(sum(n for n, b in zip(sizes, bins, strict=True) if b == k) for k in range(P))
        for bins in itertools.product(range(P), repeat=len(sizes))
    )
    assert max(f.numel for f in plan.fragments) <= (4 / 3 - 1 / (3 * P)) * best + 1e-9


def test_digest_changes_with_p_shapes_names_or_embedding_flags():
    shapes = gpt_shapes()
    base = FragmentPlan.from_shapes(shapes, 4).digest()
    assert len(base) == 32
    assert FragmentPlan.from_shapes(shapes, 3).digest() != base
    for last in [("transformer.ln_f.weight", (65,), False), ("transformer.ln_f.bias", (64,), False)]:
        assert FragmentPlan.from_shapes([*shapes[:-1], last], 4).digest() != base
    assert (
        FragmentPlan.from_shapes([*shapes[:-1], ("transformer.ln_f.weight", (64,), True)], 4).digest() != base
    )


def test_flatten_then_unflatten_round_trips_in_place():
    torch.manual_seed(0)
    model = TinyGPT()
    plan = FragmentPlan.from_module(model, 3)
    params = dict(model.named_parameters())
    before = {n: t.detach().clone() for n, t in params.items()}
    storage = {n: t.data_ptr() for n, t in params.items()}
    flats = [plan.flatten(p, params) for p in range(plan.P)]
    for p, flat in enumerate(flats):
        assert flat.dtype == torch.float32 and flat.dim() == 1 and flat.numel() == plan.fragments[p].numel
    with torch.no_grad():
        for t in params.values():
            t.zero_()
    for p, flat in enumerate(flats):
        plan.unflatten_into(p, flat, params)
    for n, t in params.items():
        assert torch.equal(t, before[n]) and t.data_ptr() == storage[n]


def test_flatten_is_plan_order_and_a_copy():
    params = {"a": torch.arange(4.0).reshape(2, 2), "b": torch.tensor([9.0])}
    plan = FragmentPlan.from_shapes([("a", (2, 2), False), ("b", (1,), False)], 1)
    flat = plan.flatten(0, params)
    assert flat.tolist() == [0.0, 1.0, 2.0, 3.0, 9.0]
    flat.zero_()
    assert params["b"].item() == 9.0


def test_unflatten_refuses_a_wrong_size_and_flatten_a_wrong_shape():
    plan = FragmentPlan.from_shapes([("a", (2, 2), False), ("b", (1,), False)], 1)
    with pytest.raises(ValueError):
        plan.unflatten_into(0, torch.zeros(4), {"a": torch.zeros(2, 2), "b": torch.zeros(1)})
    with pytest.raises(ValueError):
        plan.flatten(0, {"a": torch.zeros(4), "b": torch.zeros(1)})


def test_embeddings_are_flagged_by_module_type_or_name():
    plan = FragmentPlan.from_module(TinyGPT(), 2)
    assert plan.is_embedding("tok.weight") and plan.is_embedding("pos_embed")
    assert not plan.is_embedding("blocks.0.weight")
    assert "head.weight" not in plan.names  # tied to tok.weight
    for f in plan.fragments:
        assert f.is_embedding == any(plan.is_embedding(n) for n in f.names)
    for name in ("transformer.wte.weight", "transformer.wpe.weight", "model.embed_tokens.weight"):
        assert default_embedding_rule(name)
    assert not default_embedding_rule("lm_head.weight")


def test_embedding_tensors_form_the_prefix_of_their_fragment():
    plan = FragmentPlan.from_shapes([("w", (10,), False), ("x", (6,), False), ("e", (5,), True)], 1)
    (f,) = plan.fragments
    assert f.names == ("e", "w", "x") and f.embedding_numel == 5 and f.is_embedding
    for g in FragmentPlan.from_shapes(gpt_shapes(), 3).fragments:
        k = sum(math.prod(s) for n, s in zip(g.names, g.shapes, strict=True) if "wte" in n or "wpe" in n)
        assert g.embedding_numel == k and g.is_embedding == (k > 0)


def test_embedding_rule_is_configurable():
    plan = FragmentPlan.from_module(TinyGPT(), 2, embedding_rule=lambda name, module: False)
    assert not any(f.is_embedding for f in plan.fragments)


@pytest.mark.parametrize("P", [0, -1, 8])
def test_p_must_be_between_one_and_the_number_of_tensors(P):
    with pytest.raises(ValueError, match="P"):
        FragmentPlan.from_shapes([(f"t{i}", (3,), False) for i in range(7)], P)


def test_duplicate_names_are_refused():
    with pytest.raises(ValueError, match="twice"):
        FragmentPlan.from_shapes([("a", (3,), False), ("a", (4,), False)], 1)


def test_add_into_adds_a_flat_fragment_tensor_by_tensor_in_place():
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    plan = FragmentPlan.from_module(model, 2)
    params = dict(model.named_parameters())
    for p in range(len(plan.fragments)):
        before = plan.flatten(p, params)
        ids = [id(t) for t in params.values()]
        plan.add_into(p, torch.arange(before.numel(), dtype=torch.float32), params)
        assert torch.equal(plan.flatten(p, params), before + torch.arange(before.numel(), dtype=torch.float32))
        assert ids == [id(t) for t in params.values()]
    with pytest.raises(ValueError, match="holds"):
        plan.add_into(0, torch.zeros(3), params)

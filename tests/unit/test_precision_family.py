"""The recipe families' strategies (jetflow.precision.family): one per family, chosen by family_of, and
the exact forward reached by one route whether or not a graph is recorded."""

from __future__ import annotations

import pytest
import torch

from jetflow.precision import QuantRecipe
from jetflow.precision.exact import ExactCache, exact_linear
from jetflow.precision.family import STRATEGIES, family_of
from jetflow.precision.recipe import FAMILIES


def test_one_strategy_per_family_in_the_recipe_order():
    assert tuple(STRATEGIES) == FAMILIES
    for name in FAMILIES:
        assert family_of(QuantRecipe(family=name)).name == name


@pytest.mark.parametrize("family", FAMILIES)
def test_exact_forward_with_a_graph_equals_the_no_grad_product(family):
    """The trainer's forward (a graph recorded through the weight) and the rollout's (no graph, a cached
    call) give the same bits: the family's linear under exact numerics runs its exact product."""
    recipe = QuantRecipe(family=family)
    gen = torch.Generator().manual_seed(0)
    w = (torch.randn(40, 256, generator=gen) / 8).requires_grad_(True)
    b = torch.randn(40, generator=gen)
    x = torch.randn(3, 5, 256, generator=gen)
    wq = family_of(recipe).quantize_weight(w, recipe, "w")
    trained = exact_linear(x, w, b, "fp8", recipe=recipe, wq=wq, name="w")
    assert trained.requires_grad
    with torch.no_grad():
        rolled = exact_linear(x, w, b, "fp8", recipe=recipe, wq=wq, cache=ExactCache(), name="w")
    assert torch.equal(trained.detach(), rolled)
    trained.sum().backward()
    assert w.grad is not None and torch.isfinite(w.grad).all()

"""PriorityTrees against brute force: random batched updates, clears, rebuilds and searches."""

from __future__ import annotations

import math

import pytest
import torch

from fastreplay._segment_tree import PriorityTrees


def _brute(mass: torch.Tensor, raw: torch.Tensor) -> tuple[float, float, float]:
    written = raw != -math.inf
    if not written.any():
        return 0.0, math.inf, -math.inf
    return mass[written].sum().item(), mass[written].min().item(), raw[written].max().item()


@pytest.mark.parametrize("branching", [2, 3, 32])
@pytest.mark.parametrize("capacity", [1, 7, 50, 1023])
def test_random_updates_match_brute_force(capacity: int, branching: int) -> None:
    gen = torch.Generator().manual_seed(capacity * 31 + branching)
    trees = PriorityTrees(capacity, branching=branching)
    mass = torch.zeros(capacity, dtype=torch.float64)
    raw = torch.full((capacity,), -math.inf, dtype=torch.float64)
    for step in range(40):
        k = int(torch.randint(1, capacity + 1, (1,), generator=gen))
        index = torch.randperm(capacity, generator=gen)[:k]
        if step % 7 == 6:
            trees.clear(index)
            mass[index], raw[index] = 0.0, -math.inf
        else:
            new_raw = torch.rand(k, generator=gen, dtype=torch.float64) * 10
            new_mass = new_raw.sqrt()
            trees.update(index, new_mass, new_raw)
            mass[index], raw[index] = new_mass, new_raw
        total, m_min, m_max = _brute(mass, raw)
        assert trees.total() == pytest.approx(total, rel=1e-12, abs=1e-12)
        assert trees.min_mass() == m_min
        assert trees.max_raw() == m_max
        assert torch.equal(trees.raw(), raw)
        assert torch.equal(trees.leaf_mass(), mass)
        assert torch.equal(trees.written(), raw != -math.inf)
    # incremental internal nodes equal a full rebuild (same reductions, same order)
    rebuilt = PriorityTrees(capacity, branching=branching)
    rebuilt.set_leaves(mass, raw)
    for a, b in zip(trees.levels, rebuilt.levels, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("branching", [2, 5, 32])
@pytest.mark.parametrize("capacity", [7, 50, 1023])
def test_search_matches_searchsorted(capacity: int, branching: int) -> None:
    gen = torch.Generator().manual_seed(capacity + branching)
    mass = torch.rand(capacity, generator=gen, dtype=torch.float64)
    mass[torch.rand(capacity, generator=gen) < 0.3] = 0.0  # zero-mass slots are never drawn
    mass[0] = 0.5
    raw = torch.where(mass > 0, mass, -math.inf)
    trees = PriorityTrees(capacity, branching=branching)
    trees.set_leaves(mass, raw)
    cumsum = mass.cumsum(0)
    # the midpoint of every leaf's interval maps to that leaf (exact enumeration)
    positive = (mass > 0).nonzero().flatten()
    midpoints = cumsum[positive] - mass[positive] / 2
    assert torch.equal(trees.search(midpoints), positive)
    prefix = torch.rand(2000, generator=gen, dtype=torch.float64) * trees.total()
    expected = torch.searchsorted(cumsum, prefix, right=True)
    assert torch.equal(trees.search(prefix), expected)
    assert torch.equal(trees.search(prefix, guard=True), expected)


def test_search_past_the_total_lands_on_last_positive_slot() -> None:
    """The rounding guard: a prefix >= total never reaches an empty slot."""
    trees = PriorityTrees(100, branching=4)
    trees.update(torch.tensor([3, 41, 42]), torch.tensor([1.0, 2.0, 3.0]), torch.ones(3))
    found = trees.search(torch.tensor([6.0, 6.0 + 1e-9, 1e9], dtype=torch.float64))
    assert found.tolist() == [42, 42, 42]
    assert (trees.mass(found) > 0).all()


def test_reset_and_bad_arguments() -> None:
    trees = PriorityTrees(7)
    trees.update(torch.tensor([1]), torch.tensor([2.0]), torch.tensor([4.0]))
    trees.reset()
    assert (trees.total(), trees.min_mass(), trees.max_raw()) == (0.0, math.inf, -math.inf)
    with pytest.raises(ValueError, match="capacity must be a positive int"):
        PriorityTrees(0)
    with pytest.raises(ValueError, match="branching must be >= 2"):
        PriorityTrees(5, branching=1)
    with pytest.raises(ValueError, match="expected 7 leaves"):
        trees.set_leaves(torch.zeros(6), torch.zeros(6))

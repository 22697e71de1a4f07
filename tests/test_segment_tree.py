"""Priority trees against brute force, on every backend present (torch; numba if installed).

Random batched updates, clears, rebuilds and searches; both backends built from the same calls
must hold the same leaves and answer searches identically.
"""

from __future__ import annotations

import importlib.util
import math
import pickle

import pytest
import torch

import fastreplay._core.trees.numba_backend as numba_trees
from conftest import requires_cuda, requires_numba
from fastreplay._core.trees.interface import available_backends, make_trees
from fastreplay._core.trees.torch_backend import PriorityTrees


def _trees(capacity: int, backend: str, branching: int = 32):
    return make_trees(capacity, backend=backend, branching=branching)


def _brute(mass: torch.Tensor, raw: torch.Tensor) -> tuple[float, float, float]:
    written = raw != -math.inf
    if not written.any():
        return 0.0, math.inf, -math.inf
    return mass[written].sum().item(), mass[written].min().item(), raw[written].max().item()


@pytest.mark.parametrize("branching", [2, 3, 32])
@pytest.mark.parametrize("capacity", [1, 7, 50, 1023])
def test_random_updates_match_brute_force(capacity: int, branching: int, backend: str) -> None:
    gen = torch.Generator().manual_seed(capacity * 31 + branching)
    trees = _trees(capacity, backend, branching)
    assert trees.backend == backend
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
    rebuilt = _trees(capacity, backend, branching)
    rebuilt.set_leaves(mass, raw)
    for a, b in zip(trees.levels, rebuilt.levels, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("branching", [2, 5, 32])
@pytest.mark.parametrize("capacity", [7, 50, 1023])
def test_search_matches_searchsorted(capacity: int, branching: int, backend: str) -> None:
    gen = torch.Generator().manual_seed(capacity + branching)
    mass = torch.rand(capacity, generator=gen, dtype=torch.float64)
    mass[torch.rand(capacity, generator=gen) < 0.3] = 0.0  # zero-mass slots are never drawn
    mass[0] = 0.5
    raw = torch.where(mass > 0, mass, -math.inf)
    trees = _trees(capacity, backend, branching)
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


def test_search_past_the_total_lands_on_last_positive_slot(backend: str) -> None:
    """The rounding guard: a prefix >= total never reaches an empty slot."""
    trees = _trees(100, backend, 4)
    trees.update(torch.tensor([3, 41, 42]), torch.tensor([1.0, 2.0, 3.0]), torch.ones(3))
    found = trees.search(torch.tensor([6.0, 6.0 + 1e-9, 1e9], dtype=torch.float64))
    assert found.tolist() == [42, 42, 42]
    assert (trees.mass(found) > 0).all()


def test_reset_and_bad_arguments(backend: str) -> None:
    trees = _trees(7, backend)
    trees.update(torch.tensor([1]), torch.tensor([2.0]), torch.tensor([4.0]))
    trees.reset()
    assert (trees.total(), trees.min_mass(), trees.max_raw()) == (0.0, math.inf, -math.inf)
    with pytest.raises(ValueError, match="capacity must be a positive int"):
        _trees(0, backend)
    with pytest.raises(ValueError, match="branching must be >= 2"):
        _trees(5, backend, branching=1)
    with pytest.raises(ValueError, match="expected 7 leaves"):
        trees.set_leaves(torch.zeros(6), torch.zeros(6))


@pytest.mark.parametrize("capacity", [7, 50, 1023])
def test_bulk_writes_match_small_writes(capacity: int, backend: str) -> None:
    """A write of every slot (bulk path: rows in place + rebuild) equals one slot at a time."""
    gen = torch.Generator().manual_seed(capacity)
    raw = torch.rand(capacity, generator=gen, dtype=torch.float64)
    bulk, small = _trees(capacity, backend, 4), _trees(capacity, backend, 4)
    order = torch.randperm(capacity, generator=gen)
    bulk.update(order, raw[order].sqrt(), raw[order])
    for i in order.tolist():
        small.update(torch.tensor([i]), raw[i : i + 1].sqrt(), raw[i : i + 1])
    for a, b in zip(bulk.levels, small.levels, strict=True):
        assert torch.equal(a, b)
    clear = order[: capacity // 2 + 1]
    bulk.clear(clear)
    for i in clear.tolist():
        small.clear(torch.tensor([i]))
    for a, b in zip(bulk.levels, small.levels, strict=True):
        assert torch.equal(a, b)
    assert bulk.written().sum().item() == capacity - clear.numel()


@requires_numba
@pytest.mark.parametrize("capacity", [1, 7, 50, 1023])
def test_backends_agree(capacity: int) -> None:
    """The same calls on both backends: same leaves, same roots, same search answers."""
    gen = torch.Generator().manual_seed(capacity + 5)
    pair = [make_trees(capacity, backend="torch"), make_trees(capacity, backend="numba")]
    for step in range(12):
        k = int(torch.randint(1, capacity + 1, (1,), generator=gen))
        index = torch.randperm(capacity, generator=gen)[:k]
        raw = torch.randint(1, 9, (k,), generator=gen).double()  # exact sums in any order
        for trees in pair:
            if step % 4 == 3:
                trees.clear(index)
            else:
                trees.update(index, raw, raw)
        a, b = pair
        assert torch.equal(a.raw(), b.raw()) and torch.equal(a.leaf_mass(), b.leaf_mass())
        assert (a.total(), a.min_mass(), a.max_raw()) == (b.total(), b.min_mass(), b.max_raw())
        assert torch.equal(a.written(), b.written())
        if a.total() > 0:
            prefix = torch.rand(300, generator=gen, dtype=torch.float64) * (a.total() + 1)
            assert torch.equal(a.search(prefix), b.search(prefix))
            assert torch.equal(a.mass(a.search(prefix)), b.mass(b.search(prefix)))


@requires_numba
def test_numba_trees_pickle_and_stay_on_cpu() -> None:
    trees = make_trees(50, backend="numba")
    trees.update(torch.tensor([3, 9]), torch.tensor([1.0, 2.0]), torch.tensor([1.0, 4.0]))
    copy = pickle.loads(pickle.dumps(trees))
    copy.update(torch.tensor([5]), torch.tensor([3.0]), torch.tensor([9.0]))
    assert (trees.total(), trees.max_raw()) == (3.0, 4.0)  # independent copies
    assert (copy.total(), copy.max_raw()) == (6.0, 9.0)
    assert trees.to("cpu") is trees
    with pytest.raises(ValueError, match=r"backend='numba' keeps the priority trees on the CPU"):
        trees.to("cuda")


def test_make_trees_picks_and_rejects_backends(monkeypatch: pytest.MonkeyPatch) -> None:
    expected = "numba" if numba_trees.NUMBA_AVAILABLE else "torch"
    assert make_trees(7).backend == expected
    present = ("torch", "numba", "device") if expected == "numba" else ("torch", "device")
    assert available_backends() == present
    assert make_trees(7, backend="torch").backend == "torch"
    assert isinstance(make_trees(7, backend="torch"), PriorityTrees)
    assert make_trees(7, device="meta").backend == "device"  # not the CPU: device trees
    assert make_trees(7, backend="torch", device="meta").backend == "torch"
    if importlib.util.find_spec("triton") is None:
        with pytest.raises(ValueError, match=r"backend='triton' needs the triton package"):
            make_trees(7, backend="triton")
    with pytest.raises(
        ValueError,
        match=r"backend must be None, 'torch', 'numba', 'device' or 'triton', got backend='cpp'",
    ):
        make_trees(7, backend="cpp")
    cuda_error = "keeps the priority trees on the CPU" if expected == "numba" else "needs the numba"
    with pytest.raises(ValueError, match=rf"backend='numba' {cuda_error}"):
        make_trees(7, backend="numba", device="cuda")
    monkeypatch.setattr(numba_trees, "NUMBA_AVAILABLE", False)
    assert make_trees(7).backend == "torch"
    with pytest.raises(ValueError, match=r"backend='numba' needs the numba.*pip install numba,"):
        make_trees(7, backend="numba")


@requires_cuda
def test_cuda_trees_are_device_trees() -> None:
    trees = make_trees(50, device="cuda")
    assert trees.backend == "device" and trees.device.type == "cuda"


# ---------------------------------------------------------------------- torch trees' own shapes
# The torch trees' root reduces a whole narrow level (``top`` nodes) at once; small ``top``
# values give deep trees, so the group-by-group write and search paths run at test sizes too.
TOPS = [1, 3, 40, None]


@pytest.mark.parametrize("top", TOPS)
@pytest.mark.parametrize(("capacity", "branching"), [(7, 2), (50, 3), (1023, 4), (1023, 32)])
def test_torch_trees_of_any_depth_match_brute_force(capacity: int, branching: int, top) -> None:
    """Repeated slots (last wins), one value for all, floats, clears, bulk and deferred writes."""
    gen = torch.Generator().manual_seed(capacity + branching + (top or 0))
    trees = PriorityTrees(capacity, branching=branching, top=top)
    mass = torch.zeros(capacity, dtype=torch.float64)
    raw = torch.full((capacity,), -math.inf, dtype=torch.float64)
    for step in range(24):
        k = int(torch.randint(1, 2 * capacity, (1,), generator=gen)) // (1 + 20 * (step % 2))
        index = torch.randint(0, capacity, (max(k, 1),), generator=gen)  # repeats
        new_raw = torch.rand(index.numel(), generator=gen, dtype=torch.float64) * 10
        if step % 6 == 5:
            trees.clear(index)
            mass[index], raw[index] = 0.0, -math.inf
            new_raw = None
        elif step % 6 == 4:  # one value for all, as floats
            trees.update(index, 2.5, 6.25)
            mass[index], raw[index] = 2.5, 6.25
            new_raw = None
        elif step % 6 == 3:  # leaves only, then one rebuild (as a chunked bulk write does)
            trees.update(index, new_raw.sqrt().float(), new_raw, rebuild=False)
            trees.rebuild()
        else:
            trees.update(index, new_raw.sqrt().float(), new_raw)
        if new_raw is not None:
            for i, p in zip(index.tolist(), new_raw.tolist(), strict=True):  # last wins
                raw[i] = p
                mass[i] = float(torch.tensor(p, dtype=torch.float64).sqrt().float())
        total, m_min, m_max = _brute(mass, raw)
        assert trees.total() == pytest.approx(total, rel=1e-12, abs=1e-12)
        assert (trees.min_mass(), trees.max_raw()) == (m_min, m_max)
        assert torch.equal(trees.raw(), raw) and torch.equal(trees.leaf_mass(), mass)
    rebuilt = PriorityTrees(capacity, branching=branching, top=top)
    rebuilt.set_leaves(mass, raw)
    for a, b in zip(trees.levels, rebuilt.levels, strict=True):
        assert torch.equal(a, b)  # incremental writes equal a full rebuild, bit for bit
    if trees.total() > 0:
        prefix = torch.rand(500, generator=gen, dtype=torch.float64) * trees.total()
        expected = torch.searchsorted(mass.cumsum(0), prefix, right=True)
        found, found_mass = trees.search_with_mass(prefix)
        assert torch.equal(found, expected)
        assert torch.equal(found_mass, mass[expected])
        last = int((mass > 0).nonzero().max())
        beyond = torch.tensor([trees.total(), trees.total() * 2], dtype=torch.float64)
        assert trees.search(beyond).tolist() == [last, last]


def test_torch_tree_levels() -> None:
    """Levels: padded to whole groups below the root, whose level has at most ``top`` nodes."""
    sizes = [level.shape[1] for level in PriorityTrees(1023, branching=4, top=16).levels]
    assert sizes == [1024, 256, 64, 16, 1]
    assert [level.shape[1] for level in PriorityTrees(1023, top=2000).levels] == [1023, 1]
    assert [level.shape[1] for level in PriorityTrees(1, top=1).levels] == [1, 1]


@pytest.mark.parametrize("batched", [True, False])
def test_torch_search_either_searchsorted(monkeypatch: pytest.MonkeyPatch, batched: bool) -> None:
    """Batched 2-D searchsorted (torch >= 2.15) and compare-and-count give the same leaves."""
    import fastreplay._core.trees.torch_backend as segment_tree

    monkeypatch.setattr(segment_tree, "_BATCHED_SEARCHSORTED", batched)
    gen = torch.Generator().manual_seed(4)
    mass = torch.randint(0, 4, (1023,), generator=gen).double()  # zeros, exact sums
    trees = PriorityTrees(1023, branching=8, top=2)
    trees.set_leaves(mass, torch.where(mass > 0, mass, -math.inf))
    prefix = torch.arange(0, int(mass.sum())).double() + 0.5
    assert torch.equal(trees.search(prefix), torch.searchsorted(mass.cumsum(0), prefix, right=True))


def test_torch_trees_pickle_and_copy_independently() -> None:
    import copy

    trees = PriorityTrees(50, branching=4, top=3)
    trees.update(torch.tensor([3, 9]), torch.tensor([1.0, 2.0]), torch.tensor([1.0, 4.0]))
    for clone in (pickle.loads(pickle.dumps(trees)), copy.deepcopy(trees)):
        clone.update(torch.tensor([5]), torch.tensor([3.0]), torch.tensor([9.0]))
        assert (clone.total(), clone.max_raw()) == (6.0, 9.0)
        assert clone.search(torch.tensor([5.5], dtype=torch.float64)).tolist() == [9]
    assert (trees.total(), trees.max_raw()) == (3.0, 4.0)


def test_sampler_on_deep_torch_trees(monkeypatch: pytest.MonkeyPatch) -> None:
    """The sampler's brute-force oracle (repeats, -1 markers, alpha changes) on deep trees."""
    import fastreplay._core.trees.torch_backend as segment_tree
    from conformance.conftest import BUFFER_SIDES
    from conformance.test_tree_backends import test_brute_force_oracle

    monkeypatch.setattr(segment_tree, "_TOP", 2)
    for side in BUFFER_SIDES:
        test_brute_force_oracle("torch", side, 1023)


def test_torch_last_wins_positions() -> None:
    """Repeats resolve to the last occurrence by construction, not by the order of a scatter
    (which CUDA does not guarantee): every entry maps to its slot's last position."""
    trees = PriorityTrees(50)
    index = torch.tensor([3, 5, 3, 7, 5, 3, 49])
    assert trees._last_wins(index).tolist() == [5, 4, 5, 3, 4, 5, 6]
    assert trees.total() == 0.0  # the scratch row is only written at slots about to be written

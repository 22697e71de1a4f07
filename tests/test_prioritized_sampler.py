"""fastreplay.PrioritizedSampler: brute-force oracle, TorchRL buffers, TorchRL reference, errors."""

from __future__ import annotations

import copy
import importlib
import math
import pickle
import sys
import threading
import warnings
from typing import Any

import numpy as np
import pytest
import torch
from tensordict import TensorDict
from torchrl.data import (
    LazyMemmapStorage,
    LazyTensorStorage,
    ReplayBuffer,
    TensorDictPrioritizedReplayBuffer,
    TensorDictReplayBuffer,
)
from torchrl.data.replay_buffers.scheduler import LinearScheduler

from conftest import requires_cuda, requires_torchrl_ext
from fastreplay import PrioritizedSampler


def _chi_square_ok(counts: torch.Tensor, probs: torch.Tensor) -> bool:
    """Pearson chi-square below the 0.999 quantile (Wilson-Hilferty approximation)."""
    n = counts.sum().item()
    keep = probs > 0
    expected = probs[keep] * n
    stat = ((counts[keep] - expected) ** 2 / expected).sum().item()
    dof = int(keep.sum()) - 1
    z = 3.09  # 0.999 quantile of N(0, 1)
    bound = dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3
    return stat < bound and int(counts[~keep].sum()) == 0


class Mirror:
    """Brute-force model of the raw priority of every stored item."""

    def __init__(self, capacity: int, initial: float, upper: float) -> None:
        self.raw: dict[int, float] = {}
        self.capacity, self.initial, self.upper = capacity, initial, upper

    def default(self) -> float:
        return min(max(self.raw.values()) if self.raw else self.initial, self.upper)

    def write(self, index: list[int]) -> None:
        for i in index:
            self.raw.pop(i, None)  # the overwritten item leaves the max at once
        value = self.default()
        for i in index:
            self.raw[i] = value

    def update(self, index: list[int], priority: list[float]) -> None:
        for i, p in zip(index, priority, strict=True):
            self.raw[i] = p


def _check_against_mirror(sampler: PrioritizedSampler, mirror: Mirror, alpha, eps) -> None:
    assert sampler.default_priority == mirror.default()
    raw = torch.full((mirror.capacity,), -math.inf, dtype=torch.float64)
    for i, p in mirror.raw.items():
        raw[i] = p
    assert torch.equal(sampler._trees.raw(), raw)
    written = raw != -math.inf
    mass = torch.where(written, ((raw + eps) ** alpha).float().double(), 0.0)
    assert torch.equal(sampler._trees.leaf_mass(), mass)
    probs = mass / mass.sum()
    # exact enumeration: the midpoint of each slot's interval is drawn as that slot
    cumsum = mass.cumsum(0)
    positive = (mass > 0).nonzero().flatten()
    assert torch.equal(sampler._trees.search(cumsum[positive] - mass[positive] / 2), positive)
    assert probs.sum().item() == pytest.approx(1.0)


@pytest.mark.parametrize("capacity", [7, 50, 1023])
@pytest.mark.parametrize("upper", [math.inf, 0.7])
def test_oracle_random_workload(capacity: int, upper: float) -> None:
    alpha, eps = 0.6, 1e-3
    gen = torch.Generator().manual_seed(capacity)
    sampler = PrioritizedSampler(capacity, alpha, 0.5, eps=eps, upper_priority=upper)
    rb = TensorDictReplayBuffer(
        storage=LazyTensorStorage(capacity), sampler=sampler, priority_key="td_error"
    )
    mirror = Mirror(capacity, 1.0, upper)
    cursor, written = 0, 0
    for step in range(30):
        n = int(torch.randint(1, max(2, capacity // 3), (1,), generator=gen))
        obs = torch.arange(written, written + n)
        data = TensorDict({"obs": obs}, [n])
        index = [(cursor + j) % capacity for j in range(n)]
        if step % 3 == 0:  # priorities come with the data
            priority = (torch.rand(n, generator=gen) * 5).tolist()
            data["td_error"] = torch.tensor(priority)
            rb.extend(data)
            mirror.write(index)
            mirror.update(index, priority)
        else:  # new items get the live max
            rb.extend(data)
            mirror.write(index)
        cursor, written = (cursor + n) % capacity, written + n
        _check_against_mirror(sampler, mirror, alpha, eps)
        sample = rb.sample(32)
        assert (sample["obs"] % capacity == sample["index"] % capacity).all() or capacity > 32
        stored = list(mirror.raw)
        k = int(torch.randint(1, len(stored) + 1, (1,), generator=gen))
        pick = [stored[int(i)] for i in torch.randint(0, len(stored), (k,), generator=gen)]
        new = (torch.rand(k, generator=gen) * 3).tolist()
        if step % 4 == 1:  # lower the current max item
            top = max(mirror.raw, key=mirror.raw.get)
            pick, new = [*pick, top], [*new, 0.01]
        rb.update_priority(torch.tensor(pick), torch.tensor(new))
        mirror.update(pick, [float(torch.tensor(v)) for v in new])  # float32 round trip
        _check_against_mirror(sampler, mirror, alpha, eps)


def test_chi_square_sampling_distribution() -> None:
    capacity = 50
    sampler = PrioritizedSampler(capacity, alpha=0.7, beta=0.4, eps=1e-2)
    rb = ReplayBuffer(storage=LazyTensorStorage(capacity), sampler=sampler)
    rb.extend(torch.arange(capacity))
    priority = torch.rand(capacity, generator=torch.Generator().manual_seed(1)) * 4
    priority[::7] = 0.0
    rb.update_priority(torch.arange(capacity), priority)
    mass = ((priority.double() + 1e-2) ** 0.7).float().double()
    probs = mass / mass.sum()
    rng = torch.Generator().manual_seed(2)
    rb.set_rng(rng)
    _, info = rb.sample(20_000, return_info=True)
    counts = torch.bincount(info["index"], minlength=capacity).double()
    assert _chi_square_ok(counts, probs)
    # weights are (m_i / m_min) ** -beta
    expected = (mass[info["index"]] / mass.min()) ** -0.4
    torch.testing.assert_close(info["priority_weight"], expected.float())


def test_overwritten_max_leaves_at_once_and_initial_priority() -> None:
    sampler = PrioritizedSampler(5, alpha=1.0, beta=1.0, initial_priority=2.5)
    rb = ReplayBuffer(storage=LazyTensorStorage(5), sampler=sampler)
    assert sampler.default_priority == 2.5
    rb.extend(torch.arange(5))
    rb.update_priority(torch.arange(5), torch.tensor([9.0, 1.0, 2.0, 3.0, 4.0]))
    assert sampler.default_priority == 9.0
    rb.extend(torch.tensor([5]))  # overwrites slot 0 (the max)
    assert sampler.default_priority == 4.0
    assert sampler._trees.raw()[0].item() == 4.0  # the new item got the live max, not 9
    rb.update_priority(torch.arange(5), torch.zeros(5))
    assert sampler.default_priority == 0.0  # all-zero: documented, still sampleable via eps
    assert rb.sample(4).shape == (4,)
    rb.empty()
    assert sampler.default_priority == 2.5


def test_all_time_max_mode() -> None:
    sampler = PrioritizedSampler(5, 1.0, 1.0, max_priority_within_buffer=False)
    rb = ReplayBuffer(storage=LazyTensorStorage(5), sampler=sampler)
    rb.extend(torch.arange(5))
    rb.update_priority(torch.tensor([1]), torch.tensor([7.0]))
    rb.update_priority(torch.tensor([1]), torch.tensor([0.5]))
    assert sampler.default_priority == 7.0


def test_repeated_indices_last_write_wins() -> None:
    sampler = PrioritizedSampler(7, 1.0, 1.0)
    rb = ReplayBuffer(storage=LazyTensorStorage(7), sampler=sampler)
    rb.extend(torch.arange(7))
    rb.update_priority(torch.tensor([3, 1, 3, 3]), torch.tensor([5.0, 2.0, 6.0, 0.5]))
    assert sampler._trees.raw()[[1, 3]].tolist() == [2.0, 0.5]


def test_ndim2_storage_and_memmap(tmp_path) -> None:
    storage = LazyMemmapStorage(12, ndim=2, scratch_dir=tmp_path / "scratch")
    sampler = PrioritizedSampler(12, alpha=1.0, beta=1.0)
    rb = TensorDictReplayBuffer(storage=storage, sampler=sampler, priority_key="p")
    obs = torch.arange(12).view(4, 3) * 10
    rb.extend(TensorDict({"obs": obs}, [4, 3]))
    assert sampler.default_priority == 1.0
    assert len(storage) == 12
    width = storage.shape[1]
    # coordinates (row, col) are raveled with the storage shape
    rows, cols = torch.tensor([1, 2]), torch.tensor([2, 0])
    rb.update_priority((rows, cols), torch.tensor([8.0, 3.0]))
    assert sampler.default_priority == 8.0
    flat = sampler._trees.raw()
    assert flat[1 * width + 2] == 8.0 and flat[2 * width + 0] == 3.0
    assert (flat == 1.0).sum() == 10
    sample, info = rb.sample(64, return_info=True)
    rows, cols = info["index"]
    assert torch.equal(sample["obs"], storage[rows, cols]["obs"])
    counts = torch.bincount(rows * width + cols, minlength=12)
    assert counts[1 * width + 2] == counts.max()  # the priority-8 item is drawn most


def test_tensordict_prioritized_replay_buffer(monkeypatch) -> None:
    """TorchRL's TDPRB builds its sampler by name: route it to ours."""
    # The module that defines it (a package module from TorchRL 0.14 on, one module on 0.13).
    prioritized_tensordict = importlib.import_module(
        TensorDictPrioritizedReplayBuffer.__init__.__module__
    )
    monkeypatch.setattr(prioritized_tensordict, "PrioritizedSampler", PrioritizedSampler)
    rb = TensorDictPrioritizedReplayBuffer(
        alpha=0.7, beta=0.5, storage=LazyTensorStorage(50), priority_key="td_error"
    )
    sampler = rb._sampler
    assert isinstance(sampler, PrioritizedSampler)
    rb.extend(TensorDict({"obs": torch.arange(20), "td_error": torch.linspace(0, 2, 20)}, [20]))
    assert sampler.default_priority == 2.0
    sample = rb.sample(16)
    sample["td_error"] = torch.full((16,), 0.25)
    rb.update_tensordict_priority(sample)
    raw = sampler._trees.raw()
    assert (raw[sample["index"]] == 0.25).all()
    assert sampler.default_priority == raw[:20].max().item()


def test_alpha_schedule_keeps_trees_consistent() -> None:
    capacity = 50
    priority = torch.rand(capacity, generator=torch.Generator().manual_seed(3)) * 3
    sampler = PrioritizedSampler(capacity, alpha=0.0, beta=1.0)
    rb = ReplayBuffer(storage=LazyTensorStorage(capacity), sampler=sampler)
    rb.extend(torch.arange(capacity))
    rb.update_priority(torch.arange(capacity), priority)
    scheduler = LinearScheduler(rb, param_name="alpha", final_value=0.8, num_steps=4)
    for _ in range(4):
        scheduler.step()
    assert sampler.alpha == pytest.approx(0.8)
    fresh = PrioritizedSampler(capacity, alpha=sampler.alpha, beta=1.0)
    fresh.update_priority(torch.arange(capacity), priority)
    for a, b in zip(sampler._trees.levels, fresh._trees.levels, strict=True):
        assert torch.equal(a, b)


def test_state_dict_and_dumps_round_trip(tmp_path) -> None:
    def make() -> TensorDictReplayBuffer:
        sampler = PrioritizedSampler(50, alpha=0.6, beta=0.4, upper_priority=3.0)
        return TensorDictReplayBuffer(
            storage=LazyTensorStorage(50), sampler=sampler, priority_key="p"
        )

    rb = make()
    for i in range(4):
        rb.extend(TensorDict({"obs": torch.arange(15) + 15 * i, "p": torch.rand(15) * 4}, [15]))
    rb.dumps(tmp_path / "rb")
    other = make()
    other.loads(tmp_path / "rb")
    restored = make()._sampler
    restored.load_state_dict(rb._sampler.state_dict())
    for sampler in (other._sampler, restored):
        assert sampler.default_priority == rb._sampler.default_priority
        for a, b in zip(sampler._trees.levels, rb._sampler._trees.levels, strict=True):
            assert torch.equal(a, b)
    np.random.seed(5)  # the RNG prioritized sampling draws from, as TorchRL
    first = rb.sample(32)["index"]
    np.random.seed(5)
    assert torch.equal(other.sample(32)["index"], first)


def test_loads_rejects_other_capacity(tmp_path) -> None:
    sampler = PrioritizedSampler(7, 1.0, 1.0)
    sampler.dumps(tmp_path)
    with pytest.raises(ValueError, match="max_capacity=7 differs"):
        PrioritizedSampler(8, 1.0, 1.0).loads(tmp_path)


@pytest.mark.parametrize(
    ("index", "priority", "match"),
    [
        ([0, 1, 2], [1.0, float("nan"), 2.0], r"finite and >= 0, got index 1: nan"),
        ([0, 1, 2], [1.0, 2.0, float("inf")], r"index 2: inf"),
        ([0, 1, 2], [-1.0, 2.0, 3.0], r"index 0: -1.0"),
        ([0, 1, 2], [1.0, 2.0], r"priority has 2 elements .* index has 3"),
        ([0, 5, 9], [1.0, 2.0, 3.0], r"outside the stored range \[0, 5\): \[5, 9\]"),
        ([0, -3], [1.0, 2.0], r"outside the stored range \[0, 5\): \[-3\]"),
    ],
)
def test_bad_update_is_atomic(index, priority, match) -> None:
    sampler = PrioritizedSampler(7, 1.0, 1.0)
    rb = ReplayBuffer(storage=LazyTensorStorage(7), sampler=sampler)
    rb.extend(torch.arange(5))
    rb.update_priority(torch.arange(5), torch.arange(5.0))
    before = [level.clone() for level in sampler._trees.levels]
    with pytest.raises(ValueError, match=match):
        rb.update_priority(torch.tensor(index), torch.tensor(priority))
    assert all(torch.equal(a, b) for a, b in zip(before, sampler._trees.levels, strict=True))
    assert sampler.default_priority == 4.0


def test_bad_types_and_construction() -> None:
    sampler = PrioritizedSampler(7, 1.0, 1.0)
    with pytest.raises(TypeError, match="index must hold integers"):
        sampler.update_priority(torch.tensor([0.5]), 1.0)
    for kwargs, match in [
        ({"alpha": -0.1}, r"alpha must be greater or equal than 0, got alpha=-0.1"),
        ({"beta": -1.0}, r"beta must be greater or equal to 0, got beta=-1.0"),
        ({"upper_priority": 0.0}, r"upper_priority must be > 0, got upper_priority=0.0"),
    ]:
        args = {"alpha": 1.0, "beta": 1.0} | kwargs
        with pytest.raises(ValueError, match=match):
            PrioritizedSampler(7, **args)
    with pytest.raises(ValueError, match="alpha must be greater or equal than 0"):
        sampler.alpha = -1.0
    assert sampler.alpha == 1.0


def test_empty_buffer_sampling_raises() -> None:
    rb = ReplayBuffer(storage=LazyTensorStorage(7), sampler=PrioritizedSampler(7, 1.0, 1.0))
    with pytest.raises(RuntimeError, match="Cannot sample from an empty storage"):
        rb.sample(4)


@requires_torchrl_ext
def test_same_distribution_and_weights_as_torchrl() -> None:
    from torchrl.data import PrioritizedSampler as TorchRLSampler

    capacity = 50
    gen = torch.Generator().manual_seed(4)
    ours = PrioritizedSampler(capacity, 0.6, 0.4, max_priority_within_buffer=False)
    theirs = TorchRLSampler(capacity, 0.6, 0.4)
    buffers = [
        TensorDictReplayBuffer(storage=LazyTensorStorage(capacity), sampler=s, priority_key="p")
        for s in (ours, theirs)
    ]
    for step in range(8):
        data = TensorDict({"obs": torch.arange(17) + 17 * step}, [17])
        if step % 2:
            data["p"] = torch.rand(17, generator=gen) * 3
        for rb in buffers:
            rb.extend(data.clone())
        index = torch.randint(0, min(capacity, 17 * (step + 1)), (10,), generator=gen)
        priority = torch.rand(10, generator=gen) * 2
        for rb in buffers:
            rb.update_priority(index, priority)
    assert ours.default_priority == pytest.approx(float(theirs.default_priority))
    slots = torch.arange(capacity)
    their_mass = torch.as_tensor(theirs._sum_tree[slots]).double()
    torch.testing.assert_close(ours._trees.leaf_mass(), their_mass, rtol=1e-6, atol=0)
    torch.manual_seed(0)
    _, info = buffers[1].sample(20_000, return_info=True)
    counts = torch.bincount(info["index"], minlength=capacity).double()
    assert _chi_square_ok(counts, their_mass / their_mass.sum())
    _, mine = buffers[0].sample(20_000, return_info=True)
    counts = torch.bincount(mine["index"], minlength=capacity).double()
    assert _chi_square_ok(counts, their_mass / their_mass.sum())
    expected = torch.as_tensor(theirs._sum_tree[mine["index"]]) / theirs._min_tree.query(
        0, capacity
    )
    torch.testing.assert_close(mine["priority_weight"], expected.float() ** -0.4)


@requires_cuda
def test_cuda_trees() -> None:
    sampler = PrioritizedSampler(50, 0.6, 0.4, device="cuda")
    rb = ReplayBuffer(storage=LazyTensorStorage(50, device="cuda"), sampler=sampler)
    rb.extend(torch.arange(30, device="cuda"))
    rb.update_priority(torch.arange(30, device="cuda"), torch.rand(30, device="cuda"))
    _, info = rb.sample(64, return_info=True)
    assert info["index"].device.type == "cuda" and int(info["index"].max()) < 30
    assert sampler.default_priority == sampler._trees.raw()[:30].max().item()


# ---------------------------------------------------------------- storages larger than the trees
@pytest.mark.parametrize(("envs", "steps"), [(3, 4), (7, 3)])
def test_ndim2_storage_rounded_up_grows_the_trees(envs: int, steps: int) -> None:
    """``LazyTensorStorage(50, ndim=2)`` holds ``ceil(50 / envs) * envs`` slots: all get mass."""
    sampler = PrioritizedSampler(50, alpha=1.0, beta=1.0, eps=0.0)
    storage = LazyTensorStorage(50, ndim=2)
    rb = TensorDictReplayBuffer(storage=storage, sampler=sampler)
    slots = -(-50 // envs) * envs
    written = 0
    while written < 2 * slots:  # fill, then wrap around
        obs = torch.arange(envs * steps).view(envs, steps) + written
        rb.extend(TensorDict({"obs": obs}, [envs, steps]))
        written += envs * steps
    assert len(storage) == slots > 50
    raw = sampler._trees.raw()
    assert raw.numel() == slots and (raw == 1.0).all()  # every stored slot has a priority
    last = (torch.tensor([slots // envs - 1]), torch.tensor([envs - 1]))
    rb.update_priority(last, torch.tensor([1e6]))
    _, info = rb.sample(64, return_info=True)
    rows, cols = info["index"]
    assert ((rows == last[0]) & (cols == last[1])).float().mean() > 0.9


def test_max_capacity_smaller_than_storage_grows_and_checkpoints(tmp_path) -> None:
    """Past TorchRL's power-of-two padding too: a 5-slot sampler on a 40-slot storage."""
    sampler = PrioritizedSampler(5, alpha=1.0, beta=1.0, eps=0.0)
    rb = TensorDictReplayBuffer(storage=LazyTensorStorage(40), sampler=sampler, priority_key="p")
    mirror = torch.full((40,), -math.inf, dtype=torch.float64)
    for i in range(12):  # 36 rows: trees grow 5 -> 10 -> 20 -> 40 before each write
        p = torch.arange(3) + 3.0 * i + 1
        index = rb.extend(TensorDict({"obs": torch.arange(3) + 3 * i, "p": p}, [3]))
        mirror[index] = p.double()
        assert sampler._slots >= len(rb)
    assert sampler._slots == 40 and sampler.max_size == 5
    assert torch.equal(sampler._trees.raw(), mirror)
    _, info = rb.sample(4000, return_info=True)
    counts = torch.bincount(info["index"], minlength=40).double()
    probs = torch.where(mirror > -math.inf, mirror, 0.0)
    assert _chi_square_ok(counts, probs / probs.sum())
    # checkpoints keep every slot; a fresh 5-slot sampler grows when it loads them
    rb.dumps(tmp_path / "rb")
    other = TensorDictReplayBuffer(
        storage=LazyTensorStorage(40), sampler=PrioritizedSampler(5, 1.0, 1.0, eps=0.0)
    )
    other.loads(tmp_path / "rb")
    fresh = PrioritizedSampler(5, 1.0, 1.0, eps=0.0)
    fresh.load_state_dict(sampler.state_dict())
    for restored in (other.sampler, fresh):
        assert torch.equal(restored._trees.raw(), mirror)


# ---------------------------------------------------------------- mass overflow
@pytest.mark.parametrize(
    ("dtype", "alpha", "priority"),
    [(torch.float32, 2.0, 1e20), (torch.float32, 1.5, 3e38), (torch.float64, 2.0, 1e200)],
)
def test_mass_overflow_is_rejected_atomically(dtype, alpha: float, priority: float) -> None:
    sampler = PrioritizedSampler(7, alpha=alpha, beta=1.0, dtype=dtype)
    rb = ReplayBuffer(storage=LazyTensorStorage(7), sampler=sampler)
    rb.extend(torch.arange(5))
    rb.update_priority(torch.arange(5), torch.arange(1.0, 6.0))
    before = sampler.state_dict()
    bad = torch.tensor([2.0, priority], dtype=torch.float64)
    with pytest.raises(OverflowError, match=r"does not fit dtype=float.*nothing was changed"):
        rb.update_priority(torch.tensor([0, 1]), bad)
    with pytest.raises(ValueError, match=r"sampling mass \(p \+ eps\) \*\* alpha"):
        rb.update_priority(torch.tensor([0, 1]), bad)
    after = sampler.state_dict()
    assert torch.equal(after["_raw"], before["_raw"])
    assert torch.equal(after["_mass"], before["_mass"])
    _, info = rb.sample(2000, return_info=True)
    assert torch.bincount(info["index"], minlength=5).min() > 0  # still proportional


def test_mass_overflow_from_alpha_or_initial_priority_is_refused() -> None:
    sampler = PrioritizedSampler(7, alpha=1.0, beta=1.0)
    sampler.update_priority(torch.tensor([0, 1]), torch.tensor([1e20, 1.0]))
    before = sampler.state_dict()
    with pytest.raises(OverflowError, match=r"setting alpha=2\.0 would give"):
        sampler.alpha = 2.0
    assert sampler.alpha == 1.0
    assert torch.equal(sampler.state_dict()["_mass"], before["_mass"])
    with pytest.raises(OverflowError, match=r"initial_priority=1e\+20 gives"):
        PrioritizedSampler(7, alpha=2.0, beta=1.0, initial_priority=1e20)
    assert PrioritizedSampler(7, 2.0, 1.0, initial_priority=1e20, dtype=torch.float64)


# ---------------------------------------------------------------- checkpoints
def _torchrl_like_state() -> dict:
    """The keys of ``torchrl.data.PrioritizedSampler.state_dict()`` (trees are opaque)."""
    return {
        "_schema_version": 1,
        "_alpha": 0.25,
        "_beta": 0.5,
        "_eps": 1e-8,
        "_max_priority": (torch.tensor(3.0), torch.tensor(1)),
        "_sum_tree": object(),
        "_min_tree": object(),
    }


def _snapshot(sampler: PrioritizedSampler) -> tuple:
    state = sampler.state_dict()
    return state["_raw"], state["_mass"], sampler.alpha, sampler._beta, sampler._eps


def _same(a: tuple, b: tuple) -> bool:
    return torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and a[2:] == b[2:]


def test_load_state_dict_errors_change_nothing(tmp_path) -> None:
    sampler = PrioritizedSampler(7, alpha=0.7, beta=0.4)
    sampler.update_priority(torch.arange(3), torch.tensor([1.0, 2.0, 3.0]))
    before = _snapshot(sampler)
    with pytest.raises(KeyError, match=r"written by torchrl.data.PrioritizedSampler"):
        sampler.load_state_dict(_torchrl_like_state())
    assert _same(_snapshot(sampler), before)
    good = PrioritizedSampler(7, alpha=0.1, beta=0.9).state_dict()
    for damage, match in [
        ({"_mass": torch.zeros(3), "_raw": torch.zeros(3)}, "have 3 masses and 3 raw"),
        ({"_raw": torch.zeros(8)}, "7 masses and 8 raw"),
        ({"_max_capacity": 8}, "max_capacity=8 differs"),
        ({"dtype": "int64"}, "dtype='int64'"),
    ]:
        with pytest.raises(ValueError, match=match):
            sampler.load_state_dict(good | damage)
        assert _same(_snapshot(sampler), before)  # alpha too
    missing = {k: v for k, v in good.items() if k != "_raw"}
    with pytest.raises(KeyError, match=r"missing \['_raw'\]"):
        sampler.load_state_dict(missing)
    assert _same(_snapshot(sampler), before)
    # a TorchRL dumps folder
    (tmp_path / "sumtree.memmap").write_bytes(b"\0" * 56)
    (tmp_path / "sampler_metadata.json").write_text('{"_alpha": 0.5, "_max_capacity": 7}')
    with pytest.raises(RuntimeError, match="folder was written by torchrl"):
        sampler.loads(tmp_path)
    assert _same(_snapshot(sampler), before)


@requires_torchrl_ext
def test_load_torchrl_state_dict_is_a_clear_error() -> None:
    from torchrl.data import PrioritizedSampler as TorchRLSampler

    theirs = TorchRLSampler(7, 0.5, 0.5)
    theirs.update_priority(torch.arange(3), torch.tensor([1.0, 2.0, 3.0]))
    ours = PrioritizedSampler(7, 0.7, 0.4)
    before = _snapshot(ours)
    with pytest.raises(KeyError, match="cannot read"):
        ours.load_state_dict(theirs.state_dict())
    assert _same(_snapshot(ours), before)


def test_copies_and_pickles_keep_priorities() -> None:
    sampler = PrioritizedSampler(7, alpha=0.7, beta=torch.tensor(0.4))
    sampler.update_priority(torch.arange(3), torch.tensor([1.0, 2.0, 3.0]))
    for clone in (copy.deepcopy(sampler), pickle.loads(pickle.dumps(sampler))):
        assert _same(_snapshot(clone), _snapshot(sampler))
        assert clone._fr_lock is not sampler._fr_lock
        assert clone._written_end == sampler._written_end == 3
        assert type(clone._beta) is float and torch.equal(clone.beta, torch.tensor(0.4))
        clone.alpha = 0.3  # the clone's lock works
        assert sampler.alpha == 0.7


# ---------------------------------------------------------------- alpha from another thread
def test_alpha_change_is_atomic_with_sampling() -> None:
    """A prefetch-style thread samples while the main thread anneals ``alpha``: weights <= 1."""
    capacity = 1023
    sampler = PrioritizedSampler(capacity, alpha=0.5, beta=1.0)
    storage = LazyTensorStorage(capacity)
    rb = ReplayBuffer(storage=storage, sampler=sampler)
    rb.extend(torch.arange(capacity))
    rb.update_priority(torch.arange(capacity), torch.logspace(-3, 3, capacity))
    stop, worst, errors = threading.Event(), [0.0], []

    def sample_loop() -> None:
        try:
            while not stop.is_set():
                _, info = sampler.sample(storage, 256)
                worst[0] = max(worst[0], float(info["priority_weight"].max()))
        except Exception as err:  # reported below
            errors.append(err)

    thread = threading.Thread(target=sample_loop, daemon=True)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible
    thread.start()
    try:
        for i in range(400):
            sampler.alpha = (0.5, 2.0)[i % 2]
    finally:
        stop.set()
        thread.join(timeout=60)
        sys.setswitchinterval(interval)
    assert not thread.is_alive() and not errors
    assert worst[0] <= 1.0


# ---------------------------------------------------------------- TorchRL's private views
def test_tree_views_are_read_only() -> None:
    sampler = PrioritizedSampler(7, alpha=1.0, beta=1.0)
    sampler.update_priority(torch.arange(3), torch.tensor([1.0, 2.0, 3.0]))
    before = _snapshot(sampler)
    with pytest.raises(TypeError, match=r"read-only view .* sampler\.update_priority"):
        sampler._sum_tree[0] = 5.0
    with pytest.raises(TypeError, match="read-only view"):
        sampler._min_tree.update(torch.tensor([0]), torch.tensor([5.0]))
    for name in ("_sum_tree", "_min_tree", "_max_priority"):
        with pytest.raises(AttributeError, match=f"{name} is a read-only view"):
            setattr(sampler, name, None)
    with pytest.raises(IndexError, match=r"out of range for 7 slots: \[7\]"):
        sampler._sum_tree[7]
    assert _same(_snapshot(sampler), before)
    assert list(sampler._sum_tree)[:4] == [1.0, 2.0, 3.0, 0.0] and len(sampler._min_tree) == 7


@requires_torchrl_ext
@pytest.mark.parametrize("capacity", [7, 50, 1023])
def test_tree_views_match_torchrl_compiled_trees(capacity: int) -> None:
    """Same writes into TorchRL's sampler and ours: every read of the views agrees."""
    from torchrl.data import PrioritizedSampler as TorchRLSampler

    gen = torch.Generator().manual_seed(capacity)
    ours = PrioritizedSampler(capacity, 0.7, 0.4, max_priority_within_buffer=False)
    theirs = TorchRLSampler(capacity, 0.7, 0.4)
    for _ in range(5):
        index = torch.randint(0, capacity, (max(2, capacity // 4),), generator=gen).unique()
        priority = torch.rand(index.numel(), generator=gen) * 3
        ours.update_priority(index, priority)
        theirs.update_priority(index, priority)
    slots = torch.arange(capacity)
    close = {"rtol": 1e-6, "atol": 0}  # TorchRL rounds its float32 pow differently (1 ulp)
    for view, ref in ((ours._sum_tree, theirs._sum_tree), (ours._min_tree, theirs._min_tree)):
        torch.testing.assert_close(view[slots], ref[slots], **close)
        got, want = [view[i] for i in range(capacity)], [ref[i] for i in range(capacity)]
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), **close)
        got, want = view[slots.numpy()], ref[slots.numpy()]
        assert got.dtype == want.dtype and np.allclose(got, want, rtol=1e-6, atol=0)
        lo = torch.randint(0, capacity, (20,), generator=gen)
        hi = (lo + torch.randint(0, capacity, (20,), generator=gen)).clamp_max(capacity)
        for a, b in zip(lo.tolist(), hi.tolist(), strict=True):
            assert view.query(a, b) == pytest.approx(ref.query(a, b), rel=1e-5)
        assert view.identity_element == ref.identity_element
    # lower bound at random masses and at the exact prefix sums (ties)
    leaves = ours._trees.leaf_mass()
    cumsum = leaves.cumsum(0)
    mass = torch.cat([torch.rand(50, generator=gen).double() * cumsum[-1], cumsum[::3]])
    brute = torch.searchsorted(cumsum, mass, side="left").clamp_max(capacity)
    assert torch.equal(ours._sum_tree.scan_lower_bound(mass), brute)
    inner = mass[(mass - cumsum[::3].amin()).abs() > 1e-3][:50].float()  # away from ties
    assert torch.equal(
        ours._sum_tree.scan_lower_bound(inner), theirs._sum_tree.scan_lower_bound(inner)
    )
    assert float(ours._max_priority[0]) == float(theirs._max_priority[0])
    assert int(ours._max_priority[1]) == int(theirs._max_priority[1])


# ---------------------------------------------------------------- default_priority
def test_default_priority_is_a_tensor_holding_the_live_max() -> None:
    sampler = PrioritizedSampler(7, alpha=1.0, beta=1.0, initial_priority=2.5)
    rb = ReplayBuffer(storage=LazyTensorStorage(7), sampler=sampler)
    assert sampler.default_priority == 2.5 and isinstance(sampler.default_priority, float)
    rb.extend(torch.arange(3))
    rb.update_priority(torch.arange(3), torch.tensor([0.1, 9.0, 0.2], dtype=torch.float64))
    default = sampler.default_priority
    assert isinstance(default, torch.Tensor) and default.dtype == torch.float32
    assert default.shape == () and default.item() == 9.0
    rb.update_priority(torch.tensor([1]), torch.tensor([0.0]))
    assert sampler.default_priority.item() == pytest.approx(0.2)  # the live max, at once
    rb.extend(torch.tensor([3]))
    assert sampler._trees.raw()[3].item() == 0.2  # new items get the exact float64 max


@requires_cuda
def test_cuda_views_and_default_priority() -> None:
    sampler = PrioritizedSampler(50, 1.0, 1.0, eps=0.0, device="cuda")
    sampler.update_priority(torch.arange(3, device="cuda"), torch.tensor([1.0, 2.0, 4.0]))
    assert sampler.default_priority.device.type == "cuda"
    got = sampler._sum_tree[torch.arange(4, device="cuda")]
    assert got.device.type == "cuda" and got.tolist() == [1.0, 2.0, 4.0, 0.0]
    bound = sampler._sum_tree.scan_lower_bound(torch.tensor([0.5, 3.0, 3.5], device="cuda"))
    assert bound.tolist() == [0, 1, 2]
    assert sampler._sum_tree.query(0, 50) == 7.0 and sampler._min_tree.query(1, 3) == 2.0
    assert sampler._max_priority[1].device.type == "cuda"


@pytest.mark.parametrize("eps", [-1e-3, -1.0, math.inf, math.nan])
def test_eps_below_zero_or_not_finite_is_refused_at_construction(eps: float) -> None:
    """TorchRL accepts these and raises at the first ``sample`` once a mass is invalid."""
    with pytest.raises(ValueError, match=r"eps must be a finite number >= 0, got eps=.*pass a"):
        PrioritizedSampler(7, 0.7, 0.5, eps=eps)
    assert PrioritizedSampler(7, 0.7, 0.5, eps=0.0)._eps == 0.0  # zero stays allowed


@requires_torchrl_ext
@pytest.mark.parametrize("eps", [-1e-3, math.inf, math.nan])
def test_torchrl_fails_at_sample_with_such_an_eps(eps: float) -> None:
    """Why fastreplay refuses them: TorchRL's first sample after a small priority fails."""
    from torchrl.data import PrioritizedSampler as TorchRLSampler

    rb = ReplayBuffer(storage=LazyTensorStorage(7), sampler=TorchRLSampler(7, 0.7, 0.5, eps=eps))
    rb.extend(torch.arange(5))
    rb.update_priority(torch.arange(5), torch.tensor([0.0, 1e-6, 0.5, 1.0, 2.0]))
    with pytest.raises((OverflowError, RuntimeError)):
        rb.sample(4)


@pytest.mark.parametrize(
    ("index", "priority", "fix"),
    [
        ([0, 1], [1.0, float("nan")], r"finite and >= 0, got index 1: nan \(pass e\.g\."),
        ([0, 1], [1.0, -2.0], r"got index 1: -2\.0 \(pass e\.g\. td_error\.abs\(\)"),
        ([0, 6], [1.0, 2.0], r"\[0, 5\): \[6\] \(pass indices of stored items"),
        ([[0, 0], [3, 0]], [1.0, 2.0], r"storage shape \(1, 5\): \[\[3, 0\]\]; pass coordinates"),
    ],
)
def test_bad_update_messages_name_the_argument_show_the_value_and_say_the_fix(
    index: list, priority: list, fix: str
) -> None:
    sampler = PrioritizedSampler(7, 1.0, 1.0)
    storage = LazyTensorStorage(5, ndim=2) if isinstance(index[0], list) else LazyTensorStorage(7)
    rb = ReplayBuffer(storage=storage, sampler=sampler)
    rb.extend(torch.arange(5).reshape(-1, 1) if storage.ndim == 2 else torch.arange(5))
    before = [level.clone() for level in sampler._trees.levels]
    with pytest.raises(ValueError, match=fix):
        sampler.update_priority(torch.tensor(index), torch.tensor(priority), storage=storage)
    assert all(torch.equal(a, b) for a, b in zip(before, sampler._trees.levels, strict=True))


@requires_torchrl_ext
def test_torchrl_lets_an_unstored_index_set_the_priority_of_the_next_item() -> None:
    """Why fastreplay refuses indices past the stored range: TorchRL's update of a slot that
    holds nothing is not sampled, but raises its max priority, which the next item written
    inherits (and indices past its power-of-two trees write outside them)."""
    from torchrl.data import PrioritizedSampler as TorchRLSampler

    rb = ReplayBuffer(storage=LazyTensorStorage(7), sampler=TorchRLSampler(7, 1.0, 0.5))
    rb.extend(torch.arange(5))
    rb.update_priority(torch.tensor([6]), torch.tensor([1e6]))  # slot 6 holds nothing
    assert rb.sampler._sum_tree.query(0, 5) == 5.0  # not sampled...
    rb.extend(torch.arange(1))  # ...but slot 5, written next, inherits the stale 1e6
    assert rb.sampler._sum_tree[5] == 1e6


# ----------------------------------------------------------------- the RNG sampling draws from


def _per_buffer(side: str, sampler: PrioritizedSampler) -> Any:
    """fastreplay's sampler in TorchRL's buffer, or in fastreplay's."""
    import fastreplay

    cls = TensorDictReplayBuffer if side == "torchrl" else fastreplay.TensorDictReplayBuffer
    rb = cls(storage=LazyTensorStorage(300), sampler=sampler, batch_size=32)
    rb.extend(TensorDict(obs=torch.arange(257), batch_size=[257]))
    rb.update_priority(torch.arange(257), torch.linspace(0.1, 3.0, 257))
    return rb


@pytest.mark.parametrize("side", ["torchrl", "fastreplay"])
@pytest.mark.parametrize("backend", ["torch", "numba"])
def test_sampling_draws_from_numpy_global_rng_as_torchrl(side: str, backend: str) -> None:
    """TorchRL's CPU sampler draws ``np.random.uniform``: NumPy's seed reproduces its samples
    and torch's global RNG (exploration noise, dropout...) is not advanced by sampling."""
    if backend == "numba":
        pytest.importorskip("numba", reason="the numba backend needs numba (the fast extra)")
    rb = _per_buffer(side, PrioritizedSampler(300, 0.7, 0.5, backend=backend))
    np.random.seed(11)
    first = rb.sample()["index"]
    torch_state = torch.get_rng_state()
    np.random.seed(11)
    assert torch.equal(rb.sample()["index"], first)
    assert torch.equal(torch.get_rng_state(), torch_state)
    np.random.seed(12)
    assert not torch.equal(rb.sample()["index"], first)


@requires_torchrl_ext
@pytest.mark.parametrize("side", ["torchrl", "fastreplay"])
def test_same_numpy_seed_same_samples_as_torchrl(side: str) -> None:
    from torchrl.data import PrioritizedSampler as TorchRLPrioritizedSampler

    reference = _per_buffer("torchrl", TorchRLPrioritizedSampler(300, 0.7, 0.5))
    ours = _per_buffer(side, PrioritizedSampler(300, 0.7, 0.5))
    for seed in range(5):
        np.random.seed(seed)
        expected = reference.sample()
        np.random.seed(seed)
        got = ours.sample()
        assert torch.equal(got["index"], expected["index"])
        torch.testing.assert_close(got["priority_weight"], expected["priority_weight"])


def test_a_generator_is_used_instead_of_numpy() -> None:
    gen = torch.Generator().manual_seed(3)
    rb = _per_buffer("fastreplay", PrioritizedSampler(300, 0.7, 0.5))
    rb._sampler._rng = gen
    numpy_state = np.random.get_state()[1].copy()
    first = rb.sample()["index"]
    assert np.array_equal(np.random.get_state()[1], numpy_state)
    gen.manual_seed(3)
    assert torch.equal(rb.sample()["index"], first)


# ---------------------------------------------------------------- resuming a multi-env run
def _multi_env_buffer(kind: str, storage_kind: str, folder: Any) -> Any:
    """A 1000-slot ``ndim=2`` buffer fed by 3 envs: its tensors hold 334 x 3 = 1002 slots."""
    if storage_kind == "memmap":
        storage = LazyMemmapStorage(1000, ndim=2, scratch_dir=folder)
    else:
        storage = LazyTensorStorage(1000, ndim=2)
    if kind == "fastreplay":
        from fastreplay import TensorDictPrioritizedReplayBuffer as Buffer

        return Buffer(alpha=0.7, beta=0.5, storage=storage, priority_key="p")
    sampler = PrioritizedSampler(1000, alpha=0.7, beta=0.5)
    return TensorDictReplayBuffer(storage=storage, sampler=sampler, priority_key="p")


def _env_steps(step: int, steps: int = 10) -> TensorDict:
    obs = torch.arange(3 * steps, dtype=torch.float64).view(3, steps) + 1000 * step
    return TensorDict({"obs": obs, "p": obs % 7 + 1}, [3, steps])


@pytest.mark.parametrize("storage_kind", ["tensor", "memmap"])
@pytest.mark.parametrize("kind", ["fastreplay", "torchrl_buffer"])
def test_multi_env_run_resumes_from_state_dict_past_the_rounded_up_slots(
    kind: str, storage_kind: str, tmp_path
) -> None:
    """A loaded ``ndim=2`` storage keeps ``max_size=1000`` under its 1002 slots: writes go on.

    The resumed buffer writes rows 1000-1001 (time row 333) and gives them priorities, as
    the uninterrupted run does and as TorchRL's trees do; ``len`` stays at the loaded
    storage's ``max_size`` (TorchRL's storage), and ``sample`` draws below it.
    """
    original = _multi_env_buffer(kind, storage_kind, tmp_path / "a")
    for step in range(10):
        original.extend(_env_steps(step))
    resumed = _multi_env_buffer(kind, storage_kind, tmp_path / "b")
    with warnings.catch_warnings():  # TorchRL's memmap storage: "Loading the storage on an
        warnings.filterwarnings("ignore", "Loading the storage", UserWarning)  # uninitialized"
        resumed.load_state_dict(original.state_dict())
    assert original.storage.max_size == 1002 and resumed.storage.max_size == 1000
    for step in range(10, 40):  # 400 time rows: through row 333, then around to row 66
        data = _env_steps(step)
        original.extend(data.clone())
        resumed.extend(data)
    assert len(resumed) == 1000 and len(original) == 1002
    raw = resumed.sampler._trees.raw()
    assert torch.equal(raw[:1002], original.sampler._trees.raw()[:1002])
    assert torch.equal(resumed.storage[:]["obs"], original.storage[:]["obs"])
    sample, info = resumed.sample(256, return_info=True)
    rows, cols = info["index"]
    assert int((rows * 3 + cols).max()) < 1000
    assert torch.equal(sample["obs"], resumed.storage[rows, cols]["obs"])


@pytest.mark.parametrize(
    "bad", [[1.0, float("nan")], [1.0, -2.0], [float("inf"), 1.0]], ids=["nan", "neg", "inf"]
)
@pytest.mark.parametrize("kind", ["fastreplay", "torchrl_buffer"])
def test_extend_with_bad_priorities_writes_nothing(kind: str, bad: list[float]) -> None:
    """TorchRL's error class (``RuntimeError`` from the priority update), raised first."""
    if kind == "fastreplay":
        from fastreplay import TensorDictPrioritizedReplayBuffer as Buffer

        rb = Buffer(alpha=0.7, beta=0.5, storage=LazyTensorStorage(10), priority_key="p")
    else:  # TorchRL's buffer writes the rows first; fastreplay's sampler refuses the values
        rb = TensorDictReplayBuffer(
            storage=LazyTensorStorage(10),
            sampler=PrioritizedSampler(10, alpha=0.7, beta=0.5),
            priority_key="p",
        )
    rb.extend(TensorDict({"obs": torch.arange(3.0), "p": torch.ones(3)}, [3]))
    before = (len(rb), rb.write_count, rb.storage[:3]["obs"].clone())
    raw = rb.sampler._trees.raw().clone()
    with pytest.raises(RuntimeError, match="Failed to update priority") as caught:
        rb.extend(TensorDict({"obs": torch.tensor([7.0, 8.0]), "p": torch.tensor(bad)}, [2]))
    assert isinstance(caught.value.__cause__, ValueError)
    assert "finite and >= 0" in str(caught.value.__cause__)
    assert torch.equal(rb.sampler._trees.raw()[:3], raw[:3])  # no bad value is stored
    if kind == "fastreplay":  # nothing written at all
        assert torch.equal(rb.sampler._trees.raw(), raw)
        assert (len(rb), rb.write_count) == before[:2]
        assert torch.equal(rb.storage[:3]["obs"], before[2])

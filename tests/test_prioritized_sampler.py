"""fastreplay.PrioritizedSampler: brute-force oracle, TorchRL buffers, TorchRL reference, errors."""

from __future__ import annotations

import math

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
from torchrl.data.replay_buffers.replay_buffers import prioritized_tensordict
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
    torch.manual_seed(5)
    first = rb.sample(32)["index"]
    torch.manual_seed(5)
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

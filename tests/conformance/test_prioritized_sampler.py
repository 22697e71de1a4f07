"""PrioritizedSampler and prioritized buffers: one behaviour, TorchRL's class and fastreplay's.

Priorities are small exact numbers and ``eps=0`` where masses are compared, so
``(p + eps) ** alpha`` is exact in float32 on both sides. ``max_priority_within_buffer`` is
passed explicitly wherever the default priority matters (the defaults differ on purpose: see
docs/migration.md).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tensordict import TensorDict
from torchrl.data import LazyMemmapStorage, LazyTensorStorage, ListStorage, ReplayBuffer

# TorchRL's ravel of ndim=2 coordinates goes through numpy's deprecated __array__ path.
pytestmark = pytest.mark.filterwarnings("ignore:__array__ implementation:DeprecationWarning")


def _sampler(impl, capacity: int, alpha: float = 1.0, beta: float = 1.0, **kwargs):
    return impl.cls("PrioritizedSampler")(capacity, alpha, beta, **kwargs)


def _buffer(impl, storage, sampler, **kwargs):
    return impl.cls("TensorDictReplayBuffer")(storage=storage, sampler=sampler, **kwargs)


def _tree(sampler, n: int) -> torch.Tensor:
    """The first ``n`` sum-tree leaves, read one by one as TorchRL's tests do."""
    return torch.tensor([sampler._sum_tree[i] for i in range(n)], dtype=torch.float64)


# ---------------------------------------------------------------- everyday contract
@pytest.mark.parametrize("capacity", [7, 50])
def test_sample_index_and_weight_format(per_impl, capacity: int) -> None:
    sampler = _sampler(per_impl, capacity, alpha=0.7, beta=0.5)
    rb = _buffer(per_impl, LazyTensorStorage(capacity), sampler, priority_key="p")
    n = capacity + capacity // 2  # wraps around
    rb.extend(TensorDict({"obs": torch.arange(n), "p": torch.arange(n) % 5 + 1.0}, [n]))
    sample, info = rb.sample(32, return_info=True)
    index, weight = info["index"], info["priority_weight"]
    assert index.dtype == torch.long and index.shape == (32,)
    assert weight.dtype == torch.float32 and weight.shape == (32,)
    assert sample["priority_weight"].dtype == torch.float32
    assert torch.equal(sample["index"], index)
    assert ((weight > 0) & (weight <= 1)).all()
    # the sampled row is the stored row: obs = write position, slot = obs % capacity
    assert torch.equal(sample["obs"] % capacity, index)
    assert (sample["obs"] >= n - capacity).all()


def test_weights_are_mass_ratios(per_impl) -> None:
    sampler = _sampler(per_impl, 7, alpha=1.0, beta=0.5, eps=0.0)
    rb = _buffer(per_impl, LazyTensorStorage(7), sampler)
    rb.extend(TensorDict({"obs": torch.arange(5)}, [5]))
    priority = torch.tensor([1.0, 2.0, 4.0, 8.0, 16.0])
    rb.update_priority(torch.arange(5), priority)
    _, info = rb.sample(200, return_info=True)
    expected = (priority[info["index"]] / 1.0) ** -0.5
    torch.testing.assert_close(info["priority_weight"], expected)


def test_update_priority_index_formats(per_impl) -> None:
    sampler = _sampler(per_impl, 7, eps=0.0)
    rb = _buffer(per_impl, LazyTensorStorage(7), sampler)
    rb.extend(TensorDict({"obs": torch.arange(6)}, [6]))
    rb.update_priority(torch.tensor([0, 1]), torch.tensor([2.0, 3.0]))  # tensors
    rb.update_priority(2, 4.0)  # int and float
    rb.update_priority(torch.tensor(3), torch.tensor(5.0))  # 0-dim
    rb.update_priority(torch.tensor([4, 5]), 6)  # one int for several
    rb.update_priority(torch.tensor([-1, 0]), torch.tensor([9.0, 7.0]))  # -1 is skipped
    assert _tree(sampler, 6).tolist() == [7.0, 3.0, 4.0, 5.0, 6.0, 6.0]


def test_update_priority_coordinates_ndim2(per_impl) -> None:
    sampler = _sampler(per_impl, 12, eps=0.0)
    rb = _buffer(per_impl, LazyTensorStorage(12, ndim=2), sampler)
    rb.extend(TensorDict({"obs": torch.arange(12).view(3, 4)}, [3, 4]))  # 3 envs x 4 steps
    width = rb.storage.shape[1]
    rb.update_priority(torch.tensor([[1, 2], [3, 0]]), torch.tensor([5.0, 6.0]))  # [k, 2]
    rb.update_priority((torch.tensor([0]), torch.tensor([1])), torch.tensor([7.0]))  # tuple
    tree = _tree(sampler, 12)
    assert tree[1 * width + 2] == 5.0 and tree[3 * width + 0] == 6.0 and tree[1] == 7.0
    sample, info = rb.sample(64, return_info=True)
    rows, cols = info["index"]
    assert sample["index"].shape == (64, 2)
    assert torch.equal(sample["obs"], rb.storage[rows, cols]["obs"])


def test_mark_update_gives_the_default_priority(per_impl) -> None:
    sampler = _sampler(per_impl, 7, eps=0.0, max_priority_within_buffer=False)
    rb = _buffer(per_impl, LazyTensorStorage(7), sampler)
    rb.extend(TensorDict({"obs": torch.arange(3)}, [3]))
    assert _tree(sampler, 3).tolist() == [1.0, 1.0, 1.0]  # nothing set: 1.0
    rb.update_priority(torch.tensor([1]), torch.tensor([4.0]))
    rb.extend(TensorDict({"obs": torch.arange(2)}, [2]))
    assert _tree(sampler, 5).tolist() == [1.0, 4.0, 1.0, 4.0, 4.0]


def test_tensordict_prioritized_buffer(per_impl) -> None:
    cls = per_impl.cls("TensorDictPrioritizedReplayBuffer")
    rb = cls(alpha=1.0, beta=1.0, eps=0.0, storage=LazyTensorStorage(50), priority_key="td")
    rb.extend(TensorDict({"obs": torch.arange(20), "td": torch.arange(20) % 4 + 1.0}, [20]))
    assert _tree(rb.sampler, 20).tolist() == (torch.arange(20) % 4 + 1.0).tolist()
    sample = rb.sample(8)
    assert sample["priority_weight"].shape == (8,)
    sample["td"] = torch.full((8,), 0.5)
    rb.update_tensordict_priority(sample)
    tree = _tree(rb.sampler, 20)
    assert (tree[sample["index"]] == 0.5).all()


@pytest.mark.parametrize("storage_kind", ["tensor", "memmap"])
def test_state_dict_and_dumps_round_trip(per_impl, storage_kind: str, tmp_path) -> None:
    made = []

    def make():
        made.append(None)
        storage = (
            LazyTensorStorage(50)
            if storage_kind == "tensor"
            else LazyMemmapStorage(50, scratch_dir=tmp_path / f"scratch{len(made)}")
        )
        sampler = _sampler(per_impl, 50, alpha=0.6, beta=0.4, max_priority_within_buffer=False)
        return _buffer(per_impl, storage, sampler, priority_key="p")

    rb = make()
    for i in range(4):  # 60 writes: wraps around
        p = (torch.arange(15) % 7 + 1.0) / 2
        rb.extend(TensorDict({"obs": torch.arange(15) + 15 * i, "p": p}, [15]))
    rb.dumps(tmp_path / "rb")
    loaded = make()
    loaded.loads(tmp_path / "rb")
    fresh = make().sampler
    fresh.load_state_dict(rb.sampler.state_dict())
    for sampler in (loaded.sampler, fresh):
        torch.testing.assert_close(_tree(sampler, 50), _tree(rb.sampler, 50))
        assert float(sampler.default_priority) == float(rb.sampler.default_priority)
    sample = loaded.sample(16)
    assert torch.equal(sample["obs"] % 50, sample["index"])


def test_prefetch(per_impl) -> None:
    sampler = _sampler(per_impl, 50, alpha=0.7, beta=0.5)
    rb = per_impl.cls("TensorDictReplayBuffer")(
        storage=LazyTensorStorage(50), sampler=sampler, batch_size=8, prefetch=3
    )
    rb.extend(TensorDict({"obs": torch.arange(40)}, [40]))
    for step in range(6):
        sample = rb.sample()
        assert torch.equal(sample["obs"], sample["index"])
        assert ((sample["priority_weight"] > 0) & (sample["priority_weight"] <= 1)).all()
        rb.update_priority(sample["index"], torch.full((8,), 0.1 * (step + 1)))


def test_construction_errors(per_impl) -> None:
    cls = per_impl.cls("PrioritizedSampler")
    with pytest.raises(ValueError, match="alpha must be greater or equal"):
        cls(7, alpha=-1.0, beta=1.0)
    with pytest.raises(ValueError, match="beta must be greater or equal"):
        cls(7, alpha=1.0, beta=-1.0)
    sampler = cls(7, alpha=0.5, beta=1.0)
    with pytest.raises(ValueError, match="alpha must be greater or equal"):
        sampler.alpha = -0.5
    assert sampler.alpha == 0.5


def test_usage_errors(per_impl) -> None:
    sampler = _sampler(per_impl, 7)
    rb = _buffer(per_impl, LazyTensorStorage(7), sampler)
    with pytest.raises(RuntimeError, match="Cannot sample from an empty storage"):
        rb.sample(4)
    rb.extend(TensorDict({"obs": torch.arange(5)}, [5]))
    with pytest.raises(RuntimeError):  # 2 priorities for 3 indices
        rb.update_priority(torch.tensor([0, 1, 2]), torch.tensor([1.0, 2.0]))
    with pytest.raises(RuntimeError, match="storage"):  # coordinates need the storage
        sampler.update_priority(torch.tensor([[0, 1]]), torch.tensor([1.0]))


@pytest.mark.parametrize(
    ("shape", "index"),
    [((20,), [[1, 2], [3, 0]]), ((20, 3), [[1], [2]]), ((20, 3), [[1, 2, 0]])],
)
def test_coordinates_not_matching_the_storage_ndim_raise_value_error(
    per_impl, shape: tuple[int, ...], index: list[list[int]]
) -> None:
    """``[k, c]`` coordinates with ``c != storage.ndim``: ValueError, nothing is written."""
    size = int(np.prod(shape))
    sampler = _sampler(per_impl, size)
    rb = _buffer(per_impl, LazyTensorStorage(size, ndim=len(shape)), sampler)
    envs_by_steps = shape[::-1]  # an ndim=2 storage is [steps, envs]
    rb.extend(TensorDict({"obs": torch.zeros(envs_by_steps)}, list(envs_by_steps)))
    assert tuple(rb.storage.shape) == shape
    before = _tree(sampler, size)
    with pytest.raises(ValueError):
        rb.update_priority(torch.tensor(index), torch.full((len(index),), 7.0))
    assert torch.equal(_tree(sampler, size), before)


# ---------------------------------------------------------------- storages larger than the trees
def test_ndim2_storage_rounded_up_to_the_number_of_envs(per_impl) -> None:
    """``LazyTensorStorage(50, ndim=2)`` with 3 envs holds 51 slots; the last row is sampled."""
    sampler = _sampler(per_impl, 50, eps=0.0)
    rb = _buffer(per_impl, LazyTensorStorage(50, ndim=2), sampler)
    for i in range(6):  # 6 x 3 envs x 4 steps = 72 writes: the 17-row storage fills and wraps
        obs = torch.arange(12).view(3, 4) + 100 * i
        rb.extend(TensorDict({"obs": obs}, [3, 4]))
    assert rb.storage.shape == (17, 3) and len(rb.storage) == 51
    rb.update_priority((torch.tensor([16]), torch.tensor([2])), torch.tensor([1000.0]))
    assert sampler._sum_tree[50] == 1000.0
    _, info = rb.sample(256, return_info=True)
    rows, cols = info["index"]
    assert ((rows == 16) & (cols == 2)).float().mean() > 0.5


def test_max_capacity_smaller_than_the_storage(per_impl) -> None:
    """TorchRL's own ``test_ptdrb``: a 5-slot sampler on the default 1000-slot storage."""
    rb = per_impl.cls("TensorDictReplayBuffer")(
        sampler=_sampler(per_impl, 5, alpha=0.7, beta=0.9), priority_key="pk", batch_size=5
    )
    assert isinstance(rb.storage, ListStorage)
    first = TensorDict({"a": torch.arange(3.0), "pk": torch.rand(3) / 10}, [3])
    rb.extend(first)
    second = TensorDict({"a": torch.arange(3.0, 8.0), "pk": torch.rand(5) / 10}, [5])
    rb.extend(second)  # writes slots 3..7, past the sampler's 5
    s = rb.sample()
    assert torch.equal(s["a"], s["index"].float())
    s["pk"] = torch.where(s["index"] == 6, 1e8, 1e-3)
    rb.update_tensordict_priority(s)
    rb.update_priority(torch.tensor([6]), torch.tensor([1e8]))
    assert (rb.sample()["index"] == 6).all()


# ---------------------------------------------------------------- priorities and checkpoints
def test_mass_overflowing_float32_raises_overflow_error(per_impl) -> None:
    sampler = _sampler(per_impl, 7, alpha=2.0, beta=0.5)
    rb = _buffer(per_impl, LazyTensorStorage(7), sampler)
    rb.extend(TensorDict({"obs": torch.arange(5)}, [5]))
    with pytest.raises(OverflowError):  # TorchRL at sample, fastreplay at the update
        rb.update_priority(torch.tensor([1]), torch.tensor([1e20]))
        rb.sample(16)


def test_state_dict_of_the_other_class_raises_key_error(per_impl) -> None:
    from conftest import TORCHRL_EXT

    if not TORCHRL_EXT:
        pytest.skip("needs TorchRL's compiled extension for the other side's state dict")
    other = "fastreplay" if per_impl.is_torchrl else "torchrl"
    other_sampler = type(per_impl)(other).cls("PrioritizedSampler")(7, 1.0, 1.0)
    other_sampler.update_priority(torch.arange(3), torch.tensor([1.0, 2.0, 3.0]))
    sampler = _sampler(per_impl, 7)
    with pytest.raises(KeyError):
        sampler.load_state_dict(other_sampler.state_dict())


# ---------------------------------------------------------------- TorchRL's private trees
def test_sum_and_min_tree_reads(per_impl) -> None:
    sampler = _sampler(per_impl, 7, eps=0.0)
    sampler.update_priority(torch.tensor([0, 3, 4]), torch.tensor([1.0, 2.0, 4.0]))
    s, m = sampler._sum_tree, sampler._min_tree
    assert isinstance(s[3], float) and s[3] == 2.0 and s.at(4) == 4.0 and s[1] == 0.0
    assert isinstance(s[torch.tensor(3)], float)
    got = s[torch.tensor([[0, 3]])]
    assert isinstance(got, torch.Tensor) and got.dtype == torch.float32
    assert got.tolist() == [[1.0, 2.0]]
    got = s[np.array([0, 4])]
    assert isinstance(got, np.ndarray) and got.dtype == np.float32 and got.tolist() == [1.0, 4.0]
    assert s.query(0, 7) == 7.0 and s.query(1, 4) == 2.0 and s.query(0, 100) == 7.0
    assert m.query(0, 7) == 1.0 and m.query(1, 4) == 2.0
    assert m[1] == m.identity_element == float(torch.finfo(torch.float32).max)
    assert s.identity_element == 0.0 and len(s) == 7
    ranges = s.query(torch.tensor([0, 3]), torch.tensor([7, 4]))
    assert isinstance(ranges, torch.Tensor) and ranges.tolist() == [7.0, 2.0]


def test_scan_lower_bound(per_impl) -> None:
    sampler = _sampler(per_impl, 7, eps=0.0)
    sampler.update_priority(torch.tensor([0, 3, 4]), torch.tensor([1.0, 2.0, 4.0]))
    s = sampler._sum_tree  # prefix sums: slot 0 -> 1, slot 3 -> 3, slot 4 -> 7
    mass = [0.0, 0.5, 1.0, 1.5, 3.0, 3.5, 7.0]
    expected = [0, 0, 0, 3, 3, 4, 4]
    assert [s.scan_lower_bound(v) for v in mass] == expected
    assert s.scan_lower_bound(7.5) == 7  # past the total: the size
    got = s.scan_lower_bound(torch.tensor([mass]))
    assert got.dtype == torch.long and got.tolist() == [expected]
    got = s.scan_lower_bound(np.array(mass, dtype=np.float32))
    assert isinstance(got, np.ndarray) and got.tolist() == expected


@pytest.mark.parametrize("within", [True, False])
def test_max_priority_tracking(per_impl, within: bool) -> None:
    """TorchRL's ``test_prb_update_max_priority``, reading ``_max_priority``."""
    sampler = _sampler(per_impl, 11, max_priority_within_buffer=within)
    rb = ReplayBuffer(storage=LazyTensorStorage(11), sampler=sampler)
    for data in torch.arange(20):
        idx = rb.add(data)
        rb.update_priority(idx, 21 - data)
        value, index = sampler._max_priority
        if data <= 10 or not within:
            assert value == 21 and index == 0
        else:
            tree = _tree(sampler, 11)
            assert value == tree.max() and index == tree.argmax()
    idx = rb.extend(torch.arange(10))
    rb.update_priority(idx, 12)
    assert sampler._max_priority[0] == (12 if within else 21)
    assert sampler._max_priority[1] == 0


def test_default_priority_type(per_impl) -> None:
    sampler = _sampler(per_impl, 7, max_priority_within_buffer=False)
    assert sampler.default_priority == 1.0 and isinstance(sampler.default_priority, float)
    rb = _buffer(per_impl, LazyTensorStorage(7), sampler)
    rb.extend(TensorDict({"obs": torch.arange(3)}, [3]))
    rb.update_priority(torch.tensor([0, 1]), torch.tensor([0.5, 3.0]))
    default = sampler.default_priority
    assert isinstance(default, torch.Tensor)
    assert default.shape == () and default.dtype == torch.float32 and default.device.type == "cpu"
    assert default == 3.0

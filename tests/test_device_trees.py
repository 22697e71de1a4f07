"""The device tree backend's step dispatches a fixed number of torch ops and reads nothing back.

On an accelerator, every torch op is a kernel launch, and a read of a device value on the host
(``.item()``, ``.tolist()``, ``nonzero``, a boolean mask, a copy to the host) waits for every
queued kernel. The device backend's ``sample`` and ``mark_update`` must do neither: the tests
count, with a ``TorchDispatchMode`` on CPU tensors (the same code runs on CUDA), the ops of each
part of a PER step (``mark_update`` of a new row, ``sample`` of a batch, ``update_priority`` of
the batch), and the host reads (dispatched ones, and the Tensor methods that read values without
dispatching). The counts must not depend on the batch size or the capacity, and stay within the
budgets below. ``update_priority`` keeps one host read: the bounds of the batch that TorchRL's
errors (NaN, negative or out-of-range priorities and indices) need.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from tensordict import TensorDict
from torch.utils._python_dispatch import TorchDispatchMode
from torchrl.data import LazyTensorStorage

import fastreplay._core.trees.device_backend as device_backend
from conftest import requires_cuda
from fastreplay import PrioritizedSampler, TensorDictReplayBuffer

# Torch ops per step part on the device backend (CPU tensors; the same code on CUDA).
OP_BUDGET = {"mark_update": 54, "sample": 41, "update_priority": 49}
HOST_READ_BUDGET = {"mark_update": 0, "sample": 0, "update_priority": 1}
_SYNCING_OPS = {"_local_scalar_dense", "item", "nonzero", "masked_select", "is_nonzero"}
_READING_METHODS = ("tolist", "numpy", "item", "cpu", "__bool__", "__float__", "__int__")


class _Counter(TorchDispatchMode):
    """Counts dispatched ops by name, and the host-syncing ones apart."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()
        self.syncs = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        name = func.overloadpacket.__name__
        self.ops[name] += 1
        to_host = name in ("_to_copy", "copy_") and any(
            isinstance(a, torch.Tensor) and a.device.type != "cpu" for a in args
        )
        if name in _SYNCING_OPS or to_host:
            self.syncs += 1
        return func(*args, **(kwargs or {}))


@contextmanager
def _counting(monkeypatch: pytest.MonkeyPatch) -> Iterator[_Counter]:
    """A :class:`_Counter`, plus the Tensor methods that read values without dispatching."""
    counter = _Counter()
    for name in _READING_METHODS:
        original = getattr(torch.Tensor, name)

        def reading(self: torch.Tensor, *a: Any, _original: Callable = original, **k: Any) -> Any:
            counter.syncs += 1
            return _original(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, reading)
    with counter:
        yield counter
    monkeypatch.undo()


def _step_counts(
    capacity: int, batch: int, monkeypatch: pytest.MonkeyPatch, backend: str = "device"
) -> dict[str, tuple[int, int]]:
    """(ops, host reads) of each part of a PER step, with the index on the device."""
    # A CUDA writer's index lives on the device: mark_update then checks nothing on the host.
    monkeypatch.setattr(device_backend, "on_host", lambda index: False)
    sampler = PrioritizedSampler(capacity, 0.6, 0.4, backend=backend)
    sampler._rng = torch.Generator().manual_seed(0)  # on CUDA: torch.rand on the device
    rb = TensorDictReplayBuffer(
        storage=LazyTensorStorage(capacity), sampler=sampler, priority_key="td_error"
    )
    rb.extend(TensorDict(obs=torch.arange(300.0), td_error=torch.rand(300) + 0.1, batch_size=[300]))
    storage = rb._storage
    new = torch.tensor([300])
    storage.set(new, TensorDict(obs=torch.ones(1), td_error=torch.ones(1), batch_size=[1]))
    counts = {}
    with _counting(monkeypatch) as counter:
        sampler.mark_update(new, storage=storage)
    counts["mark_update"] = counter
    assert sampler._trees.raw()[300] == sampler._trees.raw()[:300].max()  # the live max
    with _counting(monkeypatch) as counter:
        index, info = sampler.sample(storage, batch)
    counts["sample"] = counter
    priority = torch.rand(batch) + 0.1
    with _counting(monkeypatch) as counter:
        sampler.update_priority(index, priority, storage=storage)
    counts["update_priority"] = counter
    assert index.shape == (batch,) and info["priority_weight"].shape == (batch,)
    return {part: (sum(c.ops.values()), c.syncs) for part, c in counts.items()}


@pytest.mark.parametrize("capacity", [1_000, 1_000_000])
@pytest.mark.parametrize("batch", [32, 256])
def test_step_ops_are_fixed_and_within_budget(
    capacity: int, batch: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    counts = _step_counts(capacity, batch, monkeypatch)
    for part, (ops, reads) in counts.items():
        assert ops <= OP_BUDGET[part], (part, ops)
        assert reads == HOST_READ_BUDGET[part], (part, reads)
    assert counts == _step_counts(1_000, 32, monkeypatch)  # whatever the batch and capacity


def test_the_counter_sees_host_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    """The torch backend reads back on every step: the counter must see it."""
    sampler = PrioritizedSampler(1_000, 0.6, 0.4, backend="torch")
    sampler.update_priority(torch.arange(10), torch.rand(10) + 0.1)
    rb = TensorDictReplayBuffer(storage=LazyTensorStorage(1_000), sampler=sampler)
    rb.extend(TensorDict(obs=torch.arange(10.0), batch_size=[10]))
    with _counting(monkeypatch) as counter:
        sampler.sample(rb._storage, 32)
    assert counter.syncs >= 2  # the total and the smallest mass, at least
    with _counting(monkeypatch) as counter:
        torch.ones(3).nonzero()
    assert counter.syncs == 1


def test_an_index_on_the_device_skips_minus_one_markers(monkeypatch: pytest.MonkeyPatch) -> None:
    """-1 markers write nothing, also when the index is not checked on the host."""
    monkeypatch.setattr(device_backend, "on_host", lambda index: False)
    sampler = PrioritizedSampler(10, 1.0, 0.5, backend="device")
    sampler.update_priority(torch.tensor([0, 1]), torch.tensor([1.0, 4.0]))
    sampler.mark_update(torch.tensor([-1, 2, -1]))
    raw = sampler._trees.raw()
    assert raw[:3].tolist() == [1.0, 4.0, 4.0] and (raw[3:] == -float("inf")).all()
    assert sampler._trees.total() == pytest.approx(1.0 + 2 * 4.0, rel=1e-6)
    padding = sampler._trees.levels[0][:, sampler._trees.capacity :]
    assert (padding[0] == 0).all() and sampler._trees.max_raw() == 4.0


def test_sampling_matches_the_torch_backend_at_a_million_slots() -> None:
    """Same priorities, same draws: the same slots and weights as the torch backend's."""
    gen = torch.Generator().manual_seed(3)
    index = torch.randint(0, 1_000_000, (5_000,), generator=gen)
    raw = torch.rand(5_000, generator=gen) * 10
    trees = []
    for backend in ("torch", "device"):
        sampler = PrioritizedSampler(1_000_000, 0.7, 0.5, backend=backend)
        sampler.update_priority(index, raw)
        trees.append(sampler._trees)
    assert trees[0].total() == pytest.approx(trees[1].total(), rel=1e-12)
    assert trees[0].min_mass() == trees[1].min_mass()
    draw = torch.rand(4096, generator=gen, dtype=torch.float64)
    expected = trees[0].sample(draw.clone(), trees[0].total(), trees[0].min_mass(), 0.5, True)
    found = trees[1].sample_live(draw.clone(), 0.5, True)
    assert torch.equal(found[0], expected[0]) and torch.equal(found[1], expected[1])


def test_the_cpu_default_is_unchanged_and_reported() -> None:
    """``sampler.backend`` and ``sampler.device`` report the choice; the CPU default is kept."""
    sampler = PrioritizedSampler(7, 0.5, 0.5)
    assert sampler.backend in ("numba", "torch") and sampler.device.type == "cpu"
    forced = PrioritizedSampler(7, 0.5, 0.5, backend="device")
    assert forced.backend == "device" and "backend='device'" in repr(forced)


@requires_cuda
def test_a_cuda_storage_gets_the_device_backend() -> None:
    sampler = PrioritizedSampler(100, 0.6, 0.4)
    rb = TensorDictReplayBuffer(
        storage=LazyTensorStorage(100, device="cuda"), sampler=sampler, priority_key="td_error"
    )
    rb.extend(TensorDict(obs=torch.arange(10.0), td_error=torch.rand(10) + 0.1, batch_size=[10]))
    assert sampler.backend == "device" and sampler.device.type == "cuda"
    data, info = rb.sample(32, return_info=True)
    assert info["priority_weight"].device.type == "cuda"
    rb.update_tensordict_priority(data)

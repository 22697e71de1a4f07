"""The triton tree backend: the device backend's trees with its walk and each write one kernel.

Without a GPU its kernels run under Triton's CPU interpreter (``TRITON_INTERPRET=1``, set by
``conftest.py`` before triton is imported). Checked here: the same leaves, levels and draws as
the device backend for the same calls (odd capacities, repeated slots, ``-1`` markers, a
million slots); one kernel launch per walk and per write, counted by a spy on the kernels, and
the torch ops around them counted with a ``TorchDispatchMode``, with no host read; the errors
for a device Triton cannot run on. The conformance suite
(``tests/conformance/test_tree_backends.py``) runs the backend against brute force and
TorchRL, in both buffers.
"""

from __future__ import annotations

import collections
import pickle
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import _disable_current_modes

from conftest import requires_triton
from fastreplay import PrioritizedSampler
from fastreplay._core.trees.interface import make_trees
from test_device_trees import _Counter, _step_counts

pytestmark = requires_triton
# On a GPU the kernels compile for it; elsewhere they run under the interpreter, on the CPU.
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

# Torch ops dispatched around the kernels (CPU tensors; the same code on CUDA).
OP_BUDGET = {"sample_live": 6, "write": 0}
# Torch ops of each part of the sampler's PER step (tests/test_device_trees.py's step).
STEP_BUDGET = {"mark_update": 19, "sample": 7, "update_priority": 26}


def _twins(capacity: int) -> tuple[Any, Any]:
    return tuple(make_trees(capacity, backend=b, device=DEVICE) for b in ("device", "triton"))


def _same_calls(trees: tuple[Any, Any], capacity: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for step in range(6):
        index = torch.randint(0, capacity, (60,), generator=gen)
        index[:4] = index[4:8]  # repeated slots: the last entry wins
        if step % 2:
            index[::7] = -1  # markers: nothing written
        raw = torch.rand(60, generator=gen, dtype=torch.float64) * 5
        results = [t.check_and_write(index, raw, capacity, 1e-6, 0.7, False) for t in trees]
        assert results[0] == results[1]
        new = torch.randint(0, capacity, (3,), generator=gen)
        marked = [t.mark_update(new, capacity, 1e-6, 0.7, False, 1.0, 1e9, None) for t in trees]
        assert torch.equal(marked[0][0], marked[1][0]) and marked[0][1] == marked[1][1]


@pytest.mark.parametrize("capacity", [7, 1_000, 4_097, 1_000_000])
def test_same_trees_and_draws_as_the_device_backend(capacity: int) -> None:
    device, triton = trees = _twins(capacity)
    _same_calls(trees, capacity, seed=capacity)
    assert torch.equal(device.levels[0], triton.levels[0])  # the leaves, bit for bit
    for ours, theirs in zip(device.levels[1:], triton.levels[1:], strict=True):
        assert torch.equal(ours[1:], theirs[1:])  # minima: in any order
        torch.testing.assert_close(ours[0], theirs[0], rtol=1e-13, atol=0.0)  # sums
    gen = torch.Generator().manual_seed(1)
    draw = torch.rand(500, generator=gen, dtype=torch.float64)
    expected = device.sample_live(draw.clone(), 0.5, False)
    found = triton.sample_live(draw.clone(), 0.5, False)
    assert torch.equal(found[0], expected[0])
    torch.testing.assert_close(found[1], expected[1], rtol=1e-12, atol=0.0)
    prefix = torch.rand(200, generator=gen, dtype=torch.float64) * device.total()
    assert torch.equal(triton.search(prefix), device.search(prefix))
    index, mass = triton.search_with_mass(prefix)
    assert torch.equal(mass, device.leaf_mass()[index])


def test_repeated_slots_take_their_last_value() -> None:
    trees = make_trees(100, backend="triton", device=DEVICE)
    index = torch.tensor([5, 9, 5, 5, 9, 1])
    raw = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0], dtype=torch.float64)
    trees.check_and_write(index, raw, 100, 0.0, 1.0, False)
    stored = trees.raw()
    assert stored[[1, 5, 9]].tolist() == [6.0, 4.0, 5.0]
    assert trees.total() == 15.0 and trees.min_mass() == 4.0 and trees.max_raw() == 6.0
    assert (stored[[i for i in range(100) if i not in (1, 5, 9)]] == -float("inf")).all()


@pytest.fixture
def launches() -> Iterator[collections.Counter[str]]:
    """Counts the launches of each kernel of the triton trees built after it.

    A launch runs outside any ``TorchDispatchMode``: on a GPU it dispatches no torch op, while
    Triton's CPU interpreter moves tensors through torch ops of its own.
    """
    from fastreplay._core.trees import triton_kernels

    count: collections.Counter[str] = collections.Counter()
    patches = pytest.MonkeyPatch()  # its own: the step counts undo the test's monkeypatch
    for name in ("walk", "write"):
        kernel = getattr(triton_kernels, name)

        class _Counted:
            def __getitem__(self, grid: Any, _name: str = name, _kernel: Any = kernel) -> Any:
                count[_name] += 1

                def launch(*args: Any, **kwargs: Any) -> Any:
                    with _disable_current_modes():
                        return _kernel[grid](*args, **kwargs)

                return launch

        patches.setattr(triton_kernels, name, _Counted())
    yield count
    patches.undo()


def _ops(call: Any) -> tuple[int, int]:
    with _Counter() as counter:
        call()
    return sum(counter.ops.values()), counter.syncs


@pytest.mark.parametrize("batch", [32, 256])
def test_one_launch_per_walk_and_per_write(batch: int, launches: collections.Counter) -> None:
    trees = make_trees(1_000_000, backend="triton", device=DEVICE)
    trees.check_and_write(torch.arange(300), torch.rand(300) + 0.1, 300, 1e-6, 0.6, True)
    launches.clear()
    draw = torch.rand(batch, dtype=torch.float64, device=DEVICE)
    ops, syncs = _ops(lambda: trees.sample_live(draw, 0.4, True))
    assert launches == {"walk": 1} and syncs == 0 and ops <= OP_BUDGET["sample_live"], ops
    index = torch.randint(0, 300, (batch,), device=DEVICE)
    leaves = torch.rand(3, batch, dtype=torch.float64, device=DEVICE)
    ops, syncs = _ops(lambda: trees._write(index, leaves))
    assert launches == {"walk": 1, "write": 1} and syncs == 0
    assert ops <= OP_BUDGET["write"], ops


@pytest.mark.skipif(DEVICE.type == "cuda", reason="a CPU storage's trees: under the interpreter")
@pytest.mark.parametrize("capacity", [1_000, 1_000_000])
def test_a_per_step_dispatches_fewer_ops_than_on_the_device_backend(
    capacity: int, launches: collections.Counter, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The sampler's PER step (``mark_update``, ``sample``, ``update_priority``) on each."""
    counts = _step_counts(capacity, 256, monkeypatch, backend="triton")
    device = _step_counts(capacity, 256, monkeypatch, backend="device")
    for part, (ops, reads) in counts.items():
        assert ops <= STEP_BUDGET[part], (part, ops)
        assert ops < device[part][0] and reads == device[part][1], (part, counts, device)
    # The set-up's extend and the step each: mark_update (clear, then write) and one update.
    assert launches == {"write": 6, "walk": 1}, launches


def test_the_sampler_draws_as_with_the_device_backend() -> None:
    """Same priorities and generator: the same slots and weights as ``backend="device"``."""
    samplers = [
        PrioritizedSampler(1_001, 0.7, 0.5, backend=b, device=DEVICE) for b in ("device", "triton")
    ]
    gen = torch.Generator().manual_seed(0)
    index, raw = torch.randint(0, 1_001, (700,), generator=gen), torch.rand(700, generator=gen)
    for sampler in samplers:
        sampler.update_priority(index, raw + 0.01)
        sampler._rng = torch.Generator(device=DEVICE).manual_seed(7)
    assert samplers[1].backend == "triton" and "backend='triton'" in repr(samplers[1])
    trees = [s._trees for s in samplers]
    draw = torch.rand(256, generator=gen, dtype=torch.float64).to(DEVICE)
    found = [t.sample_live(draw.clone(), 0.5, True) for t in trees]
    assert torch.equal(found[0][0], found[1][0]) and torch.equal(found[0][1], found[1][1])


def test_pickled_trees_keep_their_priorities_and_kernels() -> None:
    trees = make_trees(50, backend="triton", device=DEVICE)
    trees.check_and_write(torch.tensor([3, 7]), torch.tensor([2.0, 5.0]), 50, 0.0, 1.0, False)
    copy = pickle.loads(pickle.dumps(trees))
    assert copy.backend == "triton" and copy.total() == 7.0
    copy.check_and_write(torch.tensor([3]), torch.tensor([1.0]), 50, 0.0, 1.0, False)
    assert copy.total() == 6.0 and trees.total() == 7.0


def test_a_device_triton_cannot_run_on_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match=r"backend='triton'.*device=meta.*backend='device'"):
        make_trees(10, backend="triton", device="meta")
    from fastreplay._core.trees import triton_kernels

    trees = make_trees(10, backend="triton", device=DEVICE)
    monkeypatch.setattr(triton_kernels, "INTERPRETED", False)  # the CPU, no interpreter
    with pytest.raises(ValueError, match=r"device=cpu.*TRITON_INTERPRET=1"):
        PrioritizedSampler(10, 0.5, 0.5, backend="triton")
    with pytest.raises(ValueError, match=r"device=cpu"):
        trees.to("cpu")
    assert make_trees(10, backend="device").to("cpu").backend == "device"  # moves anywhere

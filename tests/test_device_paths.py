"""Operation budgets of the direct path on an accelerator storage, held without a GPU.

A CUDA step costs a kernel launch per operation, and a synchronisation each time the host
reads a value of the device. Both are counted here, on the same code with CPU tensors:

* :class:`OpCount`, a ``TorchDispatchMode``, records every ATen operation a step dispatches
  (views aside: they launch nothing) and the ones that synchronise on an accelerator
  (``_local_scalar_dense``, ``nonzero``, ``masked_select``, ``equal``, ...; copies from a
  device to the host);
* :class:`HostReads` counts the ``Tensor`` methods that read values on the host
  (``.item()``, ``.tolist()``, ``.numpy()``, ``.cpu()``, ``bool``/``int``/``float``/``index``):
  on a CPU tensor they dispatch nothing, on a CUDA tensor each one waits for the device;
* the ``meta`` device stands in for an accelerator: a storage there takes the direct path's
  device branch, and anything that reads one of its values on the host raises.

The budgets are written in the tests; docs/gpu.md says what they mean and what is not measured.
"""

from __future__ import annotations

import collections
import gc
import multiprocessing
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from tensordict import TensorDict
from torch.utils._python_dispatch import TorchDispatchMode
from torchrl.data import LazyTensorStorage, RandomSampler
from torchrl.data import TensorDictReplayBuffer as TorchRLBuffer

from conftest import _collections_deferred, requires_storage_revision
from fastreplay import PrioritizedSliceSampler, SliceSampler, TensorDictReplayBuffer
from fastreplay._torchrl import truncation_flags

SYNC_OPS = frozenset(
    {
        "_local_scalar_dense",  # .item(), int(t), bool(t)
        "item",
        "is_nonzero",
        "equal",  # torch.equal: a bool on the host
        "nonzero",  # a data-dependent size
        "masked_select",
        "unique",
        "_unique",
        "_unique2",
        "unique_consecutive",
        "unique_dim",
    }
)
"""Operations that make the host wait for the device (their result is read on the host)."""

KEYS = {"obs": (17,), "next_obs": (17,), "action": (6,), "reward": (), "done": ()}
"""A SAC-like row (LeanRL's layout): five keys, the storage adds ``index``."""


class OpCount(TorchDispatchMode):
    """Counts the ATen operations dispatched inside it: launches, syncs, host copies.

    ``launches``: operations that run a kernel on an accelerator (every non-view operation);
    ``syncs``: those of :data:`SYNC_OPS`, and copies from a non-CPU tensor to the CPU.
    """

    def __init__(self) -> None:
        super().__init__()
        self.launches: collections.Counter[str] = collections.Counter()
        self.syncs: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if not func.is_view:
            self.launches[name] += 1
        if name in SYNC_OPS or _to_host(name, args, kwargs):
            self.syncs[name] += 1
        return func(*args, **kwargs)


def _to_host(name: str, args: tuple, kwargs: dict) -> bool:
    """Whether the operation copies a non-CPU tensor into CPU memory."""
    if name == "_to_copy" and args and isinstance(args[0], torch.Tensor):
        target = kwargs.get("device")
        return not args[0].is_cpu and target is not None and torch.device(target).type == "cpu"
    if name == "copy_" and len(args) > 1:
        dst, src = args[0], args[1]
        return isinstance(src, torch.Tensor) and not src.is_cpu and dst.is_cpu
    return False


_HOST_READS = ("item", "tolist", "numpy", "cpu", "__bool__", "__int__", "__float__", "__index__")


class HostReads:
    """Counts calls of the ``Tensor`` methods that read values on the host (CPU ones too)."""

    def __init__(self) -> None:
        self.calls: collections.Counter[str] = collections.Counter()
        self._saved: dict[str, Any] = {}

    def __enter__(self) -> HostReads:
        for name in _HOST_READS:  # (the inherited ones are put back by deleting the override)
            self._saved[name] = torch.Tensor.__dict__.get(name)
            setattr(torch.Tensor, name, self._counted(name, getattr(torch.Tensor, name)))
        return self

    def _counted(self, name: str, method: Callable) -> Callable:
        calls = self.calls

        def counted(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            calls[name] += 1
            return method(tensor, *args, **kwargs)

        return counted

    def __exit__(self, *exc: object) -> None:
        for name, original in self._saved.items():
            if original is None:
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, original)


@contextmanager
def counted() -> Iterator[tuple[OpCount, HostReads]]:
    with HostReads() as reads, OpCount() as ops:
        yield ops, reads


def rows(n: int, device: str, start: int = 0) -> TensorDict:
    values = torch.arange(start, start + n, dtype=torch.float32)
    return TensorDict(
        {
            key: (values.reshape(n, *([1] * len(shape))).expand(n, *shape).clone())
            for key, shape in KEYS.items()
        },
        batch_size=[n],
        device=device,
    ).to(device)


def lazy_storage(capacity: int, device: str) -> LazyTensorStorage:
    return LazyTensorStorage(capacity, device=device)


def first_write(rb: Any, data: TensorDict) -> None:
    """The write that creates the storage (TorchRL's path; on ``meta`` its one host read
    of the last written row, ``int(cursor.item())``, is given the host value)."""
    storage = rb._storage
    if data.device.type == "meta":
        storage._set_last_cursor = lambda cursor: type(storage)._set_last_cursor(
            storage, cursor.numel() - 1
        )
        try:
            rb.extend(data)
        finally:
            del storage._set_last_cursor
    else:
        rb.extend(data)


def uniform_buffer(device: str, sampler: Any = None) -> TensorDictReplayBuffer:
    kwargs = {} if sampler is None else {"sampler": sampler}
    rb = TensorDictReplayBuffer(storage=lazy_storage(1000, device), **kwargs)
    first_write(rb, rows(10, device))
    return rb


LEAVES = len(KEYS)


def extend_budget(wraps: bool) -> dict[str, int]:
    """The rows (one ``arange``), the wrap (one ``remainder_``), one copy per stored leaf."""
    return {"arange": 1, "index_copy_": LEAVES + 1, **({"remainder_": 1} if wraps else {})}


SAMPLE_BUDGET = {"randint": 1, "index_select": LEAVES}
"""TorchRL's ``RandomSampler`` draw on the storage's device, and one gather per leaf."""


def _step_counts(rb: Any, device: str, n: int, batch: int) -> tuple:
    new = rows(n, device)
    with counted() as (ops, reads):
        index = rb.extend(new)
    extend = (dict(ops.launches), dict(ops.syncs), dict(reads.calls))
    with counted() as (ops, reads):
        data = rb.sample(batch)
    sample = (dict(ops.launches), dict(ops.syncs), dict(reads.calls))
    with counted() as (ops, reads):
        rb.update_tensordict_priority(data)
    priority = (dict(ops.launches), dict(ops.syncs), dict(reads.calls))
    return index, data, extend, sample, priority


@requires_storage_revision  # (the direct path needs the storage's write counter)
@pytest.mark.parametrize("device", ["cpu", "meta"])
@pytest.mark.parametrize("sampler", [None, RandomSampler], ids=["default", "RandomSampler"])
def test_uniform_step_is_a_fixed_number_of_launches_and_no_sync(device: str, sampler: Any):
    rb = uniform_buffer(device, None if sampler is None else sampler())
    seen = []
    for batch in (32, 256):
        for n in (1, 64):
            index, data, extend, sample, priority = _step_counts(rb, device, n, batch)
            assert index.device.type == device and index.shape == (n,)
            assert data.device.type == device and data.batch_size == (batch,)
            assert data["index"].device.type == device
            assert extend == (extend_budget(wraps=False), {}, {})
            assert sample == (SAMPLE_BUDGET, {}, {})
            assert priority == ({}, {}, {})  # a uniform sampler keeps no priorities
            seen.append(sample)
    assert all(s == seen[0] for s in seen)  # the batch size changes no count
    while len(rb) < 1000 or rb._writer._cursor + 64 <= 1000:  # up to a wrapping write
        rb.extend(rows(64, device))
    _, _, extend, _, _ = _step_counts(rb, device, 64, 32)
    assert extend == (extend_budget(wraps=True), {}, {})


def test_uniform_step_on_the_host_matches_torchrl():
    """The counted path is the one that returns TorchRL's rows and stream (same seeds)."""
    ours, ref = uniform_buffer("cpu"), TorchRLBuffer(storage=lazy_storage(1000, "cpu"))
    ref.extend(rows(10, "cpu"))
    for step in range(4):
        data = rows(64, "cpu", start=100 * step)
        torch.testing.assert_close(ours.extend(data.clone()), ref.extend(data.clone()))
        torch.manual_seed(step)
        got = ours.sample(32)
        torch.manual_seed(step)
        expected = ref.sample(32)
        assert (got == expected).all()


@requires_storage_revision
def test_meta_storage_takes_the_direct_path_only():
    """TorchRL's general path reads the device on the host: on ``meta`` it raises."""
    rb = uniform_buffer("meta")
    rb._fr_fast = False
    with pytest.raises((RuntimeError, NotImplementedError)):
        rb.extend(rows(4, "meta"))


@requires_storage_revision
def test_device_branch_declines_data_on_another_device():
    """A host TensorDict written into an accelerator storage goes through TorchRL's path."""
    rb = uniform_buffer("meta")
    assert rb._fr_write(rows(4, "cpu")) is None
    assert len(rb) == 10


# ----------------------------------------------------------------------------- slice samplers
# fastreplay's slice samplers keep the trajectory index on the host: a sample draws on the
# storage's device (TorchRL's stream) and reads the draw back, and the gather checks the
# runs of rows (torch.equal). On the CPU those reads are counted, not synchronisations.

SLICE_SYNC_BUDGET = 1  # the run check of the gather (torch.equal), on host indices only
SLICE_HOST_READ_BUDGET = 4  # the two draws (trajectories, start offsets): .cpu().numpy() each
SLICE_LAUNCH_BUDGET = 16  # two draws, the flags, the run check, one gather per stored leaf


def _slice_buffer() -> TensorDictReplayBuffer:
    rb = TensorDictReplayBuffer(
        storage=lazy_storage(1000, "cpu"), sampler=SliceSampler(slice_len=4, traj_key="traj")
    )
    data = rows(500, "cpu")
    data["traj"] = torch.arange(500) // 50
    rb.extend(data)
    return rb


def test_slice_sample_reads_the_host_a_fixed_number_of_times():
    rb = _slice_buffer()
    counts = []
    for batch in (32, 256):
        rb.sample(batch)  # the sampler's first sample builds its index
        with counted() as (ops, reads):
            rb.sample(batch)
        syncs, host = sum(ops.syncs.values()), sum(reads.calls.values())
        assert syncs <= SLICE_SYNC_BUDGET, ops.syncs
        assert host <= SLICE_HOST_READ_BUDGET, reads.calls
        assert sum(ops.launches.values()) <= SLICE_LAUNCH_BUDGET, ops.launches
        counts.append((dict(ops.launches), dict(ops.syncs), dict(reads.calls)))
    assert counts[0] == counts[1]


def test_slice_rows_on_an_accelerator_are_gathered_without_a_sync():
    """The rows a slice sampler drew, once on the device, are gathered with no host read.

    The run check (``torch.equal``) runs on host indices only; device indices (the host
    index copied to the storage's device, as the direct path does) go row by row: one
    ``index_select`` per stored leaf, at any batch size.
    """
    from fastreplay.buffers import rows as _rows

    plan = _rows.gather_plan(rows(100, "meta"))
    assert plan is not None
    counts = []
    for slices in (8, 64):
        host = (torch.arange(slices) * 10).repeat_interleave(4) + torch.arange(4).repeat(slices)
        assert _rows._run_starts(host, 4, 100) is not None  # host rows come in runs
        index = host.to("meta")
        with counted() as (ops, reads):
            data, _ = _rows.gather_rows(plan, index, 100, run=4)
        assert dict(ops.syncs) == {} and dict(reads.calls) == {}
        assert dict(ops.launches) == {"index_select": LEAVES}
        assert data.batch_size == (4 * slices,) and data["obs"].device.type == "meta"
        counts.append(dict(ops.launches))
    assert counts[0] == counts[1]


# ----------------------------------------------------------------------------- slice flags
def _flags_storage() -> TensorDict:
    return TensorDict(
        done=torch.zeros(10, 1, dtype=torch.bool),
        terminated=torch.zeros(10, 1, dtype=torch.bool),
        batch_size=[10],
        device="meta",  # stands in for an accelerator: a CPU operand is refused, as on CUDA
    )


def test_truncation_flags_lie_on_the_storage_device():
    index = (torch.tensor([1, 2, 3, 4]),)  # a host index, as the slice samplers' own
    truncated = torch.zeros(4, 1, dtype=torch.bool)
    flags = truncation_flags("truncated", _flags_storage(), index, truncated)
    assert {key: value.device.type for key, value in flags.items()} == dict.fromkeys(
        ("truncated", "done", "terminated"), "meta"
    )


def test_prioritized_slice_flags_with_an_accelerator_storage():
    """``PrioritizedSliceSampler``'s flags: the stored ``done`` or-ed with a host ``truncated``."""
    sampler = PrioritizedSliceSampler(100, alpha=0.7, beta=0.5, slice_len=2, traj_key="traj")
    sampler.truncated_key = "truncated"
    storage = types.SimpleNamespace(_storage=_flags_storage())
    flags = sampler._fr_flags(storage, (torch.tensor([1, 2, 5, 6]),), 2, 2)
    assert flags["done"].device.type == "meta" and flags["done"].shape == (4, 1)


# ----------------------------------------------------------------------------- the suite's guard
def test_resource_tracker_messages_run_without_collections():
    """conftest defers garbage collections while the resource tracker is called (3.12)."""
    from multiprocessing import resource_tracker

    assert resource_tracker.ResourceTracker._send.__wrapped_by_fastreplay_tests__
    assert not _collections_deferred(gc.isenabled)()
    assert gc.isenabled()
    counter = multiprocessing.get_context("spawn").Value("q", 0)  # a named semaphore
    del counter
    gc.collect()

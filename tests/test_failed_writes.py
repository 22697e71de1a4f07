"""Writes that raise part way: the next sample of a slice sampler sees the rows they wrote.

``rb[idx] = td``, ``rb.extend(td)`` or ``storage.set(...)`` with a later key of the wrong shape
writes the keys before it and raises. TorchRL's storages count a write after its data
(``_mutation_revision``), so such a write goes uncounted; TorchRL's ``SliceSampler`` (no cache)
rescans at every sample and sees the new rows. fastreplay's slice samplers must too: their
index is rebuilt (fastreplay's buffers count the failed write; the samplers also see the
signal tensors written in place), never left describing the old trajectories.

Data: ``obs = traj_id * 10_000 + step``, so a slice that crosses a trajectory shows up.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
import torchrl.data as trl

import fastreplay
from conformance.conftest import DONE, assert_slices_valid, episodes
from conftest import short_flat_batches

# The nightly warns when a without-replacement epoch ends on a short flat batch, as TorchRL's.
pytestmark = short_flat_batches

SLICE_LEN = 5
SAMPLERS = ("SliceSampler", "SliceSamplerWithoutReplacement", "PrioritizedSliceSampler")
BUFFERS = {"fastreplay": fastreplay.TensorDictReplayBuffer, "torchrl": trl.TensorDictReplayBuffer}
SIGNALS = {"traj": {"traj_key": "traj"}, "done": {"end_key": DONE}}


def _sampler(name: str, capacity: int, signal: str) -> Any:
    kwargs = {"slice_len": SLICE_LEN, **SIGNALS[signal]}
    if name == "PrioritizedSliceSampler":
        return fastreplay.PrioritizedSliceSampler(capacity, 1.0, 1.0, **kwargs)
    return getattr(fastreplay, name)(**kwargs)


def _rows(n: int, length: int, columns: int | None, *, first_id: int = 0, extra: int = 2) -> Any:
    """``episodes(...)`` plus a last key ``extra`` of feature size ``extra``."""
    td = episodes(n, length, columns=columns, first_id=first_id)
    td["extra"] = torch.zeros(*td.shape, extra)
    return td


def _setup(name: str, buffer: str, signal: str, columns: int | None) -> tuple[Any, Any, Any]:
    """Three 20-step trajectories per column, sampled once (the index is built)."""
    storage = trl.LazyTensorStorage(20 * (columns or 3), ndim=2 if columns else 1)
    sampler = _sampler(name, 20 * (columns or 3), signal)
    rb = BUFFERS[buffer](storage=storage, sampler=sampler, batch_size=4 * SLICE_LEN)
    rb.extend(_rows(20 * (1 if columns else 3), 20, columns))  # full: the writer is at row 0
    rb.sample()
    return rb, sampler, storage


def _assert_sees_the_new_rows(rb: Any, storage: Any, new_ids: set[int]) -> None:
    """Slices stay inside the trajectories now stored, and the new ones are drawn."""
    drawn: set[int] = set()
    for seed in range(40):
        torch.manual_seed(seed)
        np.random.seed(seed)  # the prioritized sampler draws from NumPy's RNG, as TorchRL's
        batch = rb.sample()
        assert_slices_valid(batch["obs"], batch.numel() // SLICE_LEN)  # (an epoch may end)
        drawn |= set(batch["traj"].reshape(-1).tolist())
    assert new_ids <= drawn


def _fail(write: Any) -> None:
    with pytest.raises(RuntimeError):
        write()


@pytest.mark.parametrize("signal", list(SIGNALS))
@pytest.mark.parametrize("buffer", list(BUFFERS))
@pytest.mark.parametrize("name", SAMPLERS)
@pytest.mark.parametrize("how", ["buffer_setitem", "storage_setitem", "storage_set", "extend"])
def test_a_write_that_raises_part_way_is_seen_1d(name: str, buffer: str, signal: str, how: str):
    """1-D storage: rows 0-9 of trajectory 0 become trajectories 100 and 101, then it raises."""
    rb, _, storage = _setup(name, buffer, signal, None)
    bad = _rows(10, 5, None, first_id=100, extra=3)  # "extra", written last, does not fit
    rows = torch.arange(10)  # from a trajectory start, so done flags describe the new rows too
    writes = {
        "buffer_setitem": lambda: rb.__setitem__(rows, bad),
        "storage_setitem": lambda: storage.__setitem__(rows, bad),
        "storage_set": lambda: storage.set(rows, bad),  # set_cursor=True: as a writer does
        "extend": lambda: rb.extend(bad),  # the writer is at row 0
    }
    _fail(writes[how])
    assert storage["traj"][rows].tolist() == [100] * 5 + [101] * 5  # written in part
    _assert_sees_the_new_rows(rb, storage, {100, 101})


@pytest.mark.parametrize("signal", list(SIGNALS))
@pytest.mark.parametrize("buffer", list(BUFFERS))
@pytest.mark.parametrize("name", SAMPLERS)
@pytest.mark.parametrize("how", ["storage_setitem", "storage_set", "extend"])
def test_a_write_that_raises_part_way_is_seen_ndim2(
    name: str, buffer: str, signal: str, how: str
) -> None:
    """ndim=2 storage (20 time rows x 3 columns): time rows 0-9 of every column rewritten."""
    rb, _, storage = _setup(name, buffer, signal, 3)
    bad = _rows(10, 5, 3, first_id=100, extra=3)  # [3 columns, 10 steps]
    rows = torch.arange(10)
    writes = {
        "storage_setitem": lambda: storage.__setitem__(rows, bad.transpose(0, 1)),
        "storage_set": lambda: storage.set(rows, bad.transpose(0, 1)),
        "extend": lambda: rb.extend(bad),  # the writer is at row 0 (the storage is full)
    }
    _fail(writes[how])
    assert storage[rows]["traj"].unique().tolist() == list(range(100, 106))  # written in part
    _assert_sees_the_new_rows(rb, storage, set(range(100, 106)))


@pytest.mark.parametrize("name", SAMPLERS)
@pytest.mark.parametrize(
    "how,columns",
    [("setitem", None), ("extend", None), ("extend", 3)],
    ids=["setitem", "1d", "ndim2"],
)
def test_through_fastreplay_s_buffer_a_later_write_changes_nothing(name: str, how: str, columns):
    """fastreplay's buffer counts its failed write: a write reported after it does not hide it."""
    rb, _, storage = _setup(name, "fastreplay", "traj", columns)
    bad = _rows(10, 5, columns, first_id=100, extra=3)
    if how == "setitem":  # rows 20-29, inside trajectory 1; the writer stays at row 0
        rows = torch.arange(20, 30)
        _fail(lambda: rb.__setitem__(rows, bad))
    else:  # rows 0-9; the writer moves on to row 10
        rows = torch.arange(10)
        _fail(lambda: rb.extend(bad))
    rb.extend(_rows(5, 5, columns, first_id=200))  # 5 rows at the writer, reported
    new_ids = set(storage[rows]["traj"].reshape(-1).tolist())
    assert min(new_ids) >= 100
    _assert_sees_the_new_rows(rb, storage, new_ids)


@pytest.mark.parametrize("name", SAMPLERS)
def test_elsewhere_a_failed_write_before_a_reported_one_is_seen(name: str):
    """A failed write fastreplay's buffer does not make, then a write the sampler is told about.

    The signal's version counter moved for both, by one more than the one reported write:
    the sampler counts the first as a write nobody reported, and rebuilds at the next sample.
    """
    rb, sampler, storage = _setup(name, "torchrl", "traj", None)
    bad = _rows(10, 5, None, first_id=100, extra=3)
    _fail(lambda: storage.__setitem__(torch.arange(20, 30), bad))  # inside trajectory 1
    rb.extend(_rows(5, 5, None, first_id=200))  # rows 0-4, reported
    expected = trl.SliceSampler(slice_len=SLICE_LEN, traj_key="traj")
    got, want = sampler._get_stop_and_length(storage), expected._get_stop_and_length(storage)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    _assert_sees_the_new_rows(rb, storage, {100, 101})

"""fastreplay's slice-index construction against TorchRL's code, bit for bit.

Every slice sampler builds its slice indices with one builder,
:func:`fastreplay._core.slice_index.slice_index`: checked here against TorchRL's ``_get_index``
(random slice starts inside trajectories, slices of one or several lengths, 1-D and 2-D
storages, wrap-around) and ``_tensor_slices_from_startend`` (given slice starts). ``SliceSampler``
uses it in the common case (``_get_index``: slices of one length, 1-D storage, no ``span``),
reads only the keys ``_finalize_index`` needs at the sampled rows (TorchRL gathers the whole
sample there), and its :class:`IndexSync` classifies the rows a write reports with numpy. Each
is checked against TorchRL's own code on the same inputs and seed: memmap and in-memory
storages, wrap-around, stored ``done``/``terminated``/``is_init`` flags, every
``truncated_key``/``init_key`` setting, and the cases that go to TorchRL's code.
"""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import pytest
import torch
import torchrl.data as trl
from tensordict import TensorDict
from torchrl.data import LazyMemmapStorage, LazyTensorStorage

import fastreplay
from conftest import short_flat_batches, skip_unless_slice_args
from fastreplay._core.slice_index import slice_index
from fastreplay._torchrl import finalize_index
from fastreplay.samplers._index_sync import IndexSync

DONE, TERMINATED = ("next", "done"), ("next", "terminated")


def _episodes(n: int, first: int, length: int, flags: bool) -> TensorDict:
    """Steps ``first .. first + n`` of episodes of ``length``: ``obs = traj * 10_000 + step``."""
    steps = torch.arange(first, first + n)
    traj = steps // length
    td = TensorDict(traj=traj, obs=traj * 10_000 + steps % length, batch_size=[n])
    if flags:
        td[DONE] = (steps % length == length - 1)[:, None]
        td[TERMINATED] = (steps % (3 * length) == 3 * length - 1)[:, None]
        td["is_init"] = steps % length == 0
    return td


def _assert_same_sample(got: tuple, expected: tuple) -> None:
    (index, info), (ref_index, ref_info) = got, expected
    assert len(index) == len(ref_index)
    for a, b in zip(index, ref_index, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)
    assert list(info) == list(ref_info)
    for key in info:
        assert type(info[key]) is type(ref_info[key]), key
        assert info[key].dtype == ref_info[key].dtype and torch.equal(info[key], ref_info[key])


SETTINGS = [
    pytest.param({}, id="defaults"),
    pytest.param({"truncated_key": None}, id="truncated_key=None"),
    pytest.param({"init_key": None}, id="init_key=None"),
    pytest.param({"truncated_key": None, "init_key": None}, id="neither"),
    pytest.param({"strict_length": False}, id="strict_length=False"),
    pytest.param({"strict_length": False, "pad_output": True}, id="pad_output"),  # TorchRL's
    pytest.param({"span": True, "strict_length": False}, id="span"),  # TorchRL's code
]


@pytest.mark.parametrize("settings", SETTINGS)
@pytest.mark.parametrize("memmap", [False, True], ids=["tensor", "memmap"])
@pytest.mark.parametrize("flags", [False, True], ids=["no-flags", "stored-flags"])
@short_flat_batches
def test_same_indices_and_info_as_torchrl(
    settings: dict, memmap: bool, flags: bool, tmp_path: Any
) -> None:
    """Same seed, same storage: fastreplay's sampler and TorchRL's return the same sample."""
    capacity = 101  # odd; written past capacity: wraps, slices cross the storage's end
    storage = (
        LazyMemmapStorage(capacity, scratch_dir=tmp_path) if memmap else LazyTensorStorage(capacity)
    )
    skip_unless_slice_args(settings)
    kwargs = {"num_slices": 5, "traj_key": "traj", **settings}
    fast, ref = fastreplay.SliceSampler(**kwargs), trl.SliceSampler(**kwargs)
    rb = fastreplay.TensorDictReplayBuffer(storage=storage, sampler=fast, batch_size=20)
    written = 0
    for n in (60, 37, 80, 13):
        rb.extend(_episodes(n, written, 9, flags))
        written += n
        for seed in range(3):
            fast._rng = torch.Generator().manual_seed(seed)
            ref._rng = torch.Generator().manual_seed(seed)
            _assert_same_sample(fast.sample(storage, 20), ref.sample(storage, 20))


def test_get_index_matches_torchrls_on_the_same_inputs() -> None:
    """``_get_index`` alone, TorchRL's as the reference, on random starts and lengths."""
    sampler = fastreplay.SliceSampler(num_slices=7, traj_key="traj")
    storage = LazyTensorStorage(1023)
    storage.set(torch.arange(1023), _episodes(1023, 0, 50, flags=True))
    gen = torch.Generator().manual_seed(0)
    for seq_length in (1, 4, 11):
        lengths = torch.randint(seq_length, 60, (40,), generator=gen)
        start_idx = torch.randint(0, 1023, (40, 1), generator=gen)
        traj_idx = torch.randint(0, 40, (7,), generator=gen)
        args = (lengths, start_idx, start_idx, seq_length, 7, 1023, traj_idx)
        sampler._rng = torch.Generator().manual_seed(seq_length)
        got = sampler._get_index(*args, storage=storage)
        sampler._rng = torch.Generator().manual_seed(seq_length)
        expected = trl.SliceSampler._get_index(sampler, *args, storage=storage)
        _assert_same_sample(got, expected)


def test_finalize_index_reads_only_the_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    """The sampler gathers no whole rows (the buffer gathers them); TorchRL's does, once."""
    storage = LazyTensorStorage(50)
    storage.set(torch.arange(50), _episodes(50, 0, 10, flags=True))
    sampler = fastreplay.SliceSampler(num_slices=2, traj_key="traj")
    sampler.sample(storage, 8)  # the index is built: only the sample's reads remain
    gathered: list[Any] = []
    original_get = LazyTensorStorage.get

    def get(self: Any, index: Any) -> Any:
        gathered.append(index)
        return original_get(self, index)

    monkeypatch.setattr(LazyTensorStorage, "get", get)
    sampler.sample(storage, 8)  # the info built directly (``_fr_info``)
    assert gathered == []
    # the ``_finalize_index`` override, which TorchRL's own paths reach through ``_get_index``
    fr_slices = fastreplay.SliceSampler._fr_slices
    monkeypatch.setattr(
        fastreplay.SliceSampler,
        "_fr_slices",
        lambda self, *args, synced=False: fr_slices(self, *args, synced=False),
    )
    sampler.sample(storage, 8)
    assert gathered == []
    # TorchRL's (on 0.13, whose ``_get_index`` builds the info inline: that code, as a hook)
    monkeypatch.setattr(
        fastreplay.SliceSampler,
        "_finalize_index",
        lambda self, **kwargs: finalize_index(super(fastreplay.SliceSampler, self), self, **kwargs),
    )
    sampler.sample(storage, 8)  # the whole sample, keys it does not read included
    assert len(gathered) == 1


def _round_robin_reference(rows: list[int]) -> bool:
    """TorchRL-style torch check: consecutive rows, wrapping at most once to row 0."""
    index = torch.as_tensor(rows)
    step = index[1:] - index[:-1]
    sequential = (step == 1) | ((index[1:] == 0) & (step < 0))
    return int((step < 0).sum()) <= 1 and bool(sequential.all())


def test_write_reports_are_classified_as_the_reference_does() -> None:
    """Every row vector up to 5 long over -1..3, plus round-robin runs with one row changed."""
    vectors = [list(v) for n in range(1, 6) for v in itertools.product(range(-1, 4), repeat=n)]
    rng = np.random.default_rng(0)
    for _ in range(300):
        capacity = int(rng.integers(1, 20))
        rows = (int(rng.integers(0, capacity)) + np.arange(int(rng.integers(1, 40)))) % capacity
        if rng.random() < 0.5:
            rows[rng.integers(0, rows.size)] = rng.integers(-1, capacity)
        vectors.append(rows.tolist())
    for rows in vectors:
        sync = fastreplay.SliceSampler(num_slices=1, traj_key="traj")._fr_sync
        assert isinstance(sync, IndexSync)
        sync.record(torch.tensor(rows))
        assert sync.dirty is not _round_robin_reference(rows), rows
        if not sync.dirty:
            assert sync.pending == [[rows[0], len(rows)]]


@pytest.mark.parametrize("ndim", [1, 2])
@pytest.mark.parametrize("variable", [False, True], ids=["one-length", "several-lengths"])
def test_builder_matches_torchrls_get_index(ndim: int, variable: bool) -> None:
    """Random slices inside trajectories: ``slice_index`` with a draw is ``_get_index``.

    TorchRL's ``_get_index`` (no ``span``) on the same starts, lengths and seed: the same rows
    and coordinates of every step, slices crossing the storage's end wrapping to row 0.
    """
    rows, columns, n = 53, 3, 9
    storage = LazyTensorStorage(rows * columns if ndim == 2 else rows, ndim=ndim)
    shape = [rows, columns] if ndim == 2 else [rows]
    storage.set(
        torch.arange(rows), TensorDict(traj=torch.zeros(shape, dtype=torch.long), batch_size=shape)
    )
    ref = trl.SliceSampler(num_slices=n, traj_key="traj", truncated_key=None)
    gen = torch.Generator().manual_seed(10 * ndim + variable)
    wrapped = 0
    for trial in range(30):
        seq: int | torch.Tensor = torch.randint(1, 8, (n,), generator=gen) if variable else 5
        lengths = seq + torch.randint(0, 30, (n,), generator=gen)
        row = torch.randint(0, rows, (n,), generator=gen)
        column = torch.randint(0, columns, (n, 1), generator=gen)
        start_idx = torch.cat([row[:, None], column], 1) if ndim == 2 else row[:, None]
        ref._rng = torch.Generator().manual_seed(trial)
        expected, _ = trl.SliceSampler._get_index(
            ref, lengths, start_idx, start_idx, seq, n, rows, torch.arange(n), storage=storage
        )
        draw = torch.rand(n, generator=torch.Generator().manual_seed(trial)).numpy()
        got, heads = slice_index(
            row.numpy(),
            seq if isinstance(seq, int) else seq.numpy(),
            rows,
            length=lengths.numpy(),
            draw=draw,
            coords=column.numpy() if ndim == 2 else None,
        )
        assert len(got) == len(expected) == ndim
        for a, b in zip(got, expected, strict=True):
            assert torch.equal(torch.from_numpy(a), b)
        counts = torch.full((n,), seq) if isinstance(seq, int) else seq
        assert heads.tolist() == (counts.cumsum(0) - counts).tolist()
        wrapped += int((got[0][1:] < got[0][:-1]).any())
    assert wrapped >= 5  # slices ran across the storage's end


@pytest.mark.parametrize("ndim", [1, 2])
@pytest.mark.parametrize("variable", [False, True])
def test_slice_steps_match_torchrl_s_helper(ndim: int, variable: bool) -> None:
    """Given slice starts (no draw): ``slice_index`` is ``_tensor_slices_from_startend``."""
    gen = torch.Generator().manual_seed(ndim)
    starts = torch.randint(0, 11, (9, ndim), generator=gen)
    seq = torch.randint(1, 6, (9,), generator=gen) if variable else 4
    sampler = fastreplay.PrioritizedSliceSampler(20, 1.0, 1.0, slice_len=4)
    expected = sampler._tensor_slices_from_startend(seq, starts, storage_length=11)
    got, _ = slice_index(
        starts[:, 0].numpy(),
        seq if isinstance(seq, int) else seq.numpy(),
        11,
        coords=starts[:, 1:].numpy() if ndim > 1 else None,
    )
    assert len(got) == ndim
    assert all(
        torch.equal(torch.from_numpy(a), b) for a, b in zip(got, expected.unbind(-1), strict=True)
    )

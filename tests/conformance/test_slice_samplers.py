"""PrioritizedSliceSampler and SliceSamplerWithoutReplacement: TorchRL's behaviour, both sides.

Slice starts of the prioritized sampler are checked by chi-square against a brute-force
reference: every stored item is a valid start if a slice from it stays inside its trajectory
(TorchRL's rule, including ``strict_length=False`` and a right ``span``), and valid starts are
drawn proportionally to ``(p + eps) ** alpha``. Each sampler is run in TorchRL's ``ReplayBuffer``
and in fastreplay's ``TensorDictReplayBuffer`` (``buffer_side``).
"""

from __future__ import annotations

import itertools

import pytest
import torch
from torchrl.data import LazyMemmapStorage, LazyTensorStorage

from conformance.conftest import (
    DONE,
    Impl,
    assert_slices_valid,
    episodes,
    extend_in_two,
    make_buffer,
)
from conftest import chi2_pvalue, short_flat_batches
from fastreplay._torchrl import last_cursor_row

ALPHA, BETA = 0.8, 0.6


def valid_starts(storage, seq_length: int, strict: bool, span_right: bool | int = False) -> dict:
    """Brute force: ``{flat slot: steps in its slice}`` for every valid start in ``storage``.

    Trajectories are read from the stored ``traj`` ids and the write order (the oldest row
    follows the cursor when the storage is full); the newest trajectory ends at the cursor.
    """
    rows = storage._storage.shape[0]
    traj = storage._storage.get("traj")
    traj = traj.reshape(rows, -1)
    size = storage._len_along_dim0
    first = (last_cursor_row(storage) + 1) % rows if storage._is_full else 0
    order = [(first + i) % rows for i in range(size)]
    k = 1 if span_right is True else seq_length - 1 - int(span_right)
    out = {}
    for c in range(traj.shape[1]):
        runs, run = [], [order[0]]
        for prev, row in itertools.pairwise(order):
            if traj[row, c] == traj[prev, c]:
                run.append(row)
            else:
                runs.append(run)
                run = [row]
        runs.append(run)
        for run in runs:
            for p, row in enumerate(run):
                left = len(run) - p
                if left > k or (not strict and p == 0):
                    out[row * traj.shape[1] + c] = min(left, seq_length)
    return out


def slice_starts(index: tuple, info: dict, columns: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(flat start slot, length) of each slice, from the truncated flag on its last step."""
    ends = info[("next", "truncated")].view(-1).nonzero().view(-1)
    begins = torch.cat([torch.zeros(1, dtype=torch.long), ends[:-1] + 1])
    slot = index[0][begins] * columns + (index[1][begins] if len(index) > 1 else 0)
    return slot, ends - begins + 1


def _per_buffer(per_impl: Impl, side: str, capacity: int, storage=None, **kw):
    sampler = per_impl.cls("PrioritizedSliceSampler")(capacity, ALPHA, BETA, **kw)
    storage = storage if storage is not None else LazyTensorStorage(capacity)
    return make_buffer(side, storage=storage, sampler=sampler, batch_size=12), sampler, storage


@pytest.mark.parametrize(
    "strict,span", [(True, False), (False, False), (True, (False, True)), (False, (False, 2))]
)
def test_prioritized_starts_follow_priorities_among_valid_starts(
    per_impl, buffer_side, strict, span
) -> None:
    rb, sampler, storage = _per_buffer(
        per_impl, buffer_side, 53, slice_len=4, traj_key="traj", strict_length=strict, span=span
    )
    gen = torch.Generator().manual_seed(1)
    raw = {}
    for n, first_id in ((30, 0), (31, 100)):  # wraps around a capacity of 53
        index = rb.extend(episodes(n, [7, 3, 11, 2], first_id=first_id))
        priority = 0.2 + torch.rand(n, generator=gen) * 2
        rb.update_priority(index, priority)
        raw.update(zip(index.tolist(), priority.tolist(), strict=True))
    valid = valid_starts(storage, 4, strict, span[1] if isinstance(span, tuple) else span)
    sampler._rng = torch.Generator().manual_seed(0)
    draws = 6000
    index, info = sampler.sample(storage, 4 * draws)
    slot, length = slice_starts(index, info, 1)
    assert set(slot.tolist()) <= set(valid)
    assert all(valid[s] == n for s, n in zip(slot.tolist(), length.tolist(), strict=True))
    keys = torch.tensor(sorted(valid))
    mass = torch.tensor([(raw[int(s)] + 1e-8) ** ALPHA for s in keys], dtype=torch.float64)
    observed = torch.bincount(torch.searchsorted(keys, slot), minlength=keys.numel()).double()
    expected = mass / mass.sum() * observed.sum()
    assert chi2_pvalue(observed, expected) > 1e-4


def test_prioritized_weights_are_start_mass_over_min_mass(per_impl, buffer_side) -> None:
    rb, sampler, storage = _per_buffer(per_impl, buffer_side, 41, slice_len=3, traj_key="traj")
    index = extend_in_two(rb, episodes(41, [6, 9, 5]))
    priority = torch.linspace(0.5, 3.0, 41)
    rb.update_priority(index, priority)
    index, info = sampler.sample(storage, 3 * 50)
    slot, _ = slice_starts(index, info, 1)
    mass = (priority.double() + 1e-8) ** ALPHA
    weight = ((mass[slot] / mass.min()) ** -BETA).repeat_interleave(3)
    assert info["priority_weight"].dtype == torch.float32
    torch.testing.assert_close(info["priority_weight"].double(), weight, rtol=1e-5, atol=0)


def test_prioritized_zero_priority_trajectory_is_almost_never_started(
    per_impl, buffer_side
) -> None:
    # mass eps ** alpha ~ 4e-7 against 1: odd trajectories are (almost surely) never drawn
    rb, sampler, storage = _per_buffer(per_impl, buffer_side, 61, slice_len=4, traj_key="traj")
    data = episodes(60, 10)
    index = extend_in_two(rb, data)
    rb.update_priority(index, (data["traj"] % 2 == 0).float() + 0.0)
    index, _ = sampler.sample(storage, 4 * 200)
    traj = storage[index]["traj"]
    assert (traj % 2 == 0).all()
    assert_slices_valid(storage[index]["obs"], 200)


@pytest.mark.parametrize("end", ["done", "traj"])
def test_prioritized_slices_stay_in_stored_rows_and_trajectories(
    per_impl, buffer_side, end
) -> None:
    key = {"end_key": DONE} if end == "done" else {"traj_key": "traj"}
    rb, sampler, storage = _per_buffer(per_impl, buffer_side, 1023, slice_len=5, **key)
    first = 0
    for n in (40, 333, 17, 700, 250):  # partly filled, then wrapping around
        data = episodes(n, [13, 50, 7], first_id=first)
        first = int(data["traj"].max()) + 1
        index = rb.extend(data)
        rb.update_priority(index, torch.rand(n) + 0.1)
        index, info = sampler.sample(storage, 5 * 64)
        assert int(index[0].max()) < len(storage)
        assert_slices_valid(storage[index]["obs"], 64)
        assert info["priority_weight"].shape == (5 * 64,)


def test_prioritized_memmap_storage(per_impl, buffer_side, tmp_path) -> None:
    storage = LazyMemmapStorage(97, scratch_dir=tmp_path)
    rb, sampler, storage = _per_buffer(
        per_impl, buffer_side, 97, storage, slice_len=4, end_key=DONE
    )
    for first in (0, 100, 200):
        index = rb.extend(episodes(45, [9, 12], first_id=first))
        rb.update_priority(index, torch.rand(45) + 0.1)
    index, info = sampler.sample(storage, 4 * 30)
    assert_slices_valid(storage[index]["obs"], 30)
    assert info[("next", "truncated")].view(30, 4)[:, -1].all()


# ------------------------------------------------------------- SliceSamplerWithoutReplacement
@pytest.fixture(params=[False, True], ids=["", "lazy"])
def lazy(request: pytest.FixtureRequest, impl: Impl) -> bool:
    """fastreplay's lazily drawn epochs (used above ``_fr_lazy_above`` trajectories)."""
    if request.param and impl.is_torchrl:
        pytest.skip("lazily drawn epochs are fastreplay's (TorchRL always draws randperm)")
    return request.param


def _wor_buffer(
    impl: Impl, side: str, capacity: int, columns: int | None = None, batch=None, lazy=False, **kw
):
    sampler = impl.cls("SliceSamplerWithoutReplacement")(**kw)
    if lazy:
        sampler._fr_lazy_above = 0
    storage = LazyTensorStorage(capacity * (columns or 1), ndim=1 if columns is None else 2)
    return make_buffer(side, storage=storage, sampler=sampler, batch_size=batch), sampler, storage


@pytest.mark.parametrize("columns", [None, 3])
@short_flat_batches
def test_wor_epoch_visits_every_trajectory_once(impl, buffer_side, lazy, columns) -> None:
    rb, sampler, storage = _wor_buffer(
        impl, buffer_side, 50, columns, lazy=lazy, num_slices=4, traj_key="traj"
    )
    rb.extend(episodes(50, [5, 8, 6], columns=columns))
    n_traj = int((sampler._get_stop_and_length(storage)[2] >= 3).sum())  # strict_length
    seen = []
    while True:
        index, _ = sampler.sample(storage, 4 * 3)
        obs = storage[index]["obs"]
        assert_slices_valid(obs, obs.numel() // 3)
        seen += (obs.view(-1, 3)[:, 0] // 10_000).tolist()
        if sampler.ran_out:
            break
    assert sorted(seen) == sorted(set(seen)) and len(seen) == n_traj


@pytest.mark.parametrize("drop_last", [False, True])
@short_flat_batches
def test_wor_drop_last_and_exhaustion(impl, buffer_side, lazy, drop_last) -> None:
    rb, sampler, storage = _wor_buffer(
        impl,
        buffer_side,
        7 * 10,
        batch=6,
        lazy=lazy,
        num_slices=3,
        traj_key="traj",
        drop_last=drop_last,
    )
    extend_in_two(rb, episodes(70, 7))  # ten trajectories, three per batch
    sizes = []
    for _ in range(4):
        index, _ = sampler.sample(storage, 3 * 2)
        sizes.append(index[0].numel() // 2)
        if sampler.ran_out:
            break
    assert sizes == ([3, 3, 3] if drop_last else [3, 3, 3, 1])
    assert sampler.ran_out


def test_wor_new_trajectories_mid_epoch_start_a_new_epoch(impl, buffer_side, lazy) -> None:
    rb, sampler, storage = _wor_buffer(
        impl, buffer_side, 101, lazy=lazy, num_slices=2, traj_key="traj", shuffle=False
    )
    rb.extend(episodes(40, 10))
    first, _ = sampler.sample(storage, 2 * 4)
    rb.extend(episodes(20, 10, first_id=4))  # two more trajectories: a fresh permutation
    second, _ = sampler.sample(storage, 2 * 4)
    assert torch.equal(storage[second]["traj"].view(2, 4)[:, 0], torch.tensor([0, 1]))
    assert torch.equal(storage[first]["traj"].view(2, 4)[:, 0], torch.tensor([0, 1]))


@short_flat_batches
def test_wor_short_trajectories_are_skipped_with_strict_length(impl, buffer_side, lazy) -> None:
    rb, sampler, storage = _wor_buffer(
        impl, buffer_side, 63, lazy=lazy, num_slices=4, traj_key="traj"
    )
    extend_in_two(rb, episodes(60, [2, 9, 3, 12]))
    index, _ = sampler.sample(storage, 4 * 5)
    obs = storage[index]["obs"]
    assert_slices_valid(obs, obs.numel() // 5)
    assert obs.numel() // 5 <= 4


def test_wor_memmap_storage_wraps_around(impl, buffer_side, lazy, tmp_path) -> None:
    sampler = impl.cls("SliceSamplerWithoutReplacement")(slice_len=3, end_key=DONE)
    if lazy:
        sampler._fr_lazy_above = 0
    storage = LazyMemmapStorage(37, scratch_dir=tmp_path)
    rb = make_buffer(buffer_side, storage=storage, sampler=sampler)
    for first in (0, 100, 200):
        rb.extend(episodes(25, [4, 7], first_id=first))
    index, _ = sampler.sample(storage, 3 * 4)
    assert_slices_valid(storage[index]["obs"], 4)

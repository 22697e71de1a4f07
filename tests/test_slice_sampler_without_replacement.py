"""fastreplay.SliceSamplerWithoutReplacement against TorchRL's (same seed -> same samples)."""

from __future__ import annotations

import inspect
import json
import pickle
import random

import numpy as np
import pytest
import torch
from torchrl.data import LazyMemmapStorage, LazyTensorStorage, ReplayBuffer
from torchrl.data import SliceSamplerWithoutReplacement as TorchRLSliceSamplerWithoutReplacement

from conformance.conftest import episodes
from conftest import (
    assert_same_sample,
    chi2_pvalue,
    record_storage_reads,
    requires_storage_revision,
    short_flat_batches,
    skip_unless_slice_args,
    trajectory_key,
)
from fastreplay import SliceSamplerWithoutReplacement
from fastreplay._core.epoch_permutation import EpochPermutation
from fastreplay._core.trajectory_index import TrajectoryIndex
from fastreplay.samplers.slice import SliceSamplerError
from test_slice_sampler_same_seed import DONE, Episodes

WOR = SliceSamplerWithoutReplacement
REF = TorchRLSliceSamplerWithoutReplacement


def _sample_both(fast, ref, storage, batch: int, seed: int) -> None:
    """Same seed on both sides: same sample, or the same error class.

    The reference is told about each write (``ref.extend(rb.extend(...))``), as a buffer's
    sampler is: TorchRL 0.13's keeps its boundaries until then.
    """
    fast._rng = torch.Generator().manual_seed(seed)
    ref._rng = torch.Generator().manual_seed(seed)
    try:
        expected = ref.sample(storage, batch)
    except (RuntimeError, ValueError) as err:
        with pytest.raises(type(err)):
            fast.sample(storage, batch)
        fast._sample_list, ref._sample_list = None, None  # TorchRL consumed a draw first
        return
    assert_same_sample(fast.sample(storage, batch), expected)
    assert fast.ran_out == ref.ran_out
    assert fast._remaining_batches == ref._remaining_batches


CASES = [
    (mode, rows, cols, strict, drop_last, shuffle)
    for mode in ("done", "ids")
    for rows, cols in ((7, None), (50, None), (1023, None), (13, 3))
    for strict, drop_last, shuffle in (
        (True, False, True),
        (False, True, True),
        (True, True, False),
    )
]


@pytest.mark.parametrize("mode,rows,columns,strict,drop_last,shuffle", CASES)
@short_flat_batches
def test_bit_identical_to_torchrl_across_epochs_and_extends(
    mode, rows, columns, strict, drop_last, shuffle
) -> None:
    seed = hash((mode, rows, columns, strict, drop_last)) % 1000
    rng = random.Random(seed)
    episodes = Episodes(columns, seed, p_end=0.2)
    storage = LazyTensorStorage(rows * (columns or 1), ndim=1 if columns is None else 2)
    kw = {"num_slices": 3, "strict_length": strict, "drop_last": drop_last, "shuffle": shuffle}
    fast, ref = WOR(**kw, **trajectory_key(mode)), REF(**kw, **trajectory_key(mode))
    rb = ReplayBuffer(storage=storage, sampler=fast, batch_size=6)
    for it in range(8):
        ref.extend(rb.extend(episodes.batch(rng.randint(1, 2 * rows))))
        if storage._len_along_dim0 == 1:
            continue  # TorchRL squeezes the single time row away (upstream quirk)
        for s in range(5):  # several samples: walks through (and past) an epoch
            _sample_both(fast, ref, storage, 6, seed=it * 10 + s)


def test_signature_is_torchrl_s() -> None:
    expected = list(inspect.signature(REF.__init__).parameters.values())[1:]
    assert list(inspect.signature(WOR).parameters.values()) == expected
    assert isinstance(WOR(num_slices=2), REF)


def test_replacement_false_builds_an_instance_of_every_slice_sampler_class() -> None:
    """As TorchRL's ``test_replacement_kwarg_slice``: the result is both kinds of sampler."""
    import torchrl.data as trl

    import fastreplay

    ours = fastreplay.SliceSampler(num_slices=2, replacement=False, end_key=DONE)
    theirs = trl.SliceSampler(num_slices=2, replacement=False, end_key=DONE)
    assert isinstance(theirs, trl.SliceSamplerWithoutReplacement)
    assert isinstance(theirs, trl.SliceSampler)
    for cls in (WOR, fastreplay.SliceSampler, REF, trl.SliceSampler):
        assert isinstance(ours, cls), cls
    assert issubclass(WOR, fastreplay.SliceSampler)


@short_flat_batches
def test_static_boundaries_keep_torchrl_s_path() -> None:
    ends = torch.zeros(30, dtype=torch.bool)
    ends[[9, 19, 29]] = True
    fast, ref = WOR(num_slices=2, ends=ends), REF(num_slices=2, ends=ends)
    storage = LazyTensorStorage(30)
    storage.set(torch.arange(30), episodes(30, [4, 7]))  # no extend: the static cache stays
    for s in range(3):
        _sample_both(fast, ref, storage, 8, seed=s)


@short_flat_batches
def test_online_writes_read_only_the_new_rows(monkeypatch) -> None:
    storage = LazyTensorStorage(101)
    fast = WOR(slice_len=4, end_key=DONE)
    rb = ReplayBuffer(storage=storage, sampler=fast)
    episodes = Episodes(None, 5, p_end=0.05)
    rb.extend(episodes.batch(60))
    fast.sample(storage, 8)
    read = record_storage_reads(monkeypatch)
    for n in (7, 30, 120):  # the last one wraps around the whole storage
        rb.extend(episodes.batch(n))
        fast.sample(storage, 8)
    assert read == [7, 30, 101]


@short_flat_batches
@requires_storage_revision
def test_writes_it_was_not_told_about_trigger_a_rebuild() -> None:
    storage = LazyTensorStorage(40)
    fast, ref = WOR(slice_len=3, traj_key="traj"), REF(slice_len=3, traj_key="traj")
    rb = ReplayBuffer(storage=storage, sampler=fast)
    ref.extend(rb.extend(Episodes(None, 1, p_end=0.3).batch(40)))
    _sample_both(fast, ref, storage, 6, seed=0)
    storage.set(torch.arange(10, 20), Episodes(None, 9, p_end=0.5).batch(10))  # behind its back
    for s in range(3):
        _sample_both(fast, ref, storage, 6, seed=s)


@short_flat_batches
def test_state_dict_round_trip_continues_the_epoch() -> None:
    storage = LazyTensorStorage(80)
    fast = WOR(num_slices=2, traj_key="traj")
    rb = ReplayBuffer(storage=storage, sampler=fast)
    rb.extend(episodes(80, [9, 12, 7]))
    fast.sample(storage, 6)
    clone = WOR(num_slices=2, traj_key="traj")
    clone.load_state_dict(fast.state_dict())
    for seed in range(4):
        fast._rng = torch.Generator().manual_seed(seed)
        clone._rng = torch.Generator().manual_seed(seed)
        assert_same_sample(clone.sample(storage, 6), fast.sample(storage, 6))


def test_dumps_loads_and_pickle_round_trip(tmp_path) -> None:
    storage = LazyTensorStorage(80)
    fast = WOR(num_slices=2, traj_key="traj")
    rb = ReplayBuffer(storage=storage, sampler=fast)
    rb.extend(episodes(80, [9, 12, 7]))
    fast.sample(storage, 6)
    fast.dumps(tmp_path / "s")
    loaded = WOR(num_slices=2, traj_key="traj")
    loaded.loads(tmp_path / "s")
    pickled = pickle.loads(pickle.dumps(fast))
    for seed in range(3):
        for other in (loaded, pickled):
            other._rng = torch.Generator().manual_seed(seed)
        fast._rng = torch.Generator().manual_seed(seed)
        expected = fast.sample(storage, 6)
        assert_same_sample(loaded.sample(storage, 6), expected)
        assert_same_sample(pickled.sample(storage, 6), expected)


@short_flat_batches
def test_memmap_storage_ndim2(tmp_path) -> None:
    storage = LazyMemmapStorage(3 * 31, scratch_dir=tmp_path, ndim=2)
    fast, ref = WOR(num_slices=2, end_key=DONE), REF(num_slices=2, end_key=DONE)
    rb = ReplayBuffer(storage=storage, sampler=fast)
    episodes = Episodes(3, 2, p_end=0.1)
    for n in (20, 25):
        ref.extend(rb.extend(episodes.batch(n)))
        for s in range(3):
            _sample_both(fast, ref, storage, 6, seed=s)


def _state(sampler) -> tuple:
    sample_list = sampler._sample_list
    return (None if sample_list is None else sample_list.tolist(), sampler.len_storage)


@short_flat_batches
def test_batch_size_not_divisible_is_a_clear_error_and_changes_nothing() -> None:
    storage = LazyTensorStorage(50)
    fast = WOR(num_slices=4, traj_key="traj")
    ReplayBuffer(storage=storage, sampler=fast).extend(Episodes(None, 1).batch(50))
    fast.sample(storage, 8)
    before = _state(fast)
    with pytest.raises(SliceSamplerError, match=r"batch_size=10 is not divisible by num_slices=4"):
        fast.sample(storage, 10)
    with pytest.raises(RuntimeError):  # TorchRL raises RuntimeError here: still caught
        fast.sample(storage, 10)
    assert _state(fast) == before


def test_drop_last_with_too_few_trajectories_is_a_clear_error_and_changes_nothing() -> None:
    storage = LazyTensorStorage(50)
    fast = WOR(num_slices=8, traj_key="traj", drop_last=True)
    rb = ReplayBuffer(storage=storage, sampler=fast, batch_size=16)
    rb.extend(Episodes(None, 1, p_end=0.0).batch(50))  # a single trajectory
    with pytest.raises(ValueError, match=r"num_slices=8 is greater than the number of stored"):
        fast.sample(storage, 16)
    assert _state(fast) == (None, 0)


def test_no_long_trajectory_and_empty_storage_are_clear_errors() -> None:
    storage = LazyTensorStorage(50)
    fast = WOR(slice_len=20, traj_key="traj")
    rb = ReplayBuffer(storage=storage, sampler=fast)
    with pytest.raises(RuntimeError, match="empty storage"):
        fast.sample(storage, 40)
    rb.extend(Episodes(None, 1, p_end=0.5).batch(50))
    with pytest.raises(SliceSamplerError, match=r"No trajectory is at least 20 steps long"):
        fast.sample(storage, 40)
    assert _state(fast) == (None, 0)


def test_missing_key_is_a_clear_error() -> None:
    storage = LazyTensorStorage(50)
    fast = WOR(slice_len=2, traj_key="episode_id")
    data = Episodes(None, 1).batch(50).exclude(DONE)  # no done flags to fall back on
    ReplayBuffer(storage=storage, sampler=fast).extend(data)
    with pytest.raises(KeyError, match=r"traj_key='episode_id' is not in the storage"):
        fast.sample(storage, 4)


@pytest.mark.parametrize(
    "keys", [{}, {"truncated_key": None}, {"init_key": None}, {"strict_length": False}]
)
@short_flat_batches
def test_flags_and_init_markers_match_torchrl_with_every_key_stored(keys) -> None:
    data = episodes(90, [7, 2, 11, 5])
    data["is_init"] = (data["step"] == 0)[:, None]
    data["next", "terminated"] = data["next", "done"].clone()
    data["next", "terminated"][::4] = False
    skip_unless_slice_args(keys)
    kw = {"num_slices": 3, "traj_key": "traj", **keys}
    fast, ref = WOR(**kw), REF(**kw)
    storage = LazyTensorStorage(61)
    rb = ReplayBuffer(storage=storage, sampler=fast)
    ref.extend(rb.extend(data))  # wraps around
    for s in range(6):
        _sample_both(fast, ref, storage, 12, seed=s)


# ------------------------------------------------------- lazily drawn epochs (many trajectories)
# Above ``_fr_lazy_above`` trajectories the epoch permutation is drawn lazily, O(num_slices) per
# sample: same epoch semantics as TorchRL, not the same random numbers. The tests below lower
# the threshold to reach that path with small buffers.


def _lazy(sampler):
    sampler._fr_lazy_above = 0
    return sampler


@pytest.mark.parametrize("n", [1, 2, 7, 40, 257, 1000])
@pytest.mark.parametrize("k", [1, 3, 64])
def test_epoch_permutation_draws_every_item_once_per_epoch(n, k) -> None:
    perm, gen = EpochPermutation(), torch.Generator().manual_seed(n * 100 + k)
    for epoch in range(3):
        perm.reset(n)
        out = []
        while perm.remaining:  # draws, with an in-order take mixed in on the last epoch
            take = epoch == 2 and len(out) % 2
            got = perm.take(k) if take else perm.draw(k, gen)
            assert got.size == min(k, n - sum(map(len, out)))
            out.append(got)
        assert sorted(np.concatenate(out).tolist()) == list(range(n))
        assert perm.draw(k, gen).size == 0


def test_epoch_permutation_rest_and_reset_after_a_partial_epoch() -> None:
    perm, gen = EpochPermutation(), torch.Generator().manual_seed(3)
    perm.reset(50)
    drawn = np.concatenate([perm.draw(7, gen), perm.draw(7, gen)])
    assert sorted(drawn.tolist() + perm.rest().tolist()) == list(range(50))
    perm.reset(20)  # smaller: the swaps of the last epoch are forgotten
    assert perm.rest().tolist() == list(range(20))
    perm.draw(5, gen)
    perm.reset(100)  # larger: grows
    assert perm.take(100).tolist() == list(range(100))


@pytest.mark.parametrize("n,k", [(7, 3), (40, 3), (6, 6)])
def test_epoch_permutation_is_uniform(n, k) -> None:
    """Chi-square: each (epoch position, item) pair and each pair of the first two items."""
    perm, gen = EpochPermutation(), torch.Generator().manual_seed(n + k)
    epochs = 6000 if n < 10 else 1500
    position = torch.zeros(n, n)
    pairs = torch.zeros(n, n)
    for _ in range(epochs):
        perm.reset(n)
        order = np.concatenate([perm.draw(k, gen) for _ in range(-(n // -k))])
        position[torch.arange(n), torch.from_numpy(order)] += 1
        pairs[order[0], order[1]] += 1
    assert chi2_pvalue(position.view(-1), torch.full((n * n,), epochs / n)) > 1e-3
    off_diagonal = ~torch.eye(n, dtype=torch.bool)
    assert not pairs[~off_diagonal].any()
    expected = torch.full((n * (n - 1),), epochs / (n * (n - 1)))
    assert chi2_pvalue(pairs[off_diagonal], expected) > 1e-3


def test_epoch_permutation_first_draws_of_many_items_are_uniform() -> None:
    """Chi-square per draw slot, where draws rarely repeat (``n >> k * k``)."""
    perm, gen = EpochPermutation(), torch.Generator().manual_seed(11)
    n, k, epochs = 200, 5, 4000
    counts = torch.zeros(k, n)
    for _ in range(epochs):
        perm.reset(n)
        first = perm.draw(k, gen)
        assert np.unique(first).size == k
        counts[torch.arange(k), torch.from_numpy(first)] += 1
    for slot in counts:
        assert chi2_pvalue(slot, torch.full((n,), epochs / n)) > 1e-3


def _epoch_run(sampler, storage, batch: int, calls: int) -> list[tuple]:
    """``(trajectories, ran_out, remaining batches, len_storage)`` after each call."""
    out = []
    for _ in range(calls):
        index, info = sampler.sample(storage, batch)
        obs = storage[index]["obs"].reshape(-1)
        last = info[("next", "truncated")].reshape(-1).nonzero().view(-1).tolist()
        traj = []
        for begin, end in zip([0] + [i + 1 for i in last[:-1]], last, strict=True):
            assert (obs[begin + 1 : end + 1] - obs[begin:end] == 1).all()  # one trajectory
            traj.append(int(obs[begin]) // 10_000)
        out.append((traj, sampler.ran_out, sampler._remaining_batches, sampler.len_storage))
    return out


@pytest.mark.parametrize(
    "drop_last,strict,columns",
    [(False, True, None), (True, True, None), (False, False, None), (True, False, 3)],
)
@short_flat_batches
def test_lazy_epochs_follow_torchrl_s_epoch_semantics(drop_last, strict, columns) -> None:
    """Per call: TorchRL's ``ran_out``, ``_remaining_batches``, ``len_storage``, at most
    ``num_slices`` distinct trajectories; per epoch: every trajectory at most once, and every
    long enough one when ``drop_last=False``. Slices never cross a boundary."""
    kw = {"num_slices": 4, "end_key": DONE, "drop_last": drop_last, "strict_length": strict}
    data = Episodes(columns, 5, p_end=0.15).batch(61)
    results = []
    for cls in (REF, WOR):
        sampler = _lazy(cls(**kw))
        storage = LazyTensorStorage(61 * (columns or 1), ndim=1 if columns is None else 2)
        ReplayBuffer(storage=storage, sampler=sampler, batch_size=12).extend(data)
        results.append(_epoch_run(sampler, storage, 4 * 3, 14))
    ref, fast = results
    assert [r[1:] for r in fast] == [r[1:] for r in ref]
    if not strict:  # every drawn trajectory gives a slice: the same count as TorchRL
        assert [len(r[0]) for r in fast] == [len(r[0]) for r in ref]
    epochs: list[list[int]] = [[]]
    for traj, ran_out, *_ in fast:
        assert len(set(traj)) == len(traj) <= 4
        epochs[-1] += traj
        if ran_out:
            epochs.append([])
    long_enough = {t for r in ref for t in r[0]}
    assert len(epochs) > 2
    for epoch in epochs[:-1]:
        assert len(set(epoch)) == len(epoch)  # never twice in an epoch
        if not drop_last:
            assert set(epoch) == long_enough


@short_flat_batches
def test_lazy_shuffle_false_is_bit_identical_to_torchrl() -> None:
    episodes_ = Episodes(None, 11, p_end=0.2)
    storage = LazyTensorStorage(97)
    kw = {"num_slices": 3, "end_key": DONE, "shuffle": False}
    fast, ref = _lazy(WOR(**kw)), REF(**kw)
    rb = ReplayBuffer(storage=storage, sampler=fast)
    for it in range(6):
        ref.extend(rb.extend(episodes_.batch(40)))
        for s in range(4):
            _sample_both(fast, ref, storage, 6, seed=it * 10 + s)


def test_lazy_new_trajectories_start_a_new_epoch() -> None:
    fast = _lazy(WOR(num_slices=2, traj_key="traj"))
    storage = LazyTensorStorage(200)
    rb = ReplayBuffer(storage=storage, sampler=fast)
    rb.extend(episodes(60, 10))
    fast.sample(storage, 2 * 4)
    assert fast._remaining_batches == 2
    rb.extend(episodes(20, 10, first_id=6))
    index, _ = fast.sample(storage, 2 * 4)
    assert fast.len_storage == 8 and fast._remaining_batches == 3  # a fresh epoch of 8
    seen = storage[index]["traj"].view(2, 4)[:, 0].tolist()
    while not fast.ran_out:
        index, _ = fast.sample(storage, 2 * 4)
        seen += storage[index]["traj"].view(2, 4)[:, 0].tolist()
    assert sorted(seen) == list(range(8))


@short_flat_batches
def test_lazy_slice_starts_follow_torchrl_s_distribution() -> None:
    """Chi-square of slice starts over whole epochs, for both classes, against the exact
    expectation: each trajectory once per epoch, its start uniform over its valid starts."""
    lengths = [5, 8, 6, 11, 4, 9, 7]
    data = episodes(100, lengths)
    epochs = 400
    for cls in (REF, WOR):
        sampler = _lazy(cls(num_slices=3, traj_key="traj"))
        storage = LazyTensorStorage(100)
        ReplayBuffer(storage=storage, sampler=sampler).extend(data)
        sampler._rng = torch.Generator().manual_seed(1)
        counts = torch.zeros(100)
        first_batch = torch.zeros(int(data["traj"].max()) + 1)
        for _ in range(epochs):
            sampler._sample_list = None
            start = True
            while True:
                index, _ = sampler.sample(storage, 3 * 4)
                firsts = index[0].view(-1, 4)[:, 0]
                counts.index_add_(0, firsts, torch.ones(firsts.numel()))
                if start:
                    first_batch[data["traj"][firsts]] += 1
                    start = False
                if sampler.ran_out:
                    break
        expected = torch.zeros(100)
        for traj in data["traj"].unique().tolist():
            rows = (data["traj"] == traj).nonzero().view(-1)
            starts = rows[: max(rows.numel() - 3, 0)]
            expected[starts] = epochs / starts.numel() if starts.numel() else 0
        assert not counts[expected == 0].any()
        assert chi2_pvalue(counts[expected > 0], expected[expected > 0]) > 1e-3
        long = first_batch[first_batch > 0]
        assert chi2_pvalue(long, torch.full_like(long, long.sum() / long.numel())) > 1e-3


def test_lazy_epoch_never_draws_a_permutation_of_every_trajectory(monkeypatch) -> None:
    fast = _lazy(WOR(num_slices=4, traj_key="traj"))
    storage = LazyTensorStorage(3000)
    rb = ReplayBuffer(storage=storage, sampler=fast)
    sizes = []
    original = torch.randperm
    monkeypatch.setattr(torch, "randperm", lambda n, **kw: sizes.append(n) or original(n, **kw))
    for it in range(5):
        rb.extend(episodes(500, [3, 5], first_id=1000 * it))  # 125 more trajectories each
        fast.sample(storage, 4 * 2)
    assert all(n < 2 * 4 for n in sizes)  # only ever the tail of an epoch


@pytest.mark.parametrize("shuffle", [True, False])
@short_flat_batches
def test_lazy_checkpoints_continue_the_epoch(tmp_path, shuffle) -> None:
    storage = LazyTensorStorage(120)
    fast = _lazy(WOR(num_slices=2, traj_key="traj", shuffle=shuffle))
    rb = ReplayBuffer(storage=storage, sampler=fast)
    rb.extend(episodes(120, [9, 12, 7]))
    fast.sample(storage, 6)
    fast.dumps(tmp_path / "s")  # the running sampler continues from the list it wrote
    pickled = pickle.loads(pickle.dumps(fast))
    left = fast._sample_list.tolist()
    clones = [_lazy(WOR(num_slices=2, traj_key="traj", shuffle=shuffle)) for _ in range(2)]
    clones[0].load_state_dict(fast.state_dict())
    clones[1].loads(tmp_path / "s")
    clones.append(pickled)
    torchrl_clone = REF(num_slices=2, traj_key="traj", shuffle=shuffle)
    torchrl_clone.load_state_dict(fast.state_dict())  # TorchRL reads fastreplay's checkpoint
    for seed in range(-(len(left) // -2)):
        for sampler in (fast, torchrl_clone, *clones):
            sampler._rng = torch.Generator().manual_seed(seed)
        expected = fast.sample(storage, 6)
        for other in clones:
            assert_same_sample(other.sample(storage, 6), expected)
        # The same trajectories (TorchRL draws its next permutation before the last offsets).
        got = storage[torchrl_clone.sample(storage, 6)[0]]["traj"].view(-1, 3)[:, 0]
        assert torch.equal(got, storage[expected[0]]["traj"].view(-1, 3)[:, 0])
    assert fast.ran_out


def test_lazy_sample_list_reads_and_resets_like_torchrl_s() -> None:
    fast = _lazy(WOR(num_slices=2, traj_key="traj"))
    storage = LazyTensorStorage(80)
    ReplayBuffer(storage=storage, sampler=fast).extend(episodes(80, 10))
    assert fast._sample_list is None
    index, _ = fast.sample(storage, 6)
    drawn = set(storage[index]["traj"].view(2, 3)[:, 0].tolist())
    left = fast._sample_list.tolist()
    assert sorted(left + sorted(drawn)) == list(range(8)) and "75.0% sampled" in repr(fast)
    fast._sample_list = None  # as TorchRL: the next sample starts a new epoch
    fast.sample(storage, 6)
    assert fast._remaining_batches == 3


@pytest.mark.parametrize("rows,p_end", [(5003, 0.3), (20011, 0.9), (997, 0.01)])
def test_index_rotation_search_matches_a_linear_scan(rows, p_end) -> None:
    """The 64-way search for the trajectories ending after the cursor, against a scan."""
    index = TrajectoryIndex(rows, 2, "done")
    gen = np.random.default_rng(rows)
    first = 0
    for n in (rows // 3, rows // 2, rows // 3, 17, rows - 5, 1):  # wraps around twice
        index.write(first, gen.random((n, 2)) < p_end)
        first = (first + n) % rows
        for c in range(2):
            for min_length in (1, 3):
                count = index.cols[c].eligible_count(min_length)
                records = index.cols[c].eligible_records(min_length, np.arange(count))
                after = (records[:, 1] + records[:, 2] - 1) % rows > index.cursor
                expected = int(np.argmin(after)) if not after.all() else count
                assert not after[expected:].any()  # a prefix, as the search assumes
                assert index._rotation_of(c, min_length) == expected


@pytest.mark.parametrize("lazy", [False, True])
@short_flat_batches
def test_benchmark_checks_answers_and_refuses_sizes_with_too_few_episodes(
    tmp_path, capsys, monkeypatch, lazy
) -> None:
    from benchmarks.harness import main

    if lazy:
        monkeypatch.setattr(WOR, "_fr_lazy_above", 0)
    threads = torch.get_num_threads()
    argv = ["--only", "slice_without_replacement", "--swor-stored", "300,8k", "--repeats", "3"]
    argv += ["--swor-capacity", "9001", "--swor-episode-len", "50", "--swor-num-slices", "8"]
    try:
        assert main([*argv, "--swor-slice-len", "5", "--out", str(tmp_path)]) == 0
    finally:
        torch.set_num_threads(threads)
    err = capsys.readouterr().err
    assert "skipped 300 stored: 300 items stored (capacity 9.001k) hold 6 episodes" in err
    assert "fewer than --swor-num-slices 8" in err
    results = json.loads((tmp_path / "results.json").read_text())["results"]
    assert [r["case"] for r in results] == ["9.001k/8k ep50 online", "9.001k/8k ep50 static"]
    assert all(r["correct"] for r in results)


@pytest.mark.parametrize(
    "keys",
    [
        {"traj_key": "traj"},  # done flags inside trajectories: gathered from the storage
        {"end_keys": [DONE, ("next", "terminated")]},  # done flags end trajectories
        {"end_key": ("next", "terminated")},  # done flags inside trajectories again
        {"end_key": DONE},  # done flags end trajectories
    ],
)
@short_flat_batches
def test_done_flags_match_torchrl_whichever_key_ends_trajectories(keys) -> None:
    data = episodes(90, [7, 9, 11, 5])
    gen = torch.Generator().manual_seed(0)
    data["next", "terminated"] = data["next", "done"].clone()  # the episode ends
    data["next", "done"] = torch.rand(90, 1, generator=gen) < 0.15  # anywhere
    skip_unless_slice_args(keys)
    kw = {"num_slices": 3, **keys}
    fast, ref = WOR(**kw), REF(**kw)
    storage = LazyTensorStorage(83)
    ReplayBuffer(storage=storage, sampler=fast).extend(data)  # wraps around
    for s in range(6):
        _sample_both(fast, ref, storage, 9, seed=s)

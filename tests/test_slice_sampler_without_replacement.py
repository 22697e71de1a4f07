"""fastreplay.SliceSamplerWithoutReplacement against TorchRL's (same seed -> same samples)."""

from __future__ import annotations

import inspect
import pickle
import random

import pytest
import torch
from torchrl.data import LazyMemmapStorage, LazyTensorStorage, ReplayBuffer
from torchrl.data import SliceSamplerWithoutReplacement as TorchRLSliceSamplerWithoutReplacement

from conformance.conftest import episodes
from fastreplay import SliceSampler, SliceSamplerWithoutReplacement
from fastreplay.samplers.slice import SliceSamplerError
from test_slice_sampler import DONE, Episodes

WOR = SliceSamplerWithoutReplacement
REF = TorchRLSliceSamplerWithoutReplacement


def _key(mode: str) -> dict:
    return {"traj_key": "traj"} if mode == "ids" else {"end_key": DONE}


def _same(got: tuple, expected: tuple) -> None:
    for a, b in zip(got[0], expected[0], strict=True):
        assert torch.equal(a, b)
    assert got[1].keys() == expected[1].keys()
    for k in got[1]:
        assert torch.equal(got[1][k], expected[1][k])


def _sample_both(fast, ref, storage, batch: int, seed: int) -> None:
    """Same seed on both sides: same sample, or the same error class."""
    fast._rng = torch.Generator().manual_seed(seed)
    ref._rng = torch.Generator().manual_seed(seed)
    try:
        expected = ref.sample(storage, batch)
    except (RuntimeError, ValueError) as err:
        with pytest.raises(type(err)):
            fast.sample(storage, batch)
        fast._sample_list, ref._sample_list = None, None  # TorchRL consumed a draw first
        return
    _same(fast.sample(storage, batch), expected)
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
def test_bit_identical_to_torchrl_across_epochs_and_extends(
    mode, rows, columns, strict, drop_last, shuffle
) -> None:
    seed = hash((mode, rows, columns, strict, drop_last)) % 1000
    rng = random.Random(seed)
    episodes = Episodes(columns, seed, p_end=0.2)
    storage = LazyTensorStorage(rows * (columns or 1), ndim=1 if columns is None else 2)
    kw = {"num_slices": 3, "strict_length": strict, "drop_last": drop_last, "shuffle": shuffle}
    fast, ref = WOR(**kw, **_key(mode)), REF(**kw, **_key(mode))
    rb = ReplayBuffer(storage=storage, sampler=fast, batch_size=6)
    for it in range(8):
        rb.extend(episodes.batch(rng.randint(1, 2 * rows)))
        if storage._len_along_dim0 == 1:
            continue  # TorchRL squeezes the single time row away (upstream quirk)
        for s in range(5):  # several samples: walks through (and past) an epoch
            _sample_both(fast, ref, storage, 6, seed=it * 10 + s)


def test_signature_is_torchrl_s() -> None:
    expected = list(inspect.signature(REF.__init__).parameters.values())[1:]
    assert list(inspect.signature(WOR).parameters.values()) == expected
    assert isinstance(WOR(num_slices=2), REF)


def test_static_boundaries_keep_torchrl_s_path() -> None:
    ends = torch.zeros(30, dtype=torch.bool)
    ends[[9, 19, 29]] = True
    fast, ref = WOR(num_slices=2, ends=ends), REF(num_slices=2, ends=ends)
    storage = LazyTensorStorage(30)
    storage.set(torch.arange(30), episodes(30, [4, 7]))  # no extend: the static cache stays
    for s in range(3):
        _sample_both(fast, ref, storage, 8, seed=s)


def test_online_writes_read_only_the_new_rows(monkeypatch) -> None:
    storage = LazyTensorStorage(101)
    fast = WOR(slice_len=4, end_key=DONE)
    rb = ReplayBuffer(storage=storage, sampler=fast)
    episodes = Episodes(None, 5, p_end=0.05)
    rb.extend(episodes.batch(60))
    fast.sample(storage, 8)
    read = []
    original = SliceSampler._fr_read
    monkeypatch.setattr(
        SliceSampler,
        "_fr_read",
        staticmethod(
            lambda leaves, first, n, *rest: read.append(n) or original(leaves, first, n, *rest)
        ),
    )
    for n in (7, 30, 120):  # the last one wraps around the whole storage
        rb.extend(episodes.batch(n))
        fast.sample(storage, 8)
    assert read == [7, 30, 101]


def test_writes_it_was_not_told_about_trigger_a_rebuild() -> None:
    storage = LazyTensorStorage(40)
    fast, ref = WOR(slice_len=3, traj_key="traj"), REF(slice_len=3, traj_key="traj")
    rb = ReplayBuffer(storage=storage, sampler=fast)
    rb.extend(Episodes(None, 1, p_end=0.3).batch(40))
    _sample_both(fast, ref, storage, 6, seed=0)
    storage.set(torch.arange(10, 20), Episodes(None, 9, p_end=0.5).batch(10))  # behind its back
    for s in range(3):
        _sample_both(fast, ref, storage, 6, seed=s)


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
        _same(clone.sample(storage, 6), fast.sample(storage, 6))


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
        _same(loaded.sample(storage, 6), expected)
        _same(pickled.sample(storage, 6), expected)


def test_memmap_storage_ndim2(tmp_path) -> None:
    storage = LazyMemmapStorage(3 * 31, scratch_dir=tmp_path, ndim=2)
    fast, ref = WOR(num_slices=2, end_key=DONE), REF(num_slices=2, end_key=DONE)
    rb = ReplayBuffer(storage=storage, sampler=fast)
    episodes = Episodes(3, 2, p_end=0.1)
    for n in (20, 25):
        rb.extend(episodes.batch(n))
        for s in range(3):
            _sample_both(fast, ref, storage, 6, seed=s)


def _state(sampler) -> tuple:
    sample_list = sampler._sample_list
    return (None if sample_list is None else sample_list.tolist(), sampler.len_storage)


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
def test_flags_and_init_markers_match_torchrl_with_every_key_stored(keys) -> None:
    data = episodes(90, [7, 2, 11, 5])
    data["is_init"] = (data["step"] == 0)[:, None]
    data["next", "terminated"] = data["next", "done"].clone()
    data["next", "terminated"][::4] = False
    kw = {"num_slices": 3, "traj_key": "traj", **keys}
    fast, ref = WOR(**kw), REF(**kw)
    storage = LazyTensorStorage(61)
    rb = ReplayBuffer(storage=storage, sampler=fast)
    rb.extend(data)  # wraps around
    for s in range(6):
        _sample_both(fast, ref, storage, 12, seed=s)

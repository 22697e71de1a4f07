"""fastreplay.SliceSampler against torchrl.data.SliceSampler (same seed -> same samples)."""

from __future__ import annotations

import pickle
import random

import pytest
import torch
from tensordict import TensorDict
from torchrl.data import LazyMemmapStorage, LazyTensorStorage, ReplayBuffer
from torchrl.data import SliceSampler as TorchRLSliceSampler

from fastreplay import SliceSampler

DONE = ("next", "done")


class Episodes:
    """Parallel episodes with ``obs = traj_id * 10_000 + step`` and random ends."""

    def __init__(self, columns: int | None, seed: int, p_end: float = 0.15) -> None:
        self.columns, self.width = columns, columns or 1
        self.gen = torch.Generator().manual_seed(seed)
        self.traj = torch.arange(self.width)
        self.step = torch.zeros(self.width, dtype=torch.long)
        self.next_id, self.p_end = self.width, p_end

    def batch(self, n: int) -> TensorDict:
        obs, traj, done = [], [], []
        for _ in range(n):
            obs.append(self.traj * 10_000 + self.step)
            traj.append(self.traj.clone())
            end = torch.rand(self.width, generator=self.gen) < self.p_end
            done.append(end)
            self.step += 1
            for b in end.nonzero().flatten().tolist():
                self.traj[b], self.step[b] = self.next_id, 0
                self.next_id += 1
        td = TensorDict(
            {
                "obs": torch.stack(obs),
                "traj": torch.stack(traj),
                DONE: torch.stack(done)[..., None],
            },
            [n, self.width],
        )
        if self.columns is None:
            return td[:, 0]
        return td.transpose(0, 1).contiguous()  # ReplayBuffer extends ndim=2 storages on dim 1


def _key(mode: str) -> dict:
    return {"traj_key": "traj"} if mode == "ids" else {"end_key": DONE}


def _assert_same(fast: SliceSampler, ref: TorchRLSliceSampler, storage, batch: int, seed: int):
    for a, b in zip(
        fast._get_stop_and_length(storage), ref._get_stop_and_length(storage), strict=True
    ):
        assert torch.equal(a, b)
    fast._rng = torch.Generator().manual_seed(seed)
    ref._rng = torch.Generator().manual_seed(seed)
    try:
        expected = ref.sample(storage, batch)
    except RuntimeError:
        with pytest.raises(RuntimeError, match="at least"):
            fast.sample(storage, batch)
        return None
    got = fast.sample(storage, batch)
    for a, b in zip(got[0], expected[0], strict=True):
        assert torch.equal(a, b)
    assert got[1].keys() == expected[1].keys()
    for k in got[1]:
        assert torch.equal(got[1][k], expected[1][k])
    return got


CASES = [
    (mode, cap, cols, strict)
    for mode in ("done", "ids")
    for cap, cols in ((7, None), (50, None), (1023, None), (13, 3))
    for strict in (True, False)
]


@pytest.mark.parametrize("mode,rows,columns,strict", CASES)
def test_bit_identical_to_torchrl_after_random_extends(mode, rows, columns, strict) -> None:
    seed = hash((mode, rows, columns, strict)) % 1000
    rng = random.Random(seed)
    episodes = Episodes(columns, seed)
    storage = LazyTensorStorage(rows * (columns or 1), ndim=1 if columns is None else 2)
    kw = {"num_slices": 4, "strict_length": strict, **_key(mode)}
    fast, ref = SliceSampler(**kw), TorchRLSliceSampler(**kw)
    rb = ReplayBuffer(storage=storage, sampler=fast, batch_size=16)
    for it in range(12):
        rb.extend(episodes.batch(rng.randint(1, 2 * rows)))
        if storage._len_along_dim0 == 1:
            continue  # TorchRL squeezes the single time row away (upstream quirk)
        for batch in (8, 16, 40):
            _assert_same(fast, ref, storage, batch, seed=it * 7 + batch)


@pytest.mark.parametrize(
    "span,pad,strict", [((True, False), False, False), ((2, True), False, True), (0, True, False)]
)
def test_span_and_pad_output_match_torchrl(span, pad, strict) -> None:
    # (an int span with strict_length=False fails inside TorchRL's own _get_index)
    episodes = Episodes(None, 3, p_end=0.3)
    kw = {"num_slices": 4, "end_key": DONE, "span": span, "strict_length": strict}
    kw["pad_output"] = pad
    storage = LazyTensorStorage(50)
    fast, ref = SliceSampler(**kw), TorchRLSliceSampler(**kw)
    rb = ReplayBuffer(storage=storage, sampler=fast, batch_size=16)
    for it in range(6):
        rb.extend(episodes.batch(17))
        _assert_same(fast, ref, storage, 24, seed=it)


def _check_invariants(storage, index: tuple, num_slices: int) -> None:
    obs = storage[index]["obs"].reshape(num_slices, -1)
    assert (obs[:, 1:] - obs[:, :-1] == 1).all(), obs  # one trajectory, consecutive steps


@pytest.mark.parametrize("columns", [None, 3])
def test_slices_never_cross_boundaries_or_the_write_cursor(columns) -> None:
    episodes = Episodes(columns, 11, p_end=0.05)
    storage = LazyTensorStorage(101 * (columns or 1), ndim=1 if columns is None else 2)
    fast = SliceSampler(slice_len=5, traj_key="traj")
    rb = ReplayBuffer(storage=storage, sampler=fast, batch_size=40)
    for n in [30, 77, 5, 120, 64, 9, 250, 33]:
        rb.extend(episodes.batch(n))
        index, _ = fast.sample(storage, 40)
        _check_invariants(storage, index, 8)


def test_memmap_storage_and_end_keys_union(tmp_path) -> None:
    episodes = Episodes(None, 5)
    storage = LazyMemmapStorage(33, scratch_dir=tmp_path)
    kw = {"num_slices": 2, "end_keys": [DONE, ("next", "truncated")]}
    fast, ref = SliceSampler(**kw), TorchRLSliceSampler(**kw)
    rb = ReplayBuffer(storage=storage, sampler=fast, batch_size=8)
    gen = torch.Generator().manual_seed(1)
    for it in range(8):
        td = episodes.batch(10)
        td["next", "truncated"] = torch.rand(10, 1, generator=gen) < 0.1
        rb.extend(td)
        _assert_same(fast, ref, storage, 8, seed=it)


def test_writes_it_was_not_told_about_trigger_a_rebuild() -> None:
    episodes = Episodes(None, 8)
    storage = LazyTensorStorage(40)
    fast, ref = SliceSampler(num_slices=2, end_key=DONE), TorchRLSliceSampler(num_slices=2)
    rb = ReplayBuffer(storage=storage, sampler=fast, batch_size=8)
    rb.extend(episodes.batch(30))
    _assert_same(fast, ref, storage, 8, seed=0)
    rb[torch.tensor([3, 11])] = episodes.batch(2).set(DONE, torch.ones(2, 1, dtype=torch.bool))
    _assert_same(fast, ref, storage, 8, seed=1)
    other = ReplayBuffer(storage=storage, batch_size=8)  # another writer on the same storage
    other.extend(episodes.batch(5))
    _assert_same(fast, ref, storage, 8, seed=2)
    rb.empty()
    rb.extend(episodes.batch(12))
    _assert_same(fast, ref, storage, 8, seed=3)
    state = rb.state_dict()
    rb.extend(episodes.batch(25))
    rb.load_state_dict(state)
    _assert_same(fast, ref, storage, 8, seed=4)
    clone = pickle.loads(pickle.dumps(fast))
    _assert_same(clone, ref, storage, 8, seed=5)


def test_online_updates_read_only_the_new_rows(monkeypatch) -> None:
    episodes = Episodes(None, 2)
    storage = LazyTensorStorage(1000)
    fast = SliceSampler(num_slices=2, traj_key="traj")
    rb = ReplayBuffer(storage=storage, sampler=fast, batch_size=8)
    rb.extend(episodes.batch(900))
    fast.sample(storage, 8)
    read = []
    original = fast._fr_read
    monkeypatch.setattr(fast, "_fr_read", lambda *a: read.append(a[2]) or original(*a))
    monkeypatch.setattr(fast, "_fr_rebuild", lambda *a: pytest.fail("unexpected rebuild"))
    for n in (7, 150, 1):
        rb.extend(episodes.batch(n))
        fast.sample(storage, 8)
        assert read[-1] == n
    assert len(read) == 3


def test_sampling_is_uniform_over_eligible_trajectories() -> None:
    storage = LazyTensorStorage(200)
    fast = SliceSampler(num_slices=1000, traj_key="traj")
    rb = ReplayBuffer(storage=storage, sampler=fast)
    lengths = [3, 40, 12, 2, 25, 60, 8, 50]  # eligible for slices of 10: 40, 12, 25, 60, 50
    traj = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])
    rb.extend(TensorDict({"traj": traj, "obs": torch.arange(len(traj))}, [len(traj)]))
    index, _ = fast.sample(storage, 10_000)
    counts = torch.bincount(traj[index[0].view(1000, 10)[:, 0]], minlength=len(lengths))
    assert counts[[0, 3, 6]].sum() == 0
    expected = 1000 / 5
    chi2 = ((counts[[1, 2, 4, 5, 7]] - expected) ** 2 / expected).sum()
    assert chi2 < 18.5  # p = 0.001 for 4 degrees of freedom


def _filled(mode: str = "done") -> tuple[SliceSampler, LazyTensorStorage]:
    storage = LazyTensorStorage(30)
    fast = SliceSampler(num_slices=3, **_key(mode))
    ReplayBuffer(storage=storage, sampler=fast).extend(Episodes(None, 1, p_end=0.3).batch(20))
    fast.sample(storage, 6)
    return fast, storage


def _state(fast: SliceSampler, storage) -> tuple:
    return [a.tolist() for a in fast._get_stop_and_length(storage)], fast._rng.get_state()


def test_batch_size_not_divisible_is_a_clear_error_and_changes_nothing() -> None:
    fast, storage = _filled()
    fast._rng = torch.Generator().manual_seed(0)
    before = _state(fast, storage)
    with pytest.raises(ValueError, match=r"batch_size=10 is not divisible by num_slices=3.*9"):
        fast.sample(storage, 10)
    with pytest.raises(RuntimeError):  # TorchRL's exception type still catches it
        fast.sample(storage, 10)
    assert torch.equal(_state(fast, storage)[1], before[1])
    assert _state(fast, storage)[0] == before[0]


def test_no_trajectory_long_enough_is_a_clear_error_and_changes_nothing() -> None:
    fast, storage = _filled()
    fast._rng = torch.Generator().manual_seed(0)
    before = _state(fast, storage)
    with pytest.raises(ValueError, match=r"No trajectory is at least 100 steps.*strict_length"):
        fast.sample(storage, 300)
    after = _state(fast, storage)
    assert after[0] == before[0] and torch.equal(after[1], before[1])


@pytest.mark.parametrize(
    "change,error,match",
    [
        ({"end_key": ("next", "nope")}, KeyError, r"end_key=\('next', 'nope'\) is not in"),
        ({"traj_key": "nope", "end_key": ("x",)}, KeyError, r"traj_key='nope' is not in"),
    ],
)
def test_missing_keys_are_clear_errors(change, error, match) -> None:
    _, storage = _filled()
    bad = SliceSampler(num_slices=3, **change)
    with pytest.raises(error, match=match):
        bad.sample(storage, 6)
    assert bad._fr_index is None and bad._fr_pending == []


def test_wrong_dtype_or_shape_of_done_flags_is_a_clear_error() -> None:
    storage = LazyTensorStorage(20)
    fast = SliceSampler(num_slices=2, end_key="done")
    rb = ReplayBuffer(storage=storage, sampler=fast)
    rb.extend(TensorDict({"done": torch.zeros(10, 1)}, [10]))
    with pytest.raises(TypeError, match=r"end_key='done' holds torch.float32.*torch.bool"):
        fast.sample(storage, 4)
    # Nothing was indexed, the buffer is intact.
    assert fast._fr_index is None and len(rb) == 10
    assert torch.equal(storage[:10]["done"], torch.zeros(10, 1))
    storage2 = LazyTensorStorage(20)
    fast2 = SliceSampler(num_slices=2, end_key="done")
    rb2 = ReplayBuffer(storage=storage2, sampler=fast2)
    rb2.extend(TensorDict({"done": torch.zeros(10, 2, dtype=torch.bool)}, [10]))
    with pytest.raises(ValueError, match=r"end_key='done' has shape \(20, 2\); expected \(20,\)"):
        fast2.sample(storage2, 4)
    assert fast2._fr_index is None and len(rb2) == 10
    fast3 = SliceSampler(num_slices=2, traj_key="done")  # bool ids are ids (as in TorchRL)
    with pytest.raises(RuntimeError, match=r"traj_key='done' has shape \(20, 2\); expected"):
        fast3.sample(storage2, 4)
    assert fast3._fr_index is None and len(rb2) == 10

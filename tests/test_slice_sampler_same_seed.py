"""fastreplay.SliceSampler against torchrl.data.SliceSampler (same seed -> same samples)."""

from __future__ import annotations

import pickle
import random

import pytest
import torch
from tensordict import TensorDict
from torchrl.data import LazyMemmapStorage, LazyTensorStorage, ReplayBuffer, TensorDictReplayBuffer
from torchrl.data import SliceSampler as TorchRLSliceSampler

import fastreplay
from conftest import (
    record_storage_reads,
    requires_cuda,
    requires_slice_args,
    requires_storage_revision,
    short_flat_batches,
    skip_unless_slice_args,
    trajectory_key,
)
from fastreplay import SliceSampler
from fastreplay._torchrl import last_cursor_row

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
@short_flat_batches
def test_bit_identical_to_torchrl_after_random_extends(mode, rows, columns, strict) -> None:
    seed = hash((mode, rows, columns, strict)) % 1000
    rng = random.Random(seed)
    episodes = Episodes(columns, seed)
    storage = LazyTensorStorage(rows * (columns or 1), ndim=1 if columns is None else 2)
    kw = {"num_slices": 4, "strict_length": strict, **trajectory_key(mode)}
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
@short_flat_batches
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


@requires_slice_args("end_keys")
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


@requires_storage_revision
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


@pytest.mark.parametrize(
    "cls", ["SliceSampler", "SliceSamplerWithoutReplacement", "PrioritizedSliceSampler"]
)
@short_flat_batches
def test_pickles_load_and_rebuild_the_index(cls) -> None:
    """A pickled sampler carries no index: it rebuilds it from the storage at its first sample."""
    klass = getattr(fastreplay, cls)
    kw = {"num_slices": 2, "traj_key": "traj"}
    fast = klass(60, 0.7, 0.5, **kw) if cls == "PrioritizedSliceSampler" else klass(**kw)
    storage = LazyTensorStorage(60)
    rb = ReplayBuffer(storage=storage, sampler=fast, batch_size=8)
    rb.extend(Episodes(None, 4, p_end=0.05).batch(50))  # episodes of ~20 steps
    if cls == "PrioritizedSliceSampler":
        rb.update_priority(torch.arange(50), torch.rand(50, generator=torch.Generator()))
    fast.sample(storage, 8)
    clone = pickle.loads(pickle.dumps(fast))
    assert type(clone) is klass and clone._fr_sync is not fast._fr_sync
    assert clone._fr_sync.dirty and clone._fr_index is None
    assert fast._fr_index is not None  # the original keeps its own
    for seed in range(3):
        clone._rng, fast._rng = (torch.Generator().manual_seed(seed) for _ in range(2))
        got, expected = clone.sample(storage, 8), fast.sample(storage, 8)
        assert all(torch.equal(a, b) for a, b in zip(got[0], expected[0], strict=True))
    assert clone._fr_index is not None and not clone._fr_sync.dirty


def test_online_updates_read_only_the_new_rows(monkeypatch) -> None:
    episodes = Episodes(None, 2)
    storage = LazyTensorStorage(1000)
    fast = SliceSampler(num_slices=2, traj_key="traj")
    rb = ReplayBuffer(storage=storage, sampler=fast, batch_size=8)
    rb.extend(episodes.batch(900))
    fast.sample(storage, 8)
    read = record_storage_reads(monkeypatch)
    monkeypatch.setattr(fast._fr_sync, "_rebuild", lambda *a: pytest.fail("unexpected rebuild"))
    for n in (7, 150, 1):
        rb.extend(episodes.batch(n))
        fast.sample(storage, 8)
        assert read[-1] == n
    assert len(read) == 3


@pytest.mark.parametrize("columns", [None, 3])
@pytest.mark.parametrize("mode", ["done", "ids"])
def test_wrapped_storage_updates_read_only_the_new_rows_and_match_torchrl(
    monkeypatch, mode, columns
) -> None:
    # Laps of writes around a full storage: each sample reads the rows written since the last
    # one and nothing else (no rebuild), and samples as TorchRL does from the whole storage.
    rows = 101  # odd, so the write cursor lands on other rows in every lap
    rng = random.Random(rows)
    episodes = Episodes(columns, 5, p_end=0.08)  # episodes of ~12 steps run across row 0
    storage = LazyTensorStorage(rows * (columns or 1), ndim=1 if columns is None else 2)
    kw = {"num_slices": 4, **trajectory_key(mode)}
    fast, ref = SliceSampler(**kw), TorchRLSliceSampler(**kw)
    rb = ReplayBuffer(storage=storage, sampler=fast, batch_size=16)
    rb.extend(episodes.batch(rows - 7))
    fast.sample(storage, 16)
    read = record_storage_reads(monkeypatch)
    monkeypatch.setattr(fast._fr_sync, "_rebuild", lambda *a: pytest.fail("rebuilt the index"))
    written, unread, across = rows - 7, 0, 0
    while written < 8 * rows:
        n = rng.randint(1, 40)
        rb.extend(episodes.batch(n))
        written, unread = written + n, unread + n
        if unread < 50 and rng.random() < 0.3:
            continue  # a few writes before the next sample
        _assert_same(fast, ref, storage, 16, seed=written)
        assert sum(read) == unread and len(read) <= 2  # one read per run (two across row 0)
        read.clear()
        unread = 0
        start, stop, _, _ = fast._fr_index.boundaries()
        across += int((start > stop).any())  # a trajectory runs from the end round to row 0
    assert storage._is_full and across >= 3


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
    fast = SliceSampler(num_slices=3, **trajectory_key(mode))
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
    assert bad._fr_index is None and bad._fr_sync.pending == []


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


# --------------------------------------------------------------------- drop-in conformance fixes
def test_replacement_false_returns_the_without_replacement_sampler() -> None:
    from fastreplay import SliceSamplerWithoutReplacement
    from fastreplay.samplers.slice import without_replacement_class

    sampler = SliceSampler(replacement=False, num_slices=2, end_key=DONE, drop_last=True)
    assert type(sampler) is without_replacement_class() is SliceSamplerWithoutReplacement
    assert sampler.drop_last and sampler.num_slices == 2 and sampler.end_key == DONE
    assert type(SliceSampler(replacement=True, num_slices=2)) is SliceSampler
    # the without-replacement class takes replacement=False as a no-op, as TorchRL's does
    same = SliceSamplerWithoutReplacement(replacement=False, num_slices=2, end_key=DONE)
    assert type(same) is SliceSamplerWithoutReplacement and same.num_slices == 2


def test_signature_and_help_show_the_real_arguments() -> None:
    import inspect
    import pydoc

    params = inspect.signature(SliceSampler).parameters
    assert list(params)[:4] == ["replacement", "num_slices", "slice_len", "end_key"]
    assert params["strict_length"].default is True
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in params.values())
    assert "num_slices: 'int | None' = None" in pydoc.render_doc(SliceSampler)
    assert "invalidate_boundaries" in pydoc.render_doc(SliceSampler)


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        ({"num_slices": 0}, ValueError, r"num_slices must be at least 1, got num_slices=0"),
        ({"slice_len": -2}, RuntimeError, r"slice_len must be at least 1, got slice_len=-2"),
        ({"num_slices": 2.5}, TypeError, r"num_slices must be an integer, got num_slices=2.5"),
        ({"slice_len": "4"}, TypeError, r"slice_len must be an integer, got slice_len='4'"),
    ],
)
def test_impossible_settings_are_refused_at_construction(kwargs, error, match) -> None:
    with pytest.raises(error, match=match):
        SliceSampler(**kwargs)


def test_numpy_integer_counts_are_accepted() -> None:
    import numpy as np

    fast, ref = SliceSampler(num_slices=np.int64(3)), TorchRLSliceSampler(num_slices=3)
    assert fast.num_slices == 3 and type(fast.num_slices) is int
    storage = LazyTensorStorage(30)
    ReplayBuffer(storage=storage, sampler=fast).extend(Episodes(None, 1, p_end=0.1).batch(25))
    _assert_same(fast, ref, storage, 6, seed=0)


def test_a_new_storage_that_reuses_a_freed_ones_id_is_not_served_its_boundaries(
    monkeypatch,
) -> None:
    import fastreplay.samplers.slice as slice_module

    # Simulate CPython handing the dead storage's address to a new one: id() collides.
    monkeypatch.setattr(slice_module, "id", lambda obj: 12345, raising=False)
    fast = SliceSampler(num_slices=2, end_key=DONE)
    first = LazyTensorStorage(40)
    ReplayBuffer(storage=first, batch_size=8).extend(Episodes(None, 1, p_end=0.5).batch(30))
    fast.sample(first, 8)
    del first
    second = LazyTensorStorage(40)  # same revision (one write), other boundaries
    ReplayBuffer(storage=second, batch_size=8).extend(Episodes(None, 2, p_end=0.05).batch(30))
    _assert_same(fast, TorchRLSliceSampler(num_slices=2, end_key=DONE), second, 8, seed=0)


def test_view_edits_are_seen_before_or_after_a_reported_write() -> None:
    # Editing stored flags in place through a view bypasses the storage's write count; the
    # flags' version counter shows it at the next sample, whether or not a write reported to
    # the sampler came in between (each reported write moves the counter by exactly one).
    # An edit that moves no counter (through ``.data``) needs invalidate_boundaries().
    episodes = Episodes(None, 4, p_end=0.0)  # one long episode
    storage = LazyTensorStorage(50)
    fast, ref = SliceSampler(num_slices=2, end_key=DONE), TorchRLSliceSampler(num_slices=2)
    rb = ReplayBuffer(storage=storage, sampler=fast, batch_size=8)
    rb.extend(episodes.batch(40))
    _assert_same(fast, ref, storage, 8, seed=0)
    storage[:][DONE][24] = True  # a view edit: TorchRL (no cache) sees a boundary at 24
    _assert_same(fast, ref, storage, 8, seed=1)  # so does the index
    storage[:][DONE][12] = True  # another view edit, then a reported write
    rb.extend(episodes.batch(5))
    _assert_same(fast, ref, storage, 8, seed=2)  # seen all the same
    rb.extend(episodes.batch(3))
    storage[:][DONE][6] = True  # a reported write, then a view edit
    _assert_same(fast, ref, storage, 8, seed=3)
    before = [a.clone() for a in fast._get_stop_and_length(storage)]
    storage._storage.get(DONE).data[30] = True  # no version counter moves
    stale = fast._get_stop_and_length(storage)
    assert all(torch.equal(a, b) for a, b in zip(stale, before, strict=True))
    fast.invalidate_boundaries()
    _assert_same(fast, ref, storage, 8, seed=4)
    rb.extend(episodes.batch(5))  # and the incremental path carries on from the rebuild
    _assert_same(fast, ref, storage, 8, seed=5)


@pytest.mark.parametrize("how", ["state_dict", "dumps"])
def test_checkpoint_into_a_fresh_buffer_keeps_the_boundary_at_the_write_cursor(
    how, tmp_path
) -> None:
    def buffer(sampler):
        return ReplayBuffer(storage=LazyTensorStorage(50), sampler=sampler, batch_size=8)

    original = buffer(SliceSampler(num_slices=2, end_key=DONE))
    td = Episodes(None, 6, p_end=0.1).batch(73)  # wraps: the cursor is at row 22
    td[DONE][-1] = False  # the newest episode is still running at the cursor
    original.extend(td)
    reference = TorchRLSliceSampler(num_slices=2, end_key=DONE)
    expected = reference._get_stop_and_length(original.storage)
    fresh = buffer(SliceSampler(num_slices=2, end_key=DONE))
    if how == "state_dict":
        fresh.load_state_dict(original.state_dict())
    else:
        original.dumps(tmp_path)
        fresh.loads(tmp_path)
    assert last_cursor_row(fresh.storage) is None  # not in the checkpoint
    got = fresh.sampler._get_stop_and_length(fresh.storage)
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
    for seed in range(5):  # slices never run from the newest step into the oldest one
        fresh.sampler._rng = torch.Generator().manual_seed(seed)
        index, _ = fresh.sampler.sample(fresh.storage, 40)
        _check_invariants(fresh.storage, index, 2)
    fresh.extend(Episodes(None, 7, p_end=0.1).batch(9))  # later writes: storage cursor again
    _assert_same(fresh.sampler, reference, fresh.storage, 8, seed=9)


def _shared_writer(rb, commands, acks) -> None:
    """Child process: extend the shared buffer with each TensorDict received, then ack."""
    while (td := commands.get(timeout=120)) is not None:
        rb.extend(td)
        acks.put(len(td))


@pytest.mark.slow  # one spawned process (imports torch): ~10-30 s on 2 busy cores
@requires_storage_revision
def test_memmap_shared_init_written_by_another_process(tmp_path) -> None:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    storage = LazyMemmapStorage(61, shared_init=True, scratch_dir=tmp_path / "rb")
    fast = SliceSampler(num_slices=2, end_key=DONE)
    rb = ReplayBuffer(storage=storage, sampler=fast, batch_size=8)
    commands, acks = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=_shared_writer, args=(rb, commands, acks), daemon=True)
    child.start()
    try:
        episodes = Episodes(None, 12, p_end=0.15)
        ref = TorchRLSliceSampler(num_slices=2, end_key=DONE)
        for round_, n in enumerate((40, 15, 30, 1)):  # fills, wraps, then one more step
            commands.put(episodes.batch(n))
            assert acks.get(timeout=120) == n
            assert len(storage) == min(61, [40, 55, 61, 61][round_])
            _assert_same(fast, ref, storage, 8, seed=round_)  # nothing stale
            index, _ = fast.sample(storage, 16)
            _check_invariants(storage, index, 2)
        commands.put(None)
        child.join(timeout=60)
        assert child.exitcode == 0
    finally:
        if child.is_alive():
            child.kill()


@pytest.mark.parametrize(
    "case", ["int64 done", "uint8 done", "[N, 1, 1] done", "float ids", "bool ids", "end_keys mix"]
)
@short_flat_batches
def test_bit_identical_to_torchrl_for_other_signal_dtypes_and_shapes(case) -> None:
    def convert(td: TensorDict) -> TensorDict:
        done = td[DONE]
        if case == "int64 done":
            return td.set(DONE, done.long())
        if case == "uint8 done":
            return td.set(DONE, done.to(torch.uint8))
        if case == "[N, 1, 1] done":
            return td.exclude(DONE).set(DONE, done[..., None])
        if case == "float ids":
            return td.set("traj", td["traj"].double())
        if case == "bool ids":  # alternating parity: a new trajectory wherever it flips
            return td.set("traj", td["traj"] % 2 == 1)
        return td.set(("next", "truncated"), done.long() * 3)  # int flags OR-ed with bool

    kw = {"num_slices": 3, "strict_length": False}
    if case.endswith("ids"):
        kw["traj_key"] = "traj"
    elif case == "end_keys mix":
        skip_unless_slice_args(["end_keys"])
        kw["end_keys"] = [("next", "truncated"), ("next", "missing"), DONE]
    else:
        kw["end_key"] = DONE
    episodes = Episodes(None, 21, p_end=0.2)
    storage = LazyTensorStorage(37)
    fast, ref = SliceSampler(**kw), TorchRLSliceSampler(**kw)
    rb = ReplayBuffer(storage=storage, sampler=fast, batch_size=12)
    for it, n in enumerate((20, 9, 30, 4)):
        td = episodes.batch(n)
        if case == "bool ids":
            td["traj"] = torch.cumsum(torch.rand(n, generator=episodes.gen) < 0.2, 0) + it
        rb.extend(convert(td))
        _assert_same(fast, ref, storage, 12, seed=it)


@requires_cuda
@pytest.mark.parametrize("mode,columns", [("done", None), ("ids", 3)])
def test_cuda_storage_bit_identical_to_torchrl(mode, columns) -> None:
    episodes = Episodes(columns, 5)
    storage = LazyTensorStorage(
        41 * (columns or 1), ndim=1 if columns is None else 2, device="cuda"
    )
    kw = {"num_slices": 4, "strict_length": False, **trajectory_key(mode)}
    fast, ref = SliceSampler(**kw), TorchRLSliceSampler(**kw)
    rb = ReplayBuffer(storage=storage, sampler=fast, batch_size=16)
    for it, n in enumerate((30, 17, 25)):
        rb.extend(episodes.batch(n).to("cuda"))
        for a, b in zip(
            fast._get_stop_and_length(storage), ref._get_stop_and_length(storage), strict=True
        ):
            assert a.device == b.device and torch.equal(a, b)
        fast._rng = torch.Generator(device="cuda").manual_seed(it)
        ref._rng = torch.Generator(device="cuda").manual_seed(it)
        got, expected = fast.sample(storage, 16), ref.sample(storage, 16)
        for a, b in zip(got[0], expected[0], strict=True):
            assert a.device.type == "cuda" and torch.equal(a, b)
        assert got[1].keys() == expected[1].keys()
        for k in got[1]:
            assert torch.equal(got[1][k], expected[1][k])


@short_flat_batches
def test_single_row_storage_samples_where_torchrl_fails() -> None:
    # TorchRL squeezes the [1, 1] done flags to a 0-dim tensor and fails (IndexError);
    # fastreplay returns the one-step trajectory (docs/migration.md).
    storage = LazyTensorStorage(20)
    fast = SliceSampler(num_slices=2, end_key=DONE, strict_length=False)
    ReplayBuffer(storage=storage, sampler=fast).extend(Episodes(None, 3).batch(1))
    with pytest.raises(IndexError):
        TorchRLSliceSampler(num_slices=2, end_key=DONE)._get_stop_and_length(storage)
    start, stop, length = fast._get_stop_and_length(storage)
    assert start.tolist() == [[0]] and stop.tolist() == [[0]] and length.tolist() == [1]
    index, _ = fast.sample(storage, 4)
    assert index[0].tolist() == [0, 0]  # two slices, each the single stored step


def test_the_without_replacement_class_is_chosen_in_one_place(monkeypatch) -> None:
    import inspect

    from fastreplay._torchrl import _REPLACEMENT_DISPATCH
    from fastreplay.samplers.slice import without_replacement_class

    class WithoutReplacement(SliceSampler):
        def __init__(self, *, drop_last: bool = False, **kwargs) -> None:
            super().__init__(**kwargs)
            self.drop_last = drop_last

    # TorchRL's replacement table: what its sampler metaclass and without_replacement_class read
    monkeypatch.setitem(_REPLACEMENT_DISPATCH, SliceSampler, WithoutReplacement)
    assert without_replacement_class() is WithoutReplacement
    built = SliceSampler(replacement=False, num_slices=3, drop_last=True)
    assert type(built) is WithoutReplacement and built.drop_last and built.num_slices == 3
    again = WithoutReplacement(replacement=False, num_slices=3)  # a no-op there, as in TorchRL
    assert type(again) is WithoutReplacement
    params = list(inspect.signature(WithoutReplacement).parameters)
    assert params[:2] == ["replacement", "drop_last"]

    class Other(SliceSampler):
        pass

    with pytest.raises(TypeError, match="no without-replacement variant"):
        Other(replacement=False, num_slices=3)  # other subclasses: TorchRL's TypeError


@pytest.mark.parametrize(
    "kwargs,change,error,match",
    [
        (
            {"end_keys": [("next", "x")]},
            None,
            KeyError,
            r"end_keys=\(\('next', 'x'\),\) is not in the storage, nor is traj_key=None "
            r"\(looked for \('collector', 'traj_ids'\), 'episode'\) \(keys: ",
        ),
        (
            {"traj_key": "traj"},
            lambda td: td.exclude("traj").set("traj", td["traj"][:, None]),
            RuntimeError,
            r"traj_key='traj' has shape \(30, 1\); expected \(30,\).*reshape",
        ),
        (
            {"end_key": DONE},
            lambda td: td.set(DONE, td[DONE].float()),
            NotImplementedError,
            r"end_key=\('next', 'done'\) holds torch.float32 values.*torch.bool",
        ),
    ],
)
def test_bad_signals_name_the_argument_and_change_nothing(kwargs, change, error, match) -> None:
    skip_unless_slice_args(kwargs)
    storage = LazyTensorStorage(30)
    fast = SliceSampler(num_slices=2, **kwargs)
    td = Episodes(None, 3, p_end=0.2).batch(20)
    rb = ReplayBuffer(storage=storage, sampler=fast)
    rb.extend(change(td) if change else td)
    before = storage[:20].clone()
    with pytest.raises(error, match=match):
        fast.sample(storage, 4)
    assert fast._fr_index is None and len(rb) == 20
    assert (storage[:20] == before).all()


@pytest.mark.parametrize("mode", ["done", "ids"])
@pytest.mark.parametrize("truncated_key", [("next", "truncated"), None])
@pytest.mark.parametrize("stored", [(), ("terminated",), ("terminated", "is_init")])
def test_slice_info_matches_torchrl_with_stored_flags(mode, truncated_key, stored) -> None:
    """The info's done/terminated/is_init against TorchRL's, through both buffers.

    With trajectory ids the stored done flags are random (they fall inside slices), so they are
    read at the sampled steps; with done flags as boundaries they only end slices.
    """
    seed = hash((mode, truncated_key, stored)) % 1000
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    episodes = Episodes(None, seed)
    kw = {"num_slices": 4, "truncated_key": truncated_key, **trajectory_key(mode)}
    fast, ref = SliceSampler(**kw), TorchRLSliceSampler(**kw)
    storage, ref_storage = LazyTensorStorage(301), LazyTensorStorage(301)
    rb = fastreplay.TensorDictReplayBuffer(storage=storage, sampler=fast, batch_size=16)
    ref_rb = TensorDictReplayBuffer(storage=ref_storage, sampler=ref, batch_size=16)
    for it in range(8):  # wraps around the 301 rows
        td = episodes.batch(rng.randint(20, 200))
        if mode == "ids":
            td[DONE] = torch.rand(td.shape[0], 1, generator=gen) < 0.3
        if "terminated" in stored:
            td["next", "terminated"] = td[DONE] & (torch.rand(td.shape[0], 1, generator=gen) < 0.5)
        if "is_init" in stored:
            td["is_init"] = torch.rand(td.shape[0], 1, generator=gen) < 0.2
        rb.extend(td)
        ref_rb.extend(td)
        for batch in (16, 32):
            _assert_same(fast, ref, storage, batch, seed=it * 7 + batch)
        fast._rng = torch.Generator().manual_seed(it)
        ref._rng = torch.Generator().manual_seed(it)
        got, expected = rb.sample(), ref_rb.sample()
        assert set(got.keys(True, True)) == set(expected.keys(True, True))
        for key in expected.keys(True, True):
            assert torch.equal(got[key], expected[key]), key


# ---------------------------------------------------------------- trajectory key detection
def _ids_and_done_flags_that_disagree() -> TensorDict:
    """40 steps: ``episode`` ids change every 10 steps, the done flags every 5."""
    done = torch.zeros(40, 1, dtype=torch.bool)
    done[4::5] = True
    return TensorDict(
        {"obs": torch.arange(40), "episode": torch.arange(40) // 10, ("next", "done"): done},
        [40],
    )


def _slice_starts(sampler: object, buffer_side: str, sample_empty_first: bool) -> torch.Tensor:
    buffer_cls = (
        TensorDictReplayBuffer if buffer_side == "torchrl" else fastreplay.TensorDictReplayBuffer
    )
    rb = buffer_cls(storage=LazyTensorStorage(100), sampler=sampler, batch_size=32)
    if sample_empty_first:  # a loop that retries until data arrives
        with pytest.raises(RuntimeError):
            rb.sample()
    rb.extend(_ids_and_done_flags_that_disagree())
    torch.manual_seed(0)
    obs = torch.cat([rb.sample()["obs"] for _ in range(20)]).view(-1, 4)
    assert ((obs - obs[:, :1]) == torch.arange(4)).all()  # contiguous slices
    return obs


@pytest.mark.parametrize("buffer_side", ["torchrl", "fastreplay"])
def test_auto_detected_trajectory_key_ignores_a_sample_of_an_empty_buffer(buffer_side: str) -> None:
    """The key is chosen from the data: ``"episode"``, whether or not an empty sample came first.

    TorchRL resolves it at its first ``sample`` and, on an empty buffer, settles on the done
    flags for good: its slices then follow the done flags (blocks of 5), not the ids.
    """
    fast = _slice_starts(SliceSampler(slice_len=4), buffer_side, sample_empty_first=True)
    assert (fast // 10 == fast[:, :1] // 10).all()  # within an ``episode``
    assert (fast // 5 != fast[:, :1] // 5).any()  # across done flags, as the ids allow
    # The same samples as TorchRL's sampler where no empty sample came first (same seed).
    reference = _slice_starts(TorchRLSliceSampler(slice_len=4), buffer_side, False)
    assert torch.equal(fast, reference)
    torchrl = _slice_starts(TorchRLSliceSampler(slice_len=4), buffer_side, True)
    assert (torchrl // 5 == torchrl[:, :1] // 5).all()  # TorchRL: the done flags' blocks
    assert not torch.equal(fast, torchrl)

"""fastreplay.PrioritizedSliceSampler: valid starts, priorities, weights, writes, errors.

The slow references: TorchRL's own ``_preceding_stop_idx`` (which starts it excludes), a
brute-force list of valid starts from the stored trajectory ids, and the stored priorities.
"""

from __future__ import annotations

import inspect
import math
import pickle
import threading

import pytest
import torch
from torchrl.data import LazyMemmapStorage, LazyTensorStorage, ReplayBuffer
from torchrl.data import PrioritizedSliceSampler as TorchRLPrioritizedSliceSampler

from conformance.conftest import DONE, assert_slices_valid, episodes
from conformance.test_slice_samplers import slice_starts, valid_starts
from conftest import (
    chi2_pvalue,
    record_storage_reads,
    requires_cuda,
    requires_storage_revision,
    requires_torchrl_ext,
)
from fastreplay import PrioritizedSliceSampler
from fastreplay._core.trees.torch_backend import PriorityTrees
from fastreplay.samplers.slice import SliceSamplerError

PSS = PrioritizedSliceSampler
ALPHA, BETA = 0.7, 0.5


def _buffer(capacity: int, columns: int | None = None, storage=None, **kw):
    sampler = PSS(capacity * (columns or 1), ALPHA, BETA, **kw)
    if storage is None:
        ndim = 1 if columns is None else 2
        storage = LazyTensorStorage(capacity * (columns or 1), ndim=ndim)
    return ReplayBuffer(storage=storage, sampler=sampler), sampler, storage


def _fill(rb, parts, columns=None, seed=0) -> dict[int, float]:
    """Extend with ``episodes`` and random priorities; returns slot -> raw priority."""
    gen = torch.Generator().manual_seed(seed)
    raw: dict[int, float] = {}
    first = 0
    for n, length in parts:
        data = episodes(n, length, columns=columns, first_id=first)
        first = int(data["traj"].max()) + 1
        index = rb.extend(data)
        priority = 0.1 + torch.rand(index.shape[0], generator=gen) * 3
        rb.update_priority(index, priority)
        if index.ndim > 1:  # [k, 2] coordinates of an ndim=2 storage
            index = index[:, 0] * columns + index[:, 1]
        raw.update(zip(index.tolist(), priority.tolist(), strict=True))
    return raw


def _chi2(sampler, storage, raw, seq, strict, span_right=False, draws=5000) -> float:
    columns = storage.shape[1] if storage.ndim > 1 else 1
    valid = valid_starts(storage, seq, strict, span_right)
    index, info = sampler.sample(storage, seq * draws)
    slot, length = slice_starts(index, info, columns)
    assert set(slot.tolist()) <= set(valid)
    assert all(valid[s] == n for s, n in zip(slot.tolist(), length.tolist(), strict=True))
    keys = torch.tensor(sorted(valid))
    mass = torch.tensor([(raw[int(s)] + 1e-8) ** ALPHA for s in keys], dtype=torch.float64)
    observed = torch.bincount(torch.searchsorted(keys, slot), minlength=keys.numel()).double()
    return chi2_pvalue(observed, mass / mass.sum() * observed.sum())


@pytest.mark.parametrize(
    "capacity,columns,parts",
    [
        (7, None, [(5, 3), (4, 2)]),  # odd capacity, wraps around
        (1023, None, [(600, [31, 7, 120]), (700, [13, 60])]),
        (13, 3, [(9, [4, 6]), (8, [3, 5])]),  # ndim=2, wraps around
    ],
)
@pytest.mark.parametrize("strict", [True, False])
def test_starts_follow_priorities_among_valid_starts(capacity, columns, parts, strict) -> None:
    rb, sampler, storage = _buffer(capacity, columns, slice_len=2, traj_key="traj")
    sampler.strict_length = strict
    raw = _fill(rb, parts, columns)
    sampler._rng = torch.Generator().manual_seed(1)
    assert _chi2(sampler, storage, raw, 2, strict) > 1e-4


@requires_torchrl_ext
@pytest.mark.parametrize("strict", [True, False])
@pytest.mark.parametrize("span", [False, (False, True), (False, 1)])
def test_valid_starts_are_exactly_torchrl_s(strict, span) -> None:
    rb, _, storage = _buffer(53, slice_len=4, traj_key="traj", strict_length=strict, span=span)
    _fill(rb, [(30, [7, 3, 11, 2]), (31, [5, 9])])
    ref = TorchRLPrioritizedSliceSampler(
        53, ALPHA, BETA, slice_len=4, traj_key="traj", strict_length=strict, span=span
    )
    start_idx, _, lengths = ref._get_stop_and_length(storage)
    excluded = set(ref._preceding_stop_idx(storage, lengths, 4, start_idx).tolist())
    torchrl_valid = set(range(len(storage))) - excluded
    right = span[1] if isinstance(span, tuple) else span
    assert set(valid_starts(storage, 4, strict, right)) == torchrl_valid


@requires_torchrl_ext
def test_outputs_have_torchrl_s_format() -> None:
    kw = {"slice_len": 3, "end_key": DONE, "strict_length": False}
    for dtype in (torch.float32,):  # (TorchRL's float64 trees reject float32 priorities)
        outputs = []
        for cls in (PSS, TorchRLPrioritizedSliceSampler):
            sampler = cls(31, ALPHA, BETA, dtype=dtype, **kw)
            storage = LazyTensorStorage(31)
            rb = ReplayBuffer(storage=storage, sampler=sampler)
            index = rb.extend(episodes(31, [2, 8, 5]))
            rb.update_priority(index, torch.rand(31) + 0.1)
            outputs.append(sampler.sample(storage, 3 * 7))
        (got, got_info), (ref, ref_info) = outputs
        assert isinstance(got, tuple) and len(got) == len(ref) == 1
        assert got[0].dtype == ref[0].dtype
        assert got_info.keys() == ref_info.keys()
        for key, value in ref_info.items():
            assert got_info[key].dtype == value.dtype, key
            assert got_info[key].shape[1:] == value.shape[1:], key
            assert got_info[key].shape[0] == got[0].shape[0], key


def test_weights_are_the_start_s_and_sample_writes_nothing(monkeypatch) -> None:
    rb, sampler, storage = _buffer(50, slice_len=4, traj_key="traj", dtype=torch.float64)
    raw = _fill(rb, [(50, [9, 12, 4])])
    leaves = sampler._trees.leaf_mass(), sampler._trees.raw()
    for name in ("update", "clear", "reset", "set_leaves"):
        monkeypatch.setattr(PriorityTrees, name, lambda *a, **k: pytest.fail("sample wrote"))
    index, info = sampler.sample(storage, 4 * 40)
    slot, _ = slice_starts(index, info, 1)
    mass = {s: (p + 1e-8) ** ALPHA for s, p in raw.items()}
    expected = torch.tensor(
        [(mass[s] / min(mass.values())) ** -BETA for s in slot.tolist()], dtype=torch.float64
    )
    assert info["priority_weight"].dtype == torch.float64
    torch.testing.assert_close(info["priority_weight"], expected.repeat_interleave(4))
    assert torch.equal(sampler._trees.leaf_mass(), leaves[0])
    assert torch.equal(sampler._trees.raw(), leaves[1])


def test_low_share_of_valid_mass_falls_back_to_an_exact_draw() -> None:
    rb, sampler, storage = _buffer(61, slice_len=5, traj_key="traj")
    data = episodes(60, 6)  # 2 valid starts per trajectory of 6
    index = rb.extend(data)
    step = data["obs"] % 10_000
    priority = torch.where(step >= 2, 1e4, 1.0)  # valid starts hold ~1e-4 of the mass
    rb.update_priority(index, priority)
    raw = dict(zip(index.tolist(), priority.tolist(), strict=True))
    sampler._rng = torch.Generator().manual_seed(0)
    assert _chi2(sampler, storage, raw, 5, True, draws=3000) > 1e-4


def test_slice_len_one_samples_every_item() -> None:
    # TorchRL masks every start when slices are 1 step long ("non-positive p_sum").
    rb, sampler, storage = _buffer(23, slice_len=1, end_key=DONE)
    raw = _fill(rb, [(20, [4, 7])])
    sampler._rng = torch.Generator().manual_seed(0)
    assert _chi2(sampler, storage, raw, 1, True) > 1e-4


def test_ndim2_slices_stay_inside_trajectories() -> None:
    # TorchRL's PrioritizedSliceSampler offsets column-major positions by a row-major start
    # once the storage is full, and draws invalid starts on ndim=2 storages.
    rb, sampler, storage = _buffer(17, 3, slice_len=4, end_key=DONE)
    for seed, parts in enumerate([[(12, [5, 9])], [(10, [6, 4])], [(15, [8])]]):
        _fill(rb, parts, 3, seed)
        index, _ = sampler.sample(storage, 4 * 50)
        assert_slices_valid(storage[index]["obs"], 50)


def test_new_items_get_the_live_max_priority() -> None:
    rb, sampler, _ = _buffer(40, slice_len=2, traj_key="traj", upper_priority=5.0)
    assert sampler.default_priority == 1.0  # initial_priority
    index = rb.extend(episodes(20, 5))
    rb.update_priority(index, torch.full((20,), 0.3))
    rb.update_priority(index[:1], torch.tensor([2.0]))
    new = rb.extend(episodes(5, 5, first_id=10))
    assert sampler._trees.raw()[new].tolist() == [2.0] * 5
    rb.update_priority(torch.cat([index[:1], new]), torch.full((6,), 0.3))
    assert sampler.default_priority == pytest.approx(0.3)
    rb.update_priority(index[:1], torch.tensor([9.0]))
    assert sampler.default_priority == 5.0  # upper_priority


def test_online_writes_read_only_the_new_rows(monkeypatch) -> None:
    rb, sampler, storage = _buffer(101, slice_len=3, end_key=DONE)
    rb.extend(episodes(60, 10))
    sampler.sample(storage, 9)
    read = record_storage_reads(monkeypatch)
    for n, first in ((7, 100), (30, 200), (150, 300)):  # the last one wraps around
        rb.extend(episodes(n, 10, first_id=first))
        index, _ = sampler.sample(storage, 9)
        assert_slices_valid(storage[index]["obs"], 3)
    assert read == [7, 30, 101]


@requires_storage_revision
def test_writes_it_was_not_told_about_trigger_a_rebuild() -> None:
    rb, sampler, storage = _buffer(40, slice_len=3, traj_key="traj")
    _fill(rb, [(40, 10)])
    sampler.sample(storage, 9)
    storage.set(torch.arange(0, 40), episodes(40, 4, first_id=50))  # behind its back
    index, _ = sampler.sample(storage, 3 * 100)
    assert (storage[index]["obs"] // 10_000 >= 50).all()
    assert_slices_valid(storage[index]["obs"], 100)


def test_checkpoints_round_trip(tmp_path) -> None:
    rb, sampler, storage = _buffer(45, slice_len=3, traj_key="traj")
    _fill(rb, [(45, [8, 5])])
    clones = [PSS(45, ALPHA, BETA, slice_len=3, traj_key="traj") for _ in range(2)]
    clones[0].load_state_dict(sampler.state_dict())
    sampler.dumps(tmp_path / "s")
    clones[1].loads(tmp_path / "s")
    clones.append(pickle.loads(pickle.dumps(sampler)))
    for seed in range(3):
        sampler._rng = torch.Generator().manual_seed(seed)
        expected = sampler.sample(storage, 12)
        for clone in clones:
            clone._rng = torch.Generator().manual_seed(seed)
            got = clone.sample(storage, 12)
            assert all(torch.equal(a, b) for a, b in zip(got[0], expected[0], strict=True))
            assert torch.equal(got[1]["priority_weight"], expected[1]["priority_weight"])


def test_memmap_storage(tmp_path) -> None:
    storage = LazyMemmapStorage(37, scratch_dir=tmp_path)
    rb, sampler, storage = _buffer(37, storage=storage, slice_len=3, end_key=DONE)
    raw = _fill(rb, [(25, [4, 7]), (25, [6, 5])])
    sampler._rng = torch.Generator().manual_seed(0)
    assert _chi2(sampler, storage, raw, 3, True, draws=2000) > 1e-4


def test_static_ends_argument() -> None:
    ends = torch.zeros(30, dtype=torch.bool)
    ends[[5, 17, 29]] = True
    sampler = PSS(30, ALPHA, BETA, slice_len=4, ends=ends, cache_values=True)
    storage = LazyTensorStorage(30)
    rb = ReplayBuffer(storage=storage, sampler=sampler)
    data = episodes(30, [6, 12, 12])
    rb.extend(data)
    rb.update_priority(torch.arange(30), torch.rand(30) + 0.1)
    index, _ = sampler.sample(storage, 4 * 50)
    assert_slices_valid(storage[index]["obs"], 50)


def test_signature_is_torchrl_s_plus_the_priority_bounds() -> None:
    ours = list(inspect.signature(PSS).parameters.values())
    theirs = list(inspect.signature(TorchRLPrioritizedSliceSampler.__init__).parameters.values())
    assert [p.name for p in ours] == [p.name for p in theirs[1:]] + [
        "upper_priority",
        "initial_priority",
    ]
    assert isinstance(PSS(10, 1.0, 1.0, num_slices=2), TorchRLPrioritizedSliceSampler)
    with pytest.warns(UserWarning, match="Left spanning is disabled"):
        assert PSS(10, 1.0, 1.0, num_slices=2, span=True).span == (0, True)


def test_is_a_slice_sampler_and_a_prioritized_sampler_of_both_libraries() -> None:
    """TorchRL's class subclasses its SliceSampler and PrioritizedSampler; so does this one."""
    import torchrl.data as trl

    import fastreplay

    sampler = PSS(10, 1.0, 1.0, num_slices=2)
    for cls in (
        fastreplay.SliceSampler,
        fastreplay.PrioritizedSampler,
        trl.SliceSampler,
        trl.PrioritizedSampler,
        TorchRLPrioritizedSliceSampler,
    ):
        assert isinstance(sampler, cls), cls
    assert not isinstance(sampler, fastreplay.SliceSamplerWithoutReplacement)


def _snapshot(sampler) -> tuple:
    index = sampler._fr_index
    return (
        sampler._trees.leaf_mass().tolist(),
        None if index is None else index.boundaries()[0].tolist(),
    )


def test_bad_requests_are_clear_errors_and_change_nothing() -> None:
    rb, sampler, storage = _buffer(40, num_slices=4, traj_key="traj")
    with pytest.raises(RuntimeError, match="empty storage"):
        sampler.sample(storage, 8)
    _fill(rb, [(40, [3, 2])])
    sampler.sample(storage, 8)
    before = _snapshot(sampler)
    with pytest.raises(SliceSamplerError, match=r"batch_size=10 is not divisible by num_slices=4"):
        sampler.sample(storage, 10)
    with pytest.raises(SliceSamplerError, match=r"No trajectory is long enough .* 5 steps"):
        sampler.sample(storage, 20)
    with pytest.raises(ValueError, match=r"priority must be finite and >= 0.*nothing was updated"):
        rb.update_priority(torch.tensor([1, 2]), torch.tensor([1.0, -1.0]))
    assert _snapshot(sampler) == before


def test_missing_key_is_a_clear_error() -> None:
    rb, sampler, storage = _buffer(30, slice_len=2, traj_key="episode_id")
    rb.extend(episodes(30, 5).exclude(DONE))
    with pytest.raises(KeyError, match=r"traj_key='episode_id' is not in the storage"):
        sampler.sample(storage, 4)


@requires_cuda
def test_cuda_storage() -> None:
    storage = LazyTensorStorage(50, device="cuda")
    rb, sampler, storage = _buffer(50, storage=storage, slice_len=3, traj_key="traj")
    _fill(rb, [(50, [7, 9])])
    index, info = sampler.sample(storage, 3 * 20)
    assert_slices_valid(storage[index]["obs"].cpu(), 20)
    assert math.isfinite(float(info["priority_weight"].sum()))


def test_concurrent_update_priority_is_never_undone() -> None:
    # pytorch/rl #2212: TorchRL's sample zeroes then restores the excluded starts' priorities,
    # so an update made in between is lost. fastreplay's sample writes nothing.
    rb, sampler, storage = _buffer(201, slice_len=4, end_key=DONE)
    rb.extend(episodes(200, [9, 14]))
    stop = threading.Event()
    errors: list[BaseException] = []

    def sample_loop() -> None:
        try:
            while not stop.is_set():
                sampler.sample(storage, 4 * 8)
        except BaseException as err:  # pragma: no cover - reported below
            errors.append(err)

    thread = threading.Thread(target=sample_loop)
    thread.start()
    try:
        for i in range(1, 41):
            sampler.update_priority(torch.arange(200), torch.full((200,), float(i)))
    finally:
        stop.set()
        thread.join()
    assert not errors
    assert (sampler._trees.raw()[:200] == 40.0).all()


def test_sample_waits_for_the_sampler_lock() -> None:
    """``sample`` reads the trees several times: never while a write or an alpha change runs."""
    rb, sampler, storage = _buffer(101, slice_len=3, end_key=DONE)
    rb.extend(episodes(60, 10))
    started, done = threading.Event(), threading.Event()

    def draw() -> None:
        started.set()
        sampler.sample(storage, 9)
        done.set()

    with sampler._fr_lock:  # what update_priority, mark_update and the alpha setter hold
        thread = threading.Thread(target=draw)
        thread.start()
        started.wait(5)
        assert not done.wait(0.2), "sample ran while another thread held the sampler lock"
    thread.join(10)
    assert done.is_set()

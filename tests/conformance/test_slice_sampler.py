"""SliceSampler conformance: the same behavioural tests against TorchRL's class and fastreplay's.

Each test builds its sampler (and, where it matters, its buffer) from ``impl``; a sampler that
TorchRL's ``ReplayBuffer`` holds is also run in fastreplay's ``TensorDictReplayBuffer``
(``buffer_side``). Data comes from
``episodes()``: ``obs = traj_id * 10_000 + step``, so a slice that crosses a trajectory
boundary or the write cursor shows up in the sample. Where TorchRL itself is wrong (boundaries
after a checkpoint is loaded into a fresh buffer), the test checks fastreplay's right answer
and pins TorchRL's wrong one; docs/migration.md lists that difference.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torchrl.data as trl
from tensordict import TensorDict

from conformance.conftest import (
    BUFFER_SIDES,
    DONE,
    FASTREPLAY_BUFFER,
    TORCHRL_BUFFER,
    Impl,
    assert_slices_valid,
    episodes,
    extend_in_two,
    make_buffer,
)
from conftest import requires_cuda, requires_slice_args, short_flat_batches, skip_unless_slice_args
from fastreplay._torchrl import HAS_CAN_SAMPLE, TORCHRL_VERSION

TERMINATED = ("next", "terminated")
TRUNCATED = ("next", "truncated")


def _buffer(
    impl: Impl,
    storage: Any,
    *,
    buffer: str = "ReplayBuffer",
    side: str = TORCHRL_BUFFER,
    **sampler: Any,
) -> Any:
    """``impl``'s SliceSampler in ``impl``'s ``buffer`` class, or for ``ReplayBuffer`` in the
    ``side`` buffer (TorchRL's ``ReplayBuffer`` or fastreplay's ``TensorDictReplayBuffer``)."""
    kwargs = {"storage": storage, "sampler": impl.cls("SliceSampler")(**sampler), "batch_size": 16}
    if buffer != "ReplayBuffer":
        return impl.cls(buffer)(**kwargs)
    return make_buffer(side, **kwargs)


def _obs(storage: Any, index: tuple) -> torch.Tensor:
    return storage[index]["obs"]


# ------------------------------------------------------------------------ everyday contract
@pytest.mark.parametrize("key", [{"end_key": DONE}, {"traj_key": "traj"}, {}])
def test_index_format_info_keys_dtypes_and_shapes(impl: Impl, buffer_side: str, key: dict) -> None:
    storage = trl.LazyTensorStorage(50)
    rb = _buffer(impl, storage, side=buffer_side, num_slices=4, **key)
    rb.extend(episodes(37, [9, 6]))
    rb.extend(episodes(30, 11, first_id=100))  # wraps around the 50 slots
    index, info = rb.sampler.sample(storage, 24)
    assert isinstance(index, tuple) and len(index) == 1
    assert index[0].dtype == torch.long and index[0].shape == (24,)
    assert set(info) == {TRUNCATED, DONE, TERMINATED}
    for k in (TRUNCATED, DONE, TERMINATED):
        assert info[k].dtype == torch.bool and info[k].shape == (24, 1)
    assert info[TRUNCATED].view(4, 6)[:, -1].all() and not info[TRUNCATED].view(4, 6)[:, :-1].any()
    assert_slices_valid(_obs(storage, index), 4)


def test_tensordict_buffer_sample_carries_metadata(impl: Impl) -> None:
    rb = _buffer(impl, trl.LazyTensorStorage(41), buffer="TensorDictReplayBuffer", slice_len=4)
    rb.extend(episodes(60, [7, 12, 5]))
    batch = rb.sample()
    assert batch.shape == (16,)
    assert batch["index"].shape == (16, 1) and batch["index"].dtype == torch.long
    assert batch[TRUNCATED].view(4, 4)[:, -1].all()
    assert_slices_valid(batch["obs"], 4)


def test_is_init_marks_each_slice_start(impl: Impl, buffer_side: str) -> None:
    storage = trl.LazyTensorStorage(40)
    rb = _buffer(impl, storage, side=buffer_side, num_slices=3, end_key=DONE)
    td = episodes(35, 10)
    td["is_init"] = td["step"] == 0
    extend_in_two(rb, td)
    index, info = rb.sampler.sample(storage, 12)
    is_init = info["is_init"].view(3, 4)
    assert is_init[:, 0].all()
    assert torch.equal(is_init[:, 1:], storage[index]["is_init"].view(3, 4)[:, 1:])


@pytest.mark.parametrize("strict", [True, False])
@short_flat_batches
def test_short_trajectories(impl: Impl, buffer_side: str, strict: bool) -> None:
    storage = trl.LazyTensorStorage(30)
    rb = _buffer(
        impl, storage, side=buffer_side, num_slices=4, traj_key="traj", strict_length=strict
    )
    extend_in_two(rb, episodes(29, [2, 9, 3]))
    for _ in range(5):
        index, info = rb.sampler.sample(storage, 24)  # slices of 6: only the 9-step episodes fit
        obs = _obs(storage, index)
        if strict:
            assert obs.shape == (24,)
            assert_slices_valid(obs, 4)
        ends = info[TRUNCATED].flatten().nonzero().flatten().tolist()
        starts = [0] + [e + 1 for e in ends[:-1]]
        assert len(ends) == 4
        for s, e in zip(starts, ends, strict=True):
            piece = obs[s : e + 1]
            assert (piece.diff() == 1).all() and 0 < piece.numel() <= 6


def test_ndim2_storage_keeps_environments_apart(impl: Impl, buffer_side: str) -> None:
    storage = trl.LazyTensorStorage(3 * 17, ndim=2)
    rb = _buffer(impl, storage, side=buffer_side, num_slices=6, end_key=DONE)
    rb.extend(episodes(12, [5, 8], columns=3))
    rb.extend(episodes(9, [4, 7], columns=3, first_id=50))  # wraps along time
    index, _ = rb.sampler.sample(storage, 24)
    assert len(index) == 2 and all(i.shape == (24,) for i in index)
    assert_slices_valid(_obs(storage, index), 6)
    assert (index[1].view(6, 4).diff(dim=1) == 0).all()  # a slice stays in one environment


@requires_slice_args("end_keys")
def test_memmap_storage(impl: Impl, buffer_side: str, tmp_path) -> None:
    storage = trl.LazyMemmapStorage(23, scratch_dir=tmp_path)
    rb = _buffer(impl, storage, side=buffer_side, num_slices=2, end_keys=[DONE, TRUNCATED])
    for i in range(4):
        td = episodes(9, [4, 3], first_id=10 * i)
        td[TRUNCATED] = torch.zeros(9, 1, dtype=torch.bool)
        rb.extend(td)
        index, _ = rb.sampler.sample(storage, 6)
        assert_slices_valid(_obs(storage, index), 2)


def test_prefetching_buffer(impl: Impl) -> None:
    rb = impl.cls("TensorDictReplayBuffer")(
        storage=trl.LazyTensorStorage(64),
        sampler=impl.cls("SliceSampler")(num_slices=4, end_key=DONE),
        batch_size=16,
        prefetch=2,
    )
    for i in range(5):
        rb.extend(episodes(21, [6, 9], first_id=10 * i))
        assert_slices_valid(rb.sample()["obs"], 4)


def _restore(rb: Any, fresh: Any, how: str, tmp_path: Any) -> None:
    """Load ``rb``'s checkpoint into ``fresh``, through ``state_dict`` or ``dumps``/``loads``."""
    if how == "state_dict":
        fresh.load_state_dict(rb.state_dict())
    else:
        rb.dumps(tmp_path)
        fresh.loads(tmp_path)


@pytest.mark.parametrize("how", ["state_dict", "dumps"])
def test_checkpoint_round_trip(impl: Impl, buffer_side: str, how: str, tmp_path) -> None:
    rb = _buffer(impl, trl.LazyTensorStorage(31), side=buffer_side, num_slices=2, end_key=DONE)
    rb.extend(episodes(45, [7, 4]))  # the newest step ends an episode: no cursor question
    fresh = _buffer(impl, trl.LazyTensorStorage(31), side=buffer_side, num_slices=2, end_key=DONE)
    _restore(rb, fresh, how, tmp_path)
    expected = rb.sampler._get_stop_and_length(rb.storage)
    got = fresh.sampler._get_stop_and_length(fresh.storage)
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
    fresh.extend(episodes(5, 5, first_id=99))
    index, _ = fresh.sampler.sample(fresh.storage, 8)
    assert_slices_valid(_obs(fresh.storage, index), 2)


@pytest.mark.parametrize("how", ["state_dict", "dumps"])
def test_checkpoint_into_fresh_buffer_cursor_boundary(
    impl: Impl, buffer_side: str, how: str, tmp_path
) -> None:
    # The newest episode is still running at the write cursor (row 22 of 50). A checkpoint
    # does not carry the storage's last write position; fastreplay recovers it from the
    # restored writer, TorchRL treats the end of the storage as the newest step and joins the
    # running episode to the oldest one (deliberate difference, docs/migration.md).
    def buffer() -> Any:
        return _buffer(
            impl, trl.LazyTensorStorage(50), side=buffer_side, num_slices=2, end_key=DONE
        )

    rb = buffer()
    td = episodes(73, [9, 13])
    td[DONE][-1] = False
    extend_in_two(rb, td)
    expected = trl.SliceSampler(num_slices=2, end_key=DONE)._get_stop_and_length(rb.storage)
    fresh = buffer()
    _restore(rb, fresh, how, tmp_path)
    got = fresh.sampler._get_stop_and_length(fresh.storage)
    same = all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
    assert same is not impl.is_torchrl


# ----------------------------------------------------------------------- drop-in behaviours
def test_replacement_false_builds_the_without_replacement_sampler(
    impl: Impl, buffer_side: str
) -> None:
    sampler = impl.cls("SliceSampler")(replacement=False, num_slices=4, end_key=DONE)
    assert isinstance(sampler, trl.SliceSamplerWithoutReplacement)
    assert isinstance(sampler, impl.cls("SliceSamplerWithoutReplacement"))
    storage = trl.LazyTensorStorage(40)
    extend_in_two(make_buffer(buffer_side, storage=storage, sampler=sampler), episodes(40, 10))
    index, _ = sampler.sample(storage, 16)
    assert_slices_valid(_obs(storage, index), 4)
    trajs = storage[index]["traj"].view(4, 4)[:, 0]
    assert trajs.unique().numel() == 4  # one slice per trajectory within a sample
    plain = impl.cls("SliceSampler")(replacement=True, num_slices=4)
    assert type(plain) is impl.cls("SliceSampler")


@requires_slice_args("end_keys")
def test_end_keys_none_in_storage_fall_back_to_traj_ids(impl: Impl, buffer_side: str) -> None:
    storage = trl.LazyTensorStorage(40)
    rb = _buffer(
        impl, storage, side=buffer_side, num_slices=2, end_keys=[("next", "x"), ("next", "y")]
    )
    td = episodes(33, [5, 8])
    td["episode"] = td["traj"]
    extend_in_two(rb, td.exclude(DONE))
    for _ in range(3):
        index, _ = rb.sampler.sample(storage, 8)
        assert_slices_valid(_obs(storage, index), 2)


def _signal_case(case: str, td: TensorDict) -> tuple[dict, TensorDict]:
    """The boundary key arguments and ``td`` with its boundary signal stored as ``case`` says."""
    done = td[DONE]
    if case == "int64 done":
        return {"end_key": DONE}, td.set(DONE, done.long())
    if case == "uint8 done":
        return {"end_key": DONE}, td.set(DONE, done.to(torch.uint8))
    if case == "[N] done":
        return {"end_key": DONE}, td.exclude(DONE).set(DONE, done[:, 0])
    if case == "[N, 1, 1] done":
        return {"end_key": DONE}, td.exclude(DONE).set(DONE, done[..., None])
    if case == "float ids":
        return {"traj_key": "traj"}, td.set("traj", td["traj"].double())
    if case == "int32 ids":
        return {"traj_key": "traj"}, td.set("traj", td["traj"].int())
    raise AssertionError(case)


@pytest.mark.parametrize(
    "case",
    ["int64 done", "uint8 done", "[N] done", "[N, 1, 1] done", "float ids", "int32 ids"],
)
def test_signal_dtypes_and_shapes_that_sample(impl: Impl, buffer_side: str, case: str) -> None:
    key, td = _signal_case(case, episodes(41, [6, 11, 4]))
    storage = trl.LazyTensorStorage(47)
    rb = _buffer(impl, storage, side=buffer_side, num_slices=3, **key)
    rb.extend(td)
    rb.extend(_signal_case(case, episodes(9, 4, first_id=70))[1])  # wraps around
    for _ in range(3):
        index, _ = rb.sampler.sample(storage, 9)
        assert_slices_valid(_obs(storage, index), 3)


def test_lazy_stack_storage(impl: Impl, buffer_side: str) -> None:
    storage = trl.LazyStackStorage(30)
    rb = _buffer(impl, storage, side=buffer_side, num_slices=2, end_key=DONE)
    rb.extend(episodes(26, [5, 7]))
    index, _ = rb.sampler.sample(storage, 8)
    assert_slices_valid(storage[index[0]]["obs"], 2)


def _bad(case: str) -> tuple[Any, dict, Any, type]:
    """(storage, sampler kwargs, data, the class TorchRL raises at sample)."""
    td = episodes(20, 5)
    if case == "missing end_key":
        return trl.LazyTensorStorage(30), {"end_key": ("next", "x")}, td, RuntimeError
    if case == "missing traj_key and end_key":
        return trl.LazyTensorStorage(30), {"traj_key": "nope"}, td.exclude(DONE), RuntimeError
    if case == "no end_keys nor ids":
        return trl.LazyTensorStorage(30), {"end_keys": [("next", "x")]}, td, KeyError
    if case == "[N, 2] done":
        wide = td.exclude(DONE).set(DONE, td[DONE].expand(20, 2).clone())
        return trl.LazyTensorStorage(30), {"end_key": DONE}, wide, RuntimeError
    if case == "[N, 1] ids":
        ids = td.exclude("traj").set("traj", td["traj"][:, None])
        return trl.LazyTensorStorage(30), {"traj_key": "traj"}, ids, RuntimeError
    if case == "float done":
        flt = td.set(DONE, td[DONE].float())
        return trl.LazyTensorStorage(30), {"end_key": DONE}, flt, NotImplementedError
    if case == "ListStorage of tensors":
        data = [torch.tensor(i) for i in range(20)]
        return trl.ListStorage(30), {}, data, RuntimeError
    if case == "empty storage":
        return trl.LazyTensorStorage(30), {"end_key": DONE}, None, RuntimeError
    raise AssertionError(case)


BAD_CASES = (
    "missing end_key",
    "missing traj_key and end_key",
    "no end_keys nor ids",
    "[N, 2] done",
    "[N, 1] ids",
    "float done",
    "ListStorage of tensors",
    "empty storage",
)
TENSOR_DATA = "ListStorage of tensors"  # data fastreplay's TensorDict buffers do not take


@pytest.mark.parametrize(
    ("buffer_side", "case"),
    [
        (side, case)
        for side in BUFFER_SIDES
        for case in BAD_CASES
        if not (side == FASTREPLAY_BUFFER and case == TENSOR_DATA)
    ],
)
def test_bad_storages_raise_torchrls_error_class_and_change_nothing(
    impl: Impl, buffer_side: str, case: str
) -> None:
    storage, kwargs, data, error = _bad(case)
    skip_unless_slice_args(kwargs)
    rb = _buffer(impl, storage, side=buffer_side, num_slices=2, **kwargs)
    if data is not None:
        extend_in_two(rb, data)
    before = [storage[i] for i in range(len(storage))]
    with pytest.raises(error):
        rb.sampler.sample(storage, 4)
    with pytest.raises(error):  # the same again: nothing half-done in between
        rb.sampler.sample(storage, 4)
    assert len(storage) == len(before)
    for i, item in enumerate(before):
        after = storage[i]
        assert (after == item).all()


@pytest.mark.parametrize("batch_size,strict", [(9, True), (40, True)])
def test_bad_requests_raise_runtime_error(
    impl: Impl, buffer_side: str, batch_size: int, strict: bool
) -> None:
    storage = trl.LazyTensorStorage(30)
    rb = _buffer(impl, storage, side=buffer_side, num_slices=2, end_key=DONE, strict_length=strict)
    extend_in_two(rb, episodes(25, 5))
    with pytest.raises(RuntimeError):
        rb.sampler.sample(storage, batch_size)
    index, _ = rb.sampler.sample(storage, 8)  # still samples afterwards
    assert_slices_valid(_obs(storage, index), 2)


def test_include_info_false_keeps_stored_keys(impl: Impl) -> None:
    rb = _buffer(impl, trl.LazyTensorStorage(40), buffer="TensorDictReplayBuffer", num_slices=4)
    td = episodes(30, 7)
    td[TERMINATED] = td[DONE].clone()
    rb.extend(td)
    with pytest.warns(UserWarning, match="include_info"):
        batch = rb.sample(include_info=False)
    assert {DONE, TERMINATED, "index", "obs"} <= set(batch.keys(True, True))
    assert TRUNCATED not in batch.keys(True, True)
    stored = rb.storage[batch["index"]]
    assert torch.equal(batch[DONE], stored[DONE])  # the stored flags, not done | truncated


@requires_cuda
def test_cuda_storage(impl: Impl, buffer_side: str) -> None:
    storage = trl.LazyTensorStorage(3 * 29, ndim=2, device="cuda")
    rb = _buffer(impl, storage, side=buffer_side, num_slices=4, end_key=DONE)
    rb.extend(episodes(20, [6, 9], columns=3))
    rb.extend(episodes(15, [4, 7], columns=3, first_id=40))
    index, _ = rb.sampler.sample(storage, 16)
    assert all(i.device.type == "cuda" for i in index)
    assert_slices_valid(_obs(storage, index), 4)
    start, stop, length = rb.sampler._get_stop_and_length(storage)
    assert {start.device.type, stop.device.type, length.device.type} == {"cuda"}


@pytest.mark.skipif(
    not HAS_CAN_SAMPLE, reason=f"TorchRL {TORCHRL_VERSION}'s samplers have no can_sample"
)
def test_can_sample(impl: Impl, buffer_side: str) -> None:
    storage = trl.LazyTensorStorage(30)
    rb = _buffer(impl, storage, side=buffer_side, num_slices=2, end_key=DONE)
    assert not rb.sampler.can_sample(storage, 8)  # empty
    extend_in_two(rb, episodes(20, [3, 6]))
    assert rb.sampler.can_sample(storage, 8)  # slices of 4 fit in the 6-step episodes
    assert not rb.sampler.can_sample(storage, 20)  # slices of 10 fit nowhere
    missing = impl.cls("SliceSampler")(num_slices=2, end_key=("next", "x"))
    assert not missing.can_sample(storage, 8)

"""The everyday buffer contract, written once, run on TorchRL's class and on fastreplay's.

``TensorDictReplayBuffer`` (``impl``) and ``TensorDictPrioritizedReplayBuffer`` (``per_impl``):
constructor arguments, sample keys / shapes / dtypes, ``return_info``, transforms, ``extend`` /
``add`` / ``__getitem__`` / ``__len__``, priority updates, checkpoint round trips (same class on
both ends), ndim=2 and memmap storages, ``prefetch``, and errors on bad input (class, and the
buffer left as it was).

Deliberate differences are not asserted equal here (docs/migration.md lists each with the test
that pins it): pinning on a machine without an accelerator (TorchRL raises at the first sample,
fastreplay warns once and samples unpinned), and the priority of new items in the prioritized
buffer (live max instead of all-time max). Where a value depends on the latter, the test sets
every priority explicitly first.
"""

from __future__ import annotations

import contextlib
from typing import Any

import numpy as np
import pytest
import torch
import torchrl.data as trl
from tensordict import TensorDict

from conformance.conftest import DONE, Impl, episodes
from conftest import assert_same_tensordict, requires_cuda, short_flat_batches, shutdown
from fastreplay._torchrl import CHECKPOINTS_KEEP_PREFETCHED, TORCHRL_VERSION

CAPACITY = 7  # odd, and small enough that every test wraps around
BATCH = 5
ALPHA, BETA, EPS = 0.7, 0.5, 1e-8


def buffer(impl: Impl, **kwargs: Any) -> Any:
    kwargs.setdefault("storage", trl.LazyTensorStorage(CAPACITY))
    kwargs.setdefault("batch_size", BATCH)
    return impl.cls("TensorDictReplayBuffer")(**kwargs)


def per_buffer(impl: Impl, **kwargs: Any) -> Any:
    kwargs.setdefault("storage", trl.LazyTensorStorage(CAPACITY))
    kwargs.setdefault("batch_size", BATCH)
    return impl.cls("TensorDictPrioritizedReplayBuffer")(alpha=ALPHA, beta=BETA, **kwargs)


def filled(rb: Any, n: int = 11) -> TensorDict:
    """Extend ``rb`` with ``n`` steps (two writes: wraps around a capacity of 7); return them."""
    data = episodes(n, [3, 4])
    rb.extend(data[:4])
    rb.extend(data[4:])
    return data


def stored(rb: Any) -> TensorDict:
    """What the storage holds (no transform, no collate_fn)."""
    return rb.storage.get(torch.arange(len(rb)))


def snapshot(rb: Any) -> tuple[int, TensorDict]:
    return len(rb), stored(rb).clone() if len(rb) else None


def assert_unchanged(rb: Any, before: tuple[int, TensorDict | None]) -> None:
    length, content = before
    assert len(rb) == length
    if content is not None:
        assert_same_tensordict(stored(rb), content)


def assert_rows(a: TensorDict, b: TensorDict) -> None:
    """The same data rows (``add``/``extend`` may write ``index`` into what they store)."""
    assert_same_tensordict(a.select(*DATA_KEYS), b.select(*DATA_KEYS))


DATA_KEYS = ("obs", "traj", "step", DONE)


def assert_sample_is_stored(rb: Any, sample: TensorDict) -> None:
    """Each sampled row is the stored row its ``index`` names."""
    index = sample["index"]
    rows = rb.storage[index if index.ndim == 1 else tuple(index.unbind(-1))]
    for key in DATA_KEYS:
        assert torch.equal(sample[key], rows[key]), key
    assert torch.equal(sample["obs"], sample["traj"] * 10_000 + sample["step"])


# ------------------------------------------------------------------ TensorDictReplayBuffer


def test_constructor_arguments(impl: Impl) -> None:
    storage, sampler, writer = (
        trl.LazyTensorStorage(CAPACITY),
        trl.RandomSampler(),
        trl.RoundRobinWriter(),
    )
    rb = buffer(
        impl,
        storage=storage,
        sampler=sampler,
        writer=writer,
        collate_fn=lambda td: td,
        pin_memory=False,
        prefetch=None,
        transform=None,
        batch_size=BATCH,
        dim_extend=0,
        generator=torch.Generator().manual_seed(0),
        priority_key="td_error",
        compilable=False,
    )
    assert rb.storage is storage and rb.sampler is sampler and rb.writer is writer
    assert rb.priority_key == "td_error"
    filled(rb)
    assert rb.sample().batch_size == (BATCH,)


def test_sample_keys_shapes_dtypes(impl: Impl) -> None:
    rb = buffer(impl)
    data = filled(rb)
    sample = rb.sample()
    assert set(sample.keys(True, True)) == set(data.keys(True, True)) | {"index"}
    assert sample.batch_size == (BATCH,)
    assert sample["index"].dtype == torch.int64 and sample["index"].shape == (BATCH,)
    for key in data.keys(True, True):
        assert sample[key].dtype == data[key].dtype
        assert sample[key].shape[1:] == data[key].shape[1:]
    assert_sample_is_stored(rb, sample)


def test_same_generator_same_samples_as_torchrl(impl: Impl) -> None:
    rb = buffer(impl, generator=torch.Generator().manual_seed(3))
    ref = buffer(Impl("torchrl"), generator=torch.Generator().manual_seed(3))
    filled(rb), filled(ref)
    for _ in range(3):
        assert_same_tensordict(rb.sample(), ref.sample())


def test_return_info(impl: Impl) -> None:
    rb = buffer(impl)
    filled(rb)
    out = rb.sample(return_info=True)
    assert isinstance(out, tuple) and len(out) == 2
    sample, info = out
    assert set(info) == {"index"}
    assert torch.equal(torch.as_tensor(info["index"]), sample["index"])


def test_transform(impl: Impl) -> None:
    def transform(td: TensorDict) -> TensorDict:
        return td.set("twice", td["obs"] * 2)

    rb = buffer(impl, transform=transform)
    ref = buffer(Impl("torchrl"), transform=transform)
    filled(rb), filled(ref)
    sample = rb.sample()
    assert torch.equal(sample["twice"], sample["obs"] * 2)
    assert_sample_is_stored(rb, sample)
    assert_same_tensordict(rb[2:5], ref[2:5])


def test_extend_add_getitem_len(impl: Impl) -> None:
    rb = buffer(impl)
    data = episodes(11, [3, 4])
    assert len(rb) == 0
    assert torch.equal(rb.extend(data[:4]), torch.arange(4))
    assert torch.equal(rb.extend(data[4:10]), torch.tensor([4, 5, 6, 0, 1, 2]))  # wraps
    assert len(rb) == CAPACITY
    index = rb.add(data[10])
    assert int(index) == 3
    assert_rows(rb[3], data[10])
    assert_rows(rb[4:7], data[4:7])
    assert_rows(rb[torch.tensor([0, 2])], data[torch.tensor([7, 9])])
    assert_rows(rb[-1], data[6])
    assert rb[:].batch_size == (CAPACITY,)
    unsized = buffer(impl, batch_size=None)
    unsized.extend(data)
    assert unsized.sample(3).batch_size == (3,)


def test_state_dict_round_trip(impl: Impl) -> None:
    rb = buffer(impl)
    filled(rb)
    fresh = buffer(impl)
    fresh.load_state_dict(rb.state_dict())
    assert len(fresh) == len(rb)
    assert_same_tensordict(stored(fresh), stored(rb))
    # The write cursor came along: the next write lands where it would have.
    more = episodes(3, 3, first_id=50)
    assert torch.equal(fresh.extend(more), rb.extend(more))
    assert_same_tensordict(stored(fresh), stored(rb))


@pytest.mark.parametrize("storage", ["tensor", "memmap"])
def test_dumps_loads_round_trip(impl: Impl, storage: str, tmp_path: Any) -> None:
    def make(name: str) -> Any:
        if storage == "tensor":
            return trl.LazyTensorStorage(CAPACITY)
        return trl.LazyMemmapStorage(CAPACITY, scratch_dir=tmp_path / name)

    rb = buffer(impl, storage=make("a"))
    filled(rb)
    rb.dumps(tmp_path / "ckpt")
    fresh = buffer(impl, storage=make("b"))
    fresh.loads(tmp_path / "ckpt")
    assert len(fresh) == len(rb)
    assert_same_tensordict(stored(fresh), stored(rb))
    more = episodes(2, 2, first_id=60)
    assert torch.equal(fresh.extend(more), rb.extend(more))


def test_memmap_storage(impl: Impl, tmp_path: Any) -> None:
    rb = buffer(impl, storage=trl.LazyMemmapStorage(CAPACITY, scratch_dir=tmp_path))
    filled(rb)
    sample = rb.sample()
    assert sample["index"].shape == (BATCH,)
    assert_sample_is_stored(rb, sample)


def test_ndim2_storage(impl: Impl) -> None:
    # 3 envs: 51 slots = 3 envs x 17 steps. Data is [env, time]; extend along time (dim 1).
    rb = buffer(impl, storage=trl.LazyTensorStorage(51, ndim=2), batch_size=12)
    data = episodes(13, [4, 5], columns=3)
    rb.extend(data[:, :9])
    rb.extend(data[:, 9:])
    rb.extend(data[:, :9])  # 22 steps in 17 columns: wraps
    assert len(rb) == 51
    sample = rb.sample()
    assert sample.batch_size == (12,)
    assert sample["index"].shape == (12, 2) and sample["index"].dtype == torch.int64
    assert_sample_is_stored(rb, sample)


def test_prefetch(impl: Impl) -> None:
    rb = buffer(impl, prefetch=3)
    try:
        filled(rb)
        for _ in range(5):
            sample = rb.sample()
            assert sample.batch_size == (BATCH,)
            assert_sample_is_stored(rb, sample)
    finally:
        shutdown(rb)


def test_sample_without_batch_size_raises_and_changes_nothing(impl: Impl) -> None:
    rb = buffer(impl, batch_size=None)
    filled(rb)
    before = snapshot(rb)
    with pytest.raises(RuntimeError, match="batch_size not specified"):
        rb.sample()
    assert_unchanged(rb, before)


def test_empty_buffer_sample_raises(impl: Impl) -> None:
    rb = buffer(impl)
    with pytest.raises(RuntimeError, match="empty storage"):
        rb.sample()
    assert len(rb) == 0


def test_out_of_range_index_raises_and_changes_nothing(impl: Impl) -> None:
    rb = buffer(impl)
    filled(rb)
    before = snapshot(rb)
    with pytest.raises(IndexError):
        rb[100]
    assert_unchanged(rb, before)


def test_non_tensordict_output_with_info_raises(impl: Impl) -> None:
    rb = buffer(impl, collate_fn=lambda td: td["obs"])
    filled(rb)
    before = snapshot(rb)
    with pytest.raises(RuntimeError, match="Cannot include info in non-tensordict data"):
        rb.sample()
    assert_unchanged(rb, before)


@pytest.mark.parametrize("pin_memory", [False, np.bool_(False), 0, None], ids=repr)
def test_false_pin_memory_values_accepted(impl: Impl, pin_memory: Any) -> None:
    """``pin_memory`` is read for its truth value (``if pin_memory:``)."""
    rb = buffer(impl, pin_memory=pin_memory, generator=torch.Generator().manual_seed(4))
    ref = buffer(Impl("torchrl"), generator=torch.Generator().manual_seed(4))
    filled(rb), filled(ref)
    assert_same_tensordict(rb.sample(), ref.sample())


@requires_cuda
@pytest.mark.parametrize("pin_memory", [True, np.bool_(True), 1], ids=repr)
def test_pinned_samples_equal_with_an_accelerator(impl: Impl, pin_memory: Any) -> None:
    rb = buffer(impl, pin_memory=pin_memory, generator=torch.Generator().manual_seed(4))
    ref = buffer(Impl("torchrl"), generator=torch.Generator().manual_seed(4))
    filled(rb), filled(ref)
    sample = rb.sample()
    assert sample["obs"].is_pinned()
    assert_same_tensordict(sample, ref.sample())


# -------------------------------------------------------- TensorDictPrioritizedReplayBuffer


def set_all_priorities(rb: Any) -> torch.Tensor:
    """Give every stored item a known priority through ``update_tensordict_priority``."""
    every = stored(rb)
    every.set("index", torch.arange(len(rb)))
    every.set("td_error", (every["obs"] % 5 + 1).float() / 4)
    rb.update_tensordict_priority(every)
    return every["td_error"]


def test_per_constructor_arguments(per_impl: Impl) -> None:
    storage = trl.LazyTensorStorage(CAPACITY)
    rb = per_buffer(
        per_impl,
        storage=storage,
        eps=1e-6,
        reduction="mean",
        priority_key="err",
        batch_size=BATCH,
        prefetch=None,
        transform=None,
        generator=torch.Generator().manual_seed(0),
    )
    assert rb.storage is storage and rb.priority_key == "err"
    sampler = rb.sampler
    assert sampler._alpha == ALPHA and sampler._beta == BETA and sampler._eps == 1e-6
    filled(rb)
    assert rb.sample().batch_size == (BATCH,)


def test_per_sample_keys_shapes_dtypes(per_impl: Impl) -> None:
    rb = per_buffer(per_impl)
    data = filled(rb)
    sample, info = rb.sample(return_info=True)
    assert set(sample.keys(True, True)) == set(data.keys(True, True)) | {
        "index",
        "priority_weight",
    }
    assert {"index", "priority_weight"} <= set(info)
    assert sample["index"].dtype == torch.int64 and sample["index"].shape == (BATCH,)
    assert sample["priority_weight"].dtype == torch.float32
    assert sample["priority_weight"].shape == (BATCH,)
    assert_sample_is_stored(rb, sample)


def test_per_update_tensordict_priority_sets_weights(per_impl: Impl) -> None:
    rb = per_buffer(per_impl, batch_size=64)
    filled(rb)
    td_error = set_all_priorities(rb)
    mass = (td_error + EPS) ** ALPHA
    # Importance weights: (N * P(i)) ** -beta, normalised by the largest (smallest mass).
    expected = (mass / mass.min()) ** -BETA
    sample = rb.sample()
    index = sample["index"]
    torch.testing.assert_close(
        sample["priority_weight"], expected[index].float(), rtol=1e-5, atol=1e-6
    )
    # The highest-priority items are drawn most: the empirical mean weight is below uniform.
    assert sample["priority_weight"].mean() < 1


def test_per_update_tensordict_priority_reduces_per_step_errors(per_impl: Impl) -> None:
    """A per-step error ``[batch, steps]`` is reduced (here: max) to one priority per item."""
    rb = per_buffer(per_impl, reduction="max", batch_size=64)
    filled(rb)
    every = stored(rb)
    every.set("index", torch.arange(len(rb)))
    errors = (torch.arange(len(rb) * 3).reshape(-1, 3) % 5 + 1).float() / 4
    every.set("td_error", errors)
    rb.update_tensordict_priority(every)
    mass = (errors.max(-1).values + EPS) ** ALPHA
    sample = rb.sample()
    expected = ((mass / mass.min()) ** -BETA)[sample["index"]]
    torch.testing.assert_close(sample["priority_weight"], expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("how", ["state_dict", "dumps", "dumps-memmap"])
def test_per_checkpoint_round_trip(per_impl: Impl, how: str, tmp_path: Any) -> None:
    def make(name: str) -> Any:
        if how == "dumps-memmap":
            return trl.LazyMemmapStorage(CAPACITY, scratch_dir=tmp_path / name)
        return trl.LazyTensorStorage(CAPACITY)

    rb = per_buffer(per_impl, storage=make("a"))
    filled(rb)
    set_all_priorities(rb)
    fresh = per_buffer(per_impl, storage=make("b"))
    if how == "state_dict":
        fresh.load_state_dict(rb.state_dict())
    else:
        rb.dumps(tmp_path / "ckpt")
        fresh.loads(tmp_path / "ckpt")
    assert len(fresh) == len(rb)
    assert_same_tensordict(stored(fresh), stored(rb))
    rb.set_rng(torch.Generator().manual_seed(11))
    fresh.set_rng(torch.Generator().manual_seed(11))
    assert_same_tensordict(fresh.sample(), rb.sample())  # same priorities, same draws


def test_per_add_getitem_len_and_transform(per_impl: Impl) -> None:
    def transform(td: TensorDict) -> TensorDict:
        return td.set("twice", td["obs"] * 2)

    rb = per_buffer(per_impl, transform=transform)
    data = filled(rb)  # 11 items in 7 slots
    assert len(rb) == CAPACITY
    assert int(rb.add(data[0])) == 4
    assert_rows(rb[4], data[0])
    assert_rows(rb[torch.tensor([0, 2])], data[torch.tensor([7, 9])])
    sample = rb.sample()
    assert torch.equal(sample["twice"], sample["obs"] * 2)
    assert {"index", "priority_weight"} <= set(sample.keys())
    assert_sample_is_stored(rb, sample)


def test_per_memmap_storage(per_impl: Impl, tmp_path: Any) -> None:
    rb = per_buffer(per_impl, storage=trl.LazyMemmapStorage(CAPACITY, scratch_dir=tmp_path))
    filled(rb)
    set_all_priorities(rb)
    assert_sample_is_stored(rb, rb.sample())


def test_per_ndim2_storage(per_impl: Impl) -> None:
    rb = per_buffer(per_impl, storage=trl.LazyTensorStorage(51, ndim=2), batch_size=12)
    data = episodes(13, [4, 5], columns=3)  # [env, time]
    rb.extend(data[:, :9])
    rb.extend(data[:, 9:])
    sample = rb.sample()
    assert sample["index"].shape == (12, 2)
    assert sample["priority_weight"].shape == (12,)
    assert_sample_is_stored(rb, sample)
    sample.set("td_error", torch.rand(12))
    rb.update_tensordict_priority(sample)
    rb.extend(data[:, :9])  # wraps
    assert_sample_is_stored(rb, rb.sample())


def test_per_prefetch(per_impl: Impl) -> None:
    rb = per_buffer(per_impl, prefetch=2)
    try:
        filled(rb)
        for _ in range(4):
            sample = rb.sample()
            assert_sample_is_stored(rb, sample)
            sample.set("td_error", torch.rand(BATCH))
            rb.update_tensordict_priority(sample)
    finally:
        shutdown(rb)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"alpha": -1.0, "beta": BETA}, "alpha"), ({"alpha": ALPHA, "beta": -1.0}, "beta")],
)
def test_per_bad_exponents_raise_value_error(per_impl: Impl, kwargs: dict, match: str) -> None:
    cls = per_impl.cls("TensorDictPrioritizedReplayBuffer")
    with pytest.raises(ValueError, match=match):
        cls(storage=trl.LazyTensorStorage(CAPACITY), **kwargs)


def test_per_empty_buffer_sample_raises(per_impl: Impl) -> None:
    rb = per_buffer(per_impl)
    with pytest.raises(RuntimeError, match="empty storage"):
        rb.sample()
    assert len(rb) == 0


def test_per_ndim2_capacity_not_a_multiple_of_envs(per_impl: Impl) -> None:
    """``LazyTensorStorage(50, ndim=2)`` with 3 envs holds 51 slots: TorchRL carries on."""
    rb = per_buffer(per_impl, storage=trl.LazyTensorStorage(50, ndim=2), batch_size=12)
    data = episodes(13, [4, 5], columns=3)
    for _ in range(4):
        rb.extend(data[:, :9])
    assert len(rb) == 51
    assert_sample_is_stored(rb, rb.sample())


def test_per_mismatched_priority_length_raises_and_changes_nothing(per_impl: Impl) -> None:
    rb = per_buffer(per_impl)
    filled(rb)
    set_all_priorities(rb)
    rb.set_rng(torch.Generator().manual_seed(5))
    before = rb.sample()
    with pytest.raises(RuntimeError):  # what TorchRL raises, or a subclass
        rb.update_priority(torch.tensor([0, 1, 2]), torch.tensor([5.0, 5.0]))
    rb.set_rng(torch.Generator().manual_seed(5))
    assert_same_tensordict(rb.sample(), before)  # priorities unchanged: same draws


# --- sample(include_info=...): stored keys that share a name with the metadata --------------
#
# TorchRL writes the metadata (``index``, ``priority_weight``, a SliceSampler's truncation
# flags) over same-named stored entries unless ``include_info=False``, in which case the sample
# is exactly what the storage returned: stored ``index``/``("next", "done")`` kept, raw.

TERMINATED = ("next", "terminated")
PIN = [False, pytest.param(True, marks=requires_cuda)]


def shadowing_data(n: int = 19, *, prioritized: bool = False) -> TensorDict:
    """Episodes whose stored keys include ``index``, ``done``/``terminated`` and a weight."""
    data = episodes(n, [3, 4])
    data[TERMINATED] = data[DONE].clone()
    data["index"] = 1_000 + torch.arange(n)  # never a real slot: visibly not the metadata
    if prioritized:
        data["td_error"] = torch.arange(1, n + 1, dtype=torch.float)
    data["priority_weight"] = torch.full((n,), -1.0)
    return data


def deprecation(include_info: bool | None) -> Any:
    """TorchRL warns that ``include_info`` is deprecated whenever it is passed."""
    if include_info is None:
        return contextlib.nullcontext()
    return pytest.warns(UserWarning, match="include_info is going to be deprecated")


def check_include_info(
    rb: Any, include_info: bool | None, return_info: bool, *, prioritized: bool = False
) -> None:
    """Sample twice; every key and value is the stored one or the metadata, as TorchRL's."""
    rb.extend(shadowing_data(prioritized=prioritized))
    try:
        for _ in range(2):
            with deprecation(include_info):
                out = rb.sample(include_info=include_info, return_info=return_info)
            data, info = out if return_info else (out, None)
            if info is None:  # the metadata is needed to check values: same RNG, one more call
                with deprecation(include_info):
                    data, info = rb.sample(include_info=include_info, return_info=True)
            index = torch.stack(info["index"], -1) if isinstance(info["index"], tuple) else None
            index = info["index"] if index is None else index
            stored_rows = rb.storage[info["index"]].to(data.device)
            stored_keys = set(stored_rows.keys(True))
            want = stored_keys | ({*info} if include_info is not False else set())
            assert set(data.keys(True)) == want
            for key in data.keys(True, True):
                if include_info is not False and key in info:
                    value = index if key == "index" else torch.as_tensor(info[key])
                    expected = value.reshape(*value.shape, *[1] * (data[key].ndim - value.ndim))
                    expected = expected.expand_as(data[key]).to(data.device)
                else:
                    expected = stored_rows[key]
                assert torch.equal(data[key], expected), key
    finally:
        shutdown(rb)


@pytest.mark.parametrize("pin_memory", PIN)
@pytest.mark.parametrize("prefetch", [None, 2])
@pytest.mark.parametrize("return_info", [False, True])
@pytest.mark.parametrize("include_info", [True, False, None])
def test_include_info_random_sampler(
    impl: Impl, include_info: bool | None, return_info: bool, prefetch: Any, pin_memory: bool
) -> None:
    rb = buffer(impl, storage=trl.LazyTensorStorage(23), prefetch=prefetch, pin_memory=pin_memory)
    check_include_info(rb, include_info, return_info)


@pytest.mark.parametrize("pin_memory", PIN)
@pytest.mark.parametrize("prefetch", [None, 2])
@pytest.mark.parametrize("return_info", [False, True])
@pytest.mark.parametrize("include_info", [True, False, None])
@short_flat_batches
def test_include_info_slice_sampler(
    impl: Impl, include_info: bool | None, return_info: bool, prefetch: Any, pin_memory: bool
) -> None:
    """The sampler adds ``("next", "truncated" | "done" | "terminated")`` to the metadata."""
    sampler = impl.cls("SliceSampler")(num_slices=2, end_key=DONE, strict_length=False)
    rb = buffer(
        impl,
        storage=trl.LazyTensorStorage(23),
        sampler=sampler,
        batch_size=6,
        prefetch=prefetch,
        pin_memory=pin_memory,
    )
    check_include_info(rb, include_info, return_info)


@pytest.mark.parametrize("pin_memory", PIN)
@pytest.mark.parametrize("prefetch", [None, 2])
@pytest.mark.parametrize("return_info", [False, True])
@pytest.mark.parametrize("include_info", [True, False, None])
def test_per_include_info(
    per_impl: Impl, include_info: bool | None, return_info: bool, prefetch: Any, pin_memory: bool
) -> None:
    """``priority_weight`` and ``index`` are metadata; stored entries of those names too."""
    rb = per_buffer(
        per_impl, storage=trl.LazyTensorStorage(23), prefetch=prefetch, pin_memory=pin_memory
    )
    check_include_info(rb, include_info, return_info, prioritized=True)


@pytest.mark.parametrize("include_info", [None, False])
@short_flat_batches
@pytest.mark.skipif(
    not CHECKPOINTS_KEEP_PREFETCHED,
    reason=f"TorchRL {TORCHRL_VERSION}'s checkpoints do not carry prefetched samples",
)
def test_prefetched_samples_in_a_checkpoint_load_into_either_library(
    impl: Impl, include_info: bool | None
) -> None:
    """A ``state_dict`` taken with samples queued restores them in TorchRL and in fastreplay."""

    def make(side: Impl) -> Any:
        sampler = side.cls("SliceSampler")(num_slices=1, end_key=DONE, strict_length=False)
        return buffer(side, storage=trl.LazyTensorStorage(23), sampler=sampler, prefetch=2)

    rb = make(impl)
    rb.extend(shadowing_data())
    rb.sample()  # fills the prefetch queue
    state = rb.state_dict()
    with deprecation(include_info):
        expected = rb.sample(include_info=include_info)  # the first queued sample
    shutdown(rb)
    for side in map(Impl, ("torchrl", "fastreplay")):
        restored = make(side)
        restored.load_state_dict(state)
        try:
            with deprecation(include_info):
                sample = restored.sample(include_info=include_info)
        finally:
            shutdown(restored)
        assert set(sample.keys(True)) == set(expected.keys(True)), side
        assert_same_tensordict(sample, expected)

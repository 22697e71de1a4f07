"""fastreplay's storages (``fastreplay.storages``) against TorchRL's classes of the same names.

``get`` must return what TorchRL's ``get`` returns (values, dtypes, devices, batch size, keys and
their order, tensor types, shared/memmap/lock flags, or the same error) for every index, whether
it takes the row gather or TorchRL's code; everything else is TorchRL's (constructor, state dict,
checkpoints, pickling, repr); TorchRL's buffers sample the same with either class; the buffers'
direct path takes fastreplay's classes as TorchRL's.
"""

from __future__ import annotations

import inspect
import pickle
import warnings
from typing import Any

import numpy as np
import pytest
import torch
import torchrl.data as trl
from tensordict import (
    MemoryMappedTensor,
    NonTensorData,
    TensorDict,
    is_non_tensor,
    is_tensor_collection,
)
from torchrl.envs.transforms import Compose, ExcludeTransform

import fastreplay
from conftest import TORCHRL_EXT
from fastreplay import _torchrl, storages
from fastreplay._torchrl import STORAGE_HAS_REVISION

NAMES = ("TensorStorage", "LazyTensorStorage", "LazyMemmapStorage")


def rows(n: int, seed: int, *, nested: bool = True) -> TensorDict:
    gen = torch.Generator().manual_seed(seed)
    data: dict[Any, torch.Tensor] = {
        "obs": torch.randn(n, 3, generator=gen),
        "action": torch.randint(5, (n,), generator=gen, dtype=torch.int32),
        "flag": torch.rand(n, 1, generator=gen) < 0.5,
    }
    if nested:
        data[("next", "obs")] = torch.randn(n, 3, generator=gen).double()
        data[("next", "deep", "reward")] = torch.randn(n, 2, 2, generator=gen)
    return TensorDict(data, batch_size=[n])


def build(name: str, side: str, capacity: int, tmp_path: Any = None, **kwargs: Any) -> Any:
    """``side``'s (``"torchrl"`` / ``"fastreplay"``) storage of class ``name``."""
    module = trl if side == "torchrl" else fastreplay
    cls = getattr(module, name)
    if name == "TensorStorage":
        prebuilt = rows(capacity, 99)
        return cls(prebuilt, **kwargs)
    if name == "LazyMemmapStorage" and tmp_path is not None:
        kwargs.setdefault("scratch_dir", tmp_path / side)
        kwargs.setdefault("existsok", True)
    return cls(capacity, **kwargs)


def same(a: Any, b: Any) -> None:
    """``a`` is ``b`` as far as a caller can tell (recursively for tensor collections)."""
    assert type(a) is type(b), (type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and a.device == b.device
        assert a.is_contiguous() == b.is_contiguous()
        if a.device.type != "meta":
            assert torch.equal(a, b)
        return
    if isinstance(a, NonTensorData):
        assert a.data == b.data
        return
    if is_non_tensor(a):
        assert a.batch_size == b.batch_size and a.device == b.device
        assert a.tolist() == b.tolist()
        return
    if is_tensor_collection(a):
        assert a.batch_size == b.batch_size and a.device == b.device
        assert list(a.keys()) == list(b.keys())
        assert a.names == b.names
        assert (a.is_shared(), a.is_memmap(), a.is_locked) == (
            b.is_shared(),
            b.is_memmap(),
            b.is_locked,
        )
        for key in a.keys():  # noqa: SIM118 (a TensorDict)
            same(a.get(key), b.get(key))
        return
    if isinstance(a, dict):
        assert list(a) == list(b)
        for key in a:
            same(a[key], b[key])
        return
    assert a == b


def both(name: str, capacity: int, tmp_path: Any, **kwargs: Any) -> tuple[Any, Any]:
    return (
        build(name, "torchrl", capacity, tmp_path, **kwargs),
        build(name, "fastreplay", capacity, tmp_path, **kwargs),
    )


def write(pair: tuple[Any, ...], steps: list[int], capacity: int, cursor: int = 0) -> int:
    """Writes of ``steps`` rows each from ``cursor``, wrapping around ``capacity``, the same on
    every storage of ``pair`` (as TorchRL's round-robin writer); returns the next cursor."""
    for step, n in enumerate(steps):
        index = (torch.arange(n) + cursor) % capacity
        cursor = (cursor + n) % capacity
        for storage in pair:
            storage.set(index, rows(n, step + cursor))
    return cursor


def get_or_error(storage: Any, index: Any) -> Any:
    try:
        return storage.get(index)
    except Exception as err:  # the same error on both sides
        return ("error", type(err), str(err))


# --------------------------------------------------------------------------- get


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("capacity", [1, 7, 13])
def test_get_matches_torchrl_for_random_indices_and_wrap_around(
    name: str, capacity: int, tmp_path: Any
) -> None:
    pair = both(name, capacity, tmp_path)
    gen = torch.Generator().manual_seed(capacity)
    cursor = 0
    for steps in ([1], [3, 2], [capacity, 1, 5, 2]):
        if name != "TensorStorage":
            cursor = write(pair, [min(n, capacity) for n in steps], capacity, cursor)
        filled = len(pair[0])
        assert len(pair[1]) == filled
        for dtype in (torch.long, torch.int32):
            for n in (1, 5, 256):
                index = torch.randint(filled, (n,), generator=gen, dtype=dtype)
                same(*(storage.get(index) for storage in pair))
                same(*(storage[index] for storage in pair))


@pytest.mark.parametrize("name", NAMES)
def test_gather_is_taken_for_plain_reads_only(
    name: str, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = []
    gather = storages.gather_rows

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return gather(*args, **kwargs)

    monkeypatch.setattr(storages, "gather_rows", counted)
    pair = both(name, 9, tmp_path)
    if name != "TensorStorage":
        write(pair, [4], 9)
    pair[1].get(torch.tensor([0, 3]))
    assert len(calls) == 1
    for index in (2, slice(0, 2), [0, 1], torch.tensor(1), torch.tensor([[0, 1]])):
        same(*(get_or_error(storage, index) for storage in pair))
    assert len(calls) == 1


@pytest.mark.parametrize("name", NAMES)
def test_other_indices_fall_back_with_torchrl_results_and_errors(name: str, tmp_path: Any) -> None:
    pair = both(name, 9, tmp_path)
    if name != "TensorStorage":
        write(pair, [5], 9)
    filled = len(pair[0])
    indices = [
        torch.tensor([filled - 1, -1, 0]),  # negative: TorchRL's indexing wraps it
        torch.tensor([-filled - 1]),  # out of range below
        torch.tensor([filled]),  # past the filled rows
        torch.tensor([100]),
        torch.tensor([], dtype=torch.long),
        torch.tensor([0, 1], dtype=torch.int16),
        torch.tensor([True, False] * (filled // 2) + [True] * (filled % 2)),
        torch.tensor([0.0, 1.0]),
        3,
        -1,
        slice(1, 4),
        slice(None),
        [0, 2],
        (torch.tensor([0, 1]),),
        torch.tensor(2),
        torch.tensor([[0, 1], [2, 3]]),
        ...,
    ]
    for index in indices:
        same(*(get_or_error(storage, index) for storage in pair))


def test_full_storage_reads_every_row(tmp_path: Any) -> None:
    pair = both("LazyTensorStorage", 5, tmp_path)
    write(pair, [5, 3], 5)
    index = torch.tensor([4, 0, 3])
    same(*(storage.get(index) for storage in pair))


def test_ndim_2_storage_is_torchrl_get(tmp_path: Any) -> None:
    pair = both("LazyTensorStorage", 12, tmp_path, ndim=2)
    data = TensorDict(obs=torch.randn(3, 4, 2), batch_size=[3, 4])
    for storage in pair:
        storage.set(torch.arange(3), data)
    for index in (
        (torch.tensor([0, 2]), torch.tensor([1, 3])),
        torch.tensor([0, 2]),
        torch.tensor([1]),
    ):
        same(*(get_or_error(storage, index) for storage in pair))


def test_memmap_output_is_plain_tensors(tmp_path: Any) -> None:
    pair = both("LazyMemmapStorage", 9, tmp_path)
    write(pair, [6], 9)
    assert isinstance(pair[1]._storage["obs"], MemoryMappedTensor)
    ours = pair[1].get(torch.tensor([5, 1]))
    same(pair[0].get(torch.tensor([5, 1])), ours)
    assert type(ours["obs"]) is torch.Tensor


def test_shared_storage_flags(tmp_path: Any) -> None:
    pair = both("LazyTensorStorage", 9, tmp_path)
    write(pair, [6], 9)
    for storage in pair:
        storage._storage.share_memory_()
    same(*(storage.get(torch.tensor([5, 1, 1])) for storage in pair))


def test_non_tensor_data_and_names_are_torchrl_get(tmp_path: Any) -> None:
    pair = both("LazyTensorStorage", 9, tmp_path)
    data = TensorDict(obs=torch.randn(4, 2), batch_size=[4])
    data["label"] = NonTensorData("x", batch_size=[4])
    for storage in pair:
        storage.set(torch.arange(4), data)
    same(*(get_or_error(storage, torch.tensor([3, 0])) for storage in pair))
    named = [
        trl.TensorStorage(TensorDict(obs=torch.randn(4, 2), batch_size=[4], names=["n"])),
        fastreplay.TensorStorage(TensorDict(obs=torch.randn(4, 2), batch_size=[4], names=["n"])),
    ]
    named[1]._storage["obs"].copy_(named[0]._storage["obs"])
    same(*(storage.get(torch.tensor([3, 0])) for storage in named))


def test_meta_device_storage_is_torchrl_get(tmp_path: Any) -> None:
    """``meta`` stands in for an accelerator: TorchRL's ``get`` there."""
    pair = both("LazyTensorStorage", 9, tmp_path, device="meta")
    for storage in pair:
        storage.set(torch.arange(4), TensorDict(obs=torch.randn(4, 2), batch_size=[4]))
    index = torch.tensor([3, 0], device="meta")
    same(*(storage.get(index) for storage in pair))


def test_uninitialised_storage_raises_as_torchrl(tmp_path: Any) -> None:
    pair = both("LazyTensorStorage", 9, tmp_path)
    same(*(get_or_error(storage, torch.tensor([0])) for storage in pair))


def test_compilable_storage_and_compiled_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    """A compilable storage read eagerly is gathered (the same rows); a read traced by
    ``torch.compile`` is TorchRL's ``get``."""
    storage = fastreplay.LazyTensorStorage(9, compilable=True)
    reference = trl.LazyTensorStorage(9, compilable=True)
    write((storage, reference), [4], 9)
    index = torch.tensor([1, 2])
    same(reference.get(index), storage.get(index))
    calls = []
    monkeypatch.setattr(storages, "gather_rows", lambda *a, **k: calls.append(1))
    monkeypatch.setattr(_torchrl, "_is_compiling", lambda: True)
    same(reference.get(index), storage.get(index))
    assert not calls


# --------------------------------------------------------------------------- the classes


@pytest.mark.parametrize("name", NAMES)
def test_subclasses_with_torchrl_constructor(name: str) -> None:
    ours, theirs = getattr(fastreplay, name), getattr(trl, name)
    assert issubclass(ours, theirs)
    assert ours.__module__ == "fastreplay.storages"
    assert inspect.signature(ours) == inspect.signature(theirs)
    assert name in fastreplay.__all__
    # TorchRL's hierarchy, mirrored
    for other in NAMES:
        assert issubclass(ours, getattr(fastreplay, other)) == issubclass(
            theirs, getattr(trl, other)
        )


@pytest.mark.parametrize("name", NAMES)
def test_repr_state_dict_and_pickle_are_torchrl(name: str, tmp_path: Any) -> None:
    ours, theirs = both(name, 7, tmp_path)
    if name != "TensorStorage":
        write((ours, theirs), [7], 7)  # (the state dict holds every row)
    if name != "LazyMemmapStorage":  # (the repr names the scratch files)
        assert repr(ours) == repr(theirs)
    mine, reference = ours.state_dict(), theirs.state_dict()
    assert mine.keys() == reference.keys()
    same(mine["_storage"], reference["_storage"])
    copy = pickle.loads(pickle.dumps(ours))
    assert type(copy) is type(ours)
    index = torch.tensor([4, 0])
    same(copy.get(index), theirs.get(index))


@pytest.mark.parametrize("name", ["LazyTensorStorage", "LazyMemmapStorage"])
@pytest.mark.parametrize("direction", ["torchrl->fastreplay", "fastreplay->torchrl"])
def test_checkpoints_round_trip_between_the_classes(
    name: str, direction: str, tmp_path: Any
) -> None:
    source_side, target_side = direction.split("->")
    source = build(name, source_side, 9, tmp_path / "a")
    write((source,), [6, 5], 9)  # wraps around
    index = torch.tensor([8, 0, 3])
    # into a storage already written (TorchRL's preferred way): the source's rows
    target = build(name, target_side, 9, tmp_path / "b")
    write((target,), [2], 9)
    target.load_state_dict(source.state_dict())
    same(source.get(index), target.get(index))
    assert len(source) == len(target)
    # into new storages: what TorchRL's class loads (it warns; the device is not restored)
    loaded = []
    for side in ("torchrl", target_side):
        fresh = build(name, side, 9, tmp_path / f"c{side}")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (TorchRL's, for an uninitialised storage)
            fresh.load_state_dict(source.state_dict())
        loaded.append(fresh)
    same(*(storage.get(index) for storage in loaded))
    # buffers' dumps/loads: the target side loads what TorchRL's class loads
    source_rb = trl.TensorDictReplayBuffer(storage=build(name, source_side, 9, tmp_path / "d"))
    source_rb.extend(rows(7, 1))
    source_rb.dumps(tmp_path / "dump")
    loaded = []
    for side in ("torchrl", target_side):
        rb = trl.TensorDictReplayBuffer(storage=build(name, side, 9, tmp_path / f"e{side}"))
        rb.loads(tmp_path / "dump")
        loaded.append(rb)
    index = torch.tensor([6, 0, 3])
    same(*(rb.storage.get(index) for rb in loaded))
    expected = source_rb.storage.get(index)
    for key in expected.keys(True, True):
        assert torch.equal(loaded[1].storage.get(index).get(key), expected.get(key))


# --------------------------------------------------------------------------- in buffers


def _per(capacity: int) -> Any:
    return fastreplay.PrioritizedSampler(capacity, 0.7, 0.5)


SAMPLERS = {
    "fastreplay PER": _per,
    "torchrl PER": lambda capacity: trl.PrioritizedSampler(capacity, 0.7, 0.5),
    "uniform": lambda capacity: trl.RandomSampler(),
    "slice": lambda capacity: trl.SliceSampler(
        num_slices=2, traj_key="episode", strict_length=False
    ),
}


@pytest.mark.parametrize("sampler", list(SAMPLERS))
@pytest.mark.parametrize("buffer", ["torchrl", "fastreplay + transform"])
def test_buffers_sample_the_same_with_either_storage(sampler: str, buffer: str) -> None:
    if sampler == "torchrl PER" and not TORCHRL_EXT:
        pytest.skip("TorchRL's compiled extension (its PrioritizedSampler's trees) does not load")
    samples = []
    for side in ("torchrl", "fastreplay"):
        capacity = 23
        kwargs: dict[str, Any] = {
            "storage": (trl if side == "torchrl" else fastreplay).LazyTensorStorage(capacity),
            "sampler": SAMPLERS[sampler](capacity),
            "batch_size": 8,
        }
        if buffer == "torchrl":
            rb = trl.TensorDictReplayBuffer(**kwargs)
        else:
            rb = fastreplay.TensorDictReplayBuffer(
                transform=Compose(ExcludeTransform("flag")), **kwargs
            )
        torch.manual_seed(0)
        np.random.seed(0)  # (the priority samplers draw from it)
        drawn = []
        for step in range(6):
            data = rows(9, step)
            data["episode"] = torch.full((9,), step)
            rb.extend(data)
            sample = rb.sample()
            drawn.append(sample)
            if "PER" in sampler:
                rb.update_priority(sample["index"], torch.arange(8.0) + 1 + step)
        samples.append(drawn)
    for ours, theirs in zip(samples[1], samples[0], strict=True):
        same(ours, theirs)


def test_direct_path_takes_fastreplay_storages() -> None:
    for name in NAMES:
        assert getattr(fastreplay, name) in _torchrl.TENSOR_STORAGES
    rb = fastreplay.TensorDictReplayBuffer(
        storage=fastreplay.LazyTensorStorage(9), sampler=_per(9), batch_size=4
    )
    rb.extend(rows(5, 0))
    rb.extend(rows(3, 1))
    plain = _torchrl.plain_storage(rb, False)
    assert (plain is rb.storage) == STORAGE_HAS_REVISION
    assert fastreplay.LazyTensorStorage in _torchrl.LAZY_TENSOR_STORAGES


def test_benchmark_script_runs_and_checks_both_sides_agree() -> None:
    """``benchmarks/storage_get.py`` at a small size: every case's sides sample the same."""
    from benchmarks import storage_get

    results = storage_get.main(
        ["--stored", "1000", "--batch", "16", "--rounds", "1", "--calls", "2"]
    )
    assert len(results) == 4 and all(a > 0 and b > 0 for a, b in results.values())

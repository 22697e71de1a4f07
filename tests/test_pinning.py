"""fastreplay's TensorDict buffers: pinned samples (``pin_memory``, ``device``).

Without CUDA, the pinning step is observed instead of run: ``fake_pinning`` pretends an
accelerator exists and replaces the one pinning hook with "clone and remember the clone's
storage"; a leaf counts as pinned only if its storage came out of that hook. Every check then
walks the returned sample independently of fastreplay's code, so a metadata key or a transform
output that escapes pinning fails the test. The same checks with real ``is_pinned()`` run under
``requires_cuda``.
"""

from __future__ import annotations

import importlib
import threading
import warnings
from collections import namedtuple
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch
import torchrl.data.replay_buffers.utils as torchrl_rb_utils
from tensordict import NonTensorData, TensorDict, is_tensor_collection
from torchrl.data import LazyTensorStorage, ListStorage
from torchrl.data import PrioritizedSampler as TorchRLPrioritizedSampler
from torchrl.data import SliceSampler as TorchRLSliceSampler
from torchrl.data import TensorDictPrioritizedReplayBuffer as TorchRLPrioritizedBuffer
from torchrl.data import TensorDictReplayBuffer as TorchRLBuffer

import fastreplay
from conftest import TORCHRL_EXT, assert_same_tensordict, requires_cuda, shutdown, synchronize
from fastreplay import (
    PrioritizedSampler,
    SliceSampler,
    TensorDictPrioritizedReplayBuffer,
    TensorDictReplayBuffer,
)
from fastreplay._torchrl import STORAGE_HAS_REVISION, TORCHRL_VERSION
from fastreplay.buffers import pinning as _pinning

N_TRAJ, TRAJ_LEN = 7, 9  # 63 items in a capacity-50 storage: wraps around
CAPACITY = 50


# ----------------------------------------------------------------------------- helpers


def make_data(n_traj: int = N_TRAJ, traj_len: int = TRAJ_LEN) -> TensorDict:
    """``obs = traj * 10_000 + step``: every value says where it came from."""
    traj = torch.arange(n_traj).repeat_interleave(traj_len)
    step = torch.arange(traj_len).repeat(n_traj)
    n = traj.numel()
    gen = torch.Generator().manual_seed(0)
    return TensorDict(
        obs=traj * 10_000 + step,
        traj=traj,
        pixels=torch.randint(0, 255, (n, 3, 4, 4), dtype=torch.uint8, generator=gen),
        reward=torch.rand(n, generator=gen),
        nested=TensorDict(value=(traj * 10_000 + step).float()[:, None], batch_size=[n]),
        batch_size=[n],
    )


def device_none_transform(td: TensorDict) -> TensorDict:
    """A transform returning a brand-new TensorDict with ``device=None``, nested keys and
    non-tensor data (the case torchrl 0.14.1 leaves unpinned)."""
    out = TensorDict(
        obs=td["obs"],
        traj=td["traj"],
        twice=td["obs"] * 2,
        deep=TensorDict(
            inner=TensorDict(scaled=td["nested", "value"] / 10, batch_size=td.batch_size),
            batch_size=td.batch_size,
        ),
        batch_size=td.batch_size,
        device=None,
    )
    out.set("tag", NonTensorData("kept", batch_size=td.batch_size))
    return out


def tensor_leaves(obj: Any, path: tuple = ()) -> Iterator[tuple[tuple, torch.Tensor]]:
    """Every tensor leaf of a sample or of ``info``, found without fastreplay's code."""
    if is_tensor_collection(obj):
        for key in obj.keys(include_nested=True, leaves_only=True):
            value = obj.get(key)
            if isinstance(value, torch.Tensor) and not is_tensor_collection(value):
                yield (*path, key), value
    elif isinstance(obj, torch.Tensor):
        yield path, obj
    elif isinstance(obj, dict):
        for key, value in obj.items():
            yield from tensor_leaves(value, (*path, key))
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            yield from tensor_leaves(value, (*path, i))


def unpinned(obj: Any, is_pinned: Callable[[torch.Tensor], bool]) -> list[tuple]:
    """Paths of host tensors that are not pinned."""
    return [p for p, t in tensor_leaves(obj) if t.device.type == "cpu" and not is_pinned(t)]


class FakePinning:
    """Stands in for an accelerator: pinning = clone + remember the clone's storage."""

    def __init__(self) -> None:
        self._storages: set[int] = set()
        self._keep: list[torch.Tensor] = []  # keeps storages alive, so pointers are not reused
        self.threads: list[threading.Thread] = []
        self.allocated: list[threading.Thread] = []  # pinned_empty calls
        self.allocated_storages: set[int] = set()
        self.lock = threading.Lock()

    def pin(self, tensor: torch.Tensor) -> torch.Tensor:
        copy = tensor.clone()
        with self.lock:
            self._keep.append(copy)
            self._storages.add(copy.untyped_storage().data_ptr())
            self.threads.append(threading.current_thread())
        return copy

    def empty(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """A "pinned" allocation for a gather to write into: remembered like a pinned copy."""
        out = torch.empty(shape, dtype=dtype)
        with self.lock:
            self._keep.append(out)
            self._storages.add(out.untyped_storage().data_ptr())
            self.allocated.append(threading.current_thread())
            self.allocated_storages.add(out.untyped_storage().data_ptr())
        return out

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        # Pinned-ness belongs to the storage: views (expand, index) of a pinned tensor count.
        return tensor.numel() > 0 and tensor.untyped_storage().data_ptr() in self._storages

    @property
    def calls(self) -> int:
        return len(self.threads)


@pytest.fixture
def fake_pinning(monkeypatch: pytest.MonkeyPatch) -> FakePinning:
    fake = FakePinning()
    monkeypatch.setattr(_pinning, "pinning_available", lambda: True)
    monkeypatch.setattr(_pinning, "_pin_tensor", fake.pin)
    monkeypatch.setattr(_pinning, "_is_pinned", fake.is_pinned)
    monkeypatch.setattr(_pinning, "_pinned_empty", fake.empty)
    return fake


@pytest.fixture
def no_accelerator(monkeypatch: pytest.MonkeyPatch) -> None:
    def must_not_pin(tensor: torch.Tensor) -> torch.Tensor:
        raise AssertionError("pinning attempted without an accelerator")

    monkeypatch.setattr(_pinning, "pinning_available", lambda: False)
    monkeypatch.setattr(_pinning, "_pin_tensor", must_not_pin)
    monkeypatch.setattr(_pinning, "_pinned_empty", must_not_pin)


def _requires_ext() -> None:
    if not TORCHRL_EXT:
        pytest.skip("TorchRL's PrioritizedSampler needs its compiled extension (absent here)")


def make_sampler(kind: str) -> Any:
    if kind == "random":
        return None
    if kind == "torchrl-slice":
        return TorchRLSliceSampler(slice_len=3, traj_key="traj")
    if kind == "torchrl-prioritized":
        _requires_ext()
        return TorchRLPrioritizedSampler(CAPACITY, alpha=0.7, beta=0.5)
    if kind == "fastreplay-slice":
        return SliceSampler(slice_len=3, traj_key="traj")
    if kind == "fastreplay-prioritized":
        return PrioritizedSampler(CAPACITY, alpha=0.7, beta=0.5)
    raise AssertionError(kind)


SAMPLERS = [
    "random",
    "torchrl-slice",
    "torchrl-prioritized",
    "fastreplay-slice",
    "fastreplay-prioritized",
]
EXPECTED_METADATA = {
    "random": {"index"},
    "torchrl-slice": {"index", ("next", "truncated"), ("next", "done"), ("next", "terminated")},
    "torchrl-prioritized": {"index", "priority_weight"},
    "fastreplay-slice": {"index", ("next", "truncated"), ("next", "done"), ("next", "terminated")},
    "fastreplay-prioritized": {"index", "priority_weight"},
}


def make_buffer(cls: type, kind: str, chunks: list | None = None, **kwargs: Any) -> Any:
    kwargs.setdefault("storage", LazyTensorStorage(CAPACITY))
    kwargs.setdefault("batch_size", 12)
    rb = cls(sampler=make_sampler(kind), **kwargs)
    if chunks is None:
        # Two writes: wrap-around without duplicate indices inside one write (whose winner is
        # unspecified in torch's index_put).
        data = make_data()
        chunks = [data[:32], data[32:]]
    for chunk in chunks:
        rb.extend(chunk)
    return rb


def generator(value: int) -> torch.Generator:
    """A buffer's own generator: samples do not depend on other draws of the global RNG."""
    return torch.Generator().manual_seed(value)


def device_generator(value: int, kind: str, storage_device: str) -> torch.Generator:
    """The generator a TorchRL user passes for sampler ``kind`` on a ``storage_device`` storage.

    The uniform and slice samplers draw on the storage's device (TorchRL's refuse a generator
    of another device: "Expected a 'cuda' device type for generator but found 'cpu'"); the
    prioritized samplers draw on the host, next to their trees.
    """
    device = "cpu" if "prioritized" in kind else storage_device
    return torch.Generator(device=device).manual_seed(value)


def assert_slices_consistent(sample: TensorDict) -> None:
    """Built-in invariant: ``obs`` encodes (trajectory, step); values never get mixed up."""
    obs = sample["obs"].cpu()
    torch.testing.assert_close(obs // 10_000, sample["traj"].cpu())
    assert bool(((obs % 10_000) < TRAJ_LEN).all())


# ----------------------------------------------------------------------------- pin_tree core


def test_pin_tree_pins_each_host_leaf_once_and_leaves_the_rest(fake_pinning: FakePinning):
    already = fake_pinning.pin(torch.arange(3))
    fake_pinning.threads.clear()
    shared = torch.ones(4)
    on_device = torch.empty(4, device="meta")  # stands in for an accelerator tensor
    td = TensorDict(
        a=shared,
        b=shared,
        pinned=torch.zeros(4),
        nested=TensorDict(x=torch.zeros(4, 2), dev=on_device, batch_size=[4]),
        batch_size=[4],
        device=None,
    )
    td.set("note", NonTensorData("text", batch_size=[4]))
    td.set("pinned", already.new_zeros(4))  # fresh
    before = {k: v for k, v in td.items(True, True)}
    tree = {"data": td, "index": (already, torch.arange(4)), "count": 3}

    out = _pinning.pin_tree(tree)

    assert unpinned(out, fake_pinning.is_pinned) == []
    assert out["index"][0] is already  # already pinned: not copied again
    assert out["data"]["nested", "dev"] is on_device  # accelerator tensor: left where it is
    assert out["data"]["a"] is out["data"]["b"]  # the same tensor is pinned once
    assert out["data"].get_non_tensor("note") == "text"
    assert out["count"] == 3
    assert out["data"].device is None and out["data"].batch_size == torch.Size([4])
    # 4 host leaves needed pinning: shared (once), pinned, nested.x, index[1].
    assert fake_pinning.calls == 4
    # The input is not modified.
    assert all(td.get(k) is v for k, v in before.items())
    assert not fake_pinning.is_pinned(tree["index"][1])


def test_pin_tree_rebuilds_namedtuples_and_returns_untouched_trees(fake_pinning: FakePinning):
    pair = namedtuple("pair", ["first", "second"])
    out = _pinning.pin_tree(pair(torch.zeros(2), [torch.ones(1), "x"]))
    assert isinstance(out, pair) and out.second[1] == "x"
    assert unpinned(out, fake_pinning.is_pinned) == []
    nothing = {"a": 1, "b": [torch.empty(2, device="meta")]}
    assert _pinning.pin_tree(nothing) is nothing


def test_leaves_to_pin_names_every_path(fake_pinning: FakePinning):
    td = TensorDict(
        a=torch.zeros(2), n=TensorDict(b=torch.zeros(2), batch_size=[2]), batch_size=[2]
    )
    info = {"index": (torch.arange(2),), ("next", "done"): torch.zeros(2, dtype=torch.bool)}
    paths = [p for p, _ in _pinning.leaves_to_pin((td, info))]
    assert paths == [(0, "a"), (0, ("n", "b")), (1, "index", 0), (1, ("next", "done"))]


def test_move_tree_copies_without_blocking(monkeypatch: pytest.MonkeyPatch):
    seen = []
    original = torch.Tensor.to

    def spy(self, *args, **kwargs):
        seen.append(kwargs.get("non_blocking"))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", spy)
    # "meta" stands in for an accelerator: host-to-device copies are queued, not waited for.
    tree = {"a": torch.zeros(2), "b": (torch.ones(1),)}
    out = _pinning.move_tree(tree, torch.device("meta"))
    assert seen == [True, True] and out["b"][0].device.type == "meta"
    # To the host (from a storage on an accelerator): a non-blocking copy would hand back a
    # tensor before its data arrived, so these copies block.
    seen.clear()
    out = _pinning.move_tree(tree, torch.device("cpu"))
    assert seen == [False, False] and out["b"][0].device.type == "cpu"
    td = TensorDict(a=torch.zeros(2), batch_size=[2])
    moved = _pinning.move_tree(td, torch.device("cpu"))
    assert moved.device == torch.device("cpu")


# ----------------------------------------------------------------------------- buffers


@pytest.mark.parametrize("kind", SAMPLERS)
@pytest.mark.parametrize("mode", ["sample", "return_info", "prefetch", "transform", "ndim2"])
def test_every_leaf_reaches_pinning(fake_pinning: FakePinning, kind: str, mode: str):
    kwargs: dict[str, Any] = {"pin_memory": True}
    if mode == "prefetch":
        kwargs["prefetch"] = 2
    if mode in ("transform", "prefetch"):
        kwargs["transform"] = device_none_transform
    chunks = None
    if mode == "ndim2":
        if "prioritized" in kind:
            pytest.skip("TorchRL's PrioritizedSampler does not support ndim=2 storages")
        kwargs["storage"] = LazyTensorStorage(CAPACITY, ndim=2)
        data = make_data().reshape(N_TRAJ, TRAJ_LEN)  # [env, time]: storage shape [7, 7]
        chunks = [data[:, :5], data[:, 5:]]  # wraps around in time
    rb = make_buffer(TensorDictReplayBuffer, kind, chunks, **kwargs)
    try:
        for _ in range(4):
            data, info = rb.sample(return_info=True)
            got = data if mode != "return_info" else (data, info)
            assert unpinned(got, fake_pinning.is_pinned) == [], mode
            assert unpinned(info, fake_pinning.is_pinned) == []
            assert EXPECTED_METADATA[kind] <= set(data.keys(True, True))
            if mode != "ndim2":
                assert_slices_consistent(data)
            if "transform" in kwargs:
                assert data.get_non_tensor("tag") == "kept"
                assert ("deep", "inner", "scaled") in data.keys(True, True)
            plain = rb.sample()
            assert unpinned(plain, fake_pinning.is_pinned) == []
            # The stage that runs in the prefetch thread already returns everything pinned
            # (the caller-thread pass in ``sample`` is only a safety net).
            assert unpinned(rb._sample(12), fake_pinning.is_pinned) == []
    finally:
        shutdown(rb)


def test_the_check_catches_torchrl_pinning_too_early(
    fake_pinning: FakePinning, monkeypatch: pytest.MonkeyPatch
):
    """Negative control: TorchRL's own order (pin, then add metadata) fails the same check."""

    def torchrl_pin(output: Any) -> Any:  # torchrl.data.replay_buffers.utils._pin_memory
        if hasattr(output, "pin_memory") and output.device == torch.device("cpu"):
            return _pinning.pin_tree(output)
        return output

    monkeypatch.setattr(torchrl_rb_utils, "_pin_memory", torchrl_pin)
    rb = make_buffer(TorchRLBuffer, "torchrl-slice", pin_memory=True)
    escaped = unpinned(rb.sample(), fake_pinning.is_pinned)
    assert ("index",) in escaped and (("next", "truncated"),) in escaped
    assert ("obs",) not in escaped  # the data itself was pinned

    rb = make_buffer(TorchRLBuffer, "random", pin_memory=True, transform=device_none_transform)
    escaped = unpinned(rb.sample(), fake_pinning.is_pinned)
    assert {("obs",), ("twice",), (("deep", "inner", "scaled"),), ("index",)} <= set(escaped)


def test_pinning_happens_in_the_prefetch_thread(fake_pinning: FakePinning):
    rb = make_buffer(
        TensorDictReplayBuffer,
        "torchrl-slice",
        pin_memory=True,
        prefetch=3,
        transform=device_none_transform,
    )
    try:
        rb.sample()  # empty queue: this one is built in the caller's thread
        synchronize(rb)
        fake_pinning.threads.clear()
        for _ in range(5):
            data = rb.sample()
            assert unpinned(data, fake_pinning.is_pinned) == []
        synchronize(rb)
        assert fake_pinning.calls > 0
        assert threading.main_thread() not in fake_pinning.threads
    finally:
        shutdown(rb)


@pytest.mark.parametrize("kind", ["random", "torchrl-slice", "torchrl-prioritized"])
@pytest.mark.parametrize("pinning", [False, True])
def test_samples_equal_torchrl(kind: str, pinning: bool, request: pytest.FixtureRequest):
    """Same seed, same workload: the same values as TorchRL's buffer without pinning."""
    if pinning:
        request.getfixturevalue("fake_pinning")
    ours = make_buffer(TensorDictReplayBuffer, kind, pin_memory=pinning, generator=generator(1))
    got = [ours.sample(return_info=True) for _ in range(3)]
    ref = make_buffer(TorchRLBuffer, kind, generator=generator(1))
    want = [ref.sample(return_info=True) for _ in range(3)]
    for (data, info), (ref_data, ref_info) in zip(got, want, strict=True):
        assert_same_tensordict(data, ref_data)
        assert set(info) == set(ref_info)
        for (_, a), (_, b) in zip(tensor_leaves(info), tensor_leaves(ref_info), strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("prefetch", [None, 2])
def test_prioritized_buffer_pins_weights_and_matches_torchrl(
    fake_pinning: FakePinning, prefetch: int | None, monkeypatch: pytest.MonkeyPatch
):
    # Reference: TorchRL's own buffer class driving the same sampler class (TorchRL builds its
    # sampler by module-level name), so only the pinning differs.
    # The module that defines it (a package module from TorchRL 0.14 on, one module on 0.13).
    torchrl_tdprb = importlib.import_module(TorchRLPrioritizedBuffer.__init__.__module__)

    monkeypatch.setattr(torchrl_tdprb, "PrioritizedSampler", fastreplay.PrioritizedSampler)
    kwargs = {"alpha": 0.7, "beta": 0.5, "batch_size": 12}
    ours = TensorDictPrioritizedReplayBuffer(
        storage=LazyTensorStorage(CAPACITY),
        pin_memory=True,
        prefetch=prefetch,
        generator=generator(2),
        **kwargs,
    )
    ref = TorchRLPrioritizedBuffer(
        storage=LazyTensorStorage(CAPACITY), generator=generator(2), **kwargs
    )
    assert type(ours.prioritized_sampler) is fastreplay.PrioritizedSampler
    assert type(ref.prioritized_sampler) is fastreplay.PrioritizedSampler
    for rb in (ours, ref):
        rb.extend(make_data()[:32])
        rb.extend(make_data()[32:])
    try:
        for _ in range(3):
            data, info = ours.sample(return_info=True)
            assert unpinned((data, info), fake_pinning.is_pinned) == []
            assert {"index", "priority_weight"} <= set(data.keys())
            priority = (data["obs"] % 7 + 1).float()
            if prefetch is None:
                ref_data = ref.sample()
                assert_same_tensordict(data, ref_data)
                ref.update_priority(ref_data["index"], priority)
            data.set("td_error", priority)
            ours.update_tensordict_priority(data)
    finally:
        shutdown(ours)


def test_prioritized_buffer_uses_fastreplay_sampler_without_compiled_extension():
    rb = TensorDictPrioritizedReplayBuffer(alpha=0.7, beta=0.5, storage=LazyTensorStorage(10))
    assert type(rb.prioritized_sampler) is fastreplay.PrioritizedSampler
    rb.extend(
        TensorDict(obs=torch.arange(4), td_error=torch.tensor([0.1, 0.4, 0.2, 0.3]), batch_size=[4])
    )
    assert rb.prioritized_sampler.default_priority == pytest.approx(0.4)
    with pytest.raises(ValueError, match="sync=False"):
        TensorDictPrioritizedReplayBuffer(
            alpha=0.7, beta=0.5, storage=LazyTensorStorage(10, ndim=2), sync=False
        )


def test_getitem_is_pinned(fake_pinning: FakePinning):
    rb = make_buffer(
        TensorDictReplayBuffer, "random", pin_memory=True, transform=device_none_transform
    )
    assert unpinned(rb[3:9], fake_pinning.is_pinned) == []
    assert unpinned(rb["obs"], fake_pinning.is_pinned) == []


def test_list_storage_and_include_info_false(fake_pinning: FakePinning):
    rb = make_buffer(TensorDictReplayBuffer, "random", pin_memory=True, storage=ListStorage(30))
    data = rb.sample()
    assert "index" in data and unpinned(data, fake_pinning.is_pinned) == []
    ref = make_buffer(TorchRLBuffer, "random", storage=ListStorage(30))
    with pytest.warns(UserWarning, match="include_info is going to be deprecated"):
        bare = rb.sample(include_info=False)
    with pytest.warns(UserWarning, match="include_info is going to be deprecated"):
        ref_bare = ref.sample(include_info=False)
    # A ListStorage keeps the extended TensorDicts, into which ``extend`` wrote ``index``: the
    # stored ``index`` comes back, as in TorchRL.
    assert "index" in ref_bare
    assert set(bare.keys(True)) == set(ref_bare.keys(True))
    assert unpinned(bare, fake_pinning.is_pinned) == []


@pytest.mark.parametrize("prefetch", [None, 2])
def test_include_info_false_keeps_stored_keys_pinned(fake_pinning: FakePinning, prefetch: Any):
    """Stored entries named like the metadata come back raw, and pinned too."""
    data = TensorDict(obs=torch.arange(19), index=torch.arange(19) + 1_000, batch_size=[19])
    rb = TensorDictReplayBuffer(
        storage=LazyTensorStorage(23), batch_size=5, pin_memory=True, prefetch=prefetch
    )
    rb.extend(data, update_priority=False)
    stored = rb.storage[torch.arange(19)]
    try:
        for _ in range(3):
            with pytest.warns(UserWarning, match="include_info is going to be deprecated"):
                bare, info = rb.sample(include_info=False, return_info=True)
            assert set(bare.keys()) == {"obs", "index"}
            assert torch.equal(bare["index"], stored["index"][info["index"]])
            assert unpinned(bare, fake_pinning.is_pinned) == []
            full = rb.sample()
            assert torch.equal(full["index"], torch.as_tensor(full["obs"]))  # the slots
            assert unpinned(full, fake_pinning.is_pinned) == []
    finally:
        shutdown(rb)


def test_non_tensordict_data_raises_like_torchrl():
    rb = make_buffer(TensorDictReplayBuffer, "random", collate_fn=lambda td: td["obs"])
    with pytest.raises(RuntimeError, match="Cannot include info in non-tensordict data"):
        rb.sample()


# ----------------------------------------------------------------------------- no accelerator


@pytest.mark.usefixtures("no_accelerator")
@pytest.mark.parametrize("kind", ["random", "torchrl-slice"])
def test_no_accelerator_warns_once_then_samples_unpinned(kind: str):
    with pytest.warns(UserWarning, match="no accelerator is found") as record:
        rb = make_buffer(
            TensorDictReplayBuffer, kind, pin_memory=True, prefetch=2, generator=generator(3)
        )
    assert len(record) == 1 and record[0].filename == __file__  # stacklevel: the user's line
    assert rb.pin_memory is True and rb.pins is False
    ref = make_buffer(TorchRLBuffer, kind, generator=generator(3))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no second warning, from any thread
            first = rb.sample()
            assert set(first.keys(True, True)) >= EXPECTED_METADATA[kind]
            assert_same_tensordict(first, ref.sample())
            for _ in range(3):
                rb.sample()
    finally:
        shutdown(rb)


@pytest.mark.skipif(_pinning.pinning_available(), reason="this machine has an accelerator")
def test_cpu_only_machine_for_real():
    """No monkeypatching: TorchRL crashes here, fastreplay warns and samples."""
    torchrl_rb = make_buffer(TorchRLBuffer, "torchrl-slice", pin_memory=True)
    with pytest.raises(RuntimeError, match=r"accelerator|NVIDIA driver"):
        torchrl_rb.sample()
    with pytest.warns(UserWarning, match="no accelerator"):
        rb = make_buffer(TensorDictReplayBuffer, "torchrl-slice", pin_memory=True, prefetch=2)
    try:
        for _ in range(3):
            data, info = rb.sample(return_info=True)
            assert_slices_consistent(data)
            assert not data["obs"].is_pinned() and not info["index"][0].is_pinned()
    finally:
        shutdown(rb)


def test_plain_buffer_never_touches_pinning(no_accelerator: None):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rb = make_buffer(TensorDictReplayBuffer, "torchrl-slice")
        assert rb.pin_memory is False and rb.pins is False and rb.device is None
        assert_slices_consistent(rb.sample())


# ----------------------------------------------------------------------------- device=


def test_device_pins_then_moves_without_blocking(
    fake_pinning: FakePinning, monkeypatch: pytest.MonkeyPatch
):
    moves = []
    real_move = _pinning.move_tree

    def spy(tree: Any, device: torch.device) -> Any:
        moves.append((unpinned(tree, fake_pinning.is_pinned), device))
        return real_move(tree, device)

    monkeypatch.setattr(_pinning, "move_tree", spy)
    rb = make_buffer(TensorDictReplayBuffer, "torchrl-slice", pin_memory=True, device="cpu")
    assert rb.device == torch.device("cpu")
    # To an accelerator ("meta" stands in for one; construction only accepts real devices):
    # everything is pinned before the non-blocking move.
    rb._fr_device = torch.device("meta")
    data = rb.sample()
    assert moves == [([], torch.device("meta"))]
    assert data.device == torch.device("meta")
    # To the host: moved first (from a storage on an accelerator), then pinned.
    rb._fr_device = torch.device("cpu")
    moves.clear()
    data = rb.sample()
    assert [device for _, device in moves] == [torch.device("cpu")]
    assert data.device == torch.device("cpu")
    assert unpinned(data, fake_pinning.is_pinned) == []


@requires_cuda
def test_device_cpu_from_a_cuda_storage_is_pinned():
    rb = TensorDictReplayBuffer(
        storage=LazyTensorStorage(CAPACITY, device="cuda"),
        batch_size=12,
        device="cpu",
        pin_memory=True,
    )
    rb.extend(make_data())
    data = rb.sample()
    assert data.device == torch.device("cpu")
    assert _real_unpinned(data) == []
    assert_slices_consistent(data)


TRUTHY = [True, np.bool_(True), 1, np.int64(2), "yes", torch.tensor(True), np.array([1])]
FALSY = [False, np.bool_(False), 0, None, "", torch.tensor(0), np.array([0.0])]


@pytest.mark.parametrize("value", TRUTHY, ids=repr)
def test_pin_memory_accepts_any_true_value_as_torchrl_does(value: Any, no_accelerator: None):
    """TorchRL reads ``pin_memory`` with ``if self._pin_memory:``: so does fastreplay."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert bool(TorchRLBuffer(storage=LazyTensorStorage(10), pin_memory=value)._pin_memory)
    for cls, kwargs in (
        (TensorDictReplayBuffer, {}),
        (TensorDictPrioritizedReplayBuffer, {"alpha": 0.7, "beta": 0.5}),
    ):
        with pytest.warns(UserWarning, match="'pin_memory' argument is set as true") as record:
            rb = cls(storage=LazyTensorStorage(10), pin_memory=value, **kwargs)
        assert len(record) == 1
        assert rb.pin_memory is True and rb.pins is False


@pytest.mark.parametrize("value", TRUTHY, ids=repr)
def test_true_pin_memory_values_pin(value: Any, fake_pinning: FakePinning):
    rb = make_buffer(TensorDictReplayBuffer, "random", pin_memory=value)
    assert rb.pin_memory is True and rb.pins is True
    assert unpinned(rb.sample(return_info=True), fake_pinning.is_pinned) == []


@pytest.mark.parametrize("value", FALSY, ids=repr)
def test_false_pin_memory_values_do_not_pin(value: Any, no_accelerator: None):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "no accelerator" warning either
        rb = make_buffer(TensorDictReplayBuffer, "random", pin_memory=value)
        assert rb.pin_memory is False and rb.pins is False
        rb.sample()


@pytest.mark.parametrize(
    ("value", "error", "match"),
    [
        (
            torch.ones(2),
            RuntimeError,
            r"pin_memory=tensor\(\[1., 1.\]\) \(of type torch.Tensor\) has no truth value: "
            r"Boolean value of Tensor with more than one value is ambiguous; pass "
            r"pin_memory=True or pin_memory=False\.",
        ),
        (
            np.array([1, 0]),
            ValueError,
            r"pin_memory=array\(\[1, 0\]\) \(of type numpy.ndarray\) has no truth value: .*"
            r"ambiguous.*; pass pin_memory=True or pin_memory=False\.",
        ),
    ],
)
def test_pin_memory_without_a_truth_value(value: Any, error: type, match: str):
    """Refused at construction with the class TorchRL raises at its first ``sample``."""
    torchrl_rb = make_buffer(TorchRLBuffer, "random", pin_memory=value)
    with pytest.raises(error):
        torchrl_rb.sample()
    with pytest.raises(error, match=match):
        TensorDictReplayBuffer(storage=LazyTensorStorage(10), pin_memory=value)
    with pytest.raises(error, match=match):
        TensorDictPrioritizedReplayBuffer(alpha=0.7, beta=0.5, pin_memory=value)


@pytest.mark.parametrize(
    ("value", "error", "match"),
    [
        ("gpu", ValueError, r"device='gpu' is not a device torch knows .*pass e.g. device='cuda'"),
        ("cuda:99", ValueError, r"device='cuda:99': (no cuda device|this machine has \d+ cuda)"),
        (1.5, TypeError, r"device must be None, a str, an int or a torch.device, got 1.5"),
        (True, TypeError, r"device must be None, a str, an int or a torch.device, got True"),
        (np.bool_(True), TypeError, r"got np.True_ of type numpy.bool; pass e.g. device='cuda'"),
    ],
)
def test_bad_device(value: Any, error: type, match: str):
    with pytest.raises(error, match=match):
        TensorDictReplayBuffer(storage=LazyTensorStorage(10), device=value)


def test_numpy_integer_device_is_an_index():
    if torch.cuda.is_available():
        rb = TensorDictReplayBuffer(storage=LazyTensorStorage(10), device=np.int64(0))
        assert rb.device == torch.device("cuda", 0)
        return
    # An int is an accelerator index: refused here (the wording depends on the torch build).
    with pytest.raises(ValueError, match=r"device=0(: no cuda device| is not a device)"):
        TensorDictReplayBuffer(storage=LazyTensorStorage(10), device=np.int64(0))


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available on this machine")
def test_cuda_device_without_cuda_is_refused_at_construction():
    with pytest.raises(ValueError, match=r"device='cuda': no cuda device is available"):
        TensorDictReplayBuffer(storage=LazyTensorStorage(10), device="cuda")


# ----------------------------------------------------------------------------- real CUDA


def _real_unpinned(obj: Any) -> list[tuple]:
    return unpinned(obj, lambda t: t.is_pinned())


@requires_cuda
@pytest.mark.parametrize("kind", ["random", "torchrl-slice", "fastreplay-slice"])
@pytest.mark.parametrize("prefetch", [None, 2])
def test_cuda_every_leaf_is_pinned(kind: str, prefetch: int | None):
    rb = make_buffer(
        TensorDictReplayBuffer,
        kind,
        pin_memory=True,
        prefetch=prefetch,
        transform=device_none_transform,
    )
    try:
        for _ in range(3):
            data, info = rb.sample(return_info=True)
            assert _real_unpinned((data, info)) == []
            assert data.get_non_tensor("tag") == "kept"
            assert_slices_consistent(data)
    finally:
        shutdown(rb)


@requires_cuda
def test_cuda_prioritized_every_leaf_is_pinned():
    rb = TensorDictPrioritizedReplayBuffer(
        alpha=0.7, beta=0.5, storage=LazyTensorStorage(CAPACITY), batch_size=12, pin_memory=True
    )
    rb.extend(make_data())
    data, info = rb.sample(return_info=True)
    assert _real_unpinned((data, info)) == []
    assert data["priority_weight"].is_pinned()


@requires_cuda
def test_cuda_pinned_and_device_tensors_are_not_copied():
    pinned = torch.arange(4).pin_memory()
    on_cuda = torch.arange(4, device="cuda")
    tree = {"pinned": pinned, "cuda": on_cuda, "host": torch.arange(4)}
    out = _pinning.pin_tree(tree)
    assert out["pinned"] is pinned and out["cuda"] is on_cuda and out["host"].is_pinned()


@requires_cuda
def test_cuda_device_delivers_device_tensors():
    rb = make_buffer(TensorDictReplayBuffer, "torchrl-slice", device="cuda", generator=generator(4))
    ref = make_buffer(TorchRLBuffer, "torchrl-slice", generator=generator(4))
    try:
        data, info = rb.sample(return_info=True)
        assert all(t.device.type == "cuda" for _, t in tensor_leaves(data))
        assert _real_unpinned(info) == []
        assert_same_tensordict(data.cpu(), ref.sample())
    finally:
        shutdown(rb)


@requires_cuda
def test_cuda_storage_is_left_on_cuda():
    rb = make_buffer(
        TensorDictReplayBuffer,
        "random",
        pin_memory=True,
        storage=LazyTensorStorage(CAPACITY, device="cuda"),
    )
    data = rb.sample()
    assert all(t.device.type == "cuda" for _, t in tensor_leaves(data))


# ----------------------------------------------------------------------------- storage devices
# Every buffer path on a storage that lives on an accelerator. The "cpu" parameter runs the same
# checks here (so the test logic itself is exercised on every machine); "cuda" needs a GPU.

STORAGE_DEVICES = ["cpu", pytest.param("cuda", marks=requires_cuda)]


def _pinning_check(request: pytest.FixtureRequest, pin_memory: bool) -> Callable:
    """The ``is_pinned`` to check with: real with an accelerator, observed without one."""
    if pin_memory and not _pinning.pinning_available():
        return request.getfixturevalue("fake_pinning").is_pinned
    return lambda t: t.is_pinned()


@pytest.mark.parametrize("storage_device", STORAGE_DEVICES)
@pytest.mark.parametrize("kind", SAMPLERS)
@pytest.mark.parametrize(("pin_memory", "prefetch"), [(False, None), (True, None), (True, 2)])
def test_storage_on_device_samples_like_torchrl(
    storage_device: str,
    kind: str,
    pin_memory: bool,
    prefetch: int | None,
    request: pytest.FixtureRequest,
):
    is_pinned = _pinning_check(request, pin_memory)
    ours = make_buffer(
        TensorDictReplayBuffer,
        kind,
        storage=LazyTensorStorage(CAPACITY, device=storage_device),
        pin_memory=pin_memory,
        prefetch=prefetch,
        generator=device_generator(5, kind, storage_device),
    )
    ref = make_buffer(
        TorchRLBuffer,
        kind,
        storage=LazyTensorStorage(CAPACITY, device=storage_device),
        generator=device_generator(5, kind, storage_device),
    )
    try:
        for _ in range(3):
            data, info = ours.sample(return_info=True)
            ref_data, ref_info = ref.sample(return_info=True)
            # Data and metadata stay on the storage's device, as in TorchRL.
            assert {t.device.type for _, t in tensor_leaves(data)} == {storage_device}
            assert_same_tensordict(data.cpu(), ref_data.cpu())
            for (_, a), (_, b) in zip(tensor_leaves(info), tensor_leaves(ref_info), strict=True):
                assert a.device == b.device
                torch.testing.assert_close(a.cpu(), b.cpu(), rtol=0, atol=0)
            if pin_memory:
                assert unpinned((data, info), is_pinned) == []
            if "prioritized" in kind and prefetch is None:
                priority = (data["obs"] % 7 + 1).float()
                ours.update_priority(data["index"], priority)
                ref.update_priority(ref_data["index"], priority)
        assert_same_tensordict(ours[3:9].cpu(), ref[3:9].cpu())
        assert ours[3:9]["obs"].device.type == storage_device
    finally:
        shutdown(ours)


@pytest.mark.parametrize("storage_device", STORAGE_DEVICES)
@pytest.mark.parametrize("kind", ["random", "torchrl-slice", "fastreplay-slice"])
def test_ndim2_storage_on_device(storage_device: str, kind: str, request: pytest.FixtureRequest):
    is_pinned = _pinning_check(request, True)
    data = make_data().reshape(N_TRAJ, TRAJ_LEN)
    chunks = [data[:, :5], data[:, 5:]]
    buffers = [
        make_buffer(
            cls,
            kind,
            chunks,
            storage=LazyTensorStorage(CAPACITY, ndim=2, device=storage_device),
            generator=device_generator(6, kind, storage_device),
            **extra,
        )
        for cls, extra in ((TensorDictReplayBuffer, {"pin_memory": True}), (TorchRLBuffer, {}))
    ]
    ours, ref = buffers
    for _ in range(3):
        got, ref_data = ours.sample(), ref.sample()
        assert got["obs"].device.type == storage_device
        assert got["index"].shape == (12, 2)
        assert_same_tensordict(got.cpu(), ref_data.cpu())
        assert unpinned(got, is_pinned) == []


@pytest.mark.parametrize("storage_device", STORAGE_DEVICES)
def test_prioritized_buffer_storage_on_device(
    storage_device: str, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
):
    # The module that defines it (a package module from TorchRL 0.14 on, one module on 0.13).
    torchrl_tdprb = importlib.import_module(TorchRLPrioritizedBuffer.__init__.__module__)

    is_pinned = _pinning_check(request, True)
    # Reference: TorchRL's buffer class driving fastreplay's sampler (see above).
    monkeypatch.setattr(torchrl_tdprb, "PrioritizedSampler", fastreplay.PrioritizedSampler)
    kwargs = {"alpha": 0.7, "beta": 0.5, "batch_size": 12}
    ours = TensorDictPrioritizedReplayBuffer(
        storage=LazyTensorStorage(CAPACITY, device=storage_device),
        pin_memory=True,
        generator=generator(7),
        **kwargs,
    )
    ref = TorchRLPrioritizedBuffer(
        storage=LazyTensorStorage(CAPACITY, device=storage_device), generator=generator(7), **kwargs
    )
    for rb in (ours, ref):
        rb.extend(make_data()[:32])
        rb.extend(make_data()[32:])
    for _ in range(3):
        data, ref_data = ours.sample(), ref.sample()
        assert data["priority_weight"].device.type == storage_device
        assert_same_tensordict(data.cpu(), ref_data.cpu())
        assert unpinned(data, is_pinned) == []
        for td in (data, ref_data):
            td.set("td_error", (td["obs"] % 7 + 1).float())
        ours.update_tensordict_priority(data)
        ref.update_tensordict_priority(ref_data)
    restored = TensorDictPrioritizedReplayBuffer(
        storage=LazyTensorStorage(CAPACITY, device=storage_device), **kwargs
    )
    restored.load_state_dict(ours.state_dict())
    assert len(restored) == len(ours)
    assert_same_tensordict(restored[:], ours[:])


@requires_cuda
def test_device_cpu_from_a_cuda_storage_is_synchronised():
    """Samples brought to the host are complete when returned (blocking device-to-host)."""
    big = TensorDict(obs=torch.arange(2_000_000).reshape(1000, 2000), batch_size=[1000])
    rb = TensorDictReplayBuffer(
        storage=LazyTensorStorage(1000, device="cuda"), batch_size=1000, device="cpu"
    )
    rb.extend(big)
    for _ in range(3):
        data = rb.sample()
        assert data.device == torch.device("cpu")
        torch.testing.assert_close(data["obs"], big["obs"][data["index"]], rtol=0, atol=0)


@requires_cuda
@pytest.mark.parametrize("storage", ["memmap", "tensor"])
def test_device_argument_from_host_storages(storage: str, tmp_path: Any):
    from torchrl.data import LazyMemmapStorage

    make_storage = {  # one folder per memmap storage: a second in the same one is refused
        "memmap": lambda name: LazyMemmapStorage(CAPACITY, scratch_dir=tmp_path / name),
        "tensor": lambda name: LazyTensorStorage(CAPACITY),
    }[storage]
    rb = make_buffer(
        TensorDictReplayBuffer,
        "torchrl-slice",
        storage=make_storage("ours"),
        device="cuda",
        generator=generator(8),
    )
    ref = make_buffer(
        TorchRLBuffer, "torchrl-slice", storage=make_storage("ref"), generator=generator(8)
    )
    data, info = rb.sample(return_info=True)
    assert data.device.type == "cuda"
    assert all(t.device.type == "cuda" for _, t in tensor_leaves(data))
    assert _real_unpinned(info) == []
    assert_same_tensordict(data.cpu(), ref.sample())


def test_restored_prefetch_queue_is_pinned(fake_pinning: FakePinning):
    """TorchRL checkpoints prefetched samples as (unpinned) clones; they come back pinned."""
    rb = make_buffer(TensorDictReplayBuffer, "torchrl-slice", pin_memory=True, prefetch=2)
    other = make_buffer(TensorDictReplayBuffer, "torchrl-slice", pin_memory=True, prefetch=2)
    try:
        rb.sample()
        other.load_state_dict(rb.state_dict())
        for _ in range(3):
            data, info = other.sample(return_info=True)
            assert unpinned((data, info), fake_pinning.is_pinned) == []
    finally:
        shutdown(rb)
        shutdown(other)


# ----------------------------------------------------------------------------- staged gathers


def stored_leaves(sample: TensorDict, kind: str) -> list:
    """The sample's leaves read from the storage (not the metadata written afterwards)."""
    metadata = EXPECTED_METADATA[kind]
    return [(path, t) for path, t in tensor_leaves(sample) if path[-1] not in metadata]


@pytest.mark.skipif(
    not STORAGE_HAS_REVISION,
    reason=f"TorchRL {TORCHRL_VERSION}'s storages count no writes, so fastreplay's direct read "
    "(and with it the gather into pinned memory) is off: samples are read, then pinned",
)
@pytest.mark.parametrize("kind", ["random", "torchrl-slice", "fastreplay-slice"])
@pytest.mark.parametrize("prefetch", [None, 2])
def test_host_storage_gathers_straight_into_pinned_memory(
    fake_pinning: FakePinning, kind: str, prefetch: int | None
):
    """One host copy per stored leaf: the gather writes into pinned memory, nothing re-pins it."""
    rb = make_buffer(TensorDictReplayBuffer, kind, pin_memory=True, prefetch=prefetch)
    try:
        if prefetch:
            rb.sample()  # empty queue: built in the caller's thread
        for _ in range(3):
            synchronize(rb)
            fake_pinning.threads.clear()
            fake_pinning.allocated.clear()
            data, info = rb.sample(return_info=True)
            synchronize(rb)
            assert unpinned((data, info), fake_pinning.is_pinned) == []
            # every stored leaf was gathered into a pinned allocation, none copied into one
            stored = stored_leaves(data, kind)
            assert stored
            for path, leaf in stored:
                assert leaf.untyped_storage().data_ptr() in fake_pinning.allocated_storages, path
            assert_slices_consistent(data)
            if prefetch:  # queued samples are gathered in the prefetch threads
                assert threading.main_thread() not in fake_pinning.allocated
    finally:
        shutdown(rb)


@pytest.mark.parametrize("kind", ["random", "torchrl-slice", "fastreplay-slice"])
def test_staged_samples_equal_torchrl(fake_pinning: FakePinning, kind: str):
    ours = make_buffer(TensorDictReplayBuffer, kind, pin_memory=True, generator=generator(5))
    got = [ours.sample(return_info=True) for _ in range(3)]
    # the gather into pinned memory ran, where the direct read exists
    assert bool(fake_pinning.allocated) == STORAGE_HAS_REVISION
    ref = make_buffer(TorchRLBuffer, kind, generator=generator(5))
    want = [ref.sample(return_info=True) for _ in range(3)]
    for (data, info), (ref_data, ref_info) in zip(got, want, strict=True):
        assert_same_tensordict(data, ref_data)
        assert set(info) == set(ref_info)
        for (_, a), (_, b) in zip(tensor_leaves(info), tensor_leaves(ref_info), strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_returned_pinned_samples_are_never_reused(fake_pinning: FakePinning):
    """A pinned host sample belongs to the caller: later samples never write into it."""
    rb = make_buffer(TensorDictReplayBuffer, "random", pin_memory=True, prefetch=2)
    try:
        first = rb.sample()
        kept = first.clone()
        later = [rb.sample() for _ in range(6)]
        synchronize(rb)
        assert_same_tensordict(first, kept)
        ptrs = {t.untyped_storage().data_ptr() for _, t in tensor_leaves(first)}
        for sample in later:
            assert ptrs.isdisjoint(t.untyped_storage().data_ptr() for _, t in tensor_leaves(sample))
    finally:
        shutdown(rb)


def test_transforms_take_the_general_read_then_pin(fake_pinning: FakePinning):
    rb = make_buffer(
        TensorDictReplayBuffer, "random", pin_memory=True, transform=device_none_transform
    )
    data = rb.sample()
    assert unpinned(data, fake_pinning.is_pinned) == []
    assert not fake_pinning.allocated  # the transform's output is pinned by copy
    assert fake_pinning.calls > 0


@requires_cuda
@pytest.mark.parametrize("prefetch", [None, 3])
def test_cuda_device_samples_from_pinned_staging_are_right(prefetch: int | None):
    """Gathered into pinned memory, copied on a prefetch thread's stream: values intact."""
    rb = make_buffer(TensorDictReplayBuffer, "fastreplay-slice", device="cuda", prefetch=prefetch)
    try:
        for _ in range(8):
            data = rb.sample()
            assert data.device.type == "cuda"
            # work on the caller's stream right away reads the copied values
            assert_slices_consistent(data)
            del data
    finally:
        shutdown(rb)

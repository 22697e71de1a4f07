"""``StreamingSliceSampler``: TorchRL's windows and samples, fastreplay's index behind the rest.

Reference: TorchRL's ``StreamingSliceSampler`` in TorchRL's buffer, same seed, same writes.
fastreplay's sampler runs in TorchRL's buffer and in fastreplay's (whose direct path writes and
samples itself). Data: ``obs = traj * 10_000 + step``; a slice crossing an episode is visible.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import torchrl
import torchrl.data as trl
from torchrl.data import LazyTensorStorage

import fastreplay
from conformance.conftest import (
    FASTREPLAY_BUFFER,
    assert_slices_valid,
    episodes,
    extend_in_two,
    make_buffer,
)
from conftest import assert_same_tensordict, record_storage_reads, requires_storage_revision
from fastreplay._torchrl import HAS_STREAMING_SLICE

pytestmark = pytest.mark.skipif(
    not HAS_STREAMING_SLICE,
    reason=f"TorchRL {torchrl.__version__} has no StreamingSliceSampler (added in 0.14)",
)

SLICE = 3


def _sampler(side: str, **kwargs: Any) -> Any:
    module = trl if side == "torchrl" else fastreplay
    return module.StreamingSliceSampler(slice_len=SLICE, **kwargs)


def _run(
    sampler: Any, buffer: str, capacity: int, *, samples: int = 3, in_two: bool = False
) -> list[Any]:
    """Writes of 4 to 23 steps (episodes of cycling lengths), ``samples`` samples after each."""
    torch.manual_seed(11)
    rb = make_buffer(
        buffer, "TensorDictReplayBuffer", storage=LazyTensorStorage(capacity), sampler=sampler
    )
    out: list[Any] = []
    first = 0
    for w in range(16):
        n = 4 + (5 * w) % 20
        data = episodes(n, [7, 2, 11, 4], first_id=first)
        first = int(data["traj"][-1]) + 1
        if in_two and n > 1:
            extend_in_two(rb, data)
        else:
            rb.extend(data)
        for _ in range(samples):
            with warnings.catch_warnings(record=True) as caught:  # the nightly's short-batch
                warnings.simplefilter("always")  # warning, with strict_length=False
                batch = rb.sample(4 * SLICE)
            out += [batch.clone(), [(w.category, str(w.message)) for w in caught]]
    return out


def _assert_same(got: list[Any], expected: list[Any]) -> None:
    for a, b in zip(got, expected, strict=True):
        if isinstance(a, list):  # the warnings of one sample
            assert a == b
        else:
            assert_same_tensordict(a, b)


@pytest.mark.parametrize("capacity", [23, 37])
@pytest.mark.parametrize("kwargs", [{}, {"traj_key": "traj"}, {"strict_length": False}])
@pytest.mark.parametrize("in_two", [False, True], ids=["one-write", "extend-in-two"])
def test_samples_are_torchrl_s(buffer_side: str, capacity: int, kwargs: dict, in_two: bool) -> None:
    """Queued windows first, then the uniform fallback: index, info and data identical."""
    expected = _run(_sampler("torchrl", **kwargs), "torchrl-buffer", capacity, in_two=in_two)
    got = _run(_sampler("fastreplay", **kwargs), buffer_side, capacity, in_two=in_two)
    _assert_same(got, expected)
    if kwargs.get("strict_length", True):
        for batch in got[::2]:
            assert_slices_valid(batch["obs"], 4)


def test_sampler_level_indices_and_info_are_torchrl_s() -> None:
    """``sampler.sample`` itself: same index tuple and info dict, call by call."""
    results = []
    for side in ("torchrl", "fastreplay"):
        torch.manual_seed(2)
        sampler = _sampler(side, traj_key="traj")
        rb = trl.TensorDictReplayBuffer(storage=LazyTensorStorage(29), sampler=sampler)
        calls = []
        first = 0
        for w in range(10):
            data = episodes(3 + (4 * w) % 13, [5, 8], first_id=first)
            first = int(data["traj"][-1]) + 1
            rb.extend(data)
            for _ in range(2):
                calls.append(sampler.sample(rb.storage, 5 * SLICE))
        results.append(calls)
    for (index_a, info_a), (index_b, info_b) in zip(*results, strict=True):
        assert len(index_a) == len(index_b)
        for a, b in zip(index_a, index_b, strict=True):
            assert torch.equal(a, b)
        assert info_a.keys() == info_b.keys()
        for key in info_a:
            assert torch.equal(info_a[key], info_b[key]), key


def test_fallback_reads_only_the_written_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each write's rows are read once by the index; no rescan of the stored boundaries."""
    sampler = fastreplay.StreamingSliceSampler(slice_len=8, traj_key="traj")
    rb = fastreplay.TensorDictReplayBuffer(storage=LazyTensorStorage(20_001), sampler=sampler)
    rb.extend(episodes(18_000, [40, 9, 200]))
    rb.sample(8 * 2_300)  # the queued windows (at most 2,250), then the fallback
    reads = record_storage_reads(monkeypatch)

    def scan(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("StreamingSliceSampler rescanned the stored boundaries")

    monkeypatch.setattr(trl.SliceSampler, "_get_stop_and_length", scan)
    written, first, fresh = [], 10_000, 0
    for w in range(15):
        data = episodes(150 + w, [40, 9, 200], first_id=first)
        first = int(data["traj"][-1]) + 1
        rb.extend(data)
        written.append(len(data))
        for _ in range(4):  # past the fresh windows: the fallback draws from the index
            fresh += min(len(sampler._queued_slices), 8)  # served from the queue
            assert_slices_valid(rb.sample(64)["obs"], 8)
    assert reads == written
    assert fresh < 15 * 4 * 8  # most slices came from the fallback


@requires_storage_revision
def test_unreported_write_rebuilds_once(buffer_side: str) -> None:
    """A write straight to the storage: the fallback reads the storage again, as TorchRL's."""
    runs = []
    for side, buffer in (("torchrl", "torchrl-buffer"), ("fastreplay", buffer_side)):
        torch.manual_seed(4)
        sampler = _sampler(side, traj_key="traj")
        rb = make_buffer(
            buffer, "TensorDictReplayBuffer", storage=LazyTensorStorage(31), sampler=sampler
        )
        rb.extend(episodes(40, [6, 3]))
        rb.sample(6)
        patch = episodes(6, [2], first_id=500)
        rb.storage.set(torch.arange(4, 10), patch)
        runs.append([rb.sample(6).clone() for _ in range(20)])
    for a, b in zip(*runs, strict=True):
        assert_same_tensordict(a, b)


def test_checkpoint_round_trip_is_torchrl_s() -> None:
    """``state_dict``/``load_state_dict`` into a fresh sampler: same queue, same samples."""
    runs = []
    for side in ("torchrl", "fastreplay"):
        torch.manual_seed(6)
        sampler = _sampler(side, traj_key="traj")
        rb = trl.TensorDictReplayBuffer(storage=LazyTensorStorage(41), sampler=sampler)
        rb.extend(episodes(50, [9, 4]))
        state = rb.state_dict()
        fresh = _sampler(side, traj_key="traj")
        rb2 = trl.TensorDictReplayBuffer(storage=LazyTensorStorage(41), sampler=fresh)
        rb2.load_state_dict(state)
        runs.append([rb2.sample(6).clone() for _ in range(10)])
    for a, b in zip(*runs, strict=True):
        assert_same_tensordict(a, b)


def test_errors_are_torchrl_s() -> None:
    for side in ("torchrl", "fastreplay"):
        module = trl if side == "torchrl" else fastreplay
        with pytest.raises(TypeError, match="slice_len"):
            module.StreamingSliceSampler(slice_len=2.5)
        with pytest.raises(ValueError, match="slice_len"):
            module.StreamingSliceSampler(slice_len=0)
        rb = trl.TensorDictReplayBuffer(
            storage=LazyTensorStorage(2), sampler=module.StreamingSliceSampler(slice_len=3)
        )
        with pytest.raises(ValueError, match="cannot hold"):
            rb.extend(episodes(2, 2))


def test_fastreplay_buffer_takes_its_direct_path() -> None:
    """In fastreplay's buffer the sampler is called from the direct path (no general read)."""
    sampler = fastreplay.StreamingSliceSampler(slice_len=SLICE, traj_key="traj")
    rb = make_buffer(
        FASTREPLAY_BUFFER, "TensorDictReplayBuffer", storage=LazyTensorStorage(19), sampler=sampler
    )
    rb.extend(episodes(10, 5))
    rb.extend(episodes(10, 5, first_id=2))  # the direct write
    assert rb._fr_plain() is not None
    assert_slices_valid(rb.sample(4 * SLICE)["obs"], 4)

"""``can_sample``: fastreplay's slice samplers answer from the index, as TorchRL's do by a scan.

TorchRL's ``SliceSampler.can_sample`` (0.14+) counts the slice windows of every stored
trajectory; every ``sample(wait=True)``, ``wait_until_sampleable`` and ``RateLimitedReplayBuffer``
check calls it. fastreplay's answers from its trajectory index in ``O(columns)``. The answers
are compared on storages with episodes of many lengths, odd capacities, wrap-around and ndim=2,
and the index path is shown to read no boundaries.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torchrl
import torchrl.data as trl
from torchrl.data import LazyTensorStorage

import fastreplay
from conformance.conftest import episodes
from conftest import TORCHRL_EXT
from fastreplay._core.trajectory_index import TrajectoryIndex
from fastreplay._torchrl import HAS_CAN_SAMPLE, HAS_STREAMING_SLICE, SAMPLE_KEYWORDS

pytestmark = pytest.mark.skipif(
    not HAS_CAN_SAMPLE, reason=f"TorchRL {torchrl.__version__}'s samplers have no can_sample"
)

SAMPLERS = (
    "SliceSampler",
    "SliceSamplerWithoutReplacement",
    "PrioritizedSliceSampler",
    *(("StreamingSliceSampler",) if HAS_STREAMING_SLICE else ()),
)


def _make(module: Any, name: str, capacity: int, **kwargs: Any) -> Any:
    if name == "PrioritizedSliceSampler":
        if module is trl and not TORCHRL_EXT:
            pytest.skip("TorchRL's PrioritizedSliceSampler needs its compiled extension")
        kwargs.update(max_capacity=capacity, alpha=0.7, beta=0.5)
    return getattr(module, name)(**kwargs)


def _fill(storage: Any, writes: list[tuple[int, Any]], columns: int | None) -> None:
    rb = trl.ReplayBuffer(storage=storage, batch_size=4)
    first = 0
    for n, lengths in writes:
        data = episodes(n, lengths, columns=columns, first_id=first)
        first += n * (columns or 1)
        rb.extend(data)


WORKLOADS = {
    "short-episodes": [(40, [1, 2, 3])],
    "mixed-wrap": [(23, [7, 2]), (30, [5, 11, 1]), (19, 4)],
    "one-long": [(33, 33)],
}


@pytest.mark.parametrize("name", SAMPLERS)
@pytest.mark.parametrize("workload", WORKLOADS)
@pytest.mark.parametrize("strict", [True, False])
@pytest.mark.parametrize("columns", [None, 3], ids=["1d", "ndim2"])
def test_can_sample_answers_as_torchrl(
    name: str, workload: str, strict: bool, columns: int | None
) -> None:
    """``can_sample`` and ``_sampleable_count`` (``SamplerEnsemble``'s weights): TorchRL's."""
    if name == "StreamingSliceSampler" and columns:
        pytest.skip("StreamingSliceSampler takes 1-D storages only (TorchRL's RuntimeError)")
    answers = {}
    sizes = (2, 4, 8, 16, 32, 64)
    for side in ("torchrl", "fastreplay"):
        module = trl if side == "torchrl" else fastreplay
        capacity = 37 * (columns or 1)
        sampler = _make(module, name, capacity, slice_len=2, traj_key="traj", strict_length=strict)
        storage = LazyTensorStorage(capacity, ndim=1 if columns is None else 2)
        _fill(storage, WORKLOADS[workload], columns)
        answers[side] = [sampler.can_sample(storage, size) for size in sizes]
        answers[side] += [int(sampler._sampleable_count(storage, size)) for size in sizes]
    assert answers["fastreplay"] == answers["torchrl"]


@pytest.mark.parametrize("name", SAMPLERS)
@pytest.mark.parametrize("strict", [True, False])
def test_counts_follow_every_write_through_wrap_around(name: str, strict: bool) -> None:
    """Counted after each of many writes (wrapping an odd capacity), the sampler in a buffer."""
    answers = {}
    for side in ("torchrl", "fastreplay"):
        module = trl if side == "torchrl" else fastreplay
        sampler = _make(module, name, 53, slice_len=3, traj_key="traj", strict_length=strict)
        rb = trl.TensorDictReplayBuffer(storage=LazyTensorStorage(53), sampler=sampler)
        counts, first = [], 0
        for w in range(30):
            rb.extend(episodes(1 + (7 * w) % 17, [1, 4, 2, 9, 3, 25], first_id=first))
            first += 40
            counts.append([int(sampler._sampleable_count(rb.storage, k)) for k in (3, 6, 9, 27)])
        answers[side] = counts
    assert answers["fastreplay"] == answers["torchrl"]


def test_can_sample_reads_no_boundaries_after_a_write(monkeypatch: pytest.MonkeyPatch) -> None:
    sampler = fastreplay.SliceSampler(slice_len=8, traj_key="traj", strict_length=True)
    rb = fastreplay.TensorDictReplayBuffer(
        storage=LazyTensorStorage(10_000), sampler=sampler, batch_size=16
    )
    rb.extend(episodes(5000, 5))  # every trajectory shorter than a slice
    assert sampler.can_sample(rb.storage, 16) is False

    def scan(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("can_sample read every trajectory boundary")

    monkeypatch.setattr(type(sampler), "_get_stop_and_length", scan)
    monkeypatch.setattr(TrajectoryIndex, "boundaries", scan)  # O(trajectories): not used
    rb.extend(episodes(20, 20, first_id=10_000))  # one long enough now
    assert sampler.can_sample(rb.storage, 16) is True
    assert int(sampler._sampleable_count(rb.storage, 16)) == 20 - 8 + 1
    assert rb.can_sample(16) is True
    with pytest.raises(RuntimeError, match="divisible"):  # TorchRL's error, as there
        sampler.can_sample(rb.storage, 12)


# ------------------------------------------------- SliceSamplerWithoutReplacement: TorchRL's rule
def _without_replacement(side: str, buffer_side: str, **kwargs: Any) -> tuple[Any, Any]:
    module = trl if side == "torchrl" else fastreplay
    sampler = module.SliceSamplerWithoutReplacement(traj_key="traj", **kwargs)
    cls = (
        trl.TensorDictReplayBuffer
        if buffer_side == "torchrl"
        else fastreplay.TensorDictReplayBuffer
    )
    rb = cls(storage=LazyTensorStorage(100), sampler=sampler, batch_size=16)
    return sampler, rb


@pytest.mark.parametrize("buffer_side", ["torchrl", "fastreplay"])
@pytest.mark.parametrize("side", ["torchrl", "fastreplay"])
def test_without_replacement_drop_last_waits_for_enough_items(side: str, buffer_side: str) -> None:
    """12 items and a batch of 16 with ``drop_last``: not yet; ``sample(wait=True)`` waits."""
    sampler, rb = _without_replacement(side, buffer_side, slice_len=4, drop_last=True)
    rb.extend(episodes(12, 4))
    assert sampler.can_sample(rb.storage, 16) is False
    assert sampler.can_sample(rb.storage, 12) is True
    if "wait" not in SAMPLE_KEYWORDS:
        return
    with pytest.raises(TimeoutError):
        rb.sample(wait=True, timeout=0.05)
    writer = threading.Timer(0.1, lambda: rb.extend(episodes(12, 4, first_id=3)))
    writer.start()
    try:
        batch = rb.sample(wait=True, timeout=20)
    finally:
        writer.join()
    assert batch.shape == (16,)


@pytest.mark.parametrize("buffer_side", ["torchrl", "fastreplay"])
@pytest.mark.parametrize("side", ["torchrl", "fastreplay"])
def test_without_replacement_strict_length_does_not_wait_for_a_long_trajectory(
    side: str, buffer_side: str
) -> None:
    """No trajectory as long as a slice: ready (TorchRL's answer); the sample then raises."""
    sampler, rb = _without_replacement(side, buffer_side, slice_len=8, strict_length=True)
    rb.extend(episodes(12, 4))
    assert sampler.can_sample(rb.storage, 16) is True
    if "wait" not in SAMPLE_KEYWORDS:
        return
    start = time.monotonic()
    with pytest.raises((RuntimeError, ValueError)):  # no wait: the sample's own error
        rb.sample(wait=True, timeout=20)
    assert time.monotonic() - start < 10

"""``can_sample``: fastreplay's slice samplers answer from the index, as TorchRL's do by a scan.

TorchRL's ``SliceSampler.can_sample`` (0.14+) counts the slice windows of every stored
trajectory; every ``sample(wait=True)``, ``wait_until_sampleable`` and ``RateLimitedReplayBuffer``
check calls it. fastreplay's answers from its trajectory index in ``O(columns)``. The answers
are compared on storages with episodes of many lengths, odd capacities, wrap-around and ndim=2,
and the index path is shown to read no boundaries.
"""

from __future__ import annotations

from typing import Any

import pytest
import torchrl
import torchrl.data as trl
from torchrl.data import LazyTensorStorage

import fastreplay
from conformance.conftest import episodes
from fastreplay._torchrl import HAS_CAN_SAMPLE

pytestmark = pytest.mark.skipif(
    not HAS_CAN_SAMPLE, reason=f"TorchRL {torchrl.__version__}'s samplers have no can_sample"
)

SAMPLERS = ("SliceSampler", "SliceSamplerWithoutReplacement")


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
    answers = {}
    for side in ("torchrl", "fastreplay"):
        module = trl if side == "torchrl" else fastreplay
        sampler = getattr(module, name)(slice_len=2, traj_key="traj", strict_length=strict)
        storage = LazyTensorStorage(37 * (columns or 1), ndim=1 if columns is None else 2)
        _fill(storage, WORKLOADS[workload], columns)
        answers[side] = [sampler.can_sample(storage, size) for size in (2, 4, 8, 16, 32, 64)]
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
    rb.extend(episodes(20, 20, first_id=10_000))  # one long enough now
    assert sampler.can_sample(rb.storage, 16) is True
    assert rb.can_sample(16) is True
    with pytest.raises(RuntimeError, match="divisible"):  # TorchRL's error, as there
        sampler.can_sample(rb.storage, 12)

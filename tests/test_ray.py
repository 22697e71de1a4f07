"""fastreplay inside TorchRL's ``RayReplayBuffer``, on a real local Ray instance.

The buffer lives in a Ray actor, built from constructors (``functools.partial``) as TorchRL
documents; writer tasks extend through picklable clients and the driver plays the learner:
it samples and updates priorities remotely. One Ray instance for the module (``num_cpus=2``,
no dashboard); the workers import the ``src/`` under test. Skipped where Ray is not installed.
"""

from __future__ import annotations

import functools
import os
import runpy
from pathlib import Path
from typing import Any

import pytest
import torch
from torchrl.data import LazyTensorStorage

import fastreplay
from test_scale_out import BATCH, NUM_SLICES, assert_valid, episode

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'fastreplay[ray]')")
from torchrl.data import RayReplayBuffer  # noqa: E402

# Raised by TorchRL's Ray helpers (torchrl.collectors.distributed.ray) when they build their
# defaults, attributed to the caller; nothing fastreplay or this test can change.
pytestmark = pytest.mark.filterwarnings(
    "ignore:Creating .*WeightUpdater which inherits from WeightUpdaterBase:DeprecationWarning"
)

REPO = Path(__file__).resolve().parents[1]
CAPACITY = 101


@pytest.fixture(scope="module", autouse=True)
def local_ray() -> Any:
    path = os.pathsep.join([str(REPO / "src"), str(REPO / "tests")])
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": {"PYTHONPATH": path}},
    )
    yield
    ray.shutdown()


@ray.remote(num_cpus=0)
def write_episodes(client: Any, writer: int, first: int, count: int) -> str:
    """A writer task: ``count`` episodes through the buffer's client; returns where it ran."""
    for number in range(first, first + count):
        client.extend(episode(writer, number))
    return fastreplay.__file__


def run_writers(rb: Any, first: int, count: int, writers: int = 2) -> None:
    tasks = [write_episodes.remote(rb.client(), w, first, count) for w in range(writers)]
    files = ray.get(tasks, timeout=300)
    assert all(f.startswith(str(REPO / "src")) for f in files), files  # the code under test


def actor_attr(rb: Any, name: str) -> Any:
    return ray.get(rb._rb._getattr.remote(name))


def test_slice_sampler_in_a_ray_buffer() -> None:
    rb = RayReplayBuffer(
        replay_buffer_cls=fastreplay.TensorDictReplayBuffer,
        storage=functools.partial(LazyTensorStorage, CAPACITY),
        sampler=functools.partial(fastreplay.SliceSampler, num_slices=NUM_SLICES, traj_key="traj"),
        batch_size=BATCH,
        remote_config={"num_cpus": 0},
    )
    try:
        assert type(actor_attr(rb, "_sampler")) is fastreplay.SliceSampler
        for round_ in range(2):  # 2 x 5 x 9 = 90 rows a round: the cursor wraps
            run_writers(rb, round_ * 5, 5)
            assert rb.write_count == (round_ + 1) * 90
            stored = rb[: len(rb)]
            live = set(stored["traj"].tolist())
            new = {w * 1_000 + n for w in range(2) for n in range(round_ * 5, round_ * 5 + 5)}
            seen: set[int] = set()
            for _ in range(30):
                sample = rb.sample()
                assert_valid(sample, NUM_SLICES)
                assert set(sample["traj"].tolist()) <= live  # never an overwritten episode
                seen |= set(sample["traj"].tolist())
            assert new <= seen
            # Slice boundaries sit at the storage's episode boundaries, wrap-around included.
            assert torch.equal(sample["obs"], stored["obs"][sample["index"].reshape(-1)])
    finally:
        rb.close()


def test_prioritized_buffer_in_ray_tracks_the_live_max() -> None:
    rb = RayReplayBuffer(
        replay_buffer_cls=fastreplay.TensorDictPrioritizedReplayBuffer,
        alpha=0.7,
        beta=0.5,
        storage=functools.partial(LazyTensorStorage, CAPACITY),
        batch_size=BATCH,
        remote_config={"num_cpus": 0},
    )
    try:
        run_writers(rb, 0, 5)  # 90 rows, all at the initial priority
        assert actor_attr(rb, "_sampler").default_priority == 1.0
        # The learner re-prioritises everything it samples, remotely.
        for step in range(30):
            sample = rb.sample()
            assert_valid(sample, None)
            sample["td_error"] = (sample["obs"] % 10_000).float() / 10 + step / 100
            rb.update_tensordict_priority(sample)
        sampler = actor_attr(rb, "_sampler")
        raw = sampler.state_dict()["_raw"][: len(rb)]
        assert sampler.default_priority == float(raw.max())
        # New rows enter at the live max; overwriting the max item lowers it at once.
        live_max = sampler.default_priority
        run_writers(rb, 10, 1, writers=1)  # 9 rows: 90..98
        sampler = actor_attr(rb, "_sampler")
        raw = sampler.state_dict()["_raw"]
        assert torch.all(raw[90:99] == live_max)
        rb.update_priority(torch.arange(99), torch.full((99,), 0.25))
        rb.update_priority(torch.tensor([3]), torch.tensor([5.0]))
        assert actor_attr(rb, "_sampler").default_priority == 5.0
        run_writers(rb, 20, 1, writers=1)  # rows 99, 100, 0..6: overwrites the max item (3)
        sampler = actor_attr(rb, "_sampler")
        assert sampler.default_priority == 0.25
        assert torch.all(sampler.state_dict()["_raw"][[99, 100, *range(7)]] == 0.25)
        rb.update_priority(torch.tensor([50]), torch.tensor([7.0]))
        run_writers(rb, 30, 1, writers=1)  # rows 7..15 enter at the live max
        sampler = actor_attr(rb, "_sampler")
        assert torch.all(sampler.state_dict()["_raw"][7:16] == 7.0)
        assert_valid(rb.sample(), None)
    finally:
        rb.close()


def test_ray_apex_example_runs() -> None:
    """``docs/examples/ray_apex.py`` (linked from docs/scale_out.md) runs end to end."""
    example = runpy.run_path(str(REPO / "docs" / "examples" / "ray_apex.py"))
    out = example["main"](num_actors=2, episodes=20, steps=20)
    assert out["written"] == out["stored"] == 2 * 20 * 25
    assert out["live_max"] == out["max_stored_priority"] <= 25

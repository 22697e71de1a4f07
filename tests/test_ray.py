"""fastreplay inside TorchRL's ``RayReplayBuffer``, on a real local Ray instance.

The buffer lives in a Ray actor, built from constructors (``functools.partial``) as TorchRL
documents; writer tasks extend through picklable clients and the driver plays the learner:
it samples and updates priorities remotely. One Ray instance for the module (``num_cpus=2``,
no dashboard); the workers import the ``src/`` under test. Ray tests skip where Ray is not
installed; the checks that need no Ray run everywhere.

Bad set-ups fail at construction, whichever way the buffer is built: ``fastreplay.
RayReplayBuffer`` (any buffer class), TorchRL's ``RayReplayBuffer`` given a fastreplay buffer
class, and ``fastreplay.TensorDictReplayBuffer(service_backend="ray")``.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import os
import runpy
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torchrl.data as trl
from torchrl.data import LazyTensorStorage, ListStorage
from torchrl.data.replay_buffers.ray_buffer import RayReplayBuffer

import fastreplay
import fastreplay.ray_buffer
from conftest import REPO
from fastreplay._torchrl import ray_runtime_lease as _ray_runtime_lease
from test_scale_out import BATCH, NUM_SLICES, assert_valid, episode

HAS_RAY = importlib.util.find_spec("ray") is not None
requires_ray = pytest.mark.skipif(not HAS_RAY, reason="Ray is not installed (pip install ray)")
if HAS_RAY:
    import ray

# Raised by TorchRL's Ray helpers (torchrl.collectors.distributed.ray) when they build their
# defaults, attributed to the caller; nothing fastreplay or this test can change.
pytestmark = pytest.mark.filterwarnings(
    "ignore:Creating .*WeightUpdater which inherits from WeightUpdaterBase:DeprecationWarning"
)

CAPACITY = 101
REMOTE = {"num_cpus": 0}  # the actor takes no CPU slot: tests never wait for one


@pytest.fixture(scope="module")
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


def write_episodes(client: Any, writer: int, first: int, count: int) -> str:
    """A writer task: ``count`` episodes through the buffer's client; returns where it ran."""
    for number in range(first, first + count):
        client.extend(episode(writer, number))
    return fastreplay.__file__


def run_writers(rb: Any, first: int, count: int, writers: int = 2) -> None:
    task = ray.remote(num_cpus=0)(write_episodes)
    tasks = [task.remote(rb.client(), w, first, count) for w in range(writers)]
    files = ray.get(tasks, timeout=300)
    assert all(f.startswith(str(REPO / "src")) for f in files), files  # the code under test


def actor_attr(rb: Any, name: str) -> Any:
    return ray.get(rb._rb._getattr.remote(name))


@requires_ray
@pytest.mark.usefixtures("local_ray")
def test_slice_sampler_in_a_ray_buffer() -> None:
    rb = RayReplayBuffer(
        replay_buffer_cls=fastreplay.TensorDictReplayBuffer,
        storage=functools.partial(LazyTensorStorage, CAPACITY),
        sampler=functools.partial(fastreplay.SliceSampler, num_slices=NUM_SLICES, traj_key="traj"),
        batch_size=BATCH,
        remote_config=REMOTE,
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


@requires_ray
@pytest.mark.usefixtures("local_ray")
def test_prioritized_buffer_in_ray_tracks_the_live_max() -> None:
    rb = RayReplayBuffer(
        replay_buffer_cls=fastreplay.TensorDictPrioritizedReplayBuffer,
        alpha=0.7,
        beta=0.5,
        storage=functools.partial(LazyTensorStorage, CAPACITY),
        batch_size=BATCH,
        remote_config=REMOTE,
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


@requires_ray
@pytest.mark.usefixtures("local_ray")
def test_ray_apex_example_runs() -> None:
    """``docs/examples/ray_apex.py`` (linked from docs/scale_out.md) runs end to end."""
    example = runpy.run_path(str(REPO / "docs" / "examples" / "ray_apex.py"))
    out = example["main"](num_actors=2, episodes=20, steps=20)
    assert out["written"] == out["stored"] == 2 * 20 * 25
    assert out["live_max"] == out["max_stored_priority"] <= 25


# ------------------------------------------------------------- bad set-ups fail at construction
def _bad_slice_sampler() -> Any:
    return functools.partial(fastreplay.SliceSampler, num_slices=-3, traj_key="traj")


def _fastreplay_ray_buffer(**kwargs: Any) -> Any:
    return fastreplay.RayReplayBuffer(remote_config=REMOTE, batch_size=BATCH, **kwargs)


def _torchrl_ray_buffer(**kwargs: Any) -> Any:
    return RayReplayBuffer(remote_config=REMOTE, batch_size=BATCH, **kwargs)


def _service_backend(replay_buffer_cls: Any, **kwargs: Any) -> Any:
    options = {"remote_config": REMOTE}
    return replay_buffer_cls(
        batch_size=BATCH, service_backend="ray", service_backend_options=options, **kwargs
    )


BAD = [
    pytest.param(  # TorchRL's buffer class, fastreplay's sampler with a bad argument
        lambda: _fastreplay_ray_buffer(
            replay_buffer_cls=trl.TensorDictReplayBuffer,
            storage=functools.partial(LazyTensorStorage, CAPACITY),
            sampler=_bad_slice_sampler(),
        ),
        ValueError,
        r"num_slices must be at least 1, got num_slices=-3; pass a positive int",
        id="fastreplay.RayReplayBuffer-bad-sampler",
    ),
    pytest.param(  # TorchRL's RayReplayBuffer, fastreplay's buffer: a storage it cannot share
        lambda: _torchrl_ray_buffer(
            replay_buffer_cls=fastreplay.TensorDictReplayBuffer,
            storage=functools.partial(ListStorage, CAPACITY),
            shared=True,
        ),
        ValueError,
        r"storage=ListStorage lives in one process.*pass storage=LazyMemmapStorage\(max_size, "
        r"shared_init=True\)",
        id="torchrl.RayReplayBuffer-unshareable-storage",
    ),
    pytest.param(  # service_backend="ray" on fastreplay's class: a bad alpha
        lambda: _service_backend(
            fastreplay.TensorDictPrioritizedReplayBuffer,
            alpha=-0.5,
            beta=0.5,
            storage=functools.partial(LazyTensorStorage, CAPACITY),
        ),
        ValueError,
        r"alpha",
        id="service_backend-bad-alpha",
    ),
]


@requires_ray
@pytest.mark.usefixtures("local_ray")
@pytest.mark.parametrize(("build", "error", "match"), BAD)
def test_bad_setup_fails_at_construction(
    build: Any, error: type, match: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    killed: list[Any] = []
    kill = ray.kill
    monkeypatch.setattr(ray, "kill", lambda actor, **kw: (killed.append(kw), kill(actor, **kw)))
    lease = _ray_runtime_lease()
    before = lease._leases if lease else None
    with pytest.raises(error, match=match) as info:
        build()
    assert killed == [{"no_restart": True}]  # the half-built actor is stopped
    if lease:  # TorchRL's hold on the Ray runtime (0.14 on) is given back
        assert lease._leases == before
    if sys.version_info >= (3, 11):  # the remote traceback comes along
        assert any("in its Ray actor" in note for note in info.value.__notes__)


@requires_ray
@pytest.mark.usefixtures("local_ray")
def test_construction_error_comes_before_any_call() -> None:
    """TorchRL's own buffer class in ``fastreplay.RayReplayBuffer``: same guarantee."""
    started = time.monotonic()
    with pytest.raises(fastreplay.samplers.slice.SliceSamplerError, match="num_slices=-3"):
        fastreplay.RayReplayBuffer(
            replay_buffer_cls=trl.ReplayBuffer,
            storage=functools.partial(LazyTensorStorage, CAPACITY),
            sampler=_bad_slice_sampler(),
            remote_config=REMOTE,
        )
    assert time.monotonic() - started < 120


@requires_ray
@pytest.mark.usefixtures("local_ray")
def test_buffer_class_not_importable_on_workers(tmp_path: Path) -> None:
    """A Ray set-up missing what it needs: the workers cannot import the buffer's module."""
    (tmp_path / "driver_only_buffers.py").write_text(
        "import fastreplay\n\n\nclass LocalBuffer(fastreplay.TensorDictReplayBuffer):\n    pass\n"
    )
    sys.path.insert(0, str(tmp_path))
    try:
        from driver_only_buffers import LocalBuffer  # type: ignore[import-not-found]

        match = (
            r"LocalBuffer did not start \(ModuleNotFoundError: No module named "
            r"'driver_only_buffers'\); driver_only_buffers and every class passed to the buffer "
            r"must be importable on the Ray workers"
        )
        with pytest.raises(RuntimeError, match=match):
            _fastreplay_ray_buffer(
                replay_buffer_cls=LocalBuffer,
                storage=functools.partial(LazyTensorStorage, CAPACITY),
            )
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("driver_only_buffers", None)


@requires_ray
@pytest.mark.usefixtures("local_ray")
def test_service_backend_runs_end_to_end() -> None:
    """``fastreplay.TensorDictReplayBuffer(service_backend="ray")``: a good set-up still runs."""
    rb = _service_backend(
        fastreplay.TensorDictReplayBuffer,
        storage=functools.partial(LazyTensorStorage, CAPACITY),
        sampler=functools.partial(fastreplay.SliceSampler, num_slices=NUM_SLICES, traj_key="traj"),
    )
    try:
        assert isinstance(rb, RayReplayBuffer) and rb.service_backend == "ray"
        assert type(actor_attr(rb, "_sampler")) is fastreplay.SliceSampler
        run_writers(rb, 0, 5)
        assert rb.write_count == len(rb) == 90
        for _ in range(5):
            assert_valid(rb.sample(), NUM_SLICES)
    finally:
        rb.close()


def test_replay_buffer_cls_must_be_a_class() -> None:
    """Checked before Ray is started (or looked for): no actor, nothing to clean up."""
    for bad in (functools.partial(fastreplay.TensorDictReplayBuffer), "TensorDictReplayBuffer"):
        with pytest.raises(TypeError, match=r"is not a replay-buffer class; pass the class"):
            fastreplay.RayReplayBuffer(replay_buffer_cls=bad)
    with pytest.raises(AttributeError, match=r"replay_buffer_cls=int \(of type type\)"):
        fastreplay.RayReplayBuffer(replay_buffer_cls=int)  # TorchRL: AttributeError


def test_missing_ray_fails_at_construction(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fastreplay.ray_buffer, "_ray_installed", lambda: False)  # as without Ray
    with pytest.raises(RuntimeError, match=r"Ray is not installed; pip install ray,"):
        fastreplay.RayReplayBuffer(
            replay_buffer_cls=fastreplay.TensorDictReplayBuffer,
            storage=functools.partial(LazyTensorStorage, CAPACITY),
        )


def test_ray_buffer_signature() -> None:
    params = inspect.signature(fastreplay.RayReplayBuffer).parameters
    torchrl_own = {"replay_buffer_cls", "ray_init_config", "remote_config", "transport"}
    assert torchrl_own | {"transport_options", "delayed_init", "storage", "sampler"} <= set(params)
    names = list(params)
    assert names[0] == "replay_buffer_cls" and names[-1] == "kwargs"
    assert params["kwargs"].kind is inspect.Parameter.VAR_KEYWORD  # replay_buffer_cls's own
    assert issubclass(fastreplay.RayReplayBuffer, RayReplayBuffer)

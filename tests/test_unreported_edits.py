"""Done flags (and versions) edited in place through a view of the storage, then a write.

A user fixes a stored done flag through a view (``storage[:]["next", "done"][4] = True``)
and the buffer is written again (``extend``, ``add``) before the next sample. TorchRL's
classes read the flags again after every write, so they see the fix; fastreplay's indices
follow the writes they are told about, and must count the edit as a write nobody told them
about (the flag tensor's version counter moved by more than the reported writes). Each case
runs the same seeded workload through TorchRL's class and fastreplay's (sample units and
samplers in both libraries' buffers) and compares the samples; each also checks what the fix
means against the data (``obs = row``): no window, slice or relabelled goal reaches into the
next episode.

Edits that move no version counter of this process (``tensor.data``) are the documented
case for ``invalidate_boundaries()``, tested last.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torchrl.data as trl
from tensordict import TensorDict
from torchrl.data import LazyMemmapStorage, LazyTensorStorage

import fastreplay
from conformance.conftest import BUFFER_SIDES, FASTREPLAY_BUFFER, TORCHRL_BUFFER, make_buffer
from conftest import assert_same_tensordict
from fastreplay._core.version_buckets import VersionBuckets
from fastreplay._torchrl import HAS_SAMPLE_UNITS, TORCHRL_VERSION, TorchRLSubgoalTriplet

DONE = ("next", "done")
CAPACITY = 64
requires_units = pytest.mark.skipif(
    not HAS_SAMPLE_UNITS, reason=f"TorchRL {TORCHRL_VERSION} has no sample units"
)
requires_subgoal = pytest.mark.skipif(
    TorchRLSubgoalTriplet is None, reason=f"TorchRL {TORCHRL_VERSION} has no SubgoalTriplet"
)


def rows(first: int, n: int, done: tuple[int, ...]) -> TensorDict:
    """Rows ``first .. first + n`` (``obs`` = the row), done at the absolute rows ``done``."""
    obs = torch.arange(first, first + n)
    flags = torch.zeros(n, 1, dtype=torch.bool)
    for row in done:
        flags[row - first] = True
    return TensorDict(
        {
            "obs": obs,
            "desired_goal": torch.full((n, 1), -1),
            "achieved_goal": obs[:, None],
            ("next", "reward"): torch.zeros(n, 1),
            DONE: flags,
        },
        [n],
    )


def edit_through_view(storage: Any, row: int) -> None:
    """Set the done flag of ``row`` through a view of the stored entry (no write reported)."""
    storage[:][DONE][row] = True


def edit_behind_counters(storage: Any, row: int) -> None:
    """Set it through ``.data``, which shares the memory and not the version counter."""
    storage._storage.get(DONE).data[row] = True


def write(rb: Any, how: str) -> None:
    """The reported write after the edit: rows 10-19, one episode ending at row 19."""
    if how == "extend":
        rb.extend(rows(10, 10, (19,)))
    else:  # one row at a time
        for row in rows(10, 10, (19,)).unbind(0):
            rb.add(row)


def workload(
    rb: Any, edit: Callable[[Any, int], None] = edit_through_view, how: str = "extend"
) -> Any:
    """Rows 0-9 (one episode, ending at row 9), a sample, row 4 fixed to end an episode,
    rows 10-19, then the sample to compare."""
    rb.extend(rows(0, 10, (9,)))
    rb.sample()  # the index now holds rows 0-9
    edit(rb.storage, 4)
    write(rb, how)
    torch.manual_seed(5)
    return rb.sample()


# ----------------------------------------------------------------------- sample units
def _unit(side: str, name: str, **kwargs: Any) -> Any:
    module = trl.replay_buffers if side == "torchrl" else fastreplay
    return getattr(module, name)(**kwargs)


def _unit_buffer(side: str, unit: Any, storage: Any = None) -> Any:
    return make_buffer(
        side,
        "TensorDictReplayBuffer",
        storage=LazyTensorStorage(CAPACITY) if storage is None else storage,
        batch_size=8,
        sample_unit=unit,
        generator=torch.Generator().manual_seed(3),
    )


@requires_units
@pytest.mark.parametrize("how", ["extend", "add"])
@pytest.mark.parametrize("unit_side", ["torchrl", "fastreplay"])
@pytest.mark.parametrize("buffer_side", BUFFER_SIDES)
def test_sequence_sees_a_view_edit_before_a_write(buffer_side: str, unit_side: str, how: str):
    """TorchRL's window for anchor 2 ends at the fixed flag: ``[2, 3, 4, 4, 4, 4]``."""
    config = {"length": 6}
    want = workload(_unit_buffer(TORCHRL_BUFFER, _unit("torchrl", "Sequence", **config)), how=how)
    rb = _unit_buffer(buffer_side, _unit(unit_side, "Sequence", **config))
    got = workload(rb, how=how)
    assert_same_tensordict(got, want)
    unit = fastreplay.sample_units.fast_unit(rb._sample_unit)
    index, info = unit.expand(torch.arange(20), {}, rb.storage)
    ref = _unit("torchrl", "Sequence", **config).expand(torch.arange(20), {}, rb.storage)
    assert torch.equal(index, ref[0])
    assert all(torch.equal(info[k], ref[1][k]) for k in ref[1])
    assert index.reshape(20, 6)[2].tolist() == [2, 3, 4, 4, 4, 4]
    assert info["validity_mask"].reshape(20, 6)[2].tolist() == [True] * 3 + [False] * 3
    windows = index.reshape(20, 6)
    valid = info["validity_mask"].reshape(20, 6)
    assert not ((windows[:5] > 4) & valid[:5]).any()  # nothing valid past the fixed end


@requires_units
@pytest.mark.parametrize("buffer_side", BUFFER_SIDES)
def test_sequence_sees_an_edit_after_a_write(buffer_side: str) -> None:
    """The edit after the reported write, before the sample: also seen."""
    samples = []
    for side, unit_side in ((TORCHRL_BUFFER, "torchrl"), (buffer_side, "fastreplay")):
        rb = _unit_buffer(side, _unit(unit_side, "Sequence", length=6))
        rb.extend(rows(0, 10, (9,)))
        rb.sample()
        write(rb, "extend")
        edit_through_view(rb.storage, 4)
        rb.extend(rows(20, 3, ()))  # TorchRL's index is rebuilt after a write only
        torch.manual_seed(5)
        samples.append(rb.sample())
    assert_same_tensordict(samples[1], samples[0])


@requires_subgoal
@pytest.mark.parametrize("unit_side", ["torchrl", "fastreplay"])
@pytest.mark.parametrize("buffer_side", BUFFER_SIDES)
def test_subgoal_triplet_sees_a_view_edit_before_a_write(buffer_side: str, unit_side: str):
    config = {"goal_discount": 0.9}
    want = workload(_unit_buffer(TORCHRL_BUFFER, _unit("torchrl", "SubgoalTriplet", **config)))
    got = workload(_unit_buffer(buffer_side, _unit(unit_side, "SubgoalTriplet", **config)))
    assert_same_tensordict(got, want)
    obs = got["obs"].reshape(-1, 4)
    first = obs[:, 0] <= 4  # anchors of the fixed episode: every record in rows 0-4
    assert (obs[first] <= 4).all()


# ------------------------------------------------------------------------------- HER
def her_reward(td: Any) -> torch.Tensor:
    return (td["achieved_goal"] == td["desired_goal"]).all(-1, keepdim=True).float()


def _her(side: str, storage: Any = None, **kwargs: Any) -> Any:
    cls = trl.HERReplayBuffer if side == "torchrl" else fastreplay.HERReplayBuffer
    return cls(
        reward_fn=her_reward,
        her_ratio=1.0,
        strategy="final",
        storage=LazyTensorStorage(CAPACITY) if storage is None else storage,
        batch_size=32,
        generator=torch.Generator().manual_seed(3),
        **kwargs,
    )


@pytest.mark.parametrize("how", ["extend", "add"])
@pytest.mark.parametrize("memmap", [False, True], ids=["tensor", "memmap"])
def test_her_final_goal_is_the_fixed_episode_s(memmap: bool, how: str) -> None:
    """Rows 0-4 get row 4's goal (TorchRL's), not row 9's, and the reward that goes with it."""
    storages = [LazyMemmapStorage(CAPACITY) if memmap else None for _ in range(2)]
    want = workload(_her("torchrl", storages[0]), how=how)
    got = workload(_her("fastreplay", storages[1]), how=how)
    assert_same_tensordict(got, want)
    first = got["obs"] <= 4
    assert first.any()
    assert (got["desired_goal"][first] == 4).all()
    assert (got[("next", "reward")][first & (got["obs"] == 4)] == 1).all()
    assert (got[("next", "reward")][first & (got["obs"] < 4)] == 0).all()


@pytest.mark.parametrize("buffer_side", BUFFER_SIDES)
def test_slice_sampler_sees_a_view_edit_before_a_write(buffer_side: str) -> None:
    """The slice samplers share the index's check: slices end at the fixed flag."""

    def run(side: str, sampler: Any) -> Any:
        rb = make_buffer(
            side,
            "TensorDictReplayBuffer",
            storage=LazyTensorStorage(CAPACITY),
            sampler=sampler,
            batch_size=12,
            generator=torch.Generator().manual_seed(3),
        )
        return workload(rb)

    want = run(TORCHRL_BUFFER, trl.SliceSampler(slice_len=3, end_key=DONE))
    got = run(buffer_side, fastreplay.SliceSampler(slice_len=3, end_key=DONE))
    assert_same_tensordict(got, want)
    obs = got["obs"].reshape(-1, 3)
    assert not ((obs[:, 0] <= 4) & (obs[:, -1] > 4)).any()  # no slice across row 4


SLICE_SAMPLERS = {
    "SliceSampler": lambda: fastreplay.SliceSampler(slice_len=3, end_key=DONE),
    "SliceSamplerWithoutReplacement": lambda: fastreplay.SliceSamplerWithoutReplacement(
        slice_len=3, end_key=DONE
    ),
    "PrioritizedSliceSampler": lambda: fastreplay.PrioritizedSliceSampler(
        max_capacity=CAPACITY, alpha=0.7, beta=0.5, slice_len=3, end_key=DONE
    ),
}


@pytest.mark.parametrize("name", list(SLICE_SAMPLERS))
@pytest.mark.parametrize("buffer_side", BUFFER_SIDES)
def test_slice_samplers_boundaries_after_a_view_edit(buffer_side: str, name: str) -> None:
    """Every slice sampler's boundaries are TorchRL's scan of the storage as it is now."""
    sampler = SLICE_SAMPLERS[name]()
    rb = make_buffer(
        buffer_side,
        "TensorDictReplayBuffer",
        storage=LazyTensorStorage(CAPACITY),
        sampler=sampler,
        batch_size=3,  # one slice: an epoch without replacement never runs short
    )
    workload(rb)
    got = sampler._get_stop_and_length(rb.storage)
    want = trl.SliceSampler(slice_len=3, end_key=DONE)._get_stop_and_length(rb.storage)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert got[1].reshape(-1).tolist()[0] == 4  # the fixed flag ends the first trajectory


@pytest.mark.parametrize("buffer_side", BUFFER_SIDES)
def test_staleness_sampler_sees_a_view_edit_before_a_write(buffer_side: str) -> None:
    """A version fixed in place, then a write: the probabilities are TorchRL's again."""
    sampler = fastreplay.StalenessAwareSampler(max_staleness=3)
    sampler.consumer_version = 10
    rb = make_buffer(
        buffer_side,
        "ReplayBuffer",
        storage=LazyTensorStorage(CAPACITY),
        sampler=sampler,
        batch_size=8,
    )
    rb.extend(TensorDict({"policy_version": torch.arange(10)}, [10]))
    rb.sample()
    rb.storage[:]["policy_version"][0] = 10  # row 0 is fresh now
    rb.extend(TensorDict({"policy_version": torch.full((5,), 9)}, [5]))
    rb.sample()
    versions = rb.storage._storage["policy_version"][: len(rb.storage)].double()
    stale = 10 - versions
    weights = torch.where(stale <= 3, 1.0 / (stale + 1.0), torch.zeros_like(stale))
    assert torch.allclose(sampler.probabilities(rb.storage), weights / weights.sum())
    assert float(sampler.probabilities(rb.storage)[0]) > 0


# -------------------------------------------------------------------- the public remedy
@requires_units
@pytest.mark.parametrize("scope", ["storage", "all"])
@pytest.mark.parametrize("name", ["Sequence", "SubgoalTriplet"])
def test_units_invalidate_boundaries(name: str, scope: str) -> None:
    """After an edit no version counter shows, ``invalidate_boundaries()`` is the remedy."""
    if name == "SubgoalTriplet" and TorchRLSubgoalTriplet is None:
        pytest.skip(f"TorchRL {TORCHRL_VERSION} has no SubgoalTriplet")
    config = {"length": 6} if name == "Sequence" else {"goal_discount": 0.9}
    samples = []
    for side in ("torchrl", "fastreplay"):
        unit = _unit(side, name, **config)
        rb = _unit_buffer(TORCHRL_BUFFER if side == "torchrl" else FASTREPLAY_BUFFER, unit)

        def edit(storage: Any, row: int, unit: Any = unit) -> None:
            edit_behind_counters(storage, row)
            if isinstance(unit, fastreplay.sample_units._IndexedUnit):
                unit.invalidate_boundaries(storage if scope == "storage" else None)

        samples.append(workload(rb, edit))
    assert_same_tensordict(samples[1], samples[0])


def test_her_invalidate_boundaries() -> None:
    """The same for ``HERReplayBuffer``: its episode ends and its sampler's boundaries."""

    def edit(storage: Any, row: int) -> None:
        edit_behind_counters(storage, row)
        rb.invalidate_boundaries()

    want = workload(_her("torchrl"), edit_behind_counters)
    rb = _her("fastreplay")
    got = workload(rb, edit)
    assert_same_tensordict(got, want)
    first = got["obs"] <= 4
    assert (got["desired_goal"][first] == 4).all()


# ---------------------------------------------------------------------- remote writes
def _write_versions(rb: Any, first: int, n: int) -> None:
    """Writer process: ``n`` rows of versions ``first ..``, in three writes."""
    for part in torch.arange(first, first + n).tensor_split(3):
        rb.extend(TensorDict({"policy_version": part}, [part.numel()]))


@pytest.mark.skipif(
    "fork" not in multiprocessing.get_all_start_methods(), reason="needs 'fork' (Linux)"
)
def test_remote_writes_move_no_counter_here(monkeypatch: pytest.MonkeyPatch) -> None:
    """Writes another process made are reported to the staleness sampler as theirs: they
    moved no version counter of this process, so they are read incrementally (a few rows
    each, beside a local write), without the full reread a write nobody reported costs, and
    the probabilities are exact."""
    rebuilds: list[int] = []
    rebuild = VersionBuckets.rebuild

    def counting(self: Any, versions: Any) -> None:
        rebuilds.append(1)
        rebuild(self, versions)

    monkeypatch.setattr(VersionBuckets, "rebuild", counting)
    sampler = fastreplay.StalenessAwareSampler(max_staleness=5)
    sampler.consumer_version = 30
    rb = fastreplay.TensorDictReplayBuffer(
        storage=LazyMemmapStorage(CAPACITY, shared_init=True),
        sampler=sampler,
        batch_size=8,
        shared=True,
    )
    rb.extend(TensorDict({"policy_version": torch.arange(40) % 10 + 20}, [40]))
    rb.sample()
    assert len(rebuilds) == 1  # the first sample reads the storage once
    for first in (18, 22):
        proc = multiprocessing.get_context("fork").Process(
            target=_write_versions, args=(rb, first, 9)
        )
        proc.start()
        proc.join(30)
        if proc.is_alive():  # pragma: no cover - a hang: fail, never block the suite
            proc.kill()
        assert proc.exitcode == 0
        rb.extend(TensorDict({"policy_version": torch.full((2,), 27)}, [2]))  # a local write
        rb.sample()
    assert len(rebuilds) == 1
    versions = rb.storage._storage["policy_version"][: len(rb.storage)].double()
    stale = 30 - versions
    weights = torch.where(stale <= 5, 1.0 / (stale + 1.0), torch.zeros_like(stale))
    assert torch.allclose(sampler.probabilities(rb.storage), weights / weights.sum())

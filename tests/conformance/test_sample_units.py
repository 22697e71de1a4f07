"""Sample units (``Sequence``, the nightly's ``SubgoalTriplet``): fastreplay's against TorchRL's.

Every combination of [TorchRL's unit, fastreplay's unit] x [TorchRL's buffer, fastreplay's
buffer] runs the same seeded workload as TorchRL's buffer with TorchRL's unit and the same
sampler class, and must return the same samples and info, key by key, and leave the same
priorities after ``update_tensordict_priority``. Writes come in chunks of odd sizes into
odd capacities, so windows wrap around the storage end and episodes span writes. Each
sample is also checked against a brute-force oracle computed from the written stream
(``obs = traj * 10_000 + step``): a window that crosses an episode, or a wrong validity
mask, is caught whatever TorchRL does.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torchrl.data as trl
from tensordict import TensorDict
from torchrl.data import LazyTensorStorage

import fastreplay
from conformance.conftest import FASTREPLAY_BUFFER, TORCHRL_BUFFER, make_buffer
from conftest import TORCHRL_EXT, assert_same_tensordict
from fastreplay import sample_units
from fastreplay._torchrl import (
    HAS_EPISODE_BOUNDARIES,
    HAS_SAMPLE_UNITS,
    TORCHRL_VERSION,
    TorchRLSequence,
    TorchRLSubgoalTriplet,
)

pytestmark = pytest.mark.skipif(
    not HAS_SAMPLE_UNITS, reason=f"TorchRL {TORCHRL_VERSION} has no sample units"
)
requires_subgoal = pytest.mark.skipif(
    TorchRLSubgoalTriplet is None, reason=f"TorchRL {TORCHRL_VERSION} has no SubgoalTriplet"
)

DONE = ("next", "done")
LENGTHS = [5, 9, 2, 13, 1, 30, 4]  # episode lengths, cycled (a one-step episode included)
WRITES = [30, 25, 41, 13, 60, 7, 33, 19]  # rows per write (per column for ndim=2)
CAPACITY = {1: 97, 2: 57}  # ndim=2: 3 columns x 19 rows
COLUMNS = 3
BATCH = 6

CONFIGS = [
    {"length": 4},
    {"length": 5, "burn_in": 3, "bootstrap": 2},
    {"length": 3, "episode_boundary": "stop", "burn_in": 2, "bootstrap": 1},
    {"length": 3, "episode_boundary": "stop", "dilation": 2},
    {"length": 4, "episode_boundary": "include_reset", "burn_in": 3, "bootstrap": 2},
    {"length": 2, "dilation": 3, "burn_in": 1, "bootstrap": 1},
    {"length": 4, "done_key": None, "burn_in": 2},
]
SAMPLERS = ["random", "prioritized", "without-replacement", "torchrl-prioritized"]
UNIT_SIDES = ["torchrl-unit", "fastreplay-unit"]


def _stream(total: int, column: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``total`` steps of back-to-back episodes: ``(obs, done)``, ``obs = traj*10_000+step``."""
    traj = torch.empty(total, dtype=torch.long)
    step = torch.empty(total, dtype=torch.long)
    t, k, tid = 0, column, column * 1000
    while t < total:
        m = min(LENGTHS[k % len(LENGTHS)], total - t)
        traj[t : t + m], step[t : t + m] = tid, torch.arange(m)
        t, k, tid = t + m, k + 1, tid + 1
    done = torch.zeros(total, dtype=torch.bool)
    done[:-1] = traj[1:] != traj[:-1]  # the last step's episode goes on past the stream
    return traj * 10_000 + step, done


def _data(ndim: int) -> tuple[TensorDict, torch.Tensor, torch.Tensor]:
    total = sum(WRITES)
    if ndim == 1:
        obs, done = _stream(total, 0)
        td = TensorDict({"obs": obs, DONE: done[:, None]}, [total])
        return td, obs[None], done[None]
    streams = [_stream(total, c) for c in range(COLUMNS)]
    obs = torch.stack([s[0] for s in streams])
    done = torch.stack([s[1] for s in streams])
    return TensorDict({"obs": obs, DONE: done[..., None]}, [COLUMNS, total]), obs, done


def _sampler(name: str, capacity: int) -> Any:
    if name == "random":
        return trl.RandomSampler()
    if name == "without-replacement":
        return trl.SamplerWithoutReplacement()
    if name == "prioritized":
        return fastreplay.PrioritizedSampler(capacity, 0.7, 0.5)
    return trl.PrioritizedSampler(capacity, 0.7, 0.5)


def _unit(side: str, cls: str, config: dict) -> Any:
    module = trl.replay_buffers if side == "torchrl-unit" else fastreplay
    return getattr(module, cls)(**config)


def _run(buffer_side: str, unit: Any, sampler: str, ndim: int) -> tuple[list, Any]:
    """The workload: writes, a sample after every other write, priority updates."""
    capacity = CAPACITY[ndim]
    if sampler == "torchrl-prioritized" and not TORCHRL_EXT:
        pytest.skip("TorchRL's PrioritizedSampler needs its compiled extension")
    rb = make_buffer(
        buffer_side,
        "TensorDictReplayBuffer",
        storage=LazyTensorStorage(capacity, ndim=ndim),
        sampler=_sampler(sampler, capacity),
        batch_size=BATCH,
        sample_unit=unit,
        generator=torch.Generator().manual_seed(3),
    )
    data, obs, done = _data(ndim)
    gen = torch.Generator().manual_seed(11)
    out, written = [], 0
    for i, n in enumerate(WRITES):
        chunk = data[written : written + n] if ndim == 1 else data[:, written : written + n]
        rb.extend(chunk)
        written += n
        if i % 2 == 0 and i:
            continue
        sample, info = rb.sample(return_info=True)
        _check_oracle(sample, unit, obs, done, written, capacity // (1 if ndim == 1 else 3))
        out.append((sample.clone(), info))
        if "prioritized" in sampler:
            sample["td_error"] = torch.rand(sample.shape, generator=gen)
            rb.update_tensordict_priority(sample)
    return out, rb


def _check_oracle(
    sample: TensorDict, unit: Any, obs: torch.Tensor, done: torch.Tensor, written: int, rows: int
) -> None:
    """Each window's records and validity, computed from the written stream by brute force."""
    if not isinstance(unit, TorchRLSequence):
        return
    total = unit.burn_in + unit.length + unit.bootstrap
    anchors = sample["anchor_index"].reshape(-1, total, *sample["anchor_index"].shape[1:])[:, 0]
    got = sample["obs"].reshape(-1, total)
    valid = sample["validity_mask"].reshape(-1, total)
    oldest, newest = max(0, written - rows), written - 1
    for b, anchor in enumerate(anchors.tolist()):
        row, col = (anchor, 0) if isinstance(anchor, int) else anchor
        pos = row + rows * ((newest - row) // rows)  # the stream position stored at row
        first, last = oldest, newest
        if unit.done_key is not None and unit.episode_boundary != "include_reset":
            first = pos
            while first > oldest and not done[col, first - 1]:
                first -= 1
            last = pos
            while last < newest and not done[col, last]:
                last += 1
        if unit.episode_boundary == "stop":
            shortfall = unit.dilation * (unit.length + unit.bootstrap - 1) - (last - pos)
            pos -= min(max(shortfall, 0), pos - first)
        offsets = [(j - unit.burn_in) * unit.dilation for j in range(total)]
        want = [min(max(pos + o, first), last) for o in offsets]
        assert got[b].tolist() == [int(obs[col, p]) for p in want], (b, anchor)
        assert valid[b].tolist() == [first <= pos + o <= last for o in offsets], (b, anchor)


def _assert_same_runs(got: list, expected: list) -> None:
    for (sample, info), (ref_sample, ref_info) in zip(got, expected, strict=True):
        assert_same_tensordict(sample, ref_sample)
        assert list(info) == list(ref_info)
        for key, value in info.items():
            ref = ref_info[key]
            if isinstance(value, tuple):
                assert all(torch.equal(a, b) for a, b in zip(value, ref, strict=True)), key
            else:
                assert torch.equal(torch.as_tensor(value), torch.as_tensor(ref)), key


def _priorities(rb: Any) -> torch.Tensor | None:
    sampler = rb._sampler
    if not hasattr(sampler, "_sum_tree"):
        return None
    capacity = len(rb.storage) if rb.storage.ndim == 1 else rb.storage.max_size
    return torch.tensor([sampler._sum_tree[i] for i in range(capacity)])


@pytest.mark.parametrize("ndim", [1, 2])
@pytest.mark.parametrize("sampler", SAMPLERS)
@pytest.mark.parametrize(
    "config", CONFIGS, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items())
)
@pytest.mark.parametrize("unit_side", UNIT_SIDES)
@pytest.mark.parametrize("buffer_side", [TORCHRL_BUFFER, FASTREPLAY_BUFFER])
def test_sequence_matches_torchrl(
    buffer_side: str, unit_side: str, config: dict, sampler: str, ndim: int
) -> None:
    if ndim == 2 and sampler == "without-replacement":
        pytest.skip("TorchRL's SamplerWithoutReplacement draws flat rows on ndim=2 storages")
    expected, ref = _run(TORCHRL_BUFFER, _unit("torchrl-unit", "Sequence", config), sampler, ndim)
    got, rb = _run(buffer_side, _unit(unit_side, "Sequence", config), sampler, ndim)
    _assert_same_runs(got, expected)
    priorities = _priorities(ref)
    if priorities is not None:
        assert torch.equal(_priorities(rb), priorities)


@requires_subgoal
@pytest.mark.parametrize("sampler", ["random", "prioritized"])
@pytest.mark.parametrize("discounts", [(0.9, None), (None, 0.5)])
@pytest.mark.parametrize("unit_side", UNIT_SIDES)
@pytest.mark.parametrize("buffer_side", [TORCHRL_BUFFER, FASTREPLAY_BUFFER])
def test_subgoal_triplet_matches_torchrl(
    buffer_side: str, unit_side: str, discounts: tuple, sampler: str
) -> None:
    config = {"goal_discount": discounts[0], "policy_goal_discount": discounts[1]}
    expected, ref = _run(
        TORCHRL_BUFFER, _unit("torchrl-unit", "SubgoalTriplet", config), sampler, 1
    )
    got, rb = _run(buffer_side, _unit(unit_side, "SubgoalTriplet", config), sampler, 1)
    _assert_same_runs(got, expected)
    for sample, _ in got:  # the four records of each anchor lie in its episode, in order
        obs = sample["obs"].reshape(-1, 4)
        valid = sample["validity_mask"].reshape(-1, 4)[:, 0]
        traj, step = obs // 10_000, obs % 10_000
        assert (traj == traj[:, :1]).all()
        assert ((step[:, 1] < step[:, 2]) | ~valid).all() and (step[:, 0] <= step[:, 1]).all()
        assert torch.equal(sample["step_offset"].reshape(-1, 4), step - step[:, :1])
    priorities = _priorities(ref)
    if priorities is not None:
        assert torch.equal(_priorities(rb), priorities)


def test_direct_path_expands(monkeypatch: pytest.MonkeyPatch) -> None:
    """fastreplay's buffer samples a TorchRL ``Sequence`` without TorchRL's ``_sample``."""
    unit = trl.replay_buffers.Sequence(length=3, burn_in=1)
    rb = fastreplay.TensorDictReplayBuffer(
        storage=LazyTensorStorage(CAPACITY[1]), batch_size=BATCH, sample_unit=unit
    )
    data, _, _ = _data(1)
    rb.extend(data[:40])

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("TorchRL's _sample ran")

    monkeypatch.setattr(trl.TensorDictReplayBuffer, "_sample", refuse)
    rb.extend(data[40:90])
    sample = rb.sample()
    assert sample.shape == (BATCH * 4,)
    assert rb._fr_sample_unit is unit and type(unit) is trl.replay_buffers.Sequence


@pytest.mark.parametrize("buffer_side", [TORCHRL_BUFFER, FASTREPLAY_BUFFER])
def test_index_is_incremental(buffer_side: str) -> None:
    """Writes through either library's buffer update the index: the writers report them."""
    unit = fastreplay.Sequence(length=4, burn_in=2)
    storage = LazyTensorStorage(CAPACITY[1])
    rb = make_buffer(
        buffer_side, "TensorDictReplayBuffer", storage=storage, batch_size=BATCH, sample_unit=unit
    )
    data, _, _ = _data(1)
    written = 0
    for n in WRITES:
        rb.extend(data[written : written + n])
        written += n
        rb.sample()
    # The first sample reads the storage once (the writes before it were made before the
    # index existed); then each write is read alone, TorchRL's writer's as fastreplay's (the
    # storage's listener is attached to it: ``mark_update``).
    assert sample_units.rebuilds(storage, DONE) == 1


def test_shared_index_and_unreported_write() -> None:
    """Units on one storage share its index; a write nobody reported is still seen."""
    storage = LazyTensorStorage(CAPACITY[1])
    rb = fastreplay.TensorDictReplayBuffer(
        storage=storage, batch_size=BATCH, sample_unit=fastreplay.Sequence(length=3)
    )
    other = fastreplay.Sequence(length=5, burn_in=1)
    reference = trl.replay_buffers.Sequence(length=5, burn_in=1)
    data, _, _ = _data(1)
    rb.extend(data[:60])
    rb.sample()
    storage.set(torch.arange(60, 80), data[60:80])  # not through a buffer: not reported
    anchors = torch.arange(0, 80, 3)
    got = other.expand(anchors, {}, storage)
    want = reference.expand(anchors, {}, storage)
    assert torch.equal(got[0], want[0])
    assert all(torch.equal(got[1][k], want[1][k]) for k in want[1])
    assert sample_units.rebuilds(storage, DONE) == 2


@pytest.mark.parametrize("unit_side", UNIT_SIDES)
def test_float_done_flags_fall_back(unit_side: str) -> None:
    """Float done flags (which TorchRL accepts): TorchRL's boundaries, the same results."""
    storage = LazyTensorStorage(CAPACITY[1])
    data, _, _ = _data(1)
    data[DONE] = data[DONE].float()
    rb = fastreplay.TensorDictReplayBuffer(
        storage=storage, batch_size=BATCH, sample_unit=_unit(unit_side, "Sequence", CONFIGS[1])
    )
    rb.extend(data[:120])
    anchors = torch.arange(0, CAPACITY[1], 5)
    got = rb._sample_unit.expand(anchors, {}, storage)
    want = _unit("torchrl-unit", "Sequence", CONFIGS[1]).expand(anchors, {}, storage)
    assert torch.equal(got[0], want[0])
    assert all(torch.equal(got[1][k], want[1][k]) for k in want[1])


def test_missing_done_key_is_torchrls_error() -> None:
    storage = LazyTensorStorage(CAPACITY[1])
    data, _, _ = _data(1)
    storage.set(torch.arange(50), data[:50])
    anchors = torch.arange(10)
    errors = []
    for unit in (
        trl.replay_buffers.Sequence(3, done_key="gone"),
        fastreplay.Sequence(3, done_key="gone"),
    ):
        with pytest.raises(KeyError) as caught:
            unit.expand(anchors, {}, storage)
        errors.append((type(caught.value), str(caught.value)))
    assert errors[0] == errors[1]


def test_episode_boundary_hook() -> None:
    """fastreplay's ``Sequence`` reads its boundaries through the index on every version."""
    calls = []
    original = sample_units.IndexedBoundaries.for_storage

    def spy(storage: Any, done_key: Any, device: Any) -> Any:
        calls.append(done_key)
        return original(storage, done_key, device)

    storage = LazyTensorStorage(CAPACITY[1])
    data, _, _ = _data(1)
    storage.set(torch.arange(50), data[:50])
    sample_units.IndexedBoundaries.for_storage = spy  # type: ignore[method-assign]
    try:
        fastreplay.Sequence(3).expand(torch.arange(10), {}, storage)
    finally:
        sample_units.IndexedBoundaries.for_storage = original  # type: ignore[method-assign]
    assert calls == [DONE]
    if not HAS_EPISODE_BOUNDARIES:  # 0.14: fastreplay's own expansion reads the index
        assert fastreplay.Sequence.expand is not TorchRLSequence.expand

"""Public attributes assigned between samples take effect, on all three slice samplers.

TorchRL's slice samplers read their public attributes at each ``sample`` (TD-MPC in LeRobot sets
``buffer._sampler.num_slices = k`` before each ``buffer.sample(k * horizon)``). Each case here
builds TorchRL's class and fastreplay's with the same arguments and data, samples, assigns the
same attribute on both, and samples again: fastreplay's ``SliceSampler`` and
``SliceSamplerWithoutReplacement`` must give bit-identical samples (same seed), and
``PrioritizedSliceSampler`` (other random numbers) samples that follow the new setting: the same
info keys and shapes as TorchRL's, every slice inside one trajectory of the keys in use.

The attributes are those TorchRL 0.14.1 reads after ``__init__``: ``SliceSampler.sample`` and
its helpers (``num_slices``, ``slice_len``, ``strict_length``, ``pad_output``, ``span``,
``end_key``, ``end_keys``, ``traj_key``, ``truncated_key``, ``init_key``, ``cache_values``,
``fragmented``, ``step_key``), plus ``drop_last`` and ``shuffle`` for the without-replacement
sampler. ``compile`` and ``use_gpu`` are read by ``__init__`` only (it wraps ``_get_index`` in
``torch.compile`` and resolves the device then): assigning them later changes nothing in
TorchRL, which the cases pin too. ``ends``/``trajectories`` are constructor arguments only
(TorchRL keeps no such attribute).

On other TorchRL versions (what differs is named in ``fastreplay._torchrl``): cases built with
arguments the installed ``SliceSampler`` lacks (0.13: ``end_keys``, ``fragmented``) are skipped;
``init_key`` does not exist on 0.13, which always marks ``is_init``, so assigning it changes
nothing there, in both libraries; and TorchRL 0.13's ``SliceSamplerWithoutReplacement`` keeps its
cached boundaries when ``end_key``/``traj_key`` is assigned
(``KEY_CHANGE_KEEPS_CACHED_BOUNDARIES``): it goes on sampling the old trajectories, which the
cases pin, while fastreplay's follows the new key, as on 0.14. The nightly warns when a flat
sample is shorter than asked for; the cases that provoke it (see :func:`_short`) filter that
warning, which fastreplay gives where TorchRL does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
import torchrl.data as trl
from tensordict import TensorDict

import fastreplay
from conftest import (
    TORCHRL_EXT,
    assert_same_sample,
    requires_slice_args,
    short_flat_batches,
    skip_unless_slice_args,
)
from fastreplay._torchrl import KEY_CHANGE_KEEPS_CACHED_BOUNDARIES

DONE, DONE2 = ("next", "done"), ("next", "done2")
ROWS, CAPACITY = 120, 150
KINDS = ("SliceSampler", "SliceSamplerWithoutReplacement", "PrioritizedSliceSampler")


def _ids(lengths: list[int]) -> torch.Tensor:
    """Trajectory ids of ``ROWS`` steps of back-to-back episodes cycling through ``lengths``."""
    ids, k = [], 0
    while len(ids) < ROWS:
        ids += [k] * lengths[k % len(lengths)]
        k += 1
    return torch.tensor(ids[:ROWS])


def _data() -> TensorDict:
    """Two segmentations of the same steps: ``episode``/``done`` and ``episode2``/``done2``."""
    episode, episode2 = _ids([9, 13, 6, 17, 3, 11]), _ids([11, 5, 20, 7])
    done, done2 = (torch.ones(ROWS, dtype=torch.bool) for _ in range(2))
    done[:-1], done2[:-1] = episode[1:] != episode[:-1], episode2[1:] != episode2[:-1]
    first = torch.ones(ROWS, dtype=torch.bool)
    first[1:] = episode[1:] != episode[:-1]
    step = torch.arange(ROWS) - torch.cummax(torch.where(first, torch.arange(ROWS), 0), 0)[0]
    return TensorDict(
        {
            "obs": torch.arange(ROWS),
            "episode": episode,
            "episode2": episode2,
            DONE: done[:, None],
            DONE2: done2[:, None],
            ("next", "terminated"): (torch.arange(ROWS) % 7 == 0)[:, None],
            "is_init": first[:, None],
            "step_count": step,
            "step2": 100 - step,  # another step order for the fragmented index
        },
        [ROWS],
    )


@dataclass(frozen=True)
class Case:
    attr: str
    value: Any
    ctor: dict = field(default_factory=lambda: {"num_slices": 4, "end_key": DONE})
    kinds: tuple[str, ...] = KINDS
    batch: int = 32
    active: str = "episode"  # the trajectory ids the boundaries in use follow after the change
    consecutive: bool = True  # slices are consecutive rows (not so for a fragmented index)

    def __str__(self) -> str:
        built = ",".join(f"{k}={v!r}" for k, v in self.ctor.items())
        return f"{self.attr}={self.value!r}[{built}]".replace(" ", "")


CASES = [
    # num_slices changed before a batch the old value does not divide (LeRobot's TD-MPC).
    Case("num_slices", 3, batch=15),
    Case("slice_len", 4, ctor={"slice_len": 8, "end_key": DONE}),
    Case("strict_length", False),
    Case("pad_output", True, ctor={"num_slices": 4, "end_key": DONE, "strict_length": False}),
    Case("span", (0, 2)),
    Case("span", (1, True)),
    Case("truncated_key", None),
    Case("truncated_key", ("alt", "truncated")),
    Case("init_key", None),
    Case("end_key", DONE2, active="episode2"),
    Case("end_keys", [DONE2], ctor={"num_slices": 4, "end_keys": [DONE]}, active="episode2"),
    Case("traj_key", "episode2", ctor={"num_slices": 4, "traj_key": "episode"}, active="episode2"),
    # Built with end_key, TorchRL keeps reading end_key: a new traj_key changes nothing.
    Case("traj_key", "episode2"),
    Case("cache_values", True),
    Case("compile", True),
    Case("use_gpu", True),
    Case(
        "fragmented",
        True,
        ctor={"num_slices": 4, "traj_key": "episode"},
        kinds=("SliceSampler",),
        consecutive=False,
    ),
    Case(
        "step_key",
        "step2",
        ctor={"num_slices": 4, "traj_key": "episode", "fragmented": True},
        kinds=("SliceSampler",),
        consecutive=False,
    ),
    Case("drop_last", True, kinds=("SliceSamplerWithoutReplacement",)),
    Case("shuffle", False, kinds=("SliceSamplerWithoutReplacement",)),
    Case("cache_values", False, kinds=("SliceSamplerWithoutReplacement",)),  # TorchRL sets True
]


def _short(kind: str, case: Case) -> bool:
    """Whether the case's flat samples are shorter than asked for (the nightly warns, as TorchRL).

    The without-replacement sampler drops the trajectories shorter than a slice (3 and 6 steps
    here) and runs out of trajectories within an epoch; ``SliceSampler`` is short with
    ``strict_length=False`` (short trajectories) and with a ``span`` (slices cut at the ends).
    """
    if kind == "SliceSamplerWithoutReplacement":
        return True
    return kind == "SliceSampler" and (
        case.attr in ("strict_length", "span") or case.ctor.get("strict_length") is False
    )


PARAMS = [
    pytest.param(
        kind, case, id=f"{kind}-{case}", marks=[short_flat_batches] if _short(kind, case) else []
    )
    for case in CASES
    for kind in case.kinds
]
WOR_SHORT = [short_flat_batches]  # without replacement, short trajectories are dropped
KIND_PARAMS = [
    pytest.param(kind, marks=WOR_SHORT if kind == "SliceSamplerWithoutReplacement" else [])
    for kind in KINDS
]


def _build(module: Any, kind: str, ctor: dict) -> Any:
    cls = getattr(module, kind)
    if kind == "PrioritizedSliceSampler":
        return cls(CAPACITY, 0.7, 0.5, **ctor)
    return cls(**ctor)


def _filled(sampler: Any) -> Any:
    storage = trl.LazyTensorStorage(CAPACITY)
    rb = trl.ReplayBuffer(storage=storage, sampler=sampler)
    data = _data()
    rb.extend(data[:70])
    rb.extend(data[70:])
    return storage


def _draw(sampler: Any, storage: Any, batch: int, seed: int) -> tuple:
    sampler._rng = torch.Generator().manual_seed(seed)
    return sampler.sample(storage, batch)


def _seq_length(sampler: Any, batch: int) -> int:
    return batch // sampler.num_slices if sampler.num_slices is not None else sampler.slice_len


def _check_slices(sampler: Any, storage: Any, drawn: tuple, case: Case) -> None:
    """Every slice: consecutive steps of one trajectory (of ``case.active``), as configured."""
    index, info = drawn
    rows = storage[index]
    seq = _seq_length(sampler, case.batch)
    obs, ids = rows["obs"], rows[case.active]
    mask = info.get(("collector", "mask"))
    truncated = None if sampler.truncated_key is None else info[sampler.truncated_key]
    if mask is not None:  # pad_output: slices of seq steps, padding masked out
        rows_of = (t.view(-1, seq) for t in (obs, ids, mask))
        pieces = [(o[m], i[m]) for o, i, m in zip(*rows_of, strict=True)]
    elif truncated is not None:  # each slice ends where truncated is set
        ends = truncated.reshape(-1).nonzero().squeeze(-1).tolist()
        starts = [0, *(e + 1 for e in ends[:-1])]
        pieces = [(obs[s : e + 1], ids[s : e + 1]) for s, e in zip(starts, ends, strict=True)]
        assert ends[-1] == obs.numel() - 1
    else:
        pieces = list(zip(obs.view(-1, seq), ids.view(-1, seq), strict=True))
    exact = sampler.strict_length and not any(sampler.span)
    for o, i in pieces:
        assert 0 < o.numel() <= seq, (o, seq)
        assert not exact or o.numel() == seq, (o, seq)
        assert (i == i[0]).all(), f"a slice crosses {case.active} trajectories: {i.tolist()}"
        if case.consecutive:
            assert (o.diff() == 1).all(), o.tolist()
    if "priority_weight" in info:
        assert info["priority_weight"].shape == obs.shape


def _same_form(got: tuple, expected: tuple, fixed_length: bool) -> None:
    """Same index dims, info keys and per-step shapes; same length where slices are fixed."""
    assert len(got[0]) == len(expected[0])
    if fixed_length:
        assert [t.shape for t in got[0]] == [t.shape for t in expected[0]]
    assert got[1].keys() == expected[1].keys()
    for key in got[1]:
        assert got[1][key].shape[1:] == expected[1][key].shape[1:], key
        assert got[1][key].shape[0] == got[0][0].shape[0], key


@pytest.mark.parametrize("kind,case", PARAMS)
def test_assigned_attribute_takes_effect_as_in_torchrl(kind: str, case: Case) -> None:
    skip_unless_slice_args(case.ctor)
    # TorchRL 0.13's without-replacement sampler keeps the boundaries it cached before a new
    # end_key/traj_key: its slices follow the old trajectories, fastreplay's the new ones.
    stale_ref = (
        KEY_CHANGE_KEEPS_CACHED_BOUNDARIES
        and kind == "SliceSamplerWithoutReplacement"
        and case.active != "episode"
    )
    fast = _build(fastreplay, kind, case.ctor)
    with_ref = kind != "PrioritizedSliceSampler" or TORCHRL_EXT  # TorchRL's needs its trees
    ref = _build(trl, kind, case.ctor) if with_ref else None
    fast_storage = _filled(fast)
    ref_storage = _filled(ref) if ref is not None else None
    before = _draw(fast, fast_storage, 32, seed=0)  # builds the index and any cache first
    if ref is not None:
        expected = _draw(ref, ref_storage, 32, seed=0)
        if kind != "PrioritizedSliceSampler":
            assert_same_sample(before, expected)

    setattr(fast, case.attr, case.value)
    assert getattr(fast, case.attr) == case.value
    crossed = []  # stale_ref: whether each of TorchRL's samples crosses the new trajectories
    for seed in (1, 2):
        got = _draw(fast, fast_storage, case.batch, seed)
        _check_slices(fast, fast_storage, got, case)
        if ref is None:
            continue
        if seed == 1:
            setattr(ref, case.attr, case.value)
        expected = _draw(ref, ref_storage, case.batch, seed)
        if stale_ref:  # TorchRL 0.13: the old trajectories; the same form as fastreplay's
            _check_slices(ref, ref_storage, expected, Case(case.attr, case.value, case.ctor))
            try:
                _check_slices(ref, ref_storage, expected, case)
            except AssertionError as error:
                crossed.append(f"crosses {case.active} trajectories" in str(error))
            _same_form(got, expected, fixed_length=False)  # other trajectories, other counts
            continue
        _check_slices(ref, ref_storage, expected, case)  # the reference follows the change too
        if kind == "PrioritizedSliceSampler":
            _same_form(got, expected, fast.strict_length and not any(fast.span))
        else:
            assert_same_sample(got, expected)
        if kind == "SliceSamplerWithoutReplacement":
            assert (fast.ran_out, fast._remaining_batches) == (ref.ran_out, ref._remaining_batches)
    if stale_ref:  # the old boundaries show: a slice crosses the new trajectories
        assert any(crossed), crossed


@pytest.mark.parametrize("kind", KIND_PARAMS)
def test_num_slices_set_on_the_buffer_s_sampler_before_each_sample(kind: str) -> None:
    """LeRobot's TD-MPC: ``buffer._sampler.num_slices = k`` then ``buffer.sample(k * horizon)``."""
    horizon = 5
    sampler = _build(fastreplay, kind, {"num_slices": 64, "traj_key": "episode"})
    storage = trl.LazyTensorStorage(CAPACITY)
    buffer = fastreplay.TensorDictReplayBuffer(storage=storage, sampler=sampler)
    buffer.extend(_data())
    for k in (32, 3, 7, 2):
        buffer._sampler.num_slices = k
        batch = buffer.sample(k * horizon)
        episodes = batch["episode"].view(-1, horizon)
        assert (episodes == episodes[:, :1]).all()
        assert (batch["obs"].view(-1, horizon).diff(dim=1) == 1).all()
        if kind == "SliceSamplerWithoutReplacement":  # one slice per trajectory left in the epoch
            assert 0 < episodes.shape[0] <= k and episodes[:, 0].unique().numel() == len(episodes)
        else:
            assert episodes.shape[0] == k


@pytest.mark.parametrize("kind", KIND_PARAMS)
@pytest.mark.parametrize(
    "attr,value,error",
    [
        ("num_slices", 0, ValueError),
        ("num_slices", 2.5, TypeError),
        ("slice_len", -3, ValueError),
    ],
)
def test_impossible_count_assigned_is_a_clear_error_at_sample(
    kind: str, attr: str, value: Any, error: type
) -> None:
    ctor = {attr: 4, "end_key": DONE}
    sampler = _build(fastreplay, kind, ctor)
    storage = _filled(sampler)
    _draw(sampler, storage, 32, seed=0)
    setattr(sampler, attr, value)
    with pytest.raises(error, match=rf"{attr} must .*got {attr}={value}"):
        _draw(sampler, storage, 32, seed=0)
    setattr(sampler, attr, 8)  # a valid value again: sampling works, with it
    index, _ = _draw(sampler, storage, 32, seed=0)
    assert index[0].numel() % 8 == 0 and index[0].numel() > 0


@requires_slice_args("fragmented", "step_key")
def test_fragmented_is_accepted_and_checked_as_torchrl_does() -> None:
    sampler = fastreplay.SliceSampler(num_slices=4, traj_key="episode", fragmented=True)
    ref = trl.SliceSampler(num_slices=4, traj_key="episode", fragmented=True)
    assert sampler.fragmented is True
    got = _draw(sampler, _filled(sampler), 32, seed=3)
    assert_same_sample(got, _draw(ref, _filled(ref), 32, seed=3))
    bad = [
        ({"step_key": None}, ValueError, "step_key must be provided"),
        ({"span": True}, NotImplementedError, "span is not supported"),
        ({"compile": True}, NotImplementedError, "compile is not supported"),
    ]
    for extra, error, match in bad:
        args = {"num_slices": 4, "traj_key": "episode", "fragmented": True, **extra}
        with pytest.raises(error, match=match):
            trl.SliceSampler(**args)
        with pytest.raises(error, match=match):
            fastreplay.SliceSampler(**args)

    class OwnSample(fastreplay.SliceSampler):  # TorchRL refuses other ``sample`` methods
        def sample(self, storage: Any, batch_size: int) -> tuple:
            return super().sample(storage, batch_size)

    with pytest.raises(NotImplementedError, match="with replacement only"):
        OwnSample(num_slices=4, traj_key="episode", fragmented=True)

"""The direct extend/sample path against TorchRL's general path, call by call, bit for bit.

fastreplay's ``TensorDictReplayBuffer`` / ``TensorDictPrioritizedReplayBuffer`` write rows
straight into the storage's leaves and gather sampled rows directly when the set-up is the
common one (``fastreplay.buffers.paths``). Each test here runs the same script of calls (extends
that wrap around odd capacities, samples with and without ``return_info``, priority updates,
checkpoint round trips) on:

* ``torchrl``: TorchRL's buffer class with the same sampler class (the reference: its glue is
  the general path);
* ``fast``: fastreplay's class, direct path on;
* ``general``: fastreplay's class with the direct path switched off (``_fr_fast = False``).

and requires identical results: every sample's keys (in order), dtypes, shapes, values, batch
size and device, every ``info``, every returned index, and after every call the storage's
rows, length, last cursor, mutation revision and the writer's cursor and ``write_count``,
and the sampler's priorities. A counter on the direct path's two entry points checks that the
``fast`` side really took it where it should, and that every other set-up fell back.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torchrl.data as trl
from tensordict import LazyStackedTensorDict, TensorDict
from torchrl.envs.transforms import Compose, RenameTransform

import fastreplay
from fastreplay._torchrl import CONSUMING_SAMPLERS, STORAGE_HAS_REVISION
from fastreplay.buffers import rows as _fast_io

ALPHA, BETA = 0.7, 0.5
SIDES = ("torchrl", "fast", "general")


# --------------------------------------------------------------------------- set-up


@pytest.fixture
def taken(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Counts the direct writes and gathers (``fastreplay.buffers.rows`` entry points)."""
    count = {"write": 0, "gather": 0}
    write, gather = _fast_io.write_rows, _fast_io.gather_rows

    def counted_write(*args: Any, **kwargs: Any) -> Any:
        count["write"] += 1
        return write(*args, **kwargs)

    def counted_gather(*args: Any, **kwargs: Any) -> Any:
        count["gather"] += 1
        return gather(*args, **kwargs)

    monkeypatch.setattr(_fast_io, "write_rows", counted_write)
    monkeypatch.setattr(_fast_io, "gather_rows", counted_gather)
    return count


def direct(counts: dict[str, int]) -> dict[str, int]:
    """The direct writes and gathers expected: none where the installed TorchRL has no
    direct path (``fastreplay._torchrl.STORAGE_HAS_REVISION``)."""
    return counts if STORAGE_HAS_REVISION else dict.fromkeys(counts, 0)


def prioritized(capacity: int) -> Any:
    return fastreplay.PrioritizedSampler(capacity, ALPHA, BETA)


def uniform(capacity: int) -> Any:
    return trl.RandomSampler()


SAMPLERS = {"prioritized": prioritized, "random": uniform}


# Whose storage classes the fastreplay sides use (the TorchRL side always uses TorchRL's):
# fastreplay's storages are TorchRL's with a faster ``get`` (``fastreplay.storages``).
STORES = {"torchrl": trl, "fastreplay": fastreplay}


def storages(side: str, stores: str) -> Any:
    """The module whose storage classes ``side`` uses."""
    return trl if side == "torchrl" else STORES[stores]


def make(
    side: str,
    sampler: str = "prioritized",
    capacity: int = 7,
    stores: str = "torchrl",
    **kwargs: Any,
) -> Any:
    """A buffer of ``side`` with a ``LazyTensorStorage(capacity)`` unless ``storage`` is given
    (TorchRL's, or fastreplay's on the fastreplay sides with ``stores="fastreplay"``)."""
    cls = trl.TensorDictReplayBuffer if side == "torchrl" else fastreplay.TensorDictReplayBuffer
    kwargs.setdefault("storage", storages(side, stores).LazyTensorStorage(capacity))
    kwargs.setdefault("batch_size", 5)
    kwargs.setdefault("generator", torch.Generator().manual_seed(3))
    rb = cls(sampler=SAMPLERS[sampler](capacity), **kwargs)
    if side == "general":
        rb._fr_fast = False
    return rb


def rows(
    n: int,
    seed: int,
    *,
    nested: bool = True,
    priority: bool = False,
    strided: bool = False,
    dtype: torch.dtype = torch.float32,
) -> TensorDict:
    """``n`` rows; the same ``seed`` gives the same rows."""
    gen = torch.Generator().manual_seed(seed)
    obs = torch.randn(n, 6, generator=gen).to(dtype)
    if strided:  # non-contiguous leaves: a column slice and a transpose
        obs = torch.randn(n, 12, generator=gen).to(dtype)[:, ::2]
    data = {
        "obs": obs,
        "action": torch.randint(5, (n,), generator=gen),
        "flag": torch.rand(n, 1, generator=gen) < 0.5,
    }
    if strided:
        data["action"] = torch.randint(5, (1, n), generator=gen).t().reshape(n)
        data["flag"] = (torch.rand(1, n, generator=gen) < 0.5).t()
    if nested:
        data[("next", "obs")] = torch.randn(n, 6, generator=gen).to(dtype)
        data[("next", "done")] = torch.rand(n, 1, generator=gen) < 0.2
        data[("next", "deep", "reward")] = torch.randn(n, 2, 2, generator=gen)
    if priority:
        data["td_error"] = torch.rand(n, generator=gen) + 0.01
    return TensorDict(data, batch_size=[n])


# --------------------------------------------------------------------------- comparisons


def same_td(a: TensorDict, b: TensorDict) -> None:
    assert type(a) is type(b)
    assert list(a.keys(True, True)) == list(b.keys(True, True))
    assert a.batch_size == b.batch_size and a.device == b.device
    assert a.is_locked == b.is_locked
    for key in a.keys(True, True):
        x, y = a.get(key), b.get(key)
        assert type(x) is type(y), key
        assert x.dtype == y.dtype and x.shape == y.shape and x.device == y.device, key
        assert torch.equal(x, y), key
    for key in a.keys(True):
        x, y = a.get(key), b.get(key)
        if isinstance(x, TensorDict):
            assert x.batch_size == y.batch_size and x.device == y.device, key


def same_value(a: Any, b: Any) -> None:
    assert type(a) is type(b)
    if isinstance(a, TensorDict):
        same_td(a, b)
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    elif isinstance(a, (tuple, list)):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            same_value(x, y)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for key in a:
            same_value(a[key], b[key])
    else:
        assert a == b


def state(rb: Any) -> dict[str, Any]:
    """Everything an extend changes, in comparable form."""
    storage, writer = rb.storage, rb.writer
    out = {
        "len": len(storage),
        "cursor": writer._cursor,
        "write_count": writer._write_count,
        "last_cursor_index": getattr(storage, "_last_cursor_index", None),  # 0.14+
        "last_cursor": getattr(storage, "_last_cursor", None),
        "revision": getattr(storage, "_mutation_revision", None),  # 0.14+
    }
    if isinstance(storage, trl.TensorStorage) and storage.initialized:
        # rows never written hold whatever memory the lazy storage got
        out["rows"] = storage._storage[: storage._len_along_dim0].clone()
    trees = getattr(rb.sampler, "_trees", None)
    if trees is not None:
        out["priorities"] = trees.raw().clone()
        out["live max"] = rb.sampler._default_value()
    return out


def run(rb: Any, script: list[tuple], *, tmp_path: Any = None) -> tuple[Any, list]:
    """Apply ``script`` to ``rb``; the record of every result and the state after each call."""
    record: list = []
    last_index = None
    for op, *args in script:
        outcome: Any
        if op == "extend":
            data, kwargs = args
            try:
                outcome = rb.extend(data(), **kwargs)
            except Exception as err:  # the same error on every side
                outcome = ("error", type(err))
        elif op == "sample":
            batch_size, return_info = args
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                outcome = rb.sample(batch_size, return_info=return_info)
            outcome = (outcome, [str(w.message) for w in caught])
        elif op == "update":
            (scale,) = args
            priority = torch.arange(last_index.numel()) * scale + 0.5
            outcome = rb.update_priority(last_index, priority)
        elif op == "checkpoint":
            fresh = args[0]()
            fresh.load_state_dict(rb.state_dict())
            if getattr(rb, "_fr_fast", True) is False:
                fresh._fr_fast = False
            rb, outcome = fresh, None
        else:  # pragma: no cover
            raise AssertionError(op)
        if op == "sample":
            sample = outcome[0][0] if isinstance(outcome[0], tuple) else outcome[0]
            last_index = sample["index"]
        record.append((op, outcome, state(rb)))
    return rb, record


def compare(records: dict[str, list]) -> None:
    reference = records["torchrl"]
    for side, record in records.items():
        assert len(record) == len(reference), side
        for step, (ours, theirs) in enumerate(zip(record, reference, strict=True)):
            try:
                same_value(ours, theirs)
            except AssertionError as err:
                raise AssertionError(
                    f"{side} differs from torchrl at call {step}: {ours[0]}"
                ) from err


SIZES = (3, 1, 5, 7, 2, 6, 4, 7, 1, 3, 5, 2)


def direct_writes(capacity: int, n_steps: int = 12) -> int:
    """Extends of :func:`script_per_step` that the direct path takes: not the first (it
    initialises the storage), not those larger than the capacity."""
    return sum(1 for step in range(1, n_steps) if SIZES[step % len(SIZES)] <= capacity)


def script_per_step(n_steps: int = 12, update: bool = True, **row_kwargs: Any) -> list[tuple]:
    """Extends of varied sizes (wrapping around), samples, priority updates."""
    script: list[tuple] = []
    for step in range(n_steps):
        n = SIZES[step % len(SIZES)]
        script.append(("extend", lambda n=n, s=step: rows(n, s, **row_kwargs), {}))
        script.append(("sample", None, step % 2 == 0))
        if update:
            script.append(("update", 1.0 + step))
    return script


def run_sides(
    script: list[tuple], factory: Callable[[str], Any], sides: tuple[str, ...] = SIDES
) -> dict[str, list]:
    records = {}
    for side in sides:
        _, records[side] = run(factory(side), script)
    compare(records)
    return records


# --------------------------------------------------------------------------- the common case


@pytest.mark.parametrize("stores", list(STORES))
@pytest.mark.parametrize("sampler", list(SAMPLERS))
@pytest.mark.parametrize("capacity", [7, 13, 1])
def test_extend_sample_update_match_torchrl(
    sampler: str, capacity: int, stores: str, taken: dict
) -> None:
    script = script_per_step(update=sampler == "prioritized")
    run_sides(script, lambda side: make(side, sampler, capacity, stores))
    # the fast side took the direct path wherever it applies, and only there
    assert taken == direct({"write": direct_writes(capacity), "gather": 12})


@pytest.mark.parametrize("sampler", list(SAMPLERS))
def test_priority_key_in_the_data(sampler: str, taken: dict) -> None:
    script = script_per_step(priority=True, update=sampler == "prioritized")
    run_sides(script, lambda side: make(side, sampler))
    assert taken == direct({"write": direct_writes(7), "gather": 12})


def test_flat_keys_and_strided_input(taken: dict) -> None:
    run_sides(script_per_step(nested=False), lambda side: make(side))
    run_sides(script_per_step(strided=True), lambda side: make(side))
    assert taken == direct({"write": 2 * direct_writes(7), "gather": 24})


@pytest.mark.parametrize("stores", list(STORES))
def test_memmap_and_prebuilt_storages(tmp_path: Any, stores: str, taken: dict) -> None:
    def memmap(side: str) -> Any:
        path = tmp_path / side
        cls = storages(side, stores).LazyMemmapStorage
        return make(side, storage=cls(9, scratch_dir=path, existsok=True))

    run_sides(script_per_step(), memmap)
    prebuilt = rows(11, 99)
    prebuilt["index"] = torch.zeros(11, dtype=torch.long)
    run_sides(
        script_per_step(),
        lambda side: make(side, storage=storages(side, stores).TensorStorage(prebuilt.clone())),
    )
    # the prebuilt storage is initialised before the first extend: every extend is direct
    assert taken == direct({"write": direct_writes(9) + 12, "gather": 24})


def test_prioritized_buffer_class_fast_and_general(taken: dict) -> None:
    def factory(side: str) -> Any:
        rb = fastreplay.TensorDictPrioritizedReplayBuffer(
            alpha=ALPHA,
            beta=BETA,
            storage=trl.LazyTensorStorage(11),
            batch_size=4,
            generator=torch.Generator().manual_seed(5),
        )
        rb._fr_fast = side == "fast"
        return rb

    records = {side: run(factory(side), script_per_step(priority=True))[1] for side in SIDES}
    records["torchrl"] = records.pop("general")  # the reference: the general path
    compare(records)
    assert taken == direct({"write": direct_writes(11), "gather": 12})


def test_checkpoint_round_trip_then_continue(taken: dict) -> None:
    def factory(side: str) -> Any:
        return make(side, "prioritized", 9)

    script = [*script_per_step(5), ("checkpoint", lambda: None), *script_per_step(5)]
    records = {}
    for side in SIDES:
        script[15] = ("checkpoint", lambda side=side: factory(side))
        _, records[side] = run(factory(side), script)
    compare(records)
    # after the round trip, the first extend writes into an initialised storage: direct
    assert taken == direct({"write": direct_writes(9, 5) + 5, "gather": 10})


def test_sample_batch_size_argument_and_conflict_warning(taken: dict) -> None:
    script = [
        ("extend", lambda: rows(6, 1), {}),
        ("sample", 3, True),  # differs from batch_size=5: TorchRL warns once
        ("sample", 3, False),
        ("sample", None, False),
        ("sample", 6, True),
    ]
    records = run_sides(script, lambda side: make(side))
    assert records["fast"][1][1][1], "the conflict warning is raised"
    assert taken["gather"] >= (3 if STORAGE_HAS_REVISION else 0)


def test_include_info_false_keeps_the_stored_index() -> None:
    for side in ("fast", "general"):
        rb = make(side)
        rb.extend(rows(4, 0))
        with pytest.warns(UserWarning, match="include_info"):
            sample = rb.sample(include_info=False)
        assert "priority_weight" not in sample and "index" in sample


def test_sample_without_batch_size_raises_as_torchrl() -> None:
    for side in SIDES:
        rb = make(side, batch_size=None)
        rb.extend(rows(4, 0))
        with pytest.raises(RuntimeError, match="batch_size not specified"):
            rb.sample()


def test_user_data_is_left_unchanged(taken: dict) -> None:
    for side in SIDES:
        rb = make(side)
        for seed in range(2):
            data = rows(4, seed)
            before = data.clone()
            rb.extend(data)
            same_td(data, before)
    assert taken["write"] == int(STORAGE_HAS_REVISION)


def test_state_after_one_fast_extend_equals_torchrl(taken: dict) -> None:
    # the very first extend initialises the storage (general path); the next ones are direct
    a, b = make("torchrl", capacity=13), make("fast", capacity=13)
    for n, seed in ((5, 0), (6, 1), (9, 2), (13, 3)):
        assert torch.equal(a.extend(rows(n, seed)), b.extend(rows(n, seed)))
        same_value(state(b), state(a))
    assert taken["write"] == 3 * STORAGE_HAS_REVISION


# --------------------------------------------------------------------------- fallbacks


def _other_keys(seed: int) -> TensorDict:
    data = rows(3, seed)
    data["extra"] = torch.zeros(3)
    return data


def _missing_key(seed: int) -> TensorDict:
    return rows(3, seed).exclude("action")


def _broadcast(seed: int) -> TensorDict:
    data = rows(3, seed)
    data["flag"] = torch.ones(3, 1, dtype=torch.bool)[:, :1].expand(3, 1)
    data["obs"] = torch.ones(3, 1)
    return data


def _lazy_stack(seed: int) -> TensorDict:
    return LazyStackedTensorDict.lazy_stack(list(rows(3, seed).unbind(0)), 0)


def _float64(seed: int) -> TensorDict:
    return rows(3, seed, dtype=torch.float64)


def _with_index(seed: int) -> TensorDict:
    data = rows(3, seed)
    data["index"] = torch.zeros(3, dtype=torch.long)
    return data


def _too_many(seed: int) -> TensorDict:
    return rows(9, seed)


@pytest.mark.parametrize(
    "data",
    [_other_keys, _missing_key, _broadcast, _lazy_stack, _float64, _with_index, _too_many],
    ids=lambda f: f.__name__.strip("_"),
)
def test_data_that_does_not_match_the_storage_takes_the_general_path(
    data: Callable[[int], TensorDict], taken: dict
) -> None:
    script = [
        ("extend", lambda: rows(7, 0), {}),  # every row written: no uninitialised memory
        ("extend", lambda: data(1), {}),
        ("sample", None, True),
        ("extend", lambda: data(2), {}),
        ("extend", lambda: rows(2, 3), {}),
        ("sample", None, False),
    ]
    run_sides(script, lambda side: make(side))
    # The first extend initialises the storage (general path), the mismatched data takes the
    # general path, the last matching rows the direct one. Once TorchRL has added the extra
    # key to the storage, the second extra-key write matches it and the last rows do not.
    assert taken["write"] == int(STORAGE_HAS_REVISION)


def _transformed(side: str) -> Any:
    return make(side, transform=Compose(RenameTransform(["obs"], ["observation"])))


def _prefetch(side: str) -> Any:
    return make(side, prefetch=2)


def _device_cpu(side: str) -> Any:
    if side == "torchrl":
        return make(side)
    return make(side, device="cpu")


def _dim_extend(side: str) -> Any:
    return make(side, dim_extend=0, storage=trl.LazyTensorStorage(7, ndim=1))


def _round_robin(side: str) -> Any:
    return make(side, writer=trl.RoundRobinWriter())


def _list_storage(side: str) -> Any:
    return make(side, storage=trl.ListStorage(7))


def _needs_generations() -> None:
    if "track_generations" not in inspect.signature(trl.TensorDictRoundRobinWriter).parameters:
        pytest.skip("the installed TorchRL's writers do not track generations (0.14+)")


def _track_generations(side: str) -> Any:
    _needs_generations()
    return make(side, writer=trl.TensorDictRoundRobinWriter(track_generations=True))


def _track_generations_prebuilt(side: str) -> Any:
    _needs_generations()
    prebuilt = rows(7, 99)
    prebuilt["index"] = torch.zeros(7, dtype=torch.long)
    return make(
        side,
        storage=trl.TensorStorage(prebuilt),
        writer=trl.TensorDictRoundRobinWriter(track_generations=True),
    )


def _consume(side: str) -> Any:
    if not CONSUMING_SAMPLERS:
        pytest.skip("the installed TorchRL has no consuming samplers (0.14+)")
    return make(side, "random", consume_after_n_samples=2)


def _collate(side: str) -> Any:
    return make(side, collate_fn=lambda x: x)


@pytest.mark.parametrize(
    "factory",
    [
        _transformed,
        _prefetch,
        _device_cpu,
        _round_robin,
        _list_storage,
        _track_generations,
        _track_generations_prebuilt,
        _consume,
        _collate,
    ],
    ids=lambda f: f.__name__.strip("_"),
)
def test_other_set_ups_take_the_general_path(factory: Callable, taken: dict) -> None:
    script = [("extend", lambda s=s, n=n: rows(n, s), {}) for s, n in ((0, 7), (1, 5))]
    script += [("sample", None, True), ("extend", lambda: rows(6, 2), {}), ("sample", None, False)]
    run_sides(script, factory)
    assert taken == direct({"write": 0, "gather": 0})


@pytest.mark.parametrize(
    "kwargs",
    [
        {"transform": Compose(RenameTransform(["obs"], ["observation"]))},
        {"prefetch": 2},
        {"sampler_kwargs": None},
    ],
    ids=["transform", "prefetch", "plain"],
)
def test_fastreplay_storages_on_torchrl_path(kwargs: dict, taken: dict) -> None:
    """fastreplay's storages where the buffer takes TorchRL's path (their ``get`` reads the
    sample), and on TorchRL's own buffer (``plain``: the TorchRL side's storage is TorchRL's,
    the others fastreplay's, all read by the general path or the direct one)."""
    kwargs = {k: v for k, v in kwargs.items() if k != "sampler_kwargs"}
    for sampler in SAMPLERS:
        script = script_per_step(update=sampler == "prioritized")
        if "prefetch" in kwargs:  # (samples drawn ahead: no writes between them)
            script = [("extend", lambda s=s, n=n: rows(n, s), {}) for s, n in ((0, 7), (1, 5))]
            script += [("sample", None, True), ("sample", None, False)]
        run_sides(
            script, lambda side, sampler=sampler: make(side, sampler, 13, "fastreplay", **kwargs)
        )
    if kwargs:
        assert taken == direct({"write": 0, "gather": 0})


def test_dim_extend_zero_is_the_default_case(taken: dict) -> None:
    run_sides(script_per_step(4), _dim_extend)
    assert (taken["write"] > 0) == STORAGE_HAS_REVISION


@pytest.mark.parametrize("stores", list(STORES))
def test_ndim_2_storage_takes_the_general_path(stores: str, taken: dict) -> None:
    def factory(side: str) -> Any:
        storage = storages(side, stores).LazyTensorStorage(12, ndim=2)
        return make(side, "random", storage=storage)

    def two_d(seed: int) -> TensorDict:
        data = rows(6, seed)
        return TensorDict({k: v.reshape(3, 2, *v.shape[1:]) for k, v in data.items(True, True)},
                          batch_size=[3, 2])  # fmt: skip

    script = [("extend", lambda: two_d(0), {}), ("extend", lambda: two_d(3), {})]
    script += [("sample", None, True)]
    script += [("extend", lambda: two_d(1), {}), ("sample", None, False)]
    run_sides(script, factory)
    assert taken == direct({"write": 0, "gather": 0})


def test_shared_buffer_takes_the_general_path(taken: dict) -> None:
    rb = fastreplay.TensorDictReplayBuffer(storage=trl.LazyTensorStorage(7), batch_size=3)
    rb.extend(rows(3, 0))
    rb.share()
    rb.extend(rows(3, 1))
    rb.sample()
    assert taken == direct({"write": 0, "gather": 0})


# --------------------------------------------------------------------------- slice samplers

SLICE_SAMPLERS = {
    "slice": lambda capacity: fastreplay.SliceSampler(slice_len=3),
    "slice, num_slices": lambda capacity: fastreplay.SliceSampler(num_slices=3),
    "slice, short slices": lambda capacity: fastreplay.SliceSampler(
        slice_len=4, strict_length=False
    ),
    "torchrl slice": lambda capacity: trl.SliceSampler(slice_len=3),
    "slice without replacement": lambda capacity: fastreplay.SliceSamplerWithoutReplacement(
        slice_len=3
    ),
    "prioritized slice": lambda capacity: fastreplay.PrioritizedSliceSampler(
        capacity, ALPHA, BETA, slice_len=3
    ),
}


def episode_rows(first: int, n: int, seed: int) -> TensorDict:
    """Steps ``first .. first + n - 1`` of episodes of 5 steps (``episode`` and done flags)."""
    data = rows(n, seed)
    steps = torch.arange(first, first + n)
    data["episode"] = steps // 5
    data[("next", "done")] = (steps % 5 == 4)[:, None]
    return data


def script_slices(prioritized: bool, sizes: tuple[int, ...] = (9, 4, 7, 1, 11, 6, 8, 3)):
    script: list[tuple] = []
    first = 0
    for step, n in enumerate(sizes):
        script.append(("extend", lambda f=first, n=n, s=step: episode_rows(f, n, s), {}))
        first += n
        script.append(("sample", None, step % 2 == 1))
        if prioritized:
            script.append(("update", 0.5 + step))
    return script


@pytest.mark.parametrize("sampler", list(SLICE_SAMPLERS))
def test_slice_samplers_match_torchrl(sampler: str, taken: dict) -> None:
    capacity = 23  # odd; the writes wrap around it, and slices with them

    def factory(side: str) -> Any:
        cls = trl.TensorDictReplayBuffer if side == "torchrl" else fastreplay.TensorDictReplayBuffer
        rb = cls(
            storage=trl.LazyTensorStorage(capacity),
            sampler=SLICE_SAMPLERS[sampler](capacity),
            batch_size=12,
            generator=torch.Generator().manual_seed(7),
        )
        rb._fr_fast = side == "fast"
        return rb

    script = script_slices(prioritized=sampler == "prioritized slice")
    run_sides(script, factory)
    assert taken == direct({"write": 7, "gather": 8})


def test_rows_with_a_time_dimension_in_a_1d_storage(taken: dict) -> None:
    """Data of batch size ``[n, 2]`` in a 1-D storage: rows of shape ``[2, ...]``."""

    def timed(seed: int, n: int) -> TensorDict:
        data = rows(2 * n, seed)
        return TensorDict(
            {k: v.reshape(n, 2, *v.shape[1:]) for k, v in data.items(True, True)},
            batch_size=[n, 2],
        )

    script = [("extend", lambda s=s, n=n: timed(s, n), {}) for s, n in ((0, 7), (1, 3), (2, 5))]
    script += [("sample", None, True), ("extend", lambda: timed(3, 4), {}), ("sample", None, False)]
    run_sides(script, lambda side: make(side, "random"))
    # the stored index is [capacity, 2]: writes take the general path, reads the direct one
    assert taken == direct({"write": 0, "gather": 2})


def test_sampler_without_replacement(taken: dict) -> None:
    def factory(side: str) -> Any:
        cls = trl.TensorDictReplayBuffer if side == "torchrl" else fastreplay.TensorDictReplayBuffer
        rb = cls(
            storage=trl.LazyTensorStorage(11),
            sampler=trl.SamplerWithoutReplacement(),
            batch_size=3,
            generator=torch.Generator().manual_seed(2),
        )
        rb._fr_fast = side == "fast"
        return rb

    run_sides(script_per_step(update=False), factory)
    assert taken == direct({"write": direct_writes(11), "gather": 12})

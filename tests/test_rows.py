"""``fastreplay.buffers.rows``: direct row writes and gathers on a TensorDict storage.

Each function is checked against what ``TensorDict.__setitem__`` / ``__getitem__`` with an
index tensor give (TorchRL's storage path), and each "not a plain match" answer is pinned:
those set-ups must go to TorchRL's general path. The buffers that use these functions are
compared call by call with TorchRL's in ``tests/conformance/test_whole_step.py``.
"""

from __future__ import annotations

import pytest
import torch
from tensordict import LazyStackedTensorDict, MemoryMappedTensor, NonTensorData, TensorDict

from conftest import assert_same_tensordict
from fastreplay.buffers import rows as _fast_io


def store(capacity: int = 7) -> TensorDict:
    gen = torch.Generator().manual_seed(capacity)
    return TensorDict(
        {
            "obs": torch.randn(capacity, 3, generator=gen),
            "index": torch.arange(capacity),
            ("next", "done"): torch.rand(capacity, 1, generator=gen) < 0.5,
            ("next", "deep", "r"): torch.randn(capacity, 2, 2, generator=gen),
        },
        batch_size=[capacity],
    )


def rows(n: int, seed: int = 0) -> TensorDict:
    gen = torch.Generator().manual_seed(seed)
    return TensorDict(
        {
            "obs": torch.randn(n, 3, generator=gen),
            ("next", "done"): torch.rand(n, 1, generator=gen) < 0.5,
            ("next", "deep", "r"): torch.randn(n, 2, 2, generator=gen),
        },
        batch_size=[n],
    )


@pytest.mark.parametrize(("start", "n"), [(0, 3), (2, 5), (5, 4), (6, 1), (3, 7), (0, 7)])
def test_write_rows_matches_setitem_with_the_writer_index(start: int, n: int) -> None:
    ours, theirs, data = store(), store(), rows(n)
    index = torch.arange(start, start + n) % 7
    theirs[index] = data.set("index", index)
    pairs = _fast_io.write_pairs(ours, rows(n), skip="index")
    assert pairs is not None and len(pairs) == 3
    _fast_io.write_rows([*pairs, (ours["index"], index)], index)
    assert_same_tensordict(ours, theirs)


def test_write_rows_takes_strided_sources() -> None:
    ours, theirs = store(), store()
    data = TensorDict(
        {
            "obs": torch.randn(4, 6)[:, ::2],
            ("next", "done"): (torch.rand(1, 4) < 0.5).t(),
            ("next", "deep", "r"): torch.randn(2, 2, 4).permute(2, 0, 1),
        },
        batch_size=[4],
    )
    assert not data["obs"].is_contiguous()
    index = torch.arange(5, 9) % 7
    theirs[index] = data
    _fast_io.write_rows(_fast_io.write_pairs(ours, data, skip="index"), index)
    assert_same_tensordict(ours.exclude("index"), theirs.exclude("index"))


def _extra_key(data: TensorDict) -> TensorDict:
    return data.set("extra", torch.zeros(data.shape[0]))


def _missing_key(data: TensorDict) -> TensorDict:
    return data.exclude(("next", "deep", "r"))


def _dtype(data: TensorDict) -> TensorDict:
    return data.set("obs", data["obs"].double())


def _feature_shape(data: TensorDict) -> TensorDict:
    return data.set("obs", torch.ones(data.shape[0], 1))


def _grad(data: TensorDict) -> TensorDict:
    return data.set("obs", data["obs"].requires_grad_())


def _index(data: TensorDict) -> TensorDict:
    return data.set("index", torch.zeros(data.shape[0], dtype=torch.long))


def _lazy_stack(data: TensorDict) -> TensorDict:
    return LazyStackedTensorDict.lazy_stack(list(data.unbind(0)), 0)


def _nested_lazy_stack(data: TensorDict) -> TensorDict:
    nested = data["next"]
    data._tensordict["next"] = LazyStackedTensorDict.lazy_stack(list(nested.unbind(0)), 0)
    return data


def _nested_leaf(data: TensorDict) -> TensorDict:
    return data.exclude("next").set("next", torch.zeros(data.shape[0]))


def _batch_dims(data: TensorDict) -> TensorDict:
    return TensorDict({"obs": data["obs"]}, batch_size=[data.shape[0], 3])


def _non_tensor(data: TensorDict) -> TensorDict:
    data._tensordict["obs"] = NonTensorData("x", batch_size=[data.shape[0]])
    return data


@pytest.mark.parametrize(
    "change",
    [
        _extra_key,
        _missing_key,
        _dtype,
        _feature_shape,
        _grad,
        _index,
        _lazy_stack,
        _nested_lazy_stack,
        _nested_leaf,
        _batch_dims,
        _non_tensor,
    ],
    ids=lambda f: f.__name__.strip("_"),
)
def test_write_pairs_refuses_what_is_not_a_plain_match(change) -> None:
    assert _fast_io.write_pairs(store(), rows(3), skip="index") is not None
    assert _fast_io.write_pairs(store(), change(rows(3)), skip="index") is None


def test_write_pairs_needs_the_skipped_key_in_the_store() -> None:
    assert _fast_io.write_pairs(store().exclude("index"), rows(3), skip="index") is None
    assert _fast_io.write_pairs(store().exclude("index"), rows(3)) is not None


@pytest.mark.parametrize("stored", [7, 4])
def test_gather_rows_matches_getitem(stored: int) -> None:
    data = store()
    index = torch.tensor([3, 0, 3, stored - 1, 1])
    plan = _fast_io.gather_plan(data)
    assert plan is not None
    ours, complete = _fast_io.gather_rows(plan, index, stored)
    assert complete
    assert_same_tensordict(ours, data[:stored][index])
    assert ours["next"].batch_size == ours["next", "deep"].batch_size == torch.Size([5])


def test_gather_rows_sets_metadata_as_tensordict_set() -> None:
    data, index = store(), torch.tensor([2, 5, 5])
    weight = torch.rand(3)
    extra = {"priority_weight": weight, "index": index}
    ours, complete = _fast_io.gather_rows(_fast_io.gather_plan(data), index, 7, extra)
    theirs = data[index]
    for key, value in extra.items():
        theirs.set(key, value)
    assert complete
    assert_same_tensordict(ours, theirs)  # the stored "index" keeps its place; new keys come last
    assert ours["priority_weight"] is weight and ours["index"] is index


def test_gather_rows_sets_nested_metadata_as_tensordict_set() -> None:
    data, index = store(), torch.tensor([2, 5, 5, 0])
    flag = torch.zeros(4, 1, dtype=torch.bool)
    extra = {
        ("next", "truncated"): flag,
        ("next", "done"): ~flag,
        ("next", "deep", "w"): torch.ones(4, 3),
        "index": index.unsqueeze(-1),
        "weight": torch.rand(4),
    }
    ours, complete = _fast_io.gather_rows(_fast_io.gather_plan(data), index, 7, extra)
    theirs = data[index]
    for key, value in extra.items():
        theirs.set(key, value)
    assert complete
    assert_same_tensordict(ours, theirs)


# Metadata a sample of 3 rows cannot take in: the gather leaves it to the caller.
_MISFITS = {
    "new level": {("other", "x"): torch.zeros(3)},
    "under a leaf": {("obs", "x"): torch.zeros(3)},
    "batch": {"w": torch.zeros(2)},
    "scalar": {"w": torch.zeros(())},
    "not a tensor": {"w": [1.0, 2.0, 3.0]},
}


@pytest.mark.parametrize(
    "extra",
    [
        *_MISFITS.values(),
        {"next": torch.zeros(3), ("next", "x"): torch.zeros(3)},
        {1: torch.zeros(3)},
    ],
    ids=[*_MISFITS, "conflict", "key"],
)
def test_gather_rows_leaves_metadata_that_does_not_fit_to_the_caller(extra: dict) -> None:
    ours, complete = _fast_io.gather_rows(_fast_io.gather_plan(store()), torch.arange(3), 7, extra)
    assert not complete
    assert_same_tensordict(ours, store()[torch.arange(3)])  # none of it set


@pytest.mark.parametrize("stored", [7, 5])
@pytest.mark.parametrize(
    "rows",
    [
        [0, 1, 2, 4, 5, 6],
        [2, 3, 4, 2, 3, 4],
        [4, 5, 6, 0, 1, 2],
        [3, 4, 5, 5, 6, 0],
        [1, 2, 3, 4, 5],
    ],
    ids=["runs", "repeated runs", "wrapped runs", "not runs", "not a multiple"],
)
def test_gather_rows_by_runs_matches_getitem(stored: int, rows: list[int]) -> None:
    data = store()
    index = torch.tensor(rows)
    if max(rows) >= stored:
        with pytest.raises(IndexError):
            _fast_io.gather_rows(_fast_io.gather_plan(data), index, stored, run=3)
        return
    by_runs = _fast_io._run_starts(index, 3, stored) is not None
    assert by_runs == (rows in ([0, 1, 2, 4, 5, 6], [2, 3, 4, 2, 3, 4], [4, 5, 6, 0, 1, 2]))
    ours, _ = _fast_io.gather_rows(_fast_io.gather_plan(data), index, stored, run=3)
    assert_same_tensordict(ours, data[:stored][index])
    assert all(leaf.is_contiguous() for leaf in ours.values(True, True))


def test_gather_rows_by_runs_from_a_memory_map(tmp_path) -> None:
    data = store(9).memmap_(tmp_path)
    index = torch.tensor([6, 7, 8, 0, 1, 2])
    ours, _ = _fast_io.gather_rows(_fast_io.gather_plan(data), index, 9, run=3)
    assert_same_tensordict(ours, data[index])
    assert type(ours["obs"]) is torch.Tensor


def test_gather_rows_refuses_rows_past_the_filled_part() -> None:
    plan = _fast_io.gather_plan(store())
    with pytest.raises(IndexError):
        _fast_io.gather_rows(plan, torch.tensor([0, 4]), 4)


def test_gather_from_memory_mapped_leaves_gives_plain_tensors(tmp_path) -> None:
    data = store().memmap_(tmp_path)
    assert type(data["obs"]) is MemoryMappedTensor
    plan = _fast_io.gather_plan(data)
    ours, _ = _fast_io.gather_rows(plan, torch.tensor([1, 2]), 7)
    assert_same_tensordict(ours, data[torch.tensor([1, 2])])
    assert type(ours["obs"]) is torch.Tensor


def test_gather_plan_refuses_non_tensor_leaves_and_names() -> None:
    data = store()
    data._tensordict["text"] = NonTensorData("x", batch_size=[7])
    assert _fast_io.gather_plan(data) is None
    named = store()
    named.names = ["time"]
    assert _fast_io.gather_plan(named) is None


# --------------------------------------------------------------------------- flat storages


def flat_store(capacity: int = 7) -> TensorDict:
    """One level, no dimension after the first: the storage the flat gather lane reads."""
    gen = torch.Generator().manual_seed(capacity)
    return TensorDict(
        {
            "obs": torch.randn(capacity, 3, generator=gen),
            "index": torch.arange(capacity),
            "r": torch.randn(capacity, generator=gen),
            "img": torch.randn(capacity, 2, 1, 2, generator=gen),
        },
        batch_size=[capacity],
    )


def test_gather_plan_marks_flat_storages() -> None:
    assert _fast_io.gather_plan(flat_store())[3]
    assert not _fast_io.gather_plan(store())[3]  # nested levels
    batched = TensorDict({"obs": torch.zeros(7, 2, 3)}, batch_size=[7, 2])
    assert not _fast_io.gather_plan(batched)[3]  # a dimension after the first


@pytest.mark.parametrize("stored", [7, 4])
@pytest.mark.parametrize(
    "extra",
    [
        None,
        {},
        {"priority_weight": "weight", "index": "index"},
        {"r": "weight", "w2": "wide"},
        {("r",): "weight", ("w",): "wide"},
    ],
    ids=["none", "empty", "new and stored keys", "stored key first", "tuple keys"],
)
def test_flat_gather_matches_getitem_then_set(stored: int, extra: dict | None) -> None:
    data, index = flat_store(), torch.tensor([3, 0, 3, stored - 1, 1])
    values = {"weight": torch.rand(5), "index": index, "wide": torch.rand(5, 2)}
    extra = None if extra is None else {key: values[name] for key, name in extra.items()}
    ours, complete = _fast_io.gather_rows(_fast_io.gather_plan(data), index, stored, extra)
    theirs = data[:stored][index]
    for key, value in (extra or {}).items():
        theirs.set(key, value)
    assert complete
    assert_same_tensordict(ours, theirs)  # stored keys keep their place, new ones come last
    for key, value in (extra or {}).items():
        assert ours.get(key) is value


@pytest.mark.parametrize(
    "extra",
    [*_MISFITS.values(), {"w": torch.zeros(3), 1: torch.zeros(3)}],
    ids=[*_MISFITS, "key"],
)
def test_flat_gather_leaves_metadata_that_does_not_fit_to_the_caller(extra: dict) -> None:
    data = flat_store()
    ours, complete = _fast_io.gather_rows(_fast_io.gather_plan(data), torch.arange(3), 7, extra)
    assert not complete
    assert_same_tensordict(ours, data[torch.arange(3)])  # none of it set


def test_flat_gather_refuses_rows_past_the_filled_part() -> None:
    with pytest.raises(IndexError):
        _fast_io.gather_rows(_fast_io.gather_plan(flat_store()), torch.tensor([0, 4]), 4)


@pytest.mark.parametrize(
    ("key", "shape", "fits"),
    [
        ("r", (3,), True),
        ("r", (3, 1), False),
        ("obs", (3, 3), True),
        ("obs", (3, 2), False),
        ("obs", (3,), False),
        ("obs", (3, 3, 1), False),
        ("img", (3, 2, 1, 2), True),
        ("img", (3, 2, 1, 3), False),
        ("img", (3, 2, 2), False),
    ],
)
def test_write_pairs_compares_every_feature_dimension(key: str, shape: tuple, fits: bool) -> None:
    data = flat_store(3)[:3].exclude("index")
    data._tensordict[key] = torch.zeros(shape, dtype=data[key].dtype)  # as it is, unchecked
    assert (_fast_io.write_pairs(flat_store(), data, skip="index") is not None) is fits


def test_write_pairs_compares_the_batch_dimensions_after_the_first() -> None:
    stored = TensorDict({"obs": torch.zeros(7, 2, 3)}, batch_size=[7, 2])
    same = TensorDict({"obs": torch.ones(3, 2, 3)}, batch_size=[3, 2])
    other = TensorDict({"obs": torch.ones(3, 2, 3)}, batch_size=[3])
    assert _fast_io.write_pairs(stored, same) is not None
    assert _fast_io.write_pairs(stored, other) is None
    assert _fast_io.write_pairs(stored, TensorDict({"obs": torch.ones(2, 3)}, [])) is None


def test_whole_step_benchmark_runs_small_and_checks_its_answers(tmp_path, capsys) -> None:
    import json

    from benchmarks.harness import main

    threads = torch.get_num_threads()
    argv = ["--only", "whole_step", "--step-per-capacity", "3k", "--step-slice-capacity", "9k"]
    argv += ["--step-slice-stored", "7k", "--step-slice-episode", "50", "--repeats", "1"]
    try:
        assert main([*argv, "--out", str(tmp_path)]) == 0
    finally:
        torch.set_num_threads(threads)
    results = json.loads((tmp_path / "results.json").read_text())["results"]
    cases = [r["case"] for r in results]
    from benchmarks.floor import KIND

    note = "" if KIND == "numba" else " (floor: NumPy, no numba)"
    assert cases == [
        case + note
        for case in (
            "PER step, fastreplay buffer (extend 16, sample 256, td_error, "
            "update_tensordict_priority), 3k",
            "PER step, fastreplay buffer, general path, 3k",
            "PER step, fastreplay buffer, update_priority(index, p), 3k",
            "slice static, fastreplay buffer, 9k/7k ep50",
            "slice static, fastreplay buffer, general path, 9k/7k ep50",
            "slice online (extend 1000 + sample), fastreplay buffer, 9k/7k ep50",
            "slice online (extend 1000 + sample), fastreplay buffer, general path, 9k/7k ep50",
        )
    ]
    assert all(r["correct"] and r["floor_s"] > 0 for r in results)
    assert results[0]["extra"]["general_path_s"] > 0 and results[0]["extra"]["sampler_alone_s"] > 0
    assert "PER step 3k:" in capsys.readouterr().out

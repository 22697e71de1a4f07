"""TorchRL's buffer bookkeeping on fastreplay's direct path, on every TorchRL version.

fastreplay's buffers write and gather rows directly in the common set-up
(``fastreplay.buffers.paths``); what TorchRL's buffer methods do besides moving data is done
there through ``fastreplay._torchrl.Bookkeeping``. Two guards keep that complete:

* **Trace.** The same call runs on fastreplay's buffer with the direct path and with it
  switched off (TorchRL's general path), under a profiler that records every TorchRL function
  it enters. Each TorchRL function the general path runs and the direct path does not must be
  data movement the direct path replaces (:data:`REPLACED`). A bookkeeping step that a new
  TorchRL adds in a function of its own fails here until the direct path does it too.
* **State.** After the same script of calls, every attribute of the buffer itself (counters,
  flags, names) is equal on both paths, so bookkeeping TorchRL does inline is compared too.

Then the behaviours behind them, through fastreplay's buffers and with fastreplay's samplers in
TorchRL's buffers: ``sample(wait=True)`` woken by a writer thread and a writer process,
``stats()``, the names of ``batch_time`` samples, the attribution of the sampler's warnings,
``as_dataset()`` and ``RateLimitedReplayBuffer`` (the nightly's features; they skip with a
reason where the installed TorchRL has none).
"""

from __future__ import annotations

import inspect
import multiprocessing as mp
import os
import sys
import threading
import time
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
import torchrl
import torchrl.data as trl
from torchrl.data import LazyTensorStorage

import fastreplay
from conformance.conftest import IMPLS, Impl, episodes
from fastreplay._torchrl import (
    NAMES_SAMPLES,
    NOTIFIES_READINESS,
    OUTPUT_LAYOUTS,
    SAMPLE_COUNTERS,
    SAMPLE_KEYWORDS,
    STORAGE_HAS_REVISION,
    WARNS_SHORT_FLAT_BATCH,
    Bookkeeping,
)

TORCHRL_DIR = os.path.dirname(torchrl.__file__) + os.sep

requires_direct_path = pytest.mark.skipif(
    not STORAGE_HAS_REVISION,
    reason=f"TorchRL {torchrl.__version__}: fastreplay's buffers take TorchRL's path for "
    "every call (its storages count no writes)",
)
requires_wait = pytest.mark.skipif(
    "wait" not in SAMPLE_KEYWORDS,
    reason=f"TorchRL {torchrl.__version__}'s ReplayBuffer.sample has no wait argument",
)
requires_counters = pytest.mark.skipif(
    not SAMPLE_COUNTERS, reason=f"TorchRL {torchrl.__version__} counts no samples"
)

# TorchRL functions the direct path replaces by its own data movement, with why each may be
# left out. Names are ``module:function``; the module is relative to torchrl/, with the
# packages 0.14+ split the buffers, samplers, storages and writers into named as 0.13's
# single modules (``data/replay_buffers/replay_buffers.py``...).
RB = "data/replay_buffers/"
REPLACED = {
    # the buffer methods themselves: the direct path is their replacement
    **dict.fromkeys(
        [
            f"{RB}replay_buffers.py:{name}"
            for name in (
                "extend",
                "_extend",
                "_set_index_in_td",
                "sample",
                "_sample",
                "update_priority",
                "update_tensordict_priority",
                "_get_priority_vector",
                "_anchor_reduced_priority",
                "dim_extend",
                "storage",
                "_get_batch_size",
                "_is_consuming",
            )
        ],
        "the method the direct path replaces, or a property read in its checks",
    ),
    f"{RB}replay_buffers.py:decorated_fun": "pin_memory_output: pinning is off on this path",
    f"{RB}replay_buffers.py:_maybe_to_storage_device": "info to the storage's device: CPU",
    f"{RB}utils.py:decorated_fun": "pin_memory_output: pinning is off on this path",
    f"{RB}utils.py:_is_int": "index type checks",
    f"{RB}utils.py:expand_as_right": "the metadata write, done by the direct gather",
    f"{RB}utils.py:_reduce": "update_tensordict_priority's reduction (as on both paths)",
    # the writer: cursor, write count, entity notification, all done by the direct write
    **dict.fromkeys(
        [
            f"{RB}writers.py:{name}"
            for name in (
                "extend",
                "_cursor",
                "_write_count",
                "_get_cursor",
                "_set_cursor",
                "_cursor_value",
                "tracks_generations",
                "_replicate_index",
                "_slot_generations",
                "_mark_update_entities",
            )
        ],
        "the round-robin writer's bookkeeping, done by the direct write",
    ),
    f"{RB}writers.py:_bump_generation": "a no-op without generations (the path requires none)",
    f"{RB}writers.py:_generation": "a no-op without generations (the path requires none)",
    # the storage: rows, length, last cursor, revision, done by the direct write and gather
    **dict.fromkeys(
        [
            f"{RB}storages.py:{name}"
            for name in (
                "set",
                "get",
                "_len",
                "__len__",
                "_last_cursor",
                "_last_cursor_index",
                "_set_last_cursor",
                "_mutation_revision",
                "_bump_mutation_revision",
                "_rand_given_ndim",
                "max_size",
                "ndim",
                "shape",
                "_storage",
                "_total_shape",
                "_len_along_dim0",
                "_max_size_along_dim0",
                "__getitem__",
                "_set_tree_map",
                "_get_new_len",
                "_flip_list",
                "_attached_entities",
                "_attached_entities_iter",
                "_is_full",
                "_collate_id",
            )
        ],
        "the tensor storage's write and read, done by the direct write and gather",
    ),
    f"{RB}storages.py:_storage_keys": "filters a locked storage's keys: exact keys are written",
    f"{RB}samplers.py:_set_sample_names": "the base no-op: Bookkeeping.named calls it if named",
    f"{RB}replay_buffers.py:_storage_index": "index conversion for the storage",
    f"{RB}replay_buffers.py:_collate_id": "the default collate function: identity",
    # the empty Compose TorchRL applies: its shallow copy and length checks
    "envs/transforms/_base.py:_inv_call": "the empty Compose's inverse (a shallow copy)",
    "envs/transforms/_base.py:inv": "the empty Compose's inverse (a shallow copy)",
    "envs/transforms/_base.py:clone": "the empty Compose's inverse (a shallow copy)",
    "envs/transforms/_base.py:in_keys_inv": "the empty Compose's inverse (a shallow copy)",
    "envs/transforms/_base.py:__len__": "the empty Compose's length check",
    # helpers with generic names: decorators, tree_map callbacks, comprehensions
    "_utils.py:_maybe_delay_init": "the delayed-init decorator (initialised already)",
    "_utils.py:wrapper": "decorator wrappers (compile-disable, delayed init)",
    f"{RB}replay_buffers.py:wrapper": "decorator wrappers (compile-disable, delayed init)",
    "_utils.py:is_compiling": "compile checks (never compiling here)",
    "_utils.py:_is_compiling": "compile checks (never compiling here)",
    f"{RB}replay_buffers.py:<lambda>": "tree_map callbacks of the data movement",
    f"{RB}replay_buffers.py:<genexpr>": "comprehensions of the data movement",
    f"{RB}samplers.py:<lambda>": "tree_map callbacks of the data movement",
}


def _where(filename: str) -> str | None:
    path = os.path.abspath(filename)
    if not path.startswith(TORCHRL_DIR):
        return None
    rel = path[len(TORCHRL_DIR) :].replace(os.sep, "/")
    for package in ("replay_buffers", "samplers", "storages", "writers"):
        if rel.startswith(f"{RB}{package}/"):
            return f"{RB}{package}.py"
    return rel


def trace(call: Callable[[], Any]) -> set[str]:
    """The TorchRL functions ``call`` enters, as ``path:function`` (see :data:`REPLACED`)."""
    seen: set[str] = set()

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            where = _where(frame.f_code.co_filename)
            if where is not None:
                seen.add(f"{where}:{frame.f_code.co_name}")

    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(None)
    return seen


def _buffers(kind: str, capacity: int = 37) -> tuple[Any, Any]:
    """Two identical fastreplay buffers: direct path on, and off (TorchRL's general path)."""

    def make() -> Any:
        if kind == "prioritized":
            return fastreplay.TensorDictPrioritizedReplayBuffer(
                alpha=0.7, beta=0.5, storage=LazyTensorStorage(capacity), batch_size=8
            )
        sampler = {
            "random": trl.RandomSampler,
            "slice": lambda: fastreplay.SliceSampler(num_slices=2, traj_key="traj"),
        }[kind]()
        return fastreplay.TensorDictReplayBuffer(
            storage=LazyTensorStorage(capacity), sampler=sampler, batch_size=8
        )

    fast, general = make(), make()
    general._fr_fast = False
    for rb in (fast, general):
        rb.extend(episodes(20, 7))  # the first write initialises the storage (general path)
    return fast, general


KINDS = ("random", "prioritized", "slice")


def _td_error(batch: Any) -> Any:
    batch["td_error"] = batch["obs"].float() % 5 + 0.5
    return batch


CALLS: dict[str, Callable[[Any], Any]] = {
    "extend": lambda rb: rb.extend(episodes(11, 7, first_id=50)),
    "sample": lambda rb: rb.sample(),
    "sample-info": lambda rb: rb.sample(return_info=True),
    "update_priority": lambda rb: rb.update_priority(torch.arange(4), torch.ones(4)),
    "update_tensordict_priority": lambda rb: rb.update_tensordict_priority(_td_error(rb.sample())),
}


def _applies(kind: str, call: str) -> bool:
    return "priority" not in call or kind == "prioritized"


@requires_direct_path
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("call", CALLS)
def test_direct_path_runs_every_torchrl_bookkeeping_step(kind: str, call: str) -> None:
    if not _applies(kind, call):
        pytest.skip(f"{call} needs a prioritized sampler")
    fast, general = _buffers(kind)
    CALLS[call](fast), CALLS[call](general)  # warm both (lazy set-up on first calls)
    on_direct = trace(lambda: CALLS[call](fast))
    on_general = trace(lambda: CALLS[call](general))
    skipped = sorted(on_general - on_direct - REPLACED.keys())
    assert not skipped, (
        f"TorchRL {torchrl.__version__}'s {call} runs {skipped} on its path and fastreplay's "
        "direct path does not: do it in fastreplay._torchrl.Bookkeeping, or add it to "
        "REPLACED if it only moves data the direct path moves itself"
    )


@requires_direct_path
@pytest.mark.skipif(
    not (NOTIFIES_READINESS and SAMPLE_COUNTERS),
    reason=f"TorchRL {torchrl.__version__} has no bookkeeping step to skip",
)
@pytest.mark.parametrize(("call", "step"), [("extend", "wrote"), ("sample", "sampled")])
def test_trace_catches_a_skipped_step(
    call: str, step: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The trace guard can fail: the direct path with one bookkeeping step left out."""
    fast, general = _buffers("random")
    monkeypatch.setattr(Bookkeeping, step, staticmethod(lambda *args: None))
    CALLS[call](fast), CALLS[call](general)
    on_general, on_direct = trace(lambda: CALLS[call](general)), trace(lambda: CALLS[call](fast))
    skipped = on_general - on_direct - REPLACED.keys()
    assert skipped


def _plain_state(rb: Any) -> dict[str, Any]:
    """The buffer's own attributes as comparable values (counters read, objects typed)."""
    out: dict[str, Any] = {}
    for name, value in vars(rb).items():
        if name.startswith("_fr_"):
            continue
        if hasattr(value, "get_lock") and hasattr(value, "value"):
            value = ("counter", value.value)
        elif isinstance(value, (bool, int, float, str, type(None), torch.Size)):
            pass
        elif isinstance(value, torch.Tensor):
            value = ("tensor", value.tolist())
        else:
            value = ("object", type(value).__name__)
        out[name] = value
    return out


@requires_direct_path
@pytest.mark.parametrize("kind", KINDS)
def test_buffer_attributes_equal_on_both_paths(kind: str) -> None:
    fast, general = _buffers(kind)
    for call in CALLS:
        if _applies(kind, call):
            for _ in range(3):
                torch.manual_seed(0)
                CALLS[call](fast)
                torch.manual_seed(0)
                CALLS[call](general)
    assert _plain_state(fast) == _plain_state(general)


# --------------------------------------------------------------------------- behaviours


def _buffer(impl: Impl, *, batch_size: int = 16, sampler: Any = None, **kwargs: Any) -> Any:
    cls = impl.cls("TensorDictReplayBuffer")
    sampler = sampler if sampler is not None else trl.RandomSampler()
    return cls(storage=LazyTensorStorage(1000), sampler=sampler, batch_size=batch_size, **kwargs)


def _emptied(impl: Impl) -> Any:
    """A buffer whose storage is initialised (so fastreplay's direct path applies) and empty."""
    rb = _buffer(impl)
    rb.extend(episodes(20, 10))
    rb.empty()
    return rb


@requires_wait
@pytest.mark.parametrize("impl", IMPLS, indirect=True)
def test_sample_wait_wakes_on_a_writer_thread(impl: Impl) -> None:
    rb = _emptied(impl)
    writer = threading.Timer(0.2, lambda: rb.extend(episodes(40, 10)))
    start = time.monotonic()
    writer.start()
    try:
        batch = rb.sample(wait=True, timeout=20)
    finally:
        writer.join()
    assert batch.shape == (16,)
    assert time.monotonic() - start < 10  # woken by the write, not by the deadline
    assert rb.wait_until_sampleable(timeout=0) is True


@requires_wait
@pytest.mark.parametrize("impl", IMPLS, indirect=True)
def test_sample_wait_times_out_and_cancels_as_torchrl(impl: Impl) -> None:
    rb = _emptied(impl)
    with pytest.raises(TimeoutError, match="did not become sampleable"):
        rb.sample(wait=True, timeout=0.05)
    cancel = threading.Event()
    cancel.set()
    with pytest.raises(RuntimeError, match="cancelled"):
        rb.sample(wait=True, timeout=5, cancel_event=cancel)


def _write_later(rb: Any) -> None:
    time.sleep(0.3)
    rb.extend(episodes(40, 10))


@requires_wait
@pytest.mark.parametrize("impl", IMPLS, indirect=True)
def test_sample_wait_wakes_on_a_writer_process(impl: Impl) -> None:
    rb = _buffer(impl)
    rb.extend(episodes(20, 10))
    rb.empty()
    rb.share()
    ctx = mp.get_context("fork")
    writer = ctx.Process(target=_write_later, args=(rb,))
    start = time.monotonic()
    writer.start()
    try:
        batch = rb.sample(wait=True, timeout=30)
    finally:
        writer.join(30)
    assert writer.exitcode == 0
    assert batch.shape == (16,)
    assert time.monotonic() - start < 20


@requires_counters
@pytest.mark.parametrize("impl", IMPLS, indirect=True)
@pytest.mark.parametrize("kind", ["random", "slice", "prioritized"])
def test_stats_count_samples_as_torchrl(impl: Impl, kind: str) -> None:
    if kind == "prioritized":
        sampler = fastreplay.PrioritizedSampler(1000, 0.7, 0.5)  # in either buffer
    elif kind == "slice":
        sampler = fastreplay.SliceSampler(num_slices=4, traj_key="traj")
    else:
        sampler = trl.RandomSampler()
    rb = _buffer(impl, sampler=sampler)
    rb.extend(episodes(100, 10))
    for _ in range(3):
        rb.sample()
    with pytest.warns(UserWarning, match="conflicting batch_sizes"):
        rb.sample(8)  # a batch size of its own
    stats = rb.stats()
    assert (stats["sample_calls"], stats["samples_returned"]) == (4, 56)
    assert rb.state_dict()["_sample_calls"] == 4
    restored = _buffer(impl, sampler=type(sampler)(**_sampler_args(kind)))
    restored.load_state_dict(rb.state_dict())
    assert restored.stats()["sample_calls"] == 4


def _sampler_args(kind: str) -> dict[str, Any]:
    if kind == "prioritized":
        return {"max_capacity": 1000, "alpha": 0.7, "beta": 0.5}
    if kind == "slice":
        return {"num_slices": 4, "traj_key": "traj"}
    return {}


@pytest.mark.skipif(
    "batch_time" not in OUTPUT_LAYOUTS or not NAMES_SAMPLES,
    reason=f"TorchRL {torchrl.__version__}'s SliceSampler has no batch_time layout",
)
@pytest.mark.parametrize("buffer_side", IMPLS)
@pytest.mark.parametrize("sampler_side", IMPLS)
@pytest.mark.parametrize("time_dim_name", [None, "steps"])
def test_batch_time_samples_carry_torchrl_names(
    buffer_side: str, sampler_side: str, time_dim_name: str | None
) -> None:
    names = {} if time_dim_name is None else {"time_dim_name": time_dim_name}
    sampler = Impl(sampler_side).cls("SliceSampler")(
        num_slices=4, traj_key="traj", output_layout="batch_time", **names
    )
    rb = _buffer(Impl(buffer_side), sampler=sampler)
    rb.extend(episodes(200, 20))
    batch = rb.sample()
    assert batch.shape == (4, 4)
    assert batch.names == [None, time_dim_name or "time"]


@pytest.mark.skipif(
    not WARNS_SHORT_FLAT_BATCH,
    reason=f"TorchRL {torchrl.__version__}'s SliceSampler does not warn on short batches",
)
@pytest.mark.parametrize("buffer_side", IMPLS)
@pytest.mark.parametrize("sampler_side", IMPLS)
def test_sampler_warnings_are_attributed_as_torchrl(buffer_side: str, sampler_side: str) -> None:
    def warned(buffer: str, sampler: str) -> list[tuple[Any, str, str, int]]:
        s = Impl(sampler).cls("SliceSampler")(num_slices=4, traj_key="traj", strict_length=False)
        rb = _buffer(Impl(buffer), sampler=s, batch_size=64)
        rb.extend(episodes(200, 5))  # episodes shorter than the slices
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            rb.sample()  # the first sample initialises (TorchRL's path)
        s._warned_short_batch = False
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            rb.sample()
        return [(w.category, str(w.message)[:40], w.filename, w.lineno) for w in seen]

    reference = warned("torchrl", "torchrl")
    assert reference and reference[0][2].startswith(TORCHRL_DIR)
    assert warned(buffer_side, sampler_side) == reference
    # and a filter written for TorchRL's module silences it
    s = Impl(sampler_side).cls("SliceSampler")(num_slices=4, traj_key="traj", strict_length=False)
    rb = _buffer(Impl(buffer_side), sampler=s, batch_size=64)
    rb.extend(episodes(200, 5))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warnings.filterwarnings("ignore", category=UserWarning, module="torchrl")
        rb.sample()
        s._warned_short_batch = False
        rb.sample()


requires_dataset = pytest.mark.skipif(
    not hasattr(trl.ReplayBuffer, "as_dataset"),
    reason=f"TorchRL {torchrl.__version__}'s buffers have no as_dataset",
)


@requires_dataset
@pytest.mark.parametrize("buffer_side", IMPLS)
def test_as_dataset_streams_slices_in_workers(buffer_side: str) -> None:
    from torch.utils.data import DataLoader
    from torchrl.data import tensordict_collate

    sampler = fastreplay.SliceSampler(num_slices=4, traj_key="traj")
    cls = Impl(buffer_side).cls("TensorDictReplayBuffer")
    rb = cls(storage=trl.LazyMemmapStorage(1000), sampler=sampler, batch_size=32)
    rb.extend(episodes(600, 50))
    loader = DataLoader(
        rb.as_dataset(num_batches=6),
        batch_size=None,
        num_workers=2,
        collate_fn=tensordict_collate,
        multiprocessing_context="fork",
    )
    batches = list(loader)
    assert len(batches) == 6
    for batch in batches:
        rows = batch["obs"].reshape(4, 8)
        assert ((rows[:, 1:] - rows[:, :-1]) == 1).all()  # never crosses a trajectory


def _count_rebuilds(monkeypatch: pytest.MonkeyPatch) -> Any:
    """A process-shared count of full index rebuilds (workers are forked after the patch)."""
    from fastreplay.samplers import _index_sync

    count = mp.get_context("fork").Value("q", 0)
    rebuild = _index_sync.IndexSync._rebuild

    def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
        with count.get_lock():
            count.value += 1
        return rebuild(self, *args, **kwargs)

    monkeypatch.setattr(_index_sync.IndexSync, "_rebuild", counted)
    return count


@requires_dataset
@pytest.mark.parametrize("shared", [False, True], ids=["unshared", "shared"])
def test_as_dataset_workers_rebuild_at_most_once_per_write(
    shared: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Workers' copies of a slice sampler: incremental when the buffer is shared (writes are
    reported to every process), at most one rebuild per write otherwise, never per batch."""
    from torch.utils.data import DataLoader
    from torchrl.data import tensordict_collate

    rebuilds = _count_rebuilds(monkeypatch)
    rb = fastreplay.TensorDictReplayBuffer(
        storage=trl.LazyMemmapStorage(5000),
        sampler=fastreplay.SliceSampler(num_slices=4, traj_key="traj"),
        batch_size=32,
    )
    rb.extend(episodes(2000, 50))
    if shared:
        rb.share()
    loader = DataLoader(
        rb.as_dataset(),
        batch_size=None,
        num_workers=2,
        collate_fn=tensordict_collate,
        multiprocessing_context="fork",
        persistent_workers=True,
        prefetch_factor=1,
    )
    batches = iter(loader)
    writes = 4
    for w in range(writes):
        for _ in range(3):
            batch = next(batches)
            rows = batch["obs"].reshape(4, 8)
            assert ((rows[:, 1:] - rows[:, :-1]) == 1).all()
        rb.extend(episodes(100, 50, first_id=1000 + 10 * w))
    for _ in range(6):
        next(batches)
    del batches, loader
    assert rebuilds.value <= (0 if shared else 2 * writes)  # 2 workers


requires_rate_limited = pytest.mark.skipif(
    not hasattr(trl, "RateLimitedReplayBuffer"),
    reason=f"TorchRL {torchrl.__version__} has no RateLimitedReplayBuffer",
)


@requires_rate_limited
@pytest.mark.parametrize(
    ("make", "slices"),
    [
        (lambda: fastreplay.SliceSampler(num_slices=2, traj_key="traj"), 2),
        (lambda: fastreplay.PrioritizedSampler(100, 0.7, 0.5), None),
        (lambda: fastreplay.SliceSamplerWithoutReplacement(num_slices=2, traj_key="traj"), 2),
    ],
    ids=["slice", "prioritized", "slice-without-replacement"],
)
def test_rate_limited_buffer_with_fastreplay_samplers(
    make: Callable[[], Any], slices: int | None
) -> None:
    rb = trl.RateLimitedReplayBuffer(
        storage=LazyTensorStorage(100), sampler=make(), batch_size=8, samples_per_insert=1.0
    )
    written = episodes(16, 8)
    rb.extend(written)
    for _ in range(2):  # 16 records sampled for 16 inserted: the budget
        batch = rb.sample(wait=True, timeout=5)
        assert batch.numel() == 8
        assert torch.isin(batch["obs"], written["obs"]).all()
        if slices is not None:
            rows = batch["obs"].reshape(slices, -1)
            assert ((rows[:, 1:] - rows[:, :-1]) == 1).all()
    assert rb.can_sample() is False
    with pytest.raises(TimeoutError):
        rb.sample(wait=True, timeout=0.05)
    rb.extend(episodes(8, 8, first_id=10))
    assert rb.sample(wait=True, timeout=5).numel() == 8


@requires_direct_path
def test_notify_is_on_the_direct_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """Readiness is notified after a direct write where TorchRL notifies (the nightly)."""
    rb = fastreplay.TensorDictReplayBuffer(storage=LazyTensorStorage(50), batch_size=4)
    rb.extend(episodes(10, 5))
    calls: list[int] = []
    if NOTIFIES_READINESS:
        real = rb._notify_replay_state_change
        monkeypatch.setattr(rb, "_notify_replay_state_change", lambda: (calls.append(1), real()))
    rb.extend(episodes(10, 5))
    assert calls == ([1] if NOTIFIES_READINESS else [])


def test_sample_keywords_match_torchrl() -> None:
    params = inspect.signature(trl.ReplayBuffer.sample).parameters
    assert {n for n, p in params.items() if p.kind is p.KEYWORD_ONLY} == SAMPLE_KEYWORDS


@requires_direct_path
@pytest.mark.parametrize("buffer", ["TensorDictReplayBuffer", "TensorDictPrioritizedReplayBuffer"])
@pytest.mark.parametrize(
    "shape", [(8,), (8, 1), (8, 3), "int", "missing"], ids=["B", "Bx1", "Bx3", "int", "missing"]
)
@pytest.mark.parametrize("reduction", ["max", "mean", "median"])
def test_update_tensordict_priority_same_on_both_paths(
    buffer: str, shape: Any, reduction: str
) -> None:
    def make() -> Any:
        if buffer == "TensorDictPrioritizedReplayBuffer":
            return fastreplay.TensorDictPrioritizedReplayBuffer(
                alpha=0.7, beta=0.5, reduction=reduction, storage=LazyTensorStorage(37),
                batch_size=8, priority_key="td_error",
            )  # fmt: skip
        return fastreplay.TensorDictReplayBuffer(
            storage=LazyTensorStorage(37),
            sampler=fastreplay.PrioritizedSampler(37, 0.7, 0.5, reduction=reduction),
            batch_size=8,
            priority_key="td_error",
        )

    fast, general = make(), make()
    general._fr_fast = False
    outcomes = []
    for rb in (fast, general):
        rb.extend(episodes(30, 7))
        np.random.seed(3)
        batch = rb.sample()
        gen = torch.Generator().manual_seed(0)
        if shape == "int":
            batch["td_error"] = torch.randint(1, 5, (8,), generator=gen)
        elif shape != "missing":
            batch["td_error"] = torch.rand(shape, generator=gen) * 3
        try:
            rb.update_tensordict_priority(batch)
            outcomes.append(rb._sampler._trees.raw().clone())
        except Exception as err:  # the same error on both paths
            outcomes.append((type(err), str(err)))
    if isinstance(outcomes[0], torch.Tensor):
        assert torch.equal(outcomes[0], outcomes[1])
    else:
        assert outcomes[0] == outcomes[1]

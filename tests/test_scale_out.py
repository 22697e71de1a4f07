"""Writer processes and one learner on a shared storage (TorchRL's collector topology).

The learner builds a ``shared=True`` buffer on ``LazyMemmapStorage(shared_init=True)``, as
TorchRL's Dreamer script does; real worker processes (``fork``: no re-import of torch, so each
test stays within seconds; one ``spawn`` test covers the pickled hand-over collectors use) write
episodes, and the learner samples. Data carries its invariants: ``obs = traj * 10_000 + step``
and a ``written`` flag that a never-written memmap slot (zeros) does not have, so a stale index,
a slice crossing episodes or a row nobody wrote is visible in the sample.

Every set-up is one entry of ``SETUPS``: adding a sampler is one line there.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torchrl.data as trl
from tensordict import TensorDict
from torchrl.data import LazyMemmapStorage, LazyTensorStorage, ListStorage, RandomSampler

import fastreplay
from conftest import TORCHRL_EXT, requires_storage_revision, short_flat_batches
from fastreplay._torchrl import (
    STORAGE_HAS_REVISION,
    TORCHRL_VERSION,
    last_cursor_row,
    mutation_revision,
)
from fastreplay.samplers._index_sync import IndexSync

CAPACITY = 101  # odd, and smaller than what each test writes: the cursor wraps
EPISODE = 9
NUM_SLICES = 4
BATCH = 20
WRITERS = 2

if "fork" not in multiprocessing.get_all_start_methods():  # pragma: no cover - Linux has it
    pytest.skip("needs the 'fork' start method (Linux)", allow_module_level=True)
FORK = multiprocessing.get_context("fork")


@dataclass(frozen=True)
class Setup:
    """A learner-side buffer on a shared storage; ``slices`` is ``NUM_SLICES`` or ``None``."""

    name: str
    build: Callable[[Any], Any]
    slices: int | None = None
    prioritized: bool = False
    needs_ext: bool = False


def _slice_rb(module: Any, name: str = "SliceSampler", **kwargs: Any) -> Callable[[Any], Any]:
    def build(storage: Any) -> Any:
        sampler = getattr(module, name)(num_slices=NUM_SLICES, traj_key="traj", **kwargs)
        return module.TensorDictReplayBuffer(
            storage=storage, sampler=sampler, batch_size=BATCH, shared=True
        )

    return build


def _per_rb(module: Any) -> Callable[[Any], Any]:
    def build(storage: Any) -> Any:
        return module.TensorDictPrioritizedReplayBuffer(
            alpha=0.7, beta=0.5, storage=storage, batch_size=BATCH, shared=True, sync=False
        )

    return build


def _uniform_rb(storage: Any) -> Any:
    return fastreplay.TensorDictReplayBuffer(storage=storage, batch_size=BATCH, shared=True)


SETUPS = [
    Setup("fastreplay.SliceSampler", _slice_rb(fastreplay), slices=NUM_SLICES),
    Setup("fastreplay.TensorDictPrioritizedReplayBuffer", _per_rb(fastreplay), prioritized=True),
    Setup("fastreplay.TensorDictReplayBuffer", _uniform_rb),
    Setup(
        "fastreplay.SliceSamplerWithoutReplacement",
        _slice_rb(fastreplay, "SliceSamplerWithoutReplacement"),
        slices=NUM_SLICES,
    ),
    # TorchRL's own classes in the same topology: the behaviour fastreplay must keep.
    Setup("torchrl.SliceSampler", _slice_rb(trl), slices=NUM_SLICES),
    Setup(
        "torchrl.TensorDictPrioritizedReplayBuffer", _per_rb(trl), prioritized=True, needs_ext=True
    ),
]


@pytest.fixture(params=SETUPS, ids=lambda s: s.name)
def setup(request: pytest.FixtureRequest) -> Setup:
    chosen = request.param
    if chosen.needs_ext and not TORCHRL_EXT:
        pytest.skip("TorchRL's prioritized sampler needs its compiled extension (torchrl._torchrl)")
    return chosen


def episode(writer: int, number: int) -> TensorDict:
    """Episode ``number`` of ``writer``: ``EPISODE`` steps with ids unique across writers."""
    traj = torch.full((EPISODE,), writer * 1_000 + number)
    return TensorDict(
        traj=traj,
        obs=traj * 10_000 + torch.arange(EPISODE),
        written=torch.ones(EPISODE, dtype=torch.bool),
        batch_size=[EPISODE],
    )


def _write(rb: Any, writer: int, first: int, count: int) -> None:
    for number in range(first, first + count):
        rb.extend(episode(writer, number))


def run_writers(rb: Any, first: int, count: int, ctx: Any = FORK, timeout: float = 120) -> None:
    """``WRITERS`` processes each write ``count`` episodes numbered from ``first``; joined."""
    procs = [ctx.Process(target=_write, args=(rb, w, first, count)) for w in range(WRITERS)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout)
    assert [p.exitcode for p in procs] == [0] * WRITERS


def assert_valid(sample: TensorDict, slices: int | None) -> None:
    """Written rows only, ``obs`` consistent with ``traj``; slices inside one episode."""
    assert sample["written"].all(), "sampled a row no process wrote"
    obs, traj = sample["obs"].reshape(-1), sample["traj"].reshape(-1)
    assert torch.equal(obs // 10_000, traj) and bool((obs % 10_000 < EPISODE).all())
    if slices:  # whole slices of BATCH // slices steps (an epoch's last batch may be short)
        rows = obs.view(-1, BATCH // slices)
        assert bool((rows[:, 1:] - rows[:, :-1] == 1).all()), rows


def stored(rb: Any) -> TensorDict:
    """Every stored row (``storage.get`` attaches this process to the workers' memmap)."""
    storage = rb._storage
    return storage.get(slice(0, len(storage)))


def raw_priorities(rb: Any) -> torch.Tensor:
    """fastreplay's raw priority per slot (0 where nothing was marked)."""
    return rb.prioritized_sampler.state_dict()["_raw"]


@short_flat_batches
def test_rows_from_writer_processes_reach_the_learner(setup: Setup) -> None:
    """Each round of writes (wrapping the storage) is sampled, never stale, never unwritten."""
    rb = setup.build(LazyMemmapStorage(CAPACITY, shared_init=True))
    for round_ in range(3):
        first = round_ * 5
        run_writers(rb, first, 5)  # 2 x 5 x 9 = 90 rows per round: the cursor wraps
        assert rb.write_count == (round_ + 1) * WRITERS * 5 * EPISODE
        assert len(rb) == min(CAPACITY, rb.write_count)
        # Sample first: the learner has not touched the storage since the workers wrote
        # (in round 0 it has never seen the memmap the first worker created).
        samples = [rb.sample() for _ in range(60)]
        live = set(stored(rb)["traj"].tolist())
        new = {w * 1_000 + n for w in range(WRITERS) for n in range(first, first + 5)}
        assert new <= live
        seen: set[int] = set()
        for sample in samples:
            assert_valid(sample, setup.slices)
            traj = set(sample["traj"].tolist())
            assert traj <= live, f"stale: sampled overwritten episodes {traj - live}"
            seen |= traj
        assert new <= seen, f"episodes written by the workers never sampled: {new - seen}"
        if setup.prioritized:
            # Rows caught up by the learner get the live max priority of what was stored.
            rows = stored(rb)
            fresh = torch.tensor([t in new for t in rows["traj"].tolist()])
            if isinstance(rb.prioritized_sampler, fastreplay.PrioritizedSampler):
                raw = raw_priorities(rb)
                old = raw[: len(rows)][~fresh]
                expected = float(old.max()) if old.numel() else 1.0
                assert torch.all(raw[: len(rows)][fresh] == expected)
            # The learner re-prioritises what it sampled.
            sample = rb.sample()
            sample["td_error"] = (sample["obs"] % 10_000 + round_).float() / 10
            rb.update_tensordict_priority(sample)


@short_flat_batches
def test_writers_and_learner_run_concurrently(setup: Setup) -> None:
    """The learner samples (and re-prioritises) while the workers write and wrap."""
    if "WithoutReplacement" in setup.name and not STORAGE_HAS_REVISION:
        pytest.skip(
            f"TorchRL {TORCHRL_VERSION}'s storages share no write cursor with other processes: "
            "mid-write trajectories at the workers' cursor look short to the learner"
        )
    rb = setup.build(LazyMemmapStorage(CAPACITY, shared_init=True))
    rb.extend(episode(9, 0))  # the learner writes too: its reported writes mix with remote ones
    procs = [FORK.Process(target=_write, args=(rb, w, 0, 40)) for w in range(WRITERS)]
    for p in procs:
        p.start()
    steps = 0
    while any(p.is_alive() for p in procs) or steps < 20:
        sample = rb.sample()
        assert_valid(sample, setup.slices)
        if setup.prioritized:
            sample["td_error"] = (sample["obs"] % 10_000).float() + 0.5
            rb.update_tensordict_priority(sample)
            sampler = rb.prioritized_sampler
            if isinstance(sampler, fastreplay.PrioritizedSampler):
                assert sampler.default_priority == float(raw_priorities(rb).max())
        steps += 1
        assert steps < 100_000
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0] * WRITERS
    assert rb.write_count == EPISODE * (1 + WRITERS * 40)
    assert_valid(rb.sample(), setup.slices)


def _spawn_writer(rb: Any, writer: int) -> None:
    _write(rb, writer, 0, 3)


@pytest.mark.slow
def test_spawned_writer_shares_cursor_and_storage() -> None:
    """``spawn`` pickles the buffer (as collectors do): cursor, length and memmap are shared."""
    rb = fastreplay.TensorDictReplayBuffer(
        storage=LazyMemmapStorage(CAPACITY, shared_init=True),
        sampler=fastreplay.SliceSampler(num_slices=NUM_SLICES, traj_key="traj"),
        batch_size=BATCH,
        shared=True,
    )
    ctx = multiprocessing.get_context("spawn")
    proc = ctx.Process(target=_spawn_writer, args=(rb, 1))
    proc.start()
    proc.join(300)
    assert proc.exitcode == 0
    assert rb.write_count == len(rb) == 3 * EPISODE
    assert torch.equal(stored(rb)["traj"], torch.arange(1_000, 1_003).repeat_interleave(EPISODE))
    for _ in range(10):
        assert_valid(rb.sample(), NUM_SLICES)
    rb.extend(episode(0, 0))  # the learner's own write continues at the shared cursor
    assert bool((stored(rb)["traj"][-EPISODE:] == 0).all())


class RecordingSliceSampler(fastreplay.SliceSampler):
    """Records the rows each ``extend`` call reports, in the process that calls it."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.reported: list[list[int]] = []

    def extend(self, index: torch.Tensor) -> None:
        self.reported.append(torch.as_tensor(index).reshape(-1).tolist())
        super().extend(index)


def _recording_rb() -> Any:
    return fastreplay.TensorDictReplayBuffer(
        storage=LazyMemmapStorage(CAPACITY, shared_init=True),
        sampler=RecordingSliceSampler(num_slices=NUM_SLICES, traj_key="traj"),
        batch_size=BATCH,
        shared=True,
    )


def test_remote_writes_are_reported_to_the_learner_sampler() -> None:
    """One ``extend`` per write made elsewhere, with exactly the rows written, in order."""
    rb = _recording_rb()
    rb.extend(episode(9, 0))  # a local write: reported by TorchRL's own path
    assert rb._sampler.reported == [list(range(EPISODE))]
    written = EPISODE
    for count in (5, 1):  # 9 + 90 rows, then 18 more that wrap past row 100
        before = len(rb._sampler.reported)
        run_writers(rb, 10 * count, count)
        assert len(rb._sampler.reported) == before  # nothing reported until this process looks
        rb.sample()
        reported = rb._sampler.reported[before:]
        assert len(reported) == WRITERS * count
        rows = [r for part in reported for r in part]
        assert rows == [r % CAPACITY for r in range(written, written + WRITERS * count * EPISODE)]
        written += WRITERS * count * EPISODE
    rb.sample()  # nothing new: nothing reported
    assert len(rb._sampler.reported) == 1 + WRITERS * 6


@requires_storage_revision
def test_remote_writes_keep_the_index_incremental(monkeypatch: pytest.MonkeyPatch) -> None:
    """After the first index build, reported remote writes never trigger a full rebuild."""
    rebuilds = []
    rebuild = IndexSync._rebuild

    def counting(self: Any, *args: Any) -> None:
        rebuilds.append(1)
        rebuild(self, *args)

    monkeypatch.setattr(IndexSync, "_rebuild", counting)
    rb = _recording_rb()
    rb.extend(episode(9, 0))
    rb.sample()
    for round_ in range(3):
        run_writers(rb, round_ * 4, 4)
        assert_valid(rb.sample(), NUM_SLICES)
    assert rebuilds == []


@requires_storage_revision
def test_unreported_remote_write_rebuilds_the_index() -> None:
    """``rb[idx] = ...`` in a worker is not a counted write: the learner re-indexes."""
    rb = _recording_rb()
    _write(rb, 0, 0, 3)
    proc = FORK.Process(target=_overwrite_middle, args=(rb,))
    proc.start()
    proc.join(60)
    assert proc.exitcode == 0
    for _ in range(20):
        sample = rb.sample()
        assert_valid(sample, NUM_SLICES)
    assert 7 in {t for _ in range(50) for t in rb.sample()["traj"].tolist()}


def _overwrite_middle(rb: Any) -> None:
    # Rows 9..17 (episode 1) become episode 7, written without the cursor.
    rb[torch.arange(EPISODE, 2 * EPISODE)] = episode(0, 7)


# ------------------------------------------------------------------- bad input, at share time
def _per(**kwargs: Any) -> Any:
    return fastreplay.TensorDictPrioritizedReplayBuffer(alpha=0.7, beta=0.5, **kwargs)


BAD = [
    pytest.param(
        lambda: fastreplay.TensorDictReplayBuffer(storage=ListStorage(7), shared=True),
        r"storage=ListStorage lives in one process.*LazyMemmapStorage\(max_size, shared_init=True",
        id="list-storage",
    ),
    pytest.param(
        lambda: _per(storage=LazyMemmapStorage(7, shared_init=True), shared=True),
        r"sampler=PrioritizedSampler: its priority trees live in one process.*sync=False",
        id="prioritized-sync-true",
    ),
]


@pytest.mark.parametrize(("build", "match"), BAD)
def test_unshareable_setups_fail_at_construction(build: Callable[[], Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        build()


def _extend_sevens(rb: Any) -> None:
    rb.extend(TensorDict(obs=torch.full((3,), 7), batch_size=[3]))


def _forked(target: Callable[..., None], *args: Any) -> None:
    proc = FORK.Process(target=target, args=args)
    proc.start()
    proc.join(60)
    assert proc.exitcode == 0


def _torchrl_list_storage() -> None:
    rb = trl.TensorDictReplayBuffer(storage=ListStorage(10), shared=True)
    rb.extend(TensorDict(obs=torch.arange(2), batch_size=[2]))
    _forked(_extend_sevens, rb)
    assert rb.write_count == 5 and len(rb) == 2  # counted, never received


def _torchrl_prioritized_sync_true() -> None:
    if not TORCHRL_EXT:
        pytest.skip("TorchRL's prioritized sampler needs its compiled extension (torchrl._torchrl)")
    rb = trl.TensorDictPrioritizedReplayBuffer(
        alpha=0.7,
        beta=0.5,
        storage=LazyMemmapStorage(100, shared_init=True),
        batch_size=64,
        shared=True,
    )
    rb.extend(TensorDict(obs=torch.arange(10), batch_size=[10]))
    _forked(_extend_sevens, rb)
    assert len(rb) == 13 and bool((stored(rb)["obs"][10:] == 7).all())
    assert max(i for _ in range(30) for i in rb.sample()["index"].tolist()) < 10


def _torchrl_lazy_storage_written_here_first() -> None:
    rb = trl.TensorDictReplayBuffer(storage=LazyTensorStorage(8), shared=True)
    rb.extend(TensorDict(obs=torch.arange(2), batch_size=[2]))
    _forked(_extend_sevens, rb)
    assert len(rb) == 5 and not bool((stored(rb)["obs"][2:] == 7).all())  # not the rows written


def _torchrl_lazy_storage_written_by_the_worker_first() -> None:
    rb = trl.TensorDictReplayBuffer(storage=LazyTensorStorage(8), shared=True)
    _forked(_extend_sevens, rb)
    assert len(rb) == 3 and not rb.storage.initialized  # counted, nothing to read


@pytest.mark.parametrize(
    "case",
    [
        _torchrl_list_storage,
        _torchrl_prioritized_sync_true,
        _torchrl_lazy_storage_written_here_first,
        _torchrl_lazy_storage_written_by_the_worker_first,
    ],
    ids=lambda case: case.__name__.removeprefix("_torchrl_"),
)
def test_torchrl_loses_a_forked_writer_s_rows(case: Callable[[], None]) -> None:
    """Why fastreplay refuses or moves these set-ups: TorchRL's learner misses a worker's rows.

    ``ListStorage`` and ``sync=True`` are refused at construction; a lazy storage is moved to
    shared memory when first written by the process that shared it, and refused when first
    written elsewhere (the tests above). TorchRL accepts all four and a ``fork``ed worker's
    rows never reach the learner.
    """
    case()


def test_share_on_an_unshareable_buffer_changes_nothing() -> None:
    rb = _per(storage=LazyMemmapStorage(7, shared_init=True), batch_size=3)
    with pytest.raises(ValueError, match=r"pass sync=False"):
        rb.share()
    assert rb.shared is False
    rb.extend(TensorDict(obs=torch.arange(5), batch_size=[5]))
    assert rb.sample().shape == (3,)


@pytest.mark.parametrize(
    "build",
    [
        lambda: fastreplay.TensorDictReplayBuffer(
            storage=LazyTensorStorage(7, shared_init=True), shared=True
        ),
        lambda: fastreplay.TensorDictReplayBuffer(storage=LazyTensorStorage(7), shared=True),
        lambda: fastreplay.TensorDictReplayBuffer(storage=LazyMemmapStorage(7)).share(True),
        lambda: _per(storage=LazyMemmapStorage(7, shared_init=True), shared=True, sync=False),
        lambda: _per(storage=LazyTensorStorage(7), shared=True, sync=False),
        lambda: fastreplay.TensorDictReplayBuffer(
            storage=LazyMemmapStorage(7, shared_init=True),
            sampler=fastreplay.SliceSampler(num_slices=2, traj_key="traj"),
            shared=True,
        ),
    ],
    ids=[
        "lazy-tensor-shared-init",
        "lazy-tensor-not-written-yet",
        "lazy-memmap-not-written-yet-share",
        "prioritized-sync-false",
        "prioritized-sync-false-lazy-tensor",
        "slice",
    ],
)
def test_shareable_setups_construct(build: Callable[[], Any]) -> None:
    assert build().shared is True


def test_initialized_tensor_storage_can_be_shared_later() -> None:
    rb = fastreplay.TensorDictReplayBuffer(storage=LazyTensorStorage(7), batch_size=3)
    rb.extend(TensorDict(obs=torch.arange(5), batch_size=[5]))
    assert rb.share().shared is True


def test_pickled_copy_owns_its_write_count() -> None:
    """A copy that is not a process start (checkpoint, Ray) gets its own write count.

    TorchRL refuses to pickle a buffer while it is shared (its write lock); once unshared, it
    pickles, and the copy must not keep counting into the original's shared value.
    """
    import pickle

    rb = fastreplay.TensorDictReplayBuffer(
        storage=LazyTensorStorage(CAPACITY),  # shared_init storages hold a lock: not picklable
        sampler=fastreplay.SliceSampler(num_slices=NUM_SLICES, traj_key="traj"),
        batch_size=BATCH,
    )
    rb.extend(episode(0, 0))
    rb.share()
    rb.extend(episode(0, 2))
    rb.share(False)
    copy = pickle.loads(pickle.dumps(rb))
    assert copy._fr_writes.value == rb._fr_writes.value == 1
    copy.share(True)
    copy.extend(episode(0, 1))
    assert (copy._fr_writes.value, rb._fr_writes.value) == (2, 1)
    assert_valid(copy.sample(), NUM_SLICES)


def test_a_waiting_sample_goes_before_writes_not_yet_started() -> None:
    """The shared gate: a write that arrives while a sample waits for the lock waits behind it.

    The lock and the gate record who starts waiting for them: while a write is in progress and
    a sample waits (marked at the gate), new writes wait at the gate and never reach the lock
    before the sample has it, so the sample waits for one write, not for a stream of them.
    """
    import threading

    from fastreplay.buffers.sharing import _SampleFirst, _turn

    events: list[tuple[str, str]] = []

    class Spy:
        def __init__(self, name: str) -> None:
            self.name, self.inner = name, threading.Lock()

        def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
            events.append((threading.current_thread().name, self.name))
            return self.inner.acquire(blocking, timeout)

        def release(self) -> None:
            self.inner.release()

    class Gate(_SampleFirst):
        def wait_for_samples(self) -> None:
            events.append((threading.current_thread().name, "gate"))
            super().wait_for_samples()

    lock, gate, order = Spy("lock"), Gate(), []

    def section(sampling: bool) -> None:
        with _turn(lock, gate, sampling):
            order.append(threading.current_thread().name)

    lock.inner.acquire()  # a write in progress
    sample = threading.Thread(target=section, args=(True,), name="sample", daemon=True)
    writes = [
        threading.Thread(target=section, args=(False,), name=f"w{i}", daemon=True) for i in range(3)
    ]
    try:
        sample.start()
        while ("sample", "lock") not in events:  # the sample is marked, waits for the lock
            assert sample.is_alive()
        for thread in writes:
            thread.start()
        while sum(who.startswith("w") for who, _ in events) < 3:  # every write is waiting
            assert any(thread.is_alive() for thread in writes)
        assert {what for who, what in events if who.startswith("w")} == {"gate"}
    finally:
        lock.inner.release()
    for thread in [sample, *writes]:
        thread.join(10)
    assert order[0] == "sample" and sorted(order[1:]) == ["w0", "w1", "w2"]
    assert not lock.inner.locked() and gate._stamp.value == 0.0


def test_shared_buffer_gate_is_copied_apart() -> None:
    """A shared buffer has a gate; a pickled (unshared) copy gets its own, and both work."""
    import pickle

    rb = fastreplay.TensorDictReplayBuffer(
        storage=LazyTensorStorage(CAPACITY),
        sampler=fastreplay.SliceSampler(num_slices=NUM_SLICES, traj_key="traj"),
        batch_size=BATCH,
    )
    rb.extend(episode(0, 0))  # initialized in this process: shareable, and picklable
    rb.share()
    assert rb._fr_gate is not None
    rb.extend(episode(0, 2))
    rb.share(False)
    copy = pickle.loads(pickle.dumps(rb))
    assert copy._fr_gate is not None and copy._fr_gate is not rb._fr_gate
    copy.share(True)
    copy.extend(episode(0, 1))
    assert_valid(copy.sample(), NUM_SLICES)


# --------------------------------------------- lazy storages shared before their first write
# TorchRL's ``TestSharedStorageInit`` (test/rb/test_storages.py) in fastreplay's buffers, with
# ``fork``: the buffer is shared before its ``LazyTensorStorage`` is initialized, the parent
# writes first, and a forked worker's writes (rows, length, mutation revision, cursor, episode
# boundaries) reach the parent. TorchRL shares the rows only when a ``spawn``ed process pickles
# the storage; fastreplay moves it to shared memory at the first write, so ``fork`` works too.
def _transitions(first: int, done: list[int], count: int) -> TensorDict:
    obs = torch.arange(first, first + count)
    return TensorDict(
        {"obs": obs, ("next", "done"): torch.tensor([int(o) in done for o in obs])},
        batch_size=[count],
    )


def _revision_worker(rb: Any, queue: Any) -> None:
    rb.extend(_transitions(6, [7], 2))
    queue.put(mutation_revision(rb.storage, None))  # None: TorchRL 0.13 counts no writes


def _boundary_worker(rb: Any, queue: Any) -> None:
    rb[1] = TensorDict({"obs": torch.tensor(1), ("next", "done"): torch.tensor(True)}, [])
    queue.put(mutation_revision(rb.storage, None))


def _run(target: Callable[..., None], rb: Any) -> Any:
    queue = FORK.Queue()
    proc = FORK.Process(target=target, args=(rb, queue))
    proc.start()
    proc.join(60)
    assert proc.exitcode == 0
    return queue.get(timeout=5)


def _slices(rb: Any, count: int) -> set[tuple[int, ...]]:
    return {tuple(row) for _ in range(count) for row in rb.sample()["obs"].view(-1, 2).tolist()}


@pytest.mark.parametrize("sampler", ["RandomSampler", "SliceSampler"])
def test_lazy_storage_shared_before_its_first_write(sampler: str) -> None:
    """Shared before it is initialized, first written here: a forked worker's writes arrive."""
    storage = LazyTensorStorage(8)
    rb = fastreplay.TensorDictReplayBuffer(
        storage=storage,
        sampler=RandomSampler()
        if sampler == "RandomSampler"
        else fastreplay.SliceSampler(slice_len=2, end_key=("next", "done")),
        batch_size=4,
    ).share(True)
    rb.extend(_transitions(0, [3], 6))
    # TorchRL 0.13's storages count no writes and keep the last written row per process.
    counted = STORAGE_HAS_REVISION
    assert mutation_revision(storage, None) == (1 if counted else None)

    assert _run(_revision_worker, rb) == (2 if counted else None)
    assert mutation_revision(storage, None) == (2 if counted else None)
    assert last_cursor_row(storage) == (7 if counted else 5)  # 0.13: this process's last row
    assert len(rb) == rb.write_count == 8 and rb._writer._cursor == 0
    assert stored(rb)["obs"].tolist() == list(range(8))  # the worker's rows, seen here
    assert rb[6:8]["next", "done"].tolist() == [False, True]
    if sampler == "RandomSampler":
        sample = rb.sample()
        assert torch.equal(sample["obs"], sample["index"])
        assert {6, 7} <= {o for _ in range(40) for o in rb.sample()["obs"].tolist()}
        return

    # Episodes [0..3] and [4..7]; the slice (1, 2) is valid until a worker ends one at 1.
    assert (1, 2) in _slices(rb, 60)
    assert _run(_boundary_worker, rb) == (3 if counted else None)
    assert mutation_revision(storage, None) == (3 if counted else None)
    if not counted:  # an unreported write with no write counter to show it (see _torchrl.py)
        rb.sampler.invalidate_boundaries()
    assert stored(rb)["next", "done"].tolist() == [0, 1, 0, 1, 0, 0, 0, 1]
    slices = _slices(rb, 60)
    assert (1, 2) not in slices and slices <= {(0, 1), (2, 3), (4, 5), (5, 6), (6, 7)}


def _first_write(rb: Any, queue: Any) -> None:
    try:
        rb.extend(_transitions(0, [], 3))
    except RuntimeError as err:
        queue.put(str(err))
    else:
        queue.put(None)


def test_lazy_storage_first_written_by_another_process_is_refused() -> None:
    """A forked worker that would initialize the storage for itself raises, writing nothing."""
    rb = fastreplay.TensorDictReplayBuffer(storage=LazyTensorStorage(8), shared=True)
    message = _run(_first_write, rb)
    assert message is not None
    assert f"not in process {os.getpid()} that shared the buffer" in message
    assert "pass storage=LazyTensorStorage(max_size, shared_init=True)" in message
    assert len(rb) == rb.write_count == 0
    rb.extend(_transitions(0, [], 3))  # the process that shared it can still write
    assert len(rb) == 3
    # and, from then on, its workers too (TorchRL 0.13 counts no writes: None)
    assert _run(_revision_worker, rb) == (2 if STORAGE_HAS_REVISION else None)
    assert len(rb) == 5


# ------------------------------------------- TorchRL's async SAC: sync=False, shared afterwards
def _write_three(rb: Any, writer: int) -> None:
    _write(rb, writer, 0, 3)


@pytest.mark.parametrize(
    ("start", "share_at"),
    [
        ("fork", "construction"),
        ("fork", "share"),
        pytest.param("spawn", "share", marks=pytest.mark.slow),
    ],
)
def test_sync_false_prioritized_buffer_extended_then_shared(start: str, share_at: str) -> None:
    """Extended once here, then shared (``shared=True`` or ``share()``, as collectors call it).

    The workers' rows reach the learner's prioritized sampler, which samples them and takes
    their new priorities.
    """
    rb = _per(
        storage=LazyTensorStorage(CAPACITY),
        batch_size=BATCH,
        sync=False,
        shared=share_at == "construction",
    )
    rb.extend(episode(9, 0))
    if share_at == "share":
        rb.share()
    writers = WRITERS if start == "fork" else 1  # a spawned process imports torch: seconds
    ctx = multiprocessing.get_context(start)
    procs = [ctx.Process(target=_write_three, args=(rb, w)) for w in range(writers)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(300)
    assert [p.exitcode for p in procs] == [0] * writers
    assert len(rb) == rb.write_count == EPISODE * (1 + writers * 3)
    new = {w * 1_000 + n for w in range(writers) for n in range(3)}
    seen: set[int] = set()
    for _ in range(30):
        sample = rb.sample()
        assert_valid(sample, None)
        seen |= set(sample["traj"].tolist())
    assert new <= seen

    rows = stored(rb)
    remote = torch.nonzero(rows["traj"] != 9_000).squeeze(-1)
    rb.update_priority(remote, torch.full((remote.numel(),), 50.0))
    raw = raw_priorities(rb)
    assert torch.all(raw[remote] == 50.0) and torch.all(raw[:EPISODE] == 1.0)
    sample = rb.sample()
    sample["td_error"] = torch.full((BATCH,), 2.0)
    rb.update_tensordict_priority(sample)
    assert torch.all(raw_priorities(rb)[sample["index"]] == 2.0)


# ------------------------------------------------------ a killed process never blocks the others
def _sample_while_written(rb: Any, ready: Any) -> None:
    ready.set()
    rb.sample()  # waits for the write lock the test holds


def _write_one(rb: Any) -> None:
    rb.extend(episode(1, 0))


@pytest.mark.parametrize(
    "build", [_slice_rb(fastreplay), _slice_rb(trl)], ids=["fastreplay", "torchrl"]
)
def test_a_sampler_killed_while_waiting_for_the_lock_blocks_no_write(
    build: Callable[[Any], Any],
) -> None:
    """SIGKILL a process whose ``sample`` waits for the write lock: other writes go on."""
    rb = build(LazyMemmapStorage(CAPACITY, shared_init=True))
    rb.extend(episode(0, 0))
    ready, lock = FORK.Event(), rb._write_lock
    sampler = FORK.Process(target=_sample_while_written, args=(rb, ready), daemon=True)
    writer = FORK.Process(target=_write_one, args=(rb,), daemon=True)
    lock.acquire()  # a write in progress
    try:
        sampler.start()
        assert ready.wait(60)
        time.sleep(0.5)  # the sample now waits for the lock
        assert sampler.is_alive()
        os.kill(sampler.pid, signal.SIGKILL)  # not reaped yet: a zombie, as after a crash
    finally:
        lock.release()
    try:
        writer.start()
        writer.join(20)
        assert writer.exitcode == 0, "a write waited for a killed sampling process"
    finally:
        if writer.is_alive():
            writer.kill()
            writer.join(10)
        sampler.join(10)
    assert sampler.exitcode == -signal.SIGKILL
    rb.extend(episode(0, 1))  # and in this process
    assert rb.write_count == 3 * EPISODE
    assert_valid(rb.sample(), NUM_SLICES)

"""Writer processes that wrap a shared slice buffer while the learner samples (Dreamer's set-up).

TorchRL's Dreamer script builds ``TensorDictReplayBuffer(prefetch=..., storage=LazyMemmapStorage(
..., shared_init=True), sampler=SliceSampler(slice_len=..., traj_key=...))``; its collector
shares the buffer (``share()``) and two worker processes extend it with chunks of steps from
episodes of varying lengths while the learner samples, through ``prefetch`` threads. Every
sample must run while the shared write lock is held, whichever thread of the learner takes
it: a sample beside a write mixes rows from before and after it, and its slices cross from one
episode into another at write-chunk boundaries once the ring has wrapped. The rows written
elsewhere must also reach the learner's trajectory index exactly, whatever their sizes and
order.

Data carries its invariant: ``obs = episode * 10_000 + step``, episode ids unique per writer.
"""

from __future__ import annotations

import multiprocessing
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torchrl.data as trl
from tensordict import TensorDict
from torchrl.data import LazyMemmapStorage, LazyTensorStorage

import fastreplay
from conftest import requires_storage_revision, shutdown
from fastreplay._torchrl import STORAGE_HAS_REVISION, last_cursor_row
from fastreplay.samplers._index_sync import IndexSync

if "fork" not in multiprocessing.get_all_start_methods():  # pragma: no cover - Linux has it
    pytest.skip("needs the 'fork' start method (Linux)", allow_module_level=True)
FORK = multiprocessing.get_context("fork")

CAPACITY = 3001  # time rows; odd, wrapped several times by what the writers write
CHUNK = 100  # steps per write, as a collector writing 100 frames at a time
SLICE = 50  # Dreamer's batch_length
BATCH = 500
WRITERS = 2
LAPS = 8  # times the writers fill the storage


def episode_rows(writer: int, envs: int = 1) -> Iterator[list[tuple[int, int]]]:
    """Endless rows of ``envs`` ``(episode, step)`` pairs, episodes of 7 to 156 steps."""
    episodes = [(writer * 100_000 + 1_000 * env, 0) for env in range(envs)]
    while True:
        yield list(episodes)
        for env, (number, step) in enumerate(episodes):
            length = 7 + number * 37 % 150
            episodes[env] = (number + 1, 0) if step + 1 == length else (number, step + 1)


def chunk(rows: Iterator[list[tuple[int, int]]], size: int, envs: int = 1) -> TensorDict:
    """The next ``size`` steps: ``[size]`` for one column, ``[envs, size]`` (collector layout)."""
    block = torch.tensor([next(rows) for _ in range(size)])  # [size, envs, 2]
    episode, step = block[..., 0], block[..., 1]
    if envs == 1:
        episode, step = episode[:, 0], step[:, 0]
    else:  # a collector's batch: [envs, time]; the buffer extends along time
        episode, step = episode.T.contiguous(), step.T.contiguous()
    return TensorDict(episode=episode, obs=episode * 10_000 + step, batch_size=episode.shape)


def _write(rb: Any, writer: int, chunks: int, envs: int) -> None:
    """Writer process: ``chunks`` writes of ``CHUNK`` steps, 2 ms apart."""
    rows = episode_rows(writer, envs)
    for _ in range(chunks):
        rb.extend(chunk(rows, CHUNK, envs))
        time.sleep(0.002)


class SlowReads(LazyMemmapStorage):
    """A memory-mapped storage whose reads of a sample take 4 ms more.

    As reading a batch of large observations (Dreamer's pixels) does: writes from other
    processes must wait for the read, or the sample mixes rows from before and after them.
    """

    def get(self, index: Any) -> Any:
        time.sleep(0.004)
        return super().get(index)


def bad_slices(sample: TensorDict) -> int:
    """Slices leaving their episode, skipping a step or holding a torn row (0 if all is well)."""
    obs = sample["obs"].reshape(-1, SLICE)
    torn = obs // 10_000 != sample["episode"].reshape(-1, SLICE)
    return int(((obs[:, 1:] - obs[:, :-1] != 1).any(1) | torn.any(1)).sum())


def dreamer_buffer(module: Any, envs: int, prefetch: int) -> Any:
    """The Dreamer script's buffer, shared as its collector shares it."""
    kwargs: dict[str, Any] = {"prefetch": prefetch} if prefetch else {"shared": True}
    rb = module.TensorDictReplayBuffer(
        storage=SlowReads(CAPACITY * envs, shared_init=True, ndim=1 + (envs > 1)),
        sampler=module.SliceSampler(slice_len=SLICE, traj_key="episode"),
        batch_size=BATCH,
        **kwargs,
    )
    if prefetch:
        rb.share()  # what TorchRL's multi-process collectors do with the buffer they get
    return rb


@pytest.mark.parametrize(
    ("module", "envs", "prefetch"),
    [
        (fastreplay, 1, 3),
        # A 2-D storage's remote writes are not reported to the sampler (one report per write
        # holds 1-D rows only): the storage's write counter shows them, where TorchRL has one.
        pytest.param(fastreplay, 2, 3, marks=requires_storage_revision),
        (fastreplay, 1, 0),
        (trl, 1, 3),  # TorchRL's own classes: the reference (no bad slice)
    ],
    ids=["fastreplay-1d-prefetch", "fastreplay-2d-prefetch", "fastreplay-1d", "torchrl-prefetch"],
)
def test_slices_stay_in_one_episode_while_writer_processes_wrap(
    module: Any, envs: int, prefetch: int
) -> None:
    """No slice crosses episodes while two writer processes wrap the buffer ``LAPS`` times."""
    rb = dreamer_buffer(module, envs, prefetch)
    lock = rb._write_lock
    chunks = LAPS * CAPACITY // (CHUNK * WRITERS)
    procs = [FORK.Process(target=_write, args=(rb, w, chunks, envs)) for w in range(WRITERS)]
    for p in procs:
        p.start()
    bad = samples = 0
    deadline = time.monotonic() + 60
    try:
        while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
            if len(rb) * envs < 10 * CHUNK:
                time.sleep(0.001)
                continue
            bad += bad_slices(rb.sample())
            samples += 1
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():  # pragma: no cover - a hang: fail, never block the suite
                p.kill()
        shutdown(rb)  # prefetch threads finish their samples (TorchRL 0.13: no rb.shutdown)
    assert [p.exitcode for p in procs] == [0] * WRITERS
    assert rb.write_count == WRITERS * chunks * CHUNK  # time rows
    assert samples >= 20
    assert bad == 0, f"{bad} slices crossed episodes in {samples} samples of {BATCH // SLICE}"
    assert rb._write_lock is lock


class _ProbingSampler(fastreplay.SliceSampler):
    """Records each ``sample`` made while the shared write lock was free (it must be held)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.lock: Any = None
        self.unlocked: list[str] = []
        self.inside = threading.Event()
        self.release = threading.Event()

    def sample(self, storage: Any, batch_size: int) -> Any:
        if self.lock.acquire(block=False):  # free: this sample runs beside writers
            self.lock.release()
            self.unlocked.append(threading.current_thread().name)
        if threading.current_thread().name == "first":
            self.inside.set()
            assert self.release.wait(10)
        return super().sample(storage, batch_size)


class _Announcing:
    """``_replay_lock`` stand-in that says when the thread named "second" starts waiting."""

    def __init__(self, lock: Any, waiting: threading.Event) -> None:
        self.lock, self.waiting = lock, waiting

    def __enter__(self) -> Any:
        if threading.current_thread().name == "second":
            self.waiting.set()
        return self.lock.__enter__()

    def __exit__(self, *exc: Any) -> Any:
        return self.lock.__exit__(*exc)


def test_a_sample_queued_behind_another_thread_holds_the_write_lock() -> None:
    """Two threads sampling at once (``prefetch``): both hold the lock, which stays in place.

    The first thread is stopped inside its locked section and the second starts to sample
    then, as a prefetch thread does: it must wait and then take the shared write lock itself.
    """
    sampler = _ProbingSampler(slice_len=SLICE, traj_key="episode")
    rb = fastreplay.TensorDictReplayBuffer(
        storage=LazyTensorStorage(CAPACITY, shared_init=True),
        sampler=sampler,
        batch_size=BATCH,
        shared=True,
    )
    rb.extend(chunk(episode_rows(0), 4 * CHUNK))
    lock = sampler.lock = rb._write_lock
    waiting = threading.Event()
    rb._replay_lock = _Announcing(rb._replay_lock, waiting)
    errors: list[BaseException] = []

    def sample() -> None:
        try:
            assert bad_slices(rb.sample()) == 0
        except BaseException as err:  # pragma: no cover - reported below
            errors.append(err)

    first = threading.Thread(target=sample, name="first")
    second = threading.Thread(target=sample, name="second")
    first.start()
    assert sampler.inside.wait(10)
    second.start()
    assert waiting.wait(10)  # the second sample waits for the first one's section
    sampler.release.set()
    first.join(10)
    second.join(10)
    assert not first.is_alive() and not second.is_alive() and not errors
    assert sampler.unlocked == []
    assert rb._write_lock is lock


# ------------------------------------------- remote writes of every shape, reported exactly
SMALL = 101  # rows: the phases below wrap it many times


def _write_sizes(rb: Any, writer: int, skip: int, sizes: list[int]) -> None:
    """Writer process: one write per size, from step ``skip`` of the writer's episodes."""
    rows = episode_rows(writer)
    for _ in range(skip):
        next(rows)
    for size in sizes:
        rb.extend(chunk(rows, size))


# Phases of writes, each ``(writer, sizes)`` (writer 0: the learner's own writes, in its
# process), then a sample; with the writer's cursor at the start of the phase.
PHASES: list[tuple[list[tuple[int, list[int]]], int]] = [
    ([(1, [37, 3, 50])], 0),  # unequal sizes, one process
    ([(1, [1, 64]), (2, [29, 100])], 90),  # two processes in turn; wraps
    ([(0, [17]), (2, [5]), (0, [2, 98]), (1, [100])], 82),  # the learner's writes in between
    ([(2, [100, 100, 99])], 1),  # more than the capacity between two samples: a rebuild
    ([(1, [3]), (2, [1])], 98),  # a write ending on the last row, then one at row 0
    ([(1, [1] * 30 + [60])], 1),  # many one-row writes
]


def bad_slices_of(sample: TensorDict, length: int) -> int:
    """:func:`bad_slices` for slices of ``length`` steps."""
    obs = sample["obs"].reshape(-1, length)
    torn = obs // 10_000 != sample["episode"].reshape(-1, length)
    return int(((obs[:, 1:] - obs[:, :-1] != 1).any(1) | torn.any(1)).sum())


def test_remote_writes_of_any_size_and_order_reach_the_index_exactly(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """After each phase of writes (processes in turn, the learner's own between them), the
    learner's trajectories are TorchRL's, recomputed from the whole storage; the index is
    rebuilt only where the whole capacity was written between two samples."""
    rebuilds: list[int] = []
    rebuild = IndexSync._rebuild

    def counting(self: Any, *args: Any) -> None:
        rebuilds.append(1)
        rebuild(self, *args)

    monkeypatch.setattr(IndexSync, "_rebuild", counting)
    rb = fastreplay.TensorDictReplayBuffer(
        storage=LazyMemmapStorage(SMALL, shared_init=True),
        sampler=fastreplay.SliceSampler(slice_len=3, traj_key="episode"),
        batch_size=30,
        shared=True,
    )
    reference = trl.SliceSampler(slice_len=3, traj_key="episode")
    local = episode_rows(0)
    written = [0, 0, 0]  # steps each writer has written (its next step)
    lagging: list[bool] = []  # phases where the learner's own last written row is stale
    for number, (phase, cursor) in enumerate(PHASES):
        assert rb._writer._cursor == cursor, f"phase {number}"
        before = len(rebuilds)
        for writer, sizes in phase:
            if not writer:
                for size in sizes:
                    rb.extend(chunk(local, size))
            else:
                args = (rb, writer, written[writer], sizes)
                proc = FORK.Process(target=_write_sizes, args=args)
                proc.start()
                proc.join(30)
                if proc.is_alive():  # pragma: no cover - a hang: fail, never block the suite
                    proc.kill()
                assert proc.exitcode == 0
            written[writer] += sum(sizes)
        assert bad_slices_of(rb.sample(), 3) == 0, f"phase {number}"
        storage = rb._storage
        got = [a.tolist() for a in rb._sampler._get_stop_and_length(storage)]
        want = [a.tolist() for a in reference._get_stop_and_length(storage)]
        assert got == want, f"phase {number}"
        over = sum(size for _, sizes in phase for size in sizes) >= SMALL  # all rows anew
        # TorchRL 0.13 keeps the last written row per process (no shared cursor): once the
        # storage is full, its boundaries end at the learner's own last write, which the
        # index follows, so a remote write elsewhere then costs a rebuild there.
        # (Before the learner's first write, the shared writer cursor is read instead.)
        own = last_cursor_row(storage)
        stale = (
            not STORAGE_HAS_REVISION
            and bool(storage._is_full)
            and own is not None
            and own != (rb._writer._cursor - 1) % SMALL
        )
        assert len(rebuilds) - before == int(over or stale), f"phase {number}"
        lagging.append(stale)
    assert lagging == [False] * 2 + [not STORAGE_HAS_REVISION] * 4  # after phase 2's own write

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
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torchrl.data as trl
from tensordict import TensorDict
from torchrl.data import LazyMemmapStorage, LazyTensorStorage, ListStorage

import fastreplay
from conftest import TORCHRL_EXT, requires_storage_revision, short_flat_batches
from fastreplay._torchrl import STORAGE_HAS_REVISION, TORCHRL_VERSION

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
    rebuild = fastreplay.SliceSampler._fr_rebuild

    def counting(self: Any, *args: Any) -> None:
        rebuilds.append(1)
        rebuild(self, *args)

    monkeypatch.setattr(fastreplay.SliceSampler, "_fr_rebuild", counting)
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
        lambda: fastreplay.TensorDictReplayBuffer(storage=LazyTensorStorage(7), shared=True),
        r"LazyTensorStorage\(shared_init=False\) is not initialized.*shared_init=True",
        id="lazy-storage-without-shared-init",
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
        lambda: _per(storage=LazyMemmapStorage(7, shared_init=True), shared=True, sync=False),
        lambda: fastreplay.TensorDictReplayBuffer(
            storage=LazyMemmapStorage(7, shared_init=True),
            sampler=fastreplay.SliceSampler(num_slices=2, traj_key="traj"),
            shared=True,
        ),
    ],
    ids=["lazy-tensor-shared-init", "prioritized-sync-false", "slice"],
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

    The locks record who starts waiting for them: while a write is in progress and a sample
    waits (holding the gate), new writes wait at the gate and never reach the lock before the
    sample has it, so the sample waits for one write, not for a stream of them.
    """
    import threading

    from fastreplay._sharing import _turn

    events: list[tuple[str, str]] = []

    class Spy:
        def __init__(self, name: str) -> None:
            self.name, self.inner = name, threading.Lock()

        def acquire(self) -> None:
            events.append((threading.current_thread().name, self.name))
            self.inner.acquire()

        def release(self) -> None:
            self.inner.release()

        def __enter__(self) -> None:
            self.acquire()

        def __exit__(self, *exc: object) -> None:
            self.release()

    lock, gate, order = Spy("lock"), Spy("gate"), []

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
        while ("sample", "lock") not in events:  # the sample holds the gate, waits for the lock
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
    assert not lock.inner.locked() and not gate.inner.locked()


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

"""Buffers shared with writer processes: checks, shared memory, reported writes, fair locks.

TorchRL shares a buffer with collector worker processes through ``ReplayBuffer(shared=True)``
or ``buffer.share()`` (multi-process collectors call it for you). What is shared then: the
storage's tensors (shared memory or a memory map), its length, write cursor and mutation
revision, the writer's cursor and ``write_count``, and the buffer's write lock. What is *not*
shared: the sampler. Each process holds its own copy, and a write in a worker only reaches the
worker's copy. A sampler whose state is derived from the storage (``SliceSampler``: it
re-indexes from the storage when the revision moved) keeps working; one whose state is written
by ``mark_update`` (``PrioritizedSampler``: the priority trees) silently stops seeing new items.
TorchRL's answer is ``TensorDictPrioritizedReplayBuffer(sync=False)``: workers write through a
``RandomSampler`` and the learner's sampler catches up from the shared ``write_count``.

:func:`check_shareable` rejects the set-ups that cannot work, when the buffer is shared (at
construction or at ``share()``), instead of letting the learner sample stale or lost data later.
O(1); no TorchRL state is changed before it passes. A lazy storage without ``shared_init=True``
is shareable, as in TorchRL, once it is first written in the process that shared the buffer:
:class:`SharedBufferChecks` then moves its tensors to shared memory (a ``fork``ed writer's rows
reach every process), and refuses a first write made in any other process.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import time
from collections.abc import Iterator
from multiprocessing.context import get_spawning_popen
from typing import Any

import torch
from tensordict import MemoryMappedTensor, is_tensor_collection
from torch.utils._pytree import tree_leaves

from fastreplay._torchrl import (
    RoundRobinWriter,
    Sampler,
    TensorDictRoundRobinWriter,
    TensorStorage,
    attached_entities,
    buffer_sampler,
    buffer_writer,
    is_consuming,
    replay_lock,
    writer_counts,
)
from fastreplay._torchrl import TorchRLPrioritizedSampler as _TorchRLPrioritizedSampler
from fastreplay.samplers._index_sync import remote_writes

__all__ = ["SharedBufferChecks", "check_shareable"]


def check_shareable(buffer: Any) -> None:
    """Raise ``ValueError`` if ``buffer`` cannot be shared with writer processes.

    A lazy storage that is not initialized yet passes: whether it can work is only known at its
    first write (see :meth:`SharedBufferChecks.extend`).

    Args:
        buffer: an initialized TorchRL replay buffer about to be shared.

    Raises:
        ValueError: the storage is not a tensor storage (a ``ListStorage`` is a per-process
            Python list), or the sampler keeps per-process priorities that writes in other
            processes never reach.
    """
    name = type(buffer).__name__
    storage = buffer._storage
    if not isinstance(storage, TensorStorage):
        raise ValueError(
            f"{name}(shared=True): storage={type(storage).__name__} lives in one process, so "
            "writes from other processes would be lost; pass "
            "storage=LazyMemmapStorage(max_size, shared_init=True) (or "
            "LazyTensorStorage(max_size, shared_init=True))."
        )
    sampler = buffer_sampler(buffer)
    if isinstance(sampler, _TorchRLPrioritizedSampler):
        fix = (
            "pass sync=False: writer processes then write through a RandomSampler and this "
            "process's PrioritizedSampler catches up from the shared write_count before "
            "each sample."
            if getattr(buffer, "_sync", None) is True
            else "use TensorDictPrioritizedReplayBuffer(alpha=..., beta=..., storage=..., "
            "sync=False), whose learner-side sampler catches up from the shared write_count."
        )
        raise ValueError(
            f"{name}(shared=True) with sampler={type(sampler).__name__}: its priority trees "
            "live in one process, so items written by other processes would never get a "
            f"priority in this one; {fix}"
        )


class SharedBufferChecks:
    """Mixin for TorchRL buffers shared with writer processes: checks, and remote writes reported.

    Placed before the TorchRL buffer in the bases. Four things, all only while ``shared``:

    * :func:`check_shareable` runs once the storage and sampler exist (``_init``; TorchRL's
      ``__init__`` calls ``share()`` before they do) and on every later ``share()``; a failing
      ``share()`` leaves ``shared`` unchanged.
    * The storage's tensors in ordinary CPU memory are moved to shared memory once the storage
      is initialized (at ``share()``, or after the first write that initializes it): processes
      started by ``fork`` then write into the storage every process reads, as ``spawn``ed ones
      do (pickling moves it there in TorchRL). A storage first written in a process other than
      the one that shared the buffer (a ``fork``ed worker, before any write in the parent) would
      be that process's alone: that write raises ``RuntimeError`` and writes nothing.
    * ``sample`` holds the shared write lock throughout (TorchRL's ``sync=False`` catch-up
      reads ``write_count`` before taking it), and goes before the writes that have not
      started when it waits for the lock (:func:`_turn`).
    * Writes made by other processes are reported in this process as a writer reports a write
      (``mark_update`` of every entity attached to the storage: this buffer, which tells its
      sampler, and the sample units' listeners; then the sampler's ``extend``; one report per
      write) at the start of every locked section of this process, under the shared write
      lock. An index kept from reported writes (``SliceSampler``'s, a ``Sequence`` unit's)
      then updates in ``O(rows written)`` instead of rebuilding from the whole storage. The
      rows are known from the shared writer cursor and ``write_count`` and a shared count of
      buffer writes, so this applies to 1-D storages written by a round-robin writer through
      this class; any other write (``rb[idx] = ...``, another buffer class on the same
      storage) is not counted, and the sampler's own revision check then rebuilds, as before.
      ``O(1)`` per locked section when nothing was written elsewhere. The reports are marked
      as other processes' (:func:`fastreplay.samplers._index_sync.remote_writes`): they moved
      no version counter here, so the indices' check for writes nobody reported does not
      count them as local writes.
    """

    _fr_writes: Any = None  # multiprocessing.Value("q"): writes through this class, all processes
    _fr_seen: tuple[int, int] = (0, 0)  # (write_count, writes) this process's sampler was told
    _fr_gate: Any = None  # _SampleFirst: samples go before writes not yet started
    _fr_owner: int | None = None  # pid of the process that shared the buffer
    _fr_settled = False  # the storage's tensors are in shared memory (or a memory map)

    def share(self, shared: bool = True) -> Any:
        """Share the buffer with other processes, as TorchRL does, after checking it can be."""
        initialized = getattr(self, "_initialized", False)
        if shared and initialized:
            check_shareable(self)
        out = super().share(shared)  # type: ignore[misc]
        if shared and self._fr_writes is None:
            self._fr_writes = multiprocessing.Value("q", 0)
            self._fr_gate = _SampleFirst()
            # earlier writes were reported locally
            self._fr_seen = (writer_counts(self)[0], 0)
        if shared and self._fr_owner is None:
            self._fr_owner = os.getpid()
        if shared and initialized:
            self._fr_settle()
        return out

    @classmethod
    def as_remote(cls, remote_config: dict[str, Any] | None = None) -> Any:
        """The Ray actor class TorchRL's ``RayReplayBuffer`` builds this buffer from.

        As TorchRL's ``as_remote``, except that ``remote(...)`` returns once the buffer is built
        in the actor and raises its constructor's error there (see ``fastreplay.ray_buffer``), so
        ``torchrl.data.RayReplayBuffer(replay_buffer_cls=...)`` and ``service_backend="ray"``
        fail at construction, not at the first call.
        """
        from fastreplay.ray_buffer import checked_actor_class

        return checked_actor_class(cls, remote_config)

    def _init(self) -> None:
        super()._init()  # type: ignore[misc]
        if getattr(self, "shared", False):
            try:
                check_shareable(self)
            except ValueError:
                self._initialized = False
                raise
            self._fr_settle()

    # ------------------------------------------------- the storage's memory, across processes
    def _fr_unsettled(self, what: str) -> bool:
        """Before a write: whether the storage may still need moving (then call ``_fr_settle``).

        Raises ``RuntimeError`` (nothing written) if this write would initialize a storage
        without ``shared_init`` in a process other than the one that shared the buffer: the
        storage it allocates would be this process's alone. ``O(1)``.
        """
        if self._fr_settled or not getattr(self, "shared", False):
            return False
        storage = getattr(self, "_storage", None)  # absent before a delayed ``_init``
        if (
            isinstance(storage, TensorStorage)
            and not storage.initialized
            and not getattr(storage, "shared_init", False)
            and self._fr_owner is not None
            and os.getpid() != self._fr_owner
        ):
            kind = type(storage).__name__
            raise RuntimeError(
                f"{type(self).__name__}.{what}: storage={kind}(shared_init=False) of this shared "
                f"buffer would be initialized in process {os.getpid()}, not in process "
                f"{self._fr_owner} that shared the buffer, so no other process would see the "
                "rows written here; write to the buffer once in the process that shares it "
                f"before starting the others, or pass storage={kind}(max_size, "
                "shared_init=True)."
            )
        return True

    def _fr_settle(self) -> None:
        """Move the initialized storage's ordinary CPU tensors to shared memory, once.

        ``O(storage bytes)`` once (the copy ``spawn`` makes when it pickles the storage), then
        ``O(1)``. Memory-mapped, shared and accelerator tensors are left as they are.
        """
        storage = getattr(self, "_storage", None)
        if not isinstance(storage, TensorStorage) or not storage.initialized:
            return
        try:
            _share_memory(storage._storage)
        except RuntimeError as err:
            raise RuntimeError(
                f"{type(self).__name__}(shared=True): the tensors of storage="
                f"{type(storage).__name__} could not be moved to shared memory ({err}), so "
                "rows written by other processes would not reach this one; pass "
                "storage=LazyMemmapStorage(max_size) (a memory-mapped file), or make room in "
                "shared memory (/dev/shm)."
            ) from err
        self._fr_settled = True

    # ------------------------------------------------------------ remote writes, reported
    def _fr_tracks(self) -> bool:
        writer, storage = buffer_writer(self), getattr(self, "_storage", None)
        return (
            self._fr_writes is not None
            and getattr(self, "shared", False)
            and type(writer) in _ROUND_ROBIN
            and storage is not None
            and storage.ndim == 1
            and not is_consuming(self)
            # Samplers whose extend does nothing (RandomSampler, the writers' side of
            # sync=False) need no reports: keep TorchRL's locking exactly.
            and type(buffer_sampler(self)).extend is not Sampler.extend
        )

    def _fr_catch_up(self) -> None:
        """Report writes made elsewhere since this process last looked. Call under the lock."""
        (write_count, cursor), writes = writer_counts(self), int(self._fr_writes.value)
        seen_count, seen_writes = self._fr_seen
        items, calls = write_count - seen_count, writes - seen_writes
        self._fr_seen = (write_count, writes)
        if items <= 0 and calls <= 0:
            return
        if items <= 0 or calls <= 0:
            # Emptied elsewhere, or written by something this class does not count: report
            # nothing; the sampler sees the storage revision move and rebuilds.
            return
        storage = self._storage
        rows = int(storage.max_size)
        index = torch.arange(cursor - min(items, rows), cursor) % rows
        sampler = buffer_sampler(self)
        with remote_writes():  # they moved no version counter of this process's tensors
            for part in torch.tensor_split(index, calls):  # one report per write
                # As the writer reports a write here: every entity attached to the storage
                # (this buffer -> its sampler's ``mark_update``, sample-unit listeners),
                # then this buffer's sampler (``extend``).
                for entity in list(attached_entities(storage)):
                    entity.mark_update(part)
                sampler.extend(part)

    @contextlib.contextmanager
    def _fr_locked(self, sampling: bool = False) -> Iterator[None]:
        """Hold the shared write lock, report remote writes, run the TorchRL body lock-free.

        ``_write_lock`` stands for a no-op while the body runs (TorchRL's body takes it again,
        and a process lock is not re-entrant), so it is read only once this thread holds
        ``_replay_lock``: another thread of this process (a ``prefetch`` thread) reading it
        earlier would get the stand-in, run its section beside writer processes and leave
        the stand-in behind for good. Under ``_replay_lock`` a thread sees the stand-in only
        inside its own section, which does hold the lock.
        """
        with replay_lock(self):
            lock = self._write_lock
            with _turn(lock, self._fr_gate, sampling):
                if self._fr_tracks():
                    self._fr_catch_up()
                self._write_lock = contextlib.nullcontext()
                try:
                    yield
                finally:
                    self._write_lock = lock

    def _fr_wrote(self) -> None:
        """Count this process's write (under the lock) so other processes can report it."""
        with self._fr_writes.get_lock():
            self._fr_writes.value += 1
        self._fr_seen = (writer_counts(self)[0], int(self._fr_writes.value))

    def extend(self, data: Any, *args: Any, **kwargs: Any) -> Any:
        """Extend as TorchRL does; when shared, report remote writes first and count this one."""
        unsettled = self._fr_unsettled("extend")
        if not self._fr_tracks():
            index = super().extend(data, *args, **kwargs)  # type: ignore[misc]
        else:
            with self._fr_locked():
                index = super().extend(data, *args, **kwargs)  # type: ignore[misc]
                self._fr_wrote()
        if unsettled:
            self._fr_settle()
        return index

    def add(self, data: Any) -> Any:
        """Add as TorchRL does; when shared, report remote writes first and count this one."""
        unsettled = self._fr_unsettled("add")
        if not self._fr_tracks():
            index = super().add(data)  # type: ignore[misc]
        else:
            with self._fr_locked():
                index = super().add(data)  # type: ignore[misc]
                self._fr_wrote()
        if unsettled:
            self._fr_settle()
        return index

    def __setitem__(self, index: Any, value: Any) -> None:
        unsettled = self._fr_unsettled("__setitem__")
        super().__setitem__(index, value)  # type: ignore[misc]
        if unsettled:
            self._fr_settle()

    def _sample(self, batch_size: int) -> Any:
        # Shared: the whole TorchRL ``_sample`` runs under the write lock. TorchRL reads
        # ``write_count`` for the ``sync=False`` catch-up before taking it, and a writer bumps
        # ``write_count`` before the storage length: fastreplay's sampler would then be asked
        # to prioritise rows the storage does not count yet (and rightly refuse).
        if not (getattr(self, "shared", False) and getattr(self, "_initialized", False)):
            return super()._sample(batch_size)  # type: ignore[misc]
        with self._fr_locked(sampling=True):
            return super()._sample(batch_size)  # type: ignore[misc]

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()  # type: ignore[misc]
        writes = state.get("_fr_writes")
        if get_spawning_popen() is None:
            # Not a process start: a copy (checkpoint, Ray) holds its own storage tensors, is
            # shared (if ever) by the process that shares it, and owns its own count and gate.
            state.pop("_fr_owner", None)
            state.pop("_fr_settled", None)
            if writes is not None:
                state["_fr_writes"] = int(writes.value)
                state["_fr_gate"] = True
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        if isinstance(state.get("_fr_writes"), int):
            state["_fr_writes"] = multiprocessing.Value("q", state["_fr_writes"])
        if state.get("_fr_gate") is True:
            state["_fr_gate"] = _SampleFirst()
        super().__setstate__(state)  # type: ignore[misc]


_ROUND_ROBIN = (RoundRobinWriter, TensorDictRoundRobinWriter)


def _share_memory(data: Any) -> None:
    """Move the ordinary CPU tensors of ``data`` (a tensor collection or pytree) to shared memory.

    In place (``Tensor.share_memory_``): views and the storage's own references see the move.
    ``O(bytes moved)``.
    """

    def move(leaf: Any) -> None:
        if (
            isinstance(leaf, torch.Tensor)
            and not isinstance(leaf, MemoryMappedTensor)
            and leaf.device.type == "cpu"
            and leaf.layout == torch.strided
            and not leaf.is_shared()
        ):
            leaf.share_memory_()

    if is_tensor_collection(data):
        data.apply(move, filter_empty=True)
    else:
        for leaf in tree_leaves(data):
            move(leaf)


class _SampleFirst:
    """Shared across processes: "a sample is waiting for the write lock", and since when.

    Holds no lock. A waiting sample refreshes a shared time stamp every :attr:`BEAT` seconds
    while it waits; a write about to wait for the lock first waits while the stamp is fresh
    (younger than :attr:`STALE` seconds). A sampling process that dies while it waits stops
    refreshing the stamp, so the writes of the survivors go on at most :attr:`STALE` seconds
    later: a dead process never blocks the others. ``time.monotonic`` is one clock for every
    process of the machine.
    """

    BEAT = 0.05
    STALE = 0.5

    def __init__(self) -> None:
        self._stamp = multiprocessing.RawValue("d", 0.0)  # 0.0: no sample waiting

    def wait_as_sample(self, lock: Any) -> None:
        """Acquire ``lock``, marking a sample as waiting until it has it. ``O(wait / BEAT)``."""
        stamp = self._stamp
        try:
            while True:
                stamp.value = time.monotonic()
                if lock.acquire(timeout=self.BEAT):
                    return
        finally:
            stamp.value = 0.0

    def wait_for_samples(self) -> None:
        """Return once no live sample is waiting for the lock. ``O(wait / 1 ms)``."""
        stamp, pause = self._stamp, 1e-4
        while True:
            since = stamp.value
            if since == 0.0 or time.monotonic() - since > self.STALE:
                return
            time.sleep(pause)
            pause = min(2 * pause, 1e-3)


@contextlib.contextmanager
def _turn(lock: Any, gate: _SampleFirst | None, sampling: bool) -> Iterator[None]:
    """Hold ``lock``; a sample (``sampling``) goes before the writes that have not started.

    A sample marks itself as waiting (``gate``) while it waits for ``lock``, and a write waits
    while a sample is marked before it waits for ``lock``: a sample then waits for the write in
    progress, not for a stream of writes from several processes that keep ``lock`` busy (the
    lock is not fair). Writes wait for the sample in progress, as they do in TorchRL. No one
    holds anything but ``lock`` while waiting, so a process killed while it waits blocks no
    one (see :class:`_SampleFirst`). ``O(1)`` besides the waits; ``gate=None``: ``lock`` only
    (also when ``lock`` is the ``nullcontext`` of a section already holding it).
    """
    if gate is None or not hasattr(lock, "acquire"):
        with lock:
            yield
        return
    if sampling:
        gate.wait_as_sample(lock)
    else:
        gate.wait_for_samples()
        lock.acquire()
    try:
        yield
    finally:
        lock.release()

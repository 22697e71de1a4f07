"""Construction-time checks for replay buffers shared with writer processes.

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
O(1); no TorchRL state is changed before it passes.
"""

from __future__ import annotations

import contextlib
import multiprocessing
from collections.abc import Iterator
from multiprocessing.context import get_spawning_popen
from typing import Any

import torch

from fastreplay._torchrl import (
    RoundRobinWriter,
    Sampler,
    TensorDictRoundRobinWriter,
    TensorStorage,
    is_consuming,
)
from fastreplay._torchrl import TorchRLPrioritizedSampler as _TorchRLPrioritizedSampler

__all__ = ["SharedBufferChecks", "check_shareable"]


def check_shareable(buffer: Any) -> None:
    """Raise ``ValueError`` if ``buffer`` cannot be shared with writer processes.

    Args:
        buffer: an initialized TorchRL replay buffer about to be shared.

    Raises:
        ValueError: the storage is not a tensor storage (a ``ListStorage`` is a per-process
            Python list), a lazy tensor storage is not initialized yet and has no
            ``shared_init=True`` (each process would allocate its own), or the sampler keeps
            per-process priorities that writes in other processes never reach.
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
    if not storage.initialized and not getattr(storage, "shared_init", False):
        raise ValueError(
            f"{name}(shared=True): storage={type(storage).__name__}(shared_init=False) is not "
            "initialized yet, so each process would allocate its own copy; pass "
            f"storage={type(storage).__name__}(max_size, shared_init=True) (or, for processes "
            "started with 'spawn', extend the buffer once before sharing it)."
        )
    sampler = buffer._sampler
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

    Placed before the TorchRL buffer in the bases. Three things, all only while ``shared``:

    * :func:`check_shareable` runs once the storage and sampler exist (``_init``; TorchRL's
      ``__init__`` calls ``share()`` before they do) and on every later ``share()``; a failing
      ``share()`` leaves ``shared`` unchanged.
    * ``sample`` holds the shared write lock throughout (TorchRL's ``sync=False`` catch-up
      reads ``write_count`` before taking it), and goes before the writes that have not
      started when it waits for the lock (:func:`_turn`).
    * Writes made by other processes are reported to this process's sampler (``extend`` with
      the rows written, one call per write) at the start of every locked section of this
      process, under the shared write lock. A sampler that keeps an index from reported writes
      (``SliceSampler``) then updates it in ``O(rows written)`` instead of rebuilding it from
      the whole storage. The rows are known from the shared writer cursor and ``write_count``
      and a shared count of buffer writes, so this applies to 1-D storages written by a
      round-robin writer through this class; any other write (``rb[idx] = ...``, another
      buffer class on the same storage) is not counted, and the sampler's own revision check
      then rebuilds, as before. ``O(1)`` per locked section when nothing was written elsewhere.
    """

    _fr_writes: Any = None  # multiprocessing.Value("q"): writes through this class, all processes
    _fr_seen: tuple[int, int] = (0, 0)  # (write_count, writes) this process's sampler was told
    _fr_gate: Any = None  # multiprocessing.Lock: samples go before writes not yet started

    def share(self, shared: bool = True) -> Any:
        """Share the buffer with other processes, as TorchRL does, after checking it can be."""
        if shared and getattr(self, "_initialized", False):
            check_shareable(self)
        out = super().share(shared)  # type: ignore[misc]
        if shared and self._fr_writes is None:
            self._fr_writes = multiprocessing.Value("q", 0)
            self._fr_gate = multiprocessing.Lock()
            writer = getattr(self, "_writer", None)  # earlier writes were reported locally
            self._fr_seen = (int(getattr(writer, "_write_count", 0) or 0), 0)
        return out

    @classmethod
    def as_remote(cls, remote_config: dict[str, Any] | None = None) -> Any:
        """The Ray actor class TorchRL's ``RayReplayBuffer`` builds this buffer from.

        As TorchRL's ``as_remote``, except that ``remote(...)`` returns once the buffer is built
        in the actor and raises its constructor's error there (see ``fastreplay._ray``), so
        ``torchrl.data.RayReplayBuffer(replay_buffer_cls=...)`` and ``service_backend="ray"``
        fail at construction, not at the first call.
        """
        from fastreplay._ray import checked_actor_class

        return checked_actor_class(cls, remote_config)

    def _init(self) -> None:
        super()._init()  # type: ignore[misc]
        if getattr(self, "shared", False):
            try:
                check_shareable(self)
            except ValueError:
                self._initialized = False
                raise

    # ------------------------------------------------------------ remote writes, reported
    def _fr_tracks(self) -> bool:
        writer, storage = getattr(self, "_writer", None), getattr(self, "_storage", None)
        return (
            self._fr_writes is not None
            and getattr(self, "shared", False)
            and type(writer) in _ROUND_ROBIN
            and storage is not None
            and storage.ndim == 1
            and not is_consuming(self)
            # Samplers whose extend does nothing (RandomSampler, the writers' side of
            # sync=False) need no reports: keep TorchRL's locking exactly.
            and type(self._sampler).extend is not Sampler.extend
        )

    def _fr_catch_up(self) -> None:
        """Report writes made elsewhere since this process last looked. Call under the lock."""
        write_count, writes = int(self._writer._write_count), int(self._fr_writes.value)
        seen_count, seen_writes = self._fr_seen
        items, calls = write_count - seen_count, writes - seen_writes
        self._fr_seen = (write_count, writes)
        if items <= 0 and calls <= 0:
            return
        if items <= 0 or calls <= 0:
            # Emptied elsewhere, or written by something this class does not count: report
            # nothing; the sampler sees the storage revision move and rebuilds.
            return
        rows, cursor = int(self._storage.max_size), int(self._writer._cursor)
        index = torch.arange(cursor - min(items, rows), cursor) % rows
        for part in torch.tensor_split(index, calls):  # one report per write
            self._sampler.extend(part)

    @contextlib.contextmanager
    def _fr_locked(self, sampling: bool = False) -> Iterator[None]:
        """Hold the shared write lock, report remote writes, run the TorchRL body lock-free."""
        lock = self._write_lock
        with self._replay_lock, _turn(lock, self._fr_gate, sampling):  # type: ignore[attr-defined]
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
        self._fr_seen = (int(self._writer._write_count), int(self._fr_writes.value))

    def extend(self, data: Any, *args: Any, **kwargs: Any) -> Any:
        """Extend as TorchRL does; when shared, report remote writes first and count this one."""
        if not self._fr_tracks():
            return super().extend(data, *args, **kwargs)  # type: ignore[misc]
        with self._fr_locked():
            index = super().extend(data, *args, **kwargs)  # type: ignore[misc]
            self._fr_wrote()
        return index

    def add(self, data: Any) -> Any:
        """Add as TorchRL does; when shared, report remote writes first and count this one."""
        if not self._fr_tracks():
            return super().add(data)  # type: ignore[misc]
        with self._fr_locked():
            index = super().add(data)  # type: ignore[misc]
            self._fr_wrote()
        return index

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
        if writes is not None and get_spawning_popen() is None:
            # Not a process start: a copy (checkpoint, Ray) owns its own count.
            state["_fr_writes"] = int(writes.value)
            state["_fr_gate"] = True  # and its own gate
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        if isinstance(state.get("_fr_writes"), int):
            state["_fr_writes"] = multiprocessing.Value("q", state["_fr_writes"])
        if state.get("_fr_gate") is True:
            state["_fr_gate"] = multiprocessing.Lock()
        super().__setstate__(state)  # type: ignore[misc]


_ROUND_ROBIN = (RoundRobinWriter, TensorDictRoundRobinWriter)


@contextlib.contextmanager
def _turn(lock: Any, gate: Any, sampling: bool) -> Iterator[None]:
    """Hold ``lock``; a sample (``sampling``) goes before the writes that have not started.

    A sample holds ``gate`` while it waits for ``lock``, and a write passes ``gate`` before it
    waits for ``lock``: a sample then waits for the write in progress, not for a stream of
    writes from several processes that keep ``lock`` busy (the lock is not fair). Writes wait
    for the sample in progress, as they do in TorchRL. ``O(1)``; ``gate=None``: ``lock`` only
    (also when ``lock`` is the ``nullcontext`` of a section already holding it).
    """
    if gate is None or not hasattr(lock, "acquire"):
        with lock:
            yield
        return
    with gate:
        if sampling:
            lock.acquire()
    if not sampling:
        lock.acquire()
    try:
        yield
    finally:
        lock.release()

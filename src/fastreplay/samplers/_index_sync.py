"""Storage -> trajectory index: the one place a slice sampler reads its storage's boundaries.

Each of fastreplay's slice samplers owns an :class:`IndexSync` (so do the sample units'
listeners and ``HERReplayBuffer``). The rows of every write are reported to it
(:meth:`IndexSync.record`) through TorchRL's write hook, ``mark_update``: TorchRL's writers
(and fastreplay's direct write path) call it, after every write, on every entity attached to
the storage (``storage.attach``): each buffer (``ReplayBuffer.mark_update`` tells its
sampler), each sample-unit listener. So a write through any buffer sharing the storage is
reported, once; ``extend``/``add``, which only the writing buffer calls, report nothing. The
owner asks for the index at each ``sample`` (:meth:`IndexSync.sync`): the reported rows are
read from the storage and added to a :class:`fastreplay._core.trajectory_index.TrajectoryIndex`
(``O(rows written)``), or, after writes nobody reported (the storage's mutation revision moved:
``storage.set``, ``rb[idx] = ...``, another process, a checkpoint loaded; a boundary key
changed), the index is rebuilt from the whole storage once (``O(items stored)``). Storages
of ``ndim > 1`` are indexed per column; :meth:`coords` turns a column back into its
coordinates.

A write that raises part way (a shape mismatch on a later key of ``rb[idx] = td`` or
``storage.set``) leaves the rows of the keys before it written, but the storage's mutation
revision unchanged (TorchRL bumps it after the write) and the sampler untold. Such writes, and
in-place edits of the signal through a view, still move the version counter torch keeps for
every tensor written in place. So :meth:`IndexSync.sync` always compares the counters of the
signal tensors with those of the last sync (``O(signal keys)``): each write reported from this
process moves each of them by exactly one (one in-place write per tensor, on every TorchRL
version), writes reported from other processes (:func:`remote_writes`: shared memory written
elsewhere) by none; any other move means a write nobody reported, and the index is rebuilt.
Writes that move no counter here (another process's in-place edits, ``tensor.data`` or NumPy
views, a memory map opened separately) cannot be seen: ``invalidate_boundaries()`` is the
remedy there.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from fastreplay._core.trajectory_index import TrajectoryIndex
from fastreplay._torchrl import (
    attach_shared_storage,
    last_cursor_row,
    mutation_revision,
    resolve_traj_key,
    round_robin_cursors,
    storage_full,
    storage_len,
    storage_rows,
    tensor_version,
    used_traj_key,
)
from fastreplay.errors import MissingKeyError, SignalTypeError, SliceSamplerError

__all__ = ["DoneFlags", "IndexSync", "remote_writes", "reporting_remote"]

_READ_CHUNK = 1 << 24  # rows read at once when rebuilding from the whole storage

_REMOTE = threading.local()  # ``on``: the writes reported now were made by other processes


@contextlib.contextmanager
def remote_writes() -> Iterator[None]:
    """Writes reported inside (``entity.mark_update(rows)``) were made by other processes.

    Their rows went to shared memory from another process, which moves no version counter of
    this process's tensors: :meth:`IndexSync.record` (and the staleness sampler) then expect
    no move for them. Per thread; O(1).
    """
    previous = getattr(_REMOTE, "on", False)
    _REMOTE.on = True
    try:
        yield
    finally:
        _REMOTE.on = previous


def reporting_remote() -> bool:
    """Whether the write being reported now was made by another process (:func:`remote_writes`)."""
    return bool(getattr(_REMOTE, "on", False))


class _KeyProbe:
    """``key in probe``: O(1) membership test on a TensorDict; lists the keys for messages."""

    def __init__(self, data: Any) -> None:
        self.data = data

    def __contains__(self, key: Any) -> bool:
        return self.data.get(key, default=None) is not None

    def __iter__(self) -> Any:
        return iter(self.data.keys(include_nested=True, leaves_only=True))


class DoneFlags:
    """The signal a reader other than a slice sampler gives :meth:`IndexSync.sync`: done flags.

    Named as a slice sampler names them (``end_key``, or any of ``end_keys``), with no
    trajectory-id key: what a sample unit (one ``done_key``) and ``HERReplayBuffer`` (its
    done and terminated keys) read. O(1).
    """

    _traj_key_auto = False
    _fetch_traj = False
    traj_key = None

    def __init__(self, end_key: Any = None, end_keys: tuple | None = None) -> None:
        self.end_key = end_key
        self.end_keys = end_keys


class IndexSync:
    """The trajectory index of one slice sampler, kept in step with the storage it samples.

    Public state, read by the sampler: ``index`` (the :class:`TrajectoryIndex`, ``None`` until
    the first :meth:`sync`), ``spec`` (``(mode, keys, rows, columns, device)`` of the signal
    it was built from), ``pending`` (``[first_row, n_rows]`` runs reported and not yet read)
    and ``dirty`` (rebuild from the storage at the next :meth:`sync`).
    """

    # The signal tensors at the last sync (weak references) and their version counters;
    # ``None``: not watched (inference tensors keep no counter). Class defaults: a sync pickled
    # by an earlier version has neither.
    _signal: tuple[weakref.ref, ...] = ()
    _versions: tuple[int, ...] | None = None
    _local_writes = 0  # writes reported from this process since the last sync

    def __init__(self) -> None:
        self.index: TrajectoryIndex | None = None
        self.spec: tuple | None = None
        self.pending: list[list[int]] = []
        self.dirty = False
        self._storage: weakref.ref | None = None  # identity that a new storage cannot reuse
        self._revision = 0
        self._pending_writes = 0
        self._local_writes = 0
        self._loaded = False  # a checkpoint was loaded: the storage's cursor may be stale

    def __getstate__(self) -> dict[str, Any]:
        """A copy rebuilds from its storage: the index and the storage are not carried."""
        state = self.__dict__.copy()
        state.update(index=None, spec=None, pending=[], dirty=True, _storage=None)
        state.update(_signal=(), _versions=None, _local_writes=0)
        return state

    def detached(self) -> IndexSync:
        """A copy for a pickled or copied sampler: it rebuilds at its first :meth:`sync`."""
        copy = IndexSync.__new__(IndexSync)
        copy.__dict__.update(self.__getstate__())
        return copy

    @property
    def device(self) -> Any:
        """The device of the storage's signal at the last :meth:`sync`."""
        return self.spec[-1]  # type: ignore[index]

    @property
    def mode(self) -> str:
        """``"done"`` (done flags) or ``"ids"`` (trajectory ids), at the last :meth:`sync`."""
        return self.spec[0]  # type: ignore[index]

    @property
    def keys(self) -> tuple:
        """The storage keys the index was built from, at the last :meth:`sync`."""
        return self.spec[1]  # type: ignore[index]

    def invalidate(self, *, loaded: bool = False) -> None:
        """Rebuild from the storage at the next :meth:`sync` (``loaded``: after a checkpoint).

        After ``load_state_dict``/``loads`` the storage's own record of its last write may be
        stale; the round-robin writer's restored cursor is then read instead. O(1).
        """
        self.dirty = True
        if loaded:
            self._loaded = True

    def record(self, index: int | torch.Tensor | tuple[torch.Tensor, ...]) -> None:
        """The rows one write wrote (its ``mark_update``): ``O(items written)``, on numpy.

        Exactly one call per write: the version counters of the signal tensors are compared
        with the number of calls.

        A round-robin run (consecutive rows, wrapping at most once to row 0) is queued to be
        read at the next :meth:`sync`; any other write marks the index for a rebuild. Inside
        :func:`remote_writes` the write is counted as another process's (it moved no version
        counter here).
        """
        self._pending_writes += 1
        if not reporting_remote():
            self._local_writes += 1
        self._loaded = False  # the storage's cursor is current again
        if self.dirty:
            return
        rows = torch.as_tensor(index).reshape(-1) if not torch.is_tensor(index) else index
        rows = rows.cpu()
        if rows.ndim == 2:  # [n * columns, ndim] for ndim > 1 storages: keep the time rows
            rows = torch.unique_consecutive(rows[:, 0])
        rows = rows.reshape(-1).numpy()  # numpy: a few microseconds per op, under the lock
        if not rows.size:
            return
        # A round-robin write: consecutive rows, wrapping at most once to row 0.
        step = np.diff(rows.astype(np.int64, copy=False))
        breaks = np.flatnonzero(step != 1)
        if breaks.size > 1 or (breaks.size and (rows[breaks[0] + 1] != 0 or step[breaks[0]] >= 0)):
            self.dirty = True  # not a round-robin write: rebuild at the next sync
            return
        first, n = int(rows[0]), int(rows.size)
        last = self.pending[-1] if self.pending else None
        if last is not None and last[0] + last[1] == first:
            last[1] += n
        else:
            self.pending.append([first, n])

    # ------------------------------------------------------------------------ syncing
    def sync(self, storage: Any, sampler: Any) -> TrajectoryIndex:
        """The index, brought up to date with ``storage``.

        ``O(1)`` when nothing was written since the last call, ``O(items written since)``
        after reported writes, one ``O(items stored)`` rebuild after unreported ones. The
        version counters of the signal tensors are compared with the writes reported, at
        every call (``O(signal keys)``): a counter that moved by anything else (an in-place
        edit through a view, before or after a reported write) means a rebuild.

        Args:
            storage: an initialized TensorDict ``TensorStorage``.
            sampler: the slice sampler; its ``traj_key``/``end_key``/``end_keys`` name the
                signal, resolved (fallbacks included) as TorchRL resolves them.

        Raises:
            MissingKeyError: no key the sampler names is in the storage.
            SignalTypeError: floating-point done flags.
            SliceSamplerError: a signal of the wrong shape.
        """
        index = self.index
        same_storage = self._storage is not None and self._storage() is storage
        if same_storage and self._signal_written():
            self.dirty = True  # written in place, not reported (a failed write, a view edit)
        if (
            index is not None
            and same_storage
            and not self._pending_writes
            and not self.dirty
            and mutation_revision(storage, self._revision) == self._revision
        ):
            return index  # nothing written since the last sync: O(1)
        self.attach(storage)
        mode, keys = _signal_keys(sampler, storage)
        leaves = _leaves(storage, mode, keys)
        rows = int(storage._storage.shape[0])
        spec = (mode, keys, rows, leaves[0].shape[1], leaves[0].device)
        revision = mutation_revision(storage, self._revision + self._pending_writes)
        base: int | None = self._revision
        if index is None or spec != self.spec or not same_storage:
            # A storage is created at revision 0: a sampler attached from the start has been
            # told about every write since. Otherwise the baseline is unknown: rebuild.
            base = 0 if self.spec is None else None
            index = TrajectoryIndex(rows, leaves[0].shape[1], mode)
        incremental = (
            not self.dirty
            and base is not None
            and revision == base + self._pending_writes
            and sum(n for _, n in self.pending) < rows
        )
        try:
            if incremental:
                try:
                    for first, n in self.pending:
                        self._write_run(index, leaves, first, n, rows)
                except ValueError:  # a run did not follow the cursor: not a round-robin write
                    incremental = False
            if not (incremental and self._matches(index, storage)):
                self._rebuild(index, storage, leaves, rows)
        except BaseException:
            self.index, self.dirty = None, True
            raise
        self.index, self.spec, self._revision = index, spec, revision
        self._storage = weakref.ref(storage)
        self._watch(storage._storage, keys)
        self.pending, self._pending_writes, self.dirty = [], 0, False
        self._local_writes = 0
        return index

    def _watch(self, data: Any, keys: tuple) -> None:
        """Remember the signal tensors and their version counters. O(signal keys)."""
        leaves = [data.get(key) for key in keys]
        if all(isinstance(leaf, torch.Tensor) and not leaf.is_inference() for leaf in leaves):
            self._signal = tuple(weakref.ref(leaf) for leaf in leaves)
            self._versions = tuple(tensor_version(leaf) for leaf in leaves)
        else:
            self._signal, self._versions = (), None

    def _signal_written(self) -> bool:
        """Whether a signal tensor was written since the last sync other than as reported.

        Each write reported from this process moves each signal tensor's version counter by
        one; a write reported from another process (:func:`remote_writes`) by none. Any other
        move is a write nobody reported. O(signal keys).

        ``False`` where nothing is watched, or a watched tensor is gone (the storage then
        replaced its tensors: a write that moves the mutation revision).
        """
        versions = self._versions
        if versions is None:
            return False
        local = self._local_writes
        for ref, version in zip(self._signal, versions, strict=True):
            leaf = ref()
            if leaf is not None and tensor_version(leaf) != version + local:
                return True
        return False

    @staticmethod
    def attach(storage: Any) -> None:
        """Attach to a shared memmap that other processes initialised, as ``storage.get()`` does.

        ``LazyMemmapStorage(shared_init=True)`` filled by worker processes has no ``_storage``
        in this process until it attaches. O(1) once attached.
        """
        if (
            not getattr(storage, "initialized", True)
            and getattr(storage, "shared_init", False)
            and storage_len(storage)
        ):
            attach_shared_storage(storage)

    @staticmethod
    def _read(leaves: list[torch.Tensor], first: int, n: int, rows: int, mode: str) -> np.ndarray:
        """Rows ``first .. first + n`` (wrapping) of the signal, on the CPU: ``O(n)``.

        Done flags of any integer dtype count where they are non-zero, as in TorchRL; several
        end keys are OR-ed.
        """
        idx = (first + torch.arange(n)) % rows if first + n > rows else slice(first, first + n)
        if mode == "ids":
            return leaves[0][idx].cpu().numpy()
        out: torch.Tensor | None = None
        for leaf in leaves:
            flags = leaf[idx]
            flags = flags if flags.dtype == torch.bool else flags != 0
            out = flags if out is None else out | flags
        assert out is not None  # ``_leaves`` returns one leaf at least
        return out.cpu().numpy()

    def _last_row(self, storage: Any) -> int | None:
        """Last written row of a full storage, or ``None`` (then: the last row).

        The storage records it on every write, but a checkpoint does not carry it: after
        ``load_state_dict``/``loads`` the round-robin writer's restored cursor says where the
        newest item is (TorchRL then treats the end of the storage as the newest item).
        """
        cursor = last_cursor_row(storage)
        if cursor is not None and not self._loaded:
            return cursor
        rows = int(storage._storage.shape[0])
        writers = round_robin_cursors(storage)
        if len(writers) == 1:
            return (writers.pop() - 1) % rows
        return cursor

    def _matches(self, index: TrajectoryIndex, storage: Any) -> bool:
        """Whether the updated index covers the storage's rows and ends at its cursor."""
        full = bool(storage_full(storage))
        if full != (index.size == index.rows) or index.size != (storage_rows(storage) or 0):
            return False
        cursor = self._last_row(storage) if full else None
        return not full or cursor is None or cursor == index.cursor

    def _write_run(
        self, index: TrajectoryIndex, leaves: list[torch.Tensor], first: int, n: int, rows: int
    ) -> None:
        """Index ``n`` rows written from row ``first`` (wrapping), reading them in chunks."""
        for offset in range(0, n, _READ_CHUNK):
            row = (first + offset) % rows
            chunk = self._read(leaves, row, min(_READ_CHUNK, n - offset), rows, index.mode)
            index.write(row, chunk)

    def _rebuild(
        self, index: TrajectoryIndex, storage: Any, leaves: list[torch.Tensor], rows: int
    ) -> None:
        """Index the whole storage, oldest row first: ``O(items stored)``."""
        index.reset()
        first = 0
        if storage_full(storage):
            cursor = self._last_row(storage)
            first = (cursor + 1) % rows if cursor is not None else 0
        self._write_run(index, leaves, first, storage_rows(storage) or 0, rows)

    # -------------------------------------------------------------------- coordinates
    @staticmethod
    def coords(storage: Any, col: np.ndarray) -> np.ndarray:
        """``[n, storage.ndim - 1]`` coordinates of the flat columns ``col``: ``O(n)``."""
        shape = tuple(storage._storage.shape[1 : storage.ndim])
        coords = np.empty((col.shape[0], len(shape)), dtype=np.int64)
        for d in range(len(shape) - 1, -1, -1):
            coords[:, d] = col % shape[d]
            col = col // shape[d]
        return coords

    @classmethod
    def with_coords(cls, storage: Any, rows: np.ndarray, col: np.ndarray) -> torch.Tensor:
        """``[n, storage.ndim]`` indices in TorchRL's format: the time row, then the column's."""
        if storage.ndim == 1:
            return torch.from_numpy(rows)[:, None]
        return torch.from_numpy(np.concatenate([rows[:, None], cls.coords(storage, col)], 1))


def _signal_keys(sampler: Any, storage: Any) -> tuple[str, tuple]:
    """(mode, keys) resolved exactly as TorchRL resolves them, fallbacks included.

    TorchRL tries ``traj_key`` then falls back to ``end_key``/``end_keys`` (or the other
    way round), remembering the outcome on the sampler; the same attributes change the same
    way here.
    """
    keys = _KeyProbe(storage._storage)
    tried: list[str] = []  # "name=value" of every key argument looked up, in order
    for fallback in (True, False):
        if getattr(sampler, "_traj_key_auto", False):
            resolve_traj_key(sampler, storage)
            if not sampler._fetch_traj:
                tried.append("traj_key=None (looked for ('collector', 'traj_ids'), 'episode')")
        if sampler._fetch_traj:
            traj_key = used_traj_key(sampler)
            if traj_key in keys:
                return "ids", (traj_key,)
            tried.append(f"traj_key={traj_key!r}")
            if fallback:
                sampler._fetch_traj = False
                continue
            break
        if sampler.end_keys is None:
            if sampler.end_key in keys:
                return "done", (sampler.end_key,)
            tried.append(f"end_key={sampler.end_key!r}")
            break  # TorchRL does not fall back from a missing end_key
        present = tuple(k for k in sampler.end_keys if k in keys)
        if present:
            return "done", present
        tried.append(f"end_keys={sampler.end_keys!r}")
        if fallback:
            sampler._fetch_traj = True
            if sampler.traj_key is None:
                sampler._traj_key_auto = True
            continue
        break
    tried = list(dict.fromkeys(tried))
    raise MissingKeyError(
        f"{tried[0]} is not in the storage{''.join(', nor is ' + t for t in tried[1:])} "
        f"(keys: {sorted(map(str, keys))}); pass the key holding trajectory ids "
        "(traj_key=...) or done flags (end_key=... or end_keys=[...])."
    )


def _leaves(storage: Any, mode: str, keys: tuple) -> list[torch.Tensor]:
    """The full signal tensors as ``[rows, columns]``, validated before any state changes."""
    data, ndim = storage._storage, storage.ndim
    shape = tuple(data.shape[:ndim])
    leaves = []
    for key in keys:
        leaf = data.get(key)
        if mode == "done" and (leaf.is_floating_point() or leaf.is_complex()):
            raise SignalTypeError(
                f"end_key={key!r} holds {leaf.dtype} values; done flags must be booleans "
                "or integers: store them as torch.bool (e.g. done.bool())."
            )
        if mode == "ids" and tuple(leaf.shape) != shape:  # TorchRL squeezes flags only
            raise SliceSamplerError(
                f"traj_key={key!r} has shape {tuple(leaf.shape)}; expected {shape} (one id "
                f"per stored step): store the ids without trailing dims (ids.reshape{shape})."
            )
        if tuple(leaf.shape[:ndim]) != shape or leaf.shape[ndim:].numel() != 1:
            raise SliceSamplerError(
                f"end_key={key!r} has shape {tuple(leaf.shape)}; expected {shape}, optionally "
                f"followed by dims of size 1 (e.g. {(*shape, 1)}): store one flag per step."
            )
        leaves.append(leaf.reshape(leaf.shape[0], -1))
    return leaves

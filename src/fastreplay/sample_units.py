"""Sample units whose episode boundaries come from fastreplay's incremental trajectory index.

TorchRL's sequence-style units (``Sequence``; ``SubgoalTriplet`` on the nightly) expand the
anchors a sampler drew into windows of records, clamped at episode boundaries. To find those
boundaries TorchRL scans the storage's whole ``done_key`` entry after every write
(``_ReplayBoundaryIndex``, cached until the storage's next write): ``O(items stored)`` per
online step. fastreplay's units read their boundaries from :class:`IndexedBoundaries`
instead, which answers the same queries from a
:class:`~fastreplay._core.trajectory_index.TrajectoryIndex` kept in step with the storage
(in fastreplay's NumPy expansion of 1-D CPU anchors, and in TorchRL's own ``expand`` through
the nightly's ``_episode_boundaries`` hook; 0.14's ``expand``, which has no such hook, runs
unmodified for other anchors):

* every write made through a writer, whichever buffer (TorchRL's or fastreplay's) made it,
  is reported to the index, through TorchRL's public door: a :class:`BoundaryListener`
  attached to the storage (``storage.attach``), whose ``mark_update`` the writers call after
  every write, as they call the buffers': ``O(rows written)``;
* writes nobody reported (``storage.set``, ``rb[idx] = ...``, ``empty()``, a checkpoint
  loaded) are seen from the storage's mutation revision and make the index rebuild once, at
  the next ``expand`` (``O(items stored)``, as TorchRL);
* done flags edited in place through a view of the storage are seen from the version counter
  torch keeps for the ``done_key`` tensor, compared at every ``expand`` with the writes
  reported (``O(1)``), whatever writes came after the edit; edits that move no counter of
  this process (``tensor.data``, another process) need ``unit.invalidate_boundaries()``;
* each query is ``O(batch x log(trajectories))``.

So every record, mask, info key and random draw is TorchRL's, by construction. The index is
shared by every unit that reads the same storage and ``done_key`` (the storage's listener
holds one per ``done_key``). Where it cannot serve
(floating-point done flags, a full storage without a recorded last write, anchors outside the
written rows...), TorchRL's own boundary object is used: never an error where TorchRL works.
``done_key=None`` (one trajectory per column, bounded by the write seam) needs no index.

TorchRL 0.13 has no sample units: this module then exports nothing.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from fastreplay._core.sequence_windows import windows
from fastreplay._torchrl import (
    HAS_EPISODE_BOUNDARIES,
    Storage,
    TorchRLSequence,
    TorchRLSubgoalTriplet,
    attached_entities,
    is_torchrl_function,
    last_cursor_row,
    storage_full,
    torchrl_episode_boundaries,
    unit_check_storage,
    unit_newest_index,
)
from fastreplay.errors import MissingKeyError, SignalTypeError, SliceSamplerError
from fastreplay.samplers._index_sync import DoneFlags, IndexSync

__all__ = [
    "BoundaryListener",
    "IndexedBoundaries",
    "invalidate_writes",
    "invalidate_done_key",
    "fast_unit",
]


class _CountingSync(IndexSync):
    """An :class:`IndexSync` that counts its full reads of the storage."""

    rebuilds = 0

    def _rebuild(self, *args: Any) -> None:
        self.rebuilds += 1
        super()._rebuild(*args)


class _Entry:
    """One storage's index for one ``done_key``, and the lock its readers take."""

    def __init__(self, done_key: Any) -> None:
        self.sync = _CountingSync()
        self.key = DoneFlags(end_key=done_key)
        self.lock = threading.Lock()


_ALL: Any = object()  # every ``done_key``


class BoundaryListener:
    """The episode-boundary indices of one storage, told of its writes as its buffers are.

    Attached to the storage with TorchRL's public ``storage.attach(listener)``: TorchRL's
    writers (and fastreplay's direct write path) call :meth:`mark_update` on every entity
    attached to the storage after every write, whichever buffer (TorchRL's or fastreplay's)
    wrote. The storage holds the listener, the listener holds no reference to the storage,
    so the indices go with their storage. It pickles as an empty listener (a storage pickles
    what is attached to it): the copy's indices rebuild from its storage at their first
    ``expand``. It is no buffer: ``round_robin_cursors`` finds no writer on it.
    """

    def __init__(self) -> None:
        self.entries: dict[Any, _Entry] = {}  # done_key -> its index
        _LISTENERS.add(self)  # unpickled ones too: ``invalidate_done_key(None, ...)`` finds them

    def __reduce__(self) -> tuple[type, tuple[()]]:
        return (BoundaryListener, ())

    def entry(self, done_key: Any) -> _Entry:
        """The index read from ``done_key``, made empty (to rebuild) on first use. O(1)."""
        entry = self.entries.get(done_key)
        if entry is None:
            with _LOCK:
                entry = self.entries.setdefault(done_key, _Entry(done_key))
        return entry

    def mark_update(self, index: Any) -> None:
        """Record the rows a write touched: ``O(rows written)`` per index, read at ``expand``.

        An index that cannot tell the rows (not a round-robin write) rebuilds at the next
        ``expand``. O(1) where no unit reads the storage yet.
        """
        for entry in list(self.entries.values()):
            with entry.lock:
                try:
                    entry.sync.record(index)
                except (TypeError, ValueError, RuntimeError):
                    entry.sync.invalidate()

    def invalidate(self, done_key: Any = _ALL) -> None:
        """Rebuild the index of ``done_key`` (default: every index) at the next ``expand``."""
        for key, entry in list(self.entries.items()):
            if done_key is _ALL or key == done_key:
                with entry.lock:
                    entry.sync.invalidate()


_LOCK = threading.Lock()  # makes each storage's listener, and each listener's entries, once
_LISTENERS: weakref.WeakSet[BoundaryListener] = weakref.WeakSet()  # every live listener (weak)


def _listener(storage: Any, create: bool) -> BoundaryListener | None:
    """The listener attached to ``storage`` (attached now if ``create``). O(entities attached)."""
    for entity in attached_entities(storage):
        if type(entity) is BoundaryListener:
            return entity
    if not create or not isinstance(storage, Storage):
        return None  # no TorchRL storage: nothing calls ``mark_update`` on what it holds
    with _LOCK:
        for entity in attached_entities(storage):
            if type(entity) is BoundaryListener:
                return entity
        listener = BoundaryListener()
        storage.attach(listener)
    return listener


def invalidate_writes(storage: Any) -> None:
    """``storage`` was written in a way no index can follow: rebuild at the next ``expand``.

    A write that raised part way (its rows written in part, no write reported). O(indices).
    """
    listener = _listener(storage, create=False)
    if listener is not None:
        listener.invalidate()


def invalidate_done_key(storage: Any, done_key: Any) -> None:
    """Rebuild the index of ``storage`` read from ``done_key`` at the next ``expand``.

    ``storage=None``: the index of every storage read from ``done_key``. O(1) per storage
    indexed (each then rebuilds once: ``O(items stored)``).
    """
    if storage is None:
        listeners = list(_LISTENERS)
    else:
        listener = _listener(storage, create=False)
        listeners = [] if listener is None else [listener]
    for listener in listeners:
        listener.invalidate(done_key)


def rebuilds(storage: Any, done_key: Any) -> int:
    """How many times the index of ``storage``/``done_key`` read the whole storage."""
    listener = _listener(storage, create=False)
    entry = None if listener is None else listener.entries.get(done_key)
    return entry.sync.rebuilds if entry is not None else 0


class IndexedBoundaries:
    """The episode boundaries TorchRL's ``_ReplayBoundaryIndex`` finds, from an index.

    Answers what TorchRL's units ask of the boundary object: :attr:`length` (the written
    length of the storage along dim 0) and :meth:`distances`. Build it with
    :meth:`for_storage`, which returns ``None`` where TorchRL's object must be used.

    Args:
        length: ``storage.shape[0]``.
        lanes: the storage's trailing batch shape (``()`` for a 1-D storage).
        locate: ``(rows, columns) -> (start_row, trajectory_length)`` numpy arrays, or
            ``None``: one trajectory per column, from ``start`` to ``stop``.
        start: first row of that single trajectory (``locate=None``).
        stop: last row of that single trajectory (``locate=None``).
        fallback: builds TorchRL's object, for a query this one does not answer.
    """

    def __init__(
        self,
        length: int,
        lanes: tuple[int, ...],
        locate: Callable[[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]] | None,
        start: int,
        stop: int,
        fallback: Callable[[], Any],
    ) -> None:
        self.length = length
        self._lanes = lanes
        self._locate = locate
        self._start, self._stop = start, stop
        self._fallback = fallback

    @classmethod
    def for_storage(cls, storage: Any, done_key: Any, device: Any) -> IndexedBoundaries | None:
        """The boundaries of ``storage`` read from ``done_key``, or ``None`` (use TorchRL's).

        ``O(1)`` when the index is current, ``O(rows written)`` after reported writes,
        ``O(items stored)`` once after unreported ones. ``device`` is not used: distances
        come back on the anchors' device, as TorchRL's.
        """

        def fallback() -> Any:
            return torchrl_episode_boundaries(storage, done_key, device)

        shape = storage.shape
        if shape is None or not len(shape) or not shape[0]:
            return None  # empty or uninitialized: TorchRL's error
        length, lanes = int(shape[0]), tuple(int(s) for s in shape[1 : storage.ndim])
        full = storage_full(storage)
        cursor = last_cursor_row(storage)
        if full and not isinstance(cursor, int):
            return None  # TorchRL then ends each column at its last row: not a write order
        if done_key is None:  # one trajectory per column, ending at the last write
            stop = cursor if full else length - 1
            assert stop is not None
            if not 0 <= stop < length:
                return None
            return cls(length, lanes, None, (stop + 1) % length, stop, fallback)
        listener = _listener(storage, create=True)
        if listener is None:
            return None  # a storage nothing can be attached to: TorchRL's object
        entry = listener.entry(done_key)
        with entry.lock:
            try:
                index = entry.sync.sync(storage, entry.key)
            except (MissingKeyError, SignalTypeError, SliceSamplerError):
                return None  # a missing key, float flags, a wrong shape: TorchRL's answer
            if index.size != length or (full and index.cursor != cursor):
                return None

        def locate(rows: np.ndarray, columns: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
            with entry.lock:
                return index.locate(rows, columns)

        return cls(length, lanes, locate, 0, 0, fallback)

    def distances(self, anchor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Distances from each anchor to its episode's first and last records, as TorchRL's.

        ``anchor``: time rows (1-D storage, any shape) or ``[B, ndim]`` coordinates.
        Returns two ``long`` tensors on ``anchor``'s device: ``[B]`` for coordinates, shaped
        like ``anchor`` for time rows. ``O(B x log(trajectories))``.
        """
        lanes = self._lanes
        if lanes:
            if anchor.ndim != 2 or anchor.shape[-1] != 1 + len(lanes):
                return self._fallback().distances(anchor)  # TorchRL's error
            time = anchor[:, 0]
        else:
            time = anchor
        if self._locate is None:
            start = torch.remainder(time - self._start, self.length)
            stop = torch.remainder(self._stop - time, self.length)
            return start.to(torch.long), stop.to(torch.long)
        host = anchor.detach().to("cpu", torch.long).numpy()
        rows = host[:, 0] if lanes else host.reshape(-1)
        if lanes:
            coords = host[:, 1:]
            if (coords < 0).any() or (coords >= np.array(lanes)).any():
                return self._fallback().distances(anchor)
            columns = np.ravel_multi_index(tuple(coords.T), lanes)
        else:
            columns = np.zeros(rows.shape, dtype=np.int64)
        if rows.size and (rows.min() < 0 or rows.max() >= self.length):
            return self._fallback().distances(anchor)  # rows never written: TorchRL's answer
        start, span = self._locate(rows, columns)
        from_start = np.remainder(rows - start, self.length)
        to_stop = np.remainder(start + span - 1 - rows, self.length)
        shape = time.shape
        return (
            torch.from_numpy(from_start).reshape(shape).to(anchor.device),
            torch.from_numpy(to_stop).reshape(shape).to(anchor.device),
        )


def _episode_boundaries(storage: Any, done_key: Any, device: Any) -> Any:
    """:class:`IndexedBoundaries` where the index serves, else TorchRL's object."""
    boundaries = IndexedBoundaries.for_storage(storage, done_key, device)
    if boundaries is None:
        return torchrl_episode_boundaries(storage, done_key, device)
    return boundaries


class _IndexedUnit:
    """The episode-boundary hook of fastreplay's units (TorchRL's ``_episode_boundaries``)."""

    @staticmethod
    def _episode_boundaries(storage: Any, done_key: Any, device: Any) -> Any:
        """Episode boundaries of ``storage`` read from ``done_key``, from the shared index.

        ``O(1)`` when nothing was written since the last call, ``O(rows written)`` after
        writes the storage's writers reported, ``O(items stored)`` once after other writes;
        TorchRL's own object where the index cannot serve.
        """
        return _episode_boundaries(storage, done_key, device)

    def invalidate_boundaries(self, storage: Any = None) -> None:
        """Reread the episode boundaries from the storage at the next ``expand``.

        The boundaries are kept from the writes the storage's writers report (any buffer's,
        through the :class:`BoundaryListener` attached to the storage), and checked at
        every ``expand`` against the storage's write count and the version counter torch
        keeps for the ``done_key`` tensor: writes nobody reported, and in-place edits of the
        done flags through a view of the storage (``storage[:]["next", "done"][i] = True``),
        before or after a reported write, are seen without this call. Call it after edits
        that move neither: made by another process (shared memory, a memory map), through
        ``tensor.data`` or a NumPy view of the flags, or to a memory map opened separately.

        Args:
            storage: the storage whose boundaries to reread; ``None``: every storage whose
                boundaries this unit's ``done_key`` reads (the index is shared by the units
                reading the same storage and ``done_key``).

        O(1); the next ``expand`` then reads the storage's ``done_key`` once
        (``O(items stored)``, as TorchRL's does after every write).
        """
        done_key = getattr(self, "done_key", None)  # set by TorchRL's unit
        if done_key is not None:  # ``None``: the write seam bounds, no index to reread
            invalidate_done_key(storage, done_key)


_fast_classes: dict[type, Any] = {}  # TorchRL's unit class -> fastreplay's

if TorchRLSequence is not None:
    _seen_expand: list[Any] = [None, False]  # TorchRL's Sequence.expand last seen, and whether
    # it is TorchRL's own (not a user's patch)

    def _torchrl_expand_is_original() -> bool:
        """Whether ``torchrl...Sequence.expand`` is TorchRL's own, not patched. O(1)."""
        expand = TorchRLSequence.expand
        if expand is not _seen_expand[0]:
            _seen_expand[:] = expand, is_torchrl_function(expand, TorchRLSequence, "expand")
        return bool(_seen_expand[1])

    def _expand_sequence(
        unit: Any, index: Any, info: dict[str, Any], storage: Any
    ) -> tuple[torch.Tensor, dict[str, Any]] | None:
        """TorchRL's ``Sequence.expand`` for 1-D ``int64`` CPU anchors, or ``None``.

        The same statements as TorchRL's, in its order (the info entries repeated per record,
        then ``sequence_id``, ``step_in_sequence``, ``learning_mask``, ``anchor_index``,
        ``validity_mask``), with the window arithmetic on NumPy arrays. ``O(batch x window)``
        plus the boundary query.
        """
        unit_check_storage(unit, storage)
        if not (
            type(index) is torch.Tensor
            and index.ndim == 1
            and index.dtype == torch.long
            and index.device.type == "cpu"
            and storage.ndim == 1
        ):
            return None
        anchor = index.clone()
        batch = anchor.shape[0]
        burn_in, length, bootstrap = unit.burn_in, unit.length, unit.bootstrap
        total = burn_in + length + bootstrap
        expanded: dict[str, Any] = {}
        for key, value in info.items():
            tensor = torch.as_tensor(value)
            expanded[key] = value if tensor.ndim == 0 else tensor.repeat_interleave(total, dim=0)
        steps = np.arange(total, dtype=np.int64)
        learning = (steps >= burn_in) & (steps < burn_in + length)
        expanded["sequence_id"] = torch.from_numpy(
            np.repeat(np.arange(batch, dtype=np.int64), total)
        )
        expanded["step_in_sequence"] = torch.from_numpy(np.tile(steps, batch))
        expanded["learning_mask"] = torch.from_numpy(np.tile(learning, batch))
        expanded["anchor_index"] = anchor.repeat_interleave(total, dim=0)
        host = anchor.numpy()
        policy = unit.episode_boundary
        if policy in ("pad", "stop"):
            boundary = unit._episode_boundaries(storage, unit.done_key, anchor.device)
            back, ahead = (d.numpy() for d in boundary.distances(anchor))
            modulus = int(boundary.length)
        else:  # "include_reset": only the write seam and unwritten rows bound a window
            modulus = int(storage.shape[0])
            newest = unit_newest_index(unit, storage, modulus)
            oldest = (newest + 1) % modulus if storage_full(storage) else 0
            ahead = np.remainder(newest - host, modulus)
            back = np.remainder(host - oldest, modulus)
        rows, valid = windows(
            host, back, ahead, length=length, burn_in=burn_in, bootstrap=bootstrap,
            dilation=unit.dilation, policy=policy, modulus=modulus,
        )  # fmt: skip
        expanded["validity_mask"] = torch.from_numpy(valid.reshape(-1))
        return torch.from_numpy(rows.reshape(-1)), expanded

    class Sequence(_IndexedUnit, TorchRLSequence):
        """TorchRL's ``Sequence`` sample unit, with its episode boundaries kept per write.

        Same arguments, records, masks, info entries and random draws as
        :class:`torchrl.data.replay_buffers.Sequence` (it runs TorchRL's ``expand``), but the
        boundaries come from fastreplay's trajectory index instead of a scan of the whole
        ``done_key`` entry after every write. An ``expand`` costs
        ``O(batch x (burn_in + length + bootstrap) + batch x log(trajectories))`` plus
        ``O(rows written since the last sample)``, whichever buffer wrote those rows (the
        writers report each write to the index: :class:`BoundaryListener`); writes that are
        not reported (``storage.set``, ``rb[idx] = ...``) make it rebuild once
        (``O(items stored)``, as TorchRL's after every write).
        Done flags edited through ``tensor.data`` or by another process need
        :meth:`invalidate_boundaries`; edits through a view of the storage are seen.

        Args:
            length: the learning region's length.
            episode_boundary: ``"pad"``, ``"stop"`` or ``"include_reset"``.
            done_key: the end-of-episode flag; ``None``: one episode per column, bounded by
                the write seam (no index needed).
            burn_in: records before the anchor.
            bootstrap: records after the learning region.
            dilation: storage records between consecutive window records.

        Raises:
            ValueError: as TorchRL's (a non-positive ``length`` or ``dilation``, a negative
                ``burn_in`` or ``bootstrap``, an unknown ``episode_boundary``).

        Example:
            >>> import torch
            >>> from tensordict import TensorDict
            >>> from torchrl.data import LazyTensorStorage
            >>> from fastreplay import Sequence, TensorDictReplayBuffer
            >>> rb = TensorDictReplayBuffer(
            ...     storage=LazyTensorStorage(10), batch_size=2,
            ...     sample_unit=Sequence(length=2, burn_in=1, bootstrap=1),
            ... )
            >>> done = torch.zeros(10, 1, dtype=torch.bool)
            >>> done[4] = done[9] = True
            >>> _ = rb.extend(TensorDict(
            ...     {"obs": torch.arange(10), ("next", "done"): done}, batch_size=[10]
            ... ))
            >>> index, info = rb._sample_unit.expand(torch.tensor([5]), {}, rb.storage)
            >>> index.tolist(), info["validity_mask"].tolist()
            ([5, 5, 6, 7], [False, True, True, True])
        """

        def expand(
            self, index: Any, info: dict[str, Any], storage: Any
        ) -> tuple[Any, dict[str, Any]]:
            """TorchRL's ``Sequence.expand``: the same records, masks and info entries.

            A 1-D CPU storage with ``int64`` anchors is expanded in a few NumPy passes
            (:func:`fastreplay._core.sequence_windows.windows`) reading the episode
            boundaries from the index: ``O(batch x window + batch x log(trajectories))``.
            Anything else runs TorchRL's ``Sequence.expand`` as it is (the nightly's reads
            the boundaries from the index too; 0.14's scans the storage, as TorchRL). A
            ``Sequence.expand`` patched into TorchRL's class runs in its place, as in
            TorchRL's buffers.
            """
            if _torchrl_expand_is_original():
                expanded = _expand_sequence(self, index, info, storage)
                if expanded is not None:
                    return expanded
            return TorchRLSequence.expand(self, index, info, storage)

    _fast_classes[TorchRLSequence] = Sequence
    __all__ += ["Sequence"]

if TorchRLSubgoalTriplet is not None and HAS_EPISODE_BOUNDARIES:

    class SubgoalTriplet(_IndexedUnit, TorchRLSubgoalTriplet):
        """TorchRL's ``SubgoalTriplet`` sample unit, with its episode boundaries kept per write.

        Same arguments and results as TorchRL's (it runs TorchRL's ``expand``, the same
        random draws from the storage's generator), with the boundaries of
        :class:`Sequence`: ``O(batch x log(trajectories))`` per ``expand`` plus the rows
        written since the last one.

        Keyword Args:
            goal_discount: the goal offset's distribution (geometric, or ``None``: uniform).
            policy_goal_discount: the same for the policy goal.
            done_key: the end-of-episode flag.

        Example:
            >>> import torch
            >>> from tensordict import TensorDict
            >>> from torchrl.data import LazyTensorStorage
            >>> from fastreplay import SubgoalTriplet, TensorDictReplayBuffer
            >>> done = torch.zeros(20, 1, dtype=torch.bool)
            >>> done[9] = done[19] = True
            >>> rb = TensorDictReplayBuffer(
            ...     storage=LazyTensorStorage(20), batch_size=8,
            ...     sample_unit=SubgoalTriplet(goal_discount=0.9),
            ... )
            >>> _ = rb.extend(TensorDict(
            ...     {"step": torch.arange(20), ("next", "done"): done}, batch_size=[20]
            ... ))
            >>> state, subgoal, goal, _ = rb.sample().unflatten(0, (8, 4))["step"].unbind(-1)
            >>> bool(((state <= subgoal) & (subgoal < goal)).all())
            True
        """

    _fast_classes[TorchRLSubgoalTriplet] = SubgoalTriplet
    __all__ += ["SubgoalTriplet"]


_SHADOWS: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()


def fast_unit(unit: Any) -> Any:
    """The unit a fastreplay buffer expands with: ``unit``, or its fastreplay twin.

    An instance of exactly TorchRL's ``Sequence``/``SubgoalTriplet`` gets a twin of
    fastreplay's class that shares its attribute dictionary (an attribute set on either is
    seen by both; ``unit`` itself is not changed), cached per unit. Any other unit is
    returned as is. O(1).
    """
    if unit is None:
        return None
    cls = _fast_classes.get(type(unit))
    if cls is None:
        return unit
    twin = _SHADOWS.get(unit)
    if twin is None:
        twin = cls.__new__(cls)
        twin.__dict__ = unit.__dict__
        _SHADOWS[unit] = twin
    return twin


def is_fast_unit(unit: Any) -> bool:
    """Whether ``unit`` is one of fastreplay's units (its expansion is TorchRL's code)."""
    return type(unit) in _fast_classes.values()

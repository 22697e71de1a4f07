"""``SliceSampler``: TorchRL's slice sampler with an incrementally maintained boundary index."""

from __future__ import annotations

import inspect
import operator
import weakref
from typing import Any

import numpy as np
import torch
from tensordict import is_tensor_collection
from tensordict.utils import NestedKey

from fastreplay._signature import constructor_signature
from fastreplay._torchrl import (
    _REPLACEMENT_DISPATCH,
    STATIC_BOUNDARIES,
    RoundRobinWriter,
    SliceSamplerBase,
    TensorStorage,
    last_cursor_row,
    mutation_revision,
    pads_short_slices,
)
from fastreplay._torchrl import TorchRLSliceSampler as _TorchRLSliceSampler
from fastreplay._trajectory_index import TrajectoryIndex

__all__ = [
    "MissingKeyError",
    "SignalTypeError",
    "SliceSampler",
    "SliceSamplerError",
    "without_replacement_class",
]

_READ_CHUNK = 1 << 24  # rows read at once when rebuilding from the whole storage


class _KeyProbe:
    """``key in probe``: O(1) membership test on a TensorDict; lists the keys for messages."""

    def __init__(self, data: Any) -> None:
        self.data = data

    def __contains__(self, key: Any) -> bool:
        return self.data.get(key, default=None) is not None

    def __iter__(self) -> Any:
        return iter(self.data.keys(include_nested=True, leaves_only=True))


class _SignalRows:
    """``storage[index]`` as TorchRL's ``_finalize_index`` reads it: only the keys it asks for.

    TorchRL gathers every stored key at the sampled rows to read ``done``, ``terminated`` and
    ``is_init`` (a second gather of the whole sample, which the buffer then gathers again).
    ``get(key)`` here gathers that key alone, with the same values: ``O(batch)`` per key read
    instead of ``O(batch x stored keys)``.
    """

    def __init__(self, storage: Any, index: Any = None) -> None:
        self.storage = storage
        self.index = index

    def __getitem__(self, index: Any) -> _SignalRows:
        return _SignalRows(self.storage, index)

    def get(self, key: NestedKey, default: Any = None) -> Any:
        storage = self.storage
        leaf = storage._storage.get(key, None)
        if leaf is None:
            return default
        if not storage._is_full:  # as TensorStorage.get: the stored rows only
            leaf = leaf[: storage._len_along_dim0]
        return leaf[self.index]


class MissingKeyError(KeyError, RuntimeError):
    """A boundary key is missing from the storage.

    TorchRL raises ``RuntimeError`` or ``KeyError`` here depending on the key arguments; this
    class is both, so either handler catches it (``str`` shows the message unquoted).
    """

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class SliceSamplerError(ValueError, RuntimeError):
    """Bad sampling request or setting; a ``ValueError`` that ``RuntimeError`` handlers catch."""


class SignalTypeError(TypeError, NotImplementedError):
    """Done flags of a floating-point dtype (TorchRL raises ``NotImplementedError``)."""


def without_replacement_class() -> type:
    """The class that ``SliceSampler(replacement=False, ...)`` builds, with the same arguments.

    The one place that makes this choice; that class also accepts ``replacement=False`` itself
    (a no-op), as TorchRL's classes do. It is read from TorchRL's replacement table, where
    :mod:`fastreplay.samplers.slice_without_replacement` registers it when it is imported
    (importing any part of fastreplay imports it), so this module does not import it.

    Returns:
        ``fastreplay.SliceSamplerWithoutReplacement``.
    """
    return _REPLACEMENT_DISPATCH[SliceSampler]


_REPLACEMENT = inspect.Parameter(
    "replacement", inspect.Parameter.KEYWORD_ONLY, default=True, annotation="bool"
)


class _SliceSamplerMeta(type(_TorchRLSliceSampler)):  # type: ignore[misc]
    """TorchRL's sampler metaclass, plus ``replacement=False`` dispatch and real signatures."""

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        if not kwargs.get("replacement", True):
            if cls is SliceSampler:
                del kwargs["replacement"]
                return without_replacement_class()(*args, **kwargs)
            if cls is without_replacement_class():  # already without replacement: a no-op
                del kwargs["replacement"]
        return super().__call__(*args, **kwargs)

    @property
    def __signature__(cls) -> inspect.Signature:
        """``cls(...)``'s arguments (TorchRL's metaclass makes them read ``*args, **kwargs``).

        A class body's own ``__signature__`` (``PrioritizedSliceSampler``'s, which takes no
        ``replacement``) is used for it and its subclasses; otherwise ``replacement`` comes
        first, then the ``__init__`` chain's arguments.
        """
        for klass in cls.__mro__:
            own = vars(klass).get("__signature__")
            if own is not None:
                return own.__get__(None, cls)
        signature = constructor_signature(cls, extra=[_REPLACEMENT])
        params = sorted(
            signature.parameters.values(), key=lambda p: (p.kind, p.name != "replacement")
        )
        return signature.replace(parameters=params)


class _BoundaryKey:
    """A boundary key attribute (``end_key``, ``end_keys``, ``traj_key``) kept in ``__dict__``.

    TorchRL reads these at every ``sample``; assigning a new value here also marks the
    trajectory index for a rebuild from the storage at the next ``sample`` (``O(items
    stored)``, once). The value lives in the instance ``__dict__`` under its own name, as a
    plain attribute would, so pickles and TorchRL's ``__getstate__`` see no difference.
    """

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, instance: Any, owner: type) -> Any:
        if instance is None:
            return self
        try:
            return instance.__dict__[self.name]
        except KeyError:
            pass
        for klass in owner.__mro__:  # a default for a TorchRL version without the argument
            default = vars(klass).get(self.name, self)
            if not isinstance(default, _BoundaryKey):
                return default
        raise AttributeError(self.name)

    def __set__(self, instance: Any, value: Any) -> None:
        state = instance.__dict__
        if self.name in state and not _same_key(state[self.name], value):
            state["_fr_dirty"] = True
        state[self.name] = value


def _same_key(old: Any, new: Any) -> bool:
    """Whether two key settings name the same keys (keys, sequences of keys or ``None``)."""
    try:
        return type(old) is type(new) and bool(old == new)
    except (TypeError, RuntimeError, ValueError):  # something that does not compare: changed
        return False


def _check_count(name: str, value: Any) -> Any:
    """``num_slices``/``slice_len``: ``None`` or a positive integer (numpy ints accepted)."""
    if value is None or isinstance(value, bool):  # TorchRL reads True as 1
        return value
    try:
        count = operator.index(value)
    except TypeError:
        raise TypeError(
            f"{name} must be an integer, got {name}={value!r} of type {type(value).__name__}; "
            f"pass a positive int (e.g. {name}=4)."
        ) from None
    if count < 1:
        raise SliceSamplerError(
            f"{name} must be at least 1, got {name}={count}; pass a positive int (e.g. {name}=4)."
        )
    return count


class SliceSampler(SliceSamplerBase, metaclass=_SliceSamplerMeta):
    """Drop-in ``torchrl.data.SliceSampler`` whose trajectory boundaries are kept up to date.

    Same constructor arguments and same outputs (index format, ``truncated``/``done``/
    ``terminated`` info, ``is_init`` markers, ``strict_length``, ``span``, ``pad_output``) as
    TorchRL's class. The same seed gives bit-identical samples. TorchRL rescans the whole storage
    at the first ``sample`` after every write; this class updates a trajectory index from the
    rows each ``extend``/``add`` reports:

    * a write of ``n`` items costs ``O(n)``, not ``O(items stored)``;
    * ``sample`` costs ``O(batch)``, independent of capacity and of the number of trajectories;
    * the index holds ``O(number of trajectories)`` integers.

    Writes through the storage that the sampler was not told about (``rb[idx] = ...``, another
    writer or process, ``empty()``, ``loads``, ``load_state_dict``) change the storage's
    mutation revision; the index is then rebuilt from the storage once (``O(items stored)``),
    never served stale. **In-place edits of stored done flags or trajectory ids through a
    view** (``rb["next", "done"][i] = True``, ``storage[:][key][i] = ...``) bypass the storage
    and cannot be seen without a full scan: call :meth:`invalidate_boundaries` after them.

    ``SliceSampler(replacement=False, ...)`` returns :func:`without_replacement_class` built with
    the other arguments, as TorchRL does. ``fragmented=True``, the static ``ends``/
    ``trajectories`` arguments, ``use_gpu`` and storages that are not a TensorDict
    ``TensorStorage`` (``ListStorage``, ``LazyStackStorage``) keep TorchRL's own code path.

    Example:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> from torchrl.data import LazyTensorStorage, TensorDictReplayBuffer
        >>> from fastreplay import SliceSampler
        >>> rb = TensorDictReplayBuffer(
        ...     storage=LazyTensorStorage(100),
        ...     sampler=SliceSampler(num_slices=4, traj_key="episode"),
        ...     batch_size=16,
        ... )
        >>> episode = torch.arange(60) // 20  # three episodes of 20 steps
        >>> _ = rb.extend(TensorDict({"episode": episode, "obs": torch.arange(60)}, [60]))
        >>> batch = rb.sample()
        >>> batch["episode"].view(4, 4).unique(dim=1).shape  # each slice in one episode
        torch.Size([4, 1])

    The public attributes TorchRL reads at each ``sample`` (``num_slices``, ``slice_len``,
    ``strict_length``, ``pad_output``, ``span``, ``end_key``, ``end_keys``, ``traj_key``,
    ``truncated_key``, ``init_key``, ``cache_values``, ``use_gpu``, ``fragmented``,
    ``step_key``) can be assigned between samples, as with TorchRL's class (e.g.
    ``sampler.num_slices = k`` before ``rb.sample(k * horizon)``); a new boundary key makes the
    index rebuild from the storage once.
    """

    end_key = _BoundaryKey()
    end_keys = _BoundaryKey()
    traj_key = _BoundaryKey()

    def __init__(self, **kwargs: Any) -> None:
        """Build the sampler; arguments as in the installed ``torchrl.data.SliceSampler``.

        Every keyword goes to TorchRL's constructor, so each TorchRL version's arguments are
        accepted (and shown by ``inspect.signature``) as they are.

        ``replacement=False`` builds :func:`without_replacement_class` instead (the metaclass
        reads it before ``__init__`` runs); ``True``, the default, builds this class.

        Raises:
            TypeError: ``num_slices``/``slice_len`` is not an integer (and TorchRL's own
                errors for exclusive, missing or unknown arguments).
            SliceSamplerError: ``num_slices``/``slice_len`` is below 1 (a ``ValueError``).
        """
        fragmented = bool(kwargs.get("fragmented", False))
        if fragmented:
            # TorchRL accepts fragmented=True only where ``sample`` is its own class's: this
            # class's ``sample`` serves it with TorchRL's code, its subclasses' may not.
            if type(self).sample is not SliceSampler.sample:
                raise NotImplementedError(
                    "fragmented=True currently supports SliceSampler with replacement only."
                )
            _TorchRLSliceSampler(**kwargs)  # TorchRL's other checks, errors and messages
            kwargs["fragmented"] = False  # the flag is read at sample time only
        super().__init__(**kwargs)
        if fragmented:
            self.fragmented = True
        self.num_slices = _check_count("num_slices", self.num_slices)
        self.slice_len = _check_count("slice_len", self.slice_len)
        self._fr_init_state()

    def _fr_init_state(self) -> None:
        """The index state; subclasses that run TorchRL's ``__init__`` directly call it too."""
        self._fr_index: TrajectoryIndex | None = None
        self._fr_spec: tuple | None = None
        self._fr_storage: weakref.ref | None = None  # identity that a new storage cannot reuse
        self._fr_revision = 0
        self._fr_pending: list[list[int]] = []  # [first_row, n_rows] runs not yet indexed
        self._fr_pending_writes = 0
        self._fr_dirty = False
        self._fr_loaded = False  # a checkpoint was loaded: the storage's cursor may be stale

    def invalidate_boundaries(self) -> None:
        """Rebuild the trajectory boundaries from the storage at the next ``sample``.

        Call it after editing stored done flags or trajectory ids in place through a view
        (``rb["next", "done"][i] = True``, ``storage[:][key][i] = ...``): such edits bypass
        the storage's write path, so the index cannot see them. Writes through the replay
        buffer or the storage (``extend``, ``add``, ``rb[idx] = ...``) need no call.
        The rebuild costs one ``O(items stored)`` read of the boundary keys.
        """
        self._fr_dirty = True

    # ----------------------------------------------------------------- write notifications
    def extend(self, index: torch.Tensor) -> None:
        """Record the rows the writer just wrote (``O(items written)``)."""
        super().extend(index)
        self._fr_record(index)

    def add(self, index: int | torch.Tensor) -> None:
        """Record the row the writer just wrote."""
        super().add(index)
        self._fr_record(index)

    def _fr_record(self, index: int | torch.Tensor) -> None:
        self._fr_pending_writes += 1
        self._fr_loaded = False  # the storage's cursor is current again
        if self._fr_dirty:
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
            self._fr_dirty = True  # not a round-robin write: rebuild at the next sample
            return
        first, n = int(rows[0]), int(rows.size)
        last = self._fr_pending[-1] if self._fr_pending else None
        if last is not None and last[0] + last[1] == first:
            last[1] += n
        else:
            self._fr_pending.append([first, n])

    def _empty(self) -> None:
        super()._empty()
        self._fr_dirty = True

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load TorchRL's (empty) state; the index is rebuilt at the next sample."""
        super().load_state_dict(state_dict)
        self._fr_dirty = self._fr_loaded = True

    def loads(self, path: Any) -> None:
        """Load from ``path`` as TorchRL does; the index is rebuilt at the next sample."""
        super().loads(path)
        self._fr_dirty = self._fr_loaded = True

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state.update(_fr_index=None, _fr_spec=None, _fr_storage=None, _fr_pending=[])
        state["_fr_dirty"] = True
        return state

    # ----------------------------------------------------------------------- the index
    def _fr_fast(self, storage: Any) -> bool:
        """Whether the index serves ``storage`` (else TorchRL's own code path does)."""
        if self.fragmented or self.use_gpu or STATIC_BOUNDARIES in self._cache:
            return False
        if not isinstance(storage, TensorStorage):
            return False  # ListStorage, LazyStackStorage, ...: TorchRL's path and errors
        self._fr_attach(storage)
        data = getattr(storage, "_storage", None)
        return data is None or is_tensor_collection(data)

    @staticmethod
    def _fr_attach(storage: Any) -> None:
        """Attach to a shared memmap that other processes initialised, as ``storage.get()`` does.

        ``LazyMemmapStorage(shared_init=True)`` filled by worker processes has no ``_storage``
        in this process until it attaches. O(1) once attached.
        """
        if (
            not getattr(storage, "initialized", True)
            and getattr(storage, "shared_init", False)
            and len(storage)
        ):
            storage._wait_for_init()

    def _fr_signal_keys(self, storage: Any) -> tuple[str, tuple]:
        """(mode, keys) resolved exactly as TorchRL resolves them, fallbacks included.

        TorchRL tries ``traj_key`` then falls back to ``end_key``/``end_keys`` (or the other
        way round), remembering the outcome; the same attributes change the same way here.
        """
        keys = _KeyProbe(storage._storage)
        tried: list[str] = []  # "name=value" of every key argument looked up, in order
        for fallback in (True, False):
            if getattr(self, "_traj_key_auto", False):
                self._resolve_traj_key(storage)
                if not self._fetch_traj:
                    tried.append("traj_key=None (looked for ('collector', 'traj_ids'), 'episode')")
            if self._fetch_traj:
                if self._used_traj_key in keys:
                    return "ids", (self._used_traj_key,)
                tried.append(f"traj_key={self._used_traj_key!r}")
                if fallback:
                    self._fetch_traj = False
                    continue
                break
            if self.end_keys is None:
                if self.end_key in keys:
                    return "done", (self.end_key,)
                tried.append(f"end_key={self.end_key!r}")
                break  # TorchRL does not fall back from a missing end_key
            present = tuple(k for k in self.end_keys if k in keys)
            if present:
                return "done", present
            tried.append(f"end_keys={self.end_keys!r}")
            if fallback:
                self._fetch_traj = True
                if self.traj_key is None:
                    self._traj_key_auto = True
                continue
            break
        tried = list(dict.fromkeys(tried))
        raise MissingKeyError(
            f"{tried[0]} is not in the storage{''.join(', nor is ' + t for t in tried[1:])} "
            f"(keys: {sorted(map(str, keys))}); pass the key holding trajectory ids "
            "(traj_key=...) or done flags (end_key=... or end_keys=[...])."
        )

    def _fr_leaves(self, storage: Any, mode: str, keys: tuple) -> list[torch.Tensor]:
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

    @staticmethod
    def _fr_read(
        leaves: list[torch.Tensor], first: int, n: int, rows: int, mode: str
    ) -> np.ndarray:
        """Rows ``first .. first + n`` (wrapping) of the signal, on the CPU: ``O(n)``.

        Done flags of any integer dtype count where they are non-zero, as in TorchRL; several
        end keys are OR-ed.
        """
        idx = (first + torch.arange(n)) % rows if first + n > rows else slice(first, first + n)
        if mode == "ids":
            return leaves[0][idx].cpu().numpy()
        out = None
        for leaf in leaves:
            flags = leaf[idx]
            flags = flags if flags.dtype == torch.bool else flags != 0
            out = flags if out is None else out | flags
        return out.cpu().numpy()

    def _fr_sync(self, storage: Any) -> TrajectoryIndex:
        """Bring the index up to date with ``storage``.

        ``O(items written since the last call)``, or one ``O(items stored)`` rebuild after
        unreported writes.
        """
        index = self._fr_index
        same_storage = self._fr_storage is not None and self._fr_storage() is storage
        if (
            index is not None
            and same_storage
            and not self._fr_pending_writes
            and not self._fr_dirty
            and mutation_revision(storage, self._fr_revision) == self._fr_revision
        ):
            return index  # nothing written since the last sync: O(1)
        self._fr_attach(storage)
        mode, keys = self._fr_signal_keys(storage)
        leaves = self._fr_leaves(storage, mode, keys)
        rows = int(storage._storage.shape[0])
        spec = (mode, keys, rows, leaves[0].shape[1], leaves[0].device)
        revision = mutation_revision(storage, self._fr_revision + self._fr_pending_writes)
        index, base = self._fr_index, self._fr_revision
        if index is None or spec != self._fr_spec or not same_storage:
            # A storage is created at revision 0: a sampler attached from the start has been
            # told about every write since. Otherwise the baseline is unknown: rebuild.
            base = 0 if self._fr_spec is None else None
            index = TrajectoryIndex(rows, leaves[0].shape[1], mode)
        incremental = (
            not self._fr_dirty
            and base is not None
            and revision == base + self._fr_pending_writes
            and sum(n for _, n in self._fr_pending) < rows
        )
        try:
            if incremental:
                try:
                    for first, n in self._fr_pending:
                        self._fr_write_run(index, leaves, first, n, rows)
                except ValueError:  # a run did not follow the cursor: not a round-robin write
                    incremental = False
            if not (incremental and self._fr_matches(index, storage)):
                self._fr_rebuild(index, storage, leaves, rows)
        except BaseException:
            self._fr_index, self._fr_dirty = None, True
            raise
        self._fr_index, self._fr_spec, self._fr_revision = index, spec, revision
        self._fr_storage = weakref.ref(storage)
        self._fr_pending, self._fr_pending_writes, self._fr_dirty = [], 0, False
        return index

    def _fr_last_row(self, storage: Any) -> int | None:
        """Last written row of a full storage, or ``None`` (then: the last row).

        The storage records it on every write, but a checkpoint does not carry it: after
        ``load_state_dict``/``loads`` the round-robin writer's restored cursor says where the
        newest item is (TorchRL then treats the end of the storage as the newest item).
        """
        cursor = last_cursor_row(storage)
        if cursor is not None and not self._fr_loaded:
            return cursor
        rows = int(storage._storage.shape[0])
        writers = {
            int(writer._cursor)
            for buffer in getattr(storage, "_attached_entities", ())
            for writer in (getattr(buffer, "_writer", None),)
            if isinstance(writer, RoundRobinWriter)
        }
        if len(writers) == 1:
            return (writers.pop() - 1) % rows
        return cursor

    def _fr_matches(self, index: TrajectoryIndex, storage: Any) -> bool:
        full = bool(storage._is_full)
        if full != (index.size == index.rows) or index.size != (storage._len_along_dim0 or 0):
            return False
        cursor = self._fr_last_row(storage) if full else None
        return not full or cursor is None or cursor == index.cursor

    def _fr_write_run(
        self, index: TrajectoryIndex, leaves: list[torch.Tensor], first: int, n: int, rows: int
    ) -> None:
        """Index ``n`` rows written from row ``first`` (wrapping), reading them in chunks."""
        for offset in range(0, n, _READ_CHUNK):
            row = (first + offset) % rows
            chunk = self._fr_read(leaves, row, min(_READ_CHUNK, n - offset), rows, index.mode)
            index.write(row, chunk)

    def _fr_rebuild(
        self, index: TrajectoryIndex, storage: Any, leaves: list[torch.Tensor], rows: int
    ) -> None:
        index.reset()
        first = 0
        if storage._is_full:
            cursor = self._fr_last_row(storage)
            first = (cursor + 1) % rows if cursor is not None else 0
        self._fr_write_run(index, leaves, first, storage._len_along_dim0 or 0, rows)

    # ------------------------------------------------------------------------ sampling
    def _fr_batch(self, batch_size: int) -> tuple[int, int]:
        """``(seq_length, num_slices)`` from the current ``num_slices``/``slice_len``.

        Read at each call, as TorchRL does (``num_slices`` wins when both are set); a value
        assigned since construction is checked here as the constructor checks it.
        """
        if self.num_slices is not None:
            name = "num_slices"
        elif self.slice_len is not None:
            name = "slice_len"
        else:
            raise TypeError(
                "Either num_slices or slice_len must be set, got num_slices=None and "
                "slice_len=None; assign one of them (e.g. sampler.num_slices = 4)."
            )
        size = int(_check_count(name, getattr(self, name)))
        if batch_size % size:
            raise SliceSamplerError(
                f"batch_size={batch_size} is not divisible by {name}={size}; pass a batch "
                f"size that is a multiple of {size} (e.g. {max(1, batch_size // size) * size})."
            )
        if name == "num_slices":
            return batch_size // size, size
        return size, batch_size // size

    def _get_stop_and_length(self, storage: Any, fallback: bool = True) -> tuple:
        if not self._fr_fast(storage) or len(storage) == 0:
            return super()._get_stop_and_length(storage, fallback)
        index = self._fr_sync(storage)
        device = self._fr_spec[-1]
        start, stop, length, col = (torch.from_numpy(a) for a in index.boundaries())
        return (
            self._fr_with_coords(storage, start, col).to(device),
            self._fr_with_coords(storage, stop, col).to(device),
            length.to(device),
        )

    @classmethod
    def _fr_with_coords(cls, storage: Any, rows: torch.Tensor, col: torch.Tensor) -> torch.Tensor:
        """``[n, storage.ndim]`` indices: the time row, then the column's coordinates."""
        if storage.ndim == 1:
            return rows[:, None]
        return torch.cat([rows[:, None], cls._fr_coords(storage, col)], 1)

    @staticmethod
    def _fr_coords(storage: Any, col: torch.Tensor) -> torch.Tensor:
        shape = tuple(storage._storage.shape[1 : storage.ndim])
        coords = torch.empty((col.shape[0], len(shape)), dtype=torch.long)
        for d in range(len(shape) - 1, -1, -1):
            coords[:, d] = col % shape[d]
            col = col // shape[d]
        return coords

    def _get_index(
        self,
        lengths: torch.Tensor,
        start_idx: torch.Tensor,
        stop_idx: torch.Tensor,
        seq_length: int | torch.Tensor,
        num_slices: int,
        storage_length: int,
        traj_idx: torch.Tensor | None = None,
        *,
        target_seq_length: int | None = None,
        storage: Any,
    ) -> tuple[Any, dict]:
        """TorchRL's slice indices, in fewer tensor ops for the common case: ``O(batch)``.

        Slices of one length (``int``) in a 1-D storage without ``span``: the same random draw
        (one ``torch.rand`` of ``num_slices``) and the same index, bit for bit; TorchRL's code
        handles every other case.
        """
        if (
            self.span[0]
            or self.span[1]
            or not isinstance(seq_length, int)
            or target_seq_length is not None
            or traj_idx is None
            or start_idx.ndim != 2
            or start_idx.shape[1] != 1
        ):
            return super()._get_index(
                lengths,
                start_idx,
                stop_idx,
                seq_length,
                num_slices,
                storage_length,
                traj_idx,
                target_seq_length=target_seq_length,
                storage=storage,
            )
        draw = torch.rand(num_slices, device=lengths.device, generator=self._rng)
        relative = (draw * (lengths[traj_idx] - seq_length + 1)).floor().to(start_idx.dtype)
        steps = torch.arange(seq_length, device=start_idx.device, dtype=start_idx.dtype)
        index = (start_idx[traj_idx, 0] + relative)[:, None] + steps
        return self._finalize_index(
            index=index.reshape(-1, 1) % storage_length,
            num_slices=num_slices,
            seq_length=seq_length,
            target_seq_length=None,
            mask_flat=None,
            storage=storage,
        )

    def _finalize_index(self, *, storage: Any, **kwargs: Any) -> tuple[Any, dict]:
        """TorchRL's, reading only the keys it needs at the sampled rows (:class:`_SignalRows`).

        Same index and info, bit for bit; TorchRL gathers the whole sample here first.
        """
        if (
            isinstance(storage, TensorStorage)
            and getattr(storage, "initialized", False)
            and is_tensor_collection(getattr(storage, "_storage", None))
        ):
            storage = _SignalRows(storage)
        return super()._finalize_index(storage=storage, **kwargs)

    def sample(self, storage: Any, batch_size: int) -> tuple[Any, dict]:
        """Sample ``batch_size`` steps as slices: ``O(batch)`` after the incremental update."""
        if not self._fr_fast(storage):
            return super().sample(storage, batch_size)
        if self._batch_size_multiplier is not None:
            batch_size = batch_size * self._batch_size_multiplier
        seq_length, num_slices = self._fr_batch(batch_size)
        if len(storage) == 0:
            raise SliceSamplerError(
                "Cannot sample from an empty storage: extend the replay buffer first."
            )
        index = self._fr_sync(storage)
        device = self._fr_spec[-1]
        n_all = int(index.counts(1).sum())
        n_long = int(index.counts(seq_length).sum())
        any_short = n_long < n_all
        if self.strict_length and not n_long:
            lengths = index.boundaries()[2]
            raise SliceSamplerError(
                f"No trajectory is at least {seq_length} steps long (stored lengths "
                f"{int(lengths.min())} to {int(lengths.max())}) with strict_length=True; "
                "sample shorter slices or pass strict_length=False."
            )
        min_length = seq_length if (self.strict_length and any_short) else 1
        ranks = torch.randint(
            n_long if min_length > 1 else n_all,
            (num_slices,),
            generator=self._rng,
            device=device,  # TorchRL draws on the storage's device: same numbers
        )
        start, length, col = (
            torch.from_numpy(a) for a in index.select(ranks.cpu().numpy(), min_length)
        )
        start_idx = self._fr_with_coords(storage, start, col).to(device)
        length = length.to(device)
        target = None
        seq: int | torch.Tensor = seq_length
        if any_short and not self.strict_length:
            seq = length.clamp_max(seq_length)
            target = seq_length if pads_short_slices(self) else None
        result = self._get_index(
            lengths=length,
            start_idx=start_idx,
            stop_idx=start_idx,
            seq_length=seq,
            num_slices=num_slices,
            storage_length=storage.shape[0],
            traj_idx=torch.arange(num_slices, device=device),
            target_seq_length=target,
            storage=storage,
        )
        self._warn_if_short_batch(result[0], batch_size)  # as TorchRL's ``sample`` (nightly)
        return result

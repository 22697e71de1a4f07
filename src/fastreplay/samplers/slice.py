"""``SliceSampler``: TorchRL's slice sampler with an incrementally maintained boundary index."""

from __future__ import annotations

import inspect
import operator
from typing import Any

import numpy as np
import torch
from tensordict import is_tensor_collection
from tensordict.utils import NestedKey

from fastreplay._core.slice_index import slice_index
from fastreplay._core.trajectory_index import TrajectoryIndex
from fastreplay._signature import constructor_signature
from fastreplay._torchrl import (
    _REPLACEMENT_DISPATCH,
    HAS_CAN_SAMPLE,
    SLICE_ATTRIBUTE_DEFAULTS,
    STATIC_BOUNDARIES,
    TensorStorage,
    adjusted_batch_size,
    batch_size_multiplier,
    finalize_index,
    init_marker_key,
    is_batch_time,
    pads_short_slices,
    sampler_generator,
    storage_full,
    storage_len,
    storage_rows,
    take,
    truncation_flags,
    warn_if_short_batch,
)
from fastreplay._torchrl import TorchRLSliceSampler as _TorchRLSliceSampler
from fastreplay.errors import MissingKeyError, SignalTypeError, SliceSamplerError
from fastreplay.samplers._index_sync import IndexSync

__all__ = [
    "MissingKeyError",
    "SignalTypeError",
    "SliceSampler",
    "SliceSamplerError",
    "without_replacement_class",
]


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
        if not storage_full(storage):  # as TensorStorage.get: the stored rows only
            leaf = leaf[: storage_rows(storage)]
        return leaf[self.index]


def without_replacement_class() -> type:
    """The class that ``SliceSampler(replacement=False, ...)`` builds, with the same arguments.

    TorchRL's sampler metaclass makes this choice from its replacement table
    (``_REPLACEMENT_DISPATCH``), where :mod:`fastreplay.samplers.slice_without_replacement`
    registers that class when it is imported (importing any part of fastreplay imports it), so
    this module does not import it. That class also accepts ``replacement=False`` itself (a
    no-op), as TorchRL's classes do: the metaclass finds it among the table's values.

    Returns:
        ``fastreplay.SliceSamplerWithoutReplacement``.
    """
    return _REPLACEMENT_DISPATCH[SliceSampler]


_REPLACEMENT = inspect.Parameter(
    "replacement", inspect.Parameter.KEYWORD_ONLY, default=True, annotation="bool"
)


class _ReplacementSignature:
    """``cls(...)``'s arguments: ``replacement``, then the ``__init__`` chain's. O(MRO length).

    TorchRL's sampler metaclass takes ``replacement`` (``False`` builds
    :func:`without_replacement_class`) and hides ``__init__`` from :func:`inspect.signature`
    (``*args, **kwargs``). A subclass whose body sets its own ``__signature__`` uses that one.
    ``None`` on an instance, as :class:`fastreplay._signature.ConstructorSignature`.
    """

    def __get__(self, instance: Any, owner: type) -> inspect.Signature | None:
        if instance is not None:
            return None
        signature = constructor_signature(owner, extra=[_REPLACEMENT])
        params = sorted(
            signature.parameters.values(), key=lambda p: (p.kind, p.name != "replacement")
        )
        return signature.replace(parameters=params)


def newest_attributes(cls: type) -> type:
    """Give ``cls`` the newest ``SliceSampler``'s attributes the installed TorchRL lacks.

    :data:`fastreplay._torchrl.SLICE_ATTRIBUTE_DEFAULTS` (``fragmented``, ``init_key``,
    ``output_layout``... with the behaviour of the versions without them), as class
    attributes, except where ``cls`` already defines the name (``end_keys``, a boundary key,
    reads its default there). A class decorator; O(attributes).
    """
    for name, value in SLICE_ATTRIBUTE_DEFAULTS.items():
        if name not in vars(cls):
            setattr(cls, name, value)
    return cls


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
        for klass in owner.__mro__:  # a class default (TorchRL's, or a subclass's)
            default = vars(klass).get(self.name, self)
            if not isinstance(default, _BoundaryKey):
                return default
        if self.name in SLICE_ATTRIBUTE_DEFAULTS:  # a TorchRL version without the argument
            return SLICE_ATTRIBUTE_DEFAULTS[self.name]
        raise AttributeError(self.name)

    def __set__(self, instance: Any, value: Any) -> None:
        state = instance.__dict__
        if self.name in state and not _same_key(state[self.name], value):
            sync = state.get("_fr_sync")
            if sync is not None:
                sync.invalidate()
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


# ------------------------------------------------------------------ the trajectory index's parts
# A slice sampler's use of its :class:`IndexSync` (``_fr_sync``), as functions: methods of
# :class:`SliceSampler` and of ``PrioritizedSliceSampler``, which is no subclass of it.


def trajectory_index(sampler: Any) -> TrajectoryIndex | None:
    """The trajectory index (``None`` until the first ``sample``), for inspection."""
    return sampler._fr_sync.index


def invalidate_boundaries(sampler: Any) -> None:
    """Rebuild the trajectory boundaries from the storage at the next ``sample``.

    Call it after editing stored done flags or trajectory ids in a way that moves no
    version counter of this process: through ``tensor.data`` or a NumPy view, in place
    by another process (shared memory, a memory map), or through a memory map opened
    separately. Everything else is seen without a call, whatever writes come after it:
    writes through the replay buffer or the storage (``extend``, ``add``,
    ``rb[idx] = ...``), in-place edits through a view (``storage[:][key][i] = ...``) and
    writes that raise part way (the version counters of the flag or id tensors moved by
    more than the writes the sampler was told about).
    The rebuild costs one ``O(items stored)`` read of the boundary keys.
    """
    sampler._fr_sync.invalidate()


def serves_storage(sampler: Any, storage: Any) -> bool:
    """Whether the index serves ``storage`` (else TorchRL's own code path does). O(1)."""
    if sampler.fragmented or sampler.use_gpu or STATIC_BOUNDARIES in sampler._cache:
        return False
    if not isinstance(storage, TensorStorage):
        return False  # ListStorage, LazyStackStorage, ...: TorchRL's path and errors
    IndexSync.attach(storage)
    data = getattr(storage, "_storage", None)
    return data is None or is_tensor_collection(data)


def slice_counts(sampler: Any, batch_size: int) -> tuple[int, int]:
    """``(seq_length, num_slices)`` from the current ``num_slices``/``slice_len``. O(1).

    Read at each call, as TorchRL does (``num_slices`` wins when both are set); a value
    assigned since construction is checked here as the constructor checks it.
    """
    if sampler.num_slices is not None:
        name = "num_slices"
    elif sampler.slice_len is not None:
        name = "slice_len"
    else:
        raise TypeError(
            "Either num_slices or slice_len must be set, got num_slices=None and "
            "slice_len=None; assign one of them (e.g. sampler.num_slices = 4)."
        )
    size = int(_check_count(name, getattr(sampler, name)))
    if batch_size % size:
        raise SliceSamplerError(
            f"batch_size={batch_size} is not divisible by {name}={size}; pass a batch "
            f"size that is a multiple of {size} (e.g. {max(1, batch_size // size) * size})."
        )
    if name == "num_slices":
        return batch_size // size, size
    return size, batch_size // size


def index_boundaries(sampler: Any, storage: Any) -> tuple[torch.Tensor, ...]:
    """``(start, stop, length)`` of the stored trajectories in TorchRL's format, from the index.

    ``O(trajectories)`` after the incremental update.
    """
    sync = sampler._fr_sync
    start, stop, length, col = sync.sync(storage, sampler).boundaries()
    device = sync.device
    return (
        sync.with_coords(storage, start, col).to(device),
        sync.with_coords(storage, stop, col).to(device),
        torch.from_numpy(length).to(device),
    )


def index_can_sample(sampler: Any, storage: Any, batch_size: int) -> bool:
    """Whether a slice of ``batch_size``'s length fits, as TorchRL decides it.

    TorchRL counts the slice windows of every stored trajectory (``O(items stored)`` after a
    write, at every ``sample(wait=True)``, ``wait_until_sampleable`` and
    ``RateLimitedReplayBuffer`` check). A window exists when some trajectory is at least that
    long (``strict_length=True``) or any trajectory is stored: the index keeps those counts, so
    this is ``O(columns)`` after the incremental update.
    """
    seq_length, _ = adjusted_batch_size(sampler, batch_size)  # TorchRL's errors
    try:
        index = sampler._fr_sync.sync(storage, sampler)
    except (KeyError, RuntimeError):  # as TorchRL: no boundaries, nothing to sample
        return False
    return bool(index.counts(seq_length if sampler.strict_length else 1).sum() > 0)


def index_sampleable_count(sampler: Any, storage: Any, batch_size: int) -> Any:
    """How many slices of ``batch_size``'s length can start, as TorchRL counts them.

    TorchRL sums ``max(0, L - slice_len + 1)`` over every stored trajectory length ``L``
    (``strict_length=False``: at least 1 per trajectory), after reading all boundaries;
    ``SamplerEnsemble`` weighs its members by it. The index keeps the lengths of the
    trajectories long enough summed, so this is ``O(columns)`` after the incremental update.
    Returns an int64 tensor, as TorchRL's.
    """
    seq_length, _ = adjusted_batch_size(sampler, batch_size)  # TorchRL's errors
    try:
        index = sampler._fr_sync.sync(storage, sampler)
    except (KeyError, RuntimeError):  # as TorchRL: no boundaries, nothing to sample
        return 0
    count = int(index.windows(seq_length).sum())
    if not sampler.strict_length:  # shorter trajectories give one (short) slice each
        count += int(index.counts(1).sum() - index.counts(seq_length).sum())
    return torch.tensor(count, device=sampler._fr_sync.device)


@newest_attributes
class SliceSampler(_TorchRLSliceSampler):
    """Drop-in ``torchrl.data.SliceSampler`` whose trajectory boundaries are kept up to date.

    Same constructor arguments and same outputs (index format, ``truncated``/``done``/
    ``terminated`` info, ``is_init`` markers, ``strict_length``, ``span``, ``pad_output``) as
    TorchRL's class. The same seed gives bit-identical samples. TorchRL rescans the whole storage
    at the first ``sample`` after every write; this class updates a trajectory index from the
    rows each write reports through TorchRL's write hook (``mark_update``, which the writer
    calls through every buffer attached to the storage, so a write through another buffer
    sharing the storage is reported too):

    * a write of ``n`` items costs ``O(n)``, not ``O(items stored)``;
    * ``sample`` costs ``O(batch)``, independent of capacity and of the number of trajectories;
    * the index holds ``O(number of trajectories)`` integers.

    Writes through the storage that the sampler was not told about (``rb[idx] = ...``,
    ``storage.set``, another process, ``empty()``, ``loads``, ``load_state_dict``; a
    ``sampler.extend(index)`` called by hand reports nothing) change the storage's
    mutation revision; the index is then rebuilt from the storage once (``O(items stored)``),
    never served stale. In-place edits of stored done flags or trajectory ids through a view
    (``storage[:][key][i] = ...``) bypass the storage but move the version counter torch keeps
    for the tensor: the index compares those counters with the writes it was told about at
    every ``sample`` (``O(boundary keys)``) and rebuilds once when they moved by anything
    else, whatever writes came after the edit. **Edits that move no version counter of this
    process** (through ``tensor.data`` or a NumPy view, in place by another process, to a
    memory map opened separately) cannot be seen without a full scan: call
    :meth:`invalidate_boundaries` after them.

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

    __signature__ = _ReplacementSignature()
    end_key = _BoundaryKey()
    end_keys = _BoundaryKey()
    traj_key = _BoundaryKey()
    num_slices: int | None  # set by TorchRL's __init__, checked by ours
    slice_len: int | None

    def __init__(self, **kwargs: Any) -> None:
        """Build the sampler; arguments as in the installed ``torchrl.data.SliceSampler``.

        Every keyword goes to TorchRL's constructor, so each TorchRL version's arguments are
        accepted (and shown by ``inspect.signature``) as they are.

        ``replacement=False`` builds :func:`without_replacement_class` instead (TorchRL's
        metaclass reads it before ``__init__`` runs); ``True``, the default, builds this class.

        Raises:
            TypeError: ``num_slices``/``slice_len`` is not an integer (and TorchRL's own
                errors for exclusive, missing or unknown arguments).
            SliceSamplerError: ``num_slices``/``slice_len`` is below 1 (a ``ValueError``).
        """
        # TorchRL accepts fragmented=True only where ``sample`` is its own class's: this
        # class's ``sample`` serves it with TorchRL's code. Elsewhere (a subclass with its own
        # ``sample``) the argument goes on to TorchRL, which raises its own error.
        fragmented = bool(kwargs.get("fragmented", False)) and (
            type(self).sample is SliceSampler.sample
        )
        if fragmented:
            _TorchRLSliceSampler(**kwargs)  # TorchRL's other checks, errors and messages
            kwargs["fragmented"] = False  # the flag is read at sample time only
        super().__init__(**kwargs)
        if fragmented:
            self.fragmented = True
        self.num_slices = _check_count("num_slices", self.num_slices)
        self.slice_len = _check_count("slice_len", self.slice_len)
        self._fr_sync = IndexSync()  # storage -> trajectory index

    # The trajectory index's parts, shared with ``PrioritizedSliceSampler`` (functions below).
    _fr_index = property(trajectory_index)
    invalidate_boundaries = invalidate_boundaries
    _fr_indexed = serves_storage
    _fr_batch = slice_counts

    # ----------------------------------------------------------------- write notifications
    def mark_update(self, index: int | torch.Tensor, *, storage: Any = None) -> None:
        """Record the rows a write just wrote (``O(items written)``): TorchRL's write hook.

        TorchRL's writers call it, through every buffer attached to the storage
        (``ReplayBuffer.mark_update``), once per write: writes through another buffer that
        shares the storage are recorded too. ``extend``/``add`` (called by the writing
        buffer only) record nothing: a write is recorded once. TorchRL's own hook runs first.
        """
        super().mark_update(index, storage=storage)
        self._fr_sync.record(index)

    def _empty(self) -> None:
        super()._empty()
        self._fr_sync.invalidate()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load TorchRL's (empty) state; the index is rebuilt at the next sample."""
        super().load_state_dict(state_dict)
        self._fr_sync.invalidate(loaded=True)

    def loads(self, path: Any) -> None:
        """Load from ``path`` as TorchRL does; the index is rebuilt at the next sample."""
        super().loads(path)
        self._fr_sync.invalidate(loaded=True)

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["_fr_sync"] = self._fr_sync.detached()  # a copy rebuilds from its storage
        return state

    # ----------------------------------------------------------------------- the index
    def _get_stop_and_length(self, storage: Any, fallback: bool = True) -> tuple:
        """TorchRL's ``(start, stop, length)`` of the stored trajectories, from the index."""
        if not self._fr_indexed(storage) or storage_len(storage) == 0:
            return super()._get_stop_and_length(storage, fallback)
        return index_boundaries(self, storage)

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
        """TorchRL's slice indices, built by :meth:`_fr_slices` in the common case: ``O(batch)``.

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
        return self._fr_slices(
            storage,
            start_idx[traj_idx, 0].cpu().numpy(),
            lengths[traj_idx].cpu().numpy(),
            seq_length,
            storage_length,
            lengths.device,
        )

    def _fr_slices(
        self,
        storage: Any,
        start: Any,
        length: Any,
        seq: int,
        rows: int,
        device: Any,
        synced: bool = False,
    ) -> tuple[Any, dict]:
        """One random slice of ``seq`` steps in each trajectory ``(start, length)``: ``O(batch)``.

        TorchRL's ``_get_index`` without ``span`` in a 1-D storage: the same draw (one
        ``torch.rand`` per slice, on ``device``) and the same index, built by
        :func:`fastreplay._core.slice_index.slice_index`. The info is ``_finalize_index``'s;
        ``synced`` (the trajectories come from the index, just synced with ``storage``): built
        by :meth:`_fr_info` on a CPU storage, the same values (the flags and markers of the
        sampled steps; the stored done flags not gathered when they are the boundaries).
        """
        draw = torch.rand(start.shape[0], device=device, generator=sampler_generator(self))
        (steps,), heads = slice_index(start, seq, rows, length=length, draw=draw.cpu().numpy())
        if (
            synced
            and torch.device(device).type == "cpu"
            and not is_batch_time(self)
            and isinstance(storage, TensorStorage)
            and is_tensor_collection(getattr(storage, "_storage", None))
        ):
            index = (torch.from_numpy(steps),)
            return index, self._fr_info(index, heads, steps.size, storage)
        return self._finalize_index(
            index=torch.from_numpy(steps)[:, None].to(device),
            num_slices=start.shape[0],
            seq_length=seq,
            target_seq_length=None,
            mask_flat=None,
            storage=storage,
        )

    def _fr_info(self, index: tuple, heads: np.ndarray, steps: int, storage: Any) -> dict[Any, Any]:
        """TorchRL's ``_finalize_index`` info: flags and ``is_init`` markers, same values.

        ``heads``: position of each slice's first step among the ``steps`` sampled steps.
        """
        data = storage._storage
        info: dict[Any, Any] = {}
        if self.truncated_key is not None:
            last = np.zeros((steps, 1), dtype=bool)
            last[heads[1:] - 1] = last[-1] = True
            info.update(
                truncation_flags(
                    self.truncated_key,
                    data,
                    index,
                    torch.from_numpy(last),
                    lambda key, leaf: self._fr_ends_trajectories(key, leaf, index),
                )
            )
        init_key = init_marker_key(self)
        existing = None if init_key is None else data.get(init_key, default=None)
        if existing is not None:
            existing = take(existing, index)
            marker = np.zeros(existing.shape, dtype=bool)
            marker[heads] = True
            info[init_key] = torch.from_numpy(marker).to(existing.device) | existing
        return info

    def _fr_ends_trajectories(self, key: NestedKey, leaf: torch.Tensor, index: tuple) -> bool:
        """Whether every ``True`` in ``leaf`` (stored at ``key``) ends an indexed trajectory.

        Then a slice, which stays inside one trajectory, holds one only on its last step, where
        ``truncated`` is set: ``leaf[index] | truncated`` is ``truncated``, with no gather from
        the storage (a cache miss per slice in a large buffer).
        """
        sync = self._fr_sync
        return (
            sync.mode == "done"
            and key in sync.keys
            and len(index) == 1
            and leaf.dtype == torch.bool
            and leaf.shape[1:] == (1,)
        )

    def _finalize_index(self, *, storage: Any, **kwargs: Any) -> tuple[Any, dict]:
        """TorchRL's, reading only the keys it needs at the sampled rows (:class:`_SignalRows`).

        Same index and info, bit for bit; TorchRL gathers the whole sample here first. On
        TorchRL 0.13, which has no such hook, the end of its ``_get_index``
        (:func:`fastreplay._torchrl.finalize_index`).
        """
        if (
            isinstance(storage, TensorStorage)
            and getattr(storage, "initialized", False)
            and is_tensor_collection(getattr(storage, "_storage", None))
        ):
            storage = _SignalRows(storage)
        return finalize_index(super(), self, storage=storage, **kwargs)

    # The nightly's short flat batch warning (attributed past fastreplay's frames), on every
    # version: a no-op where TorchRL does not warn. TorchRL's own ``sample`` calls it too.
    _warn_if_short_batch = warn_if_short_batch

    def _fr_prepare(self, storage: Any, batch_size: int) -> tuple[int, int, int, Any, int, int]:
        """The common start of a slice ``sample``: sizes, the synced index, trajectory counts.

        Returns ``(batch_size, seq_length, num_slices, index, n_all, n_long)``: the batch size
        times TorchRL's ``_batch_size_multiplier``, the slice length and count, the trajectory
        index brought up to date, and the number of stored trajectories (``n_long``: those at
        least ``seq_length`` steps long). ``O(items written since the last call)``.

        Raises:
            SliceSamplerError: an empty storage, or no trajectory long enough with
                ``strict_length=True``.
        """
        multiplier = batch_size_multiplier(self)
        if multiplier is not None:
            batch_size = batch_size * multiplier
        seq_length, num_slices = self._fr_batch(batch_size)
        if storage_len(storage) == 0:
            raise SliceSamplerError(
                "Cannot sample from an empty storage: extend the replay buffer first."
            )
        index = self._fr_sync.sync(storage, self)
        n_all = int(index.counts(1).sum())
        n_long = int(index.counts(seq_length).sum())
        if self.strict_length and not n_long:
            stored = index.boundaries()[2]
            raise SliceSamplerError(
                f"No trajectory is at least {seq_length} steps long (stored lengths "
                f"{int(stored.min())} to {int(stored.max())}) with strict_length=True; "
                "sample shorter slices or pass strict_length=False."
            )
        return batch_size, seq_length, num_slices, index, n_all, n_long

    if HAS_CAN_SAMPLE:

        def can_sample(self, storage: Any, batch_size: int) -> bool:
            """Whether a slice of ``batch_size``'s length fits, as TorchRL decides it.

            From the index (:func:`index_can_sample`): ``O(columns)`` after the incremental
            update, where TorchRL counts the windows of every stored trajectory.
            """
            if not self._fr_indexed(storage) or storage_len(storage) == 0:
                return super().can_sample(storage, batch_size)
            return index_can_sample(self, storage, batch_size)

        def _sampleable_count(self, storage: Any, batch_size: int) -> Any:
            """How many slices of ``batch_size``'s length can start, as TorchRL counts them.

            From the index (:func:`index_sampleable_count`): ``O(columns)`` after the
            incremental update, where TorchRL reads every boundary. An int64 tensor.
            """
            if not self._fr_indexed(storage) or storage_len(storage) == 0:
                return super()._sampleable_count(storage, batch_size)
            return index_sampleable_count(self, storage, batch_size)

    def sample(self, storage: Any, batch_size: int) -> tuple[Any, dict]:
        """Sample ``batch_size`` steps as slices: ``O(batch)`` after the incremental update."""
        if not self._fr_indexed(storage):
            return super().sample(storage, batch_size)
        batch_size, seq_length, num_slices, index, n_all, n_long = self._fr_prepare(
            storage, batch_size
        )
        sync = self._fr_sync
        device = sync.device
        any_short = n_long < n_all
        min_length = seq_length if (self.strict_length and any_short) else 1
        ranks = torch.randint(
            n_long if min_length > 1 else n_all,
            (num_slices,),
            generator=sampler_generator(self),
            device=device,  # TorchRL draws on the storage's device: same numbers
        )
        start, length, col = index.select(ranks.cpu().numpy(), min_length)
        if storage.ndim == 1 and not (any_short and not self.strict_length) and not any(self.span):
            result = self._fr_slices(
                storage, start, length, seq_length, storage.shape[0], device, synced=True
            )
            self._warn_if_short_batch(result[0], batch_size)  # as TorchRL's ``sample`` (nightly)
            return result
        start_idx = sync.with_coords(storage, start, col).to(device)
        lengths = torch.from_numpy(length).to(device)
        target = None
        seq: int | torch.Tensor = seq_length
        if any_short and not self.strict_length:
            seq = lengths.clamp_max(seq_length)
            target = seq_length if pads_short_slices(self) else None
        result = self._get_index(
            lengths=lengths,
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

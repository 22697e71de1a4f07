"""Direct ``extend`` and ``sample`` for the common TensorDict replay-buffer set-up.

TorchRL's ``extend`` goes through the writer, ``TensorStorage.set`` and
``TensorDict.__setitem__``, and its ``sample`` through ``TensorStorage.get``,
``TensorDict.__getitem__`` and ``TensorDict.set`` for the metadata. Every layer re-checks what
the previous one checked, and with a fast sampler that glue is most of a training step.

:class:`PathChoice` does the same work in one pass for the common case, decided on every
call:

* a 1-D ``TensorStorage`` / ``LazyTensorStorage`` / ``LazyMemmapStorage`` holding a plain
  ``TensorDict`` on CPU or on one accelerator (``LazyTensorStorage(device="cuda")``), written by
  a ``TensorDictRoundRobinWriter`` (no generation tracking);
* no transform, no prefetch, no pinning or ``device``, not shared, not consuming, the default
  collate function, ``dim_extend=0``, a synchronous sampler; no sample unit, or one of
  TorchRL's or fastreplay's ``Transition``/``Sequence``/``SubgoalTriplet`` (expanded after
  the sampler, as TorchRL does, by fastreplay's unit: :mod:`fastreplay.sample_units`);
* ``extend``: a ``TensorDict`` with exactly the stored keys (``index`` aside), feature shapes
  and dtypes, on the storage's device, 1 to ``max_size`` rows;
* ``sample``: any sampler but a consuming one; a 1-D index tensor (or a tuple holding one,
  as slice samplers return) is gathered directly, runs of consecutive rows one run at a
  time; the metadata (``index``, weights, truncation flags) goes straight into the sample.

On an accelerator storage the direct path is a fixed number of kernel launches per call (one
``arange`` and one ``index_copy_`` per leaf to write; the sampler's draw and one
``index_select`` per leaf to read) and reads nothing of the device on the host: the cursor,
length and counters are host integers, the written rows are an ``arange`` on the data's
device, as TorchRL's writer makes them, and TorchRL's ``RandomSampler`` draws on the
storage's device. ``tests/test_device_paths.py`` counts those operations (docs/gpu.md).

Anything else takes TorchRL's path unchanged. The fast path leaves the storage, writer and
sampler in exactly the state TorchRL's path leaves them (cursor, ``write_count``, length,
last cursor, mutation revision, the stored ``index`` column, the sampler's ``mark_update`` /
``extend`` calls and their order, the priority update), and returns the same sample (keys,
dtypes, values, devices, batch size, ``info``). ``tests/conformance/test_whole_step.py``
compares both paths call by call.

What TorchRL's buffer methods do besides moving data (the nightly's readiness notification,
sample counters, dimension names, and the frame its sampler is called from) is done through
:class:`fastreplay._torchrl.Bookkeeping`, at the points where TorchRL does it;
``tests/conformance/test_bookkeeping.py`` traces both paths on every version so that a step a
new TorchRL adds is not skipped unnoticed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase

from fastreplay import sample_units as _units
from fastreplay._torchrl import (
    HAS_SAMPLE_UNITS,
    INT_CLASSES,
    SAMPLE_KEYWORDS,
    STORAGE_HAS_REVISION,
    Bookkeeping,
    TensorStorage,
    TorchRLPrioritizedSampler,
    TorchRLSequence,
    TorchRLSubgoalTriplet,
    TorchRLTransition,
    _storage_index,
    anchored_priority,
    buffer_sampler,
    claim_rows,
    collate_fn,
    plain_buffer,
    plain_storage,
    replay_lock,
    rows_written,
    sample_batch_size,
    storage_len,
    without_transform,
)
from fastreplay.buffers import huge_pages
from fastreplay.buffers import rows as _rows
from fastreplay.buffers.samples import write_info

__all__ = ["PathChoice"]


_ROW_DTYPES = (torch.long, torch.int32)  # what index_select takes (and TorchRL's indexing)


def _run_length(sampler: Any, batch_size: int) -> int | None:
    """The slice length a slice sampler's rows likely come in (checked by the gather)."""
    settings = sampler.__dict__
    length = settings.get("slice_len")
    if length is None:
        slices = settings.get("num_slices")
        length = batch_size // slices if isinstance(slices, int) and slices > 0 else None
    return length if isinstance(length, int) else None


_DIRECT_UNITS: frozenset[type] = frozenset(
    cls
    for cls in (
        TorchRLTransition,
        TorchRLSequence,
        TorchRLSubgoalTriplet,
        getattr(_units, "Sequence", None),
        getattr(_units, "SubgoalTriplet", None),
    )
    if cls is not None
)
"""The sample units the direct path expands with (their ``expand`` is TorchRL's code)."""

_SEQUENCES: frozenset[type] = frozenset(
    cls for cls in (TorchRLSequence, getattr(_units, "Sequence", None)) if cls is not None
)
"""Units whose windows are runs of consecutive rows (``dilation=1``): gathered run by run."""


def written_in_part(buffer: Any) -> None:
    """After a write of ``buffer`` raised: its sampler rereads the storage at the next sample.

    ``rb.extend(td)``, ``rb.add(td)`` and ``rb[idx] = td`` write a TensorDict key by key; one
    that fails on a later key has written the keys before it, and TorchRL counts a write on its
    storage (``_mutation_revision``) only after the data, so the sampler would not know. O(1);
    the sampler's rebuild costs one ``O(items stored)`` read of the boundary keys. The storage's
    write count is left as TorchRL leaves it.
    """
    invalidate = getattr(buffer_sampler(buffer), "invalidate_boundaries", None)
    if invalidate is not None:
        invalidate()
    storage = buffer.__dict__.get("_storage")
    if storage is not None:
        _units.invalidate_writes(storage)


class PathChoice:
    """The one place that chooses, per call, between the direct path and TorchRL's path.

    First in the bases of fastreplay's buffers: ``extend``, ``sample``, ``update_priority``
    and ``update_tensordict_priority`` try the direct path (:meth:`_fr_plain` holds every
    condition, the other parts' included: not shared, not pinned, no ``device``) and
    otherwise call ``super()``, which runs the rest of the bases (pinned samples, shared-buffer
    checks) and TorchRL's buffer. Writes on either path also get what every write gets
    (huge pages after the first, a reread after a failed one). ``_fr_fast = False`` on an
    instance switches the direct path off (tests use it to compare both paths).
    """

    _fr_fast = True

    if HAS_SAMPLE_UNITS:

        @property
        def _sample_unit(self) -> Any:
            """The unit TorchRL's ``_sample`` expands with: fastreplay's twin of TorchRL's.

            The unit passed as ``sample_unit`` is kept as it is (``_fr_sample_unit``); an
            instance of exactly TorchRL's ``Sequence``/``SubgoalTriplet`` is expanded by
            fastreplay's class, sharing its attributes (:func:`fastreplay.sample_units.
            fast_unit`). O(1).
            """
            return _units.fast_unit(self.__dict__.get("_fr_sample_unit"))

        @_sample_unit.setter
        def _sample_unit(self, unit: Any) -> None:
            self.__dict__["_fr_sample_unit"] = unit

    # ------------------------------------------------------------------ common conditions
    def _fr_plain(self, staged: bool = False) -> TensorStorage | None:
        """The storage if the buffer is in the common set-up (both directions), else None.

        ``staged``: the set-up of a sample gathered into pinned memory inside ``_sample``
        (:meth:`PinnedSamples._sample`): pinning, ``device`` and ``prefetch`` are allowed.

        O(1): about twenty attribute checks (TorchRL's parts:
        :func:`~fastreplay._torchrl.plain_storage`), decided afresh on every call (the conformance
        tests switch set-ups between calls). Optional attributes are read from the instance
        dictionaries (a missing attribute through ``getattr`` costs an exception).
        """
        state = self.__dict__
        if not (STORAGE_HAS_REVISION and self._fr_fast):
            return None
        unit = state.get("_fr_sample_unit")
        if (
            (unit is not None and type(unit) not in _DIRECT_UNITS)
            or (not staged and state.get("_fr_pinning", False))
            or (not staged and state.get("_fr_device") is not None)
        ):
            return None
        return plain_storage(self, staged)

    # ------------------------------------------------------------------ writes
    def extend(self, data: Any, *args: Any, **kwargs: Any) -> Any:
        """Extend as TorchRL does; the common set-up writes the rows directly (:meth:`_fr_write`).

        Either way, the write gets what every write gets (:meth:`_fr_written`).
        """
        self._fr_check_priorities(data, kwargs.get("update_priority"))
        return self._fr_written(self._fr_extend, data, *args, **kwargs)

    def _fr_check_priorities(self, data: Any, update_priority: Any) -> None:
        """Refuse, before any row is written, priorities the write's priority update refuses.

        TorchRL writes the rows, then raises ``RuntimeError`` from the priority update; here
        the same error comes first and the buffer is left as it was. Only where the priority
        update reads ``data``'s own entry (no transform in between). O(rows) where ``data``
        holds priorities; O(1) otherwise (an exact ``TensorDict`` is looked up without key
        parsing, before anything else is read).
        """
        if update_priority is False:
            return
        key = getattr(self, "priority_key", None)
        if key is None or key == "index":
            return
        if type(data) is TensorDict:
            vector = _rows.entry(data, key)
        elif isinstance(data, TensorDictBase):
            vector = data.get(key, None)
        else:
            return
        if vector is None:
            return
        check = getattr(buffer_sampler(self), "check_priority", None)
        if check is None or not without_transform(self):
            return
        try:
            check(vector)
        except Exception as e:
            raise RuntimeError(
                "Failed to update priority of extended data. You can try to set "
                "update_priority=False in the extend method and update the priority "
                "manually. Nothing was written."
            ) from e

    def add(self, data: Any) -> Any:
        """Add as TorchRL does (its path), with what every write gets (:meth:`_fr_written`)."""
        return self._fr_written(super().add, data)  # type: ignore[misc]

    def __setitem__(self, index: Any, value: Any) -> None:
        """``rb[index] = value`` as TorchRL does, with what every write gets."""
        self._fr_written(super().__setitem__, index, value)  # type: ignore[misc]

    def _fr_written(self, write: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``write(*args, **kwargs)``, with what every write of the buffer gets.

        The write that creates a lazy storage's tensors also advises huge pages for them
        (:mod:`fastreplay.buffers.huge_pages`); a write that raises part way (a later key of
        the wrong shape) makes the sampler read the storage again (:func:`written_in_part`).
        O(1) on top of ``write``.
        """
        try:
            first = huge_pages.before_first_write(self)
            out = write(*args, **kwargs)
        except BaseException:
            written_in_part(self)
            raise
        if first:
            huge_pages.after_first_write(self)
        return out

    def _fr_extend(self, data: Any, *args: Any, **kwargs: Any) -> Any:
        """The direct write where it applies, else TorchRL's ``extend``."""
        if not args and len(kwargs) <= ("update_priority" in kwargs):
            index = self._fr_fast_extend(data, kwargs.get("update_priority"))
            if index is not None:
                return index
        return super().extend(data, *args, **kwargs)  # type: ignore[misc]

    def _fr_fast_extend(self, data: Any, update_priority: bool | None) -> torch.Tensor | None:
        """TorchRL's ``TensorDictReplayBuffer.extend`` in one pass, or ``None`` (not taken).

        Mirrors ``ReplayBuffer._extend`` -> ``TensorDictRoundRobinWriter.extend`` ->
        ``TensorStorage.set`` -> ``TensorDict.__setitem__``, then the priority update. The
        empty ``Compose`` TorchRL applies first writes ``index`` into a shallow copy of
        ``data``: ``data`` itself is left as it is, as there. O(rows x row size + leaves).
        """
        if (
            self.priority_key == "index"
            or type(self.__dict__.get("_write_lock")) is not contextlib.nullcontext
        ):
            return None  # (a shared buffer's write lock is not re-entrant: decide unlocked)
        with replay_lock(self):  # held while deciding, as while writing
            index = self._fr_write(data)
        if index is None:
            return None
        Bookkeeping.wrote(self)  # as ``ReplayBuffer._extend``, its locks released
        if update_priority is None or update_priority:
            try:
                vector = _rows.entry(data, self.priority_key)
                if vector is not None:
                    self.update_priority(index, vector)
            except Exception as e:
                raise RuntimeError(
                    "Failed to update priority of extended data. You can try to set "
                    "update_priority=False in the extend method and update the priority "
                    "manually."
                ) from e
        return index

    def _fr_write(self, data: Any) -> torch.Tensor | None:
        """Write ``data``'s rows as TorchRL's writer and storage would; ``None``: not done.

        Call under the buffer's locks. Nothing is changed unless the rows are written.
        """
        storage = self._fr_plain()
        if storage is None:
            return None
        plan = _rows.write_plan(storage._storage, data, skip="index")
        if plan is None:
            return None
        pairs, n, index_leaf, device, store_rows = plan
        capacity = storage.max_size
        if (
            not 0 < n <= capacity
            or store_rows != capacity
            or index_leaf.dtype != torch.long
            or index_leaf.shape != (capacity,)
        ):
            return None
        # TorchRL's writer makes the rows on ``data``'s device (the CPU if it has none), and
        # ``write_pairs`` checked that every leaf of ``data`` lies on its stored leaf's device.
        if device is None or device.type == "cpu":
            if not index_leaf.is_cpu:
                return None
            device = None
        elif index_leaf.device != device:
            return None
        # The writer's bookkeeping, then the storage's, in TorchRL's order (``None``: the
        # shared counters they update are not made yet); the rows; the mutation revision, the
        # buffers attached to the storage (their samplers mark the rows), the buffer's sampler.
        index = claim_rows(self, storage, n, capacity, device)
        if index is None:
            return None
        pairs.append((index_leaf, index))
        _rows.write_rows(pairs, index)
        rows_written(self, storage, index)
        return index

    # ------------------------------------------------------------------ priorities
    def update_priority(self, index: Any, priority: Any) -> None:
        """Update priorities as TorchRL does; tensors go straight to the sampler.

        TorchRL's ``ReplayBuffer.update_priority`` with ``priority`` already a tensor and a
        1-D storage: ``torch.as_tensor`` and the ``dim_extend`` transpose are no-ops there.
        """
        if (
            type(priority) is torch.Tensor
            and type(index) is torch.Tensor
            and self._fr_fast
            and plain_buffer(self)
        ):
            with replay_lock(self):
                # read under ``_replay_lock``, as ``with a, b`` reads ``b`` once ``a`` is held
                write_lock = self._write_lock
                sampler = buffer_sampler(self)
                if type(write_lock) is contextlib.nullcontext:  # (its enter/exit: Python calls)
                    sampler.update_priority(index, priority, storage=self._storage)
                else:
                    with write_lock:
                        sampler.update_priority(index, priority, storage=self._storage)
            return
        super().update_priority(index, priority)  # type: ignore[misc]

    def update_tensordict_priority(self, data: Any) -> None:
        """TorchRL's ``update_tensordict_priority``; a plain 1-D sample goes straight on.

        With a prioritized sampler, a 1-D storage, no sample unit, and a floating-point
        priority of one value per sampled row at ``priority_key``, TorchRL's reduction and
        index reshaping return their inputs: the sample's ``index`` and priorities go to
        :meth:`update_priority` directly. With a ``Sequence`` unit, TorchRL's reduction onto
        the anchors (``_anchor_reduced_priority``: the max over each window's valid records,
        ``O(batch)``) goes to :meth:`update_priority` the same way. Anything else is
        TorchRL's method. O(batch) on top of ``update_priority``.
        """
        state = self.__dict__
        if (
            self._fr_fast
            and isinstance(buffer_sampler(self), TorchRLPrioritizedSampler)
            and state.get("_initialized", False)
        ):
            storage = state.get("_storage")
            unit = state.get("_fr_sample_unit")
            if storage is not None and storage.ndim == 1 and unit is None:
                pair = _rows.priority_rows(data, self.priority_key)
                if pair is not None:
                    return self.update_priority(*pair)
            elif (
                storage is not None
                and type(unit) in _SEQUENCES
                and type(data) is TensorDict
                and data.ndim
            ):
                # TorchRL's ``update_tensordict_priority``, its sampler check passed
                anchored = anchored_priority(self, data)
                if anchored is not None:
                    return self.update_priority(*anchored)
        return super().update_tensordict_priority(data)  # type: ignore[misc]

    # ------------------------------------------------------------------ sample
    def sample(
        self,
        batch_size: int | None = None,
        return_info: bool = False,
        include_info: bool | None = None,
        **kwargs: Any,
    ) -> Any:
        """Sample as TorchRL's ``TensorDictReplayBuffer.sample``; the common set-up directly.

        Args:
            batch_size: Size of the batch; defaults to the buffer's ``batch_size``.
            return_info: Whether to return ``(data, info)`` instead of ``data``.
            include_info: Deprecated TorchRL argument (TorchRL's path).
            **kwargs: The installed TorchRL's other ``sample`` keywords (the nightly's
                ``wait``, ``timeout``, ``cancel_event``).
        """
        if include_info is None and kwargs.keys() <= SAMPLE_KEYWORDS:
            fast = self._fr_fast_sample(batch_size, kwargs)
            if fast is not None:
                data, info, written = fast
                Bookkeeping.sampled(self, info["index"])
                if not written:
                    data, _ = write_info(data, info)
                # a new dict, as TorchRL's (it maps ``info`` to the storage device)
                return (data, dict(info)) if return_info else data
        return super().sample(  # type: ignore[misc]
            batch_size, return_info=return_info, include_info=include_info, **kwargs
        )

    def _fr_fast_sample(
        self, batch_size: int | None, waiting: dict[str, Any]
    ) -> tuple[Any, dict, bool] | None:
        """TorchRL's ``sample(batch_size, return_info=True, **waiting)`` in one pass, or ``None``.

        Mirrors the checks of ``ReplayBuffer.sample`` (and its wait, ``waiting`` holding the
        installed TorchRL's ``wait``/``timeout``/``cancel_event``), ``TensorDictReplayBuffer.
        _sample`` -> ``TensorStorage.get`` -> ``TensorDict.__getitem__``, and the metadata
        writes of ``TensorDictReplayBuffer.sample``; TorchRL's bookkeeping is
        :class:`~fastreplay._torchrl.Bookkeeping`'s. Decided before the sampler runs: once
        taken, it does not fall back. O(batch x row size + leaves) on top of the sampler.

        Returns:
            ``(data, info, written)``; ``written``: the metadata is in ``data`` already
            (otherwise the caller writes it, as TorchRL's ``sample`` does).
        """
        storage = self._fr_plain()
        if storage is None or Bookkeeping.warns_from_caller(buffer_sampler(self)):
            return None
        batch_size = sample_batch_size(self, batch_size)
        if batch_size is None:
            return None  # TorchRL's error or warning, or a wait for another buffer
        if waiting:
            Bookkeeping.wait(self, batch_size, **waiting)
            storage = self._fr_plain()  # (the wait let other threads run)
            if storage is None:
                return None
        with replay_lock(self):
            # read under ``_replay_lock``, as ``with a, b`` reads ``b`` once ``a`` is held
            write_lock = self._write_lock
            if type(write_lock) is contextlib.nullcontext:  # (its enter/exit: Python calls)
                return self._fr_locked_sample(storage, batch_size)
            with write_lock:
                return self._fr_locked_sample(storage, batch_size)

    def _fr_locked_sample(
        self, storage: TensorStorage, batch_size: int, alloc: _rows.Alloc | None = None
    ) -> tuple[Any, dict, bool] | None:
        """:meth:`_fr_fast_sample` once the checks passed and the buffer's locks are held.

        ``alloc``: where the gathered leaves go (:func:`~fastreplay.buffers.rows.gather_rows`);
        the metadata is then left to the caller (``written`` is false).
        """
        sampler = buffer_sampler(self)
        plan = _rows.gather_plan(storage._storage)
        if plan is None:
            return None
        index, info = sampler.sample(storage, batch_size)
        unit = self.__dict__.get("_fr_sample_unit")
        run = None
        if unit is not None:  # expanded where TorchRL's ``_sample`` expands
            index, info = _units.fast_unit(unit).expand(index, info, storage)
            if type(unit) in _SEQUENCES and unit.dilation == 1:
                run = unit.burn_in + unit.length + unit.bootstrap  # windows: runs of rows
        else:
            run = _run_length(sampler, batch_size)
        info["index"] = index
        # A 1-D storage is read with a row tensor, or a tuple holding one (slice samplers),
        # on the storage's device (the CPU when the storage TensorDict has none).
        rows = index[0] if type(index) is tuple and len(index) == 1 else index
        length = storage_len(storage)
        device = plan[1]
        if (
            device is not None
            and device.type != "cpu"
            and type(rows) is torch.Tensor
            and rows.is_cpu
        ):
            # host rows (a sampler whose index lives on the CPU) read from an accelerator:
            # one copy to the device, as TorchRL's indexing makes it; the metadata stays
            # where the sampler put it and is moved as TorchRL moves it (``write_info``)
            rows = rows.to(device)
        if not (
            type(rows) is torch.Tensor
            and rows.dtype in _ROW_DTYPES
            and rows.ndim == 1
            and (rows.is_cpu if device is None else _rows.on_device(rows, device))
        ):
            data = self._fr_general_get(storage, index)
            return Bookkeeping.named(sampler, data), info, False
        extra = info
        if alloc is not None:
            extra = None
        elif type(index) is tuple:  # as TensorDictReplayBuffer.sample writes it: stacked
            extra = {**info, "index": torch.stack(index, -1)}
        data, written = _rows.gather_rows(plan, rows, length, extra, run, alloc)
        return Bookkeeping.named(sampler, data), info, written and alloc is None

    def _fr_general_get(self, storage: TensorStorage, index: Any) -> Any:
        """TorchRL's read, for a sampler result the direct gather does not cover."""
        data = storage.get(_storage_index(index, storage))
        if not isinstance(index, INT_CLASSES):
            data = collate_fn(self)(data)
        return data

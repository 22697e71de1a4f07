"""``SliceSampler``: TorchRL's slice sampler with an incrementally maintained boundary index."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from tensordict import is_tensor_collection
from torchrl.data.replay_buffers.samplers import SliceSampler as _TorchRLSliceSampler

from fastreplay._trajectory_index import TrajectoryIndex

__all__ = ["SliceSampler"]

_READ_CHUNK = 1 << 24  # rows read at once when rebuilding from the whole storage


class _KeyProbe:
    """``key in probe``: O(1) membership test on a TensorDict; lists the keys for messages."""

    def __init__(self, data: Any) -> None:
        self.data = data

    def __contains__(self, key: Any) -> bool:
        return self.data.get(key, default=None) is not None

    def __iter__(self) -> Any:
        return iter(self.data.keys(include_nested=True, leaves_only=True))


class MissingKeyError(KeyError):
    """A boundary key is missing from the storage (``str`` shows the message unquoted)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class SliceSamplerError(ValueError, RuntimeError):
    """Bad sampling request; a ``ValueError`` that TorchRL-style ``RuntimeError`` handlers catch."""


class SliceSampler(_TorchRLSliceSampler):
    """Drop-in ``torchrl.data.SliceSampler`` whose trajectory boundaries are kept up to date.

    Same constructor arguments and same outputs (index format, ``truncated``/``done``/
    ``terminated`` info, ``is_init`` markers, ``strict_length``, ``span``, ``pad_output``) as
    TorchRL's class. The same seed gives bit-identical samples. TorchRL rescans the whole storage
    at the first ``sample`` after every write; this class updates a trajectory index from the
    rows each ``extend``/``add`` reports:

    * a write of ``n`` items costs ``O(n)``, not ``O(items stored)``;
    * ``sample`` costs ``O(batch)``, independent of capacity and of the number of trajectories;
    * the index holds ``O(number of trajectories)`` integers.

    Writes the sampler was not told about (``rb[idx] = ...``, another writer or process,
    ``empty()``, ``loads``, ``load_state_dict``) change the storage's mutation revision; the
    index is then rebuilt from the storage once (``O(items stored)``), never served stale.

    ``fragmented=True``, the static ``ends``/``trajectories`` arguments and ``use_gpu`` keep
    TorchRL's own code path.

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
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._fr_index: TrajectoryIndex | None = None
        self._fr_spec: tuple | None = None
        self._fr_revision = 0
        self._fr_pending: list[list[int]] = []  # [first_row, n_rows] runs not yet indexed
        self._fr_pending_writes = 0
        self._fr_dirty = False

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
        if self._fr_dirty:
            return
        rows = torch.as_tensor(index).reshape(-1) if not torch.is_tensor(index) else index
        if rows.ndim == 2:  # [n * columns, ndim] for ndim > 1 storages: keep the time rows
            rows = torch.unique_consecutive(rows[:, 0])
        rows = rows.reshape(-1)
        if not rows.numel():
            return
        step = rows[1:] - rows[:-1]
        sequential = (step == 1) | ((rows[1:] == 0) & (step < 0))
        if int((step < 0).sum()) > 1 or not bool(sequential.all()):
            self._fr_dirty = True  # not a round-robin write: rebuild at the next sample
            return
        first, n = int(rows[0]), rows.numel()
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
        self._fr_dirty = True

    def loads(self, path: Any) -> None:
        """Load from ``path`` as TorchRL does; the index is rebuilt at the next sample."""
        super().loads(path)
        self._fr_dirty = True

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state.update(_fr_index=None, _fr_spec=None, _fr_pending=[], _fr_dirty=True)
        return state

    # ----------------------------------------------------------------------- the index
    def _fr_fast(self) -> bool:
        return not (self.fragmented or self.use_gpu or "static-stop-and-length" in self._cache)

    def _fr_signal_keys(self, storage: Any) -> tuple[str, tuple]:
        """(mode, keys) as TorchRL resolves them, including its traj_key -> end_key fallback."""
        data = getattr(storage, "_storage", None)
        if not is_tensor_collection(data):
            raise TypeError(
                f"SliceSampler needs a TensorDict storage (LazyTensorStorage, LazyMemmapStorage), "
                f"got storage={type(storage).__name__}; store TensorDicts in a TensorStorage."
            )
        if getattr(self, "_traj_key_auto", False):
            self._resolve_traj_key(storage)
        keys = _KeyProbe(data)
        if self._fetch_traj:
            if self._used_traj_key in keys:
                return "ids", (self._used_traj_key,)
            end_keys = self.end_keys or (self.end_key,)
            if any(k in keys for k in end_keys):
                self._fetch_traj = False  # TorchRL falls back to end_key the same way
                return "done", tuple(k for k in end_keys if k in keys)
            raise MissingKeyError(
                f"traj_key={self._used_traj_key!r} is not in the storage (keys: "
                f"{sorted(map(str, keys))}), nor is end_key={self.end_key!r}; pass the key "
                "that holds trajectory ids (traj_key=...) or done flags (end_key=...)."
            )
        end_keys = self.end_keys or (self.end_key,)
        present = tuple(k for k in end_keys if k in keys)
        if not present:
            name = "end_keys" if self.end_keys else "end_key"
            raise MissingKeyError(
                f"{name}={self.end_keys or self.end_key!r} is not in the storage (keys: "
                f"{sorted(map(str, keys))}); pass the key holding done flags ({name}=...) or "
                "trajectory ids (traj_key=...)."
            )
        return "done", present

    def _fr_leaves(self, storage: Any, mode: str, keys: tuple) -> list[torch.Tensor]:
        """The full signal tensors, validated (dtype, shape) before any state changes."""
        data, ndim = storage._storage, storage.ndim
        shape = tuple(data.shape[:ndim])
        leaves = []
        for key in keys:
            leaf = data.get(key)
            if mode == "done" and leaf.dtype != torch.bool:
                raise TypeError(
                    f"end_key={key!r} holds {leaf.dtype} values; SliceSampler needs boolean "
                    f"done flags: store them as torch.bool (e.g. done.bool())."
                )
            if mode == "ids" and (leaf.dtype == torch.bool or leaf.is_floating_point()):
                raise TypeError(
                    f"traj_key={key!r} holds {leaf.dtype} values; trajectory ids must be "
                    "integers: store them as torch.int64."
                )
            if tuple(leaf.shape) not in (shape, (*shape, 1)):
                raise ValueError(
                    f"{'end_key' if mode == 'done' else 'traj_key'}={key!r} has shape "
                    f"{tuple(leaf.shape)}; expected {shape} or {(*shape, 1)} (one value per "
                    "stored step): store one flag or id per step."
                )
            leaves.append(leaf.reshape(leaf.shape[0], -1))
        return leaves

    def _fr_read(self, leaves: list[torch.Tensor], first: int, n: int, rows: int) -> np.ndarray:
        idx = (first + torch.arange(n)) % rows if first + n > rows else slice(first, first + n)
        out = leaves[0][idx]
        for leaf in leaves[1:]:
            out = out | leaf[idx]
        return out.numpy()

    def _fr_sync(self, storage: Any) -> TrajectoryIndex:
        """Bring the index up to date with ``storage``.

        ``O(items written since the last call)``, or one ``O(items stored)`` rebuild after
        unreported writes.
        """
        index = self._fr_index
        if (
            index is not None
            and not self._fr_pending_writes
            and not self._fr_dirty
            and self._fr_spec[0] == id(storage)
            and storage._mutation_revision == self._fr_revision
        ):
            return index  # nothing written since the last sync: O(1)
        mode, keys = self._fr_signal_keys(storage)
        leaves = self._fr_leaves(storage, mode, keys)
        rows = int(storage._storage.shape[0])
        spec = (id(storage), mode, keys, rows, leaves[0].shape[1])
        revision = storage._mutation_revision
        index, base = self._fr_index, self._fr_revision
        if index is None or spec != self._fr_spec:
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
        self._fr_pending, self._fr_pending_writes, self._fr_dirty = [], 0, False
        return index

    @staticmethod
    def _fr_matches(index: TrajectoryIndex, storage: Any) -> bool:
        full = bool(storage._is_full)
        if full != (index.size == index.rows) or index.size != (storage._len_along_dim0 or 0):
            return False
        cursor = storage._last_cursor_index
        return not full or cursor is None or cursor == index.cursor

    def _fr_write_run(
        self, index: TrajectoryIndex, leaves: list[torch.Tensor], first: int, n: int, rows: int
    ) -> None:
        """Index ``n`` rows written from row ``first`` (wrapping), reading them in chunks."""
        for offset in range(0, n, _READ_CHUNK):
            row = (first + offset) % rows
            index.write(row, self._fr_read(leaves, row, min(_READ_CHUNK, n - offset), rows))

    def _fr_rebuild(
        self, index: TrajectoryIndex, storage: Any, leaves: list[torch.Tensor], rows: int
    ) -> None:
        index.reset()
        first = 0
        if storage._is_full:
            cursor = storage._last_cursor_index
            first = (cursor + 1) % rows if cursor is not None else 0
        self._fr_write_run(index, leaves, first, storage._len_along_dim0 or 0, rows)

    # ------------------------------------------------------------------------ sampling
    def _fr_batch(self, batch_size: int) -> tuple[int, int]:
        if self.num_slices:
            size, name = self.num_slices, "num_slices"
        else:
            size, name = self.slice_len, "slice_len"
        if batch_size % size:
            raise SliceSamplerError(
                f"batch_size={batch_size} is not divisible by {name}={size}; pass a batch "
                f"size that is a multiple of {size} (e.g. {max(1, batch_size // size) * size})."
            )
        return self._adjusted_batch_size(batch_size)

    def _get_stop_and_length(self, storage: Any, fallback: bool = True) -> tuple:
        if not self._fr_fast():
            return super()._get_stop_and_length(storage, fallback)
        index = self._fr_sync(storage)
        start, stop, length, col = (torch.from_numpy(a) for a in index.boundaries())
        return (
            self._fr_with_coords(storage, start, col),
            self._fr_with_coords(storage, stop, col),
            length,
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

    def sample(self, storage: Any, batch_size: int) -> tuple[Any, dict]:
        """Sample ``batch_size`` steps as slices: ``O(batch)`` after the incremental update."""
        if not self._fr_fast():
            return super().sample(storage, batch_size)
        if self._batch_size_multiplier is not None:
            batch_size = batch_size * self._batch_size_multiplier
        seq_length, num_slices = self._fr_batch(batch_size)
        if len(storage) == 0:
            raise SliceSamplerError(
                "Cannot sample from an empty storage: extend the replay buffer first."
            )
        index = self._fr_sync(storage)
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
            n_long if min_length > 1 else n_all, (num_slices,), generator=self._rng
        )
        start, length, col = (torch.from_numpy(a) for a in index.select(ranks.numpy(), min_length))
        start_idx = self._fr_with_coords(storage, start, col)
        target = None
        seq: int | torch.Tensor = seq_length
        if any_short and not self.strict_length:
            seq = length.clamp_max(seq_length)
            target = seq_length if self.pad_output else None
        return self._get_index(
            lengths=length,
            start_idx=start_idx,
            stop_idx=start_idx,
            seq_length=seq,
            num_slices=num_slices,
            storage_length=storage.shape[0],
            traj_idx=torch.arange(num_slices),
            target_seq_length=target,
            storage=storage,
        )

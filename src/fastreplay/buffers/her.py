"""``HERReplayBuffer``: TorchRL's hindsight relabelling, its episode ends kept incrementally.

TorchRL's ``HERReplayBuffer._get_episode_ends`` reads the done flags of the whole storage
again whenever the storage's length or last cursor changed, i.e. at the first ``sample`` after
every write: ``O(items stored)`` per training step. Here the episode ends come from a
:class:`fastreplay._core.trajectory_index.TrajectoryIndex` that the buffer updates from the rows
each write reports (:class:`fastreplay.samplers._index_sync.IndexSync`, the slice samplers'
machinery): ``O(items written)`` per write, ``O(batch log trajectories)`` per sample.

TorchRL's episode ends are the rows whose ``end_key`` or ``terminated`` flag is set, plus the
last row (a storage not yet full) or the last written row (a full one). Those are exactly the
stop rows of the index's trajectories (a trajectory ends at a done row or at the cursor), so
TorchRL's lookup (the first end at or after a row, else the last end; the episode starting
after the end before it, else at row 0) is answered from the index by
:meth:`HERReplayBuffer._get_episode_range`, with the same values; the relabelling itself is
TorchRL's code, so the same seed gives the same samples, bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from tensordict import is_tensor_collection

from fastreplay._core.trajectory_index import TrajectoryIndex
from fastreplay._signature import ConstructorSignature
from fastreplay._torchrl import (
    TensorStorage,
    TorchRLHERReplayBuffer,
    her_cache_key,
    her_cursor,
    her_episode_ends,
    her_terminated_key,
    mutation_revision,
    storage_full,
    storage_last_cursor,
    storage_len,
)
from fastreplay.buffers.paths import PathChoice
from fastreplay.buffers.samples import PinnedSamples
from fastreplay.buffers.sharing import SharedBufferChecks
from fastreplay.samplers._index_sync import DoneFlags, IndexSync

__all__ = ["HERReplayBuffer"]


class _IndexedEpisodes:
    """What ``_get_episode_ends`` returns when the index serves it: the index, and a length.

    TorchRL's ``_sample`` only takes its ``len`` (the number of episodes, never 0 here) and
    hands it to ``_get_episode_range``. O(1).
    """

    __slots__ = ("index",)

    def __init__(self, index: TrajectoryIndex) -> None:
        self.index = index

    def __len__(self) -> int:
        return self.index.num_trajectories


class HERReplayBuffer(PathChoice, PinnedSamples, SharedBufferChecks, TorchRLHERReplayBuffer):
    """Drop-in ``torchrl.data.HERReplayBuffer`` whose episode ends are kept up to date per write.

    Same arguments (``reward_fn``, ``her_ratio``, ``strategy``, ``goal_key``,
    ``achieved_goal_key``, ``reward_key``, ``end_key``, ``sampler``, and everything
    :class:`torchrl.data.TensorDictReplayBuffer` takes), same relabelled samples for the same
    seed. TorchRL rebuilds the episode ends from the whole storage at the first ``sample``
    after every write; here:

    * a write of ``n`` items costs ``O(n)`` more (its done flags are read into the index);
    * ``sample`` costs ``O(batch x log episodes)`` for the episode lookup, independent of
      capacity;
    * writes the buffer was not told about (another buffer on the same storage,
      ``rb[idx] = ...``, a checkpoint load, ``empty()``, a done flag edited in place through
      a view of the storage, before or after an ``extend``) make the index rebuild from the
      storage once (``O(items stored)``), never serve stale episodes; after edits torch's
      version counters do not show (another process, ``tensor.data``), call
      :meth:`invalidate_boundaries`.

    Storages TorchRL's episode lookup supports and that are not a 1-D TensorDict
    ``TensorStorage`` with integer or boolean flags of one value per step keep TorchRL's
    lookup (and its errors). Samples go through TorchRL's sampling path (the relabelling lives
    there); writes take fastreplay's direct path where it applies. ``pin_memory`` and
    ``device`` are :class:`fastreplay.TensorDictReplayBuffer`'s.

    Example:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> from torchrl.data import LazyTensorStorage
        >>> from fastreplay import HERReplayBuffer
        >>> def reward_fn(td):
        ...     return (td["achieved_goal"] == td["desired_goal"]).all(-1, keepdim=True).float()
        >>> rb = HERReplayBuffer(reward_fn=reward_fn, storage=LazyTensorStorage(100), batch_size=8)
        >>> episode, step = torch.arange(40) // 10, torch.arange(40) % 10
        >>> _ = rb.extend(
        ...     TensorDict(
        ...         {
        ...             "desired_goal": torch.full((40, 1), -1),
        ...             "achieved_goal": (episode * 10_000 + step)[:, None],
        ...             ("next", "reward"): torch.zeros(40, 1),
        ...             ("next", "done"): (step == 9)[:, None],
        ...         },
        ...         [40],
        ...     )
        ... )
        >>> batch = rb.sample()
        >>> goals = batch["desired_goal"][:6, 0]  # relabelled from the same episode
        >>> bool((goals // 10_000 == batch["achieved_goal"][:6, 0] // 10_000).all())
        True
    """

    __signature__ = ConstructorSignature()  # TorchRL's metaclass hides __init__

    def __init__(
        self,
        reward_fn: Callable[..., torch.Tensor],
        *,
        pin_memory: bool = False,
        device: Any = None,
        **kwargs: Any,
    ) -> None:
        self._fr_init_pinning(pin_memory, device)
        self._fr_her = IndexSync()  # storage -> episode ends, told about every write
        self._fr_scanned: tuple | None = None  # (key, ends) read by TorchRL's scan
        self._fr_writes = 0  # writes reported (``mark_update``): part of that key
        # TorchRL's own pinning stays off, as in fastreplay.TensorDictReplayBuffer.
        super().__init__(reward_fn, pin_memory=False, **kwargs)

    # ------------------------------------------------------------------ writes and state
    def mark_update(self, index: Any) -> None:
        """TorchRL's (the writer calls it for every write): the rows also go to the index."""
        super().mark_update(index)
        self._fr_her.record(index)
        self._fr_writes += 1

    def invalidate_boundaries(self) -> None:
        """Reread the episode ends from the storage at the next ``sample``.

        The episode ends are kept from the writes the buffer is told about, and checked at
        every ``sample`` against the storage's write count and the version counters torch
        keeps for the done and terminated flag tensors: writes nobody reported, and in-place
        edits of the flags through a view of the storage (``rb.storage[:]["next", "done"][i]
        = True``), before or after an ``extend``, are seen without this call. Call it after
        edits that move neither: made by another process (shared memory, a memory map),
        through ``tensor.data`` or a NumPy view of the flags, or to a memory map opened
        separately. The sampler's boundaries (a slice sampler's ``invalidate_boundaries``)
        are reread too.

        O(1); the next ``sample`` then reads the flags of the whole storage once
        (``O(items stored)``, as TorchRL's buffer does after every write).
        """
        self._fr_her.invalidate()
        self._fr_scanned = None
        invalidate = getattr(self.sampler, "invalidate_boundaries", None)
        if invalidate is not None:
            invalidate()

    def _fr_written(self, write: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        try:
            return super()._fr_written(write, *args, **kwargs)
        except BaseException:
            self._fr_her.invalidate()  # a write that raised part way: read the storage again
            raise

    def _fr_fast_sample(self, batch_size: int | None, waiting: dict[str, Any]) -> None:
        """Never taken: the relabelling is in ``_sample``, on TorchRL's sampling path."""
        return None

    def empty(self, empty_write_count: bool = True) -> None:
        """TorchRL's; the episode ends are rebuilt at the next sample."""
        super().empty(empty_write_count=empty_write_count)
        self._fr_her.invalidate()
        self._fr_scanned = None

    def state_dict(self) -> dict:
        """TorchRL's, with the episode ends and cache key of the storage as it is now.

        TorchRL saves the cache its last ``sample`` built; the index keeps none, so the ends are
        read from the storage here (``O(items stored)``, as the checkpoint of the storage
        itself), in TorchRL's format: either library loads the checkpoint.
        """
        state = super().state_dict()
        her = state.get("_her")
        if her is not None and len(self._storage):
            try:
                ends = her_episode_ends(self, self._storage)
            except (KeyError, RuntimeError, NotImplementedError):  # TorchRL's sample would raise
                return state
            her["episode_ends_cache"] = ends
            her["last_cache_key"] = her_cache_key(self, self._storage)
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        """TorchRL's; the episode ends are rebuilt from the loaded storage at the next sample."""
        super().load_state_dict(state_dict)
        self._fr_her.invalidate(loaded=True)
        self._fr_scanned = None

    def loads(self, path: Any) -> None:
        """TorchRL's; the episode ends are rebuilt from the loaded storage at the next sample."""
        super().loads(path)
        self._fr_her.invalidate(loaded=True)
        self._fr_scanned = None

    # ------------------------------------------------------------------ episode ends
    def _fr_end_keys(self, storage: Any) -> tuple | None:
        """The stored flag keys the index reads, or ``None``: TorchRL's lookup serves. O(1)."""
        if (
            not isinstance(storage, TensorStorage)
            or not getattr(storage, "initialized", False)
            or storage.ndim != 1
            or not storage_len(storage)
        ):
            return None
        data: Any = getattr(storage, "_storage", None)
        if data is None or not is_tensor_collection(data):
            return None
        keys = []
        for key in dict.fromkeys((self.end_key, her_terminated_key(self))):
            leaf = data.get(key, None)
            if leaf is None:
                continue
            if (
                not isinstance(leaf, torch.Tensor)
                or leaf.is_floating_point()
                or leaf.is_complex()
                or leaf.shape[1:].numel() != 1
            ):
                return None  # TorchRL's ``.bool()`` and flattening: its own lookup
            keys.append(key)
        return tuple(keys) or None  # neither key: TorchRL's KeyError

    def _get_episode_ends(self, storage: Any) -> Any:
        """The index, up to date with ``storage`` (``O(items written since)``), or TorchRL's ends.

        TorchRL's (``O(items stored)`` after each write) serves storages the index does not
        cover and a full storage whose last cursor is not the index's newest row (written
        out of order, or a cursor a checkpoint did not restore).
        """
        keys = self._fr_end_keys(storage)
        if keys is None:
            return self._fr_scanned_ends(storage)
        index = self._fr_her.sync(storage, DoneFlags(end_keys=keys))
        n = storage_len(storage)
        if storage_full(storage):
            cursor = her_cursor(storage_last_cursor(storage))
            newest = None if cursor is None else cursor % n
        else:
            newest = n - 1
        if index.size != n or newest != index.cursor:
            return self._fr_scanned_ends(storage)
        self._last_cache_key = her_cache_key(self, storage)  # TorchRL's record, O(1)
        return _IndexedEpisodes(index)

    def _fr_scanned_ends(self, storage: Any) -> torch.Tensor:
        """TorchRL's episode ends, read from the whole storage (``O(items stored)``) once per write.

        TorchRL's own cache key holds the storage's last cursor, a tensor after ``extend``:
        comparing it with the previous one raises once the storage is full (``RuntimeError``,
        in every TorchRL version). This key holds the cursor's row and the storage's write
        count (``mutation_revision``, TorchRL 0.14 on) and the writes reported here instead;
        ``empty``, ``load_state_dict`` and ``loads`` drop it.
        """
        key = (
            len(storage),
            her_cursor(storage_last_cursor(storage)),
            storage_full(storage),
            mutation_revision(storage, -1),
            self._fr_writes,
        )
        cached = self.__dict__.get("_fr_scanned")
        if cached is None or cached[0] != key:
            cached = self._fr_scanned = (key, her_episode_ends(self, storage))
        return cached[1]

    def _get_episode_range(
        self, idx: torch.Tensor, episode_ends: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(episode start, episode end)`` of each row ``idx``, as TorchRL computes them.

        From the index: ``O(len(idx) x log episodes)``. TorchRL's ends are the stop rows of
        the index's trajectories. A row whose trajectory stops at or after it gets that
        trajectory's stop, and its start (row 0 for the part after the end of the storage of
        a trajectory that runs across it). A row before the end of the storage in such a
        trajectory has no end at or after it: TorchRL gives it the last end (the row before
        that trajectory's start) and that end's episode.
        """
        if not isinstance(episode_ends, _IndexedEpisodes):
            return super()._get_episode_range(idx, episode_ends)
        index = episode_ends.index
        rows = idx.reshape(-1).cpu().numpy().astype(np.int64, copy=False)
        start, length = index.locate(rows, np.zeros_like(rows))
        stop = (start + length - 1) % index.rows
        late = stop < rows  # before the end of the storage in a trajectory running across it
        end = np.where(late, start - 1, stop)
        first = np.where(start <= stop, start, 0)
        if late.any():
            before, _ = index.locate(end[late], np.zeros(int(late.sum()), dtype=np.int64))
            first[late] = np.where(before <= end[late], before, 0)
        shape = idx.shape
        return torch.from_numpy(first).reshape(shape), torch.from_numpy(end).reshape(shape)

"""``SliceSamplerWithoutReplacement``: TorchRL's epoch-based slice sampler on the trajectory index.

A thin adapter: the trajectory boundaries come from the incremental index kept by an inner
:class:`fastreplay.SliceSampler` (composed); the epoch bookkeeping (``drop_last``, ``shuffle``,
reshuffle when the number of trajectories changes) is TorchRL's own
``SamplerWithoutReplacement`` code, so the same seed gives the same samples.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from tensordict.utils import NestedKey
from torchrl._utils import _replace_last
from torchrl.data import SliceSamplerWithoutReplacement as _TorchRLSliceSamplerWithoutReplacement
from torchrl.data.replay_buffers.samplers.base import _REPLACEMENT_DISPATCH
from torchrl.data.replay_buffers.storages import Storage

from fastreplay._signature import ConstructorSignature
from fastreplay.samplers.prioritized_slice import _slice_steps
from fastreplay.samplers.slice import SliceSampler, SliceSamplerError

__all__ = ["SliceSamplerWithoutReplacement"]


class SliceSamplerWithoutReplacement(_TorchRLSliceSamplerWithoutReplacement):
    """Drop-in ``torchrl.data.SliceSamplerWithoutReplacement`` that does not rescan the buffer.

    Same arguments, outputs and epoch semantics as TorchRL's class: each ``sample`` takes the
    next ``num_slices`` trajectories of a permutation of the stored trajectories (in TorchRL's
    order) and one random slice of each; an epoch ends when the permutation is used up
    (``drop_last``, ``ran_out``), and a new permutation is drawn whenever the number of stored
    trajectories changes. The same seed gives bit-identical samples. The difference is cost:

    * ``sample`` costs ``O(batch)`` plus ``O(trajectories)`` once per permutation, independent
      of capacity and of the number of stored items (TorchRL rescans the storage after every
      write);
    * a write costs ``O(items written)``; writes the sampler was not told about trigger one
      ``O(items stored)`` rebuild from the storage, never stale boundaries.

    ``ends``/``trajectories`` (static boundaries) and ``use_gpu`` keep TorchRL's code path.

    Example:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> from torchrl.data import LazyTensorStorage, TensorDictReplayBuffer
        >>> from fastreplay import SliceSamplerWithoutReplacement
        >>> rb = TensorDictReplayBuffer(
        ...     storage=LazyTensorStorage(100),
        ...     sampler=SliceSamplerWithoutReplacement(num_slices=2, traj_key="episode"),
        ...     batch_size=8,
        ... )
        >>> episode = torch.arange(60) // 10  # six episodes of 10 steps
        >>> _ = rb.extend(TensorDict({"episode": episode}, [60]))
        >>> seen = [rb.sample()["episode"].view(2, 4)[:, 0] for _ in range(3)]
        >>> sorted(torch.cat(seen).tolist())  # one epoch: every episode exactly once
        [0, 1, 2, 3, 4, 5]
    """

    __signature__ = ConstructorSignature()  # TorchRL's metaclass hides __init__

    def __init__(
        self,
        *,
        num_slices: int | None = None,
        slice_len: int | None = None,
        drop_last: bool = False,
        end_key: NestedKey | None = None,
        end_keys: Sequence[NestedKey] | None = None,
        traj_key: NestedKey | None = None,
        ends: torch.Tensor | None = None,
        trajectories: torch.Tensor | None = None,
        truncated_key: NestedKey | None = ("next", "truncated"),
        init_key: NestedKey | None = "is_init",
        strict_length: bool = True,
        shuffle: bool = True,
        compile: bool | dict = False,
        use_gpu: bool | torch.device = False,
    ) -> None:
        super().__init__(
            num_slices=num_slices,
            slice_len=slice_len,
            drop_last=drop_last,
            end_key=end_key,
            end_keys=end_keys,
            traj_key=traj_key,
            ends=ends,
            trajectories=trajectories,
            truncated_key=truncated_key,
            init_key=init_key,
            strict_length=strict_length,
            shuffle=shuffle,
            compile=compile,
            use_gpu=use_gpu,
        )
        self._fr_static = "static-stop-and-length" in self._cache or self.use_gpu
        # The trajectory index (composed, not copied): kept by a fastreplay.SliceSampler that
        # is told about every write and only ever asked for its index.
        self._fr_slices = SliceSampler(
            num_slices=num_slices,
            slice_len=slice_len,
            end_key=end_key,
            end_keys=end_keys,
            traj_key=traj_key,
        )

    def _fr_fast(self, storage: Any) -> bool:
        """Whether the index serves ``storage`` (else TorchRL's own code path does)."""
        return not self._fr_static and self._fr_slices._fr_fast(storage)

    # ----------------------------------------------------------------- write notifications
    def extend(self, index: torch.Tensor) -> None:
        """Record the written rows in the trajectory index (``O(items written)``)."""
        super().extend(index)
        self._fr_slices.extend(index)

    def add(self, index: int | torch.Tensor) -> None:
        """Record the written row in the trajectory index."""
        super().add(index)
        self._fr_slices.add(index)

    def _empty(self) -> None:
        super()._empty()
        self._fr_slices._empty()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the epoch state; the trajectory index is rebuilt at the next sample."""
        super().load_state_dict(state_dict)
        self._fr_slices._empty()

    def loads(self, path: Any) -> None:
        """Load what ``dumps`` wrote; the trajectory index is rebuilt at the next sample."""
        super().loads(path)
        self._fr_slices._empty()

    def _get_stop_and_length(self, storage: Any, fallback: bool = True) -> tuple:
        """Trajectory boundaries in TorchRL's format, from the index (``O(trajectories)``)."""
        if not self._fr_fast(storage):
            return super()._get_stop_and_length(storage, fallback)
        return self._fr_slices._get_stop_and_length(storage, fallback)

    # ------------------------------------------------------------------------ sampling
    def sample(self, storage: Storage, batch_size: int) -> tuple[Any, dict]:
        """The next trajectories of the epoch, one slice each: ``O(batch)`` per call.

        Plus ``O(trajectories)`` whenever a new permutation is drawn (end of an epoch, or a
        change in the number of stored trajectories), as TorchRL.
        """
        if not self._fr_fast(storage):
            return super().sample(storage, batch_size)
        if self._batch_size_multiplier is not None:
            batch_size = batch_size * self._batch_size_multiplier
        seq_length, num_slices = self._fr_slices._fr_batch(batch_size)
        if len(storage) == 0:
            raise SliceSamplerError(
                "Cannot sample from an empty storage: extend the replay buffer first."
            )
        index = self._fr_slices._fr_sync(storage)
        n_all = int(index.counts(1).sum())
        n_long = int(index.counts(seq_length).sum())
        if self.strict_length and not n_long:
            lengths = index.boundaries()[2]
            raise SliceSamplerError(
                f"No trajectory is at least {seq_length} steps long (stored lengths "
                f"{int(lengths.min())} to {int(lengths.max())}) with strict_length=True; "
                "sample shorter slices or pass strict_length=False."
            )
        self._storage_len_buffer = n_all
        ranks = self._fr_next_trajectories(storage, n_all, num_slices).cpu().numpy()
        start, length, col = index.select(ranks, 1)
        target = None
        seq: int | torch.Tensor = seq_length
        if n_long < n_all:  # TorchRL's _sample_slices with short trajectories stored
            if self.strict_length:
                # TorchRL keeps the long ones, in trajectory order (a mask's nonzero).
                ranks = np.unique(ranks[length >= seq_length])
                if not ranks.size:
                    raise RuntimeError(
                        "None of the provided indices pointed to a trajectory of sufficient "
                        "length. Consider using strict_length=False for the sampler instead."
                    )
                start, length, col = index.select(ranks, 1)
            else:
                seq = torch.from_numpy(length).clamp_max(seq_length)
                target = seq_length if self.pad_output else None
        start_idx = SliceSampler._fr_with_coords(
            storage, torch.from_numpy(start), torch.from_numpy(col)
        )
        return self._get_index(
            lengths=torch.from_numpy(length),
            start_idx=start_idx,
            stop_idx=start_idx,
            seq_length=seq,
            num_slices=int(ranks.size),
            storage_length=storage.shape[0],
            traj_idx=torch.arange(ranks.size),
            target_seq_length=target,
            storage=storage,
        )

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
        storage: Storage,
    ) -> tuple[tuple[torch.Tensor, ...], dict[str, Any]]:
        """TorchRL's ``_get_index`` (same random numbers, same outputs), vectorized.

        Only the flags' and markers' keys are gathered from the storage, where TorchRL gathers
        every stored key of the sampled steps (``storage[index]``) to read two or three.
        """
        if not self._fr_fast(storage) or any(self.span) or target_seq_length is not None:
            return super()._get_index(
                lengths=lengths,
                start_idx=start_idx,
                stop_idx=stop_idx,
                seq_length=seq_length,
                num_slices=num_slices,
                storage_length=storage_length,
                traj_idx=traj_idx,
                target_seq_length=target_seq_length,
                storage=storage,
            )
        end_point = lengths[traj_idx] - seq_length + 1
        draw = torch.rand(num_slices, device=lengths.device, generator=self._rng)
        starts = start_idx[traj_idx]
        starts[:, 0] += (draw * end_point).floor().to(start_idx.dtype)
        index = _slice_steps(starts, seq_length, storage_length)
        return index, self._fr_info(index, num_slices, seq_length, storage)

    def _fr_info(
        self, index: tuple, num_slices: int, seq_length: int | torch.Tensor, storage: Storage
    ) -> dict[Any, Any]:
        """TorchRL's ``_finalize_index`` info: flags and ``is_init`` markers, same values."""
        data = storage._storage
        info: dict[Any, Any] = {}
        if self.truncated_key is not None:
            done_key = _replace_last(self.truncated_key, "done")
            terminated_key = _replace_last(self.truncated_key, "terminated")
            truncated = torch.zeros((index[0].shape[0], 1), dtype=torch.bool)
            if isinstance(seq_length, int):
                truncated.view(num_slices, -1)[:, -1] = 1
            else:
                truncated[seq_length.cumsum(0) - 1] = 1
            done = data.get(done_key, default=None)
            terminated = data.get(terminated_key, default=None)
            info[self.truncated_key] = truncated
            info[done_key] = truncated.clone() if done is None else done[index] | truncated
            info[terminated_key] = (
                torch.zeros_like(truncated) if terminated is None else terminated[index]
            )
        existing = None if self.init_key is None else data.get(self.init_key, default=None)
        if existing is not None:
            existing = existing[index]
            marker = torch.zeros_like(existing)
            if isinstance(seq_length, int):
                starts = torch.arange(num_slices, device=marker.device) * seq_length
            else:
                starts = torch.zeros(num_slices, dtype=torch.long, device=marker.device)
                starts[1:] = seq_length.to(marker.device).cumsum(0)[:-1]
            marker[starts] = True
            info[self.init_key] = marker | existing
        return info

    def _fr_next_trajectories(self, storage: Any, n_all: int, num_slices: int) -> torch.Tensor:
        """TorchRL's ``SamplerWithoutReplacement.sample`` over ``n_all`` trajectory ranks."""
        if n_all < num_slices and self.drop_last:
            raise ValueError(
                f"num_slices={num_slices} is greater than the number of stored trajectories "
                f"({n_all}) with drop_last=True: a sample cannot avoid repeating trajectories. "
                "Sample fewer slices or pass drop_last=False."
            )
        if self.len_storage != n_all or self._sample_list is None:
            self._get_sample_list(storage, n_all, batch_size=num_slices)
        self.len_storage = n_all
        return self._single_sample(n_all, num_slices)


# TorchRL's sampler metaclass reads its dispatch table to treat ``replacement=False`` on a
# without-replacement sampler as a no-op; ``SliceSampler(replacement=False)`` builds this class.
_REPLACEMENT_DISPATCH[SliceSampler] = SliceSamplerWithoutReplacement

"""``SliceSamplerWithoutReplacement``: TorchRL's epoch-based slice sampler on the trajectory index.

A thin adapter: a :class:`fastreplay.SliceSampler` placed before TorchRL's class (as TorchRL's
class is a TorchRL ``SliceSampler``), whose trajectory boundaries come from the inherited
incremental index; the epoch bookkeeping (``drop_last``, ``shuffle``,
a new epoch when the number of trajectories changes) follows TorchRL's
``SamplerWithoutReplacement``, with large shuffled epochs drawn lazily by
:class:`fastreplay._core.epoch_permutation.EpochPermutation`.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from fastreplay._core.epoch_permutation import EpochPermutation
from fastreplay._core.slice_index import slice_index
from fastreplay._signature import ConstructorSignature
from fastreplay._torchrl import (
    _REPLACEMENT_DISPATCH,
    HAS_CAN_SAMPLE,
    STATIC_BOUNDARIES,
    Storage,
    TorchRLSliceSamplerWithoutReplacement,
    is_batch_time,
    new_sample_list,
    pads_short_slices,
    sampler_generator,
    storage_len,
)
from fastreplay.samplers.slice import SliceSampler

__all__ = ["SliceSamplerWithoutReplacement"]


class SliceSamplerWithoutReplacement(SliceSampler, TorchRLSliceSamplerWithoutReplacement):
    """Drop-in ``torchrl.data.SliceSamplerWithoutReplacement`` that does not rescan the buffer.

    Same arguments, outputs and epoch semantics as TorchRL's class: each ``sample`` takes the
    next ``num_slices`` trajectories of a permutation of the stored trajectories (in TorchRL's
    order) and one random slice of each; an epoch ends when the permutation is used up
    (``drop_last``, ``ran_out``), and a new one starts whenever the number of stored
    trajectories changes. With up to ``4096`` trajectories (or ``shuffle=False``) the same seed
    gives bit-identical samples; above, a shuffled epoch is drawn lazily (the same epochs and
    distribution, other random numbers). The difference is cost:

    * ``sample`` costs ``O(batch)``, independent of capacity, of the number of stored items
      and (above ``4096``) of the number of trajectories; TorchRL rescans the storage after
      every write and draws a permutation of every trajectory at each epoch start;
    * a write costs ``O(items written)``; writes the sampler was not told about trigger one
      ``O(items stored)`` rebuild from the storage, never stale boundaries.

    ``ends``/``trajectories`` (static boundaries) and ``use_gpu`` keep TorchRL's code path.
    It is a :class:`fastreplay.SliceSampler` (and a TorchRL ``SliceSampler`` and
    ``SliceSamplerWithoutReplacement``); ``SliceSampler(replacement=False, ...)`` builds it.
    Public attributes (``num_slices``, ``drop_last``, ``shuffle``, the boundary keys...) can
    be assigned between samples, as on :class:`fastreplay.SliceSampler`.

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

    # TorchRL's arguments exactly (``replacement=False`` is still accepted, as a no-op).
    __signature__ = ConstructorSignature()

    def __init__(self, **kwargs: Any) -> None:
        """Build the sampler; arguments as in the installed TorchRL class.

        ``replacement=False`` is accepted as a no-op (the metaclass removes it before
        ``__init__`` runs), as TorchRL's class accepts it.

        Raises:
            TypeError: ``num_slices``/``slice_len`` is not an integer (and TorchRL's own
                errors for exclusive, missing or unknown arguments).
            SliceSamplerError: ``num_slices``/``slice_len`` is below 1 (a ``ValueError``).
        """
        # fastreplay.SliceSampler's, which runs TorchRL's __init__ (TorchRL's SliceSampler's
        # and the epoch state's) with the installed version's arguments as they are.
        super().__init__(**kwargs)
        # Static boundaries are a constructor argument: TorchRL's path serves them for good.
        self._fr_static = STATIC_BOUNDARIES in self._cache
        self._fr_perm = EpochPermutation()

    def _fr_indexed(self, storage: Any) -> bool:
        """Whether the index serves ``storage`` (else TorchRL's own code path does)."""
        return not self._fr_static and super()._fr_indexed(storage)

    def state_dict(self) -> dict[str, Any]:
        """TorchRL's state: the trajectories left in the epoch as ``_sample_list``.

        A lazily drawn epoch is written out as that list (``O(remaining)``), and this sampler
        continues from the same list, so that it and a sampler loaded from the checkpoint
        draw the same trajectories.
        """
        if self._fr_lazy:
            self._sample_list = self._sample_list
        return super().state_dict()

    # ------------------------------------------------------------------------ sampling
    def sample(self, storage: Storage, batch_size: int) -> tuple[Any, dict]:
        """The next trajectories of the epoch, one slice each: ``O(batch)`` per call.

        Plus, up to ``4096`` trajectories, ``O(trajectories)`` whenever a new permutation is
        drawn (end of an epoch, or a change in the number of stored trajectories), as TorchRL.
        """
        if not self._fr_indexed(storage):  # (SliceSampler.sample then runs TorchRL's)
            return super().sample(storage, batch_size)
        batch_size, seq_length, num_slices, index, n_all, n_long = self._fr_prepare(
            storage, batch_size
        )
        self._storage_len_buffer = n_all
        ranks = self._fr_next_trajectories(storage, n_all, num_slices)
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
                target = seq_length if pads_short_slices(self) else None
        if target is None and not any(self.span) and not is_batch_time(self):
            result = self._fr_slices_at(storage, start, length, col, seq)
            self._warn_if_short_batch(result[0], batch_size)  # as TorchRL's ``sample`` (nightly)
            return result
        start_idx = self._fr_sync.with_coords(storage, start, col)
        result = super()._get_index(
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
        self._warn_if_short_batch(result[0], batch_size)
        return result

    def _fr_slices_at(
        self,
        storage: Storage,
        start: np.ndarray,
        length: np.ndarray,
        col: np.ndarray,
        seq: int | torch.Tensor,
    ) -> tuple[tuple[torch.Tensor, ...], dict[Any, Any]]:
        """One slice of ``seq`` steps in each trajectory ``(start, length, col)``: ``O(batch)``.

        TorchRL's ``_get_index`` (the same random numbers, the same outputs), built by
        :func:`fastreplay._core.slice_index.slice_index`. Only the flags' and markers' keys are
        gathered from the storage, where TorchRL gathers every stored key of the sampled steps
        (``storage[index]``) to read two or three.
        """
        draw = torch.rand(start.size, generator=sampler_generator(self)).numpy()
        steps, heads = slice_index(
            start,
            seq if isinstance(seq, int) else seq.numpy(),
            storage._storage.shape[0],
            length=length,
            draw=draw,
            coords=self._fr_sync.coords(storage, col) if storage.ndim > 1 else None,
        )
        index = tuple(torch.from_numpy(a) for a in steps)
        return index, self._fr_info(index, heads, steps[0].size, storage)

    if HAS_CAN_SAMPLE:

        def can_sample(self, storage: Any, batch_size: int) -> bool:
            """TorchRL's answer: whether the epoch can give a batch of ``batch_size``. O(1).

            ``len(storage) >= batch_size`` with ``drop_last``, else ``len(storage) > 0``, as
            TorchRL's ``SliceSamplerWithoutReplacement`` decides it (its sampler without
            replacement's rule), so ``sample(wait=True)`` waits for the same writes: with
            ``drop_last`` for enough items, and with ``strict_length`` not for a trajectory
            long enough (the sample then raises, as TorchRL's does).
            """
            stored = storage_len(storage)  # ``len(storage)``
            return stored >= batch_size if self.drop_last else stored > 0

    # ------------------------------------------------------------------------- epochs
    # TorchRL keeps an epoch as ``_sample_list``: the trajectories left in a permutation drawn
    # with ``randperm`` whenever the number of trajectories changes, so ``O(trajectories)`` at
    # every online step. Up to ``_fr_lazy_above`` trajectories this class does the same (the
    # same random numbers); above, it draws the permutation lazily (``_fr_perm``), O(batch)
    # per call. ``_sample_list`` stays readable and writable for TorchRL's code and for state
    # dicts: a list set there (a loaded checkpoint) is consumed in order, as TorchRL does.
    _fr_lazy_above = 4096
    _fr_lazy: bool  # the epoch is drawn lazily (in ``_fr_perm``), else listed in ``_fr_list``
    _fr_list: Any  # a tensor; None while the epoch is drawn lazily
    len_storage: int  # TorchRL's

    @property
    def _sample_list(self) -> torch.Tensor | None:
        """The trajectories left in the epoch; ``O(remaining)`` when drawn lazily."""
        if not self.__dict__.get("_fr_lazy"):
            return self.__dict__.get("_fr_list")
        rest = self._fr_perm.rest()
        if self.shuffle and rest.size > 1:  # its order is arbitrary: make it a random one
            order = torch.randperm(rest.size, generator=torch.Generator().manual_seed(rest.size))
            rest = rest[order.numpy()]
        return torch.from_numpy(rest)

    @_sample_list.setter
    def _sample_list(self, value: torch.Tensor | None) -> None:
        self.__dict__["_fr_list"], self.__dict__["_fr_lazy"] = value, False

    def _fr_next_trajectories(self, storage: Any, n_all: int, num_slices: int) -> np.ndarray:
        """TorchRL's ``SamplerWithoutReplacement.sample`` over ``n_all`` trajectory ranks.

        Same epochs, ``drop_last``, ``shuffle=False`` order, ``ran_out`` and
        ``_remaining_batches``. ``O(num_slices)`` per call once the epoch is drawn lazily.
        """
        if n_all < num_slices and self.drop_last:
            raise ValueError(
                f"num_slices={num_slices} is greater than the number of stored trajectories "
                f"({n_all}) with drop_last=True: a sample cannot avoid repeating trajectories. "
                "Sample fewer slices or pass drop_last=False."
            )
        if self.len_storage != n_all or not (self._fr_lazy or self._fr_list is not None):
            self._fr_new_epoch(storage, n_all, num_slices)
        self.len_storage = n_all
        if self._fr_lazy:
            perm = self._fr_perm
            rng = sampler_generator(self)
            ranks = perm.draw(num_slices, rng) if self.shuffle else perm.take(num_slices)
            left = perm.remaining
        else:  # TorchRL's list: taken in order
            ranks = self._fr_list[:num_slices].cpu().numpy()
            self._fr_list = self._fr_list[num_slices:]
            left = self._fr_list.numel()
        self._fr_count_batches(left, num_slices)
        self.ran_out = left == 0 or (self.drop_last and left < num_slices)
        if self.ran_out:
            self._fr_new_epoch(storage, n_all, num_slices)
        return ranks

    def _fr_new_epoch(self, storage: Any, n_all: int, num_slices: int) -> None:
        """A new permutation of ``n_all`` trajectories (TorchRL's ``_get_sample_list``)."""
        if n_all <= self._fr_lazy_above:
            new_sample_list(self, storage, n_all, num_slices)
            return
        self._fr_perm.reset(n_all)  # O(1) amortised
        self._fr_list, self._fr_lazy = None, True
        self._fr_count_batches(n_all, num_slices)

    def _fr_count_batches(self, left: int, num_slices: int) -> None:
        """Set TorchRL's ``_remaining_batches`` for ``left`` trajectories left in the epoch."""
        if self.drop_last:
            self._remaining_batches = left // num_slices
        else:
            self._remaining_batches = -(left // -num_slices)


# TorchRL's sampler metaclass reads its dispatch table to treat ``replacement=False`` on a
# without-replacement sampler as a no-op; ``SliceSampler(replacement=False)`` builds this class.
_REPLACEMENT_DISPATCH[SliceSampler] = SliceSamplerWithoutReplacement

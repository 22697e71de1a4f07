"""``PrioritizedSliceSampler``: prioritized slice starts from the trajectory index and the trees.

A thin adapter over fastreplay's two cores: the priority trees, inherited from
:class:`fastreplay.PrioritizedSampler`, and the incremental trajectory index, owned as
:class:`fastreplay.SliceSampler` owns it (an :class:`~fastreplay.samplers._index_sync.IndexSync`
and the functions of :mod:`fastreplay.samplers.slice` that use it). Its bases are
fastreplay's ``PrioritizedSampler`` and TorchRL's ``PrioritizedSliceSampler``; it is
registered as a virtual subclass of :class:`fastreplay.SliceSampler`, so
``isinstance(sampler, fastreplay.SliceSampler)`` holds as it does for TorchRL's classes.
``sample`` draws slice starts from the trees and keeps the draws that are valid starts
(rejection sampling), which gives exactly the priority distribution restricted to valid
starts without writing to any shared state.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from fastreplay._core.slice_index import slice_index
from fastreplay._signature import ConstructorSignature
from fastreplay._torchrl import (
    HAS_CAN_SAMPLE,
    PRIORITIZED_SLICE_ARGS,
    STATIC_BOUNDARIES,
    TORCHRL_PRIORITIZED_SLICE_KEYWORDS,
    Storage,
    sampler_generator,
    storage_len,
    storage_rows,
    truncation_flags,
    warn_if_short_batch,
    warn_left_span_disabled,
)
from fastreplay._torchrl import TorchRLPrioritizedSliceSampler as _TorchRLPrioritizedSliceSampler
from fastreplay._torchrl import TorchRLSliceSampler as _TorchRLSliceSampler
from fastreplay.samplers._index_sync import IndexSync
from fastreplay.samplers.prioritized import PrioritizedSampler, _locked, uniform_draws
from fastreplay.samplers.slice import (
    SliceSampler,
    SliceSamplerError,
    _BoundaryKey,
    _check_count,
    index_boundaries,
    index_can_sample,
    index_sampleable_count,
    invalidate_boundaries,
    newest_attributes,
    serves_storage,
    slice_counts,
    trajectory_index,
)

__all__ = ["PrioritizedSliceSampler"]

# Rejection sampling draws at most this many candidates per requested slice before falling
# back to one exact O(stored) draw (only when valid starts hold under ~1/64 of the mass).
_MAX_DRAWS_PER_SLICE = 64

Locator = Callable[[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]


class _SliceArgumentsSignature(ConstructorSignature):
    """The constructor's own arguments, then TorchRL's slice arguments (its ``**kwargs``).

    Those are the keyword-only arguments of the installed TorchRL ``PrioritizedSliceSampler``,
    which differ between TorchRL versions. O(arguments).
    """

    def __get__(self, instance: Any, owner: type) -> inspect.Signature | None:
        if instance is not None:
            return None
        init = list(inspect.signature(owner.__init__).parameters.values())[1:]
        own = {p.name: p for p in init if p.kind is not p.VAR_KEYWORD}
        # TorchRL's order, with this class's defaults, then the arguments TorchRL lacks.
        params = [p for p in own.values() if p.kind is not p.KEYWORD_ONLY]
        params += [own.pop(p.name, p) for p in TORCHRL_PRIORITIZED_SLICE_KEYWORDS]
        params += [p for p in own.values() if p.kind is p.KEYWORD_ONLY]
        return inspect.Signature(params)


@newest_attributes
class PrioritizedSliceSampler(PrioritizedSampler, _TorchRLPrioritizedSliceSampler):
    r"""Drop-in ``torchrl.data.PrioritizedSliceSampler`` whose ``sample`` does not scan the buffer.

    Same arguments and outputs as TorchRL's class (Schaul et al. 2015 on slice starts): a slice
    starts at item ``i`` with probability proportional to ``(p_i + eps) ** alpha`` among the
    *valid* starts (those from which a slice of the requested length stays inside the
    trajectory, as TorchRL defines them, including ``strict_length=False`` and a right
    ``span``), and every step of the slice carries the weight ``(m_i / m_min) ** -beta`` of its
    start, ``m_min`` being the smallest mass over all stored items. The differences:

    * ``sample`` costs ``O(batch * log(trajectories) / f)`` where ``f`` is the share of the
      priority mass on valid starts (close to 1 when episodes are much longer than slices),
      independent of capacity and of the number of stored items; TorchRL rebuilds the list of
      invalid starts from the whole storage after every write. Below ``f ~ 1/64`` one draw
      falls back to an exact ``O(stored)`` pass.
    * ``sample`` writes nothing shared: TorchRL zeroes and restores sum-tree entries, which
      races with a concurrent ``update_priority`` (pytorch/rl #2212). It never returns an
      index outside the stored range (pytorch/rl #2230).
    * New items get the live in-buffer max priority (``max_priority_within_buffer=True`` by
      default, ``upper_priority``, ``initial_priority``), as :class:`fastreplay.PrioritizedSampler`.
    * Writes cost ``O(items written)`` for the trajectory index (plus the trees' ``O(k log
      capacity)``); writes the sampler was not told about trigger one rebuild from the storage.

    Args and keyword args are TorchRL's (see :class:`torchrl.data.PrioritizedSliceSampler`),
    plus ``upper_priority`` and ``initial_priority`` (see :class:`fastreplay.PrioritizedSampler`).
    It is a :class:`fastreplay.PrioritizedSampler` and (registered) a
    :class:`fastreplay.SliceSampler`, as well as TorchRL's classes; the slice attributes
    TorchRL reads at each ``sample`` (``num_slices``, ``slice_len``, ``strict_length``,
    ``span``, ``truncated_key``, the boundary keys...) can be assigned between samples, as on
    :class:`fastreplay.SliceSampler`.

    Example:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> from torchrl.data import LazyTensorStorage, TensorDictReplayBuffer
        >>> from fastreplay import PrioritizedSliceSampler
        >>> sampler = PrioritizedSliceSampler(
        ...     max_capacity=60, alpha=1.0, beta=1.0, slice_len=4, traj_key="episode"
        ... )
        >>> rb = TensorDictReplayBuffer(storage=LazyTensorStorage(60), sampler=sampler,
        ...                             batch_size=12)
        >>> episode = torch.arange(60) // 20  # three episodes of 20 steps
        >>> index = rb.extend(TensorDict({"episode": episode, "step": torch.arange(60) % 20},
        ...                              [60]))
        >>> rb.update_priority(index, (episode == 1).float())  # only episode 1 has priority
        >>> batch = rb.sample()
        >>> batch["episode"].unique().tolist()
        [1]
        >>> batch["step"].view(3, 4).diff(dim=1).eq(1).all().item()  # slices of 4 steps
        True
    """

    __signature__ = _SliceArgumentsSignature()  # TorchRL's metaclass hides __init__
    # The trajectory index, as fastreplay.SliceSampler keeps it (see that class).
    end_key = _BoundaryKey()
    end_keys = _BoundaryKey()
    traj_key = _BoundaryKey()
    num_slices: int | None  # set by TorchRL's SliceSampler.__init__, checked by ours
    slice_len: int | None
    _fr_index = property(trajectory_index)
    invalidate_boundaries = invalidate_boundaries
    _fr_indexed = serves_storage
    _fr_batch = slice_counts
    _warn_if_short_batch = warn_if_short_batch  # (its ``sample`` returns full batches)

    def __init__(
        self,
        max_capacity: int,
        alpha: float,
        beta: float,
        eps: float = 1e-8,
        dtype: torch.dtype = torch.float,
        reduction: str = "max",
        *,
        max_priority_within_buffer: bool = True,
        upper_priority: float = math.inf,
        initial_priority: float = 1.0,
        **kwargs: Any,
    ) -> None:
        for name in kwargs:  # TorchRL's slice arguments, on the installed version
            if name not in PRIORITIZED_SLICE_ARGS:
                raise TypeError(
                    f"{type(self).__name__}.__init__() got an unexpected keyword argument "
                    f"{name!r}; it takes: {', '.join(inspect.signature(type(self)).parameters)}."
                )
        # Both halves' state, as TorchRL's class builds it: TorchRL's SliceSampler's (its
        # slice arguments) and fastreplay's PrioritizedSampler's (the trees).
        _TorchRLSliceSampler.__init__(self, **kwargs)
        super().__init__(
            max_capacity,
            alpha,
            beta,
            eps,
            dtype,
            reduction,
            max_priority_within_buffer,
            upper_priority=upper_priority,
            initial_priority=initial_priority,
        )
        if self.span[0]:
            warn_left_span_disabled(self)  # TorchRL's warning, from TorchRL's module
            self.span = (0, self.span[1])
        self.num_slices = _check_count("num_slices", self.num_slices)
        self.slice_len = _check_count("slice_len", self.slice_len)
        self._fr_sync = IndexSync()  # storage -> trajectory index, told about every write
        self._fr_static: tuple[torch.Tensor, torch.Tensor] | None = None

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(num_slices={self.num_slices}, slice_len={self.slice_len}, "
            f"end_key={self.end_key}, traj_key={self.traj_key}, "
            f"truncated_key={self.truncated_key}, strict_length={self.strict_length}, "
            f"alpha={self._alpha}, beta={self._beta}, eps={self._eps}, "
            f"upper_priority={self._upper_priority})"
        )

    # ----------------------------------------------------------------- write notifications
    def mark_update(self, index: int | torch.Tensor, *, storage: Storage | None = None) -> None:
        """Give the written rows the default priority, then record them in the trajectory index.

        TorchRL's write hook: the writer calls it through every buffer attached to the storage,
        once per write (``O(items written x log capacity)``). ``extend``/``add`` record nothing.
        """
        super().mark_update(index, storage=storage)
        self._fr_sync.record(index)

    def extend(self, index: torch.Tensor | tuple) -> None:
        """Drop TorchRL's cached trajectory ends (the rows were recorded by ``mark_update``)."""
        if self.cache_values:
            self._cache.pop("preceding_stop_idx", None)

    def add(self, index: int | torch.Tensor) -> None:
        """Drop TorchRL's cached trajectory ends (the row was recorded by ``mark_update``)."""
        if self.cache_values:
            self._cache.pop("preceding_stop_idx", None)

    def _empty(self) -> None:
        super()._empty()
        self.invalidate_boundaries()

    @_locked
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the priorities; the trajectory index is rebuilt at the next sample."""
        super().load_state_dict(state_dict)
        self.invalidate_boundaries()

    @_locked
    def loads(self, path: Any) -> None:
        """Load what ``dumps`` wrote; the trajectory index is rebuilt at the next sample."""
        super().loads(path)
        self.invalidate_boundaries()

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["_fr_sync"] = self._fr_sync.detached()  # a copy rebuilds from its storage
        return state

    def _get_stop_and_length(self, storage: Any, fallback: bool = True) -> tuple:
        """Trajectory boundaries in TorchRL's format, from the index (``O(trajectories)``)."""
        if STATIC_BOUNDARIES in self._cache:
            return self._cache[STATIC_BOUNDARIES]
        if not self._fr_indexed(storage) or storage_len(storage) == 0:
            return super()._get_stop_and_length(storage, fallback)
        return index_boundaries(self, storage)

    if HAS_CAN_SAMPLE:

        def can_sample(self, storage: Any, batch_size: int) -> bool:
            """Whether a slice of ``batch_size``'s length fits, as TorchRL decides it.

            From the trajectory index (:func:`~fastreplay.samplers.slice.index_can_sample`):
            ``O(columns)`` after the incremental update, where TorchRL rescans the storage.
            """
            if not self._fr_indexed(storage) or storage_len(storage) == 0:
                return super().can_sample(storage, batch_size)
            return index_can_sample(self, storage, batch_size)

        def _sampleable_count(self, storage: Any, batch_size: int) -> Any:
            """How many slices of ``batch_size``'s length can start, as TorchRL counts them.

            From the trajectory index
            (:func:`~fastreplay.samplers.slice.index_sampleable_count`): ``O(columns)``.
            """
            if not self._fr_indexed(storage) or storage_len(storage) == 0:
                return super()._sampleable_count(storage, batch_size)
            return index_sampleable_count(self, storage, batch_size)

    # ------------------------------------------------------------------ valid starts
    def _fr_locator(self, storage: Any, seq_length: int, k: int) -> Locator:
        """``(rows, columns) -> (position in trajectory, trajectory length)`` for stored items."""
        rows = int(storage.shape[0])
        if STATIC_BOUNDARIES in self._cache:
            if self._fr_static is None:  # static boundaries: one O(capacity) table, kept
                start, _, length = self._cache[STATIC_BOUNDARIES]
                pos = torch.cat([torch.arange(n) for n in length.tolist()])
                row = (torch.repeat_interleave(start[:, 0], length) + pos) % rows
                table_pos = torch.zeros(rows, dtype=torch.long)
                table_len = torch.ones(rows, dtype=torch.long)
                table_pos[row] = pos
                table_len[row] = torch.repeat_interleave(length, length)
                self._fr_static = (table_pos, table_len)
            table_pos, table_len = (t.numpy() for t in self._fr_static)
            return lambda r, c: (table_pos[r], table_len[r])
        index = self._fr_sync.sync(storage, self)
        if self.strict_length and not int(index.counts(k + 1).sum()):
            lengths = index.boundaries()[2]
            raise SliceSamplerError(
                f"No trajectory is long enough to start a slice of {seq_length} steps (stored "
                f"lengths {int(lengths.min())} to {int(lengths.max())}) with "
                "strict_length=True; sample shorter slices or pass strict_length=False."
            )

        def locate(r: np.ndarray, c: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
            start, length = index.locate(r, c)
            return (r - start) % rows, length

        return locate

    def _fr_valid(self, pos: np.ndarray, length: np.ndarray, k: int) -> np.ndarray:
        """Valid slice starts, exactly TorchRL's ``_preceding_stop_idx`` rule.

        More than ``k`` steps left in the trajectory, or (``strict_length=False``) its first step.
        """
        valid = length - pos > k
        if not self.strict_length:
            valid |= pos == 0
        return valid

    def _fr_draw(
        self, n: int, k: int, locate: Locator, columns: int, stored: int, total: float
    ) -> tuple[np.ndarray, np.ndarray]:
        """``n`` valid starts (flat slots) drawn by priority, and their steps left.

        Rejection sampling on the trees: each accepted draw follows the priority distribution
        restricted to valid starts. Reads the trees only.
        """
        slots = np.empty(0, dtype=np.int64)
        left = np.empty(0, dtype=np.int64)
        drawn, accepted = 0, 0
        while slots.size < n and drawn < _MAX_DRAWS_PER_SLICE * n:
            want = n - slots.size
            rate = (accepted + 1) / (drawn + 1)
            m = min(max(want, math.ceil(1.25 * want / rate)), _MAX_DRAWS_PER_SLICE * n - drawn)
            draw = uniform_draws(m, sampler_generator(self), self.device)
            slot = self._trees.search(draw.to(self.device) * total).cpu().numpy()
            pos, length = locate(slot // columns, slot % columns)
            ok = self._fr_valid(pos, length, k)
            drawn, accepted = drawn + m, accepted + int(ok.sum())
            slots = np.concatenate([slots, slot[ok]])
            left = np.concatenate([left, (length - pos)[ok]])
        if slots.size < n:  # valid starts hold a tiny share of the mass: one exact pass
            slot, steps = self._fr_draw_exact(n - slots.size, k, locate, columns, stored)
            slots, left = np.concatenate([slots, slot]), np.concatenate([left, steps])
        return slots[:n], left[:n]

    def _fr_draw_exact(
        self, n: int, k: int, locate: Locator, columns: int, stored: int
    ) -> tuple[np.ndarray, np.ndarray]:
        """``n`` valid starts by priority from the full list of valid starts. ``O(stored)``."""
        slot = np.arange(stored, dtype=np.int64)
        pos, length = locate(slot // columns, slot % columns)
        valid = self._fr_valid(pos, length, k)
        slot, left = slot[valid], (length - pos)[valid]
        mass = self._trees.mass(torch.from_numpy(slot).to(self.device)).cpu()
        cum = torch.cumsum(mass, 0)
        if not slot.size or not float(cum[-1]) > 0:
            raise SliceSamplerError(
                "Cannot sample: no valid slice start has a positive priority mass "
                f"(eps={self._eps}); raise the priorities of trajectory starts or use eps > 0."
            )
        draw = uniform_draws(n, sampler_generator(self), torch.device("cpu")) * cum[-1]
        pick = torch.searchsorted(cum, draw, right=True).clamp_max_(slot.size - 1).numpy()
        return slot[pick], left[pick]

    # ------------------------------------------------------------------------ sampling
    @_locked  # the trees are read several times: never beside a write, alpha change or load
    @torch.no_grad()
    def sample(self, storage: Storage, batch_size: int) -> tuple[Any, dict]:
        """Draw ``batch_size // seq_length`` slices by start priority. ``O(batch)`` (see above).

        Returns:
            ``(index, info)`` as TorchRL: ``index`` a tuple of ``storage.ndim`` tensors of
            ``batch_size`` steps, ``info["priority_weight"]`` one weight per step (its slice
            start's), plus ``truncated``/``done``/``terminated`` flags under
            ``truncated_key``'s parent.
        """
        self._maybe_init_from_storage(storage)
        seq_length, num_slices = self._fr_batch(batch_size)
        if storage_len(storage) == 0:
            raise SliceSamplerError(
                "Cannot sample from an empty storage: extend the replay buffer first."
            )
        span_right = self.span[1]
        k = 1 if span_right is True else seq_length - 1 - int(span_right)
        locate = self._fr_locator(storage, seq_length, k)
        total, m_min = self._trees.total(), self._trees.min_mass()
        if not total > 0 or not m_min > 0:
            super().sample(storage, 1)  # raises its clear error
        columns = math.prod(storage.shape[1:]) if storage.ndim > 1 else 1
        stored = int(storage_rows(storage) or 0) * columns
        slot, left = self._fr_draw(num_slices, k, locate, columns, stored, total)
        slot_t = torch.from_numpy(slot)
        weight = torch.pow(self._trees.mass(slot_t.to(self.device)).cpu() / m_min, -self._beta)
        weight = weight.to(self.dtype)
        seq: int | torch.Tensor = seq_length
        if span_right or not self.strict_length:
            seq = torch.from_numpy(left).clamp_max(seq_length)
        steps, _ = slice_index(
            slot // columns,
            seq if isinstance(seq, int) else seq.numpy(),
            int(storage.shape[0]),
            coords=self._fr_sync.coords(storage, slot % columns) if storage.ndim > 1 else None,
        )
        index = tuple(torch.from_numpy(a) for a in steps)
        info: dict[Any, Any] = {"priority_weight": torch.repeat_interleave(weight, seq)}
        if self.truncated_key is not None:
            info.update(self._fr_flags(storage, index, num_slices, seq))
        return index, info

    def _fr_flags(self, storage: Any, index: tuple, num_slices: int, seq: Any) -> dict:
        """TorchRL's truncated/done/terminated flags, reading only those two keys."""
        truncated = torch.zeros((index[0].shape[0], 1), dtype=torch.bool)
        if isinstance(seq, int):
            truncated.view(num_slices, -1)[:, -1] = True
        else:
            truncated[seq.cumsum(0) - 1] = True
        return truncation_flags(self.truncated_key, storage._storage, index, truncated)


# TorchRL's suites and users test ``isinstance(x, fastreplay.SliceSampler)`` (TorchRL's
# PrioritizedSliceSampler is a TorchRL SliceSampler): this class owns the same parts.
SliceSampler.register(PrioritizedSliceSampler)

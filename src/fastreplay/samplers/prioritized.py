"""``fastreplay.PrioritizedSampler``: TorchRL's PER sampler on fast segment trees with a live max.

A thin adapter: it maps TorchRL's sampler contract (arguments, scalar types, index formats,
``mark_update``, the default priority) onto the tree interface
:class:`fastreplay._core.trees.interface.PriorityTreeBackend`, which both tree backends implement
(:mod:`fastreplay._core.trees.numba_backend`, compiled loops, the default when numba is installed;
:mod:`fastreplay._core.trees.torch_backend`, pure torch, otherwise). Checkpoints are encoded
and decoded by :mod:`fastreplay._core.priority_checkpoint`, TorchRL's private tree views
answered by :mod:`fastreplay._core.trees.views`; the sampler owns its trees and settings and
hands them to both.
"""

from __future__ import annotations

import math
import threading
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fastreplay._core import priority_checkpoint as checkpoint
from fastreplay._core.priority_common import FLOAT_DTYPES as _FLOAT_DTYPES
from fastreplay._core.priority_common import locked as _locked
from fastreplay._core.priority_common import scalar as _scalar
from fastreplay._core.trees.interface import PriorityTreeBackend, make_trees, move_trees
from fastreplay._core.trees.ops import check_mass, mass_of
from fastreplay._core.trees.views import (
    MAX_PRIORITY_READ_ONLY,
    TREE_READ_ONLY,
    MinTreeView,
    SumTreeView,
    max_priority,
)
from fastreplay._signature import ConstructorSignature
from fastreplay._torchrl import (
    Storage,
    sampler_generator,
    storage_len,
    storage_slots,
    tree_device_from_storage,
)
from fastreplay._torchrl import TorchRLPrioritizedSampler as _TorchRLPrioritizedSampler
from fastreplay.errors import (
    CheckpointError,
    PriorityOverflowError,
    PriorityShapeError,
    _UnsupportedError,
)

__all__ = [
    "CheckpointError",
    "PrioritizedSampler",
    "PriorityOverflowError",
    "PriorityShapeError",
]


def uniform_draws(n: int, generator: torch.Generator | None, device: torch.device) -> torch.Tensor:
    """``n`` float64 uniforms in ``[0, 1)`` from the RNG TorchRL's ``PrioritizedSampler`` uses.

    TorchRL's CPU sampler without a generator draws ``np.random.uniform(0, p_sum, n)``: NumPy's
    global RNG, which ``np.random.seed`` makes reproducible and which leaves torch's global RNG
    (exploration noise, dropout...) untouched. The same NumPy draws are returned here, so the
    sampling masses ``draw * p_sum`` are TorchRL's bit for bit. With a ``generator`` (the
    sampler's ``_rng``), or trees on an accelerator, the draws come from ``generator`` (the
    device's default one when ``None``), as in TorchRL, in float64: float32 draws (TorchRL's)
    cannot reach every slot of a tree above 2**24 slots. O(n).
    """
    if generator is None and device.type == "cpu":
        return torch.from_numpy(np.random.random_sample(n))  # noqa: NPY002 (TorchRL's RNG)
    rand_device = generator.device if generator is not None else device
    return torch.rand(n, dtype=torch.float64, device=rand_device, generator=generator)


class PrioritizedSampler(_TorchRLPrioritizedSampler):
    r"""Prioritized Experience Replay sampler whose default priority is the live in-buffer max.

    Same arguments and contract as :class:`torchrl.data.PrioritizedSampler` (Schaul et al.
    2015): slot ``i`` is drawn with probability ``(p_i + eps) ** alpha / sum_j (p_j + eps) **
    alpha`` and weighted by ``(m_i / m_min) ** -beta`` where ``m = (p + eps) ** alpha``; ``alpha``
    can be changed (e.g. by ``ParameterScheduler``) at any time. The differences:

    * :attr:`default_priority` (the priority ``mark_update`` gives newly written items) is the
      exact max RAW priority over the items currently stored, kept up to date in
      O(log capacity) on every write, re-prioritisation or overwrite; ``upper_priority`` caps
      it and ``initial_priority`` is used while nothing prioritised is stored (pytorch/rl
      #2210). With ``max_priority_within_buffer=False`` it is TorchRL's all-time max instead.
    * The trees need no compiled TorchRL extension. Four backends: numba's compiled loops on
      the CPU (the default when numba is installed), pure torch (CPU or CUDA, the CPU
      default without numba) and ``"device"``, pure torch in a fixed shallow layout whose
      ``sample`` and ``mark_update`` read nothing back to the host (the default for trees on
      an accelerator, e.g. a CUDA storage's); and ``"triton"`` (asked for by name), the
      device layout with its walk and each write one Triton kernel (CUDA, where triton is
      installed); ``backend`` picks one. Fed the same calls
      on the CPU, both hold bit-for-bit the same priorities and masses and return the same
      weights for the same items; they draw the same indices, except where float64 totals
      summed in another order move a draw across a boundary between two items (within about
      ``2 * capacity`` float64 units, one draw in 10**13). Both are batched:
      ``update_priority`` costs O(k log capacity), ``sample`` O(batch log capacity).
    * Bad input is rejected atomically: NaN, infinite or negative priorities, mismatched shapes
      (also coordinates whose count is not ``storage.ndim``) and indices outside the stored
      range raise :class:`ValueError` (a :class:`PriorityShapeError`, also a
      :class:`RuntimeError` as in TorchRL, for shapes), a priority whose mass overflows
      ``dtype`` raises :class:`PriorityOverflowError` (an :class:`OverflowError`, as in
      TorchRL), and nothing changes.
    * A storage with more slots than ``max_capacity`` (an ``ndim=2`` storage rounded up to a
      multiple of the number of envs, or a smaller ``max_capacity`` as TorchRL's tests use)
      grows the trees before its rows are prioritised: every stored row can be sampled.
    * ``dumps``/``loads`` and ``state_dict`` are vectorized (no per-slot Python loop); a
      TorchRL checkpoint or a damaged one raises :class:`CheckpointError` before anything
      changes.
    * ``alpha`` changes, priority updates, checkpoint loads and ``sample`` hold one lock, so a
      prefetch thread never samples half-rebuilt trees.
    * ``_sum_tree``, ``_min_tree`` and ``_max_priority`` (private in TorchRL, read by its tests
      and by user code) are read-only views with TorchRL's return types.

    Args:
        max_capacity: number of slots (the storage's ``max_size``).
        alpha: priority exponent, ``>= 0`` (0 is uniform sampling).
        beta: importance-weight exponent, ``>= 0``.
        eps: added to every priority before the exponent. Defaults to ``1e-8``.

            ``alpha``, ``beta``, ``eps`` and the priorities below can be any real scalar:
            a Python number, a NumPy scalar or a one-element tensor (``torch.tensor(0.6)``);
            ``alpha`` and ``beta`` read back as they were given.
        dtype: ``torch.float32`` or ``torch.float64``: the precision of the sampling mass
            ``(p + eps) ** alpha`` (computed in float64, then rounded) and of the returned
            weights. Internal sums are float64 either way.
        reduction: how ``TensorDict`` buffers reduce a multi-element priority per item
            (``"max"``, ``"min"``, ``"mean"``, ``"median"``).
        max_priority_within_buffer: ``True`` (default here): live max over stored items.
            ``False``: all-time max since construction (TorchRL's default).
        device: device of the trees. ``None`` follows a CUDA storage, else CPU.
        upper_priority: cap on :attr:`default_priority`, ``> 0``. Defaults to ``inf``.
        initial_priority: :attr:`default_priority` while nothing prioritised is stored.
            Defaults to ``1.0``, as TorchRL.

    If every stored priority is 0, :attr:`default_priority` is 0: new items then get priority
    0 too and are sampled through ``eps`` alone (mass ``eps ** alpha``), uniformly with the
    rest. With ``eps=0`` such a buffer has no mass and ``sample`` raises; keep ``eps > 0`` or
    set ``upper_priority``/priorities above 0.

    As in TorchRL, ``sample`` draws stored items only (slots below ``len(storage)``), also
    after ``update_priority`` without ``storage=`` gave a priority to a slot past them; such a
    priority counts towards :attr:`default_priority`, as in TorchRL, until its slot is written.

    Each copy (``copy.deepcopy``, ``pickle``, a ``multiprocessing`` queue) owns its trees:
    writing one never changes another.

    Example:
        >>> import torch
        >>> from torchrl.data import LazyTensorStorage, ReplayBuffer
        >>> from fastreplay import PrioritizedSampler
        >>> sampler = PrioritizedSampler(max_capacity=7, alpha=1.0, beta=1.0)
        >>> rb = ReplayBuffer(storage=LazyTensorStorage(7), sampler=sampler, batch_size=4)
        >>> sampler.default_priority  # nothing stored yet: initial_priority, a float
        1.0
        >>> index = rb.extend(torch.arange(5))
        >>> rb.update_priority(index, torch.tensor([0.5, 3.0, 0.1, 0.2, 0.3]))
        >>> sampler.default_priority  # the live max, a tensor as in TorchRL
        tensor(3.)
        >>> rb.update_priority(torch.tensor([1]), torch.tensor([0.4]))
        >>> sampler.default_priority  # lowering the max item lowers the default at once
        tensor(0.5000)
        >>> sampler._sum_tree.query(0, 7), sampler._sum_tree[1]  # TorchRL's private reads
        (1.5, 0.4000000059604645)
        >>> data, info = rb.sample(return_info=True)
        >>> data.shape, info["priority_weight"].dtype
        (torch.Size([4]), torch.float32)
    """

    __signature__ = ConstructorSignature()  # TorchRL's metaclass hides __init__

    def __init__(
        self,
        max_capacity: int,
        alpha: float,
        beta: float,
        eps: float = 1e-8,
        dtype: torch.dtype = torch.float,
        reduction: str = "max",
        max_priority_within_buffer: bool = True,
        device: torch.device | str | None = None,
        *,
        upper_priority: float = math.inf,
        initial_priority: float = 1.0,
        backend: str | None = None,
    ) -> None:
        # TorchRL's __init__ would build its compiled trees: set the same attributes instead.
        if isinstance(max_capacity, bool) or not isinstance(max_capacity, int):
            raise TypeError(f"max_capacity must be an int, got {type(max_capacity).__name__}")
        if max_capacity < 1:
            raise ValueError(f"max_capacity must be >= 1, got max_capacity={max_capacity}")
        self._alpha_as_given, self._alpha = alpha, self._checked_alpha(alpha)
        self._beta_as_given, self._beta = beta, self._checked_beta(beta)
        eps = _scalar(eps, "eps")
        upper_priority = _scalar(upper_priority, "upper_priority")
        initial_priority = _scalar(initial_priority, "initial_priority")
        if not eps >= 0 or math.isinf(eps):
            raise ValueError(
                f"eps must be a finite number >= 0, got eps={eps!r}; pass a small positive eps "
                "(the default is 1e-8): with eps < 0 a priority below -eps has no valid mass"
            )
        if not upper_priority > 0:
            raise ValueError(
                f"upper_priority must be > 0, got upper_priority={upper_priority}; "
                "use math.inf for no cap"
            )
        if not (initial_priority >= 0 and math.isfinite(initial_priority)):
            raise ValueError(f"initial_priority must be finite and >= 0, got {initial_priority}")
        if dtype not in _FLOAT_DTYPES:
            raise _UnsupportedError(
                f"dtype must be torch.float32 or torch.float64, got dtype={dtype}"
            )
        self._max_capacity = max_capacity
        self._eps = eps
        self.reduction = reduction
        self.dtype = dtype
        self._max_priority_within_buffer = bool(max_priority_within_buffer)
        self._device = torch.device(device) if device is not None else None
        self._upper_priority = float(upper_priority)
        self._initial_priority = float(initial_priority)
        self._fr_lock = threading.RLock()
        self._backend_choice = backend
        self._init()
        self._check_mass(self._default_value(), what="initial_priority")

    # ------------------------------------------------------------------ state
    def _new_trees(self, slots: int, backend: str | None = None) -> PriorityTreeBackend:
        """Empty trees over ``slots`` slots on this sampler's device and tree backend."""
        choice = self._backend_choice if backend is None else backend
        return make_trees(slots, backend=choice, device=self._device)

    def _init(self) -> None:
        self._slots = self._max_capacity
        self._trees = self._new_trees(self._slots)
        self._all_time_max = -math.inf
        self._all_time_at: int | None = None
        # Every written slot is below this: ``sample`` bounds its draw by ``len(storage)``
        # only when it is larger (a priority set without ``storage`` past the stored items).
        self._written_end = 0

    def _find_written_end(self) -> int:
        """One past the last slot holding a priority (0 if none). O(capacity)."""
        written = self._trees.written().nonzero()
        return int(written[-1]) + 1 if written.numel() else 0

    @_locked
    def _empty(self) -> None:
        self._trees.reset()
        self._all_time_max = -math.inf
        self._all_time_at = None
        self._written_end = 0

    def _grow(self, slots: int) -> None:
        """Resize the trees to ``slots`` slots, keeping every priority. O(slots), vectorized."""
        mass, raw = self._trees.leaf_mass(), self._trees.raw()
        pad = slots - mass.numel()
        trees = self._new_trees(slots)
        trees.set_leaves(
            torch.cat([mass, mass.new_zeros(pad)]),
            torch.cat([raw, raw.new_full((pad,), -math.inf)]),
        )
        self._trees, self._slots = trees, slots

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state.pop("_fr_lock", None)  # locks do not pickle; each copy gets its own
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._fr_lock = threading.RLock()

    @property
    def device(self) -> torch.device:
        """Device holding the priority trees."""
        return self._trees.device

    @property
    def backend(self) -> str:
        """Tree backend in use: ``"numba"``, ``"torch"``, ``"device"`` or ``"triton"``.

        ``"numba"``: compiled loops, CPU; ``"torch"``: any device; ``"device"``: fixed depth,
        no host reads when sampling or writing, for accelerators; ``"triton"``: the device
        layout with Triton kernels (CUDA, asked for by name). Chosen by the ``backend``
        argument; ``None`` picks numba when it is installed and the trees are on the CPU
        (else torch), and ``"device"`` when the trees live on an accelerator (``device=`` or
        a CUDA storage that moves them).
        """
        return self._trees.backend

    def _maybe_init_from_storage(self, storage: Storage | None) -> None:
        # Hot path: nothing to do for CPU storages and a fixed device (no device parsing).
        device = self._device if self._device is not None else getattr(storage, "device", None)
        if device is None or device == self._trees.device or device in ("auto", "cpu"):
            return
        device = tree_device_from_storage(self, storage)
        if device is not None and device != self._trees.device:
            # keeping the priorities (TorchRL resets them); raises before anything changes
            # where the chosen backend cannot live
            trees = move_trees(self._trees, device, backend=self._backend_choice)
            self._trees, self._device = trees, device

    @property
    def upper_priority(self) -> float:
        """Cap applied to :attr:`default_priority`."""
        return self._upper_priority

    @property
    def initial_priority(self) -> float:
        """:attr:`default_priority` while nothing prioritised is stored."""
        return self._initial_priority

    @staticmethod
    def _checked_alpha(value: Any) -> float:
        """``alpha`` as a float; raises if it is not a number ``>= 0``."""
        alpha = _scalar(value, "alpha")
        if not alpha >= 0:
            raise ValueError(
                f"alpha must be greater or equal than 0, got alpha={value}; use 0 for uniform"
            )
        return alpha

    @staticmethod
    def _checked_beta(value: Any) -> float:
        """``beta`` as a float; raises if it is not a number ``>= 0``."""
        beta = _scalar(value, "beta")
        if not beta >= 0:
            raise ValueError(
                f"beta must be greater or equal to 0, got beta={value}; use 0 for no correction"
            )
        return beta

    @property
    def alpha(self) -> Any:
        """Priority exponent; setting it re-derives every stored mass from the raw priorities.

        O(capacity), vectorized. Exact for any old value, including ``0`` (the raw priorities
        are kept in their own tree), so annealing ``alpha`` keeps the trees consistent. Any
        real scalar is accepted (e.g. the tensors TorchRL's parameter schedulers set) and
        read back as given, as in TorchRL; the trees use it as a float.
        """
        return self._alpha_as_given

    @alpha.setter
    @_locked
    def alpha(self, value: Any) -> None:
        # Under the sampler's lock: a concurrent ``sample`` (e.g. a prefetch thread) sees the
        # old or the new alpha, never half-rebuilt trees (weights above 1).
        alpha = self._checked_alpha(value)
        if alpha != self._alpha:
            # The stored max, and what an emptied buffer falls back to (initial_priority).
            fallback = min(self._initial_priority, self._upper_priority)
            for p_max in (self._trees.max_raw(), self._default_value(), fallback):
                self._check_mass(p_max, alpha=alpha, what="alpha")
            self._alpha = alpha
            raw = self._trees.raw()
            f32 = self.dtype == torch.float32
            self._trees.set_leaves(mass_of(raw, self._eps, alpha, f32), raw)
        self._alpha_as_given = value

    @property
    def beta(self) -> Any:
        """Importance-weight exponent, read back as given (any real scalar).

        The constructor requires ``beta >= 0``; setting it later checks only that it is a
        number, as TorchRL's setter does not check it either.
        """
        return self._beta_as_given

    @beta.setter
    @_locked
    def beta(self, value: Any) -> None:
        self._beta = _scalar(value, "beta")
        self._beta_as_given = value

    def _default_value(self) -> float:
        """:attr:`default_priority` as a Python float (exact, float64). O(1)."""
        within = self._max_priority_within_buffer
        live = self._trees.max_raw() if within else self._all_time_max
        value = self._initial_priority if live == -math.inf else live
        return min(value, self._upper_priority)

    @property
    def default_priority(self) -> float | torch.Tensor:
        """Raw priority for newly written items: the live max, capped by ``upper_priority``.

        As in TorchRL: a 0-dim tensor (of ``dtype``, on :attr:`device`) once a priority is
        stored, the Python float ``initial_priority`` while none is. O(1): read from the
        root of the negated-min tree.
        """
        within = self._max_priority_within_buffer
        live = self._trees.max_raw() if within else self._all_time_max
        if live == -math.inf:
            return min(self._initial_priority, self._upper_priority)
        value = min(live, self._upper_priority)
        return torch.tensor(value, dtype=self.dtype, device=self.device)

    def _check_mass(self, p_max: float, *, alpha: float | None = None, what: str) -> None:
        """Raise :class:`PriorityOverflowError` if ``(p_max + eps) ** alpha`` overflows. O(1)."""
        alpha = self._alpha if alpha is None else alpha
        check_mass(p_max, self._eps, alpha, self.dtype == torch.float32, self._slots, what)

    # ------------------------------------------------------------------ writes
    def add(self, index: int | torch.Tensor) -> None:
        """No-op: priorities of new items are set by ``mark_update``, called by the writer."""

    def extend(self, index: torch.Tensor | tuple) -> None:
        """No-op: priorities of new items are set by ``mark_update``, called by the writer."""

    def _flat_index(
        self, index: Any, storage: Storage | None, device: torch.device | None = None
    ) -> torch.Tensor:
        """1-D long tensor of flat slots (coordinates are raveled with the storage shape).

        On ``device`` (the trees' device by default).
        """
        device = self._trees.device if device is None else device
        if (  # hot path: already a flat long tensor on that device
            type(index) is torch.Tensor
            and index.dtype == torch.long
            and index.ndim == 1
            and index.device == device
        ):
            return index
        if isinstance(index, tuple):
            index = torch.stack([torch.as_tensor(i) for i in index], -1)
        index = torch.as_tensor(index, device=device)
        if index.is_floating_point() or index.is_complex() or index.dtype == torch.bool:
            raise TypeError(f"index must hold integers, got dtype {index.dtype}")
        index = index.long()
        if index.ndim > 1:
            if storage is None:
                raise PriorityShapeError(
                    f"index of shape {tuple(index.shape)} holds multi-dimensional coordinates: "
                    "pass storage=... so they can be flattened"
                )
            if index.shape[-1] != storage.ndim:
                raise PriorityShapeError(
                    f"index of shape {tuple(index.shape)} holds {index.shape[-1]} coordinates "
                    f"per item, but the storage has ndim={storage.ndim} (shape "
                    f"{tuple(storage.shape)}): pass flat indices (a 1-D tensor) or coordinates "
                    f"of shape [k, {storage.ndim}] (the 'index' a sample returned); nothing was "
                    "updated"
                )
            shape = torch.as_tensor(tuple(storage.shape), device=device)
            bad = ((index < 0) | (index >= shape)).any(-1)
            if bool(bad.any()):
                raise ValueError(
                    f"index has coordinates outside the storage shape {tuple(storage.shape)}: "
                    f"{index[bad][:5].tolist()}; pass coordinates of stored items (the 'index' "
                    "a sample returned); nothing was updated"
                )
            strides = torch.ones_like(shape)
            for dim in range(shape.numel() - 2, -1, -1):
                strides[dim] = strides[dim + 1] * shape[dim + 1]
            return (index * strides).sum(-1).reshape(-1)
        return index.reshape(-1)

    def _stored(self, storage: Storage | None) -> int:
        """Number of stored slots; grows the trees first if the storage holds more slots.

        A storage can hold more slots than ``max_capacity``: an ``ndim=2`` storage rounds its
        size up to a multiple of the number of envs, and TorchRL accepts a smaller
        ``max_capacity`` than the storage. The trees then grow (geometrically, up to the
        storage's ``max_size``) before anything is written, so every stored row gets mass.
        """
        if storage is None:
            return self._slots
        stored = storage_len(storage)
        if stored >= self._full_at(storage) and getattr(storage, "ndim", 1) > 1:
            # Full: a storage that loaded a state dict keeps its constructor's ``max_size``,
            # under the slots its tensors hold (an ``ndim=2`` storage rounded up), so ``len``
            # stops there while the writer writes every slot. TorchRL's trees take those
            # writes; here they are in range too (``sample`` still draws below ``len``).
            slots = storage_slots(storage)
            if slots is not None and slots > stored:
                stored = slots
        if stored > self._slots:
            limit = max(getattr(storage, "max_size", stored), stored)
            self._grow(min(max(stored, 2 * self._slots), limit))
        return stored

    def check_priority(self, priority: Any) -> None:
        """Raise the error :meth:`update_priority` would for these priority values. O(k).

        Checks the values alone (real numbers, none NaN, infinite or negative, every mass
        within the dtype), so a buffer can refuse an ``extend`` before it writes a row.

        Raises:
            TypeError: priorities that are not real numbers.
            ValueError: a NaN, infinite or negative priority.
            PriorityOverflowError: a priority whose mass does not fit the dtype.
        """
        priority = torch.as_tensor(priority).detach()
        if priority.dtype == torch.bool or priority.is_complex():
            raise TypeError(f"priority must be real numbers, got dtype {priority.dtype}")
        if priority.numel() == 0:
            return
        priority = priority.reshape(-1)
        if priority.dtype not in _FLOAT_DTYPES:  # ints, float16, bfloat16: exact in float64
            priority = priority.to(torch.float64)
        low, high = (value.item() for value in torch.aminmax(priority))
        if not (low >= 0 and high < math.inf):
            bad = priority[~((priority >= 0) & (priority < math.inf))]
            raise ValueError(
                f"priority must be finite and >= 0, got {bad[:5].tolist()}"
                f"{f' (and {bad.numel() - 5} more)' if bad.numel() > 5 else ''}; pass "
                "non-negative finite priorities (e.g. abs(td_error)); nothing was written"
            )
        self._check_mass(high, what="priority")

    @staticmethod
    def _full_at(storage: Storage) -> float:
        """The storage's ``max_size`` (``inf`` where it has none). O(1)."""
        size = getattr(storage, "max_size", None)
        return size if isinstance(size, int) else math.inf

    @_locked
    def update_priority(
        self,
        index: int | torch.Tensor,
        priority: float | torch.Tensor,
        *,
        storage: Storage | None = None,
    ) -> None:
        """Set the raw priority of the items at ``index``; O(k log capacity), atomic.

        Args:
            index: flat slots (int or 1-D tensor; ``-1`` entries are skipped, as TorchRL's
                ``MaxValueWriter`` uses them) or ``[k, storage.ndim]`` coordinates.
            priority: one number, or one per index (any shape with that many elements).

        Keyword Args:
            storage: the buffer's storage: needed for coordinates, and used to check that
                every index is stored (without it, indices are checked against capacity).

        Raises:
            ValueError: NaN, infinite or negative priorities, a priority count that matches
                neither 1 nor the index count, or an index outside the stored range. The
                message names the offending entries and nothing is changed.

        Repeated indices: the last occurrence wins, as in TorchRL.
        """
        self._maybe_init_from_storage(storage)
        if (  # fast path: flat indices and float priorities on the CPU trees, as they are
            type(index) is torch.Tensor
            and type(priority) is torch.Tensor
            and index.dtype == torch.long
            and index.ndim == 1
            and priority.dtype in _FLOAT_DTYPES
            and priority.numel() in (1, index.numel())
            and index.is_cpu
            and priority.is_cpu
            and index.numel() > 0
            and self._trees.device.type == "cpu"
        ):
            if priority.ndim != 1 or priority.requires_grad:
                priority = priority.detach().reshape(-1)
            self._write(index, priority, self._stored(storage))
            return
        flat = self._flat_index(index, storage)
        if type(priority) is not torch.Tensor or priority.device != self._trees.device:
            priority = torch.as_tensor(priority, device=self.device)
        if priority.requires_grad:
            priority = priority.detach()
        if priority.dtype not in _FLOAT_DTYPES:  # ints, float16, bfloat16: exact in float64
            if priority.dtype == torch.bool or priority.is_complex():
                raise TypeError(f"priority must be real numbers, got dtype {priority.dtype}")
            priority = priority.to(torch.float64)
        if priority.numel() != 1 and priority.numel() != flat.numel():
            raise PriorityShapeError(
                f"priority has {priority.numel()} elements (shape {tuple(priority.shape)}) but "
                f"index has {flat.numel()} (shape {tuple(torch.as_tensor(index).shape)}): pass "
                "one priority per index or a single number; nothing was updated"
            )
        if flat.numel() == 0:
            return
        priority = priority if priority.ndim == 1 else priority.reshape(-1)
        self._write(flat, priority, self._stored(storage))

    def _write(self, flat: torch.Tensor, raw: torch.Tensor, stored: int) -> None:
        """Check, then write raw priorities ``raw`` (one per slot, or one for all) at ``flat``.

        Repeated slots: the last occurrence wins, as in TorchRL. Atomic: any bad entry raises
        before anything is written.
        """
        f32 = self.dtype == torch.float32
        p_max, i_max = self._trees.check_and_write(flat, raw, stored, self._eps, self._alpha, f32)
        if i_max >= self._written_end:
            self._written_end = i_max + 1
        if not self._max_priority_within_buffer and p_max > self._all_time_max:
            self._new_all_time_max(flat, raw, p_max)

    def _new_all_time_max(self, flat: torch.Tensor, raw: torch.Tensor, p_max: float) -> None:
        """Note a new all-time max priority and its slot, for the ``_max_priority`` view.

        Rare (O(k)): the first slot written with ``p_max`` (``-1`` markers skipped).
        """
        keep = flat != -1
        raw = raw.expand(flat.shape)[keep]
        self._all_time_at = int(flat[keep][raw.argmax()])
        self._all_time_max = p_max

    @_locked
    def mark_update(self, index: int | torch.Tensor, *, storage: Storage | None = None) -> None:
        """Give freshly written items :attr:`default_priority`; O(k log capacity).

        The overwritten items' old priorities leave the live max first, so a new item never
        inherits the priority of the item it replaced.
        """
        self._maybe_init_from_storage(storage)
        host = getattr(self._trees, "sync_free", False) and not (
            isinstance(index, torch.Tensor) and index.device == self._trees.device
        )  # device trees check a host index on the host, then copy it over
        flat = self._flat_index(index, storage, torch.device("cpu") if host else None)
        if flat.numel() == 0:
            return
        stored = self._stored(storage)
        within = self._max_priority_within_buffer
        f32 = self.dtype == torch.float32
        all_time = None if within else self._all_time_max
        value, i_max = self._trees.mark_update(
            flat, stored, self._eps, self._alpha, f32,
            self._initial_priority, self._upper_priority, all_time,
        )  # fmt: skip
        if i_max >= self._written_end:
            self._written_end = i_max + 1
        if not within and float(value) > self._all_time_max:  # rare: note the first slot
            self._all_time_at, self._all_time_max = int(flat[flat != -1][0]), float(value)

    # ------------------------------------------------------------------ sampling
    @_locked
    def sample(self, storage: Storage, batch_size: int) -> tuple[Any, dict]:
        """Draw ``batch_size`` indices with replacement; O(batch_size log capacity).

        Returns:
            ``(index, {"priority_weight": weight})`` where ``index`` is a 1-D tensor (a tuple
            of coordinate tensors for multi-dimensional storages) and ``weight`` is
            ``(m_i / m_min) ** -beta`` in ``dtype``.
        """
        self._maybe_init_from_storage(storage)
        stored = storage_len(storage)
        if stored == 0:
            raise RuntimeError(
                "Cannot sample from an empty storage: extend the buffer before sampling."
            )
        f32 = self.dtype == torch.float32
        if self._samples_on_device(stored, f32):  # device trees: no host read
            draw = uniform_draws(batch_size, sampler_generator(self), self.device)
            index, weight = self._trees.sample_live(draw, self._beta, f32)  # type: ignore[attr-defined]
            if storage.ndim > 1:
                index = torch.unravel_index(index, tuple(storage.shape))
            return index, {"priority_weight": weight}
        limit = None
        if self._written_end > stored:  # priorities set (without storage=) past the stored
            limit = stored  # items: draw below len(storage) only, as TorchRL
            total, m_min = self._trees.prefix(stored)
        else:
            total, m_min = self._trees.total(), self._trees.min_mass()
        if not total > 0:
            raise RuntimeError(
                f"Cannot sample: the stored items have no sampling mass (sum of (p + eps) ** "
                f"alpha = {total}, eps={self._eps}). Either no priority was written (call "
                "update_priority or mark_update after writing), or every priority is 0 with "
                "eps=0: use eps > 0."
            )
        if not m_min > 0:
            raise RuntimeError(
                "Cannot compute importance weights: a stored item has priority 0 with "
                f"eps={self._eps}, so (p_i / p_min) ** -beta is undefined; use eps > 0."
            )
        draw = uniform_draws(batch_size, sampler_generator(self), self.device)
        index, weight = self._trees.sample(draw, total, m_min, self._beta, f32, limit)
        if storage.ndim > 1:
            index = torch.unravel_index(index, tuple(storage.shape))
        return index, {"priority_weight": weight}

    def _samples_on_device(self, stored: int, f32: bool) -> bool:
        """Whether ``sample`` can take the device trees' path that reads nothing back. O(1).

        It needs what the checks of the other path read from the trees, known on the host
        instead: a written slot (every one below ``len(storage)``) and a positive mass for
        every written slot (``eps ** alpha``, the smallest mass, positive in ``dtype``).
        """
        if not getattr(self._trees, "sync_free", False):
            return False
        if not 0 < self._written_end <= stored:
            return False
        try:
            floor = self._eps**self._alpha  # 0 ** 0 is 1: every mass is 1
        except OverflowError:
            floor = math.inf
        return float(np.float32(floor)) > 0 if f32 else floor > 0

    # ------------------------------------------------------------------ checkpoints
    def _checkpoint_settings(self) -> dict[str, Any]:
        """The hyper-parameters a checkpoint stores (see :mod:`.priority_checkpoint`). O(1)."""
        return checkpoint.metadata(
            max_capacity=self._max_capacity,
            alpha=self._alpha,
            beta=self._beta,
            eps=self._eps,
            upper_priority=self._upper_priority,
            initial_priority=self._initial_priority,
            all_time_max=self._all_time_max,
            max_priority_within_buffer=self._max_priority_within_buffer,
            dtype=self.dtype,
            all_time_index=self._all_time_at,
        )

    def _restore(self, saved: checkpoint.PriorityCheckpoint) -> None:
        """Assign a validated checkpoint: settings, then the leaves. O(capacity); never raises."""
        if saved.mass.numel() > self._slots:
            self._grow(saved.mass.numel())
        mass, raw = saved.leaves(self._slots)
        self._alpha = self._alpha_as_given = saved.alpha
        self._beta = self._beta_as_given = saved.beta
        self._eps = saved.eps
        self._upper_priority = saved.upper_priority
        self._initial_priority = saved.initial_priority
        self._all_time_max = saved.all_time_max
        self._all_time_at = saved.all_time_index
        self._max_priority_within_buffer = saved.max_priority_within_buffer
        self.dtype = saved.dtype
        self._trees.set_leaves(mass, raw)
        self._written_end = self._find_written_end()

    @_locked
    def state_dict(self) -> dict[str, Any]:
        """Hyper-parameters plus the leaf arrays (mass and raw priority), cloned. O(capacity)."""
        return checkpoint.state_dict(self._checkpoint_settings(), self._trees)

    @_locked
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output exactly; trees rebuilt vectorized in O(capacity).

        Raises:
            CheckpointError: a TorchRL sampler's state dict, another capacity, or missing or
                damaged entries. Checked before anything changes.
        """
        self._restore(checkpoint.read_state_dict(state_dict, self._max_capacity))

    @_locked
    def dumps(self, path: str | Path) -> None:
        """Write ``sampler_metadata.json`` and two ``.npy`` leaf arrays under ``path``."""
        checkpoint.dump(path, self._checkpoint_settings(), self._trees)

    @_locked
    def loads(self, path: str | Path) -> None:
        """Load what :meth:`dumps` wrote; O(capacity), vectorized.

        Raises:
            CheckpointError: a TorchRL ``dumps`` folder, another capacity, or missing or
                damaged files. Checked before anything changes.
        """
        self._restore(checkpoint.read_folder(path, self._max_capacity))

    # ------------------------------------------------------------------ TorchRL's tree views
    @property
    def _sum_tree(self) -> SumTreeView:
        """Read-only view answering like TorchRL's compiled sum tree.

        Supports ``[i]``, ``at``, ``query``, ``scan_lower_bound``; backed by this sampler's trees.
        """
        return SumTreeView(lambda: self._trees, lambda: self.dtype, lambda: self._slots)

    @_sum_tree.setter
    def _sum_tree(self, value: Any) -> None:
        raise AttributeError(TREE_READ_ONLY.format(name="_sum_tree"))

    @property
    def _min_tree(self) -> MinTreeView:
        """Read-only view answering like TorchRL's compiled min tree (``[i]``, ``query``)."""
        return MinTreeView(lambda: self._trees, lambda: self.dtype, lambda: self._slots)

    @_min_tree.setter
    def _min_tree(self, value: Any) -> None:
        raise AttributeError(TREE_READ_ONLY.format(name="_min_tree"))

    @property
    def _max_priority(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """``(max priority, its flat slot)`` as TorchRL keeps it, or ``(None, None)``.

        With ``max_priority_within_buffer=True`` the live max over stored items and its slot
        (O(capacity) to find the slot); otherwise the all-time max and where it was set.
        Values are 0-dim tensors on :attr:`device` (the priority in ``dtype``).
        """
        all_time = None
        if not self._max_priority_within_buffer:
            all_time = (self._all_time_max, self._all_time_at)
        return max_priority(self._trees, self.dtype, all_time)

    @_max_priority.setter
    def _max_priority(self, value: Any) -> None:
        raise AttributeError(MAX_PRIORITY_READ_ONLY)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(max_capacity={self._max_capacity}, alpha={self._alpha}, "
            f"beta={self._beta}, eps={self._eps}, reduction={self.reduction}, "
            f"upper_priority={self._upper_priority}, backend={self.backend!r})"
        )

"""``fastreplay.PrioritizedSampler``: TorchRL's PER sampler on fast segment trees with a live max.

A thin adapter: the trees live in :mod:`fastreplay._segment_tree` (pure torch) and
:mod:`fastreplay._segment_tree_numba` (compiled loops, the default when numba is installed);
this module only maps TorchRL's sampler contract (arguments, scalar types, index formats,
``mark_update``, checkpoints) onto them.
"""

from __future__ import annotations

import functools
import json
import math
import numbers
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch

from fastreplay._segment_tree import PriorityTrees
from fastreplay._segment_tree_numba import CHECK_MASS as _CHECK_MASS
from fastreplay._segment_tree_numba import OK as _OK
from fastreplay._signature import ConstructorSignature
from fastreplay._torchrl import Storage
from fastreplay._torchrl import TorchRLPrioritizedSampler as _TorchRLPrioritizedSampler
from fastreplay._tree_backends import make_trees
from fastreplay.samplers._tree_views import MinTreeView, SumTreeView

__all__ = [
    "CheckpointError",
    "PrioritizedSampler",
    "PriorityOverflowError",
    "PriorityShapeError",
]

_FORMAT = "fastreplay.PrioritizedSampler"
_SCHEMA_VERSION = 1
_FLOAT_DTYPES = (torch.float32, torch.float64)
# A float64 value rounds to a finite float32 iff it is below FLT_MAX + half an ulp (2 ** 103).
_FLOAT32_LIMIT = float(torch.finfo(torch.float32).max) + 2.0**103
_Method = TypeVar("_Method", bound=Callable[..., Any])


class PriorityOverflowError(OverflowError, ValueError):
    """A priority whose sampling mass ``(p + eps) ** alpha`` does not fit the sampler's dtype.

    An :class:`OverflowError` (what TorchRL raises when such a mass reaches its trees) and a
    :class:`ValueError` (what fastreplay raises for other bad priorities).
    """


class PriorityShapeError(ValueError, RuntimeError):
    """Priorities that do not match the index, or coordinates without ``storage``.

    A :class:`RuntimeError`, as TorchRL raises in these cases, and a :class:`ValueError`.
    """


class _UnsupportedError(ValueError, NotImplementedError):
    """An unsupported ``dtype`` (TorchRL raises :class:`NotImplementedError`)."""


class CheckpointError(ValueError, KeyError, RuntimeError):
    """A state dict or ``dumps`` folder this sampler cannot load; nothing was changed.

    Subclasses the errors TorchRL raises for foreign or mismatched checkpoints
    (:class:`KeyError` for a missing key, :class:`RuntimeError` for another capacity) and
    :class:`ValueError`.
    """

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


def _locked(method: _Method) -> _Method:
    """Run ``method`` under the sampler's re-entrant lock.

    Sampling then never sees a half-applied change (``alpha``, a checkpoint load, an update).
    """

    @functools.wraps(method)
    def wrapper(self: PrioritizedSampler, *args: Any, **kwargs: Any) -> Any:
        with self._fr_lock:
            return method(self, *args, **kwargs)

    return wrapper  # type: ignore[return-value]


def _scalar(value: Any, name: str) -> float:
    """``value`` as a Python float: every number TorchRL accepts for ``name``. O(1).

    A Python ``int``/``float``/``bool``, a NumPy scalar, or a one-element tensor or array
    (``torch.tensor(0.6)``, as TorchRL's parameter schedulers set). The compiled kernels
    take Python floats only, so every scalar is converted here, once, where it enters.

    Raises:
        TypeError: anything else (a string, a complex number, several elements), naming
            ``name`` and showing the value.
    """
    if type(value) is float:  # hot path
        return value
    if isinstance(value, (np.ndarray, np.generic)) and value.size == 1:
        value = value.item()
    elif isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()  # one host sync for a CUDA tensor, here and only here
    if isinstance(value, numbers.Real):
        return float(value)
    raise TypeError(
        f"{name} must be a real number (a float, an int, a NumPy scalar or a one-element "
        f"tensor), got {name}={value!r} of type {type(value).__name__}"
    )


def _show(index: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, limit: int = 5) -> str:
    """``"index 3: nan, index 7: -1.0"`` for the first ``limit`` entries where ``mask``."""
    where = mask.nonzero().flatten()
    shown = [f"index {int(index[i])}: {float(values[i])!r}" for i in where[:limit].tolist()]
    more = f" (and {where.numel() - limit} more)" if where.numel() > limit else ""
    return ", ".join(shown) + more


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
    * The trees need no compiled TorchRL extension. Two backends: numba's compiled loops on
      the CPU (the default when numba is installed) and pure torch (CPU or CUDA, the
      default without numba or for CUDA storages); ``backend`` picks one. Both are batched:
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
    def _new_trees(self, slots: int, backend: str | None = None) -> PriorityTrees:
        """Empty trees over ``slots`` slots on this sampler's device and tree backend."""
        choice = self._backend_choice if backend is None else backend
        return make_trees(slots, backend=choice, device=self._device)

    @property
    def _fused(self) -> bool:
        """Whether the trees run the compiled (numba) check/write/sample kernels."""
        return self._trees.backend == "numba"

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
        if "_written_end" not in state:  # pickled by an earlier version
            self._written_end = self._find_written_end()
        for name in ("alpha", "beta"):  # scalars may be tensors in earlier pickles
            self.__dict__.setdefault(f"_{name}_as_given", state[f"_{name}"])
            setattr(self, f"_{name}", _scalar(state[f"_{name}"], name))
        self._eps = _scalar(state["_eps"], "eps")

    @property
    def device(self) -> torch.device:
        """Device holding the priority trees."""
        return self._trees.device

    @property
    def backend(self) -> str:
        """Tree backend in use: ``"numba"`` (compiled loops, CPU) or ``"torch"`` (any device).

        Chosen by the ``backend`` argument; ``None`` picks numba when it is installed and the
        trees are on the CPU, and switches to torch if a CUDA storage moves the trees.
        """
        return self._trees.backend

    def _maybe_init_from_storage(self, storage: Storage | None) -> None:
        # Hot path: nothing to do for CPU storages and a fixed device (no device parsing).
        device = self._device if self._device is not None else getattr(storage, "device", None)
        if device is None or device == self._trees.device or device in ("auto", "cpu"):
            return
        device = self._tree_device_from_storage(storage)
        if device is not None and device != self._trees.device:
            old = self._trees
            if self._backend_choice is None and device.type != "cpu" and old.backend != "torch":
                # numba trees live on the CPU: follow the storage on the torch backend
                trees = make_trees(self._slots, backend="torch", device=device)
                trees.set_leaves(old.leaf_mass(), old.raw())
            else:
                # move, keeping the priorities (TorchRL resets them); a backend that cannot
                # live there raises before anything changes
                trees = old.to(device)
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
            self._trees.set_leaves(self._mass(raw), raw)
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

    def _mass_limit(self) -> float:
        """Masses must stay below this (see :meth:`_check_mass`)."""
        f32 = self.dtype == torch.float32
        return _FLOAT32_LIMIT if f32 else sys.float_info.max / self._slots

    def _mass_bound(self) -> float:
        """A mass below this fits for sure (see :meth:`_check_mass`, which decides the rest)."""
        return self._mass_limit() * (1 - 1e-12)

    def _check_mass(self, p_max: float, *, alpha: float | None = None, what: str) -> None:
        """Raise :class:`PriorityOverflowError` if ``(p_max + eps) ** alpha`` overflows. O(1).

        float32: the mass must round to a finite float32. float64: the sum over every slot
        must stay finite, so the mass must be below ``float64 max / slots``.
        """
        if p_max == -math.inf:  # nothing stored, or a write of only -1 markers: no mass
            return
        alpha = self._alpha if alpha is None else alpha
        limit = self._mass_limit()
        try:
            mass = (p_max + self._eps) ** alpha
        except OverflowError:
            mass = math.inf
        if mass < self._mass_bound():
            return
        exact = torch.pow(torch.tensor(p_max, dtype=torch.float64) + self._eps, alpha)
        if float(exact) < limit and math.isfinite(float(exact.to(self.dtype))):
            return
        dtype = str(self.dtype).removeprefix("torch.")
        if what == "initial_priority":
            cause = f"initial_priority={p_max!r} gives a"
            fix = "lower initial_priority or alpha"
        elif what == "alpha":
            cause = f"setting alpha={alpha} would give the stored priority {p_max!r} a"
            fix = "lower the priorities first, keep a smaller alpha"
        else:
            cause = f"priority {p_max!r} gives a"
            fix = "rescale the priorities (e.g. clip TD errors), lower alpha"
        raise PriorityOverflowError(
            f"{cause} sampling mass (p + eps) ** alpha = {mass:.4g} that does not fit "
            f"dtype={dtype} (limit {limit:.4g}); {fix} or build the sampler with "
            "dtype=torch.float64; nothing was changed"
        )

    def _mass(self, raw: torch.Tensor) -> torch.Tensor:
        raw = raw if raw.dtype == torch.float64 else raw.to(torch.float64)
        mass = torch.pow(raw + self._eps, self._alpha)
        return mass if self.dtype == torch.float64 else mass.to(self.dtype)

    # ------------------------------------------------------------------ writes
    def add(self, index: int | torch.Tensor) -> None:
        """No-op: priorities of new items are set by ``mark_update``, called by the writer."""

    def extend(self, index: torch.Tensor | tuple) -> None:
        """No-op: priorities of new items are set by ``mark_update``, called by the writer."""

    def _flat_index(self, index: Any, storage: Storage | None) -> torch.Tensor:
        """1-D long tensor of flat slots (coordinates are raveled with the storage shape)."""
        if (  # hot path: already a flat long tensor on the trees' device
            type(index) is torch.Tensor
            and index.dtype == torch.long
            and index.ndim == 1
            and index.device == self._trees.device
        ):
            return index
        if isinstance(index, tuple):
            index = torch.stack([torch.as_tensor(i) for i in index], -1)
        index = torch.as_tensor(index, device=self.device)
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
            shape = torch.as_tensor(tuple(storage.shape), device=self.device)
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
        stored = len(storage)
        if stored > self._slots:
            limit = max(getattr(storage, "max_size", stored), stored)
            self._grow(min(max(stored, 2 * self._slots), limit))
        return stored

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
        if (  # numba fast path: flat CPU indices and float priorities go straight to the kernels
            self._fused
            and type(index) is torch.Tensor
            and type(priority) is torch.Tensor
            and index.dtype == torch.long
            and index.ndim == 1
            and priority.dtype in _FLOAT_DTYPES
            and priority.numel() in (1, index.numel())
            and index.is_cpu
            and priority.is_cpu
            and index.numel() > 0
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
        if self._fused:  # numba: one call checks, then writes; no temporaries
            index_np, raw_np = flat.numpy(), raw.numpy()
            f32 = self.dtype == torch.float32
            status, p_max, i_max = self._trees.check_and_write(
                index_np, raw_np, stored, self._eps, self._alpha, f32, self._mass_bound()
            )
            if i_max >= self._written_end:
                self._written_end = i_max + 1
            if status == _CHECK_MASS:  # near the limit: the exact check raises or passes
                self._check_mass(p_max, what="priority")
                self._trees.write_priorities(index_np, raw_np, self._eps, self._alpha, f32)
            elif status != _OK:
                self._validate(flat, raw.to(torch.float64).expand(flat.shape), stored)
                raise AssertionError(f"unreported bad priority write (status {status})")
        elif flat.numel() <= max(self._slots // 16, self._bulk_chunk):
            raw = raw if raw.dtype == torch.float64 else raw.to(torch.float64)
            checked = self._validate(flat, raw, stored)
            p_max = -math.inf if checked is None else checked[2]
            if checked is not None:
                self._write_torch(checked[0], checked[1], i_max=checked[3])
        else:
            # Chunks of at most capacity / 16 items bound the temporaries of a bulk write; all
            # chunks are checked before any is written, and later chunks overwrite earlier
            # ones, so the last occurrence of a slot still wins.
            raw = raw.expand(flat.shape)
            step = max(self._slots // 16, self._bulk_chunk)
            chunks = [(flat[i : i + step], raw[i : i + step]) for i in range(0, raw.numel(), step)]
            if len(chunks) > 1:
                for index, values in chunks:
                    self._validate(index, values.to(torch.float64), stored)
            p_max = -math.inf
            for index, values in chunks:
                checked = self._validate(index, values.to(torch.float64), stored)
                if checked is not None:
                    p_max = max(p_max, checked[2])
                    self._write_torch(checked[0], checked[1], i_max=checked[3], rebuild=False)
            self._trees.rebuild()  # once, after the leaves of every chunk
        if not self._max_priority_within_buffer and p_max > self._all_time_max:
            # Rare (a new all-time max): find its slot for the _max_priority view. O(k).
            checked = self._validate(flat, raw.to(torch.float64).expand(flat.shape), stored)
            if checked is not None:
                self._all_time_at = int(checked[0][checked[1].argmax()])
            self._all_time_max = p_max

    _bulk_chunk = 1 << 16  # smallest chunk of a bulk write on the torch backend

    def _write_torch(
        self, flat: torch.Tensor, raw: torch.Tensor, *, i_max: int, rebuild: bool = True
    ) -> None:
        """Write checked float64 priorities (one per slot, or one for all) on the torch backend.

        The trees resolve repeated slots themselves (the last occurrence wins); ``i_max`` is
        the largest slot of ``flat``. ``rebuild=False`` writes the leaves only: the caller
        rebuilds after its last chunk.
        """
        self._trees.update(flat, self._mass(raw), raw, rebuild=rebuild)
        self._written_end = max(self._written_end, i_max + 1)

    def _validate(
        self, flat: torch.Tensor, raw: torch.Tensor, stored: int
    ) -> tuple[torch.Tensor, torch.Tensor, float, int] | None:
        """Drop ``-1`` markers, check ranges; raise ValueError naming bad entries. O(k).

        Returns ``(flat, raw, max priority, max slot)`` for the entries to write, or ``None``
        if every entry is a ``-1`` marker.
        """
        # Two fused reductions validate the common (valid) case; ``raw`` may be one value.
        bounds = [*torch.aminmax(flat), *(torch.aminmax(raw) if raw.numel() > 1 else (raw, raw))]
        if flat.is_cpu:  # reading a CPU scalar is cheaper than stacking four
            i_min, i_max, p_min, p_max = (value.item() for value in bounds)
        else:  # one host sync
            i_min, i_max, p_min, p_max = torch.stack(
                [value.to(torch.float64).reshape(()) for value in bounds]
            ).tolist()
        if i_min == -1:  # MaxValueWriter's "do not update" marker
            keep = flat != -1
            flat, raw = flat[keep], raw[keep] if raw.numel() > 1 else raw
            return self._validate(flat, raw, stored) if flat.numel() else None
        if not (i_min >= 0 and i_max < stored and p_min >= 0 and p_max < math.inf):
            raw = raw.expand(flat.shape)
            bad_p = ~((raw >= 0) & (raw < math.inf))
            bad_i = (flat < 0) | (flat >= stored)
            problems = []
            if bool(bad_i.any()):
                shown = flat[bad_i]
                more = f" (and {shown.numel() - 5} more)" if shown.numel() > 5 else ""
                problems.append(
                    f"index outside the stored range [0, {stored}): {shown[:5].tolist()}{more} "
                    "(pass indices of stored items, e.g. the 'index' a sample returned)"
                )
            if bool(bad_p.any()):
                problems.append(
                    f"priority must be finite and >= 0, got {_show(flat, raw, bad_p)} (pass e.g. "
                    "td_error.abs(); torch.nan_to_num replaces NaN and inf)"
                )
            raise ValueError("; ".join(problems) + "; nothing was updated")
        self._check_mass(p_max, what="priority")  # the mass is monotone: check the largest
        return flat, raw, p_max, int(i_max)

    @_locked
    def mark_update(self, index: int | torch.Tensor, *, storage: Storage | None = None) -> None:
        """Give freshly written items :attr:`default_priority`; O(k log capacity).

        The overwritten items' old priorities leave the live max first, so a new item never
        inherits the priority of the item it replaced.
        """
        self._maybe_init_from_storage(storage)
        flat = self._flat_index(index, storage)
        if flat.numel() == 0:
            return
        stored = self._stored(storage)
        if not self._fused:
            self._mark_update_torch(flat, stored)
            return
        zero = torch.zeros(1, dtype=torch.float64, device=self.device)
        if self._max_priority_within_buffer:
            index_np = flat.numpy()
            status, _, _ = self._trees.check_priorities(
                index_np, zero.numpy(), stored, self._eps, self._alpha, False
            )
            if status != _OK:  # raises before any change
                self._validate(flat, zero.expand(flat.shape), stored)
            self._trees.clear_if_holds_max(index_np)
        self._write(flat, zero.fill_(self._default_value()), stored)

    def _mark_update_torch(self, flat: torch.Tensor, stored: int) -> None:
        """:meth:`mark_update` on the torch backend: one value for all, so no dedupe. O(k log)."""
        i_min, i_max = (value.item() for value in torch.aminmax(flat))
        if not 0 <= i_min <= i_max < stored:  # -1 markers, or a bad index (raises first)
            zero = torch.zeros(1, dtype=torch.float64, device=self.device)
            checked = self._validate(flat, zero, stored)
            if checked is None:
                return
            flat, i_max = checked[0], checked[3]
        trees = self._trees
        # Clear the overwritten slots first if one of them holds the live max.
        within = self._max_priority_within_buffer
        if within and trees.max_raw_of(flat) >= trees.max_raw():
            trees.clear(flat)
        value = self._default_value()
        self._check_mass(value, what="priority")
        mass = (value + self._eps) ** self._alpha  # as the numba backend computes it
        if self.dtype == torch.float32:
            mass = float(np.float32(mass))
        trees.update(flat, mass, value)
        self._written_end = max(self._written_end, int(i_max) + 1)
        if not within and value > self._all_time_max:
            self._all_time_at, self._all_time_max = int(flat[0]), value

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
        stored = len(storage)
        if stored == 0:
            raise RuntimeError(
                "Cannot sample from an empty storage: extend the buffer before sampling."
            )
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
        rng = self._rng
        rand_device = rng.device if rng is not None else self.device
        draw = torch.rand(batch_size, dtype=torch.float64, device=rand_device, generator=rng)
        if self._fused:  # one compiled pass: descent, leaf mass and weight
            f32 = self.dtype == torch.float32
            draw_np = draw.numpy() if rand_device.type == "cpu" else draw.cpu().numpy()
            index, weight = self._trees.sample(draw_np, total, m_min, self._beta, f32, limit)
        else:
            draw = draw if rand_device == self._trees.device else draw.to(self._trees.device)
            index, mass = self._trees.search_with_mass(draw.mul_(total))
            if limit is not None:
                index, mass = self._below(index, mass, limit)
            weight = torch.pow(mass / m_min, -self._beta).to(self.dtype)
        if storage.ndim > 1:
            index = torch.unravel_index(index, tuple(storage.shape))
        return index, {"priority_weight": weight}

    def _below(
        self, index: torch.Tensor, mass: torch.Tensor, limit: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Move drawn slots at or past ``limit`` (rounding) to the last one below with mass.

        O(batch), plus O(limit) if a slot moves (rare).
        """
        over = index >= limit
        if not bool(over.any()):
            return index, mass
        below = self._trees.leaf_mass()[:limit]
        last = int(below.nonzero()[-1])
        return torch.where(over, last, index), torch.where(over, below[last], mass)

    # ------------------------------------------------------------------ checkpoints
    def _metadata(self) -> dict[str, Any]:
        return {
            "_format": _FORMAT,
            "_schema_version": _SCHEMA_VERSION,
            "_max_capacity": self._max_capacity,
            "_alpha": self._alpha,
            "_beta": self._beta,
            "_eps": self._eps,
            "_upper_priority": self._upper_priority,
            "_initial_priority": self._initial_priority,
            "_all_time_max": self._all_time_max,
            "_max_priority_within_buffer": self._max_priority_within_buffer,
            "dtype": str(self.dtype).removeprefix("torch."),
            "_all_time_index": self._all_time_index(),
        }

    def _all_time_index(self) -> int | None:
        """Slot where the all-time max priority was set (``max_priority_within_buffer=False``)."""
        return self._all_time_at

    def _checked(
        self, metadata: Any, mass: Any, raw: Any, source: str
    ) -> tuple[dict[str, Any], torch.Tensor, torch.Tensor]:
        """Validate a checkpoint completely before anything is assigned. O(capacity)."""
        if not isinstance(metadata, dict) or metadata.get("_format") != _FORMAT:
            keys = set(metadata) if isinstance(metadata, dict) else set()
            if {"_sum_tree", "_min_tree"} & keys or source == "torchrl folder":
                raise CheckpointError(
                    f"this {'folder' if 'folder' in source else 'state dict'} was written by "
                    "torchrl.data.PrioritizedSampler (compiled _sum_tree/_min_tree), which "
                    "fastreplay.PrioritizedSampler cannot read: load it with TorchRL's class, "
                    "or rebuild the priorities here with update_priority; nothing was changed"
                )
            raise CheckpointError(
                "this checkpoint was not written by fastreplay.PrioritizedSampler (no "
                f"'_format': {_FORMAT!r}); load it with the sampler class that saved it; "
                "nothing was changed"
            )
        required = (
            "_max_capacity", "_alpha", "_beta", "_eps", "_upper_priority", "_initial_priority",
            "_all_time_max", "_max_priority_within_buffer", "dtype",
        )  # fmt: skip
        missing = [key for key in required if key not in metadata]
        if missing or mass is None or raw is None:
            missing += [k for k, v in (("_mass", mass), ("_raw", raw)) if v is None]
            raise CheckpointError(
                f"fastreplay.PrioritizedSampler checkpoint is missing {missing}; it was "
                "truncated or edited; nothing was changed"
            )
        if metadata["_max_capacity"] != self._max_capacity:
            raise CheckpointError(
                f"checkpoint max_capacity={metadata['_max_capacity']} differs from this "
                f"sampler's max_capacity={self._max_capacity}; build the sampler with the "
                "saved capacity; nothing was changed"
            )
        mass = torch.as_tensor(mass).reshape(-1)
        raw = torch.as_tensor(raw).reshape(-1)
        if mass.numel() != raw.numel() or mass.numel() < self._max_capacity:
            raise CheckpointError(
                f"checkpoint leaf arrays have {mass.numel()} masses and {raw.numel()} raw "
                f"priorities, expected the same number, at least max_capacity="
                f"{self._max_capacity}; the checkpoint is damaged; nothing was changed"
            )
        dtype = getattr(torch, str(metadata["dtype"]), None)
        if dtype not in _FLOAT_DTYPES:
            raise CheckpointError(
                f"checkpoint dtype={metadata['dtype']!r} is not float32 or float64; "
                "nothing was changed"
            )
        try:
            scalars = {key: _scalar(metadata[key], key.lstrip("_")) for key in required[1:6]}
        except TypeError as error:
            raise CheckpointError(
                f"{error}; the checkpoint is damaged; nothing was changed"
            ) from error
        return {**metadata, **scalars}, mass, raw

    def _restore(self, metadata: Any, mass: Any, raw: Any, source: str = "state dict") -> None:
        metadata, mass, raw = self._checked(metadata, mass, raw, source)
        # Everything is validated: from here on nothing raises.
        if mass.numel() > self._slots:
            self._grow(mass.numel())
        pad = self._slots - mass.numel()
        mass = torch.cat([mass.to(torch.float64), mass.new_zeros(pad, dtype=torch.float64)])
        raw = torch.cat(
            [raw.to(torch.float64), raw.new_full((pad,), -math.inf, dtype=torch.float64)]
        )
        self._alpha = self._alpha_as_given = metadata["_alpha"]
        self._beta = self._beta_as_given = metadata["_beta"]
        self._eps = metadata["_eps"]
        self._upper_priority = float(metadata["_upper_priority"])
        self._initial_priority = float(metadata["_initial_priority"])
        self._all_time_max = float(metadata["_all_time_max"])
        index = metadata.get("_all_time_index")
        self._all_time_at = None if index is None else int(index)
        self._max_priority_within_buffer = bool(metadata["_max_priority_within_buffer"])
        self.dtype = getattr(torch, metadata["dtype"])
        self._trees.set_leaves(mass, raw)
        self._written_end = self._find_written_end()

    @_locked
    def state_dict(self) -> dict[str, Any]:
        """Hyper-parameters plus the leaf arrays (mass and raw priority), cloned. O(capacity)."""
        return {
            **self._metadata(),
            "_mass": self._trees.leaf_mass().cpu(),
            "_raw": self._trees.raw().cpu(),
        }

    @_locked
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output exactly; trees rebuilt vectorized in O(capacity).

        Raises:
            CheckpointError: a TorchRL sampler's state dict, another capacity, or missing or
                damaged entries. Checked before anything changes.
        """
        get = state_dict.get if isinstance(state_dict, dict) else lambda key: None
        self._restore(state_dict, get("_mass"), get("_raw"))

    @_locked
    def dumps(self, path: str | Path) -> None:
        """Write ``sampler_metadata.json`` and two ``.npy`` leaf arrays under ``path``."""
        path = Path(path).absolute()
        path.mkdir(parents=True, exist_ok=True)
        np.save(path / "priority_mass.npy", self._trees.leaf_mass().cpu().numpy())
        np.save(path / "priority_raw.npy", self._trees.raw().cpu().numpy())
        with open(path / "sampler_metadata.json", "w") as file:
            json.dump(self._metadata(), file)

    @_locked
    def loads(self, path: str | Path) -> None:
        """Load what :meth:`dumps` wrote; O(capacity), vectorized.

        Raises:
            CheckpointError: a TorchRL ``dumps`` folder, another capacity, or missing or
                damaged files. Checked before anything changes.
        """
        path = Path(path).absolute()
        with open(path / "sampler_metadata.json") as file:
            metadata = json.load(file)
        if metadata.get("_format") != _FORMAT:
            torchrl = (path / "sumtree.memmap").exists()
            self._checked(metadata, None, None, "torchrl folder" if torchrl else "folder")
        files = [path / "priority_mass.npy", path / "priority_raw.npy"]
        mass, raw = (torch.from_numpy(np.load(f)) if f.exists() else None for f in files)
        self._restore(metadata, mass, raw, "folder")

    # ------------------------------------------------------------------ TorchRL's private views
    @property
    def _sum_tree(self) -> SumTreeView:
        """Read-only view answering like TorchRL's compiled sum tree.

        Supports ``[i]``, ``at``, ``query``, ``scan_lower_bound``; backed by this sampler's trees.
        """
        return SumTreeView(lambda: self._trees, lambda: self.dtype, lambda: self._slots)

    @_sum_tree.setter
    def _sum_tree(self, value: Any) -> None:
        raise AttributeError(
            "_sum_tree is a read-only view of fastreplay's priority trees; use "
            "update_priority or load_state_dict to change priorities"
        )

    @property
    def _min_tree(self) -> MinTreeView:
        """Read-only view answering like TorchRL's compiled min tree (``[i]``, ``query``)."""
        return MinTreeView(lambda: self._trees, lambda: self.dtype, lambda: self._slots)

    @_min_tree.setter
    def _min_tree(self, value: Any) -> None:
        raise AttributeError(
            "_min_tree is a read-only view of fastreplay's priority trees; use "
            "update_priority or load_state_dict to change priorities"
        )

    @property
    def _max_priority(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """``(max priority, its flat slot)`` as TorchRL keeps it, or ``(None, None)``.

        With ``max_priority_within_buffer=True`` the live max over stored items and its slot
        (O(capacity) to find the slot); otherwise the all-time max and where it was set.
        Values are 0-dim tensors on :attr:`device` (the priority in ``dtype``).
        """
        if self._max_priority_within_buffer:
            value = self._trees.max_raw()
            if value == -math.inf:
                return None, None
            index: int | None = int(torch.argmax(self._trees.raw()))
        else:
            value = self._all_time_max
            if value == -math.inf:
                return None, None
            index = self._all_time_index()
        priority = torch.tensor(value, dtype=self.dtype, device=self.device)
        slot = None if index is None else torch.tensor(index, device=self.device)
        return priority, slot

    @_max_priority.setter
    def _max_priority(self, value: Any) -> None:
        raise AttributeError(
            "_max_priority is a read-only view in fastreplay: the max priority is derived "
            "from the stored priorities (see default_priority, upper_priority)"
        )

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(max_capacity={self._max_capacity}, alpha={self._alpha}, "
            f"beta={self._beta}, eps={self._eps}, reduction={self.reduction}, "
            f"upper_priority={self._upper_priority}, backend={self.backend!r})"
        )

"""``fastreplay.PrioritizedSampler``: TorchRL's PER sampler on pure-torch trees with a live max.

A thin adapter: the trees live in :mod:`fastreplay._segment_tree`; this module only maps
TorchRL's sampler contract (arguments, index formats, ``mark_update``, checkpoints) onto them.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torchrl.data import PrioritizedSampler as _TorchRLPrioritizedSampler
from torchrl.data.replay_buffers.storages import Storage

from fastreplay._segment_tree import make_trees
from fastreplay._segment_tree_numba import OK as _OK

__all__ = ["PrioritizedSampler"]

_FORMAT = "fastreplay.PrioritizedSampler"
_SCHEMA_VERSION = 1
_FLOAT_DTYPES = (torch.float32, torch.float64)


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
    * The trees are pure torch (CPU or CUDA, no compiled extension), batched:
      ``update_priority`` costs O(k log capacity), ``sample`` O(batch log capacity).
    * Bad input is rejected atomically: NaN, infinite or negative priorities, mismatched shapes
      and indices outside the stored range raise :class:`ValueError` and change nothing.
    * ``dumps``/``loads`` and ``state_dict`` are vectorized (no per-slot Python loop).

    Args:
        max_capacity: number of slots (the storage's ``max_size``).
        alpha: priority exponent, ``>= 0`` (0 is uniform sampling).
        beta: importance-weight exponent, ``>= 0``.
        eps: added to every priority before the exponent. Defaults to ``1e-8``.
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

    Example:
        >>> import torch
        >>> from torchrl.data import LazyTensorStorage, ReplayBuffer
        >>> from fastreplay import PrioritizedSampler
        >>> sampler = PrioritizedSampler(max_capacity=7, alpha=1.0, beta=1.0)
        >>> rb = ReplayBuffer(storage=LazyTensorStorage(7), sampler=sampler, batch_size=4)
        >>> index = rb.extend(torch.arange(5))
        >>> sampler.default_priority  # nothing prioritised yet: initial_priority
        1.0
        >>> rb.update_priority(index, torch.tensor([0.5, 3.0, 0.1, 0.2, 0.3]))
        >>> sampler.default_priority  # the live max
        3.0
        >>> rb.update_priority(torch.tensor([1]), torch.tensor([0.4]))
        >>> sampler.default_priority  # lowering the max item lowers the default at once
        0.5
        >>> data, info = rb.sample(return_info=True)
        >>> data.shape, info["priority_weight"].dtype
        (torch.Size([4]), torch.float32)
    """

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
        if not alpha >= 0:
            raise ValueError(f"alpha must be >= 0, got alpha={alpha}; use 0 for uniform")
        if not beta >= 0:
            raise ValueError(f"beta must be >= 0, got beta={beta}; use 0 for no correction")
        if not eps >= 0 or math.isinf(eps):
            raise ValueError(f"eps must be a finite number >= 0, got eps={eps}")
        if not upper_priority > 0:
            raise ValueError(
                f"upper_priority must be > 0, got upper_priority={upper_priority}; "
                "use math.inf for no cap"
            )
        if not (initial_priority >= 0 and math.isfinite(initial_priority)):
            raise ValueError(f"initial_priority must be finite and >= 0, got {initial_priority}")
        if dtype not in _FLOAT_DTYPES:
            raise ValueError(f"dtype must be torch.float32 or torch.float64, got dtype={dtype}")
        self._max_capacity = max_capacity
        self._alpha = alpha
        self._beta = beta
        self._eps = eps
        self.reduction = reduction
        self.dtype = dtype
        self._max_priority_within_buffer = bool(max_priority_within_buffer)
        self._device = torch.device(device) if device is not None else None
        self._upper_priority = float(upper_priority)
        self._initial_priority = float(initial_priority)
        self._backend_choice = backend
        self._init()

    # ------------------------------------------------------------------ state
    def _init(self) -> None:
        self._trees = make_trees(
            self._max_capacity, backend=self._backend_choice, device=self._device
        )
        self._fused = self._trees.backend == "numba"
        self._all_time_max = -math.inf

    def _empty(self) -> None:
        self._trees.reset()
        self._all_time_max = -math.inf

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
            self._device = device
            old = self._trees
            if self._backend_choice is None and device.type != "cpu" and old.backend != "torch":
                # numba trees live on the CPU: follow the storage on the torch backend
                self._trees = make_trees(self._max_capacity, backend="torch", device=device)
                self._trees.set_leaves(old.leaf_mass(), old.raw())
                self._fused = False
            else:
                self._trees.to(device)  # move, keeping the priorities (TorchRL resets them)

    @property
    def upper_priority(self) -> float:
        """Cap applied to :attr:`default_priority`."""
        return self._upper_priority

    @property
    def initial_priority(self) -> float:
        """:attr:`default_priority` while nothing prioritised is stored."""
        return self._initial_priority

    @property
    def alpha(self) -> float:
        """Priority exponent; setting it re-derives every stored mass from the raw priorities.

        O(capacity), vectorized. Exact for any old value, including ``0`` (the raw priorities
        are kept in their own tree), so annealing ``alpha`` keeps the trees consistent.
        """
        return self._alpha

    @alpha.setter
    def alpha(self, value: float) -> None:
        if not value >= 0:
            raise ValueError(f"alpha must be >= 0, got alpha={value}; use 0 for uniform")
        if value == self._alpha:
            return
        self._alpha = value
        raw = self._trees.raw()
        self._trees.set_leaves(self._mass(raw), raw)

    @property
    def default_priority(self) -> float:
        """Raw priority for newly written items: the live max, capped by ``upper_priority``.

        O(1): read from the root of the negated-min tree.
        """
        within = self._max_priority_within_buffer
        live = self._trees.max_raw() if within else self._all_time_max
        value = self._initial_priority if live == -math.inf else live
        return min(value, self._upper_priority)

    def _mass(self, raw: torch.Tensor) -> torch.Tensor:
        raw = raw.to(torch.float64)
        return torch.pow(raw + self._eps, self._alpha).to(self.dtype)

    # ------------------------------------------------------------------ writes
    def add(self, index: int | torch.Tensor) -> None:
        """No-op: priorities of new items are set by ``mark_update``, called by the writer."""

    def extend(self, index: torch.Tensor | tuple) -> None:
        """No-op: priorities of new items are set by ``mark_update``, called by the writer."""

    def _flat_index(self, index: Any, storage: Storage | None) -> torch.Tensor:
        """1-D long tensor of flat slots (coordinates are raveled with the storage shape)."""
        if isinstance(index, tuple):
            index = torch.stack([torch.as_tensor(i) for i in index], -1)
        index = torch.as_tensor(index, device=self.device)
        if index.is_floating_point() or index.is_complex() or index.dtype == torch.bool:
            raise TypeError(f"index must hold integers, got dtype {index.dtype}")
        index = index.long()
        if index.ndim > 1:
            if storage is None:
                raise ValueError(
                    f"index of shape {tuple(index.shape)} holds multi-dimensional coordinates: "
                    "pass storage=... so they can be flattened"
                )
            shape = torch.as_tensor(tuple(storage.shape)[: index.shape[-1]], device=self.device)
            bad = ((index < 0) | (index >= shape)).any(-1)
            if bool(bad.any()):
                raise ValueError(
                    f"index has coordinates outside the storage shape {tuple(storage.shape)}: "
                    f"{index[bad][:5].tolist()}; nothing was updated"
                )
            strides = torch.ones_like(shape)
            for dim in range(shape.numel() - 2, -1, -1):
                strides[dim] = strides[dim + 1] * shape[dim + 1]
            return (index * strides).sum(-1)
        return index.reshape(-1)

    def _stored(self, storage: Storage | None) -> int:
        return self._max_capacity if storage is None else min(len(storage), self._max_capacity)

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
        priority = torch.as_tensor(priority, device=self.device).detach()
        if priority.dtype not in _FLOAT_DTYPES:  # ints, float16, bfloat16: exact in float64
            if priority.dtype == torch.bool or priority.is_complex():
                raise TypeError(f"priority must be real numbers, got dtype {priority.dtype}")
            priority = priority.to(torch.float64)
        if priority.numel() != 1 and priority.numel() != flat.numel():
            raise ValueError(
                f"priority has {priority.numel()} elements (shape {tuple(priority.shape)}) but "
                f"index has {flat.numel()} (shape {tuple(torch.as_tensor(index).shape)}): pass "
                "one priority per index or a single number; nothing was updated"
            )
        if flat.numel() == 0:
            return
        self._write(flat, priority.reshape(-1), self._stored(storage))

    def _write(self, flat: torch.Tensor, raw: torch.Tensor, stored: int) -> None:
        """Check, then write raw priorities ``raw`` (one per slot, or one for all) at ``flat``.

        Repeated slots: the last occurrence wins, as in TorchRL. Atomic: any bad entry raises
        before anything is written.
        """
        if self._fused:  # numba: one checking pass, then one writing pass, no temporaries
            index_np, raw_np = flat.numpy(), raw.numpy()
            f32 = self.dtype == torch.float32
            status, p_max, _ = self._trees.check_priorities(
                index_np, raw_np, stored, self._eps, self._alpha, f32
            )
            if status != _OK:
                self._validate(flat, raw.to(torch.float64).expand(flat.shape), stored)
                raise AssertionError(f"unreported bad priority write (status {status})")
            self._trees.write_priorities(index_np, raw_np, self._eps, self._alpha, f32)
        else:
            # Chunks of at most capacity / 8 items bound the temporaries of a bulk write; all
            # chunks are checked before any is written, and later chunks overwrite earlier
            # ones, so the last occurrence of a slot still wins.
            raw = raw.expand(flat.shape)
            step = max(self._max_capacity // 8, self._bulk_chunk)
            chunks = [(flat[i : i + step], raw[i : i + step]) for i in range(0, raw.numel(), step)]
            if len(chunks) > 1:
                for index, values in chunks:
                    self._validate(index, values.to(torch.float64), stored)
            p_max = -math.inf
            for index, values in chunks:
                checked = self._validate(index, values.to(torch.float64), stored)
                if checked is not None:
                    p_max = max(p_max, checked[2])
                    self._write_torch(checked[0], checked[1])
        if not self._max_priority_within_buffer and p_max > -math.inf:
            self._all_time_max = max(self._all_time_max, p_max)

    _bulk_chunk = 1 << 18  # smallest chunk of a bulk write on the torch backend

    def _write_torch(self, flat: torch.Tensor, raw: torch.Tensor) -> None:
        """Write checked float64 priorities on the torch backend (last occurrence wins)."""
        if flat.numel() > 1:
            # (torch.searchsorted would save the compaction but stalls for ms on busy CPUs.)
            flat, order = torch.sort(flat, stable=True)
            last = torch.ones_like(flat, dtype=torch.bool)
            torch.ne(flat[1:], flat[:-1], out=last[:-1])
            keep = last.nonzero().squeeze(1)
            flat = flat.index_select(0, keep)
            raw = raw.index_select(0, order.index_select(0, keep))
        self._trees.update(flat, self._mass(raw), raw)

    def _validate(
        self, flat: torch.Tensor, raw: torch.Tensor, stored: int
    ) -> tuple[torch.Tensor, torch.Tensor, float] | None:
        """Drop ``-1`` markers, check ranges; raise ValueError naming bad entries. O(k)."""
        # One fused reduction and one host sync validate the common (valid) case.
        i_min, i_max = torch.aminmax(flat)
        p_min, p_max = torch.aminmax(raw)
        i_min, i_max, p_min, p_max = torch.stack(
            [i_min.to(torch.float64), i_max.to(torch.float64), p_min, p_max]
        ).tolist()
        if i_min == -1:  # MaxValueWriter's "do not update" marker
            keep = flat != -1
            flat, raw = flat[keep], raw[keep]
            return self._validate(flat, raw, stored) if flat.numel() else None
        if not (i_min >= 0 and i_max < stored and p_min >= 0 and p_max < math.inf):
            bad_p = ~((raw >= 0) & (raw < math.inf))
            bad_i = (flat < 0) | (flat >= stored)
            problems = []
            if bool(bad_i.any()):
                shown = flat[bad_i]
                more = f" (and {shown.numel() - 5} more)" if shown.numel() > 5 else ""
                problems.append(
                    f"index outside the stored range [0, {stored}): {shown[:5].tolist()}{more}"
                )
            if bool(bad_p.any()):
                problems.append(f"priority must be finite and >= 0, got {_show(flat, raw, bad_p)}")
            raise ValueError("; ".join(problems) + "; nothing was updated")
        top = float(self._mass(torch.tensor([p_max], dtype=torch.float64)))
        if not top < math.inf:  # the mass is monotone in the priority: check the largest
            raise ValueError(
                f"priority {p_max!r} overflows the sampling mass (p + eps) ** alpha in "
                f"{self.dtype} (alpha={self._alpha}); pass smaller priorities (or "
                "dtype=torch.float64); nothing was updated"
            )
        return flat, raw, p_max

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
        zero = torch.zeros(1, dtype=torch.float64, device=self.device)
        if self._max_priority_within_buffer:
            if self._fused:
                index_np = flat.numpy()
                status, _, _ = self._trees.check_priorities(
                    index_np, zero.numpy(), stored, self._eps, self._alpha, False
                )
                if status != _OK:  # raises before any change
                    self._validate(flat, zero.expand(flat.shape), stored)
                self._trees.clear_if_holds_max(index_np)
            else:
                # Clear the overwritten slots first if one of them holds the live max.
                valid = flat.clamp(0, self._max_capacity - 1)
                old = self._trees.levels[0][2].index_select(0, valid)
                if bool((old <= self._trees.levels[-1][2, 0]).any()):
                    checked = self._validate(flat, zero.expand(flat.shape), stored)  # raises first
                    if checked is not None:
                        self._trees.clear(checked[0])
        self._write(flat, zero.fill_(self.default_priority), stored)

    # ------------------------------------------------------------------ sampling
    def sample(self, storage: Storage, batch_size: int) -> tuple[Any, dict]:
        """Draw ``batch_size`` indices with replacement; O(batch_size log capacity).

        Returns:
            ``(index, {"priority_weight": weight})`` where ``index`` is a 1-D tensor (a tuple
            of coordinate tensors for multi-dimensional storages) and ``weight`` is
            ``(m_i / m_min) ** -beta`` in ``dtype``.
        """
        self._maybe_init_from_storage(storage)
        if len(storage) == 0:
            raise RuntimeError(
                "Cannot sample from an empty storage: extend the buffer before sampling."
            )
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
            index, weight = self._trees.sample(draw_np, total, m_min, self._beta, f32)
        else:
            index = self._trees.search(draw.to(self.device) * total)
            weight = torch.pow(self._trees.mass(index) / m_min, -self._beta).to(self.dtype)
        if storage.ndim > 1:
            index = torch.unravel_index(index, tuple(storage.shape))
        return index, {"priority_weight": weight}

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
        }

    def _restore(self, metadata: dict[str, Any], mass: torch.Tensor, raw: torch.Tensor) -> None:
        if metadata.get("_format") != _FORMAT:
            raise ValueError(
                "this checkpoint was not written by fastreplay.PrioritizedSampler (no "
                f"'_format': {_FORMAT!r}); load it with the sampler class that saved it"
            )
        if metadata["_max_capacity"] != self._max_capacity:
            raise ValueError(
                f"checkpoint max_capacity={metadata['_max_capacity']} differs from this "
                f"sampler's max_capacity={self._max_capacity}; build the sampler with the "
                "saved capacity"
            )
        self._alpha = metadata["_alpha"]
        self._beta = metadata["_beta"]
        self._eps = metadata["_eps"]
        self._upper_priority = float(metadata["_upper_priority"])
        self._initial_priority = float(metadata["_initial_priority"])
        self._all_time_max = float(metadata["_all_time_max"])
        self._max_priority_within_buffer = bool(metadata["_max_priority_within_buffer"])
        self.dtype = getattr(torch, metadata["dtype"])
        self._trees.set_leaves(mass, raw)

    def state_dict(self) -> dict[str, Any]:
        """Hyper-parameters plus the leaf arrays (mass and raw priority), cloned. O(capacity)."""
        return {
            **self._metadata(),
            "_mass": self._trees.leaf_mass().cpu(),
            "_raw": self._trees.raw().cpu(),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output exactly; trees rebuilt vectorized in O(capacity)."""
        self._restore(state_dict, state_dict["_mass"], state_dict["_raw"])

    def dumps(self, path: str | Path) -> None:
        """Write ``sampler_metadata.json`` and two ``.npy`` leaf arrays under ``path``."""
        path = Path(path).absolute()
        path.mkdir(parents=True, exist_ok=True)
        np.save(path / "priority_mass.npy", self._trees.leaf_mass().cpu().numpy())
        np.save(path / "priority_raw.npy", self._trees.raw().cpu().numpy())
        with open(path / "sampler_metadata.json", "w") as file:
            json.dump(self._metadata(), file)

    def loads(self, path: str | Path) -> None:
        """Load what :meth:`dumps` wrote; O(capacity), vectorized."""
        path = Path(path).absolute()
        with open(path / "sampler_metadata.json") as file:
            metadata = json.load(file)
        if metadata.get("_format") != _FORMAT:
            self._restore(metadata, torch.empty(0), torch.empty(0))  # raises a clear error
        mass = torch.from_numpy(np.load(path / "priority_mass.npy"))
        raw = torch.from_numpy(np.load(path / "priority_raw.npy"))
        self._restore(metadata, mass, raw)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(max_capacity={self._max_capacity}, alpha={self._alpha}, "
            f"beta={self._beta}, eps={self._eps}, reduction={self.reduction}, "
            f"upper_priority={self._upper_priority}, backend={self.backend!r})"
        )

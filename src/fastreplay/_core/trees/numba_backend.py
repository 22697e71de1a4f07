"""Priority segment trees walked by numba-compiled loops (CPU only, optional ``numba``).

:class:`NumbaPriorityTrees` implements the tree interface
:class:`fastreplay._core.trees.interface.PriorityTreeBackend`, as
:class:`fastreplay._core.trees.torch_backend.PriorityTrees` does (same methods, same semantics, same
``levels`` views, same errors: :mod:`fastreplay._core.trees.ops` words them), with the tree kept in
one float64 array of shape ``(3, nodes)``: row 0 the sum tree over the sampling mass, row 1 the min
tree over the mass, row 2 the negated-min tree over the raw priorities (see
:mod:`fastreplay._core.trees.torch_backend`). The levels are stored back to back, leaves first, with
the same ``branching``-ary padded layout as the pure-torch trees.

Every operation is one compiled loop instead of a few torch ops per tree level, so a call costs
a few microseconds of dispatch plus the memory accesses themselves:

* batched writes write the leaves in order (a repeated slot: the last write wins), then
  recompute each touched ancestor once, level by level (the parents are sorted once, so each
  level dedupes them in one pass): O(k log k + k log_B capacity) time and O(k) scratch
  memory; a write touching most level-1 nodes rebuilds every internal node instead,
  O(capacity) and no scratch memory;
* a batched search descends all queries one level at a time, so the cache misses of different
  queries overlap;
* both issue prefetch hints for the nodes of the next level before reading them, so the cache
  misses of a level are in flight together rather than one after the other. Every level
  starts on a cache line (rows are padded to a multiple of 8 slots), so with the default
  ``branching=8`` the children of a node are exactly one 64-byte line per row.

The kernels are compiled on first use (``cache=True`` stores them on disk next to this module,
or in ``NUMBA_CACHE_DIR``, so later processes load them in a second or two). This module
imports without numba; only constructing :class:`NumbaPriorityTrees` needs it.

Example:
    >>> import torch
    >>> from fastreplay._core.trees.interface import make_trees
    >>> trees = make_trees(7)  # these trees when numba is installed, else the torch ones
    >>> trees.update(torch.tensor([0, 3, 6]), torch.tensor([1.0, 2.0, 5.0]),
    ...              torch.tensor([1.0, 2.0, 5.0]))
    >>> trees.total(), trees.min_mass(), trees.max_raw()
    (8.0, 1.0, 5.0)
    >>> trees.search(torch.tensor([0.5, 1.5, 7.9], dtype=torch.float64)).tolist()
    [0, 3, 6]
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from fastreplay._core.memory import huge_pages_advised, large_zeros
from fastreplay._core.trees.numba_kernels import (
    _CLEARED,
    BAD_INDEX,
    BAD_PRIORITY,
    CHECK_MASS,
    NUMBA_AVAILABLE,
    OK,
    OVERFLOW,
    _check_and_write,
    _descend,
    _mark_update,
    _prefix,
    _rebuild,
    _sample,
    _set_leaves,
    _write,
    _write_priorities,
    numba,
)
from fastreplay._core.trees.ops import check_mass, mass_bound, validate

__all__ = [
    "BAD_INDEX",
    "BAD_PRIORITY",
    "CHECK_MASS",
    "NUMBA_AVAILABLE",
    "OK",
    "OVERFLOW",
    "NumbaPriorityTrees",
]

_INF = math.inf
_WEIGHT_DTYPES = (np.float64, np.float32)  # by ``f32``


# ---------------------------------------------------------------------- trees
class NumbaPriorityTrees:
    """Sum, min and negated-min segment trees over ``capacity`` slots, compiled loops, CPU.

    Same interface (:class:`fastreplay._core.trees.interface.PriorityTreeBackend`) and semantics
    as :class:`fastreplay._core.trees.torch_backend.PriorityTrees`; ``check_and_write``,
    ``mark_update`` and ``sample`` each run one compiled kernel.

    Args:
        capacity: number of leaf slots (any positive int).
        device: must be the CPU (``None`` or ``"cpu"``).
        branching: fan-out of every internal node. Defaults to 8: one 64-byte cache line of
            children per level, the fastest of 4/8/16/32 at 1M and 10M slots (a search scans
            the children of one node per level; an update re-reduces them).

    Raises:
        ImportError: numba is not installed.
        ValueError: a non-CPU ``device``, ``capacity < 1`` or ``branching < 2``.

    Memory is about 24 bytes a slot, as for the pure-torch trees.
    """

    backend = "numba"

    def __init__(
        self, capacity: int, *, device: torch.device | str | None = None, branching: int = 8
    ) -> None:
        if numba is None:
            raise ImportError("NumbaPriorityTrees needs numba: pip install numba")
        if capacity < 1:
            raise ValueError(f"capacity must be a positive int, got capacity={capacity}")
        if branching < 2:
            raise ValueError(f"branching must be >= 2, got branching={branching}")
        self.device = _cpu_only(device)
        self.capacity = int(capacity)
        self.branching = int(branching)
        sizes = [math.ceil(self.capacity / branching) * branching]
        while sizes[-1] > 1:
            nodes = sizes[-1] // branching
            sizes.append(nodes if nodes == 1 else math.ceil(nodes / branching) * branching)
        self._sizes = np.asarray(sizes, dtype=np.int64)
        self._offsets = np.concatenate([[0], np.cumsum(self._sizes)[:-1]]).astype(np.int64)
        columns = -(-int(self._sizes.sum()) // 8) * 8  # each row starts on a cache line
        # The kernels hold the address of this NumPy array, which owns its memory: unlike a
        # tensor's storage, nothing moves it (pickling a tensor for another process moves
        # its storage to shared memory, which would leave a NumPy view of it dangling).
        # Large trees sit on huge pages where the system offers them (fewer TLB misses).
        self._tree = large_zeros((3, columns), np.float64)
        self._attach()
        self.reset()

    def _attach(self) -> None:
        """Derive the tensor view of :attr:`_tree` (never pickled: it is rebuilt here)."""
        self._data = torch.from_numpy(self._tree)
        self._root = int(self._offsets[-1])
        # masses below these fit the dtype for sure (float64, float32), see ``check_mass``
        self._bounds = (mass_bound(False, self.capacity), mass_bound(True, self.capacity))

    def __getstate__(self) -> dict[str, Any]:
        # The NumPy array is pickled by value, so every copy (another process's included)
        # owns its trees and this process's trees stay where they are. O(capacity).
        state = self.__dict__.copy()
        del state["_data"], state["_bounds"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        if "_tree" not in state:  # pickled before the trees owned a NumPy array
            state = {**state, "_tree": state["_data"].numpy().copy()}
            state.pop("_data")
        tree = state["_tree"]
        if not (tree.flags.writeable and tree.flags.owndata) or huge_pages_advised(tree.nbytes):
            # Unpickled out of band (pickle protocol 5, as Ray does): a view of a read-only
            # buffer that the kernels must not write into, nor outlive. A large tree moves to
            # huge pages as when it was built. O(capacity).
            copy = large_zeros(tree.shape, np.float64)
            copy[...] = tree
            state = {**state, "_tree": copy}
        self.__dict__.update(state)
        self._attach()

    @property
    def levels(self) -> list[torch.Tensor]:
        """Views ``(3, nodes)`` of every level, leaves first (as ``PriorityTrees.levels``)."""
        return [
            self._data[:, int(o) : int(o + n)]
            for o, n in zip(self._offsets, self._sizes, strict=True)
        ]

    # ------------------------------------------------------------------ queries, O(1)
    def total(self) -> float:
        """Sum of the mass of every written slot (root of the sum tree). O(1)."""
        return float(self._tree[0, self._root])

    def min_mass(self) -> float:
        """Smallest mass over written slots, ``inf`` if none is written. O(1)."""
        return float(self._tree[1, self._root])

    def max_raw(self) -> float:
        """Largest raw priority over written slots, ``-inf`` if none is written. O(1)."""
        return -float(self._tree[2, self._root])

    def mass(self, index: torch.Tensor) -> torch.Tensor:
        """Mass stored at leaf ``index`` (0 for unwritten slots). O(k)."""
        return self._data[0].index_select(0, torch.as_tensor(index).reshape(-1))

    def raw(self) -> torch.Tensor:
        """Raw priority of every slot (``-inf`` where unwritten), a new tensor. O(capacity)."""
        return -self._data[2, : self.capacity]

    def leaf_mass(self) -> torch.Tensor:
        """Mass of every slot (0 where unwritten), a new tensor. O(capacity)."""
        return self._data[0, : self.capacity].clone()

    def written(self) -> torch.Tensor:
        """Boolean mask of the slots that hold a priority. O(capacity)."""
        return self._data[2, : self.capacity] != _INF

    def prefix(self, n: int) -> tuple[float, float]:
        """``(sum, min)`` of the mass over slots ``[0, n)`` (min ``inf`` if none is written).

        O(branching * log_B capacity).
        """
        s, mn = _prefix(self._tree, self._offsets, self.branching, int(n))
        return float(s), float(mn)

    # ------------------------------------------------------------------ updates
    def _index(self, index: torch.Tensor) -> np.ndarray:
        index = torch.as_tensor(index).reshape(-1)
        return index.to(device="cpu", dtype=torch.long).contiguous().numpy()

    @staticmethod
    def _values(values: torch.Tensor) -> np.ndarray:
        return torch.as_tensor(values).to(device="cpu", dtype=torch.float64).reshape(-1).numpy()

    def update(self, index: torch.Tensor, mass: torch.Tensor, raw: torch.Tensor) -> None:
        """Write ``mass`` and ``raw`` priorities at leaves ``index``; O(k log_B capacity).

        ``index`` must hold in-range slots (a repeated slot: the last write wins); ``mass``
        and ``raw`` have the same length.
        """
        mass, neg = self._values(mass), -self._values(raw)
        args = (self._tree, self._offsets, self._sizes, self.branching)
        _write(*args, self._index(index), np.stack([mass, mass, neg]))

    def clear(self, index: torch.Tensor) -> None:
        """Reset leaves ``index`` to the neutral (unwritten) state; O(k log_B capacity)."""
        args = (self._tree, self._offsets, self._sizes, self.branching)
        _write(*args, self._index(index), _CLEARED)

    def reset(self) -> None:
        """Reset every slot to unwritten. O(capacity)."""
        self._data[0].zero_()
        self._data[1:].fill_(_INF)

    def set_leaves(self, mass: torch.Tensor, raw: torch.Tensor) -> None:
        """Replace every leaf at once (``-inf`` raw marks unwritten) and rebuild. O(capacity)."""
        mass, raw = torch.as_tensor(mass).reshape(-1), torch.as_tensor(raw).reshape(-1)
        if mass.numel() != self.capacity or raw.numel() != self.capacity:
            raise ValueError(
                f"expected {self.capacity} leaves, got mass {tuple(mass.shape)} and raw "
                f"{tuple(raw.shape)}"
            )
        mass, raw = (_float_array(t) for t in (mass, raw))
        _set_leaves(self._tree, self._offsets, self._sizes, self.branching, mass, raw)

    def rebuild(self) -> None:
        """Recompute every internal node from the leaves. O(capacity)."""
        _rebuild(self._tree, self._offsets, self._sizes, self.branching)

    # ------------------------------------------------------------------ sampling
    def search(self, prefix: torch.Tensor, *, guard: bool = False) -> torch.Tensor:
        """Leaf of each prefix mass: smallest ``i`` with ``sum(mass[: i + 1]) > prefix``.

        O(s log_B capacity). Prefixes at or beyond :meth:`total` return the last slot with
        positive mass (the rounding guard is always on here; ``guard`` is accepted for
        interface compatibility).
        """
        prefix = self._values(prefix)
        return torch.from_numpy(_descend(self._tree, self._offsets, self.branching, prefix))

    # ------------------------------------------------------------------ sampler operations
    def check_and_write(
        self,
        index: torch.Tensor,
        raw: torch.Tensor,
        stored: int,
        eps: float,
        alpha: float,
        f32: bool,
    ) -> tuple[float, int]:
        """Check a priority write and write it, in one compiled call: ``(max priority, max slot)``.

        O(k log k + k log_B capacity), O(k) scratch memory whatever ``k``. ``index`` and
        ``raw`` are 1-D CPU tensors (``raw`` float32/float64, one per slot or one for all).
        """
        status, p_max, i_max = _check_and_write(
            self._tree, self._offsets, self._sizes, self.branching, index.numpy(), raw.numpy(),
            stored, eps, alpha, f32, self._bounds[f32],
        )  # fmt: skip
        if status != OK:
            self._not_ok(status, p_max, index, raw, stored, eps, alpha, f32)
        return p_max, i_max

    def _not_ok(
        self,
        status: int,
        p_max: float,
        index: torch.Tensor,
        raw: torch.Tensor,
        stored: int,
        eps: float,
        alpha: float,
        f32: bool,
    ) -> None:
        """A write the kernel did not do: raise its error, or decide a large mass and write."""
        if status == CHECK_MASS:  # near the dtype's limit: the exact check raises or passes
            check_mass(p_max, eps, alpha, f32, self.capacity)
            args = (self._tree, self._offsets, self._sizes, self.branching)
            _write_priorities(*args, index.numpy(), raw.numpy(), eps, alpha, f32)
            return
        raw = raw.to(torch.float64).expand(index.shape)
        validate(index, raw, stored, eps, alpha, f32, self.capacity)  # raises the error
        raise AssertionError(f"unreported bad priority write (status {status})")

    def mark_update(
        self,
        index: torch.Tensor,
        stored: int,
        eps: float,
        alpha: float,
        f32: bool,
        initial: float,
        upper: float,
        all_time_max: float | None,
    ) -> tuple[float, int]:
        """Write the default priority at every slot of ``index``, in one compiled call.

        O(k log_B capacity). See :meth:`PriorityTreeBackend.mark_update`.
        """
        status, value, i_max = _mark_update(
            self._tree, self._offsets, self._sizes, self.branching, index.numpy(), stored,
            eps, alpha, f32, self._bounds[f32], initial, upper,
            math.nan if all_time_max is None else all_time_max,
        )  # fmt: skip
        if status == OK:
            return value, i_max
        if status == BAD_INDEX:  # nothing changed: raise the error
            zero = torch.zeros(1, dtype=torch.float64).expand(index.shape)
            validate(index, zero, stored, eps, alpha, f32, self.capacity)
        # the default's mass is near the dtype's limit (or the default is out of range): the
        # exact check raises or writes
        return self.check_and_write(
            index, torch.tensor([value], dtype=torch.float64), stored, eps, alpha, f32
        )

    def sample(
        self,
        draw: torch.Tensor,
        total: float,
        m_min: float,
        beta: float,
        f32: bool,
        limit: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Leaves for uniform float64 ``draw`` and their weights, in one compiled pass.

        ``limit``: only leaves below it are drawn; ``total`` and ``m_min`` are then those of
        :meth:`prefix` ``(limit)``. O(s log_B capacity).
        """
        draw_np = draw.numpy() if draw.is_cpu else draw.cpu().numpy()
        limit = self.capacity if limit is None else limit
        index, weight = _sample(
            self._tree, self._offsets, self.branching, draw_np, total, m_min, -beta, f32, limit
        )
        return torch.from_numpy(index), torch.from_numpy(weight.view(_WEIGHT_DTYPES[f32]))

    # ------------------------------------------------------------------ persistence
    def to(self, device: torch.device | str) -> NumbaPriorityTrees:
        """Stay on the CPU (the only device of this backend) and return ``self``."""
        _cpu_only(device)
        return self


def _cpu_only(device: torch.device | str | None) -> torch.device:
    device = torch.device("cpu") if device is None else torch.device(device)
    if device.type != "cpu":
        raise ValueError(
            f"backend='numba' keeps the priority trees on the CPU, got device={device}: use "
            "backend='torch' (or backend=None, which picks it) for trees on another device"
        )
    return device


def _float_array(values: torch.Tensor) -> np.ndarray:
    """A contiguous float32/float64 numpy view (or copy for other dtypes) of a CPU tensor."""
    values = values.detach().to("cpu")
    if values.dtype not in (torch.float32, torch.float64):
        values = values.to(torch.float64)
    return values.contiguous().numpy()

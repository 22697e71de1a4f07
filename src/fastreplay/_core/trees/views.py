"""Read-only views that answer like TorchRL's compiled segment trees (``_sum_tree``/``_min_tree``).

TorchRL's ``PrioritizedSampler`` keeps two compiled trees, ``_sum_tree`` and ``_min_tree``. They are
private, but TorchRL's tests and user code read them (``tree[i]``, ``tree.at(i)``, ``tree.query(0,
len(rb))``, ``tree.scan_lower_bound(mass)``). These views answer those calls from the sampler's
trees (a :class:`fastreplay._core.trees.interface.PriorityTreeBackend`, any backend), with TorchRL's
return types: an int index gives a Python float, a NumPy array gives a NumPy array of the tree
dtype, a tensor gives a tensor of the same shape (a 0-dim tensor gives a Python float, as the
compiled trees do). Writing through them raises :class:`TypeError`: priorities change through
``update_priority``. The sampler exposes them (and TorchRL's ``_max_priority`` pair, from
:func:`max_priority`) as read-only properties.

Costs: point reads O(k); ``query`` over every slot O(1) (the tree root), over a sub-range
O(capacity) (vectorized); ``scan_lower_bound`` O(k log capacity).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from fastreplay._core.trees.interface import PriorityTreeBackend

__all__ = [
    "MAX_PRIORITY_READ_ONLY",
    "TREE_READ_ONLY",
    "MinTreeView",
    "SumTreeView",
    "max_priority",
]

_READ_ONLY = (
    "{name} is a read-only view of fastreplay's priority trees; set priorities with "
    "sampler.update_priority(index, priority) (mass (p + eps) ** alpha is derived from them)"
)


class _TreeView:
    """Shared indexing and type mapping of the two views."""

    _name = "_tree"

    def __init__(
        self,
        trees: Callable[[], PriorityTreeBackend],
        dtype: Callable[[], torch.dtype],
        size: Callable[[], int],
    ) -> None:
        self._get_trees = trees
        self._get_dtype = dtype
        self._get_size = size

    # ------------------------------------------------------------------ attributes
    @property
    def _trees(self) -> PriorityTreeBackend:
        return self._get_trees()

    @property
    def size(self) -> int:
        """Number of slots."""
        return self._get_size()

    @property
    def capacity(self) -> int:
        """Number of slots (TorchRL rounds its compiled trees up to a power of two)."""
        return self.size

    @property
    def device(self) -> torch.device:
        """Device of the trees."""
        return self._trees.device

    @property
    def identity_element(self) -> float:
        """Value of a slot that holds no priority."""
        raise NotImplementedError

    def __len__(self) -> int:
        return self.size

    def __iter__(self) -> Iterator[float]:
        yield from self._leaves().tolist()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(size={self.size}, dtype={self._get_dtype()})"

    # ------------------------------------------------------------------ reads
    def _leaves(self) -> torch.Tensor:
        """Every slot's value, float64. O(capacity)."""
        raise NotImplementedError

    def _values(self, index: torch.Tensor) -> torch.Tensor:
        """Values at flat, in-range ``index`` (float64). O(k)."""
        raise NotImplementedError

    def _index(self, index: Any) -> torch.Tensor:
        size = self.size
        index = torch.as_tensor(index, device=self._trees.device)
        if index.is_floating_point() or index.is_complex() or index.dtype == torch.bool:
            raise TypeError(f"{self._name} index must hold integers, got dtype {index.dtype}")
        index = index.long()
        bad = (index < -size) | (index >= size)
        if bool(bad.any()):
            raise IndexError(
                f"{self._name} index out of range for {size} slots: {index[bad][:5].tolist()}"
            )
        return torch.where(index < 0, index + size, index)

    def _out(self, values: torch.Tensor, like: Any) -> Any:
        """``values`` (float64) in the type TorchRL's compiled tree returns for ``like``."""
        dtype = self._get_dtype()
        if isinstance(like, torch.Tensor) and like.ndim:
            return values.to(dtype)
        if isinstance(like, (np.ndarray, list, tuple)):
            return values.to(dtype).cpu().numpy()
        return float(values.to(dtype).reshape(()))

    def __getitem__(self, index: Any) -> Any:
        flat = self._index(index)
        return self._out(self._values(flat.reshape(-1)).reshape(flat.shape), index)

    def at(self, index: Any) -> Any:
        """Same as ``tree[index]``."""
        return self[index]

    def _reduce(self, values: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _whole(self) -> float:
        raise NotImplementedError

    def query(self, start: Any, end: Any) -> Any:
        """Reduction (sum or min) over slots ``[start, end)``; ranges are clipped to the slots.

        O(1) when the range covers every slot, else O(capacity). Tensors or arrays of bounds
        give one result per pair.
        """
        size = self.size
        lo = torch.as_tensor(start).long().cpu().reshape(-1).clamp(0, size)
        hi = torch.as_tensor(end).long().cpu().reshape(-1).clamp(0, size)
        lo, hi = torch.broadcast_tensors(lo, hi)
        if bool(((lo == 0) & (hi == size)).all()):
            out = torch.full(lo.shape, self._whole(), dtype=torch.float64)
        else:
            leaves = self._leaves().cpu()
            out = torch.stack(
                [self._reduce(leaves[a:b]) for a, b in zip(lo.tolist(), hi.tolist(), strict=True)]
            )
        shape = torch.as_tensor(start).shape
        out = out.reshape(shape).to(self._trees.device)
        return self._out(out, start)

    # ------------------------------------------------------------------ writes
    def __setitem__(self, index: Any, value: Any) -> None:
        raise TypeError(_READ_ONLY.format(name=self._name))

    def update(self, index: Any, value: Any) -> None:
        """Refused: the view is read-only."""
        raise TypeError(_READ_ONLY.format(name=self._name))


class SumTreeView(_TreeView):
    """``sampler._sum_tree``: the sampling mass ``(p + eps) ** alpha`` per slot (0 if unset).

    Example:
        >>> import torch
        >>> from fastreplay._core.trees.torch_backend import PriorityTrees
        >>> trees = PriorityTrees(7)
        >>> trees.update(torch.tensor([0, 3]), torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.0]))
        >>> view = SumTreeView(lambda: trees, lambda: torch.float32, lambda: 7)
        >>> view[3], view.query(0, 7), view.scan_lower_bound(1.0), view.scan_lower_bound(1.5)
        (2.0, 3.0, 0, 3)
        >>> view[torch.tensor([0, 1])]
        tensor([1., 0.])
    """

    _name = "_sum_tree"

    @property
    def identity_element(self) -> float:
        """0.0, the mass of a slot that holds no priority."""
        return 0.0

    def _leaves(self) -> torch.Tensor:
        return self._trees.leaf_mass()

    def _values(self, index: torch.Tensor) -> torch.Tensor:
        return self._trees.mass(index).to(torch.float64)

    def _reduce(self, values: torch.Tensor) -> torch.Tensor:
        return values.sum()

    def _whole(self) -> float:
        return self._trees.total()

    def scan_lower_bound(self, mass: Any) -> Any:
        """Smallest slot ``i`` with ``sum(tree[: i + 1]) >= mass``; ``size`` past the total.

        O(k log capacity). Floats give an int, arrays an int64 array, tensors a long tensor
        of the same shape.
        """
        trees = self._trees
        value = torch.as_tensor(mass, dtype=torch.float64, device=trees.device)
        flat = value.reshape(-1)
        total = trees.total()
        if flat.numel() == 0:
            found = flat.long()
        elif total > 0:
            # search() returns the smallest i with cumsum > prefix: step just below ``mass``.
            below = torch.nextafter(flat, flat.new_tensor(-math.inf))
            found = trees.search(below)
            found = torch.where(flat > total, self.size, found)
        else:
            found = torch.where(flat > 0, self.size, 0)
        found = found.reshape(value.shape)
        if isinstance(mass, torch.Tensor) and mass.ndim:
            return found
        if isinstance(mass, (np.ndarray, list, tuple)):
            return found.cpu().numpy()
        return int(found)


class MinTreeView(_TreeView):
    """``sampler._min_tree``: the mass per slot, the dtype's max where no priority is set.

    Example:
        >>> import torch
        >>> from fastreplay._core.trees.torch_backend import PriorityTrees
        >>> trees = PriorityTrees(7)
        >>> trees.update(torch.tensor([0, 3]), torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.0]))
        >>> view = MinTreeView(lambda: trees, lambda: torch.float32, lambda: 7)
        >>> view.query(0, 7), view.query(1, 4), view[1] == view.identity_element
        (1.0, 2.0, True)
    """

    _name = "_min_tree"

    @property
    def identity_element(self) -> float:
        """The dtype's largest finite value, as TorchRL's compiled min trees use."""
        return float(torch.finfo(self._get_dtype()).max)

    def _leaves(self) -> torch.Tensor:
        trees = self._trees
        return torch.where(trees.written(), trees.leaf_mass(), self.identity_element)

    def _values(self, index: torch.Tensor) -> torch.Tensor:
        trees = self._trees
        mass = trees.mass(index).to(torch.float64)
        zero = mass == 0
        if bool(zero.any()):  # unwritten, or written with mass 0 (eps=0): ask the mask
            unset = zero & ~trees.written().index_select(0, index)
            mass = torch.where(unset, self.identity_element, mass)
        return mass

    def _reduce(self, values: torch.Tensor) -> torch.Tensor:
        if values.numel() == 0:
            return torch.tensor(self.identity_element, dtype=torch.float64)
        return values.min()

    def _whole(self) -> float:
        value = self._trees.min_mass()
        return self.identity_element if value == math.inf else value


def max_priority(
    trees: PriorityTreeBackend,
    dtype: torch.dtype,
    all_time: tuple[float, int | None] | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """TorchRL's ``_max_priority`` pair: ``(max priority, its flat slot)``, or ``(None, None)``.

    Args:
        trees: the sampler's tree backend.
        dtype: the sampler's ``dtype``: that of the returned priority.
        all_time: ``None`` for the live max over stored items and its slot (the first slot
            holding it); else ``(all-time max, slot where it was set or None)``.

    Returns:
        0-dim tensors on the trees' device (the priority in ``dtype``). O(1), plus
        O(capacity) to find the slot of the live max.
    """
    if all_time is None:
        value = trees.max_raw()
        if value == -math.inf:
            return None, None
        index: int | None = int(torch.argmax(trees.raw()))
    else:
        value, index = all_time
        if value == -math.inf:
            return None, None
    device = trees.device
    priority = torch.tensor(value, dtype=dtype, device=device)
    slot = None if index is None else torch.tensor(index, device=device)
    return priority, slot


TREE_READ_ONLY = (
    "{name} is a read-only view of fastreplay's priority trees; use "
    "update_priority or load_state_dict to change priorities"
)
"""Message of the error assigning ``_sum_tree`` or ``_min_tree`` raises."""

MAX_PRIORITY_READ_ONLY = (
    "_max_priority is a read-only view in fastreplay: the max priority is derived "
    "from the stored priorities (see default_priority, upper_priority)"
)
"""Message of the error assigning ``_max_priority`` raises."""

"""Vectorized priority segment trees in pure torch (no TorchRL imports).

:class:`PriorityTrees` keeps three segment trees over ``capacity`` slots in one stack of
tensors, so every level of a batched update is a handful of torch ops whatever the batch:

* row 0, a **sum tree** over the sampling mass ``(p + eps) ** alpha`` (neutral ``0``);
* row 1, a **min tree** over the same mass (neutral ``+inf``), for the importance weights;
* row 2, a **negated-min tree** over the RAW priorities ``-p`` (neutral ``+inf``): its root is
  minus the live maximum raw priority of the written slots. Keeping raw values (not the mass)
  makes that maximum exact (no ``** (1 / alpha)`` round trip) and lets :meth:`retransform`
  re-derive the mass for a new ``alpha`` exactly, even from ``alpha == 0``. It is a negated
  *min* tree rather than a max tree so rows 1 and 2 share one ``amin`` per level.

The trees are ``branching``-ary (32 by default) rather than binary: 10M slots need 5 levels
above the leaves instead of 24, and on CPU each torch op costs microseconds, so the number of
levels (not the work per level) sets the cost of small batched updates.

All rows are float64 whatever the sampler's dtype: the caller rounds the mass to its own
dtype before writing, so leaves hold exactly what a float32 tree would, while internal sums
accumulate in float64.

Precision hazard (as in flashbax's sum tree): a parent sum and the running ``cumsum`` over its
children are computed in different orders, so a uniform draw just below the root can overshoot
every child by a rounding error and land on an empty (zero-mass) slot. :meth:`search` guards
against this: at each level it never descends past the last child with positive mass, so it
always returns a slot with positive mass when the root is positive.

Example:
    >>> import torch
    >>> trees = PriorityTrees(7)
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

import torch

__all__ = ["BACKENDS", "PriorityTrees", "available_backends", "make_trees"]

_INF = math.inf
# Batches larger than this dedupe parents per level (one sort, then ``unique_consecutive``);
# smaller ones skip that (two ops per call are cheaper than a few redundant reductions).
_DEDUPE_ABOVE = 256
# Writes of more than ``capacity / _BULK`` leaves copy the leaf rows in place and rebuild every
# internal node (O(capacity), no per-level temporaries) instead of walking their ancestors.
_BULK = 64


class PriorityTrees:
    """Sum, min and negated-min segment trees over ``capacity`` slots (CPU or CUDA).

    Args:
        capacity: number of leaf slots (any positive int, not only powers of two).
        device: where the trees live. Defaults to CPU.
        branching: fan-out of every internal node. Defaults to 32.

    Memory is ``3 * 8 * capacity * (1 + 1 / (branching - 1))`` bytes (about 24 bytes a slot).

    :func:`make_trees` builds these or :class:`fastreplay._segment_tree_numba.
    NumbaPriorityTrees` (same interface, compiled loops on the CPU); ``backend`` names which.

    Example:
        >>> import torch
        >>> trees = PriorityTrees(50, branching=4)
        >>> trees.update(torch.arange(50), torch.ones(50), torch.full((50,), 3.0))
        >>> trees.clear(torch.tensor([10]))
        >>> trees.total(), trees.written().sum().item()
        (49.0, 49)
    """

    backend = "torch"

    def __init__(
        self, capacity: int, *, device: torch.device | str | None = None, branching: int = 32
    ) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be a positive int, got capacity={capacity}")
        if branching < 2:
            raise ValueError(f"branching must be >= 2, got branching={branching}")
        self.capacity = int(capacity)
        self.branching = int(branching)
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self._neutral = torch.tensor([0.0, _INF, _INF], dtype=torch.float64, device=self.device)
        sizes = [math.ceil(self.capacity / branching) * branching]
        while sizes[-1] > 1:
            nodes = sizes[-1] // branching
            sizes.append(nodes if nodes == 1 else math.ceil(nodes / branching) * branching)
        # levels[0] holds the leaves, levels[-1] the root (shape (3, 1)).
        self.levels: list[torch.Tensor] = [
            self._neutral[:, None].expand(3, n).clone() for n in sizes
        ]
        self._strides = torch.tensor(
            [branching**depth for depth in range(1, len(sizes))], device=self.device
        )
        self._positions = torch.arange(branching, device=self.device)

    # ------------------------------------------------------------------ queries, O(1)
    def total(self) -> float:
        """Sum of the mass of every written slot (root of the sum tree). O(1)."""
        return float(self.levels[-1][0, 0])

    def min_mass(self) -> float:
        """Smallest mass over written slots, ``inf`` if none is written. O(1)."""
        return float(self.levels[-1][1, 0])

    def max_raw(self) -> float:
        """Largest raw priority over written slots, ``-inf`` if none is written. O(1)."""
        return -float(self.levels[-1][2, 0])

    def mass(self, index: torch.Tensor) -> torch.Tensor:
        """Mass stored at leaf ``index`` (0 for unwritten slots). O(k)."""
        return self.levels[0][0, index]

    def raw(self) -> torch.Tensor:
        """Raw priority of every slot (``-inf`` where unwritten), a new tensor. O(capacity)."""
        return -self.levels[0][2, : self.capacity]

    def leaf_mass(self) -> torch.Tensor:
        """Mass of every slot (0 where unwritten), a new tensor. O(capacity)."""
        return self.levels[0][0, : self.capacity].clone()

    def written(self) -> torch.Tensor:
        """Boolean mask of the slots that hold a priority. O(capacity)."""
        return self.levels[0][2, : self.capacity] != _INF

    # ------------------------------------------------------------------ updates
    def update(self, index: torch.Tensor, mass: torch.Tensor, raw: torch.Tensor) -> None:
        """Write ``mass`` and ``raw`` priorities at leaves ``index``; O(k log_B capacity).

        ``index`` must hold distinct, in-range slots (the caller dedupes); ``mass`` and ``raw``
        have the same length. Every level costs a fixed number of vectorized ops.
        """
        mass = mass.to(device=self.device, dtype=torch.float64).reshape(-1)
        raw = raw.to(device=self.device, dtype=torch.float64).reshape(-1)
        if index.numel() * _BULK > self.capacity:  # bulk: write rows in place, then rebuild
            index = index.to(device=self.device, dtype=torch.long).reshape(-1)
            leaves = self.levels[0]
            leaves[0].index_copy_(0, index, mass)
            leaves[1].index_copy_(0, index, mass)
            leaves[2].index_copy_(0, index, raw.neg())
            self.rebuild()
            return
        self._write(index, torch.stack([mass, mass, -raw]))

    def clear(self, index: torch.Tensor) -> None:
        """Reset leaves ``index`` to the neutral (unwritten) state; O(k log_B capacity)."""
        if index.numel() * _BULK > self.capacity:
            index = index.to(device=self.device, dtype=torch.long).reshape(-1)
            for row, value in enumerate((0.0, _INF, _INF)):
                self.levels[0][row].index_fill_(0, index, value)
            self.rebuild()
            return
        self._write(index, self._neutral[:, None].expand(3, index.numel()))

    def reset(self) -> None:
        """Reset every slot to unwritten. O(capacity)."""
        for level in self.levels:
            level.copy_(self._neutral[:, None].expand_as(level))

    def _write(self, index: torch.Tensor, leaves: torch.Tensor) -> None:
        index = index.to(device=self.device, dtype=torch.long).reshape(-1)
        self.levels[0].index_copy_(1, index, leaves)
        # Large batches: sort once so that each level's parents can be deduplicated with
        # ``unique_consecutive``; otherwise a level would re-reduce ``branching`` children per
        # leaf, O(k * branching) instead of O(k / branching ** depth).
        dedupe = index.numel() > _DEDUPE_ABOVE
        if dedupe:
            index = index.sort().values
        # Every ancestor index at once: row l holds the level-(l + 1) node of each leaf.
        ancestors = torch.div(index, self._strides[:, None], rounding_mode="floor")
        b = self.branching
        for depth, (child, parent) in enumerate(
            zip(self.levels[:-1], self.levels[1:], strict=True)
        ):
            node = torch.unique_consecutive(ancestors[depth]) if dedupe else ancestors[depth]
            # Duplicated parents (small batches) are fine: they write the same recomputed value.
            # (index_select / index_copy_: advanced indexing on dim 1 is ~300x slower on CPU.)
            group = child.view(3, -1, b).index_select(1, node)
            parent.index_copy_(1, node, torch.cat([group[:1].sum(-1), group[1:].amin(-1)]))

    def set_leaves(self, mass: torch.Tensor, raw: torch.Tensor) -> None:
        """Replace every leaf at once (``-inf`` raw marks unwritten) and rebuild. O(capacity)."""
        mass = mass.to(device=self.device, dtype=torch.float64).reshape(-1)
        raw = raw.to(device=self.device, dtype=torch.float64).reshape(-1)
        if mass.numel() != self.capacity or raw.numel() != self.capacity:
            raise ValueError(
                f"expected {self.capacity} leaves, got mass {tuple(mass.shape)} and raw "
                f"{tuple(raw.shape)}"
            )
        written = raw != -_INF
        leaves = self.levels[0]
        leaves[0, : self.capacity] = torch.where(written, mass, 0.0)
        leaves[1, : self.capacity] = torch.where(written, mass, _INF)
        leaves[2, : self.capacity] = -raw
        self.rebuild()

    def rebuild(self) -> None:
        """Recompute every internal node from the leaves, vectorized per level. O(capacity)."""
        b = self.branching
        for child, parent in zip(self.levels[:-1], self.levels[1:], strict=True):
            group = child.view(3, -1, b)
            n = group.shape[1]
            parent[0, :n] = group[0].sum(-1)
            parent[1:, :n] = group[1:].amin(-1)

    # ------------------------------------------------------------------ sampling
    def search(self, prefix: torch.Tensor, *, guard: bool = False) -> torch.Tensor:
        """Leaf of each prefix mass: smallest ``i`` with ``sum(mass[: i + 1]) > prefix``.

        One vectorized descent from the root: O(s log_B capacity) for ``s`` queries with a
        fixed number of torch ops per level. Prefixes at or beyond :meth:`total` return the
        last slot with positive mass, so the result always has positive mass while
        :meth:`total` is positive (see the module docstring for the rounding hazard): the
        fast descent checks its leaves (one op) and, if one has zero mass, redoes the search
        with ``guard=True``, which never descends past a node's last positive child.
        """
        b = self.branching
        prefix = original = prefix.to(device=self.device, dtype=torch.float64).reshape(-1)
        node = torch.zeros_like(prefix, dtype=torch.long)
        if len(self.levels) == 1 or prefix.numel() == 0:  # capacity 1: the root is the leaf
            return node
        for level in reversed(self.levels[:-1]):
            if not guard:  # an overshoot may have picked a padding node: stay in range
                node = node.clamp_max_(level.shape[1] // b - 1)
            children = level[0].view(-1, b).index_select(0, node)
            cumsum = children.cumsum(-1)
            # (batched 2-D torch.searchsorted is ~300x slower than this on CPU)
            choice = (cumsum <= prefix[:, None]).sum(-1, keepdim=True)
            if guard:
                last_positive = torch.where(children > 0, self._positions, 0).amax(-1)
                choice = torch.minimum(choice, last_positive[:, None])
            else:
                choice = choice.clamp_max_(b - 1)
            prefix = prefix - (cumsum - children).gather(1, choice)[:, 0]
            node = node.mul_(b).add_(choice[:, 0])
        if not guard and not (
            bool(self.levels[0][0].index_select(0, node).gt(0).all())
            and float(original.max()) < self.total()
        ):  # rare: rounding reached an empty slot, or a prefix beyond the total was clamped
            return self.search(original, guard=True)
        return node

    # ------------------------------------------------------------------ persistence
    def to(self, device: torch.device | str) -> PriorityTrees:
        """Move the trees to ``device`` in place and return ``self``. O(capacity)."""
        self.device = torch.device(device)
        self._neutral = self._neutral.to(self.device)
        self.levels = [level.to(self.device) for level in self.levels]
        self._strides = self._strides.to(self.device)
        self._positions = self._positions.to(self.device)
        return self


# ---------------------------------------------------------------------- backends
BACKENDS = ("torch", "numba")


def available_backends() -> tuple[str, ...]:
    """The tree backends that work in this environment (``"torch"`` always does)."""
    from fastreplay._segment_tree_numba import NUMBA_AVAILABLE

    return ("torch", "numba") if NUMBA_AVAILABLE else ("torch",)


def make_trees(
    capacity: int,
    *,
    backend: str | None = None,
    device: torch.device | str | None = None,
    branching: int | None = None,
) -> Any:
    """Build priority trees with the :class:`PriorityTrees` interface on ``backend``.

    Args:
        capacity: number of leaf slots.
        backend: ``"numba"`` (compiled loops, CPU only, needs the optional numba),
            ``"torch"`` (pure torch, any device) or ``None``: numba when it is installed and
            the trees live on the CPU, else torch.
        device: where the trees live (CPU by default).
        branching: fan-out of every internal node; ``None`` takes the backend's default
            (32 for torch, where the number of levels sets the cost; 8 for numba, where the
            memory touched per level does).

    Raises:
        ValueError: an unknown ``backend``, or one that cannot run here (numba missing, or
            a non-CPU ``device`` with ``backend="numba"``); the message says the fix.

    Example:
        >>> make_trees(7, backend="torch").backend
        'torch'
    """
    from fastreplay._segment_tree_numba import NUMBA_AVAILABLE, NumbaPriorityTrees

    if backend is not None and backend not in BACKENDS:
        raise ValueError(
            f"backend must be None, 'torch' or 'numba', got backend={backend!r}; None picks "
            "numba when it is installed and the trees are on the CPU"
        )
    on_cpu = device is None or torch.device(device).type == "cpu"
    if backend is None:
        backend = "numba" if NUMBA_AVAILABLE and on_cpu else "torch"
    if backend == "numba":
        if not NUMBA_AVAILABLE:
            raise ValueError(
                "backend='numba' needs the numba package, which is not installed: "
                "pip install 'fastreplay[fast]', or pass backend='torch' (or None)"
            )
        if not on_cpu:
            raise ValueError(
                f"backend='numba' keeps the priority trees on the CPU, got device={device}: "
                "pass backend='torch' (or None) for trees on another device"
            )
        return NumbaPriorityTrees(capacity, device=device, branching=branching or 8)
    return PriorityTrees(capacity, device=device, branching=branching or 32)

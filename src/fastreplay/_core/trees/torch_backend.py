"""Vectorized priority segment trees in pure torch (no TorchRL imports).

:class:`PriorityTrees` keeps three segment trees over ``capacity`` slots in one stack of
tensors, so every level of a batched update is a handful of torch ops whatever the batch:

* row 0, a **sum tree** over the sampling mass ``(p + eps) ** alpha`` (neutral ``0``);
* row 1, a **min tree** over the same mass (neutral ``+inf``), for the importance weights;
* row 2, a **negated-min tree** over the RAW priorities ``-p`` (neutral ``+inf``): its root is
  minus the live maximum raw priority, exact (no ``** (1 / alpha)`` round trip), and the mass
  can be re-derived for a new ``alpha`` exactly. Rows 1 and 2 share one ``amin`` per level.

The trees are ``branching``-ary (32 by default) and their root reduces a whole narrow level
(at most ``top`` nodes) at once: 10M slots need 3 levels above the leaves instead of 24. On
CPU each torch op costs microseconds, so the number of levels (not the work per level) sets
the cost of small batched writes and searches. All rows are float64: the caller rounds the
mass to its dtype first, so leaves hold what a float32 tree would; sums accumulate in float64.

Precision hazard (as in flashbax's sum tree): a parent sum and the running ``cumsum`` over its
children round differently, so a draw just below the total can overshoot every child and land
on an empty slot. :meth:`search` checks its leaves and then redoes such a search never
descending past a node's last positive child: it returns slots with positive mass.

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

from fastreplay._core.trees.ops import TorchTreeOps

__all__ = ["PriorityTrees"]

_INF = math.inf
# The root reduces the first level of at most this many nodes whole (per write one sum and one
# amin; per search one cumsum and one searchsorted): fewer levels, fewer ops.
_TOP = 16384
_SCRATCH_UP_TO = 4096  # scratch buffers of the write path are kept for batches up to this size
# Writes of more than ``capacity / _BULK`` leaves store the leaf rows and rebuild every node.
_BULK = 64
# Batched (2-D) ``torch.searchsorted`` is a single fast op from torch 2.15 on; before, it is
# ~1000x slower on CPU than a comparison and a count, which older versions use instead.
_BATCHED_SEARCHSORTED = tuple(int(v) for v in torch.__version__.split(".")[:2]) >= (2, 15)


class PriorityTrees(TorchTreeOps):
    """Sum, min and negated-min segment trees over ``capacity`` slots (CPU or CUDA).

    Args:
        capacity: number of leaf slots (any positive int, not only powers of two).
        device: where the trees live. Defaults to CPU.
        branching: fan-out of every internal node below the root. Defaults to 32.
        top: the root reduces the first level with at most ``top`` nodes (the leaves
            themselves if ``capacity <= top``). Defaults to 16384.

    Memory is ``3 * 8 * capacity * (1 + 1 / (branching - 1))`` bytes (about 24 bytes a slot).
    Not thread-safe: callers serialize writes and searches (the samplers hold a lock).

    Implements :class:`fastreplay._core.trees.interface.PriorityTreeBackend` (the sampler
    operations ``check_and_write``, ``mark_update`` and ``sample`` come from
    :class:`TorchTreeOps`), as :class:`fastreplay._core.trees.numba_backend.NumbaPriorityTrees`
    (compiled loops on the CPU) does.

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
        self,
        capacity: int,
        *,
        device: torch.device | str | None = None,
        branching: int = 32,
        top: int | None = None,
    ) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be a positive int, got capacity={capacity}")
        if branching < 2:
            raise ValueError(f"branching must be >= 2, got branching={branching}")
        self.capacity = int(capacity)
        self.branching = int(branching)
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        sizes = [self.capacity]
        top = _TOP if top is None else top
        while sizes[-1] > max(top, 1):  # pad to whole groups, then one node per group
            sizes[-1] = math.ceil(sizes[-1] / branching) * branching
            sizes.append(sizes[-1] // branching)
        sizes.append(1)
        # levels[0]: the leaves; levels[-1]: the root (3, 1), over all of levels[-2].
        neutral = torch.tensor([[0.0], [_INF], [_INF]], dtype=torch.float64, device=self.device)
        self.levels: list[torch.Tensor] = [neutral.expand(3, n).clone() for n in sizes]
        self._views()

    def _views(self) -> None:
        """Derive the views and constants of the hot paths (every op costs microseconds)."""
        b, levels, device = self.branching, self.levels, self.device
        self._neutral = torch.tensor([[0.0], [_INF], [_INF]], dtype=torch.float64, device=device)
        self._root = levels[-1][:, 0]
        self._leaf_rows = levels[0].unbind(0)
        self._scratch = self._leaf_rows[0].view(torch.long)  # same bytes, for _last_wins
        widths = [b] * (len(levels) - 2) + [levels[-2].shape[1]]
        self._groups = [level.view(3, -1, w) for level, w in zip(levels, widths, strict=False)]
        self._sum_groups = [group[0] for group in self._groups]
        self._top_row = self._sum_groups[-1][0]  # sums of the root's children
        # (sum input, min inputs, sum output, min outputs) to rebuild each parent level whole
        self._rebuilds = [
            (g[0], g[1:], parent[0, : g.shape[1]], parent[1:, : g.shape[1]])
            for g, parent in zip(self._groups, levels[1:], strict=True)
        ]
        # Writes recompute the written nodes' parents on every level below the root's.
        strides = [[b ** (depth + 1)] for depth in range(len(levels) - 2)]
        self._strides = torch.tensor(strides, dtype=torch.long, device=device)
        self._scratch_out: dict[int, tuple[torch.Tensor, ...]] = {}

    def __getstate__(self) -> dict[str, Any]:
        # Copies: pickling for another process (multiprocessing) would otherwise share the
        # levels' memory, and the two processes' trees would write each other's. O(capacity).
        state = {key: self.__dict__[key] for key in ("capacity", "branching", "device")}
        return {**state, "levels": [level.clone() for level in self.levels]}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._views()

    # ------------------------------------------------------------------ queries, O(1)
    def total(self) -> float:
        """Sum of the mass of every written slot (root of the sum tree). O(1)."""
        return self._root.tolist()[0]

    def min_mass(self) -> float:
        """Smallest mass over written slots, ``inf`` if none is written. O(1)."""
        return self._root.tolist()[1]

    def max_raw(self) -> float:
        """Largest raw priority over written slots, ``-inf`` if none is written. O(1)."""
        return -self._root.tolist()[2]

    def mass(self, index: torch.Tensor) -> torch.Tensor:
        """Mass stored at leaf ``index`` (0 for unwritten slots). O(k)."""
        if index.ndim == 1 and index.dtype == torch.long:
            return self._leaf_rows[0].index_select(0, index)
        return self.levels[0][0, index]

    def max_raw_of(self, index: torch.Tensor) -> float:
        """Largest raw priority among leaves ``index`` (``-inf`` if none is written). O(k)."""
        return -self._leaf_rows[2].index_select(0, index).amin().item()

    def raw(self) -> torch.Tensor:
        """Raw priority of every slot (``-inf`` where unwritten), a new tensor. O(capacity)."""
        return -self.levels[0][2, : self.capacity]

    def leaf_mass(self) -> torch.Tensor:
        """Mass of every slot (0 where unwritten), a new tensor. O(capacity)."""
        return self.levels[0][0, : self.capacity].clone()

    def written(self) -> torch.Tensor:
        """Boolean mask of the slots that hold a priority. O(capacity)."""
        return self.levels[0][2, : self.capacity] != _INF

    def prefix(self, n: int) -> tuple[float, float]:
        """``(sum, min)`` of the mass over slots ``[0, n)`` (min ``inf`` if none is written).

        O(n), vectorized.
        """
        leaves = self.levels[0]
        if n <= 0:
            return 0.0, _INF
        return leaves[0, :n].sum().item(), leaves[1, :n].amin().item()

    # ------------------------------------------------------------------ updates
    def update(
        self,
        index: torch.Tensor,
        mass: torch.Tensor | float,
        raw: torch.Tensor | float,
        *,
        rebuild: bool = True,
    ) -> None:
        """Write ``mass`` and ``raw`` (one per index, or one for all) at in-range leaves ``index``.

        O(k log_B capacity), a fixed number of ops per level; a repeated slot takes its last
        value. Writes of over ``capacity / 64`` slots store the leaves, then rebuild every node
        (O(capacity)); ``rebuild=False`` leaves that to the caller's :meth:`rebuild`.
        """
        index = self._index(index)
        if isinstance(mass, torch.Tensor) and isinstance(raw, torch.Tensor):
            mass = mass if mass.device == self.device else mass.to(self.device)
            mass = mass if mass.ndim == 1 else mass.reshape(-1)
            if index.numel() * _BULK > self.capacity or not rebuild:  # no (3, k) temporaries
                mass = self._float(mass)
                self._write_bulk(index, [mass, mass, self._float(raw).neg()], rebuild)
                return
            leaves = torch.stack([mass, mass, self._float(raw).neg()])  # float64 whatever mass
        else:  # floats: one value for all
            values = [[float(mass)], [float(mass)], [-float(raw)]]
            leaves = torch.tensor(values, dtype=torch.float64, device=self.device)
        self._write(index, leaves, rebuild)

    def _write(self, index: torch.Tensor, leaves: torch.Tensor, rebuild: bool = True) -> None:
        """Write leaf columns ``leaves`` (3, k), or one column for all, at ``index``."""
        k = index.numel()
        if k * _BULK > self.capacity or not rebuild:
            self._write_bulk(index, list(leaves), rebuild)
        elif k:
            if leaves.shape[1] == 1:  # one value for all: repeats write the same value
                leaves = leaves.expand(3, k)
            elif k > 1:
                leaves = leaves.index_select(1, self._last_wins(index))
            self.levels[0].index_copy_(1, index, leaves)
            self._propagate(index)

    def _write_bulk(self, index: torch.Tensor, rows: list[torch.Tensor], rebuild: bool) -> None:
        """Store leaf rows (one value each, or one per index) sorted: streaming stores."""
        if rows[2].numel() > 1:  # sorted (stable) slots, the last of each run kept
            index, order = index.sort(stable=True)
            last = torch.ones_like(index, dtype=torch.bool)
            torch.ne(index[1:], index[:-1], out=last[:-1])
            keep = last.nonzero().squeeze(1)
            index, order = index.index_select(0, keep), order.index_select(0, keep)
            del last, keep
            mass = rows[0].index_select(0, order)  # rows 0 and 1: the same mass, gathered once
            same = rows[1] is rows[0]
            rows = [
                mass,
                mass if same else rows[1].index_select(0, order),
                rows[2].index_select(0, order),
            ]
        for row, values in zip(self._leaf_rows, rows, strict=True):
            row.index_copy_(0, index, values.expand(index.numel()))
        if rebuild:
            self.rebuild()

    def clear(self, index: torch.Tensor) -> None:
        """Reset leaves ``index`` to the neutral (unwritten) state; O(k log_B capacity)."""
        self._write(self._index(index), self._neutral)

    def reset(self) -> None:
        """Reset every slot to unwritten. O(capacity)."""
        for level in self.levels:
            level.copy_(self._neutral.expand_as(level))

    def _index(self, index: torch.Tensor) -> torch.Tensor:
        if index.dtype != torch.long or index.device != self.device:
            index = index.to(device=self.device, dtype=torch.long)
        return index if index.ndim == 1 else index.reshape(-1)

    def _float(self, values: torch.Tensor) -> torch.Tensor:
        if values.dtype != torch.float64 or values.device != self.device:
            values = values.to(device=self.device, dtype=torch.float64)
        return values if values.ndim == 1 else values.reshape(-1)

    def _last_wins(self, index: torch.Tensor) -> torch.Tensor:
        """Position of the last occurrence of each entry's slot: ``index[p[i]] == index[i]``.

        O(k), no sort: the leaf sum row serves as scratch (the caller overwrites those slots
        next) and a deterministic ``amax`` scatter keeps the largest position per slot.
        """
        position = self._scratch_for(index.numel())[-1]
        self._scratch.scatter_reduce_(0, index, position, "amax", include_self=False)
        return self._scratch.index_select(0, index)

    def _propagate(self, index: torch.Tensor) -> None:
        """Recompute the ancestors of leaves ``index`` (repeats allowed), bottom up."""
        if len(self.levels) > 2:
            nodes = torch.div(index, self._strides, rounding_mode="floor")
            group, sums, mins, value, sum_out, min_out, _ = self._scratch_for(index.numel())
            for depth, node in enumerate(nodes.unbind(0)):
                # (index_select / index_copy_: advanced indexing on dim 1 is ~300x slower.)
                torch.index_select(self._groups[depth], 1, node, out=group)
                torch.sum(sums, -1, out=sum_out)
                torch.amin(mins, -1, out=min_out)
                self.levels[depth + 1].index_copy_(1, node, value)
        sums, mins, sum_out, min_out = self._rebuilds[-1]  # the root: one reduction
        torch.sum(sums, -1, out=sum_out)
        torch.amin(mins, -1, out=min_out)

    def _scratch_for(self, k: int) -> tuple[torch.Tensor, ...]:
        """Buffers (with row views) for k gathered groups and their values; positions 0..k-1."""
        found = self._scratch_out.get(k)
        if found is None:
            group = torch.empty(3, k, self.branching, dtype=torch.float64, device=self.device)
            value = torch.empty(3, k, dtype=torch.float64, device=self.device)
            position = torch.arange(k, device=self.device)
            found = (group, group[0], group[1:], value, value[0], value[1:], position)
            if k <= _SCRATCH_UP_TO:  # the usual batch sizes repeat: keep a few
                self._scratch_out = {**dict(list(self._scratch_out.items())[-3:]), k: found}
        return found

    def set_leaves(self, mass: torch.Tensor, raw: torch.Tensor) -> None:
        """Replace every leaf at once (``-inf`` raw marks unwritten) and rebuild. O(capacity)."""
        mass, raw = self._float(mass), self._float(raw)
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
        for sums, mins, sum_out, min_out in self._rebuilds:
            torch.sum(sums, -1, out=sum_out)
            torch.amin(mins, -1, out=min_out)

    # ------------------------------------------------------------------ sampling
    def search(self, prefix: torch.Tensor, *, guard: bool = False) -> torch.Tensor:
        """Leaf of each prefix mass: smallest ``i`` with ``sum(mass[: i + 1]) > prefix``.

        O(s log_B capacity), a fixed number of torch ops per level. Prefixes at or beyond
        :meth:`total` give the last slot with positive mass; found slots have positive mass
        while :meth:`total` is (``guard=True``: the module docstring's rounding guard only).
        """
        prefix = self._float(prefix)
        if guard:
            return self._guarded(prefix)
        return self.search_with_mass(prefix)[0]

    def search_with_mass(self, prefix: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`search`, plus the mass of each found leaf (float64). O(s log_B capacity)."""
        prefix = self._float(prefix)
        total = self.total()
        if prefix.numel() == 0 or not total > 0:
            node = self._guarded(prefix)
            return node, self.mass(node)
        # just below the total: a prefix rounded up to it lands on the last positive slot
        node = self._descend(prefix.clamp_max(math.nextafter(total, 0.0)))
        mass = self._leaf_rows[0].index_select(0, node)
        if not mass.amin().item() > 0:  # rare: rounding reached an empty slot
            node = self._guarded(prefix)
            mass = self._leaf_rows[0].index_select(0, node)
        return node, mass

    def _descend(self, prefix: torch.Tensor) -> torch.Tensor:
        """Fast descent: one flat search over a narrow level, then group by group below it."""
        b, row = self.branching, self._top_row
        cumsum = row.cumsum(0)
        node = torch.searchsorted(cumsum, prefix, right=True).clamp_max_(row.numel() - 1)
        if len(self.levels) == 2:
            return node
        column = (prefix - (cumsum - row).index_select(0, node)).view(-1, 1)
        for depth in range(len(self.levels) - 3, -1, -1):
            children = self._sum_groups[depth].index_select(0, node)
            cumsum = children.cumsum(1)
            if _BATCHED_SEARCHSORTED:
                choice = torch.searchsorted(cumsum, column, right=True)
            else:
                choice = (cumsum <= column).sum(1, keepdim=True)
            choice = choice.clamp_max_(b - 1)  # an overshoot stays in its group
            if depth:
                column = column - (cumsum - children).gather(1, choice)
            node = torch.add(choice.view(-1), node, alpha=b)
        return node

    def _guarded(self, prefix: torch.Tensor) -> torch.Tensor:
        """Descent that never passes a node's last positive child. O(s log_B capacity)."""
        node = torch.zeros_like(prefix, dtype=torch.long)
        if prefix.numel() == 0:
            return node
        for groups in reversed(self._sum_groups):
            width = groups.shape[1]
            children = groups.index_select(0, node)
            cumsum = children.cumsum(-1)
            choice = (cumsum <= prefix[:, None]).sum(-1, keepdim=True)
            positions = torch.arange(width, device=self.device)
            last_positive = torch.where(children > 0, positions, 0).amax(-1)
            choice = torch.minimum(choice, last_positive[:, None])
            prefix = prefix - (cumsum - children).gather(1, choice)[:, 0]
            node = node.mul_(width).add_(choice[:, 0])
        return node

    # ------------------------------------------------------------------ persistence
    def to(self, device: torch.device | str) -> PriorityTrees:
        """Move the trees to ``device`` in place and return ``self``. O(capacity)."""
        self.device = torch.device(device)
        self.levels = [level.to(self.device) for level in self.levels]
        self._views()
        return self

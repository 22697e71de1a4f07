"""Epoch permutation drawn lazily: the items of ``range(n)`` without replacement (pure core).

A Fisher-Yates shuffle run only as far as it is read. The epoch's remaining items sit at
positions ``head .. end - 1`` of a virtual array whose entry at position ``p`` is ``p`` unless
a swap wrote another item there. Each draw takes ``k`` distinct positions uniformly among the
remaining ones, returns their items and moves the untaken items of the next ``k`` positions
into the holes, so that:

* a draw of ``k`` items costs ``O(k)`` (``O(k log k)`` with the de-duplication), whatever ``n``;
* starting an epoch costs ``O(items drawn in the previous epoch)``, never ``O(n)``;
* memory is ``O(n)`` ``int64`` slots, grown by doubling.

Every draw is a uniformly random ordered ``k``-subset of the remaining items, so an epoch read
to the end is a uniformly random permutation of ``range(n)``.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["EpochPermutation"]


class EpochPermutation:
    """The remaining items of one epoch over ``range(n)``, drawn ``k`` at a time.

    Example:
        >>> import torch
        >>> perm = EpochPermutation()
        >>> perm.reset(10)
        >>> first = perm.draw(4, torch.Generator().manual_seed(0))
        >>> rest = perm.draw(6, torch.Generator().manual_seed(1))
        >>> sorted(first.tolist() + rest.tolist()), perm.remaining
        ([0, 1, 2, 3, 4, 5, 6, 7, 8, 9], 0)
        >>> perm.reset(5)
        >>> perm.take(3).tolist(), perm.rest().tolist()  # in order, as shuffle=False
        ([0, 1, 2], [3, 4])
    """

    def __init__(self) -> None:
        # slots[p] == 0: position p holds item p; else it holds item slots[p] - 1.
        self._slots = np.zeros(16, dtype=np.int64)
        self._touched: list[np.ndarray] = []  # positions written since the last reset
        self._picked: np.ndarray | None = None  # the last draw's positions, not yet settled
        self.head = self.end = 0

    @property
    def remaining(self) -> int:
        """Items not yet drawn in this epoch."""
        return self.end - self.head

    def reset(self, n: int) -> None:
        """Start a new epoch over ``range(n)``: ``O(items drawn in the previous epoch)``."""
        if n > self._slots.shape[0]:
            self._slots = np.zeros(max(n, 2 * self._slots.shape[0]), dtype=np.int64)
        elif self._touched:
            self._slots[np.concatenate(self._touched)] = 0
        self._touched, self._picked = [], None
        self.head, self.end = 0, int(n)

    def _items(self, positions: np.ndarray) -> np.ndarray:
        if not self._touched:  # no swap yet this epoch: every position holds its own item
            return positions
        slots = self._slots[positions]
        return np.where(slots > 0, slots - 1, positions)

    def _settle(self) -> None:
        """Finish the last draw's swaps (left until needed: an epoch often ends first).

        The ``k`` positions before ``head`` are consumed: their items that were not picked
        move into the picked positions at or after ``head`` (Fisher-Yates, ``k`` at once).
        """
        picked, self._picked = self._picked, None
        if picked is None:
            return
        k = picked.size
        front = picked < self.head
        holes = picked[~front]
        if holes.size:
            untaken = np.ones(k, dtype=bool)
            untaken[picked[front] - (self.head - k)] = False
            movers = self.head - k + np.flatnonzero(untaken)
            self._slots[holes] = self._items(movers) + 1
            self._touched.append(holes)

    def take(self, k: int) -> np.ndarray:
        """The next ``min(k, remaining)`` items in position order (no shuffle): ``O(k)``."""
        self._settle()
        positions = np.arange(self.head, min(self.head + k, self.end))
        self.head += positions.size
        return self._items(positions)

    def draw(self, k: int, generator: torch.Generator | None) -> np.ndarray:
        """``min(k, remaining)`` items drawn uniformly without replacement, in draw order.

        Random numbers come from ``generator`` (``None``: torch's default generator).
        Cost ``O(k log k)``.
        """
        self._settle()
        k = min(k, self.remaining)
        picked = self.head + self._distinct(k, self.remaining, generator)
        items = self._items(picked)
        self.head += k
        self._picked = picked
        return items

    @staticmethod
    def _distinct(k: int, n: int, generator: torch.Generator | None) -> np.ndarray:
        """``k`` distinct values of ``range(n)``, a uniformly random ordered ``k``-subset.

        The first ``k`` distinct values of a stream of independent uniform draws: each new
        value is uniform among those not yet seen. Past half of ``n``, a permutation's prefix.
        """
        if 2 * k >= n:
            return torch.randperm(n, generator=generator)[:k].numpy()
        batch = k + 2 * k * k // n + 8  # enough draws for k distinct values, most of the time
        draws = torch.randint(n, (batch,), generator=generator).numpy()
        while True:
            order = np.argsort(draws, kind="stable")
            ranked = draws[order]
            first = np.empty(ranked.size, dtype=bool)
            first[0] = True
            np.not_equal(ranked[1:], ranked[:-1], out=first[1:])
            distinct = np.count_nonzero(first)
            if distinct == draws.size:  # no repeat (the usual case when n >> k * k)
                return draws[:k]
            if distinct >= k:  # first occurrences, back in draw order
                return draws[np.sort(order[first])[:k]]
            more = torch.randint(n, (batch,), generator=generator).numpy()
            draws = np.concatenate([draws, more])

    def rest(self) -> np.ndarray:
        """The remaining items, in position order: ``O(remaining)``."""
        self._settle()
        return self._items(np.arange(self.head, self.end))

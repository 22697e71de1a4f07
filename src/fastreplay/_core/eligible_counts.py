"""Which trajectories of a column are long enough, for any number of lengths (pure core).

A column's trajectories carry *serials* (0, 1, 2, ... in age order; the oldest ones are
dropped as the storage wraps). For a ``min_length``, a trajectory is *eligible* when it is
closed (not the newest, still growing, one) and at least ``min_length`` long. Closed
trajectories keep their length, except the oldest, which shrinks as its rows are overwritten.

:class:`EligibleCounts` answers "how many are eligible" and "which is the ``k``-th eligible in
age order" for every ``min_length`` a sampler asks for, from one row of counts per length:
serials are grouped in blocks of :data:`BLOCK`, and the row holds, per block, the running
number of eligible trajectories up to that block's end. Selection is a ``searchsorted`` in the
row and a scan of one block's lengths per rank: ``O(batch x BLOCK)``, independent of the
number of trajectories. A row costs ``8 / BLOCK`` bytes per trajectory, is built once in one
vectorized pass (``O(trajectories)``) and then follows the writes: ``O(1)`` amortised per
trajectory closed or dropped, per length kept. Rows are kept for the most recently used
lengths while they fit a memory budget (least recently used dropped first).

:class:`Eligibility` adds, for the (at most :data:`EXACT`) lengths used most, an exact ring of
their eligible serials: an ``O(batch)`` select. A length gets one when the last :data:`RECENT`
selects asked for at most :data:`EXACT` lengths, and (for every ring after a column's first)
the block scans spent on it since it last had none add up to a ring build
(``O(trajectories)``): a sampler that keeps to one or two lengths pays the build once, after
:data:`RECENT` selects, and one rotating among more lengths builds no ring and keeps the
``O(batch x BLOCK)`` selects, with no rebuild per sample.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import numpy as np

from fastreplay._core.rings import Serials

__all__ = ["BLOCK", "EXACT", "EligibleCounts", "Eligibility"]

BLOCK = 32  # trajectories per block: a select scans one block per rank
EXACT = 2  # lengths with an exact ring of eligible serials
RECENT = 4  # selects that decide whether a sampler keeps to a few lengths


class EligibleCounts:
    """Running counts of eligible closed trajectories per block of serials, one row per length.

    All rows cover the same blocks: ``first_block`` to ``first_block + count - 1`` (the blocks
    of the stored closed trajectories), at columns ``head ..`` of ``cum``. For the row of a
    length, ``cum[row, head + i]`` is ``origin + (eligible closed trajectories up to the end of
    block first_block + i, dropped ones included)``; ``dropped[row]`` is ``origin + (eligible
    ones since dropped)`` and ``total[row]`` the value of the newest block, so that
    ``total - dropped`` trajectories are eligible now. A trajectory is counted with the length
    it has when it closes; the oldest one, when it shrinks below the length, counts as dropped.

    Args:
        budget: Callable returning the most bytes the rows may take (read at each new row
            and each growth); the least recently used lengths are dropped to fit, but the row
            in use is always kept.
    """

    def __init__(self, budget: Callable[[], int]) -> None:
        self.budget = budget
        self.rows: dict[int, int] = {}  # min_length -> row of ``cum``, least recent first
        self.lengths = np.zeros(0, dtype=np.int64)  # min_length of each row (0: free)
        self.cum = np.zeros((0, 16), dtype=np.int64)
        self.dropped = np.zeros(0, dtype=np.int64)
        self.total = np.zeros(0, dtype=np.int64)
        self.steps = np.zeros(0, dtype=np.int64)  # steps of the eligible closed, stored now
        self.head = self.count = self.first_block = 0
        self.builds = 0  # rows built from all the stored lengths (O(trajectories) each)

    @property
    def nbytes(self) -> int:
        """Bytes held by the rows and their per-row counters."""
        counters = self.lengths.nbytes + self.dropped.nbytes + self.total.nbytes
        return self.cum.nbytes + counters + self.steps.nbytes

    # ------------------------------------------------------------------ rows of lengths
    def row(self, min_length: int, first_serial: int, closed: Callable[[], np.ndarray]) -> int:
        """The row of ``min_length``; built from ``closed()`` if missing.

        ``closed()`` returns the lengths of the closed trajectories in age order, from the
        oldest (serial ``first_serial``). ``O(1)`` when the row is kept; otherwise one
        vectorized pass over them (``O(trajectories)``).
        """
        row = self.rows.pop(min_length, None)
        if row is None:
            row = self._build(min_length, first_serial, closed())
        self.rows[min_length] = row  # most recently used last
        return row

    def _build(self, min_length: int, first_serial: int, closed: np.ndarray) -> int:
        k = closed.shape[0]
        capacity = self.cum.shape[1]
        if not self.rows:  # no row follows the writes: lay the blocks out afresh
            self.first_block, self.head = first_serial // BLOCK, 0
            self.count = (first_serial + k - 1) // BLOCK - self.first_block + 1 if k else 0
            capacity = max(capacity, 2 * self.count)
        allowed = max(1, self.budget() // (capacity * 8))
        while len(self.rows) >= allowed:  # least recently used first
            self.lengths[self.rows.pop(next(iter(self.rows)))] = 0
        if capacity != self.cum.shape[1] or len(self.rows) >= self.cum.shape[0]:
            self._layout(min(allowed, max(4, self.cum.shape[0], 2 * len(self.rows))), capacity)
        row = int(np.flatnonzero(self.lengths == 0)[0])
        counted = np.zeros(k + 1, dtype=np.int64)  # eligible among the first i closed
        np.cumsum(closed >= min_length, out=counted[1:])
        ends = np.minimum(
            (self.first_block + np.arange(1, self.count + 1)) * BLOCK, first_serial + k
        )
        self.cum[row, self.head : self.head + self.count] = counted[ends - first_serial]
        self.lengths[row], self.dropped[row], self.total[row] = min_length, 0, counted[-1]
        self.steps[row] = int(closed[closed >= min_length].sum())
        self.builds += 1
        return row

    def _layout(self, rows: int, capacity: int) -> np.ndarray:
        """Reallocate as ``rows`` rows of ``capacity`` blocks, the live blocks first.

        Keeps the ``rows`` most recently used lengths (all when they fit): ``O(rows x
        capacity)``. Returns the former rows of the kept lengths, in their new order.
        """
        kept = list(self.rows.items())[-rows:]
        old = np.array([r for _, r in kept], dtype=np.int64)
        cum = np.zeros((rows, capacity), dtype=np.int64)
        if old.size:
            cum[: old.size, : self.count] = self.cum[old, self.head : self.head + self.count]
        lengths, dropped, total, steps = (np.zeros(rows, dtype=np.int64) for _ in range(4))
        lengths[: old.size] = self.lengths[old]
        dropped[: old.size], total[: old.size] = self.dropped[old], self.total[old]
        steps[: old.size] = self.steps[old]
        self.cum, self.lengths, self.dropped, self.total, self.steps, self.head = (
            cum,
            lengths,
            dropped,
            total,
            steps,
            0,
        )
        self.rows = {length: i for i, (length, _) in enumerate(kept)}
        return old

    # ------------------------------------------------------------------ following writes
    def closed(self, first_serial: int, lengths: np.ndarray) -> None:
        """Trajectories ``first_serial, first_serial + 1, ...`` closed with ``lengths``.

        ``O(len(lengths) x rows)`` in one vectorized pass.
        """
        k = lengths.shape[0]
        if not self.rows or not k:
            return
        first = first_serial // BLOCK
        last = (first_serial + k - 1) // BLOCK
        long_enough = lengths[None, :] >= self.lengths[:, None]
        self.steps += (long_enough * lengths[None, :]).sum(axis=1)
        counted = np.cumsum(long_enough, axis=1)
        ends = np.minimum(np.arange(first + 1, last + 2) * BLOCK, first_serial + k)
        values = self.total[:, None] + counted[:, ends - first_serial - 1]  # each block's end
        if self.count and self.first_block + self.count - 1 == first:  # the last block grows
            self.cum[:, self.head + self.count - 1] = values[:, 0]
            values = values[:, 1:]
        elif not self.count:
            self.first_block, self.head = first, 0
        self._push(values)
        self.total = self.cum[:, self.head + self.count - 1].copy()

    def _push(self, values: np.ndarray) -> None:
        n = values.shape[1]
        if self.head + self.count + n > self.cum.shape[1]:
            capacity = self.cum.shape[1]
            if self.count + n > capacity // 2:  # grow; else move the live blocks to the front
                capacity = max(2 * capacity, self.count + n)
            allowed = max(1, self.budget() // (capacity * 8))
            kept = self._layout(min(allowed, self.cum.shape[0]), capacity)
            values = np.concatenate(
                [values[kept], np.zeros((len(self.lengths) - kept.size, n), dtype=np.int64)]
            )
        self.cum[:, self.head + self.count : self.head + self.count + n] = values
        self.count += n

    def trimmed(
        self, first_serial: int, removed: np.ndarray, head_before: int, head_after: int
    ) -> None:
        """The oldest trajectories ``removed`` (their lengths) dropped, the new oldest shrunk.

        ``first_serial`` is the new oldest trajectory's serial; ``head_before``/``head_after``
        its length before and after (pass equal values when it is the newest, not closed).
        ``O(len(removed) x rows)``.
        """
        if not self.rows:
            return
        gone_long = removed[None, :] >= self.lengths[:, None]
        self.dropped += np.count_nonzero(gone_long, axis=1)
        self.steps -= (gone_long * removed[None, :]).sum(axis=1)
        was, still = head_before >= self.lengths, head_after >= self.lengths
        self.dropped += was & ~still
        self.steps -= np.where(still, head_before - head_after, head_before) * was
        gone = min(self.count, max(0, first_serial // BLOCK - self.first_block))
        self.head, self.count, self.first_block = (
            self.head + gone,
            self.count - gone,
            self.first_block + gone,
        )

    # ------------------------------------------------------------------------ queries
    def eligible_steps(self, row: int) -> int:
        """Steps stored in the eligible closed trajectories for the length of ``row``: ``O(1)``."""
        return int(self.steps[row])

    def eligible(self, row: int) -> int:
        """Number of eligible closed trajectories for the length of ``row``: ``O(1)``."""
        return int(self.total[row] - self.dropped[row])

    def rank(
        self,
        row: int,
        position: int,
        first_serial: int,
        length_at: Callable[[np.ndarray], np.ndarray],
    ) -> int:
        """Eligible closed trajectories among the ``position`` oldest stored: ``O(BLOCK)``."""
        block = min((first_serial + position) // BLOCK - self.first_block, self.count)
        if block >= self.count:  # past the last closed trajectory: all of them
            return self.eligible(row)
        before = self.cum[row, self.head + block - 1] if block > 0 else self.dropped[row]
        begin = max((self.first_block + block) * BLOCK - first_serial, 0)
        inside = length_at(np.arange(begin, position)) >= self.lengths[row]
        return int(before - self.dropped[row]) + int(np.count_nonzero(inside))

    def select(
        self,
        row: int,
        ranks: np.ndarray,
        first_serial: int,
        closed: int,
        length_at: Callable[[np.ndarray], np.ndarray],
    ) -> np.ndarray:
        """Age-order positions (0: the oldest stored) of the eligible ranked ``ranks``.

        Args:
            row: The length's row (from :meth:`row`).
            ranks: Ranks among the eligible closed trajectories, each in ``[0, eligible)``.
            first_serial: Serial of the oldest stored trajectory.
            closed: Number of closed trajectories stored.
            length_at: Lengths of the trajectories at age-order positions (any shape).

        Returns:
            Positions shaped like ``ranks``: ``O(len(ranks) x BLOCK)``, a ``searchsorted`` in
            the row and a scan of one block per rank.
        """
        target = ranks + self.dropped[row]
        cum = self.cum[row, self.head : self.head + self.count]
        block = np.searchsorted(cum, target, side="right")
        before = np.where(block > 0, cum[np.maximum(block - 1, 0)], self.dropped[row])
        begin = np.maximum((self.first_block + block) * BLOCK - first_serial, 0)
        stop = np.minimum((self.first_block + block + 1) * BLOCK - first_serial, closed)
        position = begin[:, None] + np.arange(BLOCK)
        inside = position < stop[:, None]
        np.minimum(position, closed - 1, out=position)
        eligible = inside & (length_at(position) >= self.lengths[row])
        seen = np.cumsum(eligible, axis=1, dtype=np.int32)
        return begin + np.argmax(seen > (target - before)[:, None], axis=1)


class Eligibility:
    """Eligible trajectories of one column for any ``min_length``: counts and selection.

    Every length asked for has a row in :class:`EligibleCounts` (``O(batch x BLOCK)``
    selects); the :data:`EXACT` most recently promoted also have an exact ring of serials
    (``O(batch)`` selects), promoted while the recent selects keep to at most :data:`EXACT`
    lengths (after a column's first ring, once their block scans add up to a ring build).

    Args:
        budget: The most bytes :class:`EligibleCounts` may take (a callable, read when needed).
    """

    def __init__(self, budget: Callable[[], int]) -> None:
        self.counts = EligibleCounts(budget)
        self.exact: dict[int, Serials] = {}  # least recently used first
        self.credit: dict[int, int] = {}  # block-scan work per length since it had no ring
        self.recent: deque[int] = deque(maxlen=RECENT)  # lengths of the last selects
        self.exact_builds = 0

    @property
    def nbytes(self) -> int:
        """Bytes held by the counts and the exact rings."""
        return self.counts.nbytes + sum(ring.data.nbytes for ring in self.exact.values())

    def closed(self, first_serial: int, lengths: np.ndarray) -> None:
        """Trajectories ``first_serial, ...`` closed with ``lengths``: ``O(len(lengths))`` each."""
        self.counts.closed(first_serial, lengths)
        for min_length, ring in self.exact.items():
            ring.push(first_serial + np.flatnonzero(lengths >= min_length))

    def trimmed(
        self, first_serial: int, removed: np.ndarray, head_before: int, head_after: int
    ) -> None:
        """See :meth:`EligibleCounts.trimmed`; ``O(len(removed))`` per length kept."""
        self.counts.trimmed(first_serial, removed, head_before, head_after)
        for min_length, ring in self.exact.items():
            ring.trim(first_serial, head_after, min_length)

    def count(self, min_length: int, first_serial: int, closed: Callable[[], np.ndarray]) -> int:
        """Eligible closed trajectories: ``O(1)`` (plus a row build the first time)."""
        ring = self.exact.get(min_length)
        if ring is not None:
            return ring.count
        return self.counts.eligible(self.counts.row(min_length, first_serial, closed))

    def steps(self, min_length: int, first_serial: int, closed: Callable[[], np.ndarray]) -> int:
        """Steps stored in the eligible closed trajectories: ``O(1)`` (plus a row build)."""
        return self.counts.eligible_steps(self.counts.row(min_length, first_serial, closed))

    def rank(
        self,
        min_length: int,
        position: int,
        first_serial: int,
        lengths: Callable[[], np.ndarray],
        length_at: Callable[[np.ndarray], np.ndarray],
    ) -> int:
        """Eligible closed trajectories among the ``position`` oldest stored.

        ``position`` is at most the number of closed trajectories. ``O(log n)`` with an exact
        ring, else ``O(BLOCK)``.
        """
        ring = self.exact.get(min_length)
        if ring is not None:
            live = ring.data[ring.head : ring.head + ring.count]
            return int(np.searchsorted(live, first_serial + position))
        row = self.counts.row(min_length, first_serial, lengths)
        return self.counts.rank(row, position, first_serial, length_at)

    def select(
        self,
        min_length: int,
        ranks: np.ndarray,
        first_serial: int,
        closed: int,
        lengths: Callable[[], np.ndarray],
        length_at: Callable[[np.ndarray], np.ndarray],
    ) -> np.ndarray:
        """Age-order positions of the eligible closed trajectories ranked ``ranks``.

        Args:
            min_length: The length.
            ranks: Ranks among the eligible closed trajectories, each in ``[0, count)``.
            first_serial: Serial of the oldest stored trajectory.
            closed: Number of closed trajectories stored.
            lengths: Returns the closed trajectories' lengths in age order (called only to
                build a row or a ring).
            length_at: Lengths at age-order positions (any shape).

        Returns:
            Positions shaped like ``ranks``: ``O(len(ranks))`` with an exact ring, else
            ``O(len(ranks) x BLOCK)`` (and, once the scans add up to it, an ``O(trajectories)``
            ring build).
        """
        ring = self.exact.pop(min_length, None)
        if ring is not None:
            self.exact[min_length] = ring  # most recently used last
            return ring.data[ring.head + ranks] - first_serial
        row = self.counts.row(min_length, first_serial, lengths)
        positions = self.counts.select(row, ranks, first_serial, closed, length_at)
        self.recent.append(min_length)
        spent = self.credit.get(min_length, 0) + ranks.size * BLOCK
        # A ring build reads each closed length once, about twice a scanned one's cost; and
        # only lengths that alone (or with one other) make the recent selects get a ring.
        # The first ring is built as soon as the recent selects keep to a few lengths (the
        # common sampler, whose later selects are then O(batch) at any size); a later one once
        # the scans add up to its build, so that switching lengths cannot churn rings.
        owed = self.exact_builds and spent < 2 * closed
        if owed or len(self.recent) < RECENT or len(set(self.recent)) > EXACT:
            self.credit[min_length] = spent
            if len(self.credit) > 4 * len(self.counts.rows) + 16:  # forget dropped lengths
                self.credit = {k: v for k, v in self.credit.items() if k in self.counts.rows}
            return positions
        self.credit.pop(min_length, None)  # the scans paid for a ring: build it
        self.exact[min_length] = Serials(first_serial + np.flatnonzero(lengths() >= min_length))
        self.exact_builds += 1
        if len(self.exact) > EXACT:
            self.exact.pop(next(iter(self.exact)))
        return positions

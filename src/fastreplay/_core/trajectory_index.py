"""Incremental trajectory-boundary index over a circular storage (pure core, no TorchRL).

The storage is viewed as ``rows`` time rows (dim 0, circular) times ``columns`` independent
columns (the flattened trailing batch dims of an ``ndim > 1`` storage, e.g. parallel
environments). Rows are written sequentially, wrapping at ``rows``. Each column keeps its
trajectories in age order in a growable ring, so that:

* a write of ``n`` rows costs ``O(n * columns)`` (plus ``O(1)`` amortised per trajectory
  created or overwritten), never ``O(rows)``;
* memory is ``O(number of trajectories)``;
* the ``k``-th trajectory in TorchRL's order (column-major, then by stop row) is found in
  ``O(1)`` after an ``O(log n)`` search per column, so sampling costs ``O(batch)``.

The boundaries are exactly those ``torchrl.data.SliceSampler`` recovers from the whole storage:
the last written row (the cursor) ends a trajectory, the row after it starts one, and a
trajectory may run across the end of the storage back to row 0.
"""

from __future__ import annotations

import numpy as np

from fastreplay._core.eligible_counts import Eligibility
from fastreplay._core.rings import Ring

__all__ = ["TrajectoryIndex"]


class _Column:
    """Trajectories of one column: ring of ``(serial, start_row, length)`` in age order.

    Beside it, a ring of each trajectory's start *position* (rows ever written to the column
    before it, so positions only grow): one contiguous column for ``searchsorted``.
    """

    def __init__(self) -> None:
        self.trajs = Ring(3)
        self.positions = Ring(1)
        self.next_serial = 0
        self.written = 0  # position of the next row written
        self.closed = True  # done mode: whether the last written row ended its trajectory
        self.last_id = 0  # ids mode: trajectory id of the last written row
        # per min_length asked for: which closed trajectories (all but the newest) are at
        # least that long; rows may take as much memory as the records, or 1 MiB
        self.eligible = Eligibility(lambda: max(1 << 20, self.trajs.data.nbytes))

    def last(self) -> np.ndarray:
        return self.trajs.data[self.trajs.slot(self.trajs.count - 1)]

    def first_serial(self) -> int:
        return int(self.trajs.data[self.trajs.head, 0])

    def append(self, first_row: int, starts: np.ndarray, rows: int) -> None:
        """Record ``len(starts)`` rows written from ``first_row``.

        ``starts[i]`` says row ``i`` begins a trajectory. Cost ``O(len(starts) + created)``.
        """
        n = starts.shape[0]
        if self.trajs.count == 0:
            starts[0] = True
        pos = np.flatnonzero(starts)
        head_rows = int(pos[0]) if pos.size else n
        written, self.written = self.written, self.written + n
        if head_rows:  # rows continuing the newest trajectory
            self.trajs.data[self.trajs.slot(self.trajs.count - 1), 2] += head_rows
        if not pos.size:
            return
        k = pos.size
        lengths = np.diff(np.append(pos, n))
        serials = self.next_serial + np.arange(k, dtype=np.int64)
        new = np.stack([serials, (first_row + pos) % rows, lengths], 1)
        # Trajectories closed by this write: the previous newest one, and all new but the last.
        closed = new[:-1]
        if self.trajs.count:
            closed = np.concatenate([self.last()[None], closed])
        self.trajs.push(new)
        self.positions.push((written + pos)[:, None])
        self.next_serial += k
        if closed.shape[0]:
            self.eligible.closed(int(closed[0, 0]), closed[:, 2])

    def trim(self, overflow: int, rows: int) -> None:
        """Forget the ``overflow`` oldest rows (overwritten): ``O(trajectories removed)``."""
        if overflow <= 0:
            return
        k = min(self.trajs.count, overflow)
        lengths = self.trajs.take(np.arange(k))[:, 2]
        cum = np.cumsum(lengths)
        removed = int(np.searchsorted(cum, overflow, side="right"))
        self.trajs.pop(removed)
        self.positions.pop(removed)
        left = overflow - (int(cum[removed - 1]) if removed else 0)
        slot = self.trajs.head
        before = int(self.trajs.data[slot, 2])
        self.trajs.data[slot, 1] = (self.trajs.data[slot, 1] + left) % rows
        self.trajs.data[slot, 2] -= left
        self.positions.data[self.positions.head, 0] += left
        after = before - left if self.trajs.count > 1 else before  # the newest is not closed
        self.eligible.trimmed(self.first_serial(), lengths[:removed], before, after)

    def _lengths_at(self, logical: np.ndarray) -> np.ndarray:
        """Lengths of the trajectories at age-order positions ``logical`` (any shape)."""
        slots = logical + self.trajs.head
        slots[slots >= self.trajs.data.shape[0]] -= self.trajs.data.shape[0]
        return self.trajs.data[slots, 2]

    def eligible_records(self, min_length: int, logical: np.ndarray) -> np.ndarray:
        """Records of the eligible trajectories at age-order positions ``logical``.

        ``O(len(logical))`` for ``min_length <= 1`` and the lengths used most, else
        ``O(len(logical) x BLOCK)`` (:mod:`fastreplay._core.eligible_counts`).
        """
        if min_length <= 1:  # every trajectory: no eligibility counts needed
            return self.trajs.take(logical)
        first, closed = self.first_serial(), self.trajs.count - 1
        in_closed = logical < self.eligible.count(min_length, first, self._closed_lengths)
        positions = np.full(logical.shape, closed, dtype=np.int64)  # the newest trajectory
        positions[in_closed] = self.eligible.select(
            min_length, logical[in_closed], first, closed, self._closed_lengths, self._lengths_at
        )
        return self.trajs.take(positions)

    def _closed_lengths(self) -> np.ndarray:
        """Lengths of the closed trajectories in age order: two slices of the ring."""
        data, head, closed = self.trajs.data, self.trajs.head, max(self.trajs.count - 1, 0)
        wrapped = max(head + closed - data.shape[0], 0)
        return np.concatenate([data[head : head + closed - wrapped, 2], data[:wrapped, 2]])

    def eligible_rank(self, min_length: int, position: int) -> int:
        """Eligible trajectories among the ``position`` oldest (not the newest): ``O(BLOCK)``."""
        first = self.first_serial()
        return self.eligible.rank(
            min_length, position, first, self._closed_lengths, self._lengths_at
        )

    def eligible_count(self, min_length: int) -> int:
        """Trajectories at least ``min_length`` long: ``O(1)`` once the length has counts."""
        if not self.trajs.count or min_length <= 1:
            return self.trajs.count
        closed = self.eligible.count(min_length, self.first_serial(), self._closed_lengths)
        return closed + int(self.last()[2] >= min_length)

    def eligible_steps(self, min_length: int, stored: int) -> int:
        """Steps in the trajectories at least ``min_length`` long (``stored``: all steps)."""
        if not self.trajs.count or min_length <= 1:
            return stored if self.trajs.count else 0
        newest = int(self.last()[2])
        closed = self.eligible.steps(min_length, self.first_serial(), self._closed_lengths)
        return closed + (newest if newest >= min_length else 0)


class TrajectoryIndex:
    """Trajectory boundaries of a circular ``[rows, columns]`` storage, updated per write.

    Args:
        rows: storage length along the time dimension (where writes wrap around).
        columns: number of independent columns (product of the trailing batch dims).
        mode: ``"done"`` (signals are end-of-trajectory flags) or ``"ids"`` (signals are
            trajectory ids; a trajectory ends where the id changes).

    Example:
        >>> import numpy as np
        >>> index = TrajectoryIndex(rows=10, columns=1, mode="done")
        >>> done = np.zeros((13, 1), dtype=bool)
        >>> done[[2, 7]] = True
        >>> index.write(0, done)  # 13 rows into 10: rows 0-2 are written twice
        >>> start, stop, length, column = index.boundaries()
        >>> start.tolist(), stop.tolist(), length.tolist()
        ([8, 3], [2, 7], [5, 5])
    """

    def __init__(self, rows: int, columns: int, mode: str) -> None:
        if mode not in ("done", "ids"):
            raise ValueError(f"mode must be 'done' or 'ids', got mode={mode!r}.")
        self.rows, self.columns, self.mode = int(rows), int(columns), mode
        self.reset()

    def reset(self) -> None:
        """Forget everything (an empty storage)."""
        self.size = 0  # rows holding data
        self.cursor = -1  # last written row
        self.cols = [_Column() for _ in range(self.columns)]
        self._rotation: dict[tuple[int, int], int] = {}

    @property
    def num_trajectories(self) -> int:
        """Number of stored trajectories (all columns)."""
        return sum(c.trajs.count for c in self.cols)

    def nbytes(self) -> int:
        """Bytes held by the index arrays (``O(number of trajectories)``)."""
        return sum(
            c.trajs.data.nbytes + c.positions.data.nbytes + c.eligible.nbytes for c in self.cols
        )

    def write(self, first_row: int, signal: np.ndarray) -> None:
        """Record rows ``first_row, first_row + 1, ...`` (mod ``rows``) written with ``signal``.

        ``first_row`` must follow the last written row (``(cursor + 1) % rows``) or the index
        must be empty. Cost ``O(len(signal) * columns)``.

        Args:
            first_row: first row written.
            signal: ``[n, columns]`` done flags (bool) or trajectory ids (integers).
        """
        n = signal.shape[0]
        if not n:
            return
        if self.size and first_row != (self.cursor + 1) % self.rows:
            raise ValueError(
                f"first_row={first_row} does not follow the last written row {self.cursor}; "
                "call reset() and write the storage from its oldest row."
            )
        if n > self.rows:  # only the last `rows` rows survive
            keep = signal[n - self.rows :]
            prev = signal[n - self.rows - 1]
            self.reset()
            first_row = (first_row + n - self.rows) % self.rows
            signal, n = keep, self.rows
            starts = self._starts(signal, prev)
        else:
            starts = self._starts(signal, None)
        for c, column in enumerate(self.cols):
            column.append(first_row, starts[:, c], self.rows)
        self.size += n
        overflow = self.size - self.rows
        if overflow > 0:
            for column in self.cols:
                column.trim(overflow, self.rows)
            self.size = self.rows
        self.cursor = (first_row + n - 1) % self.rows
        self._rotation.clear()

    def _starts(self, signal: np.ndarray, prev: np.ndarray | None) -> np.ndarray:
        starts = np.empty(signal.shape, dtype=bool)
        if self.mode == "done":
            starts[1:] = signal[:-1]
            starts[0] = prev if prev is not None else [c.closed for c in self.cols]
            for c, column in enumerate(self.cols):
                column.closed = bool(signal[-1, c])
        else:
            starts[1:] = signal[1:] != signal[:-1]
            last = prev if prev is not None else np.array([c.last_id for c in self.cols])
            starts[0] = signal[0] != last
            for c, column in enumerate(self.cols):
                column.last_id = signal[-1, c].item()
        return starts

    def _rotation_of(self, c: int, min_length: int) -> int:
        """Eligible trajectories of column ``c`` whose stop row is after the cursor.

        They come first in age order and last in TorchRL's order (sorted by stop row). For all
        trajectories, a 64-way search: ``O(log n / log 64)`` vectorized probes (one while
        nothing wrapped); for ``min_length > 1``, the eligible ones among those
        (``O(BLOCK)``). Cached until the next write.
        """
        key = (c, min_length)
        if key not in self._rotation:
            column = self.cols[c]
            if min_length > 1:
                rank = column.eligible_rank(min_length, self._rotation_of(c, 1))
                self._rotation[key] = rank
                return rank
            lo, hi = 0, column.trajs.count
            while lo < hi:  # the answer lies in lo .. hi
                probes = lo + np.arange(min(64, hi - lo)) * (hi - lo) // min(64, hi - lo)
                records = column.trajs.take(probes)
                after = (records[:, 1] + records[:, 2] - 1) % self.rows > self.cursor
                ahead = int(np.count_nonzero(after))  # a prefix of the probes
                if ahead:
                    lo = int(probes[ahead - 1]) + 1
                if ahead < probes.size:
                    hi = int(probes[ahead])
            self._rotation[key] = lo
        return self._rotation[key]

    def counts(self, min_length: int) -> np.ndarray:
        """Per-column number of trajectories at least ``min_length`` long (``O(columns)``)."""
        return np.array([c.eligible_count(min_length) for c in self.cols], dtype=np.int64)

    def windows(self, length: int) -> np.ndarray:
        """Per-column number of runs of ``length`` steps inside one trajectory (``O(columns)``).

        ``sum(max(0, L - length + 1))`` over the trajectory lengths ``L``: TorchRL's count of
        the slices that can start (``SliceSampler._sampleable_count``, ``strict_length=True``).
        """
        return np.array(
            [
                c.eligible_steps(length, self.size) - (length - 1) * c.eligible_count(length)
                for c in self.cols
            ],
            dtype=np.int64,
        )

    def select(self, ranks: np.ndarray, min_length: int) -> tuple[np.ndarray, ...]:
        """Trajectories at ``ranks`` in TorchRL's order among those ``>= min_length`` long.

        Cost ``O(len(ranks) + columns)`` (plus a cached ``O(log n)`` search per column).

        Returns:
            ``(start_row, length, column)`` arrays shaped like ``ranks``.
        """
        if self.columns == 1:  # 1-D storage: no per-column bookkeeping
            count = self.cols[0].eligible_count(min_length)
            logical = (ranks + self._rotation_of(0, min_length)) % count
            records = self.cols[0].eligible_records(min_length, logical)
            return records[:, 1], records[:, 2], np.zeros(ranks.shape, dtype=np.int64)
        counts = self.counts(min_length)
        ends = np.cumsum(counts)
        col = np.searchsorted(ends, ranks, side="right")
        local = ranks - (ends[col] - counts[col])
        start = np.empty(ranks.shape, dtype=np.int64)
        length = np.empty(ranks.shape, dtype=np.int64)
        for c in np.unique(col).tolist():
            mask = col == c
            logical = (local[mask] + self._rotation_of(c, min_length)) % counts[c]
            records = self.cols[c].eligible_records(min_length, logical)
            start[mask], length[mask] = records[:, 1], records[:, 2]
        return start, length, col

    def boundaries(self) -> tuple[np.ndarray, ...]:
        """All trajectories in TorchRL's order (``O(number of trajectories)``).

        Returns:
            ``(start_row, stop_row, length, column)`` arrays.
        """
        parts = []
        for c, column in enumerate(self.cols):
            n = column.trajs.count
            logical = (np.arange(n) + self._rotation_of(c, 1)) % max(n, 1)
            records = column.trajs.take(logical)
            parts.append(np.stack([records[:, 1], records[:, 2], np.full(n, c)], 1))
        allrec = np.concatenate(parts) if parts else np.empty((0, 3), dtype=np.int64)
        start, length, col = allrec[:, 0], allrec[:, 1], allrec[:, 2]
        return start, (start + length - 1) % self.rows, length, col

    def locate(self, rows: np.ndarray, columns: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Start row and length of the trajectory holding each stored ``(row, column)``.

        A ``searchsorted`` of each row's write position among the trajectories' start
        positions (sorted: they grow with age): cost ``O(len(rows) * log(number of
        trajectories))`` in a few vectorized calls, independent of the number of rows.
        Every ``(row, column)`` must hold data.

        Example:
            >>> import numpy as np
            >>> index = TrajectoryIndex(rows=10, columns=1, mode="ids")
            >>> index.write(0, np.array([[0], [0], [0], [1], [1], [2]]))
            >>> start, length = index.locate(np.array([1, 4, 5]), np.zeros(3, dtype=np.int64))
            >>> start.tolist(), length.tolist()
            ([0, 3, 5], [3, 2, 1])
        """
        start = np.empty(rows.shape, dtype=np.int64)
        length = np.empty(rows.shape, dtype=np.int64)
        for c in np.unique(columns).tolist() if self.columns > 1 else [0]:
            mask = columns == c
            trajs, ring = self.cols[c].trajs, self.cols[c].positions
            oldest_row, oldest = trajs.data[trajs.head, 1], ring.data[ring.head, 0]
            position = oldest + (rows[mask] - oldest_row) % self.rows
            # The ring holds the start positions in age order in at most two sorted pieces;
            # find the last trajectory starting at or before each position.
            cap, head = ring.data.shape[0], ring.head
            first = ring.data[head : min(head + ring.count, cap), 0]
            second = ring.data[: max(head + ring.count - cap, 0), 0]
            found = np.searchsorted(first, position, side="right") - 1
            if second.size:
                later = position >= second[0]
                found[later] = first.size - 1 + np.searchsorted(second, position[later], "right")
            records = trajs.take(found)
            start[mask], length[mask] = records[:, 1], records[:, 2]
        return start, length

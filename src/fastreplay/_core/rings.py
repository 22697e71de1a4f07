"""Growable FIFO rings of ``int64`` records (pure core): the trajectory index's storage.

:class:`Ring` holds fixed-width records (a trajectory's serial, start row and length; a start
position); :class:`Serials` holds increasing serials in one contiguous run, for
``searchsorted``. Pushes and pops are amortised ``O(1)`` per record.
"""

from __future__ import annotations

import numpy as np

__all__ = ["Ring", "Serials"]


class Ring:
    """Growable FIFO ring of ``int64`` records with ``width`` fields (amortised O(1) ops)."""

    def __init__(self, width: int, capacity: int = 16) -> None:
        self.data = np.empty((capacity, width), dtype=np.int64)
        self.head = 0
        self.count = 0

    def _grow(self, needed: int) -> None:
        cap = self.data.shape[0]
        if needed <= cap:
            return
        new_cap = max(needed, 2 * cap)
        new = np.empty((new_cap, self.data.shape[1]), dtype=np.int64)
        new[: self.count] = self.take(np.arange(self.count))
        self.data, self.head = new, 0

    def push(self, records: np.ndarray) -> None:
        """Append ``records`` (shape ``[k, width]``) at the back."""
        k = records.shape[0]
        if not k:
            return
        self._grow(self.count + k)
        slots = (self.head + self.count + np.arange(k)) % self.data.shape[0]
        self.data[slots] = records
        self.count += k

    def pop(self, k: int) -> None:
        """Drop the ``k`` oldest records."""
        self.head = (self.head + k) % self.data.shape[0]
        self.count -= k

    def slot(self, i: int) -> int:
        return (self.head + i) % self.data.shape[0]

    def take(self, logical: np.ndarray) -> np.ndarray:
        """Records at logical positions ``logical`` (0 is the oldest)."""
        return self.data[(self.head + logical) % self.data.shape[0]]


class Serials:
    """Growable FIFO of increasing ``int64`` serials, contiguous (amortised ``O(1)`` ops)."""

    def __init__(self, serials: np.ndarray) -> None:
        self.data = np.empty(max(16, 2 * serials.size), dtype=np.int64)
        self.data[: serials.size] = serials
        self.head, self.count = 0, serials.size

    def push(self, serials: np.ndarray) -> None:
        n, end = serials.size, self.head + self.count
        if end + n > self.data.size:  # grow, or move the live serials to the front
            size = self.data.size
            if self.count + n > size // 2:
                size = max(2 * size, 2 * (self.count + n))
            data = np.empty(size, dtype=np.int64)
            data[: self.count] = self.data[self.head : end]
            self.data, self.head, end = data, 0, self.count
        self.data[end : end + n] = serials
        self.count += n

    def trim(self, first_serial: int, head_after: int, min_length: int) -> None:
        """Drop the serials before ``first_serial``, and it if now shorter than the length."""
        live = self.data[self.head : self.head + self.count]
        gone = int(np.searchsorted(live, first_serial))
        if gone < live.size and live[gone] == first_serial and head_after < min_length:
            gone += 1
        self.head, self.count = self.head + gone, self.count - gone

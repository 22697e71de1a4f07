"""Stored items grouped by the version that wrote them, drawn by staleness (no TorchRL imports).

A staleness-aware sampler gives item ``i`` the weight ``w(c - v_i)``: ``c`` is the consumer
version, ``v_i`` the policy version stored with the item, ``w`` any elementwise function.
Every weight changes when ``c`` moves, so a sum tree over the items would be rewritten whole at
each step. Items written by the same version share a weight, though: with ``V`` distinct
versions stored, :class:`VersionBuckets` keeps one *bucket* per version (its items in an array,
each item's position in it) and a sum tree over the buckets (a
:class:`fastreplay._core.trees.interface.PriorityTreeBackend`, numba or pure torch) whose leaf
``b`` holds ``count_b * w(c - v_b)``. Then, exactly:

* a write of ``k`` items moves each to its new bucket: O(k) amortized, plus O(log V) per bucket
  whose count changed;
* a change of ``c``, of the gate or of ``w`` recomputes the ``V`` bucket weights (one call of
  ``w`` on ``V`` values, then every leaf): O(V);
* each draw picks a bucket by its mass in O(log V) (the tree), then an item of it uniformly in
  O(1): ``P(i) = count_b w_b / sum_b' count_b' w_b' * 1 / count_b = w(c - v_i) / sum_j w(c - v_j)``.

Draws without replacement (``torch.multinomial(..., replacement=False)``, successive sampling:
each draw proportional to the weights of the items not drawn yet) go in rounds: draw the
missing number with replacement, keep the first occurrence of each new item in draw order
(a repeat is a rejected draw, and rejecting the drawn items is drawing from the rest), then
take the kept items out of their buckets (moved past the bucket's live part, the leaf mass
lowered) for the next round; the buckets are restored at the end. O(batch log V) per round;
a round keeps at least one item.

Versions are keyed by their float32 value, as TorchRL computes staleness from
``versions.float()``: two versions that round to the same float32 share a weight there too.

Example:
    >>> import numpy as np, torch
    >>> buckets = VersionBuckets(7, backend="torch")
    >>> buckets.write(np.arange(5), np.array([0, 0, 1, 1, 2], dtype=np.float32))
    >>> buckets.refresh(lambda s: 1.0 / (s + 1.0), 2, -1)
    True
    >>> probs = buckets.probabilities()  # 1/3, 1/3, 1/2, 1/2, 1 over their sum
    >>> [round(p * 8, 6) for p in probs.tolist()]
    [1.0, 1.0, 1.5, 1.5, 3.0, 0.0, 0.0]
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from fastreplay._core.trees.interface import PriorityTreeBackend, make_trees

__all__ = ["VersionBuckets"]

_FIRST_BUCKETS = 64  # leaves of the first bucket tree; doubled when more versions are stored


class VersionBuckets:
    """Items ``[0, slots)`` grouped by float32 version, with a sum tree over the groups.

    Args:
        slots: number of item positions (the storage's capacity).
        backend: tree backend, ``"numba"``, ``"torch"`` or ``None`` (numba when installed).

    Memory: about 16 bytes per slot (bucket and position per item, the bucket arrays) plus
    O(V) for the buckets. Not thread-safe: the sampler serializes calls.
    """

    def __init__(self, slots: int, *, backend: str | None = None) -> None:
        self.slots = int(slots)
        self.backend_choice = backend
        self._idx = np.int32 if self.slots < 2**31 - 1 else np.int64
        self.bucket_of = np.full(self.slots, -1, np.int32)  # -1: no item at this slot
        self.pos = np.zeros(self.slots, self._idx)
        self._by_key: dict[int, int] = {}  # float32 bits -> bucket
        self._free: list[int] = []
        self._members: list[np.ndarray] = []
        self._keys = np.zeros(0, np.float32)
        self._count = np.zeros(0, np.int64)
        self._weight = np.zeros(0, np.float64)  # w(c - v_b) of valid buckets, 0 otherwise
        self._valid = np.zeros(0, bool)
        self.trees: PriorityTreeBackend = make_trees(_FIRST_BUCKETS, backend=backend)
        self.current = False  # the weights and leaves match the last refresh's arguments
        self.n_valid = 0  # items that pass the gate
        self.n_positive = 0  # items that pass it with a positive weight

    @property
    def backend(self) -> str:
        """The tree backend in use (``"numba"`` or ``"torch"``)."""
        return self.trees.backend

    @property
    def n_versions(self) -> int:
        """Distinct float32 versions stored (``V``). O(1)."""
        return len(self._by_key)

    # ------------------------------------------------------------------ writes
    def _new_bucket(self, bits: int, key: np.float32) -> int:
        if self._free:
            b = self._free.pop()
            self._members[b] = np.zeros(0, self._idx)
        else:
            b = len(self._members)
            self._members.append(np.zeros(0, self._idx))
            self._keys = np.append(self._keys, np.float32(0))
            self._count = np.append(self._count, 0)
            self._weight = np.append(self._weight, 0.0)
            self._valid = np.append(self._valid, False)
            if b >= self.trees.capacity:
                self._grow_trees(2 * self.trees.capacity)
        self._keys[b], self._by_key[bits] = key, b
        self.current = False  # a new version: its weight is computed at the next refresh
        return b

    def _grow_trees(self, capacity: int) -> None:
        mass = torch.zeros(capacity, dtype=torch.float64)
        raw = torch.full((capacity,), -torch.inf, dtype=torch.float64)
        old = self.trees.leaf_mass()
        mass[: old.numel()] = old
        raw[: old.numel()] = torch.where(self.trees.written(), old, -torch.inf)
        self.trees = make_trees(capacity, backend=self.backend_choice)
        self.trees.set_leaves(mass, raw)

    def _to_tail(self, b: int, live: int, at: np.ndarray) -> None:
        """Move the members at positions ``at`` (distinct, ``< live``) to ``[live - k, live)``."""
        members, k = self._members[b], at.size
        end = live - k
        holes = at[at < end]
        tail = np.arange(end, live, dtype=self._idx)
        movers = tail[~np.isin(tail, at)]
        held = members[holes].copy()
        members[holes] = members[movers]
        members[movers] = held
        self.pos[members[holes]] = holes
        self.pos[members[movers]] = movers

    def _set_leaves(self, buckets: np.ndarray, live: np.ndarray) -> None:
        """Leaf mass ``live * weight`` of ``buckets`` (cleared where 0). O(k log V)."""
        mass = live * self._weight[buckets]
        keep = mass > 0
        index = torch.from_numpy(buckets.astype(np.int64))
        if keep.any():
            m = torch.from_numpy(mass[keep])
            self.trees.update(index[torch.from_numpy(keep)], m, m)
        if not keep.all():
            self.trees.clear(index[torch.from_numpy(~keep)])

    def _recount(self, b: int, delta: int) -> None:
        self._count[b] += delta
        if self.current and self._valid[b]:
            self.n_valid += delta
            if self._weight[b] > 0:
                self.n_positive += delta

    def write(self, slots: np.ndarray, versions: np.ndarray) -> None:
        """Store float32 ``versions`` at distinct item ``slots``. O(k) + O(log V) per bucket.

        An item already stored leaves its bucket (overwrite); one whose version is unchanged
        stays.
        """
        slots = np.asarray(slots, np.int64)
        keys = np.ascontiguousarray(versions, np.float32)
        bits = keys.view(np.int32)
        old = self.bucket_of[slots]
        stored = old >= 0
        same = stored.copy()
        same[stored] = self._keys[old[stored]].view(np.int32) == bits[stored]
        moved = stored & ~same
        touched: set[int] = set()
        if moved.any():
            gone, at = old[moved], self.pos[slots[moved]]
            order = np.argsort(gone, kind="stable")
            gone, at = gone[order], at[order]
            cuts = np.flatnonzero(np.diff(gone)) + 1
            for group, where in zip(np.split(gone, cuts), np.split(at, cuts), strict=True):
                b = int(group[0])
                self._to_tail(b, int(self._count[b]), where)
                self._recount(b, -where.size)
                touched.add(b)
        new = ~same
        if new.any():
            slots, bits, keys = slots[new], bits[new], keys[new]
            uniq, first, inverse = np.unique(bits, return_index=True, return_inverse=True)
            order = np.argsort(inverse, kind="stable")
            cuts = np.flatnonzero(np.diff(inverse[order])) + 1
            for u, f, group in zip(uniq.tolist(), first, np.split(order, cuts), strict=True):
                b = self._by_key.get(u)
                if b is None:
                    b = self._new_bucket(u, keys[f])
                items, count = slots[group], int(self._count[b])
                members = self._members[b]
                if count + items.size > members.size:
                    grown = np.empty(max(2 * members.size, count + items.size), self._idx)
                    grown[:count] = members[:count]
                    self._members[b] = members = grown
                members[count : count + items.size] = items
                self.pos[items] = np.arange(count, count + items.size, dtype=self._idx)
                self.bucket_of[items] = b
                self._recount(b, items.size)
                touched.add(b)
        empty = [b for b in touched if self._count[b] == 0]
        for b in empty:  # a version no item holds any more
            del self._by_key[int(self._keys[b : b + 1].view(np.int32)[0])]
            self._free.append(b)
            self._members[b] = np.zeros(0, self._idx)
            self._weight[b], self._valid[b] = 0.0, False
        if self.current and touched:
            buckets = np.fromiter(touched, np.int64)
            self._set_leaves(buckets, self._count[buckets])

    def rebuild(self, versions: np.ndarray) -> None:
        """Hold exactly the items ``[0, n)``, of float32 ``versions`` (length ``n``). O(n log n)."""
        self.__init__(self.slots, backend=self.backend_choice)  # type: ignore[misc]  # reset
        n = versions.size
        if not n:
            return
        bits = np.ascontiguousarray(versions, np.float32).view(np.int32)
        uniq, first, inverse, counts = np.unique(
            bits, return_index=True, return_inverse=True, return_counts=True
        )
        order = np.argsort(inverse, kind="stable").astype(self._idx)
        starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
        self.bucket_of[:n] = inverse
        self.pos[order] = (np.arange(n) - np.repeat(starts, counts)).astype(self._idx)
        v = uniq.size
        spans = zip(starts.tolist(), counts.tolist(), strict=True)
        self._members = [order[s : s + c] for s, c in spans]
        self._keys = bits[first].view(np.float32).copy()
        self._count = counts.astype(np.int64)
        self._weight, self._valid = np.zeros(v), np.zeros(v, bool)
        self._by_key = dict(zip(uniq.tolist(), range(v), strict=True))
        if v > self.trees.capacity:
            self.trees = make_trees(max(v, 2 * _FIRST_BUCKETS), backend=self.backend_choice)

    # ------------------------------------------------------------------ weights
    def staleness(self, consumer: Any, keys: np.ndarray | None = None) -> torch.Tensor:
        """``consumer - version`` as TorchRL computes it (float32 tensor arithmetic)."""
        versions = torch.from_numpy(self._keys if keys is None else keys)
        return consumer - versions

    def refresh(self, weight_fn: Callable, consumer: Any, max_staleness: Any) -> bool:
        """Recompute every bucket's weight and leaf. O(V) (one ``weight_fn`` call).

        Returns ``False`` (nothing changed) where ``weight_fn`` returns anything but a tensor
        of its input's shape, a gated-in weight is NaN, infinite or negative, or every weight
        is 0: TorchRL's ``torch.multinomial`` raises then, and the
        caller lets TorchRL's code raise it.
        """
        live = self._count > 0
        stale = self.staleness(consumer)
        valid = live & ((stale <= max_staleness).numpy() if max_staleness >= 0 else True)
        weight = np.zeros(self._keys.size)
        if valid.any():
            given = stale[torch.from_numpy(valid)]
            w = weight_fn(given)
            if not isinstance(w, torch.Tensor) or w.shape != given.shape:
                return False  # TorchRL's code raises (or does) what it does with it
            w = torch.as_tensor(w).detach().to("cpu", torch.float64).reshape(-1).numpy()
            if w.size != int(valid.sum()) or not (np.isfinite(w).all() and (w >= 0).all()):
                return False
            weight[valid] = w
        if not (weight > 0).any():
            return False
        self._weight, self._valid, self.current = weight, valid, True
        self.n_valid = int(self._count[valid].sum())
        self.n_positive = int(self._count[weight > 0].sum())
        mass = torch.from_numpy(self._count * weight)
        raw = torch.where(mass > 0, mass, -torch.inf)
        pad = self.trees.capacity - mass.numel()
        self.trees.set_leaves(
            torch.nn.functional.pad(mass, (0, pad)),
            torch.nn.functional.pad(raw, (0, pad), value=-torch.inf),
        )
        return True

    def probabilities(self) -> torch.Tensor:
        """Each slot's probability under the last refresh (float64, ``slots``). O(slots)."""
        mass = np.zeros(self.slots)
        stored = self.bucket_of >= 0
        mass[stored] = self._weight[self.bucket_of[stored]]
        return torch.from_numpy(mass / mass.sum())

    # ------------------------------------------------------------------ draws
    def _draw(self, n: int, live: np.ndarray) -> np.ndarray:
        """``n`` items with replacement from the tree, ``live[b]`` members per bucket."""
        u = torch.rand(2, n, dtype=torch.float64)  # torch's RNG, as torch.multinomial's
        buckets = self.trees.search(u[0] * self.trees.total()).numpy()
        at = np.minimum((u[1].numpy() * live[buckets]).astype(np.int64), live[buckets] - 1)
        out = np.empty(n, np.int64)
        order = np.argsort(buckets, kind="stable")
        cuts = np.flatnonzero(np.diff(buckets[order])) + 1
        for group in np.split(order, cuts):
            out[group] = self._members[int(buckets[group[0]])][at[group]]
        return out

    def sample(self, n: int, replacement: bool) -> np.ndarray:
        """``n`` items drawn by weight, as ``torch.multinomial(weights, n, replacement)``.

        Without replacement needs ``n_positive >= n``. O(n log V) per round (see the module).
        """
        if replacement:
            return self._draw(n, self._count)
        live = self._count.copy()
        kept: list[np.ndarray] = []
        have = 0
        touched: set[int] = set()
        try:
            while have < n:
                drawn = self._draw(n - have, live)
                _, first = np.unique(drawn, return_index=True)
                new = drawn[np.sort(first)]
                kept.append(new)
                have += new.size
                if have == n:
                    break
                buckets = self.bucket_of[new].astype(np.int64)
                order = np.argsort(buckets, kind="stable")
                cuts = np.flatnonzero(np.diff(buckets[order])) + 1
                for group in np.split(order, cuts):
                    b = int(buckets[group[0]])
                    self._to_tail(b, int(live[b]), self.pos[new[group]])
                    live[b] -= group.size
                    touched.add(b)
                changed = np.fromiter(touched, np.int64)
                self._set_leaves(changed, live[changed])
        finally:
            if touched:
                changed = np.fromiter(touched, np.int64)
                self._set_leaves(changed, self._count[changed])
        return np.concatenate(kept)

"""The floor of a whole step: the same memory work as the buffers, in the simplest code.

A floor is what a step costs with nothing around the memory it must touch: preallocated NumPy
arrays, no TensorDict, no TorchRL, no checks, one compiled function per step where numba is
installed (a pure-NumPy version otherwise, which :data:`KIND` names). The ``whole_step``
scenario times it beside the buffers, calls interleaved, and reports fastreplay's time as a
multiple of it. See ``docs/benchmarks.md`` for what it leaves out.

* :class:`PerFloor`: a PER step on an ``obs[4]`` float32 array and a flat sum tree and min tree
  (float64, the same branching and level layout as fastreplay's numba trees, so a write or a
  descent reads the same tree cells): the 16-row write at the cursor with the leaf writes of the
  default priority and their propagation, 256 prefix-sum descents, the gather of those 256 rows
  and their weights ``(m_i / m_min) ** -beta``, then the "loss" ``|obs[:, 0]| + 0.05`` and the
  256 leaf updates with their propagation. Priorities become masses ``(p + eps) ** alpha``,
  rounded to float32 as TorchRL's trees hold them; new rows get the largest priority written so
  far (TorchRL's default).
* :func:`gather_runs` / :func:`write_rows`: the slice step's 256 contiguous runs gathered from
  every field (a run may wrap round the end), and the online step's row write at the cursor.

Every function is O(work): a PER step is O(k log_b capacity) for k rows, a gather O(rows read).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

try:  # the floor is compiled where numba is installed (the [fast] extra)
    import numba
except ImportError:  # pragma: no cover - depends on the environment
    numba = None

KIND = "numba" if numba is not None else "NumPy, no numba"
BRANCHING = 8  # fastreplay's numba trees: one cache line of children per node


def _njit(fn: Any) -> Any:
    return numba.njit(cache=True)(fn) if numba is not None else fn


def tree_layout(capacity: int, b: int = BRANCHING) -> tuple[np.ndarray, np.ndarray]:
    """``(offsets, sizes)`` of the levels, leaves first, as fastreplay's numba trees lay them."""
    sizes = [math.ceil(capacity / b) * b]
    while sizes[-1] > 1:
        nodes = sizes[-1] // b
        sizes.append(nodes if nodes == 1 else math.ceil(nodes / b) * b)
    offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    return offsets, np.asarray(sizes, dtype=np.int64)


# --------------------------------------------------------------------------- compiled (numba)


@_njit
def _set_leaf(tsum, tmin, offsets, b, leaf, mass):  # pragma: no cover - compiled
    """Write one leaf and recompute each of its ancestors from its ``b`` children."""
    tsum[leaf] = mass
    tmin[leaf] = mass
    node = leaf
    for level in range(1, offsets.size):
        node //= b
        base = offsets[level - 1] + node * b
        s = 0.0
        m = math.inf
        for c in range(b):
            s += tsum[base + c]
            m = min(m, tmin[base + c])
        tsum[offsets[level] + node] = s
        tmin[offsets[level] + node] = m


@_njit
def _descend(tsum, offsets, b, u):  # pragma: no cover - compiled
    """The leaf whose prefix-sum interval holds ``u``: one scan of ``b`` children per level."""
    node = 0
    for level in range(offsets.size - 2, -1, -1):
        base = offsets[level] + node * b
        chosen = b - 1
        for c in range(b):
            m = tsum[base + c]
            if u < m:
                chosen = c
                break
            u -= m
        node = node * b + chosen
    return node


@_njit
def _per_step_compiled(
    obs, tsum, tmin, offsets, b, new, state, alpha, eps, beta, out_obs, out_index, out_weight
):  # pragma: no cover - compiled
    """One PER step; ``state`` is ``[cursor, size, max priority]`` (float64), updated in place."""
    capacity = obs.shape[0]
    cursor, size, max_p = int(state[0]), int(state[1]), state[2]
    m_new = np.float64(np.float32((max_p + eps) ** alpha))
    for r in range(new.shape[0]):
        j = (cursor + r) % capacity
        obs[j, :] = new[r, :]
        _set_leaf(tsum, tmin, offsets, b, j, m_new)
    cursor = (cursor + new.shape[0]) % capacity
    size = min(size + new.shape[0], capacity)
    root = offsets[-1]
    total, m_min = tsum[root], tmin[root]
    for q in range(out_index.size):
        leaf = _descend(tsum, offsets, b, np.random.random() * total)  # noqa: NPY002 (numba's RNG)
        leaf = min(leaf, size - 1)  # rounding guard
        out_index[q] = leaf
        out_obs[q, :] = obs[leaf, :]
        out_weight[q] = (tsum[leaf] / m_min) ** -beta
    for q in range(out_index.size):
        p = abs(np.float64(out_obs[q, 0])) + 0.05
        max_p = max(max_p, p)
        _set_leaf(tsum, tmin, offsets, b, out_index[q], np.float64(np.float32((p + eps) ** alpha)))
    state[0], state[1], state[2] = cursor, size, max_p


@_njit
def _seed_compiled(seed):  # pragma: no cover - compiled
    np.random.seed(seed)  # noqa: NPY002 (seeds numba's own generator)


@_njit
def _gather_runs_compiled(source, starts, length, out):  # pragma: no cover - compiled
    capacity = source.shape[0]
    for k in range(starts.size):
        for t in range(length):
            out[k * length + t, :] = source[(starts[k] + t) % capacity, :]


# --------------------------------------------------------------------------- pure NumPy


def _mass(priority: Any, eps: float, alpha: float) -> Any:
    """``(p + eps) ** alpha`` rounded to float32, as TorchRL's default float32 trees hold it."""
    mass = (np.asarray(priority, dtype=np.float64) + eps) ** alpha
    return mass.astype(np.float32).astype(np.float64)


def _propagate_numpy(tsum, tmin, offsets, b, leaves) -> None:
    nodes = np.unique(leaves)
    for level in range(1, offsets.size):
        nodes = np.unique(nodes // b)
        children = offsets[level - 1] + nodes[:, None] * b + np.arange(b)
        tsum[offsets[level] + nodes] = tsum[children].sum(axis=1)
        tmin[offsets[level] + nodes] = tmin[children].min(axis=1)


def _per_step_numpy(floor: PerFloor, new: np.ndarray) -> None:
    cursor, size, max_p = int(floor.state[0]), int(floor.state[1]), floor.state[2]
    rows = (cursor + np.arange(len(new))) % floor.capacity
    floor.obs[rows] = new
    floor.tsum[rows] = floor.tmin[rows] = _mass(max_p, floor.eps, floor.alpha)
    _propagate_numpy(floor.tsum, floor.tmin, floor.offsets, floor.b, rows)
    size = min(size + len(new), floor.capacity)
    root = floor.offsets[-1]
    u = floor.rng.random(floor.out_index.size) * floor.tsum[root]
    leaf = np.minimum(floor.descend(u), size - 1)
    floor.out_index[:] = leaf
    floor.out_obs[:] = floor.obs[leaf]
    floor.out_weight[:] = (floor.tsum[leaf] / floor.tmin[root]) ** -floor.beta
    p = np.abs(floor.out_obs[:, 0].astype(np.float64)) + 0.05
    floor.tsum[leaf] = floor.tmin[leaf] = _mass(p, floor.eps, floor.alpha)
    _propagate_numpy(floor.tsum, floor.tmin, floor.offsets, floor.b, leaf)
    floor.state[:] = ((cursor + len(new)) % floor.capacity, size, max(max_p, float(p.max())))


class PerFloor:
    """The PER step's floor: rows, a sum tree and a min tree in flat NumPy arrays.

    Args:
        capacity: rows (and leaves).
        alpha, beta, eps: as TorchRL's ``PrioritizedSampler``.
        batch: rows sampled per step.
        seed: seeds the draws (numba's own generator, or NumPy's ``default_rng``).

    Memory: 16 bytes a row for ``obs[4]`` float32, about 18 bytes a slot for the two trees.
    """

    def __init__(
        self,
        capacity: int,
        alpha: float,
        beta: float,
        *,
        eps: float = 1e-8,
        batch: int = 256,
        seed: int = 0,
    ) -> None:
        self.capacity, self.alpha, self.beta, self.eps, self.b = capacity, alpha, beta, eps, 8
        self.offsets, self.sizes = tree_layout(capacity, self.b)
        nodes = int(self.sizes.sum())
        self.obs = np.zeros((capacity, 4), np.float32)
        self.tsum = np.zeros(nodes)
        self.tmin = np.full(nodes, math.inf)
        self.state = np.array([0.0, 0.0, 1.0])  # cursor, size, max priority (TorchRL's 1.0)
        self.out_obs = np.empty((batch, 4), np.float32)
        self.out_index = np.empty(batch, np.int64)
        self.out_weight = np.empty(batch)
        self.rng = np.random.default_rng(seed)
        if numba is not None:
            _seed_compiled(seed)

    def fill(self, start: int, obs: np.ndarray, priority: np.ndarray) -> None:
        """Write rows ``start:start + len(obs)`` with their priorities (untimed set-up).

        Leaves only; call :meth:`rebuild` once after the last fill.
        """
        stop = start + len(obs)
        self.obs[start:stop] = obs
        self.tsum[start:stop] = self.tmin[start:stop] = _mass(priority, self.eps, self.alpha)
        size = max(self.state[1], stop)
        self.state[:] = (stop % self.capacity, size, max(self.state[2], priority.max()))

    def rebuild(self) -> None:
        """Every internal node from its children, level by level (vectorized)."""
        for level in range(1, self.offsets.size):
            lo, width = self.offsets[level - 1], self.sizes[level - 1]
            padded = self.sizes[level] * self.b  # a multiple of b, at least width
            block_sum = np.zeros(padded)
            block_min = np.full(padded, math.inf)
            block_sum[:width] = self.tsum[lo : lo + width]
            block_min[:width] = self.tmin[lo : lo + width]
            at, nodes = self.offsets[level], self.sizes[level]
            self.tsum[at : at + nodes] = block_sum.reshape(-1, self.b).sum(axis=1)
            self.tmin[at : at + nodes] = block_min.reshape(-1, self.b).min(axis=1)

    def write(self, new: np.ndarray) -> np.ndarray:
        """The step's row write alone, in NumPy (for the checks); returns the rows written."""
        cursor, size, max_p = int(self.state[0]), int(self.state[1]), self.state[2]
        rows = (cursor + np.arange(len(new))) % self.capacity
        self.obs[rows] = new
        self.tsum[rows] = self.tmin[rows] = _mass(max_p, self.eps, self.alpha)
        _propagate_numpy(self.tsum, self.tmin, self.offsets, self.b, rows)
        self.state[:2] = ((cursor + len(new)) % self.capacity, min(size + len(new), self.capacity))
        return rows

    def update(self, index: np.ndarray, priority: np.ndarray) -> None:
        """The step's leaf updates alone, in NumPy (for the checks); the last write wins."""
        self.tsum[index] = self.tmin[index] = _mass(priority, self.eps, self.alpha)
        _propagate_numpy(self.tsum, self.tmin, self.offsets, self.b, index)
        self.state[2] = max(self.state[2], float(np.max(priority)))

    def step(self, new: np.ndarray) -> None:
        """One PER step (see the module docstring); the sample lands in ``out_*``."""
        if numba is not None:
            _per_step_compiled(
                self.obs,
                self.tsum,
                self.tmin,
                self.offsets,
                self.b,
                new,
                self.state,
                self.alpha,
                self.eps,
                self.beta,
                self.out_obs,
                self.out_index,
                self.out_weight,
            )
        else:
            _per_step_numpy(self, new)

    def descend(self, u: np.ndarray) -> np.ndarray:
        """The leaves of the prefix sums ``u`` (vectorized: every query one level at a time)."""
        node = np.zeros(len(u), np.int64)
        rest = np.array(u, dtype=np.float64)
        for level in range(self.offsets.size - 2, -1, -1):
            children = self.tsum[self.offsets[level] + node[:, None] * self.b + np.arange(self.b)]
            before = np.cumsum(children, axis=1)
            chosen = np.minimum((before <= rest[:, None]).sum(axis=1), self.b - 1)
            rest -= before[np.arange(len(u)), chosen] - children[np.arange(len(u)), chosen]
            node = node * self.b + chosen
        return node

    def total(self) -> float:
        """The root of the sum tree: the total mass. O(1)."""
        return float(self.tsum[self.offsets[-1]])

    def min_mass(self) -> float:
        """The root of the min tree: the smallest mass written. O(1)."""
        return float(self.tmin[self.offsets[-1]])

    def leaves(self) -> np.ndarray:
        """The leaf masses (a view). O(1)."""
        return self.tsum[: self.capacity]


def gather_runs(source: np.ndarray, starts: np.ndarray, length: int, out: np.ndarray) -> None:
    """``out[k * length + t] = source[(starts[k] + t) % len(source)]`` for every run ``k``.

    ``source`` and ``out`` are 2-D (rows, features); O(rows gathered).
    """
    if numba is not None:
        _gather_runs_compiled(source, starts, length, out)
    else:
        rows = (starts[:, None] + np.arange(length)) % len(source)
        np.take(source, rows.reshape(-1), axis=0, out=out)


def write_rows(target: np.ndarray, cursor: int, rows: np.ndarray) -> int:
    """Write ``rows`` at ``cursor`` (wrapping round the end); returns the next cursor. O(rows)."""
    capacity = len(target)
    first = min(len(rows), capacity - cursor)
    target[cursor : cursor + first] = rows[:first]
    target[: len(rows) - first] = rows[first:]
    return (cursor + len(rows)) % capacity

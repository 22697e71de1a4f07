"""Priority segment trees walked by numba-compiled loops (CPU only, optional ``numba``).

:class:`NumbaPriorityTrees` implements the interface of :class:`fastreplay._segment_tree.
PriorityTrees` (same methods, same semantics, same ``levels`` views) with the tree kept in one
float64 array of shape ``(3, nodes)``: row 0 the sum tree over the sampling mass, row 1 the min
tree over the mass, row 2 the negated-min tree over the raw priorities (see
:mod:`fastreplay._segment_tree`). The levels are stored back to back, leaves first, with the
same ``branching``-ary padded layout as the pure-torch trees.

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
    >>> from fastreplay._segment_tree import make_trees
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

try:  # optional dependency: ``pip install 'fastreplay[fast]'``
    import numba
except ImportError:  # pragma: no cover - depends on the environment
    numba = None

__all__ = ["NUMBA_AVAILABLE", "NumbaPriorityTrees"]

NUMBA_AVAILABLE = numba is not None
_INF = math.inf

# Leaf writes prefetch the leaf this many writes ahead: enough to cover a memory access,
# and a bulk write never evicts its prefetched lines before writing them.
_AHEAD = 32

# Status codes returned by the fused sampler kernels (the caller builds the error message).
OK, BAD_INDEX, BAD_PRIORITY, OVERFLOW, CHECK_MASS = 0, 1, 2, 3, 4


def _jit(fn: Any = None, **options: Any) -> Any:
    if fn is None:
        return lambda f: _jit(f, **options)
    return numba.njit(cache=True, **options)(fn) if numba is not None else fn


if numba is not None:
    from llvmlite import ir
    from numba.core import cgutils, types
    from numba.extending import intrinsic

    @intrinsic
    def _prefetch(typingctx, array, position):  # pragma: no cover - compiled
        """Hint the CPU to load the cache line of ``array[position]`` (no fault, no result).

        A search or update then issues the loads of many independent nodes back to back, so
        their cache and TLB misses overlap instead of stalling one after the other.
        """

        def codegen(context, builder, signature, args):
            array_type = signature.args[0]
            data = context.make_array(array_type)(context, builder, args[0])
            pointer = cgutils.get_item_pointer(
                context, builder, array_type, data, [args[1]], wraparound=False
            )
            i32 = ir.IntType(32)
            function = cgutils.get_or_insert_function(
                builder.module,
                ir.FunctionType(ir.VoidType(), [pointer.type, i32, i32, i32]),
                "llvm.prefetch." + pointer.type.intrinsic_name,
            )
            # read, keep in all cache levels, data cache
            builder.call(function, [pointer, i32(0), i32(3), i32(1)])
            return context.get_dummy_value()

        return types.void(array, position), codegen

else:  # pragma: no cover - numba absent: the kernels below are never called

    def _prefetch(array: Any, position: Any) -> None:
        return None


@_jit
def _prefetch_node(row, start, b):  # pragma: no cover - compiled
    """Prefetch the ``b`` children ``row[start : start + b]`` (one line when aligned)."""
    for c in range(0, b, 8):
        _prefetch(row, start + c)
    _prefetch(row, start + b - 1)


# ---------------------------------------------------------------------- kernels
# Reassociation lets LLVM vectorize the sum and min over the children (no ``nnan``/``ninf``:
# ``+inf`` is the min trees' neutral value). Every parent is computed by this one function,
# so incremental updates and full rebuilds still give bit-identical nodes.
@_jit(fastmath={"reassoc", "nsz"}, inline="always")
def _recompute(tree, child_off, parent_off, b, node):  # pragma: no cover - compiled
    base = child_off + node * b
    s = 0.0
    mn = _INF
    ng = _INF
    for c in range(b):
        s += tree[0, base + c]
        mn = min(mn, tree[1, base + c])
        ng = min(ng, tree[2, base + c])
    tree[0, parent_off + node] = s
    tree[1, parent_off + node] = mn
    tree[2, parent_off + node] = ng


@_jit
def _rebuild(tree, offsets, sizes, b):  # pragma: no cover - compiled
    for level in range(1, offsets.size):
        for node in range(sizes[level - 1] // b):
            _recompute(tree, offsets[level - 1], offsets[level], b, node)


@_jit
def _propagate(tree, offsets, sizes, b, index):  # pragma: no cover - compiled
    """Recompute every ancestor of the leaves ``index`` (negative entries skipped) once.

    The parents are sorted once; the parents of a sorted list are sorted, so every level
    dedupes in one linear pass and visits its nodes in memory order.
    """
    levels = offsets.size
    if levels == 1:
        return
    k = index.size
    if k >= sizes[1]:
        _rebuild(tree, offsets, sizes, b)
        return
    nodes = np.sort(index)
    count = 0
    for i in range(k):
        if nodes[i] >= 0:
            p = nodes[i] // b
            if count == 0 or nodes[count - 1] != p:
                nodes[count] = p
                count += 1
    for level in range(1, levels):
        # The children were just written (one aligned line per node); the nodes' own lines
        # are the misses: start loading all of them before the first recompute.
        for t in range(count):
            for row in range(3):
                _prefetch(tree[row], offsets[level] + nodes[t])
        for t in range(count):
            _recompute(tree, offsets[level - 1], offsets[level], b, nodes[t])
        if level == levels - 1:
            break
        new_count = 0
        for t in range(count):  # parents of distinct sorted nodes: sorted, dedupe in place
            p = nodes[t] // b
            if new_count == 0 or nodes[new_count - 1] != p:
                nodes[new_count] = p
                new_count += 1
        count = new_count


@_jit
def _write(tree, offsets, sizes, b, index, rows):  # pragma: no cover - compiled
    """Set leaves ``index`` to the columns of ``rows`` (3, k) or (3, 1); last write wins."""
    one = rows.shape[1] == 1
    for i in range(index.size):
        if i + _AHEAD < index.size:  # start loading the lines of a leaf written later
            for row in range(3):
                _prefetch(tree[row], index[i + _AHEAD])
        col = 0 if one else i
        for row in range(3):
            tree[row, index[i]] = rows[row, col]
    _propagate(tree, offsets, sizes, b, index)


_CLEARED = np.array([[0.0], [_INF], [_INF]])


@_jit
def _set_leaves(tree, offsets, sizes, b, mass, raw):  # pragma: no cover - compiled
    for j in range(mass.size):
        r = raw[j]
        if r == -_INF:
            tree[0, j] = 0.0
            tree[1, j] = _INF
        else:
            tree[0, j] = mass[j]
            tree[1, j] = mass[j]
        tree[2, j] = -r
    _rebuild(tree, offsets, sizes, b)


@_jit
def _descend(tree, offsets, b, prefix):  # pragma: no cover - compiled
    """Leaf of each prefix; never steps past a node's last positive child (rounding guard).

    Same arithmetic as the pure-torch search (a running sum over the children, the prefix
    reduced by ``cumsum - child`` of the chosen child), so both give the same leaves.
    """
    n = prefix.size
    node = np.zeros(n, np.int64)
    rest = prefix.copy()
    cums = np.empty(b)
    for level in range(offsets.size - 2, -1, -1):  # all queries one level at a time
        off = offsets[level]
        for q in range(n):  # branch-free, so the memory loads of queries overlap
            base = off + node[q] * b
            p = rest[q]
            cum = 0.0
            count = 0
            last = 0
            for c in range(b):
                m = tree[0, base + c]
                cum += m
                cums[c] = cum
                count += cum <= p
                last = c if m > 0 else last
            choice = min(count, last)
            rest[q] = p - (cums[choice] - tree[0, base + choice])
            node[q] = node[q] * b + choice
            if level > 0:  # its children are read one level later, after the other queries
                _prefetch_node(tree[0], offsets[level - 1] + node[q] * b, b)
    return node


@_jit
def _sample(tree, offsets, b, draw, total, m_min, neg_beta, f32):  # pragma: no cover
    """Leaves for ``draw * total`` and their weights ``(mass / m_min) ** neg_beta``."""
    index = _descend(tree, offsets, b, draw * total)
    n = index.size
    if f32:
        weight32 = np.empty(n, np.float32)
        for q in range(n):
            weight32[q] = np.float32((tree[0, index[q]] / m_min) ** neg_beta)
        return index, weight32.view(np.uint8)
    weight64 = np.empty(n, np.float64)
    for q in range(n):
        weight64[q] = (tree[0, index[q]] / m_min) ** neg_beta
    return index, weight64.view(np.uint8)


@_jit
def _check(index, raw, stored, eps, alpha, f32):  # pragma: no cover - compiled
    """Validate a priority write in one pass: (status, max priority, holds a -1 marker)."""
    one = raw.size == 1
    p_max = -_INF
    marker = False
    for i in range(index.size):
        j = index[i]
        if j == -1:
            marker = True
            continue
        if j < 0 or j >= stored:
            return BAD_INDEX, p_max, marker
        p = np.float64(raw[0] if one else raw[i])
        if not (p >= 0.0 and p < _INF):
            return BAD_PRIORITY, p_max, marker
        p_max = max(p_max, p)
    if p_max > -_INF:
        m = (p_max + eps) ** alpha  # the mass is monotone in p: check the largest one
        if f32:
            m = np.float64(np.float32(m))
        if not m < _INF:
            return OVERFLOW, p_max, marker
    return OK, p_max, marker


@_jit
def _write_priorities(tree, offsets, sizes, b, index, raw, eps, alpha, f32):  # pragma: no cover
    """Write raw priorities (already checked) and their mass; ``-1`` slots are skipped."""
    one = raw.size == 1
    for i in range(index.size):
        if i + _AHEAD < index.size and index[i + _AHEAD] >= 0:  # a leaf written later
            for row in range(3):
                _prefetch(tree[row], index[i + _AHEAD])
        j = index[i]
        if j < 0:
            continue
        p = np.float64(raw[0] if one else raw[i])
        m = (p + eps) ** alpha
        if f32:
            m = np.float64(np.float32(m))
        tree[0, j] = m
        tree[1, j] = m
        tree[2, j] = -p
    _propagate(tree, offsets, sizes, b, index)


@_jit
def _check_and_write(
    tree, offsets, sizes, b, index, raw, stored, eps, alpha, f32, bound
):  # pragma: no cover - compiled
    """:func:`_check`, then :func:`_write_priorities` if the largest mass is below ``bound``.

    Returns ``(status, max priority)``; nothing is written unless the status is ``OK``.
    ``CHECK_MASS``: the write is valid but its largest mass is not clearly below ``bound``,
    so the caller decides (exactly) whether it fits before writing.
    """
    status, p_max, _ = _check(index, raw, stored, eps, alpha, f32)
    if status != OK:
        return status, p_max
    if p_max > -_INF and not (p_max + eps) ** alpha < bound:
        return CHECK_MASS, p_max
    _write_priorities(tree, offsets, sizes, b, index, raw, eps, alpha, f32)
    return OK, p_max


@_jit
def _holds_max(tree, index, root):  # pragma: no cover - compiled
    """Whether a slot of ``index`` (negatives skipped) holds the live max raw priority."""
    for i in range(index.size):
        j = index[i]
        if j >= 0 and tree[2, j] <= tree[2, root]:
            return True
    return False


# ---------------------------------------------------------------------- trees
class NumbaPriorityTrees:
    """Sum, min and negated-min segment trees over ``capacity`` slots, compiled loops, CPU.

    Same interface and semantics as :class:`fastreplay._segment_tree.PriorityTrees`.

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
            raise ImportError(
                "NumbaPriorityTrees needs numba: pip install 'fastreplay[fast]' (or numba)"
            )
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
        self._data = torch.empty(3, columns, dtype=torch.float64)
        self._attach()
        self.reset()

    def _attach(self) -> None:
        self._tree = self._data.numpy()
        self._root = int(self._offsets[-1])

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.pop("_tree")
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
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

    # ------------------------------------------------------------------ fused sampler paths
    def check_priorities(
        self, index: np.ndarray, raw: np.ndarray, stored: int, eps: float, alpha: float, f32: bool
    ) -> tuple[int, float, bool]:
        """One pass over a priority write: ``(status, max priority, has -1 markers)``. O(k)."""
        return _check(index, raw, stored, eps, alpha, f32)

    def write_priorities(
        self, index: np.ndarray, raw: np.ndarray, eps: float, alpha: float, f32: bool
    ) -> None:
        """Write checked raw priorities and their mass ``(p + eps) ** alpha``. O(k log_B cap)."""
        args = (self._tree, self._offsets, self._sizes, self.branching)
        _write_priorities(*args, index, raw, eps, alpha, f32)

    def check_and_write(
        self,
        index: np.ndarray,
        raw: np.ndarray,
        stored: int,
        eps: float,
        alpha: float,
        f32: bool,
        bound: float,
    ) -> tuple[int, float]:
        """Check a priority write and write it in one call: ``(status, max priority)``.

        O(k log k + k log_B capacity). Nothing is written unless the status is ``OK``; see
        :meth:`check_priorities` for the other statuses, and ``CHECK_MASS`` when the largest
        mass ``(p + eps) ** alpha`` is not below ``bound``.
        """
        args = (self._tree, self._offsets, self._sizes, self.branching)
        status, p_max = _check_and_write(*args, index, raw, stored, eps, alpha, f32, bound)
        return int(status), float(p_max)

    def clear_if_holds_max(self, index: np.ndarray) -> None:
        """Clear leaves ``index`` (negatives skipped) if one of them holds the live max. O(k)."""
        if _holds_max(self._tree, index, self._root):
            args = (self._tree, self._offsets, self._sizes, self.branching)
            valid = index[index >= 0] if (index < 0).any() else index
            _write(*args, valid, _CLEARED)

    def sample(
        self, draw: np.ndarray, total: float, m_min: float, beta: float, f32: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Leaves for uniform ``draw`` and their weights ``(mass / m_min) ** -beta``."""
        index, weight = _sample(
            self._tree, self._offsets, self.branching, draw, total, m_min, -beta, f32
        )
        dtype = np.float32 if f32 else np.float64
        return torch.from_numpy(index), torch.from_numpy(weight.view(dtype))

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

"""The compiled loops behind :class:`fastreplay._core.trees.numba_backend.NumbaPriorityTrees`.

Every function works on the ``(3, nodes)`` float64 tree array (rows: sum of the mass, min of
the mass, negated min of the raw priorities; levels back to back, leaves first) and the
``offsets``/``sizes`` of its levels. The functions are plain Python when numba is missing;
they are then never called (only constructing the trees needs numba).

Compiling, caching and the ``_prefetch`` hint are in :mod:`fastreplay._core.numba_jit`.
"""

from __future__ import annotations

import math

import numpy as np

from fastreplay._core.numba_jit import NUMBA_AVAILABLE, _jit, _prefetch, numba

_INF = math.inf

# Leaf writes prefetch the leaf this many writes ahead: enough to cover a memory access,
# and a bulk write never evicts its prefetched lines before writing them.
_AHEAD = 32

# Status codes returned by the fused sampler kernels (the caller builds the error message).
OK, BAD_INDEX, BAD_PRIORITY, OVERFLOW, CHECK_MASS = 0, 1, 2, 3, 4

__all__ = ["NUMBA_AVAILABLE", "numba"]  # and the kernels, imported by name


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
def _pow_each(base, exponent, out):  # pragma: no cover - compiled
    """``out[i] = base[i] ** exponent``: the C library's ``pow``, as in the kernels below."""
    for i in range(base.size):
        out[i] = base[i] ** exponent


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
def _prefix(tree, offsets, b, n):  # pragma: no cover - compiled
    """``(sum, min)`` of the mass over the leaves ``[0, n)``; O(b log_b capacity).

    Climbs from leaf ``n``: on each level the nodes left of the position inside its group,
    then the group's parent, up to the root.
    """
    s = 0.0
    mn = _INF
    p = n
    for level in range(offsets.size - 1):
        off = offsets[level]
        for j in range(p - p % b, p):
            s += tree[0, off + j]
            mn = min(mn, tree[1, off + j])
        p //= b
    if p > 0:  # every leaf: the root
        s += tree[0, offsets[-1]]
        mn = min(mn, tree[1, offsets[-1]])
    return s, mn


@_jit
def _sample(tree, offsets, b, draw, total, m_min, neg_beta, f32, limit):  # pragma: no cover
    """Leaves below ``limit`` for ``draw * total`` and their weights ``(mass / m_min) ** neg_beta``.

    ``total`` is the mass of the leaves ``[0, limit)``; a rounding overshoot past ``limit``
    steps back to the last leaf below it with positive mass.
    """
    index = _descend(tree, offsets, b, draw * total)
    n = index.size
    for q in range(n):
        if index[q] >= limit:
            j = limit - 1
            while j > 0 and tree[0, j] == 0.0:
                j -= 1
            index[q] = j
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
    """Validate a priority write in one pass.

    Returns ``(status, max priority, holds a -1 marker, largest slot)``.
    """
    one = raw.size == 1
    p_max = -_INF
    marker = False
    i_max = -1
    for i in range(index.size):
        j = index[i]
        if j == -1:
            marker = True
            continue
        if j < 0 or j >= stored:
            return BAD_INDEX, p_max, marker, i_max
        p = np.float64(raw[0] if one else raw[i])
        if not (p >= 0.0 and p < _INF):
            return BAD_PRIORITY, p_max, marker, i_max
        p_max = max(p_max, p)
        i_max = max(i_max, j)
    if p_max > -_INF:
        m = (p_max + eps) ** alpha  # the mass is monotone in p: check the largest one
        if f32:
            m = np.float64(np.float32(m))
        if not m < _INF:
            return OVERFLOW, p_max, marker, i_max
    return OK, p_max, marker, i_max


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

    Returns ``(status, max priority, largest slot)``; nothing is written unless the status is
    ``OK``. ``CHECK_MASS``: the write is valid but its largest mass is not clearly below
    ``bound``, so the caller decides (exactly) whether it fits before writing.
    """
    status, p_max, _, i_max = _check(index, raw, stored, eps, alpha, f32)
    if status != OK:
        return status, p_max, i_max
    if p_max > -_INF and not (p_max + eps) ** alpha < bound:
        return CHECK_MASS, p_max, i_max
    _write_priorities(tree, offsets, sizes, b, index, raw, eps, alpha, f32)
    return OK, p_max, i_max


@_jit
def _holds_max(tree, index, root):  # pragma: no cover - compiled
    """Whether a slot of ``index`` (negatives skipped) holds the live max raw priority."""
    for i in range(index.size):
        j = index[i]
        if j >= 0 and tree[2, j] <= tree[2, root]:
            return True
    return False


_ZERO = np.zeros(1)


@_jit
def _mark_update(
    tree, offsets, sizes, b, index, stored, eps, alpha, f32, bound, initial, upper, all_time
):  # pragma: no cover - compiled
    """Give the slots ``index`` (``-1`` skipped) the default priority, in one call.

    ``all_time``: the all-time max priority, or NaN for the live one: the slots holding the
    live max are then cleared first, and the default is the max of what is left. The default
    is ``initial`` while no priority is stored, and at most ``upper``.

    Returns ``(status, default priority, largest slot)``. ``BAD_INDEX``: nothing changed.
    Otherwise the default is written as :func:`_check_and_write` writes it, with its statuses;
    the slots may have been cleared when that one is not ``OK`` (the caller decides).
    ``(OK, -inf, -1)``: every index is ``-1``.
    """
    status, _, _, i_max = _check(index, _ZERO, stored, eps, alpha, False)
    if status != OK:
        return status, 0.0, i_max
    if i_max < 0:
        return OK, -_INF, i_max
    root = offsets[-1]
    live = all_time != all_time  # NaN: the live max
    if live and _holds_max(tree, index, root):
        _write(tree, offsets, sizes, b, index[index >= 0], _CLEARED)
    current = -tree[2, root] if live else all_time
    value = min(initial if current == -_INF else current, upper)
    raw = np.full(1, value)
    status, _, _ = _check_and_write(
        tree, offsets, sizes, b, index, raw, stored, eps, alpha, f32, bound
    )
    return status, value, i_max

"""Triton kernels of :class:`fastreplay._core.trees.triton_backend.TritonPriorityTrees`.

Two kernels over the three-level layout of
:class:`fastreplay._core.trees.device_backend.DevicePriorityTrees` (leaves ``(3, B**3)``,
levels ``(3, B**2)``, ``(3, B)`` and the root ``(3, 1)``; rows: sum of the mass, min of the
mass, min of the negated raw priorities):

* :func:`walk`: every prefix mass descends the three levels in one launch, ``BLOCK`` prefixes
  per program, each level a ``(BLOCK, B)`` tile of children, its running sum and a count: the
  arithmetic of ``DevicePriorityTrees._walk`` (same running sums, same guard below a group's
  sum), so that on the CPU interpreter the found slots are the device backend's.
* :func:`write`: a write of ``k`` leaf columns and the recomputation of their ancestors, in one
  launch of a single program (the levels depend on each other, and only one program can wait
  for itself): the last entry of a repeated slot wins (an ``atomic_max`` of the positions into
  the leaf sum row, which is overwritten next), then the leaves, then each level's touched
  parents, then the root, with a barrier between the phases.

Importing this module needs ``triton``; with ``TRITON_INTERPRET=1`` set before the import, the
kernels run on CPU tensors (Triton's interpreter), which is how the tests run them without a GPU.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton import knobs

__all__ = ["INTERPRETED", "walk", "write"]

INTERPRETED: bool = bool(knobs.runtime.interpret)
"""Whether the kernels were built for Triton's CPU interpreter (``TRITON_INTERPRET=1``)."""


@triton.jit
def _below(x):
    """``nextafter(x, 0)`` for ``x >= 0`` (float64): the bit pattern minus one."""
    return tl.where(x > 0, (x.to(tl.int64, bitcast=True) - 1).to(tl.float64, bitcast=True), x)


@triton.jit
def _choose(children, target, cols, B: tl.constexpr):
    """Per row: the child where ``target`` falls, and the mass before it in its group."""
    inside = cols[None, :] < B
    running = tl.cumsum(children, axis=1)
    last = tl.sum(tl.where(cols[None, :] == B - 1, running, 0.0), axis=1)
    bound = tl.minimum(target, _below(last))
    count = tl.sum((inside & (running <= bound[:, None])).to(tl.int64), axis=1)
    choice = tl.minimum(count, B - 1)
    before = tl.sum(tl.where(cols[None, :] == choice[:, None], running - children, 0.0), axis=1)
    return choice, before


@triton.jit
def walk(
    prefix_ptr,
    index_ptr,
    mass_ptr,
    leaf_ptr,
    mid_ptr,
    top_ptr,
    root_ptr,
    n,
    SCALE: tl.constexpr,
    B: tl.constexpr,
    BP: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Slots (int64) and masses (float64) of ``n`` prefixes (times the total if ``SCALE``)."""
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = rows < n
    cols = tl.arange(0, BP)
    inside = cols < B
    prefix = tl.load(prefix_ptr + rows, mask=live, other=0.0)
    if SCALE:
        prefix = prefix * tl.load(root_ptr)
    top = tl.load(top_ptr + cols, mask=inside, other=0.0)
    node, before = _choose(tl.broadcast_to(top[None, :], (BLOCK, BP)), prefix, cols, B)
    column = prefix - before
    both = live[:, None] & inside[None, :]
    children = tl.load(mid_ptr + node[:, None] * B + cols[None, :], mask=both, other=0.0)
    choice, before = _choose(children, column, cols, B)
    column = column - before
    node = choice + node * B
    children = tl.load(leaf_ptr + node[:, None] * B + cols[None, :], mask=both, other=0.0)
    choice, before = _choose(children, column, cols, B)
    node = choice + node * B
    tl.store(index_ptr + rows, node, mask=live)
    tl.store(mass_ptr + rows, tl.load(leaf_ptr + node, mask=live, other=0.0), mask=live)


@triton.jit
def _parents(
    child_ptr,
    child_row,
    parent_ptr,
    parent_row,
    index_ptr,
    k,
    stride,
    B: tl.constexpr,
    BP: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Recompute the parents (``index // stride``) of the written leaves from their children."""
    offs = tl.arange(0, BLOCK)
    cols = tl.arange(0, BP)
    for start in range(0, k, BLOCK):
        live = start + offs < k
        node = tl.load(index_ptr + start + offs, mask=live, other=0) // stride
        both = live[:, None] & (cols[None, :] < B)
        at = node[:, None] * B + cols[None, :]
        total = tl.sum(tl.load(child_ptr + at, mask=both, other=0.0), axis=1)
        low = tl.min(tl.load(child_ptr + child_row + at, mask=both, other=float("inf")), axis=1)
        neg = tl.min(tl.load(child_ptr + 2 * child_row + at, mask=both, other=float("inf")), axis=1)
        tl.store(parent_ptr + node, total, mask=live)
        tl.store(parent_ptr + parent_row + node, low, mask=live)
        tl.store(parent_ptr + 2 * parent_row + node, neg, mask=live)


@triton.jit
def write(
    index_ptr,
    values_ptr,
    values_row,
    values_step,
    k,
    scratch_ptr,
    leaf_ptr,
    mid_ptr,
    top_ptr,
    root_ptr,
    B: tl.constexpr,
    BP: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Write columns ``values[:, p]`` at ``index[p]``, then recompute their ancestors.

    ``values_step`` 0: one column for all. One program; ``scratch_ptr`` is the leaf sum row
    as int64.
    """
    offs = tl.arange(0, BLOCK)
    leaf_row = B * B * B
    # 1. the last entry of each slot wins: the largest position, kept in the scratch row
    for start in range(0, k, BLOCK):
        live = start + offs < k
        slot = tl.load(index_ptr + start + offs, mask=live, other=0)
        tl.store(scratch_ptr + slot, tl.full((BLOCK,), -1, tl.int64), mask=live)
    tl.debug_barrier()
    for start in range(0, k, BLOCK):
        live = start + offs < k
        slot = tl.load(index_ptr + start + offs, mask=live, other=0)
        tl.atomic_max(scratch_ptr + slot, (start + offs).to(tl.int64), mask=live)
    tl.debug_barrier()
    # 2. the winners write their leaves (a slot's later entries all lost to its winner)
    for start in range(0, k, BLOCK):
        position = start + offs
        live = position < k
        slot = tl.load(index_ptr + position, mask=live, other=0)
        wins = live & (tl.load(scratch_ptr + slot, mask=live, other=-1) == position)
        tl.debug_barrier()  # every read of this round before the first write
        column = values_ptr + position * values_step
        tl.store(leaf_ptr + slot, tl.load(column, mask=wins, other=0.0), mask=wins)
        tl.store(
            leaf_ptr + leaf_row + slot,
            tl.load(column + values_row, mask=wins, other=0.0),
            mask=wins,
        )
        tl.store(
            leaf_ptr + 2 * leaf_row + slot,
            tl.load(column + 2 * values_row, mask=wins, other=0.0),
            mask=wins,
        )
    tl.debug_barrier()
    # 3. the parents of the written leaves, level by level
    _parents(leaf_ptr, leaf_row, mid_ptr, B * B, index_ptr, k, B, B, BP, BLOCK)
    tl.debug_barrier()
    _parents(mid_ptr, B * B, top_ptr, B, index_ptr, k, B * B, B, BP, BLOCK)
    tl.debug_barrier()
    # 4. the root, from the top level's B nodes
    cols = tl.arange(0, BP)
    inside = cols < B
    tl.store(root_ptr, tl.sum(tl.load(top_ptr + cols, mask=inside, other=0.0), axis=0))
    low = tl.min(tl.load(top_ptr + B + cols, mask=inside, other=float("inf")), axis=0)
    tl.store(root_ptr + 1, low)
    neg = tl.min(tl.load(top_ptr + 2 * B + cols, mask=inside, other=float("inf")), axis=0)
    tl.store(root_ptr + 2, neg)

"""Priority-tree backends: which ones run here, and a factory (no TorchRL imports).

Two backends implement the interface of :class:`fastreplay._segment_tree.PriorityTrees`:
``"torch"`` (pure torch, any device, always available) and ``"numba"`` (compiled loops on the
CPU, :mod:`fastreplay._segment_tree_numba`, when numba is installed).

Example:
    >>> from fastreplay._tree_backends import available_backends, make_trees
    >>> "torch" in available_backends()
    True
    >>> trees = make_trees(7)  # numba when it is installed, else torch
    >>> trees.backend in available_backends()
    True
"""

from __future__ import annotations

from typing import Any

import torch

from fastreplay._segment_tree import PriorityTrees

__all__ = ["BACKENDS", "available_backends", "make_trees"]

BACKENDS = ("torch", "numba")


def available_backends() -> tuple[str, ...]:
    """The tree backends that work in this environment (``"torch"`` always does)."""
    from fastreplay._segment_tree_numba import NUMBA_AVAILABLE

    return ("torch", "numba") if NUMBA_AVAILABLE else ("torch",)


def make_trees(
    capacity: int,
    *,
    backend: str | None = None,
    device: torch.device | str | None = None,
    branching: int | None = None,
) -> Any:
    """Build priority trees with the :class:`PriorityTrees` interface on ``backend``.

    Args:
        capacity: number of leaf slots.
        backend: ``"numba"`` (compiled loops, CPU only, needs the optional numba),
            ``"torch"`` (pure torch, any device) or ``None``: numba when it is installed and
            the trees live on the CPU, else torch.
        device: where the trees live (CPU by default).
        branching: fan-out of every internal node; ``None`` takes the backend's default
            (32 for torch, where the number of levels sets the cost; 8 for numba, where the
            memory touched per level does).

    Raises:
        ValueError: an unknown ``backend``, or one that cannot run here (numba missing, or
            a non-CPU ``device`` with ``backend="numba"``); the message says the fix.

    Example:
        >>> make_trees(7, backend="torch").backend
        'torch'
    """
    from fastreplay._segment_tree_numba import NUMBA_AVAILABLE, NumbaPriorityTrees

    if backend is not None and backend not in BACKENDS:
        raise ValueError(
            f"backend must be None, 'torch' or 'numba', got backend={backend!r}; None picks "
            "numba when it is installed and the trees are on the CPU"
        )
    on_cpu = device is None or torch.device(device).type == "cpu"
    if backend is None:
        backend = "numba" if NUMBA_AVAILABLE and on_cpu else "torch"
    if backend == "numba":
        if not NUMBA_AVAILABLE:
            raise ValueError(
                "backend='numba' needs the numba package, which is not installed: "
                "pip install numba, or pass backend='torch' (or None)"
            )
        if not on_cpu:
            raise ValueError(
                f"backend='numba' keeps the priority trees on the CPU, got device={device}: "
                "pass backend='torch' (or None) for trees on another device"
            )
        return NumbaPriorityTrees(capacity, device=device, branching=branching or 8)
    return PriorityTrees(capacity, device=device, branching=branching or 32)

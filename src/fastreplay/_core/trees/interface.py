"""Priority-tree backends: their interface, which ones run here, a factory (no TorchRL imports).

Four backends implement :class:`PriorityTreeBackend` completely: ``"torch"``
(:class:`fastreplay._core.trees.torch_backend.PriorityTrees`: pure torch, any device, always
available), ``"numba"`` (:class:`fastreplay._core.trees.numba_backend.NumbaPriorityTrees`:
compiled loops on the CPU, when numba is installed) and ``"device"``
(:class:`fastreplay._core.trees.device_backend.DevicePriorityTrees`: pure torch in a fixed
depth-3 layout whose sampling and writes read nothing back to the host, the default on
accelerators; float64 masses by ``torch.pow``, which may differ from the C library's in the
last bit), and ``"triton"`` (:class:`fastreplay._core.trees.triton_backend.TritonPriorityTrees`:
the device layout with its walk and each write as one Triton kernel; asked for by name, where
the optional triton package runs). Fed the same calls on the CPU, the torch and numba backends
hold
bit-for-bit the same leaves (raw priorities and masses, whose ``pow`` is the C library's on
both: :func:`fastreplay._core.trees.ops.c_pow`) and return the same weights for the same leaves.
Their inner nodes sum the children in different orders (each vectorizes its own way), so with
float64 masses the totals may differ by the rounding of a sum, at most ``2 * (slots - 1)``
float64 units of the total, and a draw within that distance of a boundary between two leaves
(about one in 10**13) may land on the neighbouring leaf; float32 masses usually sum exactly in
float64, in any order (``tests/conformance/test_tree_backends.py``). The samplers call the
interface and never ask which backend runs.

Example:
    >>> from fastreplay._core.trees.interface import available_backends, make_trees
    >>> "torch" in available_backends()
    True
    >>> trees = make_trees(7)  # numba when it is installed, else torch
    >>> trees.backend in available_backends()
    True
"""

from __future__ import annotations

from typing import Protocol

import torch

from fastreplay._core.trees.torch_backend import PriorityTrees

__all__ = ["BACKENDS", "PriorityTreeBackend", "available_backends", "make_trees", "move_trees"]

BACKENDS = ("torch", "numba", "device", "triton")


class PriorityTreeBackend(Protocol):
    """Sum, min and negated-min segment trees over ``capacity`` slots: what a backend provides.

    Each slot holds a sampling mass ``m = (p + eps) ** alpha`` (rounded to float32 for float32
    samplers; sums accumulate in float64) and its raw priority ``p``; an unwritten slot has
    mass 0 and raw priority ``-inf``. ``B`` is :attr:`branching`; ``k`` the number of slots
    written, ``s`` the number of draws. Not thread-safe: the samplers hold a lock.

    The sampler operations (:meth:`check_and_write`, :meth:`mark_update`, :meth:`sample`) take
    ``eps``, ``alpha``, ``beta`` as Python floats and ``f32`` (the sampler's dtype is float32)
    and raise the samplers' errors, worded by :mod:`fastreplay._core.trees.ops`; a call that
    raises has changed nothing.
    """

    backend: str
    """``"torch"``, ``"numba"`` or ``"device"``."""
    capacity: int
    branching: int
    device: torch.device

    @property
    def levels(self) -> list[torch.Tensor]:
        """Views ``(3, nodes)`` of every level, leaves first (rows: sum, min, negated raw)."""
        ...

    # ---------------------------------------------------------------- reads
    def total(self) -> float:
        """Sum of the mass of every written slot. O(1)."""
        ...

    def min_mass(self) -> float:
        """Smallest mass over written slots, ``inf`` if none is written. O(1)."""
        ...

    def max_raw(self) -> float:
        """Largest raw priority over written slots, ``-inf`` if none is written. O(1)."""
        ...

    def prefix(self, n: int) -> tuple[float, float]:
        """``(sum, min)`` of the mass over slots ``[0, n)``. O(n) at most."""
        ...

    def mass(self, index: torch.Tensor) -> torch.Tensor:
        """Mass (float64) at the slots ``index``. O(k)."""
        ...

    def raw(self) -> torch.Tensor:
        """Raw priority of every slot (``-inf`` where unwritten), float64. O(capacity)."""
        ...

    def leaf_mass(self) -> torch.Tensor:
        """Mass of every slot (0 where unwritten), float64, a copy. O(capacity)."""
        ...

    def written(self) -> torch.Tensor:
        """Boolean mask of the slots that hold a priority. O(capacity)."""
        ...

    def search(self, prefix: torch.Tensor, *, guard: bool = False) -> torch.Tensor:
        """Slot of each prefix mass: the smallest ``i`` with ``sum(mass[:i + 1]) > prefix``.

        Always a slot with positive mass while :meth:`total` is. O(s log_B capacity).
        """
        ...

    # ---------------------------------------------------------------- raw writes (no checks)
    def update(self, index: torch.Tensor, mass: torch.Tensor, raw: torch.Tensor) -> None:
        """Write masses and raw priorities at in-range ``index`` (last repeat wins).

        O(k log_B capacity).
        """
        ...

    def clear(self, index: torch.Tensor) -> None:
        """Make the slots ``index`` unwritten. O(k log_B capacity)."""
        ...

    def reset(self) -> None:
        """Make every slot unwritten. O(capacity)."""
        ...

    def set_leaves(self, mass: torch.Tensor, raw: torch.Tensor) -> None:
        """Replace every leaf (``capacity`` each; raw ``-inf``: unwritten). O(capacity)."""
        ...

    def rebuild(self) -> None:
        """Recompute every internal node from the leaves. O(capacity)."""
        ...

    # ---------------------------------------------------------------- sampler operations
    def check_and_write(
        self,
        index: torch.Tensor,
        raw: torch.Tensor,
        stored: int,
        eps: float,
        alpha: float,
        f32: bool,
    ) -> tuple[float, int]:
        """Check, then write raw priorities ``raw`` and their mass at the slots ``index``.

        ``index``: a 1-D long tensor on :attr:`device`; ``-1`` entries are skipped (TorchRL's
        ``MaxValueWriter`` marks rows so). ``raw``: a 1-D float32/float64 tensor, one priority
        per index or one for all. A repeated slot takes its last value. Atomic: nothing is
        written unless every entry is good. Memory stays bounded for bulk writes (numba:
        O(k) scratch; torch: chunks of ``max(capacity / 16, 65536)`` slots).

        Returns:
            ``(largest priority written, largest slot written)``; ``(-inf, -1)`` if every
            index is ``-1``.

        Raises:
            ValueError: an index outside ``[0, stored)``, or a NaN, infinite or negative
                priority (the message names them).
            PriorityOverflowError: a mass that does not fit the dtype.

        O(k log_B capacity); O(capacity) for writes of a large share of the slots.
        """
        ...

    def mark_update(
        self,
        index: torch.Tensor,
        stored: int,
        eps: float,
        alpha: float,
        f32: bool,
        initial: float,
        upper: float,
        all_time_max: float | None,
    ) -> tuple[float | torch.Tensor, int]:
        """Write one priority at every slot of ``index`` (``-1`` skipped): new items' default.

        Checks ``index`` first. With ``all_time_max=None`` (the live max): if a slot of
        ``index`` holds the live max raw priority, clears those slots, and the default is the
        max of what is left. Otherwise the default is ``all_time_max``. The default is
        ``initial`` while there is no max (``-inf``), and at most ``upper``; it is written as
        :meth:`check_and_write` writes.

        Returns:
            ``(value written, largest slot written)``; ``(-inf, -1)`` if every index is ``-1``.
            The device backend returns, without reading them back, the live-max value as a
            0-dim tensor and ``stored - 1`` as the largest slot of an index on an
            accelerator.

        O(k log_B capacity).
        """
        ...

    def sample(
        self,
        draw: torch.Tensor,
        total: float,
        m_min: float,
        beta: float,
        f32: bool,
        limit: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Draw a slot for each uniform float64 ``draw`` in ``[0, 1)`` (scaled in place).

        Descends the sum tree to the slot holding ``draw * total``, reads its mass ``m`` and
        returns ``(slots, (m / m_min) ** -beta)``, the weights float32 if ``f32`` else float64.
        ``total`` and ``m_min`` are :meth:`total` and :meth:`min_mass`, or with ``limit``
        (only slots below it are drawn) those of :meth:`prefix` ``(limit)``: a draw that
        rounding pushes past ``limit`` moves to the last slot below it with mass.

        O(s log_B capacity).
        """
        ...

    # ---------------------------------------------------------------- persistence
    def to(self, device: torch.device | str) -> PriorityTreeBackend:
        """The trees on ``device``, moved in place (``self``). O(capacity).

        Raises ValueError where this backend cannot live (numba: off the CPU).
        """
        ...


def available_backends() -> tuple[str, ...]:
    """The tree backends that work in this environment (``"torch"`` and ``"device"`` always do)."""
    from fastreplay._core.trees.numba_backend import NUMBA_AVAILABLE

    return ("torch", "numba", "device") if NUMBA_AVAILABLE else ("torch", "device")


def make_trees(
    capacity: int,
    *,
    backend: str | None = None,
    device: torch.device | str | None = None,
    branching: int | None = None,
) -> PriorityTreeBackend:
    """Build priority trees (a :class:`PriorityTreeBackend`) on ``backend``. O(capacity).

    Args:
        capacity: number of leaf slots.
        backend: ``"numba"`` (compiled loops, CPU only, needs the optional numba),
            ``"torch"`` (pure torch, any device), ``"device"`` (pure torch, fixed depth, no
            host reads when sampling or writing: for accelerators), ``"triton"`` (the device
            layout with its walk and writes as one Triton kernel each: CUDA, needs triton)
            or ``None``: ``"device"``
            off the CPU; on the CPU numba when it is installed, else torch.
        device: where the trees live (CPU by default).
        branching: fan-out of every internal node; ``None`` takes the backend's default
            (32 for torch, where the number of levels sets the cost; 8 for numba, where the
            memory touched per level does; for device, the smallest ``B`` with
            ``B ** 3 > capacity``).

    Raises:
        ValueError: an unknown ``backend``, or one that cannot run here (numba missing, or
            a non-CPU ``device`` with ``backend="numba"``); the message says the fix.

    Example:
        >>> make_trees(7, backend="torch").backend
        'torch'
    """
    from fastreplay._core.trees.device_backend import DevicePriorityTrees
    from fastreplay._core.trees.numba_backend import NUMBA_AVAILABLE, NumbaPriorityTrees

    if backend is not None and backend not in BACKENDS:
        raise ValueError(
            f"backend must be None, 'torch', 'numba', 'device' or 'triton', got "
            f"backend={backend!r}; None picks 'device' for trees off the CPU, and on the CPU "
            "numba when it is installed, else torch"
        )
    on_cpu = device is None or torch.device(device).type == "cpu"
    if backend is None:
        backend = ("numba" if NUMBA_AVAILABLE else "torch") if on_cpu else "device"
    if backend == "device":
        return DevicePriorityTrees(capacity, device=device, branching=branching)
    if backend == "triton":
        from fastreplay._core.trees.triton_backend import TritonPriorityTrees

        return TritonPriorityTrees(capacity, device=device, branching=branching)
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


def move_trees(
    trees: PriorityTreeBackend, device: torch.device | str, *, backend: str | None = None
) -> PriorityTreeBackend:
    """``trees`` on ``device``, every priority kept. O(capacity).

    Moved in place where their backend lives there. With ``backend=None`` (the automatic
    choice of :func:`make_trees`), trees asked off the CPU are rebuilt on the ``"device"``
    backend there (unless they are on it already).

    Raises:
        ValueError: ``backend`` was chosen explicitly and cannot live on ``device``.

    Example:
        >>> move_trees(make_trees(7, backend="torch"), "cpu").backend
        'torch'
    """
    device = torch.device(device)
    if backend is None and device.type != "cpu" and trees.backend not in ("device", "triton"):
        moved = make_trees(trees.capacity, backend="device", device=device)
        moved.set_leaves(trees.leaf_mass(), trees.raw())
        return moved
    return trees.to(device)

"""Priority trees whose sampling walk and writes are one Triton kernel each.

:class:`TritonPriorityTrees` (backend ``"triton"``) is
:class:`fastreplay._core.trees.device_backend.DevicePriorityTrees` (same three-level layout,
same checks, same host reads: none when sampling or writing) with its two multi-op steps
replaced by one launch each (:mod:`fastreplay._core.trees.triton_kernels`):

* the walk of :meth:`sample_live` / :meth:`search_with_mass` (about 25 torch ops there): one
  kernel that also reads the total from the root and the found leaves' masses;
* a write with the recomputation of its ancestors (about 15 torch ops there, and two more to
  make the last of repeated slots win): one kernel of a single program.

Sums inside the levels are reduced in another order than ``torch.sum``'s, so draws may differ
from the ``"device"`` backend's within rounding of a boundary between two leaves; everything
else (checks, errors, the default priority, checkpoints) is the device backend's. Writes of
more than :data:`KERNEL_WRITE_UP_TO` slots, and bulk rebuilds, use the device backend's torch
ops.

Triton is an optional dependency (it ships with torch's CUDA builds): :func:`triton_available`
says whether the kernels can run, which is on a CUDA device, or on the CPU under Triton's
interpreter (``TRITON_INTERPRET=1`` set before fastreplay builds its first ``"triton"`` trees),
which is what the tests use without a GPU.
"""

from __future__ import annotations

import importlib.util

import torch

from fastreplay._core.trees.device_backend import DevicePriorityTrees

__all__ = ["KERNEL_WRITE_UP_TO", "TritonPriorityTrees", "triton_available", "triton_unusable"]

KERNEL_WRITE_UP_TO = 1 << 14
"""Largest write (slots) done by the single-program write kernel; larger ones use torch ops."""

_WALK_TILE = 4096  # prefixes x padded branching per program of the walk


def triton_available() -> bool:
    """Whether the ``triton`` package is installed (its kernels may still need a GPU). O(1)."""
    return importlib.util.find_spec("triton") is not None


def triton_unusable(device: torch.device) -> str | None:
    """Why ``"triton"`` trees cannot live on ``device`` (``None``: they can). O(1).

    They need the ``triton`` package, and a CUDA device, or Triton's interpreter for trees on
    the CPU (``TRITON_INTERPRET=1`` in the environment before the first ``"triton"`` trees).
    """
    if not triton_available():
        return (
            "backend='triton' needs the triton package (it ships with torch's CUDA builds); "
            "pass backend='device' (or None) for pure-torch trees"
        )
    if device.type == "cuda":
        return None
    from fastreplay._core.trees import triton_kernels

    if device.type == "cpu" and triton_kernels.INTERPRETED:
        return None
    return (
        f"backend='triton' runs Triton kernels on a CUDA device, got device={device}: pass "
        "backend='device' (or None) for trees there (on the CPU, Triton's interpreter runs them "
        "when TRITON_INTERPRET=1 is set before fastreplay builds its first triton trees)"
    )


def _padded(b: int) -> int:
    return 1 << (b - 1).bit_length()


class TritonPriorityTrees(DevicePriorityTrees):
    """:class:`DevicePriorityTrees` with the walk and each write as one Triton kernel.

    Args:
        capacity: number of leaf slots.
        device: where the trees live: a CUDA device (or the CPU under Triton's interpreter).
        branching: as for :class:`DevicePriorityTrees`.

    Raises:
        ValueError: Triton cannot run on ``device`` (:func:`triton_unusable` says why).

    Memory: that of :class:`DevicePriorityTrees`. Implements
    :class:`fastreplay._core.trees.interface.PriorityTreeBackend`.
    """

    backend = "triton"

    def __init__(
        self,
        capacity: int,
        *,
        device: torch.device | str | None = None,
        branching: int | None = None,
    ) -> None:
        where = torch.device(device) if device is not None else torch.device("cpu")
        reason = triton_unusable(where)
        if reason is not None:
            raise ValueError(reason)
        super().__init__(capacity, device=device, branching=branching)

    def _views(self) -> None:
        super()._views()
        from fastreplay._core.trees import triton_kernels

        self._kernels = triton_kernels
        b = self.branching
        self._bp = _padded(b)
        self._walk_block = max(1, _WALK_TILE // self._bp)
        self._write_block = max(16, 4096 // self._bp)

    def to(self, device: torch.device | str) -> TritonPriorityTrees:
        """Move the trees to ``device`` in place and return ``self``. O(capacity).

        Raises:
            ValueError: Triton cannot run on ``device`` (nothing is moved).
        """
        reason = triton_unusable(torch.device(device))
        if reason is not None:
            raise ValueError(reason)
        super().to(device)
        return self

    def _launch_write(self, index: torch.Tensor, leaves: torch.Tensor) -> None:
        """One kernel: the columns of ``leaves`` (3, k) or (3, 1) at ``index``, and ancestors."""
        leaf, mid, top, root = self.levels
        self._kernels.write[(1,)](
            index,
            leaves,
            leaves.stride(0),
            0 if leaves.shape[1] == 1 else leaves.stride(1),
            index.numel(),
            self._scratch,
            leaf,
            mid,
            top,
            root,
            B=self.branching,
            BP=self._bp,
            BLOCK=self._write_block,
        )

    def _write(self, index: torch.Tensor, leaves: torch.Tensor, rebuild: bool = True) -> None:
        """Write leaf columns ``leaves`` (3, k), or one column for all, at ``index``.

        One kernel launch for up to :data:`KERNEL_WRITE_UP_TO` slots with ``rebuild``; the
        device backend's torch ops otherwise. A repeated slot takes its last value. O(k B).
        """
        k = index.numel()
        if not k:
            return
        if not rebuild or k > KERNEL_WRITE_UP_TO or k * self.branching > self._bulk_from:
            super()._write(index, leaves, rebuild)
            return
        self._launch_write(index.contiguous(), leaves)

    def _find(self, prefix: torch.Tensor, scale: bool) -> tuple[torch.Tensor, torch.Tensor]:
        n = prefix.numel()
        index = torch.empty(n, dtype=torch.long, device=self.device)
        mass = torch.empty(n, dtype=torch.float64, device=self.device)
        if n:
            leaf, mid, top, root = self.levels
            block = self._walk_block
            self._kernels.walk[((n + block - 1) // block,)](
                prefix.contiguous(),
                index,
                mass,
                leaf,
                mid,
                top,
                root,
                n,
                SCALE=scale,
                B=self.branching,
                BP=self._bp,
                BLOCK=block,
            )
        return index, mass

    def search_with_mass(self, prefix: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Leaf of each prefix mass and its mass: one kernel launch, no host read. O(s B)."""
        return self._find(self._float(prefix), scale=False)

    def _walk(self, prefix: torch.Tensor) -> torch.Tensor:
        """The device backend's guarded walk, in one kernel launch. O(s B)."""
        return self._find(prefix, scale=False)[0]

    def sample_live(
        self, draw: torch.Tensor, beta: float, f32: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`DevicePriorityTrees.sample_live`: the walk in one launch, then the weights.

        The draws are scaled by the total inside the kernel (read from the root there).
        Three launches in all for float64 weights, four for float32. O(s B).
        """
        draw = self._float(draw)
        index, mass = self._find(draw, scale=True)
        weight = torch.div(mass, self._root[1]).pow_(-beta)
        return index, weight.to(torch.float32) if f32 else weight

"""The steps of slices: TorchRL's slice indices, built from slice starts with numpy.

Every slice sampler of fastreplay turns its slices (a start row per slice, optionally a random
offset inside the slice's trajectory, a length, and for storages of ``ndim > 1`` the
coordinates of the slice's column) into the flat index TorchRL returns with
:func:`slice_index`. The same inputs give the same index as TorchRL's
``SliceSampler._get_index`` (without ``span``) and ``_tensor_slices_from_startend``, bit for
bit: the random offset is computed in ``float32``, as TorchRL's ``rand * (lengths - seq + 1)``.

Numpy, not torch: for a few hundred slices each torch op costs more than the work it does
(about 3x slower here for 256 slices of 32 steps).
"""

from __future__ import annotations

import numpy as np

__all__ = ["slice_index"]


def slice_index(
    start: np.ndarray,
    seq: int | np.ndarray,
    rows: int,
    *,
    length: np.ndarray | None = None,
    draw: np.ndarray | None = None,
    coords: np.ndarray | None = None,
) -> tuple[tuple[np.ndarray, ...], np.ndarray]:
    """Every step of ``n`` slices, in TorchRL's flat layout: ``O(steps)``.

    Args:
        start: ``[n]`` int64 time rows: each slice's first step, or (with ``draw``) the first
            step of the slice's trajectory.
        seq: steps per slice, an ``int`` or an ``[n]`` int64 array (slices of several lengths).
        rows: the storage's time rows; step rows wrap around past the last one.
        length: ``[n]`` trajectory lengths (with ``draw``).
        draw: ``[n]`` uniform draws in ``[0, 1)`` of ``torch.rand``'s dtype (float32): then
            slice ``i`` starts at ``start[i] + floor(draw[i] * (length[i] - seq[i] + 1))``,
            as TorchRL's ``_get_index`` places it (its ``torch.rand(n)``: same result).
        coords: ``[n, d]`` int64 coordinates of each slice's column for storages of
            ``ndim = d + 1 > 1``; every step of a slice has its column's coordinates.

    Returns:
        ``(index, heads)``: ``index`` a tuple of ``1 + d`` int64 arrays of every step (the time
        row, then each coordinate), as TorchRL's index unbound along its last dim; ``heads``
        the position of each slice's first step in them.
    """
    n = start.shape[0]
    first = start
    if draw is not None:
        assert length is not None, "draw needs the trajectory lengths"
        room = (length - seq + 1).astype(draw.dtype)  # torch's ``rand * int64``: float32
        first = start + np.floor(draw * room).astype(np.int64)
    if isinstance(seq, int):
        steps = (first[:, None] + np.arange(seq)).reshape(-1)
        heads = np.arange(0, n * seq, seq)
        longest = seq
    else:
        heads = np.cumsum(seq) - seq
        steps = np.repeat(first - heads, seq) + np.arange(int(seq.sum()))
        longest = int(seq.max()) if n else 0
    if n and (int(first.min()) < 0 or int(first.max()) + longest > rows):
        steps %= rows  # slices running past the last row wrap to row 0
    if coords is None or not coords.shape[1]:
        return (steps,), heads
    repeated = np.repeat(coords, seq, axis=0)
    return (steps, *(repeated[:, d] for d in range(coords.shape[1]))), heads

"""The windows of a ``Sequence`` sample unit, in a few NumPy passes (pure core, no TorchRL).

TorchRL's ``Sequence`` unit turns each anchor into ``burn_in + length + bootstrap`` records
spaced ``dilation`` apart, clamped at the anchor's episode boundaries (``"pad"``), shifted back
so that the learning region and bootstrap end at the episode's end where possible
(``"stop"``), or clamped only at the storage's write seam (``"include_reset"``). Its
``expand`` computes that with about thirty small torch operations; :func:`windows` computes
the same integers with a dozen NumPy operations on the ``[batch, window]`` arrays, so that a
sample's expansion costs ``O(batch x window)`` with a small constant.

Example:
    >>> import numpy as np
    >>> index, valid = windows(
    ...     np.array([5]), np.array([0]), np.array([4]), length=2, burn_in=1, bootstrap=1,
    ...     dilation=1, policy="pad", modulus=10,
    ... )
    >>> index.tolist(), valid.tolist()
    ([[5, 5, 6, 7]], [[False, True, True, True]])
"""

from __future__ import annotations

import numpy as np

__all__ = ["windows"]


def windows(
    anchor: np.ndarray,
    back: np.ndarray,
    ahead: np.ndarray,
    *,
    length: int,
    burn_in: int,
    bootstrap: int,
    dilation: int,
    policy: str,
    modulus: int,
) -> tuple[np.ndarray, np.ndarray]:
    """Record rows and validity of each anchor's window, as TorchRL's ``Sequence.expand``.

    Args:
        anchor: ``[B]`` int64 time rows of the anchors.
        back: ``[B]`` int64 rows the window may reach before the anchor (the distance to
            the episode's first row; for ``"include_reset"``, to the oldest stored row).
        ahead: ``[B]`` int64 rows it may reach after (to the episode's last row; for
            ``"include_reset"``, to the newest stored row).
        length: the learning region's length.
        burn_in: records before the anchor.
        bootstrap: records after the learning region.
        dilation: rows between consecutive records.
        policy: ``"pad"``, ``"stop"`` or ``"include_reset"`` (for the last two, only
            ``"stop"`` moves the anchor).
        modulus: the number of rows the indices wrap at.

    Returns:
        ``(rows, valid)``, both ``[B, burn_in + length + bootstrap]``: int64 rows and booleans.
        ``O(B x window)``.
    """
    total = burn_in + length + bootstrap
    offset = (np.arange(total, dtype=np.int64) - burn_in) * dilation
    if policy == "stop":
        shortfall = dilation * (length + bootstrap - 1) - ahead
        shift = np.minimum(np.maximum(shortfall, 0), back)
        anchor = anchor - shift
        ahead = ahead + shift
        back = back - shift
    ahead, back = ahead[:, None], back[:, None]
    valid = (offset <= ahead) & (offset >= -back)
    clamped = np.maximum(np.minimum(offset, ahead), -back)
    return np.remainder(anchor[:, None] + clamped, modulus), valid

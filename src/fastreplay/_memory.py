"""Large arrays that ask the kernel for huge pages (Linux transparent huge pages).

A priority tree over millions of slots spans tens of megabytes, and every sample or update
touches a few hundred scattered lines of it. With 4 KiB pages most of those accesses also miss
the TLB, and each miss walks the page tables before the load can start; 2 MiB pages cover the
same tree with a few entries. :func:`large_zeros` allocates such arrays from anonymous memory
aligned to 2 MiB and advised ``MADV_HUGEPAGE``, which Linux honours where transparent huge
pages are set to ``always`` or ``madvise`` (the common default). Elsewhere (other systems,
huge pages set to ``never``, small arrays) it is plain ``numpy.zeros``: the only difference is
speed.

The memory is private to the process (``MAP_PRIVATE``): a forked child gets a copy-on-write
view, as with ``numpy.zeros``, and pickling copies the values.

Example:
    >>> import numpy as np
    >>> from fastreplay._memory import large_zeros
    >>> tree = large_zeros((3, 1_000_000), np.float64)
    >>> tree.shape, tree.dtype, float(tree.sum()), tree.flags.c_contiguous
    ((3, 1000000), dtype('float64'), 0.0, True)
"""

from __future__ import annotations

import contextlib
import mmap
from typing import Any

import numpy as np

__all__ = ["HUGE_PAGE", "MIN_BYTES", "huge_pages_advised", "large_zeros"]

HUGE_PAGE = 2 << 20  # the x86-64 / arm64 transparent huge page size
MIN_BYTES = 2 * HUGE_PAGE  # below this, the few 4 KiB pages stay cached anyway
_ADVICE = getattr(mmap, "MADV_HUGEPAGE", None)  # Linux only
_PRIVATE = getattr(mmap, "MAP_PRIVATE", None)
_ANONYMOUS = getattr(mmap, "MAP_ANONYMOUS", None)


def huge_pages_advised(nbytes: int) -> bool:
    """Whether :func:`large_zeros` of ``nbytes`` bytes asks for huge pages here. O(1)."""
    return nbytes >= MIN_BYTES and None not in (_ADVICE, _PRIVATE, _ANONYMOUS)


def large_zeros(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """A zero-filled, writable, C-contiguous array, on huge pages where the system allows.

    O(size) memory, reserved lazily by the kernel as the pages are first written (as for
    ``numpy.zeros``). The array keeps its memory alive; it is freed with the array.

    Args:
        shape: the array's shape.
        dtype: the array's NumPy dtype.

    Returns:
        The array. ``array.flags.owndata`` is False when it lives on advised memory (its
        ``base`` holds the mapping).
    """
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if not huge_pages_advised(nbytes):
        return np.zeros(shape, dtype)
    try:
        # One extra huge page of address space, so an aligned start fits inside it.
        mapping = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=_PRIVATE | _ANONYMOUS)
    except OSError:  # pragma: no cover - address space exhausted: let numpy report it
        return np.zeros(shape, dtype)
    with contextlib.suppress(OSError):  # a kernel without transparent huge pages: plain pages
        mapping.madvise(_ADVICE)
    raw = np.frombuffer(mapping, dtype=np.uint8)
    start = -raw.ctypes.data % HUGE_PAGE
    return raw[start : start + nbytes].view(dtype).reshape(shape)

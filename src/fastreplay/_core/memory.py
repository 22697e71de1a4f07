"""Large arrays that ask the kernel for huge pages (Linux transparent huge pages).

A priority tree over millions of slots spans tens of megabytes, and every sample or update
touches a few hundred scattered lines of it. With 4 KiB pages most of those accesses also miss
the TLB, and each miss walks the page tables before the load can start; 2 MiB pages cover the
same tree with a few entries. :func:`large_zeros` allocates such arrays from anonymous memory
aligned to 2 MiB and advised ``MADV_HUGEPAGE``, which Linux honours where transparent huge
pages are set to ``always`` or ``madvise`` (the common default); :func:`advise_huge_pages`
gives the same advice for memory allocated elsewhere (a storage's fresh tensors). Elsewhere
(other systems, huge pages set to ``never``, small arrays) nothing is advised: the only
difference is speed. Setting the environment variable ``FASTREPLAY_HUGE_PAGES=0`` turns the
advice off (for example where a system's huge-page compaction stalls are not wanted).

The memory is private to the process (``MAP_PRIVATE``): a forked child gets a copy-on-write
view, as with ``numpy.zeros``, and pickling copies the values.

Example:
    >>> import numpy as np
    >>> from fastreplay._core.memory import large_zeros
    >>> tree = large_zeros((3, 1_000_000), np.float64)
    >>> tree.shape, tree.dtype, float(tree.sum()), tree.flags.c_contiguous
    ((3, 1000000), dtype('float64'), 0.0, True)
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import mmap
import os
from typing import Any

import numpy as np

__all__ = ["HUGE_PAGE", "MIN_BYTES", "advise_huge_pages", "huge_pages_advised", "large_zeros"]

HUGE_PAGE = 2 << 20  # the x86-64 / arm64 transparent huge page size
MIN_BYTES = 2 * HUGE_PAGE  # below this, the few 4 KiB pages stay cached anyway
_ADVICE = getattr(mmap, "MADV_HUGEPAGE", None)  # Linux only
_PRIVATE = getattr(mmap, "MAP_PRIVATE", None)
_ANONYMOUS = getattr(mmap, "MAP_ANONYMOUS", None)


def _enabled() -> bool:
    """Huge pages are advised unless ``FASTREPLAY_HUGE_PAGES=0``; read at each call. O(1)."""
    return os.environ.get("FASTREPLAY_HUGE_PAGES", "1").strip() != "0"


def huge_pages_advised(nbytes: int) -> bool:
    """Whether :func:`large_zeros` of ``nbytes`` bytes asks for huge pages here. O(1)."""
    return nbytes >= MIN_BYTES and None not in (_ADVICE, _PRIVATE, _ANONYMOUS) and _enabled()


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
    assert _PRIVATE is not None and _ANONYMOUS is not None and _ADVICE is not None  # advised
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


def advise_huge_pages(address: int, nbytes: int) -> int:
    """Advise huge pages for the whole 2 MiB pages inside ``[address, address + nbytes)``.

    For memory that is already allocated but not yet written (a fresh ``torch.empty``): the
    pages written from then on can be huge pages. Pages already written keep their size. The
    advice changes no values. O(1).

    Returns:
        The number of bytes advised: 0 where the range holds no whole huge page, or where the
        system has no such advice.
    """
    start = -(-address // HUGE_PAGE) * HUGE_PAGE
    stop = (address + nbytes) // HUGE_PAGE * HUGE_PAGE
    if stop - start < HUGE_PAGE or _ADVICE is None or not _enabled() or _libc() is None:
        return 0
    done = _libc().madvise(ctypes.c_void_p(start), ctypes.c_size_t(stop - start), _ADVICE)
    return stop - start if done == 0 else 0


@functools.cache
def _libc() -> Any:
    """The C library's ``madvise``, or None where it cannot be loaded."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        libc.madvise.restype = ctypes.c_int
    except (OSError, AttributeError):  # pragma: no cover - not a POSIX C library
        return None
    return libc

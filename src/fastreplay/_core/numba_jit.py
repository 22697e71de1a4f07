"""numba for fastreplay's kernels: compile with a disk cache where one is writable, prefetch.

The kernels (:mod:`fastreplay._core.trees.numba_kernels`) are cached on disk (numba's
``cache=True``: a ``__pycache__`` next to the module, the user's cache dir, or ``NUMBA_CACHE_DIR``).
Where none of them is writable (a read-only install), they are compiled without a cache in every
process instead, and one message on the ``fastreplay`` logger says how to enable it (a logged
message, not a warning: importing must keep working where warnings are errors).

``_prefetch`` hints the CPU to load a cache line without waiting for it: a search or update
issues the loads of many independent nodes back to back, so their misses overlap. Without
numba, :func:`_jit` returns the function unchanged and ``_prefetch`` does nothing.
"""

from __future__ import annotations

import logging
from typing import Any

try:  # optional dependency: ``pip install numba``
    import numba
except ImportError:  # pragma: no cover - depends on the environment
    numba = None  # type: ignore[assignment, unused-ignore]  # (Any where numba is missing)

NUMBA_AVAILABLE = numba is not None

_LOG = logging.getLogger("fastreplay._core.trees.numba_kernels")  # where users look for it
_NO_CACHE = (
    "numba cannot cache fastreplay's compiled kernels: neither the __pycache__ folder next to "
    "%s nor the user's cache dir is writable, so every new process compiles them again (a few "
    "seconds at first use). To cache them, set the environment variable "
    "NUMBA_CACHE_DIR=/some/writable/dir before importing fastreplay."
)
_cache = True  # False once numba found no writable cache location (checked on the first kernel)


def _jit(fn: Any = None, **options: Any) -> Any:
    """``numba.njit(cache=True)``; without a cache where numba finds no writable location."""
    global _cache
    if fn is None:
        return lambda f: _jit(f, **options)
    if numba is None:
        return fn
    if _cache:
        try:
            return numba.njit(cache=True, **options)(fn)
        except RuntimeError as error:  # "cannot cache function ...: no locator available ..."
            if "cannot cache" not in str(error):
                raise
            _cache = False
            _LOG.warning(_NO_CACHE, __file__)
    return numba.njit(**options)(fn)


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

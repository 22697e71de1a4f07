"""``python -m fastreplay.warm``: compile fastreplay's numba kernels into numba's cache now.

The numba priority trees (the default ``PrioritizedSampler`` backend where numba is installed)
run compiled kernels, cached on disk after their first compilation (see
:mod:`fastreplay._core.numba_jit`). A process that finds the cache empty compiles every kernel
its first calls need: seconds, once per kernel and argument types, at the first ``extend``,
``sample`` or ``update_priority``. Run this module once where the cache will be read (a Docker
image build, a CI job's set-up, after ``pip install``), with the same ``NUMBA_CACHE_DIR`` as
the training processes, and they load the kernels instead (milliseconds each).

It calls every kernel of the numba trees with each argument type fastreplay passes it (float32
and float64 priorities, one priority for all slots or one per slot), on a tiny tree: what it
compiles is what the samplers' calls load later. A second run only loads them.

Example:
    >>> from fastreplay.warm import warm
    >>> kernels = warm()  # compiled, or loaded from the cache
    >>> not kernels or "_sample" in kernels
    True
"""

from __future__ import annotations

import math
import sys
import time

import torch

__all__ = ["warm"]


def warm() -> dict[str, int]:
    """Compile (or load) every numba kernel of the priority trees; O(1) work, seconds once.

    Returns:
        Kernel name -> number of argument-type signatures now compiled or loaded in this
        process; empty where numba is not installed (nothing to compile: the pure-torch trees
        are used).
    """
    from fastreplay._core.trees import numba_kernels
    from fastreplay._core.trees.numba_backend import NUMBA_AVAILABLE, NumbaPriorityTrees
    from fastreplay._core.trees.ops import c_pow

    if not NUMBA_AVAILABLE:
        return {}
    capacity, eps, alpha = 37, 1e-8, 0.7
    trees = NumbaPriorityTrees(capacity)
    index = torch.arange(5)
    for dtype in (torch.float32, torch.float64):
        f32 = dtype == torch.float32
        raw = torch.linspace(0.5, 1.5, 5, dtype=dtype)
        trees.check_and_write(index, raw, capacity, eps, alpha, f32)
        trees.check_and_write(index, raw[:1], capacity, eps, alpha, f32)  # one for all
        numba_kernels._write_priorities(
            trees._tree, trees._offsets, trees._sizes, trees.branching,
            index.numpy(), raw.numpy(), eps, alpha, f32,
        )  # fmt: skip  # the exact path for masses near the dtype's limit
        trees.mark_update(index, capacity, eps, alpha, f32, 1.0, math.inf, None)
        trees.mark_update(index, capacity, eps, alpha, f32, 1.0, math.inf, 2.0)
        draw = torch.linspace(0.0, 0.99, 8, dtype=torch.float64)
        total, m_min = trees.prefix(capacity)
        trees.sample(draw, total, m_min, 0.5, f32)
        leaves = torch.full((capacity,), 1.0, dtype=dtype)
        trees.set_leaves(leaves, leaves)
    trees.update(index, torch.ones(5, dtype=torch.float64), torch.ones(5, dtype=torch.float64))
    trees.clear(index)
    trees.rebuild()
    trees.search(torch.tensor([0.5], dtype=torch.float64))
    c_pow(torch.ones(1 << 14, dtype=torch.float64), alpha)  # bulk masses: the compiled pow
    return {
        name: len(kernel.signatures)
        for name, kernel in vars(numba_kernels).items()
        if getattr(kernel, "signatures", None)
    }


def main() -> int:
    """Warm the cache and say what was compiled, where, and how long it took."""
    start = time.perf_counter()
    kernels = warm()
    seconds = time.perf_counter() - start
    if not kernels:
        print("numba is not installed: fastreplay uses its pure-torch trees, nothing to compile")
        return 0
    from fastreplay._core.trees import numba_kernels

    where = numba_kernels._sample.stats.cache_path  # where numba wrote (or found) the kernels
    print(
        f"{len(kernels)} numba kernels ready in {seconds:.1f} s ({sum(kernels.values())} "
        f"signatures; numba cache: {where})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

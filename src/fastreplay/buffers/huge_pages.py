"""Huge pages for a lazy storage's tensors, advised when the buffer's first write creates them.

A ``LazyTensorStorage`` allocates its tensors (``torch.empty``, nothing written yet) in the
first write. Every sample then gathers a few hundred scattered rows from them, and with 4 KiB
pages most of those reads also miss the TLB. The buffers' writes
(:class:`~fastreplay.buffers.paths.PathChoice`) advise
``MADV_HUGEPAGE`` (see :mod:`fastreplay._core.memory`) for those tensors right after that first
write, so the rows written from then on sit on 2 MiB pages where Linux offers them. Values,
shapes, dtypes and the storage's state are untouched; elsewhere nothing happens.

Only ``LazyTensorStorage`` (TorchRL's or fastreplay's) on the CPU, in this process's own
memory: a ``LazyMemmapStorage`` is a file, a ``TensorStorage`` holds the user's tensors, and
shared storages live in shared memory (``torch.multiprocessing``), whose page size the system
decides.
"""

from __future__ import annotations

from typing import Any

import torch
from tensordict import is_tensor_collection
from torch.utils._pytree import tree_leaves

from fastreplay import _torchrl
from fastreplay._core.memory import MIN_BYTES, advise_huge_pages

__all__ = ["advise_storage", "after_first_write", "before_first_write"]


def before_first_write(buffer: Any) -> bool:
    """Whether the buffer's next write may create its storage's tensors. O(1).

    True for a ``LazyTensorStorage`` not yet initialised, and for a buffer whose storage is
    built on its first write (TorchRL's ``delayed_init``).
    """
    storage = buffer.__dict__.get("_storage")
    if storage is None:
        return True
    return type(storage) in _torchrl.LAZY_TENSOR_STORAGES and not storage.__dict__.get(
        "initialized", False
    )


def after_first_write(buffer: Any) -> None:
    """Advise huge pages for the storage's tensors if that write created them. O(leaves)."""
    storage = buffer.__dict__.get("_storage")
    if type(storage) in _torchrl.LAZY_TENSOR_STORAGES and storage.__dict__.get(
        "initialized", False
    ):
        advise_storage(storage)


def advise_storage(storage: Any) -> int:
    """Advise huge pages for the large CPU tensors of an initialised storage. O(leaves).

    Returns:
        The number of bytes advised.
    """
    data = storage.__dict__.get("_storage")
    if data is None:
        return 0
    leaves = data.values(True, True) if is_tensor_collection(data) else tree_leaves(data)
    seen: set[int] = set()
    advised = 0
    for leaf in leaves:
        if type(leaf) is not torch.Tensor or leaf.device.type != "cpu" or leaf.is_shared():
            continue
        memory = leaf.untyped_storage()
        address, nbytes = memory.data_ptr(), memory.nbytes()
        if nbytes >= MIN_BYTES and address not in seen:  # views of one buffer: once
            seen.add(address)
            advised += advise_huge_pages(address, nbytes)
    return advised

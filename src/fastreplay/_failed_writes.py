"""Writes that raise part way: the buffer's sampler reads the storage again.

``rb.extend(td)``, ``rb.add(td)`` and ``rb[idx] = td`` write a TensorDict key by key; one that
fails on a later key (a shape or dtype mismatch) has written the keys before it. TorchRL counts a
write on its storage (``_mutation_revision``) after the data, so such a write goes uncounted, and
the sampler is not told about it: a sampler that keeps what it read from the storage
(fastreplay's slice samplers and their trajectory index) would keep the old rows.
"""

from __future__ import annotations

from typing import Any

__all__ = ["FailedWriteMixin"]


def _written_in_part(buffer: Any) -> None:
    """After a write of ``buffer`` raised: its sampler rebuilds what it read, at the next sample.

    O(1); the rebuild costs one ``O(items stored)`` read of the boundary keys. The storage's
    write count is left as TorchRL leaves it (the write may have written nothing).
    """
    invalidate = getattr(buffer.__dict__.get("_sampler"), "invalidate_boundaries", None)
    if invalidate is not None:
        invalidate()


class FailedWriteMixin:
    """Placed first in a TorchRL buffer's bases: after a write that raises, the sampler rereads.

    O(1) per write when it succeeds (a ``try``).
    """

    def extend(self, data: Any, *args: Any, **kwargs: Any) -> Any:
        """TorchRL's ``extend``; if it raises, the sampler rereads the storage."""
        try:
            return super().extend(data, *args, **kwargs)  # type: ignore[misc]
        except BaseException:
            _written_in_part(self)
            raise

    def add(self, data: Any) -> Any:
        """TorchRL's ``add``; if it raises, the sampler rereads the storage."""
        try:
            return super().add(data)  # type: ignore[misc]
        except BaseException:
            _written_in_part(self)
            raise

    def __setitem__(self, index: Any, value: Any) -> None:
        """TorchRL's ``rb[index] = value``; if it raises, the sampler rereads the storage."""
        try:
            super().__setitem__(index, value)  # type: ignore[misc]
        except BaseException:
            _written_in_part(self)
            raise

"""``StreamingSliceSampler``: TorchRL's streaming windows over fastreplay's slice index.

TorchRL's ``StreamingSliceSampler`` (0.14 and later) queues every completed window of
``slice_len`` steps as it is written and returns those first; the rest of a batch comes from its
``SliceSampler`` base, which rescans every stored trajectory boundary at the first ``sample``
after each write. Here that base is :class:`fastreplay.SliceSampler`: TorchRL's class is placed
before it in the bases, so its queue runs unchanged and its ``super()`` calls (``sample``,
``mark_update``, ``_finalize_index``, ``_empty``) reach fastreplay's incremental index.

TorchRL 0.13 has no ``StreamingSliceSampler``; neither has fastreplay there
(:data:`fastreplay._torchrl.HAS_STREAMING_SLICE`).
"""

from __future__ import annotations

from typing import Any

from fastreplay._signature import ConstructorSignature
from fastreplay._torchrl import HAS_STREAMING_SLICE, TorchRLStreamingSliceSampler
from fastreplay.samplers.slice import SliceSampler

__all__ = ["StreamingSliceSampler"] if HAS_STREAMING_SLICE else []

if HAS_STREAMING_SLICE:

    class StreamingSliceSampler(TorchRLStreamingSliceSampler, SliceSampler):
        """Drop-in ``torchrl.data.StreamingSliceSampler`` flat in capacity.

        Same arguments, same queue of fresh windows and, for the same seed, the same indices
        and info as TorchRL's class. Costs:

        * a write of ``n`` items: ``O(n)`` (TorchRL's window queue, plus fastreplay's
          trajectory index reading the ``n`` new rows);
        * ``sample``: ``O(batch)``: queued windows first, then uniform slices drawn from the
          index, where TorchRL rescans all ``O(items stored)`` boundaries after every write;
        * ``can_sample``/``_sampleable_count``: ``O(columns)`` from the index.

        Writes the sampler is not told about are handled as :class:`fastreplay.SliceSampler`
        handles them (one rebuild from the storage, never stale boundaries).

        Example:
            >>> import torch
            >>> from tensordict import TensorDict
            >>> from torchrl.data import LazyTensorStorage
            >>> from fastreplay import StreamingSliceSampler, TensorDictReplayBuffer
            >>> rb = TensorDictReplayBuffer(
            ...     storage=LazyTensorStorage(16),
            ...     sampler=StreamingSliceSampler(slice_len=3),
            ...     batch_size=6,
            ... )
            >>> done = torch.zeros(6, 1, dtype=torch.bool)
            >>> _ = rb.extend(TensorDict({"value": torch.arange(6), ("next", "done"): done}, [6]))
            >>> rb.sample()["value"].reshape(2, 3)
            tensor([[0, 1, 2],
                    [3, 4, 5]])
        """

        __signature__ = ConstructorSignature()  # TorchRL's metaclass hides __init__

        def load_state_dict(self, state_dict: dict[str, Any]) -> None:
            """TorchRL's; the trajectory index is rebuilt from the storage at the next sample."""
            super().load_state_dict(state_dict)
            self._fr_sync.invalidate(loaded=True)

"""fastreplay's TorchRL TensorDict replay buffers, and the parts they are built from.

* :mod:`~fastreplay.buffers.tensordict`: ``TensorDictReplayBuffer`` and
  ``TensorDictPrioritizedReplayBuffer`` (TorchRL's, with the parts below in their bases).
* :mod:`~fastreplay.buffers.her`: ``HERReplayBuffer`` (TorchRL's, its episode ends read from
  an incremental trajectory index).
* :mod:`~fastreplay.buffers.paths`: the one choice, per call, between the direct path and
  TorchRL's general path, and the direct path itself.
* :mod:`~fastreplay.buffers.rows`: the direct path's row writes and gathers (the one module
  that touches TensorDict's private fields).
* :mod:`~fastreplay.buffers.samples` and :mod:`~fastreplay.buffers.pinning`: the sample's
  metadata, pinning and device on TorchRL's path.
* :mod:`~fastreplay.buffers.sharing`: buffers shared with writer processes.
* :mod:`~fastreplay.buffers.huge_pages`: huge pages for lazy storages' tensors.
"""

from __future__ import annotations

from fastreplay.buffers.her import HERReplayBuffer
from fastreplay.buffers.tensordict import TensorDictPrioritizedReplayBuffer, TensorDictReplayBuffer

__all__ = ["HERReplayBuffer", "TensorDictPrioritizedReplayBuffer", "TensorDictReplayBuffer"]

"""fastreplay: fast, correct drop-in replacements for TorchRL replay-buffer components.

Change one import line and keep TorchRL's interfaces, arguments and outputs::

    from fastreplay import SliceSampler, PrioritizedSampler

See ``docs/index.md`` for what each component fixes and how it is tested.
"""

from __future__ import annotations

from fastreplay import samplers as _samplers
from fastreplay.buffers import (
    HERReplayBuffer,
    TensorDictPrioritizedReplayBuffer,
    TensorDictReplayBuffer,
)
from fastreplay.ppo import chunked_log_prob
from fastreplay.ray_buffer import RayReplayBuffer
from fastreplay.sample_units import __all__ as _unit_names
from fastreplay.samplers import (
    PrioritizedSampler,
    PrioritizedSliceSampler,
    SliceSampler,
    SliceSamplerWithoutReplacement,
    StalenessAwareSampler,
)
from fastreplay.storages import LazyMemmapStorage, LazyTensorStorage, TensorStorage

if "StreamingSliceSampler" in _samplers.__all__:  # TorchRL 0.14 and later
    from fastreplay.samplers import StreamingSliceSampler as StreamingSliceSampler

__version__ = "0.1.0"

__all__ = [
    "PrioritizedSampler",
    "SliceSampler",
    "TensorDictPrioritizedReplayBuffer",
    "TensorDictReplayBuffer",
    "__version__",
    "chunked_log_prob",
    "PrioritizedSliceSampler",
    "SliceSamplerWithoutReplacement",
    "RayReplayBuffer",
    "StalenessAwareSampler",
    "HERReplayBuffer",
    "LazyMemmapStorage",
    "LazyTensorStorage",
    "TensorStorage",
    *(name for name in ("StreamingSliceSampler",) if name in _samplers.__all__),
]

# TorchRL's sample units where the installed TorchRL has them (``Sequence`` from 0.14,
# ``SubgoalTriplet`` on the nightly).
if "Sequence" in _unit_names:
    from fastreplay.sample_units import Sequence

    __all__ += ["Sequence"]
if "SubgoalTriplet" in _unit_names:
    from fastreplay.sample_units import SubgoalTriplet

    __all__ += ["SubgoalTriplet"]

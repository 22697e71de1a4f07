"""TorchRL sampler subclasses (thin adapters over fastreplay's pure cores)."""

from fastreplay.samplers.prioritized import PrioritizedSampler
from fastreplay.samplers.prioritized_slice import PrioritizedSliceSampler
from fastreplay.samplers.slice import SliceSampler
from fastreplay.samplers.slice_without_replacement import SliceSamplerWithoutReplacement
from fastreplay.samplers.staleness import StalenessAwareSampler
from fastreplay.samplers.streaming_slice import __all__ as _streaming

if _streaming:  # TorchRL 0.14 and later (0.13 has no StreamingSliceSampler)
    from fastreplay.samplers.streaming_slice import StreamingSliceSampler as StreamingSliceSampler

__all__ = [
    "PrioritizedSampler",
    "SliceSampler",
    "PrioritizedSliceSampler",
    "SliceSamplerWithoutReplacement",
    "StalenessAwareSampler",
    *_streaming,
]

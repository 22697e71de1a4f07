"""TorchRL sampler subclasses (thin adapters over fastreplay's pure cores)."""

from fastreplay.samplers.prioritized import PrioritizedSampler
from fastreplay.samplers.prioritized_slice import PrioritizedSliceSampler
from fastreplay.samplers.slice import SliceSampler
from fastreplay.samplers.slice_without_replacement import SliceSamplerWithoutReplacement
from fastreplay.samplers.staleness import StalenessAwareSampler

__all__ = [
    "PrioritizedSampler",
    "SliceSampler",
    "PrioritizedSliceSampler",
    "SliceSamplerWithoutReplacement",
    "StalenessAwareSampler",
]

"""TorchRL sampler subclasses (thin adapters over fastreplay's pure cores)."""

from fastreplay.samplers.prioritized import PrioritizedSampler
from fastreplay.samplers.slice import SliceSampler

__all__ = ["PrioritizedSampler", "SliceSampler"]

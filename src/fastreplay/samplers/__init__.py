"""TorchRL sampler subclasses (thin adapters over fastreplay's pure cores)."""

from fastreplay.samplers.prioritized import PrioritizedSampler

__all__ = ["PrioritizedSampler"]

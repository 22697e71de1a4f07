"""TorchRL sampler subclasses backed by fastreplay's pure cores."""

from fastreplay.samplers.slice import SliceSampler

__all__ = ["SliceSampler"]

"""fastreplay's pure cores: plain classes and functions, no TorchRL or tensordict imports.

The trajectory index, slice indices, epoch permutations, priority trees and their helpers.
They take and return NumPy arrays, torch tensors and Python scalars; the TorchRL adapters
(``fastreplay.samplers``, ``fastreplay.buffers``, ...) wire them in. ``tests/test_layout.py``
checks that nothing here imports TorchRL or tensordict.
"""

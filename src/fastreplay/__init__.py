"""fastreplay: fast, correct drop-in replacements for TorchRL replay-buffer components.

Change one import line and keep TorchRL's interfaces, arguments and outputs::

    from fastreplay import SliceSampler, PrioritizedSampler

See ``docs/index.md`` for what each component fixes and how it is tested.
"""

from __future__ import annotations

from fastreplay.samplers.prioritized import PrioritizedSampler

__version__ = "0.1.0"

__all__ = ["PrioritizedSampler", "__version__"]

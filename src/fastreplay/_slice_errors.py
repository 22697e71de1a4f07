"""The error classes of fastreplay's slice samplers, public in ``fastreplay.samplers.slice``.

Each is a subclass of every class TorchRL raises in the same situation, so TorchRL-style
handlers still catch it. They live here so that the trajectory-index sync
(:mod:`fastreplay._index_sync`) raises them without importing a sampler; their
``__module__`` is the public one, so tracebacks and pickles name it.
"""

from __future__ import annotations

__all__ = ["MissingKeyError", "SignalTypeError", "SliceSamplerError"]


class MissingKeyError(KeyError, RuntimeError):
    """A boundary key is missing from the storage.

    TorchRL raises ``RuntimeError`` or ``KeyError`` here depending on the key arguments; this
    class is both, so either handler catches it (``str`` shows the message unquoted).
    """

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class SliceSamplerError(ValueError, RuntimeError):
    """Bad sampling request or setting; a ``ValueError`` that ``RuntimeError`` handlers catch."""


class SignalTypeError(TypeError, NotImplementedError):
    """Done flags of a floating-point dtype (TorchRL raises ``NotImplementedError``)."""


for _cls in (MissingKeyError, SignalTypeError, SliceSamplerError):
    _cls.__module__ = "fastreplay.samplers.slice"

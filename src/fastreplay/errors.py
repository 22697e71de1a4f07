"""fastreplay's error classes, in one module.

Each is a subclass of every class TorchRL raises in the same situation, so TorchRL-style
handlers (``except RuntimeError``, ``except KeyError``, ...) still catch it, and its message
names the argument, the value and the fix. The modules that raise them also export them:
``fastreplay.samplers.slice`` (:class:`SliceSamplerError`, :class:`MissingKeyError`,
:class:`SignalTypeError`), ``fastreplay.samplers.prioritized`` (:class:`PriorityOverflowError`,
:class:`PriorityShapeError`, :class:`CheckpointError`) and ``fastreplay.ray_buffer``
(:class:`ReplayBufferClassError`).

This module imports nothing: the pure cores (``fastreplay._core``) raise these classes too.

Example:
    >>> from fastreplay.errors import SliceSamplerError
    >>> issubclass(SliceSamplerError, ValueError) and issubclass(SliceSamplerError, RuntimeError)
    True
"""

from __future__ import annotations

__all__ = [
    "CheckpointError",
    "MissingKeyError",
    "PriorityOverflowError",
    "PriorityShapeError",
    "ReplayBufferClassError",
    "SignalTypeError",
    "SliceSamplerError",
]


# --------------------------------------------------------------------------- slice samplers
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


# --------------------------------------------------------------------- prioritized samplers
class PriorityOverflowError(OverflowError, ValueError):
    """A priority whose sampling mass ``(p + eps) ** alpha`` does not fit the sampler's dtype.

    An :class:`OverflowError` (what TorchRL raises when such a mass reaches its trees) and a
    :class:`ValueError` (what fastreplay raises for other bad priorities).
    """


class PriorityShapeError(ValueError, RuntimeError):
    """Priorities that do not match the index, or coordinates without ``storage``.

    A :class:`RuntimeError`, as TorchRL raises in these cases, and a :class:`ValueError`.
    """


class CheckpointError(ValueError, KeyError, RuntimeError):
    """A state dict or ``dumps`` folder this sampler cannot load; nothing was changed.

    Subclasses the errors TorchRL raises for foreign or mismatched checkpoints
    (:class:`KeyError` for a missing key, :class:`RuntimeError` for another capacity) and
    :class:`ValueError`.
    """

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class _UnsupportedError(ValueError, NotImplementedError):
    """An unsupported ``dtype`` (TorchRL raises :class:`NotImplementedError`)."""


# ---------------------------------------------------------------------------------------- Ray
class ReplayBufferClassError(TypeError, AttributeError):
    """``replay_buffer_cls`` is not a replay-buffer class.

    TorchRL fails on ``replay_buffer_cls.as_remote`` (``AttributeError``); a wrong type is a
    ``TypeError``: this class is both.
    """

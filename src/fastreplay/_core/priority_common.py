"""What the prioritized sampler's adapter modules share: its lock and its scalar parsing."""

from __future__ import annotations

import functools
import numbers
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np
import torch

__all__ = ["FLOAT_DTYPES", "locked", "scalar"]

FLOAT_DTYPES = (torch.float32, torch.float64)
_Method = TypeVar("_Method", bound=Callable[..., Any])


def locked(method: _Method) -> _Method:
    """Run ``method`` under the sampler's re-entrant lock (``self._fr_lock``).

    Sampling then never sees a half-applied change (``alpha``, a checkpoint load, an update).

    Example:
        >>> import threading
        >>> class Counter:
        ...     def __init__(self) -> None:
        ...         self._fr_lock, self.n = threading.RLock(), 0
        ...     @locked
        ...     def bump(self) -> int:
        ...         self.n += 1
        ...         return self.n
        >>> Counter().bump()
        1
    """

    @functools.wraps(method)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        with self._fr_lock:
            return method(self, *args, **kwargs)

    return wrapper  # type: ignore[return-value]


def scalar(value: Any, name: str) -> float:
    """``value`` as a Python float: every number TorchRL accepts for ``name``. O(1).

    A Python ``int``/``float``/``bool``, a NumPy scalar, or a one-element tensor or array
    (``torch.tensor(0.6)``, as TorchRL's parameter schedulers set). The compiled kernels
    take Python floats only, so every scalar is converted here, once, where it enters.

    Raises:
        TypeError: anything else (a string, a complex number, several elements), naming
            ``name`` and showing the value.

    Example:
        >>> scalar(torch.tensor(0.5), "alpha"), scalar(np.float32(2), "beta")
        (0.5, 2.0)
    """
    if type(value) is float:  # hot path
        return value
    if isinstance(value, (np.ndarray, np.generic)) and value.size == 1:
        value = value.item()
    elif isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()  # one host sync for a CUDA tensor, here and only here
    if isinstance(value, numbers.Real):
        return float(value)
    raise TypeError(
        f"{name} must be a real number (a float, an int, a NumPy scalar or a one-element "
        f"tensor), got {name}={value!r} of type {type(value).__name__}"
    )

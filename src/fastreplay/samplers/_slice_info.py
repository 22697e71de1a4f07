"""The ``truncated``/``done``/``terminated`` info of a slice sample, built once for all samplers.

TorchRL's slice samplers add three flags to a sample's ``info`` when ``truncated_key`` is set:
``truncated`` (``True`` at each slice's last step), ``done`` (the stored done flag at the
sampled steps, OR-ed with ``truncated``) and ``terminated`` (the stored terminated flag, or
``False``), under ``truncated_key``'s parent. :func:`truncation_flags` builds them from the
storage's TensorDict, reading only those two keys at the sampled steps.

The flags lie on the storage's device: a sampler whose index lives on the host (fastreplay's
slice samplers keep their trajectory index there) has its ``truncated`` moved to the device
of the stored flags, one copy to the device, never one back to the host.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from fastreplay._torchrl import _replace_last

__all__ = ["take", "truncation_flags"]


def take(leaf: torch.Tensor, index: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """``leaf[index]``; with numpy for the boolean flags of a 1-dim CPU storage (4x faster)."""
    if len(index) == 1 and leaf.dtype == torch.bool and leaf.device.type == "cpu":
        return torch.from_numpy(np.take(leaf.numpy(), index[0].numpy(), axis=0))
    return leaf[index]


def truncation_flags(
    truncated_key: Any,
    data: Any,
    index: tuple[torch.Tensor, ...],
    truncated: torch.Tensor,
    ends_slices: Callable[[Any, torch.Tensor], bool] | None = None,
) -> dict[Any, torch.Tensor]:
    """TorchRL's ``{truncated_key: ..., done: ..., terminated: ...}`` for one slice sample.

    Args:
        truncated_key: The sampler's ``truncated_key`` (the other two keys are its siblings).
        data: The storage's TensorDict (``storage._storage``).
        index: The sampled steps, one coordinate tensor per storage dimension.
        truncated: ``[steps, 1]`` booleans, ``True`` at each slice's last step.
        ends_slices: Optional ``(key, leaf) -> bool``: ``True`` when every ``True`` of the
            stored done flags ends a trajectory, so that within a slice it can only fall on
            the last step: ``done`` is then ``truncated`` with no gather from the storage.

    Returns:
        The three flags, ``[steps, 1]`` each, on the device of the stored flags (that of
        ``truncated`` where none is stored). O(steps).
    """
    done_key = _replace_last(truncated_key, "done")
    terminated_key = _replace_last(truncated_key, "terminated")
    done = data.get(done_key, default=None)
    terminated = data.get(terminated_key, default=None)
    stored = done if done is not None else terminated
    if stored is not None and not (stored.is_cpu and truncated.is_cpu):
        truncated = truncated.to(stored.device)  # (a host-to-device copy, or nothing)
    if done is None or (ends_slices is not None and ends_slices(done_key, done)):
        done = truncated.clone()
    else:
        done = take(done, index) | truncated
    return {
        truncated_key: truncated,
        done_key: done,
        terminated_key: torch.zeros_like(truncated)
        if terminated is None
        else take(terminated, index),
    }

"""Checkpoints of the prioritized sampler: ``state_dict``, ``dumps`` and their loaders.

A checkpoint is the sampler's hyper-parameters (``_metadata``, tagged with ``_format``) plus
two leaf arrays over every slot: the sampling mass and the raw priority (``-inf`` where
unwritten). This module is the codec, and holds no sampler: :func:`metadata` and
:func:`state_dict`/:func:`dump` encode the settings and tree backend they are given;
:func:`read_state_dict`/:func:`read_folder` validate everything and decode it into a
:class:`PriorityCheckpoint` of plain values, which the sampler then assigns (nothing is
assigned while anything can still raise). Leaves are rebuilt into the trees in O(capacity),
vectorized, on whichever tree backend the sampler runs.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from fastreplay._core.priority_common import FLOAT_DTYPES, scalar
from fastreplay.errors import CheckpointError

if TYPE_CHECKING:
    from fastreplay._core.trees.interface import PriorityTreeBackend

__all__ = [
    "CheckpointError",
    "PriorityCheckpoint",
    "dump",
    "metadata",
    "read_folder",
    "read_state_dict",
    "state_dict",
]

_FORMAT = "fastreplay.PrioritizedSampler"
_SCHEMA_VERSION = 1
_REQUIRED = (
    "_max_capacity", "_alpha", "_beta", "_eps", "_upper_priority", "_initial_priority",
    "_all_time_max", "_max_priority_within_buffer", "dtype",
)  # fmt: skip


def metadata(
    *,
    max_capacity: int,
    alpha: float,
    beta: float,
    eps: float,
    upper_priority: float,
    initial_priority: float,
    all_time_max: float,
    max_priority_within_buffer: bool,
    dtype: torch.dtype,
    all_time_index: int | None,
) -> dict[str, Any]:
    """The hyper-parameters of a checkpoint, under the keys it stores them. O(1).

    ``alpha`` and ``beta`` are the floats the trees use; ``all_time_index`` is the slot where
    ``all_time_max`` was set (``None`` if unknown).
    """
    return {
        "_format": _FORMAT,
        "_schema_version": _SCHEMA_VERSION,
        "_max_capacity": max_capacity,
        "_alpha": alpha,
        "_beta": beta,
        "_eps": eps,
        "_upper_priority": upper_priority,
        "_initial_priority": initial_priority,
        "_all_time_max": all_time_max,
        "_max_priority_within_buffer": max_priority_within_buffer,
        "dtype": str(dtype).removeprefix("torch."),
        "_all_time_index": all_time_index,
    }


def state_dict(settings: dict[str, Any], trees: PriorityTreeBackend) -> dict[str, Any]:
    """``settings`` (from :func:`metadata`) plus the leaf arrays of ``trees``, on the CPU.

    O(capacity).
    """
    return {**settings, "_mass": trees.leaf_mass().cpu(), "_raw": trees.raw().cpu()}


def dump(path: str | Path, settings: dict[str, Any], trees: PriorityTreeBackend) -> None:
    """Write ``sampler_metadata.json`` and two ``.npy`` leaf arrays under ``path``. O(capacity)."""
    path = Path(path).absolute()
    path.mkdir(parents=True, exist_ok=True)
    np.save(path / "priority_mass.npy", trees.leaf_mass().cpu().numpy())
    np.save(path / "priority_raw.npy", trees.raw().cpu().numpy())
    with open(path / "sampler_metadata.json", "w") as file:
        json.dump(settings, file)


@dataclass(frozen=True)
class PriorityCheckpoint:
    """A validated checkpoint, decoded: the settings to assign and the leaves to load.

    ``alpha``, ``beta``, ``eps`` are the stored scalars as floats; ``mass`` and ``raw`` hold
    one float64 value per checkpointed slot (at least ``max_capacity``).
    """

    alpha: float
    beta: float
    eps: float
    upper_priority: float
    initial_priority: float
    all_time_max: float
    all_time_index: int | None
    max_priority_within_buffer: bool
    dtype: torch.dtype
    mass: torch.Tensor
    raw: torch.Tensor

    def leaves(self, slots: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(mass, raw)`` in float64 over ``slots`` slots, ``>=`` the checkpoint's. O(slots).

        The slots past the checkpoint's are unwritten: mass 0, raw priority ``-inf``.
        """
        mass, raw = self.mass, self.raw
        pad = slots - mass.numel()
        mass = torch.cat([mass.to(torch.float64), mass.new_zeros(pad, dtype=torch.float64)])
        raw = torch.cat(
            [raw.to(torch.float64), raw.new_full((pad,), -math.inf, dtype=torch.float64)]
        )
        return mass, raw


def _checked(
    settings: Any, mass: Any, raw: Any, source: str, max_capacity: int
) -> tuple[dict[str, Any], torch.Tensor, torch.Tensor]:
    """Validate a checkpoint completely before anything is assigned. O(capacity)."""
    if not isinstance(settings, dict) or settings.get("_format") != _FORMAT:
        keys = set(settings) if isinstance(settings, dict) else set()
        if {"_sum_tree", "_min_tree"} & keys or source == "torchrl folder":
            raise CheckpointError(
                f"this {'folder' if 'folder' in source else 'state dict'} was written by "
                "torchrl.data.PrioritizedSampler (compiled _sum_tree/_min_tree), which "
                "fastreplay.PrioritizedSampler cannot read: load it with TorchRL's class, "
                "or rebuild the priorities here with update_priority; nothing was changed"
            )
        raise CheckpointError(
            "this checkpoint was not written by fastreplay.PrioritizedSampler (no "
            f"'_format': {_FORMAT!r}); load it with the sampler class that saved it; "
            "nothing was changed"
        )
    missing = [key for key in _REQUIRED if key not in settings]
    if missing or mass is None or raw is None:
        missing += [k for k, v in (("_mass", mass), ("_raw", raw)) if v is None]
        raise CheckpointError(
            f"fastreplay.PrioritizedSampler checkpoint is missing {missing}; it was "
            "truncated or edited; nothing was changed"
        )
    if settings["_max_capacity"] != max_capacity:
        raise CheckpointError(
            f"checkpoint max_capacity={settings['_max_capacity']} differs from this "
            f"sampler's max_capacity={max_capacity}; build the sampler with the "
            "saved capacity; nothing was changed"
        )
    mass = torch.as_tensor(mass).reshape(-1)
    raw = torch.as_tensor(raw).reshape(-1)
    if mass.numel() != raw.numel() or mass.numel() < max_capacity:
        raise CheckpointError(
            f"checkpoint leaf arrays have {mass.numel()} masses and {raw.numel()} raw "
            f"priorities, expected the same number, at least max_capacity="
            f"{max_capacity}; the checkpoint is damaged; nothing was changed"
        )
    dtype = getattr(torch, str(settings["dtype"]), None)
    if dtype not in FLOAT_DTYPES:
        raise CheckpointError(
            f"checkpoint dtype={settings['dtype']!r} is not float32 or float64; nothing was changed"
        )
    try:
        scalars = {key: scalar(settings[key], key.lstrip("_")) for key in _REQUIRED[1:6]}
    except TypeError as error:
        raise CheckpointError(f"{error}; the checkpoint is damaged; nothing was changed") from error
    return {**settings, **scalars}, mass, raw


def _decoded(
    settings: Any, mass: Any, raw: Any, source: str, max_capacity: int
) -> PriorityCheckpoint:
    """The checkpoint validated by :func:`_checked`, as plain values. O(capacity)."""
    settings, mass, raw = _checked(settings, mass, raw, source, max_capacity)
    index = settings.get("_all_time_index")
    return PriorityCheckpoint(
        alpha=settings["_alpha"],
        beta=settings["_beta"],
        eps=settings["_eps"],
        upper_priority=float(settings["_upper_priority"]),
        initial_priority=float(settings["_initial_priority"]),
        all_time_max=float(settings["_all_time_max"]),
        all_time_index=None if index is None else int(index),
        max_priority_within_buffer=bool(settings["_max_priority_within_buffer"]),
        dtype=getattr(torch, settings["dtype"]),
        mass=mass,
        raw=raw,
    )


def read_state_dict(state: Any, max_capacity: int) -> PriorityCheckpoint:
    """Decode what :func:`state_dict` returned, for a sampler of ``max_capacity`` slots.

    O(capacity).

    Raises:
        CheckpointError: a TorchRL sampler's state dict, another capacity, or missing or
            damaged entries.
    """
    get = state.get if isinstance(state, dict) else lambda key: None
    return _decoded(state, get("_mass"), get("_raw"), "state dict", max_capacity)


def read_folder(path: str | Path, max_capacity: int) -> PriorityCheckpoint:
    """Decode what :func:`dump` wrote under ``path``, for a sampler of ``max_capacity`` slots.

    O(capacity).

    Raises:
        CheckpointError: a TorchRL ``dumps`` folder, another capacity, or missing or
            damaged files.
    """
    path = Path(path).absolute()
    with open(path / "sampler_metadata.json") as file:
        settings = json.load(file)
    if settings.get("_format") != _FORMAT:
        torchrl = (path / "sumtree.memmap").exists()
        _checked(settings, None, None, "torchrl folder" if torchrl else "folder", max_capacity)
    files = [path / "priority_mass.npy", path / "priority_raw.npy"]
    mass, raw = (torch.from_numpy(np.load(f)) if f.exists() else None for f in files)
    return _decoded(settings, mass, raw, "folder", max_capacity)

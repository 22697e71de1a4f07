"""Checkpoints of the prioritized sampler: ``state_dict``, ``dumps`` and their loaders.

A checkpoint is the sampler's hyper-parameters (``_metadata``, tagged with ``_format``) plus
two leaf arrays over every slot: the sampling mass and the raw priority (``-inf`` where
unwritten). Loading validates everything before assigning anything, then rebuilds the trees
from the leaves in O(capacity), vectorized, on whichever tree backend the sampler runs.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from fastreplay._core.priority_common import FLOAT_DTYPES, locked, scalar
from fastreplay.errors import CheckpointError

if TYPE_CHECKING:
    from fastreplay._core.trees.interface import PriorityTreeBackend

__all__ = ["CheckpointError", "PriorityCheckpoints"]

_FORMAT = "fastreplay.PrioritizedSampler"
_SCHEMA_VERSION = 1
_REQUIRED = (
    "_max_capacity", "_alpha", "_beta", "_eps", "_upper_priority", "_initial_priority",
    "_all_time_max", "_max_priority_within_buffer", "dtype",
)  # fmt: skip


class PriorityCheckpoints:
    """``state_dict``, ``load_state_dict``, ``dumps`` and ``loads`` of the prioritized sampler.

    Reads and sets the sampler's attributes below; ``_grow``, ``_find_written_end`` and
    ``_all_time_index`` are the sampler's.
    """

    _fr_lock: Any
    _trees: PriorityTreeBackend
    _slots: int
    _max_capacity: int
    _alpha: float
    _alpha_as_given: Any
    _beta: float
    _beta_as_given: Any
    _eps: float
    _upper_priority: float
    _initial_priority: float
    _all_time_max: float
    _all_time_at: int | None
    _max_priority_within_buffer: bool
    _written_end: int
    dtype: torch.dtype

    if TYPE_CHECKING:

        def _grow(self, slots: int) -> None: ...
        def _find_written_end(self) -> int: ...
        def _all_time_index(self) -> int | None: ...

    def _metadata(self) -> dict[str, Any]:
        return {
            "_format": _FORMAT,
            "_schema_version": _SCHEMA_VERSION,
            "_max_capacity": self._max_capacity,
            "_alpha": self._alpha,
            "_beta": self._beta,
            "_eps": self._eps,
            "_upper_priority": self._upper_priority,
            "_initial_priority": self._initial_priority,
            "_all_time_max": self._all_time_max,
            "_max_priority_within_buffer": self._max_priority_within_buffer,
            "dtype": str(self.dtype).removeprefix("torch."),
            "_all_time_index": self._all_time_index(),
        }

    def _checked(
        self, metadata: Any, mass: Any, raw: Any, source: str
    ) -> tuple[dict[str, Any], torch.Tensor, torch.Tensor]:
        """Validate a checkpoint completely before anything is assigned. O(capacity)."""
        if not isinstance(metadata, dict) or metadata.get("_format") != _FORMAT:
            keys = set(metadata) if isinstance(metadata, dict) else set()
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
        missing = [key for key in _REQUIRED if key not in metadata]
        if missing or mass is None or raw is None:
            missing += [k for k, v in (("_mass", mass), ("_raw", raw)) if v is None]
            raise CheckpointError(
                f"fastreplay.PrioritizedSampler checkpoint is missing {missing}; it was "
                "truncated or edited; nothing was changed"
            )
        if metadata["_max_capacity"] != self._max_capacity:
            raise CheckpointError(
                f"checkpoint max_capacity={metadata['_max_capacity']} differs from this "
                f"sampler's max_capacity={self._max_capacity}; build the sampler with the "
                "saved capacity; nothing was changed"
            )
        mass = torch.as_tensor(mass).reshape(-1)
        raw = torch.as_tensor(raw).reshape(-1)
        if mass.numel() != raw.numel() or mass.numel() < self._max_capacity:
            raise CheckpointError(
                f"checkpoint leaf arrays have {mass.numel()} masses and {raw.numel()} raw "
                f"priorities, expected the same number, at least max_capacity="
                f"{self._max_capacity}; the checkpoint is damaged; nothing was changed"
            )
        dtype = getattr(torch, str(metadata["dtype"]), None)
        if dtype not in FLOAT_DTYPES:
            raise CheckpointError(
                f"checkpoint dtype={metadata['dtype']!r} is not float32 or float64; "
                "nothing was changed"
            )
        try:
            scalars = {key: scalar(metadata[key], key.lstrip("_")) for key in _REQUIRED[1:6]}
        except TypeError as error:
            raise CheckpointError(
                f"{error}; the checkpoint is damaged; nothing was changed"
            ) from error
        return {**metadata, **scalars}, mass, raw

    def _restore(self, metadata: Any, mass: Any, raw: Any, source: str = "state dict") -> None:
        metadata, mass, raw = self._checked(metadata, mass, raw, source)
        # Everything is validated: from here on nothing raises.
        if mass.numel() > self._slots:
            self._grow(mass.numel())
        pad = self._slots - mass.numel()
        mass = torch.cat([mass.to(torch.float64), mass.new_zeros(pad, dtype=torch.float64)])
        raw = torch.cat(
            [raw.to(torch.float64), raw.new_full((pad,), -math.inf, dtype=torch.float64)]
        )
        self._alpha = self._alpha_as_given = metadata["_alpha"]
        self._beta = self._beta_as_given = metadata["_beta"]
        self._eps = metadata["_eps"]
        self._upper_priority = float(metadata["_upper_priority"])
        self._initial_priority = float(metadata["_initial_priority"])
        self._all_time_max = float(metadata["_all_time_max"])
        index = metadata.get("_all_time_index")
        self._all_time_at = None if index is None else int(index)
        self._max_priority_within_buffer = bool(metadata["_max_priority_within_buffer"])
        self.dtype = getattr(torch, metadata["dtype"])
        self._trees.set_leaves(mass, raw)
        self._written_end = self._find_written_end()

    @locked
    def state_dict(self) -> dict[str, Any]:
        """Hyper-parameters plus the leaf arrays (mass and raw priority), cloned. O(capacity)."""
        return {
            **self._metadata(),
            "_mass": self._trees.leaf_mass().cpu(),
            "_raw": self._trees.raw().cpu(),
        }

    @locked
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output exactly; trees rebuilt vectorized in O(capacity).

        Raises:
            CheckpointError: a TorchRL sampler's state dict, another capacity, or missing or
                damaged entries. Checked before anything changes.
        """
        get = state_dict.get if isinstance(state_dict, dict) else lambda key: None
        self._restore(state_dict, get("_mass"), get("_raw"))

    @locked
    def dumps(self, path: str | Path) -> None:
        """Write ``sampler_metadata.json`` and two ``.npy`` leaf arrays under ``path``."""
        path = Path(path).absolute()
        path.mkdir(parents=True, exist_ok=True)
        np.save(path / "priority_mass.npy", self._trees.leaf_mass().cpu().numpy())
        np.save(path / "priority_raw.npy", self._trees.raw().cpu().numpy())
        with open(path / "sampler_metadata.json", "w") as file:
            json.dump(self._metadata(), file)

    @locked
    def loads(self, path: str | Path) -> None:
        """Load what :meth:`dumps` wrote; O(capacity), vectorized.

        Raises:
            CheckpointError: a TorchRL ``dumps`` folder, another capacity, or missing or
                damaged files. Checked before anything changes.
        """
        path = Path(path).absolute()
        with open(path / "sampler_metadata.json") as file:
            metadata = json.load(file)
        if metadata.get("_format") != _FORMAT:
            torchrl = (path / "sumtree.memmap").exists()
            self._checked(metadata, None, None, "torchrl folder" if torchrl else "folder")
        files = [path / "priority_mass.npy", path / "priority_raw.npy"]
        mass, raw = (torch.from_numpy(np.load(f)) if f.exists() else None for f in files)
        self._restore(metadata, mass, raw, "folder")

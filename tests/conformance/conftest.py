"""Conformance suite: behaviour written once, run against TorchRL's class and fastreplay's.

Test modules import data helpers as ``from conformance.conftest import episodes``.
Every test here takes an ``impl`` fixture (or one of the ``*_cls`` fixtures below) whose params
are ``"torchrl"`` and ``"fastreplay"``. A behaviour TorchRL keeps and fastreplay breaks fails
on the fastreplay side; where TorchRL's compiled extension is missing, the TorchRL side of the
prioritized tests skips with a reason. Deliberate differences are not tested here as equal:
each one is listed in docs/migration.md with the test that pins it.

Tests that put a sampler into a TorchRL buffer also take ``buffer_side``
(``"torchrl-buffer"``, ``"fastreplay-buffer"``) and build the buffer with
:func:`make_buffer`: the same behaviour then runs through fastreplay's buffer, whose direct
path (``fastreplay.buffers.paths``) TorchRL's buffers never take.

Data carries its own invariants: ``obs = traj_id * 10_000 + step`` so any slice that crosses a
trajectory boundary, or any sampled row that was never written, is visible in the sample.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torchrl.data as trl
from tensordict import TensorDict

import fastreplay
from conftest import TORCHRL_EXT

IMPLS = ("torchrl", "fastreplay")
DONE = ("next", "done")


TORCHRL_BUFFER, FASTREPLAY_BUFFER = "torchrl-buffer", "fastreplay-buffer"
BUFFER_SIDES = (TORCHRL_BUFFER, FASTREPLAY_BUFFER)
# fastreplay's counterpart of each TorchRL buffer class a test names: its buffers are
# TensorDict buffers (samples carry an ``index`` entry, as TorchRL's TensorDict buffers' do).
_FASTREPLAY_BUFFERS = {
    "ReplayBuffer": "TensorDictReplayBuffer",
    "TensorDictReplayBuffer": "TensorDictReplayBuffer",
    "TensorDictPrioritizedReplayBuffer": "TensorDictPrioritizedReplayBuffer",
}


@dataclass(frozen=True)
class Impl:
    """One side of the comparison: where to take each class from."""

    name: str

    @property
    def module(self) -> Any:
        return trl if self.name == "torchrl" else fastreplay

    def cls(self, name: str) -> Any:
        """The class ``name`` from this side (TorchRL's, or fastreplay's drop-in)."""
        return getattr(self.module, name)

    @property
    def is_torchrl(self) -> bool:
        return self.name == "torchrl"


def _skip_without_ext(impl: Impl) -> None:
    if impl.is_torchrl and not TORCHRL_EXT:
        pytest.skip(
            "TorchRL's compiled extension (torchrl._torchrl) does not load on torch "
            f"{torch.__version__}; TorchRL's prioritized classes need it"
        )


@pytest.fixture(params=IMPLS)
def impl(request: pytest.FixtureRequest) -> Impl:
    """Either side, for classes that work without TorchRL's compiled extension."""
    return Impl(request.param)


@pytest.fixture(params=IMPLS)
def per_impl(request: pytest.FixtureRequest) -> Impl:
    """Either side, for prioritized classes (TorchRL's side needs its compiled trees)."""
    side = Impl(request.param)
    _skip_without_ext(side)
    return side


@pytest.fixture(params=BUFFER_SIDES)
def buffer_side(request: pytest.FixtureRequest) -> str:
    """The buffer a test's sampler goes into: TorchRL's class, or fastreplay's counterpart."""
    return request.param


def make_buffer(side: str, torchrl_cls: str = "ReplayBuffer", **kwargs: Any) -> Any:
    """TorchRL's buffer class ``torchrl_cls``, or with ``side="fastreplay-buffer"`` fastreplay's
    TensorDict counterpart (``ReplayBuffer`` -> ``TensorDictReplayBuffer``), built from
    ``kwargs``."""
    if side == TORCHRL_BUFFER:
        return getattr(trl, torchrl_cls)(**kwargs)
    if side == FASTREPLAY_BUFFER:
        return getattr(fastreplay, _FASTREPLAY_BUFFERS[torchrl_cls])(**kwargs)
    raise ValueError(f"side must be one of {BUFFER_SIDES}, got {side!r}")


def extend_in_two(rb: Any, data: Any) -> torch.Tensor:
    """``rb.extend(data)`` as two writes of its halves: the same rows stored, the same cursor.

    The first write to a lazy storage initialises it (TorchRL's path in either buffer);
    fastreplay's buffer writes the second on its direct path, which tells the sampler of the
    rows itself. Returns the written indices, as one ``extend`` would.
    """
    half = len(data) // 2
    return torch.cat([rb.extend(data[:half]), rb.extend(data[half:])])


def episodes(n: int, length: int | list[int], *, columns: int | None = None, first_id: int = 0):
    """``n`` steps of back-to-back episodes with ``obs = traj_id * 10_000 + step``.

    ``length`` is one episode length or a cycle of lengths. With ``columns``, returns an
    ``[columns, n]`` TensorDict (ndim=2 buffers extend along dim 1), each column with its own ids.
    """
    lengths = [length] if isinstance(length, int) else list(length)
    width = columns or 1
    traj = torch.empty(width, n, dtype=torch.long)
    step = torch.empty(width, n, dtype=torch.long)
    next_id = first_id
    for c in range(width):
        t, k = 0, c
        while t < n:
            ep = lengths[k % len(lengths)]
            m = min(ep, n - t)
            traj[c, t : t + m] = next_id
            step[c, t : t + m] = torch.arange(m)
            next_id, t, k = next_id + 1, t + m, k + 1
    done = torch.zeros(width, n, dtype=torch.bool)
    done[:, :-1] = traj[:, 1:] != traj[:, :-1]
    done[:, -1] = True
    td = TensorDict(
        {"obs": traj * 10_000 + step, "traj": traj, "step": step, DONE: done[..., None]},
        [width, n],
    )
    return td if columns else td[0]


def assert_slices_valid(obs: torch.Tensor, num_slices: int) -> None:
    """Each of ``num_slices`` rows of ``obs`` is consecutive steps of one trajectory."""
    rows = obs.reshape(num_slices, -1)
    assert ((rows[:, 1:] - rows[:, :-1]) == 1).all(), rows

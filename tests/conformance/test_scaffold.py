"""The shared conformance data has the invariants the other conformance tests rely on."""

from __future__ import annotations

import pytest
import torch

from conformance.conftest import DONE, Impl, assert_slices_valid, episodes


def test_episodes_encode_traj_and_step() -> None:
    td = episodes(23, [5, 3])
    assert torch.equal(td["obs"], td["traj"] * 10_000 + td["step"])
    ends = td[DONE].squeeze(-1).nonzero().flatten().tolist()
    assert ends == [4, 7, 12, 15, 20, 22]  # lengths 5, 3, 5, 3, 5, then the cut
    two = episodes(9, 4, columns=3)
    assert two.shape == (3, 9)
    assert two["traj"][:, 0].unique().numel() == 3  # every column has its own ids


def test_assert_slices_valid_catches_a_crossing() -> None:
    td = episodes(8, 4)
    assert_slices_valid(td["obs"], 2)
    with pytest.raises(AssertionError):
        assert_slices_valid(td["obs"][2:6], 1)


def test_impl_resolves_both_sides() -> None:
    import torchrl.data

    import fastreplay

    assert Impl("torchrl").cls("SliceSampler") is torchrl.data.SliceSampler
    assert issubclass(Impl("fastreplay").cls("SliceSampler"), torchrl.data.SliceSampler)
    assert Impl("fastreplay").cls("SliceSampler") is fastreplay.SliceSampler

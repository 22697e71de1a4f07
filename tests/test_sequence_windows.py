"""The NumPy windows of a Sequence unit against a record-by-record reference (brute force)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fastreplay._core.sequence_windows import windows


def _reference(anchor, back, ahead, length, burn_in, bootstrap, dilation, policy, modulus):
    """TorchRL's statements, one record at a time, on Python ints."""
    rows, valid = [], []
    for a, b, f in zip(anchor.tolist(), back.tolist(), ahead.tolist(), strict=True):
        if policy == "stop":
            shortfall = dilation * (length + bootstrap - 1) - f
            shift = min(max(shortfall, 0), b)
            a, f, b = a - shift, f + shift, b - shift
        row, ok = [], []
        for step in range(burn_in + length + bootstrap):
            offset = (step - burn_in) * dilation
            ok.append(-b <= offset <= f)
            row.append((a + max(min(offset, f), -b)) % modulus)
        rows.append(row)
        valid.append(ok)
    return np.array(rows, dtype=np.int64), np.array(valid, dtype=bool)


@pytest.mark.parametrize("policy", ["pad", "stop", "include_reset"])
@pytest.mark.parametrize(
    "burn_in,length,bootstrap,dilation", [(0, 1, 0, 1), (3, 5, 2, 1), (2, 4, 3, 3)]
)
def test_windows_match_the_record_by_record_reference(
    policy: str, burn_in: int, length: int, bootstrap: int, dilation: int
) -> None:
    rng = np.random.default_rng(burn_in * 100 + length * 10 + dilation)
    modulus = 97
    anchor = rng.integers(0, modulus, 300)
    back = rng.integers(0, 40, 300)
    ahead = rng.integers(0, 40, 300)
    got = windows(
        anchor, back, ahead, length=length, burn_in=burn_in, bootstrap=bootstrap,
        dilation=dilation, policy=policy, modulus=modulus,
    )  # fmt: skip
    want = _reference(anchor, back, ahead, length, burn_in, bootstrap, dilation, policy, modulus)
    assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])
    assert got[0].dtype == np.int64 and got[1].dtype == np.bool_


def test_fastreplay_sequence_expands_one_dim_anchors_without_torchrls_code(monkeypatch) -> None:
    """A 1-D storage's expansion takes the NumPy windows, not TorchRL's statements."""
    sample_units = pytest.importorskip("fastreplay.sample_units")
    if not hasattr(sample_units, "Sequence"):
        pytest.skip("this TorchRL has no sample units")
    from tensordict import TensorDict
    from torchrl.data import LazyTensorStorage

    storage = LazyTensorStorage(50)
    done = (torch.arange(50) % 7 == 6)[:, None]
    storage.set(torch.arange(50), TensorDict({("next", "done"): done}, [50]))

    numpy_expand = sample_units._expand_sequence
    results = []

    def spy(*args, **kwargs):
        results.append(numpy_expand(*args, **kwargs))
        return results[-1]

    monkeypatch.setattr(sample_units, "_expand_sequence", spy)
    unit = sample_units.Sequence(length=3, burn_in=2)
    index, info = unit.expand(torch.tensor([0, 8, 20]), {}, storage)
    assert len(results) == 1 and results[0] is not None  # the NumPy windows, not TorchRL's
    assert index.tolist() == [0, 0, 0, 1, 2, 7, 7, 8, 9, 10, 18, 19, 20, 20, 20]
    assert info["validity_mask"].tolist()[:5] == [False, False, True, True, True]

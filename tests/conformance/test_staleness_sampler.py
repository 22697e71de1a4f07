"""StalenessAwareSampler: TorchRL's class and fastreplay's, in TorchRL's buffers and fastreplay's.

fastreplay's sampler draws from version buckets and a sum tree (both tree backends: the
``backend`` fixture), TorchRL's with ``torch.multinomial`` over every item, so their random
streams differ (docs/migration.md); what must agree is checked here: which items can be drawn,
each item's exact probability (against TorchRL's own multinomial weights and a brute-force
oracle), the empirical distribution (chi-square, with a check that a wrong weighting fails
it), info, shapes, dtypes, errors, and checkpoints in both directions. Items carry their id
(``obs``) and their version.
"""

from __future__ import annotations

import copy
import math
import pickle
from collections import Counter

import numpy as np
import pytest
import torch
import torchrl.data as trl
from tensordict import TensorDict
from torchrl.data import LazyTensorStorage, ListStorage

import fastreplay
from conformance.conftest import FASTREPLAY_BUFFER, Impl, extend_in_two, make_buffer
from conftest import requires_storage_revision

# -------------------------------------------------------------------- helpers


def _sampler(impl: Impl, backend: str = "torch", **kwargs):
    if impl.is_torchrl:
        return trl.StalenessAwareSampler(**kwargs)
    sampler = fastreplay.StalenessAwareSampler(backend=backend, **kwargs)
    assert sampler.backend == backend
    return sampler


def _buffer(side: str, sampler, capacity: int, batch_size: int = 8, storage=None):
    storage = LazyTensorStorage(capacity) if storage is None else storage
    return make_buffer(
        side, "ReplayBuffer", storage=storage, sampler=sampler, batch_size=batch_size
    )


def _rows(first_id: int, versions) -> TensorDict:
    versions = torch.as_tensor(versions, dtype=torch.int64).reshape(-1)
    n = versions.numel()
    obs = (torch.arange(first_id, first_id + n) // 5) * 10_000 + torch.arange(n) % 5
    return TensorDict({"obs": obs, "policy_version": versions}, [n])


def _oracle(versions: torch.Tensor, consumer, max_staleness: int, fn=None) -> torch.Tensor:
    """Brute force: each stored item's probability, from its float32 version (float64)."""
    stale = consumer - versions.reshape(-1).float()
    valid = stale <= max_staleness if max_staleness >= 0 else torch.ones_like(stale, dtype=bool)
    fn = fn or (lambda s: 1.0 / (s.float() + 1.0))
    w = torch.zeros(stale.shape, dtype=torch.float64)
    w[valid] = fn(stale[valid]).double()
    return w / w.sum()


def _stored_versions(rb) -> torch.Tensor:
    return rb.storage._storage["policy_version"][: len(rb.storage)]


def _torchrl_weights(rb, consumer: int, max_staleness: int) -> torch.Tensor:
    """TorchRL's own multinomial weights for ``rb``'s storage, spread over every item."""
    ref = trl.StalenessAwareSampler(max_staleness=max_staleness)
    ref.consumer_version = consumer
    seen = []
    multinomial = torch.multinomial

    def record(weights, *args, **kwargs):
        seen.append(weights.clone())
        return multinomial(weights, *args, **kwargs)

    torch.multinomial = record
    try:
        ref.sample(rb.storage, 1)
    finally:
        torch.multinomial = multinomial
    stale = consumer - _stored_versions(rb).float()
    valid = stale <= max_staleness if max_staleness >= 0 else torch.ones_like(stale, dtype=bool)
    dense = torch.zeros(stale.numel(), dtype=torch.float64)
    dense[valid] = seen[0].double()
    return dense


def _chi2_critical(df: int, z: float = 3.719) -> float:
    """Upper chi-square quantile (Wilson-Hilferty); z=3.719: p = 1e-4."""
    h = 2.0 / (9.0 * df)
    return df * (1.0 - h + z * math.sqrt(h)) ** 3


def _chi2(counts: np.ndarray, expected_p: np.ndarray) -> tuple[float, int]:
    total = counts.sum()
    keep = expected_p > 0
    assert counts[~keep].sum() == 0, "an item of probability 0 was drawn"
    exp = expected_p[keep] * total
    return float(((counts[keep] - exp) ** 2 / exp).sum()), int(keep.sum()) - 1


# -------------------------------------------------------------------- exact probabilities


@pytest.mark.parametrize("capacity", [7, 51, 1023])
def test_probabilities_equal_torchrl_weights_and_oracle(
    backend: str, buffer_side: str, capacity: int
) -> None:
    """Random extends (wrap-around), adds, overwrites, consumer and gate changes."""
    gen = torch.Generator().manual_seed(capacity)
    sampler = _sampler(Impl("fastreplay"), backend, max_staleness=-1)
    rb = _buffer(buffer_side, sampler, capacity)
    written, version = 0, 0
    for step in range(40):
        if step % 4 == 0 or written == 0:
            n = int(torch.randint(1, 2 * capacity, (1,), generator=gen))
            versions = version - torch.randint(0, 4, (n,), generator=gen)
            (extend_in_two if step % 8 == 0 and n > 1 else type(rb).extend)(
                rb, _rows(written, versions)
            )
            written, version = written + n, version + 1
        elif step % 4 == 1:
            rb.add(_rows(written, [version])[0])
            written += 1
        elif step % 4 == 2:
            sampler.consumer_version = version + int(torch.randint(0, 3, (1,), generator=gen))
            sampler.max_staleness = [-1, 0, 2, 5][int(torch.randint(0, 4, (1,), generator=gen))]
        else:  # an overwrite the sampler is not told about (rb[idx] = ...)
            idx = torch.randint(0, len(rb), (3,), generator=gen).unique()
            rb[idx] = _rows(0, torch.full((idx.numel(),), version - 1))
        if sampler.consumer_version < version:  # no version ahead of the consumer
            sampler.consumer_version = version
        cv, ms = sampler.consumer_version, sampler.max_staleness
        expected = _oracle(_stored_versions(rb), cv, ms)
        if not expected.isfinite().all():  # everything gated out: TorchRL's error
            with pytest.raises(RuntimeError, match="exceed max_staleness"):
                rb.sample()
            continue
        probs = sampler.probabilities(rb.storage)
        torch.testing.assert_close(probs, expected, rtol=1e-12, atol=1e-15)
        torchrl_w = _torchrl_weights(rb, cv, ms)
        torch.testing.assert_close(probs, torchrl_w, rtol=1e-5, atol=1e-7)
        index, info = sampler.sample(rb.storage, 5)
        assert expected[index].gt(0).all()
        torch.testing.assert_close(info["staleness"], cv - _stored_versions(rb)[index].float())


def test_custom_weight_function_and_version_key(backend: str, buffer_side: str) -> None:
    def fn(s):
        return torch.exp(-0.5 * s)

    sampler = _sampler(
        Impl("fastreplay"), backend, max_staleness=6, staleness_weight_fn=fn, version_key="v"
    )
    rb = _buffer(buffer_side, sampler, 101)
    for version in range(12):
        rows = _rows(version * 9, torch.full((9,), version)).rename_key_("policy_version", "v")
        rb.extend(rows)
    sampler.consumer_version = 13
    expected = _oracle(rb.storage._storage["v"][: len(rb)], 13, 6, fn)
    torch.testing.assert_close(sampler.probabilities(rb.storage), expected)


# -------------------------------------------------------------------- empirical distribution


def _draw_counts(sampler, rb, n_items: int, calls: int, batch: int) -> np.ndarray:
    counts = np.zeros(n_items, np.int64)
    for _ in range(calls):
        index, _ = sampler.sample(rb.storage, batch)
        np.add.at(counts, index.numpy(), 1)
    return counts


def _small_workload(sampler, side: str, batch_size: int | None = 8):
    rb = _buffer(side, sampler, 37, batch_size)
    for version in range(9):  # 54 rows in 37 slots: wrap-around
        rb.extend(_rows(version * 6, torch.full((6,), version)))
    sampler.consumer_version = 9
    sampler.max_staleness = 4
    return rb


def test_chi_square_with_replacement(backend: str, buffer_side: str) -> None:
    """Batches larger than the eligible items draw with replacement: chi-square per item."""
    torch.manual_seed(0)
    sampler = _sampler(Impl("fastreplay"), backend)
    rb = _small_workload(sampler, buffer_side)
    expected = _oracle(_stored_versions(rb), 9, 4).numpy()
    eligible = int((expected > 0).sum())
    counts = _draw_counts(sampler, rb, 37, 200, eligible + 100)
    stat, df = _chi2(counts, expected)
    assert stat < _chi2_critical(df), (stat, df)
    # The test has power: a wrong weighting (1 / (s + 2)) fails it on the same draws.
    wrong = _oracle(_stored_versions(rb), 9, 4, lambda s: 1.0 / (s.float() + 2.0)).numpy()
    assert _chi2(counts, wrong)[0] > _chi2_critical(df)


def test_chi_square_without_replacement_ordered_pairs(impl: Impl, backend: str) -> None:
    """Batches of 2 from 4 items: the 12 ordered pairs of successive sampling, both sides."""
    torch.manual_seed(1)
    sampler = _sampler(impl, backend)
    rb = _buffer(FASTREPLAY_BUFFER, sampler, 5)
    rb.extend(_rows(0, [0, 3, 5, 5]))
    sampler.consumer_version = 6
    p = _oracle(_stored_versions(rb), 6, -1).numpy()
    pairs = [(i, j) for i in range(4) for j in range(4) if i != j]
    exact = np.array([p[i] * p[j] / (1 - p[i]) for i, j in pairs])
    seen: Counter = Counter()
    for _ in range(6000):
        index, _ = sampler.sample(rb.storage, 2)
        seen[tuple(index.tolist())] += 1
    counts = np.array([seen[pair] for pair in pairs])
    assert counts.sum() == 6000  # never the same item twice
    stat, df = _chi2(counts, exact)
    assert stat < _chi2_critical(df), (stat, df)
    with_replacement = np.array([p[i] * p[j] for i, j in pairs])
    assert _chi2(counts, with_replacement / with_replacement.sum())[0] > _chi2_critical(df)


def test_without_replacement_heavy_item_and_many_rounds(backend: str) -> None:
    """Each version weighs 8x the one before: rounds mostly redraw the heaviest items."""
    torch.manual_seed(2)
    sampler = _sampler(Impl("fastreplay"), backend, staleness_weight_fn=lambda s: 8.0 ** (-s))
    rb = _buffer(FASTREPLAY_BUFFER, sampler, 31)
    rb.extend(_rows(0, torch.arange(31)))
    sampler.consumer_version = 30
    before = sampler.probabilities(rb.storage)
    assert (before > 0).all()
    firsts = Counter()
    for batch in (1, 2, 17, 31, 31, 5):
        index, _ = sampler.sample(rb.storage, batch)
        assert index.unique().numel() == batch
        firsts[int(index[0])] += 1
    assert sorted(sampler.sample(rb.storage, 31)[0].tolist()) == list(range(31))
    torch.testing.assert_close(sampler.probabilities(rb.storage), before)  # buckets restored
    for _ in range(200):
        firsts[int(sampler.sample(rb.storage, 3)[0][0])] += 1
    assert firsts[30] > 150  # the first draw is the heaviest item with probability 7/8


# -------------------------------------------------------------------- sides agree


def test_sample_shapes_info_and_eligibility(impl: Impl, buffer_side: str, backend: str) -> None:
    torch.manual_seed(3)
    sampler = _sampler(impl, backend)
    rb = _small_workload(sampler, buffer_side, None)
    for batch in (1, 7, 19, 60):
        data, info = rb.sample(batch, return_info=True)
        index = info["index"]
        assert index.shape == (batch,) and index.dtype == torch.int64
        assert info["staleness"].shape == (batch,) and info["staleness"].dtype == torch.float32
        assert set(info) == {"index", "staleness"}
        assert (info["staleness"] <= 4).all()
        torch.testing.assert_close(info["staleness"], 9 - data["policy_version"].float())
        assert (data["obs"] == rb.storage._storage["obs"][index]).all()
        if batch <= 20:  # 20 eligible items: without replacement
            assert index.unique().numel() == batch


def test_errors_equal_torchrl(impl: Impl, buffer_side: str) -> None:
    sampler = _sampler(impl)
    rb = _buffer(buffer_side, sampler, 9)
    with pytest.raises(RuntimeError, match="Cannot sample from an empty storage"):
        sampler.sample(rb.storage, 3)
    rb.extend(_rows(0, [0, 0, 1]))
    sampler.consumer_version = 5
    sampler.max_staleness = 3
    with pytest.raises(RuntimeError, match=r"All 3 entries in the buffer exceed max_staleness=3"):
        rb.sample()
    sampler.max_staleness = 4  # the version-1 item only
    index, _ = sampler.sample(rb.storage, 2)  # more than eligible: with replacement
    assert index.tolist() == [2, 2]
    sampler.max_staleness = -1
    sampler._weight_fn = lambda s: s - 4.5  # a negative weight: torch.multinomial's error
    with pytest.raises(RuntimeError, match=r"probability|invalid multinomial"):
        rb.sample()
    other = _sampler(impl, version_key="missing")
    rb2 = _buffer(buffer_side, other, 9)
    rb2.extend(_rows(0, [0, 1]))
    with pytest.raises(KeyError, match="Could not find key 'missing'"):
        rb2.sample()


def test_zero_weight_items_complete_a_batch_as_in_torchrl(impl: Impl) -> None:
    """Without replacement, a batch above the positive-weight items: TorchRL's own path."""
    sampler = _sampler(impl, staleness_weight_fn=lambda s: (s < 1).float())
    rb = _buffer(FASTREPLAY_BUFFER, sampler, 9)
    rb.extend(_rows(0, [3, 1, 1, 3]))
    sampler.consumer_version = 3
    torch.manual_seed(4)
    index, _ = sampler.sample(rb.storage, 3)
    torch.manual_seed(4)
    ref = _sampler(Impl("torchrl"), staleness_weight_fn=lambda s: (s < 1).float())
    ref.consumer_version = 3
    assert index.tolist() == ref.sample(rb.storage, 3)[0].tolist()


def test_empty_then_refill_and_consumer_reset(impl: Impl, buffer_side: str) -> None:
    sampler = _sampler(impl, max_staleness=1)
    rb = _buffer(buffer_side, sampler, 11)
    rb.extend(_rows(0, torch.full((11,), 4)))
    sampler.consumer_version = 5
    rb.sample()
    rb.empty()
    assert sampler.consumer_version == 0  # TorchRL's _empty resets it
    rb.extend(_rows(0, [0, 0, 1]))
    sampler.consumer_version = 1
    index, info = sampler.sample(rb.storage, 50)
    assert set(index.tolist()) <= {0, 1, 2} and (info["staleness"] <= 1).all()


def test_in_place_edit_of_the_version_column_is_seen(backend: str, buffer_side: str) -> None:
    sampler = _sampler(Impl("fastreplay"), backend, max_staleness=0)
    rb = _buffer(buffer_side, sampler, 13)
    rb.extend(_rows(0, torch.zeros(13)))
    sampler.consumer_version = 1
    with pytest.raises(RuntimeError, match="exceed max_staleness"):
        rb.sample()
    rb.storage._storage["policy_version"][6] = 1  # through a view: no reported write
    index, _ = sampler.sample(rb.storage, 4)
    assert index.tolist() == [6, 6, 6, 6]


@requires_storage_revision
def test_write_through_another_buffer_on_the_storage_is_seen(backend: str) -> None:
    sampler = _sampler(Impl("fastreplay"), backend, max_staleness=0)
    storage = LazyTensorStorage(15)
    rb = _buffer(FASTREPLAY_BUFFER, sampler, 15, storage=storage)
    rb.extend(_rows(0, [2, 2] + [0] * 13))  # full: a set leaves the length as it is
    sampler.consumer_version = 2
    rb.sample()  # the buckets are built
    storage.set(torch.tensor([3, 4]), _rows(0, [2, 2]))  # counted by the storage, unreported
    rb.extend(_rows(15, [0]))  # row 0, reported: the counts differ, so a full reread
    assert sorted(set(sampler.sample(rb.storage, 60)[0].tolist())) == [1, 3, 4]


# -------------------------------------------------------------------- TorchRL's own paths


def test_other_storages_take_torchrl_s_code(impl: Impl) -> None:
    """A ListStorage and an ndim=2 storage: fastreplay's sampler runs TorchRL's code.

    (TorchRL's reads a ListStorage's slice as a TensorDict, which it is not: both raise.)
    """
    rb = trl.ReplayBuffer(storage=ListStorage(7), sampler=_sampler(impl), batch_size=3)
    rb.extend(_rows(0, [0, 1, 1, 2]))
    rb.sampler.consumer_version = 3
    with pytest.raises(AttributeError, match="'list' object has no attribute 'get'"):
        rb.sampler.sample(rb.storage, 3)
    ref = trl.StalenessAwareSampler()
    storage = LazyTensorStorage(6, ndim=2)
    sampler = _sampler(impl)
    rb2 = trl.ReplayBuffer(storage=storage, sampler=sampler, batch_size=2)
    rb2.extend(TensorDict({"policy_version": torch.arange(4).view(2, 2)}, [2, 2]))
    sampler.consumer_version = 4
    torch.manual_seed(6)
    got = sampler.sample(storage, 2)
    torch.manual_seed(6)
    ref.consumer_version = 4
    want = ref.sample(storage, 2)
    assert got[0].tolist() == want[0].tolist()
    torch.testing.assert_close(got[1]["staleness"], want[1]["staleness"])


# -------------------------------------------------------------------- checkpoints


@pytest.mark.parametrize("source", ["torchrl", "fastreplay"])
def test_state_dict_round_trip_both_ways(source: str, tmp_path, buffer_side: str) -> None:
    src = _sampler(Impl(source), max_staleness=3)
    src.consumer_version = 17
    state = src.state_dict()
    assert list(state) == ["consumer_version", "max_staleness"]
    for target_name in ("torchrl", "fastreplay"):
        target = _sampler(Impl(target_name))
        target.load_state_dict(state)
        assert (target.consumer_version, target.max_staleness) == (17, 3)
        assert target.state_dict() == state
    src.dumps(tmp_path / "sampler")
    loaded = _sampler(Impl("fastreplay"))
    rb = _buffer(buffer_side, loaded, 9)
    rb.extend(_rows(0, [13, 14, 15, 16]))
    loaded.loads(tmp_path / "sampler")
    assert (loaded.consumer_version, loaded.max_staleness) == (17, 3)
    expected = _oracle(_stored_versions(rb), 17, 3)
    torch.testing.assert_close(loaded.probabilities(rb.storage), expected)
    assert repr(loaded) == "StalenessAwareSampler(consumer_version=17, max_staleness=3)"


def test_buffer_checkpoint_and_copies(backend: str, buffer_side: str, tmp_path) -> None:
    sampler = _sampler(Impl("fastreplay"), backend, max_staleness=2)
    rb = _buffer(buffer_side, sampler, 17)
    rb.extend(_rows(0, torch.arange(20) // 4))
    sampler.consumer_version = 5
    rb.sample()
    rb.dumps(tmp_path / "rb")
    fresh = _sampler(Impl("fastreplay"), backend)
    rb2 = _buffer(buffer_side, fresh, 17)
    rb2.loads(tmp_path / "rb")
    assert (fresh.consumer_version, fresh.max_staleness) == (5, 2)
    expected = _oracle(_stored_versions(rb2), 5, 2)
    torch.testing.assert_close(fresh.probabilities(rb2.storage), expected)
    for clone in (copy.deepcopy(sampler), pickle.loads(pickle.dumps(sampler))):
        index, _ = clone.sample(rb.storage, 30)
        assert expected[index].gt(0).all()


def test_constructor_arguments_and_backend_errors() -> None:
    import inspect

    torchrl_params = list(inspect.signature(trl.StalenessAwareSampler.__init__).parameters)[1:]
    ours = inspect.signature(fastreplay.StalenessAwareSampler).parameters
    assert list(ours)[: len(torchrl_params)] == torchrl_params
    assert ours["backend"].kind is inspect.Parameter.KEYWORD_ONLY
    sampler = fastreplay.StalenessAwareSampler(5, None, "pv")
    assert (sampler.max_staleness, sampler._version_key) == (5, "pv")
    with pytest.raises(ValueError, match="backend must be None"):
        fastreplay.StalenessAwareSampler(backend="cuda-tree")


# -------------------------------------------------------------------- past 2**24 items


@pytest.mark.slow
def test_more_items_than_torch_multinomial_takes(backend: str) -> None:
    """20M items (2**24 is 16.8M): TorchRL's multinomial refuses, fastreplay samples them."""
    n, per = 20_000_000, 5_000_000
    storage = LazyTensorStorage(n)
    sampler = _sampler(Impl("fastreplay"), backend, max_staleness=4)
    rb = trl.ReplayBuffer(storage=storage, sampler=sampler, batch_size=256)
    for version in range(4):
        rb.extend(
            TensorDict({"policy_version": torch.full((per,), version, dtype=torch.int32)}, [per])
        )
    sampler.consumer_version = 4
    ref = trl.StalenessAwareSampler(max_staleness=4)  # every item passes: 20M categories
    ref.consumer_version = 4
    with pytest.raises(RuntimeError, match="2\\^24"):
        ref.sample(storage, 256)
    torch.manual_seed(7)
    drawn = []
    for _ in range(40):
        index, info = sampler.sample(storage, 256)
        assert index.unique().numel() == 256
        version = index // per
        torch.testing.assert_close(info["staleness"], (4 - version).float())
        drawn.append(version)
    counts = np.bincount(torch.cat(drawn).numpy(), minlength=4)
    weights = 1.0 / (4 - np.arange(4) + 1)  # equal counts per version: 1/5, 1/4, 1/3, 1/2
    stat, df = _chi2(counts, weights / weights.sum())
    assert stat < _chi2_critical(df), counts
    sampler.max_staleness = 2  # the gate: versions 2 and 3 only
    assert (sampler.sample(storage, 256)[0] // per >= 2).all()
    rb.extend(TensorDict({"policy_version": torch.full((3,), 4, dtype=torch.int32)}, [3]))
    index, info = sampler.sample(storage, 256)  # three rows rewritten: an O(k) update
    assert (index[info["staleness"] == 0] < 3).all()


# -------------------------------------------------------------------- weight functions


class _Annealed:
    """``exp(-s / tau)``: a weight function with state (an annealed temperature)."""

    tau = 100.0

    def __call__(self, s: torch.Tensor) -> torch.Tensor:
        return torch.exp(-s / self.tau)


def test_a_weight_function_with_state_is_read_at_every_sample(impl: Impl, buffer_side: str) -> None:
    """TorchRL calls ``staleness_weight_fn`` at every sample: a new ``tau`` counts at once."""
    torch.manual_seed(0)
    fn = _Annealed()
    sampler = _sampler(impl, staleness_weight_fn=fn)
    rb = _buffer(buffer_side, sampler, 100, batch_size=2000)
    for version in range(10):
        rb.extend(_rows(version * 10, torch.full((10,), version)))
    sampler.consumer_version = 10
    counts = torch.bincount(rb.sample()["policy_version"], minlength=10)
    assert (counts > 100).all()  # nearly uniform over the 10 versions
    fn.tau = 0.05  # version 9 (staleness 1) outweighs version 8 by e**20
    assert rb.sample()["policy_version"].tolist() == [9] * 2000
    if not impl.is_torchrl:
        expected = _oracle(_stored_versions(rb), 10, -1, fn)
        torch.testing.assert_close(sampler.probabilities(rb.storage), expected)
    fn.tau = 100.0
    counts = torch.bincount(rb.sample()["policy_version"], minlength=10)
    assert (counts > 100).all()


@pytest.mark.parametrize(
    ("output", "error"),
    [
        (lambda w: w[:, None], RuntimeError),  # [n, 1]: torch.multinomial draws per row
        (lambda w: w.numpy(), TypeError),
        (lambda w: w.tolist(), AttributeError),
    ],
    ids=["column", "numpy", "list"],
)
def test_weight_outputs_torchrl_rejects_raise_its_errors(
    impl: Impl, buffer_side: str, output, error: type
) -> None:
    sampler = _sampler(impl, staleness_weight_fn=lambda s: output(1.0 / (s + 1.0)))
    rb = _buffer(buffer_side, sampler, 20, batch_size=4)  # 4 of 12 items: no replacement
    for version in range(3):
        rb.extend(_rows(version * 4, torch.full((4,), version)))
    sampler.consumer_version = 3
    with pytest.raises(error):
        rb.sample()
    sampler._weight_fn = lambda s: 1.0 / (s + 1.0)  # a good function samples again
    assert rb.sample()["policy_version"].shape == (4,)

"""PrioritizedSampler on every tree backend present: oracle, cross-backend identity, errors.

The ``backend`` fixture runs each test on the pure-torch trees, on the device backend's (with
CPU tensors) and, where numba is installed, on the compiled ones (skipped with a reason
otherwise). Where TorchRL's compiled extension
loads, the sampler is also checked against TorchRL's own sampler fed the same calls. The tests
that put the sampler into a buffer run it in TorchRL's ``TensorDictReplayBuffer`` and in
fastreplay's (``buffer_side``).
"""

from __future__ import annotations

import inspect
import math

import numpy as np
import pytest
import torch
import torchrl.data as trl
from tensordict import TensorDict
from torchrl.data import LazyTensorStorage

import fastreplay._core.trees.numba_backend as numba_trees
from conformance.conftest import TORCHRL_BUFFER, extend_in_two, make_buffer
from conftest import requires_cuda, requires_numba, requires_torchrl_ext, requires_triton
from fastreplay import PrioritizedSampler
from fastreplay._core.trees.interface import PriorityTreeBackend, make_trees
from fastreplay._core.trees.torch_backend import PriorityTrees


@pytest.fixture(
    params=[
        "torch",
        pytest.param("numba", marks=requires_numba),
        "device",
        pytest.param(
            "triton",
            marks=[
                requires_triton,
                pytest.mark.skipif(
                    torch.cuda.is_available(),
                    reason="triton trees on these CPU storages need Triton's interpreter, which "
                    "is not used where a GPU is: tests/test_triton_trees.py runs them on it",
                ),
            ],
        ),
    ]
)
def backend(request: pytest.FixtureRequest) -> str:
    """conftest's ``backend``, plus the device backend (the default off the CPU) and the triton
    backend (its kernels under Triton's CPU interpreter here)."""
    return request.param


def _buffer(sampler: PrioritizedSampler, capacity: int, side: str) -> trl.TensorDictReplayBuffer:
    """``sampler`` in the ``side`` buffer: TorchRL's ``TensorDictReplayBuffer`` or fastreplay's."""
    storage = LazyTensorStorage(capacity)
    return _td_buffer(side, storage=storage, sampler=sampler, priority_key="td_error")


def _td_buffer(side: str, **kwargs) -> trl.TensorDictReplayBuffer:
    return make_buffer(side, "TensorDictReplayBuffer", **kwargs)


def _rows(start: int, n: int, priority: torch.Tensor | None = None) -> TensorDict:
    data = {"obs": torch.arange(start, start + n) * 10_000}
    if priority is not None:
        data["td_error"] = priority
    return TensorDict(data, [n])


@pytest.mark.parametrize("capacity", [7, 50, 1023])
def test_brute_force_oracle(backend: str, buffer_side: str, capacity: int) -> None:
    """Random extends (wrap-around), updates with repeats and -1 markers, alpha changes."""
    gen = torch.Generator().manual_seed(capacity)
    sampler = PrioritizedSampler(capacity, 0.6, 0.4, eps=1e-3, backend=backend)
    assert sampler.backend == backend
    rb = _buffer(sampler, capacity, buffer_side)
    raw = torch.full((capacity,), -math.inf, dtype=torch.float64)
    written = 0
    for step in range(30):
        if step % 3 == 0:  # new items: the live max of what stays stored
            n = int(torch.randint(1, capacity + 1, (1,), generator=gen))
            slots = (torch.arange(written, written + n) % capacity).unique()
            raw[slots] = -math.inf
            live = raw.max().item()
            rb.extend(_rows(written, n))
            raw[slots] = live if live > -math.inf else 1.0
            written += n
        elif step % 7 == 5:
            sampler.alpha = [0.0, 0.6, 1.3][step % 3]
        else:
            stored = min(written, capacity)
            k = int(torch.randint(1, 3 * capacity, (1,), generator=gen))
            index = torch.randint(-1, stored, (k,), generator=gen)
            priority = torch.rand(k, generator=gen) * 5
            sampler.update_priority(index, priority, storage=rb.storage)
            for i, p in zip(index.tolist(), priority.double().tolist(), strict=True):
                if i != -1:
                    raw[i] = p  # last occurrence wins
        assert torch.equal(sampler._trees.raw(), raw)
        mass = torch.where(raw > -math.inf, (raw + 1e-3) ** sampler.alpha, 0.0).float()
        torch.testing.assert_close(sampler._trees.leaf_mass(), mass.double(), rtol=1e-6, atol=0)
        assert sampler.default_priority == raw.max().item()
        assert sampler._trees.total() == pytest.approx(mass.double().sum().item(), rel=1e-9)
    index, info = sampler.sample(rb.storage, 500)
    assert (raw[index] > -math.inf).all()
    m = sampler._trees.leaf_mass()
    expected = (m[index] / m[m > 0].min()) ** -0.4
    torch.testing.assert_close(info["priority_weight"], expected.float())


@pytest.mark.parametrize("within", [True, False])
def test_default_priority_writes_against_a_brute_force_oracle(backend: str, within: bool) -> None:
    """``mark_update``: live or all-time max, ``initial_priority``, ``upper_priority``, markers.

    The oracle keeps every raw priority: new items get the max of what is still stored (the
    overwritten slots left first) or of every priority ever written, ``initial_priority``
    while there is none, capped by ``upper_priority``.
    """
    capacity, initial, upper = 37, 0.75, 3.5
    gen = torch.Generator().manual_seed(5 + within)
    sampler = PrioritizedSampler(
        capacity, 0.7, 0.4, max_priority_within_buffer=within, backend=backend,
        initial_priority=initial, upper_priority=upper,
    )  # fmt: skip
    raw = torch.full((capacity,), -math.inf, dtype=torch.float64)
    all_time = -math.inf
    for step in range(60):
        if step % 2 == 0:  # new items, sometimes with -1 markers (as TorchRL's writers pass)
            k = int(torch.randint(1, 9, (1,), generator=gen))
            slots = torch.randint(-1, capacity, (k,), generator=gen)
            keep = slots[slots != -1].unique()
            if within:
                raw[keep] = -math.inf
            live = raw.max().item() if within else all_time
            value = min(initial if live == -math.inf else live, upper)
            sampler.mark_update(slots)
            if keep.numel():
                raw[keep] = value
                all_time = max(all_time, value)
        else:  # priorities above and below the cap
            k = int(torch.randint(1, 5, (1,), generator=gen))
            slots = torch.randint(0, capacity, (k,), generator=gen)
            priority = torch.rand(k, generator=gen, dtype=torch.float64) * 6
            sampler.update_priority(slots, priority)
            for i, p in zip(slots.tolist(), priority.tolist(), strict=True):
                raw[i] = p
            all_time = max(all_time, priority.max().item())
        assert torch.equal(sampler._trees.raw(), raw), step
    with pytest.raises(ValueError, match="index"):
        sampler.mark_update(torch.tensor([3, capacity]))  # outside the trees: nothing written
    assert torch.equal(sampler._trees.raw(), raw)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_default_priority_just_below_the_dtype_limit_is_written(backend, dtype) -> None:
    """New items get a live max whose mass is this close to the limit: exact check, written."""
    sampler = PrioritizedSampler(7, 1.0, 0.5, eps=0.0, dtype=dtype, backend=backend)
    if dtype == torch.float32:  # as in the test above: past the fast bound, below the limit
        fits = float(torch.finfo(torch.float32).max) + 2.0**103 - 1e26
    else:
        fits = 1.7976931348623157e308 / sampler._slots * (1 - 1e-13)
    sampler.update_priority(torch.tensor([0]), torch.tensor([fits], dtype=torch.float64))
    sampler.mark_update(torch.tensor([5, -1, 6]))
    assert sampler._trees.raw()[[0, 5, 6]].tolist() == [fits] * 3
    assert math.isfinite(sampler._trees.total())


@requires_numba
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_backends_sample_identically(buffer_side: str, dtype: torch.dtype) -> None:
    """Same calls and seed on both backends: same indices, same weights (exact masses)."""
    samplers = [
        PrioritizedSampler(1023, 1.0, 1.0, eps=0.0, dtype=dtype, backend=b)
        for b in ("torch", "numba")
    ]
    buffers = [_buffer(s, 1023, buffer_side) for s in samplers]
    gen = torch.Generator().manual_seed(3)
    for rb in buffers:
        rb.extend(_rows(0, 1500, torch.randint(1, 50, (1500,), generator=gen).float()))
        gen.manual_seed(3)
    for rb in buffers:
        rb.extend(_rows(1500, 16))  # default priority: the live max
    out = []
    for s, rb in zip(samplers, buffers, strict=True):
        np.random.seed(11)  # the RNG prioritized sampling draws from
        out.append(s.sample(rb.storage, 4000))
        np.random.seed(11)
        batch = rb.sample(64)
        out.append((batch["index"], {"priority_weight": batch["priority_weight"]}))
    for (i1, w1), (i2, w2) in [(out[0], out[2]), (out[1], out[3])]:
        assert torch.equal(i1, i2)
        assert torch.equal(w1["priority_weight"], w2["priority_weight"])
        assert w1["priority_weight"].dtype == dtype
    assert torch.equal(samplers[0]._trees.raw(), samplers[1]._trees.raw())


@requires_numba
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(
    ("alpha", "beta", "eps", "capacity"),
    [
        (0.6, 0.4, 1e-8, 1000),
        (0.7, 0.5, 1e-3, 1000),
        (1.3, 0.9, 1e-6, 1000),
        (0.35, 1.0, 0.0, 1000),
        (1.0, 0.6, 0.01, 1000),
        (0.6, 0.4, 1e-6, 20_000),  # bulk writes and the alpha change: the compiled pow loop
    ],
)
def test_backends_are_bit_identical_at_any_alpha_and_beta(
    dtype: torch.dtype, alpha: float, beta: float, eps: float, capacity: int
) -> None:
    """Random priorities over six decades, updates, an alpha change, new items: both backends
    hold the same leaf masses and return the same indices and weights, to the last bit.

    The inner nodes sum their children in different orders (each backend vectorizes its own
    way), so the float64 totals agree to within the rounding of a sum of ``capacity`` terms,
    ``2 * (capacity - 1)`` float64 units of the total; a draw lands on another leaf only
    within that distance of a leaf boundary (about one draw in 10**13).
    """
    samplers = [
        PrioritizedSampler(capacity, alpha, beta, eps=eps, dtype=dtype, backend=b)
        for b in ("torch", "numba")
    ]
    buffers = [_buffer(s, capacity, TORCHRL_BUFFER) for s in samplers]
    gen = torch.Generator().manual_seed(int(alpha * 100 + beta * 10))
    first = torch.rand(capacity, generator=gen, dtype=torch.float64) * 10.0 ** torch.randint(
        -3, 3, (capacity,), generator=gen
    )
    for rb in buffers:
        rb.extend(_rows(0, capacity, first))

    def same_everywhere(step: int) -> None:
        trees = [s._trees for s in samplers]
        assert torch.equal(trees[0].raw(), trees[1].raw())
        assert torch.equal(trees[0].leaf_mass(), trees[1].leaf_mass())
        assert trees[0].min_mass() == trees[1].min_mass()
        bound = 2 * (capacity - 1) * 2.0**-53
        assert math.isclose(trees[0].total(), trees[1].total(), rel_tol=bound, abs_tol=0)
        out = []
        for s, rb in zip(samplers, buffers, strict=True):
            torch.manual_seed(step)
            np.random.seed(step)
            out.append(s.sample(rb.storage, 256))
        (i1, info1), (i2, info2) = out
        assert torch.equal(i1, i2)
        w1, w2 = info1["priority_weight"], info2["priority_weight"]
        assert w1.dtype == w2.dtype == dtype
        assert torch.equal(w1, w2), f"{int((w1 != w2).sum())} of {w1.numel()} weights differ"

    same_everywhere(0)
    for step in range(1, 6):
        index = torch.randint(0, capacity, (256,), generator=gen)
        priority = torch.rand(256, generator=gen, dtype=torch.float64) * 10.0 ** (step - 3)
        for s, rb in zip(samplers, buffers, strict=True):
            s.update_priority(index, priority, storage=rb.storage)
        same_everywhere(step)
    for s in samplers:
        s.alpha = alpha * 0.75  # every stored mass recomputed
    same_everywhere(10)
    for rb in buffers:
        rb.extend(_rows(capacity, 37))  # new items: the live max priority
    same_everywhere(11)


def test_bad_input_rejected_atomically(backend: str, buffer_side: str) -> None:
    sampler = PrioritizedSampler(50, 1.0, 0.5, backend=backend)
    rb = _buffer(sampler, 50, buffer_side)
    extend_in_two(rb, _rows(0, 20, torch.rand(20) + 0.1))
    before = [level.clone() for level in sampler._trees.levels]
    cases = [
        (torch.tensor([1, 2]), torch.tensor([1.0, math.nan]), ValueError, r"index 2: nan"),
        (torch.tensor([1, 2]), torch.tensor([math.inf, 1.0]), ValueError, r"index 1: inf"),
        (torch.tensor([3]), torch.tensor([-0.5]), ValueError, r"finite and >= 0.*index 3: -0.5"),
        (torch.tensor([1, 25]), torch.tensor([1.0, 2.0]), ValueError, r"stored range \[0, 20\)"),
        (torch.tensor([1, -2]), torch.tensor([1.0, 2.0]), ValueError, r"stored range.*-2"),
        (torch.tensor([1, 2, 3]), torch.ones(2), ValueError, r"priority has 2 elements"),
        (
            torch.tensor([4]),
            torch.tensor([1e39], dtype=torch.float64),
            OverflowError,
            "fit dtype=float32",
        ),
        (torch.tensor([1.0]), torch.ones(1), TypeError, "index must hold integers"),
        (torch.tensor([1]), torch.tensor([True]), TypeError, "priority must be real numbers"),
    ]
    for index, priority, error, match in cases:
        with pytest.raises(error, match=match):
            sampler.update_priority(index, priority, storage=rb.storage)
        assert all(torch.equal(a, b) for a, b in zip(before, sampler._trees.levels, strict=True))
    with pytest.raises(ValueError, match=r"stored range \[0, 20\)"):
        sampler.mark_update(torch.tensor([3, 30]), storage=rb.storage)
    assert all(torch.equal(a, b) for a, b in zip(before, sampler._trees.levels, strict=True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_mass_just_below_the_dtype_limit_is_written(backend: str, dtype: torch.dtype) -> None:
    # Masses this close to the limit skip the fast bound and take the exact check.
    sampler = PrioritizedSampler(7, 1.0, 0.5, eps=0.0, dtype=dtype, backend=backend)
    if dtype == torch.float32:  # fits if it rounds to a finite float32: below max + ulp / 2
        limit, margin = float(torch.finfo(torch.float32).max) + 2.0**103, 1e26
    else:  # the 7 slots' masses must sum to a finite float64
        limit = 1.7976931348623157e308 / sampler._slots
        margin = limit * 1e-13
    fits = torch.tensor([limit - margin, 1.0], dtype=torch.float64)
    sampler.update_priority(torch.tensor([0, 1]), fits)
    assert sampler._trees.max_raw() == float(fits[0])
    assert math.isfinite(sampler._trees.total())
    before = [level.clone() for level in sampler._trees.levels]
    too_big = torch.tensor([1.0, limit + margin], dtype=torch.float64)
    with pytest.raises(OverflowError, match="does not fit"):
        sampler.update_priority(torch.tensor([2, 3]), too_big)
    assert all(torch.equal(a, b) for a, b in zip(before, sampler._trees.levels, strict=True))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.int32, torch.float64])
def test_priority_dtypes(backend: str, dtype: torch.dtype) -> None:
    sampler = PrioritizedSampler(7, 1.0, 0.5, backend=backend)
    priority = torch.tensor([3, 1, 2]).to(dtype)
    sampler.update_priority(torch.tensor([0, 5, 2]), priority)
    sampler.update_priority(torch.tensor([1, 4]), torch.tensor([[2], [7]]).to(dtype))
    assert sampler._trees.raw().tolist() == [3.0, 2.0, 2.0, -math.inf, 7.0, 1.0, -math.inf]


def test_bulk_writes_in_chunks_stay_atomic_and_last_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    """The torch backend writes large batches chunk by chunk: same result, same atomicity."""
    monkeypatch.setattr(PriorityTrees, "bulk_chunk", 8)
    chunked = PrioritizedSampler(50, 0.8, 0.5, backend="torch")
    whole = PrioritizedSampler(50, 0.8, 0.5, backend="torch")
    whole._trees.bulk_chunk = 10**9
    gen = torch.Generator().manual_seed(9)
    index = torch.randint(-1, 50, (300,), generator=gen)  # repeats across chunks, -1 markers
    priority = torch.rand(300, generator=gen)
    for sampler in (chunked, whole):
        sampler.update_priority(index, priority)
    assert torch.equal(chunked._trees.raw(), whole._trees.raw())
    expected = torch.full((50,), -math.inf, dtype=torch.float64)
    for i, p in zip(index.tolist(), priority.double().tolist(), strict=True):
        if i >= 0:
            expected[i] = p
    assert torch.equal(chunked._trees.raw(), expected)
    before = [level.clone() for level in chunked._trees.levels]
    bad = priority.clone()
    bad[-1] = math.nan  # in the last chunk: nothing of the earlier chunks may be written
    with pytest.raises(ValueError, match="nan"):
        chunked.update_priority(index.clamp_min(0), bad + 1.0)
    assert all(torch.equal(a, b) for a, b in zip(before, chunked._trees.levels, strict=True))


def test_backend_keyword_and_repr(backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    sampler = PrioritizedSampler(7, 0.5, 0.5, backend=backend)
    assert sampler.backend == backend
    assert f"backend={backend!r}" in repr(sampler)
    default = PrioritizedSampler(7, 0.5, 0.5)
    assert default.backend == ("numba" if numba_trees.NUMBA_AVAILABLE else "torch")
    with pytest.raises(ValueError, match=r"got backend='fast'"):
        PrioritizedSampler(7, 0.5, 0.5, backend="fast")
    cuda_error = "keeps the priority trees" if numba_trees.NUMBA_AVAILABLE else "needs the numba"
    with pytest.raises(ValueError, match=rf"backend='numba' {cuda_error}"):
        PrioritizedSampler(7, 0.5, 0.5, device="cuda", backend="numba")
    monkeypatch.setattr(numba_trees, "NUMBA_AVAILABLE", False)
    assert PrioritizedSampler(7, 0.5, 0.5).backend == "torch"
    with pytest.raises(ValueError, match=r"needs the numba package.*pip install numba,"):
        PrioritizedSampler(7, 0.5, 0.5, backend="numba")


def test_checkpoints_cross_backends(backend: str, buffer_side: str, tmp_path) -> None:
    """A state saved on one backend loads on the other, leaves and roots intact."""
    other = "torch" if backend == "numba" else "numba"
    if other == "numba" and not numba_trees.NUMBA_AVAILABLE:
        other = "torch"
    source = PrioritizedSampler(50, 0.7, 0.5, backend=backend)
    rb = _buffer(source, 50, buffer_side)
    extend_in_two(rb, _rows(0, 60, torch.rand(60) + 0.1))
    target = PrioritizedSampler(50, 0.7, 0.5, backend=other)
    target.load_state_dict(source.state_dict())
    assert torch.equal(target._trees.raw(), source._trees.raw())
    assert torch.equal(target._trees.leaf_mass(), source._trees.leaf_mass())
    assert target.default_priority == source.default_priority
    source.dumps(tmp_path)
    again = PrioritizedSampler(50, 0.7, 0.5, backend=other)
    again.loads(tmp_path)
    assert torch.equal(again._trees.raw(), source._trees.raw())


@requires_torchrl_ext
def test_same_calls_as_torchrl(backend: str, buffer_side: str) -> None:
    """TorchRL's sampler fed the same calls (all-time max, its default): same masses, weights.

    TorchRL's sampler, the reference, stays in TorchRL's buffer."""
    ours = PrioritizedSampler(1023, 0.7, 0.5, max_priority_within_buffer=False, backend=backend)
    theirs = trl.PrioritizedSampler(1023, 0.7, 0.5)
    gen = torch.Generator().manual_seed(5)
    rbs = [_buffer(ours, 1023, buffer_side), _buffer(theirs, 1023, TORCHRL_BUFFER)]
    data = _rows(0, 1100, torch.rand(1100, generator=gen) + 0.05)
    for rb in rbs:
        extend_in_two(rb, data.clone())
        rb.extend(_rows(1100, 16))
    index = torch.randint(1023, (300,), generator=gen)
    priority = torch.rand(300, generator=gen)
    for s, rb in zip((ours, theirs), rbs, strict=True):
        s.update_priority(index, priority, storage=rb.storage)
    assert ours.default_priority == pytest.approx(float(theirs.default_priority), rel=1e-6)
    their_mass = torch.as_tensor(theirs._sum_tree[torch.arange(1023)], dtype=torch.float64)
    torch.testing.assert_close(ours._trees.leaf_mass(), their_mass, rtol=1e-6, atol=0)
    sample, info = ours.sample(rbs[0].storage, 256)
    expected = (their_mass[sample] / their_mass.min()) ** -0.5
    torch.testing.assert_close(info["priority_weight"], expected.float(), rtol=1e-5, atol=0)


@requires_cuda
def test_cuda_storage_switches_auto_backend_to_device(buffer_side: str) -> None:
    sampler = PrioritizedSampler(30, 0.7, 0.5)
    rb = _td_buffer(
        buffer_side,
        storage=LazyTensorStorage(30, device="cuda"),
        sampler=sampler,
        priority_key="td_error",
    )
    rb.extend(_rows(0, 10, torch.rand(10) + 0.1).to("cuda"))
    assert sampler.backend == "device" and sampler.device.type == "cuda"
    assert sampler.default_priority == sampler._trees.raw()[:10].max().item()


def test_updates_of_only_minus_one_markers_change_nothing(backend: str, buffer_side: str) -> None:
    """TorchRL's ``MaxValueWriter`` marks rejected rows ``-1``: a write of only those is a no-op."""
    sampler = PrioritizedSampler(8, 0.6, 0.4, backend=backend)
    sampler.update_priority(torch.tensor([0, 1]), torch.tensor([1.0, 2.0]))
    before = sampler._trees.raw().clone()
    sampler.update_priority(torch.tensor([-1, -1]), torch.tensor([3.0, 4.0]))
    sampler.mark_update(torch.tensor([-1]))
    assert torch.equal(sampler._trees.raw(), before)
    rb = _td_buffer(
        buffer_side,
        storage=LazyTensorStorage(4),
        sampler=PrioritizedSampler(4, 0.6, 0.4, backend=backend),
        writer=trl.TensorDictMaxValueWriter(rank_key="r"),
        batch_size=2,
    )
    rb.extend(TensorDict(r=torch.tensor([5.0, 6.0, 7.0, 8.0]), batch_size=[4]))
    assert rb.extend(TensorDict(r=torch.tensor([0.0, 1.0]), batch_size=[2])).tolist() == [-1, -1]
    assert len(rb) == 4


def test_alpha_that_would_overflow_the_initial_priority_is_refused(backend: str) -> None:
    """Emptying the buffer falls back to ``initial_priority``: alpha must keep its mass finite."""
    sampler = PrioritizedSampler(8, 1.0, 0.4, initial_priority=1e20, backend=backend)
    sampler.update_priority(torch.tensor([0]), torch.tensor([1.0]))
    with pytest.raises(OverflowError, match=r"alpha=2\.0"):
        sampler.alpha = 2.0
    assert sampler.alpha == 1.0
    sampler.mark_update(torch.tensor([0]))  # clears the max item, then writes the default
    assert sampler._trees.raw()[0] == 1e20


def test_a_move_that_fails_changes_nothing() -> None:
    """numba trees cannot follow a storage to CUDA when numba is forced: nothing changes."""
    pytest.importorskip("numba", reason="numba is not installed (optional extra 'fast')")

    class CudaStorage:  # only what the device check reads
        device = torch.device("cuda:0")

        def __len__(self) -> int:
            return 4

    sampler = PrioritizedSampler(8, 0.6, 0.4, backend="numba")
    with pytest.raises(ValueError, match="numba"):
        sampler.mark_update(torch.tensor([1]), storage=CudaStorage())
    assert sampler.device == torch.device("cpu") and sampler._device is None
    sampler.update_priority(torch.tensor([1]), torch.tensor([2.0]))  # still usable
    assert sampler._trees.raw()[1] == 2.0


# ---------------------------------------------------------------- scalars of every kind
def _assert_masses_and_weights(sampler: PrioritizedSampler, rb, raw: torch.Tensor) -> None:
    """The stored masses are ``(p + eps) ** alpha`` and sampled weights ``(m / m_min) ** -beta``
    for the current (float) ``alpha``/``beta``: a brute-force check of the whole state."""
    alpha, beta, eps = (float(getattr(sampler, name)) for name in ("alpha", "beta", "_eps"))
    mass = ((raw.double() + eps) ** alpha).float().double()
    torch.testing.assert_close(sampler._trees.leaf_mass()[: raw.numel()], mass)
    _, info = rb.sample(64, return_info=True)
    expected = (mass[info["index"]] / mass.min()) ** -beta
    torch.testing.assert_close(info["priority_weight"], expected.float(), rtol=1e-5, atol=0)


@pytest.mark.parametrize(("alpha", "beta"), [(torch.tensor(1.0), torch.tensor(0.1)), (0.6, 0.7)])
def test_torchrl_parameter_schedulers(backend: str, buffer_side: str, alpha, beta) -> None:
    """TorchRL's LinearScheduler/StepScheduler set ``alpha``/``beta`` to tensors (or NumPy
    floats): sampling and writing keep working, with the scheduled values, read back as set."""
    from torchrl.data.replay_buffers.scheduler import LinearScheduler, SchedulerList, StepScheduler

    sampler = PrioritizedSampler(100, alpha, beta, backend=backend)
    rb = _buffer(sampler, 100, buffer_side)
    gen = torch.Generator().manual_seed(3)
    raw = torch.rand(60, generator=gen) + 0.1
    rb.extend(_rows(0, 60, raw))
    schedulers = SchedulerList(
        [
            LinearScheduler(rb, param_name="alpha", final_value=0.2, num_steps=5),
            StepScheduler(rb, "beta", gamma=0.1, n_steps=2, max_value=1.4, mode="additive"),
        ]
    )
    expected_alpha = torch.linspace(float(alpha), 0.2, 6).tolist() + [0.2] * 2
    for step in range(8):
        assert float(sampler.alpha) == pytest.approx(expected_alpha[step], rel=1e-6)
        _assert_masses_and_weights(sampler, rb, raw)
        more = torch.rand(4, generator=gen) + 0.1
        rb.extend(_rows(60 + 4 * step, 4, more))  # mark_update, then update_priority
        raw = torch.cat([raw, more])
        schedulers.step()
    assert float(sampler.beta) == pytest.approx(float(beta) + 0.4, rel=1e-6)
    # read back as the schedulers set them, as in TorchRL: tensors, or NumPy floats
    kind = torch.Tensor if isinstance(alpha, torch.Tensor) else np.floating
    assert isinstance(sampler.alpha, kind) and isinstance(sampler.beta, kind)


def test_scalars_of_every_kind_at_construction_and_in_updates(
    backend: str, buffer_side: str
) -> None:
    """0-dim tensors, NumPy scalars and ints wherever a number goes: construction, setters,
    priorities; the trees get plain floats and ``alpha``/``beta`` read back as given."""
    sampler = PrioritizedSampler(
        10,
        alpha=torch.tensor(0.6),
        beta=np.float32(0.4),
        eps=torch.tensor(1e-6, dtype=torch.float64),
        upper_priority=np.float64(50.0),
        initial_priority=torch.tensor(2),
        backend=backend,
    )
    assert isinstance(sampler.alpha, torch.Tensor) and isinstance(sampler.beta, np.float32)
    assert sampler.default_priority == 2.0 and sampler.upper_priority == 50.0
    rb = _buffer(sampler, 10, buffer_side)
    rb.extend(_rows(0, 6))
    sampler.update_priority(1, np.float32(3.0))
    sampler.update_priority(torch.tensor([2, 3]), np.float64(4.0))
    sampler.update_priority(torch.tensor(4), torch.tensor(5))  # 0-dim index, int priority
    sampler.update_priority(np.int64(5), 6)
    raw = torch.tensor([2.0, 3.0, 4.0, 4.0, 5.0, 6.0])
    _assert_masses_and_weights(sampler, rb, raw)
    sampler.alpha, sampler.beta = np.float64(0.9), torch.tensor(0.8, dtype=torch.float64)
    _assert_masses_and_weights(sampler, rb, raw)
    sampler.alpha, sampler.beta = 1, True  # ints and bools are numbers too
    _assert_masses_and_weights(sampler, rb, raw)
    for bad in ("0.5", torch.tensor([0.5, 0.6]), 1j):
        with pytest.raises(TypeError, match=r"alpha must be a real number.*got alpha="):
            sampler.alpha = bad
        with pytest.raises(TypeError, match=r"beta must be a real number"):
            PrioritizedSampler(10, 0.5, bad, backend=backend)
    with pytest.raises(ValueError, match=r"alpha must be greater or equal than 0"):
        sampler.alpha = torch.tensor(-0.5)
    assert sampler.alpha == 1
    again = PrioritizedSampler(10, 0.1, 0.1, backend=backend)
    again.load_state_dict(sampler.state_dict())
    assert (again.alpha, again.beta, again._eps) == (1.0, 1.0, 1e-6)


# ---------------------------------------------------------------- coordinates of the wrong length
@pytest.mark.parametrize(
    ("shape", "index"),
    [((20,), [[1, 2], [3, 0]]), ((20, 3), [[1], [2]]), ((20, 3), [[1, 2, 0]])],
)
def test_coordinates_not_matching_the_storage_ndim_are_refused(
    backend: str, buffer_side: str, shape: tuple[int, ...], index: list[list[int]]
) -> None:
    """A ``[k, c]`` index with ``c != storage.ndim`` raveled with a truncated shape would write
    other slots: it raises ValueError (as TorchRL) naming the index, its shape and the fix."""
    sampler = PrioritizedSampler(60, 1.0, 0.5, backend=backend)
    storage = LazyTensorStorage(math.prod(shape), ndim=len(shape))
    rb = _td_buffer(buffer_side, storage=storage, sampler=sampler)
    envs_by_steps = shape[::-1]  # an ndim=2 storage is [steps, envs]
    rb.extend(TensorDict({"obs": torch.zeros(envs_by_steps)}, list(envs_by_steps)))
    assert tuple(rb.storage.shape) == shape
    before = [level.clone() for level in sampler._trees.levels]
    coords = torch.tensor(index)
    ndim = len(shape)
    fix = rf"index of shape \({len(index)}, {len(index[0])}\).*ndim={ndim}.*\[k, {ndim}\]"
    with pytest.raises(ValueError, match=fix):
        rb.update_priority(coords, torch.full((len(index),), 7.0))
    with pytest.raises(ValueError, match=fix):
        sampler.mark_update(coords, storage=rb.storage)
    assert all(torch.equal(a, b) for a, b in zip(before, sampler._trees.levels, strict=True))


# ---------------------------------------------------------------- priorities past the stored items
def _stored_only_sampler(backend: str) -> tuple[PrioritizedSampler, trl.ReplayBuffer]:
    sampler = PrioritizedSampler(64, 1.0, 0.5, eps=0.0, backend=backend)
    rb = trl.ReplayBuffer(storage=LazyTensorStorage(64), sampler=sampler, batch_size=4000)
    rb.extend(torch.arange(10))
    sampler.update_priority(torch.arange(10), torch.arange(10) + 1.0)
    return sampler, rb


def test_a_priority_set_past_the_stored_items_is_never_sampled(backend: str) -> None:
    """``update_priority`` without ``storage=`` on slot 50 while 10 items are stored: as in
    TorchRL, sampling draws the stored items only, with their own probabilities and weights."""
    sampler, rb = _stored_only_sampler(backend)
    sampler.update_priority([50], 0.25)  # below every stored mass: must not enter m_min
    raw = torch.arange(10) + 1.0
    for _ in range(3):
        data, info = rb.sample(return_info=True)
        assert torch.equal(data, info["index"]) and int(data.max()) < 10
        expected = (raw[info["index"]] / raw.min()) ** -0.5
        torch.testing.assert_close(info["priority_weight"], expected)
    counts = torch.bincount(torch.cat([rb.sample() for _ in range(5)]), minlength=10).double()
    frequency, probability = counts / counts.sum(), raw / raw.sum()
    assert ((frequency - probability).abs() < 5 * (probability / 20_000).sqrt()).all()
    # As in TorchRL, the priority counts towards the default priority of new items...
    sampler.update_priority([60], 1e3)
    assert float(sampler.default_priority) == 1e3
    rb.extend(torch.arange(10, 11))
    assert sampler._trees.raw()[10] == 1e3
    assert int(rb.sample().max()) <= 10
    rb.extend(torch.arange(11, 51))  # ...until its slot is written: then it is a stored item
    assert sampler._trees.raw()[50] == 1e3 and int(rb.sample().max()) == 50


def test_a_rounding_overshoot_past_the_stored_items_stays_below_them(
    backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A draw that rounding pushes past ``len(storage)`` lands on the last stored slot with mass."""
    sampler, rb = _stored_only_sampler(backend)
    rb.extend(torch.arange(10, 12))  # slots 10 and 11: stored, priority 0 from now on
    sampler.update_priority(torch.tensor([10, 11]), 0.0)
    sampler.update_priority([50], 2.0)
    total, m_min = sampler._trees.prefix(12)
    assert total == 55.0 and m_min == 0.0
    monkeypatch.setattr(sampler._trees, "prefix", lambda n: (2 * total, 1.0))  # overshoots
    index, info = sampler.sample(rb.storage, 2000)
    assert int(index.max()) == 9 and (index == 9).float().mean() > 0.4
    torch.testing.assert_close(
        info["priority_weight"][index == 9],
        torch.full_like(info["priority_weight"][index == 9], 10.0**-0.5),
    )


@requires_torchrl_ext
def test_a_priority_past_the_stored_items_as_in_torchrl(backend: str) -> None:
    """Same calls on TorchRL's sampler: same sampled range, same default priority."""
    theirs = trl.PrioritizedSampler(64, 1.0, 0.5, eps=0.0, max_priority_within_buffer=True)
    ours = PrioritizedSampler(64, 1.0, 0.5, eps=0.0, backend=backend)
    for sampler in (theirs, ours):
        rb = trl.ReplayBuffer(storage=LazyTensorStorage(64), sampler=sampler, batch_size=500)
        rb.extend(torch.arange(10))
        sampler.update_priority(torch.arange(10), torch.arange(10) + 1.0)
        sampler.update_priority([50], 1e3)
        assert int(rb.sample().max()) < 10
        assert float(sampler.default_priority) == 1e3
        rb.extend(torch.arange(10, 11))
        assert sampler._sum_tree[10] == 1e3


def test_every_backend_implements_the_whole_tree_interface(backend: str) -> None:
    """The samplers call only :class:`PriorityTreeBackend`: each backend has every member, with
    the interface's parameters in its order (extra parameters only with defaults)."""
    trees = make_trees(7, backend=backend)
    members = set(PriorityTreeBackend.__annotations__) | {
        name for name in vars(PriorityTreeBackend) if not name.startswith("_")
    }
    assert {"check_and_write", "mark_update", "sample", "set_leaves", "levels"} <= members
    for name in sorted(members):
        assert hasattr(trees, name), f"{backend} trees lack {name}"
        wanted = vars(PriorityTreeBackend).get(name)
        if not inspect.isfunction(wanted):
            continue
        expected = list(inspect.signature(wanted).parameters.values())
        found = list(inspect.signature(getattr(type(trees), name)).parameters.values())
        assert [p.name for p in found[: len(expected)]] == [p.name for p in expected], name
        assert all(p.default is not p.empty for p in found[len(expected) :]), name

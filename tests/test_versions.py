"""One code base for every supported TorchRL: 0.13.x, 0.14.x and the nightly.

What differs between TorchRL versions has one name in ``fastreplay._torchrl``; these tests
check each name against the installed TorchRL's own behaviour (so they hold on every version),
and compare fastreplay's samplers with the installed TorchRL's where a version adds something:
the nightly's ``output_layout="batch_time"`` and its short-flat-batch warning. fastreplay's
samplers run there in TorchRL's buffer and in fastreplay's (``buffer_side``); TorchRL's samplers,
the reference, in TorchRL's.
"""

from __future__ import annotations

import gc
import inspect
import pickle
import warnings
import weakref
from typing import Any

import pytest
import torch
import torchrl.data as trl

import fastreplay
from conformance.conftest import (
    BUFFER_SIDES,
    DONE,
    TORCHRL_BUFFER,
    assert_slices_valid,
    episodes,
    make_buffer,
)
from conftest import TORCHRL_EXT
from fastreplay import _torchrl as compat
from fastreplay import sample_units
from fastreplay.sample_units import BoundaryListener
from fastreplay.samplers._index_sync import IndexSync

_P = inspect.Parameter
SLICE_CLASSES = ("SliceSampler", "SliceSamplerWithoutReplacement")
BATCH_TIME = pytest.mark.skipif(
    "batch_time" not in compat.OUTPUT_LAYOUTS,
    reason=f"TorchRL {compat.TORCHRL_VERSION} has no SliceSampler(output_layout='batch_time')",
)


def _init_params(cls: type) -> dict[str, inspect.Parameter]:
    params = list(inspect.signature(cls.__init__).parameters.values())[1:]
    return {p.name: p for p in params if p.kind not in (_P.VAR_POSITIONAL, _P.VAR_KEYWORD)}


# ------------------------------------------------------------ the compat module's names
def test_slice_sampler_args_are_the_installed_ones() -> None:
    assert set(_init_params(trl.SliceSampler)) == compat.SLICE_SAMPLER_ARGS
    assert compat.OUTPUT_LAYOUTS[0] == "flat"
    assert ("output_layout" in compat.SLICE_SAMPLER_ARGS) == ("batch_time" in compat.OUTPUT_LAYOUTS)
    assert hasattr(trl.SliceSampler, "_finalize_index") == compat.HAS_FINALIZE_INDEX


def test_static_boundaries_key_is_where_torchrl_keeps_them() -> None:
    sampler = trl.SliceSampler(num_slices=2, ends=torch.tensor([0, 1, 0, 0, 1]), cache_values=True)
    assert set(sampler._cache) == {compat.STATIC_BOUNDARIES}


def test_storage_revision_and_last_cursor() -> None:
    storage = trl.LazyTensorStorage(10)
    rb = trl.TensorDictReplayBuffer(storage=storage, batch_size=2)
    rb.extend(episodes(7, 3))
    assert compat.last_cursor_row(storage) == 6
    before = compat.mutation_revision(storage, assumed=-1)
    rb.extend(episodes(5, 3))  # wraps: rows 7, 8, 9, 0, 1
    assert compat.last_cursor_row(storage) == 1
    rb.add(episodes(1, 1)[0])
    assert compat.last_cursor_row(storage) == 2
    after = compat.mutation_revision(storage, assumed=-1)
    if compat.STORAGE_HAS_REVISION:
        assert after > before
    else:  # TorchRL 0.13: no counter, the caller's assumption comes back
        assert not hasattr(storage, "_mutation_revision") and before == after == -1


@pytest.mark.parametrize(
    "make",
    [
        lambda: trl.LazyTensorStorage(10),
        lambda: trl.LazyTensorStorage(10, compilable=True),
        lambda: trl.LazyMemmapStorage(10),
        lambda: trl.ListStorage(10),
        lambda: type("Sub", (trl.LazyTensorStorage,), {"__len__": lambda self: 3})(10),
    ],
    ids=["lazy", "compilable", "memmap", "list", "subclass"],
)
def test_storage_len_is_len(make) -> None:
    """``storage_len`` reads TorchRL's counter where it can; always what ``len`` returns."""
    storage = make()
    rb = trl.TensorDictReplayBuffer(storage=storage, batch_size=2)
    lengths = [(compat.storage_len(storage), len(storage))]
    for rows in (7, 5, 1):  # the second extend wraps
        rb.extend(episodes(rows, 3))
        lengths.append((compat.storage_len(storage), len(storage)))
    rb.empty()
    lengths.append((compat.storage_len(storage), len(storage)))
    assert all(fast == slow for fast, slow in lengths), lengths
    assert lengths[1][1] in (7, 3)  # the data went in (the subclass reports 3)


def test_short_flat_batch_warning_flag_matches_torchrl() -> None:
    storage = trl.LazyTensorStorage(30)
    sampler = trl.SliceSampler(num_slices=4, traj_key="traj", strict_length=False)
    rb = trl.ReplayBuffer(storage=storage, sampler=sampler, batch_size=24)
    rb.extend(episodes(29, [2, 9, 3]))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rb.sample()
    messages = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
    warned = any(m.startswith(compat.SHORT_FLAT_BATCH_MESSAGE) for m in messages)
    assert warned == compat.WARNS_SHORT_FLAT_BATCH, messages


@pytest.mark.skipif(not TORCHRL_EXT, reason="TorchRL's PrioritizedSampler needs its extension")
def test_alpha_change_flag_matches_torchrl() -> None:
    sampler = trl.PrioritizedSampler(8, alpha=0.5, beta=1.0, max_priority_within_buffer=True)
    sampler.extend(torch.arange(4))
    sampler.update_priority(torch.arange(4), torch.tensor([1.0, 2.0, 3.0, 4.0]))
    before = sampler._sum_tree[1]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sampler.alpha = 1.0
    retransformed = sampler._sum_tree[1] != before
    assert retransformed == compat.ALPHA_CHANGE_RETRANSFORMS
    assert bool(caught) == (not compat.ALPHA_CHANGE_RETRANSFORMS)


def test_streaming_slice_and_her_are_where_torchrl_has_them() -> None:
    """``StreamingSliceSampler``: 0.14 and later, on both sides; ``HERReplayBuffer``: all."""
    has = hasattr(trl, "StreamingSliceSampler")
    assert has == compat.HAS_STREAMING_SLICE
    assert hasattr(fastreplay, "StreamingSliceSampler") == has
    assert ("StreamingSliceSampler" in fastreplay.__all__) == has
    if has:
        assert issubclass(fastreplay.StreamingSliceSampler, trl.StreamingSliceSampler)
        assert issubclass(fastreplay.StreamingSliceSampler, fastreplay.SliceSampler)
        shared = getattr(trl.StreamingSliceSampler, "requires_shared_state", None)
        assert getattr(fastreplay.StreamingSliceSampler, "requires_shared_state", None) == shared
    assert issubclass(fastreplay.HERReplayBuffer, trl.HERReplayBuffer)


# --------------------------------------------------------------- constructor arguments
@pytest.mark.parametrize("name", [*SLICE_CLASSES, "PrioritizedSliceSampler"])
def test_every_torchrl_argument_is_accepted_and_shown(name: str) -> None:
    ours, theirs = getattr(fastreplay, name), getattr(trl, name)
    shown = inspect.signature(ours).parameters
    positional = {"max_capacity": 10, "alpha": 0.7, "beta": 0.5}
    for arg, param in _init_params(theirs).items():
        assert arg in shown, f"{name}: TorchRL's {arg!r} is not in fastreplay's signature"
        if arg in positional or arg in ("ends", "trajectories"):
            continue
        default = param.default
        kwargs = {**({} if name != "PrioritizedSliceSampler" else positional), "num_slices": 2}
        if arg == "num_slices":
            default = 2
        kwargs[arg] = default
        ours(**kwargs)  # TorchRL's default, passed explicitly: accepted on every version


@pytest.mark.parametrize("name", [*SLICE_CLASSES, "PrioritizedSliceSampler"])
def test_unknown_arguments_raise_type_error_as_torchrl(name: str) -> None:
    extra = {"max_capacity": 10, "alpha": 0.7, "beta": 0.5} if "Prioritized" in name else {}
    with pytest.raises(TypeError, match="no_such_argument"):
        getattr(fastreplay, name)(num_slices=2, no_such_argument=1, **extra)
    if "output_layout" not in compat.PRIORITIZED_SLICE_ARGS:  # as TorchRL's, on every version
        with pytest.raises(TypeError, match="output_layout"):
            fastreplay.PrioritizedSliceSampler(10, 0.7, 0.5, num_slices=2, output_layout="flat")


@pytest.mark.skipif(
    "end_keys" in compat.SLICE_SAMPLER_ARGS,
    reason=f"TorchRL {compat.TORCHRL_VERSION} has end_keys",
)
def test_arguments_the_installed_torchrl_lacks_are_refused_as_torchrl_does() -> None:
    for cls in (trl.SliceSampler, fastreplay.SliceSampler):
        with pytest.raises(TypeError, match="end_keys"):
            cls(num_slices=2, end_keys=[DONE])


# -------------------------------------------------------------------------- batch_time
BUFFERS = pytest.mark.parametrize("buffer_side", BUFFER_SIDES)


def _pair(name: str, storage_size: int, side: str, **kwargs: Any) -> list[tuple[Any, Any]]:
    """TorchRL's sampler in TorchRL's ``TensorDictReplayBuffer``, and fastreplay's in the
    ``side`` buffer (TorchRL's ``TensorDictReplayBuffer`` or fastreplay's)."""
    out = []
    for module, buffer in ((trl, TORCHRL_BUFFER), (fastreplay, side)):
        storage = trl.LazyTensorStorage(storage_size)
        sampler = getattr(module, name)(**kwargs)
        rb = make_buffer(
            buffer, "TensorDictReplayBuffer", storage=storage, sampler=sampler, batch_size=24
        )
        out.append((rb, storage))
    return out


def _assert_same(a: Any, b: Any) -> None:
    if isinstance(a, dict):
        assert set(a) == set(b)
        for key in a:
            _assert_same(a[key], b[key])
    elif isinstance(a, tuple):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _assert_same(x, y)
    else:
        assert a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b), (a, b)


def _outcome(fn: Any, *args: Any) -> Any:
    """``fn(*args)``, or the exception it raised (compared between the two libraries)."""
    try:
        return fn(*args)
    except RuntimeError as err:
        return err


_SHORT = pytest.mark.filterwarnings(f"ignore:{compat.SHORT_FLAT_BATCH_MESSAGE}:UserWarning")


@BATCH_TIME
@_SHORT  # the flat reference samples below may be short
@pytest.mark.parametrize("name", SLICE_CLASSES)
@pytest.mark.parametrize(
    "config",
    [
        {"strict_length": True},
        {"strict_length": False},
        {"strict_length": True, "span": (False, 2)},
        {"strict_length": True, "slice_end_key": "end", "time_dim_name": "t"},
        {"strict_length": False, "time_dim_name": None},
    ],
    ids=["strict", "padded", "span", "custom-keys", "unnamed"],
)
@pytest.mark.parametrize("key", [{"traj_key": "traj"}, {"end_key": DONE}], ids=["ids", "done"])
@BUFFERS
def test_batch_time_is_bit_identical_to_torchrl(
    buffer_side: str, name: str, config: dict, key: dict
) -> None:
    if "span" in config and name != "SliceSampler":
        pytest.skip(f"{name} takes no span")
    kwargs = {"num_slices": 4, "output_layout": "batch_time", **config, **key}
    data = episodes(70, [2, 9, 13, 3, 20])
    data["is_init"] = data["step"] == 0
    (rb_t, st_t), (rb_f, st_f) = _pair(name, 60, buffer_side, **kwargs)
    for rb in (rb_t, rb_f):
        rb.extend(data[:40])
        rb.extend(data[40:])  # wraps around the 60 slots
    for _ in range(4):
        torch.manual_seed(7)
        sample_t = _outcome(rb_t.sampler.sample, st_t, 24)
        torch.manual_seed(7)
        sample_f = _outcome(rb_f.sampler.sample, st_f, 24)
        if isinstance(sample_t, Exception):  # all drawn trajectories too short: same error
            assert (type(sample_f), str(sample_f)) == (type(sample_t), str(sample_t))
            continue
        _assert_same(sample_t, sample_f)
        index, info = sample_f
        rows = index[0].shape[0]
        assert index[0].shape == (rows, 6)  # [num_slices, time]
        end_key = config.get("slice_end_key", ("collector", "slice_end"))
        assert info[end_key].shape == (rows, 6, 1)
        if not config["strict_length"]:
            assert info["collector", "mask"].shape == (rows, 6)
        torch.manual_seed(11)
        batch_t = _outcome(rb_t.sample)
        torch.manual_seed(11)
        batch_f = _outcome(rb_f.sample)
        if isinstance(batch_t, Exception):
            assert (type(batch_f), str(batch_f)) == (type(batch_t), str(batch_t))
            continue
        assert batch_t.names == batch_f.names
        assert batch_f.names[-1] == config.get("time_dim_name", "time")
        _assert_same(batch_t.to_dict(), batch_f.to_dict())


@BATCH_TIME
@BUFFERS
def test_batch_time_is_served_by_the_incremental_index(
    buffer_side: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``batch_time`` samples come from fastreplay's index: no rescan of the storage."""
    rebuilds: list[int] = []
    rebuild = IndexSync._rebuild

    def counting(self: Any, *args: Any) -> None:
        rebuilds.append(1)
        rebuild(self, *args)

    monkeypatch.setattr(IndexSync, "_rebuild", counting)
    storage = trl.LazyTensorStorage(100)
    sampler = fastreplay.SliceSampler(num_slices=2, traj_key="traj", output_layout="batch_time")
    rb = make_buffer(
        buffer_side, "TensorDictReplayBuffer", storage=storage, sampler=sampler, batch_size=8
    )
    rb.extend(episodes(50, 10))
    rb.sample()
    index = sampler._fr_index
    assert index is not None
    rb.extend(episodes(10, 5, first_id=50))
    rb.sample()
    assert sampler._fr_index is index  # updated in place, not rebuilt
    assert not rebuilds  # every write was read incrementally, the direct one too


# --------------------------------------------------------------------------- warnings
def _warnings_of(rb: Any, storage: Any, n: int) -> list[tuple[type, str, str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for seed in range(n):
            torch.manual_seed(seed)
            rb.sample()
    return [(w.category, str(w.message), w.filename) for w in caught]


@_SHORT
@pytest.mark.parametrize("name", SLICE_CLASSES)
@pytest.mark.parametrize(
    "config",
    [{"strict_length": False}, {"span": (False, 3)}, {}],
    ids=["non-strict", "span", "strict"],
)
@BUFFERS
def test_warnings_are_torchrl_s(buffer_side: str, name: str, config: dict) -> None:
    """Same warnings (class, text, the line they point at) as the installed TorchRL."""
    if "span" in config and name != "SliceSampler":
        pytest.skip(f"{name} takes no span")
    kwargs = {"num_slices": 4, "traj_key": "traj", **config}
    found = []
    for rb, storage in _pair(name, 60, buffer_side, **kwargs):  # TorchRL's, then fastreplay's
        rb.extend(episodes(59, [2, 9, 13, 3, 20]))
        found.append(_warnings_of(rb, storage, 4))
    assert found[0] == found[1]
    short = [w for w in found[1] if w[1].startswith(compat.SHORT_FLAT_BATCH_MESSAGE)]
    if compat.WARNS_SHORT_FLAT_BATCH and (config or name != "SliceSampler"):
        assert len(short) == 1 and short[0][0] is UserWarning  # once per sampler
    else:
        assert not short


@pytest.mark.skipif(
    not compat.WARNS_SHORT_FLAT_BATCH,
    reason=f"TorchRL {compat.TORCHRL_VERSION} does not warn on short flat batches",
)
@BUFFERS
def test_short_flat_batch_warning_can_be_filtered_by_message(buffer_side: str) -> None:
    storage = trl.LazyTensorStorage(40)
    sampler = fastreplay.SliceSampler(num_slices=4, traj_key="traj", strict_length=False)
    rb = make_buffer(buffer_side, storage=storage, sampler=sampler, batch_size=24)
    rb.extend(episodes(39, [2, 9, 3]))
    with pytest.warns(UserWarning, match=compat.SHORT_FLAT_BATCH_MESSAGE):
        rb.sample()
    with warnings.catch_warnings():
        warnings.filterwarnings("error")
        warnings.filterwarnings("ignore", message=compat.SHORT_FLAT_BATCH_MESSAGE)
        fresh = fastreplay.SliceSampler(num_slices=4, traj_key="traj", strict_length=False)
        rb.set_sampler(fresh)
        rb.sample()


def _left_span_warnings(cls: type, span: Any, monkeypatch: pytest.MonkeyPatch) -> list[tuple]:
    """The warnings ``cls(..., span=span)`` emits: (category, text, filename, lineno)."""
    with monkeypatch.context() as patch:
        if not TORCHRL_EXT and cls is trl.PrioritizedSliceSampler:
            # TorchRL's trees need its extension, built before the warning: skipped here.
            patch.setattr(compat.TorchRLPrioritizedSampler, "__init__", lambda *a, **k: None)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            sampler = cls(10, 1.0, 1.0, num_slices=2, span=span)
    assert not sampler.span[0]
    return [(w.category, str(w.message), w.filename, w.lineno) for w in caught]


@pytest.mark.parametrize("span", [True, 2, (True, 3)], ids=["true", "int", "tuple"])
def test_left_span_warning_is_torchrl_s(span: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Same text, category, file and line as the installed TorchRL's ``PrioritizedSliceSampler``."""
    theirs = _left_span_warnings(trl.PrioritizedSliceSampler, span, monkeypatch)
    ours = _left_span_warnings(fastreplay.PrioritizedSliceSampler, span, monkeypatch)
    assert len(theirs) == 1 and ours == theirs
    category, text, filename, _ = ours[0]
    assert category is UserWarning and text.startswith(compat.LEFT_SPAN_MESSAGE)
    assert filename == trl.PrioritizedSliceSampler.__init__.__code__.co_filename


@pytest.mark.parametrize(
    "module",
    # where TorchRL's __init__ is defined (its class is re-exported from another module)
    [trl.PrioritizedSliceSampler.__init__.__module__.replace(".", r"\.") + "$", "torchrl"],
    ids=["exact", "package"],
)
def test_left_span_warning_filter_written_for_torchrl_applies(module: str) -> None:
    """A ``filterwarnings(message=..., module=...)`` silencing TorchRL's warning silences ours."""
    text = "Left spanning is disabled for PrioritizedSliceSampler and will be automatically"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warnings.filterwarnings("ignore", message=text, category=UserWarning, module=module)
        sampler = fastreplay.PrioritizedSliceSampler(10, 1.0, 1.0, num_slices=2, span=True)
    assert sampler.span == (0, True)
    with warnings.catch_warnings():  # a filter for another module does not apply
        warnings.simplefilter("error")
        warnings.filterwarnings("ignore", message=text, module="fastreplay")
        with pytest.raises(UserWarning, match=text):
            fastreplay.PrioritizedSliceSampler(10, 1.0, 1.0, num_slices=2, span=True)


# ------------------------------------------------------------------- storage revision
def _same_boundaries(ours: Any, storage: Any) -> bool:
    expected = trl.SliceSampler(num_slices=2, traj_key="traj")._get_stop_and_length(storage)
    got = ours._get_stop_and_length(storage)
    return all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))


@BUFFERS
@pytest.mark.parametrize("unreported", [False, True], ids=["other-buffer", "storage-set"])
def test_writes_the_sampler_is_not_told_about(buffer_side: str, unreported: bool) -> None:
    """Seen on every version: the ids' version counter moved by more than the reported write.

    A write through another buffer on the same storage is reported (its writer calls
    ``mark_update`` through every buffer attached to the storage), but lands where this
    buffer's writer did not expect it; ``storage.set`` is reported to nobody.
    """
    storage = trl.LazyTensorStorage(40)
    sampler = fastreplay.SliceSampler(num_slices=2, traj_key="traj")
    rb = make_buffer(buffer_side, storage=storage, sampler=sampler, batch_size=8)
    rb.extend(episodes(40, 10))  # full: the writer is back at row 0
    rb.sample()
    data = episodes(10, 1, first_id=500)  # rows 0-9: ten one-step trajectories
    if unreported:
        storage.set(torch.arange(10), data)
    else:
        other = trl.ReplayBuffer(storage=storage, batch_size=8)  # another writer, same storage
        other.extend(data)
    # A write the sampler is told about, after it (rows 0-4): the ids' version counter moved
    # by more than the writes reported, so the unreported write is seen too (and, on 0.14+,
    # by the storage's write counter).
    rb.extend(episodes(5, 5, first_id=600))
    assert _same_boundaries(sampler, storage)
    sampler.invalidate_boundaries()
    assert _same_boundaries(sampler, storage)


# ------------------------------------------------------- write notifications: mark_update
# Every write is reported once, through TorchRL's write hook: the writer calls ``mark_update``
# on every entity attached to the storage (``storage.attach``): the buffers, which tell their
# samplers, and the sample units' listeners. Whichever buffer writes, every index reading the
# storage reads the new rows alone.
NO_UNITS = pytest.mark.skipif(
    not compat.HAS_SAMPLE_UNITS, reason=f"TorchRL {compat.TORCHRL_VERSION} has no sample units"
)


def _count_rebuilds(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """From now on, one entry per full read of a storage by any index (``IndexSync._rebuild``)."""
    rebuilds: list[int] = []
    rebuild = IndexSync._rebuild

    def counting(self: Any, *args: Any) -> None:
        rebuilds.append(1)
        rebuild(self, *args)

    monkeypatch.setattr(IndexSync, "_rebuild", counting)
    return rebuilds


def _slice_sampler(module: Any, name: str, capacity: int) -> Any:
    if name == "PrioritizedSliceSampler":
        return getattr(module, name)(capacity, 0.7, 0.5, num_slices=2, traj_key="traj")
    return getattr(module, name)(num_slices=2, traj_key="traj")


def _same_samples(ours: Any, reference: Any, seed: int) -> None:
    """The same sample (or error: a sampler without replacement runs out) for ``seed``."""
    torch.manual_seed(seed)
    got = _outcome(ours.sample)
    torch.manual_seed(seed)
    want = _outcome(reference.sample)
    if isinstance(want, Exception):
        assert (type(got), str(got)) == (type(want), str(want))
    else:
        _assert_same(want.to_dict(), got.to_dict())


def _listeners(storage: Any) -> list[Any]:
    return [e for e in compat.attached_entities(storage) if isinstance(e, BoundaryListener)]


@_SHORT  # slices without replacement may come back short (the nightly warns)
@BUFFERS
@pytest.mark.parametrize("name", SLICE_CLASSES)
def test_writes_through_another_buffer_are_read_incrementally(
    buffer_side: str, name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Buffer A writes, buffer B's slice sampler samples the same storage.

    B is attached to the storage, so A's writer tells it of every write (``mark_update``):
    B's index reads each write's rows alone, never the whole storage, and B samples what
    TorchRL's sampler samples there for the same seed.
    """
    rebuilds = _count_rebuilds(monkeypatch)
    storage = trl.LazyTensorStorage(60)
    writer = make_buffer(buffer_side, "TensorDictReplayBuffer", storage=storage, batch_size=8)
    sampler = _slice_sampler(fastreplay, name, 60)
    reader = make_buffer(
        buffer_side, "TensorDictReplayBuffer", storage=storage, sampler=sampler, batch_size=8
    )
    reference = trl.TensorDictReplayBuffer(
        storage=storage, sampler=_slice_sampler(trl, name, 60), batch_size=8
    )
    # TorchRL 0.13's SliceSamplerWithoutReplacement, in a buffer that did not write, does not
    # see the other buffer's writes (0.13's storages count no writes; only the writing
    # buffer's sampler hears ``extend``): there the slices are checked against the data.
    compare = compat.STORAGE_HAS_REVISION or name == "SliceSampler"
    writer.extend(episodes(25, [4, 7, 3]))
    for step in range(6):  # the fourth write wraps around the storage
        if step:
            writer.extend(episodes(13, [5, 2, 6], first_id=100 * step))
        if compare:
            _same_samples(reader, reference, seed=step)
        else:
            sample = _outcome(reader.sample)
            if not isinstance(sample, Exception):
                assert_slices_valid(sample["obs"], 2)
        assert sampler._fr_index is not None
    assert not rebuilds  # every write of A was read alone, the first one included


@_SHORT  # slices without replacement may come back short (the nightly warns)
@BUFFERS
@pytest.mark.parametrize("name", [*SLICE_CLASSES, "PrioritizedSliceSampler"])
@pytest.mark.parametrize("ndim", [1, 2])
def test_each_write_is_reported_once(
    buffer_side: str, name: str, ndim: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``extend`` and ``add`` report each write once (``mark_update``; ``extend``/``add`` of the
    sampler report nothing): N writes, then a sample, read the new rows alone."""
    rebuilds = _count_rebuilds(monkeypatch)
    storage = trl.LazyTensorStorage(60, ndim=ndim)
    sampler = _slice_sampler(fastreplay, name, 60)
    rb = make_buffer(
        buffer_side, "TensorDictReplayBuffer", storage=storage, sampler=sampler, batch_size=8
    )
    columns = 3 if ndim == 2 else None
    rb.extend(episodes(50 if ndim == 1 else 10, [4, 7, 3], columns=columns))
    _outcome(rb.sample)
    before = len(rebuilds)
    writes = 7
    # 1-D: adds between the extends. 7 writes wrap around the storage (60 rows; 20 rows of 3
    # columns), and write fewer rows than it holds (more would be read in one pass instead).
    for i in range(writes):
        if ndim == 1 and i % 2:
            rb.add(episodes(1, 1, first_id=1000 + i)[0])
        else:
            rb.extend(episodes(2, [3, 5], columns=columns, first_id=100 * (i + 1)))
    assert sampler._fr_sync._pending_writes == writes  # one report per write
    _outcome(rb.sample)
    assert len(rebuilds) == before
    assert _same_boundaries(sampler, storage)


@_SHORT  # slices without replacement may come back short (the nightly warns)
@pytest.mark.parametrize("name", SLICE_CLASSES)
def test_a_sampler_told_by_hand_samples_as_torchrl(name: str) -> None:
    """No buffer: ``storage.set`` then ``sampler.extend(index)`` by hand, as TorchRL's tests do.

    ``extend`` reports nothing (the writers report through ``mark_update``): the index sees
    the write from the storage (its write count, the version counters) and rereads it.
    """
    storage = trl.LazyTensorStorage(40)
    ours, theirs = _slice_sampler(fastreplay, name, 40), _slice_sampler(trl, name, 40)
    cursor = 0
    for step, n in enumerate([15, 12, 20, 6]):  # the third write wraps around the storage
        index = (torch.arange(n) + cursor) % 40
        storage.set(index, episodes(n, [4, 7, 3], first_id=100 * step))
        cursor = (cursor + n) % 40
        ours.extend(index)
        theirs.extend(index)
        torch.manual_seed(step)
        got = _outcome(ours.sample, storage, 8)
        torch.manual_seed(step)
        want = _outcome(theirs.sample, storage, 8)
        if isinstance(want, Exception):
            assert (type(got), str(got)) == (type(want), str(want))
        else:
            _assert_same(want, got)


@NO_UNITS
@BUFFERS
def test_sequence_index_is_fed_by_torchrl_s_buffer_writes(buffer_side: str) -> None:
    """TorchRL's own buffer writes; a buffer with fastreplay's ``Sequence`` samples.

    The unit's index is told of each write by the listener attached to the storage (the
    writer calls its ``mark_update``): one full read (the first ``expand``, made after the
    first write), then each write's rows alone; samples are TorchRL's for the same seed.
    """
    storage = trl.LazyTensorStorage(60)
    writer = trl.TensorDictReplayBuffer(storage=storage, batch_size=8)
    reader = make_buffer(
        buffer_side,
        "TensorDictReplayBuffer",
        storage=storage,
        batch_size=6,
        sample_unit=fastreplay.Sequence(length=3, burn_in=1),
    )
    reference = trl.TensorDictReplayBuffer(
        storage=storage, batch_size=6, sample_unit=trl.replay_buffers.Sequence(length=3, burn_in=1)
    )
    writer.extend(episodes(25, [4, 7, 3]))
    for step in range(6):  # the fourth write wraps around the storage
        if step:
            writer.extend(episodes(13, [5, 2, 6], first_id=100 * step))
        _same_samples(reader, reference, seed=step)
    assert sample_units.rebuilds(storage, DONE) == 1
    assert len(_listeners(storage)) == 1


def _same_windows(storage: Any) -> None:
    anchors = torch.arange(0, len(storage), 3)
    got = fastreplay.Sequence(length=4, burn_in=1).expand(anchors, {}, storage)
    want = trl.replay_buffers.Sequence(length=4, burn_in=1).expand(anchors, {}, storage)
    _assert_same(want, got)


@NO_UNITS
@BUFFERS
def test_a_write_at_given_rows_rereads_the_unit_index(buffer_side: str) -> None:
    """``rb[idx] = td`` is no writer's write (nothing is reported): the storage's write count
    and the done flags' version counter move, and the index rereads the storage once."""
    storage = trl.LazyTensorStorage(60)
    rb = make_buffer(
        buffer_side,
        "TensorDictReplayBuffer",
        storage=storage,
        batch_size=6,
        sample_unit=fastreplay.Sequence(length=3, burn_in=1),
    )
    rb.extend(episodes(40, [4, 7, 3]))
    rb.sample()
    count = sample_units.rebuilds(storage, DONE)
    rb[torch.arange(10, 16)] = episodes(6, 2, first_id=900)
    _same_windows(storage)
    assert sample_units.rebuilds(storage, DONE) == count + 1
    rb.extend(episodes(5, 5, first_id=950))  # reported: read alone
    _same_windows(storage)
    assert sample_units.rebuilds(storage, DONE) == count + 1


@NO_UNITS
def test_a_storage_pickles_with_its_listener() -> None:
    """A storage pickles what is attached to it: its listener comes back empty (its indices
    rebuild from the copy), is no buffer to ``round_robin_cursors``, and keeps nothing alive."""
    storage = trl.LazyTensorStorage(60)
    rb = fastreplay.TensorDictReplayBuffer(
        storage=storage, batch_size=6, sample_unit=fastreplay.Sequence(length=3)
    )
    rb.extend(episodes(40, [4, 7, 3]))
    rb.sample()
    (listener,) = _listeners(storage)
    assert set(listener.entries) == {DONE}
    assert compat.round_robin_cursors(storage) == {40}
    assert not pickle.loads(pickle.dumps(listener)).entries
    copy = pickle.loads(pickle.dumps(storage))
    (copied,) = _listeners(copy)
    assert not copied.entries
    _same_windows(copy)
    assert sample_units.rebuilds(copy, DONE) == 1
    copy.set(torch.arange(40, 45), episodes(5, 5, first_id=950))  # unreported: reread
    _same_windows(copy)
    ref = weakref.ref(storage)
    del storage, rb, listener
    gc.collect()
    assert ref() is None

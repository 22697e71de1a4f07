"""The one module that knows which TorchRL is installed.

fastreplay supports TorchRL 0.13.x, 0.14.x and the next release (``torchrl-nightly``) from one
code base. Every other module imports TorchRL's classes and private helpers from here, and
every behaviour that differs between those versions has one name here (a constant or a
function), read where it matters. Each is detected from the installed code itself (an
argument, an attribute, a method), never from a version number: the nightly's
``torchrl.__version__`` is a date.

What differs, for what fastreplay subclasses or calls (``0.13`` = 0.13.3, ``0.14`` = 0.14.1,
``nightly`` = torchrl-nightly 2026.10.27):

* **Module layout.** 0.13 keeps every sampler in one module, ``torchrl.data.replay_buffers.
  samplers``; 0.14 and the nightly split it into a package (``samplers.base``,
  ``samplers.slice``...). The package re-exports what fastreplay needs
  (``_REPLACEMENT_DISPATCH`` included), so everything is imported from
  ``torchrl.data.replay_buffers.samplers`` here, which both layouts provide.
* **SliceSampler's constructor** (:data:`SLICE_SAMPLER_ARGS`): 0.14 added ``end_keys``,
  ``step_key``, ``fragmented`` and ``init_key``; the nightly added ``output_layout``,
  ``slice_end_key`` and ``time_dim_name`` (also on ``SliceSamplerWithoutReplacement``).
  fastreplay's samplers forward their keyword arguments to TorchRL's and read their
  signature from it, so each version's arguments are accepted, and shown, by themselves.
* **PrioritizedSliceSampler's constructor** (:data:`TORCHRL_PRIORITIZED_SLICE_KEYWORDS`):
  its keyword-only arguments, passed on to ``SliceSampler``; 0.13 has no ``end_keys``/
  ``init_key``, and no version has ``output_layout``.
* **The index-to-info hook** (:data:`HAS_FINALIZE_INDEX`): 0.14 and the nightly build the
  ``truncated``/``done``/``terminated`` info and the ``is_init`` markers in
  ``SliceSampler._finalize_index``; 0.13 does it inline at the end of ``_get_index``, with the
  marker key fixed to ``"is_init"``. fastreplay's slice samplers call :func:`finalize_index`,
  TorchRL's hook where it exists and 0.13's code otherwise, so they use one hook everywhere.
  The attributes of arguments older versions lack (``end_keys``, ``fragmented``,
  ``init_key``, ``output_layout``) are :data:`SLICE_ATTRIBUTE_DEFAULTS`.
* **The ``is_init`` marker key** (:func:`init_marker_key`): 0.14 and the nightly read the
  sampler's ``init_key`` at each ``sample`` (``None``: no markers); 0.13 has no ``init_key``
  and always marks ``"is_init"``, so an ``init_key`` assigned there changes nothing.
* **Cached boundaries after a key change** (:data:`KEY_CHANGE_KEEPS_CACHED_BOUNDARIES`): 0.14
  and the nightly cache the boundaries read from the storage under the key they were read from
  (``_find_start_stop_traj(..., source=...)``), so assigning ``end_key``/``traj_key`` reads the
  new key's. 0.13 caches them under one fixed key, and its ``SliceSamplerWithoutReplacement``
  always caches (``cache_values=True``): after such an assignment it keeps sampling the old
  boundaries until the next write. fastreplay's samplers rebuild their index on every version.
* **The static boundary cache** (:data:`STATIC_BOUNDARIES`): the key under which
  ``SliceSampler(ends=...)``/``(trajectories=...)`` keeps its boundaries in ``_cache``:
  ``"static-stop-and-length"`` on 0.14 and the nightly, ``"stop-and-length"`` on 0.13 (where
  ``cache_values=True`` also caches boundaries read from the storage under that key).
* **Storage revision** (:func:`mutation_revision`): 0.14 and the nightly count every write to
  a storage (``Storage._mutation_revision``, shared with spawned processes); 0.13 has no such
  counter. There the trajectory index trusts the writes the sampler is told about
  (``extend``/``add``/``empty``/checkpoint loads), as TorchRL 0.13's own
  ``cache_values=True`` does: writes it is not told about need
  ``SliceSampler.invalidate_boundaries()``.
* **Last written row** (:func:`last_cursor_row`): ``Storage._last_cursor_index`` (an int,
  shared with spawned processes) on 0.14 and the nightly; 0.13 keeps the raw cursor passed to
  ``set`` in ``_last_cursor``, per process (a learner does not see where writer processes
  are, so a trajectory being written there looks cut at the end of the storage).
* **Batch-time output** (:data:`OUTPUT_LAYOUTS`, :func:`pads_short_slices`): the nightly's
  ``SliceSampler(output_layout="batch_time")`` returns ``[num_slices, time]`` indices, pads
  short slices (``strict_length=False``) by repeating their last step, and returns
  ``slice_end_key``, ``("collector", "mask")`` (``strict_length=False`` only) and ``is_init``
  in ``info`` instead of the ``truncated``/``done``/``terminated`` flags; the buffer names
  the time dimension ``time_dim_name`` (``Sampler._set_sample_names``). Earlier versions
  only know the flat layout. ``PrioritizedSliceSampler`` has no ``output_layout`` on any
  version (the nightly's samples it flat).
* **Short flat batch warning** (:data:`WARNS_SHORT_FLAT_BATCH`): the nightly's
  ``SliceSampler``/``SliceSamplerWithoutReplacement`` warn once per sampler (``UserWarning``
  "SliceSampler returned a short flat batch: ...") when a flat ``sample`` returns fewer
  steps than asked for (``strict_length=False`` without ``pad_output``, a right ``span``,
  or short trajectories dropped without replacement); 0.13 and 0.14 do not warn.
  :func:`warn_if_short_batch` is fastreplay's samplers' ``_warn_if_short_batch`` on every
  version (a no-op where TorchRL has none), and their fast paths call it where TorchRL does.
* **The left-span warning** (:func:`warn_left_span_disabled`): ``PrioritizedSliceSampler(span=
  True)`` turns left spanning off and warns, from TorchRL's own module (``samplers`` on 0.13,
  ``samplers.prioritized_slice`` on 0.14 and the nightly). fastreplay's sampler emits the
  same text and category through ``warnings.warn_explicit``, attributed to the line of the
  installed ``__init__`` that warns (found in its bytecode), its module and once-registry.
* **Sampler attributes**: the nightly's ``Sampler.requires_shared_state`` (``False`` for
  ``SliceSampler``, ``True`` for the without-replacement and prioritized ones) is inherited
  as it is.
* **PrioritizedSampler.alpha** (:data:`ALPHA_CHANGE_RETRANSFORMS`): setting ``alpha`` on a
  sampler holding priorities re-transforms the stored ``(p + eps) ** alpha`` values on 0.14
  and the nightly; 0.13 keeps them and warns once ("Changing alpha on a PrioritizedSampler
  ...") when ``max_priority_within_buffer=True``.
* **Boundary recovery** (:func:`find_start_stop_traj`): TorchRL's one-shot recovery of
  trajectory boundaries is the public ``torchrl.data.find_start_stop_traj`` from 0.14 on,
  the ``SliceSampler._find_start_stop_traj`` method on 0.13 (the same results).
* **Ray runtime** (:func:`ray_runtime_lease`): from 0.14 on, TorchRL counts its holds on the
  Ray runtime (``torchrl._comm.ray_runtime._RayRuntimeLease``); 0.13 has no such count.
* **Sampler.can_sample** (:data:`HAS_CAN_SAMPLE`): 0.14 added ``Sampler.can_sample(storage,
  batch_size)`` (and ``ReplayBuffer.can_sample``); 0.13 has neither. fastreplay's samplers
  inherit it where TorchRL has it.
* **StreamingSliceSampler** (:data:`HAS_STREAMING_SLICE`): 0.14 added it (the nightly's
  also says ``requires_shared_state = True``); 0.13 has none, so neither has fastreplay there.
  ``HERReplayBuffer`` is the same on all three (:data:`TorchRLHERReplayBuffer`; its
  ``_resolve_cursor``, :func:`her_cursor`, reads the storage's last cursor as it does).
* **Consuming samplers** (:func:`is_consuming`, :data:`CONSUMING_SAMPLERS`): 0.14 added
  ``ConsumingSampler`` and
  ``ReplayBuffer._is_consuming()``; 0.13 has neither (no buffer consumes).
* **Buffer life cycle** (:data:`CHECKPOINTS_KEEP_PREFETCHED`): 0.14 added
  ``ReplayBuffer.shutdown()``/``synchronize()`` and checkpoints (``state_dict``, ``dumps``,
  pickling) that carry the prefetched samples; 0.13 has none of them (its checkpoints drop the
  prefetch queue).
* **Direct buffer path** (:mod:`fastreplay.buffers.paths`): it updates the counters TorchRL
  0.14 and the nightly keep for a write (writer cursor and count, storage length, last
  cursor, mutation revision); where one is missing (0.13 has no mutation revision,
  :data:`STORAGE_HAS_REVISION`), every write and sample takes TorchRL's own path.
* **Replay buffers**: the nightly's ``TensorDictReplayBuffer.sample`` takes ``wait``,
  ``timeout`` and ``cancel_event`` keywords (:data:`SAMPLE_KEYWORDS`), which fastreplay's
  buffers honour on the direct path too.
* **Sample units** (:data:`HAS_SAMPLE_UNITS`, :func:`episode_boundaries_expand`): 0.14 and
  the nightly have ``torchrl.data.replay_buffers.sample_units`` (``Sequence``; the nightly
  adds ``SubgoalTriplet``); 0.13 has no sample units. The nightly reads a unit's episode
  boundaries through the static method ``SampleUnit._episode_boundaries(storage, done_key,
  device)``; 0.14 builds the same object inline in ``Sequence.expand``, which fastreplay runs
  unmodified where its own expansion does not apply. :func:`torchrl_episode_boundaries`
  builds TorchRL's object on both. :func:`is_torchrl_function` tells TorchRL's own
  ``Sequence.expand`` from one a user patched in (then run as it is).
* **Buffer bookkeeping** (:class:`Bookkeeping`): what TorchRL's buffer methods do besides
  moving data, which fastreplay's direct buffer path does at the same points through this one
  class: the nightly's readiness notification after every write
  (``ReplayBuffer._notify_replay_state_change``, which wakes ``sample(wait=True)`` and
  ``wait_until_sampleable``), its per-buffer sample counters (``sample_calls`` and
  ``samples_returned`` of ``stats()``, saved in checkpoints), the sampler's names for the
  sample's dimensions (``Sampler._set_sample_names``: ``time_dim_name`` for ``batch_time``
  samples). 0.13 and 0.14 have none of them. A sampler's warning that TorchRL emits with a
  ``stacklevel`` pointing at the caller of ``sample`` (:func:`warn_at_sample_caller`) is
  attributed, on fastreplay's direct path, to the line of TorchRL's buffer that calls the
  sampler, as there. ``tests/conformance/test_bookkeeping.py`` traces which TorchRL functions
  each buffer call runs on both paths, on every version, so a bookkeeping step a new TorchRL
  adds cannot be skipped unnoticed.
"""

from __future__ import annotations

import dis
import functools
import inspect
import sys
import warnings
from collections.abc import Callable
from multiprocessing.sharedctypes import Synchronized as _Synchronized  # TorchRL's counters
from typing import Any

import numpy as np
import torch
import torchrl
from torchrl._utils import _replace_last as _replace_last
from torchrl.data import PrioritizedSliceSampler as TorchRLPrioritizedSliceSampler
from torchrl.data import SliceSamplerWithoutReplacement as TorchRLSliceSamplerWithoutReplacement
from torchrl.data import TensorDictPrioritizedReplayBuffer as TorchRLPrioritizedBuffer
from torchrl.data import TensorDictReplayBuffer as TorchRLBuffer
from torchrl.data.replay_buffers import RandomSampler
from torchrl.data.replay_buffers import ReplayBuffer as TorchRLReplayBuffer
from torchrl.data.replay_buffers import samplers as _samplers
from torchrl.data.replay_buffers.her import HERReplayBuffer as TorchRLHERReplayBuffer
from torchrl.data.replay_buffers.her import _resolve_cursor as her_cursor
from torchrl.data.replay_buffers.ray_buffer import RayReplayBuffer as TorchRLRayReplayBuffer
from torchrl.data.replay_buffers.replay_buffers import _storage_index as _storage_index
from torchrl.data.replay_buffers.samplers import _REPLACEMENT_DISPATCH as _REPLACEMENT_DISPATCH
from torchrl.data.replay_buffers.samplers import PrioritizedSampler as TorchRLPrioritizedSampler
from torchrl.data.replay_buffers.samplers import Sampler
from torchrl.data.replay_buffers.samplers import SliceSampler as TorchRLSliceSampler
from torchrl.data.replay_buffers.samplers import (
    StalenessAwareSampler as TorchRLStalenessAwareSampler,
)
from torchrl.data.replay_buffers.storages import (
    LazyMemmapStorage,
    LazyTensorStorage,
    Storage,
    TensorStorage,
)
from torchrl.data.replay_buffers.storages import _collate_id as _collate_id
from torchrl.data.replay_buffers.utils import INT_CLASSES
from torchrl.data.replay_buffers.writers import RoundRobinWriter, TensorDictRoundRobinWriter

# What the rest of fastreplay uses; TorchRL's private names it uses are re-exported as `x as x`.
__all__ = [
    "TENSOR_STORAGES",
    "LAZY_TENSOR_STORAGES",
    "plain_rows",
    "register_tensor_storages",
    "storage_slots",
    "storage_len",
    "ALPHA_CHANGE_RETRANSFORMS",
    "PRIORITIZED_SLICE_ARGS",
    "TORCHRL_PRIORITIZED_SLICE_KEYWORDS",
    "SHORT_FLAT_BATCH_MESSAGE",
    "STORAGE_HAS_REVISION",
    "CHECKPOINTS_KEEP_PREFETCHED",
    "HAS_CAN_SAMPLE",
    "HAS_STREAMING_SLICE",
    "TorchRLHERReplayBuffer",
    "TorchRLStreamingSliceSampler",
    "her_cursor",
    "HAS_FINALIZE_INDEX",
    "KEY_CHANGE_KEEPS_CACHED_BOUNDARIES",
    "OUTPUT_LAYOUTS",
    "SLICE_SAMPLER_ARGS",
    "STATIC_BOUNDARIES",
    "TORCHRL_VERSION",
    "WARNS_SHORT_FLAT_BATCH",
    "RandomSampler",
    "RoundRobinWriter",
    "Sampler",
    "Storage",
    "TensorDictRoundRobinWriter",
    "TensorStorage",
    "TorchRLBuffer",
    "TorchRLPrioritizedBuffer",
    "TorchRLPrioritizedSampler",
    "TorchRLPrioritizedSliceSampler",
    "TorchRLRayReplayBuffer",
    "TorchRLReplayBuffer",
    "TorchRLSliceSampler",
    "TorchRLSliceSamplerWithoutReplacement",
    "TorchRLStalenessAwareSampler",
    "CONSUMING_SAMPLERS",
    "INT_CLASSES",
    "LazyMemmapStorage",
    "LazyTensorStorage",
    "find_start_stop_traj",
    "init_marker_key",
    "is_batch_time",
    "Bookkeeping",
    "SAMPLE_KEYWORDS",
    "is_consuming",
    "last_cursor_row",
    "mutation_revision",
    "pads_short_slices",
    "ray_runtime_lease",
    "warn_left_span_disabled",
    "HAS_SAMPLE_UNITS",
    "HAS_EPISODE_BOUNDARIES",
    "TorchRLSampleUnit",
    "TorchRLSequence",
    "TorchRLSubgoalTriplet",
    "TorchRLTransition",
    "ReplayBoundaryIndex",
    "torchrl_episode_boundaries",
    "is_torchrl_function",
    "warn_at_sample_caller",
    "take",
    "truncation_flags",
]

TORCHRL_VERSION: str = torchrl.__version__
"""The installed TorchRL's version string (for messages; a date on the nightly)."""

CONSUMING_SAMPLERS: tuple[type, ...] = tuple(
    cls for cls in (getattr(_samplers, "ConsumingSampler", None),) if cls is not None
)
"""Samplers that remove what they return from the storage (``ConsumingSampler``, 0.14+)."""


def _init_args(cls: type) -> frozenset[str]:
    init = cls.__init__  # type: ignore[misc]  # the class's, not an instance's
    params = list(inspect.signature(init).parameters.values())[1:]  # not ``self``
    return frozenset(p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD))


SLICE_SAMPLER_ARGS: frozenset[str] = _init_args(TorchRLSliceSampler)
"""``torchrl.data.SliceSampler``'s constructor arguments on the installed version.

0.13: no ``end_keys``/``step_key``/``fragmented``/``init_key``; 0.14 adds them; the nightly
adds ``output_layout``/``slice_end_key``/``time_dim_name``.
"""

TORCHRL_PRIORITIZED_SLICE_KEYWORDS: tuple[inspect.Parameter, ...] = tuple(
    p
    for p in inspect.signature(TorchRLPrioritizedSliceSampler.__init__).parameters.values()
    if p.kind is p.KEYWORD_ONLY
)
"""``torchrl.data.PrioritizedSliceSampler``'s keyword-only arguments, in its order: those it
passes on to ``SliceSampler`` (0.13: no ``end_keys``/``init_key``; 0.14 and the nightly add
them, and no ``output_layout``), then ``max_priority_within_buffer``."""

PRIORITIZED_SLICE_ARGS: frozenset[str] = frozenset(
    p.name for p in TORCHRL_PRIORITIZED_SLICE_KEYWORDS if p.name != "max_priority_within_buffer"
)
"""The names of those it passes on to ``SliceSampler``."""

OUTPUT_LAYOUTS: tuple[str, ...] = (
    ("flat", "batch_time") if "output_layout" in SLICE_SAMPLER_ARGS else ("flat",)
)
"""The ``output_layout`` values ``SliceSampler`` takes: ``("flat", "batch_time")`` on the
nightly; 0.13 and 0.14 have no ``output_layout`` argument (always flat)."""

HAS_FINALIZE_INDEX: bool = hasattr(TorchRLSliceSampler, "_finalize_index")
"""Whether TorchRL's ``SliceSampler`` has the ``_finalize_index`` hook (0.14, nightly); 0.13
builds the info inline in ``_get_index``."""

KEY_CHANGE_KEEPS_CACHED_BOUNDARIES: bool = (
    "source" not in inspect.signature(TorchRLSliceSampler._find_start_stop_traj).parameters
)
"""Whether TorchRL's cached storage boundaries outlive an ``end_key``/``traj_key`` assignment:
0.13 caches them under one key (its ``SliceSamplerWithoutReplacement`` always), so it keeps
sampling the old trajectories; 0.14 and the nightly cache them per source key."""

STATIC_BOUNDARIES: str = "static-stop-and-length" if HAS_FINALIZE_INDEX else "stop-and-length"
"""``SliceSampler._cache`` key of the boundaries given by ``ends=``/``trajectories=``:
``"static-stop-and-length"`` on 0.14 and the nightly, ``"stop-and-length"`` on 0.13."""

WARNS_SHORT_FLAT_BATCH: bool = hasattr(TorchRLSliceSampler, "_warn_if_short_batch")
"""Whether TorchRL's slice samplers warn ("SliceSampler returned a short flat batch") when a
flat sample is shorter than asked for: the nightly does, once per sampler; 0.13/0.14 do not."""

SHORT_FLAT_BATCH_MESSAGE = "SliceSampler returned a short flat batch"
"""The start of that warning's message (for ``filterwarnings``)."""

ALPHA_CHANGE_RETRANSFORMS: bool = hasattr(TorchRLPrioritizedSampler, "_retransform_priority_trees")
"""Whether TorchRL's ``PrioritizedSampler`` re-transforms stored priorities when ``alpha``
changes (0.14, nightly). 0.13 keeps them and warns once instead."""


CHECKPOINTS_KEEP_PREFETCHED: bool = hasattr(TorchRLReplayBuffer, "_capture_prefetch_state")
"""Whether buffer checkpoints carry the prefetched samples (0.14, nightly); 0.13's do not."""

HAS_CAN_SAMPLE: bool = hasattr(Sampler, "can_sample")
"""Whether TorchRL's samplers have ``can_sample`` (0.14, nightly); 0.13's do not."""

TorchRLStreamingSliceSampler: Any = getattr(_samplers, "StreamingSliceSampler", None)
"""TorchRL's ``StreamingSliceSampler`` (0.14, nightly), or ``None`` (0.13 has none)."""

HAS_STREAMING_SLICE: bool = TorchRLStreamingSliceSampler is not None
"""Whether TorchRL has ``StreamingSliceSampler`` (0.14, nightly); 0.13 does not."""


STORAGE_HAS_REVISION: bool = hasattr(Storage, "_mutation_revision")
"""Whether storages count their writes (0.14, nightly), so that a sampler sees writes it was
not told about (another buffer, ``rb[idx] = ...``, another process); 0.13's do not. fastreplay's
direct buffer path keeps that counter, so it runs only where it exists."""


def mutation_revision(storage: Any, assumed: int) -> int:
    """The storage's write counter (``Storage._mutation_revision``). O(1).

    Args:
        storage: A TorchRL storage.
        assumed: The value to return where the storage keeps no counter (TorchRL 0.13): the
            revision the caller expects if every write was reported to it.

    Returns:
        The counter on TorchRL 0.14 and the nightly, ``assumed`` on 0.13.
    """
    if STORAGE_HAS_REVISION:
        return storage._mutation_revision
    return assumed


TENSOR_STORAGES = (TensorStorage, LazyTensorStorage, LazyMemmapStorage)
"""TorchRL's tensor storage classes (exact types: a subclass may change what they do)."""


def storage_len(storage: Any) -> int:
    """``len(storage)``, read straight from a tensor storage's counter. O(1).

    TorchRL's ``TensorStorage.__len__`` (0.13, 0.14 and the nightly alike) returns its
    ``_len`` property, the value of the ``_len_value`` counter, from behind a
    ``torch.compiler.disable`` wrapper that costs more than the read. For these three exact
    classes with their counter in place this reads the same value under the same lock;
    anything else (a subclass, another storage, a counter not yet made) is ``len(storage)``.
    """
    if type(storage) in TENSOR_STORAGES:
        counter = storage.__dict__.get("_len_value")
        if type(counter) is _Synchronized:
            return counter.value
    return len(storage)


def storage_slots(storage: Any) -> int | None:
    """Slots the storage's tensors hold (rows of every dimension it writes), or ``None``. O(1).

    An ``ndim > 1`` storage rounds its size up to a multiple of the other dimensions when its
    tensors are made, and says so through ``max_size``; a storage that loaded a state dict
    instead keeps the ``max_size`` it was built with, so ``len`` stops below its slots while
    the writer keeps writing all of them. ``None`` before the tensors exist or for storages
    that hold no tensor collection or tensor.
    """
    if not storage.__dict__.get("initialized", False):
        return None
    store = storage.__dict__.get("_storage")
    shape = getattr(store, "batch_size", None)
    if shape is None:
        shape = getattr(store, "shape", None)
    ndim = storage.__dict__.get("ndim", 1)
    if shape is None or len(shape) < ndim:
        return None
    return int(torch.Size(shape[:ndim]).numel())


def last_cursor_row(storage: Any) -> int | None:
    """The time row of the storage's last write, or ``None``. O(1).

    TorchRL 0.14 and the nightly keep it as ``_last_cursor_index``; 0.13 keeps the cursor as
    passed to ``set`` (an int, a tensor, a range, a tuple of them) in ``_last_cursor``.
    """
    if STORAGE_HAS_REVISION:
        return storage._last_cursor_index
    cursor = getattr(storage, "_last_cursor", None)
    if isinstance(cursor, (tuple, list)):
        cursor = cursor[0] if cursor else None
    if isinstance(cursor, torch.Tensor):
        cursor = cursor.reshape(-1)
        return int(cursor[-1]) if cursor.numel() else None
    if isinstance(cursor, range):
        return cursor[-1] if len(cursor) else None
    if isinstance(cursor, slice):
        rows = range(*cursor.indices(storage.max_size))
        return rows[-1] if len(rows) else None
    return None if cursor is None else int(cursor)


def find_start_stop_traj(
    *,
    trajectory: torch.Tensor | None = None,
    end: torch.Tensor | None = None,
    at_capacity: bool,
    cursor: Any = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """TorchRL's ``(start, stop, length)`` of the trajectories in ``trajectory`` or ``end``.

    ``torchrl.data.find_start_stop_traj`` where it exists (0.14+), else (0.13) TorchRL's
    ``SliceSampler._find_start_stop_traj``. O(rows).
    """
    try:
        from torchrl.data import find_start_stop_traj as find
    except ImportError:  # TorchRL 0.13
        find = TorchRLSliceSampler(num_slices=1)._find_start_stop_traj
    return find(trajectory=trajectory, end=end, at_capacity=at_capacity, cursor=cursor)


def init_marker_key(sampler: Any) -> Any:
    """The key of the ``is_init`` markers ``sampler``'s samples carry, or ``None``. O(1).

    ``sampler.init_key`` where TorchRL's ``SliceSampler`` takes ``init_key`` (0.14, nightly);
    ``"is_init"`` on 0.13, which always marks that key (an assigned ``init_key`` is ignored
    there, as by TorchRL 0.13).
    """
    return sampler.init_key if "init_key" in SLICE_SAMPLER_ARGS else "is_init"


def ray_runtime_lease() -> Any:
    """TorchRL's counter of holds on the Ray runtime (0.14+), or ``None`` (0.13)."""
    try:
        from torchrl._comm.ray_runtime import _RayRuntimeLease
    except ImportError:
        return None
    return _RayRuntimeLease


def is_consuming(buffer: Any) -> bool:
    """Whether ``buffer`` consumes what it samples (``ReplayBuffer._is_consuming()``, 0.14+).

    TorchRL 0.13 has no consuming sampler: ``False`` there. O(1).
    """
    method = getattr(buffer, "_is_consuming", None)
    return bool(method()) if method is not None else False


def is_batch_time(sampler: Any) -> bool:
    """Whether ``sampler`` returns ``[num_slices, time]`` samples (nightly's ``batch_time``)."""
    return getattr(sampler, "output_layout", "flat") == "batch_time"


def pads_short_slices(sampler: Any) -> bool:
    """Whether ``sampler`` pads short slices (``strict_length=False``) to the slice length.

    ``pad_output=True`` on every version, and ``output_layout="batch_time"`` on the nightly.
    """
    return bool(getattr(sampler, "pad_output", False)) or is_batch_time(sampler)


# ------------------------------------------------------------------ accessors: storages
# What fastreplay's storage classes (``fastreplay.storages``) read of TorchRL's storages.

LAZY_TENSOR_STORAGES: tuple[type, ...] = (LazyTensorStorage,)
"""``LazyTensorStorage`` and fastreplay's subclass of it (exact types; huge pages advised)."""

_GATHER_DTYPES = (torch.long, torch.int)


def register_tensor_storages(*classes: type, lazy: tuple[type, ...] = ()) -> None:
    """Add fastreplay's storage classes to :data:`TENSOR_STORAGES`. O(1), once at import.

    fastreplay's ``TensorStorage``, ``LazyTensorStorage`` and ``LazyMemmapStorage`` change
    only how ``get`` reads (the same output), so the buffers' direct path, which writes and
    reads the storage's TensorDict itself, takes them as it takes TorchRL's.

    Args:
        classes: The storage classes to add.
        lazy: Those of them that allocate as ``LazyTensorStorage`` does
            (:data:`LAZY_TENSOR_STORAGES`).
    """
    global TENSOR_STORAGES, LAZY_TENSOR_STORAGES
    TENSOR_STORAGES = TENSOR_STORAGES + tuple(c for c in classes if c not in TENSOR_STORAGES)
    LAZY_TENSOR_STORAGES = LAZY_TENSOR_STORAGES + tuple(
        c for c in lazy if c not in LAZY_TENSOR_STORAGES
    )


def plain_rows(storage: Any, index: Any) -> tuple[TensorDict, int] | None:
    """``(the storage's TensorDict, rows TorchRL's get reads)`` for a plain read, else None.

    Plain: the storage is initialised, 1-D (``ndim == 1``), not being traced by
    ``torch.compile`` (a compilable storage read eagerly gives the same rows either way), and
    holds exactly a ``TensorDict`` without dimension names (:func:`td_parts`); ``index`` is a
    1-D ``int64`` or ``int32`` tensor on the CPU. The rows are what ``TensorStorage.get``
    slices before indexing: all of them when the storage is full (``_is_full``:
    ``len == max_size``), else ``len``. Reads ``initialized``, ``ndim``, ``_storage``,
    ``max_size`` and the ``_len_value`` counter (:func:`storage_len`) from the instance's
    ``__dict__``. O(1).

    Checked on TorchRL 0.13.3, 0.14.1 and the nightly 2026.10.27 (the same ``get``).
    """
    if (
        type(index) is not torch.Tensor
        or index.ndim != 1
        or index.dtype not in _GATHER_DTYPES
        or not index.is_cpu
    ):
        return None
    state = storage.__dict__
    store = state.get("_storage")
    if (
        type(store) is not TensorDict
        or not state.get("initialized", False)
        or state.get("ndim") != 1
        or _is_compiling()
    ):
        return None
    _, size, _, names = td_parts(store)
    if names is not None:
        return None
    length = storage_len(storage)
    if length == state.get("max_size"):
        return store, size[0] if size else 0
    return store, length


_is_compiling = torch.compiler.is_compiling


# ------------------------------------------------------------------ accessors: priority samplers
# What fastreplay's PrioritizedSampler and PrioritizedSliceSampler read of TorchRL's internals.


def tree_device_from_storage(sampler: Any, storage: Any) -> torch.device | None:
    """The device TorchRL's ``PrioritizedSampler`` puts its trees on for ``storage``. O(1).

    ``PrioritizedSampler._tree_device_from_storage``: the sampler's own ``_device`` where one
    was given, else a CUDA storage's device, else ``None`` (the trees stay where they are).
    The same code on TorchRL 0.13.3, 0.14.1 and the nightly 2026.10.27.
    """
    return sampler._tree_device_from_storage(storage)


def storage_rows(storage: Any) -> int:
    """Rows stored along the storage's first dimension (``TensorStorage._len_along_dim0``).

    ``len(storage)`` divided by the size of the other dimensions, rounded up, for an
    ``ndim > 1`` storage; 0 where TorchRL gives ``None`` (no data yet). O(1). Read the same
    on TorchRL 0.13.3, 0.14.1 and the nightly 2026.10.27.
    """
    return int(storage._len_along_dim0 or 0)


def _function(method: Any) -> Any:
    """The plain function under ``method``'s decorators (``__wrapped__``, or a closure cell)."""
    method = inspect.unwrap(method)
    for cell in method.__closure__ or ():  # a decorator without ``functools.wraps``
        inner = cell.cell_contents
        if inspect.isfunction(inner):
            method = inner
    return method


def _instructions(code: Any) -> list[tuple[int, Any]]:
    """``(line, instruction)`` for each instruction of ``code``, as its traceback shows it."""
    found = []
    line = code.co_firstlineno
    for instruction in dis.get_instructions(code):
        positions = getattr(instruction, "positions", None)  # Python 3.11+
        if positions is not None and positions.lineno is not None:
            line = positions.lineno
        elif type(instruction.starts_line) is int:  # (a bool from Python 3.13 on)
            line = instruction.starts_line  # Python 3.10
        found.append((line, instruction))
    return found


def _call_line(method: Any, owner: str, name: str) -> int | None:
    """The line of ``method`` that calls ``<...>.{owner}.{name}(...)``, from its bytecode.

    ``None`` if no instruction loads attribute ``name`` right after attribute ``owner``.
    O(instructions of ``method``), once.
    """
    previous = None
    for line, instruction in _instructions(method.__code__):
        loads_attribute = "ATTR" in instruction.opname or instruction.opname == "LOAD_METHOD"
        if loads_attribute and instruction.argval == name and previous == owner:
            return line
        previous = instruction.argval if loads_attribute else None
    return None


def _module_site(function: Any, line: int) -> tuple[str, int, str, dict[str, Any]]:
    """``(filename, line, module, globals)`` of ``function``'s module, for ``warn_explicit``."""
    return function.__code__.co_filename, line, function.__module__, function.__globals__


def _warn_at(site: tuple[str, int, str, dict[str, Any]], message: str, category: type) -> None:
    """``warnings.warn`` as if issued at ``site``: same filters, module and once-registry."""
    filename, line, module, module_globals = site
    warnings.warn_explicit(
        message,
        category,
        filename,
        line,
        module=module,
        registry=module_globals.setdefault("__warningregistry__", {}),
        module_globals=module_globals,
    )


LEFT_SPAN_MESSAGE = "Left spanning is disabled for "
"""The start of ``PrioritizedSliceSampler``'s warning when ``span`` asks for a left span."""


@functools.cache
def _left_span_site() -> tuple[str, int, str, dict[str, Any]]:
    """Where the installed ``PrioritizedSliceSampler.__init__`` issues its left-span warning.

    The line of the ``warn`` call whose message starts with :data:`LEFT_SPAN_MESSAGE`, read
    from ``__init__``'s bytecode (checked on 0.13.3, 0.14.1 and the nightly), else
    ``__init__``'s first line. O(instructions), once.
    """
    init = _function(TorchRLPrioritizedSliceSampler.__init__)
    line = init.__code__.co_firstlineno
    warn_line = None
    for at, instruction in _instructions(init.__code__):
        if instruction.argval == "warn":
            warn_line = at
        elif isinstance(instruction.argval, str) and instruction.argval.startswith(
            LEFT_SPAN_MESSAGE
        ):
            line = warn_line if warn_line is not None else at
            break
    return _module_site(init, line)


def warn_left_span_disabled(sampler: Any) -> None:
    """Emit TorchRL's "Left spanning is disabled" warning for ``sampler``, as TorchRL does.

    ``PrioritizedSliceSampler.__init__`` warns so when ``span`` asks for a left span, from
    its own module (``torchrl.data.replay_buffers.samplers`` on 0.13,
    ``...samplers.prioritized_slice`` on 0.14 and the nightly), with the sampler's class name
    in the text. The same text and category are emitted here with ``warnings.warn_explicit``,
    at that statement's file and line, with its module's name and once-registry
    (:func:`_left_span_site`), so ``filterwarnings(message=..., module=...)`` written for
    TorchRL's warning applies. O(1).
    """
    _warn_at(
        _left_span_site(),
        f"{LEFT_SPAN_MESSAGE}{type(sampler).__name__} and will be automatically turned off. "
        "If this feature is required, please file an issue on torchrl GitHub repo.",
        UserWarning,
    )


@functools.cache
def _sampler_call_site() -> tuple[str, int, str, dict[str, Any]]:
    """Where TorchRL's ``TensorDictReplayBuffer._sample`` calls ``self._sampler.sample``.

    Read from its bytecode (checked on 0.13.3, 0.14.1 and the nightly); its first line where
    that call is not found. O(instructions), once.
    """
    method = _function(TorchRLBuffer._sample)
    line = _call_line(method, "_sampler", "sample")
    return _module_site(method, method.__code__.co_firstlineno if line is None else line)


_SAMPLER_MODULES = ("fastreplay.samplers", _samplers.__name__)


def warn_at_sample_caller(message: str, category: type) -> None:
    """Warn as TorchRL's samplers do with a ``stacklevel`` naming the caller of ``sample``.

    The warning is attributed to the first frame outside the samplers' modules (fastreplay's
    and TorchRL's): the user's code or TorchRL's buffer, as with TorchRL's sampler. Where
    that frame is fastreplay's own (its direct buffer path calls the sampler in place of
    TorchRL's ``_sample``), to the line of TorchRL's ``_sample`` that calls the sampler, with
    its module and once-registry: ``filterwarnings(module="torchrl")`` applies, as there.
    O(stack depth), only when warning.
    """
    frame = sys._getframe(1)
    while frame is not None and frame.f_globals.get("__name__", "").startswith(_SAMPLER_MODULES):
        frame = frame.f_back
    if frame is None or frame.f_globals.get("__name__", "").startswith("fastreplay."):
        site = _sampler_call_site()
    else:
        site = (frame.f_code.co_filename, frame.f_lineno, frame.f_globals.get("__name__", ""),
                frame.f_globals)  # fmt: skip
    _warn_at(site, message, category)


def _short_batch_warning(requested: int, returned: int) -> str:
    """The nightly's ``SliceSampler`` short-batch warning text."""
    return (
        f"{SHORT_FLAT_BATCH_MESSAGE}: requested {requested} transitions but returned "
        f"{returned}. Use output_layout='batch_time' for padded, fixed-shape output or "
        "strict_length=True to sample only eligible trajectories."
    )


# ---------------------------------------------------------------------- accessors: slice samplers
# What fastreplay's slice samplers and their trajectory-index adapter read of TorchRL's internals.
__all__ += [
    "SLICE_ATTRIBUTE_DEFAULTS",
    "adjusted_batch_size",
    "attach_shared_storage",
    "attached_entities",
    "batch_size_multiplier",
    "finalize_index",
    "new_sample_list",
    "resolve_traj_key",
    "round_robin_cursors",
    "sampler_generator",
    "storage_rows",
    "tensor_version",
    "used_traj_key",
    "warn_if_short_batch",
]


def sampler_generator(sampler: Any) -> torch.Generator | None:
    """The sampler's random generator (``Sampler._rng``; ``None``: torch's default). O(1).

    Read at each draw, as TorchRL's samplers read it. Checked on 0.13.3, 0.14.1 and the nightly
    2026.10.27 (a class default of ``None``, set by ``set_rng``/the buffer's ``generator``).
    """
    return sampler._rng


def batch_size_multiplier(sampler: Any) -> int | None:
    """``SliceSampler._batch_size_multiplier``: the factor ``sample`` applies to the batch size.

    A class default of ``1``; ``None`` or another factor where something set it. Checked on
    0.13.3, 0.14.1 and the nightly 2026.10.27. O(1).
    """
    return sampler._batch_size_multiplier


def adjusted_batch_size(sampler: Any, batch_size: int) -> tuple[int, int]:
    """``SliceSampler._adjusted_batch_size(batch_size)``: ``(seq_length, num_slices)``.

    TorchRL's own computation and errors (a batch size not divisible by ``num_slices``/
    ``slice_len``). Checked on 0.14.1 and the nightly 2026.10.27 (called from ``can_sample``
    and ``_sampleable_count``, which 0.13.3 does not have; 0.13.3 has the same method). O(1).
    """
    return sampler._adjusted_batch_size(batch_size)


def used_traj_key(sampler: Any) -> Any:
    """The trajectory-id key a slice sampler reads (``SliceSampler._used_traj_key``). O(1).

    ``traj_key``, or the key found by ``_resolve_traj_key`` when ``traj_key`` was ``None``.
    Checked on 0.13.3, 0.14.1 and the nightly 2026.10.27 (a property over its ``__dict__``).
    """
    return sampler._used_traj_key


def resolve_traj_key(sampler: Any, storage: Any) -> None:
    """TorchRL's ``SliceSampler._resolve_traj_key(storage)``: pick the trajectory-id key.

    With ``traj_key=None``, TorchRL looks for ``("collector", "traj_ids")`` then ``"episode"``
    in the storage and records the outcome on the sampler (``_fetch_traj``,
    ``_used_traj_key``). Checked on 0.13.3, 0.14.1 and the nightly 2026.10.27. O(1).
    """
    sampler._resolve_traj_key(storage)


def new_sample_list(sampler: Any, storage: Any, count: int, batch_size: int) -> None:
    """``SamplerWithoutReplacement._get_sample_list``: a new epoch of ``count`` items.

    Draws TorchRL's permutation (``randperm`` on the sampler's generator, or ``arange`` with
    ``shuffle=False``) into ``_sample_list`` and sets ``_remaining_batches``, with the same
    random numbers as TorchRL. Checked on 0.13.3, 0.14.1 and the nightly 2026.10.27.
    O(count).
    """
    sampler._get_sample_list(storage, count, batch_size=batch_size)


def attach_shared_storage(storage: Any) -> None:
    """``TensorStorage._wait_for_init()``: attach to a memmap another process initialised.

    What ``storage.get()`` does first on a ``LazyMemmapStorage(shared_init=True)`` that worker
    processes filled; it blocks until the storage's files exist. Checked on 0.13.3, 0.14.1 and
    the nightly 2026.10.27. O(1) once attached.
    """
    storage._wait_for_init()


def attached_entities(storage: Any) -> list[Any]:
    """What is attached to ``storage`` (``storage.attach(obj)``): the list itself. O(1).

    TorchRL's writers call ``mark_update(index)`` on each after every write (the buffers
    using the storage, and any other object attached through the public ``Storage.attach``,
    such as fastreplay's sample-unit listeners). Reads ``Storage._attached_entities`` (a
    property that creates the list on first use); an empty list for an object that is no
    TorchRL storage. Checked on 0.13.3, 0.14.1 and the nightly 2026.10.27.
    """
    if not isinstance(storage, Storage):
        return []
    return storage._attached_entities


def round_robin_cursors(storage: Any) -> set[int]:
    """The cursors of the round-robin writers of the buffers attached to ``storage``. O(buffers).

    Reads the entities attached to the storage (:func:`attached_entities`: the buffers using
    it, and objects that are no buffers, skipped), each buffer's ``_writer`` and, for a
    ``RoundRobinWriter``, its ``_cursor`` (the next row to write). Checked on 0.13.3, 0.14.1
    and the nightly 2026.10.27.
    """
    return {
        int(writer._cursor)
        for buffer in attached_entities(storage)
        for writer in (getattr(buffer, "_writer", None),)
        if isinstance(writer, RoundRobinWriter)
    }


def tensor_version(tensor: torch.Tensor) -> int:
    """The version counter torch keeps for ``tensor`` (``Tensor._version``). O(1).

    Moved by one at every in-place write to the tensor or a view of it. Read by the slice
    samplers' index to see in-place writes nobody reported, on every TorchRL version
    (0.13.3, 0.14.1, nightly 2026.10.27 write each signal tensor once per ``set``).
    """
    return tensor._version


SLICE_ATTRIBUTE_DEFAULTS: dict[str, Any] = {
    name: value
    for name, value in (
        ("end_keys", None),
        ("fragmented", False),
        ("init_key", "is_init"),
        ("output_layout", "flat"),
    )
    if name not in SLICE_SAMPLER_ARGS
}
"""The newest ``SliceSampler``'s attributes that the installed one lacks, with its behaviour.

``end_keys`` (``None``), ``fragmented`` (``False``), ``init_key`` (``"is_init"``, which 0.13
always marks) and ``output_layout`` (``"flat"``): empty on the nightly, the last on 0.14.1, all
four on 0.13.3. fastreplay's slice samplers carry them as class attributes, so they read the
same on every version."""


def warn_if_short_batch(sampler: Any, index: Any, requested_size: int) -> None:
    """The nightly's short flat batch warning, once per sampler; nothing on 0.13/0.14.

    TorchRL's nightly ``SliceSampler._warn_if_short_batch`` warns (``UserWarning``) when a flat
    ``sample`` returns fewer steps than asked for, once per sampler (``_warned_short_batch``),
    with ``stacklevel=3``: at the caller of ``sample``. fastreplay's ``sample`` may run
    TorchRL's, so that caller is found past both (:func:`warn_at_sample_caller`). Checked on
    0.13.3 and 0.14.1 (no such warning) and the nightly 2026.10.27. O(1) unless warning.
    """
    if not WARNS_SHORT_FLAT_BATCH:
        return
    if sampler.output_layout != "flat" or sampler._warned_short_batch:
        return
    returned = index[0].numel() if isinstance(index, tuple) else index.numel()
    if returned < requested_size:
        sampler._warned_short_batch = True
        warn_at_sample_caller(_short_batch_warning(requested_size, returned), UserWarning)


def finalize_index(
    parent: Any,
    sampler: Any,
    *,
    index: torch.Tensor,
    num_slices: int,
    seq_length: int | torch.Tensor,
    target_seq_length: int | None,
    mask_flat: torch.Tensor | None,
    storage: Any,
) -> tuple[tuple[torch.Tensor, ...], dict[Any, Any]]:
    """TorchRL's ``SliceSampler._finalize_index``: the sample's index and its slice info.

    ``parent._finalize_index(...)`` on 0.14.1 and the nightly 2026.10.27 (``parent``: the
    sampler's ``super()``, so a class between it and TorchRL's runs too); on 0.13.3, which
    builds the info inline at the end of ``SliceSampler._get_index``, that code: the
    ``truncated``/``done``/``terminated`` flags (:func:`truncation_flags`) and the ``is_init``
    markers (``_maybe_emit_init_marker``). O(steps x stored keys) on 0.13 (it gathers the
    whole sample), as TorchRL.
    """
    if HAS_FINALIZE_INDEX:
        return parent._finalize_index(
            index=index,
            num_slices=num_slices,
            seq_length=seq_length,
            target_seq_length=target_seq_length,
            mask_flat=mask_flat,
            storage=storage,
        )
    flat = index.to(torch.long).unbind(-1)
    st_index = storage[flat]
    info: dict[Any, Any] = {}
    if sampler.truncated_key is not None:
        truncated = torch.zeros((flat[0].shape[0], 1), dtype=torch.bool, device=flat[0].device)
        if target_seq_length is not None and isinstance(seq_length, torch.Tensor):
            first = torch.arange(num_slices, device=seq_length.device) * target_seq_length
            truncated[first + (seq_length - 1).clamp(min=0)] = 1
        elif isinstance(seq_length, int):
            truncated.view(num_slices, -1)[:, -1] = 1
        else:
            truncated[seq_length.cumsum(0) - 1] = 1
        info = truncation_flags(sampler.truncated_key, st_index, (), truncated)
    if mask_flat is not None:
        info[("collector", "mask")] = mask_flat
    sampler._maybe_emit_init_marker(info, st_index, num_slices, seq_length, target_seq_length)
    return flat, info


# ---------------------------------------------------------------------- slice info
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

    TorchRL's slice samplers add three flags to a sample's ``info`` when ``truncated_key`` is
    set: ``truncated`` (``True`` at each slice's last step), ``done`` (the stored done flag at
    the sampled steps, OR-ed with ``truncated``) and ``terminated`` (the stored terminated
    flag, or ``False``), under ``truncated_key``'s parent. Built from the storage's
    TensorDict, reading only those two keys at the sampled steps.

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
        ``truncated`` where none is stored): a sampler whose index lives on the host has its
        ``truncated`` moved there, one copy to the device, never one back. O(steps).
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


# ---------------------------------------------------------------------- accessors: buffers
# What fastreplay's buffers, sample units and staleness sampler read of TorchRL's buffers,
# writers, storages and of tensordict's internals.
# Checked on TorchRL 0.13.3, 0.14.1 and torchrl-nightly 2026.10.27 (tensordict as each pins it).
# Optional fields are read from the instances' ``__dict__``: a missing attribute read through
# ``getattr`` costs an exception, and TorchRL's public properties of the buffer run its delayed
# initialisation (``_maybe_delay_init``), which these reads must not trigger.

from tensordict import TensorDict  # noqa: E402
from tensordict.utils import _StringOnlyDict  # noqa: E402
from torchrl.envs.transforms import Compose  # noqa: E402

TensorDictFields: type = _StringOnlyDict
"""The mapping a ``TensorDict`` keeps its entries in (tensordict's ``_StringOnlyDict``)."""


def buffer_sampler(buffer: Any) -> Any:
    """The buffer's sampler (``ReplayBuffer._sampler``), ``None`` before it exists. O(1).

    Unlike the ``sampler`` property, never runs a delayed initialisation.

    Checked on 0.13.3, 0.14.1 and the nightly.
    """
    return buffer.__dict__.get("_sampler")


def buffer_writer(buffer: Any) -> Any:
    """The buffer's writer (``ReplayBuffer._writer``), ``None`` before it exists. O(1).

    Checked on 0.13.3, 0.14.1 and the nightly.
    """
    return buffer.__dict__.get("_writer")


def replay_lock(buffer: Any) -> Any:
    """The buffer's thread lock around writes and samples (``ReplayBuffer._replay_lock``). O(1).

    The same ``threading.RLock`` on every version; TorchRL's methods hold it, then the write
    lock (``_write_lock``).

    Checked on 0.13.3, 0.14.1 and the nightly.
    """
    return buffer._replay_lock


def collate_fn(buffer: Any) -> Any:
    """The buffer's collate function (``ReplayBuffer._collate_fn``), ``None`` before it exists.

    TorchRL's default for a tensor storage is ``_collate_id`` (the data as it is). O(1).

    Checked on 0.13.3, 0.14.1 and the nightly.
    """
    return buffer.__dict__.get("_collate_fn")


def without_transform(buffer: Any) -> bool:
    """Whether the buffer applies no transform: none, or the empty ``Compose`` TorchRL builds.

    Reads ``ReplayBuffer._transform`` and the ``Compose``'s submodule registry. O(1).

    Checked on 0.13.3, 0.14.1 and the nightly.
    """
    return _no_transform(buffer.__dict__.get("_transform"))


def _no_transform(transform: Any) -> bool:
    """Whether ``transform`` is ``None`` or an empty ``Compose``."""
    if transform is None:
        return True
    if type(transform) is not Compose:
        return False
    modules = transform.__dict__.get("_modules")  # nn.Module's registry of submodules
    transforms = modules.get("transforms") if modules is not None else None
    return transforms is not None and len(transforms) == 0


def plain_storage(buffer: Any, prefetch: bool) -> Any:
    """The buffer's storage if TorchRL's parts are in their plain set-up, else ``None``. O(1).

    Plain: initialised, synchronous, ``dim_extend=0`` (as :func:`plain_buffer`), a tensor
    storage of exactly a TorchRL class
    (:data:`TENSOR_STORAGES`), initialised, 1-D and not compilable, written by exactly a
    ``TensorDictRoundRobinWriter`` that is not compilable and tracks no generations (the
    storage keeps none: ``_slot_generations``); the buffer not shared, not prefetching (unless
    ``prefetch``), TorchRL's default collate
    function, no transform (:func:`without_transform`), its sampler not consuming. A field
    TorchRL did not set declines (a set-up this check does not know). Read here in one pass,
    not through the accessors above: this runs on every direct ``extend`` and ``sample``.

    Checked on 0.14.1 and the nightly (0.13.3 lacks it: the direct path does not run there).
    """
    state = buffer.__dict__
    storage = state.get("_storage")
    writer = state.get("_writer")
    if (
        not state.get("_initialized", False)
        or type(storage) not in TENSOR_STORAGES
        or type(writer) is not TensorDictRoundRobinWriter
        or state.get("shared", True)
        or (state.get("_prefetch", True) and not prefetch)
        or state.get("_dim_extend") != 0
        or state.get("_collate_fn") is not _collate_id
        or not state.get("_sync", True)
        or not _no_transform(state.get("_transform"))
        or _consuming(type(state.get("_sampler")))
    ):
        return None
    stored, written = storage.__dict__, writer.__dict__
    if (
        not stored.get("initialized", False)
        or stored.get("ndim") != 1
        or stored.get("_compilable", True)
        or written.get("_compilable", True)
        or written.get("_track_generations", True)
        or stored.get("_slot_generations") is not None
    ):
        return None
    return storage


_CONSUMING: dict[type, bool] = {}


def _consuming(cls: type) -> bool:
    """Whether sampler class ``cls`` is a ``ConsumingSampler`` (cached per class)."""
    known = _CONSUMING.get(cls)
    if known is None:
        known = _CONSUMING[cls] = issubclass(cls, CONSUMING_SAMPLERS)
    return known


def plain_buffer(buffer: Any) -> bool:
    """Whether the buffer is initialised (``_initialized``), synchronous, ``dim_extend=0``. O(1).

    Then TorchRL's ``ReplayBuffer.update_priority`` calls ``sampler.update_priority(index,
    priority, storage=storage)`` under its locks once ``torch.as_tensor`` and the transpose it
    skips for ``dim_extend=0`` are done; :func:`plain_storage` checks the rest of a plain set-up.

    Checked on 0.13.3, 0.14.1 and the nightly.
    """
    state = buffer.__dict__
    return (
        state.get("_initialized", False)
        and state.get("_sync", True)
        and state.get("_dim_extend") == 0
    )


def sample_batch_size(buffer: Any, batch_size: int | None) -> int | None:
    """The batch size TorchRL's ``sample(batch_size)`` draws, or ``None`` where it does more.

    ``None`` where ``ReplayBuffer.sample`` would raise or warn (no batch size anywhere; one
    that differs from the buffer's before the one-time warning), or waits for another buffer
    or service first (``_service_shutdown``, ``_sample_dependency``). O(1).

    Checked on 0.14.1 and the nightly (0.13.3 lacks it: the direct path does not run there).
    """
    state = buffer.__dict__
    if state.get("_service_shutdown", True) or state.get("_sample_dependency") is not None:
        return None
    own = buffer.batch_size  # (a plain property: no delayed initialisation)
    if batch_size is None:
        return own
    if own is not None and batch_size != own and not state.get("_warned_batch_size_conflict"):
        return None
    return batch_size


def anchored_priority(buffer: Any, data: Any) -> Any:
    """TorchRL's reduction of ``data``'s priorities onto a sequence unit's anchors, or ``None``.

    ``TensorDictReplayBuffer.update_tensordict_priority``'s own steps
    (``_get_priority_vector``, then ``_anchor_reduced_priority``): ``(index, priority)``.

    Checked on 0.14.1 and the nightly (0.13.3 lacks it: the direct path does not run there).
    """
    return buffer._anchor_reduced_priority(data, buffer._get_priority_vector(data))


def _write_counters(buffer: Any, storage: Any) -> tuple[_Synchronized, ...] | None:
    """The shared counters a write of the buffer updates, or ``None`` if one is missing. O(1).

    ``(writer cursor, writer write count, storage length, storage last cursor index, storage
    mutation revision)``: the ``multiprocessing`` values behind TorchRL's properties
    (``_cursor_value``, ``_write_count_value``, ``_len_value``, ``_last_cursor_index_value``,
    ``_mutation_revision_value``), made by the write that initialised the storage.

    Checked on 0.14.1 and the nightly (0.13.3 lacks it: the direct path does not run there).
    """
    written, stored = buffer.__dict__["_writer"].__dict__, storage.__dict__
    counters = (
        written.get("_cursor_value"),
        written.get("_write_count_value"),
        stored.get("_len_value"),
        stored.get("_last_cursor_index_value"),
        stored.get("_mutation_revision_value"),
    )
    for counter in counters:
        if type(counter) is not _Synchronized:
            return None
    return counters


def _add(counter: _Synchronized, n: int) -> None:
    """``counter.value += n`` under its lock, as TorchRL's properties update it."""
    lock = counter.get_lock()
    lock.acquire()
    try:
        counter.get_obj().value += n
    finally:
        lock.release()


def claim_rows(
    buffer: Any, storage: Any, n: int, capacity: int, device: Any
) -> torch.Tensor | None:
    """The rows a write of ``n`` rows goes to, with TorchRL's bookkeeping before the data.

    ``None``, with nothing changed, where a counter below is missing (the write that
    initialises the storage makes them: it takes TorchRL's path). Otherwise
    ``TensorDictRoundRobinWriter.extend``'s bookkeeping: the cursor read and moved in one
    holding of its lock, the write count; the rows, an ``arange`` on ``device`` (the CPU for
    ``None``) wrapped around ``capacity``; then ``TensorStorage.set``'s: the last cursor
    (``_last_cursor``), its row and the length. Each counter is updated under its own lock, as
    TorchRL's properties do (the lock's ``acquire``/``release``: ``with`` goes through two
    Python methods of ``multiprocessing``). Follow with :func:`rows_written` once the rows
    are written. O(n).

    Checked on 0.14.1 and the nightly (0.13.3 lacks it: the direct path does not run there).
    """
    counters = _write_counters(buffer, storage)
    if counters is None:
        return None
    cursor_value, count_value, len_value, last_value, _ = counters
    lock = cursor_value.get_lock()
    lock.acquire()
    try:
        cell = cursor_value.get_obj()
        cursor = cell.value
        stop = cursor + n
        cell.value = stop % capacity
    finally:
        lock.release()
    index = (
        torch.arange(cursor, stop) if device is None else torch.arange(cursor, stop, device=device)
    )
    if stop > capacity:
        index.remainder_(capacity)
    _add(count_value, n)
    storage._last_cursor = index
    lock = last_value.get_lock()
    lock.acquire()
    try:
        last_value.get_obj().value = (stop - 1) % capacity
    finally:
        lock.release()
    lock = len_value.get_lock()
    lock.acquire()
    try:
        cell = len_value.get_obj()
        cell.value = min(cell.value + n, capacity)
    finally:
        lock.release()
    return index


def rows_written(buffer: Any, storage: Any, index: torch.Tensor) -> None:
    """TorchRL's bookkeeping after the rows ``index`` (:func:`claim_rows`) were written.

    ``TensorStorage.set`` counts the write (mutation revision); the writer tells every entity
    attached to the storage (``_attached_entities``, :func:`attached_entities`): each buffer
    tells its sampler (``mark_update``: the slice samplers record the rows there), each
    sample-unit listener its indices; then the buffer tells its sampler (``extend``).
    O(entities attached) on top of their ``mark_update``.

    Checked on 0.14.1 and the nightly (0.13.3 lacks it: the direct path does not run there).
    """
    _add(storage.__dict__["_mutation_revision_value"], 1)
    for entity in storage._attached_entities:
        entity.mark_update(index)
    buffer.__dict__["_sampler"].extend(index)


def storage_full(storage: Any) -> bool:
    """Whether the storage has written all its rows once (``Storage._is_full``). O(1).

    ``False`` for an object that is no TorchRL storage.

    Checked on 0.13.3, 0.14.1 and the nightly.
    """
    return bool(getattr(storage, "_is_full", False))


def storage_last_cursor(storage: Any) -> Any:
    """The cursor of the storage's last ``set`` as passed (``_last_cursor``), or ``None``.

    Checked on 0.13.3, 0.14.1 and the nightly.
    """
    return getattr(storage, "_last_cursor", None)


def writer_counts(buffer: Any) -> tuple[int, int]:
    """``(write count, cursor)`` of the buffer's round-robin writer. O(1).

    The writer's ``_write_count`` and ``_cursor`` properties (shared with other processes);
    0 for what the writer lacks (none before the buffer's delayed initialisation).

    Checked on 0.13.3, 0.14.1 and the nightly.
    """
    writer = buffer_writer(buffer)
    count, cursor = getattr(writer, "_write_count", 0), getattr(writer, "_cursor", 0)
    return int(count or 0), int(cursor or 0)


def make_storage(buffer: Any, storage: Any, compilable: bool) -> Any:
    """The storage TorchRL's buffer constructors make of ``storage`` (``_maybe_make_storage``).

    Checked on 0.13.3, 0.14.1 and the nightly.
    """
    return buffer._maybe_make_storage(storage, compilable=compilable)


def her_episode_ends(buffer: Any, storage: Any) -> Any:
    """``HERReplayBuffer``'s episode ends read from the whole storage (``_build_episode_cache``).

    Checked on 0.13.3, 0.14.1 and the nightly.
    """
    return buffer._build_episode_cache(storage)


def her_cache_key(buffer: Any, storage: Any) -> Any:
    """``HERReplayBuffer``'s cache key of the storage as it is (``_storage_cache_key``).

    Checked on 0.13.3, 0.14.1 and the nightly.
    """
    return buffer._storage_cache_key(storage)


def her_terminated_key(buffer: Any) -> Any:
    """The ``terminated`` key ``HERReplayBuffer`` reads beside ``end_key`` (``_terminated_key``).

    Checked on 0.13.3, 0.14.1 and the nightly.
    """
    return buffer._terminated_key()


def unit_check_storage(unit: Any, storage: Any) -> None:
    """A sample unit's check of the storage it expands in (``SampleUnit._check_storage``).

    Checked on 0.14.1 and the nightly (0.13.3 has no sample units).
    """
    unit._check_storage(storage)


def unit_newest_index(unit: Any, storage: Any, modulus: int) -> int:
    """A sample unit's newest written row (``SampleUnit._newest_index``; 0.14, nightly).

    Checked on 0.14.1 and the nightly (0.13.3 has no sample units).
    """
    return unit._newest_index(storage, modulus)


def staleness_settings(sampler: Any) -> tuple[Any, Any]:
    """``(version_key, weight function)`` of a ``StalenessAwareSampler``. O(1).

    Its ``_version_key`` and ``_weight_fn`` (``consumer_version`` and ``max_staleness`` are
    public properties).

    Checked on 0.13.3, 0.14.1 and the nightly.
    """
    return sampler._version_key, sampler._weight_fn


def td_parts(td: TensorDict) -> tuple[dict, torch.Size, Any, Any]:
    """``(entries, batch size, device, dimension names)`` of an exact ``TensorDict``. O(1).

    Its fields as tensordict keeps them (``_tensordict``, ``_batch_size``, ``_device``,
    ``_td_dim_names``): the properties re-parse nothing, but cost a call each.

    Checked with the tensordict of 0.13.3, 0.14.1 and the nightly.
    """
    return td._tensordict, td._batch_size, td._device, td._td_dim_names


def _new_td_unsafe(entries: Any, batch_size: torch.Size, device: Any) -> TensorDict:
    return TensorDict._new_unsafe(entries, batch_size=batch_size, device=device, nested=False)


def _new_td_direct(entries: Any, batch_size: torch.Size, device: Any) -> TensorDict:
    out = _object_new(TensorDict)
    out._device = device
    out._tensordict = entries
    out._batch_size = batch_size
    out._td_dim_names = None
    return out


def _direct_matches() -> bool:
    """Whether :func:`_new_td_direct` gives ``_new_unsafe``'s object (this tensordict)."""
    size = torch.Size((2,))
    try:
        reference = _new_td_unsafe(TensorDictFields(), size, None)
        direct = _new_td_direct(TensorDictFields(), size, None)
    except Exception:  # pragma: no cover - another tensordict
        return False
    return vars(reference) == vars(direct)


_object_new = object.__new__
new_tensordict: Callable[[Any, torch.Size, Any], TensorDict] = (
    _new_td_direct if _direct_matches() else _new_td_unsafe
)
"""A ``TensorDict`` of ``entries`` (a :data:`TensorDictFields`), without validation. O(1).

What ``TensorDict._new_unsafe(entries, batch_size=..., device=..., nested=False)`` builds,
its four fields set directly where that gives the same object (checked at import): no device
parsing and no compile check, a fifth of ``_new_unsafe``'s time.
Checked with the tensordict of 0.13.3, 0.14.1 and the nightly.
"""


# ---------------------------------------------------------------------- buffer bookkeeping
SAMPLE_KEYWORDS: frozenset[str] = frozenset(
    p.name
    for p in inspect.signature(TorchRLReplayBuffer.sample).parameters.values()
    if p.kind is p.KEYWORD_ONLY
)
"""``ReplayBuffer.sample``'s keyword-only arguments: ``wait``, ``timeout``, ``cancel_event`` on
the nightly; none on 0.13 and 0.14."""

NOTIFIES_READINESS: bool = hasattr(TorchRLReplayBuffer, "_notify_replay_state_change")
"""Whether TorchRL's buffers notify waiting samplers after each write (nightly)."""


def _constants(code: Any) -> set[Any]:
    """The constants of ``code`` and of the code objects nested in it."""
    found = set()
    for constant in code.co_consts:
        if inspect.iscode(constant):
            found |= _constants(constant)
        elif isinstance(constant, str):
            found.add(constant)
    return found


def _counts_samples() -> tuple[str, ...]:
    """The counters ``ReplayBuffer.sample`` increments (named in its code), in its order."""
    if not hasattr(TorchRLReplayBuffer, "_increment_counter"):
        return ()
    names = ("_sample_call_count_value", "_sampled_item_count_value")
    constants = _constants(_function(TorchRLReplayBuffer.sample).__code__)
    return names if all(name in constants for name in names) else ()


SAMPLE_COUNTERS: tuple[str, ...] = _counts_samples()
"""The buffer counters TorchRL's ``sample`` increments (calls, then records): the nightly's
``("_sample_call_count_value", "_sampled_item_count_value")``; empty on 0.13 and 0.14."""

NAMES_SAMPLES: bool = hasattr(Sampler, "_set_sample_names")
"""Whether TorchRL's buffers let the sampler name the sample's dimensions (nightly)."""


def sampled_items(index: Any, storage: Any) -> int:
    """The number of records a sample returned, counted as TorchRL's ``sample`` counts them."""
    if isinstance(index, tuple):
        return torch.as_tensor(index[0]).numel()
    index = torch.as_tensor(index)
    if storage.ndim > 1 and index.ndim > 1 and index.shape[-1] == storage.ndim:
        return index[..., 0].numel()
    return index.numel()


class Bookkeeping:
    """TorchRL's buffer bookkeeping, for fastreplay's direct path (one method per point).

    Each method does what the installed TorchRL's buffer does at that point besides moving
    data, through TorchRL's own methods, and nothing where that TorchRL does nothing (see
    the module docstring). All O(1).
    """

    if NOTIFIES_READINESS:

        @staticmethod
        def wrote(buffer: Any) -> None:
            """After a write, its locks released: wake ``sample(wait=True)`` callers."""
            buffer._notify_replay_state_change()

    else:

        @staticmethod
        def wrote(buffer: Any) -> None:
            """TorchRL 0.13/0.14 notify nobody after a write."""

    if SAMPLE_COUNTERS:

        @staticmethod
        def sampled(buffer: Any, index: Any) -> None:
            """After a sample: one more call, and the records it returned (``stats()``)."""
            calls, items = SAMPLE_COUNTERS
            count = sampled_items(index, buffer._storage)
            increment = buffer._increment_counter
            increment(calls, 1)
            increment(items, count)

    else:

        @staticmethod
        def sampled(buffer: Any, index: Any) -> None:
            """TorchRL 0.13/0.14 count no samples."""

    if NAMES_SAMPLES:

        @staticmethod
        def named(sampler: Any, data: Any) -> Any:
            """The sample with the sampler's dimension names (``batch_time``: the time dim)."""
            return sampler._set_sample_names(data)

    else:

        @staticmethod
        def named(sampler: Any, data: Any) -> Any:
            """TorchRL 0.13/0.14 name no dimensions."""
            return data

    if WARNS_SHORT_FLAT_BATCH:

        @staticmethod
        def warns_from_caller(sampler: Any) -> bool:
            """Whether ``sampler`` may still warn from TorchRL's code at its caller's line.

            TorchRL's own slice samplers (not fastreplay's) warn once on a short flat batch
            with ``stacklevel=3``: called by fastreplay's direct path, the warning would point
            at fastreplay's line, so they take TorchRL's path until they have warned. A flat
            batch can be short only with ``strict_length=False`` or at the end of a
            without-replacement epoch; other set-ups (``strict_length=True``, TorchRL's
            default) keep the direct path (checked on torchrl-nightly 2026.10.27). O(1).
            """
            state = sampler.__dict__
            return (
                state.get("_warned_short_batch") is False
                and type(sampler)._warn_if_short_batch is not warn_if_short_batch
                and state.get("output_layout", "flat") == "flat"
                and (
                    state.get("strict_length") is not True
                    or isinstance(sampler, TorchRLSliceSamplerWithoutReplacement)
                )
            )

    else:

        @staticmethod
        def warns_from_caller(sampler: Any) -> bool:
            """TorchRL 0.13/0.14's samplers warn at no caller's line."""
            return False

    @staticmethod
    def wait(
        buffer: Any,
        batch_size: int,
        wait: bool = False,
        timeout: float | None = None,
        cancel_event: Any = None,
    ) -> None:
        """``sample(wait=True)``'s wait, as TorchRL's ``ReplayBuffer.sample`` (no prefetch).

        Raises:
            TimeoutError: Not sampleable within ``timeout`` seconds.
            RuntimeError: ``cancel_event`` was set, or the buffer was shut down.
        """
        if wait and not buffer.wait_until_sampleable(
            batch_size, timeout=timeout, cancel_event=cancel_event
        ):
            if cancel_event is not None and cancel_event.is_set():
                raise RuntimeError("Replay-buffer sampling was cancelled.")
            raise TimeoutError(
                f"Replay buffer did not become sampleable for a batch of "
                f"{batch_size} items within {timeout} seconds."
            )


# ---------------------------------------------------------------------- sample units
try:
    from torchrl.data.replay_buffers import sample_units as _sample_units
except ImportError:  # TorchRL 0.13: no sample units
    _sample_units = None

HAS_SAMPLE_UNITS: bool = _sample_units is not None
"""Whether TorchRL has sample units (``sample_unit=`` on its buffers): 0.14, nightly."""

TorchRLSampleUnit: Any = getattr(_sample_units, "SampleUnit", None)
TorchRLSequence: Any = getattr(_sample_units, "Sequence", None)
TorchRLSubgoalTriplet: Any = getattr(_sample_units, "SubgoalTriplet", None)
"""TorchRL's ``SubgoalTriplet`` (nightly), or ``None``."""
TorchRLTransition: Any = getattr(_sample_units, "Transition", None)
ReplayBoundaryIndex: Any = getattr(_sample_units, "_ReplayBoundaryIndex", None)
"""The episode-boundary class TorchRL's units build (``torchrl...utils._ReplayBoundaryIndex``)."""

HAS_EPISODE_BOUNDARIES: bool = hasattr(TorchRLSampleUnit, "_episode_boundaries")
"""Whether TorchRL's units read their boundaries through ``SampleUnit._episode_boundaries``
(nightly); 0.14 builds them inline in ``Sequence.expand``."""


if HAS_EPISODE_BOUNDARIES:
    _boundaries = TorchRLSampleUnit._episode_boundaries
else:

    def _boundaries(storage: Any, done_key: Any, device: Any) -> Any:
        """0.14's ``Sequence.expand`` block that builds its boundary object (checked on 0.14.1).

        The nightly moved the same statements to ``SampleUnit._episode_boundaries``.
        """
        done = (
            storage.get(done_key)
            if done_key is not None
            else torch.zeros(storage.shape, dtype=torch.bool, device=device)
        )
        while done.ndim > storage.ndim and done.shape[-1] == 1:
            done = done.squeeze(-1)
        return ReplayBoundaryIndex(
            end=done,
            at_capacity=storage_full(storage),
            cursor=last_cursor_row(storage),  # its ``_last_cursor_index``
            device=device,
            storage=storage,
            source=("end", done_key),
            cache_values=True,
        )


def torchrl_episode_boundaries(storage: Any, done_key: Any, device: Any) -> Any:
    """TorchRL's episode-boundary object for ``storage``/``done_key`` (its full scan).

    The nightly's ``SampleUnit._episode_boundaries``; on 0.14, the same statements, which its
    ``Sequence.expand`` runs inline. O(items stored), cached by TorchRL until the next write.
    """
    return _boundaries(storage, done_key, device)


def is_torchrl_function(function: Any, cls: Any, name: str) -> bool:
    """Whether ``function`` is ``cls.name`` as the installed TorchRL defines it.

    ``False`` for a function a user put in its place (to backport a fix, say), before or
    after ``import fastreplay``: it is defined in another module (other globals) or under
    another name, even when it wraps TorchRL's. O(1).
    """
    module = sys.modules.get(cls.__module__)
    return (
        inspect.isfunction(function)
        and module is not None
        and function.__globals__ is module.__dict__
        and function.__qualname__ == f"{cls.__qualname__}.{name}"
    )

"""TorchRL TensorDict replay buffers whose samples are fully pinned (and optionally on device).

``pin_memory=True`` in torchrl 0.14.1 (pytorch/rl #2404, fix #2411) leaves part of each sample
in pageable memory: a transform output with ``device=None``, and the ``index``,
``priority_weight`` and truncation flags added after pinning. Without an accelerator the first
``sample`` raises ``RuntimeError: Cannot access accelerator device when none is available``.

These subclasses keep TorchRL's arguments and behaviour and change one thing: the whole sample,
metadata included, is built first and pinned last, in the prefetch thread when ``prefetch`` is
set. TorchRL's own pinning is switched off. Without an accelerator, ``pin_memory=True`` warns
once at construction and samples unpinned, as ``torch.utils.data.DataLoader`` does.
"""

from __future__ import annotations

import contextlib
import operator
import os
import sys
import warnings
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
import torchrl
from tensordict import is_tensor_collection, is_tensorclass
from tensordict.utils import expand_as_right

from fastreplay import _pinning
from fastreplay._failed_writes import FailedWriteMixin
from fastreplay._fast_path import FastPathMixin
from fastreplay._sharing import SharedBufferChecks
from fastreplay._signature import ConstructorSignature
from fastreplay._storage_pages import HugePageStorageMixin
from fastreplay._torchrl import RandomSampler
from fastreplay._torchrl import TorchRLBuffer as _TorchRLBuffer
from fastreplay._torchrl import TorchRLPrioritizedBuffer as _TorchRLPrioritizedBuffer
from fastreplay._torchrl import TorchRLReplayBuffer as _TorchRLReplayBuffer

__all__ = ["TensorDictPrioritizedReplayBuffer", "TensorDictReplayBuffer"]

_NO_ACCELERATOR = (
    "'pin_memory' argument is set as true but no accelerator is found, so samples of this "
    "replay buffer will not be pinned. Pass pin_memory=False to silence this warning."
)


_LIBRARY_DIRS = tuple(
    os.path.dirname(os.path.abspath(path)) + os.sep
    for path in (torchrl.__file__, torch.__file__, __file__)
)


def _user_stacklevel() -> int:
    """The ``stacklevel`` that points a warning at the first frame outside fastreplay/TorchRL.

    TorchRL's buffer metaclass adds a variable number of frames around ``__init__``.
    """
    frame, level = sys._getframe(1), 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_LIBRARY_DIRS):
        frame, level = frame.f_back, level + 1
    return level


def _type_name(value: Any) -> str:
    """``int``, ``str``... for builtins; ``numpy.bool``, ``torch.Tensor``... for the rest."""
    cls = type(value)
    if cls.__module__ == "builtins":
        return cls.__qualname__
    return f"{cls.__module__.split('.')[0]}.{cls.__qualname__}"


def _check_pin_memory(pin_memory: Any) -> bool:
    """As TorchRL (``if self._pin_memory:``): any value, read for its truth value.

    ``numpy.bool_``, ``0``/``1``, a one-element tensor... are accepted. A value with no truth
    value (a tensor or array of several elements) raises here, at construction, the error class
    ``bool()`` raises, where TorchRL would raise it at the first ``sample``.
    """
    try:
        return bool(pin_memory)
    except Exception as err:
        cls = type(err) if isinstance(err, (TypeError, ValueError, RuntimeError)) else TypeError
        raise cls(
            f"pin_memory={pin_memory!r} (of type {_type_name(pin_memory)}) has no truth value: "
            f"{err}; pass pin_memory=True or pin_memory=False."
        ) from None


def _check_device(device: Any) -> torch.device | None:
    """A ``torch.device`` that exists on this machine, or ``None``."""
    if device is None:
        return None
    if not isinstance(device, (bool, np.bool_, str, torch.device)):
        with contextlib.suppress(TypeError):
            device = operator.index(device)  # int, or a numpy / torch integer scalar
    if isinstance(device, bool) or not isinstance(device, (str, int, torch.device)):
        raise TypeError(
            f"device must be None, a str, an int or a torch.device, got {device!r} of type "
            f"{_type_name(device)}; pass e.g. device='cuda'."
        )
    try:
        parsed = torch.device(device)
    except RuntimeError as err:
        raise ValueError(
            f"device={device!r} is not a device torch knows ({err}); pass e.g. device='cuda', "
            "device='cuda:0' or device='cpu'."
        ) from None
    if parsed.type == "cpu":
        return parsed
    backend = getattr(torch, parsed.type, None)
    available = backend is not None and getattr(backend, "is_available", lambda: False)()
    if not available:
        raise ValueError(
            f"device={device!r}: no {parsed.type} device is available on this machine; "
            "pass device=None (samples stay on the host) or device='cpu'."
        )
    count = getattr(backend, "device_count", lambda: 1)()
    if parsed.index is not None and parsed.index >= count:
        raise ValueError(
            f"device={device!r}: this machine has {count} {parsed.type} device(s), "
            f"indices 0 to {count - 1}; pass one of those."
        )
    return parsed


class _PinnedSampleMixin:
    """Builds the full sample in ``_sample`` (prefetch thread), then pins and moves it.

    Placed before a TorchRL TensorDict buffer in the bases. O(number of leaves) per sample on
    top of TorchRL's work, plus one host copy per leaf that is not pinned yet.
    """

    def _fr_init_pinning(self, pin_memory: Any, device: Any) -> None:
        """Validate ``pin_memory``/``device`` and decide whether samples are pinned.

        Runs before any TorchRL state is built, so bad arguments leave nothing behind.
        """
        pin_memory = _check_pin_memory(pin_memory)
        device = _check_device(device)
        self._fr_pin_memory = pin_memory
        self._fr_device = device
        wants_pinning = pin_memory or (device is not None and device.type != "cpu")
        self._fr_pinning = wants_pinning and _pinning.pinning_available()
        if pin_memory and not self._fr_pinning:
            warnings.warn(_NO_ACCELERATOR, UserWarning, stacklevel=_user_stacklevel())

    @property
    def pin_memory(self) -> bool:
        """Whether pinning was requested (``bool(pin_memory)``; :attr:`pins`: what happens)."""
        return self._fr_pin_memory

    @property
    def pins(self) -> bool:
        """Whether samples are really pinned (an accelerator is present and pinning was asked)."""
        return self._fr_pinning

    @property
    def device(self) -> torch.device | None:
        """The device samples are moved to, or ``None`` to keep them on the storage's device."""
        return self._fr_device

    def _finish(self, data: Any, info: Any) -> tuple[Any, Any]:
        device = self._fr_device
        to_host = device is not None and device.type == "cpu"
        if to_host:
            # From a storage on an accelerator: bring it over first, then pin what arrived.
            data = _pinning.move_tree(data, device)
        if self._fr_pinning:
            data, info = _pinning.pin_tree((data, info))
        if device is not None and not to_host:
            # To an accelerator: pinned first, so the copy does not block.
            data = _pinning.move_tree(data, device)
        return data, info

    def _sample(self, batch_size: int) -> tuple[Any, dict]:
        data, info = super()._sample(batch_size)
        if not is_tensor_collection(data) or is_tensorclass(data):
            return self._finish(data, info)
        data, info[_SHADOWED] = _write_info(data, info)
        # ``info[_SHADOWED]``: what undoes the writes, for ``sample(include_info=False)``
        # (popped there); its presence marks the metadata as written.
        return self._finish(data, info)

    def sample(
        self,
        batch_size: int | None = None,
        return_info: bool = False,
        include_info: bool | None = None,
        **kwargs: Any,
    ) -> Any:
        """Sample a batch, as TorchRL's ``TensorDictReplayBuffer.sample`` does.

        The metadata (``index``, ``priority_weight``, truncation flags) is already in the
        TensorDict, written and pinned where the sample was built (the prefetch thread when
        ``prefetch`` is set). With ``device`` set, the TensorDict is on ``device``; ``info``
        stays on the storage's device (pinned), as in TorchRL.

        Args:
            batch_size: Size of the batch; defaults to the buffer's ``batch_size``.
            return_info: Whether to return ``(data, info)`` instead of ``data``.
            include_info: Deprecated TorchRL argument; ``False`` returns the sample as the
                storage (and transform) produced it, without the metadata: stored entries
                named like it (a stored ``index`` or ``("next", "done")``) keep their values.
            **kwargs: The installed TorchRL's other ``sample`` keywords (the nightly's
                ``wait``, ``timeout``, ``cancel_event``), passed on as they are.
        """
        if include_info is not None:
            warnings.warn(
                "include_info is going to be deprecated soon.The default behavior has changed "
                "to `include_info=True` to avoid bugs linked to wrongly preassigned values in "
                "the output tensordict.",
                stacklevel=2,
            )
        if include_info is None and not kwargs:  # keywords of a newer TorchRL: its path
            fast = self._fr_fast_sample(batch_size)
            if fast is not None:
                data, info, written = fast
                if not written:
                    data, _ = _write_info(data, info)
                # a new dict, as TorchRL's (it maps ``info`` to the storage device)
                return (data, dict(info)) if return_info else data
        data, info = _TorchRLReplayBuffer.sample(self, batch_size, return_info=True, **kwargs)
        written = _SHADOWED in info
        shadowed = info.pop(_SHADOWED, None)
        is_tc = is_tensor_collection(data)
        if not is_tc and include_info in (True, None):
            raise RuntimeError("Cannot include info in non-tensordict data")
        if is_tc and not is_tensorclass(data):
            if include_info is False and written:
                replaced, drop = shadowed
                data = _unwrite_info(data, (self._finish(replaced, {})[0], drop))
            elif include_info is not False and not written:
                # A queued sample restored from a checkpoint that TorchRL wrote.
                data, _ = _write_info(data, info)
        if self._fr_pinning:
            # Leftovers only (TorchRL moves ``info`` to the storage device after ``_sample``, and
            # restored prefetch queues hold clones): pinned leaves are not copied again.
            data, info = _pinning.pin_tree((data, info))
        if return_info:
            return data, info
        return data

    @contextlib.contextmanager
    def _capture_prefetch_state(self, *, clone_queue: bool = True) -> Iterator[dict[str, Any]]:
        """TorchRL's, with the queued samples in TorchRL's form (metadata not written yet).

        Checkpoints (``state_dict``, ``dumps``, pickling) then load into either library; a
        restored sample gets its metadata in :meth:`sample`. O(queued samples).
        """
        with super()._capture_prefetch_state(clone_queue=clone_queue) as state:
            yield {**state, "queue": tuple(map(_upstream_form, state["queue"]))}

    def __getitem__(self, index: Any) -> Any:
        data = super().__getitem__(index)
        if self._fr_pinning:
            data = _pinning.pin_tree(data)
        return data


_SHADOWED = "_fastreplay_shadowed"


def _write_info(data: Any, info: dict) -> tuple[Any, Any]:
    """Write the sampler's ``info`` into ``data``, as ``TensorDictReplayBuffer.sample`` does.

    Returns ``data`` and what :func:`_unwrite_info` needs to give back the sample as it was:
    the stored entries the metadata replaced (usually none) and the keys to drop.
    O(number of metadata keys).
    """
    replaced, drop = {}, []
    for key in info:  # ``get``: the cheapest membership test TensorDict offers
        value = data.get(key, None)
        if value is not None:
            replaced[key] = value
            drop.append(key)
            continue
        path, depth = (key if isinstance(key, tuple) else (key,)), 1
        while depth < len(path) and data.get(path[:depth], None) is not None:
            depth += 1
        drop.append(path[:depth])  # the outermost level the write creates
    shadowed = (replaced, tuple(drop))
    is_locked = data.is_locked
    with data.unlock_() if is_locked else contextlib.nullcontext():
        for key, val in info.items():
            if key == "index" and isinstance(val, tuple):
                val = torch.stack(val, -1)
            try:
                val = _as_tensor(val, data.device)
                if val.ndim < data.ndim:
                    val = expand_as_right(val, data)
                data.set(key, val)
            except RuntimeError:
                raise RuntimeError(
                    "Failed to set the metadata (e.g., indices or weights) in the sampled "
                    "tensordict within TensorDictReplayBuffer.sample. This is probably caused "
                    "by a shape mismatch (one of the transforms has probably modified the "
                    "shape of the output tensordict). You can always recover these items from "
                    "the `sample` method from a regular ReplayBuffer instance with the "
                    "'return_info' flag set to True."
                ) from None
    return data, shadowed


def _upstream_form(result: Any) -> Any:
    """A queued ``(data, info)`` of :meth:`_PinnedSampleMixin._sample` as TorchRL queues it."""
    info = result[1]
    if not isinstance(info, dict) or _SHADOWED not in info:
        return result
    info = dict(info)
    return _unwrite_info(result[0], info.pop(_SHADOWED)), info


def _unwrite_info(data: Any, shadowed: tuple[dict, tuple]) -> Any:
    """``data`` as it was before :func:`_write_info`; ``data`` itself is not modified.

    ``exclude`` rebuilds every level holding a dropped key, so putting back the replaced
    entries never writes into ``data``. O(number of keys).
    """
    replaced, drop = shadowed
    raw = data.exclude(*drop)
    if replaced:
        is_locked = raw.is_locked
        with raw.unlock_() if is_locked else contextlib.nullcontext():
            for key, value in replaced.items():
                raw.set(key, value)
    return raw


def _as_tensor(value: Any, device: torch.device | None) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value if device is None else value.to(device)
    return torch.as_tensor(value, device=device)


class TensorDictReplayBuffer(
    FailedWriteMixin,
    HugePageStorageMixin,
    _PinnedSampleMixin,
    FastPathMixin,
    SharedBufferChecks,
    _TorchRLBuffer,
):
    """TorchRL's ``TensorDictReplayBuffer`` whose samples are pinned in full.

    Same arguments and behaviour as :class:`torchrl.data.TensorDictReplayBuffer`, plus:

    - ``pin_memory=True`` pins every host tensor of the sample: metadata the buffer adds
      (``index``, ``priority_weight``, truncation flags), transform outputs (``device=None``
      TensorDicts and nested keys too) and ``info``. Pinned and accelerator tensors are not
      copied; non-tensor data is untouched. With ``prefetch``, pinning runs in the prefetch
      thread. Without an accelerator: one ``UserWarning`` at construction, then unpinned
      samples.
    - ``device`` (optional): samples are pinned, then moved with ``non_blocking=True``. An
      accelerator ``device`` implies pinning.

    Args:
        pin_memory: Pin samples; read for its truth value, as TorchRL does. Defaults to
            ``False``.
        device: Where samples are delivered (``"cuda"``, ``"cuda:1"``, ``"cpu"``...). Must
            exist on this machine. Defaults to ``None`` (the storage's device).
        **kwargs: Everything :class:`torchrl.data.TensorDictReplayBuffer` accepts.

    With ``shared=True`` (or ``share()``, which multi-process collectors call), the buffer is
    checked to be shareable, its storage is moved to shared memory once it is initialized (so
    ``fork``ed workers write into it too), and writes made by other processes are reported to
    this process's sampler (see ``docs/scale_out.md``). A lazy storage without
    ``shared_init=True`` must be first written in the process that shares the buffer: a first
    write elsewhere raises ``RuntimeError``.

    Raises:
        TypeError: ``device`` is not a device-like value.
        ValueError, RuntimeError: ``pin_memory`` has no truth value (an array or tensor of
            several elements); the class is the one ``bool(pin_memory)`` raises.
        ValueError: ``device`` is unknown to torch or absent from this machine; ``shared=True``
            with a storage that other processes cannot write into.

    Example:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> from torchrl.data import LazyTensorStorage
        >>> from fastreplay import TensorDictReplayBuffer
        >>> rb = TensorDictReplayBuffer(storage=LazyTensorStorage(100), batch_size=8)
        >>> _ = rb.extend(TensorDict(obs=torch.arange(50), batch_size=[50]))
        >>> sample = rb.sample()
        >>> sorted(sample.keys()), sample["obs"].shape, rb.pin_memory
        (['index', 'obs'], torch.Size([8]), False)
    """

    __signature__ = ConstructorSignature()  # TorchRL's metaclass hides __init__

    def __init__(self, *, pin_memory: bool = False, device: Any = None, **kwargs: Any) -> None:
        self._fr_init_pinning(pin_memory, device)
        # TorchRL's own pinning (``pin_memory_output``) stays off: it pins too early and
        # crashes without an accelerator.
        super().__init__(pin_memory=False, **kwargs)


class TensorDictPrioritizedReplayBuffer(
    FailedWriteMixin,
    HugePageStorageMixin,
    _PinnedSampleMixin,
    FastPathMixin,
    SharedBufferChecks,
    _TorchRLPrioritizedBuffer,
):
    """TorchRL's ``TensorDictPrioritizedReplayBuffer`` with fastreplay's sampler, pinned in full.

    Same arguments and behaviour as :class:`torchrl.data.TensorDictPrioritizedReplayBuffer`,
    with two differences:

    - the sampler is :class:`fastreplay.PrioritizedSampler` (compiled numba trees where numba
      is installed, pure torch otherwise, so it works where TorchRL's compiled segment trees
      do not load; new items get the live max priority of what is still stored);
    - the ``pin_memory`` and ``device`` behaviour of :class:`TensorDictReplayBuffer`
      (``priority_weight`` and ``index`` are pinned too).

    Args:
        alpha: Priority exponent (``>= 0``).
        beta: Importance-sampling exponent (``>= 0``).
        eps: Added to priorities before ``** alpha``. Defaults to ``1e-8``.
        reduction: How ``update_tensordict_priority`` reduces per-step priorities
            (``"max"``, ``"min"``, ``"mean"``, ``"median"``). Defaults to ``"max"``.
        storage: The storage; defaults to TorchRL's default for this buffer.
        sampler_device: Device of the priority trees. Defaults to ``None`` (CPU).
        sync: As in TorchRL: ``False`` samples uniformly in worker processes.
        pin_memory: Pin samples; read for its truth value, as TorchRL does. Defaults to
            ``False``.
        device: Where samples are delivered. Must exist on this machine. Defaults to ``None``.
        **kwargs: Everything else :class:`torchrl.data.TensorDictPrioritizedReplayBuffer`
            accepts (``priority_key``, ``batch_size``, ``transform``, ``prefetch``...).

    Raises:
        TypeError: ``device`` is not a device-like value.
        ValueError, RuntimeError: ``pin_memory`` has no truth value (an array or tensor of
            several elements); the class is the one ``bool(pin_memory)`` raises.
        ValueError: ``device`` is unknown to torch or absent from this machine; bad
            ``alpha``/``beta``/``eps`` (from :class:`fastreplay.PrioritizedSampler`);
            ``shared=True`` with ``sync=True`` (writes from other processes would never get a
            priority here: pass ``sync=False``) or with an unshareable storage.

    Example:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> from torchrl.data import LazyTensorStorage
        >>> from fastreplay import TensorDictPrioritizedReplayBuffer
        >>> rb = TensorDictPrioritizedReplayBuffer(
        ...     alpha=0.7, beta=0.5, storage=LazyTensorStorage(100), batch_size=4
        ... )
        >>> data = TensorDict(obs=torch.arange(10), td_error=torch.rand(10), batch_size=[10])
        >>> _ = rb.extend(data)
        >>> sample = rb.sample()
        >>> sorted(sample.keys())
        ['index', 'obs', 'priority_weight', 'td_error']
        >>> TensorDictPrioritizedReplayBuffer(alpha=0.7, beta=0.5, pin_memory=torch.ones(2))
        Traceback (most recent call last):
        ...
        RuntimeError: pin_memory=tensor([1., 1.]) (of type torch.Tensor) has no truth value: ...
    """

    __signature__ = ConstructorSignature()  # TorchRL's metaclass hides __init__

    def __init__(
        self,
        *,
        alpha: float,
        beta: float,
        eps: float = 1e-8,
        reduction: str = "max",
        storage: Any = None,
        sampler_device: Any = None,
        sync: bool = True,
        compilable: bool = False,
        pin_memory: bool = False,
        device: Any = None,
        **kwargs: Any,
    ) -> None:
        from fastreplay.samplers.prioritized import PrioritizedSampler

        self._fr_init_pinning(pin_memory, device)
        # Mirrors TorchRL's ``TensorDictPrioritizedReplayBuffer.__init__`` (torchrl 0.14.1), whose
        # only difference is that it builds TorchRL's compiled ``PrioritizedSampler``.
        storage = self._maybe_make_storage(storage, compilable=compilable)
        prioritized_sampler = PrioritizedSampler(
            storage.max_size, alpha, beta, eps, reduction=reduction, device=sampler_device
        )
        self._sync = sync
        self._prioritized_sampler = None
        self._prioritized_sampler_write_count = 0
        if sync:
            sampler = prioritized_sampler
        else:
            if storage.ndim != 1:
                raise ValueError(
                    f"{type(self).__name__} only supports 1-D storages when sync=False, got "
                    f"storage.ndim={storage.ndim}; pass sync=True or a 1-D storage."
                )
            self._prioritized_sampler = prioritized_sampler
            sampler = RandomSampler()
        _TorchRLBuffer.__init__(
            self,
            storage=storage,
            sampler=sampler,
            compilable=compilable,
            pin_memory=False,
            **kwargs,
        )

"""What a sample becomes after the storage read: metadata written, pinned, moved.

:class:`PinnedSamples` builds the whole sample in ``_sample`` (the prefetch thread when
``prefetch`` is set): the metadata TorchRL's ``TensorDictReplayBuffer.sample`` adds (``index``,
``priority_weight``, truncation flags) is written there, then the sample is pinned and moved to
``device`` last. ``pin_memory=True`` in TorchRL 0.14.1 (pytorch/rl #2404, fix #2411) leaves part
of each sample in pageable memory (a transform output with ``device=None``, and the metadata
added after pinning), and without an accelerator the first ``sample`` raises. The metadata
helpers (:func:`write_info`, :func:`unwrite_info`) are shared with the direct path
(:mod:`fastreplay.buffers.paths`).
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

from fastreplay._torchrl import TorchRLBuffer as _TorchRLBuffer
from fastreplay._torchrl import replay_lock
from fastreplay.buffers import pinning

__all__ = ["PinnedSamples", "write_info"]

_NO_ACCELERATOR = (
    "'pin_memory' argument is set as true but no accelerator is found, so samples of this "
    "replay buffer will not be pinned. Pass pin_memory=False to silence this warning."
)


_LIBRARY_DIRS = tuple(
    os.path.dirname(os.path.abspath(path)) + os.sep
    for path in (torchrl.__file__, torch.__file__, os.path.dirname(__file__))
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


class PinnedSamples:
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
        self._fr_pinning = wants_pinning and pinning.pinning_available()
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

    def _finish(self, data: Any, info: Any, prefetching: bool = False) -> tuple[Any, Any]:
        """Pin and move a sample built by ``_sample`` (``prefetching``: maybe in a thread)."""
        device = self._fr_device
        if device is not None and device.type == "cpu":
            # From a storage on an accelerator: bring it over first, then pin what arrived.
            data = pinning.move_tree(data, device)
            device = None
        if self._fr_pinning:
            data, info = pinning.pin_tree((data, info))
        if device is not None:
            # To an accelerator: pinned first, so the copy does not block.
            stream = pinning.side_stream(device) if prefetching else None
            if stream is None:
                data = pinning.move_tree(data, device)
            else:  # a prefetching thread: its own stream, and an event the consumer waits on
                with torch.cuda.stream(stream):
                    data = pinning.move_tree(data, device)
                    if isinstance(info, dict):
                        info[_READY] = stream.record_event()
        return data, info

    def _fr_staged_read(self, batch_size: int) -> tuple[Any, dict] | None:
        """TorchRL's ``_sample`` read, gathered straight into pinned memory, or ``None``.

        In the common set-up (a host ``TensorStorage``, no transform, the direct path's
        conditions apart from pinning, ``device`` and ``prefetch``), each leaf is gathered by
        one ``index_select`` into pinned memory (:func:`~fastreplay.buffers.pinning.
        pinned_empty`): one host copy per leaf, where reading then pinning makes two. The
        sampler runs as in TorchRL's ``_sample``, under the same locks.
        O(batch x row size + leaves).
        """
        plain = getattr(self, "_fr_plain", None)
        if not self._fr_pinning or plain is None:
            return None
        storage = plain(staged=True)
        if storage is None:
            return None
        with replay_lock(self), self._write_lock:  # type: ignore[attr-defined]
            result = self._fr_locked_sample(  # type: ignore[attr-defined]
                storage, batch_size, pinning.pinned_empty
            )
        if result is None:
            return None
        return result[0], result[1]

    def _sample(self, batch_size: int) -> tuple[Any, dict]:
        staged = self._fr_staged_read(batch_size)
        if staged is not None:
            data, info = staged
        else:
            data, info = super()._sample(batch_size)  # type: ignore[misc]
        if not is_tensor_collection(data) or is_tensorclass(data):
            return self._finish(data, info, bool(self.__dict__.get("_prefetch")))
        data, info[_SHADOWED] = write_info(data, info)
        # ``info[_SHADOWED]``: what undoes the writes, for ``sample(include_info=False)``
        # (popped there); its presence marks the metadata as written.
        return self._finish(data, info, bool(self.__dict__.get("_prefetch")))

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
        # The bases after ``TensorDictReplayBuffer`` (``ReplayBuffer.sample``), not its own
        # ``sample``: the metadata is written (and pinned) in ``_sample`` already, where
        # TorchRL's would overwrite it. Every base before it runs as usual.
        data, info = super(_TorchRLBuffer, self).sample(batch_size, return_info=True, **kwargs)  # type: ignore[misc]
        ready = info.pop(_READY, None)
        if ready is not None and self._fr_device is not None:
            # copied on a prefetch thread's stream: the caller's stream waits for it here
            pinning.wait_ready(data, ready, self._fr_device)
        written = _SHADOWED in info
        shadowed = info.pop(_SHADOWED, None)
        is_tc = is_tensor_collection(data)
        if not is_tc and include_info in (True, None):
            raise RuntimeError("Cannot include info in non-tensordict data")
        if is_tc and not is_tensorclass(data):
            if include_info is False and written:
                replaced, drop = shadowed
                data = unwrite_info(data, (self._finish(replaced, {})[0], drop))
            elif include_info is not False and not written:
                # A queued sample restored from a checkpoint that TorchRL wrote.
                data, _ = write_info(data, info)
        if self._fr_pinning:
            # Leftovers only (TorchRL moves ``info`` to the storage device after ``_sample``, and
            # restored prefetch queues hold clones): pinned leaves are not copied again.
            data, info = pinning.pin_tree((data, info))
        if return_info:
            return data, info
        return data

    @contextlib.contextmanager
    def _capture_prefetch_state(self, *, clone_queue: bool = True) -> Iterator[dict[str, Any]]:
        """TorchRL's, with the queued samples in TorchRL's form (metadata not written yet).

        Checkpoints (``state_dict``, ``dumps``, pickling) then load into either library; a
        restored sample gets its metadata in :meth:`sample`. O(queued samples).
        """
        with super()._capture_prefetch_state(clone_queue=clone_queue) as state:  # type: ignore[misc]
            yield {**state, "queue": tuple(map(upstream_form, state["queue"]))}

    def __getitem__(self, index: Any) -> Any:
        data = super().__getitem__(index)  # type: ignore[misc]
        if self._fr_pinning:
            data = pinning.pin_tree(data)
        return data


_SHADOWED = "_fastreplay_shadowed"
# In ``info`` between a prefetch thread and ``sample``: the event after the copies to ``device``.
_READY = "_fastreplay_ready"


def write_info(data: Any, info: dict) -> tuple[Any, Any]:
    """Write the sampler's ``info`` into ``data``, as ``TensorDictReplayBuffer.sample`` does.

    Returns ``data`` and what :func:`unwrite_info` needs to give back the sample as it was:
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


def upstream_form(result: Any) -> Any:
    """A queued ``(data, info)`` of :meth:`PinnedSamples._sample` as TorchRL queues it."""
    info = result[1]
    if not isinstance(info, dict) or (_SHADOWED not in info and _READY not in info):
        return result
    info = dict(info)
    ready = info.pop(_READY, None)
    if ready is not None:
        ready.synchronize()  # the copies into ``result[0]`` are complete before it is saved
    if _SHADOWED not in info:
        return result[0], info
    return unwrite_info(result[0], info.pop(_SHADOWED)), info


def unwrite_info(data: Any, shadowed: tuple[dict, tuple]) -> Any:
    """``data`` as it was before :func:`write_info`; ``data`` itself is not modified.

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

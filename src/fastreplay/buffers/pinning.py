"""Pin every host tensor of a sample, and move it to a device without blocking.

Pure core, no TorchRL imports. Every pin goes through :func:`_pin_tensor` and every
"is it pinned already?" question through :func:`_is_pinned`, and the availability of an
accelerator is asked of :func:`pinning_available` only: tests on a CPU-only machine replace
these three to record which tensors reach the pinning step.

A "tree" is what a replay buffer returns: a tensor, a TensorDict or tensorclass (nested keys,
``device=None`` included; non-tensor data is kept as it is), or a dict, list or tuple of those
(TorchRL's ``info``). Anything else is returned unchanged.

Example:
    >>> import torch
    >>> from tensordict import TensorDict
    >>> td = TensorDict(obs=torch.zeros(4, 3), nested=TensorDict(x=torch.ones(4), batch_size=[4]),
    ...                 batch_size=[4])
    >>> [path for path, _ in leaves_to_pin(td)]
    [('obs',), (('nested', 'x'),)]
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
from tensordict import is_tensor_collection

__all__ = [
    "leaves_to_pin",
    "move_tree",
    "pin_tree",
    "pinned_empty",
    "pinning_available",
    "side_stream",
]


def pinning_available() -> bool:
    """Whether page-locked (pinned) host memory can be allocated here.

    Pinned memory needs an accelerator (CUDA, or another ``torch.accelerator`` backend).
    Without one, ``tensor.pin_memory()`` raises ``RuntimeError: Cannot access accelerator
    device when none is available``.

    Example:
        >>> isinstance(pinning_available(), bool)
        True
    """
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None and hasattr(accelerator, "is_available"):
        return bool(accelerator.is_available())
    return torch.cuda.is_available()


def _pin_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The single place that pins: a page-locked copy of a host tensor."""
    return tensor.pin_memory()


def _pinned_empty(shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """The single place that allocates pinned memory for a gather to write into."""
    return torch.empty(shape, dtype=dtype, pin_memory=True)


def pinned_empty(shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised page-locked host tensor, for a gather to write into (``out=``).

    Memory comes from torch's caching host allocator: a block freed by an earlier sample of
    the same size is reused, and a block that fed a non-blocking copy to a device is only
    handed out again once that copy has finished (torch records an event on the block when the
    copy is queued). fastreplay never reuses a pinned tensor itself, so a pinned sample
    returned to the user is never written again under them. Needs an accelerator. O(1)
    (amortised; the first allocation of a size pins fresh pages).

    Args:
        shape: Shape of the tensor.
        dtype: Its dtype.
    """
    return _pinned_empty(shape, dtype)


def _is_pinned(tensor: torch.Tensor) -> bool:
    """The single place that asks whether a host tensor is pinned already."""
    return tensor.is_pinned()


def _needs_pinning(tensor: torch.Tensor) -> bool:
    # Accelerator (and meta) tensors stay where they are; pinned ones are not copied again.
    return tensor.device.type == "cpu" and not _is_pinned(tensor)


def _is_plain_tensor(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and not is_tensor_collection(value)


def leaves_to_pin(tree: Any, path: tuple = ()) -> Iterator[tuple[tuple, torch.Tensor]]:
    """Yield ``(path, tensor)`` for each host tensor of ``tree`` that is not pinned yet.

    A path is a tuple of steps: a TensorDict key (a string, or a tuple for a nested key), a
    dict key, or a list/tuple position. Non-tensor data and accelerator tensors are skipped.
    O(number of leaves).

    Args:
        tree: A tensor, TensorDict/tensorclass, or dict/list/tuple of those.
        path: Prefix prepended to every path.

    Example:
        >>> import torch
        >>> info = {"index": torch.arange(3), "note": "kept", "pair": (torch.ones(2), 1.0)}
        >>> [path for path, _ in leaves_to_pin(info)]
        [('index',), ('pair', 0)]
    """
    if is_tensor_collection(tree):
        for key, value in tree.items(include_nested=True, leaves_only=True):
            if _is_plain_tensor(value) and _needs_pinning(value):
                yield (*path, key), value
    elif _is_plain_tensor(tree):
        if _needs_pinning(tree):
            yield path, tree
    elif isinstance(tree, dict):
        for key, value in tree.items():
            yield from leaves_to_pin(value, (*path, key))
    elif isinstance(tree, (list, tuple)):
        for position, value in enumerate(tree):
            yield from leaves_to_pin(value, (*path, position))


def _map_tree(tree: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """Apply ``fn`` to every plain tensor leaf; containers are rebuilt, not mutated."""
    if is_tensor_collection(tree):
        # ``apply`` leaves non-tensor data alone and keeps the batch size, device (None too),
        # names and the lock state.
        return tree.apply(fn, propagate_lock=True, filter_empty=False)
    if _is_plain_tensor(tree):
        return fn(tree)
    if isinstance(tree, dict):
        return type(tree)((key, _map_tree(value, fn)) for key, value in tree.items())
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):  # namedtuple
        return type(tree)(*(_map_tree(value, fn) for value in tree))
    if isinstance(tree, (list, tuple)):
        return type(tree)(_map_tree(value, fn) for value in tree)
    return tree


def pin_tree(tree: Any) -> Any:
    """Return ``tree`` with every host tensor leaf in pinned memory.

    Host tensors that are already pinned and accelerator tensors are returned as they are (no
    copy); non-tensor data is untouched. The input is not modified: a new container is built
    when anything needs pinning, and the same object is returned when nothing does. A tensor
    reached twice (the same object under two keys) is pinned once. Needs an accelerator
    (see :func:`pinning_available`) whenever some leaf needs pinning. O(number of leaves) plus
    one host copy per unpinned leaf.

    Args:
        tree: A tensor, TensorDict/tensorclass, or dict/list/tuple of those.

    Example:
        >>> import torch
        >>> tree = {"note": "no tensors, nothing to pin"}
        >>> pin_tree(tree) is tree
        True
    """
    if next(iter(leaves_to_pin(tree)), None) is None:
        return tree
    # id -> (original, pinned copy); holding the original keeps its id from being reused.
    memo: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def pin(tensor: torch.Tensor) -> torch.Tensor:
        if not _needs_pinning(tensor):
            return tensor
        if id(tensor) not in memo:
            memo[id(tensor)] = (tensor, _pin_tensor(tensor))
        return memo[id(tensor)][1]

    return _map_tree(tree, pin)


def move_tree(tree: Any, device: torch.device) -> Any:
    """Return ``tree`` with every tensor leaf on ``device``; copies to an accelerator don't block.

    Pin the tree first (:func:`pin_tree`): a non-blocking copy from pageable host memory is
    synchronous. Copies to the host (``device="cpu"``, e.g. from a storage on an accelerator)
    block: a non-blocking device-to-host copy returns before the data has arrived. TensorDicts
    and tensorclasses take ``device`` as their device. Leaves already on ``device`` are not
    copied. O(number of leaves); the copies are queued on the current stream of the calling
    thread.

    Args:
        tree: A tensor, TensorDict/tensorclass, or dict/list/tuple of those.
        device: The target device.

    Example:
        >>> import torch
        >>> move_tree({"index": torch.arange(3)}, torch.device("cpu"))["index"].device
        device(type='cpu')
    """
    non_blocking = device.type != "cpu"
    if is_tensor_collection(tree):
        return tree.to(device, non_blocking=non_blocking)
    return _map_tree(tree, lambda tensor: tensor.to(device, non_blocking=non_blocking))


_SIDE = threading.local()


def side_stream(device: torch.device) -> Any:
    """This thread's own CUDA stream on ``device`` for sample copies (created on first use).

    A prefetch thread queues its copies there instead of on the default stream, so the copy of
    the next batch runs while the training loop's kernels run on theirs; the consumer waits on
    an event recorded after the copies (:func:`wait_ready`). ``None`` off CUDA. O(1).

    Args:
        device: The device the copies go to.
    """
    if device.type != "cuda":
        return None
    streams = getattr(_SIDE, "streams", None)
    if streams is None:
        streams = _SIDE.streams = {}
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = streams.get(index)
    if stream is None:
        stream = streams[index] = torch.cuda.Stream(device=index)
    return stream


def wait_ready(tree: Any, event: Any, device: torch.device) -> None:
    """Make the caller's current stream wait for ``event`` and own ``tree``'s device tensors.

    ``record_stream`` tells the caching allocator that the caller's stream uses memory that
    was allocated on a side stream, so it is not reused before that stream is done with it.
    O(number of leaves).
    """
    current = torch.cuda.current_stream(device)
    current.wait_event(event)

    def own(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.device.type == "cuda":
            tensor.record_stream(current)
        return tensor

    _map_tree(tree, own)

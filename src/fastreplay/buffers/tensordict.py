"""fastreplay's TorchRL TensorDict replay buffers: the classes and their argument checks.

Each class is TorchRL's buffer with fastreplay's parts in its bases, outermost first:

* :class:`~fastreplay.buffers.paths.PathChoice` decides, for every ``extend``, ``sample`` and
  ``update_priority``, between the direct path and TorchRL's general path (the one place that
  decides);
* :class:`~fastreplay.buffers.samples.PinnedSamples` writes the metadata, pins and moves
  samples on the general path;
* :class:`~fastreplay.buffers.sharing.SharedBufferChecks` makes shared buffers safe with
  writer processes.
"""

from __future__ import annotations

from typing import Any

from fastreplay._signature import ConstructorSignature
from fastreplay._torchrl import RandomSampler, make_storage
from fastreplay._torchrl import TorchRLBuffer as _TorchRLBuffer
from fastreplay._torchrl import TorchRLPrioritizedBuffer as _TorchRLPrioritizedBuffer
from fastreplay.buffers.paths import PathChoice
from fastreplay.buffers.samples import PinnedSamples
from fastreplay.buffers.sharing import SharedBufferChecks

__all__ = ["TensorDictPrioritizedReplayBuffer", "TensorDictReplayBuffer"]


class TensorDictReplayBuffer(PathChoice, PinnedSamples, SharedBufferChecks, _TorchRLBuffer):
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
    PathChoice,
    PinnedSamples,
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
        storage = make_storage(self, storage, compilable)
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
        # The bases after TorchRL's ``TensorDictPrioritizedReplayBuffer`` (its
        # ``TensorDictReplayBuffer``), skipping only its ``__init__`` (it builds TorchRL's
        # sampler); every base before it runs as usual.
        super(_TorchRLPrioritizedBuffer, self).__init__(
            storage=storage,
            sampler=sampler,
            compilable=compilable,
            pin_memory=False,
            **kwargs,
        )

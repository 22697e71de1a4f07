"""TorchRL's tensor storages, read through fastreplay's row gather.

``fastreplay.TensorStorage``, ``fastreplay.LazyTensorStorage`` and
``fastreplay.LazyMemmapStorage`` are TorchRL's classes of the same names (subclasses: the same
constructor, state dict, checkpoints, pickling and repr, ``isinstance`` holds) whose ``get``
reads the common case faster. TorchRL's ``TensorStorage.get(index)`` slices the storage's
``TensorDict`` to its filled rows and indexes it (``TensorDict.__getitem__``), which
re-validates the index, the keys and the batch size on every call: most of the time a
replay buffer's ``sample`` spends outside its sampler when the buffer takes TorchRL's general
path (a transform, ``prefetch``, a shared buffer, or TorchRL's own ``TensorDictReplayBuffer``).

Here, a read is one ``index_select`` per leaf into a new ``TensorDict`` built without
re-validation (:func:`fastreplay.buffers.rows.gather_rows`) when the case is plain
(:func:`fastreplay._torchrl.plain_rows`: an initialised 1-D storage of a plain ``TensorDict`` on
the CPU, read with a 1-D ``int64``/``int32`` CPU tensor); anything else (an ``ndim > 1``
storage, an integer, a slice, a tuple, a mask, a storage of plain tensors, an accelerator
storage, non-tensor data, dimension names, a read traced by ``torch.compile``) is TorchRL's
``get``. A row outside the filled rows, or a negative one, is also left to TorchRL's ``get``,
which returns or raises what it always does. The output is TorchRL's: the same values, dtypes,
devices, batch size, keys and order, and the same tensor types (plain tensors, also from a
memmap). Writes are TorchRL's.

The buffers' direct path (:mod:`fastreplay.buffers.paths`) takes these classes as it takes
TorchRL's.

Example:
    >>> import torch
    >>> from tensordict import TensorDict
    >>> from fastreplay import LazyTensorStorage
    >>> storage = LazyTensorStorage(10)
    >>> storage.set(torch.arange(4), TensorDict(obs=torch.arange(4.0), batch_size=[4]))
    >>> storage.get(torch.tensor([3, 1]))["obs"].tolist()
    [3.0, 1.0]
"""

from __future__ import annotations

from typing import Any

from fastreplay import _torchrl
from fastreplay._torchrl import plain_rows, register_tensor_storages
from fastreplay.buffers.rows import gather_plan, gather_rows

__all__ = ["LazyMemmapStorage", "LazyTensorStorage", "TensorStorage"]


def _gathered(storage: Any, index: Any) -> Any:
    """The rows ``index`` of a plain storage, as TorchRL's ``get`` returns them, or None.

    ``None``: not a plain case (see the module docstring), or a row outside the filled rows
    (the ``IndexError`` of ``index_select``, before anything is returned). O(len(index) x
    row size).
    """
    found = plain_rows(storage, index)
    if found is None:
        return None
    plan = gather_plan(found[0])
    if plan is None or (plan[1] is not None and plan[1].type != "cpu"):
        return None
    try:
        return gather_rows(plan, index, found[1])[0]
    except IndexError:  # negative or past the filled rows: TorchRL's indexing decides
        return None


class TensorStorage(_torchrl.TensorStorage):
    """TorchRL's ``TensorStorage``, whose ``get`` reads plain cases with one gather per leaf.

    Same constructor, behaviour and output as ``torchrl.data.TensorStorage``; see
    :mod:`fastreplay.storages`.

    Example:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> from fastreplay import TensorStorage
        >>> storage = TensorStorage(TensorDict(obs=torch.arange(5.0), batch_size=[5]))
        >>> storage.get(torch.tensor([4, 0]))["obs"].tolist()
        [4.0, 0.0]
    """

    def get(self, index: Any) -> Any:
        """``TensorStorage.get``: the rows ``index``. O(len(index) x row size).

        The lazy subclasses inherit it below TorchRL's lazy ``get`` (which first waits for a
        storage another process initialises, then calls this through ``super()``).
        """
        data = _gathered(self, index)
        if data is None:
            return super().get(index)
        return data


class LazyTensorStorage(_torchrl.LazyTensorStorage, TensorStorage):
    """TorchRL's ``LazyTensorStorage``, whose ``get`` reads plain cases with one gather per leaf.

    Same constructor, behaviour and output as ``torchrl.data.LazyTensorStorage``; see
    :mod:`fastreplay.storages`.

    Example:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> from torchrl.data import TensorDictReplayBuffer
        >>> from fastreplay import LazyTensorStorage
        >>> rb = TensorDictReplayBuffer(storage=LazyTensorStorage(100), batch_size=4)
        >>> _ = rb.extend(TensorDict(obs=torch.randn(10, 3), batch_size=[10]))
        >>> rb.sample()["obs"].shape
        torch.Size([4, 3])
    """


class LazyMemmapStorage(_torchrl.LazyMemmapStorage, LazyTensorStorage):
    """TorchRL's ``LazyMemmapStorage``, whose ``get`` reads plain cases with one gather per leaf.

    Same constructor, behaviour and output as ``torchrl.data.LazyMemmapStorage``; see
    :mod:`fastreplay.storages`.

    Example:
        >>> import tempfile, torch
        >>> from tensordict import TensorDict
        >>> from fastreplay import LazyMemmapStorage
        >>> storage = LazyMemmapStorage(10, scratch_dir=tempfile.mkdtemp())
        >>> storage.set(torch.arange(3), TensorDict(obs=torch.arange(3.0), batch_size=[3]))
        >>> storage.get(torch.tensor([2, 2]))["obs"].tolist()
        [2.0, 2.0]
    """


register_tensor_storages(
    TensorStorage, LazyTensorStorage, LazyMemmapStorage, lazy=(LazyTensorStorage,)
)
